/*
 * Fused backward + optimizer against the plain reference (dense gradient, rows updated in
 * order) and against values worked out by hand. Every sharding keeps each row's occurrences
 * in batch order, so weights and state must equal the reference bit for bit; the hand values
 * are decimal, so they hold to 1e-6 relative.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <pthread.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu_kernels.h"
#include "kernels/device.h"
#include "kernels/finite.h"
#include "kernels/jagged.h"
#include "kernels/optim_row.h"
#include "tests/unit/kernels/kernel_test_util.h"

static struct embd_optimizer_spec opt_spec(enum embd_optimizer_type type, float wd)
{
	struct embd_optimizer_spec o = {
		.type = type, .lr = 0.1f, .eps = 1e-8f, .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = wd,
	};
	return o;
}

static struct embd_bag_batch tbatch(const struct embd_shard *s, uint32_t feature, const struct tbags *t,
				    enum embd_pooling pooling, const int32_t *mean_lengths,
				    const float *grad, uint64_t stride, uint32_t col)
{
	struct embd_bag_batch bt = {
		.shard = s, .feature = feature, .batch_size = t->batch_size, .offsets = t->offsets,
		.ids = t->ids, .weights = t->weights, .num_ids = t->num_ids, .pooling = pooling,
		.mean_lengths = mean_lengths, .pooled_grad = grad, .pooled_stride = stride,
		.pooled_col = col,
	};
	return bt;
}

/* Weights and state of shard s equal the reference's at the same global coordinates. */
static void expect_shard_equals_ref(const char *what, const struct embd_shard *s,
				    const struct embd_ref_table *ref)
{
	const struct embd_shard_desc *d = &s->desc;
	char msg[160];

	for (int64_t r = 0; r < d->rows; r++) {
		int64_t g = d->row_offset + r;
		float w[d->cols], e[d->cols];
		for (uint32_t c = 0; c < d->cols; c++) {
			uint64_t i = (uint64_t)r * d->cols + c;
			w[c] = d->dtype ? embd_fp16_to_fp32(((uint16_t *)s->weights)[i]) : ((float *)s->weights)[i];
			e[c] = embd_ref_weight(ref, g, d->col_offset + c);
		}
		snprintf(msg, sizeof(msg), "%s: weights of row %lld", what, (long long)g);
		texpect_equal(msg, e, w, d->cols);
		if (d->optimizer.type == EMBD_OPT_ROWWISE_ADAGRAD) {
			snprintf(msg, sizeof(msg), "%s: state of row %lld", what, (long long)g);
			texpect_equal(msg, &ref->m1[g], &s->momentum1[r], 1);
		} else if (d->optimizer.type != EMBD_OPT_SGD) {
			snprintf(msg, sizeof(msg), "%s: momentum1 of row %lld", what, (long long)g);
			texpect_equal(msg, ref->m1 + (uint64_t)g * ref->dim + d->col_offset,
				      s->momentum1 + (uint64_t)r * d->cols, d->cols);
			if (d->optimizer.type == EMBD_OPT_ADAM) {
				snprintf(msg, sizeof(msg), "%s: momentum2 of row %lld", what, (long long)g);
				texpect_equal(msg, ref->m2 + (uint64_t)g * ref->dim + d->col_offset,
					      s->momentum2 + (uint64_t)r * d->cols, d->cols);
			}
		}
	}
}

static float *random_grad(struct trng *r, uint64_t n)
{
	float *g = malloc((n ? n : 1) * sizeof(float));
	for (uint64_t i = 0; i < n; i++)
		g[i] = trng_float(r, -1.0f, 1.0f);
	return g;
}

/* steps of two features on one unsplit shard, on every ISA, with 1 and 3 workers;
 * grad_divisor: the gradients' division (0: none). */
static void check_unsharded_div(struct trng *r, enum embd_optimizer_type type,
				enum embd_data_type dtype, int64_t rows, uint32_t dim, uint32_t batch,
				uint32_t max_len, uint32_t hot_pct, int steps, uint32_t grad_divisor)
{
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	struct embd_workers *three;
	char msg[160];

	cr_assert_eq(embd_workers_create(3, NULL, &three, msg, sizeof(msg)), 0, "%s", msg);
	for (int i = 0; i < nisa; i++) {
		for (int nw = 0; nw < 2; nw++) {
			/* both, on every isa: without weight decay adagrad, rowwise_adagrad and adam
			 * take loops of their own (cpu_kernels.c's optim_row_checked and
			 * rowwise_row_checked) */
			struct embd_optimizer_spec o = opt_spec(type, nw ? 0.01f : 0.0f);
			struct embd_ref_table *ref = embd_ref_table_create(5, rows, dim, dtype, &o, 21);
			struct embd_shard *s = tshard(ref, 21, 0, rows, 0, dim);
			struct embd_exec ex = { .workers = nw ? three : NULL, .isa = isas[i] };
			for (int step = 0; step < steps; step++) {
				struct tbags t[2];
				float *g[2];
				struct embd_bag_batch bt[2];
				struct embd_ref_bags rb[2];
				for (int f = 0; f < 2; f++) {
					/* a weighted batch in every other call: keys that name
					 * the ids' places then, else their bags (backward.c) */
					tbags_random(&t[f], r, batch, max_len, 10, rows, hot_pct,
						     f == 1 && step % 2 == 1);
					g[f] = random_grad(r, (uint64_t)batch * dim);
					enum embd_pooling p = f ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM;
					bt[f] = tbatch(s, f, &t[f], p, NULL, g[f], dim, 0);
					bt[f].grad_divisor = grad_divisor;
					rb[f] = (struct embd_ref_bags){ batch, t[f].lengths, t[f].ids,
									t[f].weights, p, g[f],
									grad_divisor };
				}
				struct embd_kernel_err err;
				int rc = embd_kernels_backward(&ex, s, bt, 2, &err);
				cr_assert_eq(rc, 0, "backward: %d %s", rc, err.msg);
				cr_assert_eq(embd_ref_backward(ref, rb, 2), 0);
				snprintf(msg, sizeof(msg), "%s opt %d %s dim %u workers %d step %d",
					 embd_kernels_isa_name(isas[i]), (int)type, dtype ? "fp16" : "fp32",
					 dim, nw ? 3 : 1, step);
				expect_shard_equals_ref(msg, s, ref);
				cr_assert_eq(s->step, ref->step);
				for (int f = 0; f < 2; f++) {
					tbags_free(&t[f]);
					free(g[f]);
				}
			}
			embd_shard_destroy(s);
			embd_ref_table_destroy(ref);
		}
	}
	embd_workers_destroy(three);
}

static void check_unsharded(struct trng *r, enum embd_optimizer_type type,
			    enum embd_data_type dtype, int64_t rows, uint32_t dim, uint32_t batch,
			    uint32_t max_len, uint32_t hot_pct, int steps)
{
	check_unsharded_div(r, type, dtype, rows, dim, batch, max_len, hot_pct, steps, 0);
}

/* TorchRec's gradient division (by 3: not a power of two) equals the reference's. */
Test(kernels_backward, gradient_division_equals_reference, .timeout = 120)
{
	struct trng r = { 34 };

	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++)
		check_unsharded_div(&r, type, EMBD_DTYPE_FP32, 300, 16, 20, 6, 30, 3, 3);
}

/* By hand: sgd, lr 0.1, one id of gradient 1 with the gradient divided by 4 moves the row
 * by 0.025; without division by 0.1. */
Test(kernels_backward, gradient_division_by_hand)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(1, 4, 1, EMBD_DTYPE_FP32, &o, 7);
	int64_t offsets[2] = { 0, 1 }, ids[1] = { 2 };
	float g = 1.0f;

	for (uint32_t div = 0; div <= 4; div += 4) {
		struct embd_shard *s = tshard(ref, 7, 0, 4, 0, 1);
		float before = ((float *)s->weights)[2];
		struct embd_bag_batch bt = { .shard = s, .batch_size = 1, .offsets = offsets,
					     .ids = ids, .num_ids = 1, .pooled_grad = &g,
					     .pooled_stride = 1, .grad_divisor = div };
		struct embd_kernel_err err;
		cr_assert_eq(embd_kernels_backward(NULL, s, &bt, 1, &err), 0, "%s", err.msg);
		float moved = before - ((float *)s->weights)[2], want = div ? 0.025f : 0.1f;
		cr_expect(fabsf(moved - want) <= 1e-6f * want, "divisor %u: expected the row to "
			  "move by %g, it moved by %g", div, want, moved);
		embd_shard_destroy(s);
	}
	embd_ref_table_destroy(ref);
}

Test(kernels_backward, every_optimizer_equals_reference, .timeout = 120)
{
	static const uint32_t dims[] = { 1, 4, 15, 16, 33, 64, 100, 128 };
	struct trng r = { 31 };

	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++)
		for (int trial = 0; trial < 4; trial++)
			check_unsharded(&r, type, trng_below(&r, 2), 1 + (int64_t)trng_below(&r, 2000),
					dims[trng_below(&r, 8)], 1 + (uint32_t)trng_below(&r, 60),
					(uint32_t)trng_below(&r, 30), 30, 3);
}

/* The row widths the CPU kernels compile a loop of their own for (cpu_kernels.c apply_rows:
 * fp32 D 32, 64, 128 and 256), every optimizer, next to a width that takes the general loop
 * and to fp16 rows of the same widths. */
Test(kernels_backward, every_compiled_width_equals_reference, .timeout = 120)
{
	static const uint32_t dims[] = { 32, 64, 128, 256, 48 };
	struct trng r = { 41 };

	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++)
		for (int i = 0; i < 5; i++)
			for (int fp16 = 0; fp16 < 2; fp16++)
				check_unsharded(&r, type, fp16 ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32, 400,
						dims[i], 24, 8, 30, 2);
}

Test(kernels_backward, heavy_duplicates_and_many_ids, .timeout = 120)
{
	struct trng r = { 32 };
	/* 80% of ids on 4 hot rows: long runs to combine; ~100K ids per feature */
	check_unsharded(&r, EMBD_OPT_ROWWISE_ADAGRAD, EMBD_DTYPE_FP32, 50000, 24, 1000, 200, 80, 2);
	/* a single-row table: one bucket, every id a duplicate */
	check_unsharded(&r, EMBD_OPT_ADAM, EMBD_DTYPE_FP16, 1, 8, 30, 10, 0, 2);
}

/* Every number of radix passes under the buckets (backward.c's sort) up to three: 4096 rows
 * and 3000-4000 ids one (6 bits under 64 buckets); 4096 rows and ~60 ids two where under 64
 * (12 bits under one bucket: more than LOW_BITS_MAX), else one (11 under 2); 2^16 rows and
 * ~600 ids two (12-13 bits under 8-16 buckets); 64 rows and ~8000 ids none (a bucket a row);
 * 2^23 rows of one column and under 64 ids three (23 bits under one bucket). */
Test(kernels_backward, sorted_in_one_two_or_no_passes_alike, .timeout = 120)
{
	struct trng r = { 43 };

	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type += 3) {
		check_unsharded(&r, type, EMBD_DTYPE_FP32, 4096, 16, 200, 20, 30, 2);
		check_unsharded(&r, type, EMBD_DTYPE_FP32, 4096, 16, 6, 10, 30, 2);
		check_unsharded(&r, type, EMBD_DTYPE_FP32, 1 << 16, 8, 70, 10, 30, 2);
		check_unsharded(&r, type, EMBD_DTYPE_FP32, 64, 16, 300, 30, 30, 2);
	}
	check_unsharded(&r, EMBD_OPT_SGD, EMBD_DTYPE_FP32, 1 << 23, 1, 4, 6, 0, 2);
}

Test(kernels_backward, a_million_ids, .timeout = 120)
{
	struct trng r = { 33 };
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(6, 1 << 20, 8, EMBD_DTYPE_FP32, &o, 3);
	struct embd_shard *s = tshard(ref, 3, 0, 1 << 20, 0, 8);
	struct embd_workers *two;
	char msg[128];
	struct tbags t;

	cr_assert_eq(embd_workers_create(2, NULL, &two, msg, sizeof(msg)), 0, "%s", msg);
	tbags_random(&t, &r, 4000, 500, 0, 1 << 20, 5, true);
	float *g = random_grad(&r, 4000 * 8);
	struct embd_bag_batch bt = tbatch(s, 0, &t, EMBD_POOLING_SUM, NULL, g, 8, 0);
	struct embd_ref_bags rb = { 4000, t.lengths, t.ids, t.weights, EMBD_POOLING_SUM, g, 0 };
	struct embd_exec ex = { .workers = two };
	cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, NULL), 0);
	cr_assert_eq(embd_ref_backward(ref, &rb, 1), 0);
	expect_shard_equals_ref("a million ids", s, ref);
	free(g);
	tbags_free(&t);
	embd_workers_destroy(two);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/*
 * Phase times: asked for, every phase of every call is counted, their sum is inside the calls'
 * wall time, and the result is still the reference's (timing changes nothing computed).
 */
Test(kernels_backward, phase_times_add_up)
{
	struct trng r = { 35 };
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_ADAGRAD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(8, 1 << 16, 16, EMBD_DTYPE_FP32, &o, 5);
	struct embd_shard *s = tshard(ref, 5, 0, 1 << 16, 0, 16);
	struct embd_backward_times tm = { 0 };
	struct embd_workers *two;
	char msg[128];
	struct tbags t;

	cr_assert_eq(embd_workers_create(2, NULL, &two, msg, sizeof(msg)), 0, "%s", msg);
	tbags_random(&t, &r, 2000, 40, 5, 1 << 16, 10, true);
	float *g = random_grad(&r, 2000 * 16);
	struct embd_bag_batch bt = tbatch(s, 0, &t, EMBD_POOLING_SUM, NULL, g, 16, 0);
	struct embd_ref_bags rb = { 2000, t.lengths, t.ids, t.weights, EMBD_POOLING_SUM, g, 0 };
	struct embd_exec ex = { .workers = two, .backward_times = &tm };
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int step = 0; step < 2; step++) {
		cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, NULL), 0);
		cr_assert_eq(embd_ref_backward(ref, &rb, 1), 0);
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	uint64_t wall = (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000ull + (uint64_t)t1.tv_nsec -
			(uint64_t)t0.tv_nsec;
	uint64_t sum = tm.setup_ns + tm.collect_ns + tm.scatter_ns + tm.sort_ns + tm.apply_ns;
	cr_expect_eq(tm.calls, 2, "expected 2 calls counted, got %llu", (unsigned long long)tm.calls);
	cr_expect(tm.collect_ns && tm.scatter_ns && tm.sort_ns && tm.apply_ns,
		  "a phase was not timed: collect %llu scatter %llu sort %llu apply %llu ns",
		  (unsigned long long)tm.collect_ns, (unsigned long long)tm.scatter_ns,
		  (unsigned long long)tm.sort_ns, (unsigned long long)tm.apply_ns);
	cr_expect(sum <= wall, "phases add up to %llu ns, more than the calls' %llu ns",
		  (unsigned long long)sum, (unsigned long long)wall);
	expect_shard_equals_ref("timed backward", s, ref);
	free(g);
	tbags_free(&t);
	embd_workers_destroy(two);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/* Row-wise: two features bucketized over W shards, MEAN divided by the full bag lengths. */
Test(kernels_backward, row_shards_equal_reference)
{
	struct trng r = { 34 };
	const uint32_t W = 4, F = 2, B = 30, dim = 12;
	const int64_t rows = 10; /* blocks of 3, 3, 3, 1 */

	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++) {
		struct embd_optimizer_spec o = opt_spec(type, 0.0f);
		struct embd_ref_table *ref = embd_ref_table_create(7, rows, dim, EMBD_DTYPE_FP32, &o, 4);
		struct embd_shard *sh[4];
		for (uint32_t k = 0; k < W; k++)
			sh[k] = tshard(ref, 4, 3 * k, k < 3 ? 3 : 1, 0, dim);
		for (int step = 0; step < 2; step++) {
			/* one KJT of F features: lengths feature-major */
			struct tbags t[2];
			int32_t lengths[F * B];
			uint64_t nv = 0;
			for (uint32_t f = 0; f < F; f++) {
				tbags_random(&t[f], &r, B, 8, 10, rows, 30, true);
				memcpy(lengths + f * B, t[f].lengths, B * sizeof(int32_t));
				nv += t[f].num_ids;
			}
			int64_t *values = malloc(nv * sizeof(int64_t)), *bval = malloc(nv * sizeof(int64_t));
			float *weights = malloc(nv * sizeof(float)), *bw = malloc(nv * sizeof(float));
			memcpy(values, t[0].ids, t[0].num_ids * sizeof(int64_t));
			memcpy(values + t[0].num_ids, t[1].ids, t[1].num_ids * sizeof(int64_t));
			memcpy(weights, t[0].weights, t[0].num_ids * sizeof(float));
			memcpy(weights + t[0].num_ids, t[1].weights, t[1].num_ids * sizeof(float));
			int32_t blen[W * F * B];
			int64_t frows[2] = { rows, rows };
			struct embd_bucketize_args ba = {
				.num_features = F, .batch_size = B, .lengths = lengths, .values = values,
				.weights = weights, .num_values = nv, .feature_rows = frows,
				.num_buckets = W, .out_lengths = blen, .out_values = bval, .out_weights = bw,
			};
			char msg[128];
			cr_assert_eq(embd_jagged_bucketize(&ba, msg, sizeof(msg)), 0, "%s", msg);
			/* dL/d(pooled): a KeyedTensor of the two features */
			float *grad = random_grad(&r, B * F * dim);

			uint64_t pos = 0;
			for (uint32_t k = 0; k < W; k++) {
				int64_t off[F][B + 1];
				struct tbags tk[2];
				struct embd_bag_batch bt[2];
				for (uint32_t f = 0; f < F; f++) {
					off[f][0] = 0;
					for (uint32_t b = 0; b < B; b++)
						off[f][b + 1] = off[f][b] + blen[(k * F + f) * B + b];
					tk[f] = (struct tbags){ .batch_size = B, .offsets = off[f],
								.ids = bval + pos, .weights = bw + pos,
								.num_ids = (uint64_t)off[f][B] };
					pos += (uint64_t)off[f][B];
					bt[f] = tbatch(sh[k], f, &tk[f], EMBD_POOLING_MEAN, lengths + f * B,
						       grad, F * dim, f * dim);
				}
				cr_assert_eq(embd_kernels_backward(NULL, sh[k], bt, F, NULL), 0);
			}
			struct embd_ref_bags rb[2];
			float *g2[2] = { malloc(B * dim * sizeof(float)), malloc(B * dim * sizeof(float)) };
			for (uint32_t f = 0; f < F; f++) {
				for (uint32_t b = 0; b < B; b++)
					memcpy(g2[f] + b * dim, grad + b * F * dim + f * dim, dim * sizeof(float));
				rb[f] = (struct embd_ref_bags){ B, t[f].lengths, t[f].ids, t[f].weights,
								EMBD_POOLING_MEAN, g2[f], 0 };
			}
			cr_assert_eq(embd_ref_backward(ref, rb, F), 0);
			for (uint32_t k = 0; k < W; k++)
				expect_shard_equals_ref("row shards", sh[k], ref);
			for (uint32_t f = 0; f < F; f++) {
				tbags_free(&t[f]);
				free(g2[f]);
			}
			free(grad);
			free(values);
			free(bval);
			free(weights);
			free(bw);
		}
		for (uint32_t k = 0; k < W; k++)
			embd_shard_destroy(sh[k]);
		embd_ref_table_destroy(ref);
	}
}

/* Column-wise: each shard updates its own columns (rowwise_adagrad keeps a state per column
 * shard in TorchRec too, so it is left out: it only equals an unsplit table when whole). */
Test(kernels_backward, column_shards_equal_reference)
{
	static const enum embd_optimizer_type types[] = { EMBD_OPT_SGD, EMBD_OPT_ADAGRAD, EMBD_OPT_ADAM };
	struct trng r = { 35 };
	const uint32_t dim = 40, split = 17, B = 25;
	const int64_t rows = 300;

	for (int i = 0; i < 3; i++) {
		struct embd_optimizer_spec o = opt_spec(types[i], 0.02f);
		struct embd_ref_table *ref = embd_ref_table_create(8, rows, dim, EMBD_DTYPE_FP16, &o, 6);
		struct embd_shard *a = tshard(ref, 6, 0, rows, 0, split);
		struct embd_shard *b = tshard(ref, 6, 0, rows, split, dim - split);
		for (int step = 0; step < 3; step++) {
			struct tbags t;
			tbags_random(&t, &r, B, 12, 10, rows, 40, true);
			float *g = random_grad(&r, B * dim);
			struct embd_bag_batch ba = tbatch(a, 0, &t, EMBD_POOLING_SUM, NULL, g, dim, 0);
			struct embd_bag_batch bb = tbatch(b, 0, &t, EMBD_POOLING_SUM, NULL, g, dim, split);
			cr_assert_eq(embd_kernels_backward(NULL, a, &ba, 1, NULL), 0);
			cr_assert_eq(embd_kernels_backward(NULL, b, &bb, 1, NULL), 0);
			struct embd_ref_bags rb = { B, t.lengths, t.ids, t.weights, EMBD_POOLING_SUM, g, 0 };
			cr_assert_eq(embd_ref_backward(ref, &rb, 1), 0);
			expect_shard_equals_ref("column shard a", a, ref);
			expect_shard_equals_ref("column shard b", b, ref);
			free(g);
			tbags_free(&t);
		}
		embd_shard_destroy(a);
		embd_shard_destroy(b);
		embd_ref_table_destroy(ref);
	}
}

/* Row 1 = {1, -2}; one bag holding id 1 twice, dL/d(pooled) = {0.5, 1}: g = {1, 2}. */
static void hand_steps_eps(enum embd_optimizer_type type, float wd, float eps,
			   const float expected[2][2], const float *state_after_2, int state_n)
{
	struct embd_optimizer_spec o = opt_spec(type, wd);
	o.eps = eps;
	/* betas that are exact in binary, so the hand values are exact too */
	o.beta1 = 0.5f;
	o.beta2 = 0.875f;
	struct embd_shard_desc d = { .table_id = 1, .num_embeddings = 4, .embedding_dim = 2,
				     .dtype = EMBD_DTYPE_FP32, .rows = 4, .cols = 2, .optimizer = o };
	struct embd_shard *s;
	char msg[128];
	int64_t ids[2] = { 1, 1 }, offsets[2] = { 0, 2 };
	float dy[2] = { 0.5f, 1.0f };

	cr_assert_eq(embd_shard_create(&d, &s, msg, sizeof(msg)), 0, "%s", msg);
	float *w = s->weights;
	for (int i = 0; i < 8; i++)
		w[i] = 7.0f;
	w[2] = 1.0f;
	w[3] = -2.0f;
	struct embd_bag_batch bt = { .shard = s, .batch_size = 1, .offsets = offsets, .ids = ids,
				     .num_ids = 2, .pooling = EMBD_POOLING_SUM, .pooled_grad = dy,
				     .pooled_stride = 2 };
	for (int step = 0; step < 2; step++) {
		cr_assert_eq(embd_kernels_backward(NULL, s, &bt, 1, NULL), 0);
		for (int c = 0; c < 2; c++)
			cr_expect(fabsf(w[2 + c] - expected[step][c]) <= 1e-6f * fabsf(expected[step][c]),
				  "optimizer %d wd %g step %d col %d: expected %.8g, got %.8g", (int)type, wd,
				  step + 1, c, expected[step][c], w[2 + c]);
	}
	for (int i = 0; i < state_n; i++) {
		float got = i < 2 ? s->momentum1[(type == EMBD_OPT_ROWWISE_ADAGRAD ? 1 : 2) + i]
				  : s->momentum2[2 + i - 2];
		cr_expect(fabsf(got - state_after_2[i]) <= 1e-6f * fabsf(state_after_2[i]),
			  "optimizer %d state %d: expected %.8g, got %.8g", (int)type, i, state_after_2[i], got);
	}
	for (int i = 0; i < 8; i++)
		if (i / 2 != 1)
			cr_expect_eq(w[i], 7.0f, "untouched weight %d changed to %g", i, w[i]);
	cr_expect_eq(s->step, 2);
	embd_shard_destroy(s);
}

static void hand_steps(enum embd_optimizer_type type, float wd, const float expected[2][2],
		       const float *state_after_2, int state_n)
{
	hand_steps_eps(type, wd, 1e-8f, expected, state_after_2, state_n);
}

Test(kernels_backward, optimizers_match_hand_computed_values)
{
	/* w -= 0.1 g */
	hand_steps(EMBD_OPT_SGD, 0.0f, (const float[2][2]){ { 0.9f, -2.2f }, { 0.8f, -2.4f } }, NULL, 0);
	/* g' = g + 0.5 w: {1.5, 1} then {1.425, 0.95} */
	hand_steps(EMBD_OPT_SGD, 0.5f, (const float[2][2]){ { 0.85f, -2.1f }, { 0.7075f, -2.195f } }, NULL, 0);
	/* s = {1, 4} then {2, 8}; w -= 0.1 g / sqrt(s) */
	hand_steps(EMBD_OPT_ADAGRAD, 0.0f,
		   (const float[2][2]){ { 0.9f, -2.1f }, { 0.829289322f, -2.170710678f } },
		   (const float[]){ 2.0f, 8.0f }, 2);
	/* s = (1 + 4) / 2 = 2.5 then 5; w -= 0.1 / sqrt(s) g */
	hand_steps(EMBD_OPT_ROWWISE_ADAGRAD, 0.0f,
		   (const float[2][2]){ { 0.936754447f, -2.126491106f }, { 0.892033088f, -2.215933825f } },
		   (const float[]){ 5.0f }, 1);
	/* beta1 0.5, beta2 0.875: bias-corrected m / sqrt(v) = sign(g) on both steps, so
	 * w -= 0.1 sign(g); after two steps m = 0.75 g, v = (1 - 0.875^2) g^2 = 0.234375 g^2 */
	hand_steps(EMBD_OPT_ADAM, 0.0f, (const float[2][2]){ { 0.9f, -2.1f }, { 0.8f, -2.2f } },
		   (const float[]){ 0.75f, 1.5f, 0.234375f, 0.9375f }, 4);
	/* eps 1, where it counts: bias-corrected m = g and sqrt(v) = |g| on both steps, so
	 * w -= 0.1 g / (|g| + 1) (g = {1, 2}); eps added unscaled to the uncorrected sqrt(v),
	 * as torch.optim.SparseAdam does, would give 0.974 and -2.041 after the first step */
	hand_steps_eps(EMBD_OPT_ADAM, 0.0f, 1.0f,
		       (const float[2][2]){ { 0.95f, -2.066666667f }, { 0.9f, -2.133333333f } },
		       (const float[]){ 0.75f, 1.5f, 0.234375f, 0.9375f }, 4);
}

/*
 * adam's eps is scaled by sqrt(1 - beta2^t) (kernels/optim_row.h): the least float eps, scaled,
 * would round to 0, and a row whose gradient, m and v are all 0 would take 0 / 0. Such a row
 * keeps its weights on every isa, on the vector path (16 columns) and the scalar one (3), and a
 * row with a gradient still moves.
 */
Test(kernels_backward, adam_with_the_least_eps_keeps_a_row_without_gradient)
{
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	const uint32_t widths[] = { 16, 3 };

	for (int i = 0; i < nisa; i++)
		for (int k = 0; k < 2; k++) {
			const uint32_t cols = widths[k];
			struct embd_optimizer_spec o = opt_spec(EMBD_OPT_ADAM, 0.0f);
			o.eps = FLT_TRUE_MIN;
			struct embd_shard_desc d = { .table_id = 1, .num_embeddings = 2,
						     .embedding_dim = cols, .dtype = EMBD_DTYPE_FP32,
						     .rows = 2, .cols = cols, .optimizer = o };
			struct embd_shard *s;
			char msg[128];
			int64_t ids[2] = { 0, 1 }, offsets[3] = { 0, 1, 2 };
			float dy[2 * 16] = { 0 };
			for (uint32_t c = 0; c < cols; c++)
				dy[cols + c] = 1.0f;    /* bag 1 (row 1): a gradient; bag 0: none */
			cr_assert_eq(embd_shard_create(&d, &s, msg, sizeof(msg)), 0, "%s", msg);
			float *w = s->weights;
			for (uint32_t c = 0; c < 2 * cols; c++)
				w[c] = 0.5f;
			struct embd_bag_batch bt = {
				.shard = s, .batch_size = 2, .offsets = offsets, .ids = ids,
				.num_ids = 2, .pooling = EMBD_POOLING_SUM, .pooled_grad = dy,
				.pooled_stride = cols,
			};
			struct embd_exec ex = { .isa = isas[i] };
			struct embd_kernel_err err;
			cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, &err), 0, "%s", err.msg);
			for (uint32_t c = 0; c < cols; c++) {
				cr_expect_eq(w[c], 0.5f, "isa %d cols %u: row 0 col %u is %g", (int)isas[i],
					     cols, c, w[c]);
				cr_expect(w[cols + c] < 0.5f, "isa %d cols %u: row 1 col %u did not move (%g)",
					  (int)isas[i], cols, c, w[cols + c]);
			}
			embd_shard_destroy(s);
		}
}

struct id_flipper {
	int64_t *ids;
	uint64_t num_ids;
	int64_t a, b;
	int stop;
};

/* Rewrites every odd id, again and again, as a or b by turns (the even ones are left as they
 * are): a client still writing its batch. */
static void *flip_ids(void *arg)
{
	struct id_flipper *f = arg;

	for (uint64_t round = 0; !__atomic_load_n(&f->stop, __ATOMIC_RELAXED); round++)
		for (uint64_t k = 1; k < f->num_ids; k += 2)
			__atomic_store_n(&f->ids[k], (k / 2 + round) % 2 ? f->a : f->b,
					 __ATOMIC_RELAXED);
	return NULL;
}

/*
 * Backward calls on ids that a thread keeps rewriting between rows a and b, for up to 20 s or
 * until `want` of them have failed. Each must succeed or fail with EMBD_EINVAL naming the
 * change and leave the shard as it was; none may write past the occurrences' arrays (the
 * sanitizer build sees those) or crash. Returns the failures.
 */
static int backward_while_ids_change(struct embd_workers *workers, int64_t a, int64_t b, int want,
				     bool weighted)
{
	struct trng r = { 37 };
	const int64_t rows = 1 << 16;
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, rows, 8, EMBD_DTYPE_FP32, &o, 9);
	struct embd_shard *s = tshard(ref, 9, 0, rows, 0, 8);
	struct embd_exec ex = { .workers = workers };
	const size_t bytes = (size_t)rows * 8 * sizeof(float);
	float *before = malloc(bytes);
	struct tbags t;
	pthread_t th;
	int failed = 0, calls = 0;

	cr_assert(before);
	tbags_random(&t, &r, 1000, 40, 0, rows, 0, weighted);
	for (uint64_t k = 0; k < t.num_ids; k += 2)
		t.ids[k] = 1;   /* half the ids on row 1: its bucket is the first owner's share */
	float *g = random_grad(&r, 1000 * 8);
	struct id_flipper f = { .ids = t.ids, .num_ids = t.num_ids, .a = a, .b = b };
	cr_assert_eq(pthread_create(&th, NULL, flip_ids, &f), 0);
	struct embd_bag_batch bt = tbatch(s, 4, &t, EMBD_POOLING_SUM, NULL, g, 8, 0);
	struct timespec t0, now;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do {
		struct embd_kernel_err err = { 0 };
		int64_t step = s->step;
		memcpy(before, s->weights, bytes);
		int rc = embd_kernels_backward(&ex, s, &bt, 1, &err);
		cr_assert(rc == 0 || rc == EMBD_EINVAL, "call %d: rc %d (%s)", calls, rc, err.msg);
		if (rc) {
			cr_assert(strstr(err.msg, "ids changed") && err.feature == 4 &&
					  err.sample >= 0 && err.sample < 1000,
				  "call %d: %s (feature %u sample %lld)", calls, err.msg, err.feature,
				  (long long)err.sample);
			cr_assert(!memcmp(before, s->weights, bytes) && s->step == step,
				  "call %d failed but changed the shard", calls);
			failed++;
		}
		calls++;
		clock_gettime(CLOCK_MONOTONIC, &now);
	} while (failed < want && now.tv_sec - t0.tv_sec < 20 && (want || calls < 200));
	__atomic_store_n(&f.stop, 1, __ATOMIC_RELAXED);
	pthread_join(th, NULL);
	cr_expect_eq(embd_first_nonfinite(s->weights, (uint64_t)rows * 8), (uint64_t)rows * 8);
	free(before);
	free(g);
	tbags_free(&t);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
	return failed;
}

/*
 * The backward of several workers reads each id twice (backward.c, phases 2 and 3): ids
 * rewritten in between fail the call. Rows 1, 2^15 and 2^16 - 2 lie in the first, a middle
 * and the last bucket; half the ids stay on row 1, so with two workers its bucket is the first
 * owner's share and the rest the second's. Between rows 1 and 2^16 - 2 a rewrite overfills a
 * worker's part of an owner; between 2^15 and 2^16 - 2 (one owner) a bucket of its sort, with
 * and without weights (the sort's keys name the ids' places, or their bags: the sample named
 * is decoded from either). One worker reads each id once and uses it as read: its calls all
 * succeed.
 */
Test(kernels_backward, ids_rewritten_during_the_call_fail_it, .timeout = 120)
{
	struct embd_workers *two;
	char msg[160];

	cr_assert_eq(embd_workers_create(2, NULL, &two, msg, sizeof(msg)), 0, "%s", msg);
	cr_expect(backward_while_ids_change(two, 1, (1 << 16) - 2, 3, false) == 3,
		  "no rewrite across owners was seen in 20 s");
	for (int weighted = 0; weighted < 2; weighted++)
		cr_expect(backward_while_ids_change(two, 1 << 15, (1 << 16) - 2, 3, weighted) == 3,
			  "no rewrite within an owner was seen in 20 s (weighted %d)", weighted);
	cr_expect_eq(backward_while_ids_change(NULL, 1, (1 << 16) - 2, 0, false), 0);
	embd_workers_destroy(two);
}

Test(kernels_backward, out_of_range_changes_nothing)
{
	struct trng r = { 36 };
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_ADAM, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 1000, 16, EMBD_DTYPE_FP32, &o, 9);
	struct embd_shard *s = tshard(ref, 9, 200, 300, 0, 16);
	enum embd_isa isas[3];
	int nisa = tisas(isas);

	for (int i = 0; i < nisa; i++) {
		struct tbags t;
		tbags_random(&t, &r, 40, 10, 0, 300, 10, false);
		for (uint64_t k = 0; k < t.num_ids; k++)
			t.ids[k] += 200;
		t.ids[t.num_ids - 1] = 500; /* one past the end, in the last non-empty bag */
		int64_t sample = 39;
		while (t.lengths[sample] == 0)
			sample--;
		float *g = random_grad(&r, 40 * 16);
		float *before = malloc(300 * 16 * sizeof(float));
		memcpy(before, s->weights, 300 * 16 * sizeof(float));
		struct embd_bag_batch bt = tbatch(s, 3, &t, EMBD_POOLING_SUM, NULL, g, 16, 0);
		struct embd_exec ex = { .isa = isas[i] };
		struct embd_kernel_err err;
		int rc = embd_kernels_backward(&ex, s, &bt, 1, &err);
		cr_assert_eq(rc, EMBD_ERANGE, "expected EMBD_ERANGE, got %d", rc);
		cr_expect_eq(err.feature, 3u);
		cr_expect_eq(err.sample, sample, "sample: expected %lld, got %lld", (long long)sample,
			     (long long)err.sample);
		cr_expect_eq(err.id, 500, "id: expected 500, got %lld", (long long)err.id);
		cr_assert(!memcmp(before, s->weights, 300 * 16 * sizeof(float)), "weights changed");
		cr_assert_eq(s->step, 0, "step changed to %lld", (long long)s->step);
		free(before);
		free(g);
		tbags_free(&t);
	}
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/*
 * Workers split a call's bags evenly, whatever batch holds them, and each writes (and clears)
 * the occurrences of its own: batches without bags at the start, middle and end, bags without
 * ids, slices that end on a batch's last bag, and more workers than bags. Equals the
 * reference; an id outside the shard in the last batch with ids is still found.
 */
Test(kernels_backward, batches_without_bags_and_more_workers_than_bags, .timeout = 120)
{
	static const uint32_t shapes[][6] = {
		{ 0, 3, 0, 0, 2, 0 }, { 0, 0, 0, 0, 0, 1 }, { 1, 0, 0, 0, 0, 0 }, { 2, 2, 0, 0, 0, 0 },
		{ 0, 0, 0, 0, 0, 0 }, { 4, 0, 4, 0, 4, 0 }, { 0, 7, 0, 5, 0, 9 }, { 1, 1, 1, 1, 1, 1 },
	};
	static const uint32_t worker_counts[] = { 2, 3, 4, 5, 8 };
	struct trng r = { 91 };
	char msg[160];

	for (size_t wi = 0; wi < sizeof(worker_counts) / sizeof(worker_counts[0]); wi++) {
		struct embd_workers *workers;
		cr_assert_eq(embd_workers_create(worker_counts[wi], NULL, &workers, msg, sizeof(msg)),
			     0, "%s", msg);
		for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
			for (int empty_pct = 10; empty_pct <= 60; empty_pct += 50) {
				struct embd_optimizer_spec o = opt_spec(EMBD_OPT_ADAGRAD, 0.0f);
				struct embd_ref_table *ref =
					embd_ref_table_create(5, 300, 8, EMBD_DTYPE_FP32, &o, 3);
				struct embd_shard *s = tshard(ref, 3, 0, 300, 0, 8);
				struct embd_exec ex = { .workers = workers };
				struct tbags t[6];
				float *g[6];
				struct embd_bag_batch bt[6];
				struct embd_ref_bags rb[6];
				int last_with_ids = -1;

				for (int f = 0; f < 6; f++) {
					tbags_random(&t[f], &r, shapes[si][f], 5, (uint32_t)empty_pct, 300, 30,
						     f % 2);
					g[f] = random_grad(&r, (uint64_t)shapes[si][f] * 8);
					bt[f] = tbatch(s, f, &t[f], EMBD_POOLING_SUM, NULL, g[f], 8, 0);
					rb[f] = (struct embd_ref_bags){ shapes[si][f], t[f].lengths,
									t[f].ids, t[f].weights,
									EMBD_POOLING_SUM, g[f], 0 };
					if (t[f].num_ids)
						last_with_ids = f;
				}
				snprintf(msg, sizeof(msg), "%u workers, shape %zu, %d%% empty bags",
					 worker_counts[wi], si, empty_pct);
				struct embd_kernel_err err;
				cr_assert_eq(embd_kernels_backward(&ex, s, bt, 6, &err), 0, "%s: %s", msg,
					     err.msg);
				cr_assert_eq(embd_ref_backward(ref, rb, 6), 0);
				expect_shard_equals_ref(msg, s, ref);
				if (last_with_ids >= 0) {
					struct tbags *lt = &t[last_with_ids];
					lt->ids[lt->num_ids - 1] = 300;
					cr_assert_eq(embd_kernels_backward(&ex, s, bt, 6, &err), EMBD_ERANGE,
						     "%s", msg);
					cr_expect_eq(err.feature, (uint32_t)last_with_ids, "%s", msg);
				}
				for (int f = 0; f < 6; f++) {
					tbags_free(&t[f]);
					free(g[f]);
				}
				embd_shard_destroy(s);
				embd_ref_table_destroy(ref);
			}
		}
		embd_workers_destroy(workers);
	}
}

/* Counts of ids that add up past what offsets can hold are refused before anything is
 * allocated for them or read. */
Test(kernels_backward, ids_counted_past_int64_are_refused)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 100, 8, EMBD_DTYPE_FP32, &o, 4);
	struct embd_shard *s = tshard(ref, 4, 0, 100, 0, 8);
	int64_t ids[3] = { 1, 2, 3 };
	int64_t offs[3][2] = { { 0, INT64_MAX }, { 0, INT64_MAX }, { 0, 3 } };
	float grad[8] = { 0 };
	struct embd_bag_batch bt[3];

	for (int f = 0; f < 3; f++)
		bt[f] = (struct embd_bag_batch){
			.shard = s, .feature = (uint32_t)f, .batch_size = 1, .offsets = offs[f],
			.ids = ids, .num_ids = (uint64_t)offs[f][1], .pooling = EMBD_POOLING_SUM,
			.pooled_grad = grad, .pooled_stride = 8,
		};
	struct embd_kernel_err err;
	struct embd_exec ex = { 0 };
	cr_assert_eq(embd_kernels_backward(&ex, s, bt, 3, &err), EMBD_EINVAL, "%s", err.msg);
	cr_expect_eq(err.feature, 1u, "%s", err.msg);
	cr_expect(strstr(err.msg, "num_ids") != NULL, "%s", err.msg);
	cr_assert_eq(s->step, 0);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/* A shard with more rows than a sort key holds with its bags' or ids' bits is refused before
 * anything is read or written (no memory holds such a shard: its size is faked). */
Test(kernels_backward, rows_and_ids_past_the_sort_keys_are_refused)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 100, 8, EMBD_DTYPE_FP32, &o, 4);
	struct embd_shard *s = tshard(ref, 4, 0, 100, 0, 8);
	int64_t ids[4] = { 1, 2, 3, 4 }, offsets[5] = { 0, 1, 2, 3, 4 };
	float weights[4] = { 1, 1, 1, 1 }, grad[4 * 8] = { 0 };

	s->desc.rows = (int64_t)1 << 62;        /* 62 bits of row, 2 of bag or place */
	for (int weighted = 0; weighted < 2; weighted++) {
		struct embd_bag_batch bt = {
			.shard = s, .batch_size = 4, .offsets = offsets, .ids = ids,
			.weights = weighted ? weights : NULL, .num_ids = 4,
			.pooling = EMBD_POOLING_SUM, .pooled_grad = grad, .pooled_stride = 8,
		};
		struct embd_kernel_err err;
		cr_assert_eq(embd_kernels_backward(NULL, s, &bt, 1, &err), EMBD_ERANGE, "%s",
			     err.msg);
		cr_expect(strstr(err.msg, weighted ? "4 ids" : "4 bags") != NULL, "%s", err.msg);
		cr_expect(strstr(err.msg, "64 bits") != NULL, "%s", err.msg);
	}
	s->desc.rows = 100;
	cr_assert_eq(s->step, 0);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

Test(kernels_backward, no_ids_still_counts_the_step)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 10, 4, EMBD_DTYPE_FP32, &o, 9);
	struct embd_shard *s = tshard(ref, 9, 0, 10, 0, 4);
	int64_t offsets[3] = { 0, 0, 0 };
	float g[8] = { 1, 1, 1, 1, 1, 1, 1, 1 };
	struct tbags t = { .batch_size = 2, .offsets = offsets };
	struct embd_bag_batch bt = tbatch(s, 0, &t, EMBD_POOLING_MEAN, NULL, g, 4, 0);

	cr_assert_eq(embd_kernels_backward(NULL, s, &bt, 1, NULL), 0);
	cr_assert_eq(embd_kernels_backward(NULL, s, NULL, 0, NULL), 0);
	cr_expect_eq(s->step, 2);
	expect_shard_equals_ref("no ids", s, ref);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/* Every row an update leaves NaN or infinite (weights or state) is counted on the shard and
 * the lowest named, on every instruction set; rows left finite are not. */
Test(kernels_backward, rows_left_nonfinite_are_counted)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_ADAGRAD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 100, 24, EMBD_DTYPE_FP32, &o, 9);
	enum embd_isa isas[3];
	int nisa = tisas(isas);

	for (int i = 0; i < nisa; i++) {
		struct embd_shard *s = tshard(ref, 9, 40, 60, 0, 24);
		/* bag 0: rows 47 and 52 (huge gradient: adagrad's sum of squares overflows), bag 1:
		 * row 45 (small) */
		int64_t offsets[3] = { 0, 2, 3 }, ids[3] = { 52, 47, 45 };
		float g[3 * 24];                /* the second step reads 2 bags from g + 24 */
		for (int k = 0; k < 24; k++) {
			g[k] = 3e19f;
			g[24 + k] = g[48 + k] = 0.5f;
		}
		struct tbags t = { .batch_size = 2, .offsets = offsets, .ids = ids, .num_ids = 3 };
		struct embd_bag_batch bt = tbatch(s, 0, &t, EMBD_POOLING_SUM, NULL, g, 24, 0);
		struct embd_exec ex = { .isa = isas[i] };
		cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, NULL), 0);
		cr_expect_eq(s->nonfinite_rows, 2, "%s: rows 47 and 52: got %llu",
			     embd_kernels_isa_name(isas[i]), (unsigned long long)s->nonfinite_rows);
		cr_expect_eq(s->nonfinite_row, 47, "%s: the lowest: got %lld",
			     embd_kernels_isa_name(isas[i]), (long long)s->nonfinite_row);
		/* a second step on row 45 alone leaves nothing new */
		int64_t off1[3] = { 0, 1, 1 }, id1[1] = { 45 };
		struct tbags t1 = { .batch_size = 2, .offsets = off1, .ids = id1, .num_ids = 1 };
		bt = tbatch(s, 0, &t1, EMBD_POOLING_SUM, NULL, g + 24, 24, 0);
		cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, NULL), 0);
		cr_expect_eq(s->nonfinite_rows, 2, "%s: row 45 stays finite",
			     embd_kernels_isa_name(isas[i]));
		embd_shard_destroy(s);
	}
	embd_ref_table_destroy(ref);
}

/* Whether row r of shard s holds a NaN or an infinity, in its weights as stored or its state. */
static bool shard_row_nonfinite(const struct embd_shard *s, int64_t r)
{
	const struct embd_shard_desc *d = &s->desc;
	uint64_t cols = d->cols, m1 = embd_optim_state_floats(d->optimizer.type, d->cols, 0);
	uint64_t m2 = embd_optim_state_floats(d->optimizer.type, d->cols, 1);

	for (uint64_t c = 0; c < cols; c++) {
		uint64_t i = (uint64_t)r * cols + c;
		if (d->dtype == EMBD_DTYPE_FP16 ? (((uint16_t *)s->weights)[i] & 0x7c00u) == 0x7c00u
						: !isfinite(((float *)s->weights)[i]))
			return true;
	}
	for (uint64_t c = 0; c < m1; c++)
		if (!isfinite(s->momentum1[(uint64_t)r * m1 + c]))
			return true;
	for (uint64_t c = 0; c < m2; c++)
		if (!isfinite(s->momentum2[(uint64_t)r * m2 + c]))
			return true;
	return false;
}

/* The rows the small tests below update: bag 0 rows 52 and 47, bag 1 row 45. */
static const int64_t three_ids[3] = { 52, 47, 45 };

/* One backward step of shard s (at most 64 columns) on isa: two bags over three_ids, summed,
 * every gradient 0.5. */
static void backward_of_three_ids(struct embd_shard *s, enum embd_isa isa, const char *msg)
{
	const uint32_t dim = s->desc.cols;
	int64_t offsets[3] = { 0, 2, 3 }, ids[3];
	float g[2 * 64];

	cr_assert_leq(dim, 64, "%s", msg);
	memcpy(ids, three_ids, sizeof(ids));
	for (uint32_t k = 0; k < 2 * dim; k++)
		g[k] = 0.5f;
	struct tbags t = { .batch_size = 2, .offsets = offsets, .ids = ids, .num_ids = 3 };
	struct embd_bag_batch bt = tbatch(s, 0, &t, EMBD_POOLING_SUM, NULL, g, dim, 0);
	struct embd_exec ex = { .isa = isa };
	cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, NULL), 0, "%s", msg);
}

/*
 * adagrad's and adam's fp32 rows of whole vectors are checked on the sum of their new weights
 * and state: rows whose values are all finite but add up past the largest float are
 * recounted one by one, not counted (a width with a loop of its own and one without, every
 * instruction set).
 */
Test(kernels_backward, finite_rows_whose_sums_overflow_are_not_counted)
{
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	const uint32_t dims[2] = { 48, 64 };

	for (int i = 0; i < nisa; i++)
		for (int di = 0; di < 4; di++) {
			uint32_t dim = dims[di % 2];
			bool adam = di >= 2;
			struct embd_optimizer_spec o = opt_spec(adam ? EMBD_OPT_ADAM : EMBD_OPT_ADAGRAD, 0.0f);
			struct embd_ref_table *ref = embd_ref_table_create(2, 100, dim, EMBD_DTYPE_FP32, &o, 9);
			struct embd_shard *s = tshard(ref, 9, 0, 100, 0, dim);
			float *w = s->weights;
			/* weights 2e38; adagrad's sum of squares 2e38; adam's m 1e37 and v 2e38 (the
			 * step, ~1e16, is far under the weight's ulp: the weight stays as it is) */
			for (uint64_t k = 0; k < 100ull * dim; k++) {
				w[k] = 2e38f;
				s->momentum1[k] = adam ? 1e37f : 2e38f;
				if (adam)
					s->momentum2[k] = 2e38f;
			}
			char msg[96];
			snprintf(msg, sizeof(msg), "%s %s D %u", embd_kernels_isa_name(isas[i]),
				 adam ? "adam" : "adagrad", dim);
			backward_of_three_ids(s, isas[i], msg);
			for (int j = 0; j < 3; j++) {
				uint64_t at = (uint64_t)three_ids[j] * dim;
				float sum = w[at] + s->momentum1[at] + (adam ? s->momentum2[at] : 0.0f);
				cr_expect(!shard_row_nonfinite(s, three_ids[j]), "%s: row %lld stays finite",
					  msg, (long long)three_ids[j]);
				cr_expect(isinf(sum), "%s: row %lld's weight and state should add up past the "
					  "largest float: %g", msg, (long long)three_ids[j], (double)sum);
			}
			cr_expect_eq(s->nonfinite_rows, 0, "%s: counted %llu", msg,
				     (unsigned long long)s->nonfinite_rows);
			embd_shard_destroy(s);
			embd_ref_table_destroy(ref);
		}
}

/*
 * rowwise_adagrad's fp32 rows of whole 16-float groups without weight decay (cpu_kernels.c's
 * rowwise_row_checked), every instruction set: a weight left infinite beside a finite state is
 * counted, and a zero learning rate leaves weights of -0 as -0 (the step adds -0 * g, as
 * fmaf(-mult, g, w) does, not +0), bit for bit.
 */
Test(kernels_backward, rowwise_adagrad_counts_a_nonfinite_weight_and_keeps_signed_zeros)
{
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	const uint32_t dim = 64;

	for (int i = 0; i < nisa; i++)
		for (int zero_lr = 0; zero_lr < 2; zero_lr++) {
			struct embd_optimizer_spec o = opt_spec(EMBD_OPT_ROWWISE_ADAGRAD, 0.0f);
			o.lr = zero_lr ? 0.0f : 0.1f;
			struct embd_ref_table *ref = embd_ref_table_create(2, 100, dim, EMBD_DTYPE_FP32, &o, 9);
			struct embd_shard *s = tshard(ref, 9, 0, 100, 0, dim);
			float *w = s->weights;
			char msg[96];
			snprintf(msg, sizeof(msg), "%s lr %g", embd_kernels_isa_name(isas[i]), (double)o.lr);
			for (uint64_t k = 0; k < 100ull * dim; k++)
				w[k] = zero_lr ? -0.0f : 1.0f;
			if (!zero_lr)
				w[47 * dim + 5] = INFINITY; /* its state (one float a row) stays finite */
			backward_of_three_ids(s, isas[i], msg);
			cr_expect(isfinite(s->momentum1[47]), "%s: row 47's state stays finite", msg);
			cr_expect_eq(s->nonfinite_rows, zero_lr ? 0 : 1, "%s: counted %llu", msg,
				     (unsigned long long)s->nonfinite_rows);
			if (!zero_lr)
				cr_expect_eq(s->nonfinite_row, 47, "%s: named %lld", msg,
					     (long long)s->nonfinite_row);
			for (uint64_t k = 0; zero_lr && k < 100ull * dim; k++)
				if (!signbit(w[k]) || w[k] != 0.0f) {
					cr_expect(false, "%s: weight %llu should stay -0: %g", msg,
						  (unsigned long long)k, (double)w[k]);
					break;
				}
			embd_shard_destroy(s);
			embd_ref_table_destroy(ref);
		}
}

/*
 * Every optimizer, fp32 and fp16 rows, weight decay 0 and 0.01, every instruction set, 1 and 3
 * workers, rows of 20 columns (checked row by row), 48 and 64 (fp32: checked into vector lanes
 * over a chunk, rows counted after it; 64 has a loop of its own, 48 the loop of any width):
 * gradients from ordinary to 3e38 leave some rows NaN or infinite in the weights (an fp16
 * weight overflows from a gradient of 1e6, a fp32 one when a row's occurrences sum past the
 * largest float) or the state (squares of 3e19 overflow); the count and the lowest row are
 * exactly the rows that now hold one, and the rows themselves still equal the reference.
 */
Test(kernels_backward, every_optimizer_counts_the_rows_it_leaves_nonfinite, .timeout = 120)
{
	static const float palette[] = { 0.5f, -0.25f, 1e6f, -3e19f, 3e38f };
	struct trng r = { 77 };
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	struct embd_workers *three;
	char msg[160];

	cr_assert_eq(embd_workers_create(3, NULL, &three, msg, sizeof(msg)), 0, "%s", msg);
	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++)
		for (int kind = 0; kind < 4; kind++) /* fp32, fp16; weight decay 0, then 0.01 */
			for (int i = 0; i < nisa * 6; i++) {
				/* both weight decays: without it, fp32 rows of whole 16-float groups take
				 * loops of their own (cpu_kernels.c) for all but sgd */
				const float wd = kind >= 2 ? 0.01f : 0.0f;
				enum embd_data_type dt = kind % 2 ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32;
				const uint32_t dims[3] = { 20, 48, 64 }, dim = dims[i % 6 / 2];
				struct embd_optimizer_spec o = opt_spec((enum embd_optimizer_type)type, wd);
				struct embd_ref_table *ref = embd_ref_table_create(3, 200, dim, dt, &o, 5);
				struct embd_shard *s = tshard(ref, 5, 0, 200, 0, dim);
				struct embd_exec ex = { .workers = i % 2 ? three : NULL, .isa = isas[i / 6] };
				struct tbags t;
				tbags_random(&t, &r, 64, 6, 10, 200, 20, false);
				float *g = malloc(64 * dim * sizeof(float));
				for (uint32_t k = 0; k < 64 * dim; k++)
					g[k] = trng_below(&r, 8) ? palette[trng_below(&r, 2)]
								 : palette[trng_below(&r, 5)];
				struct embd_bag_batch bt = tbatch(s, 0, &t, EMBD_POOLING_SUM, NULL, g, dim, 0);
				struct embd_ref_bags rb = { 64, t.lengths, t.ids, NULL, EMBD_POOLING_SUM, g, 0 };
				cr_assert_eq(embd_kernels_backward(&ex, s, &bt, 1, NULL), 0);
				cr_assert_eq(embd_ref_backward(ref, &rb, 1), 0);
				uint64_t want = 0;
				int64_t lowest = -1;
				for (int64_t row = 0; row < 200; row++)
					if (shard_row_nonfinite(s, row)) {
						want++;
						lowest = lowest < 0 ? row : lowest;
					}
				snprintf(msg, sizeof(msg), "opt %d %s D %u wd %g %s workers %d", type,
					 kind % 2 ? "fp16" : "fp32", dim, (double)wd,
					 embd_kernels_isa_name(isas[i / 6]), i % 2 ? 3 : 1);
				cr_expect(want > 0 && want < 200, "%s: the gradients should leave some rows "
					  "non-finite, not all: %llu", msg, (unsigned long long)want);
				cr_expect_eq(s->nonfinite_rows, want, "%s: counted %llu rows, %llu hold one", msg,
					     (unsigned long long)s->nonfinite_rows, (unsigned long long)want);
				if (want)
					cr_expect_eq(s->nonfinite_row, lowest, "%s: lowest %lld, named %lld", msg,
						     (long long)lowest, (long long)s->nonfinite_row);
				expect_shard_equals_ref(msg, s, ref);
				tbags_free(&t);
				free(g);
				embd_shard_destroy(s);
				embd_ref_table_destroy(ref);
			}
	embd_workers_destroy(three);
}

Test(kernels_backward, first_nonfinite_finds_every_position)
{
	float x[83];

	for (int i = 0; i < 83; i++)
		x[i] = i % 2 ? 3.4e38f : -1e-42f;       /* the largest finite, a denormal */
	cr_expect_eq(embd_first_nonfinite(x, 83), 83);
	for (int at = 0; at < 83; at++) {
		float keep = x[at];
		x[at] = at % 3 == 0 ? NAN : at % 3 == 1 ? INFINITY : -INFINITY;
		cr_expect_eq(embd_first_nonfinite(x, 83), (uint64_t)at, "at %d", at);
		cr_expect_eq(embd_first_nonfinite(x, (uint64_t)at), (uint64_t)at, "before %d", at);
		x[at] = keep;
	}
}

/* Shards a and b hold the same bits: weights, optimizer state, step, non-finite count. */
static void expect_shards_identical(const char *what, const struct embd_shard *a,
				    const struct embd_shard *b)
{
	uint64_t bytes[3];
	char err[128];

	cr_assert_eq(embd_shard_sizes(&a->desc, &bytes[0], &bytes[1], &bytes[2], err, sizeof(err)), 0,
		     "%s", err);
	cr_expect_eq(memcmp(a->weights, b->weights, bytes[0]), 0, "%s: weights differ", what);
	if (bytes[1])
		cr_expect_eq(memcmp(a->momentum1, b->momentum1, bytes[1]), 0, "%s: momentum1 differs",
			     what);
	if (bytes[2])
		cr_expect_eq(memcmp(a->momentum2, b->momentum2, bytes[2]), 0, "%s: momentum2 differs",
			     what);
	cr_expect_eq(a->step, b->step, "%s: step %lld, expected %lld", what, (long long)a->step,
		     (long long)b->step);
	cr_expect_eq(a->nonfinite_rows, b->nonfinite_rows, "%s: non-finite rows", what);
}

struct concurrent_apply {
	const struct embd_exec *exec;
	struct embd_shard *shard;
	const struct embd_backward_prep *prep;
	const struct embd_bag_batch *batches;
	int rc;
	struct embd_kernel_err err;
};

static void *apply_thread(void *arg)
{
	struct concurrent_apply *a = arg;

	a->rc = embd_kernels_backward_apply(a->exec, a->shard, a->prep, a->batches, 2, &a->err);
	return NULL;
}

/*
 * The split API: a table of D columns cut into two column shards; each step prepares the bags
 * once (on 3 workers) and applies the prep to both shards at once (one on a thread of its own,
 * one on 3 workers), and each shard ends bit for bit where embd_kernels_backward leaves its twin, for
 * every optimizer and isa, fp32 and fp16, weighted MEAN bags with their full lengths given and
 * SUM bags, the gradients divided by 3.
 */
Test(kernels_backward, prepared_once_applied_to_two_column_shards, .timeout = 120)
{
	static const uint32_t dims[][2] = { { 64, 32 }, { 24, 5 } };       /* D, first shard's */
	enum embd_isa isas[3];
	int nisa = tisas(isas);
	struct trng r = { 36 };
	struct embd_workers *three;
	char msg[160];

	cr_assert_eq(embd_workers_create(3, NULL, &three, msg, sizeof(msg)), 0, "%s", msg);
	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++)
	for (int i = 0; i < nisa; i++)
	for (int fp16 = 0; fp16 < 2; fp16++) {
		const uint32_t D = dims[(type + fp16) % 2][0], c0 = dims[(type + fp16) % 2][1];
		const uint32_t col[2] = { 0, c0 }, cols[2] = { c0, D - c0 };
		const int64_t rows = 3000;
		struct embd_optimizer_spec o = opt_spec(type, 0.01f);
		struct embd_ref_table *ref = embd_ref_table_create(9, rows, D, fp16, &o, 23);
		struct embd_shard *split[2], *plain[2];
		for (int k = 0; k < 2; k++) {
			split[k] = tshard(ref, 23, 0, rows, col[k], cols[k]);
			plain[k] = tshard(ref, 23, 0, rows, col[k], cols[k]);
		}
		struct embd_exec ex3 = { .workers = three, .isa = isas[i] };
		struct embd_exec ex1 = { .isa = isas[i] };
		for (int step = 0; step < 2; step++) {
			struct tbags t[2];
			float *g[2];
			int32_t *full[2];
			struct embd_bag_batch bt[2][2];
			for (int f = 0; f < 2; f++) {
				tbags_random(&t[f], &r, 200, 20, 10, rows, 40, f == 1);
				g[f] = random_grad(&r, 200ull * D);
				full[f] = malloc(200 * sizeof(int32_t));
				for (uint32_t b = 0; b < 200; b++)
					full[f][b] = t[f].lengths[b] + (int32_t)(b % 3);
				enum embd_pooling p = f ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM;
				for (int k = 0; k < 2; k++) {
					bt[k][f] = tbatch(NULL, f, &t[f], p, f ? full[f] : NULL, g[f], D,
							  col[k]);
					bt[k][f].grad_divisor = 3;
				}
			}
			struct embd_kernel_err err;
			struct embd_backward_prep *prep = NULL;
			int rc = embd_kernels_backward_prepare(&ex3, split[0], bt[0], 2, &prep, &err);
			cr_assert_eq(rc, 0, "prepare: %d %s", rc, err.msg);
			/* both applies at once, as two ranks run them: the prep is only read */
			struct concurrent_apply other = { .exec = &ex1, .shard = split[0], .prep = prep,
							  .batches = bt[0] };
			pthread_t th;
			cr_assert_eq(pthread_create(&th, NULL, apply_thread, &other), 0);
			rc = embd_kernels_backward_apply(&ex3, split[1], prep, bt[1], 2, &err);
			pthread_join(th, NULL);
			cr_assert_eq(rc, 0, "apply to shard 1: %d %s", rc, err.msg);
			cr_assert_eq(other.rc, 0, "apply to shard 0: %d %s", other.rc, other.err.msg);
			for (int k = 0; k < 2; k++) {
				rc = embd_kernels_backward(&ex3, plain[k], bt[k], 2, &err);
				cr_assert_eq(rc, 0, "backward of shard %d: %d %s", k, rc, err.msg);
				snprintf(msg, sizeof(msg), "%s opt %d %s D %u shard %d (cols %u) step %d",
					 embd_kernels_isa_name(isas[i]), type, fp16 ? "fp16" : "fp32", D,
					 k, cols[k], step);
				expect_shards_identical(msg, split[k], plain[k]);
			}
			embd_backward_prep_free(prep);
			for (int f = 0; f < 2; f++) {
				tbags_free(&t[f]);
				free(g[f]);
				free(full[f]);
			}
		}
		for (int k = 0; k < 2; k++) {
			embd_shard_destroy(split[k]);
			embd_shard_destroy(plain[k]);
		}
		embd_ref_table_destroy(ref);
	}
	embd_workers_destroy(three);
}

/* A bad id or bad offsets: prepare fails exactly as embd_kernels_backward does (code, feature,
 * sample, id, message), makes no prep and writes no row. */
Test(kernels_backward, prepare_reports_errors_as_backward_does)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 50, 4, EMBD_DTYPE_FP32, &o, 8);
	struct embd_shard *s = tshard(ref, 8, 0, 50, 0, 4);
	struct embd_workers *two;
	char msg[128];
	int64_t offsets[4] = { 0, 2, 3, 5 }, bad_offsets[4] = { 0, 3, 2, 5 };
	int64_t ids[5] = { 1, 7, 50, 9, -1 };
	float g[3 * 4] = { 0 };

	cr_assert_eq(embd_workers_create(2, NULL, &two, msg, sizeof(msg)), 0, "%s", msg);
	struct embd_exec ex = { .workers = two };
	for (int c = 0; c < 2; c++) {
		struct embd_bag_batch bt = { .feature = 4, .batch_size = 3,
					     .offsets = c ? bad_offsets : offsets, .ids = ids,
					     .num_ids = 5, .pooled_grad = g, .pooled_stride = 4 };
		struct embd_kernel_err want, got;
		struct embd_backward_prep *prep = (struct embd_backward_prep *)&got;
		int rc_want = embd_kernels_backward(&ex, s, &bt, 1, &want);
		int rc = embd_kernels_backward_prepare(&ex, s, &bt, 1, &prep, &got);
		cr_assert_eq(rc_want, c ? EMBD_EINVAL : EMBD_ERANGE, "case %d: %d %s", c, rc_want,
			     want.msg);
		cr_expect_eq(rc, rc_want, "case %d: prepare %d, backward %d", c, rc, rc_want);
		cr_expect_null(prep, "case %d: a prep made despite the error", c);
		cr_expect_eq(got.feature, want.feature);
		cr_expect_eq(got.sample, want.sample, "case %d: sample %lld, expected %lld", c,
			     (long long)got.sample, (long long)want.sample);
		cr_expect_eq(got.id, want.id, "case %d: id %lld, expected %lld", c,
			     (long long)got.id, (long long)want.id);
		cr_expect_str_eq(got.msg, want.msg);
		cr_expect_eq(s->step, 0, "case %d: the shard stepped", c);
	}
	embd_workers_destroy(two);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/* The apply's second prefetch, into L1 one row nearer: adagrad's and adam's on every CPU
 * (embd_backward_prefetch_l1_near; the same whichever vendor's rules run); the other optimizers
 * keep the L2's alone. */
Test(kernels_backward, near_l1_prefetch_for_adagrad_and_adam)
{
	static const bool near[] = { [EMBD_OPT_SGD] = false, [EMBD_OPT_ADAGRAD] = true,
				     [EMBD_OPT_ROWWISE_ADAGRAD] = false, [EMBD_OPT_ADAM] = true };

	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++) {
		cr_expect_eq(embd_backward_prefetch_l1_near(type), near[type], "optimizer %d",
			     type);
		cr_expect_eq(embd_backward_prefetch_l1(type), near[type], "optimizer %d", type);
	}
}

/* Apply refuses a shard of other rows, and batches of other bags than the prepared ones. */
Test(kernels_backward, apply_refuses_other_rows_and_bags)
{
	struct embd_optimizer_spec o = opt_spec(EMBD_OPT_SGD, 0.0f);
	struct embd_ref_table *ref = embd_ref_table_create(2, 50, 4, EMBD_DTYPE_FP32, &o, 8);
	struct embd_shard *s = tshard(ref, 8, 0, 50, 0, 4);
	struct embd_shard *rows = tshard(ref, 8, 10, 40, 0, 4);
	int64_t offsets[3] = { 0, 2, 3 }, ids[3] = { 11, 17, 12 };
	float g[2 * 4] = { 0 };
	struct embd_bag_batch bt = { .feature = 2, .batch_size = 2, .offsets = offsets, .ids = ids,
				     .num_ids = 3, .pooled_grad = g, .pooled_stride = 4 };
	struct embd_backward_prep *prep;
	struct embd_kernel_err err;

	cr_assert_eq(embd_kernels_backward_prepare(NULL, s, &bt, 1, &prep, &err), 0, "%s", err.msg);
	cr_expect_eq(embd_kernels_backward_apply(NULL, rows, prep, &bt, 1, &err), EMBD_EINVAL);
	cr_expect(strstr(err.msg, "rows [10, 50)"), "%s", err.msg);
	cr_expect_eq(embd_kernels_backward_apply(NULL, s, prep, &bt, 0, &err), EMBD_EINVAL);
	struct embd_bag_batch fewer = bt;
	fewer.batch_size = 1;
	fewer.num_ids = 2;
	cr_expect_eq(embd_kernels_backward_apply(NULL, s, prep, &fewer, 1, &err), EMBD_EINVAL);
	cr_expect(strstr(err.msg, "feature 2"), "%s", err.msg);
	cr_expect_eq(s->step, 0);
	cr_expect_eq(rows->step, 0);
	cr_expect_eq(embd_kernels_backward_apply(NULL, s, prep, &bt, 1, &err), 0, "%s", err.msg);
	cr_expect_eq(s->step, 1);
	embd_backward_prep_free(prep);
	embd_shard_destroy(rows);
	embd_shard_destroy(s);
	embd_ref_table_destroy(ref);
}

/*
 * Either vendor's distances ($EMBD_CPU_VENDOR, read once a process; criterion runs each test in
 * its own), so that both rules' apply loops, their prefetches running on into the next chunk
 * included, are checked on any CPU: every optimizer and both key kinds against the reference,
 * with 1 and 3 workers, over batches of 500-3000 occurrences (chunks of 512).
 */
static void check_with_vendor(const char *vendor)
{
	const bool intel = !strcmp(vendor, "intel");
	struct trng r = { 41 };

	cr_assert_eq(setenv("EMBD_CPU_VENDOR", vendor, 1), 0);
	cr_assert_eq(embd_backward_prefetch_distance(256), embd_backward_prefetch_rows(256, intel),
		     "the vendor was read before the test set it");
	for (int type = EMBD_OPT_SGD; type <= EMBD_OPT_ADAM; type++) {
		check_unsharded(&r, type, EMBD_DTYPE_FP32, 5000, 64, 100, 60, 10, 2);
		check_unsharded(&r, type, EMBD_DTYPE_FP16, 300, 128, 50, 20, 30, 2);
	}
}

Test(kernels_backward, intel_prefetch_distances_equal_reference, .timeout = 120)
{
	check_with_vendor("intel");
}

Test(kernels_backward, other_prefetch_distances_equal_reference, .timeout = 120)
{
	check_with_vendor("other");
}

/*
 * The apply's prefetch distance (embd_backward_prefetch_rows), for either vendor: rows within
 * the rule's bounds, fewer (or as many) as rows grow, and as many lines in flight as the rule
 * wants wherever a bound does not hold it back; this CPU's distance is one of the two.
 */
Test(kernels_backward, prefetch_distance_rule)
{
	/* sgd D 16 (fp16 D 32) to adam D 256, and rows past the bounds */
	const uint64_t bytes[] = { 64, 128, 256, 512, 516, 1024, 1536, 3072, 65536 };

	for (int intel = 0; intel <= 1; intel++) {
		const uint64_t lo = intel ? 16 : 2, hi = intel ? 64 : 12, want = intel ? 768 : 96;
		uint32_t last = UINT32_MAX;

		for (size_t i = 0; i < sizeof(bytes) / sizeof(bytes[0]); i++) {
			const uint64_t lines = (bytes[i] + 63) / 64;
			const uint32_t rows = embd_backward_prefetch_rows(bytes[i], intel);

			cr_expect(rows >= lo && rows <= hi, "intel %d, %lu bytes: %u rows", intel,
				  (unsigned long)bytes[i], rows);
			cr_expect(rows <= last, "intel %d: more rows for longer rows", intel);
			if (rows > lo && rows < hi)
				cr_expect(rows * lines <= want && (rows + 1) * lines > want,
					  "intel %d, %lu bytes: %u rows of %lu lines", intel,
					  (unsigned long)bytes[i], rows, (unsigned long)lines);
			last = rows;
		}
		/* the bounds themselves: short rows at the longest distance, huge ones the shortest */
		cr_expect_eq(embd_backward_prefetch_rows(256, intel), hi);
		cr_expect_eq(embd_backward_prefetch_rows(65536, intel), lo);
	}
	cr_expect_eq(embd_backward_prefetch_rows(1536, true), 32, "adam D 128 on an Intel CPU");
	cr_expect_eq(embd_backward_prefetch_rows(1536, false), 4, "adam D 128 elsewhere");
	for (size_t i = 0; i < sizeof(bytes) / sizeof(bytes[0]); i++) {
		const uint32_t here = embd_backward_prefetch_distance(bytes[i]);
		cr_expect(here == embd_backward_prefetch_rows(bytes[i], true) ||
			  here == embd_backward_prefetch_rows(bytes[i], false));
	}
}
