/*
 * The checkpoint service (ckpt/ckpt_service.h) over a real step engine: a checkpoint written
 * under one plan restores under another (per-row optimizer state across a column merge
 * becomes the column-weighted mean), other tables are refused, damaged checkpoints are moved
 * aside and a fresh start over them refused unless allowed, a second service on the directory
 * and another node's part are refused, and the triggers: every N steps (one node: after a
 * slow write, with the skipped ones counted; a cluster: the multiples of N), every T seconds,
 * on request, with retention.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/embedding.h"
#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_service.h"
#include "engine/step.h"
#include "tests/support/dir_util.h"
#include "tests/support/dist_util.h"

static char root[64];

static void setup(void)
{
	tu_tmpdir(root, sizeof(root), "embd-ckpt-service");
}

static void teardown(void)
{
	tu_rmtree(root);
}

TestSuite(checkpoint, .init = setup, .fini = teardown, .timeout = 60);

/* A cluster node's tests also need a store to talk to (nobody else on it). */
static void cluster_setup(void)
{
	setup();
	tu_server_start();
}

static void cluster_teardown(void)
{
	tu_server_stop();
	teardown();
}

static bool has_dir(const char *name)
{
	return tu_has_entry(root, name);
}

/* ---- the service: restore into a step engine under another plan -------------------------- */

struct node {
	struct embd_table_spec specs[2];
	struct embd_table_constraints cons[2];
	struct embd_ckpt_settings config;
	struct embd_plan plan;
	struct embd_plan_table ptables[2];
	struct embd_plan_shard pshards[2][4];
	struct embd_ranks *ranks;
	struct embd_step *step;
	struct embd_ckpt_service *ck;
};

/* Tables t0 (40 x 16, adagrad) and t1 (23 x 8, rowwise_adagrad), sharded as `kind`. */
static void node_start(struct node *n, const char *kind, uint32_t num_ranks)
{
	struct embd_optimizer_spec ada = { .type = EMBD_OPT_ADAGRAD, .lr = 0.1f, .eps = 1e-8f };
	struct embd_optimizer_spec rwa = { .type = EMBD_OPT_ROWWISE_ADAGRAD, .lr = 0.1f, .eps = 1e-8f };
	char err[512] = "";

	memset(n, 0, sizeof(*n));
	n->specs[0] = (struct embd_table_spec){ .name = "t0", .num_embeddings = 40,
		.embedding_dim = 16, .optimizer = ada, .num_features = 1, .feature_names = { "a" } };
	n->specs[1] = (struct embd_table_spec){ .name = "t1", .num_embeddings = 23,
		.embedding_dim = 8, .optimizer = rwa, .num_features = 1, .feature_names = { "b" } };
	n->config.tables = (struct embd_tables){ .count = 2, .specs = n->specs, .constraints = n->cons };
	snprintf(n->config.checkpoint_dir, sizeof(n->config.checkpoint_dir), "%s", root);
	n->config.checkpoint_keep = 3;
	embd_plan_topology_default(&n->plan.topology, (int32_t)num_ranks);
	n->plan.topology.batch_size = 4;
	n->plan.topology.compute_device = EMBD_DEVICE_CPU;
	n->config.num_nodes = 1;
	n->plan.num_tables = 2;
	n->plan.tables = n->ptables;
	for (uint32_t t = 0; t < 2; t++) {
		struct embd_plan_table *pt = &n->ptables[t];
		int64_t rows = n->specs[t].num_embeddings;
		int32_t dim = n->specs[t].embedding_dim;
		strcpy(pt->name, n->specs[t].name);
		pt->compute_kernel = EMBD_KERNEL_FUSED;
		pt->shards = n->pshards[t];
		if (!strcmp(kind, "tw")) {
			pt->sharding_type = EMBD_SHARD_TABLE_WISE;
			pt->num_shards = 1;
			pt->shards[0] = (struct embd_plan_shard){ (int32_t)(t % num_ranks), 0, rows, 0, dim };
		} else if (!strcmp(kind, "rw")) {
			pt->sharding_type = EMBD_SHARD_ROW_WISE;
			pt->num_shards = num_ranks;
			int64_t block = (rows + num_ranks - 1) / num_ranks;
			for (uint32_t r = 0; r < num_ranks; r++)
				pt->shards[r] = (struct embd_plan_shard){ (int32_t)r, block * r,
					r + 1 < num_ranks ? block : rows - block * r, 0, dim };
		} else {
			pt->sharding_type = EMBD_SHARD_COLUMN_WISE;
			pt->num_shards = 2;
			pt->shards[0] = (struct embd_plan_shard){ 0, 0, rows, 0, dim / 4 };
			pt->shards[1] = (struct embd_plan_shard){ (int32_t)(1 % num_ranks), 0, rows,
								  dim / 4, dim - dim / 4 };
		}
	}
	cr_assert_eq(embd_ranks_create(num_ranks, 1, &n->ranks, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_step_create(&n->config.tables, &n->plan, n->ranks, 7, 2, &n->step, err,
				      sizeof(err)), 0, "%s", err);
	int rc = embd_ckpt_service_create(&n->config, n->step, &n->plan, &n->ck, err, sizeof(err));
	cr_assert_eq(rc, 0, "ckpt_service_create: %d %s", rc, err);
}

static void node_stop(struct node *n)
{
	embd_ckpt_service_destroy(n->ck);
	embd_step_destroy(n->step);
	embd_ranks_destroy(n->ranks);
}

/* Distinctive weights and state: w = f(table, row, col); per-row state = g(row, shard cols). */
static void node_fill(struct node *n)
{
	for (uint32_t i = 0; i < embd_step_num_shards(n->step); i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(n->step, i, &v);
		const struct embd_shard_desc *d = &v.shard->desc;
		for (int64_t r = 0; r < d->rows; r++) {
			for (uint32_t c = 0; c < d->cols; c++) {
				float w = (float)(v.table * 1000 + (d->row_offset + r) * 17 + d->col_offset + c) / 8.0f;
				((float *)v.shard->weights)[r * d->cols + c] = w;
				if (v.table == 0)
					v.shard->momentum1[r * d->cols + c] = w * 2;
			}
			if (v.table == 1)
				v.shard->momentum1[r] = (float)(d->row_offset + r) + (float)d->col_offset;
		}
		v.shard->step = 11;
	}
	embd_step_shards_changed(n->step);      /* host views written: the devices get them */
}

/* A node sharded as kind on num_ranks writes its filled shards as checkpoint `step`. */
static void node_write(const char *kind, uint32_t num_ranks, uint64_t step)
{
	struct node a;

	node_start(&a, kind, num_ranks);
	node_fill(&a);
	cr_assert_eq(embd_ckpt_service_final(a.ck, step), 0);
	node_stop(&a);
}

Test(checkpoint, service_restores_under_another_plan)
{
	struct node b;
	char err[512] = "";
	uint64_t step;

	node_write("cw", 2, 17);
	node_start(&b, "rw", 1);         /* CW on 2 ranks -> RW (one row block) on 1 rank */
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_assert_eq(rc, 0, "restore: %d %s", rc, err);
	cr_expect_eq(step, 17);
	uint32_t bad = 0;
	for (uint32_t t = 0; t < 2; t++)
		for (int64_t r = 0; r < b.specs[t].num_embeddings; r++)
			for (uint32_t c = 0; c < (uint32_t)b.specs[t].embedding_dim; c++) {
				float got, want = (float)(t * 1000 + r * 17 + c) / 8.0f;
				cr_assert_eq(embd_step_read_weight(b.step, t, r, c, 0, &got), 0);
				if (got != want && bad++ < 5)
					cr_expect(false, "t%u (%lld, %u): expected %g, got %g", t,
						  (long long)r, c, want, got);
			}
	cr_expect_eq(bad, 0, "%u weights differ", bad);
	struct embd_step_shard_view v;
	for (uint32_t i = 0; i < embd_step_num_shards(b.step); i++) {
		embd_step_shard_view(b.step, i, &v);
		const struct embd_shard_desc *d = &v.shard->desc;
		cr_expect_eq(v.shard->step, 11, "optimizer step restored");
		for (int64_t r = 0; r < d->rows; r++) {
			if (v.table == 0) {
				float w = (float)((d->row_offset + r) * 17 + 3) / 8.0f;
				cr_expect_eq(v.shard->momentum1[r * d->cols + 3], w * 2);
				continue;
			}
			/* source shards: cols [0, 2) with state row + 0, cols [2, 8) with row + 2 */
			float want = ((float)(d->row_offset + r) * 2 + (float)(d->row_offset + r + 2) * 6) / 8;
			cr_expect(fabsf(v.shard->momentum1[r] - want) < 1e-5f,
				  "t1 row %lld per-row state: expected the column-weighted mean %g, got %g",
				  (long long)(d->row_offset + r), want, v.shard->momentum1[r]);
		}
	}
	node_stop(&b);
}

Test(checkpoint, service_refuses_other_tables)
{
	struct node b;
	char err[512] = "";
	uint64_t step;

	node_write("tw", 2, 3);
	node_start(&b, "tw", 2);
	b.specs[1].num_embeddings = 24;  /* the config changed the table's rows */
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EMISMATCH, "expected EMBD_EMISMATCH, got %d (%s)", rc, err);
	cr_expect(strstr(err, "'t1'") && strstr(err, "23 x 8"), "got '%s'", err);
	b.specs[1].num_embeddings = 23;
	strcpy(b.specs[1].name, "t9");
	rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EMISMATCH);
	cr_expect(strstr(err, "'t9'"), "got '%s'", err);
	node_stop(&b);
}

/* Truncates the first .npy file of step-<step> so that its check fails. */
static void damage_step(uint64_t step)
{
	char dir[256], path[600];
	DIR *d;
	bool done = false;

	snprintf(dir, sizeof(dir), "%s/step-%llu", root, (unsigned long long)step);
	cr_assert_not_null(d = opendir(dir));
	for (struct dirent *e; !done && (e = readdir(d));)
		if (strstr(e->d_name, ".npy")) {
			snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
			cr_assert_eq(truncate(path, 100), 0);
			done = true;
		}
	closedir(d);
	cr_assert(done, "no .npy file in %s", dir);
}

Test(checkpoint, service_refuses_a_fresh_start_over_damaged_checkpoints)
{
	struct node b;
	char err[1024] = "";
	uint64_t step = 99;

	node_write("tw", 2, 3);
	damage_step(3);
	node_start(&b, "tw", 2);
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_ECHECKSUM, "expected a refusal (EMBD_ECHECKSUM), got %d (%s)", rc,
		     err);
	cr_expect(strstr(err, "step-3") && strstr(err, "checkpoint_allow_fresh_start"), "got '%s'",
		  err);
	cr_expect(has_dir("step-3"), "a refusal leaves the damaged checkpoint in place");
	b.config.checkpoint_allow_fresh_start = true;
	rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, 0, "allowed: %d %s", rc, err);
	cr_expect_eq(step, 0);
	cr_expect(!has_dir("step-3") && tu_count_damaged(root, "step-3-") == 1,
		  "the damaged checkpoint must be moved to damaged/, not deleted");
	node_stop(&b);
}

/* Every damaged checkpoint is in damaged/ already (moved there by retention or an earlier
 * start) and no step-<N> is left: still no silent fresh start. */
Test(checkpoint, service_refuses_a_fresh_start_while_damaged_holds_checkpoints)
{
	struct node b;
	char err[1024] = "", dir[128], moved[4200];
	uint64_t step = 99;

	node_write("tw", 2, 3);
	damage_step(3);
	snprintf(dir, sizeof(dir), "%s/step-3", root);
	cr_assert_eq(embd_ckpt_move_damaged(root, dir, moved, sizeof(moved), err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_ckpt_count_damaged(root), 1);
	node_start(&b, "tw", 2);
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_ECHECKSUM, "expected a refusal (EMBD_ECHECKSUM), got %d (%s)", rc,
		     err);
	cr_expect(strstr(err, "damaged") && strstr(err, "checkpoint_allow_fresh_start"),
		  "expected the refusal to name damaged/ and the key, got '%s'", err);
	b.config.checkpoint_allow_fresh_start = true;
	rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, 0, "allowed: %d %s", rc, err);
	cr_expect_eq(step, 0);
	cr_expect_eq(tu_count_damaged(root, "step-3-"), 1, "damaged/ is left as it is");
	/* once a valid checkpoint exists, damaged/ no longer matters */
	cr_assert_eq(embd_ckpt_service_final(b.ck, 5), 0);
	node_stop(&b);
	node_start(&b, "tw", 2);
	rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect(rc == 0 && step == 5, "expected step 5 restored, got %d step %llu (%s)", rc,
		  (unsigned long long)step, err);
	node_stop(&b);
}

Test(checkpoint, service_moves_newer_damaged_ones_aside_and_keeps_the_valid_one)
{
	struct node b;
	char err[1024] = "";
	uint64_t step = 0;

	node_write("tw", 2, 3);
	node_write("tw", 2, 6);
	damage_step(6);
	node_start(&b, "tw", 2);
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_assert_eq(rc, 0, "restore: %d %s", rc, err);
	cr_expect_eq(step, 3);
	cr_expect(!has_dir("step-6") && tu_count_damaged(root, "step-6-") == 1, "step 6 moved aside");
	/* keep 1: the next checkpoint (step 4) replaces step 3; no damaged one holds its slot */
	b.config.checkpoint_keep = 1;
	cr_assert_eq(embd_ckpt_service_final(b.ck, 4), 0);
	cr_expect(has_dir("step-4") && !has_dir("step-3"), "keep 1: the new checkpoint stays");
	node_stop(&b);
}

/* Replaces text `from` by `to` in step-<step>'s manifest. */
static void edit_manifest(uint64_t step, const char *from, const char *to)
{
	char path[256], text[65536];

	snprintf(path, sizeof(path), "%s/step-%llu/manifest.json", root, (unsigned long long)step);
	FILE *f = fopen(path, "r");
	cr_assert_not_null(f);
	size_t n = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	text[n] = 0;
	char *at = strstr(text, from);
	cr_assert_not_null(at, "'%s' not in %s", from, path);
	f = fopen(path, "w");
	cr_assert_not_null(f);
	fprintf(f, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
	fclose(f);
}

Test(checkpoint, service_is_the_one_owner_of_its_directory)
{
	struct node a, b;
	struct embd_ckpt_service *second = NULL;
	char err[1024] = "", pid[32];
	uint64_t step;

	node_start(&a, "tw", 2);
	int rc = embd_ckpt_service_create(&a.config, a.step, &a.plan, &second, err, sizeof(err));
	snprintf(pid, sizeof(pid), "pid %d", (int)getpid());
	cr_expect_eq(rc, EMBD_EBUSY, "a second service on the directory: got %d", rc);
	cr_expect(strstr(err, pid) && strstr(err, root), "got '%s'", err);
	cr_expect_null(second);
	node_fill(&a);
	cr_assert_eq(embd_ckpt_service_final(a.ck, 5), 0);
	node_stop(&a);
	/* one node's part of a per_node checkpoint is not this one node's to restore */
	edit_manifest(5, "\"node\":0,\"num_nodes\":1", "\"node\":1,\"num_nodes\":2,"
		      "\"layout\":\"per_node\"");
	node_start(&b, "tw", 2);
	rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EMISMATCH, "a per_node part restored on one node: got %d (%s)", rc,
		     err);
	cr_expect(strstr(err, "per_node") && strstr(err, "node 1 of 2"), "got '%s'", err);
	node_stop(&b);
}

/* Waits (up to 10 s) until the service finished checkpoint seq. */
static void wait_written(struct node *n, uint64_t seq)
{
	for (int i = 0; i < 1000 && embd_ckpt_service_reap(n->ck) < seq; i++)
		usleep(10000);
	cr_assert_geq(embd_ckpt_service_reap(n->ck), seq, "checkpoint %llu not written in 10 s",
		      (unsigned long long)seq);
}

static bool has_step(uint64_t step)
{
	char dir[4200];
	embd_ckpt_dir_name(root, step, dir, sizeof(dir));
	return access(dir, F_OK) == 0;
}

Test(checkpoint, service_triggers_and_retention)
{
	struct node n;
	char *json = NULL;

	node_start(&n, "tw", 1);
	n.config.checkpoint_every_steps = 3;
	n.config.checkpoint_keep = 2;
	cr_expect(!embd_ckpt_service_due(n.ck, 2) && embd_ckpt_service_due(n.ck, 3),
		  "due says every_steps: not at step 2, at step 3");
	embd_ckpt_service_poll(n.ck, 1);
	embd_ckpt_service_poll(n.ck, 2);
	cr_expect_eq(embd_ckpt_service_reap(n.ck), 0, "nothing is due before step 3");
	embd_ckpt_service_poll(n.ck, 3);
	wait_written(&n, 1);
	cr_expect(has_step(3));
	embd_ckpt_service_poll(n.ck, 5);
	embd_ckpt_service_poll(n.ck, 6);
	wait_written(&n, 2);
	embd_ckpt_service_poll(n.ck, 9);
	wait_written(&n, 3);
	cr_expect(has_step(6) && has_step(9) && !has_step(3), "keep 2: steps 6 and 9 stay");
	/* every T seconds: only once T passed, and only when steps ran since the last one */
	n.config.checkpoint_every_steps = 0;
	n.config.checkpoint_every_seconds = 1;
	embd_ckpt_service_poll(n.ck, 10);
	cr_expect_eq(embd_ckpt_service_reap(n.ck), 3, "not due before a second passed");
	usleep(1100000);
	embd_ckpt_service_poll(n.ck, 10);
	wait_written(&n, 4);
	cr_expect(has_step(10));
	usleep(1100000);
	embd_ckpt_service_poll(n.ck, 10);
	cr_expect_eq(embd_ckpt_service_reap(n.ck), 4, "no new step, no new checkpoint");
	/* a request for a step already on disk completes at once, successfully */
	cr_expect(!embd_ckpt_service_due(n.ck, 10), "nothing due at step 10 before the request");
	uint64_t seq = embd_ckpt_service_request(n.ck);
	cr_expect(embd_ckpt_service_due(n.ck, 10), "one node: a request is due at once");
	embd_ckpt_service_poll(n.ck, 10);
	wait_written(&n, seq);
	cr_assert_eq(embd_ckpt_service_result_json(n.ck, &json), 0);
	cr_expect(strstr(json, "\"ok\":true") && strstr(json, "step-10"), "got %s", json);
	free(json);
	node_stop(&n);
}

/* A write slower than every_steps: the due checkpoint is taken after it, and the boundaries
 * that passed meanwhile are counted (checkpoint.skipped) instead of vanishing silently. */
Test(checkpoint, every_steps_behind_a_slow_write_counts_the_skipped_ones)
{
	struct node n;
	char *json = NULL;

	setenv("EMBD_TEST_CKPT_WRITE_DELAY_MS", "400", 1);
	node_start(&n, "tw", 1);
	unsetenv("EMBD_TEST_CKPT_WRITE_DELAY_MS");
	n.config.checkpoint_every_steps = 2;
	cr_expect(embd_ckpt_service_poll(n.ck, 2), "step 2 is due");
	for (uint64_t s = 3; s <= 8; s++)
		cr_expect(!embd_ckpt_service_poll(n.ck, s), "step %llu: the write of step 2 runs",
			  (unsigned long long)s);
	wait_written(&n, 1);
	cr_expect(embd_ckpt_service_poll(n.ck, 9), "due since step 4: taken after the write");
	wait_written(&n, 2);
	cr_expect(has_step(9));
	json = strdup("{}");
	cr_assert_eq(embd_ckpt_service_status_add(n.ck, &json), 0);
	cr_expect(strstr(json, "\"skipped\":2"), "boundaries 4, 6, 8 passed, one taken late at "
		  "9: expected skipped 2 in %s", json);
	free(json);
	node_stop(&n);
}

/* A cluster's every_steps are the multiples of N, not N after the last one this node took (an
 * agreed one, or one a node took alone while the cluster re-formed), so every node is due at
 * the same steps. Node 0 of 2 with no node 1: each write fails after store_timeout_ms. */
Test(checkpoint, cluster_every_steps_are_its_multiples, .init = cluster_setup,
     .fini = cluster_teardown)
{
	struct node n;
	char err[512] = "";

	node_start(&n, "tw", 1);
	embd_ckpt_service_destroy(n.ck);
	n.config.num_nodes = 2;
	snprintf(n.config.master_addr, sizeof(n.config.master_addr), "127.0.0.1");
	n.config.master_port = tu_port;
	n.config.store_timeout_ms = 200;
	n.config.checkpoint_every_steps = 5;
	int rc = embd_ckpt_service_create(&n.config, n.step, &n.plan, &n.ck, err, sizeof(err));
	cr_assert_eq(rc, 0, "ckpt_service_create on a cluster: %d %s", rc, err);
	embd_ckpt_service_request(n.ck);
	cr_expect(!embd_ckpt_service_due(n.ck, 3), "a cluster's request is not due until agreed");
	embd_ckpt_service_agreed(n.ck);
	cr_expect(embd_ckpt_service_due(n.ck, 3), "an agreed checkpoint is due");
	cr_expect(embd_ckpt_service_poll(n.ck, 3), "an agreed checkpoint at step 3");
	cr_expect(embd_ckpt_service_due(n.ck, 5), "step 5 is due while step 3's write runs");
	wait_written(&n, 1);
	cr_expect(embd_ckpt_service_poll(n.ck, 5), "step 5: due (a multiple of 5)");
	wait_written(&n, 2);
	cr_expect(!embd_ckpt_service_due(n.ck, 8), "step 8: due says not due");
	cr_expect(!embd_ckpt_service_poll(n.ck, 8), "step 8: not due (5 after step 3)");
	cr_expect(embd_ckpt_service_poll(n.ck, 10), "step 10: due");
	wait_written(&n, 3);
	node_stop(&n);
}
