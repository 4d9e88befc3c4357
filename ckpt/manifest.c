/*
 * Checkpoint manifests (ckpt/manifest.h): cJSON both ways. Every number is checked to be
 * an integer in range before it is converted, every string against its cap; the manifest
 * arrives from disk and is treated like a message from a peer.
 */
#include "ckpt/manifest.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "planner/plan_json.h"

static const char *const state_names[] = { "weight", "momentum1", "momentum2" };
static const char *const optimizer_names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };

const char *embd_ckpt_state_name(enum embd_ckpt_state state)
{
	return (unsigned)state < 3 ? state_names[state] : "?";
}

uint32_t embd_ckpt_optimizer_states(enum embd_optimizer_type type)
{
	return type == EMBD_OPT_ADAM ? 2 : type == EMBD_OPT_ADAGRAD ||
	       type == EMBD_OPT_ROWWISE_ADAGRAD ? 1 : 0;
}

/* ---- writing ----------------------------------------------------------------------------- */

int embd_ckpt_manifest_write(const struct embd_ckpt_manifest *m, char **out)
{
	cJSON *root = cJSON_CreateObject(), *arr, *o;
	char hex[17];
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!root)
		return rc;
	snprintf(hex, sizeof(hex), "%016" PRIx64, m->plan_hash);
	cJSON_AddStringToObject(root, "format", "embd-checkpoint");
	cJSON_AddNumberToObject(root, "format_version", EMBD_MANIFEST_VERSION);
	cJSON_AddNumberToObject(root, "step", (double)m->step);
	cJSON_AddNumberToObject(root, "created_unix_ms", (double)m->created_unix_ms);
	cJSON_AddNumberToObject(root, "node", m->node);
	cJSON_AddNumberToObject(root, "num_nodes", m->num_nodes);
	if (m->node_part)
		cJSON_AddStringToObject(root, "layout", "per_node");
	cJSON_AddStringToObject(root, "plan_hash", hex);
	if (m->plan_json) {
		cJSON *plan = cJSON_Parse(m->plan_json);
		if (!plan) {
			rc = EMBD_EPARSE;
			goto out;
		}
		cJSON_AddItemToObject(root, "plan", plan);
	}
	if (!(arr = cJSON_AddArrayToObject(root, "tables")))
		goto out;
	for (uint32_t i = 0; i < m->num_tables; i++) {
		const struct embd_ckpt_table *t = &m->tables[i];
		if (!(o = cJSON_CreateObject()))
			goto out;
		cJSON_AddItemToArray(arr, o);
		cJSON_AddStringToObject(o, "name", t->name);
		cJSON_AddNumberToObject(o, "num_embeddings", (double)t->num_embeddings);
		cJSON_AddNumberToObject(o, "embedding_dim", t->embedding_dim);
		cJSON_AddStringToObject(o, "data_type", t->data_type == EMBD_DTYPE_FP16 ? "fp16" : "fp32");
		cJSON_AddStringToObject(o, "optimizer", (unsigned)t->optimizer < 4 ?
					optimizer_names[t->optimizer] : "?");
	}
	if (!(arr = cJSON_AddArrayToObject(root, "files")))
		goto out;
	for (uint32_t i = 0; i < m->num_files; i++) {
		const struct embd_ckpt_file *f = &m->files[i];
		if (!(o = cJSON_CreateObject()))
			goto out;
		cJSON_AddItemToArray(arr, o);
		cJSON_AddStringToObject(o, "name", f->name);
		cJSON_AddNumberToObject(o, "bytes", (double)f->bytes);
		cJSON_AddNumberToObject(o, "crc32c", f->crc32c);
		cJSON_AddStringToObject(o, "table", f->table < m->num_tables ? m->tables[f->table].name : "");
		cJSON_AddStringToObject(o, "state", embd_ckpt_state_name(f->state));
		cJSON_AddNumberToObject(o, "row_offset", (double)f->row_offset);
		cJSON_AddNumberToObject(o, "rows", (double)f->rows);
		cJSON_AddNumberToObject(o, "col_offset", f->col_offset);
		cJSON_AddNumberToObject(o, "cols", f->cols);
		cJSON_AddStringToObject(o, "dtype", embd_npy_dtype_name(f->dtype) ?
					embd_npy_dtype_name(f->dtype) : "?");
		cJSON_AddNumberToObject(o, "optimizer_step", (double)f->optimizer_step);
		cJSON_AddNumberToObject(o, "node", f->node);
	}
	*out = cJSON_PrintUnformatted(root);
	rc = *out ? 0 : EMBD_ENOMEM;
out:
	cJSON_Delete(root);
	return rc;
}

/* ---- parsing ----------------------------------------------------------------------------- */

/* An integer member in [lo, hi]. */
static int get_int(const cJSON *o, const char *key, double lo, double hi, int64_t *out,
		   const char *where, char *err, size_t err_len)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);

	if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo ||
	    v->valuedouble > hi)
		return snprintf(err, err_len, "manifest %s%s: expected an integer in [%.0f, %.0f]",
				where, key, lo, hi), EMBD_EPARSE;
	*out = (int64_t)v->valuedouble;
	return 0;
}

static int get_str(const cJSON *o, const char *key, char *out, size_t cap, const char *where,
		   char *err, size_t err_len)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);

	if (!cJSON_IsString(v) || strlen(v->valuestring) >= cap || !v->valuestring[0])
		return snprintf(err, err_len, "manifest %s%s: expected a string of 1 to %zu bytes",
				where, key, cap - 1), EMBD_EPARSE;
	strcpy(out, v->valuestring);
	return 0;
}

static int lookup(const char *const *names, int n, const char *s)
{
	for (int i = 0; i < n; i++)
		if (!strcmp(names[i], s))
			return i;
	return -1;
}

#define MAX_ROWS 9007199254740992.0     /* 2^53: exact in a JSON number */

static int parse_table(const cJSON *o, struct embd_ckpt_table *t, const char *where, char *err,
		       size_t err_len)
{
	char buf[32];
	int64_t v;
	int rc, k;

	if (!cJSON_IsObject(o))
		return snprintf(err, err_len, "manifest %s: expected an object", where), EMBD_EPARSE;
	if ((rc = get_str(o, "name", t->name, sizeof(t->name), where, err, err_len)) ||
	    (rc = get_int(o, "num_embeddings", 1, MAX_ROWS, &t->num_embeddings, where, err, err_len)) ||
	    (rc = get_int(o, "embedding_dim", 1, INT32_MAX, &v, where, err, err_len)))
		return rc;
	t->embedding_dim = (int32_t)v;
	if ((rc = get_str(o, "data_type", buf, sizeof(buf), where, err, err_len)))
		return rc;
	if (strcmp(buf, "fp32") && strcmp(buf, "fp16"))
		return snprintf(err, err_len, "manifest %sdata_type: '%s' is not fp32 or fp16", where,
				buf), EMBD_EPARSE;
	t->data_type = strcmp(buf, "fp16") ? EMBD_DTYPE_FP32 : EMBD_DTYPE_FP16;
	if ((rc = get_str(o, "optimizer", buf, sizeof(buf), where, err, err_len)))
		return rc;
	if ((k = lookup(optimizer_names, 4, buf)) < 0)
		return snprintf(err, err_len, "manifest %soptimizer: '%s' unknown", where, buf),
		       EMBD_EPARSE;
	t->optimizer = (enum embd_optimizer_type)k;
	return 0;
}

static bool safe_name(const char *s)
{
	if (!strcmp(s, ".") || !strcmp(s, ".."))
		return false;
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
		      *s == '.' || *s == '_' || *s == '-'))
			return false;
	return true;
}

static int parse_file(const cJSON *o, const struct embd_ckpt_manifest *m, struct embd_ckpt_file *f,
		      const char *where, char *err, size_t err_len)
{
	char buf[EMBD_NAME_MAX];
	int64_t v;
	int rc, k;

	if (!cJSON_IsObject(o))
		return snprintf(err, err_len, "manifest %s: expected an object", where), EMBD_EPARSE;
	if ((rc = get_str(o, "name", f->name, sizeof(f->name), where, err, err_len)))
		return rc;
	if (!safe_name(f->name))
		return snprintf(err, err_len, "manifest %sname: '%s' is not [A-Za-z0-9._-]+", where,
				f->name), EMBD_EPARSE;
	if ((rc = get_int(o, "bytes", 0, MAX_ROWS, &v, where, err, err_len)))
		return rc;
	f->bytes = (uint64_t)v;
	if ((rc = get_int(o, "crc32c", 0, UINT32_MAX, &v, where, err, err_len)))
		return rc;
	f->crc32c = (uint32_t)v;
	if ((rc = get_str(o, "table", buf, sizeof(buf), where, err, err_len)))
		return rc;
	for (f->table = 0; f->table < m->num_tables && strcmp(m->tables[f->table].name, buf);)
		f->table++;
	if (f->table == m->num_tables)
		return snprintf(err, err_len, "manifest %stable: '%s' is not in tables", where, buf),
		       EMBD_EPARSE;
	const struct embd_ckpt_table *t = &m->tables[f->table];
	if ((rc = get_str(o, "state", buf, sizeof(buf), where, err, err_len)))
		return rc;
	if ((k = lookup(state_names, 3, buf)) < 0 ||
	    (uint32_t)k > embd_ckpt_optimizer_states(t->optimizer))
		return snprintf(err, err_len, "manifest %sstate: '%s' is not a state of table '%s' "
				"(optimizer %s)", where, buf, t->name, optimizer_names[t->optimizer]),
		       EMBD_EPARSE;
	f->state = (enum embd_ckpt_state)k;
	if ((rc = get_int(o, "row_offset", 0, (double)t->num_embeddings - 1, &f->row_offset, where,
			  err, err_len)) ||
	    (rc = get_int(o, "rows", 1, (double)(t->num_embeddings - f->row_offset), &f->rows, where,
			  err, err_len)) ||
	    (rc = get_int(o, "col_offset", 0, t->embedding_dim - 1, &v, where, err, err_len)))
		return rc;
	f->col_offset = (uint32_t)v;
	if ((rc = get_int(o, "cols", 1, t->embedding_dim - (double)f->col_offset, &v, where, err,
			  err_len)))
		return rc;
	f->cols = (uint32_t)v;
	if ((rc = get_str(o, "dtype", buf, sizeof(buf), where, err, err_len)))
		return rc;
	bool f16 = !strcmp(buf, "<f2");
	if (strcmp(buf, "<f4") && !(f16 && f->state == EMBD_CKPT_WEIGHT))
		return snprintf(err, err_len, "manifest %sdtype: '%s' (weights are <f4 or <f2, "
				"optimizer state <f4)", where, buf), EMBD_EPARSE;
	f->dtype = f16 ? EMBD_NPY_F2 : EMBD_NPY_F4;
	if ((rc = get_int(o, "optimizer_step", 0, MAX_ROWS, &f->optimizer_step, where, err, err_len)) ||
	    (rc = get_int(o, "node", 0, m->num_nodes - 1.0, &v, where, err, err_len)))
		return rc;
	f->node = (uint32_t)v;
	return 0;
}

static bool overlap(const struct embd_ckpt_file *a, const struct embd_ckpt_file *b)
{
	return a->table == b->table && a->state == b->state &&
	       a->row_offset < b->row_offset + b->rows && b->row_offset < a->row_offset + a->rows &&
	       a->col_offset < b->col_offset + b->cols && b->col_offset < a->col_offset + a->cols;
}

int embd_ckpt_manifest_parse(const char *text, size_t len, struct embd_ckpt_manifest *m,
			     char *err, size_t err_len)
{
	cJSON *root;
	const cJSON *arr, *item;
	char buf[32], where[48];
	int64_t v;
	int rc;

	memset(m, 0, sizeof(*m));
	if ((rc = embd_plan_json_parse(text, len, "manifest", &root, err, err_len)))
		goto out;
	rc = EMBD_EPARSE;
	if (!cJSON_IsObject(root)) {
		snprintf(err, err_len, "manifest: not a JSON object");
		goto out;
	}
	if ((rc = get_str(root, "format", buf, sizeof(buf), "", err, err_len)))
		goto out;
	rc = EMBD_EPARSE;
	if (strcmp(buf, "embd-checkpoint")) {
		snprintf(err, err_len, "manifest format: '%s', expected 'embd-checkpoint'", buf);
		goto out;
	}
	if ((rc = get_int(root, "format_version", 0, UINT32_MAX, &v, "", err, err_len)))
		goto out;
	if (v != EMBD_MANIFEST_VERSION) {
		rc = EMBD_ENOTSUP;
		snprintf(err, err_len, "manifest format_version: %lld, this build reads %u",
			 (long long)v, EMBD_MANIFEST_VERSION);
		goto out;
	}
	if ((rc = get_int(root, "step", 0, MAX_ROWS, &v, "", err, err_len)))
		goto out;
	m->step = (uint64_t)v;
	if ((rc = get_int(root, "created_unix_ms", 0, MAX_ROWS, &v, "", err, err_len)))
		goto out;
	m->created_unix_ms = (uint64_t)v;
	if ((rc = get_int(root, "num_nodes", 1, 65536, &v, "", err, err_len)))
		goto out;
	m->num_nodes = (uint32_t)v;
	if ((rc = get_int(root, "node", 0, m->num_nodes - 1.0, &v, "", err, err_len)))
		goto out;
	m->node = (uint32_t)v;
	/* absent in manifests written before parts were marked: whole */
	if (cJSON_GetObjectItemCaseSensitive(root, "layout")) {
		if ((rc = get_str(root, "layout", buf, sizeof(buf), "", err, err_len)))
			goto out;
		rc = EMBD_EPARSE;
		if (strcmp(buf, "per_node") && strcmp(buf, "shared")) {
			snprintf(err, err_len, "manifest layout: '%s', expected per_node or shared", buf);
			goto out;
		}
		m->node_part = !strcmp(buf, "per_node");
	}
	if ((rc = get_str(root, "plan_hash", buf, sizeof(buf), "", err, err_len)))
		goto out;
	char *end;
	m->plan_hash = strtoull(buf, &end, 16);
	rc = EMBD_EPARSE;
	if (strlen(buf) != 16 || *end) {
		snprintf(err, err_len, "manifest plan_hash: '%s' is not 16 hex digits", buf);
		goto out;
	}
	item = cJSON_GetObjectItemCaseSensitive(root, "plan");
	if (item && !(m->plan_json = cJSON_PrintUnformatted(item))) {
		rc = EMBD_ENOMEM;
		goto out;
	}
	arr = cJSON_GetObjectItemCaseSensitive(root, "tables");
	if (!cJSON_IsArray(arr) || !cJSON_GetArraySize(arr) || cJSON_GetArraySize(arr) > 65536) {
		snprintf(err, err_len, "manifest tables: expected an array of 1 to 65536 tables");
		goto out;
	}
	m->tables = calloc((size_t)cJSON_GetArraySize(arr), sizeof(*m->tables));
	if (!m->tables) {
		rc = EMBD_ENOMEM;
		goto out;
	}
	cJSON_ArrayForEach(item, arr) {
		snprintf(where, sizeof(where), "tables[%u].", m->num_tables);
		if ((rc = parse_table(item, &m->tables[m->num_tables], where, err, err_len)))
			goto out;
		for (uint32_t i = 0; i < m->num_tables; i++)
			if (!strcmp(m->tables[i].name, m->tables[m->num_tables].name)) {
				rc = EMBD_EPARSE;
				snprintf(err, err_len, "manifest %sname: '%s' repeated", where,
					 m->tables[i].name);
				goto out;
			}
		m->num_tables++;
	}
	arr = cJSON_GetObjectItemCaseSensitive(root, "files");
	rc = EMBD_EPARSE;
	if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) > 1 << 20) {
		snprintf(err, err_len, "manifest files: expected an array of at most 2^20 files");
		goto out;
	}
	m->files = calloc((size_t)cJSON_GetArraySize(arr) + 1, sizeof(*m->files));
	if (!m->files) {
		rc = EMBD_ENOMEM;
		goto out;
	}
	cJSON_ArrayForEach(item, arr) {
		struct embd_ckpt_file *f = &m->files[m->num_files];
		snprintf(where, sizeof(where), "files[%u].", m->num_files);
		if ((rc = parse_file(item, m, f, where, err, err_len)))
			goto out;
		for (uint32_t i = 0; i < m->num_files; i++)
			if (!strcmp(m->files[i].name, f->name) || overlap(&m->files[i], f)) {
				rc = EMBD_EPARSE;
				snprintf(err, err_len, "manifest %s: '%s' %s files[%u] '%s'", where, f->name,
					 strcmp(m->files[i].name, f->name) ? "overlaps" : "repeats", i,
					 m->files[i].name);
				goto out;
			}
		m->num_files++;
	}
	rc = 0;
out:
	cJSON_Delete(root);
	return rc;
}

void embd_ckpt_manifest_free(struct embd_ckpt_manifest *m)
{
	if (!m)
		return;
	free(m->plan_json);
	free(m->tables);
	free(m->files);
	memset(m, 0, sizeof(*m));
}

static bool same_tables(const struct embd_ckpt_manifest *a, const struct embd_ckpt_manifest *b)
{
	if (a->num_tables != b->num_tables)
		return false;
	for (uint32_t i = 0; i < a->num_tables; i++) {
		const struct embd_ckpt_table *x = &a->tables[i], *y = &b->tables[i];
		if (strcmp(x->name, y->name) || x->num_embeddings != y->num_embeddings ||
		    x->embedding_dim != y->embedding_dim || x->data_type != y->data_type ||
		    x->optimizer != y->optimizer)
			return false;
	}
	return true;
}

int embd_ckpt_manifest_merge(const struct embd_ckpt_manifest *parts, uint32_t n,
			     struct embd_ckpt_manifest *out, char *err, size_t err_len)
{
	uint64_t files = 0;

	memset(out, 0, sizeof(*out));
	if (!n)
		return snprintf(err, err_len, "merge: no manifests"), EMBD_EINVAL;
	for (uint32_t k = 0; k < n; k++) {
		const struct embd_ckpt_manifest *p = &parts[k];
		const char *what = p->node != k ? "node" : p->num_nodes != n ? "num_nodes" :
				   p->step != parts[0].step ? "step" :
				   p->plan_hash != parts[0].plan_hash ? "plan_hash" :
				   !same_tables(p, &parts[0]) ? "tables" : NULL;
		if (what)
			return snprintf(err, err_len, "merge: node %u's manifest: %s differs (node %u of "
					"%u, step %" PRIu64 "; expected node %u of %u, step %" PRIu64 ")",
					k, what, p->node, p->num_nodes, p->step, k, n, parts[0].step),
			       EMBD_EMISMATCH;
		files += p->num_files;
	}
	*out = parts[0];
	out->plan_json = parts[0].plan_json ? strdup(parts[0].plan_json) : NULL;
	out->tables = calloc(parts[0].num_tables + 1, sizeof(*out->tables));
	out->files = calloc(files + 1, sizeof(*out->files));
	out->num_files = 0;
	out->node = 0;
	out->node_part = false;         /* every node's parts together: whole */
	if (!out->tables || !out->files || (parts[0].plan_json && !out->plan_json)) {
		embd_ckpt_manifest_free(out);
		return EMBD_ENOMEM;
	}
	memcpy(out->tables, parts[0].tables, sizeof(*out->tables) * parts[0].num_tables);
	for (uint32_t k = 0; k < n; k++)
		for (uint32_t i = 0; i < parts[k].num_files; i++) {
			const struct embd_ckpt_file *f = &parts[k].files[i];
			for (uint32_t j = 0; j < out->num_files; j++)
				if (overlap(&out->files[j], f) || !strcmp(out->files[j].name, f->name)) {
					snprintf(err, err_len, "merge: node %u's '%s' overlaps node %u's '%s'",
						 k, f->name, out->files[j].node, out->files[j].name);
					embd_ckpt_manifest_free(out);
					return EMBD_EMISMATCH;
				}
			out->files[out->num_files] = *f;
			out->files[out->num_files++].node = k;
		}
	return 0;
}
