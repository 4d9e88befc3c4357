/*
 * The memory limits of `embd-bench kernels`: what the memory system allows for the kernels'
 * own access patterns, measured with the kernels' own tricks and none of their work.
 *
 * gather (forward): the rows of a batch's ids, in batch order, each read once with the vector
 *   loads of the kernel's isa (64 bytes for avx512, 32 for avx2, 16 for scalar, which the
 *   compiler vectorizes with SSE2), fully unrolled per row size, the row embd_prefetch_rows()
 *   ids ahead prefetched line by line exactly as the kernel does (embd_prefetch_bytes), chunks
 *   of ids grabbed from one counter by the same workers; and after every P ids one pooled row
 *   (D fp32) stored, as the kernel must (at P = 1 that write is as much traffic as the reads).
 *   It checks no id, multiplies by no weight and keeps no per-column sums: the loads feed
 *   integer adds into four rotating accumulators (one cycle, no denormal assists on fp16 bits,
 *   no chain that holds back the loads of later rows). It is the kernel minus everything but
 *   the traffic the kernel cannot avoid, so a kernel can only approach it.
 * read-modify-write (backward): every distinct row of a batch, in ascending order (the order
 *   the kernel's sort produces, the kindest to DRAM pages and the TLB), read and written back
 *   once in the weights and in each optimizer state array, state rows prefetched for writing
 *   beside the weights, embd_prefetch_rows() rows ahead; and the incoming gradient (B x D
 *   fp32) read once, in order. That is the least traffic any exact update does; it leaves out
 *   the kernel's reading of ids, the grouping of occurrences, the gradient rows it reads once
 *   per occurrence (in row order, so at random) and all arithmetic.
 * Stored values are unchanged (an opaque zero is added), so the limits run on the kernels' own
 * shards: same pages, same huge-page backing, same placement.
 */
#include "bench_limits.h"

#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"

#define GATHER_CHUNK_IDS 1024
#define RMW_CHUNK_ROWS 256

/* ---- gather ------------------------------------------------------------------------------ */

#if defined(__x86_64__)
/*
 * One body per vector type: VLOAD/VADD/VZERO of width VBYTES; nvec constant per call site,
 * so the row's loads are unrolled and independent. ACC_STORE puts the sum into sink.
 */
#define GATHER_BODY(VTYPE, VBYTES, VZERO, VLOAD, VADD, VSTORE)                                    \
	const uint8_t *t = g->table;                                                              \
	uint64_t rb = g->row_bytes, per_out = g->ids_per_out, out_vecs = g->out_row_bytes / VBYTES; \
	uint64_t next_out = per_out - 1 - lo % per_out; /* ids until the end of this bag */      \
	VTYPE acc[4] = { VZERO, VZERO, VZERO, VZERO };                                            \
	for (uint64_t k = 0; k < n && k < dist; k++)                                              \
		embd_prefetch_bytes(t + (uint64_t)ids[k] * rb, rb, 0);                            \
	for (uint64_t k = 0; k < n; k++) {                                                        \
		if (k + dist < n)                                                                 \
			embd_prefetch_bytes(t + (uint64_t)ids[k + dist] * rb, rb, 0);             \
		const uint8_t *row = t + (uint64_t)ids[k] * rb;                                   \
		_Pragma("GCC unroll 64") for (uint32_t v = 0; v < nvec; v++)                      \
			acc[v & 3] = VADD(acc[v & 3], VLOAD((const void *)(row + (uint64_t)v * VBYTES))); \
		if (k == next_out) {                                                              \
			uint8_t *o = g->out + (lo + k) / per_out * g->out_row_bytes;              \
			for (uint64_t v = 0; v < out_vecs; v++)                                   \
				VSTORE(o + v * VBYTES, acc[v & 3]);                               \
			next_out += per_out;                                                      \
		}                                                                                 \
	}                                                                                         \
	VSTORE(sink, VADD(VADD(acc[0], acc[1]), VADD(acc[2], acc[3])));

#define LOAD512(p) _mm512_loadu_si512(p)
#define STORE512(s, x) _mm512_storeu_si512((void *)(s), x)
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE256(s, x) _mm256_storeu_si256((__m256i *)(s), x)
#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE128(s, x) _mm_storeu_si128((__m128i *)(s), x)

__attribute__((target("avx512f"), always_inline)) static inline void
gather_512(const struct bench_gather *g, uint64_t lo, const int64_t *ids, uint64_t n,
	   uint32_t dist, uint64_t *sink, const uint32_t nvec)
{
	GATHER_BODY(__m512i, 64, _mm512_setzero_si512(), LOAD512, _mm512_add_epi32, STORE512)
}

__attribute__((target("avx2"), always_inline)) static inline void
gather_256(const struct bench_gather *g, uint64_t lo, const int64_t *ids, uint64_t n,
	   uint32_t dist, uint64_t *sink, const uint32_t nvec)
{
	GATHER_BODY(__m256i, 32, _mm256_setzero_si256(), LOAD256, _mm256_add_epi32, STORE256)
}

static inline __attribute__((always_inline)) void
gather_128(const struct bench_gather *g, uint64_t lo, const int64_t *ids, uint64_t n,
	   uint32_t dist, uint64_t *sink, const uint32_t nvec)
{
	GATHER_BODY(__m128i, 16, _mm_setzero_si128(), LOAD128, _mm_add_epi32, STORE128)
}

/* Cases for the row sizes of 64 bytes to 1 KiB; others take the rolled loop (default). */
#define NVEC_SWITCH(FN, VBYTES)                                                                   \
	switch (g->row_bytes) {                                                                   \
	case 64: FN(g, lo, ids, n, dist, sink, 64 / VBYTES); break;                               \
	case 128: FN(g, lo, ids, n, dist, sink, 128 / VBYTES); break;                             \
	case 256: FN(g, lo, ids, n, dist, sink, 256 / VBYTES); break;                             \
	case 512: FN(g, lo, ids, n, dist, sink, 512 / VBYTES); break;                             \
	case 1024: FN(g, lo, ids, n, dist, sink, 1024 / VBYTES); break;                           \
	default: FN(g, lo, ids, n, dist, sink, (uint32_t)(g->row_bytes / VBYTES)); break;         \
	}

#define GATHER_CHUNK_ARGS                                                                         \
	const struct bench_gather *g, uint64_t lo, const int64_t *ids, uint64_t n, uint32_t dist, \
	uint64_t *sink

__attribute__((target("avx512f"))) static void gather_chunk_512(GATHER_CHUNK_ARGS)
{
	NVEC_SWITCH(gather_512, 64)
}

__attribute__((target("avx2"))) static void gather_chunk_256(GATHER_CHUNK_ARGS)
{
	NVEC_SWITCH(gather_256, 32)
}

static void gather_chunk_128(GATHER_CHUNK_ARGS)
{
	NVEC_SWITCH(gather_128, 16)
}
#endif

static void gather_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bench_gather *g = arg;
	uint64_t *sink = g->sink[w % BENCH_LIMIT_MAX_WORKERS];
	uint32_t dist = embd_prefetch_rows(g->row_bytes);

	(void)nw;
	for (;;) {
		uint64_t lo = atomic_fetch_add_explicit(&g->next, GATHER_CHUNK_IDS, memory_order_relaxed);
		if (lo >= g->n)
			break;
		uint64_t n = g->n - lo < GATHER_CHUNK_IDS ? g->n - lo : GATHER_CHUNK_IDS;
#if defined(__x86_64__)
		if (g->isa == EMBD_ISA_AVX512)
			gather_chunk_512(g, lo, g->ids + lo, n, dist, sink);
		else if (g->isa == EMBD_ISA_AVX2)
			gather_chunk_256(g, lo, g->ids + lo, n, dist, sink);
		else
			gather_chunk_128(g, lo, g->ids + lo, n, dist, sink);
#else
		for (uint64_t k = 0; k < n; k++) {
			const uint64_t *row = (const uint64_t *)(g->table + (uint64_t)g->ids[lo + k] * g->row_bytes);
			for (uint64_t i = 0; i < g->row_bytes / 8; i++)
				sink[i & 7] += row[i];
			if ((lo + k + 1) % g->ids_per_out == 0)
				for (uint64_t o = 0; o < g->out_row_bytes; o += 64)
					memcpy(g->out + (lo + k) / g->ids_per_out * g->out_row_bytes + o, sink, 64);
		}
#endif
	}
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

#if defined(__x86_64__)
#define RMW_BODY(VTYPE, VBYTES, VSET1, VLOAD, VADD, VSTORE)                                       \
	VTYPE z = VSET1((int)zero);                                                               \
	_Pragma("GCC unroll 64") for (uint32_t v = 0; v < nvec; v++) {                            \
		uint8_t *q = p + (uint64_t)v * VBYTES;                                            \
		VSTORE(q, VADD(VLOAD((const void *)q), z));                                       \
	}

__attribute__((target("avx512f"), always_inline)) static inline void
rmw_512(uint8_t *p, uint32_t zero, const uint32_t nvec)
{
	RMW_BODY(__m512i, 64, _mm512_set1_epi32, LOAD512, _mm512_add_epi32, STORE512)
}

__attribute__((target("avx2"), always_inline)) static inline void
rmw_256(uint8_t *p, uint32_t zero, const uint32_t nvec)
{
	RMW_BODY(__m256i, 32, _mm256_set1_epi32, LOAD256, _mm256_add_epi32, STORE256)
}

static inline __attribute__((always_inline)) void rmw_128(uint8_t *p, uint32_t zero, const uint32_t nvec)
{
	RMW_BODY(__m128i, 16, _mm_set1_epi32, LOAD128, _mm_add_epi32, STORE128)
}

#define RMW_SWITCH(FN, VBYTES)                                                                    \
	switch (rb) {                                                                             \
	case 64: FN(p, zero, 64 / VBYTES); break;                                                 \
	case 128: FN(p, zero, 128 / VBYTES); break;                                               \
	case 256: FN(p, zero, 256 / VBYTES); break;                                               \
	case 512: FN(p, zero, 512 / VBYTES); break;                                               \
	case 1024: FN(p, zero, 1024 / VBYTES); break;                                             \
	default: FN(p, zero, (uint32_t)(rb / VBYTES)); break;                                     \
	}

__attribute__((target("avx512f"))) static void rmw_row_512(uint8_t *p, uint64_t rb, uint32_t zero)
{
	RMW_SWITCH(rmw_512, 64)
}

__attribute__((target("avx2"))) static void rmw_row_256(uint8_t *p, uint64_t rb, uint32_t zero)
{
	RMW_SWITCH(rmw_256, 32)
}

static void rmw_row_128(uint8_t *p, uint64_t rb, uint32_t zero)
{
	RMW_SWITCH(rmw_128, 16)
}
#endif

/* One array's row: vectors of the isa, or one 4-byte word (rowwise_adagrad's state). */
static inline void rmw_row(enum embd_isa isa, uint8_t *p, uint64_t rb, uint32_t zero)
{
	if (rb == 4) {
		*(uint32_t *)p += zero;
		return;
	}
#if defined(__x86_64__)
	if (isa == EMBD_ISA_AVX512)
		rmw_row_512(p, rb, zero);
	else if (isa == EMBD_ISA_AVX2)
		rmw_row_256(p, rb, zero);
	else
		rmw_row_128(p, rb, zero);
#else
	(void)isa;
	for (uint64_t i = 0; i < rb / 4; i++)
		((uint32_t *)p)[i] += zero;
#endif
}

static void rmw_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bench_rmw *r = arg;
	uint64_t bytes = 0;

	/* this worker's share of the incoming gradient, read once */
	const uint64_t *gr = (const uint64_t *)r->grad;
	uint64_t words = r->grad_bytes / 8, sum = 0;
	for (uint64_t i = words * w / nw; i < words * (w + 1) / nw; i++)
		sum += gr[i];
	r->sink[w % BENCH_LIMIT_MAX_WORKERS] = sum;
	for (int a = 0; a < r->num_arrays; a++)
		bytes += r->row_bytes[a];
	uint32_t dist = embd_prefetch_rows(bytes);
	for (;;) {
		uint64_t lo = atomic_fetch_add_explicit(&r->next, RMW_CHUNK_ROWS, memory_order_relaxed);
		if (lo >= r->n)
			break;
		uint64_t hi = r->n - lo < RMW_CHUNK_ROWS ? r->n : lo + RMW_CHUNK_ROWS;
		uint32_t zero = r->zero;
		for (uint64_t k = lo; k < hi && k < lo + dist; k++)
			for (int a = 0; a < r->num_arrays; a++)
				embd_prefetch_bytes(r->arrays[a] + r->rows[k] * r->row_bytes[a], r->row_bytes[a], 1);
		for (uint64_t k = lo; k < hi; k++) {
			for (int a = 0; k + dist < hi && a < r->num_arrays; a++)
				embd_prefetch_bytes(r->arrays[a] + r->rows[k + dist] * r->row_bytes[a],
						    r->row_bytes[a], 1);
			for (int a = 0; a < r->num_arrays; a++)
				rmw_row(r->isa, r->arrays[a] + r->rows[k] * r->row_bytes[a], r->row_bytes[a], zero);
		}
	}
}

void bench_rmw_run(struct embd_workers *workers, struct bench_rmw *r)
{
	atomic_store_explicit(&r->next, 0, memory_order_relaxed);
	embd_workers_run(workers, rmw_worker, r);
}
