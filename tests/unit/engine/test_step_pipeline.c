/*
 * Pipelined steps (embd_step_prepare, engine/step.h): the next step's batches routed while the
 * step before waits for its backward train exactly as unpipelined steps do (checked against
 * the unsharded reference at every step, weights bit-exact), for every sharding type. The
 * trainers overwrite their ids after the preparation, before the forward: the forward still
 * looks up the prepared ids, so the routing really happened early (a forward that routed
 * again would refuse the overwritten ids). A bad id is refused at preparation; an abort drops
 * the preparation; a forward of other batches ignores it.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tests/unit/engine/step_fixture.h"

#define STEPS 4u

/* Sets the statuses the engine wrote in batches into the trainers (the checks read them). */
static void take_status(struct trainer *trs, const struct embd_step_batch *batches, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		trs[i].batch.status = batches[i].status;
}

static void pipelined_case(enum embd_sharding_type type)
{
	static struct fixture fx;
	static struct trainer trs[2][2];
	static int64_t saved[2][3 * B * 3];
	struct embd_step_batch batches[2][2];
	const uint32_t replicas = type == EMBD_SHARD_DATA_PARALLEL ? 2 : 1;
	const float tol = type == EMBD_SHARD_ROW_WISE || type == EMBD_SHARD_TABLE_ROW_WISE ? RW_TOL
															   : 0.0f;
	char what[96];

	setup(&fx, EMBD_OPT_ADAGRAD, type, 2);
	fill_all(&fx, trs[0], batches[0], 2, 100);
	cr_assert_eq(embd_step_forward(fx.step, batches[0], 2), 2, "%s", batches[0][0].err);
	check_forward(&fx, trs[0], 2, tol, "step 0");
	for (uint32_t s = 1; s < STEPS; s++) {
		struct trainer *cur = trs[(s - 1) % 2], *next = trs[s % 2];
		struct embd_step_batch *bcur = batches[(s - 1) % 2], *bnext = batches[s % 2];
		snprintf(what, sizeof(what), "%s, pipelined step %u", embd_plan_sharding_name(type), s);
		fill_all(&fx, next, bnext, 2, 100 + 10 * s);
		const bool bad = s == 2;        /* trainer 1's batch of step 2 has a bad id */
		if (bad)
			next[1].values[0] = 1ll << 40;
		int rc = embd_step_prepare(fx.step, bnext, 2);
		cr_assert_eq(rc, bad ? 1 : 2, "%s: prepare accepted %d: %s", what, rc, bnext[1].err);
		cr_assert(embd_step_prepared(fx.step), "%s: nothing prepared", what);
		if (bad)
			cr_assert(bnext[1].status == EMBD_ERANGE && strstr(bnext[1].err, "values[0]"),
				  "%s: bad id refused at preparation: got %d '%s'", what,
				  bnext[1].status, bnext[1].err);
		/* the trainers scribble on their ids: the prepared copy is what counts */
		for (uint32_t i = 0; i < 2; i++) {
			memcpy(saved[i], next[i].values, sizeof(saved[i]));
			for (uint32_t k = 0; k < 3 * B * 3; k++)
				next[i].values[k] = -1;
		}
		backward_and_check(&fx, cur, bcur, 2, replicas, what);
		rc = embd_step_forward(fx.step, bnext, 2);
		cr_assert_eq(rc, bad ? 1 : 2, "%s: forward accepted %d: %s", what, rc, bnext[0].err);
		cr_assert(!embd_step_prepared(fx.step), "%s: the preparation was not used", what);
		for (uint32_t i = 0; i < 2; i++)
			memcpy(next[i].values, saved[i], sizeof(saved[i]));
		take_status(next, bnext, 2);
		check_forward(&fx, next, 2, tol, what);
	}
	backward_and_check(&fx, trs[(STEPS - 1) % 2], batches[(STEPS - 1) % 2], 2, replicas,
			   "the last step");
	stop(&fx);
}

Test(step_pipeline, table_wise) { pipelined_case(EMBD_SHARD_TABLE_WISE); }
Test(step_pipeline, column_wise) { pipelined_case(EMBD_SHARD_COLUMN_WISE); }
Test(step_pipeline, row_wise) { pipelined_case(EMBD_SHARD_ROW_WISE); }
Test(step_pipeline, table_row_wise) { pipelined_case(EMBD_SHARD_TABLE_ROW_WISE); }
Test(step_pipeline, table_column_wise) { pipelined_case(EMBD_SHARD_TABLE_COLUMN_WISE); }
Test(step_pipeline, data_parallel) { pipelined_case(EMBD_SHARD_DATA_PARALLEL); }

/* An abort drops the preparation (its step never ran: the trainers post it again); a forward
 * of another batches array routes its own and trains exactly. */
Test(step_pipeline, abort_and_other_batches_drop_it)
{
	static struct fixture fx;
	static struct trainer trs[2], other[2];
	struct embd_step_batch batches[2], obatches[2];

	setup(&fx, EMBD_OPT_SGD, EMBD_SHARD_TABLE_WISE, 2);
	fill_all(&fx, trs, batches, 2, 5);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
	fill_all(&fx, other, obatches, 2, 6);
	cr_assert_eq(embd_step_prepare(fx.step, obatches, 2), 2);
	embd_step_abort(fx.step, "test");
	cr_assert(!embd_step_prepared(fx.step), "an abort keeps the preparation");
	check_weights(&fx, 1, 0.0f, "after abort");

	fill_all(&fx, trs, batches, 2, 7);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
	cr_assert_eq(embd_step_prepare(fx.step, obatches, 2), 2);
	backward_and_check(&fx, trs, batches, 2, 1, "backward with a preparation");
	/* not the prepared array: routed anew (and the preparation is gone) */
	fill_all(&fx, trs, batches, 2, 8);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2);
	cr_assert(!embd_step_prepared(fx.step), "a forward of other batches keeps the preparation");
	check_forward(&fx, trs, 2, 0.0f, "forward of other batches");
	backward_and_check(&fx, trs, batches, 2, 1, "its backward");
	cr_assert_eq(embd_step_prepare(fx.step, obatches, MAX_T + 1), EMBD_EINVAL);
	stop(&fx);
}
