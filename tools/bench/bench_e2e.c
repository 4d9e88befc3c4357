/*
 * embd-bench e2e: training steps (forward + backward with the fused optimizer) per second
 * through a real embd, one trainer, against the same kernels called in this process on the
 * same batches, the same shard shapes, optimizer, seed and number of worker threads. Rounds
 * of the two alternate and the median round of each is reported, with the time split into
 * forward and backward, so overhead_ratio = embd steps/s / in-process steps/s shows what the
 * service costs per step. One embd and one set of in-process shards serve every size (its
 * config plans for the largest), so both keep the memory (and huge pages) they got first.
 * With --scrape-hz HZ embd also serves its Prometheus endpoint (metrics_listen) and a third
 * mode runs the embd rounds again while a thread of this process GETs /metrics HZ times a
 * second: scraped_steps_per_s beside steps_per_s shows what scrapes cost the step.
 * With --dense-us U every step spins U microseconds between its forward's result and its
 * backward (the trainer's dense model), and --pipeline adds a mode that posts FORWARD s + 1
 * before that dense work and BACKWARD s after it (pipelined steps, engine/step.h):
 * pipelined_steps_per_s beside steps_per_s shows what the service hides behind the trainer.
 * With --device cpu|cuda embd's ranks compute on that device (compute_device; one rank) and the
 * in-process side calls the same kernels through the ranks of that device in this process
 * (engine/ranks.h: on a GPU the CUDA backend's copies and kernels, its host arrays registered as
 * the service registers the trainer's slab): overhead_ratio is then what the service costs
 * over the device's own kernels (issue 16's target on one GPU: >= 0.9). Without a CUDA device
 * --device cuda exits 77 with one line saying why. Without --device the in-process side calls
 * the CPU kernels directly. --rows N sizes both tables (default 1000000).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "embd/client.h"
#include "embd/plan.h"
#include "engine/ranks.h"
#include "kernels/embedding.h"
#include "kernels/workers.h"

#define E2E_TABLES 2                    /* table_wise tables, one feature each */
#define E2E_DIM 64
#define E2E_ROWS 1000000                /* default --rows */
#define E2E_BATCH 2048                  /* B */
#define E2E_BATCHES 4                   /* distinct batches, cycled */
#define E2E_ROUNDS 3
#define E2E_SEED 2026
#define E2E_LR 0.05f
#define E2E_EPS 1e-8f

struct e2e {
	uint32_t threads;
	uint32_t pf;                            /* ids per bag */
	uint64_t ids;                           /* per step, all features */
	double round_s;
	uint32_t dense_us;                      /* the trainer's own work per step */
	bool pipeline;
	int32_t *lengths;                       /* [E2E_BATCHES][F * B] */
	int64_t *values;                        /* [E2E_BATCHES][ids] */
	float *grad;                            /* [B][total_dim] */
	/* in-process */
	struct embd_workers *workers;
	struct embd_exec exec;
	struct embd_shard *shards[E2E_TABLES];
	int64_t *offsets;                       /* [F][B + 1] */
	float *pooled;
	int64_t rows;                           /* of each table */
	/* --device: the in-process side through ranks of that device (ranks_call) */
	bool on_ranks;
	enum embd_compute_device device;
	struct embd_ranks *ranks;
	struct embd_bag_batch bb[E2E_TABLES];
	bool backward;
	int rc;
	struct embd_kernel_err kerr;
};

struct split {
	double steps_per_s, fwd_ms, bwd_ms, scrapes_per_s;
};

/* The trainer's dense work of one step: a spin of us microseconds. */
static void dense_work(uint32_t us)
{
	const uint64_t end = bench_now_ns() + (uint64_t)us * 1000;

	while (us && bench_now_ns() < end)
		;
}

/* ---- the scraper: GET /metrics at a pace, while on ------------------------------------- */

struct scraper {
	int port;
	double hz;
	pthread_t thread;
	atomic_bool on, quit;
	atomic_uint_fast64_t done, failed;
};

/* One GET /metrics, the answer read to its end: 0, or -1. */
static int scrape_once(int port)
{
	static const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	char buf[16384];
	ssize_t n, total = 0;
	bool ok = false;
	int fd = socket(AF_INET, SOCK_STREAM, 0);

	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) ||
	    write(fd, req, sizeof(req) - 1) != (ssize_t)sizeof(req) - 1) {
		close(fd);
		return -1;
	}
	while ((n = read(fd, buf, sizeof(buf))) > 0) {
		if (!total)
			ok = n > 12 && !strncmp(buf, "HTTP/1.1 200", 12);
		total += n;
	}
	close(fd);
	return n == 0 && ok ? 0 : -1;
}

static void *scraper_main(void *arg)
{
	struct scraper *s = arg;
	const uint64_t period_ns = (uint64_t)(1e9 / s->hz);
	uint64_t next = bench_now_ns();

	while (!atomic_load(&s->quit)) {
		uint64_t now = bench_now_ns();
		if (!atomic_load(&s->on) || now < next) {
			uint64_t wait = atomic_load(&s->on) ? next - now : 1000000;
			struct timespec ts = { 0, (long)(wait < 1000000 ? wait : 1000000) };
			nanosleep(&ts, NULL);
			if (!atomic_load(&s->on))
				next = bench_now_ns();
			continue;
		}
		next += period_ns;
		if (scrape_once(s->port))
			atomic_fetch_add(&s->failed, 1);
		else
			atomic_fetch_add(&s->done, 1);
	}
	return NULL;
}

/* Whole pages of their own for the arrays the in-process ranks copy: registration (CUDA's is
 * by page) never meets another array's page. */
static void *page_alloc(uint64_t bytes)
{
	const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);

	return aligned_alloc(page, (bytes + page - 1) / page * page);
}

/* A host array the in-process ranks' device copies (registered by ranks_setup), released. */
static void unregister(struct e2e *x, void *p)
{
	if (x->ranks && p)
		embd_ranks_host_unregister(x->ranks, p);
}

/* The batches of one size (x->pf ids per bag); replaces those of the last size. */
static int make_batches(struct e2e *x)
{
	const uint64_t nl = (uint64_t)E2E_TABLES * E2E_BATCH;
	uint64_t s = 42;

	free(x->lengths);
	unregister(x, x->values);
	free(x->values);
	x->lengths = malloc(E2E_BATCHES * nl * sizeof(int32_t));
	x->values = page_alloc(E2E_BATCHES * x->ids * sizeof(int64_t));
	if (!x->lengths || !x->values)
		return -1;
	for (uint64_t i = 0; i < E2E_BATCHES * nl; i++)
		x->lengths[i] = (int32_t)x->pf;
	for (uint64_t i = 0; i < E2E_BATCHES * x->ids; i++)
		x->values[i] = (int64_t)(bench_rng_next(&s) % (uint64_t)x->rows);
	/* a refusal is logged and the copies are staged by the driver (slower, still right) */
	if (x->ranks)
		embd_ranks_dma_register(x->ranks, x->values, E2E_BATCHES * x->ids * sizeof(int64_t),
					"embd-bench e2e's ids");
	return 0;
}

/* The CPUs this process may use, in order (as the service pins its single rank). */
static void allowed_cpus(int *cpus, uint32_t n)
{
	int allowed[CPU_SETSIZE];
	uint32_t k = bench_allowed_cpus(allowed);

	for (uint32_t i = 0; i < n; i++)
		cpus[i] = allowed[i % k];
}

/* On the in-process rank's thread: the forward of x->bb, or one backward per shard. */
static void ranks_call(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct e2e *x = arg;

	x->rc = 0;
	if (!x->backward)
		x->rc = embd_ranks_forward(x->ranks, rank, exec, x->bb, E2E_TABLES, &x->kerr);
	for (uint32_t f = 0; x->backward && f < E2E_TABLES && !x->rc; f++)
		x->rc = embd_ranks_backward(x->ranks, rank, exec, x->shards[f], &x->bb[f], 1,
					    &x->kerr);
}

static void ranks_init(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct e2e *x = arg;

	(void)rank;
	for (uint32_t t = 0; t < E2E_TABLES; t++)
		embd_shard_init_weights(embd_ranks_shard_host(x->ranks, x->shards[t]), E2E_SEED,
					exec);
}

/* --device: one rank of the device with the shards, initialised as embd initialises them,
 * and the host arrays its device copies registered. */
static int ranks_setup(struct e2e *x, const struct embd_shard_desc *descs)
{
	char err[256];
	const uint64_t rows_bytes = (uint64_t)E2E_BATCH * E2E_TABLES * E2E_DIM * sizeof(float);
	int rc = embd_ranks_create_on(x->device, 1, x->threads, &x->ranks, err, sizeof(err));

	for (uint32_t t = 0; t < E2E_TABLES && !rc; t++)
		rc = embd_ranks_alloc_shard(x->ranks, 0, &descs[t], EMBD_KERNEL_FUSED, 0,
					    &x->shards[t], err, sizeof(err));
	if (!rc)
		embd_ranks_run(x->ranks, ranks_init, x);
	for (uint32_t t = 0; t < E2E_TABLES && !rc; t++) {
		embd_ranks_shard_changed(x->ranks, x->shards[t]);
		rc = embd_ranks_shard_push(x->ranks, x->shards[t], err, sizeof(err));
	}
	if (!rc) {
		embd_ranks_dma_register(x->ranks, x->grad, rows_bytes, "embd-bench e2e's gradients");
		embd_ranks_dma_register(x->ranks, x->pooled, rows_bytes, "embd-bench e2e's outputs");
		embd_ranks_dma_register(x->ranks, x->offsets, (uint64_t)E2E_TABLES *
					(E2E_BATCH + 1) * sizeof(int64_t), "embd-bench e2e's offsets");
	}
	if (rc)
		fprintf(stderr, "embd-bench e2e: in-process %s rank: %s\n",
			embd_plan_device_name(x->device), err);
	return rc ? -1 : 0;
}

static int inprocess_setup(struct e2e *x)
{
	char err[256];
	int cpus[256];

	x->grad = page_alloc((uint64_t)E2E_BATCH * E2E_TABLES * E2E_DIM * sizeof(float));
	x->offsets = page_alloc((uint64_t)E2E_TABLES * (E2E_BATCH + 1) * sizeof(int64_t));
	x->pooled = page_alloc((uint64_t)E2E_BATCH * E2E_TABLES * E2E_DIM * sizeof(float));
	if (!x->grad || !x->offsets || !x->pooled)
		return -1;
	for (uint64_t i = 0; i < (uint64_t)E2E_BATCH * E2E_TABLES * E2E_DIM; i++)
		x->grad[i] = 0.01f * (float)((i % 7) + 1);
	struct embd_shard_desc descs[E2E_TABLES];
	for (uint32_t t = 0; t < E2E_TABLES; t++)
		descs[t] = (struct embd_shard_desc){
			.table_id = t, .num_embeddings = x->rows, .embedding_dim = E2E_DIM,
			.dtype = EMBD_DTYPE_FP32, .row_offset = 0, .rows = x->rows,
			.col_offset = 0, .cols = E2E_DIM,
			.optimizer = { .type = EMBD_OPT_ROWWISE_ADAGRAD, .lr = E2E_LR, .eps = E2E_EPS },
		};
	if (x->on_ranks)
		return ranks_setup(x, descs);
	allowed_cpus(cpus, x->threads);
	if (embd_workers_create(x->threads, cpus, &x->workers, err, sizeof(err))) {
		fprintf(stderr, "embd-bench e2e: workers: %s\n", err);
		return -1;
	}
	x->exec = (struct embd_exec){ .workers = x->workers, .isa = EMBD_ISA_AUTO };
	for (uint32_t t = 0; t < E2E_TABLES; t++) {
		if (embd_shard_create(&descs[t], &x->shards[t], err, sizeof(err))) {
			fprintf(stderr, "embd-bench e2e: shard: %s\n", err);
			return -1;
		}
		embd_shard_init_weights(x->shards[t], E2E_SEED, &x->exec);
	}
	return 0;
}

static void inprocess_teardown(struct e2e *x)
{
	if (x->ranks) {
		unregister(x, x->values);
		unregister(x, x->grad);
		unregister(x, x->pooled);
		unregister(x, x->offsets);
		embd_ranks_destroy(x->ranks);   /* and its shards */
		x->ranks = NULL;
		return;
	}
	for (uint32_t t = 0; t < E2E_TABLES; t++)
		embd_shard_destroy(x->shards[t]);
	embd_workers_destroy(x->workers);
}

/* The forward (or the backward) of bb in process: on the ranks (--device), or the CPU
 * kernels on this process's workers. */
static int inprocess_call(struct e2e *x, struct embd_bag_batch *bb, bool backward,
			  struct embd_kernel_err *kerr)
{
	int rc = 0;

	if (x->ranks) {
		memcpy(x->bb, bb, sizeof(x->bb));
		x->backward = backward;
		embd_ranks_run(x->ranks, ranks_call, x);
		*kerr = x->kerr;
		return x->rc;
	}
	if (!backward)
		return embd_kernels_forward(&x->exec, bb, E2E_TABLES, kerr);
	for (uint32_t f = 0; f < E2E_TABLES && !rc; f++)
		rc = embd_kernels_backward(&x->exec, x->shards[f], &bb[f], 1, kerr);
	return rc;
}

/* One in-process step on batch k: offsets from the lengths (as the service does), forward,
 * then one fused backward per shard. */
static int inprocess_step(struct e2e *x, uint64_t k, uint64_t *fwd_ns, uint64_t *bwd_ns)
{
	const uint64_t nl = (uint64_t)E2E_TABLES * E2E_BATCH;
	const int32_t *len = x->lengths + (k % E2E_BATCHES) * nl;
	const int64_t *val = x->values + (k % E2E_BATCHES) * x->ids;
	struct embd_bag_batch bb[E2E_TABLES];
	struct embd_kernel_err kerr;
	uint64_t t0 = bench_now_ns(), at = 0;

	for (uint32_t f = 0; f < E2E_TABLES; f++) {
		int64_t *off = x->offsets + (uint64_t)f * (E2E_BATCH + 1);
		uint64_t first = at;
		off[0] = 0;
		for (uint32_t b = 0; b < E2E_BATCH; b++) {
			at += (uint64_t)len[(uint64_t)f * E2E_BATCH + b];
			off[b + 1] = (int64_t)(at - first);
		}
		bb[f] = (struct embd_bag_batch){
			.shard = x->shards[f], .feature = f, .batch_size = E2E_BATCH, .offsets = off,
			.ids = val + first, .num_ids = at - first, .pooling = EMBD_POOLING_SUM,
			.pooled = x->pooled, .pooled_grad = x->grad,
			.pooled_stride = E2E_TABLES * E2E_DIM, .pooled_col = f * E2E_DIM,
		};
	}
	int rc = inprocess_call(x, bb, false, &kerr);
	dense_work(x->dense_us);
	uint64_t t1 = bench_now_ns();
	if (!rc)
		rc = inprocess_call(x, bb, true, &kerr);
	*fwd_ns += t1 - t0;
	*bwd_ns += bench_now_ns() - t1;
	if (rc)
		fprintf(stderr, "embd-bench e2e: in-process kernel: %s (%s)\n", embd_strerror(rc),
			kerr.msg);
	return rc;
}

/* One step through embd on batch k: write the KJT into the slot, forward, backward. */
static int embd_step(struct e2e *x, struct embd_client *c, uint64_t step, uint64_t k,
		     uint64_t *fwd_ns, uint64_t *bwd_ns)
{
	const uint64_t nl = (uint64_t)E2E_TABLES * E2E_BATCH;
	uint32_t slot = (uint32_t)(step % EMBD_CLIENT_SLOTS);
	struct embd_batch b;
	uint64_t t0 = bench_now_ns();
	int rc = embd_batch_get(c, slot, &b);

	if (!rc) {
		memcpy(b.lengths, x->lengths + (k % E2E_BATCHES) * nl, nl * sizeof(int32_t));
		memcpy(b.values, x->values + (k % E2E_BATCHES) * x->ids, x->ids * sizeof(int64_t));
		rc = embd_forward(c, slot, step, x->ids, 0);
	}
	dense_work(x->dense_us);
	uint64_t t1 = bench_now_ns();
	if (!rc)
		rc = embd_backward(c, slot, step, x->ids, 0);
	*fwd_ns += t1 - t0;
	*bwd_ns += bench_now_ns() - t1;
	if (rc)
		fprintf(stderr, "embd-bench e2e: step %llu: %s (%s)\n", (unsigned long long)step,
			embd_strerror(rc), embd_last_error(c));
	return rc;
}

/* Writes batch k into step's slot and posts its FORWARD (user_data 0: forward). */
static int post_forward(struct e2e *x, struct embd_client *c, uint64_t step, uint64_t k)
{
	const uint64_t nl = (uint64_t)E2E_TABLES * E2E_BATCH;
	struct embd_batch b;
	int rc = embd_batch_get(c, (uint32_t)(step % EMBD_CLIENT_SLOTS), &b);

	if (rc)
		return rc;
	memcpy(b.lengths, x->lengths + (k % E2E_BATCHES) * nl, nl * sizeof(int32_t));
	memcpy(b.values, x->values + (k % E2E_BATCHES) * x->ids, x->ids * sizeof(int64_t));
	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .step = step,
				    .slot = (uint32_t)(step % EMBD_CLIENT_SLOTS),
				    .num_values = x->ids };
	return embd_submit(c, &req);
}

static int await(struct embd_client *c, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		struct embd_completion done;
		int rc = embd_wait(c, &done, 60000);
		if (rc || done.result)
			return rc ? rc : done.result;
	}
	return 0;
}

/*
 * One pipelined step: the forward of step (posted by the step before, or now when first) has
 * its result; FORWARD step + 1 (batch k + 1) is posted before the dense work, BACKWARD step
 * after it (last: no next forward). fwd_ns: waiting for the first forward; bwd_ns the rest.
 */
static int embd_step_pipelined(struct e2e *x, struct embd_client *c, uint64_t step, uint64_t k,
			       bool first, bool last, uint64_t *fwd_ns, uint64_t *bwd_ns)
{
	uint64_t t0 = bench_now_ns();
	int rc = first ? post_forward(x, c, step, k) : 0;

	if (!rc && first)
		rc = await(c, 1);
	uint64_t t1 = bench_now_ns();
	if (!rc && !last)
		rc = post_forward(x, c, step + 1, k + 1);
	dense_work(x->dense_us);
	struct embd_request req = { .op = EMBD_REQUEST_BACKWARD, .step = step,
				    .slot = (uint32_t)(step % EMBD_CLIENT_SLOTS),
				    .num_values = x->ids, .user_data = 1 };
	if (!rc)
		rc = embd_submit(c, &req);
	if (!rc)
		rc = await(c, last ? 1 : 2);
	*fwd_ns += t1 - t0;
	*bwd_ns += bench_now_ns() - t1;
	if (rc)
		fprintf(stderr, "embd-bench e2e: pipelined step %llu: %s (%s)\n",
			(unsigned long long)step, embd_strerror(rc), embd_last_error(c));
	return rc;
}

static int compare_split(const void *a, const void *b)
{
	double x = ((const struct split *)a)->steps_per_s, y = ((const struct split *)b)->steps_per_s;
	return (x > y) - (x < y);
}

static const char e2e_config_fmt[] =
	"{ \"tables\": [\n"
	"    { \"name\": \"t0\", \"num_embeddings\": %d, \"embedding_dim\": %d, \"pooling\": \"sum\",\n"
	"      \"data_type\": \"fp32\",\n"
	"      \"optimizer\": { \"type\": \"rowwise_adagrad\", \"lr\": %g, \"eps\": %g },\n"
	"      \"constraints\": { \"sharding_types\": [\"table_wise\"], \"compute_kernels\": [\"fused\"],\n"
	"                       \"pooling_factors\": [%u] } },\n"
	"    { \"name\": \"t1\", \"num_embeddings\": %d, \"embedding_dim\": %d, \"pooling\": \"sum\",\n"
	"      \"data_type\": \"fp32\",\n"
	"      \"optimizer\": { \"type\": \"rowwise_adagrad\", \"lr\": %g, \"eps\": %g },\n"
	"      \"constraints\": { \"sharding_types\": [\"table_wise\"], \"compute_kernels\": [\"fused\"],\n"
	"                       \"pooling_factors\": [%u] } } ],\n"
	"  \"topology\": { \"world_size\": 1, \"local_world_size\": 1, \"compute_device\": \"%s\",\n"
	"                \"hbm_cap\": \"16G\", \"ddr_cap\": \"16G\", \"batch_size\": %d },\n"
	"  \"trainers_per_node\": 1, \"seed\": %d, \"threads_per_rank\": %u,\n"
	"  \"log_level\": \"error\", \"busy_poll_us\": %u%s }\n";

/* One size on a connected embd and the in-process shards. */
static int run_size(struct e2e *x, struct embd_client *c, uint64_t *step, unsigned busy_poll_us,
		    struct scraper *sc)
{
	struct split se[E2E_ROUNDS], si[E2E_ROUNDS], ss[E2E_ROUNDS] = { { 0 } };
	struct split sq[E2E_ROUNDS] = { { 0 } };
	uint64_t k = 0, d0 = 0, d1 = 0;
	int rc = make_batches(x);

	for (int w = 0; w < 2 && !rc; w++)          /* warm-up */
		rc = embd_step(x, c, (*step)++, k, &d0, &d1) || inprocess_step(x, k++, &d0, &d1);
	for (int r = 0; r < E2E_ROUNDS && !rc; r++) {
		/* 0 embd, 1 in process, 2 embd scraped, 3 embd pipelined */
		for (int mode = 0; mode < 4 && !rc; mode++) {
			uint64_t n = 0, fwd = 0, bwd = 0, t0 = bench_now_ns(), el = 0;
			uint64_t scraped = sc ? atomic_load(&sc->done) : 0;
			if ((mode == 2 && !sc) || (mode == 3 && !x->pipeline))
				continue;
			if (mode == 2)
				atomic_store(&sc->on, true);
			/* the last pipelined step posts no next forward: decided before it starts */
			for (bool last = false; mode == 3 && !rc && !last; n++) {
				last = n && (double)(bench_now_ns() - t0) >= x->round_s * 1e9;
				rc = embd_step_pipelined(x, c, (*step)++, k++, !n, last, &fwd, &bwd);
				el = bench_now_ns() - t0;
			}
			while (mode != 3 && !rc && (!n || (double)el < x->round_s * 1e9)) {
				rc = mode != 1 ? embd_step(x, c, (*step)++, k++, &fwd, &bwd)
					       : inprocess_step(x, k++, &fwd, &bwd);
				n++;
				el = bench_now_ns() - t0;
			}
			if (mode == 2)
				atomic_store(&sc->on, false);
			struct split sp = { (double)n * 1e9 / (double)el, (double)fwd / 1e6 / (double)n,
					    (double)bwd / 1e6 / (double)n, 0 };
			if (mode == 2)
				sp.scrapes_per_s = (double)(atomic_load(&sc->done) - scraped) * 1e9 /
						   (double)el;
			*(mode == 0 ? &se[r] : mode == 1 ? &si[r] : mode == 2 ? &ss[r] : &sq[r]) = sp;
		}
	}
	if (rc)
		return -1;
	qsort(se, E2E_ROUNDS, sizeof(se[0]), compare_split);
	qsort(si, E2E_ROUNDS, sizeof(si[0]), compare_split);
	qsort(ss, E2E_ROUNDS, sizeof(ss[0]), compare_split);
	qsort(sq, E2E_ROUNDS, sizeof(sq[0]), compare_split);
	const struct split *me = &se[E2E_ROUNDS / 2], *mi = &si[E2E_ROUNDS / 2];
	const struct split *ms = &ss[E2E_ROUNDS / 2], *mq = &sq[E2E_ROUNDS / 2];
	char scraped[256] = "", piped[160] = "";
	if (x->pipeline)
		snprintf(piped, sizeof(piped), ",\"pipelined_steps_per_s\":%.2f,\"pipeline_gain\":%.3f",
			 mq->steps_per_s, me->steps_per_s > 0 ? mq->steps_per_s / me->steps_per_s : 0);
	if (sc)
		snprintf(scraped, sizeof(scraped), ",\"scrape_hz\":%.0f,\"scraped_steps_per_s\":%.2f,"
			 "\"scrapes_per_s\":%.1f,\"scrape_failures\":%llu", sc->hz, ms->steps_per_s,
			 ms->scrapes_per_s, (unsigned long long)atomic_load(&sc->failed));
	printf("{\"name\":\"e2e\",\"ids_per_step\":%llu,\"steps_per_s\":%.2f,"
	       "\"inprocess_steps_per_s\":%.2f,\"overhead_ratio\":%.3f,\"batch_size\":%u,"
	       "\"tables\":%d,\"dim\":%d,\"pooling_factor\":%u,\"threads\":%u,\"busy_poll_us\":%u,"
	       "\"fwd_ms\":%.3f,\"bwd_ms\":%.3f,\"inprocess_fwd_ms\":%.3f,\"inprocess_bwd_ms\":%.3f,"
	       "\"dense_us\":%u,\"device\":\"%s\",\"rows\":%lld,\"reference\":\"%s\"%s%s}\n",
	       (unsigned long long)x->ids, me->steps_per_s, mi->steps_per_s,
	       mi->steps_per_s > 0 ? me->steps_per_s / mi->steps_per_s : 0, E2E_BATCH, E2E_TABLES,
	       E2E_DIM, x->pf, x->threads, busy_poll_us, me->fwd_ms, me->bwd_ms, mi->fwd_ms,
	       mi->bwd_ms, x->dense_us, embd_plan_device_name(x->device), (long long)x->rows,
	       x->on_ranks ? "ranks" : "kernels", scraped, piped);
	fflush(stdout);
	return 0;
}

/* Sets up embd (planned for max_pf ids per bag) and the in-process shards, runs every size. */
static int run_all(struct e2e *x, const char *embd, unsigned busy_poll_us, const uint32_t *pfs,
		   int num_sizes, uint32_t max_pf, double scrape_hz)
{
	char config[4096], err[256], metrics[64] = "";
	struct bench_embd e = { 0 };
	struct embd_client *c = NULL;
	struct scraper sc = { .hz = scrape_hz };
	bool scraping = false;
	int rc = -1, fails = 0;

	if (scrape_hz > 0) {
		if (!(sc.port = bench_free_port()))
			goto out;
		snprintf(metrics, sizeof(metrics), ", \"metrics_listen\": \"127.0.0.1:%d\"", sc.port);
	}
	snprintf(config, sizeof(config), e2e_config_fmt, (int)x->rows, E2E_DIM, (double)E2E_LR,
		 (double)E2E_EPS, max_pf, (int)x->rows, E2E_DIM, (double)E2E_LR, (double)E2E_EPS,
		 max_pf, embd_plan_device_name(x->device), E2E_BATCH, E2E_SEED, x->threads,
		 busy_poll_us, metrics);
	if (inprocess_setup(x))
		goto out;
	if (bench_embd_start(embd, config, &e))
		goto out;
	if (scrape_hz > 0) {
		if (scrape_once(sc.port)) {
			fprintf(stderr, "embd-bench e2e: no metrics endpoint on port %d\n", sc.port);
			goto out;
		}
		if (pthread_create(&sc.thread, NULL, scraper_main, &sc))
			goto out;
		scraping = true;
	}
	rc = embd_connect(e.socket_path, 0, 30000, &c, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "embd-bench e2e: connect: %s (%s)\n", embd_strerror(rc), err);
		goto out;
	}
	const struct embd_client_layout *l = embd_layout(c);
	if (l->batch_size != E2E_BATCH || l->total_dim != E2E_TABLES * E2E_DIM ||
	    l->max_values < (uint64_t)E2E_TABLES * E2E_BATCH * max_pf ||
	    l->num_features != E2E_TABLES) {
		fprintf(stderr, "embd-bench e2e: unexpected layout (B %u, dim %u, max_values %llu)\n",
			l->batch_size, l->total_dim, (unsigned long long)l->max_values);
		rc = -1;
		goto out;
	}
	uint64_t step = l->resumed_step;
	for (uint32_t s = 0; s < EMBD_CLIENT_SLOTS; s++) {
		struct embd_batch b;
		if ((rc = embd_batch_get(c, s, &b)))
			goto out;
		memcpy(b.grad, x->grad, (uint64_t)E2E_BATCH * E2E_TABLES * E2E_DIM * sizeof(float));
	}
	for (int i = 0; i < num_sizes; i++) {
		x->pf = pfs[i];
		x->ids = (uint64_t)E2E_TABLES * E2E_BATCH * pfs[i];
		if (run_size(x, c, &step, busy_poll_us, scraping ? &sc : NULL))
			fails++;
	}
	rc = fails ? -1 : 0;
out:
	if (scraping) {
		atomic_store(&sc.quit, true);
		pthread_join(sc.thread, NULL);
	}
	embd_close(c);
	bench_embd_stop(&e);
	inprocess_teardown(x);
	free(x->lengths);
	free(x->values);
	free(x->grad);
	free(x->offsets);
	free(x->pooled);
	return rc ? -1 : 0;
}

int bench_e2e_run(int argc, char **argv)
{
	const char *embd = bench_embd_path(argc, argv);
	uint64_t sizes[8] = { 65536, 262144 };
	int num_sizes = 2, given = 0;
	long nproc = sysconf(_SC_NPROCESSORS_ONLN);
	uint32_t threads = nproc > 0 ? (uint32_t)nproc : 1;
	unsigned busy_poll_us = 50;
	double seconds = 1.0, scrape_hz = 0;
	uint32_t pfs[8], max_pf = 1, dense_us = 0;
	bool pipeline = false, on_ranks = false;
	enum embd_compute_device device = EMBD_DEVICE_CPU;
	long long rows = E2E_ROWS;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--embd") && i + 1 < argc) {
			i++;
		} else if (!strcmp(argv[i], "--ids") && i + 1 < argc && given < 8) {
			sizes[given++] = strtoull(argv[++i], NULL, 0);
			num_sizes = given;
		} else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
			threads = (uint32_t)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
			seconds = atof(argv[++i]);
		} else if (!strcmp(argv[i], "--busy-poll-us") && i + 1 < argc) {
			busy_poll_us = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--scrape-hz") && i + 1 < argc) {
			scrape_hz = atof(argv[++i]);
		} else if (!strcmp(argv[i], "--dense-us") && i + 1 < argc) {
			dense_us = (uint32_t)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--pipeline")) {
			pipeline = true;
		} else if (!strcmp(argv[i], "--device") && i + 1 < argc &&
			   (!strcmp(argv[i + 1], "cpu") || !strcmp(argv[i + 1], "cuda"))) {
			device = !strcmp(argv[++i], "cuda") ? EMBD_DEVICE_CUDA : EMBD_DEVICE_CPU;
			on_ranks = true;
		} else if (!strcmp(argv[i], "--rows") && i + 1 < argc && atoll(argv[i + 1]) > 0 &&
			   atoll(argv[i + 1]) <= (1ll << 30)) {
			rows = atoll(argv[++i]);
		} else {
			fprintf(stderr, "usage: embd-bench e2e [--ids N]... (65536 262144) [--threads T]"
				" [--seconds S per mode per size (1)] [--busy-poll-us U (50)]"
				" [--scrape-hz HZ (0: no scraped mode)] [--dense-us U (0)] [--pipeline]"
				" [--device cpu|cuda] [--rows N (1000000)] [--embd PATH]\n");
			return 2;
		}
	}
	if (threads < 1 || threads > 256)
		threads = 1;
	if (device == EMBD_DEVICE_CUDA) {
		char err[256];
		uint32_t gpus = 0;
		if (embd_ranks_device_count(device, &gpus, err, sizeof(err))) {
			fprintf(stderr, "embd-bench e2e: --device cuda: %s\n", err);
			return 77;
		}
	}
	for (int s = 0; s < num_sizes; s++) {
		uint64_t per = (uint64_t)E2E_TABLES * E2E_BATCH;
		uint64_t pf = (sizes[s] + per - 1) / per;
		pfs[s] = (uint32_t)(pf < 1 ? 1 : pf > 4096 ? 4096 : pf);
		if (pfs[s] > max_pf)
			max_pf = pfs[s];
	}
	struct e2e x = { .threads = threads, .round_s = seconds / E2E_ROUNDS, .dense_us = dense_us,
			 .pipeline = pipeline, .rows = rows, .on_ranks = on_ranks, .device = device };
	if (scrape_hz < 0 || scrape_hz > 100000)
		scrape_hz = 0;
	return run_all(&x, embd, busy_poll_us, pfs, num_sizes, max_pf, scrape_hz) ? 1 : 0;
}
