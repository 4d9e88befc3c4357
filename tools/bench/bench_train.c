/*
 * embd-bench train: training steps per second of Python trainers through embd against
 * TorchRec's own sharded EmbeddingBagCollection (DistributedModelParallel over gloo, the fused
 * kernel with SGD), same machine, same run, same batches (tools/bench/train_bench.py runs both
 * in the same trainer processes, rounds alternating; this file makes the batches, measures
 * the step's memory limits and prints the lines). Default: the configuration of issue 17,
 * 8 tables x 1M rows x 64, 2 ranks, 2 trainers, B 2048 per trainer, 20 ids per bag.
 *
 * The limit of a step is the memory traffic it cannot avoid, timed with the limits of
 * `embd-bench kernels` (bench_limits.c) over the same ids and run the way the service runs the
 * step: on the sharding type's plan (each rank's pinned threads on its own shards, all ranks at
 * once), every shard's gather of every id's row of the global batch (all trainers) with the
 * pooled rows stored (each way of reading the ids, bench_gather.windowed, where the two differ,
 * at the kernel's prefetch distance and at the other one (bench_gather_other_prefetch_ids),
 * bench_gather.prefetch_ids: the one whose median is the shortest), then every shard's
 * read-modify-write of its distinct rows after each one's occurrences' gradient rows are read
 * (in each of its orders, the one whose median is the shortest, as `embd-bench kernels` takes
 * it). Each step, of the limits or of the kernels, runs its lookup and its update on a batch of
 * its own, the batches cycling as the service's steps cycle them, so that a step finds the rows
 * in the caches as the service's step does: its lookup after three other batches' steps, its
 * update right after its lookup. table_wise and column_wise are modelled; other types' lines
 * carry no limit. The same threads also run the kernels
 * themselves on that plan, called as engine/step.c calls them (kernels_steps_per_s): the
 * service against them (embd_ratio_to_kernels) is what its own work and the trainers' part of
 * the step cost. ratio_to_limit = steps/s / limit_steps_per_s (1: the step is all unavoidable
 * traffic); pipelined_ratio_to_limit the same of the pipelined embd steps
 * (embd_pipelined_steps_per_s). train_bench.py adds the service's step phases
 * (embd_step_phases_ms, `embctl stats`): the step cannot be shorter than its limit plus the
 * trainers' phase, in which the service waits for the gradients, so ratio_to_limit_bound =
 * limit / (limit + trainers) is the most ratio_to_limit these trainers allow.
 * The limits are measured before the trainers start and again after they end, and the faster of
 * the two is the limit: a shared host's speed drifts over the minute the rounds take. Both are
 * printed (limit_steps_per_s_before, _after), so that a ratio above 1 can be told from drift.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bench.h"
#include "bench_limits.h"
#include "kernels/cpu_kernels.h"
#include "kernels/embedding.h"
#include "kernels/workers.h"

#define TRAIN_BATCHES 4                 /* distinct global batches, cycled */
#define TRAIN_SEED 2026

struct train_opts {
	uint32_t tables, dim, batch, ids_per_bag, trainers, ranks, steps, rounds, warmup;
	uint64_t rows;
	char shardings[256];
	const char *python;
	bool limits;
};

struct limits {
	char sharding[32];
	double ms, gather_ms, rmw_ms;   /* per global step, medians; ms 0: not modelled */
	double kernels_forward_ms, kernels_backward_ms; /* the kernels on the same plan */
	/* the backward's phases (embedding.h), a rank's average in a timed step */
	double kernels_setup_ms, kernels_collect_ms, kernels_scatter_ms, kernels_sort_ms,
		kernels_apply_ms;
	double step_bytes;
	double before_ms, after_ms;     /* ms measured before the trainers and after them */
};

#define TRAIN_MAX_SHARDINGS 8

/* ids[k][trainer][feature][B * P]: what the trainers post (the file train_bench.py reads). */
static int64_t *make_ids(const struct train_opts *o, uint64_t *count)
{
	uint64_t n = (uint64_t)TRAIN_BATCHES * o->trainers * o->tables * o->batch * o->ids_per_bag;
	int64_t *ids = malloc(n * sizeof(*ids));
	uint64_t s = TRAIN_SEED;

	for (uint64_t i = 0; ids && i < n; i++)
		ids[i] = (int64_t)(bench_rng_next(&s) % o->rows);
	*count = n;
	return ids;
}

/* The column blocks the job asks the planner for (train_bench.py's min_partition): D / 2. */
static uint32_t min_partition(const struct train_opts *o)
{
	return o->dim / 2 >= 4 ? o->dim / 2 : 4;
}

/*
 * The limits of a step are timed on the plan the service makes for the sharding type: each
 * rank's thread(s), pinned as engine/ranks.c pins them, on its own shards (one array each, as
 * the service's), all ranks at once; steps of the limits, each every table's gather (in one of
 * its ways) then every table's update (in one of its orders, enum bench_rmw_order), and a step
 * of the kernels' forward and backward (measure_limits: each step on a batch of its own), each
 * phase from the first rank's start to the last rank's end (stamped by the
 * ranks: the timing thread itself waits for a CPU while every CPU holds a rank, and read
 * phases 2-3 ms short that way).
 */
/* One shard of the plan: columns [col, col + cols) of a table, on a rank. */
struct limit_piece {
	uint32_t table, rank, col, cols;
	struct embd_shard *shard;
	float *pooled, *grad;
};

/* One global batch of one table: its ids and what its update touches (bench_rmw_rows_make). */
struct limit_batch {
	int64_t *ids;
	uint64_t *rows, *first;
	uint32_t *bags;
	uint64_t n_rows;
};

struct limit_run {
	const struct train_opts *o;
	struct limit_piece *pieces;
	uint32_t num_pieces;
	const struct limit_batch *batches;      /* [k * tables + table] */
	enum embd_isa isa;
	int cpus[CPU_SETSIZE];
	uint32_t num_cpus, threads_per_rank;
	pthread_mutex_t lock;                   /* gate: the ranks wait for the barrier's count */
	pthread_cond_t opened;
	bool open;
	bool no_barrier;                        /* it could not be made: the ranks just clean up */
	pthread_barrier_t barrier;              /* the ranks started and the timing thread */
	uint32_t k;                             /* the batch of this phase */
	int phase;                              /* enum limit_phase */
	bool timed;                             /* a step whose times count (not the warm-up) */
	uint64_t *start_ns, *end_ns;            /* per rank: when it began and ended the phase */
	/* the kernels' own phases, called as the service calls them (engine/step.c) */
	int64_t *offsets;                       /* batch + 1: one trainer's bags of P ids each */
	float **pooled, **grad;                 /* per trainer: its KeyedTensor, B x tables x D */
	bool shared_prep;                       /* column_wise: a table's shards share a prep */
	uint32_t *prep_rank;                    /* per table: the rank that prepares it */
	struct embd_backward_prep **preps;      /* per table: this step's, while it runs */
	atomic_uint_fast64_t checksum;
	atomic_int failed;
	atomic_int kernels_failed;              /* the limits stand, the kernels' figures do not */
	atomic_int windowed_differs;            /* a shard's lookup reads ids through a window */
};

enum limit_phase {
	/* the limits: the lookup each way of bench_gather.windowed at the kernel's distance,
	 * then each at the other distance (gather_windowed, gather_far), and */
	LIMIT_GATHER, LIMIT_GATHER_LAST = LIMIT_GATHER + 3,
	LIMIT_RMW,                              /* the update in each order of */
	LIMIT_RMW_LAST = LIMIT_RMW + BENCH_RMW_ORDERS - 1, /* enum bench_rmw_order, LIMIT_RMW + it */
	KERNEL_FORWARD, KERNEL_PREPARE, KERNEL_BACKWARD, /* the kernels */
	LIMIT_STOP
};

/* Whether gather phase reads the ids through a window (bench_gather.windowed), and whether at
 * the other distance (bench_gather_other_prefetch_ids) rather than the kernel's. */
static bool gather_windowed(int phase)
{
	return (phase - LIMIT_GATHER) % 2;
}

static bool gather_far(int phase)
{
	return phase - LIMIT_GATHER >= 2;
}

struct limit_rank {
	struct limit_run *run;
	uint32_t rank;
	pthread_t thread;
	struct embd_backward_times times; /* its kernels' backward phases in the timed steps */
};

/*
 * The plan's shards (*pieces, *n; to free) for sharding, as the planner places them for this
 * benchmark's tables (equal, so any balanced placement costs the same): table_wise puts table f
 * on rank f % ranks; column_wise cuts each table into blocks of min_partition (D / 2,
 * train_bench.py's constraint: the planner's only choice) and deals the blocks out over the
 * ranks in turn. Returns 1 for what this does not model (other types; rows the gather limit
 * cannot take whole: bench_limits.h wants pooled rows of a multiple of 64 bytes), -1 when out
 * of memory.
 */
static int limit_plan(const struct train_opts *o, const char *sharding,
		      struct limit_piece **pieces, uint32_t *n)
{
	const uint32_t block = min_partition(o);
	const bool columns = !strcmp(sharding, "column_wise");
	const uint32_t per_table = columns ? o->dim / block : 1, cols = columns ? block : o->dim;

	*pieces = NULL;
	*n = 0;
	if ((!columns && strcmp(sharding, "table_wise")) ||
	    (columns && (o->dim % block || per_table < 2)) || (cols * 4) % 64)
		return 1;
	struct limit_piece *p = calloc((size_t)o->tables * per_table, sizeof(*p));
	if (!p)
		return -1;
	/* piece i of the plan on rank i % ranks: table f's one piece is piece f */
	for (uint32_t f = 0; f < o->tables; f++)
		for (uint32_t j = 0; j < per_table; j++, (*n)++)
			p[*n] = (struct limit_piece){ .table = f, .rank = *n % o->ranks,
						      .col = j * cols, .cols = cols };
	*pieces = p;
	return 0;
}

/* A rank's shards: created and first touched by its own pinned threads, as the service's. */
static int limit_rank_setup(struct limit_rank *lr, struct embd_workers *workers)
{
	struct limit_run *run = lr->run;
	const struct train_opts *o = run->o;
	const uint64_t bags = (uint64_t)o->batch * o->trainers;
	struct embd_exec exec = { .workers = workers, .isa = run->isa };
	char err[256];

	for (uint32_t i = 0; i < run->num_pieces; i++) {
		struct limit_piece *p = &run->pieces[i];
		if (p->rank != lr->rank)
			continue;
		struct embd_shard_desc d = {
			.table_id = p->table, .num_embeddings = (int64_t)o->rows,
			.embedding_dim = o->dim, .dtype = EMBD_DTYPE_FP32, .rows = (int64_t)o->rows,
			.col_offset = p->col, .cols = p->cols,
			.optimizer = { .type = EMBD_OPT_SGD, .lr = 0.01f },
		};
		if (embd_shard_create(&d, &p->shard, err, sizeof(err))) {
			fprintf(stderr, "embd-bench train: limits: shard: %s\n", err);
			return -1;
		}
		embd_shard_init_weights(p->shard, TRAIN_SEED, &exec);
		p->pooled = malloc(bags * p->cols * sizeof(float));
		p->grad = malloc(bags * p->cols * sizeof(float));
		if (!p->pooled || !p->grad) {
			fprintf(stderr, "embd-bench train: limits: out of memory for table %u's "
				"pooled rows\n", p->table);
			return -1;
		}
		/* written, not calloc's untouched zero pages: the service's gradient is real memory */
		memset(p->grad, 0, bags * p->cols * sizeof(float));
	}
	return 0;
}

/* Piece p's bag batches of global batch b as the service hands them to the kernels: one per
 * trainer, its pooled rows and gradient columns in that trainer's KeyedTensor. */
static void kernel_batches(const struct limit_run *run, const struct limit_piece *p,
			   const struct limit_batch *b, struct embd_bag_batch *bb)
{
	const struct train_opts *o = run->o;
	const uint64_t mine = (uint64_t)o->batch * o->ids_per_bag;

	for (uint32_t t = 0; t < o->trainers; t++)
		bb[t] = (struct embd_bag_batch){
			.shard = p->shard, .feature = p->table, .batch_size = o->batch,
			.offsets = run->offsets, .ids = b->ids + t * mine, .num_ids = mine,
			.pooling = EMBD_POOLING_SUM, .pooled = run->pooled[t],
			.pooled_grad = run->grad[t], .grad_divisor = o->trainers,
			.pooled_stride = (uint64_t)o->tables * o->dim,
			.pooled_col = p->table * o->dim + p->col,
		};
}

/*
 * A kernel phase on the rank's pieces (bb: room for all of them, trainers batches each): the
 * forward of all its shards' batches in one call, as engine/step.c's lookup makes one; the
 * prepare of the tables this rank prepares; each shard's backward (or apply of its table's
 * prep). Returns 0, or the kernels' error (printed).
 */
static int kernel_phase(struct limit_run *run, uint32_t rank, const struct embd_exec *exec,
			struct embd_bag_batch *bb)
{
	static const char *const names[] = {
		[KERNEL_FORWARD] = "forward", [KERNEL_PREPARE] = "backward prepare",
		[KERNEL_BACKWARD] = "backward",
	};
	const struct train_opts *o = run->o;
	struct embd_kernel_err kerr = { 0 };
	uint32_t n = 0;
	int rc = 0;

	for (uint32_t i = 0; i < run->num_pieces && !rc; i++) {
		const struct limit_piece *p = &run->pieces[i];
		if (p->rank != rank)
			continue;
		struct embd_bag_batch *mine = run->phase == KERNEL_FORWARD ? bb + n : bb;
		kernel_batches(run, p, &run->batches[run->k * o->tables + p->table], mine);
		n += o->trainers;
		if (run->phase == KERNEL_PREPARE && run->shared_prep &&
		    run->prep_rank[p->table] == rank && !run->preps[p->table])
			rc = embd_kernels_backward_prepare(exec, p->shard, mine, o->trainers,
							   &run->preps[p->table], &kerr);
		else if (run->phase == KERNEL_BACKWARD && run->shared_prep)
			rc = embd_kernels_backward_apply(exec, p->shard, run->preps[p->table], mine,
							 o->trainers, &kerr);
		else if (run->phase == KERNEL_BACKWARD)
			rc = embd_kernels_backward(exec, p->shard, mine, o->trainers, &kerr);
	}
	if (run->phase == KERNEL_FORWARD && n && !rc)
		rc = embd_kernels_forward(exec, bb, n, &kerr);
	if (rc)
		fprintf(stderr, "embd-bench train: limits: rank %u's kernels' %s: %s\n", rank,
			names[run->phase], kerr.msg);
	return rc;
}

/* One phase of batch run->k on the rank's shards, in table order. */
static void limit_rank_phase(struct limit_rank *lr, struct embd_workers *workers,
			     struct bench_gather *ga, struct bench_rmw *rm, struct embd_bag_batch *bb)
{
	struct limit_run *run = lr->run;
	const struct train_opts *o = run->o;
	const struct embd_exec exec = { .workers = workers, .isa = run->isa,
					.backward_times = run->timed ? &lr->times : NULL };

	if (run->phase >= KERNEL_FORWARD) {
		if (!atomic_load(&run->kernels_failed) && kernel_phase(run, lr->rank, &exec, bb))
			atomic_store(&run->kernels_failed, 1);
		return;
	}
	for (uint32_t i = 0; i < run->num_pieces; i++) {
		const struct limit_piece *p = &run->pieces[i];
		if (p->rank != lr->rank)
			continue;
		const struct limit_batch *b = &run->batches[run->k * o->tables + p->table];
		const uint64_t rb = (uint64_t)p->cols * 4;
		if (run->phase <= LIMIT_GATHER_LAST) {
			const uint32_t kernel_dist = embd_forward_prefetch_distance(rb, 4);
			const uint32_t other_dist = bench_gather_other_prefetch_ids(rb, 4);
			ga->table = p->shard->weights;
			ga->row_bytes = rb;
			ga->pass_bytes = (uint64_t)embd_forward_pass_cols(run->isa, p->cols, 4) * 4;
			ga->out = (uint8_t *)p->pooled;
			ga->out_row_bytes = rb;
			ga->ids_per_out = o->ids_per_bag;
			ga->isa = run->isa;
			ga->ids = b->ids;
			ga->n = (uint64_t)o->batch * o->trainers * o->ids_per_bag;
			ga->windowed = gather_windowed(run->phase);
			ga->prefetch_ids = gather_far(run->phase) ? other_dist : kernel_dist;
			if (bench_gather_ways(ga) > 1)
				atomic_store(&run->windowed_differs, 1);
			bench_gather_run(workers, ga);
		} else {
			rm->arrays[0] = p->shard->weights;
			rm->row_bytes[0] = rb;
			rm->num_arrays = 1;
			rm->grad = (const uint8_t *)p->grad;
			rm->grad_row_bytes = rb;
			rm->isa = run->isa;
			rm->rows = b->rows;
			rm->first = b->first;
			rm->bags = b->bags;
			rm->n = b->n_rows;
			rm->order = (enum bench_rmw_order)(run->phase - LIMIT_RMW);
			bench_rmw_run(workers, rm);
		}
	}
}

/* A rank: its pinned pool and shards, then phases between the barrier's waits until STOP. */
static void *limit_rank_main(void *arg)
{
	struct limit_rank *lr = arg;
	struct limit_run *run = lr->run;
	int cpus[BENCH_LIMIT_MAX_WORKERS];
	uint32_t n = run->threads_per_rank; /* at most BENCH_LIMIT_MAX_WORKERS: measure_limits */
	struct embd_workers *workers = NULL;
	struct bench_gather *g = calloc(1, sizeof(*g));
	struct embd_bag_batch *bb = calloc((size_t)run->num_pieces * run->o->trainers, sizeof(*bb));
	struct bench_rmw rm = { .zero = 0 };
	char err[256];

	for (uint32_t t = 0; t < n; t++)
		cpus[t] = run->cpus[(lr->rank * run->threads_per_rank + t) % run->num_cpus];
	if (embd_workers_create(n, cpus, &workers, err, sizeof(err))) {
		fprintf(stderr, "embd-bench train: limits: rank %u's workers: %s\n", lr->rank, err);
		atomic_store(&run->failed, 1);
	} else if (!g || !bb || limit_rank_setup(lr, workers)) {
		atomic_store(&run->failed, 1);
	}
	pthread_mutex_lock(&run->lock);
	while (!run->open)
		pthread_cond_wait(&run->opened, &run->lock);
	pthread_mutex_unlock(&run->lock);
	while (!run->no_barrier) {
		pthread_barrier_wait(&run->barrier);
		if (run->phase == LIMIT_STOP)
			break;
		run->start_ns[lr->rank] = bench_now_ns();
		if (!atomic_load(&run->failed))
			limit_rank_phase(lr, workers, g, &rm, bb);
		run->end_ns[lr->rank] = bench_now_ns();
		pthread_barrier_wait(&run->barrier);
	}
	if (g)
		atomic_fetch_add(&run->checksum, bench_gather_checksum(g));
	free(g);
	free(bb);
	for (uint32_t i = 0; i < run->num_pieces; i++) {
		struct limit_piece *p = &run->pieces[i];
		if (p->rank != lr->rank)
			continue;
		embd_shard_destroy(p->shard);
		free(p->pooled);
		free(p->grad);
		p->shard = NULL;
		p->pooled = p->grad = NULL;
	}
	embd_workers_destroy(workers);
	return NULL;
}

static void limit_batches_free(const struct train_opts *o, struct limit_batch *bs)
{
	for (uint64_t i = 0; bs && i < (uint64_t)TRAIN_BATCHES * o->tables; i++) {
		free(bs[i].ids);
		free(bs[i].rows);
		free(bs[i].first);
		free(bs[i].bags);
	}
	free(bs);
}

/* Every table's global batches and what their updates touch, for limit_run.batches. */
static struct limit_batch *limit_batches(const struct train_opts *o, const int64_t *ids)
{
	const uint64_t per = (uint64_t)o->batch * o->ids_per_bag * o->trainers;
	const uint64_t n = (uint64_t)TRAIN_BATCHES * o->tables;
	struct limit_batch *bs = calloc(n, sizeof(*bs));
	uint64_t *scratch = malloc(2 * per * sizeof(*scratch));
	bool ok = bs && scratch;

	for (uint64_t i = 0; ok && i < n; i++) {
		struct limit_batch *b = &bs[i];
		const uint64_t k = i / o->tables, f = i % o->tables;
		b->ids = malloc(per * sizeof(*b->ids));
		b->rows = malloc(per * sizeof(*b->rows));
		b->first = malloc((per + 1) * sizeof(*b->first));
		b->bags = malloc(per * sizeof(*b->bags));
		if (!b->ids || !b->rows || !b->first || !b->bags) {
			ok = false;
			break;
		}
		/* the trainers' bags of feature f in trainer order: the global batch */
		const uint64_t mine = (uint64_t)o->batch * o->ids_per_bag;
		for (uint32_t t = 0; t < o->trainers; t++)
			memcpy(b->ids + t * mine, ids + ((k * o->trainers + t) * o->tables + f) * mine,
			       mine * sizeof(*b->ids));
		b->n_rows = bench_rmw_rows_make(b->ids, per, o->ids_per_bag, scratch, b->rows,
						b->first, b->bags);
	}
	free(scratch);
	if (ok)
		return bs;
	limit_batches_free(o, bs);
	return NULL;
}

/*
 * The threads a rank gets over the CPUs this process may run on (bench_allowed_cpus): what
 * train_bench.py's service gets (write_job), each rank's dealt out as engine/ranks.c deals
 * them on one NUMA node (several nodes are not modelled).
 */
static uint32_t threads_per_rank(const struct train_opts *o, uint32_t cpus)
{
	return cpus / o->ranks ? cpus / o->ranks : 1;
}

/*
 * The limits of one global step of sharding over the batches (bs): medians over REPS reps after
 * one that warms up (each way of the gather and the kernels once a rep, each order of the
 * update once or twice), each phase from the first rank's start to the last one's end. A rep is
 * PAIRS steps of the limits (each a way of the lookup, then an order of the update) and one of
 * the kernels (forward, then backward), each step on the next of the TRAIN_BATCHES batches:
 * with the ways run back to back on one batch, every way but the first found that batch's rows
 * in the last level cache (480 MiB on the Intel Xeon of docs/benchmarks.md, 2026-12-06: the
 * first way 11.7-14.3 ms, the others 10-11), which no lookup of the service finds. Returns 1
 * when the type is not modelled (no limit), -1 on failure.
 */
static int measure_limits(const struct train_opts *o, const struct limit_batch *bs,
			  const char *sharding, struct limits *out)
{
	struct limit_rank *ranks = calloc(o->ranks, sizeof(*ranks));
	struct limit_run run = { .o = o, .batches = bs, .isa = embd_kernels_isa_best(),
				 .lock = PTHREAD_MUTEX_INITIALIZER,
				 .opened = PTHREAD_COND_INITIALIZER };
	enum { REPS = 15, PAIRS = LIMIT_GATHER_LAST - LIMIT_GATHER + 1 };
	_Static_assert((int)PAIRS >= (int)BENCH_RMW_ORDERS,
		       "every order of the update runs in every rep");
	_Static_assert((int)PAIRS <= 2 * (int)BENCH_RMW_ORDERS,
		       "an order runs at most twice a rep");
	_Static_assert(PAIRS == TRAIN_BATCHES,
		       "the gather ways' turn (r / TRAIN_BATCHES) wants a batch a pair");
	double ms[KERNEL_BACKWARD + 1][2 * REPS] = { { 0 } };  /* an order may run twice a rep */
	uint32_t samples[KERNEL_BACKWARD + 1] = { 0 };
	const uint64_t kt_floats = (uint64_t)o->batch * o->tables * o->dim;
	uint32_t started = 0;
	int rc = -1;

	run.start_ns = calloc(o->ranks, sizeof(*run.start_ns));
	run.end_ns = calloc(o->ranks, sizeof(*run.end_ns));
	run.offsets = malloc(((size_t)o->batch + 1) * sizeof(*run.offsets));
	run.pooled = calloc(o->trainers, sizeof(*run.pooled));
	run.grad = calloc(o->trainers, sizeof(*run.grad));
	run.prep_rank = calloc(o->tables, sizeof(*run.prep_rank));
	run.preps = calloc(o->tables, sizeof(*run.preps));
	run.num_cpus = bench_allowed_cpus(run.cpus);
	run.threads_per_rank = threads_per_rank(o, run.num_cpus);
	if (!ranks || !run.start_ns || !run.end_ns || !run.offsets || !run.pooled || !run.grad ||
	    !run.prep_rank || !run.preps)
		goto out;
	if (run.threads_per_rank > BENCH_LIMIT_MAX_WORKERS) {
		fprintf(stderr, "embd-bench train: limits: %u threads a rank, more than the %d the "
			"limits run: no limit\n", run.threads_per_rank, BENCH_LIMIT_MAX_WORKERS);
		rc = 1;
		goto out;
	}
	rc = limit_plan(o, sharding, &run.pieces, &run.num_pieces);
	if (rc)
		goto out;
	rc = -1;
	for (uint32_t b = 0; b <= o->batch; b++)
		run.offsets[b] = (int64_t)b * o->ids_per_bag;
	/* the trainers' KeyedTensors, 64-byte aligned as the trainers' slots (a table's columns
	 * start a line, so ranks write no line together): written (real pages), a zero gradient
	 * (rows unchanged) */
	const size_t kt_bytes = (kt_floats * sizeof(float) + 63) / 64 * 64;
	for (uint32_t t = 0; t < o->trainers; t++) {
		run.pooled[t] = aligned_alloc(64, kt_bytes);
		run.grad[t] = aligned_alloc(64, kt_bytes);
		if (!run.pooled[t] || !run.grad[t])
			goto out;
		memset(run.pooled[t], 0, kt_bytes);
		memset(run.grad[t], 0, kt_bytes);
	}
	/* engine/step.c's shared preps: column shards of a table, prepared on the rank of one of
	 * them with the fewest preps so far */
	run.shared_prep = run.num_pieces > o->tables;
	uint32_t *preps_of = calloc(o->ranks, sizeof(*preps_of));
	if (!preps_of)
		goto out;
	for (uint32_t i = 0; run.shared_prep && i < run.num_pieces; i++) {
		const struct limit_piece *p = &run.pieces[i];
		uint32_t *prep_rank = &run.prep_rank[p->table];
		if (i == 0 || p->table != run.pieces[i - 1].table)   /* a table's first piece */
			*prep_rank = p->rank;
		else if (preps_of[p->rank] < preps_of[*prep_rank])
			*prep_rank = p->rank;
		if (i + 1 == run.num_pieces || run.pieces[i + 1].table != p->table)
			preps_of[*prep_rank]++;
	}
	free(preps_of);
	for (; started < o->ranks; started++) {
		ranks[started] = (struct limit_rank){ .run = &run, .rank = started };
		if (pthread_create(&ranks[started].thread, NULL, limit_rank_main, &ranks[started])) {
			fprintf(stderr, "embd-bench train: limits: cannot start rank %u\n", started);
			atomic_store(&run.failed, 1);
			break;
		}
	}
	/* the barrier counts the ranks that started; they wait at the gate until it exists */
	if (pthread_barrier_init(&run.barrier, NULL, started + 1)) {
		fprintf(stderr, "embd-bench train: limits: no barrier\n");
		atomic_store(&run.failed, 1);
		run.no_barrier = true;
	}
	pthread_mutex_lock(&run.lock);
	run.open = true;
	pthread_cond_broadcast(&run.opened);
	pthread_mutex_unlock(&run.lock);
	for (int r = 0; r < REPS + 1 && !run.no_barrier; r++) { /* the first rep warms up */
		/* PAIRS steps of the limits and one of the kernels, each on its own batch (see
		 * measure_limits); the lookup's ways and the update's orders take turns */
		int phases[2 * PAIRS + 3];
		uint32_t batch[2 * PAIRS + 3], n = 0;
		for (int j = 0; j < PAIRS; j++) {
			const uint32_t k = (uint32_t)(((PAIRS + 1) * r + j) % TRAIN_BATCHES);
			/* (j + r) alone would time each way on one batch only: the batch is
			 * (j + r) % TRAIN_BATCHES, and PAIRS == TRAIN_BATCHES */
			phases[n] = LIMIT_GATHER + (j + r + r / TRAIN_BATCHES) % PAIRS;
			batch[n++] = k;
			phases[n] = LIMIT_RMW + (j + r) % BENCH_RMW_ORDERS;
			batch[n++] = k;
		}
		for (int phase = KERNEL_FORWARD; phase <= KERNEL_BACKWARD; phase++) {
			phases[n] = phase;
			batch[n++] = (uint32_t)(((PAIRS + 1) * r + PAIRS) % TRAIN_BATCHES);
		}
		for (uint32_t i = 0; i < n; i++) {
			const int phase = phases[i];
			if (phase == KERNEL_PREPARE && !run.shared_prep)
				continue;
			run.k = batch[i];
			run.phase = phase;
			run.timed = r > 0;
			pthread_barrier_wait(&run.barrier);
			pthread_barrier_wait(&run.barrier);
			uint64_t t0 = UINT64_MAX, t1 = 0;
			for (uint32_t w = 0; w < started; w++) {
				t0 = run.start_ns[w] < t0 ? run.start_ns[w] : t0;
				t1 = run.end_ns[w] > t1 ? run.end_ns[w] : t1;
			}
			if (r && started)
				ms[phase][samples[phase]++] = (double)(t1 - t0) / 1e6;
		}
		for (uint32_t t = 0; t < o->tables; t++) {
			embd_backward_prep_free(run.preps[t]);
			run.preps[t] = NULL;
		}
	}
	if (!run.no_barrier) {
		run.phase = LIMIT_STOP;
		pthread_barrier_wait(&run.barrier);
	}
	for (uint32_t i = 0; i < started; i++)
		pthread_join(ranks[i].thread, NULL);
	if (!run.no_barrier)
		pthread_barrier_destroy(&run.barrier);
	if (atomic_load(&run.failed))
		goto out;
	/* the way and the order whose medians are the shortest (as embd-bench kernels takes
	 * them) */
	out->gather_ms = bench_median(ms[LIMIT_GATHER], samples[LIMIT_GATHER]);
	for (int phase = LIMIT_GATHER + 1; phase <= LIMIT_GATHER_LAST; phase++) {
		const double median_ms = bench_median(ms[phase], samples[phase]);
		if ((!gather_windowed(phase) || atomic_load(&run.windowed_differs)) &&
		    median_ms < out->gather_ms)
			out->gather_ms = median_ms;
	}
	for (int phase = LIMIT_RMW; phase <= LIMIT_RMW_LAST; phase++) {
		const double median_ms = bench_median(ms[phase], samples[phase]);
		out->rmw_ms = phase == LIMIT_RMW || median_ms < out->rmw_ms ? median_ms : out->rmw_ms;
	}
	out->ms = out->gather_ms + out->rmw_ms;
	for (uint32_t r = 0; r < samples[KERNEL_PREPARE]; r++)  /* one of each a rep, in order */
		ms[KERNEL_BACKWARD][r] += ms[KERNEL_PREPARE][r];
	out->kernels_forward_ms = bench_median(ms[KERNEL_FORWARD], samples[KERNEL_FORWARD]);
	out->kernels_backward_ms = bench_median(ms[KERNEL_BACKWARD], samples[KERNEL_BACKWARD]);
	if (atomic_load(&run.kernels_failed))
		out->kernels_forward_ms = out->kernels_backward_ms = 0;
	struct embd_backward_times sum = { 0 };
	for (uint32_t i = 0; i < started; i++) {
		sum.setup_ns += ranks[i].times.setup_ns;
		sum.collect_ns += ranks[i].times.collect_ns;
		sum.scatter_ns += ranks[i].times.scatter_ns;
		sum.sort_ns += ranks[i].times.sort_ns;
		sum.apply_ns += ranks[i].times.apply_ns;
	}
	const double per_rank_step = started ? 1e6 * REPS * started : 1;
	if (atomic_load(&run.kernels_failed))   /* the steps before the failure would read short */
		memset(&sum, 0, sizeof(sum));
	out->kernels_setup_ms = (double)sum.setup_ns / per_rank_step;
	out->kernels_collect_ms = (double)sum.collect_ns / per_rank_step;
	out->kernels_scatter_ms = (double)sum.scatter_ns / per_rank_step;
	out->kernels_sort_ms = (double)sum.sort_ns / per_rank_step;
	out->kernels_apply_ms = (double)sum.apply_ns / per_rank_step;
	/* every id's row read, the pooled rows written, the distinct rows read and written,
	 * each occurrence's gradient row read (counted once: it stays in cache) */
	double bytes = 0;
	const uint64_t bags = (uint64_t)o->batch * o->trainers;
	const uint32_t k = 1 % TRAIN_BATCHES;  /* the first timed step's batch */
	for (uint32_t i = 0; i < run.num_pieces; i++) {
		const double rb = (double)run.pieces[i].cols * 4;
		const struct limit_batch *b = &bs[k * o->tables + run.pieces[i].table];
		bytes += (double)bags * o->ids_per_bag * rb + (double)bags * rb +
			 2.0 * (double)b->n_rows * rb + (double)bags * rb;
	}
	out->step_bytes = bytes;
	fprintf(stderr, "embd-bench train: %s limits measured (checksum %llu)\n", sharding,
		(unsigned long long)atomic_load(&run.checksum));
	rc = 0;
out:
	pthread_mutex_destroy(&run.lock);
	pthread_cond_destroy(&run.opened);
	for (uint32_t t = 0; t < o->trainers; t++) {
		free(run.pooled ? run.pooled[t] : NULL);
		free(run.grad ? run.grad[t] : NULL);
	}
	free(run.pooled);
	free(run.grad);
	free(run.offsets);
	free(run.prep_rank);
	free(run.preps);
	free(run.pieces);
	free(run.start_ns);
	free(run.end_ns);
	free(ranks);
	return rc;
}

/* The job train_bench.py reads. */
static int write_job(const struct train_opts *o, const char *path, const char *ids_path)
{
	static int cpu_list[CPU_SETSIZE];
	const uint32_t cpus = bench_allowed_cpus(cpu_list);
	cJSON *j = cJSON_CreateObject(), *sh = cJSON_AddArrayToObject(j, "shardings");
	char list[sizeof(o->shardings)], *save = NULL;

	snprintf(list, sizeof(list), "%s", o->shardings);
	for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save))
		cJSON_AddItemToArray(sh, cJSON_CreateString(t));
	/* TorchRec shards no table row_wise on CPU: its table_wise is the comparison there */
	cJSON_AddStringToObject(cJSON_AddObjectToObject(j, "torchrec_sharding"), "row_wise",
				"table_wise");
	const struct { const char *k; double v; } nums[] = {
		{ "tables", o->tables }, { "rows", (double)o->rows }, { "dim", o->dim },
		{ "batch_size", o->batch }, { "ids_per_bag", o->ids_per_bag },
		{ "trainers", o->trainers }, { "ranks", o->ranks }, { "steps", o->steps },
		{ "rounds", o->rounds }, { "warmup", o->warmup }, { "batches", TRAIN_BATCHES },
		{ "lr", 0.01 }, { "min_partition", min_partition(o) },
		{ "threads_per_rank", threads_per_rank(o, cpus) },
		{ "torch_threads", cpus / o->trainers ? cpus / o->trainers : 1 },
		{ "timeout_s", 3600 },
	};
	for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
		cJSON_AddNumberToObject(j, nums[i].k, nums[i].v);
	cJSON_AddStringToObject(j, "ids_file", ids_path);
	char *text = cJSON_Print(j);
	cJSON_Delete(j);
	FILE *f = text ? fopen(path, "w") : NULL;
	int rc = f && fputs(text, f) >= 0 ? 0 : -1;
	if (f && fclose(f))
		rc = -1;
	free(text);
	return rc;
}

/* One line of train_bench.py with its sharding's limits (of lims[n]), the machine and the
 * configuration added. */
static void print_line(const struct train_opts *o, const char *line, const struct limits *lims,
		       int n, const char *cpu, const char *isa)
{
	cJSON *j = cJSON_Parse(line);
	if (!j) {
		fputs(line, stdout);
		return;
	}
	const cJSON *sh = cJSON_GetObjectItemCaseSensitive(j, "sharding");
	const struct limits *lim = NULL;
	for (int i = 0; i < n && cJSON_IsString(sh); i++)
		if (!strcmp(lims[i].sharding, sh->valuestring))
			lim = &lims[i];
	const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "embd_steps_per_s");
	const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "torchrec_steps_per_s");
	const cJSON *ep = cJSON_GetObjectItemCaseSensitive(j, "embd_pipelined_steps_per_s");
	cJSON *out = cJSON_CreateObject();
	cJSON_AddStringToObject(out, "name", "train");
	for (cJSON *it = j->child; it; it = it->next)
		cJSON_AddItemToObject(out, it->string, cJSON_Duplicate(it, true));
	if (o->limits && lim && lim->ms > 0) {
		double limit_sps = 1e3 / lim->ms;
		cJSON_AddNumberToObject(out, "limit_steps_per_s", limit_sps);
		cJSON_AddNumberToObject(out, "limit_steps_per_s_before", 1e3 / lim->before_ms);
		if (lim->after_ms > 0)
			cJSON_AddNumberToObject(out, "limit_steps_per_s_after", 1e3 / lim->after_ms);
		cJSON_AddNumberToObject(out, "ratio_to_limit",
					cJSON_IsNumber(e) ? e->valuedouble / limit_sps : 0);
		cJSON_AddNumberToObject(out, "torchrec_ratio_to_limit",
					cJSON_IsNumber(t) ? t->valuedouble / limit_sps : 0);
		cJSON_AddNumberToObject(out, "pipelined_ratio_to_limit",
					cJSON_IsNumber(ep) ? ep->valuedouble / limit_sps : 0);
		cJSON_AddNumberToObject(out, "step_bytes", lim->step_bytes);
		cJSON_AddNumberToObject(out, "limit_gather_ms", lim->gather_ms);
		cJSON_AddNumberToObject(out, "limit_rmw_ms", lim->rmw_ms);
		if (lim->kernels_forward_ms > 0) {      /* 0: the kernels failed */
			double kernels_sps = 1e3 / (lim->kernels_forward_ms + lim->kernels_backward_ms);
			cJSON_AddNumberToObject(out, "kernels_steps_per_s", kernels_sps);
			cJSON_AddNumberToObject(out, "kernels_forward_ms", lim->kernels_forward_ms);
			cJSON_AddNumberToObject(out, "kernels_backward_ms", lim->kernels_backward_ms);
			cJSON_AddNumberToObject(out, "kernels_ratio_to_limit", kernels_sps / limit_sps);
			cJSON *ph = cJSON_AddObjectToObject(out, "kernels_backward_phases_ms");
			cJSON_AddNumberToObject(ph, "setup", lim->kernels_setup_ms);
			cJSON_AddNumberToObject(ph, "collect", lim->kernels_collect_ms);
			cJSON_AddNumberToObject(ph, "scatter", lim->kernels_scatter_ms);
			cJSON_AddNumberToObject(ph, "sort", lim->kernels_sort_ms);
			cJSON_AddNumberToObject(ph, "apply", lim->kernels_apply_ms);
			cJSON_AddNumberToObject(out, "embd_ratio_to_kernels",
						cJSON_IsNumber(e) ? e->valuedouble / kernels_sps : 0);
		}
		/* the step cannot be shorter than its limit plus the trainers' phase, in which the
		 * service waits for their gradients */
		const cJSON *ph = cJSON_GetObjectItemCaseSensitive(j, "embd_step_phases_ms");
		const cJSON *tr = cJSON_GetObjectItemCaseSensitive(ph, "trainers");
		if (cJSON_IsNumber(tr))
			cJSON_AddNumberToObject(out, "ratio_to_limit_bound",
						lim->ms / (lim->ms + tr->valuedouble));
	}
	const struct { const char *k; double v; } conf[] = {
		{ "tables", o->tables }, { "rows", (double)o->rows }, { "dim", o->dim },
		{ "batch_size", o->batch }, { "ids_per_bag", o->ids_per_bag },
		{ "trainers", o->trainers }, { "ranks", o->ranks }, { "steps_per_round", o->steps },
	};
	for (size_t i = 0; i < sizeof(conf) / sizeof(conf[0]); i++)
		cJSON_AddNumberToObject(out, conf[i].k, conf[i].v);
	cJSON_AddStringToObject(out, "optimizer", "sgd");
	cJSON_AddStringToObject(out, "cpu", cpu);
	cJSON_AddStringToObject(out, "isa", isa);
	char *text = cJSON_PrintUnformatted(out);
	if (text)
		printf("%s\n", text);
	fflush(stdout);
	free(text);
	cJSON_Delete(out);
	cJSON_Delete(j);
}

/* Runs train_bench.py on the job and keeps its lines (*lines, *n of them, each and the array
 * to free); returns its exit status, or -1 also when a line could not be kept. */
static int run_python(const struct train_opts *o, const char *embd, const char *job,
		      char ***lines, int *n)
{
	char build[4096], cmd[8192], line[8192];

	/* the build's embd is <build>/daemon/embd: support.py finds embd and embctl there */
	snprintf(build, sizeof(build), "%s", embd);
	for (int up = 0; up < 2; up++) {
		char *slash = strrchr(build, '/');
		if (slash)
			*slash = 0;
	}
	snprintf(cmd, sizeof(cmd), "EMBD_BUILD_DIR='%s' '%s' '%s/train_bench.py' '%s'", build,
		 o->python, EMBD_BENCH_SCRIPT_DIR, job);
	FILE *p = popen(cmd, "r");
	if (!p) {
		perror("embd-bench train: popen");
		return -1;
	}
	bool kept = true;
	while (fgets(line, sizeof(line), p)) {
		char **grown = realloc(*lines, (size_t)(*n + 1) * sizeof(**lines));
		char *copy = strdup(line);
		if (grown)
			*lines = grown;
		if (!grown || !copy) {
			free(copy);
			kept = false;
			continue;
		}
		(*lines)[(*n)++] = copy;
	}
	int st = pclose(p);
	if (!kept)
		fprintf(stderr, "embd-bench train: out of memory for train_bench.py's lines\n");
	return st == 0 && kept ? 0 : -1;
}

static void usage(void)
{
	fprintf(stderr, "usage: embd-bench train [--tables N (8)] [--rows R (1000000)] [--dim D (64)]"
		" [--batch B (2048)] [--ids P per bag (20)] [--trainers T (2)] [--ranks N (2)]"
		" [--steps S per round (10)] [--rounds R (3)] [--warmup W (3)]"
		" [--sharding table_wise,column_wise] [--python PATH ($EMBD_BENCH_PYTHON, .venv)]"
		" [--no-limits] [--embd PATH]\n");
}

static int parse(int argc, char **argv, struct train_opts *o)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		uint32_t *u = !strcmp(a, "--tables") ? &o->tables : !strcmp(a, "--dim") ? &o->dim :
			      !strcmp(a, "--batch") ? &o->batch : !strcmp(a, "--ids") ? &o->ids_per_bag :
			      !strcmp(a, "--trainers") ? &o->trainers : !strcmp(a, "--ranks") ? &o->ranks :
			      !strcmp(a, "--steps") ? &o->steps : !strcmp(a, "--rounds") ? &o->rounds :
			      !strcmp(a, "--warmup") ? &o->warmup : NULL;
		if (!strcmp(a, "--no-limits")) {
			o->limits = false;
			continue;
		}
		if (!v)
			return -1;
		i++;
		if (u)
			*u = (uint32_t)strtoul(v, NULL, 0);
		else if (!strcmp(a, "--rows"))
			o->rows = strtoull(v, NULL, 0);
		else if (!strcmp(a, "--sharding"))
			snprintf(o->shardings, sizeof(o->shardings), "%s", v);
		else if (!strcmp(a, "--python"))
			o->python = v;
		else if (strcmp(a, "--embd"))
			return -1;
	}
	if (!o->tables || !o->rows || o->dim < 4 || o->dim % 4 || !o->batch || !o->ids_per_bag ||
	    !o->trainers || !o->ranks || !o->steps || !o->rounds)
		return -1;
	return 0;
}

int bench_train_run(int argc, char **argv)
{
	const char *embd = bench_embd_path(argc, argv);
	struct train_opts o = {
		.tables = 8, .rows = 1000000, .dim = 64, .batch = 2048, .ids_per_bag = 20,
		.trainers = 2, .ranks = 2, .steps = 10, .rounds = 3, .warmup = 3,
		.shardings = "table_wise,column_wise", .python = getenv("EMBD_BENCH_PYTHON"),
		.limits = true,
	};
	char job[64] = "/tmp/embd-bench-train-XXXXXX", ids_path[80], job_path[80];
	struct limits lims[TRAIN_MAX_SHARDINGS] = { 0 };
	struct limit_batch *batches = NULL;
	int num_lims = 0;
	char **lines = NULL, cpu[128];
	const char *isa = embd_kernels_isa_name(embd_kernels_isa_best());
	int num_lines = 0;
	uint64_t n = 0;
	int rc = 1;

	if (parse(argc, argv, &o)) {
		usage();
		return 2;
	}
	if (!o.python)
		o.python = EMBD_BENCH_SCRIPT_DIR "/../../.venv/bin/python";
	if (!mkdtemp(job)) {
		perror("embd-bench train: mkdtemp");
		return 1;
	}
	snprintf(ids_path, sizeof(ids_path), "%s/ids.bin", job);
	snprintf(job_path, sizeof(job_path), "%s/job.json", job);
	int64_t *ids = make_ids(&o, &n);
	FILE *f = ids ? fopen(ids_path, "wb") : NULL;
	if (!f || fwrite(ids, sizeof(*ids), n, f) != n || fclose(f)) {
		fprintf(stderr, "embd-bench train: cannot write %s\n", ids_path);
		goto out;
	}
	if (o.limits) {
		char list[sizeof(o.shardings)], *save = NULL;
		snprintf(list, sizeof(list), "%s", o.shardings);
		for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
			if (num_lims == TRAIN_MAX_SHARDINGS) {
				fprintf(stderr, "embd-bench train: no limit for %s: limits are "
					"measured for %d sharding types at most\n", t,
					TRAIN_MAX_SHARDINGS);
				continue;
			}
			snprintf(lims[num_lims++].sharding, sizeof(lims[0].sharding), "%s", t);
		}
		batches = limit_batches(&o, ids);
		if (!batches) {
			fprintf(stderr, "embd-bench train: out of memory for the limits' batches\n");
			goto out;
		}
	}
	/* before the trainers start: the limits' shards are freed when they run */
	for (int i = 0; i < num_lims; i++) {
		int m = measure_limits(&o, batches, lims[i].sharding, &lims[i]);
		if (m < 0)
			goto out;
		lims[i].before_ms = lims[i].ms;
	}
	if (write_job(&o, job_path, ids_path))
		goto out;
	rc = run_python(&o, embd, job_path, &lines, &num_lines) ? 1 : 0;
	/* after the trainers end, and the faster of the two is the limit */
	for (int i = 0; num_lines && i < num_lims; i++) {
		struct limits after = lims[i];
		if (lims[i].ms <= 0 || measure_limits(&o, batches, lims[i].sharding, &after))
			continue;
		after.after_ms = lims[i].after_ms = after.ms;
		if (after.ms < lims[i].ms)
			lims[i] = after;
	}
	bench_cpu_model(cpu, sizeof(cpu));
	for (int i = 0; i < num_lines; i++)
		print_line(&o, lines[i], lims, num_lims, cpu, isa);
out:
	limit_batches_free(&o, batches);
	for (int i = 0; i < num_lines; i++)
		free(lines[i]);
	free(lines);
	free(ids);
	unlink(ids_path);
	unlink(job_path);
	rmdir(job);
	return rc;
}
