/*
 * Copy-before-write snapshots (ckpt/ckpt_snapshot.h) on the real step engine: the
 * snapshot must hold every shard's weights and optimizer state exactly as they were at
 * embd_ckpt_snapshot_begin, whatever training steps ran meanwhile - before the copy, during
 * it on another thread, or after it - for per-element state (adam), per-row state
 * (rowwise_adagrad), fp16 weights and a data_parallel table (one copy saved).
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/embedding.h"
#include "ckpt/ckpt_snapshot.h"
#include "engine/ranks.h"
#include "engine/step.h"

#define RANKS 2u
#define BATCH 64u
#define BAG 8u
#define NTAB 3u

struct fixture {
	struct embd_table_spec specs[NTAB];
	struct embd_table_constraints cons[NTAB];
	struct embd_tables tables;
	struct embd_plan plan;
	struct embd_plan_table ptables[NTAB];
	struct embd_plan_shard pshards[NTAB][RANKS];
	struct embd_ranks *ranks;
	struct embd_step *step;
	struct embd_ckpt_snapshot *snap;
	int32_t lengths[NTAB * BATCH];
	int64_t values[NTAB * BATCH * BAG];
	float pooled[BATCH * (48 + 16 + 8)];
	float grad[BATCH * (48 + 16 + 8)];
	struct embd_step_batch batch;
	uint64_t rng;
};

/* t0: 30,000 x 48 adam, row_wise (~8 chunks per shard); t1: 9,000 x 16 rowwise_adagrad fp16,
 * table_wise; t2: 500 x 8 adagrad, data_parallel. */
static void setup(struct fixture *fx)
{
	static const struct { const char *name; int64_t rows; int32_t dim;
			      enum embd_optimizer_type opt; enum embd_sharding_type type;
			      enum embd_data_type dtype; } t[NTAB] = {
		{ "t0", 30000, 48, EMBD_OPT_ADAM, EMBD_SHARD_ROW_WISE, EMBD_DTYPE_FP32 },
		{ "t1", 9000, 16, EMBD_OPT_ROWWISE_ADAGRAD, EMBD_SHARD_TABLE_WISE, EMBD_DTYPE_FP16 },
		{ "t2", 500, 8, EMBD_OPT_ADAGRAD, EMBD_SHARD_DATA_PARALLEL, EMBD_DTYPE_FP32 },
	};
	char err[256] = "";

	memset(fx, 0, sizeof(*fx));
	for (uint32_t i = 0; i < NTAB; i++) {
		fx->specs[i] = (struct embd_table_spec){ .num_embeddings = t[i].rows,
			.embedding_dim = t[i].dim, .data_type = t[i].dtype, .num_features = 1,
			.optimizer = { .type = t[i].opt, .lr = 0.05f, .eps = 1e-8f, .beta1 = 0.9f,
				       .beta2 = 0.999f } };
		snprintf(fx->specs[i].name, sizeof(fx->specs[i].name), "%s", t[i].name);
		snprintf(fx->specs[i].feature_names[0], EMBD_NAME_MAX, "f%u", i);
	}
	fx->tables = (struct embd_tables){ .count = NTAB, .specs = fx->specs, .constraints = fx->cons };
	embd_plan_topology_default(&fx->plan.topology, (int32_t)RANKS);
	fx->plan.topology.batch_size = BATCH;
	fx->plan.topology.compute_device = EMBD_DEVICE_CPU;
	fx->plan.num_tables = NTAB;
	fx->plan.tables = fx->ptables;
	for (uint32_t i = 0; i < NTAB; i++) {
		struct embd_plan_table *pt = &fx->ptables[i];
		int64_t rows = t[i].rows, half = rows / 2;
		strcpy(pt->name, t[i].name);
		pt->sharding_type = t[i].type;
		pt->compute_kernel = EMBD_KERNEL_FUSED;
		pt->shards = fx->pshards[i];
		if (t[i].type == EMBD_SHARD_ROW_WISE) {
			pt->num_shards = 2;
			pt->shards[0] = (struct embd_plan_shard){ 0, 0, half, 0, t[i].dim };
			pt->shards[1] = (struct embd_plan_shard){ 1, half, rows - half, 0, t[i].dim };
		} else if (t[i].type == EMBD_SHARD_DATA_PARALLEL) {
			pt->num_shards = 2;
			pt->shards[0] = (struct embd_plan_shard){ 0, 0, rows, 0, t[i].dim };
			pt->shards[1] = (struct embd_plan_shard){ 1, 0, rows, 0, t[i].dim };
		} else {
			pt->num_shards = 1;
			pt->shards[0] = (struct embd_plan_shard){ 1, 0, rows, 0, t[i].dim };
		}
	}
	int rc = embd_ranks_create(RANKS, 1, &fx->ranks, err, sizeof(err));
	cr_assert_eq(rc, 0, "ranks: %s", err);
	rc = embd_step_create(&fx->tables, &fx->plan, fx->ranks, 5, 1, &fx->step, err, sizeof(err));
	cr_assert_eq(rc, 0, "step: %s", err);
	rc = embd_ckpt_snapshot_create(&fx->tables, fx->step, 0, &fx->snap, err, sizeof(err));
	cr_assert_eq(rc, 0, "snapshot: %s", err);
	embd_step_set_update_hook(fx->step, embd_ckpt_snapshot_before_update, fx->snap);
	fx->rng = 12345;
	for (uint32_t i = 0; i < NTAB * BATCH; i++)
		fx->lengths[i] = BAG;
	for (uint32_t i = 0; i < BATCH * (48 + 16 + 8); i++)
		fx->grad[i] = (float)(i % 13) / 130.0f - 0.05f;
	fx->batch = (struct embd_step_batch){
		.kjt = { .num_features = NTAB, .batch_size = BATCH, .lengths = fx->lengths,
			 .values = fx->values, .num_values = NTAB * BATCH * BAG },
		.pooled = fx->pooled, .pooled_grad = fx->grad,
	};
}

static void teardown(struct fixture *fx)
{
	embd_step_set_update_hook(fx->step, NULL, NULL);
	embd_ckpt_snapshot_destroy(fx->snap);
	embd_step_destroy(fx->step);
	embd_ranks_destroy(fx->ranks);
}

/* One training step over fresh random ids (half of them from a few hot rows, so rows are
 * updated again after the hook saved them). */
static void train(struct fixture *fx)
{
	for (uint32_t f = 0; f < NTAB; f++)
		for (uint32_t i = 0; i < BATCH * BAG; i++) {
			fx->rng = fx->rng * 6364136223846793005ull + 1442695040888963407ull;
			uint64_t r = fx->rng >> 33;
			int64_t rows = fx->specs[f].num_embeddings;
			fx->values[f * BATCH * BAG + i] = (int64_t)(r & 1 ? r % 16 : r % (uint64_t)rows);
		}
	int rc = embd_step_forward(fx->step, &fx->batch, 1);
	cr_assert_eq(rc, 1, "forward: %d %s", rc, fx->batch.err);
	rc = embd_step_backward(fx->step, &fx->batch, 1);
	cr_assert_eq(rc, 0, "backward: %d %s", rc, fx->batch.err);
}

/* The state of every array, copied from the shards: what the snapshot must equal. */
struct saved {
	void *data[16];
	int64_t step[16];
	uint32_t n;
};

static void save_state(struct fixture *fx, struct saved *out)
{
	uint32_t n = embd_step_num_shards(fx->step), k = 0;
	char err[256];

	/* the host views as the shards are now (rows kept apart on a GPU: step.h) */
	cr_assert_eq(embd_step_shards_pull(fx->step, err, sizeof(err)), 0, "%s", err);
	for (uint32_t i = 0; i < n; i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(fx->step, i, &v);
		if (v.replica || !v.shard)
			continue;
		uint64_t bytes[3];
		cr_assert_eq(embd_shard_sizes(&v.shard->desc, &bytes[0], &bytes[1], &bytes[2], err,
					      sizeof(err)), 0);
		const void *src[3] = { v.shard->weights, v.shard->momentum1, v.shard->momentum2 };
		for (int s = 0; s < 3; s++) {
			if (!bytes[s])
				continue;
			cr_assert_lt(k, 16);
			out->data[k] = malloc(bytes[s]);
			memcpy(out->data[k], src[s], bytes[s]);
			out->step[k++] = v.shard->step;
		}
	}
	out->n = k;
}

/* The snapshot against `want`, byte for byte, and the shards must have changed since (so the
 * comparison proves the copy-before-write, not a late copy). */
static void expect_snapshot(struct fixture *fx, const struct saved *want)
{
	uint32_t n;
	const struct embd_ckpt_array *a = embd_ckpt_snapshot_arrays(fx->snap, &n);
	struct saved now;

	save_state(fx, &now);
	cr_assert_eq(n, want->n, "expected %u arrays, got %u", want->n, n);
	uint32_t changed = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t bytes = a[i].file.rows * (a[i].ndim == 1 ? 1 : a[i].file.cols) *
				 (a[i].file.dtype == EMBD_NPY_F2 ? 2 : 4);
		embd_ckpt_snapshot_wait_array(fx->snap, i);
		cr_expect_eq(memcmp(a[i].data, want->data[i], bytes), 0,
			     "array %s differs from the state at begin", a[i].file.name);
		cr_expect_eq(a[i].file.optimizer_step, want->step[i], "%s: optimizer_step",
			     a[i].file.name);
		changed += memcmp(now.data[i], want->data[i], bytes) != 0;
	}
	cr_expect_eq(changed, n, "expected training to change all %u arrays after begin, %u did",
		     n, changed);
	for (uint32_t i = 0; i < now.n; i++)
		free(now.data[i]);
}

static void free_saved(struct saved *s)
{
	for (uint32_t i = 0; i < s->n; i++)
		free(s->data[i]);
}

Test(ckpt_snapshot, steps_before_the_copy_leave_the_snapshot_at_begin)
{
	struct fixture *fx = calloc(1, sizeof(*fx));
	struct saved want;

	setup(fx);
	train(fx);
	save_state(fx, &want);
	embd_ckpt_snapshot_begin(fx->snap);
	for (int i = 0; i < 6; i++)
		train(fx);              /* every update goes through the hook */
	embd_ckpt_snapshot_copy(fx->snap);
	cr_expect_gt(embd_ckpt_snapshot_hook_ns(fx->snap), 0);
	expect_snapshot(fx, &want);
	free_saved(&want);
	teardown(fx);
	free(fx);
}

static void *copy_thread(void *snap)
{
	embd_ckpt_snapshot_copy(snap);
	return NULL;
}

Test(ckpt_snapshot, steps_during_the_copy_leave_the_snapshot_at_begin)
{
	struct fixture *fx = calloc(1, sizeof(*fx));

	setup(fx);
	/* several rounds: the copier and the hooks meet at different chunks each time */
	for (int round = 0; round < 8; round++) {
		struct saved want;
		pthread_t copier;
		train(fx);
		save_state(fx, &want);
		embd_ckpt_snapshot_begin(fx->snap);
		cr_assert_eq(pthread_create(&copier, NULL, copy_thread, fx->snap), 0);
		for (int i = 0; i < 3 + round; i++)
			train(fx);
		pthread_join(copier, NULL);
		expect_snapshot(fx, &want);
		free_saved(&want);
	}
	teardown(fx);
	free(fx);
}

Test(ckpt_snapshot, after_the_copy_steps_cost_nothing_and_change_nothing)
{
	struct fixture *fx = calloc(1, sizeof(*fx));
	struct saved want;

	setup(fx);
	train(fx);
	save_state(fx, &want);
	embd_ckpt_snapshot_begin(fx->snap);
	embd_ckpt_snapshot_copy(fx->snap);
	for (int i = 0; i < 3; i++)
		train(fx);
	cr_expect_eq(embd_ckpt_snapshot_hook_ns(fx->snap), 0,
		     "expected no hook work once the copy ended");
	expect_snapshot(fx, &want);
	free_saved(&want);
	teardown(fx);
	free(fx);
}
