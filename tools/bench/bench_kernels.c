/*
 * embd-bench kernels: the CPU embedding kernels against this machine's memory limits and
 * against FBGEMM (PyTorch's CPU embedding kernels), on the same ids and threads in one run.
 *
 * Every forward shape (D 32/64/128/256, P 1/20/100, fp32 and fp16 rows, unweighted and
 * weighted) is held against the gather limit and every optimizer's backward (fp32, D 64 and
 * 128, P 20) against the read-modify-write limit (bench_limits.c says what they are): runs of
 * the kernel and of its limit alternate on the same pinned workers and batches, and
 * ratio_to_limit is the median over runs of limit time / kernel time (with --repeat N, the
 * median of N such medians, beside their min and max). copy_limit (a parallel memcpy) is
 * context.
 * FBGEMM runs in tools/bench/fbgemm_kernels.py under $EMBD_BENCH_PYTHON (default python3),
 * with FBGEMM and ATen held to AVX2 when the kernels are; when torch does not import, its
 * fields are left out. Every line names the CPU model and the kernels' isa.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <assert.h>
#include <cjson/cJSON.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "bench_limits.h"
#include "kernels/cpu_kernels.h"
#include "kernels/embedding.h"
#include "kernels/workers.h"

#define MAX_RUNS 64
/* ways to read the ids x prefetch distances x with and without the near prefetch into L1 */
#define GATHER_REFS (2 * 2 * 2 * 2)
/* ways a reference may take (paired_once) */
#define MAX_REFS (BENCH_RMW_ORDERS > GATHER_REFS ? BENCH_RMW_ORDERS : GATHER_REFS)
#define MAX_REPEATS 100
#define POOL_IDS_MIN (4u << 20)        /* ids per table: their rows far exceed any cache */
#define BACKWARD_DIM 128                /* the incoming gradient's width: the widest backward */
#define BACKWARD_P 20

#ifndef EMBD_BENCH_SCRIPT_DIR
#define EMBD_BENCH_SCRIPT_DIR "tools/bench"
#endif

struct opts {
	uint32_t threads;
	uint64_t table_bytes;
	uint32_t batch;
	int runs;
	int repeats;                    /* --repeat: paired measurements per line */
	double run_ns;
	enum embd_isa isa;
	bool fbgemm;
	bool cpu_clock;                 /* --clock cpu: process CPU time / threads, not wall time */
	const char *python;
	const char *configs;            /* --config: comma-separated names to run, NULL for all */
};

struct bench {
	struct opts o;
	struct embd_workers *workers;
	struct embd_exec exec;
	enum embd_isa isa;              /* the kernels' (AUTO resolved) */
	char cpu[128];
	cpu_set_t start_cpus;           /* this process's CPUs before worker 0 pinned this thread */
	bool have_start_cpus;
};

static const uint32_t dims[] = { 32, 64, 128, 256 };
static const uint32_t pfs[] = { 1, 20, 100 };
static const char *const opt_names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };

/* Whether the config named name is to run: all without --config, else those listed exactly. */
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

/* Opens a JSON line with the fields every line has. */
static void print_head(const struct bench *b, const char *name)
{
	printf("{\"name\":\"%s\",\"cpu\":\"%s\",\"isa\":\"%s\",\"threads\":%u,\"clock\":\"%s\"", name,
	       b->cpu, embd_kernels_isa_name(b->isa), b->o.threads, b->o.cpu_clock ? "cpu" : "wall");
}

/* ---- timing ------------------------------------------------------------------------------ */

typedef void (*step_fn)(void *arg, uint64_t k);

/*
 * The clock runs are timed with. On a shared machine other processes take the cores for
 * milliseconds at a time; the process's CPU time over its threads leaves those out (but
 * still counts the workers' spinning at the joins), where wall time counts them in full.
 */
static double clock_ns(const struct bench *b)
{
	struct timespec ts;

	if (!b->o.cpu_clock)
		return (double)bench_now_ns();
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return ((double)ts.tv_sec * 1e9 + (double)ts.tv_nsec) / b->o.threads;
}

/* One run: repeats steps from *k on for run_ns; returns ns per step. */
static double run_steps(const struct bench *b, step_fn fn, void *arg, uint64_t *k)
{
	double t0 = clock_ns(b), el;
	uint64_t n = 0;

	do {
		fn(arg, (*k)++);
		n++;
		el = clock_ns(b) - t0;
	} while (el < b->o.run_ns);
	return el / (double)n;
}

/* Median over runs of the time of one step, after a warm-up run. */
static double median_step_ns(const struct bench *b, step_fn fn, void *arg)
{
	double per[MAX_RUNS];
	uint64_t k = 0;

	run_steps(b, fn, arg, &k);
	for (int r = 0; r < b->o.runs; r++)
		per[r] = run_steps(b, fn, arg, &k);
	return bench_median(per, (size_t)b->o.runs);
}

struct paired {
	double ns, ref_ns;              /* medians */
	double ratio;                   /* median over runs of ref time / fn time */
	double ref_spread;              /* (slowest - fastest) / median run of ref */
	/* over --repeat measurements (each as above); ns, ref_ns, ratio and ref_spread are then
	 * their medians */
	double ratio_min, ratio_max;
	double ref_repeat_spread;       /* (slowest - fastest) / median of the repeats' ref_ns */
	int ref_won[MAX_REFS];          /* per reference: the measurements (--repeat) it was the
					 * fastest in */
};

/*
 * Runs of fn and of its reference ref alternate after a warm-up run of each, so that both see
 * the same machine (other processes come and go on a shared host). With several ref_args (ways
 * to do the same work), each run of fn follows a run of each, and the way whose median run is
 * the shortest is the reference (a median each, not the fastest of each round: that minimum of
 * noisy times would read low even where the ways are one).
 */
static struct paired paired_once(const struct bench *b, step_fn fn, void *arg, step_fn ref,
				 void *const *ref_args, int nref)
{
	double a[MAX_RUNS], r[MAX_REFS][MAX_RUNS], q[MAX_RUNS], sorted[MAX_RUNS];
	double med[MAX_REFS];
	uint64_t k = 0, kr[MAX_REFS] = { 0 };
	const int runs = b->o.runs;
	struct paired p = { .ref_won = { 0 } };

	assert(nref >= 1 && nref <= MAX_REFS); /* the callers' own constants */
	for (int j = 0; j < nref; j++)
		run_steps(b, ref, ref_args[j], &kr[j]);
	run_steps(b, fn, arg, &k);
	for (int i = 0; i < runs; i++) {
		for (int j = 0; j < nref; j++)
			r[j][i] = run_steps(b, ref, ref_args[j], &kr[j]);
		a[i] = run_steps(b, fn, arg, &k);
	}
	int use = 0;
	for (int j = 0; j < nref; j++) {
		memcpy(sorted, r[j], (size_t)runs * sizeof(*sorted));
		med[j] = bench_median(sorted, (size_t)runs);
		use = med[j] < med[use] ? j : use;
	}
	double lo = 0, hi = 0;
	for (int i = 0; i < runs; i++) {
		q[i] = r[use][i] / a[i];
		lo = i && lo < r[use][i] ? lo : r[use][i];
		hi = hi > r[use][i] ? hi : r[use][i];
	}
	p.ratio = bench_median(q, (size_t)runs);
	p.ns = bench_median(a, (size_t)runs);
	p.ref_ns = med[use];
	p.ref_spread = (hi - lo) / p.ref_ns;
	p.ratio_min = p.ratio_max = p.ratio;
	p.ref_repeat_spread = 0;
	p.ref_won[use] = 1;
	return p;
}

static double min_of(const double *x, int n)
{
	double m = x[0];

	for (int i = 1; i < n; i++)
		m = x[i] < m ? x[i] : m;
	return m;
}

static double max_of(const double *x, int n)
{
	double m = x[0];

	for (int i = 1; i < n; i++)
		m = x[i] > m ? x[i] : m;
	return m;
}

/*
 * paired_once --repeat times: whether a kernel ever reads above its limit and how stable the
 * limit is from one measurement to the next, in one command (each repeat starts with its own
 * warm-up runs, as a separate invocation would).
 */
static struct paired paired_step_ns(const struct bench *b, step_fn fn, void *arg, step_fn ref,
				    void *const *ref_args, int nref)
{
	double ns[MAX_REPEATS], ref_ns[MAX_REPEATS], ratio[MAX_REPEATS], spread[MAX_REPEATS];
	int won[MAX_REFS] = { 0 };
	int n = b->o.repeats;
	struct paired p;

	if (n <= 1)
		return paired_once(b, fn, arg, ref, ref_args, nref);
	for (int i = 0; i < n; i++) {
		p = paired_once(b, fn, arg, ref, ref_args, nref);
		for (int j = 0; j < nref; j++)
			won[j] += p.ref_won[j];
		ns[i] = p.ns;
		ref_ns[i] = p.ref_ns;
		ratio[i] = p.ratio;
		spread[i] = p.ref_spread;
	}
	p.ratio_min = min_of(ratio, n);
	p.ratio_max = max_of(ratio, n);
	p.ns = bench_median(ns, (size_t)n);
	p.ratio = bench_median(ratio, (size_t)n);
	p.ref_spread = bench_median(spread, (size_t)n);
	p.ref_ns = bench_median(ref_ns, (size_t)n);
	p.ref_repeat_spread = (max_of(ref_ns, n) - min_of(ref_ns, n)) / p.ref_ns;
	memcpy(p.ref_won, won, sizeof(won));
	return p;
}

/* The fields --repeat adds to a line (none without it). */
static void print_repeats(const struct bench *b, const struct paired *p)
{
	if (b->o.repeats <= 1)
		return;
	printf(",\"repeats\":%d,\"ratio_to_limit_min\":%.3f,\"ratio_to_limit_max\":%.3f,"
	       "\"limit_repeat_spread\":%.3f", b->o.repeats, p->ratio_min, p->ratio_max,
	       p->ref_repeat_spread);
}

/* ---- copy: context, not a limit of either kernel ----------------------------------------- */

struct copy_job {
	const uint8_t *src;
	uint8_t *dst;
	uint64_t bytes;
	struct embd_workers *workers;
};

static void copy_worker(void *arg, uint32_t w, uint32_t nw)
{
	const struct copy_job *j = arg;
	uint64_t lo = j->bytes * w / nw & ~63ull, hi = w + 1 == nw ? j->bytes : j->bytes * (w + 1) / nw & ~63ull;
	memcpy(j->dst + lo, j->src + lo, hi - lo);
}

static void copy_step(void *arg, uint64_t k)
{
	struct copy_job *j = arg;
	(void)k;
	embd_workers_run(j->workers, copy_worker, j);
}

static int measure_copy(struct bench *b)
{
	struct copy_job j = { .bytes = 256ull << 20, .workers = b->workers };
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
	double ns = median_step_ns(b, copy_step, &j);
	print_head(b, "copy_limit");
	printf(",\"bytes\":%llu,\"counts\":\"read+write\",\"gbps\":%.2f}\n",
	       (unsigned long long)j.bytes, 2.0 * (double)j.bytes / ns);
	free(src);
	free(dst);
	return 0;
}

/* ---- one table: shard, ids, and the batches every measurement walks ---------------------- */

struct table {
	uint32_t dim;
	bool fp16;
	int64_t rows;
	uint64_t row_bytes;
	struct embd_shard *shard;
	int64_t *ids;                   /* batch k of per_batch ids: ids[(k % nb) * per_batch ...] */
	uint64_t num_ids;
	char ids_path[64];              /* for FBGEMM; "" when not written */
};

static const int64_t *table_batch(const struct table *t, uint64_t per_batch, uint64_t k)
{
	return t->ids + (k % (t->num_ids / per_batch)) * per_batch;
}

static bool write_ids(struct table *t)
{
	snprintf(t->ids_path, sizeof(t->ids_path), "/tmp/embd-bench-ids-XXXXXX");
	int fd = mkstemp(t->ids_path);
	if (fd < 0) {
		t->ids_path[0] = 0;
		return false;
	}
	FILE *f = fdopen(fd, "wb");
	bool ok = f && fwrite(t->ids, sizeof(int64_t), t->num_ids, f) == t->num_ids;
	if (f)
		ok = fclose(f) == 0 && ok;
	if (!ok) {
		unlink(t->ids_path);
		t->ids_path[0] = 0;
	}
	return ok;
}

static void table_destroy(struct table *t)
{
	if (t->ids_path[0])
		unlink(t->ids_path);
	embd_shard_destroy(t->shard);
	free(t->ids);
}

/* A table of table_bytes of random-looking weights and uniformly random ids (xorshift). */
static int table_create(struct bench *b, uint32_t dim, bool fp16, struct table *t)
{
	char err[256];
	uint64_t max_batch_ids = (uint64_t)b->o.batch * pfs[2];

	memset(t, 0, sizeof(*t));
	t->dim = dim;
	t->fp16 = fp16;
	t->row_bytes = (uint64_t)dim * (fp16 ? 2 : 4);
	t->rows = (int64_t)(b->o.table_bytes / t->row_bytes);
	struct embd_shard_desc d = {
		.num_embeddings = t->rows, .embedding_dim = dim,
		.dtype = fp16 ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32, .rows = t->rows, .cols = dim,
		.optimizer = { .type = EMBD_OPT_SGD, .lr = 0.01f, .eps = 1e-8f, .beta1 = 0.9f,
			       .beta2 = 0.999f },
	};
	t->num_ids = POOL_IDS_MIN > 8 * max_batch_ids ? POOL_IDS_MIN : 8 * max_batch_ids;
	t->num_ids -= t->num_ids % max_batch_ids; /* whole batches at P = 100, and so at 20 and 1 */
	t->ids = malloc(t->num_ids * sizeof(int64_t));
	if (!t->ids || embd_shard_create(&d, &t->shard, err, sizeof(err))) {
		fprintf(stderr, "embd-bench kernels: table D %u: %s\n", dim, t->ids ? err : "out of memory");
		return 1;
	}
	embd_shard_init_weights(t->shard, 1, &b->exec);
	uint64_t x = 0x1234567 + dim;
	for (uint64_t i = 0; i < t->num_ids; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		t->ids[i] = (int64_t)(x % (uint64_t)t->rows);
	}
	if (b->o.fbgemm && !write_ids(t))
		fprintf(stderr, "embd-bench kernels: cannot write the ids file for FBGEMM\n");
	return 0;
}

/* ---- the kernels' steps and their limits' --------------------------------------------------- */

struct kernel_arg {
	struct bench *b;
	const struct table *t;
	struct embd_shard *shard;
	uint32_t P;
	const int64_t *offsets;
	const float *weights;           /* per id of a batch, or NULL */
	float *pooled;
	const float *grad;
	int rc;
	struct embd_kernel_err err;
};

static struct embd_bag_batch kernel_batch(struct kernel_arg *a, uint64_t k)
{
	uint64_t per_batch = (uint64_t)a->b->o.batch * a->P;
	struct embd_bag_batch bt = {
		.shard = a->shard, .batch_size = a->b->o.batch, .offsets = a->offsets,
		.ids = table_batch(a->t, per_batch, k), .weights = a->weights, .num_ids = per_batch,
		.pooling = EMBD_POOLING_SUM, .pooled = a->pooled, .pooled_grad = a->grad,
		.pooled_stride = a->t->dim,
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

struct gather_arg {
	struct bench *b;
	const struct table *t;
	uint64_t per_batch;
	struct bench_gather g;
};

static void gather_step(void *arg, uint64_t k)
{
	struct gather_arg *ga = arg;
	ga->g.ids = table_batch(ga->t, ga->per_batch, k);
	bench_gather_run(ga->b->workers, &ga->g);
}

/* What an exact update of each batch touches: its distinct rows, ascending, and each one's
 * occurrences' bags (bench_rmw_rows_make), batch k's at rows + start[k], first + start[k] + k
 * and bags + k * per_batch. */
struct unique_rows {
	uint64_t *rows, *first;
	uint32_t *bags;
	uint64_t *start;                /* nb + 1 */
	uint64_t nb, per_batch;
};

static void unique_rows_free(struct unique_rows *u)
{
	free(u->rows);
	free(u->first);
	free(u->bags);
	free(u->start);
}

static int unique_rows_make(const struct table *t, uint64_t per_batch, struct unique_rows *u)
{
	uint64_t *scratch = malloc(2 * per_batch * sizeof(*scratch));

	u->nb = t->num_ids / per_batch;
	u->per_batch = per_batch;
	u->rows = malloc(t->num_ids * sizeof(*u->rows));
	u->first = malloc((t->num_ids + u->nb) * sizeof(*u->first));
	u->bags = malloc(t->num_ids * sizeof(*u->bags));
	u->start = malloc((u->nb + 1) * sizeof(*u->start));
	if (!scratch || !u->rows || !u->first || !u->bags || !u->start) {
		free(scratch);
		return 1;
	}
	u->start[0] = 0;
	for (uint64_t k = 0; k < u->nb; k++)
		u->start[k + 1] = u->start[k] +
				  bench_rmw_rows_make(t->ids + k * per_batch, per_batch, BACKWARD_P, scratch,
						      u->rows + u->start[k], u->first + u->start[k] + k,
						      u->bags + k * per_batch);
	free(scratch);
	return 0;
}

struct rmw_arg {
	struct bench *b;
	const struct unique_rows *u;
	struct bench_rmw r;
};

static void rmw_step(void *arg, uint64_t k)
{
	struct rmw_arg *ra = arg;
	const struct unique_rows *u = ra->u;
	uint64_t i = k % u->nb;
	ra->r.rows = u->rows + u->start[i];
	ra->r.first = u->first + u->start[i] + i;
	ra->r.bags = u->bags + i * u->per_batch;
	ra->r.n = u->start[i + 1] - u->start[i];
	bench_rmw_run(ra->b->workers, &ra->r);
}

static const char *const rmw_order_names[BENCH_RMW_ORDERS] = {
	[BENCH_RMW_PREFETCH_FIRST] = "prefetch_first",
	[BENCH_RMW_GRAD_FIRST] = "grad_first",
	[BENCH_RMW_GRAD_FIRST_UNROLLED] = "grad_first_unrolled",
};

/* ---- FBGEMM ------------------------------------------------------------------------------ */

/* FBGEMM's results for one config; ns 0 when it did not run. */
struct theirs {
	double ns, tbe_ns;
	int cpus;                       /* the CPUs FBGEMM's process was allowed */
	char op[160], tbe_op[160], isa[64];
};

static void parse_theirs(const char *line, struct theirs *th)
{
	cJSON *j = cJSON_Parse(line);
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "ns_per_batch");
	const cJSON *tv = cJSON_GetObjectItemCaseSensitive(j, "tbe_ns_per_batch");
	const cJSON *op = cJSON_GetObjectItemCaseSensitive(j, "op");
	const cJSON *top = cJSON_GetObjectItemCaseSensitive(j, "tbe_op");
	const cJSON *isa = cJSON_GetObjectItemCaseSensitive(j, "isa");
	const cJSON *cpus = cJSON_GetObjectItemCaseSensitive(j, "cpus");

	if (cJSON_IsNumber(v) && v->valuedouble > 0)
		th->ns = v->valuedouble;
	if (cJSON_IsNumber(tv) && tv->valuedouble > 0)
		th->tbe_ns = tv->valuedouble;
	snprintf(th->op, sizeof(th->op), "%s", cJSON_IsString(op) ? op->valuestring : "?");
	snprintf(th->tbe_op, sizeof(th->tbe_op), "%s", cJSON_IsString(top) ? top->valuestring : "?");
	snprintf(th->isa, sizeof(th->isa), "%s", cJSON_IsString(isa) ? isa->valuestring : "?");
	th->cpus = cJSON_IsNumber(cpus) ? cpus->valueint : 0;
	cJSON_Delete(j);
}

/*
 * Runs the python side for n configs of table t (mode, optimizer, "P" or "Pw" per config in
 * what) and fills th[0, n) in order. On an AVX2 run FBGEMM and ATen are held to AVX2 too.
 */
static void fbgemm_time(const struct bench *b, const struct table *t, const char *mode,
			const char *optimizer, const char *what, struct theirs *th, int n)
{
	char cmd[1536], line[4096];
	const char *script = getenv("EMBD_BENCH_FBGEMM_SCRIPT");

	memset(th, 0, (size_t)n * sizeof(*th));
	if (!t->ids_path[0])
		return;
	snprintf(cmd, sizeof(cmd),
		 "%s'%s' '%s' --ids '%s' --rows %lld --dim %u --dtype %s --configs %s --batch %u "
		 "--threads %u --mode %s --optimizer %s --runs %d --run-seconds %.3f --clock %s 2>/dev/null",
		 b->isa == EMBD_ISA_AVX2 ? "FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 " : "",
		 b->o.python, script ? script : EMBD_BENCH_SCRIPT_DIR "/fbgemm_kernels.py", t->ids_path,
		 (long long)t->rows, t->dim, t->fp16 ? "fp16" : "fp32", what, b->o.batch, b->o.threads,
		 mode, optimizer, b->o.runs, b->o.run_ns / 1e9, b->o.cpu_clock ? "cpu" : "wall");
	/* FBGEMM's threads may use every CPU this benchmark may, not just the one worker 0 (this
	 * thread) is pinned to: the child inherits this thread's affinity at the fork */
	cpu_set_t pinned;
	bool unpin = b->have_start_cpus &&
		     !pthread_getaffinity_np(pthread_self(), sizeof(pinned), &pinned);
	if (unpin)
		pthread_setaffinity_np(pthread_self(), sizeof(b->start_cpus), &b->start_cpus);
	FILE *f = popen(cmd, "r");
	if (unpin)
		pthread_setaffinity_np(pthread_self(), sizeof(pinned), &pinned);
	if (!f)
		return;
	for (int i = 0; i < n && fgets(line, sizeof(line), f); i++)
		parse_theirs(line, &th[i]);
	if (pclose(f) != 0)
		memset(th, 0, (size_t)n * sizeof(*th));
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

/*
 * FBGEMM ran in another process after ours: ours is measured again right after it and each
 * vs_ uses the mean of both medians, so a load that comes or goes on a shared machine between
 * the two sides does not decide the ratio alone.
 */
static void print_theirs(const struct bench *b, step_fn fn, void *arg, double ours_ns,
			 const struct theirs *th)
{
	if (th->ns <= 0)
		return;
	double after = median_step_ns(b, fn, arg), ours = 0.5 * (ours_ns + after);
	printf(",\"ns_per_batch_after_fbgemm\":%.0f,\"fbgemm_ns_per_batch\":%.0f,\"vs_fbgemm\":%.3f,"
	       "\"fbgemm_op\":\"%s\",\"fbgemm_isa\":\"%s\",\"fbgemm_cpus\":%d", after, th->ns, th->ns / ours,
	       th->op, th->isa, th->cpus);
	if (th->tbe_ns > 0)
		printf(",\"tbe_ns_per_batch\":%.0f,\"vs_tbe\":%.3f,\"tbe_op\":\"%s\"", th->tbe_ns,
		       th->tbe_ns / ours, th->tbe_op);
}

/* ---- forward ----------------------------------------------------------------------------- */

/* How the gather limit read the ids, by bench_gather.windowed: the line's limit_ids */
static const char *const gather_way_names[2] = { "batch", "window" };
_Static_assert(sizeof(gather_way_names) / sizeof(gather_way_names[0]) * 2 * 2 * 2 == GATHER_REFS,
	       "each way at the kernel's distance and the other one, near prefetch or not, in "
	       "line order or not");
_Static_assert(EMBD_PREFETCH_IDS != EMBD_PREFETCH_IDS_FAR,
	       "the limit's two distances (bench_gather_other_prefetch_ids) differ");

#define FWD_CONFIGS 6                   /* pfs x {unweighted, weighted} */

static void set_offsets(int64_t *offsets, uint32_t batch, uint32_t P)
{
	for (uint32_t i = 0; i <= batch; i++)
		offsets[i] = (int64_t)i * P;
}

static void forward_name(const struct table *t, uint32_t P, bool weighted, char *name, size_t len)
{
	snprintf(name, len, "forward%s%s/%u/%u", t->fp16 ? "_fp16" : "", weighted ? "_weighted" : "",
		 t->dim, P);
}

/* One of a forward line's limit ways: how it reads the ids (bench_gather.windowed), which of
 * the two distances it prefetches at, whether with the near prefetch and in line order. */
struct limit_way {
	int windowed, dist, near, in_order;
};

/* Way r of a line whose limit has ways x ndist x nears x orders of them (every count at least
 * 1): r = ((in_order * nears + near) * ndist + dist) * ways + windowed. */
static struct limit_way limit_way_of(int r, int ways, int ndist, int nears)
{
	return (struct limit_way){ .windowed = r % ways,
				   .dist = r / ways % ndist,
				   .near = r / (ways * ndist) % nears,
				   .in_order = r / (ways * ndist * nears) };
}

/* The forward configs of table t: gather limit and ours, then FBGEMM for all, then lines. */
static int bench_forward(struct bench *b, const struct table *t, int64_t *offsets,
			 const float *weights, float *pooled)
{
	struct paired res[FWD_CONFIGS];
	struct theirs th[FWD_CONFIGS];
	int idx[FWD_CONFIGS], ways[FWD_CONFIGS], nears[FWD_CONFIGS], orders[FWD_CONFIGS], n = 0;
	char name[64], what[64] = "";
	/* the limit's distances: the kernel's and the other one */
	const uint32_t elem = t->fp16 ? 2 : 4;
	const uint32_t dists[2] = { embd_forward_prefetch_distance(t->row_bytes, elem),
				    bench_gather_other_prefetch_ids(t->row_bytes, elem) };
	const int ndist = 2;

	for (int c = 0; c < FWD_CONFIGS; c++) {
		uint32_t P = pfs[c % 3];
		bool weighted = c >= 3;
		forward_name(t, P, weighted, name, sizeof(name));
		if (!config_selected(&b->o, name))
			continue;
		struct kernel_arg a = { .b = b, .t = t, .shard = t->shard, .P = P, .offsets = offsets,
					.weights = weighted ? weights : NULL, .pooled = pooled };
		struct gather_arg g = { b, t, (uint64_t)b->o.batch * P,
					{ .table = t->shard->weights, .row_bytes = t->row_bytes,
					  .pass_bytes = (uint64_t)embd_forward_pass_cols(b->isa, t->dim,
											 t->fp16 ? 2 : 4) *
							(t->fp16 ? 2 : 4),
					  .out = (uint8_t *)pooled, .out_row_bytes = (uint64_t)t->dim * 4,
					  .ids_per_out = P, .isa = b->isa,
					  .n = (uint64_t)b->o.batch * P } };
		/* the limit's ways (bench_gather.windowed, where the kernel has a window) at each
		 * distance, with the near prefetch or without (where the kernel has one), in line
		 * order or not (where that walk has both): refs[r], limit_way_of(r) */
		struct gather_arg gr[GATHER_REFS];
		void *refs[GATHER_REFS];
		ways[n] = bench_gather_ways(&g.g);
		nears[n] = bench_gather_near_ways(&g.g);
		orders[n] = bench_gather_order_ways(&g.g);
		const int nrefs = orders[n] * nears[n] * ndist * ways[n];
		for (int r = 0; r < nrefs; r++) {
			const struct limit_way lw = limit_way_of(r, ways[n], ndist, nears[n]);
			gr[r] = g;
			gr[r].g.windowed = lw.windowed;
			gr[r].g.prefetch_ids = dists[lw.dist];
			gr[r].g.prefetch_near = lw.near;
			gr[r].g.in_line_order = lw.in_order;
			refs[r] = &gr[r];
		}
		set_offsets(offsets, b->o.batch, P);
		res[n] = paired_step_ns(b, forward_step, &a, gather_step, refs, nrefs);
		if (a.rc) {
			fprintf(stderr, "embd-bench kernels: forward failed: %s\n", a.err.msg);
			return 1;
		}
		snprintf(what + strlen(what), sizeof(what) - strlen(what), "%s%u%s", n ? "," : "", P,
			 weighted ? "w" : "");
		idx[n++] = c;
	}
	if (!n)
		return 0;
	if (b->o.fbgemm)
		fbgemm_time(b, t, "forward", "sgd", what, th, n);
	else
		memset(th, 0, sizeof(th));
	for (int i = 0; i < n; i++) {
		uint32_t P = pfs[idx[i] % 3];
		bool weighted = idx[i] >= 3;
		double bytes = (double)b->o.batch * P * (double)t->row_bytes;
		struct kernel_arg a = { .b = b, .t = t, .shard = t->shard, .P = P, .offsets = offsets,
					.weights = weighted ? weights : NULL, .pooled = pooled };
		set_offsets(offsets, b->o.batch, P);
		forward_name(t, P, weighted, name, sizeof(name));
		print_head(b, "forward");
		printf(",\"config\":\"%s\",\"dim\":%u,\"dtype\":\"%s\",\"weighted\":%s,\"pooling_factor\":%u,"
		       "\"batch\":%u,\"table_bytes\":%llu,\"ns_per_batch\":%.0f,\"gbps\":%.2f,"
		       "\"limit\":\"gather\",\"limit_gbps\":%.2f,\"limit_spread\":%.3f,\"ratio_to_limit\":%.3f",
		       name, t->dim, t->fp16 ? "fp16" : "fp32", weighted ? "true" : "false", P, b->o.batch,
		       (unsigned long long)b->o.table_bytes, res[i].ns, bytes / res[i].ns,
		       bytes / res[i].ref_ns, res[i].ref_spread, res[i].ratio);
		/* the way and the distance that were the fastest in the most measurements */
		int won_way[2] = { 0 }, won_dist[2] = { 0 }, won_near[2] = { 0 };
		int won_order[2] = { 0 };
		for (int j = 0; j < orders[i] * nears[i] * ndist * ways[i]; j++) {
			const struct limit_way lw = limit_way_of(j, ways[i], ndist, nears[i]);
			won_way[lw.windowed] += res[i].ref_won[j];
			won_dist[lw.dist] += res[i].ref_won[j];
			won_near[lw.near] += res[i].ref_won[j];
			won_order[lw.in_order] += res[i].ref_won[j];
		}
		if (ways[i] > 1)
			printf(",\"limit_ids\":\"%s\"",
			       gather_way_names[won_way[1] > won_way[0]]);
		printf(",\"prefetch_ids\":%u,\"limit_prefetch_ids\":%u", dists[0],
		       dists[won_dist[1] > won_dist[0]]);
		if (nears[i] > 1)
			printf(",\"limit_near_l1\":%s", won_near[1] > won_near[0] ? "true" : "false");
		if (orders[i] > 1)
			printf(",\"limit_in_order\":%s",
			       won_order[1] > won_order[0] ? "true" : "false");
		print_repeats(b, &res[i]);
		if (ways[i] > 1 && b->o.repeats > 1)
			printf(",\"limit_ids_won\":{\"%s\":%d,\"%s\":%d}", gather_way_names[0],
			       won_way[0], gather_way_names[1], won_way[1]);
		if (b->o.repeats > 1)
			printf(",\"limit_prefetch_ids_won\":{\"%u\":%d,\"%u\":%d}", dists[0],
			       won_dist[0], dists[1], won_dist[1]);
		if (nears[i] > 1 && b->o.repeats > 1)
			printf(",\"limit_near_l1_won\":{\"false\":%d,\"true\":%d}", won_near[0],
			       won_near[1]);
		if (orders[i] > 1 && b->o.repeats > 1)
			printf(",\"limit_in_order_won\":{\"false\":%d,\"true\":%d}", won_order[0],
			       won_order[1]);
		print_theirs(b, forward_step, &a, res[i].ns, &th[i]);
		printf("}\n");
		fflush(stdout);
	}
	return 0;
}

/* ---- backward ---------------------------------------------------------------------------- */

/* Where one backward step's time goes, per batch (per shard's call: the phases' times over the
 * applies), from a run of fn with the kernel's phase times on. */
static void print_phases(struct bench *b, step_fn fn, void *arg)
{
	struct embd_backward_times tm = { 0 };
	uint64_t k = 0;

	b->exec.backward_times = &tm;
	run_steps(b, fn, arg, &k);
	b->exec.backward_times = NULL;
	double c = (double)(tm.calls ? tm.calls : 1);
	printf(",\"phases_ns\":{\"setup\":%.0f,\"collect\":%.0f,\"scatter\":%.0f,\"sort\":%.0f,"
	       "\"apply\":%.0f}", (double)tm.setup_ns / c, (double)tm.collect_ns / c,
	       (double)tm.scatter_ns / c, (double)tm.sort_ns / c, (double)tm.apply_ns / c);
}

/*
 * One optimizer's backward on a shard over the memory of `mem` (a shard with room for every
 * selected optimizer's state, allocated like the weights): the table's weights copied in, the
 * state zeroed. With a shard allocated and freed for every line, 0.5-1.5 GiB was unmapped and
 * faulted in again just before each line, and the lines after it read their limit up to 2x
 * slow (docs/benchmarks.md); one allocation for all the lines of a table churns memory only
 * before the first.
 */
static int bench_backward_opt(struct bench *b, const struct table *t, int opt,
			      const struct unique_rows *u, struct kernel_arg *proto,
			      const struct embd_shard *mem)
{
	struct embd_shard_desc od = t->shard->desc;
	struct embd_shard *os = NULL;
	uint64_t wb, m1b, m2b;
	char err[256], name[64];

	od.optimizer.type = (enum embd_optimizer_type)opt;
	if (embd_shard_sizes(&od, &wb, &m1b, &m2b, err, sizeof(err)) ||
	    embd_shard_create_in(&od, mem->weights, m1b ? mem->momentum1 : NULL,
				 m2b ? mem->momentum2 : NULL, &os, err, sizeof(err))) {
		fprintf(stderr, "embd-bench kernels: %s state: %s\n", opt_names[opt], err);
		return 1;
	}
	memcpy(os->weights, t->shard->weights, wb);
	if (m1b)
		memset(os->momentum1, 0, m1b);
	if (m2b)
		memset(os->momentum2, 0, m2b);
	struct kernel_arg a = *proto;
	a.shard = os;
	/* the limit in each of its orders (bench_limits.c), the fastest one's */
	struct rmw_arg ra[BENCH_RMW_ORDERS];
	void *refs[BENCH_RMW_ORDERS];
	uint64_t state_row = (m1b + m2b) / (uint64_t)t->rows;
	void *arrays[3] = { os->weights, os->momentum1, os->momentum2 };
	uint64_t sizes[3] = { wb, m1b, m2b };
	for (int j = 0; j < BENCH_RMW_ORDERS; j++) {
		memset(&ra[j], 0, sizeof(ra[j]));
		ra[j].b = b;
		ra[j].u = u;
		ra[j].r.isa = b->isa;
		ra[j].r.grad = (const uint8_t *)a.grad;
		ra[j].r.grad_row_bytes = (uint64_t)t->dim * 4;
		ra[j].r.order = (enum bench_rmw_order)j;
		refs[j] = &ra[j];
		for (int i = 0; i < 3; i++)
			if (sizes[i]) {
				ra[j].r.arrays[ra[j].r.num_arrays] = arrays[i];
				ra[j].r.row_bytes[ra[j].r.num_arrays++] = sizes[i] / (uint64_t)t->rows;
			}
	}
	struct paired p = paired_step_ns(b, backward_step, &a, rmw_step, refs, BENCH_RMW_ORDERS);
	int order = 0;                  /* the order fastest in most measurements */
	for (int j = 0; j < BENCH_RMW_ORDERS; j++)
		order = p.ref_won[j] > p.ref_won[order] ? j : order;
	/* the weights alone, in that order */
	int nstate = ra[order].r.num_arrays;
	ra[order].r.num_arrays = 1;
	double weights_only_ns = median_step_ns(b, rmw_step, &ra[order]);
	ra[order].r.num_arrays = nstate;
	if (a.rc) {
		fprintf(stderr, "embd-bench kernels: backward failed: %s\n", a.err.msg);
		embd_shard_destroy(os);
		return 1;
	}
	double unique = (double)u->start[u->nb] / (double)u->nb;
	double bytes = unique * 2.0 * ((double)t->row_bytes + (double)state_row);
	struct theirs th;
	if (b->o.fbgemm)
		fbgemm_time(b, t, "backward", opt_names[opt], "20", &th, 1);
	else
		memset(&th, 0, sizeof(th));
	snprintf(name, sizeof(name), "backward_%s", opt_names[opt]);
	print_head(b, name);
	printf(",\"config\":\"%s/%u/%u\",\"dim\":%u,\"dtype\":\"fp32\",\"pooling_factor\":%u,"
	       "\"batch\":%u,\"table_bytes\":%llu,\"state_bytes\":%llu,\"unique_rows_per_batch\":%.0f,"
	       "\"ns_per_batch\":%.0f,\"gbps\":%.2f,\"limit\":\"read_modify_write\",\"limit_gbps\":%.2f,"
	       "\"limit_spread\":%.3f,\"ratio_to_limit\":%.3f,\"limit_ns\":%.0f,"
	       "\"limit_weights_only_ns\":%.0f,\"limit_order\":\"%s\"", name, t->dim, BACKWARD_P,
	       t->dim, BACKWARD_P, b->o.batch, (unsigned long long)wb,
	       (unsigned long long)(m1b + m2b), unique, p.ns, bytes / p.ns, bytes / p.ref_ns,
	       p.ref_spread, p.ratio, p.ref_ns, weights_only_ns, rmw_order_names[order]);
	print_repeats(b, &p);
	if (b->o.repeats > 1) {
		printf(",\"limit_order_won\":{");
		for (int j = 0; j < BENCH_RMW_ORDERS; j++)
			printf("%s\"%s\":%d", j ? "," : "", rmw_order_names[j], p.ref_won[j]);
		printf("}");
	}
	print_phases(b, backward_step, &a);
	print_theirs(b, backward_step, &a, p.ns, &th);
	printf("}\n");
	fflush(stdout);
	embd_shard_destroy(os);
	return 0;
}

/* A table's two column halves, each a shard of its own over all the rows, as column_wise
 * places them: stepped by a backward each, or from one prepare applied to both. */
struct halves_arg {
	struct kernel_arg a;
	struct embd_shard *half[2];
};

static struct embd_bag_batch half_batch(struct halves_arg *h, int i, uint64_t k)
{
	struct embd_bag_batch bt = kernel_batch(&h->a, k);

	bt.shard = h->half[i];
	bt.pooled_col = (uint32_t)i * h->half[0]->desc.cols;
	return bt;
}

static void halves_per_shard_step(void *arg, uint64_t k)
{
	struct halves_arg *h = arg;

	for (int i = 0; i < 2; i++) {
		struct embd_bag_batch bt = half_batch(h, i, k);
		int rc = embd_kernels_backward(&h->a.b->exec, h->half[i], &bt, 1, &h->a.err);
		if (rc)
			h->a.rc = rc;
	}
}

static void halves_shared_step(void *arg, uint64_t k)
{
	struct halves_arg *h = arg;
	struct embd_bag_batch bt[2] = { half_batch(h, 0, k), half_batch(h, 1, k) };
	struct embd_backward_prep *prep;
	int rc = embd_kernels_backward_prepare(&h->a.b->exec, h->half[0], &bt[0], 1, &prep,
					       &h->a.err);

	for (int i = 0; !rc && i < 2; i++)
		rc = embd_kernels_backward_apply(&h->a.b->exec, h->half[i], prep, &bt[i], 1, &h->a.err);
	embd_backward_prep_free(prep);
	if (rc)
		h->a.rc = rc;
}

/* backward_column_halves_sgd/D/20: the shared prepare against a backward per half, paired
 * (fp32 D up to BACKWARD_DIM, the gradient's width). */
static int bench_column_halves(struct bench *b, const struct table *t, int64_t *offsets,
			       const float *grad)
{
	struct halves_arg h = { .a = { .b = b, .t = t, .P = BACKWARD_P, .offsets = offsets,
				       .grad = grad } };
	char err[256], name[64];
	int rc = 0;

	snprintf(name, sizeof(name), "backward_column_halves_sgd/%u/%u", t->dim, BACKWARD_P);
	if (t->fp16 || t->dim > BACKWARD_DIM || !config_selected(&b->o, name))
		return 0;
	set_offsets(offsets, b->o.batch, BACKWARD_P);

	for (int i = 0; i < 2 && !rc; i++) {
		struct embd_shard_desc d = t->shard->desc;
		d.col_offset = (uint32_t)i * (t->dim / 2);
		d.cols = t->dim / 2;
		if (embd_shard_create(&d, &h.half[i], err, sizeof(err))) {
			fprintf(stderr, "embd-bench kernels: column half: %s\n", err);
			rc = 1;
			break;
		}
		embd_shard_init_weights(h.half[i], 1, &b->exec);
	}
	if (!rc) {
		struct paired p = paired_step_ns(b, halves_shared_step, &h, halves_per_shard_step,
					  (void *[]){ &h }, 1);
		if (h.a.rc) {
			fprintf(stderr, "embd-bench kernels: backward failed: %s\n", h.a.err.msg);
			rc = 1;
		} else {
			print_head(b, "backward_column_halves_sgd");
			printf(",\"config\":\"backward_column_halves_sgd/%u/%u\",\"dim\":%u,"
			       "\"shard_cols\":%u,\"batch\":%u,\"ns_per_batch\":%.0f,"
			       "\"per_shard_ns_per_batch\":%.0f,\"speedup\":%.3f",
			       t->dim, BACKWARD_P, t->dim, t->dim / 2, b->o.batch, p.ns, p.ref_ns,
			       p.ratio);
			print_phases(b, halves_shared_step, &h);
			printf("}\n");
			fflush(stdout);
		}
	}
	for (int i = 0; i < 2; i++)
		embd_shard_destroy(h.half[i]);
	return rc;
}

static int bench_backward(struct bench *b, const struct table *t, int64_t *offsets, const float *grad)
{
	struct unique_rows u = { 0 };
	struct embd_shard *mem = NULL;
	char name[64], err[256];
	int rc = 0;

	for (int opt = EMBD_OPT_SGD; opt <= EMBD_OPT_ADAM && !rc; opt++) {
		snprintf(name, sizeof(name), "backward_%s/%u/%u", opt_names[opt], t->dim, BACKWARD_P);
		if (!config_selected(&b->o, name))
			continue;
		if (!mem) {
			/* room for every selected optimizer's state: adam's holds all the others',
			 * adagrad's rowwise_adagrad's (a row of floats against one float a row) */
			struct embd_shard_desc md = t->shard->desc;
			char oname[64];
			md.optimizer.type = EMBD_OPT_SGD;
			for (int o = EMBD_OPT_SGD; o <= EMBD_OPT_ADAM; o++) {
				snprintf(oname, sizeof(oname), "backward_%s/%u/%u", opt_names[o], t->dim,
					 BACKWARD_P);
				if (config_selected(&b->o, oname) &&
				    (o == EMBD_OPT_ADAM || md.optimizer.type != EMBD_OPT_ADAGRAD))
					md.optimizer.type = (enum embd_optimizer_type)o;
			}
			if (embd_shard_create(&md, &mem, err, sizeof(err))) {
				fprintf(stderr, "embd-bench kernels: backward memory: %s\n", err);
				rc = 1;
				break;
			}
		}
		if (!u.rows && unique_rows_make(t, (uint64_t)b->o.batch * BACKWARD_P, &u)) {
			fprintf(stderr, "embd-bench kernels: out of memory for the unique rows\n");
			rc = 1;
			break;
		}
		struct kernel_arg proto = { .b = b, .t = t, .P = BACKWARD_P, .offsets = offsets,
					    .grad = grad };
		set_offsets(offsets, b->o.batch, BACKWARD_P);
		rc = bench_backward_opt(b, t, opt, &u, &proto, mem);
	}
	unique_rows_free(&u);
	embd_shard_destroy(mem);
	return rc;
}

/* ---- driver ------------------------------------------------------------------------------ */

/* fp32 widths with backward lines: D 128 as FBGEMM's benchmarks, D 64 as embd-bench train. */
static bool backward_dim(uint32_t dim)
{
	return dim == 64 || dim == BACKWARD_DIM;
}

/* Whether any config of the table (dim, fp16) is selected. */
static bool table_selected(const struct bench *b, uint32_t dim, bool fp16)
{
	struct table t = { .dim = dim, .fp16 = fp16 };
	char name[64];

	for (int c = 0; c < FWD_CONFIGS; c++) {
		forward_name(&t, pfs[c % 3], c >= 3, name, sizeof(name));
		if (config_selected(&b->o, name))
			return true;
	}
	for (int opt = EMBD_OPT_SGD; !fp16 && backward_dim(dim) && opt <= EMBD_OPT_ADAM; opt++) {
		snprintf(name, sizeof(name), "backward_%s/%u/%u", opt_names[opt], dim, BACKWARD_P);
		if (config_selected(&b->o, name))
			return true;
	}
	snprintf(name, sizeof(name), "backward_column_halves_sgd/%u/%u", dim, BACKWARD_P);
	if (!fp16 && dim <= BACKWARD_DIM && config_selected(&b->o, name))
		return true;
	return false;
}

static int bench_tables(struct bench *b)
{
	uint64_t max_ids = (uint64_t)b->o.batch * pfs[2];
	int64_t *offsets = malloc(((uint64_t)b->o.batch + 1) * sizeof(int64_t));
	float *weights = malloc(max_ids * sizeof(float));
	float *pooled = malloc((uint64_t)b->o.batch * dims[3] * sizeof(float));
	float *grad = malloc((uint64_t)b->o.batch * BACKWARD_DIM * sizeof(float));
	int rc = 1;

	if (!offsets || !weights || !pooled || !grad) {
		fprintf(stderr, "embd-bench kernels: out of memory\n");
		goto out;
	}
	for (uint64_t i = 0; i < max_ids; i++)
		weights[i] = 0.5f + (float)(i % 7) / 8.0f; /* as fbgemm_kernels.py weights() */
	for (uint64_t i = 0; i < (uint64_t)b->o.batch * BACKWARD_DIM; i++)
		grad[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
	for (int h = 0; h < 2; h++)
		for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++) {
			struct table t;
			if (!table_selected(b, dims[d], h))
				continue;
			int bad = table_create(b, dims[d], h, &t) ||
				  bench_forward(b, &t, offsets, weights, pooled) ||
				  (!h && backward_dim(dims[d]) && bench_backward(b, &t, offsets, grad)) ||
				  bench_column_halves(b, &t, offsets, grad);
			table_destroy(&t);
			if (bad)
				goto out;
		}
	rc = 0;
out:
	free(grad);
	free(pooled);
	free(weights);
	free(offsets);
	return rc;
}

/* Workers pinned one per CPU this process may run on (cycling when there are fewer). */
static int create_workers(struct bench *b, char *err, size_t len)
{
	cpu_set_t set;
	int cpus[BENCH_LIMIT_MAX_WORKERS], n = 0;

	if (b->o.threads > BENCH_LIMIT_MAX_WORKERS) {
		snprintf(err, len, "at most %d threads", BENCH_LIMIT_MAX_WORKERS);
		return 1;
	}
	if (sched_getaffinity(0, sizeof(set), &set))
		return embd_workers_create(b->o.threads, NULL, &b->workers, err, len);
	b->start_cpus = set;
	b->have_start_cpus = true;
	int allowed[CPU_SETSIZE];
	const int na = (int)bench_allowed_cpus(allowed);
	for (; n < (int)b->o.threads; n++)
		cpus[n] = allowed[n % na];
	return embd_workers_create(b->o.threads, cpus, &b->workers, err, len);
}

static void usage(FILE *f)
{
	fprintf(f, "usage: embd-bench kernels [--threads N] [--table-mib M] [--batch B] [--runs R]\n"
		   "                          [--run-ms MS] [--isa scalar|avx2|avx512] [--no-fbgemm]\n"
		   "                          [--clock wall|cpu] [--repeat N] [--config NAME,...]\n"
		   "defaults: all cores (pinned), 512 MiB tables, B 2048, 7 runs of 100 ms (medians);\n"
		   "workers are pinned to the first CPUs the process may run on: two benchmarks side\n"
		   "by side each need their own CPUs (taskset -c), or they share the first ones.\n"
		   "FBGEMM through $EMBD_BENCH_PYTHON (default python3); --config runs only the configs\n"
		   "named: forward[_fp16][_weighted]/DIM/P (DIM 32, 64, 128 or 256; P 1, 20 or 100) and\n"
		   "backward_OPT/DIM/20 (OPT sgd, adagrad, rowwise_adagrad or adam; DIM 64 or 128).\n"
		   "--isa and $EMBD_ISA pick the kernels' instruction set; FBGEMM is held to AVX2 when\n"
		   "they run AVX2.\n"
		   "--clock cpu times runs by the process's CPU time over the threads (both sides),\n"
		   "which leaves out the time other processes hold the cores on a shared machine.\n"
		   "--repeat N measures each kernel line N times against its limit (each with its\n"
		   "warm-up and runs) and adds the min and max ratio_to_limit and the limit's spread\n"
		   "over the N (limit_repeat_spread) to the line; its other figures are the\n"
		   "medians.\n");
}

static int parse_args(struct bench *b, int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(argv[i], "--no-fbgemm")) {
			b->o.fbgemm = false;
		} else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
			usage(stdout);
			return 0;
		} else if (v && !strcmp(argv[i], "--threads")) {
			b->o.threads = (uint32_t)atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--table-mib")) {
			b->o.table_bytes = strtoull(v, NULL, 10) << 20, i++;
		} else if (v && !strcmp(argv[i], "--batch")) {
			b->o.batch = (uint32_t)atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--runs")) {
			b->o.runs = atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--repeat")) {
			b->o.repeats = atoi(v), i++;
		} else if (v && !strcmp(argv[i], "--config")) {
			b->o.configs = v, i++;
		} else if (v && !strcmp(argv[i], "--run-ms")) {
			b->o.run_ns = atof(v) * 1e6, i++;
		} else if (v && !strcmp(argv[i], "--clock")) {
			b->o.cpu_clock = !strcmp(v, "cpu");
			if (!b->o.cpu_clock && strcmp(v, "wall"))
				b->o.runs = 0; /* refused below */
			i++;
		} else if (v && !strcmp(argv[i], "--isa")) {
			if (embd_kernels_isa_parse(v, &b->o.isa))
				b->o.isa = (enum embd_isa)-1;
			i++;
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (!b->o.threads || !b->o.batch || b->o.runs < 1 || b->o.runs > MAX_RUNS ||
	    b->o.repeats < 1 || b->o.repeats > MAX_REPEATS ||
	    b->o.table_bytes < (1u << 20) || !embd_kernels_isa_supported(b->o.isa)) {
		fprintf(stderr, "embd-bench kernels: bad option value (threads, batch, runs 1..%d, "
				"repeat 1..%d, table >= 1 MiB, isa this CPU has)\n", MAX_RUNS,
			MAX_REPEATS);
		return 2;
	}
	return -1;
}

int bench_kernels_run(int argc, char **argv)
{
	struct bench b = { .o = { .threads = (uint32_t)sysconf(_SC_NPROCESSORS_ONLN),
				  .table_bytes = 512ull << 20, .batch = 2048, .runs = 7, .repeats = 1,
				  .run_ns = 100e6, .fbgemm = true } };
	char err[256];
	int rc;

	b.o.python = getenv("EMBD_BENCH_PYTHON") ? getenv("EMBD_BENCH_PYTHON") : "python3";
	rc = parse_args(&b, argc, argv);
	if (rc >= 0)
		return rc;
	if (create_workers(&b, err, sizeof(err))) {
		fprintf(stderr, "embd-bench kernels: %s\n", err);
		return 1;
	}
	bench_cpu_model(b.cpu, sizeof(b.cpu));
	b.isa = b.o.isa ? b.o.isa : embd_kernels_isa_best();
	b.exec.workers = b.workers;
	b.exec.isa = b.isa;
	if (b.o.fbgemm && !fbgemm_available(&b, err, sizeof(err))) {
		print_head(&b, "fbgemm");
		printf(",\"available\":false,\"reason\":\"%s\"}\n", err);
		b.o.fbgemm = false;
	}
	rc = measure_copy(&b) || bench_tables(&b);
	embd_workers_destroy(b.workers);
	return rc;
}
