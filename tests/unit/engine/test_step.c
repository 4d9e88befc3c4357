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

#include "daemon/config.h"
#include "tests/unit/engine/step_fixture.h"

/* Samples of trainer i's batch: B, or with short batches B, B - 1, 1, 3, ... (the last
 * batch of an epoch, TorchRec's smaller stride). */
static uint32_t batch_samples(uint32_t i, bool short_batches)
{
	static const uint32_t sizes[4] = { B, B - 1, 1, 3 };
	return short_batches ? sizes[i % 4] : B;
}

/* Rows past a short batch's in its pooled buffer keep this value: forward writes nb rows. */
#define UNTOUCHED (-12345.0f)

static void check_rows_untouched(const struct trainer *tr, const char *what, uint32_t i)
{
	for (uint32_t r = tr->batch.kjt.batch_size; r < B; r++)
		for (uint32_t c = 0; c < 40; c++)
			cr_assert_eq(tr->pooled[r * 40 + c], UNTOUCHED, "%s: trainer %u of %u samples: "
				     "row %u col %u written (%g)", what, i, tr->batch.kjt.batch_size, r,
				     c, tr->pooled[r * 40 + c]);
}

/* K steps of type x optimizer with n trainers on num_ranks ranks, checked at every step;
 * short_batches: the trainers' batches have different sizes below B. */
static void run_training_n(enum embd_sharding_type type, enum embd_optimizer_type opt,
			   uint32_t n, uint32_t num_ranks, bool short_batches)
{
	static struct fixture fx;
	static struct trainer trs[MAX_T];
	const bool split = type == EMBD_SHARD_ROW_WISE || type == EMBD_SHARD_TABLE_ROW_WISE;
	char what[96];

	setup(&fx, opt, type, num_ranks);
	for (uint32_t step = 0; step < 3; step++) {
		snprintf(what, sizeof(what), "%s opt %d, %u trainers%s, step %u",
			 embd_plan_sharding_name(type), (int)opt, n,
			 short_batches ? " of short batches" : "", step);
		for (uint32_t i = 0; i < n; i++) {
			fill_trainer_n(&fx, &trs[i], 1000 * step + i + 1, i % 2 == 1,
				       batch_samples(i + step, short_batches));
			for (uint32_t k = 0; k < B * 40; k++)
				trs[i].pooled[k] = UNTOUCHED;
		}
		struct embd_step_batch batches[MAX_T];
		for (uint32_t i = 0; i < n; i++)
			batches[i] = trs[i].batch;
		int rc = embd_step_forward(fx.step, batches, n);
		cr_assert_eq(rc, (int)n, "%s: forward accepted %d of %u: %s", what, rc, n, batches[0].err);
		check_forward(&fx, trs, n, split ? RW_TOL : 0.0f, what);
		for (uint32_t i = 0; i < n; i++)
			check_rows_untouched(&trs[i], what, i);
		backward_and_check(&fx, trs, batches, n,
				   type == EMBD_SHARD_DATA_PARALLEL ? num_ranks : 1, what);
	}
	stop(&fx);
}

static void run_training(enum embd_sharding_type type, enum embd_optimizer_type opt,
			 uint32_t n, uint32_t num_ranks)
{
	run_training_n(type, opt, n, num_ranks, false);
}

/* TorchRec's gradient division by the 3 trainers (not a power of two), adam and adagrad. */
static void run_divided(enum embd_sharding_type type)
{
	grad_divisor = 3;
	run_training_n(type, EMBD_OPT_ADAM, 3, 2, false);
	run_training_n(type, EMBD_OPT_ADAGRAD, 3, 4, true);
}

/* Evaluations of three batches (one short, one weighted) on the rows as they are: checked
 * against the reference forward, with rows past a short batch's untouched. */
static void eval_and_check(struct fixture *fx, struct trainer *ev, uint64_t seed,
			   const char *what)
{
	const bool split = row_split_plan(fx);
	struct embd_step_batch batches[3];

	for (uint32_t i = 0; i < 3; i++) {
		fill_trainer_n(fx, &ev[i], seed + i, i == 1, i == 2 ? 2 : B);
		for (uint32_t k = 0; k < B * 40; k++)
			ev[i].pooled[k] = UNTOUCHED;
		batches[i] = ev[i].batch;
	}
	int rc = embd_step_eval(fx->step, batches, 3);
	cr_assert_eq(rc, 3, "%s: eval accepted %d of 3: %s", what, rc, batches[0].err);
	check_forward(fx, ev, 3, split ? RW_TOL : 0.0f, what);
	for (uint32_t i = 0; i < 3; i++)
		check_rows_untouched(&ev[i], what, i);
}

/*
 * Evaluations between a step's forward and its backward read the rows before the step's
 * update (TorchRec's order: the update happens in backward), change no row and leave the
 * pending step intact: its backward still trains exactly; an evaluation after it reads the
 * updated rows. A refused evaluation batch changes nothing either.
 */
static void eval_case(enum embd_sharding_type type)
{
	static struct fixture fx;
	static struct trainer trs[2], ev[3];
	struct embd_step_batch batches[2];
	const uint32_t replicas = type == EMBD_SHARD_DATA_PARALLEL ? 2 : 1;

	setup(&fx, EMBD_OPT_ADAGRAD, type, 2);
	eval_and_check(&fx, ev, 70, "eval before any step");
	cr_assert_eq(embd_step_backward(fx.step, batches, 0),
		     EMBD_EINVAL, "an evaluation leaves no backward pending");
	fill_all(&fx, trs, batches, 2, 5);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
	eval_and_check(&fx, ev, 80, "eval between forward and backward");
	struct embd_step_batch bad = ev[0].batch;
	bad.kjt.batch_size = B + 1;
	cr_assert_eq(embd_step_eval(fx.step, &bad, 1), 0);
	cr_assert(bad.status == EMBD_EINVAL && strstr(bad.err, "batch_size"), "got %d '%s'",
		  bad.status, bad.err);
	/* a bad id refuses an evaluation batch at routing too (data_parallel: read by the one
	 * replica that looks up) */
	const uint64_t at = ev[1].batch.kjt.num_values - 1;
	cr_assert_gt(ev[1].batch.kjt.num_values, 0, "the seed should give the batch ids");
	const int64_t kept = ev[1].values[at];
	struct embd_step_batch bad_id = ev[1].batch;
	char want[48];
	ev[1].values[at] = -1;
	cr_assert_eq(embd_step_eval(fx.step, &bad_id, 1), 0);
	snprintf(want, sizeof(want), "values[%llu]: id -1 of feature", (unsigned long long)at);
	cr_assert(bad_id.status == EMBD_ERANGE && strstr(bad_id.err, want), "got %d '%s'",
		  bad_id.status, bad_id.err);
	ev[1].values[at] = kept;
	check_weights(&fx, replicas, 0.0f, "after evaluations");
	backward_and_check(&fx, trs, batches, 2, replicas, "backward after evaluations");
	eval_and_check(&fx, ev, 90, "eval after the step");
	check_weights(&fx, replicas, 0.0f, "after the last evaluation");
	stop(&fx);
}

#define OPTIMIZER_TESTS(name, type)                                                     \
	Test(step_##name, sgd_two_trainers) { run_training(type, EMBD_OPT_SGD, 2, 2); }    \
	Test(step_##name, adagrad_four_trainers) { run_training(type, EMBD_OPT_ADAGRAD, 4, 2); } \
	Test(step_##name, rowwise_adagrad_two_trainers_four_ranks)                      \
	{ run_training(type, EMBD_OPT_ROWWISE_ADAGRAD, 2, 4); }                          \
	Test(step_##name, adam_four_trainers_four_ranks) { run_training(type, EMBD_OPT_ADAM, 4, 4); } \
	Test(step_##name, short_batches_four_trainers)                                   \
	{ run_training_n(type, EMBD_OPT_ADAGRAD, 4, 2, true); }                          \
	Test(step_##name, eval_between_forward_and_backward) { eval_case(type); }   \
	Test(step_##name, gradients_divided_by_the_trainers)                            \
	{ run_divided(type); }

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

/*
 * A gradient in memory the caller does not own (grad_from: a trainer's slab) is copied into
 * grad_copy as it is checked, over every rank's workers, and the update reads the copy: the
 * step trains as the reference on it, every element of the copy is the source's (b rows,
 * none past them), and a NaN or infinity anywhere in a part (the first element, the last of a
 * short batch of 3 x 40, not a multiple of the parts' blocks) refuses the step naming it.
 */
Test(step, gradient_from_shared_memory_is_copied_as_checked)
{
	static struct fixture fx;
	static struct trainer trs[2];
	static float copies[2][B * 40];
	struct embd_step_batch batches[2];
	const uint32_t rows[2] = { 3, B };
	struct { uint32_t trainer, at; float bad; } cases[3] = {
		{ 0, 0, NAN }, { 0, 3 * 40 - 1, INFINITY }, { 1, B * 40 - 1, NAN } };

	make_tables(&fx, EMBD_OPT_ADAGRAD);
	make_plan(&fx, EMBD_SHARD_COLUMN_WISE, 2);
	start_threads(&fx, 2, 2);
	for (uint32_t c = 0; c <= 3; c++) {
		for (uint32_t i = 0; i < 2; i++) {
			fill_trainer_n(&fx, &trs[i], 70 + c * 2 + i, i == 1, rows[i]);
			for (uint32_t k = 0; k < B * 40; k++)
				copies[i][k] = -7.0f;
			batches[i] = trs[i].batch;
			batches[i].trainer = i;
			batches[i].pooled_grad = NULL;
			batches[i].grad_from = trs[i].grad;
			batches[i].grad_copy = copies[i];
		}
		cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
		if (c == 3) {   /* every part finite: the step trains on the copies */
			backward_and_check(&fx, trs, batches, 2, 1, "a gradient from shared memory");
			for (uint32_t i = 0; i < 2; i++) {
				cr_expect_eq(batches[i].pooled_grad, copies[i]);
				cr_expect_arr_eq(copies[i], trs[i].grad, rows[i] * 40 * sizeof(float));
				for (uint32_t k = rows[i] * 40; k < B * 40; k++)
					cr_assert_eq(copies[i][k], -7.0f, "trainer %u element %u past "
						     "its rows copied", i, k);
			}
			break;
		}
		trs[cases[c].trainer].grad[cases[c].at] = cases[c].bad;
		int rc = embd_step_backward(fx.step, batches, 2);
		cr_expect_eq(rc, EMBD_ECANCELED, "case %u: expected EMBD_ECANCELED, got %d", c, rc);
		char want[96];
		snprintf(want, sizeof(want), "trainer %u of node 0 sent a gradient that is %s at "
			 "sample %u, column %u", cases[c].trainer, c == 1 ? "infinite" : "NaN",
			 cases[c].at / 40, cases[c].at % 40);
		cr_expect(strstr(batches[0].err, want), "case %u: expected '%s' in '%s'", c, want,
			  batches[0].err);
		check_weights(&fx, 1, 0.0f, "after a refused gradient from shared memory");
	}
	stop(&fx);
}

/* A short batch's gradient is its b rows: whatever lies past them in the buffer (here NaN) is
 * neither checked nor applied. */
Test(step, short_batch_gradient_is_its_own_rows)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];

	setup(&fx, EMBD_OPT_ADAGRAD, EMBD_SHARD_ROW_WISE, 2);
	fill_trainer_n(&fx, &trs[0], 11, false, 3);
	fill_trainer_n(&fx, &trs[1], 12, true, B);
	for (uint32_t i = 3 * 40; i < B * 40; i++)
		trs[0].grad[i] = NAN;
	for (uint32_t i = 0; i < 2; i++)
		batches[i] = trs[i].batch;
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
	backward_and_check(&fx, trs, batches, 2, 1, "a short batch with NaN past its rows");
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

/*
 * A table's column shards on this node (the fixture's three, two of them on one rank) step
 * from one prep of their occurrences: every step counts one prepare per table and all its
 * shards, and stays exact; types without column shards count none.
 */
static void shared_prepare_case(enum embd_sharding_type type, uint32_t prepares,
				uint32_t shards)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];
	struct embd_step_counts counts;
	char what[64];

	setup(&fx, EMBD_OPT_ADAGRAD, type, 2);
	for (uint32_t step = 0; step < 2; step++) {
		snprintf(what, sizeof(what), "%s step %u", embd_plan_sharding_name(type), step);
		fill_all(&fx, trs, batches, 2, 40 + step);
		cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s: %s", what, batches[0].err);
		backward_and_check(&fx, trs, batches, 2, 1, what);
		embd_step_counts(fx.step, &counts);
		cr_expect_eq(counts.backward_prepares, prepares, "%s: %u tables prepared once, "
			     "expected %u", what, counts.backward_prepares, prepares);
		cr_expect_eq(counts.backward_shared_shards, shards, "%s: %u shards applied a shared "
			     "prep, expected %u", what, counts.backward_shared_shards, shards);
	}
	stop(&fx);
}

Test(step, column_shards_share_one_prepare)
{
	shared_prepare_case(EMBD_SHARD_COLUMN_WISE, NTAB, 3 * NTAB);
}
Test(step, table_column_shards_share_one_prepare)
{
	shared_prepare_case(EMBD_SHARD_TABLE_COLUMN_WISE, NTAB, 3 * NTAB);
}
Test(step, table_wise_shares_no_prepare) { shared_prepare_case(EMBD_SHARD_TABLE_WISE, 0, 0); }
Test(step, row_shards_share_no_prepare) { shared_prepare_case(EMBD_SHARD_ROW_WISE, 0, 0); }

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

/* A NaN or infinite per-sample weight would scale the bag's gradient into shared rows: the
 * batch is refused at routing like a bad id, naming the weight, and the others stay exact. */
static void nonfinite_weight_case(enum embd_sharding_type type, float bad)
{
	static struct fixture fx;
	static struct trainer trs[3];
	struct embd_step_batch batches[3];

	setup(&fx, EMBD_OPT_ADAGRAD, type, 2);
	for (uint32_t i = 0; i < 3; i++)
		fill_trainer(&fx, &trs[i], 31 + i, true);
	uint64_t at = (uint64_t)trs[1].batch.kjt.num_values / 2;
	trs[1].weights[at] = bad;
	for (uint32_t i = 0; i < 3; i++)
		batches[i] = trs[i].batch;
	int rc = embd_step_forward(fx.step, batches, 3);
	cr_assert_eq(rc, 2, "expected 2 accepted batches, got %d", rc);
	cr_assert_eq(batches[1].status, EMBD_EINVAL, "got %d: %s", batches[1].status,
		     batches[1].err);
	char want[64];
	snprintf(want, sizeof(want), "weights[%llu]: %s weight", (unsigned long long)at,
		 isnan(bad) ? "NaN" : "infinite");
	cr_assert(strstr(batches[1].err, want), "error should name '%s': %s", want, batches[1].err);
	for (uint32_t i = 0; i < 3; i++)
		trs[i].batch.status = batches[i].status;
	check_forward(&fx, trs, 3, type == EMBD_SHARD_ROW_WISE ? RW_TOL : 0.0f, "refused weight");
	backward_and_check(&fx, trs, batches, 3, type == EMBD_SHARD_DATA_PARALLEL ? 2 : 1,
			   "refused weight");
	stop(&fx);
}

Test(step, nan_weight_refuses_its_batch) { nonfinite_weight_case(EMBD_SHARD_TABLE_WISE, NAN); }
Test(step, infinite_weight_refuses_its_batch_row_wise)
{
	nonfinite_weight_case(EMBD_SHARD_ROW_WISE, -INFINITY);
}

/*
 * A batch with bad ids and a bad weight is refused for the first of them by position, an id
 * before a weight at the same position, whether its bags are copied whole (table_wise) or id
 * by id (row_wise keeps its shard's ids only), and whichever features and ranks they are in.
 * Every bag holds 3 ids: features a, b and c are values [0, 18), [18, 36) and [36, 54), each
 * one whole block of the copy's check (16 ids) and two past it.
 */
static void first_bad_value_case(enum embd_sharding_type type, const int64_t bad[3])
{
	static struct fixture fx;
	static struct trainer trs[3];
	struct embd_step_batch batches[3];
	const int64_t weight_at = bad[2];
	int64_t id_at = -1;
	char what[112];

	setup(&fx, EMBD_OPT_SGD, type, 2);
	for (uint32_t i = 0; i < 3; i++) {
		fill_trainer(&fx, &trs[i], 51 + i, true);
		if (i != 1)
			continue;
		for (uint32_t k = 0; k < 3 * B; k++)
			trs[i].lengths[k] = 3;
		for (uint32_t j = 0; j < 3 * B * 3; j++) {
			trs[i].values[j] = (int64_t)(j % 11);
			trs[i].weights[j] = 0.75f;
		}
		trs[i].batch.kjt.num_values = 3 * B * 3;
		for (int k = 0; k < 2; k++)
			if (bad[k] >= 0) {
				trs[i].values[bad[k]] = bad[k] % 2 ? -1 : INT64_MAX;
				id_at = id_at < 0 || bad[k] < id_at ? bad[k] : id_at;
			}
		if (weight_at >= 0)
			trs[i].weights[weight_at] = NAN;
	}
	for (uint32_t i = 0; i < 3; i++)
		batches[i] = trs[i].batch;
	snprintf(what, sizeof(what), "type %d, bad ids at %lld and %lld, bad weight at %lld",
		 (int)type, (long long)bad[0], (long long)bad[1], (long long)weight_at);
	cr_assert_eq(embd_step_forward(fx.step, batches, 3), 2, "%s: %s", what, batches[1].err);
	char want[64];
	if (id_at >= 0 && (weight_at < 0 || id_at <= weight_at)) {
		cr_assert_eq(batches[1].status, EMBD_ERANGE, "%s: %s", what, batches[1].err);
		snprintf(want, sizeof(want), "values[%lld]: id %lld of feature", (long long)id_at,
			 (long long)trs[1].values[id_at]);
	} else {
		cr_assert_eq(batches[1].status, EMBD_EINVAL, "%s: %s", what, batches[1].err);
		snprintf(want, sizeof(want), "weights[%lld]: NaN weight", (long long)weight_at);
	}
	cr_assert(strstr(batches[1].err, want), "%s: error should name '%s': %s", what, want,
		  batches[1].err);
	for (uint32_t i = 0; i < 3; i++)
		trs[i].batch.status = batches[i].status;
	check_forward(&fx, trs, 3, type == EMBD_SHARD_ROW_WISE ? RW_TOL : 0.0f, what);
	backward_and_check(&fx, trs, batches, 3, 1, what);
	stop(&fx);
}

Test(step, the_first_bad_value_refuses_its_batch)
{
	const enum embd_sharding_type types[2] = { EMBD_SHARD_TABLE_WISE, EMBD_SHARD_ROW_WISE };
	/* two id positions and a weight position (-1: none) */
	const int64_t cases[][3] = {
		{ 9, -1, 4 }, { 4, -1, 9 }, { 10, -1, 10 }, { 17, -1, -1 }, { 20, -1, -1 },
		{ -1, -1, 16 }, { 53, -1, 52 },
		{ 12, 5, -1 }, { 17, 9, -1 }, { 16, -1, 4 }, { 4, -1, 16 },   /* one feature */
		{ 40, -1, 30 }, { 2, -1, 40 }, { 47, 25, 44 },                /* across features */
	};

	for (int t = 0; t < 2; t++)
		for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
			first_bad_value_case(types[t], cases[c]);
}

/* A trainer whose batch has no ids at all (its values array NULL) is served: empty bags. */
Test(step, a_batch_without_ids_is_served)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];

	setup(&fx, EMBD_OPT_SGD, EMBD_SHARD_TABLE_WISE, 2);
	for (uint32_t i = 0; i < 2; i++)
		fill_trainer(&fx, &trs[i], 71 + i, i == 1);
	memset(trs[1].lengths, 0, sizeof(trs[1].lengths));
	trs[1].batch.kjt.values = NULL;
	trs[1].batch.kjt.weights = NULL;
	trs[1].batch.kjt.num_values = 0;
	for (uint32_t i = 0; i < 2; i++)
		batches[i] = trs[i].batch;
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[1].err);
	check_forward(&fx, trs, 2, 0.0f, "no ids");
	backward_and_check(&fx, trs, batches, 2, 1, "no ids");
	stop(&fx);
}

Test(step, malformed_batches_name_the_field)
{
	static struct fixture fx;
	static struct trainer tr;
	struct embd_step_batch b;
	const char *keys_bad[3] = { "a", "x", "c" };

	setup(&fx, EMBD_OPT_SGD, EMBD_SHARD_TABLE_WISE, 2);
	const char *fields[] = { "batch_size", "num_features", "lengths", "keys[1]",
				 "batch_size: 0" };
	for (uint32_t k = 0; k < 5; k++) {
		fill_trainer(&fx, &tr, 3, false);
		b = tr.batch;
		if (k == 0)
			b.kjt.batch_size = B + 1;
		else if (k == 1)
			b.kjt.num_features = 2;
		else if (k == 2)
			b.kjt.num_values += 1;  /* lengths no longer sum to num_values */
		else if (k == 3)
			b.kjt.keys = keys_bad;
		else
			b.kjt.batch_size = 0;
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
