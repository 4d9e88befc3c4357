/*
 * The limits of embd-bench (tools/bench/bench_limits.c). The backward limit walks what an
 * exact update touches: the rows and occurrences bench_rmw_rows_make groups must be the
 * batch's, and the walk must leave the arrays it rewrites unchanged on every instruction set.
 * The forward (gather) limit must store every pooled row whole, as the kernel does.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu_kernels.h"
#include "kernels/embedding.h"
#include "kernels/workers.h"
#include "tools/bench/bench_limits.h"

/* Bags of 3 ids: rows ascending, each row's occurrences' bags in batch order. */
Test(bench_limits, rows_group_occurrences_in_batch_order)
{
	const int64_t ids[12] = { 7, 2, 7, 5, 2, 9, 7, 0, 5, 5, 5, 1 };
	uint64_t scratch[24], rows[12], first[13];
	uint32_t bags[12];
	const uint64_t want_rows[6] = { 0, 1, 2, 5, 7, 9 };
	const uint64_t want_first[7] = { 0, 1, 2, 4, 8, 11, 12 };
	/* 0: bag 2; 1: bag 3; 2: bags 0, 1; 5: 1, 2, 3, 3; 7: 0, 0, 2; 9: 1 */
	const uint32_t want_bags[12] = { 2, 3, 0, 1, 1, 2, 3, 3, 0, 0, 2, 1 };

	uint64_t n = bench_rmw_rows_make(ids, 12, 3, scratch, rows, first, bags);
	cr_assert_eq(n, 6, "distinct rows: got %llu", (unsigned long long)n);
	for (int k = 0; k < 6; k++)
		cr_expect_eq(rows[k], want_rows[k], "row %d: got %llu", k, (unsigned long long)rows[k]);
	for (int k = 0; k < 7; k++)
		cr_expect_eq(first[k], want_first[k], "first[%d]: got %llu", k,
			     (unsigned long long)first[k]);
	for (int j = 0; j < 12; j++)
		cr_expect_eq(bags[j], want_bags[j], "occurrence %d: bag %u", j, bags[j]);
}

/* Weights, a per-column state and a per-row state of rows that are no whole number of vectors
 * (24 floats): nothing changed, with 1 and 2 workers and every isa this CPU runs. */
Test(bench_limits, rmw_leaves_every_array_unchanged)
{
	enum { ROWS = 4096, D = 24, BAGS = 64, P = 5 };
	enum embd_isa isas[3] = { EMBD_ISA_SCALAR, EMBD_ISA_AVX2, EMBD_ISA_AVX512 };
	float *w = malloc(ROWS * D * 4), *m1 = malloc(ROWS * D * 4), *m2 = malloc(ROWS * 4);
	float *w0 = malloc(ROWS * D * 4), *m10 = malloc(ROWS * D * 4), *m20 = malloc(ROWS * 4);
	float *grad = malloc(BAGS * D * 4);
	int64_t ids[BAGS * P];
	uint64_t scratch[2 * BAGS * P], rows[BAGS * P], first[BAGS * P + 1];
	uint32_t bags[BAGS * P];
	struct embd_workers *two;
	char err[128];

	cr_assert(w && m1 && m2 && w0 && m10 && m20 && grad);
	cr_assert_eq(embd_workers_create(2, NULL, &two, err, sizeof(err)), 0, "%s", err);
	for (int i = 0; i < ROWS * D; i++)
		w[i] = m1[i] = (float)i * 0.5f - 7.0f;
	for (int i = 0; i < ROWS; i++)
		m2[i] = (float)i;
	for (int i = 0; i < BAGS * D; i++)
		grad[i] = (float)(i % 13) - 6.0f;
	for (int i = 0; i < BAGS * P; i++)
		ids[i] = (int64_t)((i * 2654435761u) % (i % 4 ? ROWS : 16)); /* some duplicates */
	memcpy(w0, w, ROWS * D * 4);
	memcpy(m10, m1, ROWS * D * 4);
	memcpy(m20, m2, ROWS * 4);
	uint64_t n = bench_rmw_rows_make(ids, BAGS * P, P, scratch, rows, first, bags);
	for (int i = 0; i < 3; i++) {
		if (!embd_kernels_isa_supported(isas[i]))
			continue;
		for (int nw = 1; nw <= 2; nw++)
			for (int order = 0; order < BENCH_RMW_ORDERS; order++) {
				struct bench_rmw r = {
					.arrays = { (uint8_t *)w, (uint8_t *)m1, (uint8_t *)m2 },
					.row_bytes = { D * 4, D * 4, 4 }, .num_arrays = 3,
					.grad = (const uint8_t *)grad, .grad_row_bytes = D * 4,
					.isa = isas[i], .rows = rows, .first = first, .bags = bags, .n = n,
					.order = (enum bench_rmw_order)order,
				};
				bench_rmw_run(nw == 2 ? two : NULL, &r);
				cr_expect(!memcmp(w, w0, ROWS * D * 4) &&
					  !memcmp(m1, m10, ROWS * D * 4) && !memcmp(m2, m20, ROWS * 4),
					  "%s, %d workers, order %d: an array changed",
					  embd_kernels_isa_name(isas[i]), nw, order);
			}
	}
	embd_workers_destroy(two);
	free(w), free(m1), free(m2), free(w0), free(m10), free(m20), free(grad);
}

/*
 * With a zero mask that keeps every bit, the walk adds what it read of the gradient to the
 * rows it writes, so each row shows how often it was written and how many gradient rows it
 * read (gradient words of 1): each word in a row's whole vectors gains its occurrences times
 * the vectors in a gradient row (a lane sums one word of each), each word past them and the
 * one-float array's word that plus the words past them (summed on their own, then added to
 * the low lane's sum); other rows nothing. D 32 is whole vectors on every isa; D 36 leaves 4
 * words past them on AVX2 and AVX-512 (and is not one of the unrolled order's widths). Many
 * chunks, so that the prefetch stream crosses from one into the next, with 1 and 2 workers,
 * and in every order of enum bench_rmw_order.
 */
Test(bench_limits, rmw_writes_each_row_once_after_reading_its_gradients)
{
	enum { ROWS = 8192, MAX_D = 36, BAGS = 600, P = 5 };
	enum embd_isa isas[3] = { EMBD_ISA_SCALAR, EMBD_ISA_AVX2, EMBD_ISA_AVX512 };
	const uint32_t dims[2] = { 32, 36 };
	uint32_t *w = calloc(ROWS * MAX_D, 4), *m1 = calloc(ROWS * MAX_D, 4), *m2 = calloc(ROWS, 4);
	uint32_t *grad = malloc(BAGS * MAX_D * 4), *times = calloc(ROWS, 4);
	int64_t ids[BAGS * P];
	uint64_t scratch[2 * BAGS * P], rows[BAGS * P], first[BAGS * P + 1];
	uint32_t bags[BAGS * P];
	struct embd_workers *two;
	char err[128];

	cr_assert(w && m1 && m2 && grad && times);
	cr_assert_eq(embd_workers_create(2, NULL, &two, err, sizeof(err)), 0, "%s", err);
	for (int i = 0; i < BAGS * MAX_D; i++)
		grad[i] = 1;
	for (int i = 0; i < BAGS * P; i++) {
		ids[i] = (int64_t)((i * 2654435761u) % (i % 3 ? ROWS : 64)); /* some duplicates */
		times[ids[i]]++;
	}
	uint64_t n = bench_rmw_rows_make(ids, BAGS * P, P, scratch, rows, first, bags);
	cr_assert_gt(n, 4 * 256, "%llu rows: too few chunks", (unsigned long long)n);
	/* the rows and their first occurrences in buffers of exactly their size, so that a row
	 * ahead read past the last one is outside (AddressSanitizer's build names it) */
	uint64_t *rows_n = malloc(n * sizeof(*rows_n)), *first_n = malloc((n + 1) * sizeof(*first_n));
	cr_assert(rows_n && first_n);
	memcpy(rows_n, rows, n * sizeof(*rows_n));
	memcpy(first_n, first, (n + 1) * sizeof(*first_n));
	for (int i = 0; i < 3; i++) {
		if (!embd_kernels_isa_supported(isas[i]))
			continue;
#if defined(__x86_64__)
		uint32_t lanes = isas[i] == EMBD_ISA_AVX512 ? 16 : isas[i] == EMBD_ISA_AVX2 ? 8 : 4;
#else
		uint32_t lanes = 1;
#endif
		for (int run = 0; run < 4 * BENCH_RMW_ORDERS; run++) {
			const int nw = 1 + run % 2, order = run / 2 % BENCH_RMW_ORDERS;
			const uint32_t D = dims[run / (2 * BENCH_RMW_ORDERS)];
			const uint32_t vecs = D / lanes, past = D - vecs * lanes; /* per row */
			struct bench_rmw r = {
				.arrays = { (uint8_t *)w, (uint8_t *)m1, (uint8_t *)m2 },
				.row_bytes = { D * 4, D * 4, 4 }, .num_arrays = 3,
				.grad = (const uint8_t *)grad, .grad_row_bytes = D * 4, .isa = isas[i],
				.rows = rows_n, .first = first_n, .bags = bags, .n = n, .zero = UINT32_MAX,
				.order = (enum bench_rmw_order)order,
			};
			memset(w, 0, ROWS * D * 4);
			memset(m1, 0, ROWS * D * 4);
			memset(m2, 0, ROWS * 4);
			bench_rmw_run(nw == 2 ? two : NULL, &r);
			int wrong = 0;
			for (uint32_t row = 0; row < ROWS && wrong < 5; row++) {
				const uint32_t want = times[row] * vecs, want_past = times[row] * (vecs + past);
				for (uint32_t c = 0; c < D; c++) {
					uint32_t want_c = c < vecs * lanes ? want : want_past;
					if (w[row * D + c] != want_c || m1[row * D + c] != want_c)
						wrong++;
				}
				if (m2[row] != want_past)
					wrong++;
				cr_expect(!wrong, "%s D %u, %d workers, order %d: row %u (%u occurrences): "
					  "%u %u %u .. %u, want %u (%u past the vectors)",
					  embd_kernels_isa_name(isas[i]), D, nw, order, row, times[row],
					  w[row * D], m1[row * D], m2[row], w[row * D + D - 1], want,
					  want_past);
			}
		}
	}
	embd_workers_destroy(two);
	free(w), free(m1), free(m2), free(grad), free(times), free(rows_n), free(first_n);
}

/*
 * The gather limit's second distance (bench_gather_other_prefetch_ids) is the one of the
 * kernels' two, 12 and 48 ids, that the kernel does not use for the row, under either vendor's
 * rules ($EMBD_CPU_VENDOR, read once a process: each test is one), so that every line's limit
 * runs both.
 */
static void check_other_distance(const char *vendor)
{
	const uint64_t bytes[] = { 32, 64, 128, 192, 256, 512, 1024, 2048 };

	cr_assert_eq(setenv("EMBD_CPU_VENDOR", vendor, 1), 0);
	for (size_t i = 0; i < sizeof(bytes) / sizeof(bytes[0]); i++)
		for (uint32_t elem = 2; elem <= 4; elem += 2) {
			const uint32_t kernel = embd_forward_prefetch_distance(bytes[i], elem);
			const uint32_t other = bench_gather_other_prefetch_ids(bytes[i], elem);

			cr_expect_eq(kernel + other, 12u + 48u, "%s: %lu bytes of %u: %u and %u",
				     vendor, (unsigned long)bytes[i], elem, kernel, other);
		}
}

Test(bench_limits, other_distance_intel)
{
	check_other_distance("intel");
}

Test(bench_limits, other_distance_other)
{
	check_other_distance("other");
}

/*
 * The gather limit stores each bag's whole pooled row (D fp32, twice the bytes of an fp16 row)
 * and nothing past the last bag's, on every isa this CPU runs and every pass width the kernels
 * use (one pass, and several over a row, the last one shorter on AVX2); a zero table pools to
 * zeros. Its ways of reading the ids (straight from the batch, and through windows of them,
 * several a chunk at P 100) and of prefetching the rows (into L2, and into L2 with a second
 * prefetch into L1 a few ids ahead), at the kernel's distance and the other one, in
 * line order or not, store the same bytes from a table of other bytes; the near ids are
 * clamped to the chunk's as the rows ahead are. The table is exactly its rows, the ids exactly
 * the batch's, and the last bag reads the last row, so that a pass reading past a row's end, or
 * an id past the batch's, reads outside them (AddressSanitizer's build names it).
 */
Test(bench_limits, gather_stores_each_pooled_row_whole)
{
	enum { ROWS = 1024, BAGS = 40, GUARD = 256 };
	enum embd_isa isas[3] = { EMBD_ISA_SCALAR, EMBD_ISA_AVX2, EMBD_ISA_AVX512 };
	const uint32_t dims[3] = { 32, 128, 256 };
	const uint32_t pfs[2] = { 3, 100 };
	uint8_t *out = aligned_alloc(64, BAGS * 256 * 4 + GUARD);
	uint8_t *out_window = aligned_alloc(64, BAGS * 256 * 4);
	struct embd_workers *two;
	char err[128];

	cr_assert(out && out_window);
	/* the rules whose near prefetch (bench_gather.prefetch_near) the limit can run, on any CPU
	 * (each test is a process of its own: the vendor is not asked yet) */
	setenv("EMBD_CPU_VENDOR", "intel", 1);
	cr_assert_eq(embd_workers_create(2, NULL, &two, err, sizeof(err)), 0, "%s", err);
	for (int i = 0; i < 3; i++) {
		if (!embd_kernels_isa_supported(isas[i]))
			continue;
		for (int c = 0; c < 3 * 2 * 2; c++) { /* every D, fp32 and fp16 rows, both P */
			const int d = c / 4, fp16 = c / 2 % 2;
			const uint32_t P = pfs[c % 2];
			int64_t *ids = malloc(BAGS * P * sizeof(*ids));
			uint64_t rb = dims[d] * (fp16 ? 2u : 4u), ob = dims[d] * 4u;
			uint8_t *table = aligned_alloc(64, ROWS * rb);
			struct bench_gather *g = calloc(1, sizeof(*g));
			cr_assert(ids && table && g);
			for (uint32_t j = 0; j < BAGS * P; j++)
				ids[j] = (int64_t)((j * 2654435761u) % ROWS);
			ids[BAGS * P - 1] = ROWS - 1;
			uint64_t pass = embd_forward_pass_cols(isas[i], dims[d], fp16 ? 2u : 4u) *
					(fp16 ? 2u : 4u);
			*g = (struct bench_gather){
				.table = table, .row_bytes = rb, .pass_bytes = pass, .out = out,
				.out_row_bytes = ob, .ids_per_out = P, .isa = isas[i], .ids = ids,
				.n = BAGS * P,
			};
			/* the near way is one of these rows' on AVX2 and AVX-512 (Intel rules,
			 * below), in one pass or several */
			if (isas[i] != EMBD_ISA_SCALAR && fp16 && dims[d] >= 128)
				cr_expect_eq(bench_gather_near_ways(g), 2, "%s fp16 D %u",
					     embd_kernels_isa_name(isas[i]), dims[d]);
			/* both orders where the 256-bit walk takes a lean row, one on the others */
			if (isas[i] == EMBD_ISA_AVX512 && fp16 && dims[d] >= 128)
				cr_expect_eq(bench_gather_order_ways(g), 2, "fp16 D %u", dims[d]);
			if (isas[i] == EMBD_ISA_SCALAR || (isas[i] == EMBD_ISA_AVX512 && !fp16))
				cr_expect_eq(bench_gather_order_ways(g), 1, "%s %s D %u",
					     embd_kernels_isa_name(isas[i]), fp16 ? "fp16" : "fp32",
					     dims[d]);
			/* AVX2 takes rows of up to 512 bytes lean, in one pass or several (D 128 and
			 * fp16 D 256); fp32 D 256, 1 KiB, not */
			if (isas[i] == EMBD_ISA_AVX2)
				cr_expect_eq(bench_gather_order_ways(g), rb <= 512 ? 2 : 1,
					     "avx2 %s D %u", fp16 ? "fp16" : "fp32", dims[d]);
			const uint32_t other = bench_gather_other_prefetch_ids(rb, fp16 ? 2u : 4u);
			/* windowed or not, near prefetch or not, the kernel's distance or the other
			 * one, in line order or not */
			for (int way = 0; way < 16; way++) {
				const int windowed = way & 1, near = way >> 1 & 1;
				memset(table, 0, ROWS * rb);
				memset(out, 0x5a, BAGS * ob + GUARD);
				g->windowed = windowed;
				g->prefetch_near = near;
				g->prefetch_ids = way >> 2 & 1 ? other : 0;
				g->in_line_order = way >> 3 & 1;
				bench_gather_run(two, g);
				uint64_t bad = 0, past = 0;
				for (uint64_t j = 0; j < BAGS * ob; j++)
					bad += out[j] != 0;
				for (uint64_t j = BAGS * ob; j < BAGS * ob + GUARD; j++)
					past += out[j] != 0x5a;
				cr_expect(!bad && !past,
					  "%s D %u %s P %u%s%s: %llu pooled bytes not stored, "
					  "%llu stored past the last row (way %d)",
					  embd_kernels_isa_name(isas[i]), dims[d],
					  fp16 ? "fp16" : "fp32", P, windowed ? " windowed" : "",
					  near ? " near" : "", (unsigned long long)bad,
					  (unsigned long long)past, way);
			}
			for (uint64_t j = 0; j < ROWS * rb; j++)
				table[j] = (uint8_t)(j * 131 + j / rb);
			g->windowed = 0;
			g->prefetch_near = false;
			g->prefetch_ids = 0;
			g->in_line_order = false;
			bench_gather_run(two, g);
			memcpy(out_window, out, BAGS * ob);
			for (int way = 1; way < 16; way++) {
				g->windowed = way & 1;
				g->prefetch_near = way >> 1 & 1;
				g->prefetch_ids = way >> 2 & 1 ? other : 0;
				g->in_line_order = way >> 3 & 1;
				bench_gather_run(two, g);
				cr_expect(memcmp(out, out_window, BAGS * ob) == 0,
					  "%s D %u %s P %u: way %d stored other sums than the first",
					  embd_kernels_isa_name(isas[i]), dims[d],
					  fp16 ? "fp16" : "fp32", P, way);
			}
			free(g);
			free(table);
			free(ids);
		}
	}
	embd_workers_destroy(two);
	free(out_window);
	free(out);
}
