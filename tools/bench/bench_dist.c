/*
 * embd-bench dist: training steps per second of the step engine spread over N nodes on
 * loopback (N = 1, 2, 3; 2 ranks and 2 trainers per node, fixed per-trainer batch), for every
 * sharding type, beside a raw Gloo alltoallv of the same byte counts measured in the same run.
 *
 * Each node is a process of its own running what embd runs between its event-loop passes:
 * rendezvous store, gloo comm (dist/comm.h), its ranks and the step engine
 * (embd_step_forward + embd_step_backward over its trainers' batches, in memory: the IPC
 * cost is what `embd-bench e2e` measures). The raw reference is N more processes that call
 * embd_comm_alltoallv directly, four times per step, each node sending to each peer the
 * bytes the engine's exchange of that kind sent (sizes, ids, outputs, gradients; per node,
 * split evenly over its peers). Three alternating rounds of each (--rounds R), medians.
 * ratio_to_raw = steps_per_s / raw_alltoallv_steps_per_s: the
 * share of a step that is the collectives themselves (1 = the engine adds nothing).
 *
 * On one machine the nodes' lookups and optimizer steps share its cores with the collectives,
 * so a third reference runs the whole cluster's work (every trainer's batch, as many ranks) in
 * ONE node process: its compute without any collective (one_node_steps_per_s). A step that
 * does the two one after the other takes 1/raw + 1/one_node seconds (serial_bound);
 * ratio_to_serial_bound above 1 means compute and collectives overlap, below 1 is the
 * engine's own overhead.
 *
 * --cores-per-node K gives node n's processes (its ranks, Gloo's threads) the cores
 * [n*K, (n+1)*K) and the one-node run the cluster's N*K cores, as separate machines would have
 * them; --max-nodes N (1-3) stops at N nodes. --pipeline makes every other block of
 * DIST_BLOCK timed steps of the engine's runs pipelined (engine/step.h): step s + 1 prepared
 * before step s's backward, which exchanges its ids while the ranks apply step s
 * (embd_step_backward_overlapped); steps_per_s is then the plain blocks' rate and
 * pipelined_steps_per_s the pipelined blocks' of the same runs, pipeline_gain the median of
 * the runs' ratios. --steps N times N steps a run.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "embd/plan.h"
#include "dist/comm.h"
#include "engine/ranks.h"
#include "dist/rendezvous.h"
#include "engine/step.h"
#include "dist/store.h"

#define DIST_MAX_NODES 3
#define DIST_L 2                        /* ranks and trainers per node */
#define DIST_MAX_L (DIST_MAX_NODES * DIST_L)    /* the one-node run of a whole cluster's work */
#define DIST_B 512                      /* per-trainer batch */
#define DIST_TABLES 2
#define DIST_ROWS 100000
#define DIST_DIM 64
#define DIST_PF 8                       /* ids per bag */
#define DIST_WARMUP 3
#define DIST_STEPS 20                   /* timed steps per run by default; --steps N */
#define DIST_TIMEOUT_MS 30000
#define DIST_ROUNDS 3                   /* by default; --rounds R, at most DIST_MAX_ROUNDS */
#define DIST_MAX_ROUNDS 15
#define DIST_BLOCK 5                    /* --pipeline: timed steps alternate plain, pipelined */

/* What a node process reports: seconds and steps of its timed steps, [0] plain, [1] pipelined
 * (the engine's steps with --pipeline). */
struct dist_shared {
	double seconds[DIST_MAX_NODES][2];
	int steps[DIST_MAX_NODES][2];
	uint64_t xbytes[DIST_MAX_NODES][EMBD_STEP_EXCHANGES];
	char err[DIST_MAX_NODES][256];
};

struct dist_run {
	enum embd_sharding_type type;
	uint32_t nodes;
	uint32_t local;                         /* ranks and trainers per node */
	uint32_t cores_per_node;                /* 0: every process may run on every core */
	uint32_t cores_this_run;                /* of one process of this run (one-node: all) */
	bool pipelined;                         /* blocks of the engine's steps pipelined */
	int steps;                              /* timed steps per run */
	uint16_t port;
	struct dist_shared *sh;
};

/* Store and comm of node `node` (none on one node). */
static int join(const struct dist_run *r, uint32_t node, const char *prefix,
		struct embd_store_server **server, struct embd_store **store,
		struct embd_comm **comm, char *err, size_t err_len)
{
	struct embd_rendezvous rv;
	char inner[200];

	if (r->nodes == 1)
		return 0;
	embd_rendezvous_defaults(&rv);
	rv.master_port = r->port;
	rv.world_size = (int32_t)(r->nodes * r->local);
	rv.local_world_size = (int32_t)r->local;
	rv.node_rank = (int32_t)node;
	int rc = embd_rendezvous_store(&rv, DIST_TIMEOUT_MS, server, store, inner, sizeof(inner));
	if (rc)
		return snprintf(err, err_len, "store: %s", inner), rc;
	struct embd_comm_options o = { .backend = EMBD_COMM_GLOO, .rank = node, .size = r->nodes,
				       .timeout_ms = DIST_TIMEOUT_MS, .hostname = "",
				       .prefix = prefix };
	rc = embd_comm_create(&o, *store, comm, inner, sizeof(inner));
	if (rc)
		snprintf(err, err_len, "comm: %s", inner);
	return rc;
}

/* One node of the engine run: K steps of its r->local trainers; seconds of the timed ones. */
static int node_main(const struct dist_run *r, uint32_t node)
{
	struct embd_table_spec specs[DIST_TABLES];
	struct embd_table_constraints cons[DIST_TABLES];
	struct embd_topology topo;
	struct embd_plan *plan = NULL;
	struct embd_store_server *server = NULL;
	struct embd_store *store = NULL;
	struct embd_comm *comm = NULL;
	struct embd_ranks *ranks = NULL;
	struct embd_step *step = NULL;
	struct embd_step_batch batches[2][DIST_MAX_L];     /* step s's and step s + 1's */
	const uint32_t L = r->local;
	char *err = r->sh->err[node];
	int32_t *lengths = NULL;
	int64_t *values = NULL;
	float *bufs = NULL;
	int rc;

	memset(specs, 0, sizeof(specs));
	memset(cons, 0, sizeof(cons));
	for (uint32_t t = 0; t < DIST_TABLES; t++) {
		snprintf(specs[t].name, sizeof(specs[t].name), "t%u", t);
		specs[t].num_embeddings = DIST_ROWS;
		specs[t].embedding_dim = DIST_DIM;
		specs[t].optimizer = (struct embd_optimizer_spec){ .type = EMBD_OPT_SGD, .lr = 0.01f };
		specs[t].num_features = 1;
		snprintf(specs[t].feature_names[0], EMBD_NAME_MAX, "f%u", t);
		cons[t] = (struct embd_table_constraints){ .sharding_types = 1u << r->type,
			.min_partition = DIST_DIM / 2, .num_pooling_factors = 1,
			.pooling_factors = { DIST_PF } };
	}
	embd_plan_topology_default(&topo, (int32_t)(r->nodes * L));
	topo.local_world_size = (int32_t)L;
	topo.compute_device = EMBD_DEVICE_CPU;
	topo.batch_size = DIST_B;
	topo.hbm_cap_bytes = 4ull << 30;
	/* every node plans alike: the planner is deterministic (plan.h) */
	rc = embd_plan_build(specs, cons, DIST_TABLES, &topo, NULL, &plan, err, 256);
	if (!rc)
		rc = join(r, node, "bench/step/", &server, &store, &comm, err, 256);
	if (!rc)
		rc = embd_ranks_create(L, 1, &ranks, err, 256);
	struct embd_tables tables = { DIST_TABLES, specs, cons };
	struct embd_step_cluster where = { node, r->nodes, comm, store, DIST_TIMEOUT_MS };
	if (!rc)
		rc = embd_step_create_cluster(&tables, plan, ranks, 7, L, &where, &step, err,
					      256);
	if (rc)
		goto out;
	const uint64_t nl = (uint64_t)DIST_TABLES * DIST_B, nv = nl * DIST_PF;
	const uint64_t out_floats = (uint64_t)DIST_B * DIST_TABLES * DIST_DIM;
	lengths = malloc(nl * sizeof(int32_t));
	values = malloc(L * nv * sizeof(int64_t));
	bufs = malloc(2 * L * out_floats * sizeof(float));
	rc = EMBD_ENOMEM;
	if (!lengths || !values || !bufs)
		goto out;
	uint64_t seed = 1000 + node;
	for (uint64_t i = 0; i < nl; i++)
		lengths[i] = DIST_PF;
	for (uint64_t i = 0; i < L * nv; i++)
		values[i] = (int64_t)(bench_rng_next(&seed) % DIST_ROWS);
	for (uint64_t i = 0; i < 2 * L * out_floats; i++)
		bufs[i] = (float)(bench_rng_next(&seed) % 2001) / 1000.0f - 1.0f;
	for (int j = 0; j < 2; j++)
		for (uint32_t i = 0; i < L; i++)
			batches[j][i] = (struct embd_step_batch){
				.kjt = { .num_features = DIST_TABLES, .batch_size = DIST_B,
					 .lengths = lengths, .values = values + i * nv, .num_values = nv },
				.pooled = bufs + 2 * i * out_floats,
				.pooled_grad = bufs + (2 * i + 1) * out_floats,
			};
	/* step k's backward, then step k + 1's forward: the timed steps are whole steps either
	 * way, and pipelined, step k + 1 is prepared before step k's backward. With --pipeline
	 * blocks of plain and pipelined steps alternate in one run, so both see the same load. */
	uint64_t ns[2] = { 0, 0 };
	int done[2] = { 0, 0 };
	rc = embd_step_forward(step, batches[0], L);
	for (int k = 0; rc >= 0 && k < DIST_WARMUP + r->steps; k++) {
		struct embd_step_batch *cur = batches[k % 2], *next = batches[(k + 1) % 2];
		const bool timed = k >= DIST_WARMUP;
		const int piped = r->pipelined && timed && (k - DIST_WARMUP) / DIST_BLOCK % 2;
		const uint64_t t0 = bench_now_ns();
		for (uint32_t i = 0; i < L; i++)
			next[i].status = 0;
		if (piped) {
			rc = embd_step_prepare(step, next, L);
			if (rc >= 0)
				rc = embd_step_backward_overlapped(step, cur, L, NULL, NULL);
		} else {
			rc = embd_step_backward(step, cur, L);
		}
		if (rc >= 0)
			rc = embd_step_forward(step, next, L);
		if (rc < 0)
			snprintf(err, 256, "step %d: %s", k, cur[0].err[0] ? cur[0].err : next[0].err);
		ns[piped] += timed ? bench_now_ns() - t0 : 0;
		done[piped] += timed;
	}
	if (rc < 0)
		goto out;
	for (int m = 0; m < 2; m++) {
		r->sh->seconds[node][m] = (double)ns[m] / 1e9;
		r->sh->steps[node][m] = done[m];
	}
	struct embd_step_counts counts;
	embd_step_counts(step, &counts);
	memcpy(r->sh->xbytes[node], counts.exchange_bytes, sizeof(counts.exchange_bytes));
	rc = 0;
out:
	free(lengths);
	free(values);
	free(bufs);
	embd_step_destroy(step);
	embd_ranks_destroy(ranks);
	embd_comm_destroy(comm);
	embd_store_close(store);
	embd_store_server_stop(server);
	embd_plan_destroy(plan);
	return rc ? 1 : 0;
}

/* One node of the raw run: the engine's per-exchange byte counts, four alltoallvs a step. */
static int raw_main(const struct dist_run *r, uint32_t node)
{
	struct embd_store_server *server = NULL;
	struct embd_store *store = NULL;
	struct embd_comm *comm = NULL;
	uint64_t sb[EMBD_STEP_EXCHANGES][DIST_MAX_NODES], rb[EMBD_STEP_EXCHANGES][DIST_MAX_NODES];
	uint64_t most_s = 1, most_r = 1;
	char *err = r->sh->err[node];
	void *send = NULL, *recv = NULL;
	int rc;

	for (int e = 0; e < EMBD_STEP_EXCHANGES; e++) {
		uint64_t ts = 0, tr = 0;
		for (uint32_t p = 0; p < r->nodes; p++) {
			sb[e][p] = p == node ? 0 : r->sh->xbytes[node][e] / (r->nodes - 1);
			rb[e][p] = p == node ? 0 : r->sh->xbytes[p][e] / (r->nodes - 1);
			ts += sb[e][p];
			tr += rb[e][p];
		}
		most_s = ts > most_s ? ts : most_s;
		most_r = tr > most_r ? tr : most_r;
	}
	rc = join(r, node, "bench/raw/", &server, &store, &comm, err, 256);
	send = calloc(1, most_s);
	recv = calloc(1, most_r);
	if (!rc && (!send || !recv))
		rc = EMBD_ENOMEM;
	uint64_t t0 = 0;
	for (int k = 0; !rc && k < DIST_WARMUP + r->steps; k++) {
		if (k == DIST_WARMUP)
			t0 = bench_now_ns();
		for (int e = 0; !rc && e < EMBD_STEP_EXCHANGES; e++)
			if ((rc = embd_comm_alltoallv(comm, send, sb[e], recv, rb[e])))
				snprintf(err, 256, "alltoallv: %s", embd_comm_error(comm));
	}
	if (!rc) {
		r->sh->seconds[node][0] = (double)(bench_now_ns() - t0) / 1e9;
		r->sh->steps[node][0] = r->steps;
	}
	free(send);
	free(recv);
	embd_comm_destroy(comm);
	embd_store_close(store);
	embd_store_server_stop(server);
	return rc ? 1 : 0;
}

/* This process (and the threads it starts: ranks, Gloo) on cores [first, first + count). */
static int pin_cores(uint32_t first, uint32_t count)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	for (uint32_t c = first; c < first + count; c++)
		CPU_SET(c, &set);
	return sched_setaffinity(0, sizeof(set), &set);
}

/* Runs fn on every node as a process; steps/s of the slowest, or 0 on failure; *piped (may
 * be NULL): the same of its pipelined steps. */
static double run_nodes(struct dist_run *r, int (*fn)(const struct dist_run *, uint32_t),
			const char *what, double *piped)
{
	pid_t pids[DIST_MAX_NODES];
	double slowest[2] = { 0, 0 };
	bool ok = true;

	r->port = bench_free_port();  /* a fresh store per run */
	if (!r->port)
		return 0;
	memset(r->sh->seconds, 0, sizeof(r->sh->seconds));
	memset(r->sh->steps, 0, sizeof(r->sh->steps));
	for (uint32_t n = 0; n < r->nodes; n++) {
		r->sh->err[n][0] = 0;
		pids[n] = fork();
		if (pids[n] == 0) {
			if (r->cores_this_run && pin_cores(n * r->cores_this_run, r->cores_this_run)) {
				snprintf(r->sh->err[n], sizeof(r->sh->err[n]), "cores %u-%u: %s",
					 n * r->cores_this_run, (n + 1) * r->cores_this_run - 1,
					 strerror(errno));
				_exit(1);
			}
			_exit(fn(r, n));
		}
	}
	for (uint32_t n = 0; n < r->nodes; n++) {
		int st;
		if (pids[n] < 0 || waitpid(pids[n], &st, 0) != pids[n] || !WIFEXITED(st) ||
		    WEXITSTATUS(st)) {
			fprintf(stderr, "embd-bench dist: %s %s on %u nodes, node %u failed: %s\n", what,
				embd_plan_sharding_name(r->type), r->nodes, n, r->sh->err[n]);
			ok = false;
		}
		for (int m = 0; m < 2; m++)
			if (r->sh->seconds[n][m] > slowest[m])
				slowest[m] = r->sh->seconds[n][m];
	}
	if (piped)
		*piped = ok && slowest[1] > 0 ? r->sh->steps[0][1] / slowest[1] : 0;
	return ok && slowest[0] > 0 ? r->sh->steps[0][0] / slowest[0] : 0;
}

int bench_dist_run(int argc, char **argv)
{
	double step_ms[EMBD_SHARD_COUNT][DIST_MAX_NODES + 1] = { { 0 } };
	struct dist_run r = { .steps = DIST_STEPS };
	uint32_t max_nodes = DIST_MAX_NODES;
	bool pipeline = false;
	int rounds = DIST_ROUNDS;

	for (int i = 1; i < argc; i++) {      /* argv[0] is "dist" */
		if (!strcmp(argv[i], "--cores-per-node") && i + 1 < argc) {
			r.cores_per_node = (uint32_t)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--max-nodes") && i + 1 < argc) {
			max_nodes = (uint32_t)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--pipeline")) {
			pipeline = true;
		} else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
			rounds = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
			r.steps = atoi(argv[++i]);
		} else {
			fprintf(stderr, "embd-bench dist: unknown argument %s (--cores-per-node K, "
				"--max-nodes N, --pipeline, --rounds R, --steps N)\n", argv[i]);
			return 2;
		}
	}
	if (rounds < 1 || rounds > DIST_MAX_ROUNDS || r.steps < 1) {
		fprintf(stderr, "embd-bench dist: --rounds %d (1 to %d), --steps %d (1 or more)\n",
			rounds, DIST_MAX_ROUNDS, r.steps);
		return 2;
	}
	if (max_nodes < 1 || max_nodes > DIST_MAX_NODES) {
		fprintf(stderr, "embd-bench dist: --max-nodes %u: 1 to %d\n", max_nodes,
			DIST_MAX_NODES);
		return 2;
	}
	if (r.cores_per_node && (long)(r.cores_per_node * max_nodes) > sysconf(_SC_NPROCESSORS_ONLN)) {
		fprintf(stderr, "embd-bench dist: --cores-per-node %u x %u nodes: this machine has "
			"%ld cores (--max-nodes lowers the count)\n", r.cores_per_node, max_nodes,
			sysconf(_SC_NPROCESSORS_ONLN));
		return 2;
	}
	r.sh = mmap(NULL, sizeof(*r.sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
		    0);
	if (r.sh == MAP_FAILED)
		return 1;
	for (uint32_t n = 1; n <= max_nodes; n++)
		for (int t = 0; t < EMBD_SHARD_COUNT; t++) {
			r.type = (enum embd_sharding_type)t;
			/* engine and raw rounds alternate, medians reported: the load of a shared
			 * machine drifts over a run */
			double eng[DIST_MAX_ROUNDS], piped[DIST_MAX_ROUNDS], rawr[DIST_MAX_ROUNDS];
			double one[DIST_MAX_ROUNDS], gain[DIST_MAX_ROUNDS];
			uint64_t bytes = 0;
			for (int k = 0; k < rounds; k++) {
				r.nodes = n;
				r.local = DIST_L;
				r.cores_this_run = r.cores_per_node;
				r.pipelined = pipeline;
				memset(r.sh->xbytes, 0, sizeof(r.sh->xbytes));
				eng[k] = run_nodes(&r, node_main, "engine", &piped[k]);
				gain[k] = eng[k] > 0 ? piped[k] / eng[k] : 0;
				r.pipelined = false;
				bytes = 0;
				for (uint32_t m = 0; m < n; m++)
					for (int e = 0; e < EMBD_STEP_EXCHANGES; e++)
						bytes += r.sh->xbytes[m][e];
				rawr[k] = n > 1 && eng[k] > 0 ? run_nodes(&r, raw_main, "raw", NULL) : 0;
				/* the cluster's whole work on one node process: its compute alone */
				r.nodes = 1;
				r.local = n * DIST_L;
				r.cores_this_run = n * r.cores_per_node;        /* the cluster's cores */
				one[k] = n > 1 ? run_nodes(&r, node_main, "one-node", NULL) : 0;
			}
			double sps = bench_median(eng, (size_t)rounds);
			double psps = bench_median(piped, (size_t)rounds);
			double pgain = bench_median(gain, (size_t)rounds);
			double raw = bench_median(rawr, (size_t)rounds);
			double alone = bench_median(one, (size_t)rounds);
			step_ms[t][n] = sps > 0 ? 1000.0 / sps : 0;
			printf("{\"name\":\"dist\",\"sharding_type\":\"%s\",\"nodes\":%u,"
			       "\"trainers\":%u,\"batch_per_trainer\":%d,\"cores_per_node\":%u,"
			       "\"steps_per_s\":%.2f,\"bytes_per_step\":%llu,",
			       embd_plan_sharding_name(r.type), n, n * DIST_L, DIST_B, r.cores_per_node,
			       sps, (unsigned long long)bytes);
			if (pipeline)
				printf("\"pipelined_steps_per_s\":%.2f,\"pipeline_gain\":%.3f,", psps,
				       pgain);
			if (raw > 0 && alone > 0) {
				/* compute and collectives one after the other, nothing overlapped */
				double serial = 1.0 / (1.0 / raw + 1.0 / alone);
				printf("\"raw_alltoallv_steps_per_s\":%.2f,\"ratio_to_raw\":%.3f,"
				       "\"one_node_steps_per_s\":%.2f,\"serial_bound_steps_per_s\":%.2f,"
				       "\"ratio_to_serial_bound\":%.3f}\n", raw, sps / raw, alone, serial,
				       sps / serial);
			} else {
				printf("\"raw_alltoallv_steps_per_s\":null,\"ratio_to_raw\":null}\n");
			}
			fflush(stdout);
		}
	for (int t = 0; t < EMBD_SHARD_COUNT; t++) {
		printf("{\"name\":\"dist_scaling\",\"sharding_type\":\"%s\",\"batch_per_trainer\":%d",
		       embd_plan_sharding_name((enum embd_sharding_type)t), DIST_B);
		for (uint32_t n = 1; n <= max_nodes; n++)
			printf(",\"step_ms_%u\":%.2f", n, step_ms[t][n]);
		for (uint32_t n = 2; n <= max_nodes; n++)
			printf(",\"growth_1_to_%u\":%.2f", n,
			       step_ms[t][1] > 0 ? step_ms[t][n] / step_ms[t][1] : 0);
		printf("}\n");
	}
	munmap(r.sh, sizeof(*r.sh));
	return 0;
}
