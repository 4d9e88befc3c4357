/*
 * Pooled forward on the GPU. A group of G lanes pools one bag (G = 8, 16 or 32, the fewest
 * whose 4 columns per lane cover the widest shard of the call), so a warp gathers whole rows
 * with 16-byte (fp32) or 8-byte (fp16) loads. The group reads G ids at once, checks them all
 * before any row is touched, then walks them in bag order with IDS_IN_FLIGHT row loads issued
 * before the first is added: each lane's columns are summed in exactly the order of
 * pool_row.h, so the result equals the CPU's bit for bit.
 */
#include "kernels/cuda_internal.cuh"

#define IDS_IN_FLIGHT 4                 /* rows loaded before the first is added */

/* 4 blocks of 256 per SM (64 registers): enough warps in flight to cover DRAM latency */
template <int G>
static __global__ void __launch_bounds__(EMBD_CUDA_BLOCK, 4)
forward_kernel(const struct embd_cuda_bags *descs, uint32_t n, uint64_t total_bags,
	       struct embd_cuda_fault *fault)
{
	if (fault->code)
		return; /* an earlier call failed: the context is stopped until sync */
	uint64_t g = ((uint64_t)blockIdx.x * EMBD_CUDA_BLOCK + threadIdx.x) / G;
	if (g >= total_bags)
		return; /* the whole group: g is the same for its lanes */
	const unsigned mask = embd_cuda_group_mask<G>();
	const uint32_t lane = threadIdx.x % G;
	const uint32_t i = embd_cuda_bags_find(descs, n, g);
	const struct embd_cuda_bags &d = descs[i]; /* fields stay in L1 rather than spill */
	const uint64_t b = g - d.bag_base;
	const uint64_t key = (uint64_t)i << 32 | b;
	/* each offset is read once: the bag is checked on the values it is run with */
	const int64_t s = d.offsets[b], e = d.offsets[b + 1];

	if (s < 0 || s > e || (uint64_t)e > d.num_ids) {
		if (lane == 0)
			embd_cuda_fault_note(fault, key);
		return;
	}
	int64_t divisor = d.mean_lengths ? d.mean_lengths[b] : e - s;
	float scale = embd_pool_scale(d.mean ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM, divisor);
	float *out = d.pooled + b * d.pooled_stride;

	for (uint32_t c0 = 0; c0 < d.cols; c0 += 4 * G) {
		const uint32_t c = c0 + 4 * lane;
		float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

		for (int64_t k0 = s; k0 < e; k0 += G) {
			int64_t k = k0 + lane;
			uint64_t r = 0;
			float w = 1.0f;
			bool bad = false;
			if (k < e) {
				r = (uint64_t)d.ids[k] - d.row_offset; /* ids below row_offset wrap */
				bad = r >= d.num_rows;
				if (d.weights)
					w = d.weights[k];
			}
			if (__ballot_sync(mask, bad) & mask) {
				if (lane == 0)
					embd_cuda_fault_note(fault, key);
				return;
			}
			const int cnt = (int)min((int64_t)G, e - k0);
			int j = 0;
			for (; j + IDS_IN_FLIGHT <= cnt; j += IDS_IN_FLIGHT) {
				float x[IDS_IN_FLIGHT][4], wj[IDS_IN_FLIGHT];
#pragma unroll
				for (int u = 0; u < IDS_IN_FLIGHT; u++) {
					uint64_t ru = __shfl_sync(mask, r, j + u, G);
					wj[u] = __shfl_sync(mask, w, j + u, G);
					embd_cuda_row_load4<true>(d.rows, d.fp16, ru, d.cols, c, d.vec_rows, x[u]);
				}
#pragma unroll
				for (int u = 0; u < IDS_IN_FLIGHT; u++)
					embd_pool_row_fp32(acc, x[u], wj[u], 4);
			}
			for (; j < cnt; j++) {
				float x[4];
				uint64_t ru = __shfl_sync(mask, r, j, G);
				float wu = __shfl_sync(mask, w, j, G);
				embd_cuda_row_load4<true>(d.rows, d.fp16, ru, d.cols, c, d.vec_rows, x);
				embd_pool_row_fp32(acc, x, wu, 4);
			}
		}
		embd_pool_finish(acc, acc, scale, 4);
		embd_cuda_store4(out + c, d.vec_pooled, c, d.cols, acc);
	}
}

int embd_cuda_forward(struct embd_cuda_ctx *ctx, const struct embd_bag_batch *batches, uint32_t n,
		      struct embd_kernel_err *err)
{
	struct embd_cuda_bags *descs = NULL;
	uint64_t bags = 0, ids = 0;
	uint32_t max_cols = 0;
	cudaError_t e;
	int rc;

	cudaSetDevice(ctx->device);
	rc = embd_cuda_bags_prepare(ctx, batches, n, NULL, &descs, &bags, &ids, err);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++)
		if (batches[i].batch_size && batches[i].shard->desc.cols > max_cols)
			max_cols = batches[i].shard->desc.cols;
	uint32_t call = ctx->calls++;
	if (bags) {
		int G = embd_cuda_group_lanes(max_cols);
		unsigned blocks = (unsigned)((bags * (uint64_t)G + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK);
		if (G == 8)
			forward_kernel<8><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(descs, n, bags, ctx->fault);
		else if (G == 16)
			forward_kernel<16><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(descs, n, bags, ctx->fault);
		else
			forward_kernel<32><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(descs, n, bags, ctx->fault);
		e = cudaGetLastError();
		rc = e == cudaSuccess ? embd_cuda_bags_latch(ctx, descs, false, call, err)
				      : embd_cuda_fail(err, e, "launching the forward kernel");
	}
	embd_cuda_scratch_free(ctx, descs);
	return rc;
}

__global__ void add_kernel(float *dst, const float *src, uint64_t n,
			   const struct embd_cuda_fault *fault)
{
	if (fault->code)
		return;         /* the context stopped at an earlier fault: nothing moves */
	for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
	     i += (uint64_t)gridDim.x * blockDim.x)
		dst[i] += src[i];
}

int embd_cuda_add(struct embd_cuda_ctx *ctx, float *dst, const float *src, uint64_t n,
		  struct embd_kernel_err *err)
{
	if (!n)
		return 0;
	cudaSetDevice(ctx->device);
	uint64_t blocks = (n + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK;
	const uint64_t max_blocks = (uint64_t)ctx->num_sms * 8;
	blocks = blocks > max_blocks ? max_blocks : blocks;
	add_kernel<<<(unsigned)blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(dst, src, n, ctx->fault);
	cudaError_t e = cudaGetLastError();
	return e == cudaSuccess ? 0 : embd_cuda_fail(err, e, "launching the add kernel");
}
