/*
 * The step engine against the unsharded reference (tests/support/reference.c): for every sharding
 * type, forward outputs and the weights after K training steps of each optimizer, with two
 * and four simulated trainers whose batches share ids (so gradients of several trainers meet
 * on one row). Exact wherever the summation order is the reference's; row-split forwards add
 * partial sums in another order and get a float tolerance. Also: abort (no row changes), a
 * refused batch (the others train as if it never came), and a planner-built plan.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/embedding.h"
#include "daemon/config.h"
#include "engine/step.h"
#include "tests/support/reference.h"

#define SEED 77u
#define B 6u
#define MAX_T 4u
#define NTAB 2u
#define RW_TOL 2e-6f

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
static bool slice_per_shard(const struct fixture *fx, uint32_t t)
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

static void make_tables(struct fixture *fx, enum embd_optimizer_type opt)
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
static void make_plan(struct fixture *fx, enum embd_sharding_type type, uint32_t num_ranks)
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

static void start(struct fixture *fx, uint32_t num_ranks)
{
	char err[256] = "";
	int rc = embd_ranks_create(num_ranks, 1, &fx->ranks, err, sizeof(err));
	cr_assert_eq(rc, 0, "embd_ranks_create: %d %s", rc, err);
	rc = embd_step_create(&fx->tables, &fx->plan, fx->ranks, SEED, MAX_T, &fx->step, err,
			      sizeof(err));
	cr_assert_eq(rc, 0, "embd_step_create: expected 0, got %d: %s", rc, err);
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

static void setup(struct fixture *fx, enum embd_optimizer_type opt,
		  enum embd_sharding_type type, uint32_t num_ranks)
{
	make_tables(fx, opt);
	make_plan(fx, type, num_ranks);
	start(fx, num_ranks);
}

static void stop(struct fixture *fx)
{
	embd_step_destroy(fx->step);
	embd_ranks_destroy(fx->ranks);
	for (uint32_t t = 0; t < NTAB; t++)
		for (uint32_t k = 0; k < fx->num_refs[t]; k++)
			embd_ref_table_destroy(fx->ref[t][k]);
}

static uint64_t rng_next(uint64_t *s)
{
	*s = *s * 6364136223846793005ull + 1442695040888963407ull;
	return *s >> 33;
}

/* Feature f's table rows: a, b -> t0; c -> t1. */
static int64_t feature_rows(const struct fixture *fx, uint32_t f)
{
	return fx->specs[f < 2 ? 0 : 1].num_embeddings;
}

static void fill_trainer(const struct fixture *fx, struct trainer *tr, uint64_t seed, bool weighted)
{
	uint64_t rng = seed, n = 0;
	memset(tr, 0, sizeof(*tr));
	for (uint32_t f = 0; f < 3; f++)
		for (uint32_t b = 0; b < B; b++) {
			int32_t len = (int32_t)(rng_next(&rng) % 4);
			tr->lengths[f * B + b] = len;
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
		.kjt = { .num_features = 3, .batch_size = B, .lengths = tr->lengths,
			 .values = tr->values, .weights = weighted ? tr->weights : NULL, .num_values = n },
		.pooled = tr->pooled, .pooled_grad = tr->grad,
	};
}

static uint32_t feature_col(uint32_t f)
{
	return f == 0 ? 0 : f == 1 ? 16 : 32;
}

/* Reference bags of feature f of trainer tr; grad_cols gets columns [col, col + cols) of the
 * trainer's gradient for the feature. */
static struct embd_ref_bags ref_bags(const struct fixture *fx, const struct trainer *tr,
				     uint32_t f, uint32_t col, uint32_t cols, float *grad_cols)
{
	uint64_t start_id = 0;
	for (uint32_t i = 0; i < f * B; i++)
		start_id += (uint64_t)tr->lengths[i];
	const uint32_t t = f < 2 ? 0 : 1;
	if (grad_cols)
		for (uint32_t b = 0; b < B; b++)
			memcpy(&grad_cols[b * cols], &tr->grad[b * 40 + feature_col(f) + col],
			       cols * sizeof(float));
	return (struct embd_ref_bags){ .batch_size = B, .lengths = &tr->lengths[f * B],
		.ids = &tr->values[start_id],
		.weights = tr->batch.kjt.weights ? &tr->weights[start_id] : NULL,
		.pooling = fx->specs[t].pooling, .grad = grad_cols };
}

static void fill_all(const struct fixture *fx, struct trainer *trs, struct embd_step_batch *batches,
		     uint32_t n, uint64_t seed)
{
	for (uint32_t i = 0; i < n; i++) {
		fill_trainer(fx, &trs[i], seed + i, false);
		batches[i] = trs[i].batch;
	}
}

static void check_forward(const struct fixture *fx, struct trainer *trs, uint32_t n, float tol,
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
				for (uint32_t b = 0; b < B; b++)
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
static void ref_backward(struct fixture *fx, struct trainer *trs, uint32_t n)
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
						k++;
					}
			cr_assert_eq(embd_ref_backward(fx->ref[t][s], bags, k), 0);
		}
}

static void check_weights(const struct fixture *fx, uint32_t num_ranks, float tol, const char *what)
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
static void backward_and_check(struct fixture *fx, struct trainer *trs,
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

/* K steps of type x optimizer with n trainers on num_ranks ranks, checked at every step. */
static void run_training(enum embd_sharding_type type, enum embd_optimizer_type opt,
			 uint32_t n, uint32_t num_ranks)
{
	static struct fixture fx;
	static struct trainer trs[MAX_T];
	const bool split = type == EMBD_SHARD_ROW_WISE || type == EMBD_SHARD_TABLE_ROW_WISE;
	char what[96];

	setup(&fx, opt, type, num_ranks);
	for (uint32_t step = 0; step < 3; step++) {
		snprintf(what, sizeof(what), "%s opt %d, %u trainers, step %u",
			 embd_plan_sharding_name(type), (int)opt, n, step);
		for (uint32_t i = 0; i < n; i++) {
			fill_trainer(&fx, &trs[i], 1000 * step + i + 1, i % 2 == 1);
			trs[i].batch.pooled = trs[i].pooled;
		}
		struct embd_step_batch batches[MAX_T];
		for (uint32_t i = 0; i < n; i++)
			batches[i] = trs[i].batch;
		int rc = embd_step_forward(fx.step, batches, n);
		cr_assert_eq(rc, (int)n, "%s: forward accepted %d of %u: %s", what, rc, n, batches[0].err);
		check_forward(&fx, trs, n, split ? RW_TOL : 0.0f, what);
		backward_and_check(&fx, trs, batches, n,
				   type == EMBD_SHARD_DATA_PARALLEL ? num_ranks : 1, what);
	}
	stop(&fx);
}

#define OPTIMIZER_TESTS(name, type)                                                     \
	Test(step_##name, sgd_two_trainers) { run_training(type, EMBD_OPT_SGD, 2, 2); }    \
	Test(step_##name, adagrad_four_trainers) { run_training(type, EMBD_OPT_ADAGRAD, 4, 2); } \
	Test(step_##name, rowwise_adagrad_two_trainers_four_ranks)                      \
	{ run_training(type, EMBD_OPT_ROWWISE_ADAGRAD, 2, 4); }                          \
	Test(step_##name, adam_four_trainers_four_ranks) { run_training(type, EMBD_OPT_ADAM, 4, 4); }

OPTIMIZER_TESTS(table_wise, EMBD_SHARD_TABLE_WISE)
OPTIMIZER_TESTS(column_wise, EMBD_SHARD_COLUMN_WISE)
OPTIMIZER_TESTS(row_wise, EMBD_SHARD_ROW_WISE)
OPTIMIZER_TESTS(table_row_wise, EMBD_SHARD_TABLE_ROW_WISE)
OPTIMIZER_TESTS(table_column_wise, EMBD_SHARD_TABLE_COLUMN_WISE)
OPTIMIZER_TESTS(data_parallel, EMBD_SHARD_DATA_PARALLEL)

Test(step, abort_changes_no_row)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];

	setup(&fx, EMBD_OPT_ADAM, EMBD_SHARD_ROW_WISE, 2);
	fill_all(&fx, trs, batches, 2, 5);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
	embd_step_abort(fx.step, "test");
	check_weights(&fx, 1, 0.0f, "after abort");
	cr_assert_eq(embd_step_backward(fx.step, batches, 2), EMBD_EINVAL,
		     "backward after abort: expected EMBD_EINVAL");
	/* the next step trains as if the aborted one never happened (adam's t included) */
	fill_all(&fx, trs, batches, 2, 50);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
	backward_and_check(&fx, trs, batches, 2, 1, "step after abort");
	stop(&fx);
}

/* A gradient with a NaN or an infinity refuses the whole step before any row changes (the
 * reference takes no step), naming the trainer, sample, column and feature; the next step
 * trains as if it never came. */
Test(step, nonfinite_gradient_refuses_the_step)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];
	struct embd_step_counts counts;
	const float bad[2] = { NAN, -INFINITY };
	const char *name[2] = { "NaN", "infinite" };

	setup(&fx, EMBD_OPT_ADAGRAD, EMBD_SHARD_ROW_WISE, 2);
	for (int k = 0; k < 2; k++) {
		fill_all(&fx, trs, batches, 2, 5 + (uint64_t)k);
		batches[1].trainer = 1;
		trs[1].grad[3 * 40 + 17] = bad[k];     /* sample 3, column 17: feature b */
		cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
		int rc = embd_step_backward(fx.step, batches, 2);
		cr_expect_eq(rc, EMBD_ECANCELED, "a %s gradient: expected EMBD_ECANCELED, got %d",
			     name[k], rc);
		char want[128];
		snprintf(want, sizeof(want), "trainer 1 of node 0 sent a gradient that is %s at "
			 "sample 3, column 17 (feature 'b')", name[k]);
		for (int i = 0; i < 2; i++)
			cr_expect(strstr(batches[i].err, want), "batch %d: expected '%s' in '%s'", i,
				  want, batches[i].err);
		embd_step_counts(fx.step, &counts);
		cr_expect_eq(counts.nonfinite_grads, 1);
		check_weights(&fx, 1, 0.0f, "after a refused gradient");
	}
	fill_all(&fx, trs, batches, 2, 50);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
	backward_and_check(&fx, trs, batches, 2, 1, "step after a refused gradient");
	stop(&fx);
}

/* A huge but finite gradient is applied (clipping is the trainer's job); the rows it leaves
 * non-finite (here adagrad's sum of squares overflows) are counted and named. */
Test(step, rows_an_update_leaves_nonfinite_are_counted)
{
	static struct fixture fx;
	static struct trainer trs[1];
	struct embd_step_batch batches[1];
	struct embd_step_counts counts;

	setup(&fx, EMBD_OPT_ADAGRAD, EMBD_SHARD_TABLE_WISE, 2);
	fill_all(&fx, trs, batches, 1, 7);
	for (uint32_t i = 0; i < B * 40; i++)
		trs[0].grad[i] = 3e19f;
	cr_assert_eq(embd_step_forward(fx.step, batches, 1), 1);
	cr_assert_eq(embd_step_backward(fx.step, batches, 1), 0, "a finite gradient is applied: %s",
		     batches[0].err);
	embd_step_counts(fx.step, &counts);
	cr_expect_eq(counts.nonfinite_grads, 0);
	cr_expect_gt(counts.nonfinite_rows, 0, "adagrad's state overflowed: expected rows counted");
	cr_expect_lt(counts.nonfinite_table, NTAB);
	cr_expect(counts.nonfinite_row >= 0 &&
		  counts.nonfinite_row < fx.specs[counts.nonfinite_table].num_embeddings,
		  "a row of the table: %lld", (long long)counts.nonfinite_row);
	/* the next step with sane gradients: rows already bad are counted again when updated */
	fill_all(&fx, trs, batches, 1, 8);
	cr_assert_eq(embd_step_forward(fx.step, batches, 1), 1);
	cr_assert_eq(embd_step_backward(fx.step, batches, 1), 0);
	stop(&fx);
}

/* The middle one of three trainers has a bad id: its items are dropped from every rank after
 * the ranks copied the ids, and the others' step stays exact (row_wise: up to the rounding of
 * its partial sums; data_parallel: on every replica). */
static void refused_batch_case(enum embd_sharding_type type)
{
	static struct fixture fx;
	static struct trainer trs[3];
	struct embd_step_batch batches[3];

	setup(&fx, EMBD_OPT_ADAGRAD, type, 2);
	for (uint32_t i = 0; i < 3; i++)
		fill_trainer(&fx, &trs[i], 9 + i, false);
	/* trainer 1: its first id of feature c is one past table t1's rows (24: two past) */
	uint64_t first_c = 0, num_c = 0;
	for (uint32_t i = 0; i < 2 * B; i++)
		first_c += (uint64_t)trs[1].lengths[i];
	for (uint32_t i = 2 * B; i < 3 * B; i++)
		num_c += (uint64_t)trs[1].lengths[i];
	cr_assert_gt(num_c, 1, "the seed should give feature c two ids or more");
	trs[1].values[first_c] = 23;
	/* and its last one too: the message still names the first, as a serial read would */
	trs[1].values[first_c + num_c - 1] = 24;
	for (uint32_t i = 0; i < 3; i++)
		batches[i] = trs[i].batch;
	int rc = embd_step_forward(fx.step, batches, 3);
	cr_assert_eq(rc, 2, "expected 2 accepted batches, got %d", rc);
	cr_assert_eq(batches[1].status, EMBD_ERANGE, "expected EMBD_ERANGE, got %d", batches[1].status);
	char want[64];
	snprintf(want, sizeof(want), "values[%llu]: id 23 of feature 'c'",
		 (unsigned long long)first_c);
	cr_assert(strstr(batches[1].err, want), "error should begin '%s': %s", want,
		  batches[1].err);
	for (uint32_t i = 0; i < 3; i++)
		trs[i].batch.status = batches[i].status;
	check_forward(&fx, trs, 3, type == EMBD_SHARD_ROW_WISE ? RW_TOL : 0.0f,
		      "refused batch");
	backward_and_check(&fx, trs, batches, 3, type == EMBD_SHARD_DATA_PARALLEL ? 2 : 1,
			   "refused batch");
	stop(&fx);
}

Test(step, refused_batch_leaves_others_exact) { refused_batch_case(EMBD_SHARD_COLUMN_WISE); }
Test(step, refused_batch_leaves_others_exact_row_wise) { refused_batch_case(EMBD_SHARD_ROW_WISE); }
Test(step, refused_batch_leaves_others_exact_data_parallel)
{
	refused_batch_case(EMBD_SHARD_DATA_PARALLEL);
}

Test(step, malformed_batches_name_the_field)
{
	static struct fixture fx;
	static struct trainer tr;
	struct embd_step_batch b;
	const char *keys_bad[3] = { "a", "x", "c" };

	setup(&fx, EMBD_OPT_SGD, EMBD_SHARD_TABLE_WISE, 2);
	const char *fields[] = { "batch_size", "num_features", "lengths", "keys[1]" };
	for (uint32_t k = 0; k < 4; k++) {
		fill_trainer(&fx, &tr, 3, false);
		b = tr.batch;
		if (k == 0)
			b.kjt.batch_size = B + 1;
		else if (k == 1)
			b.kjt.num_features = 2;
		else if (k == 2)
			b.kjt.num_values += 1;  /* lengths no longer sum to num_values */
		else
			b.kjt.keys = keys_bad;
		cr_assert_eq(embd_step_forward(fx.step, &b, 1), 0, "%s: batch accepted", fields[k]);
		cr_assert(b.status < 0 && strstr(b.err, fields[k]),
			  "expected an error naming %s, got %d '%s'", fields[k], b.status, b.err);
	}
	check_weights(&fx, 1, 0.0f, "after refused batches");
	stop(&fx);
}

Test(step, planner_built_plan)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];
	struct embd_plan *plan = NULL;
	char err[256] = "";

	make_tables(&fx, EMBD_OPT_ROWWISE_ADAGRAD);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 2);
	topo.compute_device = EMBD_DEVICE_CPU;
	topo.batch_size = B;
	int rc = embd_plan_build(fx.specs, fx.cons, NTAB, &topo, NULL, &plan, err, sizeof(err));
	cr_assert_eq(rc, 0, "embd_plan_build: %d %s", rc, err);
	fx.plan = *plan;
	start(&fx, 2);
	for (uint32_t step = 0; step < 2; step++) {
		for (uint32_t i = 0; i < 2; i++) {
			fill_trainer(&fx, &trs[i], 300 + 10 * step + i, i == 0);
			batches[i] = trs[i].batch;
		}
		cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
		check_forward(&fx, trs, 2, RW_TOL, "planner plan");
		backward_and_check(&fx, trs, batches, 2, 1, "planner plan");
	}
	stop(&fx);
	embd_plan_destroy(plan);
}

/* What `embd` alone runs: the embedded default config, planned, on two ranks. A bag of one id
 * pools to that row's init value; an empty bag pools to zero; backward moves the row. */
Test(step, default_config_layout_and_step)
{
	struct embd_config config;
	struct embd_plan *plan = NULL;
	struct embd_ranks *ranks = NULL;
	struct embd_step *step = NULL;
	char err[512] = "";
	const char *text = embd_config_default_text();

	cr_assert_eq(embd_config_parse(text, strlen(text), &config, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_plan_build(config.tables.specs, config.tables.constraints,
				     config.tables.count, &config.topology, NULL, &plan, err,
				     sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ranks_create(2, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_step_create(&config.tables, plan, ranks, config.seed, 2, &step, err,
				      sizeof(err)), 0, "%s", err);
	const struct embd_step_layout *l = embd_step_layout(step);
	cr_assert_eq(l->num_features, 5, "features: expected 5, got %u", l->num_features);
	cr_assert_eq(l->total_dim, 64 + 64 + 64 + 32 + 32, "total_dim: got %u", l->total_dim);
	cr_assert_eq(l->batch_size, config.topology.batch_size);
	cr_assert_str_eq(l->feature_names[2], "clicked_item_id");
	cr_assert_eq(l->feature_offsets[2], 128);
	cr_assert_eq(l->feature_tables[2], 1);

	/* feature 0 (user_id): sample 0 has id 7, every other bag is empty */
	const uint32_t F = l->num_features, Bd = l->batch_size, D = l->total_dim;
	int32_t *lengths = calloc((size_t)F * Bd, sizeof(int32_t));
	float *pooled = calloc((size_t)Bd * D, sizeof(float));
	float *grad = calloc((size_t)Bd * D, sizeof(float));
	int64_t id = 7;
	cr_assert(lengths && pooled && grad);
	lengths[0] = 1;
	grad[0] = 1.0f;
	struct embd_step_batch b = {
		.kjt = { .num_features = F, .batch_size = Bd, .lengths = lengths, .values = &id,
			 .num_values = 1 },
		.pooled = pooled, .pooled_grad = grad,
	};
	cr_assert_eq(embd_step_forward(step, &b, 1), 1, "%s", b.err);
	for (uint32_t c = 0; c < 64; c++) {
		float want = embd_init_value(config.seed, 0, 10000, 7, c);
		cr_assert_eq(pooled[c], want, "col %u: expected %.9g, got %.9g", c, want, pooled[c]);
	}
	for (uint64_t i = 64; i < (uint64_t)Bd * D; i++)
		cr_assert_eq(pooled[i], 0.0f, "pooled[%llu]: expected 0 (empty bag), got %g",
			     (unsigned long long)i, pooled[i]);
	cr_assert_eq(embd_step_backward(step, &b, 1), 0);
	float w;
	cr_assert_eq(embd_step_read_weight(step, 0, 7, 0, 0, &w), 0);
	cr_assert_lt(w, embd_init_value(config.seed, 0, 10000, 7, 0),
		     "a positive gradient must lower the weight");
	free(lengths);
	free(pooled);
	free(grad);
	embd_step_destroy(step);
	embd_ranks_destroy(ranks);
	embd_plan_destroy(plan);
	embd_config_free(&config);
}
