/*
 * kernels/cpu_kernels.h - internal: the hot loops of the CPU kernels, one table of functions
 * per instruction set. cpu_kernels.c is compiled once per variant (scalar; AVX2; AVX-512) with
 * that variant's compiler flags, so the same source, and the same per-row arithmetic of
 * pool_row.h and optim_row.h, runs at every width; forward.c and backward.c pick a table at
 * run time (isa.c) and do everything that does not depend on it.
 */
#ifndef EMBD_KERNELS_CPU_KERNELS_H
#define EMBD_KERNELS_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/embedding.h"
#include "kernels/optim_row.h"

/* Rows of upcoming ids are prefetched this many ids ahead (a few DRAM latencies' worth); fp16
 * rows, rows of up to two lines and fp32 rows of 512 bytes, and on CPUs other than Intel's
 * every row, EMBD_PREFETCH_IDS_FAR (embd_forward_prefetch_rows). */
#define EMBD_PREFETCH_IDS 12
#define EMBD_PREFETCH_IDS_FAR 48
/* ids ahead of the forward's second prefetch, into L1 (embd_forward_prefetch_l1_near) */
#define EMBD_PREFETCH_IDS_NEAR 4
/* The lean loop's window (cpu_kernels.c): ids copied as rows and checked at a time, and the
 * rows past them that it prefetches (at most the longest prefetch distance). 8.4 KiB of
 * stack. The benchmark's gather limit reads ids through a window of the same size. */
#define EMBD_LEAN_WINDOW_IDS 1024
#define EMBD_LEAN_WINDOW_PAD EMBD_PREFETCH_IDS_FAR /* >= every prefetch distance (asserted in
						    * cpu_kernels.c) */
/* Lines of a row that are prefetched; longer rows stream on their own after the first. */
#define EMBD_PREFETCH_MAX_LINES 16
#define EMBD_CACHE_LINE_BYTES 64

/*
 * How many rows ahead the forward prefetches rows of row_bytes and elements of elem_bytes, on
 * an Intel CPU (intel) or another. On an Intel Xeon (2026-12-06) 48 ids ahead took fp16 rows of
 * every width 8-31% less time a batch at P 20 and 100 than 12 or 20 did, and fp32 rows of 128
 * bytes 17%, while fp32 rows of 256 and 1024 bytes took 3-14% more at 32-64 (a guess at why:
 * their loop issues fewer instructions a line, so the core's own loads run further ahead of
 * it). fp32 rows of 512 bytes (D 128) took 17-31% less time a batch 48 ahead than 12 at P 20
 * and 100 and 11-46% at P 1 on AVX-512, and 13-36% less at P 1 and 20 and 1-6% at P 100 on
 * AVX2 (three alternations, 2026-12-07, docs/benchmarks.md; the scalar kernels unmeasured).
 * On a Zen 4 (2026-12-07), which had kept 12 ahead (20 for rows of a line; measured when the
 * rows went to L1), 48 took fp32 D 32, fp16 D 32 and fp16 D 64 20-46% less time a batch at
 * P 20 and 100 on AVX-512 and AVX2 (medians of two or three runs a side), fp32 D 128 4-18%
 * less on AVX2 and 13% less to 3% more on AVX-512, fp16 D 128 13-25% less on AVX2 and 27% less
 * to 8% more on AVX-512 (weighted P 100 +8%), fp16 D 256 17-29% less on AVX2 (AVX-512 -1 to
 * +3%; all without the near prefetch), and fp32 D 64, kept at 12 on Intel, 0-36% less; fp32
 * D 256 (2026-12-08, medians of the pairs of ten alternations, seven at P 1;
 * docs/benchmarks.md) 3-10% less at P 20 and 100 on AVX2 (P 1 +-2%), and on AVX-512 14-25%
 * less at P 1, 4-5% less at P 20 and 3-4% more at P 100. Rows of other sizes were not measured
 * at 48 there (fp32 under 128 bytes or between the measured widths, fp16 over 512 bytes, any
 * over 1 KiB). The benchmark's gather limit runs the kernel's distance and the other one
 * (bench_gather_other_prefetch_ids), the faster taken.
 */
static inline uint32_t embd_forward_prefetch_rows(uint64_t row_bytes, uint32_t elem_bytes,
						  bool intel)
{
	if (!intel || elem_bytes == 2 || row_bytes <= 2 * EMBD_CACHE_LINE_BYTES || row_bytes == 512)
		return EMBD_PREFETCH_IDS_FAR;
	return EMBD_PREFETCH_IDS;
}

/*
 * Whether the forward's lean loop, with isa on an Intel CPU (intel) or another, also prefetches
 * into L1 each row of row_bytes (elements of elem_bytes) EMBD_PREFETCH_IDS_NEAR ids ahead,
 * besides its L2 prefetch embd_forward_prefetch_rows ahead. On an Intel Xeon (2026-12-06,
 * docs/benchmarks.md) the AVX-512 fp16 rows of 256 and 512 bytes (D 128 and 256), prefetched
 * into L2 48 ids ahead, took 3-17% less time a batch at P 20 and 100 with it; fp16 D 64 ~3%
 * less, fp16 D 32 and fp32 D 32 the same, fp32 D 64 (12 ahead) 4-17% more, and the fp16 D 256
 * rows prefetched into L1 alone, 48 ahead, 30-45% more. AVX2, which pools these rows in
 * passes of 96 columns, each pass prefetching its own lines of both rows, took 3-13% less time
 * a batch with it in most pairs at P 20 and 100 (one slow pair 32%), fp16 D 128 at P 20 6%
 * less to 2% more and at P 100 5% less to 2% more (three alternations, 2026-12-07,
 * docs/benchmarks.md). On a Zen 4 (2026-12-07, these rows 48 ahead, three alternations) AVX2
 * took 2-40% less time a batch with it in 18 of 24 pairs (medians of the pairs: six of the
 * eight lines 7-20% less, fp16 D 128 P 100 the same, fp16 D 256 P 20 13% more), while AVX-512
 * took more in 16 of 24 (medians 3-51% more on six lines, 3-6% less on two), so AVX-512 has it
 * on Intel CPUs only.
 */
static inline bool embd_forward_prefetch_l1_near(enum embd_isa isa, uint64_t row_bytes,
						 uint32_t elem_bytes, bool intel)
{
	return (isa == EMBD_ISA_AVX2 || (intel && isa == EMBD_ISA_AVX512)) && elem_bytes == 2 &&
	       (row_bytes == 256 || row_bytes == 512);
}

/*
 * How many rows ahead the backward prefetches when each row brings row_bytes of weights and
 * state, on an Intel CPU (intel) or another. Elsewhere: 96 lines in flight (EMBD_PREFETCH_IDS
 * rows of 512 bytes, the forward's distance there until 2026-12-07; not measured against the
 * forward's 48 since), so 12 rows for sgd at D 128 but 6 for
 * adagrad and 4 for adam, at least 2 (on a Zen 4, with prefetches into L1, adam's rows 12
 * ahead applied ~8% slower and adagrad's ~6%, 2026-12-03; into L2, twice the distance was
 * within +-3%, 2026-12-05). On an Intel Xeon (2026-12-06, docs/benchmarks.md) the apply of
 * sgd, adagrad and adam at D 64 and 128 and of rowwise_adagrad at D 128 took 8-34% less time
 * 32 to 96 rows ahead than at those distances, and about as little anywhere in that range:
 * 768 lines' worth, 16 to 64 rows, lies inside it for each. The benchmark's limit uses the
 * same distance.
 */
static inline uint32_t embd_backward_prefetch_rows(uint64_t row_bytes, bool intel)
{
	const uint64_t lines = (row_bytes + EMBD_CACHE_LINE_BYTES - 1) / EMBD_CACHE_LINE_BYTES;
	const uint64_t lines_wanted = intel ? 768 : EMBD_PREFETCH_IDS * (512 / EMBD_CACHE_LINE_BYTES);
	const uint64_t lo = intel ? 16 : 2, hi = intel ? 64 : EMBD_PREFETCH_IDS;
	const uint64_t rows = lines_wanted / (lines ? lines : 1);

	return (uint32_t)(rows < lo ? lo : rows > hi ? hi : rows);
}

/*
 * Whether the backward's apply also prefetches into L1 the weights and state of the row of the
 * occurrence after the next row's first (the row after the next where rows occur once),
 * besides the L2 prefetch embd_backward_prefetch_rows ahead, for optimizer type: adagrad and adam,
 * whose divisions and square roots overlap the row misses only in part. On an Intel Xeon
 * (docs/benchmarks.md) adagrad's apply read .83-.86 of its limit so at fp32 D 128 against .81-.82
 * without (AVX-512, 2026-12-06), D 64 the same; adam's, with the rows' L2 prefetches spread over
 * the row loop, .826-.860 at D 128 against .780-.803 (AVX-512) and .92-.93 at D 64 against .89-.90
 * (AVX2; medians of ten, four alternations, 2026-12-07), AVX2 at D 128 .76-.83 against .76-.81
 * (medians .818 and .783 of seven). rowwise_adagrad gained nothing from it (.01 slower on AVX-512,
 * as much faster on AVX2), nor did sgd (measured before the spread prefetches only). The
 * read-modify-write limit ran slower with it and keeps its own walk. On a Zen 4 (2026-12-08,
 * thirteen alternations, at its own distances) adagrad's and adam's applies took 3-12% less time
 * a batch with it at fp32 D 64 and 128 on AVX2 and AVX-512 (medians of the pairs, less in 9-12
 * of 13), but for AVX2 adagrad D 64 (4% more, less in 6 of 13; docs/benchmarks.md), so it is on
 * for every CPU. Only fp32 D 64 and 128 were measured: fp16 rows, other widths, the scalar
 * variant, adagrad on AVX2 on the Intel Xeon and CPUs other than these two follow by
 * extrapolation.
 */
static inline bool embd_backward_prefetch_l1_near(enum embd_optimizer_type type)
{
	return type == EMBD_OPT_ADAGRAD || type == EMBD_OPT_ADAM;
}

/*
 * Columns the forward pools per pass over a bag of rows of elem_bytes elements (4: fp32, 2:
 * fp16): as many as its accumulators in registers hold (avx512: 16 zmm x 16; avx2: 8 ymm x 8
 * for fp32 rows, 12 x 8 for fp16 rows); wider rows take several passes, the last one what is
 * left (avx2 fp16 D 128: 96 + 32). The scalar variant pools whole rows. On AVX2 the fp16 rows'
 * wider passes took D 256 P 100 from 4 passes to 3 and 17-22% less time a batch (Zen 4
 * capped to AVX2, 2026-12-05); fp32 rows read the same on the Zen 4 and slower on an Ice Lake
 * (P 20 .92 -> .84-.86 of the limit then, 2026-12-03), so they keep 64 (docs/benchmarks.md).
 */
static inline uint32_t embd_forward_pass_cols(enum embd_isa isa, uint32_t cols, uint32_t elem_bytes)
{
	uint32_t pass = isa == EMBD_ISA_AVX512 ? 256
			: isa == EMBD_ISA_AVX2 ? (elem_bytes == 2 ? 96 : 64)
					       : cols;

	return pass < cols ? pass : cols;
}

/*
 * How much of a row of row_bytes the kernels prefetch: rows up to 512 bytes whole, longer ones
 * their first quarter. The L2 streamer brings the rest of a long row once its head is read,
 * without holding one of the core's few line fill buffers per line: prefetching every line
 * of 1 KiB rows 12 rows ahead gathered 20% slower than the first 256 bytes (D 256 fp32 P 20,
 * AVX-512, paired CPU-time runs); rows of 256-512 bytes were 10-20% faster prefetched whole
 * (fp16 D 128 and 256, fp32 D 64), fp32 D 128 within 4% either way.
 */
static inline uint64_t embd_prefetch_row_bytes(uint64_t row_bytes)
{
	return row_bytes <= 512 ? row_bytes : row_bytes / 4;
}

/*
 * Whether the forward pools rows of row_bytes (pass_bytes of them per pass, from
 * embd_forward_pass_cols) at base in its lean loop (cpu_kernels.c): a vector isa, the row
 * prefetched whole and made of whole cache lines, and every pass starting on a line (one pass
 * covering the row, or passes of whole lines: AVX2's fp16 rows of 256-512 bytes and fp32 rows
 * of 320-512). The benchmark's gather limit decides the same way, to read as the kernel reads.
 * The lean loop takes its row, and each pass, to be whole vectors: whole lines of 2- or 4-byte
 * elements are.
 */
static inline bool embd_forward_lean(enum embd_isa isa, uint64_t pass_bytes, uint64_t row_bytes,
				     const void *base)
{
	return isa != EMBD_ISA_SCALAR &&
	       (pass_bytes >= row_bytes || pass_bytes % EMBD_CACHE_LINE_BYTES == 0) &&
	       embd_prefetch_row_bytes(row_bytes) == row_bytes &&
	       row_bytes % EMBD_CACHE_LINE_BYTES == 0 &&
	       (uintptr_t)base % EMBD_CACHE_LINE_BYTES == 0;
}

/*
 * Prefetches the line at p into L2 (prefetcht1): every prefetch of the kernels' rows, and of
 * the benchmark's limits, goes through here, so that they issue the same one (but the rows
 * embd_forward_prefetch_l1_near and embd_backward_prefetch_l1_near send to L1 a second time,
 * through embd_prefetch_line_l1). The
 * kernels keep many rows' lines in flight (embd_forward_prefetch_rows,
 * embd_backward_prefetch_rows), more than the L1's miss buffers hold, and prefetches into L1
 * waited for them: perf put 13% of adam D 128's apply samples right after a row's first
 * prefetcht0. Into L2, on the Zen 4 (2026-12-05, docs/benchmarks.md): the backward took 15-28%
 * less time a batch (sgd D 64 to adam D 128, P 20, AVX-512) and 9-15% with AVX2; the forward
 * 10-27% less at D 32-128 (AVX-512; D 256 the same) and 24-37% with AVX2. The limits, which
 * prefetch the same way, sped up as much or more. Without -mprfchw GCC emits prefetcht0 for a
 * write hint, and prefetchw measured no better.
 */
static inline __attribute__((always_inline)) void embd_prefetch_line(const void *p)
{
	__builtin_prefetch(p, 0, 2);
}

/* The line at p into L1 (prefetcht0): the forward's and the backward's near rows where
 * embd_forward_prefetch_l1_near() and embd_backward_prefetch_l1_near() say so (the gather
 * limit runs the forward's as one of its ways, bench_gather.prefetch_near; the
 * read-modify-write limit has none); the AVX-512 lean loop's per-id weights beside fp32 rows of
 * up to 128 bytes (LEAN_WEIGHTS_AHEAD in cpu_kernels.c; the limit reads no weights). */
static inline __attribute__((always_inline)) void embd_prefetch_line_l1(const void *p)
{
	__builtin_prefetch(p, 0, 3);
}

/*
 * embd_prefetch_line (or, where l1, embd_prefetch_line_l1) for each line of [p, p + bytes), at
 * most EMBD_PREFETCH_MAX_LINES. A function that does nothing but prefetch must be always_inline,
 * as this one and the one below are: a prefetch writes no memory, so GCC 12 judges such a
 * function pure or const and deletes the calls whose result goes unused, prefetches and all
 * (objdump shows none left).
 */
static inline __attribute__((always_inline)) void embd_prefetch_lines(const void *p, uint64_t bytes,
								      bool l1)
{
	uintptr_t line = (uintptr_t)p & ~(uintptr_t)(EMBD_CACHE_LINE_BYTES - 1);
	uintptr_t end = (uintptr_t)p + bytes;

/* nvcc (cuda_internal.cuh includes this) knows no GCC pragmas, and gcc warns that it
 * ignores the annotation when it does not optimise (the sanitizer build) */
#if !defined(__CUDACC__) && defined(__OPTIMIZE__)
#pragma GCC unroll 16
#endif
	for (int i = 0; i < EMBD_PREFETCH_MAX_LINES && line < end; i++, line += EMBD_CACHE_LINE_BYTES) {
		if (l1)
			embd_prefetch_line_l1((const void *)line);
		else
			embd_prefetch_line((const void *)line);
	}
}

/* [p, p + bytes) into L2: every row prefetch but the L1 ones. */
static inline __attribute__((always_inline)) void embd_prefetch_bytes(const void *p, uint64_t bytes)
{
	embd_prefetch_lines(p, bytes, false);
}

/*
 * One occurrence of a row in a backward step, after its id was checked, as the backward's
 * prepare sorts it: the shard-local row above embd_bwd_rows.idx_bits bits that name the rest
 * of what applying it needs: its bag (embd_bwd_rows.bags), or where ids carry weights its
 * place among the call's ids (embd_bwd_rows.side). The sort's passes move these 8 bytes, not
 * the 16 of the row, bag and coefficient together: at the training step's batches (sgd D 64,
 * B 4096 P 20, one worker) the sort took 30% less time (Intel Xeon, 2026-12-06,
 * docs/benchmarks.md).
 */
typedef uint64_t embd_occ_key;

/* What applying an occurrence of weighted ids needs besides its row. */
struct embd_occ_side {
	uint32_t bag;                   /* index into embd_bwd_rows.bags */
	float coef;                     /* embd_grad_coef(): per-id weight times the bag's scale */
};

/* A bag's gradient row and, where keys name bags, the coefficient of its ids. */
struct embd_bag_grad {
	const float *row;               /* its dL/d(pooled) for the shard's columns */
	float coef;                     /* embd_grad_coef() of each of its ids (unweighted) */
};

/* What applying combined gradients to a shard's rows needs. */
struct embd_bwd_rows {
	struct embd_shard *shard;
	struct embd_optim_params params;
	/* per bag; the coefficient beside the row, in the line the apply loads for it: from an
	 * array of their own the coefficients took sgd D 64 P 20's apply ~5% longer (Intel Xeon,
	 * 2026-12-06) */
	const struct embd_bag_grad *bags;
	const struct embd_occ_side *side; /* keys name places among the ids: per place; else NULL */
	uint32_t idx_bits;              /* a key's bits under its row */
	uint32_t prefetch_rows;         /* occurrences ahead whose rows are prefetched:
					 * embd_backward_prefetch_distance() */
	bool prefetch_near;             /* embd_backward_prefetch_l1() */
};

struct embd_cpu_kernels {
	enum embd_isa isa;
	/*
	 * Pools bags [first, last) of batch into batch->pooled. 0, EMBD_EINVAL for offsets out of
	 * order or outside num_ids, EMBD_ERANGE for an id outside the shard; err says where.
	 */
	int (*forward_bags)(const struct embd_bag_batch *batch, uint32_t first, uint32_t last,
			    struct embd_kernel_err *err);
	/*
	 * Whether forward_bags' lean loop has its loop for rows of cols elements of elem_bytes;
	 * NULL where the variant has no lean loop (scalar). A row embd_forward_lean takes that
	 * has none falls back to the checked loop, with the same sums, only slower: the tests
	 * hold the two to each other.
	 */
	bool (*lean_has_loop)(uint32_t cols, uint32_t elem_bytes);
	/*
	 * occ[0, n) is sorted by row, each row's run in batch order: sums each run into grad_row
	 * (2 x cols floats of scratch) and applies the optimizer to the row once. next[0, next_n)
	 * are the (sorted) occurrences the caller applies next, whose rows are prefetched once
	 * occ's run out; the previous call prefetched occ[0, prefetched). Adds to *bad the rows it
	 * left NaN or infinite (weights or state) and lowers *bad_row to the first of them.
	 * Returns how many of next it prefetched, to pass on as prefetched.
	 */
	size_t (*apply_rows)(const struct embd_bwd_rows *ctx, const embd_occ_key *occ, size_t n,
			     const embd_occ_key *next, size_t next_n, size_t prefetched,
			     float *grad_row, uint64_t *bad, uint64_t *bad_row);
};

extern const struct embd_cpu_kernels embd_cpu_kernels_scalar;
#ifdef EMBD_KERNELS_X86
extern const struct embd_cpu_kernels embd_cpu_kernels_avx2;
extern const struct embd_cpu_kernels embd_cpu_kernels_avx512;
#endif

#if defined(EMBD_KERNELS_X86) && !defined(__CUDACC__)
#include <immintrin.h>

/*
 * 16 fp32 elements of a row at p, in two 32-byte loads joined in a register: how the AVX-512
 * forward reads rows but in passes of 16 vectors (embd_load_fp32_pass), and so how the
 * benchmark's gather limit reads them (which casts the result to integers: in the float domain,
 * clang does not fold the two loads back into one 64-byte load). On the Zen 4 the forward's rows
 * came in faster that way than in one 64-byte load: fp32 D 32 P 20 and 100 15-18% less time a
 * batch, D 64 10-15%, D 128 3-6%, D 256 and P 1 the same (AVX-512, two threads, 2026-12-05,
 * docs/benchmarks.md). Only for rows read: the backward's read-modify-write of rows with 32-byte
 * loads took up to 28% longer (adam D 128 P 20).
 */
__attribute__((target("avx512f"), always_inline)) static inline __m512
embd_load_fp32_halves(const void *p)
{
	const __m256 lo = _mm256_loadu_ps((const float *)p);
	const __m256 hi = _mm256_loadu_ps((const float *)p + 8);

	return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
						   _mm256_castps_pd(hi), 1));
}

/*
 * 16 fp32 elements of a row at p, as the AVX-512 forward reads them in a pass of whole_vecs
 * whole vectors (a constant where the loop is unrolled; a part vector after them is read
 * masked), and so as the gather limit reads them: in a pass of 16 whole vectors, 1 KiB (fp32
 * D 256, one pass a row, and wider rows' passes, unmeasured), in 64-byte loads, in others in
 * halves (embd_load_fp32_halves). On an Intel Xeon fp32 D 256 took 3-9% less time a batch in
 * whole loads at P 20 and 100 and weighted P 20, pair by pair (medians 4-5%), weighted P 100
 * 1-2%, unsteady (2026-12-07, docs/benchmarks.md), where the Zen 4 had read the same either way.
 */
__attribute__((target("avx512f"), always_inline)) static inline __m512
embd_load_fp32_pass(const void *p, const uint32_t whole_vecs)
{
	if (whole_vecs == 16)
		return _mm512_loadu_ps((const float *)p);
	return embd_load_fp32_halves(p);
}
#endif

/* What $EMBD_ISA = cap (NULL when unset) makes of the detected best isa (embedding.h). */
enum embd_isa embd_kernels_isa_capped(enum embd_isa detected, const char *cap);

/* The table for isa (AUTO: the best), or NULL when this CPU or build cannot run it. */
const struct embd_cpu_kernels *embd_cpu_kernels_get(enum embd_isa isa);

/* Fills err (may be NULL) and returns code. */
int embd_kernel_fail(struct embd_kernel_err *err, int code, uint32_t feature, int64_t sample,
		     int64_t id, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The first error by (batch, sample) among several found (per worker, then merged), so the
 * error reported does not depend on how work was scheduled. */
struct embd_first_err {
	int rc;                         /* 0: none yet */
	uint32_t batch;
	struct embd_kernel_err e;
};

/* Keeps (rc, batch, e) in f when it comes before what f holds. */
void embd_first_err_note(struct embd_first_err *f, int rc, uint32_t batch,
			 const struct embd_kernel_err *e);

/* Checks what a batch's description promises (pointers, pooling, stride) against its shard. */
int embd_bag_batch_check(const struct embd_bag_batch *bt, const struct embd_shard *shard,
			 bool backward, struct embd_kernel_err *err);

#endif /* EMBD_KERNELS_CPU_KERNELS_H */
