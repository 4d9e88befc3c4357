/*
 * embd-bench kernels: the CPU embedding kernels against this machine's memory limits and
 * against FBGEMM (PyTorch's CPU embedding kernels), on the same ids and threads in one run.
 *
 * Limits first: copy_limit (parallel memcpy, read + write bytes) and gather_limit (a plain
 * prefetching loop summing random rows of R bytes from a table far larger than cache, per
 * batch split over the same workers, so fork-join costs are in the limit too). Forward gbps
 * counts the row bytes gathered; backward gbps counts the least DRAM traffic of an update
 * (each touched row and its state read and written once) and is held against copy_limit.
 * FBGEMM runs in tools/bench/fbgemm_kernels.py under $EMBD_BENCH_PYTHON (default python3);
 * when torch does not import, its fields are left out.
 */
#include <cjson/cJSON.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bench.h"
#include "kernels/embedding.h"
#include "kernels/workers.h"

#define MAX_RUNS 64
#define GATHER_PREFETCH_IDS 12
#define POOL_IDS_MIN (4u << 20)        /* ids per table: their rows far exceed any cache */

#ifndef EMBD_BENCH_SCRIPT_DIR
#define EMBD_BENCH_SCRIPT_DIR "tools/bench"
#endif

struct opts {
	uint32_t threads;
	uint64_t table_bytes;
	uint32_t batch;
	int runs;
	double run_ns;
	enum embd_isa isa;
	bool fbgemm;
	const char *python;
	const char *configs;            /* --config: comma-separated names to run, NULL for all */
};

struct bench {
	struct opts o;
	struct embd_workers *workers;
	struct embd_exec exec;
	double copy_gbps;
};

/*
 * Whether the config named name ("forward/64/1", "backward_sgd/128/20") is to run: every one
 * without --config, else those listed (exact names, so that forward/64/1 is not forward/64/100).
 */
static bool config_selected(const struct opts *o, const char *name)
{
	size_t len = strlen(name);

	if (!o->configs)
		return true;
	for (const char *p = o->configs; *p;) {
		size_t n = strcspn(p, ",");
		if (n == len && !strncmp(p, name, len))
			return true;
		p += n + (p[n] == ',');
	}
	return false;
}

/* ---- timing ------------------------------------------------------------------------------ */

typedef void (*step_fn)(void *arg, uint64_t k);

/* One run: repeats steps from *k on for run_ns; returns ns per step. */
static double run_steps(const struct bench *b, step_fn fn, void *arg, uint64_t *k)
{
	uint64_t n = 0, t0 = bench_now_ns(), el;

	do {
		fn(arg, (*k)++);
		n++;
		el = bench_now_ns() - t0;
	} while (el < b->o.run_ns);
	return (double)el / (double)n;
}

/* Median over runs of the time of one step. */
static double median_step_ns(const struct bench *b, step_fn fn, void *arg)
{
	double per[MAX_RUNS];
	uint64_t k = 0;

	fn(arg, k++);
	for (int r = 0; r < b->o.runs; r++)
		per[r] = run_steps(b, fn, arg, &k);
	return bench_median(per, (size_t)b->o.runs);
}

/*
 * Runs of fn and of its reference ref alternate, so that both see the same machine (other
 * processes come and go on a shared host): *ns and *ref_ns are the medians of each, and
 * *ratio the median over runs of ref time / fn time, i.e. fn's throughput over ref's.
 */
static void paired_step_ns(const struct bench *b, step_fn fn, void *arg, step_fn ref, void *ref_arg,
			   double *ns, double *ref_ns, double *ratio)
{
	double a[MAX_RUNS], r[MAX_RUNS], q[MAX_RUNS];
	uint64_t k = 0, kr = 0;

	fn(arg, k++);
	ref(ref_arg, kr++);
	for (int i = 0; i < b->o.runs; i++) {
		r[i] = run_steps(b, ref, ref_arg, &kr);
		a[i] = run_steps(b, fn, arg, &k);
		q[i] = r[i] / a[i];
	}
	*ns = bench_median(a, (size_t)b->o.runs);
	*ref_ns = bench_median(r, (size_t)b->o.runs);
	*ratio = bench_median(q, (size_t)b->o.runs);
}

/* ---- the limits -------------------------------------------------------------------------- */

struct copy_job {
	const uint8_t *src;
	uint8_t *dst;
	uint64_t bytes;
};

static void copy_worker(void *arg, uint32_t w, uint32_t nw)
{
	const struct copy_job *j = arg;
	uint64_t lo = j->bytes * w / nw & ~63ull, hi = w + 1 == nw ? j->bytes : j->bytes * (w + 1) / nw & ~63ull;
	memcpy(j->dst + lo, j->src + lo, hi - lo);
}

static void copy_step(void *arg, uint64_t k)
{
	struct bench *b = ((void **)arg)[0];
	(void)k;
	embd_workers_run(b->workers, copy_worker, ((void **)arg)[1]);
}

static int measure_copy(struct bench *b)
{
	struct copy_job j = { .bytes = 256ull << 20 };
	void *src = aligned_alloc(64, j.bytes), *dst = aligned_alloc(64, j.bytes);

	if (!src || !dst) {
		free(src);
		free(dst);
		fprintf(stderr, "embd-bench kernels: out of memory for the copy buffers\n");
		return 1;
	}
	memset(src, 1, j.bytes);
	memset(dst, 2, j.bytes);
	j.src = src;
	j.dst = dst;
	void *arg[2] = { b, &j };
	double ns = median_step_ns(b, copy_step, arg);
	b->copy_gbps = 2.0 * (double)j.bytes / ns;
	printf("{\"name\":\"copy_limit\",\"bytes\":%llu,\"threads\":%u,\"counts\":\"read+write\",\"gbps\":%.2f}\n",
	       (unsigned long long)j.bytes, b->o.threads, b->copy_gbps);
	free(src);
	free(dst);
	return 0;
}

/* The batches every measurement walks: pool[(k % nbatches) * per_batch ...]. */
struct id_pool {
	int64_t *ids;
	uint64_t n;
	int64_t rows;
};

static const int64_t *pool_batch(const struct id_pool *p, uint64_t per_batch, uint64_t k)
{
	uint64_t nb = p->n / per_batch;
	return p->ids + (k % nb) * per_batch;
}

/* Workers grab chunks of the batch's ids from a counter, as the kernels do, so one worker
 * the scheduler delays does not hold the limit back more than it holds back the kernel. */
#define GATHER_CHUNK_IDS 1024

struct gather_job {
	const float *table;
	uint32_t floats;
	const int64_t *ids;
	uint64_t n;
	atomic_uint_fast64_t next;
	float sink[64][128];            /* per worker; read after the run so nothing is elided */
};

#if defined(__x86_64__)
/*
 * nvec 64-byte vectors per row (constant nvec: see gather_avx512). Each row is summed to one
 * vector by a tree, then into one of 4 rotating accumulators: no long chain of dependent adds,
 * so a late row never stalls the loads of the rows after it. The unroll pragmas matter: with
 * the loops rolled (gcc -O2) this loop ran about 1.5x slower than the kernel itself.
 */
__attribute__((target("avx512f"), always_inline)) static inline void
gather_rows_avx512(const float *t, const int64_t *ids, uint64_t n, float *acc, const uint32_t nvec)
{
	__m512 a[4] = { _mm512_loadu_ps(acc), _mm512_setzero_ps(), _mm512_setzero_ps(),
			_mm512_setzero_ps() };

	for (uint64_t k = 0; k < n; k++) {
		if (k + GATHER_PREFETCH_IDS < n) {
			const char *p = (const char *)(t + (uint64_t)ids[k + GATHER_PREFETCH_IDS] * 16 * nvec);
#pragma GCC unroll 8
			for (uint32_t v = 0; v < nvec; v++)
				_mm_prefetch(p + 64 * v, _MM_HINT_T0);
		}
		const float *row = t + (uint64_t)ids[k] * 16 * nvec;
		__m512 x[8];
#pragma GCC unroll 8
		for (uint32_t v = 0; v < nvec; v++)
			x[v] = _mm512_loadu_ps(row + 16 * v);
#pragma GCC unroll 4
		for (uint32_t w = nvec; w > 1; w /= 2)
#pragma GCC unroll 4
			for (uint32_t v = 0; v < w / 2; v++)
				x[v] = _mm512_add_ps(x[v], x[v + w / 2]);
		a[k & 3] = _mm512_add_ps(a[k & 3], x[0]);
	}
	_mm512_storeu_ps(acc, _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

__attribute__((target("avx512f"))) static bool gather_avx512(const float *t, uint32_t floats,
							      const int64_t *ids, uint64_t n, float *acc)
{
	switch (floats) {
	case 64: gather_rows_avx512(t, ids, n, acc, 4); return true;
	case 128: gather_rows_avx512(t, ids, n, acc, 8); return true;
	default: return false;
	}
}
#endif

static void gather_plain(const float *t, uint32_t floats, const int64_t *ids, uint64_t n, float *acc)
{
	for (uint64_t k = 0; k < n; k++) {
		if (k + GATHER_PREFETCH_IDS < n) {
			const char *p = (const char *)(t + (uint64_t)ids[k + GATHER_PREFETCH_IDS] * floats);
			for (uint32_t off = 0; off < floats * 4; off += 64)
				__builtin_prefetch(p + off, 0, 3);
		}
		const float *row = t + (uint64_t)ids[k] * floats;
		for (uint32_t c = 0; c < floats; c++)
			acc[c] += row[c];
	}
}

static void gather_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct gather_job *j = arg;
	float *acc = j->sink[w % 64];
	bool avx512 = embd_kernels_isa_supported(EMBD_ISA_AVX512);

	(void)nw;
	for (;;) {
		uint64_t lo = atomic_fetch_add_explicit(&j->next, GATHER_CHUNK_IDS, memory_order_relaxed);
		if (lo >= j->n)
			break;
		uint64_t n = j->n - lo < GATHER_CHUNK_IDS ? j->n - lo : GATHER_CHUNK_IDS;
#if defined(__x86_64__)
		if (avx512 && gather_avx512(j->table, j->floats, j->ids + lo, n, acc))
			continue;
#endif
		(void)avx512;
		gather_plain(j->table, j->floats, j->ids + lo, n, acc);
	}
}

struct gather_arg {
	struct bench *b;
	struct gather_job *job;
	const struct id_pool *pool;
	uint64_t per_batch;
};

static void gather_step(void *arg, uint64_t k)
{
	struct gather_arg *g = arg;
	g->job->ids = pool_batch(g->pool, g->per_batch, k);
	atomic_store_explicit(&g->job->next, 0, memory_order_relaxed);
	embd_workers_run(g->b->workers, gather_worker, g->job);
}

/* The gather limit over the pool's batches of per_batch ids; job outlives the arg. */
static struct gather_arg gather_prepare(struct bench *b, struct gather_job *job,
					const struct embd_shard *s, const struct id_pool *pool,
					uint64_t per_batch)
{
	memset(job, 0, sizeof(*job));
	job->table = s->weights;
	job->floats = s->desc.cols;
	job->n = per_batch;
	return (struct gather_arg){ b, job, pool, per_batch };
}

static void print_gather(const struct bench *b, const struct gather_job *job, double ns)
{
	float check = 0;

	for (int w = 0; w < 64; w++)
		check += job->sink[w][0];
	printf("{\"name\":\"gather_limit\",\"row_bytes\":%u,\"threads\":%u,\"table_bytes\":%llu,"
	       "\"ids_per_batch\":%llu,\"gbps\":%.2f,\"checksum\":%.3g}\n",
	       job->floats * 4, b->o.threads, (unsigned long long)b->o.table_bytes,
	       (unsigned long long)job->n, (double)job->n * job->floats * 4 / ns, check);
}

/* ---- FBGEMM ------------------------------------------------------------------------------ */

static bool write_ids(const struct id_pool *p, char *path, size_t path_len)
{
	snprintf(path, path_len, "/tmp/embd-bench-ids-XXXXXX");
	int fd = mkstemp(path);
	if (fd < 0)
		return false;
	FILE *f = fdopen(fd, "wb");
	bool ok = f && fwrite(p->ids, sizeof(int64_t), p->n, f) == p->n;
	if (f)
		ok = fclose(f) == 0 && ok;
	return ok;
}

/* Runs the python side; *ns = its median ns per batch, 0 when it did not run. */
static void fbgemm_time(const struct bench *b, const char *ids_path, int64_t rows, uint32_t dim,
			uint32_t P, const char *mode, const char *optimizer, double *ns, char *op,
			size_t op_len)
{
	char cmd[1024], line[4096];
	const char *script = getenv("EMBD_BENCH_FBGEMM_SCRIPT");

	*ns = 0;
	snprintf(cmd, sizeof(cmd),
		 "'%s' '%s' --ids '%s' --rows %lld --dim %u --pooling-factor %u --batch %u --threads %u "
		 "--mode %s --optimizer %s --runs %d --run-seconds %.3f 2>/dev/null",
		 b->o.python, script ? script : EMBD_BENCH_SCRIPT_DIR "/fbgemm_kernels.py", ids_path,
		 (long long)rows, dim, P, b->o.batch, b->o.threads, mode, optimizer, b->o.runs,
		 b->o.run_ns / 1e9);
	FILE *f = popen(cmd, "r");
	if (!f)
		return;
	bool got = fgets(line, sizeof(line), f) != NULL;
	int status = pclose(f);
	if (!got || status != 0)
		return;
	cJSON *j = cJSON_Parse(line);
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "ns_per_batch");
	const cJSON *o = cJSON_GetObjectItemCaseSensitive(j, "op");
	if (cJSON_IsNumber(v) && v->valuedouble > 0)
		*ns = v->valuedouble;
	snprintf(op, op_len, "%s", cJSON_IsString(o) ? o->valuestring : "?");
	cJSON_Delete(j);
}

static bool fbgemm_available(const struct bench *b, char *why, size_t why_len)
{
	char cmd[512];

	snprintf(cmd, sizeof(cmd), "'%s' -c 'import torch, fbgemm_gpu' >/dev/null 2>&1", b->o.python);
	int status = system(cmd);
	snprintf(why, why_len, "%s -c 'import torch, fbgemm_gpu' failed (exit code %d)", b->o.python,
		 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
	return status == 0;
}

/* ---- forward and backward ---------------------------------------------------------------- */

struct kernel_arg {
	struct bench *b;
	struct embd_shard *shard;
	const struct id_pool *pool;
	uint32_t P;
	int64_t *offsets;
	float *pooled;
	float *grad;
	int rc;
	struct embd_kernel_err err;
};

static struct embd_bag_batch kernel_batch(struct kernel_arg *a, uint64_t k)
{
	uint64_t per_batch = (uint64_t)a->b->o.batch * a->P;
	struct embd_bag_batch bt = {
		.shard = a->shard, .batch_size = a->b->o.batch, .offsets = a->offsets,
		.ids = pool_batch(a->pool, per_batch, k), .num_ids = per_batch,
		.pooling = EMBD_POOLING_SUM, .pooled = a->pooled, .pooled_grad = a->grad,
		.pooled_stride = a->shard->desc.cols,
	};
	return bt;
}

static void forward_step(void *arg, uint64_t k)
{
	struct kernel_arg *a = arg;
	struct embd_bag_batch bt = kernel_batch(a, k);
	int rc = embd_kernels_forward(&a->b->exec, &bt, 1, &a->err);
	if (rc)
		a->rc = rc;
}

static void backward_step(void *arg, uint64_t k)
{
	struct kernel_arg *a = arg;
	struct embd_bag_batch bt = kernel_batch(a, k);
	int rc = embd_kernels_backward(&a->b->exec, a->shard, &bt, 1, &a->err);
	if (rc)
		a->rc = rc;
}

static void set_offsets(int64_t *offsets, uint32_t batch, uint32_t P)
{
	for (uint32_t i = 0; i <= batch; i++)
		offsets[i] = (int64_t)i * P;
}

/* Distinct rows per batch, averaged over the pool's batches: the rows an update writes. */
static double mean_unique_rows(const struct id_pool *p, uint64_t per_batch)
{
	uint64_t nb = p->n / per_batch, total = 0;
	uint8_t *seen = calloc((uint64_t)p->rows / 8 + 1, 1);

	if (!seen)
		return (double)per_batch;
	for (uint64_t k = 0; k < nb; k++) {
		const int64_t *ids = p->ids + k * per_batch;
		for (uint64_t i = 0; i < per_batch; i++) {
			uint8_t bit = (uint8_t)(1u << (ids[i] & 7));
			total += !(seen[ids[i] >> 3] & bit);
			seen[ids[i] >> 3] |= bit;
		}
		for (uint64_t i = 0; i < per_batch; i++)
			seen[ids[i] >> 3] = 0;
	}
	free(seen);
	return (double)total / (double)nb;
}

static const char *const opt_names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };

/*
 * FBGEMM runs in another process, after ours: ours is measured again right after it and
 * vs_fbgemm uses the mean of both medians, so a load that comes or goes on a shared machine
 * between the two sides does not decide the ratio alone.
 */
static void print_fbgemm(const struct bench *b, step_fn fn, void *arg, double ours_ns,
			 double theirs_ns, const char *op)
{
	if (theirs_ns <= 0)
		return;
	double after = median_step_ns(b, fn, arg);
	printf(",\"ns_per_batch_after_fbgemm\":%.0f,\"fbgemm_ns_per_batch\":%.0f,\"vs_fbgemm\":%.3f,"
	       "\"fbgemm_op\":\"%s\"", after, theirs_ns, theirs_ns / (0.5 * (ours_ns + after)), op);
}

/* Everything for one table of dim columns: its gather limit, forward at each P, and (for
 * the backward dim) every optimizer. */
static int bench_dim(struct bench *b, uint32_t dim, bool with_backward)
{
	static const uint32_t pfs[] = { 1, 20, 100 };
	const uint32_t backward_P = 20;
	int64_t rows = (int64_t)(b->o.table_bytes / ((uint64_t)dim * 4));
	struct embd_shard_desc d = {
		.num_embeddings = rows, .embedding_dim = dim, .dtype = EMBD_DTYPE_FP32, .rows = rows,
		.cols = dim, .optimizer = { .type = EMBD_OPT_SGD, .lr = 0.01f, .eps = 1e-8f,
					    .beta1 = 0.9f, .beta2 = 0.999f },
	};
	struct embd_shard *s = NULL;
	struct id_pool pool = { .rows = rows };
	char err[256], ids_path[64] = "", op[256];
	int rc = 1;
	uint64_t max_batch_ids = (uint64_t)b->o.batch * 100;
	int64_t *offsets = malloc(((uint64_t)b->o.batch + 1) * sizeof(int64_t));
	float *pooled = malloc((uint64_t)b->o.batch * dim * sizeof(float));
	float *grad = malloc((uint64_t)b->o.batch * dim * sizeof(float));

	bool any = false;
	char name[64];
	for (size_t i = 0; i < sizeof(pfs) / sizeof(pfs[0]); i++) {
		snprintf(name, sizeof(name), "forward/%u/%u", dim, pfs[i]);
		any = any || config_selected(&b->o, name);
	}
	for (int t = EMBD_OPT_SGD; with_backward && t <= EMBD_OPT_ADAM; t++) {
		snprintf(name, sizeof(name), "backward_%s/%u/%u", opt_names[t], dim, backward_P);
		any = any || config_selected(&b->o, name);
	}
	if (!any) {
		rc = 0;
		goto out;
	}
	pool.n = POOL_IDS_MIN > 8 * max_batch_ids ? POOL_IDS_MIN : 8 * max_batch_ids;
	pool.n -= pool.n % max_batch_ids;  /* whole batches at P = 100, and so at 20 and 1 */
	pool.ids = malloc(pool.n * sizeof(int64_t));
	if (!offsets || !pooled || !grad || !pool.ids) {
		fprintf(stderr, "embd-bench kernels: out of memory\n");
		goto out;
	}
	if (embd_shard_create(&d, &s, err, sizeof(err))) {
		fprintf(stderr, "embd-bench kernels: %s\n", err);
		goto out;
	}
	embd_shard_init_weights(s, 1, &b->exec);
	uint64_t x = 0x1234567 + dim;
	for (uint64_t i = 0; i < pool.n; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		pool.ids[i] = (int64_t)(x % (uint64_t)rows);
	}
	for (uint64_t i = 0; i < (uint64_t)b->o.batch * dim; i++)
		grad[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
	if (b->o.fbgemm && !write_ids(&pool, ids_path, sizeof(ids_path))) {
		fprintf(stderr, "embd-bench kernels: cannot write the ids file for FBGEMM\n");
		ids_path[0] = 0;
	}

	static struct gather_job gjob;
	struct gather_arg g = gather_prepare(b, &gjob, s, &pool, (uint64_t)b->o.batch * 20);
	print_gather(b, &gjob, median_step_ns(b, gather_step, &g));
	for (size_t i = 0; i < sizeof(pfs) / sizeof(pfs[0]); i++) {
		struct kernel_arg a = { b, s, &pool, pfs[i], offsets, pooled, grad, 0, { 0 } };
		snprintf(name, sizeof(name), "forward/%u/%u", dim, pfs[i]);
		if (!config_selected(&b->o, name))
			continue;
		set_offsets(offsets, b->o.batch, pfs[i]);
		/* the limit over the very batches of this config, runs interleaved with ours */
		g = gather_prepare(b, &gjob, s, &pool, (uint64_t)b->o.batch * pfs[i]);
		double ns, limit_ns, ratio;
		paired_step_ns(b, forward_step, &a, gather_step, &g, &ns, &limit_ns, &ratio);
		if (a.rc) {
			fprintf(stderr, "embd-bench kernels: forward failed: %s\n", a.err.msg);
			goto out;
		}
		double gbps = (double)b->o.batch * pfs[i] * dim * 4 / ns;
		double theirs = 0;
		if (ids_path[0])
			fbgemm_time(b, ids_path, rows, dim, pfs[i], "forward", "sgd", &theirs, op, sizeof(op));
		printf("{\"name\":\"forward\",\"dim\":%u,\"pooling_factor\":%u,\"batch\":%u,"
		       "\"table_bytes\":%llu,\"threads\":%u,\"isa\":\"%s\",\"ns_per_batch\":%.0f,"
		       "\"gbps\":%.2f,\"limit_gbps\":%.2f,\"ratio_to_limit\":%.3f", dim, pfs[i],
		       b->o.batch, (unsigned long long)b->o.table_bytes, b->o.threads,
		       embd_kernels_isa_name(b->exec.isa ? b->exec.isa : embd_kernels_isa_best()), ns,
		       gbps, (double)b->o.batch * pfs[i] * dim * 4 / limit_ns, ratio);
		print_fbgemm(b, forward_step, &a, ns, theirs, op);
		printf("}\n");
		fflush(stdout);
	}

	if (with_backward) {
		set_offsets(offsets, b->o.batch, backward_P);
		double unique = mean_unique_rows(&pool, (uint64_t)b->o.batch * backward_P);
		for (int t = EMBD_OPT_SGD; t <= EMBD_OPT_ADAM; t++) {
			struct embd_shard_desc od = d;
			uint64_t wb, m1b, m2b;
			struct embd_shard *os = NULL;
			snprintf(name, sizeof(name), "backward_%s/%u/%u", opt_names[t], dim, backward_P);
			if (!config_selected(&b->o, name))
				continue;
			od.optimizer.type = t;
			/* a shard of its own (state allocated like the weights), weights copied */
			if (embd_shard_sizes(&od, &wb, &m1b, &m2b, err, sizeof(err)) ||
			    embd_shard_create(&od, &os, err, sizeof(err))) {
				fprintf(stderr, "embd-bench kernels: %s state: %s\n", opt_names[t], err);
				goto out;
			}
			memcpy(os->weights, s->weights, wb);
			struct kernel_arg a = { b, os, &pool, backward_P, offsets, pooled, grad, 0, { 0 } };
			double ns = median_step_ns(b, backward_step, &a);
			if (a.rc) {
				fprintf(stderr, "embd-bench kernels: backward failed: %s\n", a.err.msg);
				embd_shard_destroy(os);
				goto out;
			}
			double state_row = (double)(m1b + m2b) / (double)rows;
			double bytes = unique * 2.0 * (dim * 4.0 + state_row);
			double theirs = 0;
			if (ids_path[0])
				fbgemm_time(b, ids_path, rows, dim, backward_P, "backward", opt_names[t],
					    &theirs, op, sizeof(op));
			printf("{\"name\":\"backward_%s\",\"dim\":%u,\"pooling_factor\":%u,\"batch\":%u,"
			       "\"table_bytes\":%llu,\"state_bytes\":%llu,\"threads\":%u,"
			       "\"unique_rows_per_batch\":%.0f,\"ns_per_batch\":%.0f,\"gbps\":%.2f,"
			       "\"limit\":\"copy_limit\",\"ratio_to_limit\":%.3f", opt_names[t], dim, backward_P,
			       b->o.batch, (unsigned long long)wb, (unsigned long long)(m1b + m2b),
			       b->o.threads, unique, ns, bytes / ns, bytes / ns / b->copy_gbps);
			print_fbgemm(b, backward_step, &a, ns, theirs, op);
			printf("}\n");
			fflush(stdout);
			embd_shard_destroy(os);
		}
	}
	rc = 0;
out:
	if (ids_path[0])
		unlink(ids_path);
	embd_shard_destroy(s);
	free(pool.ids);
	free(grad);
	free(pooled);
	free(offsets);
	return rc;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: embd-bench kernels [--threads N] [--table-mib M] [--batch B] [--runs R]\n"
		   "                          [--run-ms MS] [--isa scalar|avx2|avx512] [--no-fbgemm]\n"
		   "                          [--config NAME,...]\n"
		   "defaults: all cores, 512 MiB tables, B 2048, 5 runs of 100 ms (medians);\n"
		   "FBGEMM through $EMBD_BENCH_PYTHON (default python3); --config runs only the configs\n"
		   "named, as forward/DIM/P (DIM 64 or 128, P 1, 20 or 100) and backward_OPT/128/20\n"
		   "(OPT sgd, adagrad, rowwise_adagrad or adam); the limits run for every dim named\n");
}

int bench_kernels_run(int argc, char **argv)
{
	struct bench b = { .o = { .threads = (uint32_t)sysconf(_SC_NPROCESSORS_ONLN),
				  .table_bytes = 512ull << 20, .batch = 2048, .runs = 5,
				  .run_ns = 100e6, .fbgemm = true } };
	char err[256];
	int rc = 1;

	b.o.python = getenv("EMBD_BENCH_PYTHON") ? getenv("EMBD_BENCH_PYTHON") : "python3";
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(argv[i], "--no-fbgemm")) {
			b.o.fbgemm = false;
		} else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
			usage(stdout);
			return 0;
		} else if (v && !strcmp(argv[i], "--threads")) {
			b.o.threads = (uint32_t)atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--table-mib")) {
			b.o.table_bytes = strtoull(v, NULL, 10) << 20, i++;
		} else if (v && !strcmp(argv[i], "--batch")) {
			b.o.batch = (uint32_t)atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--runs")) {
			b.o.runs = atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--config")) {
			b.o.configs = v, i++;
		} else if (v && !strcmp(argv[i], "--run-ms")) {
			b.o.run_ns = atof(v) * 1e6, i++;
		} else if (v && !strcmp(argv[i], "--isa")) {
			b.o.isa = !strcmp(v, "scalar") ? EMBD_ISA_SCALAR : !strcmp(v, "avx2") ? EMBD_ISA_AVX2
				: !strcmp(v, "avx512") ? EMBD_ISA_AVX512 : (enum embd_isa)-1;
			i++;
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (!b.o.threads || !b.o.batch || b.o.runs < 1 || b.o.runs > MAX_RUNS || b.o.table_bytes < (1u << 20) ||
	    !embd_kernels_isa_supported(b.o.isa)) {
		fprintf(stderr, "embd-bench kernels: bad option value (threads, batch, runs 1..%d, "
				"table >= 1 MiB, isa this CPU has)\n", MAX_RUNS);
		return 2;
	}
	if (embd_workers_create(b.o.threads, NULL, &b.workers, err, sizeof(err))) {
		fprintf(stderr, "embd-bench kernels: %s\n", err);
		return 1;
	}
	b.exec.workers = b.workers;
	b.exec.isa = b.o.isa;
	if (b.o.fbgemm && !fbgemm_available(&b, err, sizeof(err))) {
		printf("{\"name\":\"fbgemm\",\"available\":false,\"reason\":\"%s\"}\n", err);
		b.o.fbgemm = false;
	}
	if (measure_copy(&b))
		goto out;
	if (bench_dim(&b, 64, false) || bench_dim(&b, 128, true))
		goto out;
	rc = 0;
out:
	embd_workers_destroy(b.workers);
	return rc;
}
