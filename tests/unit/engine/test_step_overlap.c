/*
 * embd_step_backward_overlapped on a cluster (engine/step.h): two forked node processes, each
 * with its own store handle, gloo comm (2 lanes) and step engine over 2 ranks, row_wise tables
 * over all 4 ranks. Node 0 prepares step 1 before step 0's backward and overlaps step 1's id
 * exchange with the update, node 1 steps unpipelined and starts step 1 only DELAY_MS after its
 * backward: node 0's applied callback comes as soon as its update is in, long before its
 * exchange (which waits for node 1) ends, and both nodes' outputs of step 1 and 2 are bit for
 * bit those of the same steps with neither node pipelined. A preparation dropped after its
 * exchange (an abort) breaks the comm, saying why, and the other node's step fails.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "embd/plan.h"
#include "common/clock.h"
#include "dist/comm.h"
#include "dist/store.h"
#include "engine/ranks.h"
#include "engine/step.h"
#include "tests/support/dist_util.h"

TestSuite(step_overlap, .init = tu_server_process_start, .fini = tu_server_process_stop,
	  .timeout = 60);

#define NODES 2u
#define L 2u                    /* ranks and trainers per node */
#define B 16u
#define ROWS 200
#define DIM 16
#define PF 3                    /* ids per bag */
#define STEPS 3u
#define DELAY_MS 400
#define TIMEOUT_MS 1500

enum scenario { PLAIN, OVERLAP, DROP };

/* What the children hand back: node n's pooled outputs of every step, per scenario. */
struct outputs {
	float pooled[3][NODES][STEPS][L][B * 2 * DIM];
};

struct node {
	struct embd_table_spec specs[2];
	struct embd_table_constraints cons[2];
	struct embd_plan *plan;
	struct embd_store *store;
	struct embd_comm *comm;
	struct embd_ranks *ranks;
	struct embd_step *step;
	int32_t lengths[STEPS][L][2 * B];
	int64_t values[STEPS][L][2 * B * PF];
	float pooled[STEPS][L][B * 2 * DIM], grad[L][B * 2 * DIM];
	struct embd_step_batch batches[STEPS][L];
};

static int node_open(struct node *n, int node, const char *prefix, char *err, size_t err_len)
{
	struct embd_topology topo;
	char inner[256];

	memset(n, 0, sizeof(*n));
	for (uint32_t t = 0; t < 2; t++) {
		snprintf(n->specs[t].name, sizeof(n->specs[t].name), "t%u", t);
		n->specs[t].num_embeddings = ROWS;
		n->specs[t].embedding_dim = DIM;
		n->specs[t].optimizer = (struct embd_optimizer_spec){ .type = EMBD_OPT_ADAGRAD,
								      .lr = 0.1f, .eps = 1e-8f };
		n->specs[t].num_features = 1;
		snprintf(n->specs[t].feature_names[0], EMBD_NAME_MAX, "f%u", t);
		n->cons[t] = (struct embd_table_constraints){
			.sharding_types = 1u << EMBD_SHARD_ROW_WISE, .num_pooling_factors = 1,
			.pooling_factors = { PF } };
	}
	embd_plan_topology_default(&topo, (int32_t)(NODES * L));
	topo.local_world_size = (int32_t)L;
	topo.compute_device = EMBD_DEVICE_CPU;
	topo.batch_size = B;
	int rc = embd_plan_build(n->specs, n->cons, 2, &topo, NULL, &n->plan, err, err_len);
	if (rc)
		return rc;
	rc = embd_store_connect("127.0.0.1", tu_port, 5000, &n->store, inner, sizeof(inner));
	if (rc < 0)
		return snprintf(err, err_len, "store: %s", inner), rc;
	char host[32];
	snprintf(host, sizeof(host), "127.0.0.%d", node + 1);
	struct embd_comm_options o = { .backend = EMBD_COMM_GLOO, .rank = (uint32_t)node,
				       .size = NODES, .lanes = L, .timeout_ms = TIMEOUT_MS,
				       .hostname = host, .prefix = prefix };
	if ((rc = embd_comm_create(&o, n->store, &n->comm, inner, sizeof(inner))))
		return snprintf(err, err_len, "comm: %s", inner), rc;
	if ((rc = embd_ranks_create(L, 1, &n->ranks, err, err_len)))
		return rc;
	struct embd_tables tables = { 2, n->specs, n->cons };
	struct embd_step_cluster where = { (uint32_t)node, NODES, n->comm, n->store, TIMEOUT_MS };
	if ((rc = embd_step_create_cluster(&tables, n->plan, n->ranks, 5, L, &where, &n->step, err,
					   err_len)))
		return rc;
	/* step k's batches: ids from a small range (duplicates, every row shard hit) */
	for (uint32_t k = 0; k < STEPS; k++)
		for (uint32_t i = 0; i < L; i++) {
			for (uint32_t j = 0; j < 2 * B; j++)
				n->lengths[k][i][j] = PF;
			for (uint32_t j = 0; j < 2 * B * PF; j++)
				n->values[k][i][j] = (int64_t)((j * 37 + k * 11 + i * 5 + node * 3) %
							       ROWS);
			n->batches[k][i] = (struct embd_step_batch){
				.kjt = { .num_features = 2, .batch_size = B, .lengths = n->lengths[k][i],
					 .values = n->values[k][i], .num_values = 2 * B * PF },
				.pooled = n->pooled[k][i], .pooled_grad = n->grad[i], .trainer = i };
		}
	for (uint32_t i = 0; i < L; i++)
		for (uint32_t j = 0; j < B * 2 * DIM; j++)
			n->grad[i][j] = (float)((int)((j * 7 + i * 3 + (uint32_t)node) % 19) - 9) / 9.0f;
	return 0;
}

static void node_close(struct node *n)
{
	embd_step_destroy(n->step);
	embd_ranks_destroy(n->ranks);
	embd_comm_destroy(n->comm);
	embd_store_close(n->store);
	embd_plan_destroy(n->plan);
}

/* The applied callback: when it came, and with what. */
struct applied {
	int64_t at_ms;
	int rc;
	int calls;
};

static void on_applied(void *arg, int rc)
{
	struct applied *a = arg;

	a->at_ms = embd_now_ms();
	a->rc = rc;
	a->calls++;
}

static struct outputs *shared_out;
static enum scenario scenario_now;

/* One node of a scenario: step 0, then steps 1 and 2 (node 0 overlapping step 1's exchange
 * with step 0's update unless PLAIN; DROP aborts after that exchange). */
static int run_node(int node, void *arg)
{
	const enum scenario sc = scenario_now;
	const char *prefix = sc == PLAIN ? "gloo/plain/" : sc == OVERLAP ? "gloo/overlap/" :
				       "gloo/drop/";
	static struct node nd;
	struct node *n = &nd;
	char err[512] = "";
	int rc;

	(void)arg;
	rc = node_open(n, node, prefix, err, sizeof(err));
	TU_CHECK(rc == 0, "node %d: %d %s", node, rc, err);
	rc = embd_step_forward(n->step, n->batches[0], L);
	TU_CHECK(rc == (int)L, "node %d step 0 forward: %d %s", node, rc, n->batches[0][0].err);
	if (node == 0 && sc != PLAIN) {
		struct applied a = { 0 };
		TU_CHECK(embd_step_prepare(n->step, n->batches[1], L) == (int)L, "prepare");
		rc = embd_step_backward_overlapped(n->step, n->batches[0], L, on_applied, &a);
		const int64_t back_ms = embd_now_ms();
		TU_CHECK(rc == 0, "overlapped backward: %d %s", rc, n->batches[0][0].err);
		TU_CHECK(a.calls == 1 && a.rc == 0, "applied called %d times, rc %d", a.calls, a.rc);
		TU_CHECK(embd_step_exchanged(n->step), "step 1's ids were not exchanged");
		/* node 1 posts step 1 DELAY_MS after its backward: the update was in long before */
		TU_CHECK(back_ms - a.at_ms >= DELAY_MS / 2, "applied came %lld ms before the "
			 "overlapped backward returned, expected about %d (the exchange waits for node "
			 "1)", (long long)(back_ms - a.at_ms), DELAY_MS);
		if (sc == DROP) {
			const char *why = NULL;
			embd_step_abort(n->step, "test");
			TU_CHECK(embd_step_comm_broken(n->step, &why) &&
				 strstr(why, "dropped a step after its input exchange"),
				 "an exchanged step dropped: expected the comm broken saying so, got %s",
				 why ? why : "(not broken)");
			rc = embd_step_forward(n->step, n->batches[1], L);
			TU_CHECK(rc == EMBD_EIO, "forward after the drop: expected EMBD_EIO, got %d",
				 rc);
			node_close(n);
			return 0;
		}
	} else {
		rc = embd_step_backward(n->step, n->batches[0], L);
		TU_CHECK(rc == 0, "node %d backward 0: %d %s", node, rc, n->batches[0][0].err);
		if (node == 1)
			usleep(DELAY_MS * 1000);
	}
	for (uint32_t k = 1; k < STEPS; k++) {
		rc = embd_step_forward(n->step, n->batches[k], L);
		if (sc == DROP) {
			TU_CHECK(rc < 0, "node 1, step 1 with node 0 out of line: expected an error, "
				 "got %d", rc);
			break;
		}
		TU_CHECK(rc == (int)L, "node %d step %u forward: %d %s", node, k, rc,
			 n->batches[k][0].err);
		rc = embd_step_backward(n->step, n->batches[k], L);
		TU_CHECK(rc == 0, "node %d backward %u: %d %s", node, k, rc, n->batches[k][0].err);
	}
	memcpy(shared_out->pooled[sc][node], n->pooled, sizeof(n->pooled));
	node_close(n);
	return 0;
}

static void run_scenario(enum scenario sc)
{
	pid_t pids[NODES];
	int codes[NODES];

	scenario_now = sc;
	tu_spawn_n(run_node, NODES, NULL, pids);
	tu_join(pids, NODES, 30000, codes);
	for (uint32_t i = 0; i < NODES; i++)
		cr_assert_eq(codes[i], 0, "scenario %d: node %u exited %d (its stderr says why)", sc,
			     i, codes[i]);
}

Test(step_overlap, overlapped_exchange_applies_early_and_changes_nothing)
{
	shared_out = mmap(NULL, sizeof(*shared_out), PROT_READ | PROT_WRITE,
			  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(shared_out != MAP_FAILED);
	run_scenario(PLAIN);
	run_scenario(OVERLAP);
	for (uint32_t node = 0; node < NODES; node++)
		for (uint32_t k = 0; k < STEPS; k++)
			cr_expect(!memcmp(shared_out->pooled[PLAIN][node][k],
					  shared_out->pooled[OVERLAP][node][k],
					  sizeof(shared_out->pooled[PLAIN][node][k])),
				  "node %u step %u: outputs differ from the unpipelined steps'", node, k);
	munmap(shared_out, sizeof(*shared_out));
}

Test(step_overlap, a_step_dropped_after_its_exchange_breaks_the_comm)
{
	shared_out = mmap(NULL, sizeof(*shared_out), PROT_READ | PROT_WRITE,
			  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(shared_out != MAP_FAILED);
	run_scenario(DROP);
	munmap(shared_out, sizeof(*shared_out));
}
