/*
 * Live table access (engine/step_tables.c) against the unsharded reference, for every sharding
 * type: after training steps the rows read back (a range, or ids in any order) equal the
 * reference's weights and optimizer state bit for bit; rows written (weights and state) are
 * exactly what the next step's forward and backward use, on every data_parallel replica; a
 * write is shown to the update hook first; refusals name the row, table or value and change
 * nothing.
 */
#include "tests/unit/engine/step_fixture.h"

#define MAX_COLS 16

/* The reference's rows of array a of table t, in table coordinates (step_tables.c's pieces:
 * the fixture's column slices in column order). */
static void ref_rows(const struct fixture *fx, uint32_t t, enum embd_step_array a,
		     uint32_t cols, int64_t row, float *out)
{
	for (uint32_t k = 0; k < fx->num_refs[t]; k++) {
		const struct embd_ref_table *r = fx->ref[t][k];
		const uint32_t col = fx->ref_col[t][k], n = fx->ref_cols[t][k];
		if (a == EMBD_STEP_WEIGHTS)
			for (uint32_t c = 0; c < n; c++)
				out[col + c] = embd_ref_weight(r, row, c);
		else if (r->opt.type == EMBD_OPT_ROWWISE_ADAGRAD)
			out[cols == 1 ? 0 : k] = r->m1[row];
		else
			for (uint32_t c = 0; c < n; c++)
				out[col + c] = (a == EMBD_STEP_MOMENTUM1 ? r->m1 : r->m2)[row * n + c];
	}
}

/* Sets row `row` of array a of table t in the reference to in. */
static void ref_set(struct fixture *fx, uint32_t t, enum embd_step_array a, uint32_t cols,
		    int64_t row, const float *in)
{
	for (uint32_t k = 0; k < fx->num_refs[t]; k++) {
		struct embd_ref_table *r = fx->ref[t][k];
		const uint32_t col = fx->ref_col[t][k], n = fx->ref_cols[t][k];
		if (a == EMBD_STEP_WEIGHTS)
			memcpy(&r->w32[row * n], in + col, n * sizeof(float));
		else if (r->opt.type == EMBD_OPT_ROWWISE_ADAGRAD)
			r->m1[row] = in[cols == 1 ? 0 : k];
		else
			memcpy(&(a == EMBD_STEP_MOMENTUM1 ? r->m1 : r->m2)[row * n], in + col,
			       n * sizeof(float));
	}
}

/* Floats per row of array a of table t (0: the optimizer has no such array). */
static uint32_t array_cols(const struct fixture *fx, uint32_t t, int a)
{
	struct embd_step_table_info info;

	cr_assert_eq(embd_step_table_info(fx->step, t, (enum embd_step_array)a, &info), 0);
	cr_assert_eq(info.num_embeddings, fx->specs[t].num_embeddings);
	return info.cols;
}

/* Every array of every table read back whole (a range) and by ids equals the reference. */
static void check_reads(const struct fixture *fx, const char *what)
{
	static float got[64 * MAX_COLS];
	char err[256];

	for (uint32_t t = 0; t < NTAB; t++)
		for (int a = EMBD_STEP_WEIGHTS; a <= EMBD_STEP_MOMENTUM2; a++) {
			const uint32_t cols = array_cols(fx, t, a);
			const int64_t rows = fx->specs[t].num_embeddings;
			if (!cols)
				continue;
			struct embd_step_rows all = { .row_begin = 0, .n = (uint64_t)rows };
			int rc = embd_step_table_read(fx->step, t, a, &all, got, err, sizeof(err));
			cr_assert_eq(rc, 0, "%s: table %u array %d: %d %s", what, t, a, rc, err);
			int64_t ids[3] = { rows - 1, 0, 7 };
			float by_id[3 * MAX_COLS], want[MAX_COLS];
			struct embd_step_rows some = { .ids = ids, .n = 3 };
			rc = embd_step_table_read(fx->step, t, a, &some, by_id, err, sizeof(err));
			cr_assert_eq(rc, 0, "%s: table %u array %d by ids: %s", what, t, a, err);
			for (int64_t r = 0; r < rows; r++) {
				ref_rows(fx, t, a, cols, r, want);
				for (uint32_t c = 0; c < cols; c++)
					cr_assert_eq(got[r * cols + c], want[c], "%s: table %u array %d "
						     "row %lld col %u: expected %.9g, got %.9g", what, t, a,
						     (long long)r, c, want[c], got[r * cols + c]);
			}
			for (uint32_t i = 0; i < 3; i++)
				cr_assert(!memcmp(&by_id[i * cols], &got[ids[i] * cols],
						  cols * sizeof(float)),
					  "%s: table %u array %d: row %lld read by id differs", what, t,
					  a, (long long)ids[i]);
		}
}

/* Writes rows of every array: t0 rows 39, 0, 5 by ids, t1 rows 3..7 as a range; the same
 * into the reference. */
static void write_rows(struct fixture *fx, uint64_t seed)
{
	static float in[8 * MAX_COLS];
	uint64_t rng = seed;
	char err[256];

	for (uint32_t t = 0; t < NTAB; t++)
		for (int a = EMBD_STEP_WEIGHTS; a <= EMBD_STEP_MOMENTUM2; a++) {
			const uint32_t cols = array_cols(fx, t, a);
			int64_t ids[3] = { 39, 0, 5 };
			if (!cols)
				continue;
			struct embd_step_rows rows = t == 0 ? (struct embd_step_rows){ .ids = ids, .n = 3 }
							    : (struct embd_step_rows){ .row_begin = 3,
										       .n = 5 };
			for (uint64_t i = 0; i < rows.n * cols; i++)
				/* state stays positive: adagrad divides by its square root */
				in[i] = (float)(rng_next(&rng) % 1000) / (a ? 500.0f : -800.0f);
			int rc = embd_step_table_write(fx->step, t, a, &rows, in, err, sizeof(err));
			cr_assert_eq(rc, 0, "write table %u array %d: %d %s", t, a, rc, err);
			for (uint64_t i = 0; i < rows.n; i++)
				ref_set(fx, t, a, cols, rows.ids ? ids[i] : 3 + (int64_t)i,
					&in[i * cols]);
		}
}

/* Trains, reads everything back, writes rows and trains on them: every step and read equals
 * the reference. */
static void table_case(enum embd_sharding_type type, enum embd_optimizer_type opt)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];
	const uint32_t replicas = type == EMBD_SHARD_DATA_PARALLEL ? 2 : 1;

	setup(&fx, opt, type, 2);
	for (uint32_t step = 0; step < 2; step++) {
		fill_all(&fx, trs, batches, 2, 40 + step);
		cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
		backward_and_check(&fx, trs, batches, 2, replicas, "training before the reads");
	}
	check_reads(&fx, "after 2 steps");
	write_rows(&fx, 99);
	check_weights(&fx, replicas, 0.0f, "after the writes");
	check_reads(&fx, "after the writes");
	fill_all(&fx, trs, batches, 2, 60);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
	check_forward(&fx, trs, 2, row_split_plan(&fx) ? RW_TOL : 0.0f, "the step after the writes");
	backward_and_check(&fx, trs, batches, 2, replicas, "the step after the writes");
	check_reads(&fx, "after the step after the writes");
	stop(&fx);
}

#define TABLE_TESTS(name, type)                                                           \
	Test(step_tables_##name, adagrad) { table_case(type, EMBD_OPT_ADAGRAD); }             \
	Test(step_tables_##name, rowwise_adagrad) { table_case(type, EMBD_OPT_ROWWISE_ADAGRAD); } \
	Test(step_tables_##name, adam) { table_case(type, EMBD_OPT_ADAM); }

TABLE_TESTS(table_wise, EMBD_SHARD_TABLE_WISE)
TABLE_TESTS(column_wise, EMBD_SHARD_COLUMN_WISE)
TABLE_TESTS(row_wise, EMBD_SHARD_ROW_WISE)
TABLE_TESTS(table_row_wise, EMBD_SHARD_TABLE_ROW_WISE)
TABLE_TESTS(table_column_wise, EMBD_SHARD_TABLE_COLUMN_WISE)
TABLE_TESTS(data_parallel, EMBD_SHARD_DATA_PARALLEL)

/* What the update hook was shown: (shard, id) pairs. */
struct hook_log {
	uint32_t n;
	const struct embd_shard *shard[16];
	int64_t id[16];
};

static void record(void *arg, const struct embd_shard *shard, const struct embd_bag_batch *bb,
		   uint32_t n)
{
	struct hook_log *log = arg;
	for (uint32_t b = 0; b < n; b++)
		for (uint64_t i = 0; i < bb[b].num_ids && log->n < 16; i++, log->n++) {
			log->shard[log->n] = shard;
			log->id[log->n] = bb[b].ids[i];
		}
}

/* A write is shown to the hook (a checkpoint's copy-before-write) before it happens, every
 * shard of the table with the rows written; refused writes show nothing and change nothing. */
Test(step_tables, writes_go_through_the_update_hook_and_refusals_change_nothing)
{
	static struct fixture fx;
	struct hook_log log = { 0 };
	float in[2 * 16], nan_row[16];
	char err[256];

	setup(&fx, EMBD_OPT_ADAGRAD, EMBD_SHARD_ROW_WISE, 2);
	embd_step_set_update_hook(fx.step, record, &log);
	for (uint32_t i = 0; i < 2 * 16; i++)
		in[i] = 0.25f * (float)i;
	struct embd_step_rows rows = { .row_begin = 19, .n = 2 };      /* one row on each shard */
	cr_assert_eq(embd_step_table_write(fx.step, 0, EMBD_STEP_WEIGHTS, &rows, in, err,
					   sizeof(err)), 0, "%s", err);
	cr_assert_eq(log.n, 4, "expected the 2 rows shown with each of the 2 shards, got %u",
		     log.n);
	cr_expect(log.id[0] == 19 && log.id[1] == 20 && log.shard[0] != log.shard[2],
		  "expected rows 19, 20 once per shard");
	ref_set(&fx, 0, EMBD_STEP_WEIGHTS, 16, 19, in);
	ref_set(&fx, 0, EMBD_STEP_WEIGHTS, 16, 20, in + 16);
	log.n = 0;

	int64_t bad_ids[2] = { 3, 40 };
	struct embd_step_rows bad = { .ids = bad_ids, .n = 2 };
	cr_expect_eq(embd_step_table_write(fx.step, 0, EMBD_STEP_WEIGHTS, &bad, in, err,
					   sizeof(err)), EMBD_ERANGE);
	cr_expect(strstr(err, "ids[1]: row 40 outside table 't0' rows [0, 40)"), "got '%s'", err);
	struct embd_step_rows past = { .row_begin = 38, .n = 3 };
	cr_expect_eq(embd_step_table_read(fx.step, 0, EMBD_STEP_WEIGHTS, &past, in, err,
					  sizeof(err)), EMBD_ERANGE);
	cr_expect(strstr(err, "rows[2]: row 40"), "got '%s'", err);
	memset(nan_row, 0, sizeof(nan_row));
	nan_row[5] = NAN;
	struct embd_step_rows one = { .row_begin = 2, .n = 1 };
	cr_expect_eq(embd_step_table_write(fx.step, 0, EMBD_STEP_WEIGHTS, &one, nan_row, err,
					   sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "row 0 col 5") && strstr(err, "not a finite"), "got '%s'", err);
	cr_expect_eq(embd_step_table_write(fx.step, 0, EMBD_STEP_MOMENTUM2, &one, nan_row, err,
					   sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "no such state"), "adagrad has no momentum2: got '%s'", err);
	cr_expect_eq(embd_step_table_read(fx.step, NTAB, EMBD_STEP_WEIGHTS, &one, in, err,
					  sizeof(err)), EMBD_ENOENT);
	cr_expect_eq(log.n, 0, "refused writes must not reach the hook");
	check_weights(&fx, 1, 0.0f, "after the refusals");
	stop(&fx);
}

/*
 * The optimizer step a table reports (embd_step_table_info: a trainer's state_dict carries it
 * as adam's t) is its shards' whatever side of them is newer: after steps the device applied
 * and nobody pulled, after a restore that wrote the host views and nothing pushed yet; and
 * the step after that restore trains with it. On the CPU's own shards, and with the CPU
 * running the GPU's ways (engine/ranks.h's EMBD_TEST_CPU_KERNEL): fused_uvm_caching's cache,
 * and rows apart from their host views (device_copy).
 */
static void optimizer_step_case(const char *cpu_kernel)
{
	static struct fixture fx;
	static struct trainer trs[2];
	struct embd_step_batch batches[2];
	struct embd_step_table_info info;
	const char *mode = cpu_kernel ? cpu_kernel : "cpu";
	char err[256];

	/* read by embd_ranks_create_on only, so the other tests keep their environment */
	char *was = getenv("EMBD_TEST_CPU_KERNEL") ? strdup(getenv("EMBD_TEST_CPU_KERNEL")) : NULL;
	if (cpu_kernel)
		setenv("EMBD_TEST_CPU_KERNEL", cpu_kernel, 1);
	else
		unsetenv("EMBD_TEST_CPU_KERNEL");
	setup(&fx, EMBD_OPT_ADAM, EMBD_SHARD_ROW_WISE, 2);
	if (was)
		setenv("EMBD_TEST_CPU_KERNEL", was, 1);
	else
		unsetenv("EMBD_TEST_CPU_KERNEL");
	free(was);

	/* steps and nothing that pulls: the reference trains alongside, unread */
	for (uint32_t step = 0; step < 3; step++) {
		fill_all(&fx, trs, batches, 2, 70 + step);
		cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
		cr_assert_eq(embd_step_backward(fx.step, batches, 2), 0, "%s", batches[0].err);
		for (uint32_t i = 0; i < 2; i++)
			trs[i].batch.status = batches[i].status;
		ref_backward(&fx, trs, 2);
	}
	for (uint32_t t = 0; t < NTAB; t++) {
		cr_assert_eq(embd_step_table_info(fx.step, t, EMBD_STEP_WEIGHTS, &info), 0);
		cr_expect_eq(info.optimizer_step, 3, "%s: table %u after 3 steps not pulled: expected "
			     "optimizer_step 3, got %lld", mode, t, (long long)info.optimizer_step);
	}

	/* a restore of step 57 as ckpt_service.c does one: the host views written, then marked */
	cr_assert_eq(embd_step_shards_pull(fx.step, err, sizeof(err)), 0, "%s", err);
	for (uint32_t i = 0; i < embd_step_num_shards(fx.step); i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(fx.step, i, &v);
		if (v.shard)
			v.shard->step = 57;
	}
	embd_step_shards_changed(fx.step);
	for (uint32_t t = 0; t < NTAB; t++) {
		cr_assert_eq(embd_step_table_info(fx.step, t, EMBD_STEP_MOMENTUM2, &info), 0);
		cr_expect_eq(info.optimizer_step, 57, "%s: table %u after a restore of step 57: "
			     "expected optimizer_step 57, got %lld", mode, t,
			     (long long)info.optimizer_step);
		for (uint32_t k = 0; k < fx.num_refs[t]; k++)
			fx.ref[t][k]->step = 57;
	}

	/* adam's t of the next update is 58 where the kernels run too */
	fill_all(&fx, trs, batches, 2, 80);
	cr_assert_eq(embd_step_forward(fx.step, batches, 2), 2, "%s", batches[0].err);
	backward_and_check(&fx, trs, batches, 2, 1, mode);
	for (uint32_t t = 0; t < NTAB; t++) {
		cr_assert_eq(embd_step_table_info(fx.step, t, EMBD_STEP_WEIGHTS, &info), 0);
		cr_expect_eq(info.optimizer_step, 58, "%s: table %u a step after the restore: "
			     "expected optimizer_step 58, got %lld", mode, t,
			     (long long)info.optimizer_step);
	}
	stop(&fx);
}

Test(step_tables, optimizer_step_of_cpu_shards) { optimizer_step_case(NULL); }
Test(step_tables, optimizer_step_through_the_cache) { optimizer_step_case("fused_uvm_caching"); }
Test(step_tables, optimizer_step_of_device_rows) { optimizer_step_case("device_copy"); }
