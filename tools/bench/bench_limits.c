/*
 * The memory limits of `embd-bench kernels`: what the memory system allows for the kernels'
 * own access patterns, measured with the kernels' own tricks and none of their work.
 *
 * gather (forward): the rows of a batch's ids, in batch order, each read once with the vector
 *   loads of the kernel's isa (64 bytes for avx512, fp32 in two 32-byte loads as the kernel
 *   makes them, whole in its passes of 1 KiB: embd_load_fp32_pass; 32 for avx2, 16 for scalar,
 *   which the compiler vectorizes with SSE2; fp16 rows 32 bytes on avx512 and avx2: the AVX-512
 *   kernel loads 16 halves at a time, and 64-byte loads made the limit slower than that kernel,
 *   which read fp16 D 64 P 20 and 100 at 1.07-1.19 of it (Zen 4, 2026-12-05: limit 16.2-17.5
 *   GB/s, 22.1-22.4 with 32-byte loads); fp32 rows come in halves joined in a register as that
 *   kernel joins them: against 32-byte loads into 256-bit accumulators it read D 64 P 20 at
 *   1.10-1.12; on AVX2 16-byte loads of fp16 made this limit slower (Zen 4), D 256 P 20
 *   25.3-26.3 against 28.6-29.3 GB/s, and the kernel's lean loop loads 32 bytes too in rows
 *   of one pass since that made it faster, 16 in rows of several passes and its checked loop
 *   (with 32-byte loads the checked loop read 7-13% less of this limit, and the lean passes over
 *   fp16 D 128 and 256 took 6-11% longer at P 100 on an Intel Xeon)), in the
 *   kernel's passes over each bag (embd_forward_pass_cols: as many columns as its accumulators
 *   in registers hold), fully unrolled per pass width, the head of each pass's columns of the
 *   row embd_forward_prefetch_distance() ids ahead (bench_gather.prefetch_ids; the benchmarks
 *   also run the other distance, bench_gather_other_prefetch_ids, and take the faster: the
 *   kernel's loop issues more per line than this one, and on an Intel Xeon 48 ids ahead took
 *   fp16 D 128 P 20's kernel from 17.2 to 18.4 GB/s and this limit from 19.1 to 17.8,
 *   docs/benchmarks.md) prefetched as the kernel does (embd_prefetch_row_bytes: for one pass
 *   over a row that beat prefetching all of it at every size; for rows the kernels' lean loop
 *   takes, one line at a time after the load that starts the same line (the kernel's second
 *   prefetch of fp16 rows of 256 and 512 bytes into L1 a few ids ahead,
 *   embd_forward_prefetch_l1_near, is run both ways, bench_gather.prefetch_near, and the faster
 *   taken, as which is faster changes with the hour: on an Intel Xeon it made this loop slower
 *   on 2026-12-06, fp16 D 256 P 100 5.87-6.09 ms a batch against 5.50-5.73, D 128 P 100
 *   2.88-3.15 against 2.76-2.90, and ~5% faster at D 128 and 256 P 100 on 2026-12-07; the limit
 *   without it had the kernel's fp16 D 128 P 100 at 1.032 of it in the median of ten
 *   (2026-12-06), docs/benchmarks.md), with the row's size a constant as it is in that loop,
 *   and the ids read one of two ways: straight from the batch, the id ahead without a clamp but
 *   in the chunk's last bags, where it is clamped to the chunk (a clamp on every id was a cost
 *   the kernel does not have; the last bags' compare and move, on the 2-3% of ids whose row
 *   ahead would pass the chunk's end, are a fraction of a percent of the limit's instructions),
 *   or as the kernel reads them, from a window of up to 1024 of them (whole bags) copied first,
 *   padded with the rows ahead, clamped to the chunk's last id (the copy a memcpy, the pad a
 *   loop of its own: as one loop with the clamp in it the copy compiled to ten scalar
 *   instructions an id, where the kernel's is vector moves, and the kernel read fp32 D 64 P 20
 *   and 100 at 1.01-1.035 of the limit; Intel Xeon, 2026-12-06, docs/benchmarks.md). Which is
 *   faster depends on the row (Zen 4, AVX-512, 2026-12-05: the window's fp32 D 64 P 20 limit
 *   432-435 us a batch against 438-479 straight, where the kernel, its ids' cache misses out of
 *   its loop, had read 1.05-1.07 of the straight one; D 32 P 20 241-263 against 226-246), so
 *   the benchmarks run both and take the faster), chunks of ids grabbed from one counter by the
 *   same workers; and after each pass over a bag its share of the pooled row (D fp32) stored,
 *   unrolled from registers as the kernel stores it (at P = 1 that write is as much traffic as
 *   the reads). It checks no id, multiplies by no weight and keeps no per-column sums: the
 *   loads feed integer adds into four rotating accumulators (one cycle, no denormal assists on
 *   fp16 bits, no chain that holds back the loads of later rows; in the 512-bit walk, AVX-512's
 *   fp32 rows, held in the row's line order, as the kernel's FMAs are: gather_add_in_order512).
 *   So it does what the kernel must do to move the same bytes in the same order, with the same
 *   prefetches (but the kernel's of the per-id weights, LEAN_WEIGHTS_AHEAD: it reads no
 *   weights, which made it no faster, docs/benchmarks.md), and nothing else; a kernel can only
 *   approach it, provided the limit's own loop costs no more than the kernel's: hence the
 *   unrolled stores from registers (with accumulators spilled to the stack for a store loop of
 *   run-time length, P = 1 rows paid a spill and a reload each, and the kernel read up to 1.14
 *   times its limit there; docs/benchmarks.md).
 * read-modify-write (backward): every distinct row of a batch, in ascending order (the order
 *   the kernel's sort produces, the kindest to DRAM pages and the TLB), read and written back
 *   once in the weights and in each optimizer state array, every array's row prefetched as the
 *   kernel prefetches it into L2 (embd_prefetch_bytes; the kernel's second prefetch into L1,
 *   adagrad's and adam's, embd_backward_prefetch_l1_near, is left out: it made this walk
 *   slower over adagrad's rows on an Intel Xeon, docs/benchmarks.md; not tried on the Zen 4),
 *   embd_backward_prefetch_distance() rows ahead (before the row's gradient reads, or after
 *   them as the kernel orders them, and after them with the gradient loads unrolled and the
 *   arrays of under a line a row written first:
 *   enum bench_rmw_order. Which is fastest depends on the isa and the optimizer, so the
 *   benchmarks run each and take the one whose median run is the shortest; rowwise_adagrad D
 *   128 P 20 on a Zen 4, 2026-12-05: AVX-512 1.41 ms a batch after against 1.52 before, where
 *   the kernel had read 1.04-1.11 times the limit placed before, and 1.03-1.41 unrolled against
 *   1.35-1.56 (the kernel at 1.0 of the second); AVX2 1.43 after against 1.20 before, and
 *   unrolled 17-22% slower); and before a row is written, the gradient row (D fp32) of the bag
 *   of each of its occurrences read, which any exact update must do: a row's gradient is the
 *   sum of its occurrences' bag gradients. In row order these reads land at random in the
 *   batch's gradient (L2 and L3 hits, as many as there are ids); the one order that would read
 *   them in sequence, rows by their first occurrence, puts the rows at random instead and
 *   measured slower as a whole (D 128 P 20, 2026-12-03: sgd 2.88 against 2.74 ms a batch, adam
 *   7.99 against 6.04). The gradient rows are not prefetched (nor are they by the kernel):
 *   prefetching them made this loop 5-10% slower, and so did a stream of one entry per
 *   occurrence, gradient row included, running on into the next chunk (AVX-512 7-25% slower,
 *   AVX2 mixed). It leaves out the kernel's reading of ids, the grouping of occurrences and all
 *   arithmetic. Each chunk of rows is walked by one function of the isa's width, the row code
 *   inlined and the batch's pointers and sizes in a local, as the kernel's row loop has them:
 *   with a call per row into the isa's row function, which read them again through the
 *   bench_rmw pointer after every store (a store through a byte pointer may alias it) and
 *   cleared the upper vector state on return, the limit took 16-69% longer per batch on AVX2
 *   (7-15% on AVX-512), and the AVX2 kernel read up to 1.23 times it (docs/benchmarks.md).
 * Stored values are unchanged (an opaque zero is added), so the limits run on the kernels' own
 * shards: same pages, same huge-page backing, same placement.
 */
#include "bench_limits.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"

#define RMW_CHUNK_ROWS 256

/* ---- gather ------------------------------------------------------------------------------ */

#if defined(__x86_64__)
/*
 * The bags [b0, b1) (P ids each), each in passes of nvec vectors over its rows' columns and,
 * where the row is not a whole number of passes, a last pass of nlast vectors: for each id,
 * the same columns of the row dist ids ahead prefetched (their first pf bytes, within the
 * chunk and the pass), then the loads; each pass stores its share of the bag's pooled row
 * (out_mul vectors per vector read: 2 for fp16 rows, whose pooled row is fp32). nvec, nlast
 * and out_mul are constant per call site, so the loads and the stores unroll and the four
 * accumulators stay in registers, as the kernel's do (a store loop of run-time length kept
 * them on the stack: a reload and a spill per pass that the kernel does not have, at P = 1
 * one per row).
 */
#define GATHER_BAGS(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, ROW_BYTES)                         \
	const uint8_t *t = g->table;                                                              \
	/* a lean row of one pass: a constant where nvec is one, as the kernel's row size is; of  \
	 * several, ROW_BYTES (0 for rows of one pass), a constant at the benchmarks' sizes */    \
	uint64_t rb = (ROW_BYTES) ? (uint64_t)(ROW_BYTES)                                         \
		      : lean      ? (uint64_t)nvec * VBYTES                                       \
				  : g->row_bytes;                                                 \
	uint64_t P = g->ids_per_out, n = (b1 - b0) * P;                                           \
	uint64_t pass = (uint64_t)nvec * VBYTES, out_pass = pass * out_mul;                       \
	uint64_t pf = pb < pass ? pb : pass;                                                      \
	const int64_t *ids = g->ids + b0 * P;                                                     \
	for (uint64_t k = 0; k < n && k < dist; k++)                                              \
		embd_prefetch_bytes(t + (uint64_t)ids[k] * rb, pb);                               \
	if (lean && g->windowed && P <= EMBD_LEAN_WINDOW_IDS) {                                   \
		/* windows of whole bags, as the kernel's lean loop reads them (where:            \
		 * bench_gather_ways) */                                                          \
		uint64_t win[EMBD_LEAN_WINDOW_IDS + EMBD_LEAN_WINDOW_PAD];                        \
		const uint64_t per_win = EMBD_LEAN_WINDOW_IDS / P;                                \
		for (uint64_t w0 = 0; w0 < b1 - b0; w0 += per_win) {                              \
			const uint64_t w1 = b1 - b0 - w0 < per_win ? b1 - b0 : w0 + per_win;      \
			/* the ids in vector moves, as the kernel's copy, then the pad */         \
			const uint64_t fill = (w1 - w0) * P + dist, in = n - w0 * P;              \
			const uint64_t copied = in < fill ? in : fill;                            \
			memcpy(win, ids + w0 * P, copied * sizeof(win[0]));                       \
			for (uint64_t i = copied; i < fill; i++)                                  \
				win[i] = (uint64_t)ids[n - 1];                                    \
			for (uint64_t b = w0; b < w1; b++)                                        \
				GATHER_BAG(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, win,        \
					   w0 * P, 0)                                             \
		}                                                                                 \
	} else {                                                                                  \
		/* only the chunk's last bags clamp the row ahead to the chunk */                 \
		uint64_t unclamped = lean && n >= dist ? (n - dist) / P : 0;                      \
		for (uint64_t b = 0; b < unclamped; b++)                                          \
			GATHER_BAG(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, ids, 0, 0)          \
		for (uint64_t b = unclamped; b < b1 - b0; b++)                                    \
			GATHER_BAG(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, ids, 0, 1)          \
	}                                                                                         \
	VSTORE(sink, VLOAD((const void *)(g->out + b0 * g->out_row_bytes), nvec));

/* GATHER_BAGS' bag b, id k read from SRC[k - BASE], each row ahead's clamped to the chunk's
 * last id when CLAMP */
#define GATHER_BAG(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, SRC, BASE, CLAMP)                   \
	{                                                                                         \
		uint8_t *out = g->out + (b0 + b) * g->out_row_bytes;                              \
		for (uint64_t from = 0; from < rb; from += pass, out += out_pass) {               \
			if (from + pass <= rb)                                                    \
				GATHER_PASS(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, SRC, BASE, \
					    CLAMP, nvec)                                          \
			else                                                                      \
				GATHER_PASS(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, SRC, BASE, \
					    CLAMP, nlast)                                         \
		}                                                                                 \
	}

/* GATHER_BAG's pass over columns [from, + N vectors) of the bag's rows, the row ahead's id
 * read from SRC too in the lean loop (a window is padded past the bags it holds), which
 * prefetches the pass's lines of that row */
#define GATHER_PASS(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE, SRC, BASE, CLAMP, N)               \
	{                                                                                         \
		const uint64_t pf_pass = pf < (uint64_t)(N) * VBYTES ? pf : (uint64_t)(N) * VBYTES; \
		VTYPE acc[4] = { VZERO, VZERO, VZERO, VZERO };                                    \
		for (uint64_t k = b * P; k < (b + 1) * P; k++) {                                  \
			const uint8_t *ahead = t;                                                 \
			if (lean)                                                                 \
				ahead += (uint64_t)SRC[!(CLAMP) || k + dist < n                   \
							       ? k - (BASE) + dist                \
							       : n - 1 - (BASE)] * rb + from;     \
			else if (k + dist < n)                                                    \
				embd_prefetch_bytes(t + (uint64_t)ids[k + dist] * rb + from, pf_pass); \
			const uint8_t *row = t + (uint64_t)SRC[k - (BASE)] * rb + from;           \
			/* lean 2: the row a few ids ahead too, into L1 (NEAR <= dist) */         \
			const uint8_t *near = t;                                                  \
			if (lean == 2)                                                            \
				near += (uint64_t)SRC[!(CLAMP) || k + EMBD_PREFETCH_IDS_NEAR < n  \
							      ? k - (BASE) + EMBD_PREFETCH_IDS_NEAR \
							      : n - 1 - (BASE)] * rb + from;      \
			_Pragma("GCC unroll 64") for (uint32_t v = 0; v < (N); v++) {             \
				acc[v & 3] = VADD(acc[v & 3], VLOAD((const void *)(row + (uint64_t)v * VBYTES), N)); \
				if (lean == 2 && (v * VBYTES) % 64 == 0)                          \
					embd_prefetch_line_l1(near + (uint64_t)v * VBYTES);       \
				if (lean && (v * VBYTES) % 64 == 0)                               \
					embd_prefetch_line(ahead + (uint64_t)v * VBYTES);         \
			}                                                                         \
		}                                                                                 \
		_Pragma("GCC unroll 64") for (uint32_t v = 0; v < (N) * out_mul; v++)             \
			VSTORE(out + (uint64_t)v * VBYTES, acc[v & 3]);                           \
	}

/*
 * The AVX-512 walk's add: as the kernel's FMAs chain into their accumulators, each of a row's
 * loads feeds its own add in the row's line order, each line's prefetch after its load. Left to
 * itself, GCC regroups the integer adds (they associate) and schedules all of a row's
 * prefetches first, then its loads out of line order; the kernel, whose float adds it cannot
 * regroup, read fp32 D 256 at 1.00-1.02 of that loop. An empty asm on each sum holds the
 * kernel's order (read in the machine code: each line's prefetch after its load; a non-volatile
 * asm was not tried; tests/unit/bench/check_load_order.sh checks the order): on an Intel Xeon
 * the limit took 0.4-4% less time a batch at fp32 D 64 and 2-8% at D 256, D 32 and 128 within
 * 2% either way (2026-12-07, docs/benchmarks.md). The 256-bit walk (AVX2's, and fp16 rows' on
 * AVX-512) runs its lean loop both ways (bench_gather.in_line_order, gather_add_in_order256):
 * held to the kernel's order, AVX2 fp32 D 64 P 20's limit and fp16 D 256's took longer, fp16
 * D 128 P 100's less.
 */
__attribute__((target("avx512f"), always_inline)) static inline __m512i
gather_add_in_order512(__m512i acc, __m512i x)
{
	acc = _mm512_add_epi32(acc, x);
	__asm__ volatile("" : "+v"(acc));
	return acc;
}

/* gather_add_in_order512 of the 256-bit walk, where bench_gather.in_line_order */
__attribute__((target("avx2"), always_inline)) static inline __m256i
gather_add_in_order256(__m256i acc, __m256i x)
{
	acc = _mm256_add_epi32(acc, x);
	__asm__ volatile("" : "+x"(acc));
	return acc;
}

#define LOAD512(p) _mm512_loadu_si512(p)
/* a vector of a pass of n vectors, as the kernels read it: AVX-512 fp32 rows in
 * embd_load_fp32_pass's loads (the AVX-512 walk reads only fp32 rows), the others whole */
#define GATHER_LOAD512(p, n) _mm512_castps_si512(embd_load_fp32_pass(p, n))
#define GATHER_LOAD256(p, n) LOAD256(p)
#define GATHER_LOAD128(p, n) LOAD128(p)
#define STORE512(s, x) _mm512_storeu_si512((void *)(s), x)
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE256(s, x) _mm256_storeu_si256((__m256i *)(s), x)
#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE128(s, x) _mm_storeu_si128((__m128i *)(s), x)

#define GATHER_ARGS                                                                               \
	const struct bench_gather *g, uint64_t b0, uint64_t b1, uint64_t pb, uint32_t dist,       \
	uint64_t *sink

/* the bag loops' lean mode (kernels/cpu_kernels.c), lean 1 and 2: the row's lines are
 * prefetched into L2 one after each load that starts a line, dist ids ahead, clamped to the
 * chunk, in one pass over the row or, in the 256-bit walk (bags_256_several: AVX2's fp16 rows
 * of 256-512 bytes and fp32 rows of 320-512), several of whole lines, each prefetching its own
 * lines of the row ahead; lean 2 also prefetches the row EMBD_PREFETCH_IDS_NEAR ids ahead into
 * L1, where bench_gather.prefetch_near */
#define GATHER_LEAN_ARGS                                                                          \
	const uint32_t nvec, const uint32_t nlast, const uint32_t out_mul, const int lean

__attribute__((target("avx512f"), always_inline)) static inline void
bags_512(GATHER_ARGS, GATHER_LEAN_ARGS)
{
	GATHER_BAGS(__m512i, 64, _mm512_setzero_si512(), GATHER_LOAD512, gather_add_in_order512,
		    STORE512, 0)
}

__attribute__((target("avx2"), always_inline)) static inline void
bags_256(GATHER_ARGS, GATHER_LEAN_ARGS)
{
	GATHER_BAGS(__m256i, 32, _mm256_setzero_si256(), GATHER_LOAD256, _mm256_add_epi32, STORE256,
		    0)
}

__attribute__((target("avx2"), always_inline)) static inline void
bags_256_in_order(GATHER_ARGS, GATHER_LEAN_ARGS)
{
	GATHER_BAGS(__m256i, 32, _mm256_setzero_si256(), GATHER_LOAD256, gather_add_in_order256,
		    STORE256, 0)
}

/* a lean row of several passes (lean 1 or 2) with the row's size row_bytes */
__attribute__((target("avx2"), always_inline)) static inline void
bags_256_several(GATHER_ARGS, GATHER_LEAN_ARGS, const uint64_t row_bytes)
{
	GATHER_BAGS(__m256i, 32, _mm256_setzero_si256(), GATHER_LOAD256, _mm256_add_epi32, STORE256,
		    row_bytes)
}

__attribute__((target("avx2"), always_inline)) static inline void
bags_256_several_in_order(GATHER_ARGS, GATHER_LEAN_ARGS, const uint64_t row_bytes)
{
	GATHER_BAGS(__m256i, 32, _mm256_setzero_si256(), GATHER_LOAD256, gather_add_in_order256,
		    STORE256, row_bytes)
}

static inline __attribute__((always_inline)) void bags_128(GATHER_ARGS, GATHER_LEAN_ARGS)
{
	GATHER_BAGS(__m128i, 16, _mm_setzero_si128(), GATHER_LOAD128, _mm_add_epi32, STORE128, 0)
}

/* Constant vector counts for passes of 64 bytes to 1 KiB (with the last pass of AVX2's
 * 96-column passes over D 128 and 256 rows) and pooled rows of the rows' size (fp32) or twice
 * it (fp16); others take the rolled loops. */
#define PASS_ARGS g, b0, b1, pb, dist, sink
#define PASS_CASES(FN, VBYTES, OUT_MUL, LEAN)                                                     \
	if (last == 0) {                                                                          \
		switch (pass) {                                                                   \
		case 64: FN(PASS_ARGS, 64 / VBYTES, 0, OUT_MUL, LEAN); break;                     \
		case 128: FN(PASS_ARGS, 128 / VBYTES, 0, OUT_MUL, LEAN); break;                   \
		case 192: FN(PASS_ARGS, 192 / VBYTES, 0, OUT_MUL, LEAN); break;                   \
		case 256: FN(PASS_ARGS, 256 / VBYTES, 0, OUT_MUL, LEAN); break;                   \
		case 384: FN(PASS_ARGS, 384 / VBYTES, 0, OUT_MUL, LEAN); break;                   \
		case 512: FN(PASS_ARGS, 512 / VBYTES, 0, OUT_MUL, LEAN); break;                   \
		case 1024: FN(PASS_ARGS, 1024 / VBYTES, 0, OUT_MUL, LEAN); break;                 \
		default: FN(PASS_ARGS, (uint32_t)(pass / VBYTES), 0, OUT_MUL, LEAN); break;       \
		}                                                                                 \
	} else if (pass == 192 && last == 64) {                                                   \
		FN(PASS_ARGS, 192 / VBYTES, 64 / VBYTES, OUT_MUL, LEAN);                          \
	} else if (pass == 192 && last == 128) {                                                  \
		FN(PASS_ARGS, 192 / VBYTES, 128 / VBYTES, OUT_MUL, LEAN);                         \
	} else if (pass == 384 && last == 128) {                                                  \
		FN(PASS_ARGS, 384 / VBYTES, 128 / VBYTES, OUT_MUL, LEAN);                         \
	} else if (pass == 384 && last == 256) {                                                  \
		FN(PASS_ARGS, 384 / VBYTES, 256 / VBYTES, OUT_MUL, LEAN);                         \
	} else {                                                                                  \
		FN(PASS_ARGS, (uint32_t)(pass / VBYTES), (uint32_t)(last / VBYTES), OUT_MUL, LEAN); \
	}
/* the lean loop into L2 (lean 1) or no lean loop (0); the loops into L1 too are
 * bags_near_256's and bags_near_256_in_order's */
#define PASS_LEAN(FN, VBYTES, OUT_MUL)                                                            \
	if (lean)                                                                                 \
		PASS_CASES(FN, VBYTES, OUT_MUL, 1)                                                \
	else                                                                                      \
		PASS_CASES(FN, VBYTES, OUT_MUL, 0)
/* the lean loop alone over rows of one pass (lean 1; rows of several take PASS_SEVERAL): a row
 * of at most 512 bytes (embd_forward_lean), so no last pass and no 1 KiB case */
#define PASS_LEAN_ONLY(FN, VBYTES, OUT_MUL)                                                       \
	switch (pass) {                                                                           \
	case 64: FN(PASS_ARGS, 64 / VBYTES, 0, OUT_MUL, 1); break;                                \
	case 128: FN(PASS_ARGS, 128 / VBYTES, 0, OUT_MUL, 1); break;                              \
	case 192: FN(PASS_ARGS, 192 / VBYTES, 0, OUT_MUL, 1); break;                              \
	case 256: FN(PASS_ARGS, 256 / VBYTES, 0, OUT_MUL, 1); break;                              \
	case 384: FN(PASS_ARGS, 384 / VBYTES, 0, OUT_MUL, 1); break;                              \
	case 512: FN(PASS_ARGS, 512 / VBYTES, 0, OUT_MUL, 1); break;                              \
	default: FN(PASS_ARGS, (uint32_t)(pass / VBYTES), 0, OUT_MUL, 1); break;                  \
	}
/* lean rows of several passes (lean LEAN) of the benchmarks (D 128 and 256: fp16 in passes of
 * 192 bytes, fp32 of 256) with constant sizes, others at run time */
#define PASS_SEVERAL_AS(FN, VBYTES, OUT_MUL, LEAN)                                                \
	if (g->row_bytes == 256 && pass == 192 && last == 64)                                     \
		FN(PASS_ARGS, 192 / VBYTES, 64 / VBYTES, OUT_MUL, LEAN, 256);                     \
	else if (g->row_bytes == 512 && pass == 192 && last == 128)                               \
		FN(PASS_ARGS, 192 / VBYTES, 128 / VBYTES, OUT_MUL, LEAN, 512);                    \
	else if (g->row_bytes == 512 && pass == 256 && last == 0)                                 \
		FN(PASS_ARGS, 256 / VBYTES, 0, OUT_MUL, LEAN, 512);                               \
	else                                                                                      \
		FN(PASS_ARGS, (uint32_t)(pass / VBYTES), (uint32_t)(last / VBYTES), OUT_MUL,      \
		   LEAN, g->row_bytes);
#define PASS_SEVERAL(FN, VBYTES, OUT_MUL) PASS_SEVERAL_AS(FN, VBYTES, OUT_MUL, 1)
#define PASS_SEVERAL_NEAR(FN, VBYTES, OUT_MUL) PASS_SEVERAL_AS(FN, VBYTES, OUT_MUL, 2)
#define PASS_SWITCH_BY(FN, VBYTES, BY)                                                            \
	if (g->out_row_bytes == g->row_bytes)                                                     \
		BY(FN, VBYTES, 1)                                                                 \
	else if (g->out_row_bytes == 2 * g->row_bytes)                                            \
		BY(FN, VBYTES, 2)                                                                 \
	else                                                                                      \
		BY(FN, VBYTES, (uint32_t)(g->out_row_bytes / g->row_bytes))
#define PASS_SWITCH(FN, VBYTES) PASS_SWITCH_BY(FN, VBYTES, PASS_LEAN)

/* Each isa's walks are out of line (noinline) so that tests/unit/kernels/check_prefetch.sh
 * finds their prefetch instructions by name, as it finds the kernels', and those in the
 * kernel's load order are apart from gcc's so that tests/unit/bench/check_load_order.sh finds
 * their loads (bags_any_512, bags_lean_256_in_order, bags_near_256_in_order). */
__attribute__((target("avx512f"), noinline)) static void
bags_any_512(GATHER_ARGS, uint64_t pass, uint64_t last, int lean)
{
	PASS_SWITCH(bags_512, 64)
}

__attribute__((target("avx2"), noinline)) static void
bags_any_256(GATHER_ARGS, uint64_t pass, uint64_t last, int lean)
{
	if (lean && pass < g->row_bytes) {
		PASS_SWITCH_BY(bags_256_several, 32, PASS_SEVERAL)
	} else {
		PASS_SWITCH(bags_256, 32)
	}
}

/* the 256-bit walk's lean loop into L2 (lean 1) in the kernel's load order
 * (bench_gather.in_line_order) */
__attribute__((target("avx2"), noinline)) static void
bags_lean_256_in_order(GATHER_ARGS, uint64_t pass, uint64_t last)
{
	if (pass < g->row_bytes) {
		PASS_SWITCH_BY(bags_256_several_in_order, 32, PASS_SEVERAL)
	} else {
		PASS_SWITCH_BY(bags_256_in_order, 32, PASS_LEAN_ONLY)
	}
}

__attribute__((noinline)) static void
bags_any_128(GATHER_ARGS, uint64_t pass, uint64_t last, int lean)
{
	PASS_SWITCH(bags_128, 16)
}

/* lean 2: into L2, and into L1 EMBD_PREFETCH_IDS_NEAR ids ahead, fp16 rows of 256 or 512
 * bytes (embd_forward_prefetch_l1_near) in one pass (AVX-512, ONE) or several (AVX2, SEVERAL),
 * 32 bytes a load as the other fp16 walks */
#define NEAR_WALK(ONE, SEVERAL)                                                                   \
	if (pass < g->row_bytes) {                                                                \
		PASS_SWITCH_BY(SEVERAL, 32, PASS_SEVERAL_NEAR)                                    \
	} else if (pass == 256) {                                                                 \
		ONE(PASS_ARGS, 256 / 32, 0, 2, 2);                                                \
	} else {                                                                                  \
		ONE(PASS_ARGS, 512 / 32, 0, 2, 2);                                                \
	}

/* NEAR_WALK out of line on its own (as the kernel's lean_bags_near), so that check_prefetch.sh
 * finds its prefetches into L1 */
__attribute__((target("avx2"), noinline)) static void
bags_near_256(GATHER_ARGS, uint64_t pass, uint64_t last)
{
	NEAR_WALK(bags_256, bags_256_several)
}

/* bags_near_256 in the kernel's load order (bench_gather.in_line_order) */
__attribute__((target("avx2"), noinline)) static void
bags_near_256_in_order(GATHER_ARGS, uint64_t pass, uint64_t last)
{
	NEAR_WALK(bags_256_in_order, bags_256_several_in_order)
}
#endif

#if defined(__x86_64__)
/* Whether gather_bags takes the 256-bit walk: AVX2's rows, and fp16 rows (a pooled row twice
 * theirs) on AVX-512 too (the head of this file says why). */
static bool gather_walk_256(const struct bench_gather *g)
{
	return g->isa == EMBD_ISA_AVX2 ||
	       (g->isa == EMBD_ISA_AVX512 && g->out_row_bytes == 2 * g->row_bytes);
}
#endif

/* The bags [b0, b1) of the batch: the kernel's passes, prefetches and stores, no arithmetic. */
static void gather_bags(const struct bench_gather *g, uint64_t b0, uint64_t b1, uint64_t *sink)
{
	uint64_t rb = g->row_bytes, pb = embd_prefetch_row_bytes(rb);
	uint64_t pass = g->pass_bytes < rb ? g->pass_bytes : rb, last = rb % pass;
	const uint32_t elem_bytes = g->out_row_bytes == 2 * rb ? 2 : 4;
	uint32_t dist = g->prefetch_ids ? g->prefetch_ids
					: embd_forward_prefetch_distance(rb, elem_bytes);

	if (dist > EMBD_LEAN_WINDOW_PAD) /* what the window holds past its ids */
		dist = EMBD_LEAN_WINDOW_PAD;
	int lean = embd_forward_lean(g->isa, g->pass_bytes, rb, g->table);

	/* the near loop where the kernel has it (bench_gather.prefetch_near is ignored elsewhere),
	 * else the L2 loop; rows of several passes only in the 256-bit walk (the AVX-512 passes
	 * cover every lean row), the near loop's of one pass or several */
	if (lean && g->prefetch_near && dist >= EMBD_PREFETCH_IDS_NEAR &&
	    bench_gather_near_ways(g) > 1)
		lean = 2;

#if defined(__x86_64__)
	if (lean == 2 && g->in_line_order)
		bags_near_256_in_order(g, b0, b1, pb, dist, sink, pass, last);
	else if (lean == 2)
		bags_near_256(g, b0, b1, pb, dist, sink, pass, last);
	else if (gather_walk_256(g) && lean && g->in_line_order)
		bags_lean_256_in_order(g, b0, b1, pb, dist, sink, pass, last);
	else if (gather_walk_256(g))
		bags_any_256(g, b0, b1, pb, dist, sink, pass, last, lean);
	else if (g->isa == EMBD_ISA_AVX512)
		bags_any_512(g, b0, b1, pb, dist, sink, pass, last, lean);
	else
		bags_any_128(g, b0, b1, pb, dist, sink, pass, last, lean);
#else
	uint64_t P = g->ids_per_out;
	(void)pb, (void)pass, (void)last, (void)dist, (void)lean;
	for (uint64_t b = b0; b < b1; b++) {
		for (uint64_t k = b * P; k < (b + 1) * P; k++) {
			const uint64_t *row = (const uint64_t *)(g->table + (uint64_t)g->ids[k] * rb);
			for (uint64_t i = 0; i < rb / 8; i++)
				sink[i & 7] += row[i];
		}
		for (uint64_t i = 0; i < g->out_row_bytes; i += 64)
			memcpy(g->out + b * g->out_row_bytes + i, sink, 64);
	}
#endif
}

static void gather_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bench_gather *g = arg;
	uint64_t *sink = g->sink[w % BENCH_LIMIT_MAX_WORKERS];
	uint64_t bags = g->n / g->ids_per_out;
	/* chunks of bags as the kernels' (forward.c): about 1024 ids, at least 32 bags */
	uint64_t per = 1024 / g->ids_per_out > 32 ? 1024 / g->ids_per_out : 32;

	(void)nw;
	for (;;) {
		uint64_t b0 = atomic_fetch_add_explicit(&g->next, per, memory_order_relaxed);
		if (b0 >= bags)
			break;
		gather_bags(g, b0, bags - b0 < per ? bags : b0 + per, sink);
	}
}

uint32_t bench_gather_other_prefetch_ids(uint64_t row_bytes, uint32_t elem_bytes)
{
	return embd_forward_prefetch_distance(row_bytes, elem_bytes) == EMBD_PREFETCH_IDS_FAR
		       ? EMBD_PREFETCH_IDS
		       : EMBD_PREFETCH_IDS_FAR;
}

/* GATHER_BAGS' condition for its window, where the kernel's lean loop has one */
int bench_gather_ways(const struct bench_gather *g)
{
	return embd_forward_lean(g->isa, g->pass_bytes, g->row_bytes, g->table) &&
			       g->ids_per_out <= EMBD_LEAN_WINDOW_IDS
		       ? 2
		       : 1;
}

int bench_gather_near_ways(const struct bench_gather *g)
{
	const uint32_t elem_bytes = g->out_row_bytes == 2 * g->row_bytes ? 2 : 4;

	return embd_forward_lean(g->isa, g->pass_bytes, g->row_bytes, g->table) &&
			       embd_forward_prefetch_near(g->isa, g->row_bytes, elem_bytes)
		       ? 2
		       : 1;
}

int bench_gather_order_ways(const struct bench_gather *g)
{
#if defined(__x86_64__)
	return gather_walk_256(g) &&
			       embd_forward_lean(g->isa, g->pass_bytes, g->row_bytes, g->table)
		       ? 2
		       : 1;
#else
	(void)g;
	return 1;
#endif
}

void bench_gather_run(struct embd_workers *workers, struct bench_gather *g)
{
	atomic_store_explicit(&g->next, 0, memory_order_relaxed);
	embd_workers_run(workers, gather_worker, g);
}

uint64_t bench_gather_checksum(const struct bench_gather *g)
{
	uint64_t sum = 0;

	for (int w = 0; w < BENCH_LIMIT_MAX_WORKERS; w++)
		for (int i = 0; i < 8; i++)
			sum += g->sink[w][i];
	return sum;
}

/* ---- read-modify-write ------------------------------------------------------------------- */

/* (row, position) pairs, ordered by row and then by position: a stable sort by row. */
static int compare_occ(const void *a, const void *b)
{
	const uint64_t *x = a, *y = b;

	return x[0] != y[0] ? (x[0] > y[0]) - (x[0] < y[0]) : (x[1] > y[1]) - (x[1] < y[1]);
}

uint64_t bench_rmw_rows_make(const int64_t *ids, uint64_t n, uint64_t ids_per_bag,
			     uint64_t *scratch, uint64_t *rows, uint64_t *first, uint32_t *bags)
{
	uint64_t n_rows = 0;

	for (uint64_t i = 0; i < n; i++) {
		scratch[2 * i] = (uint64_t)ids[i];
		scratch[2 * i + 1] = i;
	}
	qsort(scratch, n, 2 * sizeof(*scratch), compare_occ);
	for (uint64_t i = 0; i < n; i++) {
		if (!n_rows || rows[n_rows - 1] != scratch[2 * i]) {
			first[n_rows] = i;
			rows[n_rows++] = scratch[2 * i];
		}
		bags[i] = (uint32_t)(scratch[2 * i + 1] / ids_per_bag);
	}
	first[n_rows] = n;
	return n_rows;
}

/*
 * What the walk reads of bench_rmw, copied into a local: the stores through byte pointers
 * could alias *r, so fields read through r are read again after every store; from a local
 * whose address does not escape they stay in registers, as the kernel's do.
 */
struct rmw_view {
	uint8_t *arrays[3];
	uint64_t row_bytes[3];
	int num_arrays;
	int unrolled;                   /* the gradient rows' loads unrolled */
	const uint8_t *grad;
	uint64_t grad_row_bytes;
	const uint64_t *rows, *first;
	const uint32_t *bags;
};

/* Row k's lines as the kernel prefetches them: every array's row, for writing. */
static inline __attribute__((always_inline)) void prefetch_rmw_row(const struct rmw_view *v,
								   uint64_t k)
{
	for (int a = 0; a < v->num_arrays; a++)
		embd_prefetch_bytes(v->arrays[a] + v->rows[k] * v->row_bytes[a], v->row_bytes[a]);
}

/*
 * Rows [lo, hi): row k + dist's lines prefetched, then row k's gradients read and rows
 * written; or, when after_grad, row k's gradients read, then row k + dist's lines prefetched
 * (as the kernel orders them) and row k written.
 */
#define CHUNK_BODY(ROW)                                                                           \
	for (uint64_t k = lo; k < hi && k < lo + dist; k++)                                       \
		prefetch_rmw_row(&v, k);                                                          \
	if (after_grad) {                                                                         \
		for (uint64_t k = lo; k < hi; k++)                                                \
			ROW(&v, k, k + dist < hi ? k + dist : 0, zero);                           \
	} else {                                                                                  \
		for (uint64_t k = lo; k < hi; k++) {                                              \
			if (k + dist < hi)                                                        \
				prefetch_rmw_row(&v, k + dist);                                   \
			ROW(&v, k, 0, zero);                                                      \
		}                                                                                 \
	}

#define CHUNK_ARGS                                                                                \
	const struct rmw_view v, uint64_t lo, uint64_t hi, uint32_t dist, uint32_t zero,          \
	int after_grad

#if defined(__x86_64__)
/*
 * Row k: the gradient rows of its occurrences loaded and summed (integer adds: one vector, and
 * a word for what is left past the last whole vector), row ahead's lines prefetched unless it
 * is 0, then every array's row loaded, that sum ANDed with zero added, and stored back: the
 * stores wait on the gradient loads as the kernel's do, and nothing changes.
 */
#define ROW_BODY(VTYPE, VSET1, VZERO, VLOAD, VADD, VAND, VLOW32, RMW)                             \
	const uint64_t grb = v->grad_row_bytes, gvec = grb / sizeof(VTYPE) * sizeof(VTYPE);       \
	VTYPE z = VZERO;                                                                          \
	uint32_t zt = 0;                                                                          \
	for (uint64_t j = v->first[k]; j < v->first[k + 1]; j++) {                                \
		const uint8_t *gp = v->grad + (uint64_t)v->bags[j] * grb;                         \
		GRAD_SWITCH(VTYPE, VLOAD, VADD)                                                   \
		for (uint64_t o = gvec; o < grb; o += 4)                                          \
			zt += *(const uint32_t *)(gp + o);                                        \
	}                                                                                         \
	if (ahead)                                                                                \
		prefetch_rmw_row(v, ahead);                                                       \
	z = VAND(z, VSET1((int)zero));                                                            \
	zt = (zt + (uint32_t)VLOW32(z)) & zero;                                                   \
	for (int a = 0; a < v->num_arrays; a++) {                                                 \
		const uint64_t rb = v->row_bytes[a], rvec = rb / sizeof(VTYPE) * sizeof(VTYPE);   \
		uint8_t *p = v->arrays[a] + v->rows[k] * rb;                                      \
		RMW_SWITCH(RMW)                                                                   \
		for (uint64_t o = rvec; o < rb; o += 4)                                           \
			*(uint32_t *)(p + o) += zt;                                               \
	}

/* A gradient row's vectors summed into z: in the unrolled order unrolled for rows of 128 bytes
 * to 1 KiB, otherwise (and for other widths) in a rolled loop. */
#define GRAD_SUM(VTYPE, VLOAD, VADD, N)                                                           \
	{                                                                                         \
		_Pragma("GCC unroll 64") for (uint32_t u = 0; u < (N); u++)                       \
			z = VADD(z, VLOAD((const void *)(gp + (uint64_t)u * sizeof(VTYPE))));     \
	}
#define GRAD_SWITCH(VTYPE, VLOAD, VADD)                                                           \
	switch (v->unrolled ? gvec : 0) {                                                         \
	case 128: GRAD_SUM(VTYPE, VLOAD, VADD, 128 / sizeof(VTYPE)) break;                        \
	case 256: GRAD_SUM(VTYPE, VLOAD, VADD, 256 / sizeof(VTYPE)) break;                        \
	case 512: GRAD_SUM(VTYPE, VLOAD, VADD, 512 / sizeof(VTYPE)) break;                        \
	case 1024: GRAD_SUM(VTYPE, VLOAD, VADD, 1024 / sizeof(VTYPE)) break;                      \
	default:                                                                                  \
		for (uint64_t o = 0; o < gvec; o += sizeof(VTYPE))                                \
			z = VADD(z, VLOAD((const void *)(gp + o)));                               \
	}

#define RMW_BODY(VTYPE, VBYTES, VLOAD, VADD, VSTORE)                                              \
	_Pragma("GCC unroll 64") for (uint32_t v = 0; v < nvec; v++) {                            \
		uint8_t *q = p + (uint64_t)v * VBYTES;                                            \
		VSTORE(q, VADD(VLOAD((const void *)q), z));                                       \
	}

/* Constant vector counts for rows of 64 bytes to 1 KiB; others take the rolled loop. */
#define RMW_SWITCH(FN)                                                                            \
	switch (rvec) {                                                                           \
	case 64: FN(p, z, 64 / sizeof(z)); break;                                                 \
	case 128: FN(p, z, 128 / sizeof(z)); break;                                               \
	case 256: FN(p, z, 256 / sizeof(z)); break;                                               \
	case 512: FN(p, z, 512 / sizeof(z)); break;                                               \
	case 1024: FN(p, z, 1024 / sizeof(z)); break;                                             \
	default: FN(p, z, (uint32_t)(rvec / sizeof(z))); break;                                   \
	}

__attribute__((target("avx512f"), always_inline)) static inline void
rmw_512(uint8_t *p, __m512i z, const uint32_t nvec)
{
	RMW_BODY(__m512i, 64, LOAD512, _mm512_add_epi32, STORE512)
}

__attribute__((target("avx2"), always_inline)) static inline void
rmw_256(uint8_t *p, __m256i z, const uint32_t nvec)
{
	RMW_BODY(__m256i, 32, LOAD256, _mm256_add_epi32, STORE256)
}

static inline __attribute__((always_inline)) void rmw_128(uint8_t *p, __m128i z,
							  const uint32_t nvec)
{
	RMW_BODY(__m128i, 16, LOAD128, _mm_add_epi32, STORE128)
}

#define LOW32_512(z) _mm_cvtsi128_si32(_mm512_castsi512_si128(z))
#define LOW32_256(z) _mm_cvtsi128_si32(_mm256_castsi256_si128(z))

__attribute__((target("avx512f"), always_inline)) static inline void
row_512(const struct rmw_view *v, uint64_t k, uint64_t ahead, uint32_t zero)
{
	ROW_BODY(__m512i, _mm512_set1_epi32, _mm512_setzero_si512(), LOAD512, _mm512_add_epi32,
		 _mm512_and_si512, LOW32_512, rmw_512)
}

__attribute__((target("avx2"), always_inline)) static inline void
row_256(const struct rmw_view *v, uint64_t k, uint64_t ahead, uint32_t zero)
{
	ROW_BODY(__m256i, _mm256_set1_epi32, _mm256_setzero_si256(), LOAD256, _mm256_add_epi32,
		 _mm256_and_si256, LOW32_256, rmw_256)
}

static inline __attribute__((always_inline)) void row_128(const struct rmw_view *v, uint64_t k,
							 uint64_t ahead, uint32_t zero)
{
	ROW_BODY(__m128i, _mm_set1_epi32, _mm_setzero_si128(), LOAD128, _mm_add_epi32,
		 _mm_and_si128, _mm_cvtsi128_si32, rmw_128)
}

__attribute__((target("avx512f"), noinline)) static void chunk_512(CHUNK_ARGS)
{
	CHUNK_BODY(row_512)
}

__attribute__((target("avx2"), noinline)) static void chunk_256(CHUNK_ARGS)
{
	CHUNK_BODY(row_256)
}

__attribute__((noinline)) static void chunk_128(CHUNK_ARGS)
{
	CHUNK_BODY(row_128)
}
#else
static inline void row_any(const struct rmw_view *v, uint64_t k, uint64_t ahead, uint32_t zero)
{
	uint32_t z = 0;
	for (uint64_t j = v->first[k]; j < v->first[k + 1]; j++) {
		const uint32_t *gp = (const uint32_t *)(v->grad + (uint64_t)v->bags[j] * v->grad_row_bytes);
		for (uint64_t i = 0; i < v->grad_row_bytes / 4; i++)
			z += gp[i];
	}
	if (ahead)
		prefetch_rmw_row(v, ahead);
	z &= zero;
	for (int a = 0; a < v->num_arrays; a++)
		for (uint64_t i = 0; i < v->row_bytes[a] / 4; i++)
			((uint32_t *)(v->arrays[a] + v->rows[k] * v->row_bytes[a]))[i] += z;
}

static void chunk_any(CHUNK_ARGS)
{
	CHUNK_BODY(row_any)
}
#endif

/*
 * Chunks of rows from one counter; each chunk walked by one function of the isa's width, whose
 * row loop has the view, the prefetch distance and the zero mask in registers.
 */
static void rmw_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bench_rmw *r = arg;
	const int unrolled = r->order == BENCH_RMW_GRAD_FIRST_UNROLLED;
	struct rmw_view v = { .unrolled = unrolled, .grad = r->grad,
			      .grad_row_bytes = r->grad_row_bytes, .rows = r->rows,
			      .first = r->first, .bags = r->bags };
	uint64_t bytes = 0;

	(void)w, (void)nw;
	/* in the unrolled order, arrays of under a line a row first, then the others */
	for (int narrow = unrolled; narrow >= 0; narrow--)
		for (int a = 0; a < r->num_arrays; a++)
			if (!unrolled || (r->row_bytes[a] < EMBD_CACHE_LINE_BYTES) == narrow) {
				v.arrays[v.num_arrays] = r->arrays[a];
				v.row_bytes[v.num_arrays++] = r->row_bytes[a];
				bytes += r->row_bytes[a];
			}
	const uint32_t dist = embd_backward_prefetch_distance(bytes), zero = r->zero;
	const int after_grad = r->order != BENCH_RMW_PREFETCH_FIRST;
	for (;;) {
		uint64_t lo = atomic_fetch_add_explicit(&r->next, RMW_CHUNK_ROWS, memory_order_relaxed);
		if (lo >= r->n)
			break;
		uint64_t hi = r->n - lo < RMW_CHUNK_ROWS ? r->n : lo + RMW_CHUNK_ROWS;
#if defined(__x86_64__)
		if (r->isa == EMBD_ISA_AVX512)
			chunk_512(v, lo, hi, dist, zero, after_grad);
		else if (r->isa == EMBD_ISA_AVX2)
			chunk_256(v, lo, hi, dist, zero, after_grad);
		else
			chunk_128(v, lo, hi, dist, zero, after_grad);
#else
		chunk_any(v, lo, hi, dist, zero, after_grad);
#endif
	}
}

void bench_rmw_run(struct embd_workers *workers, struct bench_rmw *r)
{
	atomic_store_explicit(&r->next, 0, memory_order_relaxed);
	embd_workers_run(workers, rmw_worker, r);
}
