/*
 * Pooled forward against the plain reference. Over one unsplit shard or column shards the
 * kernels must equal the reference bit for bit (same fmaf order per column, whatever the ISA
 * or the worker count). Row-wise shards add partial sums in another order, so their sum is
 * held to the float error bound of that reordering: |got - ref| <= 4 (L + W) eps sum|w x| / L
 * for a bag of L ids split over W shards.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu_kernels.h"
#include "kernels/jagged.h"
#include "tests/unit/kernels/kernel_test_util.h"

static const struct embd_optimizer_spec sgd = { .type = EMBD_OPT_SGD, .lr = 0.1f };

/* The forward of one feature over shard s into out (stride floats, column col). */
static int run_forward(const struct embd_exec *ex, const struct embd_shard *s, const struct tbags *t,
		       enum embd_pooling pooling, const int32_t *mean_lengths, float *out,
		       uint64_t stride, uint32_t col, struct embd_kernel_err *err)
{
	struct embd_bag_batch bt = {
		.shard = s, .feature = 7, .batch_size = t->batch_size, .offsets = t->offsets,
		.ids = t->ids, .weights = t->weights, .num_ids = t->num_ids, .pooling = pooling,
		.mean_lengths = mean_lengths, .pooled = out, .pooled_stride = stride, .pooled_col = col,
	};
	return embd_kernels_forward(ex, &bt, 1, err);
}

/* The bags t over one unsplit shard, on every ISA, with 1 and 3 workers: kernel == reference
 * exactly, and nothing stored in the GUARD columns after each pooled row (a pass's part vector
 * stored whole would land there). */
#define GUARD 3
static void check_bags(const struct tbags *t, int64_t rows, uint32_t dim, enum embd_data_type dtype,
		       bool weighted, enum embd_pooling pooling)
{
	struct embd_ref_table *ref = embd_ref_table_create(3, rows, dim, dtype, &sgd, 11);
	struct embd_shard *s = tshard(ref, 11, 0, rows, 0, dim);
	const uint32_t batch = t->batch_size;
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	struct embd_workers *three;
	char msg[128];

	cr_assert_eq(embd_workers_create(3, NULL, &three, msg, sizeof(msg)), 0, "%s", msg);
	const uint64_t stride = dim + GUARD;
	float *expected = malloc((uint64_t)batch * dim * sizeof(float) + 4);
	float *got = malloc((uint64_t)batch * dim * sizeof(float) + 4);
	float *strided = malloc((uint64_t)batch * stride * sizeof(float));
	struct embd_ref_bags rb = { batch, t->lengths, t->ids, t->weights, pooling, NULL, 0 };
	embd_ref_forward(ref, &rb, expected);

	for (int i = 0; i < nisa; i++) {
		for (int nw = 0; nw < 2; nw++) {
			struct embd_exec ex = { .workers = nw ? three : NULL, .isa = isas[i] };
			struct embd_kernel_err err;
			memset(strided, 0xff, (uint64_t)batch * stride * sizeof(float));
			int rc = run_forward(&ex, s, t, pooling, NULL, strided, stride, 0, &err);
			cr_assert_eq(rc, 0, "%s: rc %d %s", embd_kernels_isa_name(isas[i]), rc, err.msg);
			snprintf(msg, sizeof(msg), "%s %s dim %u B %u %s %s workers %d",
				 embd_kernels_isa_name(isas[i]), dtype ? "fp16" : "fp32", dim, batch,
				 weighted ? "weighted" : "unweighted", pooling ? "mean" : "sum",
				 nw ? 3 : 1);
			uint64_t stored_past = 0;
			for (uint32_t b = 0; b < batch; b++) {
				const float *row = strided + b * stride;
				memcpy(got + (uint64_t)b * dim, row, dim * sizeof(float));
				for (uint32_t c = dim; c < stride; c++) {
					uint32_t bits;
					memcpy(&bits, &row[c], sizeof(bits));
					stored_past += bits != 0xffffffffu;
				}
			}
			cr_expect_eq(stored_past, 0, "%s: %llu floats stored past pooled rows", msg,
				     (unsigned long long)stored_past);
			texpect_equal(msg, expected, got, (uint64_t)batch * dim);
		}
	}
	free(expected);
	free(got);
	free(strided);
	embd_workers_destroy(three);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/* One random case on every ISA and with 1 and 3 workers: kernel == reference exactly. */
static void check_unsharded(struct trng *r, int64_t rows, uint32_t dim, enum embd_data_type dtype,
			    uint32_t batch, uint32_t max_len, bool weighted, enum embd_pooling pooling)
{
	struct tbags t;

	tbags_random(&t, r, batch, max_len, 10, rows, 20, weighted);
	check_bags(&t, rows, dim, dtype, weighted, pooling);
	tbags_free(&t);
}

Test(kernels_forward, random_shapes_equal_reference)
{
	static const uint32_t dims[] = { 1, 3, 8, 15, 16, 17, 31, 64, 100, 128, 129, 257, 300 };
	struct trng r = { 1 };

	for (int trial = 0; trial < 40; trial++) {
		uint32_t dim = dims[trng_below(&r, sizeof(dims) / sizeof(dims[0]))];
		check_unsharded(&r, 1 + (int64_t)trng_below(&r, 3000), dim,
				trng_below(&r, 2) ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32,
				1 + (uint32_t)trng_below(&r, 80), (uint32_t)trng_below(&r, 40),
				trng_below(&r, 2), trng_below(&r, 2) ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM);
	}
}

/*
 * Every isa against the definition at widths of whole vectors (one pass and several) and with a
 * tail vector in the last pass, for fp32 and fp16 rows, plain and weighted: the kernels compile
 * separate loops for passes of whole vectors and for a pass with a tail. AVX2 passes are 96
 * columns of fp16 rows (80, 88 and 96 one whole pass, the lean loop's for 96, and 84 one
 * with a tail; 128, 200 and 256 ending on a shorter pass of whole vectors, 100 and 260 on a
 * tail) and 64 of fp32 rows. AVX2's lean loop widens fp16 rows of one pass two vectors a
 * load: 32, 64 and 96 columns (4, 8 and 12 vectors; its lean fp16 rows are whole lines, an
 * even number of vectors); it takes rows of several passes of whole lines too: fp16 128, 160,
 * 192, 224 and 256 columns (12 + 4 vectors up to 12 + 12 + 8), fp32 80, 96, 112 and 128 (8 + 2
 * up to 8 + 8). AVX-512 reads fp32 passes of 16 whole vectors (256 and 512 columns) in whole
 * loads, others in halves (250: 15 and a part).
 */
Test(kernels_forward, whole_and_tail_passes_equal_reference)
{
	static const uint32_t dims[] = { 8, 20, 24, 32, 64, 80, 84, 88, 96, 100, 112, 128, 160, 192,
					 200, 224, 250, 256, 260, 512 };
	struct trng r = { 4 };

	for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++)
		for (int fp16 = 0; fp16 <= 1; fp16++)
			for (int weighted = 0; weighted <= 1; weighted++)
				check_unsharded(&r, 700, dims[d], fp16 ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32,
						33, 25, weighted, EMBD_POOLING_SUM);
}

/*
 * The forward's prefetch distance (embd_forward_prefetch_rows), row by row as the benchmarks
 * chose it: 48 ids for every row, but on Intel CPUs 12 for fp32 rows longer than two lines
 * other than 512 bytes; every distance within what the lean loop's window holds past its ids.
 * The CPU's (embd_forward_prefetch_distance) is the vendor's of $EMBD_CPU_VENDOR.
 */
static void check_distance_rule(const char *vendor)
{
	static const struct {
		uint64_t bytes;
		uint32_t elem, intel, other;
	} rows[] = {
		/* bytes, element, Intel's, others' */
		{ 32, 2, 48, 48 },   { 64, 2, 48, 48 },   { 128, 2, 48, 48 },  { 192, 2, 48, 48 },
		{ 256, 2, 48, 48 },  { 512, 2, 48, 48 },  { 1024, 2, 48, 48 },
		{ 32, 4, 48, 48 },   { 64, 4, 48, 48 },   { 128, 4, 48, 48 },  { 192, 4, 12, 48 },
		{ 256, 4, 12, 48 },  { 512, 4, 48, 48 },  { 1024, 4, 12, 48 }, { 2048, 4, 12, 48 },
	};
	const bool intel = !strcmp(vendor, "intel");

	cr_assert_eq(setenv("EMBD_CPU_VENDOR", vendor, 1), 0);
	for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
		const uint64_t bytes = rows[i].bytes;
		const uint32_t elem = rows[i].elem;
		const uint32_t want = intel ? rows[i].intel : rows[i].other;
		const uint32_t rule = embd_forward_prefetch_rows(bytes, elem, intel);

		cr_expect_eq(rule, want, "%s: %lu bytes of %u", vendor, (unsigned long)bytes, elem);
		cr_expect_eq(embd_forward_prefetch_distance(bytes, elem), want,
			     "%s: %lu bytes of %u", vendor, (unsigned long)bytes, elem);
		cr_expect(rule <= EMBD_LEAN_WINDOW_PAD);
	}
}

Test(kernels_forward, prefetch_distance_rule_intel)
{
	check_distance_rule("intel");
}

Test(kernels_forward, prefetch_distance_rule_other)
{
	check_distance_rule("other");
}

/*
 * Every row the lean loop takes (embd_forward_lean, at the kernels' pass widths) is among the
 * widths lean_bags has a case for (lean_has_loop answers from the same list), fp16 and fp32
 * rows of up to 1024 columns, on each vector isa this CPU runs (the table's function is that
 * variant's code): a width without one falls back to the checked loop with the same sums,
 * which no other test sees. The scalar variant has no lean loop.
 */
Test(kernels_forward, lean_rows_have_their_loop)
{
	static const enum embd_isa isas[] = { EMBD_ISA_AVX2, EMBD_ISA_AVX512 };
	static _Alignas(64) const uint8_t base[64];

	cr_expect(embd_cpu_kernels_get(EMBD_ISA_SCALAR)->lean_has_loop == NULL);
	for (int i = 0; i < 2; i++) {
		const struct embd_cpu_kernels *k = embd_cpu_kernels_get(isas[i]);
		uint32_t lean = 0;

		if (!embd_kernels_isa_supported(isas[i]))
			continue;
		cr_assert(k && k->lean_has_loop, "%s", embd_kernels_isa_name(isas[i]));
		for (uint32_t cols = 1; cols <= 1024; cols++) {
			for (uint32_t elem = 2; elem <= 4; elem += 2) {
				const uint32_t pass = embd_forward_pass_cols(isas[i], cols, elem);
				const char *dtype = elem == 2 ? "fp16" : "fp32";

				if (!embd_forward_lean(isas[i], (uint64_t)pass * elem,
						       (uint64_t)cols * elem, base))
					continue;
				lean++;
				cr_expect(k->lean_has_loop(cols, elem), "%s: %s rows of %u columns",
					  embd_kernels_isa_name(isas[i]), dtype, cols);
			}
		}
		/* fp16 and fp32 rows of 1-8 whole lines (on AVX2 their passes start on a line) */
		cr_expect_eq(lean, 16, "%s: %u lean widths", embd_kernels_isa_name(isas[i]), lean);
	}
}

/*
 * The rows the AVX2 and AVX-512 lean loops also prefetch into L1 a few ids ahead
 * (embd_forward_prefetch_l1_near): fp16 rows of 256 and 512 bytes, AVX-512's on Intel CPUs
 * only, no others, and never further ahead than their L2 prefetch (the window holds the rows
 * to that one).
 */
static bool near_prefetch_listed(bool intel, enum embd_isa isa, uint64_t bytes, uint32_t elem)
{
	/* the fp16 rows that have it: isa, bytes, on Intel's, on others' */
	static const struct {
		enum embd_isa isa;
		uint64_t bytes;
		bool intel, other;
	} near[] = {
		{ EMBD_ISA_AVX2, 256, true, true },
		{ EMBD_ISA_AVX2, 512, true, true },
		{ EMBD_ISA_AVX512, 256, true, false },
		{ EMBD_ISA_AVX512, 512, true, false },
	};

	for (size_t i = 0; elem == 2 && i < sizeof(near) / sizeof(near[0]); i++)
		if (near[i].isa == isa && near[i].bytes == bytes)
			return intel ? near[i].intel : near[i].other;
	return false;
}

Test(kernels_forward, near_prefetch_rule)
{
	const uint64_t bytes[] = { 64, 128, 256, 384, 512, 1024 };
	const enum embd_isa isas[] = { EMBD_ISA_SCALAR, EMBD_ISA_AVX2, EMBD_ISA_AVX512 };

	for (int n = 0; n < 2 * 6 * 2 * 3; n++) { /* vendor x bytes x element x isa */
		const bool intel = n / 36;
		const uint64_t b = bytes[n / 6 % 6];
		const uint32_t elem = n / 3 % 2 ? 4 : 2;
		const enum embd_isa isa = isas[n % 3];
		const bool want = near_prefetch_listed(intel, isa, b, elem);

		cr_expect_eq(embd_forward_prefetch_l1_near(isa, b, elem, intel), want,
			     "%s, %s, %lu bytes of %u", intel ? "intel" : "other",
			     embd_kernels_isa_name(isa), (unsigned long)b, elem);
		if (want)
			cr_expect_geq(embd_forward_prefetch_rows(b, elem, intel),
				      EMBD_PREFETCH_IDS_NEAR);
	}
}

/*
 * Either vendor's rules ($EMBD_CPU_VENDOR, read once a process; criterion runs each test in its
 * own), so that both rules' lean-loop windows, chunk heads and checked loops are checked on any
 * CPU: fp16 and 128- and 512-byte fp32 rows (48 ids ahead), 256-byte and 1 KiB fp32 rows (12
 * ahead on Intel, 48 elsewhere), fp16 rows of 256 and 512 bytes (with AVX2, and on Intel with
 * AVX-512, also prefetched into L1 a few ids ahead), many short chunks, and bags longer than a
 * window.
 */
static void check_with_vendor(const char *vendor)
{
	struct trng r = { 12 };
	const bool intel = !strcmp(vendor, "intel");

	cr_assert_eq(setenv("EMBD_CPU_VENDOR", vendor, 1), 0);
	cr_assert_eq(embd_forward_prefetch_distance(256, 4),
		     embd_forward_prefetch_rows(256, 4, intel),
		     "the vendor was read before the test set it");
	cr_assert_eq(embd_forward_prefetch_near(EMBD_ISA_AVX512, 512, 2),
		     embd_forward_prefetch_l1_near(EMBD_ISA_AVX512, 512, 2, intel));
	check_unsharded(&r, 3000, 128, EMBD_DTYPE_FP16, 80, 40, true, EMBD_POOLING_SUM);
	check_unsharded(&r, 3000, 32, EMBD_DTYPE_FP32, 80, 40, false, EMBD_POOLING_MEAN);
	check_unsharded(&r, 3000, 128, EMBD_DTYPE_FP32, 80, 40, true, EMBD_POOLING_SUM);
	check_unsharded(&r, 3000, 64, EMBD_DTYPE_FP32, 80, 40, true, EMBD_POOLING_SUM);
	check_unsharded(&r, 3000, 256, EMBD_DTYPE_FP32, 40, 30, true, EMBD_POOLING_SUM);
	check_unsharded(&r, 50000, 16, EMBD_DTYPE_FP16, 4099, 2, false, EMBD_POOLING_SUM);
	check_unsharded(&r, 5000, 64, EMBD_DTYPE_FP16, 3, 3000, true, EMBD_POOLING_MEAN);
	check_unsharded(&r, 3000, 256, EMBD_DTYPE_FP16, 40, 30, true, EMBD_POOLING_SUM);
	check_unsharded(&r, 5000, 256, EMBD_DTYPE_FP16, 3, 3000, false, EMBD_POOLING_SUM);
	check_unsharded(&r, 5000, 128, EMBD_DTYPE_FP16, 3, 3000, false, EMBD_POOLING_SUM);
}

Test(kernels_forward, intel_prefetch_distances_equal_reference, .timeout = 60)
{
	check_with_vendor("intel");
}

Test(kernels_forward, other_prefetch_distances_equal_reference, .timeout = 60)
{
	check_with_vendor("other");
}

Test(kernels_forward, batch_of_one)
{
	struct trng r = { 2 };
	check_unsharded(&r, 500, 33, EMBD_DTYPE_FP32, 1, 50, true, EMBD_POOLING_SUM);
	check_unsharded(&r, 500, 24, EMBD_DTYPE_FP16, 1, 50, false, EMBD_POOLING_MEAN);
}

Test(kernels_forward, empty_bags_are_zero)
{
	struct trng r = { 3 };
	/* max_len 0: every bag empty; MEAN of an empty bag is 0, not NaN */
	check_unsharded(&r, 100, 20, EMBD_DTYPE_FP32, 64, 0, false, EMBD_POOLING_MEAN);
	check_unsharded(&r, 100, 20, EMBD_DTYPE_FP16, 64, 0, true, EMBD_POOLING_SUM);

	struct embd_ref_table *ref = embd_ref_table_create(3, 10, 5, EMBD_DTYPE_FP32, &sgd, 1);
	struct embd_shard *s = tshard(ref, 1, 0, 10, 0, 5);
	int64_t offsets[3] = { 0, 0, 0 };
	struct tbags t = { .batch_size = 2, .offsets = offsets };
	float out[10];
	memset(out, 0xff, sizeof(out));
	cr_assert_eq(run_forward(NULL, s, &t, EMBD_POOLING_MEAN, NULL, out, 5, 0, NULL), 0);
	for (int i = 0; i < 10; i++)
		cr_expect_eq(out[i], 0.0f, "out[%d]: expected 0, got %g", i, out[i]);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

Test(kernels_forward, a_million_ids, .timeout = 60)
{
	struct trng r = { 4 };
	/* B 2000 x up to 1000 ids: about a million, dim 20 (not a multiple of 8 or 16) */
	check_unsharded(&r, 100000, 20, EMBD_DTYPE_FP32, 2000, 1000, true, EMBD_POOLING_MEAN);
}

Test(kernels_forward, column_shards_equal_reference)
{
	struct trng r = { 5 };
	const uint32_t dim = 45, split = 29;
	const int64_t rows = 700;

	for (int dt = 0; dt < 2; dt++) {
		struct embd_ref_table *ref = embd_ref_table_create(9, rows, dim, dt, &sgd, 5);
		struct embd_shard *a = tshard(ref, 5, 0, rows, 0, split);
		struct embd_shard *b = tshard(ref, 5, 0, rows, split, dim - split);
		struct tbags t;
		tbags_random(&t, &r, 50, 30, 10, rows, 30, true);
		/* a KeyedTensor of two features: a 3-column feature first, then this table's */
		const uint32_t stride = 3 + dim;
		float *got = calloc(50 * stride, sizeof(float)), *expected = malloc(50 * dim * sizeof(float));
		struct embd_ref_bags rb = { 50, t.lengths, t.ids, t.weights, EMBD_POOLING_MEAN, NULL, 0 };
		embd_ref_forward(ref, &rb, expected);
		struct embd_bag_batch bt[2] = {
			{ .shard = a, .batch_size = 50, .offsets = t.offsets, .ids = t.ids,
			  .weights = t.weights, .num_ids = t.num_ids, .pooling = EMBD_POOLING_MEAN,
			  .pooled = got, .pooled_stride = stride, .pooled_col = 3 },
			{ .shard = b, .batch_size = 50, .offsets = t.offsets, .ids = t.ids,
			  .weights = t.weights, .num_ids = t.num_ids, .pooling = EMBD_POOLING_MEAN,
			  .pooled = got, .pooled_stride = stride, .pooled_col = 3 + split },
		};
		cr_assert_eq(embd_kernels_forward(NULL, bt, 2, NULL), 0);
		for (uint32_t s = 0; s < 50; s++) {
			texpect_equal("column shards", expected + s * dim, got + s * stride + 3, dim);
			for (int c = 0; c < 3; c++)
				cr_assert_eq(got[s * stride + c], 0.0f, "column %d of sample %u was written", c, s);
		}
		free(got);
		free(expected);
		tbags_free(&t);
		embd_shard_destroy(a);
		embd_shard_destroy(b);
		embd_ref_table_destroy(ref);
	}
}

Test(kernels_forward, row_shards_sum_to_reference)
{
	struct trng r = { 6 };
	const uint32_t W = 3, dim = 19, B = 40;
	const int64_t rows = 1000, block = (rows + W - 1) / W;

	for (int pooling = 0; pooling < 2; pooling++) {
		struct embd_ref_table *ref = embd_ref_table_create(2, rows, dim, EMBD_DTYPE_FP32, &sgd, 8);
		struct tbags t;
		tbags_random(&t, &r, B, 25, 10, rows, 10, true);
		int32_t *blen = malloc(W * B * sizeof(int32_t));
		int64_t *bval = malloc((t.num_ids + 1) * sizeof(int64_t));
		float *bw = malloc((t.num_ids + 1) * sizeof(float));
		struct embd_bucketize_args ba = {
			.num_features = 1, .batch_size = B, .lengths = t.lengths, .values = t.ids,
			.weights = t.weights, .num_values = t.num_ids, .feature_rows = &rows,
			.num_buckets = W, .out_lengths = blen, .out_values = bval, .out_weights = bw,
		};
		char msg[128];
		cr_assert_eq(embd_jagged_bucketize(&ba, msg, sizeof(msg)), 0, "%s", msg);

		float *sum = calloc(B * dim, sizeof(float)), *part = malloc(B * dim * sizeof(float));
		uint64_t base = 0;
		for (uint32_t k = 0; k < W; k++) {
			int64_t lo = k * block, n = lo + block > rows ? rows - lo : block;
			struct embd_shard *s = tshard(ref, 8, lo, n, 0, dim);
			int64_t off[B + 1];
			off[0] = 0;
			for (uint32_t b = 0; b < B; b++)
				off[b + 1] = off[b] + blen[k * B + b];
			struct tbags tk = { .batch_size = B, .offsets = off, .ids = bval + base,
					    .weights = bw + base, .num_ids = (uint64_t)off[B] };
			cr_assert_eq(run_forward(NULL, s, &tk, pooling, t.lengths, part, dim, 0, NULL), 0);
			for (uint32_t i = 0; i < B * dim; i++)
				sum[i] += part[i];
			base += (uint64_t)off[B];
			embd_shard_destroy(s);
		}
		float *expected = malloc(B * dim * sizeof(float));
		struct embd_ref_bags rb = { B, t.lengths, t.ids, t.weights, pooling, NULL, 0 };
		embd_ref_forward(ref, &rb, expected);
		const int64_t *id = t.ids;
		const float *w = t.weights;
		for (uint32_t b = 0; b < B; b++) {
			int32_t L = t.lengths[b];
			for (uint32_t c = 0; c < dim; c++) {
				double mag = 0;
				for (int32_t k = 0; k < L; k++)
					mag += fabs(w[k] * embd_ref_weight(ref, id[k], c));
				if (pooling == EMBD_POOLING_MEAN && L)
					mag /= L;
				double bound = 4.0 * (L + W) * FLT_EPSILON * mag;
				double d = fabs((double)sum[b * dim + c] - expected[b * dim + c]);
				cr_assert(d <= bound, "sample %u col %u: expected %.9g, got %.9g (|d| %.3g > %.3g)",
					  b, c, expected[b * dim + c], sum[b * dim + c], d, bound);
			}
			id += L;
			w += L;
		}
		free(expected);
		free(sum);
		free(part);
		free(blen);
		free(bval);
		free(bw);
		tbags_free(&t);
		embd_ref_table_destroy(ref);
	}
}

/*
 * Bags of 0-2 ids, thousands of them: chunks of about a thousand ids hold hundreds of bags
 * each and the last chunk is ragged, so chunk edges (the rows prefetched at a chunk's head,
 * prefetching that stops at its end) are crossed many times, on every ISA and 3 workers.
 */
Test(kernels_forward, many_chunks_of_short_bags)
{
	struct trng r = { 8 };
	check_unsharded(&r, 50000, 64, EMBD_DTYPE_FP32, 5001, 2, false, EMBD_POOLING_SUM);
	check_unsharded(&r, 50000, 20, EMBD_DTYPE_FP16, 4099, 2, true, EMBD_POOLING_MEAN);
	check_unsharded(&r, 50000, 129, EMBD_DTYPE_FP32, 3333, 1, true, EMBD_POOLING_MEAN);
}

/*
 * Bags longer than the lean loop's window of ids (1024: cpu_kernels.c) are pooled a window at a
 * time, their sums carried in the output row between windows: still equal to the reference,
 * for fp16 and fp32 rows the lean loop takes, plain and weighted, summed and averaged, in one
 * pass and (AVX2: fp32 D 128, fp16 D 256) in several.
 */
Test(kernels_forward, bags_longer_than_a_window, .timeout = 60)
{
	/* 600 bags, every 37th 1024-3100 ids long (some ending on a window's edge), the rest
	 * 0-30: the forward's chunks (about 1024 ids, at least 32 bags) start and end inside long
	 * bags' neighbours, and each long bag spans two to four windows */
	static const uint32_t long_len[] = { 1024, 1025, 2048, 3100, 1500, 2047 };
	struct trng r = { 10 };
	const int64_t rows = 20000;
	struct tbags t;

	for (int shape = 0; shape < 5; shape++) {
		static const uint32_t dims[] = { 32, 64, 16, 128, 256 };
		bool fp16 = shape < 2 || shape == 4, weighted = shape % 2 == 0;
		tbags_random(&t, &r, 600, 30, 10, rows, 20, weighted);
		for (uint32_t b = 0, n = 0; b < t.batch_size; b += 37, n++)
			t.lengths[b] = (int32_t)long_len[n % (sizeof(long_len) / sizeof(long_len[0]))];
		t.num_ids = 0;
		for (uint32_t b = 0; b < t.batch_size; b++) {
			t.offsets[b] = (int64_t)t.num_ids;
			t.num_ids += (uint64_t)t.lengths[b];
		}
		t.offsets[t.batch_size] = (int64_t)t.num_ids;
		t.ids = realloc(t.ids, t.num_ids * sizeof(*t.ids));
		cr_assert(t.ids);
		for (uint64_t k = 0; k < t.num_ids; k++)
			t.ids[k] = (int64_t)trng_below(&r, (uint64_t)rows);
		if (weighted) {
			t.weights = realloc(t.weights, t.num_ids * sizeof(float));
			cr_assert(t.weights);
			for (uint64_t k = 0; k < t.num_ids; k++)
				t.weights[k] = trng_float(&r, -1.5f, 1.5f);
		}
		check_bags(&t, rows, dims[shape], fp16 ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32, weighted,
			   shape % 3 == 0 ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM);
		tbags_free(&t);
	}
}

/*
 * An id outside the shard in the second window of a long bag, and one just past a window's end
 * (among the ids that window's last rows prefetch), on every isa, in rows of one lean pass
 * (fp32 D 16) and of several (fp16 D 256 on AVX2): the bag that holds it is named, with the
 * id, whatever window it falls in.
 */
Test(kernels_forward, out_of_range_id_past_a_window)
{
	const int64_t rows = 5000;
	/* windows of the one chunk: [0, 1024), [1024, 2048), ..., [5120, 6000); bag 0 is ids
	 * [0, 1500), bag 1 [1500, 4000), bag 2 [4000, 4100), bag 3 [4100, 6000) */
	static const struct { uint64_t at; uint32_t sample; } cases[] = {
		{ 3000, 1 }, { 1024 + 3, 0 }, { 4000 + 2, 2 }, { 5999, 3 },
	};
	static const struct { uint32_t dim; enum embd_data_type dtype; } shapes[] = {
		{ 16, EMBD_DTYPE_FP32 }, { 256, EMBD_DTYPE_FP16 },
	};
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	int64_t offsets[5] = { 0, 1500, 4000, 4100, 6000 };
	int64_t *ids = malloc(6000 * sizeof(*ids));
	float *out = malloc(4 * 256 * sizeof(float));
	struct trng r = { 11 };

	for (size_t sh = 0; sh < sizeof(shapes) / sizeof(shapes[0]); sh++) {
		const uint32_t dim = shapes[sh].dim;
		struct embd_ref_table *ref =
			embd_ref_table_create(4, rows, dim, shapes[sh].dtype, &sgd, 2);
		struct embd_shard *s = tshard(ref, 2, 0, rows, 0, dim);

		for (int i = 0; i < nisa; i++) {
			for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
				for (int k = 0; k < 6000; k++)
					ids[k] = (int64_t)trng_below(&r, (uint64_t)rows);
				ids[cases[c].at] = rows + 7;
				struct tbags t = { .batch_size = 4, .offsets = offsets, .ids = ids,
						   .num_ids = 6000 };
				struct embd_exec ex = { .isa = isas[i] };
				struct embd_kernel_err err = { 0 };
				int rc = run_forward(&ex, s, &t, EMBD_POOLING_SUM, NULL, out, dim, 0, &err);
				cr_assert_eq(rc, EMBD_ERANGE, "D %u %s id at %llu: expected EMBD_ERANGE, got %d",
					     dim, embd_kernels_isa_name(isas[i]),
					     (unsigned long long)cases[c].at, rc);
				cr_expect_eq(err.sample, cases[c].sample,
					     "D %u %s id at %llu: sample %lld, expected %u", dim,
					     embd_kernels_isa_name(isas[i]), (unsigned long long)cases[c].at,
					     (long long)err.sample, cases[c].sample);
				cr_expect_eq(err.id, rows + 7, "id: expected %lld, got %lld",
					     (long long)(rows + 7), (long long)err.id);
			}
		}
		embd_shard_destroy(s);
		embd_ref_table_destroy(ref);
	}
	free(out);
	free(ids);
}

/* An id out of range in a late chunk, with 3 workers: the first bad sample is reported. */
Test(kernels_forward, out_of_range_id_in_a_late_chunk)
{
	struct trng r = { 9 };
	struct embd_ref_table *ref = embd_ref_table_create(4, 1000, 16, EMBD_DTYPE_FP32, &sgd, 2);
	struct embd_shard *s = tshard(ref, 2, 0, 1000, 0, 16);
	struct embd_workers *three;
	char msg[128];
	struct tbags t;

	cr_assert_eq(embd_workers_create(3, NULL, &three, msg, sizeof(msg)), 0, "%s", msg);
	tbags_random(&t, &r, 6000, 2, 0, 1000, 0, false);
	uint32_t sample = 5000, later = 5900;
	while (t.lengths[sample] == 0)
		sample++;
	while (t.lengths[later] == 0)
		later++;
	t.ids[t.offsets[sample]] = 1000;
	t.ids[t.offsets[later]] = -5;
	float *out = malloc(6000 * 16 * sizeof(float));
	struct embd_exec ex = { .workers = three };
	struct embd_kernel_err err = { 0 };
	int rc = run_forward(&ex, s, &t, EMBD_POOLING_SUM, NULL, out, 16, 0, &err);
	cr_assert_eq(rc, EMBD_ERANGE, "expected EMBD_ERANGE, got %d", rc);
	cr_expect_eq(err.sample, sample, "sample: expected %u, got %lld", sample, (long long)err.sample);
	cr_expect_eq(err.id, 1000, "id: expected 1000, got %lld", (long long)err.id);
	free(out);
	tbags_free(&t);
	embd_workers_destroy(three);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

Test(kernels_forward, out_of_range_ids_are_errors)
{
	struct trng r = { 7 };
	const int64_t rows = 300;
	struct embd_ref_table *ref = embd_ref_table_create(4, rows, 16, EMBD_DTYPE_FP32, &sgd, 2);
	/* rows [100, 200): ids 99 and 200 are one past either end */
	struct embd_shard *s = tshard(ref, 2, 100, 100, 0, 16);
	static const int64_t bad_ids[] = { 99, 200, -1, INT64_MIN, INT64_MAX, 100 + (1ll << 40) };
	enum embd_isa isas[3];
	int nisa = tisas(isas);

	for (int i = 0; i < nisa; i++) {
		for (size_t j = 0; j < sizeof(bad_ids) / sizeof(bad_ids[0]); j++) {
			struct tbags t;
			tbags_random(&t, &r, 64, 10, 0, 100, 0, false);
			for (uint64_t k = 0; k < t.num_ids; k++)
				t.ids[k] += 100;
			uint32_t sample = 37;
			while (t.lengths[sample] == 0)
				sample++;
			t.ids[t.offsets[sample] + t.lengths[sample] / 2] = bad_ids[j];
			float *out = malloc(64 * 16 * sizeof(float));
			struct embd_exec ex = { .isa = isas[i] };
			struct embd_kernel_err err = { 0 };
			int rc = run_forward(&ex, s, &t, EMBD_POOLING_SUM, NULL, out, 16, 0, &err);
			cr_assert_eq(rc, EMBD_ERANGE, "%s id %lld: expected EMBD_ERANGE, got %d",
				     embd_kernels_isa_name(isas[i]), (long long)bad_ids[j], rc);
			cr_expect_eq(err.feature, 7u, "feature: expected 7, got %u", err.feature);
			cr_expect_eq(err.sample, sample, "sample: expected %u, got %lld", sample,
				     (long long)err.sample);
			cr_expect_eq(err.id, bad_ids[j], "id: expected %lld, got %lld",
				     (long long)bad_ids[j], (long long)err.id);
			cr_expect(strstr(err.msg, "outside"), "message: %s", err.msg);
			free(out);
			tbags_free(&t);
		}
	}
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

Test(kernels_forward, bad_offsets_are_errors)
{
	struct embd_ref_table *ref = embd_ref_table_create(4, 10, 4, EMBD_DTYPE_FP32, &sgd, 2);
	struct embd_shard *s = tshard(ref, 2, 0, 10, 0, 4);
	int64_t ids[4] = { 1, 2, 3, 4 };
	static const int64_t bad[][3] = { { 0, 3, 2 }, { 0, 2, 5 }, { -1, 2, 4 } };
	float out[8];

	for (int i = 0; i < 3; i++) {
		struct tbags t = { .batch_size = 2, .offsets = (int64_t *)bad[i], .ids = ids, .num_ids = 4 };
		struct embd_kernel_err err;
		int rc = run_forward(NULL, s, &t, EMBD_POOLING_SUM, NULL, out, 4, 0, &err);
		cr_expect_eq(rc, EMBD_EINVAL, "offsets {%lld, %lld, %lld}: expected EMBD_EINVAL, got %d",
			     (long long)bad[i][0], (long long)bad[i][1], (long long)bad[i][2], rc);
	}
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

Test(kernels_forward, isa_selection)
{
	enum embd_isa best = embd_kernels_isa_best();
	cr_assert(embd_kernels_isa_supported(best), "best isa %s not supported", embd_kernels_isa_name(best));
	cr_assert(embd_kernels_isa_supported(EMBD_ISA_SCALAR));
	cr_assert_str_eq(embd_kernels_isa_name(EMBD_ISA_AVX512), "avx512");
#if defined(__x86_64__)
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
		enum embd_isa want = embd_kernels_isa_capped(EMBD_ISA_AVX512, getenv("EMBD_ISA"));
		cr_assert_eq(best, want, "this CPU has AVX-512 and EMBD_ISA is %s: best should be %s, is %s",
			     getenv("EMBD_ISA") ? getenv("EMBD_ISA") : "unset",
			     embd_kernels_isa_name(want), embd_kernels_isa_name(best));
	}
#endif
}

Test(kernels_forward, isa_names_parse)
{
	enum embd_isa all[] = { EMBD_ISA_AUTO, EMBD_ISA_SCALAR, EMBD_ISA_AVX2, EMBD_ISA_AVX512 };
	for (int i = 0; i < 4; i++) {
		enum embd_isa got = (enum embd_isa)-1;
		cr_assert_eq(embd_kernels_isa_parse(embd_kernels_isa_name(all[i]), &got), 0);
		cr_assert_eq(got, all[i], "%s parsed as %d", embd_kernels_isa_name(all[i]), (int)got);
	}
	enum embd_isa untouched = EMBD_ISA_AVX2;
	cr_assert_eq(embd_kernels_isa_parse("avx512f", &untouched), EMBD_EINVAL);
	cr_assert_eq(embd_kernels_isa_parse("", &untouched), EMBD_EINVAL);
	cr_assert_eq(embd_kernels_isa_parse(NULL, &untouched), EMBD_EINVAL);
	cr_assert_eq(untouched, EMBD_ISA_AVX2);
}

/* $EMBD_ISA lowers the best isa and never raises it; what it does not name is ignored. */
Test(kernels_forward, isa_env_caps_the_best)
{
	static const struct { enum embd_isa detected; const char *cap; enum embd_isa want; } cases[] = {
		{ EMBD_ISA_AVX512, "avx2", EMBD_ISA_AVX2 },
		{ EMBD_ISA_AVX512, "scalar", EMBD_ISA_SCALAR },
		{ EMBD_ISA_AVX512, "avx512", EMBD_ISA_AVX512 },
		{ EMBD_ISA_AVX2, "avx512", EMBD_ISA_AVX2 },
		{ EMBD_ISA_SCALAR, "avx2", EMBD_ISA_SCALAR },
		{ EMBD_ISA_AVX512, NULL, EMBD_ISA_AVX512 },
		{ EMBD_ISA_AVX512, "", EMBD_ISA_AVX512 },
		{ EMBD_ISA_AVX512, "auto", EMBD_ISA_AVX512 },
		{ EMBD_ISA_AVX2, "sse9", EMBD_ISA_AVX2 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		enum embd_isa got = embd_kernels_isa_capped(cases[i].detected, cases[i].cap);
		cr_expect_eq(got, cases[i].want, "detected %s, EMBD_ISA %s: expected %s, got %s",
			     embd_kernels_isa_name(cases[i].detected), cases[i].cap ? cases[i].cap : "unset",
			     embd_kernels_isa_name(cases[i].want), embd_kernels_isa_name(got));
	}
}

/*
 * The variable itself, read by the library: Criterion runs each test in a fresh process, so
 * the cached answer is first computed here, after setenv. scalar is below every CPU's best.
 */
Test(kernels_forward, isa_env_forces_scalar)
{
	setenv("EMBD_ISA", "scalar", 1);
	cr_assert_eq(embd_kernels_isa_best(), EMBD_ISA_SCALAR, "EMBD_ISA=scalar: best is %s",
		     embd_kernels_isa_name(embd_kernels_isa_best()));
	cr_assert(!embd_kernels_isa_supported(EMBD_ISA_AVX2), "EMBD_ISA=scalar still offers avx2");
	const struct embd_cpu_kernels *k = embd_cpu_kernels_get(EMBD_ISA_AUTO);
	cr_assert(k && k->isa == EMBD_ISA_SCALAR, "AUTO picked %s",
		  k ? embd_kernels_isa_name(k->isa) : "nothing");
	cr_assert_null(embd_cpu_kernels_get(EMBD_ISA_AVX2));
}
