/*
 * A cluster's checkpoint through the store (ckpt/ckpt_cluster.h), two nodes as two threads
 * of this process with a store handle each and one shared checkpoint_dir. The case: keys a
 * node left behind when it checkpointed a step alone (its generation re-formed before node 0
 * took that step) must not be read when the re-formed cluster checkpoints the same step
 * again. Node 0 used to take node 1's stale report at once and commit the step with node 1's
 * old files before node 1 wrote the new ones: a checkpoint reported ok holding other values.
 * And the per_node restore decision over a step damaged on one node only: refused on both
 * nodes (it used to start afresh), unless checkpoint_allow_fresh_start.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_cluster.h"
#include "dist/store.h"
#include "tests/support/dist_util.h"

#define ROWS 37
#define DIM 12
#define SPLIT 20                        /* node 0 holds rows [0, SPLIT), node 1 the rest */
#define STEP 7

static char root[64];
static struct embd_ckpt_settings config;       /* read by both nodes' threads, never written there */

static void setup(void)
{
	snprintf(root, sizeof(root), "/tmp/embd-ckcl-XXXXXX");
	cr_assert_not_null(mkdtemp(root));
	tu_server_start();
}

static void teardown(void)
{
	char cmd[128];

	tu_server_stop();
	snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(ckpt_cluster, .init = setup, .fini = teardown, .timeout = 60);

/* The value of the weight at (r, c) in version v of the table; its momentum is minus that. */
static float value(int64_t r, uint32_t c, int v)
{
	return (float)(r * 100 + c) / 64.0f + (float)v;
}

struct node {
	uint32_t node;
	uint64_t generation;
	int version;                    /* the values this node writes */
	int delay_ms;                   /* EMBD_CKPT_WRITE_DELAY_ENV's hook */
	int rc;
	char err[768];
};

/* This node's part of step STEP (its rows, weight and momentum) through embd_ckpt_cluster_write. */
static void *write_node(void *arg)
{
	struct node *n = arg;
	const int64_t row = n->node ? SPLIT : 0, rows = n->node ? ROWS - SPLIT : SPLIT;
	struct embd_ckpt_table tab = { .name = "emb", .num_embeddings = ROWS, .embedding_dim = DIM,
				       .data_type = EMBD_DTYPE_FP32,
				       .optimizer = EMBD_OPT_ADAGRAD };
	struct embd_ckpt_manifest m = { .step = STEP, .node = n->node, .num_nodes = 2,
					.plan_hash = 0x1234, .num_tables = 1, .tables = &tab };
	struct embd_ckpt_array arrays[2];
	float *bufs[2];
	struct embd_store *store = NULL;
	uint64_t bytes = 0;

	n->rc = embd_store_connect("127.0.0.1", tu_port, 5000, &store, n->err, sizeof(n->err));
	for (int st = 0; st < 2 && !n->rc; st++) {
		float *b = bufs[st] = malloc(sizeof(float) * (size_t)(rows * DIM));
		for (int64_t r = 0; b && r < rows; r++)
			for (uint32_t c = 0; c < DIM; c++)
				b[r * DIM + c] = value(row + r, c, n->version) * (st ? -1.0f : 1.0f);
		arrays[st] = (struct embd_ckpt_array){ .data = b, .ndim = 2 };
		arrays[st].file = (struct embd_ckpt_file){
			.state = st ? EMBD_CKPT_MOMENTUM1 : EMBD_CKPT_WEIGHT, .node = n->node,
			.row_offset = row, .rows = rows, .cols = DIM, .dtype = EMBD_NPY_F4 };
		snprintf(arrays[st].file.name, sizeof(arrays[st].file.name), "emb.n%u.%s.npy",
			 n->node, st ? "m1" : "w");
	}
	if (!n->rc) {
		struct embd_ckpt_cluster cl = { .store = store, .settings = &config, .node = n->node,
						.num_nodes = 2, .plan_hash = 0x1234,
						.write_delay_ms = n->delay_ms,
						.generation = n->generation };
		n->rc = embd_ckpt_cluster_write(&cl, &m, arrays, 2, &bytes, n->err, sizeof(n->err));
		free(bufs[0]);
		free(bufs[1]);
	}
	free(m.files);
	embd_store_close(store);
	return NULL;
}

/* The committed step STEP holds version v everywhere (every row of both nodes). */
static void expect_version(int v)
{
	char dir[EMBD_CKPT_PATH_MAX + 64], err[512];
	struct embd_ckpt_manifest m;
	static float w[ROWS * DIM], m1[ROWS * DIM];
	struct embd_ckpt_target t = { .table = 0, .rows = ROWS, .cols = DIM,
				      .dtype = EMBD_DTYPE_FP32, .weights = w, .momentum1 = m1 };

	int rc = embd_ckpt_find(root, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err,
				sizeof(err));
	cr_assert_eq(rc, 0, "expected a committed checkpoint, got %d %s", rc, err);
	cr_assert_eq(m.step, STEP);
	rc = embd_ckpt_load(dir, &m, &t, 1, err, sizeof(err));
	cr_assert_eq(rc, 0, "load: %d %s", rc, err);
	embd_ckpt_manifest_free(&m);
	for (int64_t r = 0; r < ROWS; r++)
		for (uint32_t c = 0; c < DIM; c++)
			cr_assert(w[r * DIM + c] == value(r, c, v) && m1[r * DIM + c] == -value(r, c, v),
				  "row %lld col %u (node %d's): expected version %d (%g), got %g",
				  (long long)r, c, r < SPLIT ? 0 : 1, v, value(r, c, v), w[r * DIM + c]);
}

Test(ckpt_cluster, keys_left_by_an_earlier_generation_are_not_read_when_a_step_is_taken_again)
{
	pthread_t t1;

	snprintf(config.checkpoint_dir, sizeof(config.checkpoint_dir), "%s", root);
	config.checkpoint_layout = EMBD_CKPT_SHARED;
	/* generation 0: node 1 alone checkpoints step 7 (version 1); node 0 never takes it (the
	 * cluster re-formed first), so node 1 gives up waiting for the verdict and leaves its
	 * report and its files in .tmp-step-7 */
	config.store_timeout_ms = 200;
	struct node late = { .node = 1, .generation = 0, .version = 1 };
	write_node(&late);
	cr_assert_neq(late.rc, 0, "node 1 alone: expected no verdict, got ok");
	/* generation 1 (restored, trained again): both nodes take step 7 with version 2, node 1
	 * slower than node 0 */
	config.store_timeout_ms = 5000;
	struct node n0 = { .node = 0, .generation = 1, .version = 2 };
	struct node n1 = { .node = 1, .generation = 1, .version = 2, .delay_ms = 600 };
	cr_assert_eq(pthread_create(&t1, NULL, write_node, &n1), 0);
	write_node(&n0);
	pthread_join(t1, NULL);
	cr_expect_eq(n0.rc, 0, "node 0: %d %s", n0.rc, n0.err);
	cr_expect_eq(n1.rc, 0, "node 1: %d %s", n1.rc, n1.err);
	expect_version(2);
}

/* ---- per_node restore over a damaged part --------------------------------------------------- */

static struct embd_ckpt_settings node_config[2];

/* Node n's own whole step-<step> in <root>/n<n> (per_node: only its rows). */
static void write_part(uint32_t n, uint64_t step)
{
	const int64_t row = n ? SPLIT : 0, rows = n ? ROWS - SPLIT : SPLIT;
	struct embd_ckpt_table tab = { .name = "emb", .num_embeddings = ROWS, .embedding_dim = DIM,
				       .data_type = EMBD_DTYPE_FP32, .optimizer = EMBD_OPT_SGD };
	struct embd_ckpt_manifest m = { .step = step, .node = n, .num_nodes = 2, .node_part = true,
					.plan_hash = 0x1234, .num_tables = 1, .tables = &tab };
	float *w = calloc((size_t)(rows * DIM), sizeof(float));
	struct embd_ckpt_array a = { .data = w, .ndim = 2 };
	char err[512];
	uint64_t bytes;

	cr_assert_not_null(w);
	a.file = (struct embd_ckpt_file){ .state = EMBD_CKPT_WEIGHT, .node = n, .row_offset = row,
					  .rows = rows, .cols = DIM, .dtype = EMBD_NPY_F4 };
	snprintf(a.file.name, sizeof(a.file.name), "emb.n%u.w.npy", n);
	int rc = embd_ckpt_write_dir(node_config[n].checkpoint_dir, &m, &a, 1, false, &bytes, err,
				     sizeof(err));
	cr_assert_eq(rc, 0, "node %u: %s", n, err);
	free(w);
	free(m.files);
}

struct finder {
	uint32_t node;
	const char *key;
	int rc;
	uint32_t skipped;
	char err[768];
};

static void *find_node(void *arg)
{
	struct finder *f = arg;
	struct embd_store *store = NULL;
	struct embd_ckpt_skipped sk = { 0 };
	struct embd_ckpt_manifest m = { 0 };
	char dir[EMBD_CKPT_PATH_MAX + 64];

	f->rc = embd_store_connect("127.0.0.1", tu_port, 5000, &store, f->err, sizeof(f->err));
	if (!f->rc) {
		struct embd_ckpt_cluster cl = { .store = store, .settings = &node_config[f->node],
						.node = f->node, .num_nodes = 2, .plan_hash = 0x1234 };
		f->rc = embd_ckpt_cluster_find(&cl, f->key, &sk, dir, sizeof(dir), &m, f->err,
					       sizeof(f->err));
	}
	f->skipped = sk.n;
	embd_ckpt_skipped_free(&sk);
	embd_ckpt_manifest_free(&m);
	embd_store_close(store);
	return NULL;
}

/* Runs both nodes' restore decision under key. */
static void find_both(const char *key, struct finder *f)
{
	pthread_t t1;

	f[0] = (struct finder){ .node = 0, .key = key };
	f[1] = (struct finder){ .node = 1, .key = key };
	cr_assert_eq(pthread_create(&t1, NULL, find_node, &f[1]), 0);
	find_node(&f[0]);
	pthread_join(t1, NULL);
}

/* Step 5 is valid on node 0 and damaged on node 1: no step every node holds remains, and the
 * cluster used to start afresh over it. Both nodes now refuse, until the operator allows it. */
Test(ckpt_cluster, per_node_refuses_a_fresh_start_over_a_part_damaged_on_one_node)
{
	char path[EMBD_CKPT_PATH_MAX + 128];
	struct finder f[2];

	for (uint32_t n = 0; n < 2; n++) {
		node_config[n] = (struct embd_ckpt_settings){ .checkpoint_layout = EMBD_CKPT_PER_NODE,
			.store_timeout_ms = 5000, .node_rank = n, .num_nodes = 2 };
		snprintf(node_config[n].checkpoint_dir, sizeof(node_config[n].checkpoint_dir),
			 "%s/n%u", root, n);
		write_part(n, 5);
	}
	snprintf(path, sizeof(path), "%s/n1/step-5/emb.n1.w.npy", root);
	cr_assert_eq(truncate(path, 64), 0);
	find_both("ckpt/restore", f);
	cr_expect_eq(f[0].rc, EMBD_ECHECKSUM, "node 0: expected a refusal, got %d (%s)", f[0].rc,
		     f[0].err);
	cr_expect(strstr(f[0].err, "node 1") && strstr(f[0].err, "checkpoint_allow_fresh_start"),
		  "node 0's refusal names node 1 and the key: '%s'", f[0].err);
	cr_expect_neq(f[1].rc, 0, "node 1 must not start afresh either");
	cr_expect_neq(f[1].rc, EMBD_ENOENT, "node 1: %s", f[1].err);
	cr_expect_eq(f[1].skipped, 1, "node 1 skipped its damaged step 5");
	for (uint32_t n = 0; n < 2; n++)
		node_config[n].checkpoint_allow_fresh_start = true;
	find_both("ckpt/restore-allowed", f);
	cr_expect(f[0].rc == EMBD_ENOENT && f[1].rc == EMBD_ENOENT, "allowed: a fresh start on "
		  "both nodes, got %d (%s) and %d (%s)", f[0].rc, f[0].err, f[1].rc, f[1].err);
}
