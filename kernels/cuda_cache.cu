/*
 * fused_uvm_caching's row copies on the GPU (kernels/embedding_cuda.h, embd_cuda_cache_copy):
 * a plan of kernels/cache.h moved between the shard's host rows (pinned and mapped, read and
 * written in place over PCIe) and the cache's slot rows in HBM. The plan's index arrays go
 * over once; one kernel per array and direction copies whole rows, a thread per word, in the
 * widest word every row is aligned to. Write-backs are enqueued before fetches on the one
 * stream, so a slot that is both is written back first.
 */
#include "kernels/cuda_internal.cuh"

template <typename W>
__global__ void rows_copy_kernel(uint8_t *dst, const uint64_t *dst_index, const uint8_t *src,
				 const uint64_t *src_index, uint64_t n, uint64_t row_bytes,
				 const struct embd_cuda_fault *fault)
{
	const uint64_t words = row_bytes / sizeof(W);
	const uint64_t total = n * words;

	if (fault->code)
		return;         /* the context stopped at an earlier fault: nothing moves */
	for (uint64_t t = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; t < total;
	     t += (uint64_t)gridDim.x * blockDim.x) {
		const uint64_t k = t / words, w = t % words;
		const W *s = (const W *)(src + src_index[k] * row_bytes);
		W *d = (W *)(dst + dst_index[k] * row_bytes);
		d[w] = s[w];
	}
}

static cudaError_t rows_copy(struct embd_cuda_ctx *ctx, void *dst, const uint64_t *dst_index,
			     const void *src, const uint64_t *src_index, uint64_t n,
			     uint64_t row_bytes)
{
	if (!n || !row_bytes)
		return cudaSuccess;
	const uint64_t words = n * row_bytes;
	uint64_t blocks = (words / 4 + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK;
	const uint64_t max_blocks = (uint64_t)ctx->num_sms * 8;
	blocks = blocks < 1 ? 1 : blocks > max_blocks ? max_blocks : blocks;
	uint8_t *d = (uint8_t *)dst;
	const uint8_t *s = (const uint8_t *)src;
	if (row_bytes % 16 == 0)
		rows_copy_kernel<uint4><<<(unsigned)blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
			d, dst_index, s, src_index, n, row_bytes, ctx->fault);
	else if (row_bytes % 4 == 0)
		rows_copy_kernel<uint32_t><<<(unsigned)blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
			d, dst_index, s, src_index, n, row_bytes, ctx->fault);
	else
		rows_copy_kernel<uint8_t><<<(unsigned)blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
			d, dst_index, s, src_index, n, row_bytes, ctx->fault);
	return cudaGetLastError();
}

int embd_cuda_cache_copy(struct embd_cuda_ctx *ctx, const struct embd_cache_moves *m,
			 void *const host_rows[3], void *const slot_rows[3],
			 const uint64_t row_bytes[3], struct embd_kernel_err *err)
{
	const uint64_t nw = m->num_writebacks, nf = m->num_fetches;
	uint64_t *index = NULL;
	cudaError_t e = cudaSuccess;
	int rc;

	if (!nw && !nf)
		return 0;
	cudaSetDevice(ctx->device);
	if ((rc = embd_cuda_scratch(ctx, (void **)&index, 2 * (nw + nf) * sizeof(uint64_t), err)))
		return rc;
	/* rows are never negative: their int64 bits read as uint64 */
	uint64_t *wb_slot = index, *wb_row = index + nw, *f_slot = index + 2 * nw,
		 *f_row = index + 2 * nw + nf;
	const void *from[4] = { m->wb_slot, m->wb_row, m->fetch_slot, m->fetch_row };
	uint64_t *to[4] = { wb_slot, wb_row, f_slot, f_row };
	const uint64_t count[4] = { nw, nw, nf, nf };
	for (int i = 0; i < 4 && e == cudaSuccess; i++)
		if (count[i])
			e = cudaMemcpyAsync(to[i], from[i], count[i] * sizeof(uint64_t),
					    cudaMemcpyHostToDevice, ctx->stream);
	for (int i = 0; i < 3 && e == cudaSuccess; i++)
		e = rows_copy(ctx, host_rows[i], wb_row, slot_rows[i], wb_slot, nw, row_bytes[i]);
	for (int i = 0; i < 3 && e == cudaSuccess; i++)
		e = rows_copy(ctx, slot_rows[i], f_slot, host_rows[i], f_row, nf, row_bytes[i]);
	embd_cuda_scratch_free(ctx, index);
	return e == cudaSuccess ? 0 : embd_cuda_fail(err, e, "copying cache rows");
}
