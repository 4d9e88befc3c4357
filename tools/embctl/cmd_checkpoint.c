/*
 * embctl checkpoint / export / import.
 *   checkpoint [--wait]    asks a running embd for a checkpoint now (CHECKPOINT_REQUEST).
 *   export                 assembles one table's weights from a checkpoint's shard files
 *                          (any plan) into one .npy file, offline: no service involved.
 *   import                 the other way, for initial weights: writes a checkpoint-format
 *                          directory step-<S> (weights only, so optimizer state starts at 0)
 *                          that embd restores at start like any checkpoint. Tables without an
 *                          -i file get embd's own initial weights (config seed), because a
 *                          restore needs every table of the config. Offline as well: a file
 *                          format, not a service request, so it works before embd ever ran
 *                          and the service needs no code path that rewrites live weights.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embctl.h"
#include "kernels/device.h"
#include "kernels/embedding.h"
#include "ckpt/checkpoint.h"
#include "daemon/config.h"
#include "ckpt/npy.h"

#define MAX_IMPORTS 64
#define MAX_NODES 64
#define MAX_STEP 9007199254740992ull    /* 2^53: what a manifest's JSON number holds exactly */

/* How long a running embd takes to answer a status request: at once, or after the collective
 * its loop may be in (a cluster's step, up to collective_timeout_ms when a node is slow). */
#define ANSWER_TIMEOUT_S 10
#define WAIT_TIMEOUT_S 600

int embctl_checkpoint(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' }, { "wait", no_argument, NULL, 'w' },
		{ "timeout", required_argument, NULL, 't' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *socket_path = EMBCTL_DEFAULT_SOCKET;
	struct embd_ctl_checkpoint req = { 0 };
	uint64_t timeout_s = 0;
	char *text = NULL;
	int rc, opt;

	while ((opt = getopt_long(argc, argv, "s:wt:h", opts, NULL)) != -1) {
		switch (opt) {
		case 's': socket_path = optarg; break;
		case 'w': req.flags |= EMBD_CTL_CHECKPOINT_WAIT; break;
		case 't': if (embctl_number("--timeout", optarg, 1, 604800, &timeout_s)) goto usage; break;
		default: goto usage;
		}
	}
	if (optind != argc)
		goto usage;
	bool wait = req.flags & EMBD_CTL_CHECKPOINT_WAIT;
	if (!timeout_s)
		timeout_s = wait ? WAIT_TIMEOUT_S : ANSWER_TIMEOUT_S;
	/* --wait may rightly take long (a big write): first make sure a service answers at all */
	if (wait) {
		int probe_s = timeout_s < ANSWER_TIMEOUT_S ? (int)timeout_s : ANSWER_TIMEOUT_S;
		rc = embctl_ask(socket_path, EMBD_CTL_STATUS_REQUEST, NULL, 0, probe_s * 1000, &text);
		free(text);
		text = NULL;
		if (rc) {
			fprintf(stderr, "embctl: no checkpoint asked for (a status request first, "
				"with %d s for the answer)\n", probe_s);
			return 1;
		}
	}
	rc = embctl_ask(socket_path, EMBD_CTL_CHECKPOINT_REQUEST, &req, sizeof(req),
			(int)timeout_s * 1000, &text);
	if (!rc) {
		printf("%s\n", text);
		cJSON *r = cJSON_Parse(text);
		const cJSON *ok = cJSON_GetObjectItemCaseSensitive(r, "ok");
		if (!r || (ok && !cJSON_IsTrue(ok)))
			rc = 1;
		cJSON_Delete(r);
	}
	free(text);
	return rc;
usage:
	fprintf(stderr, "usage: embctl checkpoint [--socket PATH] [--wait] [--timeout SECONDS]\n"
		"  --wait            answer once the checkpoint is on disk, with its result\n"
		"  --timeout SECONDS give up when the service has not answered by then (default %d;\n"
		"                    with --wait %d, once the service answered a status request\n"
		"                    within %d)\n", ANSWER_TIMEOUT_S, WAIT_TIMEOUT_S, ANSWER_TIMEOUT_S);
	return 2;
}

static void print_skip(void *arg, const char *dir, const char *why)
{
	(void)arg;
	fprintf(stderr, "embctl: skipping damaged checkpoint %s: %s\n", dir, why);
}

/* --dir, or the config's checkpoint_dir. */
static int pick_dir(const char *dir, const char *config_path, struct embd_config *config,
		    char *out, size_t cap)
{
	char err[1024];

	if (config_path && embd_config_load(config_path, config, err, sizeof(err))) {
		fprintf(stderr, "embctl: %s\n", err);
		return 1;
	}
	if (!dir && (!config_path || !config->checkpoint_dir[0])) {
		fprintf(stderr, "embctl: no --dir, and no --config with a checkpoint_dir\n");
		return 2;
	}
	snprintf(out, cap, "%s", dir ? dir : config->checkpoint_dir);
	return 0;
}

/* Whether output (a file to write) lies inside directory dir, after symlinks: writing it
 * would overwrite (or add to) the checkpoint being read. */
static bool inside(const char *output, const char *dir)
{
	char *out = realpath(output, NULL), *d = realpath(dir, NULL), *parent = NULL;
	bool in = false;

	if (!out) {     /* a new file: its directory decides */
		char *copy = strdup(output);
		char *slash = copy ? strrchr(copy, '/') : NULL;
		if (slash == copy)
			slash[1] = 0;
		else if (slash)
			*slash = 0;
		parent = copy ? realpath(slash ? copy : ".", NULL) : NULL;
		free(copy);
	}
	const char *p = out ? out : parent;
	if (p && d) {
		size_t n = strlen(d);
		in = !strncmp(p, d, n) && (p[n] == '/' || p[n] == 0);
	}
	free(out);
	free(parent);
	free(d);
	return in;
}

int embctl_export(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "table", required_argument, NULL, 't' }, { "step", required_argument, NULL, 's' },
		{ "dir", required_argument, NULL, 'd' }, { "config", required_argument, NULL, 'c' },
		{ "output", required_argument, NULL, 'o' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	static char ckdirs[MAX_NODES][EMBD_CKPT_PATH_MAX + 64];
	const char *table = NULL, *dirs[MAX_NODES] = { NULL }, *config_path = NULL, *output = NULL;
	const char *ckp[MAX_NODES];
	char root[EMBD_CKPT_PATH_MAX], err[1024];
	uint32_t n_dirs = 0;
	struct embd_config config = { 0 };
	struct embd_ckpt_manifest m = { 0 };
	uint64_t step = UINT64_MAX;
	void *data = NULL;
	int rc, opt;

	while ((opt = getopt_long(argc, argv, "t:s:d:c:o:h", opts, NULL)) != -1) {
		switch (opt) {
		case 't': table = optarg; break;
		case 's': if (embctl_number("--step", optarg, 0, MAX_STEP, &step)) goto usage; break;
		case 'd': if (n_dirs == MAX_NODES) goto usage; dirs[n_dirs++] = optarg; break;
		case 'c': config_path = optarg; break;
		case 'o': output = optarg; break;
		default: goto usage;
		}
	}
	if (optind != argc || !table || !output)
		goto usage;
	if ((rc = pick_dir(dirs[0], config_path, &config, root, sizeof(root))))
		goto out;
	rc = 1;
	dirs[0] = root;
	n_dirs = n_dirs ? n_dirs : 1;
	/* several --dir: per-node directories of one cluster (ckpt/checkpoint.h) */
	if (n_dirs == 1 ? embd_ckpt_find(root, step, print_skip, NULL, ckdirs[0], sizeof(ckdirs[0]),
					  &m, err, sizeof(err))
			: embd_ckpt_find_nodes(dirs, n_dirs, step, print_skip, NULL, ckdirs, &m, err,
					       sizeof(err))) {
		fprintf(stderr, "embctl: %s\n", err);
		goto out;
	}
	const char *ckdir = ckdirs[0];
	for (uint32_t i = 0; i < n_dirs; i++)
		ckp[i] = ckdirs[i];
	if (step != UINT64_MAX && m.step != step) {
		fprintf(stderr, "embctl: %s: no valid checkpoint of step %" PRIu64 " (newest before "
			"it: %s)\n", root, step, ckdir);
		goto out;
	}
	for (uint32_t i = 0; i < n_dirs; i++)
		if (inside(output, ckp[i])) {
			fprintf(stderr, "embctl: -o %s is inside the checkpoint %s it reads: refusing "
				"to write there (it would overwrite or add to its files)\n", output,
				ckp[i]);
			goto out;
		}
	int k = embd_ckpt_table_index(&m, table);
	if (k < 0) {
		fprintf(stderr, "embctl: %s: no table '%s'\n", ckdir, table);
		goto out;
	}
	const struct embd_ckpt_table *t = &m.tables[k];
	uint32_t eb = embd_dtype_bytes(t->data_type);
	data = malloc((size_t)t->num_embeddings * (size_t)t->embedding_dim * eb + 1);
	if (!data) {
		fprintf(stderr, "embctl: out of memory for table '%s'\n", table);
		goto out;
	}
	struct embd_ckpt_target target = {
		.table = (uint32_t)k, .rows = t->num_embeddings, .cols = (uint32_t)t->embedding_dim,
		.dtype = t->data_type, .weights = data,
	};
	uint64_t shape[2] = { (uint64_t)t->num_embeddings, (uint64_t)t->embedding_dim };
	if (embd_ckpt_load_nodes(ckp, n_dirs, &m, &target, 1, err, sizeof(err)) ||
	    embd_npy_write_file(output, t->data_type == EMBD_DTYPE_FP16 ? EMBD_NPY_F2 : EMBD_NPY_F4,
				2, shape, data, true, NULL, NULL, err, sizeof(err))) {
		fprintf(stderr, "embctl: %s\n", err);
		goto out;
	}
	fprintf(stderr, "embctl: table '%s' (%lld x %d) of %s -> %s\n", table,
		(long long)t->num_embeddings, t->embedding_dim, ckdir, output);
	rc = 0;
out:
	free(data);
	embd_ckpt_manifest_free(&m);
	embd_config_free(&config);
	return rc;
usage:
	fprintf(stderr, "usage: embctl export --table NAME [--step S] (--dir DIR [--dir DIR1 ...] | "
		"--config FILE) -o FILE.npy\n  (several --dir: node 0's, node 1's, ... per-node "
		"checkpoint directories)\n");
	return 2;
}

/* Table t's weights for import: the -i file (checked and converted) or embd's init values. */
static int import_weights(const struct embd_config *c, uint32_t t, const char *file,
			  void **out, char *err, size_t err_len)
{
	const struct embd_table_spec *s = &c->tables.specs[t];
	uint64_t n = (uint64_t)s->num_embeddings * (uint64_t)s->embedding_dim;
	bool f16 = s->data_type == EMBD_DTYPE_FP16;
	struct embd_npy_header h;
	void *src = NULL, *dst = malloc(n * (f16 ? 2 : 4) + 1);

	*out = NULL;
	if (!dst)
		return snprintf(err, err_len, "table '%s': out of memory", s->name), EMBD_ENOMEM;
	if (!file) {
		for (uint64_t i = 0; i < n; i++) {
			float v = embd_init_value(c->seed, t, s->num_embeddings,
						  (int64_t)(i / (uint64_t)s->embedding_dim),
						  (uint32_t)(i % (uint64_t)s->embedding_dim));
			if (f16)
				((uint16_t *)dst)[i] = embd_fp32_to_fp16(v);
			else
				((float *)dst)[i] = v;
		}
		*out = dst;
		return 0;
	}
	int rc = embd_npy_read_file(file, &h, &src, err, err_len);
	if (!rc && (h.ndim != 2 || h.shape[0] != (uint64_t)s->num_embeddings ||
		    h.shape[1] != (uint64_t)s->embedding_dim ||
		    (h.dtype != EMBD_NPY_F4 && h.dtype != EMBD_NPY_F2 && h.dtype != EMBD_NPY_F8))) {
		rc = EMBD_EMISMATCH;
		snprintf(err, err_len, "%s: shape (%" PRIu64 ", %" PRIu64 ") ndim %u dtype %s; table "
			 "'%s' needs (%lld, %d) of <f4, <f2 or <f8", file, h.shape[0],
			 h.ndim > 1 ? h.shape[1] : 0, h.ndim, embd_npy_dtype_name(h.dtype), s->name,
			 (long long)s->num_embeddings, s->embedding_dim);
	}
	for (uint64_t i = 0; !rc && i < n; i++) {
		double given = h.dtype == EMBD_NPY_F4 ? ((float *)src)[i] :
			       h.dtype == EMBD_NPY_F8 ? ((double *)src)[i] :
			       embd_fp16_to_fp32(((uint16_t *)src)[i]);
		float v = (float)given;
		if (f16)
			((uint16_t *)dst)[i] = embd_fp32_to_fp16(v);
		else
			((float *)dst)[i] = v;
		/* after the conversion: a finite <f8 or <f4 value may not fit the table's dtype */
		float kept = f16 ? embd_fp16_to_fp32(((uint16_t *)dst)[i]) : v;
		if (!isfinite(kept)) {
			char what[64];
			if (isfinite(given))
				snprintf(what, sizeof(what), "%g, beyond %s", given, f16 ? "fp16" : "fp32");
			else
				snprintf(what, sizeof(what), "%s", isnan(given) ? "NaN" : "infinite");
			rc = EMBD_EINVAL;
			snprintf(err, err_len, "%s: element (%" PRIu64 ", %" PRIu64 ") is %s: table '%s' "
				 "would train nothing but NaN from it", file,
				 i / (uint64_t)s->embedding_dim, i % (uint64_t)s->embedding_dim, what,
				 s->name);
		}
	}
	free(src);
	if (rc)
		free(dst);
	else
		*out = dst;
	return rc;
}

/* embd restores the newest valid checkpoint, not necessarily the one just imported. */
static void say_what_embd_restores(const char *root, uint64_t step)
{
	char dir[EMBD_CKPT_PATH_MAX + 64], err[1024];
	struct embd_ckpt_manifest m;

	if (embd_ckpt_find(root, UINT64_MAX, print_skip, NULL, dir, sizeof(dir), &m, err,
			   sizeof(err)))
		return;
	if (m.step == step)
		fprintf(stderr, "embctl: embd restores it at start (the newest valid checkpoint in "
			"%s)\n", root);
	else
		fprintf(stderr, "embctl: note: embd restores %s at start, not this import: it "
			"restores the newest valid checkpoint (import with --step above %" PRIu64 ", or "
			"move that one away)\n", dir, m.step);
	embd_ckpt_manifest_free(&m);
}

int embctl_import(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "table", required_argument, NULL, 't' }, { "input", required_argument, NULL, 'i' },
		{ "config", required_argument, NULL, 'c' }, { "dir", required_argument, NULL, 'd' },
		{ "step", required_argument, NULL, 's' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *names[MAX_IMPORTS], *files[MAX_IMPORTS], *dir = NULL, *config_path = NULL;
	char root[EMBD_CKPT_PATH_MAX], err[1024];
	struct embd_config config = { 0 };
	struct embd_ckpt_manifest m = { 0 };
	struct embd_ckpt_array *arrays = NULL;
	uint32_t n_names = 0, n_files = 0;
	const struct embd_tables *t = &config.tables;
	struct embd_ckpt_lock *lock = NULL;
	uint64_t step = 0, bytes;
	int rc, opt;

	while ((opt = getopt_long(argc, argv, "t:i:c:d:s:h", opts, NULL)) != -1) {
		switch (opt) {
		case 't': if (n_names == MAX_IMPORTS) goto usage; names[n_names++] = optarg; break;
		case 'i': if (n_files == MAX_IMPORTS) goto usage; files[n_files++] = optarg; break;
		case 'c': config_path = optarg; break;
		case 'd': dir = optarg; break;
		case 's': if (embctl_number("--step", optarg, 0, MAX_STEP, &step)) goto usage; break;
		default: goto usage;
		}
	}
	if (optind != argc || !config_path || !n_names || n_names != n_files)
		goto usage;
	if ((rc = pick_dir(dir, config_path, &config, root, sizeof(root))))
		goto out;
	rc = 1;
	for (uint32_t k = 0; k < n_names; k++) {
		uint32_t i = 0;
		while (i < t->count && strcmp(t->specs[i].name, names[k]))
			i++;
		if (i == t->count) {
			fprintf(stderr, "embctl: --table %s: not a table of %s\n", names[k], config_path);
			goto out;
		}
		for (uint32_t j = 0; j < k; j++)
			if (!strcmp(names[j], names[k])) {
				fprintf(stderr, "embctl: --table %s given twice (-i %s and -i %s): which "
					"one?\n", names[k], files[j], files[k]);
				goto out;
			}
	}
	/* the directory's owner: a running embd would restore or remove what is written here */
	if (embd_ckpt_lock_take(root, false, 0, "embctl import", &lock, err, sizeof(err))) {
		fprintf(stderr, "embctl: %s\n", err);
		goto out;
	}
	m = (struct embd_ckpt_manifest){ .step = step, .num_nodes = 1, .num_tables = t->count };
	m.tables = calloc(t->count + 1, sizeof(*m.tables));
	arrays = calloc(t->count + 1, sizeof(*arrays));
	if (!m.tables || !arrays)
		goto out;
	for (uint32_t i = 0; i < t->count; i++) {
		const struct embd_table_spec *s = &t->specs[i];
		const char *file = NULL;
		for (uint32_t k = 0; k < n_names; k++)
			if (!strcmp(names[k], s->name))
				file = files[k];
		m.tables[i] = (struct embd_ckpt_table){
			.num_embeddings = s->num_embeddings, .embedding_dim = s->embedding_dim,
			.data_type = s->data_type, .optimizer = s->optimizer.type,
		};
		memcpy(m.tables[i].name, s->name, EMBD_NAME_MAX);
		struct embd_ckpt_array *a = &arrays[i];
		a->ndim = 2;
		a->file = (struct embd_ckpt_file){
			.table = i, .state = EMBD_CKPT_WEIGHT, .rows = s->num_embeddings,
			.cols = (uint32_t)s->embedding_dim,
			.dtype = s->data_type == EMBD_DTYPE_FP16 ? EMBD_NPY_F2 : EMBD_NPY_F4,
		};
		snprintf(a->file.name, sizeof(a->file.name), "t%u.import.weight.npy", i);
		if (import_weights(&config, i, file, (void **)&a->data, err, sizeof(err))) {
			fprintf(stderr, "embctl: %s\n", err);
			goto out;
		}
	}
	if (embd_ckpt_write_dir(root, &m, arrays, t->count, true, &bytes, err, sizeof(err))) {
		fprintf(stderr, "embctl: %s\n", err);
		goto out;
	}
	fprintf(stderr, "embctl: wrote %s/step-%" PRIu64 " (%" PRIu64 " bytes, %u tables, %u "
		"imported)\n", root, step, bytes, t->count, n_names);
	say_what_embd_restores(root, step);
	rc = 0;
out:
	for (uint32_t i = 0; arrays && i < t->count; i++)
		free((void *)arrays[i].data);
	free(arrays);
	embd_ckpt_lock_release(lock);
	embd_ckpt_manifest_free(&m);
	embd_config_free(&config);
	return rc;
usage:
	fprintf(stderr, "usage: embctl import --config FILE [--dir DIR] [--step S] --table NAME "
		"-i FILE.npy [--table NAME -i FILE.npy ...]\n");
	return 2;
}
