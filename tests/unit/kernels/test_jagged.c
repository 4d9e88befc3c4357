/*
 * Lengths/offsets, block bucketize and segment permutes against the naive reference and
 * against small cases worked by hand (TorchRec's 10 rows over 4 ranks: blocks 3, 3, 3, 1).
 * Integer results: everything must be equal.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/jagged.h"
#include "tests/unit/kernels/kernel_test_util.h"

Test(kernels_jagged, offsets_and_lengths)
{
	int32_t lengths[5] = { 2, 0, 3, 0, 1 }, back[5];
	int64_t offsets[6];
	char err[128];

	cr_assert_eq(embd_jagged_offsets(lengths, 5, 6, offsets, err, sizeof(err)), 0, "%s", err);
	static const int64_t expected[6] = { 0, 2, 2, 5, 5, 6 };
	for (int i = 0; i < 6; i++)
		cr_expect_eq(offsets[i], expected[i], "offsets[%d]: expected %lld, got %lld", i,
			     (long long)expected[i], (long long)offsets[i]);
	cr_assert_eq(embd_jagged_lengths(offsets, 5, back, err, sizeof(err)), 0, "%s", err);
	cr_assert(!memcmp(back, lengths, sizeof(lengths)));

	cr_assert_eq(embd_jagged_offsets(lengths, 5, 7, offsets, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "add up to 6, num_values is 7"), "message: %s", err);
	lengths[3] = -1;
	cr_assert_eq(embd_jagged_offsets(lengths, 5, 5, offsets, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "lengths[3] = -1"), "message: %s", err);
	offsets[2] = 9;
	cr_assert_eq(embd_jagged_lengths(offsets, 5, back, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "offsets[2..3]"), "message: %s", err);
}

Test(kernels_jagged, bucketize_by_hand)
{
	/* one feature, 2 samples, 10 rows over 4 buckets: blocks [0,3) [3,6) [6,9) [9,10) */
	int32_t lengths[2] = { 3, 2 }, out_len[8];
	int64_t values[5] = { 9, 0, 4, 3, 8 }, out_val[5], rows = 10;
	float weights[5] = { 1, 2, 3, 4, 5 }, out_w[5];
	uint64_t perm[5];
	char err[128];
	struct embd_bucketize_args a = {
		.num_features = 1, .batch_size = 2, .lengths = lengths, .values = values,
		.weights = weights, .num_values = 5, .feature_rows = &rows, .num_buckets = 4,
		.out_lengths = out_len, .out_values = out_val, .out_weights = out_w, .out_permute = perm,
	};
	cr_assert_eq(embd_jagged_bucketize(&a, err, sizeof(err)), 0, "%s", err);
	static const int32_t el[8] = { 1, 0, 1, 1, 0, 1, 1, 0 };
	static const int64_t ev[5] = { 0, 4, 3, 8, 9 };
	static const float ew[5] = { 2, 3, 4, 5, 1 };
	static const uint64_t ep[5] = { 4, 0, 1, 2, 3 };
	for (int i = 0; i < 8; i++)
		cr_expect_eq(out_len[i], el[i], "lengths[%d]: expected %d, got %d", i, el[i], out_len[i]);
	for (int i = 0; i < 5; i++) {
		cr_expect_eq(out_val[i], ev[i], "values[%d]: expected %lld, got %lld", i,
			     (long long)ev[i], (long long)out_val[i]);
		cr_expect_eq(out_w[i], ew[i], "weights[%d]: expected %g, got %g", i, ew[i], out_w[i]);
		cr_expect_eq(perm[i], ep[i], "permute[%d]: expected %llu, got %llu", i,
			     (unsigned long long)ep[i], (unsigned long long)perm[i]);
	}
	values[3] = 10;
	cr_assert_eq(embd_jagged_bucketize(&a, err, sizeof(err)), EMBD_ERANGE);
	cr_expect(strstr(err, "feature 0 sample 1: id 10"), "message: %s", err);
	values[3] = 3;
	lengths[1] = 3;
	cr_assert_eq(embd_jagged_bucketize(&a, err, sizeof(err)), EMBD_EINVAL);
}

Test(kernels_jagged, bucketize_random_equals_reference)
{
	struct trng r = { 41 };

	for (int trial = 0; trial < 50; trial++) {
		uint32_t F = 1 + (uint32_t)trng_below(&r, 4), B = 1 + (uint32_t)trng_below(&r, 20);
		uint32_t W = 1 + (uint32_t)trng_below(&r, 9);
		int64_t frows[4];
		int32_t *lengths = malloc(F * B * sizeof(int32_t));
		uint64_t nv = 0;
		for (uint32_t f = 0; f < F; f++)
			frows[f] = 1 + (int64_t)trng_below(&r, 100);
		for (uint32_t i = 0; i < F * B; i++)
			nv += (uint64_t)(lengths[i] = (int32_t)trng_below(&r, 6));
		int64_t *v = malloc((nv + 1) * 8), *ov = malloc((nv + 1) * 8), *rv = malloc((nv + 1) * 8);
		float *w = malloc((nv + 1) * 4), *ow = malloc((nv + 1) * 4), *rw = malloc((nv + 1) * 4);
		uint64_t *op = malloc((nv + 1) * 8), *rp = malloc((nv + 1) * 8);
		int32_t *ol = malloc(W * F * B * 4), *rl = malloc(W * F * B * 4);
		for (uint64_t j = 0, i = 0; i < F * B; i++)
			for (int32_t k = 0; k < lengths[i]; k++, j++) {
				v[j] = (int64_t)trng_below(&r, (uint64_t)frows[i / B]);
				w[j] = (float)j;
			}
		struct embd_bucketize_args a = {
			.num_features = F, .batch_size = B, .lengths = lengths, .values = v, .weights = w,
			.num_values = nv, .feature_rows = frows, .num_buckets = W, .out_lengths = ol,
			.out_values = ov, .out_weights = ow, .out_permute = op,
		};
		char err[128];
		cr_assert_eq(embd_jagged_bucketize(&a, err, sizeof(err)), 0, "%s", err);
		embd_ref_bucketize(F, B, lengths, v, w, frows, W, rl, rv, rw, rp);
		cr_assert(!memcmp(ol, rl, W * F * B * 4), "trial %d: bucketized lengths differ", trial);
		cr_assert(!memcmp(ov, rv, nv * 8), "trial %d: bucketized values differ", trial);
		cr_assert(!memcmp(ow, rw, nv * 4), "trial %d: bucketized weights differ", trial);
		cr_assert(!memcmp(op, rp, nv * 8), "trial %d: permutation differs", trial);
		for (uint64_t j = 0; j < nv; j++)
			cr_assert_eq(ov[op[j]], v[j], "value %llu does not scatter back", (unsigned long long)j);
		free(lengths); free(v); free(ov); free(rv); free(w); free(ow); free(rw);
		free(op); free(rp); free(ol); free(rl);
	}
}

Test(kernels_jagged, permute_random_equals_reference_and_inverts)
{
	struct trng r = { 42 };

	for (int trial = 0; trial < 50; trial++) {
		uint32_t S = 1 + (uint32_t)trng_below(&r, 12), seg = 1 + (uint32_t)trng_below(&r, 10);
		uint32_t *perm = malloc(S * 4), *inv = malloc(S * 4);
		int32_t *len = malloc(S * seg * 4), *ol = malloc(S * seg * 4), *rl = malloc(S * seg * 4),
			*bl = malloc(S * seg * 4);
		uint64_t nv = 0;
		for (uint32_t i = 0; i < S; i++)
			perm[i] = i;
		for (uint32_t i = S; i > 1; i--) {
			uint32_t j = (uint32_t)trng_below(&r, i), t = perm[i - 1];
			perm[i - 1] = perm[j];
			perm[j] = t;
		}
		for (uint32_t i = 0; i < S * seg; i++)
			nv += (uint64_t)(len[i] = (int32_t)trng_below(&r, 4));
		int64_t *v = malloc((nv + 1) * 8), *ov = malloc((nv + 1) * 8), *rv = malloc((nv + 1) * 8),
			*bv = malloc((nv + 1) * 8);
		float *w = malloc((nv + 1) * 4), *ow = malloc((nv + 1) * 4), *rw = malloc((nv + 1) * 4),
		      *bw = malloc((nv + 1) * 4);
		for (uint64_t j = 0; j < nv; j++) {
			v[j] = (int64_t)j * 7;
			w[j] = (float)j;
		}
		struct embd_permute_args a = {
			.num_segments = S, .segment_size = seg, .perm = perm, .lengths = len, .values = v,
			.weights = w, .num_values = nv, .out_lengths = ol, .out_values = ov, .out_weights = ow,
		};
		char err[128];
		cr_assert_eq(embd_jagged_permute(&a, err, sizeof(err)), 0, "%s", err);
		embd_ref_permute(S, seg, perm, len, v, w, rl, rv, rw);
		cr_assert(!memcmp(ol, rl, S * seg * 4) && !memcmp(ov, rv, nv * 8) && !memcmp(ow, rw, nv * 4),
			  "trial %d: permute differs from the reference", trial);
		cr_assert_eq(embd_jagged_perm_invert(perm, S, inv, err, sizeof(err)), 0, "%s", err);
		struct embd_permute_args back = {
			.num_segments = S, .segment_size = seg, .perm = inv, .lengths = ol, .values = ov,
			.weights = ow, .num_values = nv, .out_lengths = bl, .out_values = bv, .out_weights = bw,
		};
		cr_assert_eq(embd_jagged_permute(&back, err, sizeof(err)), 0, "%s", err);
		cr_assert(!memcmp(bl, len, S * seg * 4) && !memcmp(bv, v, nv * 8) && !memcmp(bw, w, nv * 4),
			  "trial %d: the inverse permutation does not undo it", trial);
		free(perm); free(inv); free(len); free(ol); free(rl); free(bl);
		free(v); free(ov); free(rv); free(bv); free(w); free(ow); free(rw); free(bw);
	}
}

Test(kernels_jagged, permute_rejects_non_permutations)
{
	uint32_t perm[3] = { 0, 2, 2 }, inv[3];
	char err[128];

	cr_assert_eq(embd_jagged_perm_invert(perm, 3, inv, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "perm[2] = 2: repeated"), "message: %s", err);
	perm[2] = 3;
	cr_assert_eq(embd_jagged_perm_invert(perm, 3, inv, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "out of range"), "message: %s", err);
}

Test(kernels_jagged, rank_to_feature_perm)
{
	/* 2 ranks x 3 features: [r0f0 r0f1 r0f2 r1f0 r1f1 r1f2] -> [r0f0 r1f0 r0f1 r1f1 r0f2 r1f2] */
	uint32_t perm[6];
	static const uint32_t expected[6] = { 0, 3, 1, 4, 2, 5 };

	embd_jagged_rank_to_feature_perm(2, 3, perm);
	for (int i = 0; i < 6; i++)
		cr_expect_eq(perm[i], expected[i], "perm[%d]: expected %u, got %u", i, expected[i], perm[i]);
}
