/*
 * kernels/cuda_internal.cuh - internal to the CUDA kernels (kernels/cuda_*.cu): the context,
 * the device fault word, the batch descriptor the forward and backward kernels read, and the
 * column-chunk loads they share.
 *
 * Faults: a kernel that finds a bad id or offset does atomicMin(&fault->key, key), where key
 * orders faults as the CPU kernels order errors ((batch << 32) | sample). Only after the kernel
 * has finished does a one-thread "latch" kernel turn the smallest key into a full record
 * (re-deriving the bad value from that one bag or segment) and set fault->code; every later
 * kernel of the context returns at once while code is set. Kernels never skip on the key
 * itself, so the smallest key of a stage always wins, whatever the block schedule.
 */
#ifndef EMBD_KERNELS_CUDA_INTERNAL_CUH
#define EMBD_KERNELS_CUDA_INTERNAL_CUH

#include <stdint.h>

#include <cuda_runtime.h>

/* device.h pulls in cuda_fp16.h (C++): include the per-row headers before the C block */
#include "kernels/device.h"
#include "kernels/optim_row.h"
#include "kernels/pool_row.h"

#include "kernels/embedding_cuda.h"

extern "C" {
#include "kernels/cpu_kernels.h"
}

#define EMBD_CUDA_NO_FAULT (~0ull)
#define EMBD_CUDA_BLOCK 256             /* threads per block of every kernel */

/* Which check failed: says what value, arg1 and arg2 of the fault mean. */
enum embd_cuda_fault_kind {
	EMBD_FAULT_NONE = 0,
	EMBD_FAULT_BAG_OFFSETS,         /* value = start, arg1 = end, arg2 = num_ids */
	EMBD_FAULT_BAG_COVER,           /* backward: value = offsets[0] or offsets[B], arg2 = num_ids */
	EMBD_FAULT_BAG_ID,              /* value = id, [arg1, arg2) = the shard's rows */
	EMBD_FAULT_LENGTH,              /* bucketize: value = a negative length */
	EMBD_FAULT_LENGTH_SUM,          /* value = sum of lengths, arg1 = num_values */
	EMBD_FAULT_VALUE,               /* value = id at position arg1, arg2 = the table's rows */
	EMBD_FAULT_CHANGED,             /* the faulting data no longer faults: it changed */
};

struct embd_cuda_fault {
	unsigned long long key;         /* smallest fault key of the running stage */
	int32_t code;                   /* 0, or the EMBD_E* of the latched fault */
	uint32_t call;                  /* the context's call number of the failing call */
	uint32_t kind;                  /* enum embd_cuda_fault_kind */
	uint32_t feature;
	int64_t sample;
	int64_t value, arg1, arg2;
};

/* A backward call since the last sync, whose step the sync undoes if the call was stopped. */
struct embd_cuda_bwd_call {
	struct embd_shard *shard;
	uint32_t call;
};

/*
 * The rows each backward call since the last sync left non-finite, as the CPU kernels count
 * them (kernels/embedding.h): call i's update kernel adds to rows[i] and lowers first[i] (a
 * shard-local row; all ones when none). Device memory, grown with the calls' records; the
 * sync adds them to the calls' shards and clears them.
 */
struct embd_cuda_nonfinite {
	unsigned long long *rows;       /* device: cap of them, then cap firsts */
	unsigned long long *first;      /* device: rows + cap */
	unsigned long long *host;       /* 2 * cap, the sync's copy */
	size_t cap;
};

struct embd_cuda_ctx {
	int device;
	int num_sms;
	cudaStream_t stream;
	bool owns_stream;
	cudaMemPool_t pool;             /* scratch of the calls, stream-ordered */
	struct embd_cuda_fault *fault;  /* device */
	uint32_t calls;                 /* calls enqueued since the last sync */
	struct embd_cuda_bwd_call *bwd; /* num_bwd of cap_bwd used */
	size_t num_bwd, cap_bwd;
	struct embd_cuda_nonfinite nonfinite;   /* one record per entry of bwd */
};

/* One embd_bag_batch as the kernels read it, with its place among the call's bags and ids. */
struct embd_cuda_bags {
	const int64_t *offsets;
	const int64_t *ids;
	const float *weights;           /* or NULL */
	const int32_t *mean_lengths;    /* or NULL */
	const void *rows;               /* the shard's weights */
	float *pooled;                  /* forward: row 0 of the output, pooled_col added */
	const float *pooled_grad;       /* backward: likewise */
	uint64_t pooled_stride;
	uint64_t row_offset, num_rows, num_ids;
	uint64_t bag_base;              /* global index of bag 0 */
	uint64_t id_base;               /* global index of id 0 */
	uint32_t batch_size, cols, feature;
	uint32_t grad_divisor;          /* backward: embd_bag_batch.grad_divisor */
	uint8_t fp16, mean;
	uint8_t vec_rows;               /* rows may be read 4 elements at a time */
	uint8_t vec_pooled;             /* pooled / pooled_grad may be accessed as float4 */
};

/* ---- host helpers (cuda_ctx.cu) ----------------------------------------------------------- */

/* Fills err from a CUDA error and returns EMBD_ENOMEM or EMBD_EIO. */
int embd_cuda_fail(struct embd_kernel_err *err, cudaError_t e, const char *what);

/* Stream-ordered scratch from the context's pool; embd_cuda_scratch_free() on the stream. */
int embd_cuda_scratch(struct embd_cuda_ctx *ctx, void **p, uint64_t bytes,
		      struct embd_kernel_err *err);
void embd_cuda_scratch_free(struct embd_cuda_ctx *ctx, void *p);

/*
 * Checks n batches on the host (embd_bag_batch_check) and builds their device descriptors into
 * the scratch at *descs, setting *total_bags and *total_ids. shard: the backward's shard (every
 * batch must name it or NULL), NULL for forward.
 */
int embd_cuda_bags_prepare(struct embd_cuda_ctx *ctx, const struct embd_bag_batch *batches,
			   uint32_t n, struct embd_shard *shard, struct embd_cuda_bags **descs,
			   uint64_t *total_bags, uint64_t *total_ids, struct embd_kernel_err *err);

/* Enqueues the latch of a bag stage (forward, backward collect). cover: backward's checks. */
int embd_cuda_bags_latch(struct embd_cuda_ctx *ctx, const struct embd_cuda_bags *descs, bool cover,
			 uint32_t call, struct embd_kernel_err *err);

static inline bool embd_cuda_aligned16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

/* Rounds up to the alignment every scratch sub-array gets. */
static inline uint64_t embd_cuda_align(uint64_t bytes)
{
	return (bytes + 255) & ~(uint64_t)255;
}

/*
 * Consecutive aligned arrays out of one scratch allocation, placed in two passes over the same
 * code: with base NULL it only adds up `used`; with base set it hands out the arrays.
 */
struct embd_cuda_carve {
	uint8_t *base;
	uint64_t used;
};

static inline void *embd_cuda_carve_take(struct embd_cuda_carve *c, uint64_t bytes)
{
	void *p = c->base ? c->base + c->used : NULL;
	c->used += embd_cuda_align(bytes);
	return p;
}

/* Second pass: allocates the `used` bytes the first pass added up, and starts handing out. */
int embd_cuda_carve_alloc(struct embd_cuda_ctx *ctx, struct embd_cuda_carve *c,
			  struct embd_kernel_err *err);

/*
 * Room for the record of backward call ctx->num_bwd (bwd and nonfinite grown together); the
 * nonfinite records of the calls so far are kept, stream ordered after the calls writing them.
 */
int embd_cuda_bwd_reserve(struct embd_cuda_ctx *ctx, struct embd_kernel_err *err);

/* ---- device helpers ----------------------------------------------------------------------- */

static __device__ __forceinline__ void embd_cuda_fault_note(struct embd_cuda_fault *f, uint64_t key)
{
	atomicMin(&f->key, (unsigned long long)key);
}

/* NaN or infinity: an exponent of all ones (kernels/finite.h's test, on the device). */
static __device__ __forceinline__ bool embd_cuda_nonfinite(float x)
{
	return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

static __device__ __forceinline__ bool embd_cuda_nonfinite_fp16(uint16_t h)
{
	return (h & 0x7c00u) == 0x7c00u;
}

/* The batch that global bag g belongs to: the last i with bag_base <= g. */
static __device__ __forceinline__ uint32_t embd_cuda_bags_find(const struct embd_cuda_bags *d,
							       uint32_t n, uint64_t g)
{
	uint32_t lo = 0, hi = n;

	while (hi - lo > 1) {
		uint32_t mid = (lo + hi) / 2;
		if (d[mid].bag_base <= g)
			lo = mid;
		else
			hi = mid;
	}
	return lo;
}

/*
 * Lanes of a group of G consecutive lanes (G divides 32) each own 4 consecutive columns of a
 * 4*G-column chunk. These move one lane's 4 elements at p (column c of a row of cols); columns
 * at or past cols read as 0 and are not written. vec: p may be accessed as one 16-byte (fp32)
 * or 8-byte (fp16) word when all 4 columns exist. NC: read through the read-only cache (data
 * the kernel does not write).
 */
template <bool NC, typename T>
static __device__ __forceinline__ T embd_cuda_ld(const T *p)
{
	return NC ? __ldg(p) : *p;
}

template <bool NC>
static __device__ __forceinline__ void embd_cuda_load4(const float *p, bool vec, uint32_t c,
						       uint32_t cols, float x[4])
{
	if (vec && c + 4 <= cols) {
		float4 v = embd_cuda_ld<NC>(reinterpret_cast<const float4 *>(p));
		x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
		return;
	}
#pragma unroll
	for (int j = 0; j < 4; j++)
		x[j] = c + j < cols ? embd_cuda_ld<NC>(p + j) : 0.0f;
}

template <bool NC>
static __device__ __forceinline__ void embd_cuda_load4(const uint16_t *p, bool vec, uint32_t c,
						       uint32_t cols, float x[4])
{
	if (vec && c + 4 <= cols) {
		uint2 v = embd_cuda_ld<NC>(reinterpret_cast<const uint2 *>(p));
		x[0] = embd_fp16_to_fp32((uint16_t)(v.x & 0xffffu));
		x[1] = embd_fp16_to_fp32((uint16_t)(v.x >> 16));
		x[2] = embd_fp16_to_fp32((uint16_t)(v.y & 0xffffu));
		x[3] = embd_fp16_to_fp32((uint16_t)(v.y >> 16));
		return;
	}
#pragma unroll
	for (int j = 0; j < 4; j++)
		x[j] = c + j < cols ? embd_fp16_to_fp32(embd_cuda_ld<NC>(p + j)) : 0.0f;
}

/* This lane's 4 elements of row r of a row-major fp32 or fp16 array of cols columns. */
template <bool NC>
static __device__ __forceinline__ void embd_cuda_row_load4(const void *rows, bool fp16, uint64_t r,
							   uint32_t cols, uint32_t c, bool vec, float x[4])
{
	if (fp16)
		embd_cuda_load4<NC>((const uint16_t *)rows + r * cols + c, vec, c, cols, x);
	else
		embd_cuda_load4<NC>((const float *)rows + r * cols + c, vec, c, cols, x);
}

static __device__ __forceinline__ void embd_cuda_store4(float *p, bool vec, uint32_t c, uint32_t cols,
							const float x[4])
{
	if (vec && c + 4 <= cols) {
		*reinterpret_cast<float4 *>(p) = make_float4(x[0], x[1], x[2], x[3]);
		return;
	}
#pragma unroll
	for (int j = 0; j < 4; j++)
		if (c + j < cols)
			p[j] = x[j];
}

/* Rounds to fp16 as optim_row.h does (embd_fp32_to_fp16). */
static __device__ __forceinline__ void embd_cuda_store4(uint16_t *p, bool vec, uint32_t c, uint32_t cols,
							const float x[4])
{
	uint16_t h[4];

#pragma unroll
	for (int j = 0; j < 4; j++)
		h[j] = embd_fp32_to_fp16(x[j]);
	if (vec && c + 4 <= cols) {
		*reinterpret_cast<uint2 *>(p) = make_uint2((uint32_t)h[0] | (uint32_t)h[1] << 16,
							   (uint32_t)h[2] | (uint32_t)h[3] << 16);
		return;
	}
#pragma unroll
	for (int j = 0; j < 4; j++)
		if (c + j < cols)
			p[j] = h[j];
}

/* The mask of the G-lane group that this lane belongs to. */
template <int G>
static __device__ __forceinline__ unsigned embd_cuda_group_mask()
{
	unsigned lane = threadIdx.x & 31;
	return (unsigned)((1ull << G) - 1) << (lane & ~(unsigned)(G - 1));
}

/* Lanes per group for rows of at most max_cols columns: 4 columns per lane, 8 to 32 lanes. */
static inline int embd_cuda_group_lanes(uint32_t max_cols)
{
	return max_cols <= 32 ? 8 : max_cols <= 64 ? 16 : 32;
}

#endif /* EMBD_KERNELS_CUDA_INTERNAL_CUH */
