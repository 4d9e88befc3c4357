/*
 * tests/unit/engine/step_fixture.h - what the step engine's unit tests share: two tables (t0:
 * features a, b, sum, 16 columns; t1: feature c, mean, 8 columns) planned by hand for every
 * sharding type on 2 or 4 ranks, the step engine over them, the unsharded reference of each
 * table (tests/support/reference.c) as column slices where a shard keeps per-row state,
 * deterministic trainer batches (lengths 0..3, duplicate ids, every row shard hit), and the
 * checks of forward outputs and weights against the reference.
 */
#ifndef EMBD_TESTS_STEP_FIXTURE_H
#define EMBD_TESTS_STEP_FIXTURE_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/embedding.h"
#include "engine/step.h"
#include "tests/support/reference.h"

#define SEED 77u
#define B 6u
#define MAX_T 4u
#define NTAB 2u
#define RW_TOL 2e-6f

/* The gradient division the step engine is given (embd_step_set_grad_divisor; 0: none) and
 * the reference applies. */
static uint32_t grad_divisor;

struct fixture {
	struct embd_tables tables;
	struct embd_table_spec specs[NTAB];
	struct embd_table_constraints cons[NTAB];
	struct embd_plan plan;
	struct embd_plan_table ptables[NTAB];
	struct embd_plan_shard pshards[NTAB][8];
	struct embd_ranks *ranks;
	struct embd_step *step;
	/* the reference of each table, as column slices: one slice of all columns, except where
	 * the optimizer's state is per shard row (see slice_per_shard) */
	struct embd_ref_table *ref[NTAB][8];
	uint32_t ref_col[NTAB][8], ref_cols[NTAB][8], num_refs[NTAB];
};

/*
 * rowwise_adagrad keeps one state value per row of a SHARD, as FBGEMM's TBE does under
 * TorchRec's column-wise sharding: each column shard then trains like a table of its own
 * columns, so that is what the reference is for those plans.
 */
static inline bool slice_per_shard(const struct fixture *fx, uint32_t t)
{
	enum embd_sharding_type type = fx->plan.tables[t].sharding_type;
	return fx->specs[t].optimizer.type == EMBD_OPT_ROWWISE_ADAGRAD &&
	       (type == EMBD_SHARD_COLUMN_WISE || type == EMBD_SHARD_TABLE_COLUMN_WISE);
}

/* Trainer batches: lengths 0..3 (so empty bags occur), ids from a small range (duplicates). */
struct trainer {
	int32_t lengths[3 * B];
	int64_t values[3 * B * 3];
	float weights[3 * B * 3];
	float pooled[B * 40];
	float grad[B * 40];
	struct embd_step_batch batch;
};

static inline void make_tables(struct fixture *fx, enum embd_optimizer_type opt)
{
	struct embd_optimizer_spec o = { .type = opt, .lr = 0.05f, .eps = 1e-8f, .beta1 = 0.9f,
					 .beta2 = 0.999f };
	memset(fx, 0, sizeof(*fx));
	fx->specs[0] = (struct embd_table_spec){ .name = "t0", .num_embeddings = 40,
		.embedding_dim = 16, .pooling = EMBD_POOLING_SUM, .optimizer = o, .num_features = 2,
		.feature_names = { "a", "b" } };
	fx->specs[1] = (struct embd_table_spec){ .name = "t1", .num_embeddings = 23,
		.embedding_dim = 8, .pooling = EMBD_POOLING_MEAN, .optimizer = o, .num_features = 1,
		.feature_names = { "c" } };
	fx->tables = (struct embd_tables){ .count = NTAB, .specs = fx->specs,
					   .constraints = fx->cons };
}

/* The plan of every table sharded as type over num_ranks ranks. */
static inline void make_plan(struct fixture *fx, enum embd_sharding_type type, uint32_t num_ranks)
{
	embd_plan_topology_default(&fx->plan.topology, (int32_t)num_ranks);
	fx->plan.topology.batch_size = B;
	fx->plan.topology.compute_device = EMBD_DEVICE_CPU;
	fx->plan.num_tables = NTAB;
	fx->plan.tables = fx->ptables;
	for (uint32_t t = 0; t < NTAB; t++) {
		struct embd_plan_table *pt = &fx->ptables[t];
		int64_t rows = fx->specs[t].num_embeddings;
		int32_t dim = fx->specs[t].embedding_dim;
		strcpy(pt->name, fx->specs[t].name);
		pt->sharding_type = type;
		pt->compute_kernel = EMBD_KERNEL_FUSED;
		pt->shards = fx->pshards[t];
		switch (type) {
		case EMBD_SHARD_TABLE_WISE:
			pt->num_shards = 1;
			pt->shards[0] = (struct embd_plan_shard){ (int32_t)((t + 1) % num_ranks), 0, rows,
								  0, dim };
			break;
		case EMBD_SHARD_COLUMN_WISE:
		case EMBD_SHARD_TABLE_COLUMN_WISE:
			/* three column shards: two ranks hold one each, one rank holds two */
			pt->num_shards = 3;
			pt->shards[0] = (struct embd_plan_shard){ 0, 0, rows, 0, dim / 4 };
			pt->shards[1] = (struct embd_plan_shard){ (int32_t)(1 % num_ranks), 0, rows,
								  dim / 4, dim / 4 };
			pt->shards[2] = (struct embd_plan_shard){ 0, 0, rows, dim / 2, dim / 2 };
			break;
		case EMBD_SHARD_ROW_WISE:
		case EMBD_SHARD_TABLE_ROW_WISE: {
			int64_t block = (rows + num_ranks - 1) / num_ranks;
			pt->num_shards = 0;
			for (uint32_t r = 0; r < num_ranks && block * r < rows; r++) {
				int64_t n = rows - block * r < block ? rows - block * r : block;
				pt->shards[pt->num_shards++] = (struct embd_plan_shard){ (int32_t)r,
					block * r, n, 0, dim };
			}
			break;
		}
		case EMBD_SHARD_DATA_PARALLEL:
			pt->num_shards = num_ranks;
			for (uint32_t r = 0; r < num_ranks; r++)
				pt->shards[r] = (struct embd_plan_shard){ (int32_t)r, 0, rows, 0, dim };
			break;
		default:
			cr_assert_fail("unknown type %d", type);
		}
	}
}

static inline bool row_split_plan(const struct fixture *fx)
{
	enum embd_sharding_type type = fx->plan.tables[0].sharding_type;
	return type == EMBD_SHARD_ROW_WISE || type == EMBD_SHARD_TABLE_ROW_WISE;
}

static inline void start_threads(struct fixture *fx, uint32_t num_ranks, uint32_t threads)
{
	char err[256] = "";
	int rc = embd_ranks_create(num_ranks, threads, &fx->ranks, err, sizeof(err));
	cr_assert_eq(rc, 0, "embd_ranks_create: %d %s", rc, err);
	rc = embd_step_create(&fx->tables, &fx->plan, fx->ranks, SEED, MAX_T, &fx->step, err,
			      sizeof(err));
	cr_assert_eq(rc, 0, "embd_step_create: expected 0, got %d: %s", rc, err);
	embd_step_set_grad_divisor(fx->step, grad_divisor);
	for (uint32_t t = 0; t < NTAB; t++) {
		const struct embd_table_spec *sp = &fx->specs[t];
		bool sliced = slice_per_shard(fx, t);
		fx->num_refs[t] = sliced ? fx->plan.tables[t].num_shards : 1;
		for (uint32_t k = 0; k < fx->num_refs[t]; k++) {
			uint32_t col = sliced ? (uint32_t)fx->plan.tables[t].shards[k].col_offset : 0;
			uint32_t cols = sliced ? (uint32_t)fx->plan.tables[t].shards[k].cols
					       : (uint32_t)sp->embedding_dim;
			struct embd_ref_table *r = embd_ref_table_create(t, sp->num_embeddings, cols,
				sp->data_type, &sp->optimizer, SEED);
			cr_assert_not_null(r);
			/* a slice starts from the table's init values of its own columns */
			for (int64_t row = 0; row < sp->num_embeddings; row++)
				for (uint32_t c = 0; c < cols; c++)
					r->w32[row * cols + c] = embd_init_value(SEED, t, sp->num_embeddings,
										 row, col + c);
			fx->ref[t][k] = r;
			fx->ref_col[t][k] = col;
			fx->ref_cols[t][k] = cols;
		}
	}
}

static inline void start(struct fixture *fx, uint32_t num_ranks)
{
	start_threads(fx, num_ranks, 1);
}

static inline void setup(struct fixture *fx, enum embd_optimizer_type opt,
		  enum embd_sharding_type type, uint32_t num_ranks)
{
	make_tables(fx, opt);
	make_plan(fx, type, num_ranks);
	start(fx, num_ranks);
}

static inline void stop(struct fixture *fx)
{
	embd_step_destroy(fx->step);
	embd_ranks_destroy(fx->ranks);
	for (uint32_t t = 0; t < NTAB; t++)
		for (uint32_t k = 0; k < fx->num_refs[t]; k++)
			embd_ref_table_destroy(fx->ref[t][k]);
}

static inline uint64_t rng_next(uint64_t *s)
{
	*s = *s * 6364136223846793005ull + 1442695040888963407ull;
	return *s >> 33;
}

/* Feature f's table rows: a, b -> t0; c -> t1. */
static inline int64_t feature_rows(const struct fixture *fx, uint32_t f)
{
	return fx->specs[f < 2 ? 0 : 1].num_embeddings;
}

/* A batch of nb samples (1..B): lengths feature-major with stride nb, output rows nb. */
static inline void fill_trainer_n(const struct fixture *fx, struct trainer *tr, uint64_t seed,
			   bool weighted, uint32_t nb)
{
	uint64_t rng = seed, n = 0;
	memset(tr, 0, sizeof(*tr));
	for (uint32_t f = 0; f < 3; f++)
		for (uint32_t b = 0; b < nb; b++) {
			int32_t len = (int32_t)(rng_next(&rng) % 4);
			tr->lengths[f * nb + b] = len;
			for (int32_t j = 0; j < len; j++, n++) {
				/* ids 0..11 and the table's last rows: duplicates and every row shard */
				uint64_t r = rng_next(&rng) % 16;
				tr->values[n] = r < 12 ? (int64_t)r : feature_rows(fx, f) - 1 - (int64_t)(r - 12);
				tr->weights[n] = 0.5f + (float)(rng_next(&rng) % 8) / 8.0f;
			}
		}
	for (uint32_t i = 0; i < B * 40; i++)
		tr->grad[i] = ((float)(rng_next(&rng) % 200) - 100.0f) / 64.0f;
	tr->batch = (struct embd_step_batch){
		.kjt = { .num_features = 3, .batch_size = nb, .lengths = tr->lengths,
			 .values = tr->values, .weights = weighted ? tr->weights : NULL, .num_values = n },
		.pooled = tr->pooled, .pooled_grad = tr->grad,
	};
}

static inline void fill_trainer(const struct fixture *fx, struct trainer *tr, uint64_t seed, bool weighted)
{
	fill_trainer_n(fx, tr, seed, weighted, B);
}

static inline uint32_t feature_col(uint32_t f)
{
	return f == 0 ? 0 : f == 1 ? 16 : 32;
}

/* Reference bags of feature f of trainer tr; grad_cols gets columns [col, col + cols) of the
 * trainer's gradient for the feature. */
static inline struct embd_ref_bags ref_bags(const struct fixture *fx, const struct trainer *tr,
				     uint32_t f, uint32_t col, uint32_t cols, float *grad_cols)
{
	const uint32_t nb = tr->batch.kjt.batch_size;
	uint64_t start_id = 0;
	for (uint32_t i = 0; i < f * nb; i++)
		start_id += (uint64_t)tr->lengths[i];
	const uint32_t t = f < 2 ? 0 : 1;
	if (grad_cols)
		for (uint32_t b = 0; b < nb; b++)
			memcpy(&grad_cols[b * cols], &tr->grad[b * 40 + feature_col(f) + col],
			       cols * sizeof(float));
	return (struct embd_ref_bags){ .batch_size = nb, .lengths = &tr->lengths[f * nb],
		.ids = &tr->values[start_id],
		.weights = tr->batch.kjt.weights ? &tr->weights[start_id] : NULL,
		.pooling = fx->specs[t].pooling, .grad = grad_cols };
}

static inline void fill_all(const struct fixture *fx, struct trainer *trs, struct embd_step_batch *batches,
		     uint32_t n, uint64_t seed)
{
	for (uint32_t i = 0; i < n; i++) {
		fill_trainer(fx, &trs[i], seed + i, false);
		batches[i] = trs[i].batch;
	}
}

static inline void check_forward(const struct fixture *fx, struct trainer *trs, uint32_t n, float tol,
			  const char *what)
{
	float out[B * 16];
	for (uint32_t i = 0; i < n; i++) {
		if (trs[i].batch.status)
			continue;
		for (uint32_t f = 0; f < 3; f++) {
			const uint32_t t = f < 2 ? 0 : 1;
			for (uint32_t k = 0; k < fx->num_refs[t]; k++) {
				const uint32_t cols = fx->ref_cols[t][k];
				const uint32_t col = feature_col(f) + fx->ref_col[t][k];
				struct embd_ref_bags bags = ref_bags(fx, &trs[i], f, 0, cols, NULL);
				embd_ref_forward(fx->ref[t][k], &bags, out);
				for (uint32_t b = 0; b < bags.batch_size; b++)
					for (uint32_t c = 0; c < cols; c++) {
						float want = out[b * cols + c];
						float got = trs[i].pooled[b * 40 + col + c];
						cr_assert(fabsf(want - got) <= tol * (1.0f + fabsf(want)),
							  "%s: trainer %u feature %u sample %u col %u: "
							  "expected %.9g, got %.9g", what, i, f, b, col + c,
							  want, got);
					}
			}
		}
	}
}

/* The reference step on the concatenated batch: features in order, trainers in order. */
static inline void ref_backward(struct fixture *fx, struct trainer *trs, uint32_t n)
{
	static float grads[MAX_T * 3][B * 16];
	struct embd_ref_bags bags[MAX_T * 3];
	for (uint32_t t = 0; t < NTAB; t++)
		for (uint32_t s = 0; s < fx->num_refs[t]; s++) {
			uint32_t k = 0;
			for (uint32_t f = t == 0 ? 0 : 2; f < (t == 0 ? 2u : 3u); f++)
				for (uint32_t i = 0; i < n; i++)
					if (!trs[i].batch.status) {
						bags[k] = ref_bags(fx, &trs[i], f, fx->ref_col[t][s],
								   fx->ref_cols[t][s], grads[k]);
						bags[k].grad_divisor = grad_divisor;
						k++;
					}
			cr_assert_eq(embd_ref_backward(fx->ref[t][s], bags, k), 0);
		}
}

static inline void check_weights(const struct fixture *fx, uint32_t num_ranks, float tol, const char *what)
{
	for (uint32_t t = 0; t < NTAB; t++)
		for (uint32_t replica = 0; replica < num_ranks; replica++)
			for (int64_t r = 0; r < fx->specs[t].num_embeddings; r++)
				for (uint32_t c = 0; c < (uint32_t)fx->specs[t].embedding_dim; c++) {
					uint32_t k = 0;
					while (c >= fx->ref_col[t][k] + fx->ref_cols[t][k])
						k++;
					float got, want = embd_ref_weight(fx->ref[t][k], r,
									  c - fx->ref_col[t][k]);
					int rc = embd_step_read_weight(fx->step, t, r, c, replica, &got);
					cr_assert_eq(rc, 0, "%s: table %u row %lld col %u: no shard holds it",
						     what, t, (long long)r, c);
					cr_assert(fabsf(want - got) <= tol * (1.0f + fabsf(want)),
						  "%s: table %u replica %u row %lld col %u: expected %.9g, got %.9g",
						  what, t, replica, (long long)r, c, want, got);
				}
}

/* Backward of the step just forwarded, then the same step on the reference, then compare. */
static inline void backward_and_check(struct fixture *fx, struct trainer *trs,
			       struct embd_step_batch *batches, uint32_t n, uint32_t replicas,
			       const char *what)
{
	for (uint32_t i = 0; i < n; i++)
		trs[i].batch.status = batches[i].status;
	int rc = embd_step_backward(fx->step, batches, n);
	cr_assert_eq(rc, 0, "%s: backward: expected 0, got %d %s", what, rc, batches[0].err);
	ref_backward(fx, trs, n);
	check_weights(fx, replicas, 0.0f, what);
}

#endif /* EMBD_TESTS_STEP_FIXTURE_H */
