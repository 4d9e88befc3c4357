/*
 * The per-row headers on their own: fp16 conversion against the F16C instructions (every
 * half, and fp32 values chosen around every rounding boundary), the pooling scale, and the
 * worker pool the kernels run on.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "kernels/device.h"
#include "kernels/optim_row.h"
#include "kernels/pool_row.h"
#include "kernels/workers.h"
#include "tests/unit/kernels/kernel_test_util.h"

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("f16c"))) static float f16c_to_fp32(uint16_t h)
{
	return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

__attribute__((target("f16c"))) static uint16_t f16c_to_fp16(float f)
{
	return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0);
}

static bool have_f16c(void)
{
	return embd_kernels_isa_supported(EMBD_ISA_AVX2);
}
#endif

Test(kernels_rows, fp16_every_half_round_trips)
{
	for (uint32_t h = 0; h < 65536; h++) {
		float f = embd_fp16_to_fp32((uint16_t)h);
		bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
		if (nan) {
			cr_assert(f != f, "half 0x%04x: expected NaN, got %g", h, f);
			continue;
		}
		uint16_t back = embd_fp32_to_fp16(f);
		cr_assert_eq(back, h, "half 0x%04x -> %g -> 0x%04x", h, f, back);
#if defined(__x86_64__)
		if (have_f16c()) {
			float g = f16c_to_fp32((uint16_t)h);
			cr_assert(!memcmp(&f, &g, 4), "half 0x%04x: F16C gives %g, we give %g", h, g, f);
		}
#endif
	}
}

Test(kernels_rows, fp32_to_fp16_matches_f16c)
{
#if defined(__x86_64__)
	if (!have_f16c())
		cr_skip_test("no F16C on this CPU");
	struct trng r = { 51 };
	/* every float whose top 19 bits are those of a half, with low bits at the rounding
	 * boundary (tie), just under it, just over it, and random ones */
	for (uint32_t hi = 0; hi < (1u << 19); hi++) {
		uint32_t lows[5] = { 0, 0x1000, 0x0fff, 0x1001, (uint32_t)trng_below(&r, 0x2000) };
		for (int i = 0; i < 5; i++) {
			uint32_t bits = (hi << 13) | lows[i];
			float f;
			memcpy(&f, &bits, 4);
			if (f != f)
				continue; /* NaN payload propagation is not part of the definition */
			uint16_t want = f16c_to_fp16(f), got = embd_fp32_to_fp16(f);
			cr_assert_eq(got, want, "fp32 0x%08x (%g): F16C 0x%04x, we 0x%04x", bits, f, want, got);
		}
	}
#else
	cr_skip_test("not x86-64");
#endif
}

Test(kernels_rows, pool_scale_and_rows)
{
	cr_expect_eq(embd_pool_scale(EMBD_POOLING_SUM, 0), 1.0f);
	cr_expect_eq(embd_pool_scale(EMBD_POOLING_MEAN, 4), 0.25f);
	cr_expect_eq(embd_pool_scale(EMBD_POOLING_MEAN, 0), 0.0f, "mean of an empty bag must be 0");

	float acc[3] = { 1, 1, 1 }, row[3] = { 1, 2, 3 };
	uint16_t row16[3] = { 0x3c00, 0x4000, 0xc200 }; /* 1, 2, -3 */
	embd_pool_row_fp32(acc, row, 2.0f, 3);
	embd_pool_row_fp16(acc, row16, 0.5f, 3);
	static const float expected[3] = { 3.5f, 6.0f, 5.5f };
	for (int i = 0; i < 3; i++)
		cr_expect_eq(acc[i], expected[i], "acc[%d]: expected %g, got %g", i, expected[i], acc[i]);
	float g[2] = { 0, 0 }, dy[2] = { 1, -2 };
	embd_grad_accum_row(g, dy, embd_grad_coef(3.0f, 0.5f), 2);
	cr_expect(g[0] == 1.5f && g[1] == -3.0f, "grad: expected {1.5, -3}, got {%g, %g}", g[0], g[1]);
}

struct count_job {
	int calls[8];
	uint32_t seen_n;
};

static void count_fn(void *arg, uint32_t worker, uint32_t n)
{
	struct count_job *j = arg;
	__atomic_fetch_add(&j->calls[worker], 1, __ATOMIC_RELAXED);
	__atomic_store_n(&j->seen_n, n, __ATOMIC_RELAXED);
}

Test(kernels_rows, workers_run_every_worker_once)
{
	struct embd_workers *w;
	char err[128];
	int cpus[4] = { 0, 0, 0, 0 };

	cr_assert_eq(embd_workers_create(4, cpus, &w, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_workers_count(w), 4u);
	for (int round = 0; round < 100; round++) {
		struct count_job j = { { 0 }, 0 };
		embd_workers_run(w, count_fn, &j);
		for (int i = 0; i < 4; i++)
			cr_assert_eq(j.calls[i], 1, "round %d worker %d ran %d times", round, i, j.calls[i]);
		cr_assert_eq(j.seen_n, 4u);
	}
	embd_workers_destroy(w);
	embd_workers_destroy(NULL);
	cr_expect_eq(embd_workers_count(NULL), 1u);

	cr_assert_eq(embd_workers_create(0, NULL, &w, err, sizeof(err)), EMBD_EINVAL);
	int bad[2] = { 0, -5 };
	cr_assert_eq(embd_workers_create(2, bad, &w, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "cpu -5"), "message: %s", err);
	cr_expect_null(w);
}
