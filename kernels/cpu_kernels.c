/*
 * The hot loops of the CPU kernels, compiled once per instruction set: CMake builds this file
 * as embd_cpu_kernels_scalar, _avx2 and _avx512 with EMBD_CPU_VARIANT set and that variant's
 * -m flags. The bag loop is written with intrinsics where the flags allow (accumulators in
 * registers, masked tails, F16C widening) and falls back to pool_row.h; the backward's row
 * loops sum gradient rows with pool_row.h and update each row with optim_row.h's row
 * functions, which the compiler vectorizes at each width, or, for fp32 rows of whole 16-float
 * groups, with the same arithmetic written in vectors of the variant's width.
 *
 * Every id is read once, checked against the shard's rows and only then used. Rows are prefetched
 * embd_forward_prefetch_distance() ids ahead across bag boundaries, which is what makes P = 1 fast,
 * from the head of a chunk of bags (forward.c) to its end and no further, and only the head of each
 * row (embd_prefetch_row_bytes): the L2 streamer brings the rest without tying up a line fill
 * buffer per line. A row wider than one pass of accumulators (AVX2 past 64 fp32 or 96 fp16 columns)
 * is pooled in several passes over the bag; each pass prefetches the head of its own columns of the
 * row ahead, as the columns a later pass reads are no longer right behind the head (prefetching
 * whole rows in the first pass bunched all misses there: a D 256 P 20 bag ran 1.35x faster on AVX2
 * with the prefetches spread, fp16 D 128 P 20 1.5x).
 * Rows that are prefetched whole (a multiple of 64 bytes, at most 512) and whose passes start
 * on a line take a lean loop instead, each of the row ahead's lines prefetched right after the
 * load that starts the same line of this row, as FBGEMM's generated kernels do (on an AMD EPYC,
 * Zen 4: 6-11% off D 32/64 fp32 batches, 2-3% off fp16 D 128/256; docs/benchmarks.md,
 * 2026-12-04). That loop reads no id: a window of the chunk's ids is first copied, as rows
 * of the shard, into a buffer on the stack and checked in one vector pass, with the rows of
 * the prefetch distance past the window behind it (those past the chunk the chunk's last
 * one, as if clamped; those outside the shard row 0). Each id is still read once, so a
 * caller's ids that change meanwhile cannot take a read outside the shard; a window that
 * holds an id outside the shard is pooled by the checked loop, which names it. Without the
 * check, the clamp and the id arithmetic in it, the loop is about half as many instructions
 * an id (11 for fp16 D 32), and more ids ahead fit in the core's window while a row waits on
 * DRAM: on the Zen 4 (AVX-512, 2026-12-05) fp16 D 32 P 20 and P 100 went from .84 and .88 of
 * the gather limit to .89 and .93, with the limit's own clamp taken out the same way.
 */
#include "kernels/cpu_kernels.h"

#include <string.h>

#include "kernels/finite.h"
#include "kernels/pool_row.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define VARIANT_TABLE CAT(embd_cpu_kernels_, EMBD_CPU_VARIANT)

/* What one bag loop needs about its shard and batch, read once per call. */
struct bag_ctx {
	const uint8_t *base;            /* shard weights */
	uint64_t row_bytes;
	uint64_t row_offset;            /* as unsigned: id - row_offset wraps for ids below it */
	uint64_t rows;
	uint32_t cols;
	const int64_t *ids;
	const float *weights;
	uint64_t prefetch_end;          /* no row at or after this id is prefetched (<= num_ids) */
	uint32_t prefetch_ids;          /* embd_forward_prefetch_distance() */
	uint64_t prefetch_bytes;        /* embd_prefetch_row_bytes(row_bytes) */
	uint64_t prefetch_last;         /* prefetch_end - 1: the last id whose row is prefetched */
	bool lean;                      /* the row prefetched whole, in lines, its passes
					 * starting on a line: the lean loop's */
	bool prefetch_near;             /* the lean loop also prefetches into L1 a few ids
					 * ahead (embd_forward_prefetch_l1_near) */
};

_Static_assert(EMBD_PREFETCH_IDS <= EMBD_LEAN_WINDOW_PAD &&
		       EMBD_PREFETCH_IDS_FAR <= EMBD_LEAN_WINDOW_PAD,
	       "the window's padding holds every prefetch distance");

/* Whether a bag's offsets [s, e), as read, lie inside the batch's ids (the checked and the
 * lean loop check them alike). */
static inline bool bag_inside(const struct embd_bag_batch *bt, int64_t s, int64_t e)
{
	return s >= 0 && s <= e && (uint64_t)e <= bt->num_ids;
}

/* Bag b's pooled output row and, in *scale, what its sums are multiplied by. */
static inline float *bag_out(const struct embd_bag_batch *bt, uint32_t b, int64_t s, int64_t e,
			     float *scale)
{
	*scale = embd_pool_scale(bt->pooling, bt->mean_lengths ? bt->mean_lengths[b] : e - s);
	return bt->pooled + b * bt->pooled_stride + bt->pooled_col;
}

/* The bytes [from, + bytes) of the row of id k, clipped to prefetch_bytes and to the row,
 * unless k is past prefetch_end or outside the shard. */
static inline __attribute__((always_inline)) void
prefetch_part(const struct bag_ctx *c, uint64_t k, uint64_t from, uint64_t bytes)
{
	if (k >= c->prefetch_end)
		return;
	uint64_t r = (uint64_t)c->ids[k] - c->row_offset;
	if (r >= c->rows)
		return;
	if (bytes > c->prefetch_bytes)
		bytes = c->prefetch_bytes;
	if (from + bytes > c->row_bytes)
		bytes = c->row_bytes - from;
	embd_prefetch_bytes(c->base + r * c->row_bytes + from, bytes);
}

static inline __attribute__((always_inline)) void prefetch_row(const struct bag_ctx *c, uint64_t k)
{
	prefetch_part(c, k, 0, c->row_bytes);
}

/*
 * The row of id k from column c0 on, or NULL when the id is outside the shard (then nothing of
 * it is read). It also prefetches the same columns of the row prefetch_ids ahead: a pass
 * over the bag's first columns brings the lines of the next passes' too.
 */
static inline __attribute__((always_inline)) const uint8_t *
bag_row(const struct bag_ctx *c, int64_t k, uint32_t c0, uint64_t elem_bytes, uint64_t pass_bytes)
{
	uint64_t r = (uint64_t)c->ids[k] - c->row_offset; /* read once */

	if (r >= c->rows)
		return NULL;
	prefetch_part(c, (uint64_t)k + c->prefetch_ids, c0 * elem_bytes, pass_bytes);
	return c->base + r * c->row_bytes + c0 * elem_bytes;
}

/*
 * The vector operations the loops below are written in, so that each loop is written once for
 * both instruction sets: VEC_OP names an intrinsic of the variant's width, and the loads and
 * stores of a row's part vector (n_valid < VEC_FLOATS: a pass's last columns), which read and
 * write only where it lies, the rest read as zero, are written for each.
 */
#if defined(__AVX512F__)
#define VEC_FLOATS 16
#define CHUNK_VECS 16                   /* 256 columns per pass: 16 of the 32 zmm registers */
#define CHUNK_VECS_FP32 16
typedef __m512 vecf;
#define VEC_OP(op) _mm512_##op

/* 16 fp16 elements at p, widened. */
static inline __attribute__((always_inline)) vecf vec_load_fp16(const uint8_t *p)
{
	return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* 16 fp32 elements of a row at p in a pass of whole_vecs whole vectors (embd_load_fp32_pass). */
static inline __attribute__((always_inline)) vecf vec_load_fp32(const uint8_t *p,
								const int whole_vecs)
{
	return embd_load_fp32_pass(p, (uint32_t)whole_vecs);
}

/* The first n_valid (< 16) floats of a row at p (fp16 or fp32 elements), the rest zero. */
static inline __attribute__((always_inline)) vecf vec_load_part(const uint8_t *p, uint32_t n_valid,
								const int fp16)
{
	__mmask16 m = (__mmask16)((1u << n_valid) - 1);
	return fp16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)) : _mm512_maskz_loadu_ps(m, p);
}

/* x's first n_valid (< 16) floats to p. */
static inline __attribute__((always_inline)) void vec_store_part(float *p, vecf x, uint32_t n_valid)
{
	_mm512_mask_storeu_ps(p, (__mmask16)((1u << n_valid) - 1), x);
}
#elif defined(__AVX2__)
#define VEC_FLOATS 8
/* fp16 rows: 96 columns per pass, 12 of the 16 ymm registers (the rest for the weight and
 * loads); fp32 rows: 64, 8 of them (embd_forward_pass_cols says why). */
#define CHUNK_VECS 12
#define CHUNK_VECS_FP32 8
typedef __m256 vecf;
#define VEC_OP(op) _mm256_##op

/* 8 fp16 elements at p, widened. */
static inline __attribute__((always_inline)) vecf vec_load_fp16(const uint8_t *p)
{
	return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 fp32 elements of a row at p (in a pass of any width). */
static inline __attribute__((always_inline)) vecf vec_load_fp32(const uint8_t *p,
								const int whole_vecs)
{
	(void)whole_vecs;
	return _mm256_loadu_ps((const float *)p);
}

/*
 * 16 fp16 elements at p, widened into two vectors from one 32-byte load (the empty asm holds
 * the load whole: without it gcc reads the low half again in a 16-byte load of its own).
 */
static inline __attribute__((always_inline)) void vec_load_fp16_pair(const uint8_t *p, vecf *lo,
								     vecf *hi)
{
	__m256i x = _mm256_loadu_si256((const __m256i *)p);

	__asm__("" : "+x"(x));
	*lo = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
	*hi = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
}

/* The first n_valid (< 8) floats of a row at p (fp16 or fp32 elements), the rest zero. AVX2
 * has no masked 16-bit load: fp16 elements go through the stack. */
static inline __attribute__((always_inline)) vecf vec_load_part(const uint8_t *p, uint32_t n_valid,
								const int fp16)
{
	if (fp16) {
		uint16_t tmp[VEC_FLOATS] = { 0 };
		memcpy(tmp, p, n_valid * 2);
		return vec_load_fp16((const uint8_t *)tmp);
	}
	__m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
	__m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n_valid), idx);
	return _mm256_maskload_ps((const float *)p, mask);
}

/* x's first n_valid (< 8) floats to p. */
static inline __attribute__((always_inline)) void vec_store_part(float *p, vecf x, uint32_t n_valid)
{
	float tmp[VEC_FLOATS];
	_mm256_storeu_ps(tmp, x);
	memcpy(p, tmp, n_valid * sizeof(float));
}
#endif

#ifdef VEC_FLOATS
/* Columns a pass over a bag pools (embd_forward_pass_cols) */
#define PASS_COLS(fp16) ((fp16) ? CHUNK_VECS * VEC_FLOATS : CHUNK_VECS_FP32 * VEC_FLOATS)

static inline __attribute__((always_inline)) vecf vec_zero(void) { return VEC_OP(setzero_ps)(); }
static inline __attribute__((always_inline)) vecf vec_set1(float x) { return VEC_OP(set1_ps)(x); }
static inline __attribute__((always_inline)) vecf vec_load(const float *p) { return VEC_OP(loadu_ps)(p); }
static inline __attribute__((always_inline)) vecf vec_mul(vecf a, vecf b) { return VEC_OP(mul_ps)(a, b); }
static inline __attribute__((always_inline)) vecf vec_fmadd(vecf a, vecf b, vecf c)
{
	return VEC_OP(fmadd_ps)(a, b, c);
}

/* n_valid floats of a row (fp16 or fp32 elements) at p, in a pass of whole_vecs whole vectors
 * (and maybe a part one), widened to fp32. */
static inline __attribute__((always_inline)) vecf vec_load_row(const uint8_t *p, uint32_t n_valid,
							       const int fp16, const int whole_vecs)
{
	if (n_valid < VEC_FLOATS)
		return vec_load_part(p, n_valid, fp16);
	return fp16 ? vec_load_fp16(p) : vec_load_fp32(p, whole_vecs);
}

static inline __attribute__((always_inline)) void vec_store(float *p, vecf x, uint32_t n_valid)
{
	if (n_valid < VEC_FLOATS)
		vec_store_part(p, x, n_valid);
	else
		VEC_OP(storeu_ps)(p, x);
}

/*
 * The checked loop: pools ids [s, e) into out[0, cols) times scale. Returns -1, or the
 * position of the first id outside the shard (nothing of it was read).
 * The loop holds as constants what it would otherwise read from the context for every id: the
 * per-id weights' pointer, read once, lets the compiler split the loop on it, and with
 * pool_bag inlined into forward_bags, whose context this is, its other fields stay in
 * registers too. Fewer instructions an id let more ids ahead be in flight while a row waits
 * on DRAM (in the lean loop, fp16 D 32 P 100 went from 1.13-1.18 to 1.00-1.03 ms a batch
 * with its constants, Zen 4, docs/benchmarks.md; the window took it further).
 * This pass covers columns [c0, c0 + n) in nvec vectors, the last one part of a vector unless
 * whole.
 */
static inline __attribute__((always_inline)) int64_t
pool_chunk(const struct bag_ctx *c, int64_t s, int64_t e, uint32_t c0, uint32_t n, float scale,
	   float *out, const int nvec, const int fp16, const int whole)
{
	vecf acc[CHUNK_VECS];
	const uint32_t tail = whole ? VEC_FLOATS : n - (uint32_t)(nvec - 1) * VEC_FLOATS;
	const uint64_t elem_bytes = fp16 ? 2 : 4;
	const float *const weights = c->weights;

	for (int v = 0; v < nvec; v++)
		acc[v] = vec_zero();
	for (int64_t k = s; k < e; k++) {
		const uint8_t *row = bag_row(c, k, c0, elem_bytes, PASS_COLS(fp16) * elem_bytes);
		if (!row)
			return k;
		vecf w = vec_set1(weights ? weights[k] : 1.0f);
		for (int v = 0; v < nvec; v++) {
			vecf x = vec_load_row(row + v * VEC_FLOATS * elem_bytes,
					      v == nvec - 1 ? tail : VEC_FLOATS, fp16,
					      whole ? nvec : nvec - 1);
			acc[v] = vec_fmadd(w, x, acc[v]);
		}
	}
	vecf sv = vec_set1(scale);
	for (int v = 0; v < nvec; v++)
		vec_store(out + c0 + v * VEC_FLOATS, vec_mul(acc[v], sv),
			  v == nvec - 1 ? tail : VEC_FLOATS);
	return -1;
}

/*
 * Adds vector v of a lean pass (nvec whole vectors at row) times w to acc[v]. AVX2 reads fp16
 * rows of one pass (single) 32 bytes a load, as the gather limit does, vectors v and v + 1 at
 * an even v (nothing at an odd one; its lean fp16 rows are whole lines, an even number of
 * vectors, so the lone last vector is only a guard): the rows of 64 and 128 bytes (D 32 and 64)
 * read 2-13% more of their limit than in 16-byte loads, D 32 P 20 0.270 against 0.290 ms a
 * batch (Intel Xeon, 2026-12-07, docs/benchmarks.md; 192-byte rows, D 96, take it
 * unmeasured). Only there: rows of several passes of 192 bytes (fp16 D 128 and 256) took 6-11%
 * longer at P 100 that way than in the checked loop (Intel Xeon, AVX2, 2026-12-07; the checked
 * loop's passes read 7-13% less of their limit that way), and on
 * AVX-512, whose fp16 loads are 32 bytes already, a 64-byte load widened in halves was no
 * faster.
 */
static inline __attribute__((always_inline)) void
pool_lean_vec(vecf *acc, vecf w, const uint8_t *row, const int v, const int nvec,
	      const uint64_t vec_bytes, const int fp16, const int single)
{
#if VEC_FLOATS == 8
	if (fp16 && single && v % 2 == 1)
		return;
	if (fp16 && single && v + 1 < nvec) {
		vecf lo, hi;
		vec_load_fp16_pair(row + v * vec_bytes, &lo, &hi);
		acc[v] = vec_fmadd(w, lo, acc[v]);
		acc[v + 1] = vec_fmadd(w, hi, acc[v + 1]);
		return;
	}
#else
	(void)single;
#endif
	acc[v] = vec_fmadd(w, vec_load_row(row + v * vec_bytes, VEC_FLOATS, fp16, nvec), acc[v]);
}

/*
 * Whether the lean loop prefetches the per-id weights into L1, LEAN_WEIGHTS_AHEAD_BYTES ahead
 * of an id's, where its rows are fp32 of up to 128 bytes (AVX-512 only: D 32, and D 16
 * unmeasured): there an id's weight is a broadcast load beside four 32-byte row loads, and a
 * weight's line that is not in L1 holds back the FMAs of 16 ids. On an Intel Xeon fp32
 * weighted D 32 took 2-6% less time a batch with it at P 100 and up to 8% at P 20 (six
 * alternations, 2026-12-07, docs/benchmarks.md), where the gather limit reading the weights
 * too was no slower. Prefetched for every row size, fp16 weighted D 256 P 100 took 1-7%
 * longer, fp32 weighted D 128 P 100 1-3% less in three pairs (within what that line moves
 * in one build: 6.72-6.97 ms a batch; not taken) and the other AVX-512 lines within 1-2%
 * either way; AVX2 fp32 weighted D 32 (four vectors) read the same either way.
 */
#define LEAN_WEIGHTS_AHEAD (EMBD_CPU_ISA == EMBD_ISA_AVX512)
#define LEAN_WEIGHTS_AHEAD_BYTES 192 /* three lines */

/* Where the lean loop prefetches its rows: into L2, or into L2 and then, a few ids ahead, into
 * L1 too. */
enum lean_prefetch { LEAN_L2, LEAN_L2_NEAR_L1 };

/*
 * The lean loop's pass over bytes [from, + nvec whole vectors) of rows of row_bytes: adds that
 * part of rows[0, n) (checked rows of the shard) times weights[j] (1 unless weighted) to
 * out[0, nvec x VEC_FLOATS) and, when finish, multiplies the sums by scale; resume: out holds
 * the bag's sums so far, unscaled (a bag longer than a window is pooled in pieces, in the same
 * order). Each of rows[j + dist]'s lines in the pass is prefetched after the load that starts
 * the same line of rows[j], into L2, and for LEAN_L2_NEAR_L1 each of
 * rows[j + EMBD_PREFETCH_IDS_NEAR]'s into L1 before it (dist is at least that): rows holds
 * n + dist entries.
 */
static inline __attribute__((always_inline)) void
pool_lean(const uint8_t *base, const uint64_t *rows, const float *weights, uint64_t n,
	  uint64_t dist, float scale, float *out, bool resume, bool finish, const int nvec,
	  const int fp16, const int weighted, const enum lean_prefetch pf, const uint64_t row_bytes,
	  const uint64_t from)
{
	vecf acc[CHUNK_VECS];
	const uint64_t elem_bytes = fp16 ? 2 : 4;
	const uint64_t vec_bytes = VEC_FLOATS * elem_bytes;
	const int single = row_bytes == (uint64_t)nvec * vec_bytes;

	for (int v = 0; v < nvec; v++)
		acc[v] = resume ? vec_load(out + v * VEC_FLOATS) : vec_zero();
	for (uint64_t j = 0; j < n; j++) {
		const uint8_t *row = base + rows[j] * row_bytes + from;
		const uint8_t *ahead = base + rows[j + dist] * row_bytes + from;
		const uint8_t *near =
			pf == LEAN_L2_NEAR_L1
				? base + rows[j + EMBD_PREFETCH_IDS_NEAR] * row_bytes + from
				: NULL;
		/* the integer round trip: the line ahead may lie past the weights' end */
		if (LEAN_WEIGHTS_AHEAD && weighted && !fp16 && row_bytes <= 128)
			embd_prefetch_line_l1((const void *)((uintptr_t)(weights + j) +
							     LEAN_WEIGHTS_AHEAD_BYTES));
		vecf w = vec_set1(weighted ? weights[j] : 1.0f);
		for (int v = 0; v < nvec; v++) {
			pool_lean_vec(acc, w, row, v, nvec, vec_bytes, fp16, single);
			if ((v * vec_bytes) % 64 == 0) {
				if (pf == LEAN_L2_NEAR_L1)
					embd_prefetch_line_l1(near + v * vec_bytes);
				embd_prefetch_line(ahead + v * vec_bytes);
			}
		}
	}
	vecf sv = vec_set1(scale);
	for (int v = 0; v < nvec; v++)
		vec_store(out + v * VEC_FLOATS, finish ? vec_mul(acc[v], sv) : acc[v], VEC_FLOATS);
}

/*
 * pool_lean over a lean row of rvec whole vectors, pass by pass (as the checked loop's passes,
 * embd_forward_pass_cols: AVX2's fp16 rows past 96 columns and fp32 rows past 64), each pass's
 * sums in its columns of out. Each pass prefetches its own lines of the row ahead, as the
 * checked loop's do. On AVX2 (Intel Xeon, 2026-12-07, docs/benchmarks.md) fp32 and fp16 D 128
 * took 15-28% less time a batch this way than in the checked loop at P 1 (fp16 D 256 4-9%),
 * mostly less at P 20 unweighted (13% less to 3% more a pair), and at P 100 (10% less to 6%
 * more) and weighted (5% less to 4% more) about the same.
 */
static inline __attribute__((always_inline)) void
pool_lean_passes(const uint8_t *base, const uint64_t *rows, const float *weights, uint64_t n,
		 uint64_t dist, float scale, float *out, bool resume, bool finish, const int rvec,
		 const int fp16, const int weighted, const enum lean_prefetch pf)
{
	const int pvec = (int)(PASS_COLS(fp16) / VEC_FLOATS);
	const uint64_t vec_bytes = VEC_FLOATS * (fp16 ? 2 : 4);
	const uint64_t row_bytes = (uint64_t)rvec * vec_bytes;

	/* written out, not a loop, so that each pass's vector count is a constant and its
	 * accumulators stay in registers; a lean row is at most 512 bytes, 3 AVX2 passes */
	_Static_assert(4 * PASS_COLS(0) * 4 >= 512 && 4 * PASS_COLS(1) * 2 >= 512,
		       "four passes cover every lean row");
#define LEAN_PASS(P)                                                                              \
	if ((P) * pvec < rvec)                                                                    \
		pool_lean(base, rows, weights, n, dist, scale, out + (P) * pvec * VEC_FLOATS,     \
			  resume, finish, rvec - (P) * pvec < pvec ? rvec - (P) * pvec : pvec, fp16,  \
			  weighted, pf, row_bytes, (uint64_t)(P) * pvec * vec_bytes);
	LEAN_PASS(0) LEAN_PASS(1) LEAN_PASS(2) LEAN_PASS(3)
#undef LEAN_PASS
}

/*
 * Passes of whole vectors (every width that is a multiple of 8 or 16) get a loop without the
 * tail's load: the AVX2 fp16 tail goes through a buffer on the stack, and with that path in
 * the loop gcc kept all eight accumulators on the stack too (a load and a store per vector
 * per id).
 */
#define CHUNK_CASE(N)                                                             \
	case N:                                                                   \
		if (n == N * VEC_FLOATS)                                          \
			bad = fp16 ? pool_chunk(c, s, e, c0, n, scale, out, N, 1, 1) \
				   : pool_chunk(c, s, e, c0, n, scale, out, N, 0, 1); \
		else                                                              \
			bad = fp16 ? pool_chunk(c, s, e, c0, n, scale, out, N, 1, 0) \
				   : pool_chunk(c, s, e, c0, n, scale, out, N, 0, 0); \
		break;

_Static_assert(CHUNK_VECS * VEC_FLOATS == (EMBD_CPU_ISA == EMBD_ISA_AVX512 ? 256 : 96) &&
		       CHUNK_VECS_FP32 * VEC_FLOATS == (EMBD_CPU_ISA == EMBD_ISA_AVX512 ? 256 : 64),
	       "embd_forward_pass_cols() tells the benchmark's limit these pass widths");

/* always_inline: forward_bags' context stays its own local (see pool_chunk) */
static inline __attribute__((always_inline)) int64_t
pool_bag(const struct bag_ctx *c, int fp16, int64_t s, int64_t e, float scale, float *out)
{
	const uint32_t pass = PASS_COLS(fp16);

	for (uint32_t c0 = 0; c0 < c->cols; c0 += pass) {
		uint32_t n = c->cols - c0 < pass ? c->cols - c0 : pass;
		int64_t bad = -1;

		/* a constant vector count per case keeps the accumulators in registers */
		switch ((n + VEC_FLOATS - 1) / VEC_FLOATS) {
		CHUNK_CASE(1) CHUNK_CASE(2) CHUNK_CASE(3) CHUNK_CASE(4)
		CHUNK_CASE(5) CHUNK_CASE(6) CHUNK_CASE(7) CHUNK_CASE(8)
		CHUNK_CASE(9) CHUNK_CASE(10) CHUNK_CASE(11) CHUNK_CASE(12)
#if CHUNK_VECS > 12
		CHUNK_CASE(13) CHUNK_CASE(14) CHUNK_CASE(15) CHUNK_CASE(16)
#endif
		}
		if (bad >= 0)
			return bad;
	}
	return -1;
}

/* The lean loop's window of a chunk's ids, as rows of the shard. */
struct lean_window {
	uint64_t from, to;              /* ids [from, to) are in rows[0, to - from) */
	bool inside;                    /* all of them inside the shard */
	bool placed;                    /* from and to are set */
	/* then the rows they prefetch */
	uint64_t rows[EMBD_LEAN_WINDOW_IDS + EMBD_LEAN_WINDOW_PAD];
};

/*
 * Moves the window to ids [k, k + EMBD_LEAN_WINDOW_IDS), clipped to the chunk's (prefetch_end);
 * false when none is left there. The rows past the window are those its last ids prefetch:
 * the chunk's next ids' (row 0 for one outside the shard; they are checked again in the next
 * window), past the chunk its last id's, as the checked loop's clamp. Once a window: not
 * inlined into every lean loop.
 */
static __attribute__((noinline)) bool
move_window(struct lean_window *wnd, const struct bag_ctx *c, uint64_t k)
{
	const uint64_t off = c->row_offset, nrows = c->rows;
	uint64_t to = c->prefetch_end - k < EMBD_LEAN_WINDOW_IDS ? c->prefetch_end
								 : k + EMBD_LEAN_WINDOW_IDS;
	uint64_t outside = 0;

	if (k >= c->prefetch_end)
		return false;
	for (uint64_t i = 0; i < to - k; i++) {
		uint64_t r = (uint64_t)c->ids[k + i] - off; /* read once */
		wnd->rows[i] = r;
		outside |= r >= nrows;
	}
	for (uint64_t i = 0; i < c->prefetch_ids; i++) {
		uint64_t at = to + i < c->prefetch_last ? to + i : c->prefetch_last;
		uint64_t r = (uint64_t)c->ids[at] - off;
		wnd->rows[to - k + i] = r < nrows ? r : 0;
	}
	wnd->from = k;
	wnd->to = to;
	wnd->inside = !outside;
	wnd->placed = true;
	return true;
}

/*
 * Pools bags [b, last) of bt in the lean loop, nvec whole vectors a row, while their ids lie in
 * windows that hold only ids inside the shard, and returns the first bag it left to the
 * checked loop (last when none): one whose offsets are not inside the ids, not where the
 * chunk was cut or not where the last bag ended, or whose window holds an id outside the
 * shard. Each offset is read once here; the checked loop reads that bag's again and checks
 * what it reads. A bag longer than a window is pooled in pieces, its sums kept unscaled in
 * its output row between them. Bags whose offsets follow on from each other only ever need
 * the window moved to where it ends; offsets changed under the loop to jump about would
 * otherwise have each one-id bag copy a whole window.
 */
static inline __attribute__((always_inline)) uint32_t
lean_bags_as(struct lean_window *wnd, const struct embd_bag_batch *bt, const struct bag_ctx *c,
	     uint32_t b, uint32_t last, const int nvec, const int fp16, const int weighted,
	     const enum lean_prefetch pf)
{
	const uint8_t *base = c->base;
	const uint64_t dist = c->prefetch_ids;

	for (; b < last; b++) {
		int64_t s = bt->offsets[b], e = bt->offsets[b + 1];
		if (!bag_inside(bt, s, e))
			return b;
		float scale;
		float *out = bag_out(bt, b, s, e, &scale);
		uint64_t k = (uint64_t)s;
		do {
			if ((k < wnd->from || k >= wnd->to) &&
			    ((wnd->placed && k != wnd->to) || !move_window(wnd, c, k)))
				return b;
			if (!wnd->inside)
				return b;
			uint64_t stop = (uint64_t)e < wnd->to ? (uint64_t)e : wnd->to;
			pool_lean_passes(base, wnd->rows + (k - wnd->from),
					 weighted ? c->weights + k : NULL, stop - k, dist, scale, out,
					 k > (uint64_t)s, stop == (uint64_t)e, nvec, fp16, weighted, pf);
			k = stop;
		} while (k < (uint64_t)e);
	}
	return b;
}

/* The lean loop's row widths in vectors: lean_bags' cases, and lean_has_loop's answers. Past
 * 16 vectors, rows of several passes on AVX2, fp16 rows only (320-512 bytes; fp32 rows of
 * 320-512 bytes are 10-16 vectors). */
#define LEAN_WIDTHS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(10) X(12) X(14) X(16)
#if VEC_FLOATS == 8
#define LEAN_WIDTHS_FP16(X) X(20) X(24) X(28) X(32)
#else
#define LEAN_WIDTHS_FP16(X)
#endif

#define LEAN_CASE(N)                                                                              \
	case N:                                                                                   \
		if (fp16 && c->weights)                                                           \
			return lean_bags_as(wnd, bt, c, b, last, N, 1, 1, LEAN_L2);               \
		if (fp16)                                                                         \
			return lean_bags_as(wnd, bt, c, b, last, N, 1, 0, LEAN_L2);               \
		if (c->weights)                                                                   \
			return lean_bags_as(wnd, bt, c, b, last, N, 0, 1, LEAN_L2);               \
		return lean_bags_as(wnd, bt, c, b, last, N, 0, 0, LEAN_L2);
/* fp16 rows only: fp32 rows of as many vectors are past 512 bytes, never lean */
#define LEAN_CASE_FP16(N)                                                                         \
	case N:                                                                                   \
		if (!fp16)                                                                        \
			return b;                                                                 \
		if (c->weights)                                                                   \
			return lean_bags_as(wnd, bt, c, b, last, N, 1, 1, LEAN_L2);               \
		return lean_bags_as(wnd, bt, c, b, last, N, 1, 0, LEAN_L2);

/* The only rows embd_forward_prefetch_l1_near also prefetches into L1: fp16 of 256 and 512
 * bytes (128 or 256 columns; on AVX2 in passes, pool_lean_passes). Out of line and named on
 * its own, so that check_prefetch.sh finds its prefetches into L1 apart from lean_bags'. */
static __attribute__((noinline)) uint32_t
lean_bags_near(struct lean_window *wnd, const struct embd_bag_batch *bt, const struct bag_ctx *c,
	       uint32_t b, uint32_t last)
{
	const enum lean_prefetch pf = LEAN_L2_NEAR_L1;

	if (c->cols == 128)
		return c->weights ? lean_bags_as(wnd, bt, c, b, last, 128 / VEC_FLOATS, 1, 1, pf)
				  : lean_bags_as(wnd, bt, c, b, last, 128 / VEC_FLOATS, 1, 0, pf);
	return c->weights ? lean_bags_as(wnd, bt, c, b, last, 256 / VEC_FLOATS, 1, 1, pf)
			  : lean_bags_as(wnd, bt, c, b, last, 256 / VEC_FLOATS, 1, 0, pf);
}

/* lean_bags_as for the shard's row width, chosen once for a run of bags. Out of line, as
 * forward_bags and apply_rows are: tests/unit/kernels/check_prefetch.sh finds their prefetch
 * instructions by name. */
static __attribute__((noinline)) uint32_t
lean_bags(struct lean_window *wnd, const struct embd_bag_batch *bt, const struct bag_ctx *c,
	  int fp16, uint32_t b, uint32_t last)
{
	if (c->prefetch_near && fp16 && (c->cols == 128 || c->cols == 256))
		return lean_bags_near(wnd, bt, c, b, last);
	switch (c->cols / VEC_FLOATS) {
	LEAN_WIDTHS(LEAN_CASE)
	LEAN_WIDTHS_FP16(LEAN_CASE_FP16)
	}
	return b;
}

/* Whether lean_bags has its loop for rows of cols elements of elem_bytes (struct
 * embd_cpu_kernels) */
static bool lean_has_loop(uint32_t cols, uint32_t elem_bytes)
{
#define LEAN_HAS(N)                                                                               \
	case N:                                                                                   \
		return true;
#define LEAN_HAS_FP16(N)                                                                          \
	case N:                                                                                   \
		return elem_bytes == 2;
	(void)elem_bytes; /* no fp16-only widths on AVX-512 */
	if (cols % VEC_FLOATS)
		return false;
	switch (cols / VEC_FLOATS) {
	LEAN_WIDTHS(LEAN_HAS)
	LEAN_WIDTHS_FP16(LEAN_HAS_FP16)
	}
	return false;
#undef LEAN_HAS
#undef LEAN_HAS_FP16
}
#else
/* The definition itself: pool_row.h on the output row. */
static int64_t pool_bag(const struct bag_ctx *c, int fp16, int64_t s, int64_t e, float scale,
			float *out)
{
	memset(out, 0, c->cols * sizeof(float));
	for (int64_t k = s; k < e; k++) {
		const uint8_t *row = bag_row(c, k, 0, 0, c->row_bytes);
		if (!row)
			return k;
		float w = c->weights ? c->weights[k] : 1.0f;
		if (fp16)
			embd_pool_row_fp16(out, (const uint16_t *)row, w, c->cols);
		else
			embd_pool_row_fp32(out, (const float *)row, w, c->cols);
	}
	embd_pool_finish(out, out, scale, c->cols);
	return -1;
}
#endif

static __attribute__((noinline)) int
forward_bags(const struct embd_bag_batch *bt, uint32_t first, uint32_t last,
	     struct embd_kernel_err *err)
{
	const struct embd_shard_desc *d = &bt->shard->desc;
	const uint32_t elem_bytes = embd_dtype_bytes(d->dtype);
	const uint64_t row_bytes = (uint64_t)d->cols * elem_bytes;
	struct bag_ctx c = {
		.base = bt->shard->weights,
		.row_bytes = row_bytes,
		.row_offset = (uint64_t)d->row_offset,
		.rows = (uint64_t)d->rows,
		.cols = d->cols,
		.prefetch_ids = embd_forward_prefetch_distance(row_bytes, elem_bytes),
		.prefetch_bytes = embd_prefetch_row_bytes(row_bytes),
		.ids = bt->ids,
		.weights = bt->weights,
	};
	int fp16 = d->dtype == EMBD_DTYPE_FP16;

	/*
	 * Prefetching stops at the end of these bags' ids: the rows after them belong to the next
	 * chunk, which another worker likely takes, and fetching them here only doubles their
	 * traffic. The offset is read as a hint, clamped; each bag is still checked on its own.
	 */
	uint64_t end = (uint64_t)bt->offsets[last];
	c.prefetch_end = end < bt->num_ids ? end : bt->num_ids;
	c.prefetch_last = c.prefetch_end ? c.prefetch_end - 1 : 0;
	c.lean = embd_forward_lean(EMBD_CPU_ISA,
				   (uint64_t)embd_forward_pass_cols(EMBD_CPU_ISA, c.cols, elem_bytes) *
					   elem_bytes,
				   row_bytes, c.base) &&
		 c.prefetch_end > 0;
	c.prefetch_near = c.lean && c.prefetch_ids >= EMBD_PREFETCH_IDS_NEAR &&
			  embd_forward_prefetch_near(EMBD_CPU_ISA, row_bytes, elem_bytes);

	/*
	 * The rows of the first prefetch_ids ids: each id prefetches the row that many ids
	 * ahead, so without this the head of every chunk of bags would wait on DRAM one row at a
	 * time (at P = 1 that was a quarter of the gap to the gather limit). The offset is only a
	 * hint here; prefetch_row checks what it reads.
	 */
	if (first < last) {
		uint64_t s = (uint64_t)bt->offsets[first];
		for (uint64_t k = s; k < s + c.prefetch_ids; k++)
			prefetch_row(&c, k);
	}
#ifdef VEC_FLOATS
	struct lean_window wnd;
	wnd.from = wnd.to = 0;
	wnd.inside = wnd.placed = false;
	/* a copy: c's address never leaves this function, so its fields stay in registers
	 * across the checked loop's stores */
	const struct bag_ctx lean_ctx = c;
#endif
	for (uint32_t b = first; b < last; b++) {
#ifdef VEC_FLOATS
		/* the lean loop takes what it can; the bag it stops at (if any) is checked here */
		if (c.lean && (b = lean_bags(&wnd, bt, &lean_ctx, fp16, b, last)) == last)
			break;
#endif
		/* each offset is read once: the bag is checked on the values it is run with */
		int64_t s = bt->offsets[b], e = bt->offsets[b + 1];
		if (!bag_inside(bt, s, e))
			return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, b, s,
						"feature %u sample %u: offsets [%lld, %lld) not inside the %llu ids",
						bt->feature, b, (long long)s, (long long)e,
						(unsigned long long)bt->num_ids);
		float scale;
		float *out = bag_out(bt, b, s, e, &scale);
		int64_t bad = pool_bag(&c, fp16, s, e, scale, out);
		if (bad >= 0) {
			int64_t id = bt->ids[bad];
			return embd_kernel_fail(err, EMBD_ERANGE, bt->feature, b, id,
						"feature %u sample %u: id %lld outside the shard's rows [%lld, %lld)",
						bt->feature, b, (long long)id, (long long)d->row_offset,
						(long long)(d->row_offset + d->rows));
		}
	}
	return 0;
}

/* The rows applying one occurrence updates, prefetched prefetch_ids occurrences ahead. */
struct occ_prefetch {
	const uint8_t *weights, *m1, *m2;
	uint64_t row_bytes, m1_bytes, m2_bytes;
};

/*
 * Prefetches one occurrence's row: its weights and state, into L2 (DRAM misses). A row of
 * several occurrences is prefetched once per occurrence; the later ones find it in flight or in
 * L1. The bag's gradient row it reads is not prefetched: those are L2/L3 hits, and their
 * prefetches take fill buffers from the DRAM misses (without them, D 128 P 20, same batches in
 * one process: Zen 4 sgd 5%, adagrad 4%, adam 3% faster, rowwise_adagrad the same; Intel Ice
 * Lake the same within its noise). Into L1 where l1: the near row of
 * embd_backward_prefetch_l1_near.
 */
static inline __attribute__((always_inline)) void prefetch_occ(const struct occ_prefetch *p,
							       uint64_t row, bool l1)
{
	embd_prefetch_lines(p->weights + row * p->row_bytes, p->row_bytes, l1);
	if (p->m1_bytes)
		embd_prefetch_lines(p->m1 + row * p->m1_bytes, p->m1_bytes, l1);
	if (p->m2_bytes)
		embd_prefetch_lines(p->m2 + row * p->m2_bytes, p->m2_bytes, l1);
}

/*
 * A row whose lines a checked row loop (optim_row_checked, rowwise_row_checked) prefetches as it
 * goes, into L2 (embd_prefetch_line): each line of its weights and element-wise state after the
 * load that starts the same line of the row being updated, as the forward's lean loop spreads
 * its rows' prefetches over its loads. Prefetched all at once before the row, 24 lines for adam
 * D 128, they waited for fill buffers while the row's arithmetic waited behind them: spread,
 * adam D 128 P 20 took 10-15% less time a batch on AVX2 and ~10% on AVX-512, adagrad D 128 ~6%
 * on AVX-512 (Intel Xeon, 2026-12-06, docs/benchmarks.md). Where no row is left to prefetch the
 * loop gets the row it updates (its lines are in L1 by then). At most EMBD_PREFETCH_MAX_LINES
 * lines of each array, as embd_prefetch_lines prefetches the other rows.
 */
struct spread_prefetch {
	const uint8_t *weights, *m1, *m2; /* m1, m2: the element-wise state the optimizer has */
};

/* The row's lines of the arrays it has, from byte `at` of each (a line's first byte). */
static inline __attribute__((always_inline)) void
spread_prefetch_line(const struct spread_prefetch *sp, uint64_t at,
		     const enum embd_optimizer_type type)
{
	embd_prefetch_line(sp->weights + at);
	if (type == EMBD_OPT_ADAGRAD || type == EMBD_OPT_ADAM)
		embd_prefetch_line(sp->m1 + at);
	if (type == EMBD_OPT_ADAM)
		embd_prefetch_line(sp->m2 + at);
}

/*
 * The gradient row and coefficient of the occurrence whose key's low bits are named: its bag's,
 * or where ids carry weights (side) its own. Occurrences that named their own place in every
 * case read the side in the apply at random and cost it what the sort gained: sgd D 64 P 20,
 * the training step's batches, 1.1 ms a step more, prefetched or not (Intel Xeon, 2026-12-06).
 */
static inline __attribute__((always_inline)) const float *
occ_grad(const struct embd_bag_grad *bags, const struct embd_occ_side *side, uint64_t named,
	 float *coef)
{
	if (side) {
		*coef = side[named].coef;
		return bags[side[named].bag].row;
	}
	*coef = bags[named].coef;
	return bags[named].row;
}

/*
 * The apply's vectors: the variant's own width (one zmm, one ymm, or for the scalar variant
 * one SSE2 xmm). A GCC vector wider than the machine's registers (16 floats where AVX-512 is
 * off) has no machine mode: GCC keeps it on the stack and copies it through general registers
 * at every step: AVX2 applied adam D 128 P 20 in 11.3 ms a batch with 16-float vectors, 6.5 ms
 * with those of its width (Zen 4, 2026-12-05, docs/benchmarks.md). may_alias and
 * aligned(4): loaded from rows of floats at any float boundary.
 */
#ifdef VEC_FLOATS
#define OPT_FLOATS VEC_FLOATS
#else
#define OPT_FLOATS 4
#endif
typedef float floatsn __attribute__((vector_size(OPT_FLOATS * 4), aligned(4), may_alias));
typedef uint32_t lanesn __attribute__((vector_size(OPT_FLOATS * 4), aligned(4), may_alias));
_Static_assert(EMBD_SUM_SQ_LANES % OPT_FLOATS == 0, "a sum of squares' lanes are whole vectors");

/* The square root of each lane, as sqrtf (correctly rounded). */
static inline __attribute__((always_inline)) floatsn sqrtn(floatsn x)
{
#ifdef VEC_FLOATS
	return (floatsn)VEC_OP(sqrt_ps)((vecf)x);
#else
	for (int j = 0; j < OPT_FLOATS; j++)
		x[j] = sqrtf(x[j]);
	return x;
#endif
}

/* a * b + c in each lane with one rounding, as fmaf. */
static inline __attribute__((always_inline)) floatsn fman(floatsn a, floatsn b, floatsn c)
{
#ifdef VEC_FLOATS
	return (floatsn)VEC_OP(fmadd_ps)((vecf)a, (vecf)b, (vecf)c);
#else
	for (int j = 0; j < OPT_FLOATS; j++)
		c[j] = fmaf(a[j], b[j], c[j]);
	return c;
#endif
}

/*
 * The test the apply keeps across a chunk of fp32 rows of whole vectors, of every value it
 * writes (or, for optim_row_checked, of sums of them): non-zero once a value added was NaN or
 * infinite. On AVX2 it is a float that each value times 0 is added to by one fused
 * multiply-add, NaN from the first non-finite value on: one instruction a vector where the
 * integer test of the exponent takes four, and a chain compilers may not reassociate. GCC did
 * reassociate the integer ORs into a tree, and with AVX2's 16 ymm registers then spilled the
 * row's new weights to the stack: with the float, adagrad D 128 P 20 took 16% less time a batch,
 * rowwise_adagrad D 128 6% and adam D 64 5% (medians of ten, Intel Xeon, 2026-12-06,
 * docs/benchmarks.md), sgd the same. AVX-512 keeps the integer test (32 registers hold the
 * tree; adagrad read 1-3% slower with the float), and so does the scalar variant (SSE2 has no
 * fused multiply-add: fmaf would be a call).
 */
#if OPT_FLOATS == 8
typedef floatsn nonfinite_acc;

static inline __attribute__((always_inline)) nonfinite_acc nonfinite_acc_add(nonfinite_acc acc,
									  floatsn v)
{
	return fman(v, (floatsn){ 0 }, acc);
}

static inline __attribute__((always_inline)) uint32_t nonfinite_acc_lane(const nonfinite_acc *acc,
									int l)
{
	return embd_nonfinite_bit((*acc)[l]);
}

/* Adds each of x[0, n) (n a multiple of OPT_FLOATS) to the test *acc. */
static inline __attribute__((always_inline)) void or_nonfinite(nonfinite_acc *acc, const float *x,
							       uint64_t n)
{
	for (uint64_t i = 0; i < n; i += OPT_FLOATS)
		*acc = nonfinite_acc_add(*acc, *(const floatsn *)(x + i));
}
#else
typedef lanesn nonfinite_acc;

/* ORs embd_nonfinite_bit of each lane of the float bits v into acc's. */
static inline __attribute__((always_inline)) lanesn or_nonfinite_bits(lanesn acc, lanesn v)
{
	return acc | (((v & 0x7f800000u) + 0x00800000u) & 0x80000000u);
}

static inline __attribute__((always_inline)) nonfinite_acc nonfinite_acc_add(nonfinite_acc acc,
									  floatsn v)
{
	return or_nonfinite_bits(acc, (lanesn)v);
}

static inline __attribute__((always_inline)) uint32_t nonfinite_acc_lane(const nonfinite_acc *acc,
									int l)
{
	return (*acc)[l];
}

/* ORs embd_nonfinite_bit of each of x[0, n) (n a multiple of OPT_FLOATS) into *acc's lanes. */
static inline __attribute__((always_inline)) void or_nonfinite(nonfinite_acc *acc, const float *x,
							       uint64_t n)
{
	for (uint64_t i = 0; i < n; i += OPT_FLOATS)
		*acc = or_nonfinite_bits(*acc, *(const lanesn *)(x + i));
}
#endif

/*
 * sgd, adagrad or adam without weight decay on a row of whole 16-float groups, prefetching the
 * lines of sp's row as it goes: embd_optim_elem's arithmetic, operation for operation (so bit
 * for bit: contraction is off, fmaf is fman), OPT_FLOATS columns at a time, that also adds to
 * the test *acc (nonfinite_acc_add) the new weight plus its new state (sgd: the weight; adam:
 * the weight and v), from the values in registers rather than read back after the row is
 * written. The sum is NaN or infinite whenever one of them is, and otherwise only when finite
 * values add up past the largest float, which the recount (count_nonfinite_rows) tells apart.
 * Read back, the test was ~6% of adam D 128 P 20's step; here adam D 64 won 9 of 10
 * alternations on AVX-512, its apply 5% shorter (Zen 4, 2026-12-05, docs/benchmarks.md). sgd,
 * with no state to read back, read ~3% slower this way until the prefetches were spread over
 * the row loop; with them, sgd D 64 took 5-7% less time a batch on AVX-512 (Intel Xeon,
 * 2026-12-06).
 */
static inline __attribute__((always_inline)) void
optim_row_checked(const struct embd_optim_params *params, float *restrict w,
		  const float *restrict g, float *restrict m1, float *restrict m2,
		  const uint32_t cols, const enum embd_optimizer_type type, nonfinite_acc *acc,
		  const struct spread_prefetch *sp)
{
	const float b1 = params->beta1, b2 = params->beta2, c1 = 1.0f - params->beta1,
		    c2 = 1.0f - params->beta2, step = params->adam_step,
		    adam_eps = params->adam_eps, lr = params->lr, eps = params->eps;

	/*
	 * A line at a time, its vectors in one iteration with the prefetch at its head: where a
	 * vector is under a line (AVX2, SSE2), a loop a vector at a time leaves GCC a test and a
	 * branch a vector for the line's first; a line at a time AVX2 adagrad D 128 P 20 read .922
	 * of its limit against .837 (medians of ten, Intel Xeon, 2026-12-07), AVX-512 the same
	 * within its noise.
	 */
	enum { LINE_FLOATS = EMBD_CACHE_LINE_BYTES / 4 };
	_Static_assert(EMBD_SUM_SQ_LANES % LINE_FLOATS == 0 && LINE_FLOATS % OPT_FLOATS == 0,
		       "a row of whole 16-float groups is whole lines of whole vectors");
	for (uint32_t line = 0; line < cols; line += LINE_FLOATS)
	for (uint32_t c = line; c < line + LINE_FLOATS; c += OPT_FLOATS) {
		const floatsn gd = *(const floatsn *)(g + c);
		floatsn x = *(floatsn *)(w + c), sum;

		if (c == line && c * 4 < EMBD_PREFETCH_MAX_LINES * EMBD_CACHE_LINE_BYTES)
			spread_prefetch_line(sp, c * 4, type);

		if (type == EMBD_OPT_SGD) {
			x = fman(-lr - (floatsn){ 0 }, gd, x);
			sum = x;
		} else if (type == EMBD_OPT_ADAGRAD) {
			const floatsn st = fman(gd, gd, *(floatsn *)(m1 + c));
			*(floatsn *)(m1 + c) = st;
			x = x - lr * gd / (sqrtn(st) + eps);
			sum = x + st;
		} else {
			const floatsn m = b1 * *(floatsn *)(m1 + c) + c1 * gd;
			const floatsn v = b2 * *(floatsn *)(m2 + c) + c2 * (gd * gd);
			*(floatsn *)(m1 + c) = m;
			*(floatsn *)(m2 + c) = v;
			x = x - step * m / (sqrtn(v) + adam_eps);
			/* m need not be added: where it is NaN or infinite so is the new weight,
			 * unless v is (the step divides by sqrt(v) + eps', eps' > 0); one add less
			 * took adam D 128 P 20 4-8% less time a batch (Intel Xeon, 2026-12-07) */
			sum = x + v;
		}
		*(floatsn *)(w + c) = x;
		*acc = nonfinite_acc_add(*acc, sum);
	}
}

/*
 * rowwise_adagrad without weight decay on a row of whole 16-float groups, bit for bit
 * embd_optim_row_fp32's: the sum of g^2 in embd_optim_sum_sq's 16 lanes and halvings, kept in
 * registers (GCC reduced embd_optim_sum_sq's lanes through the stack: one store and sixteen
 * scalar loads a row, then a chain of scalar adds; in registers AVX-512 D 128 P 20 read .867 of
 * its limit against .796, 8 of 8 alternations, Zen 4, 2026-12-05), and the new weights tested
 * in registers into *acc as optim_row_checked does; the row's one state float into *acc_state.
 */
static inline __attribute__((always_inline)) void
rowwise_row_checked(const struct embd_optim_params *params, float *restrict w,
		    const float *restrict g, float *restrict m1, const uint32_t cols,
		    nonfinite_acc *acc, uint32_t *acc_state, const struct spread_prefetch *sp)
{
	enum { PARTS = EMBD_SUM_SQ_LANES / OPT_FLOATS };
	floatsn lane[PARTS] = { 0 };    /* lane[q][j]: embd_optim_sum_sq's lane q * OPT_FLOATS + j */

	for (uint32_t c = 0; c < cols; c += EMBD_SUM_SQ_LANES)
		for (int q = 0; q < PARTS; q++) {
			const floatsn gq = *(const floatsn *)(g + c + q * OPT_FLOATS);
			lane[q] = fman(gq, gq, lane[q]);
		}
	/* the halvings: lanes j += j + 8, then j += j + 4 */
	typedef float floats4 __attribute__((vector_size(16)));
	floats4 l4;
#if OPT_FLOATS >= 8
#if OPT_FLOATS == 16
	typedef float floats8 __attribute__((vector_size(32)));
	floats8 half[2];
	memcpy(half, &lane[0], sizeof(half));
	const floats8 l8 = half[0] + half[1];
#else
	const floatsn l8 = lane[0] + lane[1];
#endif
	floats4 quarter[2];
	memcpy(quarter, &l8, sizeof(quarter));
	l4 = quarter[0] + quarter[1];
#else
	l4 = (lane[0] + lane[2]) + (lane[1] + lane[3]);
#endif
	const float sum_sq = (l4[0] + l4[2]) + (l4[1] + l4[3]);
	const float mult = embd_optim_rowwise_mult(params, m1, sum_sq, cols);
	const floatsn neg_mult = -(mult - (floatsn){ 0 }); /* x - 0 is x, -0 included */

	*acc_state |= embd_nonfinite_bit(*m1);
	for (uint32_t c = 0; c < cols; c += OPT_FLOATS) {
		const floatsn x = fman(neg_mult, *(const floatsn *)(g + c), *(floatsn *)(w + c));

		if (c * 4 % EMBD_CACHE_LINE_BYTES == 0 &&
		    c * 4 < EMBD_PREFETCH_MAX_LINES * EMBD_CACHE_LINE_BYTES)
			spread_prefetch_line(sp, c * 4, EMBD_OPT_ROWWISE_ADAGRAD);
		*(floatsn *)(w + c) = x;
		*acc = nonfinite_acc_add(*acc, x);
	}
}

/*
 * Counts the rows of occ[0, n) (sorted by row) that hold a NaN or an infinity in their fp32
 * weights or their state, naming the lowest in *bad_row: what embd_optim_row_fp32 would have
 * said of each row updated, asked again after a chunk whose rows left one somewhere (or, for
 * optim_row_checked, whose finite values summed past the largest float). The rows were just
 * written and are still in cache.
 */
static __attribute__((noinline, cold)) void
count_nonfinite_rows(const struct embd_bwd_rows *ctx, const embd_occ_key *occ, size_t n,
		     uint64_t *bad, uint64_t *bad_row)
{
	const struct embd_shard *sh = ctx->shard;
	const uint32_t cols = sh->desc.cols;
	const uint64_t m1_per_row = embd_optim_state_floats(sh->desc.optimizer.type, cols, 0);
	const uint64_t m2_per_row = embd_optim_state_floats(sh->desc.optimizer.type, cols, 1);

	for (size_t i = 0; i < n; i++) {
		uint64_t row = occ[i] >> ctx->idx_bits;

		if (i && occ[i - 1] >> ctx->idx_bits == row)
			continue;
		/* no state array is touched where the optimizer has none (NULL) */
		bool b = embd_first_nonfinite((const float *)sh->weights + row * cols, cols) < cols ||
			 (m1_per_row && embd_first_nonfinite(sh->momentum1 + row * m1_per_row,
							     m1_per_row) < m1_per_row) ||
			 (m2_per_row && embd_first_nonfinite(sh->momentum2 + row * m2_per_row,
							     m2_per_row) < m2_per_row);
		if (b) {
			(*bad)++;
			if (row < *bad_row)
				*bad_row = row;
		}
	}
}

/*
 * apply_rows for one optimizer and one dtype, and for a row width that is a constant where the
 * caller passes one: the compiler then unrolls the row loops whole and keeps the optimizer's
 * switch out of the loop.
 */
static inline __attribute__((always_inline)) size_t
apply_rows_as(const struct embd_bwd_rows *ctx, const embd_occ_key *occ, size_t n,
	      const embd_occ_key *next, size_t next_n, size_t prefetched, float *g, uint64_t *bad,
	      uint64_t *bad_row, const uint32_t cols, const enum embd_optimizer_type type,
	      const bool fp16)
{
	const struct embd_shard *sh = ctx->shard;
	struct embd_optim_params params = ctx->params;
	/* held here: the rows' stores (may_alias vectors) would have ctx's fields reloaded */
	const struct embd_bag_grad *bags = ctx->bags;
	const struct embd_occ_side *side = ctx->side;
	const uint32_t idx_bits = ctx->idx_bits;
	const uint64_t idx_mask = ((uint64_t)1 << idx_bits) - 1;
	const uint64_t m1_per_row = embd_optim_state_floats(type, cols, 0);
	const uint64_t m2_per_row = embd_optim_state_floats(type, cols, 1);
	struct occ_prefetch p = {
		.weights = sh->weights, .m1 = (const uint8_t *)sh->momentum1,
		.m2 = (const uint8_t *)sh->momentum2, .row_bytes = (uint64_t)cols * (fp16 ? 2 : 4),
		.m1_bytes = m1_per_row * 4, .m2_bytes = m2_per_row * 4,
	};
	const size_t dist = ctx->prefetch_rows;
	/* false at compile time for the optimizers the rule leaves out: their loops keep no test */
	const bool near = embd_backward_prefetch_l1_near(type) && ctx->prefetch_near;
	size_t total = n + next_n, ahead = prefetched; /* occurrences [0, ahead) are prefetched */
	/*
	 * fp32 rows of whole vectors are checked into lanes that stay in registers across the
	 * chunk, and only a chunk that left something non-finite (or, for adagrad and adam, a
	 * row whose weight and state summed past the largest float: optim_row_checked) is
	 * looked at row by row: with
	 * a check reduced to one answer per row (a horizontal OR and a branch on it) sgd D 64
	 * P 20 read .794 of its limit, with the lanes .863 (two threads, Zen 4, medians of six
	 * paired runs, docs/benchmarks.md). Once training has diverged and rows stay NaN, every
	 * chunk holding one is looked at twice: slower, but only then.
	 */
	const bool lanes = !fp16 && cols % EMBD_SUM_SQ_LANES == 0;
	nonfinite_acc nonfinite_lanes = { 0 };
	/* rows updated and tested in registers (optim_row_checked, rowwise_row_checked) */
	const bool checked = lanes && params.weight_decay == 0.0f &&
			     (type == EMBD_OPT_SGD || type == EMBD_OPT_ADAGRAD || type == EMBD_OPT_ADAM ||
			      type == EMBD_OPT_ROWWISE_ADAGRAD);
	uint32_t nonfinite_state = 0;   /* rowwise_adagrad's state float of each row */

	params.type = type;
	for (; ahead < dist && ahead < total; ahead++)
		prefetch_occ(&p, (ahead < n ? occ[ahead] : next[ahead - n]) >> idx_bits, false);
	for (size_t i = 0; i < n;) {
		const uint64_t row = occ[i] >> idx_bits;
		float coef;
		const float *grad = occ_grad(bags, side, occ[i] & idx_mask, &coef);

		embd_grad_first_row(g, grad, coef, cols);
		for (i++; i < n && occ[i] >> idx_bits == row; i++) {
			grad = occ_grad(bags, side, occ[i] & idx_mask, &coef);
			embd_grad_accum_row(g, grad, coef, cols);
		}
		/* the first row to prefetch: spread over the row loop where it is checked, unless
		 * none is left (then the row itself) */
		uint64_t spread_row = row;
		bool spread_set = !checked;
		for (; ahead < i + dist && ahead < total; ahead++) {
			const uint64_t r = (ahead < n ? occ[ahead] : next[ahead - n]) >> idx_bits;
			if (spread_set) {
				prefetch_occ(&p, r, false);
			} else {
				spread_row = r;
				spread_set = true;
			}
		}
		/* i is the next row's first occurrence: the row of the one after it, into L1 */
		if (near && i + 1 < n)
			prefetch_occ(&p, occ[i + 1] >> idx_bits, true);

		float *m1 = m1_per_row ? sh->momentum1 + row * m1_per_row : NULL;
		float *m2 = m2_per_row ? sh->momentum2 + row * m2_per_row : NULL;
		void *w = (uint8_t *)sh->weights + row * p.row_bytes;
		/* checked while in cache: reported, not kept silently (engine/step.h) */
		if (checked) {
			/* rowwise_adagrad's one state float a row: prefetched whole here */
			const struct spread_prefetch sp = {
				.weights = p.weights + spread_row * p.row_bytes,
				.m1 = m1_per_row ? p.m1 + spread_row * p.m1_bytes : NULL,
				.m2 = m2_per_row ? p.m2 + spread_row * p.m2_bytes : NULL,
			};
			if (type == EMBD_OPT_ROWWISE_ADAGRAD) {
				embd_prefetch_line(sp.m1);
				rowwise_row_checked(&params, w, g, m1, cols, &nonfinite_lanes,
						    &nonfinite_state, &sp);
			} else {
				optim_row_checked(&params, w, g, m1, m2, cols, type,
						  &nonfinite_lanes, &sp);
			}
			continue;
		}
		if (lanes) {
			(void)embd_optim_row_fp32(&params, w, g, m1, m2, cols);
			or_nonfinite(&nonfinite_lanes, w, cols);
			if (m1_per_row == cols)
				or_nonfinite(&nonfinite_lanes, m1, cols);
			else if (m1_per_row)
				nonfinite_state |= embd_nonfinite_bit(*m1);
			if (m2_per_row)
				or_nonfinite(&nonfinite_lanes, m2, cols);
			continue;
		}
		uint32_t nonfinite = fp16 ? embd_optim_row_fp16(&params, w, g, m1, m2, g + cols, cols)
					  : embd_optim_row_fp32(&params, w, g, m1, m2, cols);
		if (nonfinite) {
			(*bad)++;
			if (row < *bad_row)
				*bad_row = row;
		}
	}
	if (lanes) {
		uint32_t any = nonfinite_state;
		for (int l = 0; l < OPT_FLOATS; l++)
			any |= nonfinite_acc_lane(&nonfinite_lanes, l);
		if (any)
			count_nonfinite_rows(ctx, occ, n, bad, bad_row);
	}
	return ahead > n ? ahead - n : 0;
}

#define APPLY_CASE(COLS, TYPE, FP16)                                                             \
	case TYPE:                                                                                \
		return apply_rows_as(ctx, occ, n, next, next_n, prefetched, g, bad, bad_row, COLS, \
				     TYPE, FP16);
#define APPLY_AS(COLS, FP16)                                                                      \
	switch (type) {                                                                           \
	APPLY_CASE(COLS, EMBD_OPT_SGD, FP16)                                                      \
	APPLY_CASE(COLS, EMBD_OPT_ADAGRAD, FP16)                                                  \
	APPLY_CASE(COLS, EMBD_OPT_ROWWISE_ADAGRAD, FP16)                                          \
	APPLY_CASE(COLS, EMBD_OPT_ADAM, FP16)                                                     \
	}

/*
 * fp32 rows of 32, 64, 128 and 256 columns get a loop of their own per optimizer (fully
 * unrolled rows: D 128 applied 5-8% faster for every optimizer, 2026-12-03); other widths and
 * fp16 rows one per optimizer. flatten inlines the row functions into each, so that the
 * constants reach them; noinline keeps the whole named for check_prefetch.sh.
 */
static __attribute__((flatten, noinline)) size_t
apply_rows(const struct embd_bwd_rows *ctx, const embd_occ_key *occ, size_t n,
	   const embd_occ_key *next, size_t next_n, size_t prefetched, float *g, uint64_t *bad,
	   uint64_t *bad_row)
{
	const struct embd_shard_desc *d = &ctx->shard->desc;
	enum embd_optimizer_type type = d->optimizer.type;

	if (d->dtype == EMBD_DTYPE_FP32) {
		switch (d->cols) {
		case 32: APPLY_AS(32, false) break;
		case 64: APPLY_AS(64, false) break;
		case 128: APPLY_AS(128, false) break;
		case 256: APPLY_AS(256, false) break;
		}
		APPLY_AS(d->cols, false)
	}
	APPLY_AS(d->cols, true)
	return 0;
}

const struct embd_cpu_kernels VARIANT_TABLE = {
	.isa = EMBD_CPU_ISA,
	.forward_bags = forward_bags,
#ifdef VEC_FLOATS
	.lean_has_loop = lean_has_loop,
#endif
	.apply_rows = apply_rows,
};
