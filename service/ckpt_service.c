/*
 * Checkpoints of the running service (service/ckpt_service.h). The snapshot layout (one
 * array per shard and state, at a fixed 64-byte aligned offset of one buffer) is computed
 * once at create, so a snapshot is a loop of memcpy and the writer thread owns the buffer
 * until it signals the eventfd; the service thread never touches it in between.
 */
#include "service/ckpt_service.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "service/checkpoint.h"
#include "service/log.h"
#include "service/store.h"

#define HUGE_PAGE (2u << 20)

struct result {
	int rc;                         /* 0, or why the write failed */
	uint64_t seq, step, bytes;
	double write_ms, stall_ms;
	char dir[EMBD_CKPT_PATH_MAX + 64];
	char err[768];
};

struct embd_ckpt_service {
	const struct embd_config *config;
	struct embd_step *step;
	struct embd_ckpt_manifest base;         /* tables, plan, node: every write's manifest */
	struct embd_store *store;               /* a cluster's: restore, then the writer's only */
	struct embd_ckpt_array *arrays;
	const void **sources;                   /* shard memory of each array */
	uint64_t *array_bytes;
	struct embd_shard **array_shards;
	uint32_t num_arrays;
	uint8_t *buffer;
	int efd;
	/* the write in flight (owned by the thread while running) */
	pthread_t thread;
	bool running;
	atomic_bool finished;
	struct result w;
	/* triggers */
	uint64_t seq_started;
	bool requested;
	uint64_t last_step, last_ns;            /* of the last started (or restored) checkpoint */
	uint64_t resumed_step;
	/* results */
	struct result last;                     /* the last finished one (seq 0: none) */
	double max_stall_ms;
	uint64_t written;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A file name from the table name: unsafe characters become '_'; the index keeps it unique. */
static void array_name(char *out, size_t cap, uint32_t table, const char *name, int64_t row,
		       uint32_t col, uint32_t node, enum embd_ckpt_state state)
{
	char safe[EMBD_NAME_MAX];
	size_t i = 0;

	for (; name[i] && i + 1 < sizeof(safe); i++) {
		char c = name[i];
		bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
			  c == '_' || c == '-';
		safe[i] = ok ? c : '_';
	}
	safe[i] = 0;
	snprintf(out, cap, "t%u-%s.r%lld.c%u.n%u.%s.npy", table, safe, (long long)row, col, node,
		 embd_ckpt_state_name(state));
}

static int build_layout(struct embd_ckpt_service *ck, char *err, size_t err_len)
{
	uint32_t n = embd_step_num_shards(ck->step), k = 0;
	uint64_t total = 0;

	ck->arrays = calloc(3 * (size_t)n + 1, sizeof(*ck->arrays));
	ck->sources = calloc(3 * (size_t)n + 1, sizeof(*ck->sources));
	ck->array_bytes = calloc(3 * (size_t)n + 1, sizeof(*ck->array_bytes));
	ck->array_shards = calloc(3 * (size_t)n + 1, sizeof(*ck->array_shards));
	if (!ck->arrays || !ck->sources || !ck->array_bytes || !ck->array_shards)
		return EMBD_ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		struct embd_step_shard_view v;
		uint64_t bytes[3];
		embd_step_shard_view(ck->step, i, &v);
		if (v.replica || !v.shard)
			continue;       /* one copy of data_parallel; another node's shard */
		const struct embd_shard_desc *d = &v.shard->desc;
		int rc = embd_shard_sizes(d, &bytes[0], &bytes[1], &bytes[2], err, err_len);
		if (rc)
			return rc;
		const void *src[3] = { v.shard->weights, v.shard->momentum1, v.shard->momentum2 };
		for (int s = 0; s < 3; s++) {
			if (!bytes[s])
				continue;
			struct embd_ckpt_array *a = &ck->arrays[k];
			bool per_row = s && d->optimizer.type == EMBD_OPT_ROWWISE_ADAGRAD;
			a->file = (struct embd_ckpt_file){
				.table = v.table, .state = (enum embd_ckpt_state)s,
				.row_offset = d->row_offset, .rows = d->rows, .col_offset = d->col_offset,
				.cols = d->cols, .dtype = !s && d->dtype == EMBD_DTYPE_FP16 ? EMBD_NPY_F2 :
				EMBD_NPY_F4, .node = ck->base.node,
			};
			a->ndim = per_row ? 1 : 2;
			array_name(a->file.name, sizeof(a->file.name), v.table,
				   ck->config->tables.specs[v.table].name, d->row_offset, d->col_offset,
				   ck->base.node, a->file.state);
			ck->sources[k] = src[s];
			ck->array_bytes[k] = bytes[s];
			ck->array_shards[k] = v.shard;
			total += (bytes[s] + 63) / 64 * 64;
			k++;
		}
	}
	ck->num_arrays = k;
	/* 2 MiB aligned and advised to huge pages, as shard memory is: fewer TLB misses in the
	 * copy that steps wait for */
	uint64_t rounded = (total + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
	ck->buffer = aligned_alloc(HUGE_PAGE, rounded ? rounded : HUGE_PAGE);
	if (!ck->buffer)
		return snprintf(err, err_len, "checkpoint snapshot buffer: out of memory for %" PRIu64
				" bytes", total), EMBD_ENOMEM;
	madvise(ck->buffer, rounded, MADV_HUGEPAGE);
	memset(ck->buffer, 0, total);   /* touched now, so no snapshot pays the page faults */
	uint64_t off = 0;
	for (uint32_t i = 0; i < k; i++) {
		ck->arrays[i].data = ck->buffer + off;
		off += (ck->array_bytes[i] + 63) / 64 * 64;
	}
	return 0;
}

int embd_ckpt_service_create(const struct embd_config *config, struct embd_step *step,
			     struct embd_plan *plan, struct embd_ckpt_service **out, char *err,
			     size_t err_len)
{
	struct embd_ckpt_service *ck = calloc(1, sizeof(*ck));
	const struct embd_tables *t = &config->tables;
	size_t len;
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!ck)
		return rc;
	ck->config = config;
	ck->step = step;
	ck->efd = -1;
	ck->base.node = config->node_rank;
	ck->base.num_nodes = embd_config_nodes(config);
	ck->base.num_tables = t->count;
	ck->base.tables = calloc(t->count + 1, sizeof(*ck->base.tables));
	if (!ck->base.tables)
		goto out;
	for (uint32_t i = 0; i < t->count; i++)
		ck->base.tables[i] = (struct embd_ckpt_table){
			.num_embeddings = t->specs[i].num_embeddings,
			.embedding_dim = t->specs[i].embedding_dim, .data_type = t->specs[i].data_type,
			.optimizer = t->specs[i].optimizer.type,
		};
	for (uint32_t i = 0; i < t->count; i++)
		memcpy(ck->base.tables[i].name, t->specs[i].name, EMBD_NAME_MAX);
	if ((rc = embd_plan_write_json(plan, &ck->base.plan_json, &len)))
		goto out;
	ck->base.plan_hash = plan->plan_hash;
	if ((rc = build_layout(ck, err, err_len)))
		goto out;
	/* a handle of its own: the service thread's one is busy in the steps' collectives */
	if (ck->base.num_nodes > 1 &&
	    (rc = embd_store_connect(config->master_addr, config->master_port,
				     config->store_timeout_ms, &ck->store, err, err_len)))
		goto out;
	ck->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (ck->efd < 0) {
		rc = EMBD_EIO;
		snprintf(err, err_len, "checkpoints: eventfd: %s", strerror(errno));
		goto out;
	}
	ck->last_ns = now_ns();
	*out = ck;
	return 0;
out:
	if (rc == EMBD_ENOMEM && !err[0])
		snprintf(err, err_len, "checkpoints: out of memory");
	embd_ckpt_service_destroy(ck);
	return rc;
}

void embd_ckpt_service_destroy(struct embd_ckpt_service *ck)
{
	if (!ck)
		return;
	if (ck->running)
		pthread_join(ck->thread, NULL);
	if (ck->efd >= 0)
		close(ck->efd);
	embd_store_close(ck->store);
	embd_ckpt_manifest_free(&ck->base);
	free(ck->arrays);
	free(ck->sources);
	free(ck->array_bytes);
	free(ck->array_shards);
	free(ck->buffer);
	free(ck);
}

int embd_ckpt_service_fd(const struct embd_ckpt_service *ck)
{
	return ck->efd;
}

/* ---- writing ----------------------------------------------------------------------------- */

/* Node 0 of a cluster: waits for every node's report of step, merges them and commits
 * (checkpoint.h, "shared directory"). Any failure drops .tmp-step-<step>. */
static int commit_cluster(struct embd_ckpt_service *ck, uint64_t step)
{
	const uint32_t n = ck->base.num_nodes;
	const char *root = ck->config->checkpoint_dir;
	struct result *w = &ck->w;
	struct embd_ckpt_manifest *parts = calloc(n, sizeof(*parts)), merged = { 0 };
	char (*keys)[64] = calloc(n, sizeof(*keys)), inner[512];
	const char **names = calloc(n, sizeof(*names));
	int rc = EMBD_ENOMEM;

	if (!parts || !keys || !names)
		goto out;
	for (uint32_t k = 0; k < n; k++) {
		snprintf(keys[k], sizeof(keys[k]), "ckpt/%" PRIu64 "/node/%u", step, k);
		names[k] = keys[k];
	}
	if ((rc = embd_store_wait(ck->store, names, n))) {
		char missing[256] = "";
		size_t len = 0;
		for (uint32_t k = 0; k < n && len < sizeof(missing) - 16; k++)
			if (embd_store_check(ck->store, keys[k]) != 1)
				len += (size_t)snprintf(missing + len, sizeof(missing) - len, "%s%u",
							len ? ", " : "", k);
		snprintf(w->err, sizeof(w->err), "node %s did not report its files within "
			 "store_timeout_ms %d (%s): step %" PRIu64 " is dropped", len ? missing : "?",
			 ck->config->store_timeout_ms, embd_store_error(ck->store), step);
		goto out;
	}
	for (uint32_t k = 0; k < n && !rc; k++) {
		void *v = NULL;
		size_t len = 0;
		if ((rc = embd_store_get(ck->store, keys[k], &v, &len))) {
			snprintf(w->err, sizeof(w->err), "node %u's report: %s", k,
				 embd_store_error(ck->store));
		} else if (!len || *(char *)v != '{') {
			rc = EMBD_EIO;
			snprintf(w->err, sizeof(w->err), "node %u: %.*s", k, (int)len, (char *)v);
		} else if ((rc = embd_ckpt_manifest_parse(v, len, &parts[k], inner, sizeof(inner)))) {
			snprintf(w->err, sizeof(w->err), "node %u's report: %s", k, inner);
		}
		free(v);
	}
	if (!rc)
		rc = embd_ckpt_manifest_merge(parts, n, &merged, w->err, sizeof(w->err));
	if (!rc)
		rc = embd_ckpt_commit(root, &merged, true, w->err, sizeof(w->err));
out:
	if (rc == EMBD_ENOMEM && !w->err[0])
		snprintf(w->err, sizeof(w->err), "out of memory");
	if (rc && embd_ckpt_discard(root, step, inner, sizeof(inner)))
		embd_log_warning("checkpoint of step %" PRIu64 ": %s", step, inner);
	for (uint32_t k = 0; keys && k < n; k++) {
		embd_store_delete(ck->store, keys[k]);
		embd_ckpt_manifest_free(&parts[k]);
	}
	embd_ckpt_manifest_free(&merged);
	free(parts);
	free(keys);
	free(names);
	return rc;
}

/* Every node of a cluster: its part into .tmp-step-N, then its report (the manifest of its
 * files, or why it has none); node 0 then commits. */
static int write_cluster(struct embd_ckpt_service *ck, struct embd_ckpt_manifest *m)
{
	struct result *w = &ck->w;
	char key[64], failed[sizeof(w->err) + 8], *text = NULL;
	int rc = embd_ckpt_write_part(ck->config->checkpoint_dir, m, ck->arrays, ck->num_arrays,
				      true, &w->bytes, w->err, sizeof(w->err));

	if (!rc && (rc = embd_ckpt_manifest_write(m, &text)))
		snprintf(w->err, sizeof(w->err), "cannot format this node's manifest");
	snprintf(failed, sizeof(failed), "error: %s", w->err);
	const char *report = text ? text : failed;
	snprintf(key, sizeof(key), "ckpt/%" PRIu64 "/node/%u", m->step, m->node);
	int src = embd_store_set(ck->store, key, report, strlen(report));
	free(text);
	if (src && !rc) {
		rc = src;
		snprintf(w->err, sizeof(w->err), "reporting to the store: %s",
			 embd_store_error(ck->store));
	}
	return rc || m->node ? rc : commit_cluster(ck, m->step);
}

/* The write itself: the thread's body, or the final checkpoint's on the service thread. */
static void write_snapshot(struct embd_ckpt_service *ck)
{
	struct embd_ckpt_manifest m = ck->base;        /* shares tables and plan */
	struct result *w = &ck->w;
	const char *root = ck->config->checkpoint_dir;
	const bool cluster = ck->base.num_nodes > 1;
	uint64_t t0 = now_ns();

	m.files = NULL;
	m.num_files = 0;
	m.step = w->step;
	m.created_unix_ms = 0;
	embd_ckpt_dir_name(root, w->step, w->dir, sizeof(w->dir));
	w->rc = cluster ? write_cluster(ck, &m)
			: embd_ckpt_write_dir(root, &m, ck->arrays, ck->num_arrays, true, &w->bytes,
					      w->err, sizeof(w->err));
	free(m.files);
	if (!w->rc && !m.node) {
		char inner[512];
		int removed = embd_ckpt_retain(root, ck->config->checkpoint_keep,
					       cluster ? w->step : UINT64_MAX, inner, sizeof(inner));
		if (removed < 0)
			snprintf(w->err, sizeof(w->err), "retention: %s", inner);
	}
	w->write_ms = (double)(now_ns() - t0) / 1e6;
}

static void *writer_main(void *arg)
{
	struct embd_ckpt_service *ck = arg;
	uint64_t one = 1;

	write_snapshot(ck);
	atomic_store_explicit(&ck->finished, true, memory_order_release);
	if (write(ck->efd, &one, sizeof(one)) != sizeof(one))
		embd_log_warning("checkpoint: cannot signal the service (eventfd)");
	return NULL;
}

/* One copier's part of the snapshot: bytes [from, to) of all arrays laid end to end. */
struct copy_part {
	const struct embd_ckpt_service *ck;
	uint64_t from, to;
	pthread_t thread;
	bool started;
};

static void *copy_part(void *arg)
{
	struct copy_part *p = arg;
	uint64_t at = 0;

	for (uint32_t i = 0; i < p->ck->num_arrays && at < p->to; i++) {
		uint64_t n = p->ck->array_bytes[i], lo = p->from > at ? p->from - at : 0;
		uint64_t hi = p->to - at < n ? p->to - at : n;
		if (lo < hi)
			memcpy((uint8_t *)p->ck->arrays[i].data + lo, (const uint8_t *)p->ck->sources[i] + lo,
			       hi - lo);
		at += n;
	}
	return NULL;
}

/* Copies the shards into the buffer: the stall. Memory bandwidth is shared, but one core
 * rarely saturates it, so the copy is split over up to COPY_THREADS threads (one per CPU). */
#define COPY_THREADS 8
static void snapshot(struct embd_ckpt_service *ck, uint64_t step)
{
	struct copy_part parts[COPY_THREADS];
	uint64_t t0 = now_ns(), total = 0;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	uint32_t n = cpus < 1 ? 1 : cpus > COPY_THREADS ? COPY_THREADS : (uint32_t)cpus;

	for (uint32_t i = 0; i < ck->num_arrays; i++) {
		total += ck->array_bytes[i];
		ck->arrays[i].file.optimizer_step = ck->array_shards[i]->step;
	}
	if (total < (64u << 20))
		n = 1;          /* thread start-up costs more than it saves */
	for (uint32_t k = 0; k < n; k++) {
		parts[k] = (struct copy_part){ .ck = ck, .from = total * k / n,
					       .to = total * (k + 1) / n };
		parts[k].started = k && !pthread_create(&parts[k].thread, NULL, copy_part, &parts[k]);
	}
	for (uint32_t k = 0; k < n; k++)
		if (!parts[k].started)
			copy_part(&parts[k]);   /* part 0, or one whose thread did not start */
	for (uint32_t k = 1; k < n; k++)
		if (parts[k].started)
			pthread_join(parts[k].thread, NULL);
	ck->w = (struct result){ .seq = ++ck->seq_started, .step = step };
	ck->w.stall_ms = (double)(now_ns() - t0) / 1e6;
	if (ck->w.stall_ms > ck->max_stall_ms)
		ck->max_stall_ms = ck->w.stall_ms;
	ck->requested = false;
	ck->last_step = step;
	ck->last_ns = now_ns();
}

static void finish(struct embd_ckpt_service *ck)
{
	struct result *w = &ck->w;

	if (w->rc == EMBD_EBUSY) {      /* this step is on disk already: nothing to add */
		w->rc = 0;
		w->bytes = 0;
		embd_log_info("checkpoint of step %" PRIu64 ": %s holds it already", w->step, w->dir);
	} else if (w->rc) {
		embd_log_error("checkpoint of step %" PRIu64 " failed: %s", w->step, w->err);
	} else {
		ck->written++;
		embd_log_info("checkpoint of step %" PRIu64 ": %s, %" PRIu64 " bytes in %.1f ms "
			      "(steps stalled %.2f ms)%s%s", w->step, w->dir, w->bytes, w->write_ms,
			      w->stall_ms, w->err[0] ? "; " : "", w->err);
		w->err[0] = 0;
	}
	ck->last = *w;
}

static void join_writer(struct embd_ckpt_service *ck)
{
	pthread_join(ck->thread, NULL);
	ck->running = false;
	finish(ck);
}

void embd_ckpt_service_poll(struct embd_ckpt_service *ck, uint64_t step)
{
	const struct embd_config *c = ck->config;
	bool every = c->checkpoint_every_steps && step >= ck->last_step + c->checkpoint_every_steps;
	bool due = ck->requested || every;

	if (ck->running) {
		/* A cluster's nodes must all take the same steps: a due one waits for the write
		 * before it (a stall) rather than moving to whichever step this node is at when its
		 * write ends. One node alone takes it when the write ends. */
		if (!every || ck->base.num_nodes == 1)
			return;
		join_writer(ck);
	}
	if (c->checkpoint_every_seconds && step != ck->last_step &&
	    now_ns() - ck->last_ns >= (uint64_t)c->checkpoint_every_seconds * 1000000000u)
		due = true;
	if (!due)
		return;
	snapshot(ck, step);
	atomic_store(&ck->finished, false);
	if (pthread_create(&ck->thread, NULL, writer_main, ck)) {
		ck->w.rc = EMBD_EIO;
		snprintf(ck->w.err, sizeof(ck->w.err), "cannot start the writer thread");
		finish(ck);
		return;
	}
	ck->running = true;
}

uint64_t embd_ckpt_service_request(struct embd_ckpt_service *ck)
{
	ck->requested = true;
	return ck->seq_started + 1;
}

uint64_t embd_ckpt_service_reap(struct embd_ckpt_service *ck)
{
	uint64_t v;

	if (read(ck->efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
		embd_log_warning("checkpoint: eventfd read: %s", strerror(errno));
	if (ck->running && atomic_load_explicit(&ck->finished, memory_order_acquire))
		join_writer(ck);
	return ck->last.seq;
}

int embd_ckpt_service_final(struct embd_ckpt_service *ck, uint64_t step)
{
	if (ck->running)
		join_writer(ck);
	if (ck->base.num_nodes > 1) {
		if (step != ck->last_step)
			embd_log_notice("no final checkpoint of step %" PRIu64 ": a cluster takes only "
					"checkpoint_every_steps (the last one is step %" PRIu64 ")", step,
					ck->last_step);
		return 0;
	}
	if (ck->last.seq && !ck->last.rc && ck->last.step == step)
		return 0;
	if (ck->last_step == step && step == ck->resumed_step && !ck->seq_started)
		return 0;       /* nothing trained since the restore */
	snapshot(ck, step);
	write_snapshot(ck);
	finish(ck);
	return ck->last.rc;
}

/* ---- restore ----------------------------------------------------------------------------- */

static void log_skip(void *arg, const char *dir, const char *why)
{
	(void)arg;
	embd_log_warning("checkpoint %s is damaged, skipped: %s", dir, why);
}

/* The checkpoint's tables must be the config's: same names, rows and columns. */
static int check_tables(const struct embd_ckpt_service *ck, const struct embd_ckpt_manifest *m,
			const char *dir, int *index, char *err, size_t err_len)
{
	const struct embd_tables *t = &ck->config->tables;

	for (uint32_t i = 0; i < t->count; i++) {
		const struct embd_table_spec *s = &t->specs[i];
		int k = index[i] = embd_ckpt_table_index(m, s->name);
		if (k < 0)
			return snprintf(err, err_len, "%s: table '%s' of the config is not in the "
					"checkpoint", dir, s->name), EMBD_EMISMATCH;
		const struct embd_ckpt_table *c = &m->tables[k];
		if (c->num_embeddings != s->num_embeddings || c->embedding_dim != s->embedding_dim)
			return snprintf(err, err_len, "%s: table '%s' is %lld x %d in the checkpoint, "
					"%lld x %d in the config", dir, s->name,
					(long long)c->num_embeddings, c->embedding_dim,
					(long long)s->num_embeddings, s->embedding_dim), EMBD_EMISMATCH;
		bool has_state = false;
		for (uint32_t f = 0; f < m->num_files; f++)
			has_state |= m->files[f].table == (uint32_t)k && m->files[f].state != EMBD_CKPT_WEIGHT;
		if (has_state && c->optimizer != s->optimizer.type)
			return snprintf(err, err_len, "%s: table '%s' was trained with another optimizer "
					"(its state cannot be used)", dir, s->name), EMBD_EMISMATCH;
	}
	for (uint32_t k = 0; k < m->num_tables; k++) {
		bool found = false;
		for (uint32_t i = 0; i < t->count && !found; i++)
			found = index[i] == (int)k;
		if (!found)
			return snprintf(err, err_len, "%s: table '%s' of the checkpoint is not in the "
					"config", dir, m->tables[k].name), EMBD_EMISMATCH;
	}
	return 0;
}

#define RESTORE_KEY "ckpt/restore"

/* Which checkpoint a cluster restores (checkpoint.h): node 0 finds the newest valid one and
 * publishes its step ("none", or "error: why"); every other node opens that very directory
 * and fails on damage rather than take another step than node 0. */
static int find_cluster(struct embd_ckpt_service *ck, char *dir, size_t dir_cap,
			struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	const char *root = ck->config->checkpoint_dir;
	char value[800], inner[600];
	void *v = NULL;
	size_t len = 0;
	int rc;

	if (!ck->base.node) {
		rc = embd_ckpt_find(root, UINT64_MAX, log_skip, NULL, dir, dir_cap, m, err, err_len);
		if (!rc)
			snprintf(value, sizeof(value), "%" PRIu64, m->step);
		else
			snprintf(value, sizeof(value), rc == EMBD_ENOENT ? "none" : "error: %s", err);
		if (embd_store_set(ck->store, RESTORE_KEY, value, strlen(value))) {
			embd_ckpt_manifest_free(m);
			return snprintf(err, err_len, "store: publishing the step to restore: %s",
					embd_store_error(ck->store)), EMBD_EIO;
		}
		return rc;
	}
	if ((rc = embd_store_get(ck->store, RESTORE_KEY, &v, &len)))
		return snprintf(err, err_len, "store: waiting for node 0's choice of checkpoint: %s",
				embd_store_error(ck->store)), rc;
	snprintf(value, sizeof(value), "%.*s", (int)len, (char *)v);
	free(v);
	if (!strcmp(value, "none"))
		return snprintf(err, err_len, "%s: no valid checkpoint (node 0)", root), EMBD_ENOENT;
	if (!strncmp(value, "error: ", 7))
		return snprintf(err, err_len, "node 0 cannot choose a checkpoint: %s", value + 7),
		       EMBD_EIO;
	uint64_t step = strtoull(value, NULL, 10);
	embd_ckpt_dir_name(root, step, dir, dir_cap);
	rc = embd_ckpt_open_dir(dir, m, inner, sizeof(inner));
	if (!rc && m->step != step) {
		snprintf(inner, sizeof(inner), "its manifest is of step %" PRIu64, m->step);
		embd_ckpt_manifest_free(m);
		rc = EMBD_EPARSE;
	}
	/* never EMBD_ENOENT: this node must not start afresh while node 0 restores */
	if (rc)
		return snprintf(err, err_len, "%s: node 0 restores step %" PRIu64 ", this node cannot "
				"(is checkpoint_dir one shared directory?): %s", dir, step, inner),
		       rc == EMBD_ENOENT ? EMBD_EMISMATCH : rc;
	return 0;
}

int embd_ckpt_service_restore(struct embd_ckpt_service *ck, uint64_t *step_out, char *err,
			      size_t err_len)
{
	char dir[EMBD_CKPT_PATH_MAX + 64];
	struct embd_ckpt_manifest m;
	uint32_t n = embd_step_num_shards(ck->step);
	struct embd_ckpt_target *targets = calloc(n + 1, sizeof(*targets));
	int *index = calloc(ck->config->tables.count + 1, sizeof(int));
	int rc = EMBD_ENOMEM;

	*step_out = 0;
	memset(&m, 0, sizeof(m));
	if (!targets || !index)
		goto out;
	rc = ck->base.num_nodes > 1 ? find_cluster(ck, dir, sizeof(dir), &m, err, err_len)
				    : embd_ckpt_find(ck->config->checkpoint_dir, UINT64_MAX, log_skip,
						     NULL, dir, sizeof(dir), &m, err, err_len);
	if (rc == EMBD_ENOENT) {
		embd_log_info("no checkpoint to restore in %s: starting from the initial weights",
			      ck->config->checkpoint_dir);
		rc = 0;
		goto out;
	}
	if (rc || (rc = check_tables(ck, &m, dir, index, err, err_len)))
		goto out;
	uint32_t num_targets = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(ck->step, i, &v);
		if (!v.shard)
			continue;       /* another node's */
		const struct embd_shard_desc *d = &v.shard->desc;
		targets[num_targets++] = (struct embd_ckpt_target){
			.table = (uint32_t)index[v.table], .row_offset = d->row_offset, .rows = d->rows,
			.col_offset = d->col_offset, .cols = d->cols, .dtype = d->dtype,
			.weights = v.shard->weights, .momentum1 = v.shard->momentum1,
			.momentum2 = v.shard->momentum2,
		};
	}
	if ((rc = embd_ckpt_load(dir, &m, targets, num_targets, err, err_len)))
		goto out;
	for (uint32_t i = 0, k = 0; i < n; i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(ck->step, i, &v);
		if (v.shard)
			v.shard->step = targets[k++].optimizer_step;
	}
	ck->resumed_step = ck->last_step = *step_out = m.step;
	embd_log_notice("restored %s: step %" PRIu64 ", %u files, written under plan %016" PRIx64
			"%s", dir, m.step, m.num_files, m.plan_hash,
			m.plan_hash == ck->base.plan_hash ? "" : " (resharded to this plan)");
out:
	embd_ckpt_manifest_free(&m);
	free(targets);
	free(index);
	return rc;
}

/* ---- reporting --------------------------------------------------------------------------- */

static void add_result(cJSON *o, const struct result *r)
{
	cJSON_AddBoolToObject(o, "ok", r->rc == 0);
	cJSON_AddNumberToObject(o, "step", (double)r->step);
	cJSON_AddStringToObject(o, "dir", r->dir);
	cJSON_AddNumberToObject(o, "bytes", (double)r->bytes);
	cJSON_AddNumberToObject(o, "write_ms", r->write_ms);
	cJSON_AddNumberToObject(o, "stall_ms", r->stall_ms);
	if (r->rc)
		cJSON_AddStringToObject(o, "error", r->err);
}

static int print(cJSON *root, char **out)
{
	*out = root ? cJSON_PrintUnformatted(root) : NULL;
	cJSON_Delete(root);
	return *out ? 0 : EMBD_ENOMEM;
}

int embd_ckpt_service_result_json(const struct embd_ckpt_service *ck, char **out)
{
	cJSON *root = cJSON_CreateObject();

	if (root)
		add_result(root, &ck->last);
	return print(root, out);
}

int embd_ckpt_service_status_add(const struct embd_ckpt_service *ck, char **status)
{
	cJSON *root = cJSON_Parse(*status), *o, *last;

	if (!root || !(o = cJSON_AddObjectToObject(root, "checkpoint"))) {
		cJSON_Delete(root);
		return EMBD_ENOMEM;
	}
	cJSON_AddNumberToObject(root, "resumed_step", (double)ck->resumed_step);
	cJSON_AddStringToObject(o, "dir", ck->config->checkpoint_dir);
	cJSON_AddNumberToObject(o, "every_steps", ck->config->checkpoint_every_steps);
	cJSON_AddNumberToObject(o, "every_seconds", ck->config->checkpoint_every_seconds);
	cJSON_AddNumberToObject(o, "keep", ck->config->checkpoint_keep);
	cJSON_AddBoolToObject(o, "in_progress", ck->running);
	cJSON_AddNumberToObject(o, "written", (double)ck->written);
	cJSON_AddNumberToObject(o, "max_stall_ms", ck->max_stall_ms);
	if (ck->last.seq && (last = cJSON_AddObjectToObject(o, "last")))
		add_result(last, &ck->last);
	char *text;
	int rc = print(root, &text);
	if (!rc) {
		free(*status);
		*status = text;
	}
	return rc;
}

void embd_ckpt_service_figures(const struct embd_ckpt_service *ck, struct embd_ckpt_figures *out)
{
	*out = (struct embd_ckpt_figures){
		.max_stall_ms = ck->max_stall_ms, .last_stall_ms = ck->last.stall_ms,
		.last_write_ms = ck->last.write_ms, .last_bytes = ck->last.bytes,
		.written = ck->written,
	};
}
