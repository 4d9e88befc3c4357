/*
 * kernels/embedding_cuda.h - the embedding kernels for GPU memory: shards in device memory,
 * pooled forward, fused backward + optimizer and block bucketize, enqueued on a CUDA stream.
 *
 * The arguments are the CPU kernels' own (struct embd_shard, embd_bag_batch and
 * embd_bucketize_args of kernels/embedding.h and kernels/jagged.h) with their arrays in device
 * memory, and the arithmetic is the same per-row headers (pool_row.h, optim_row.h), so a GPU
 * result equals the CPU's bit for bit; only rowwise_adagrad's sum of squares over a row is
 * added in a different order (a tree reduction), as optim_row.h allows.
 *
 * Calls are asynchronous: each returns once its work is enqueued on the context's stream. Ids,
 * offsets and lengths live on the device, so they are checked there: a bad one stops that call
 * (a backward then changes no row) and every later call on the context, until
 * embd_cuda_sync() reports the first one (by call, then batch, then sample, as the CPU kernels
 * order errors) and undoes the step count of every backward call that did nothing.
 */
#ifndef EMBD_KERNELS_EMBEDDING_CUDA_H
#define EMBD_KERNELS_EMBEDDING_CUDA_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "kernels/cache.h"
#include "kernels/embedding.h"
#include "kernels/jagged.h"

/* A stream on one GPU, the device word that collects its errors, and its scratch memory. */
struct embd_cuda_ctx;

/* GPUs this process can use; 0 (and return 0) when there is no GPU or no driver. */
int embd_cuda_device_count(int *count);

/*
 * A context on GPU `device`. stream: the caller's stream (it stays the caller's), or NULL for a
 * new non-blocking stream that the context owns. Every call on a context runs in order on its
 * stream; a context is used by one host thread at a time.
 */
int embd_cuda_ctx_create(int device, cudaStream_t stream, struct embd_cuda_ctx **out, char *err,
			 size_t err_len);

/* Waits for the stream and frees the context. NULL is a no-op. */
void embd_cuda_ctx_destroy(struct embd_cuda_ctx *ctx);

cudaStream_t embd_cuda_ctx_stream(const struct embd_cuda_ctx *ctx);

/*
 * Waits for everything enqueued on the context and returns the first error of the calls since
 * the last sync: 0; EMBD_EINVAL (offsets or lengths), EMBD_ERANGE (an id outside its shard or
 * table) with feature, sample and id in err as embd_kernels_forward() reports them; EMBD_EIO
 * or EMBD_ENOMEM for a CUDA failure (its message in err). After an id or offset error, the
 * failing call and every later call did nothing (forward outputs are unspecified) and the
 * shards' step counts are as if none of those backward calls had been made. The backward
 * calls' non-finite rows are added to their shards (embd_cuda_backward). The context is
 * usable again afterwards.
 */
int embd_cuda_sync(struct embd_cuda_ctx *ctx, struct embd_kernel_err *err);

/*
 * A shard in device memory (one allocation: weights, then state), described as
 * embd_shard_create() describes a host shard: shard->weights, momentum1 and momentum2 are device
 * pointers. State is zeroed; weights are left uninitialised (copy a host shard in). Free it with
 * embd_cuda_shard_destroy(), never embd_shard_destroy().
 */
int embd_cuda_shard_create(struct embd_cuda_ctx *ctx, const struct embd_shard_desc *desc,
			   struct embd_shard **out, char *err, size_t err_len);

/* Frees a shard from embd_cuda_shard_create(). NULL is a no-op. */
void embd_cuda_shard_destroy(struct embd_shard *shard);

/*
 * Copies weights, state and step from src to dst, host to device or device to host (shards of
 * the same rows, columns, dtype and optimizer), and returns when the copy is done.
 */
int embd_cuda_shard_copy(struct embd_cuda_ctx *ctx, struct embd_shard *dst,
			 const struct embd_shard *src, char *err, size_t err_len);

/*
 * Pooled forward, as embd_kernels_forward(): batches (a host array) name device shards, and
 * offsets, ids, weights, mean_lengths and pooled are device memory. Returns 0 once enqueued;
 * EMBD_EINVAL for a description that is wrong on the host (missing pointers, stride, more than
 * 2^32 - 1 bags), EMBD_ENOMEM/EMBD_EIO for a CUDA failure; errors in device data come from
 * embd_cuda_sync().
 */
int embd_cuda_forward(struct embd_cuda_ctx *ctx, const struct embd_bag_batch *batches, uint32_t n,
		      struct embd_kernel_err *err);

/*
 * One fused backward + optimizer step on a device shard, as embd_kernels_backward(): ids are
 * sorted by row on the device, each row's gradient is summed in batch order and the row is
 * updated once. shard->step is incremented when the call is enqueued (embd_cuda_sync() undoes
 * it if the call failed on the device); the rows the update left NaN or infinite are counted
 * on the device and added to shard->nonfinite_rows (and the lowest one to nonfinite_row) by
 * embd_cuda_sync(), as embd_kernels_backward() adds them. At most 2^31 - 1 ids per call.
 * Returns as embd_cuda_forward().
 */
int embd_cuda_backward(struct embd_cuda_ctx *ctx, struct embd_shard *shard,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err);

/*
 * Block bucketize, as embd_jagged_bucketize(): feature_rows is host memory (F values), every
 * other array device memory; out_lengths, out_values, out_weights and out_permute are written
 * in the same order and with the same values as the CPU's. At most 2^31 - 1 values and
 * 2^31 - 1 output lengths per call. Returns as embd_cuda_forward() (EMBD_EINVAL also for
 * num_buckets 0 or a table of no rows).
 */
int embd_cuda_bucketize(struct embd_cuda_ctx *ctx, const struct embd_bucketize_args *args,
			struct embd_kernel_err *err);

/*
 * fused_uvm_caching's moves (kernels/cache.h, a host plan): for each array i (weights, then
 * the optimizer's momentum1 and momentum2; row_bytes[i] 0 where unused) every write-back row
 * slot_rows[i] -> host_rows[i], then every fetch host_rows[i] -> slot_rows[i]. host_rows are
 * device pointers of pinned mapped host memory, slot_rows device memory. Returns 0 once
 * enqueued (the plan's arrays may then be reused), EMBD_ENOMEM/EMBD_EIO for a CUDA failure.
 */
int embd_cuda_cache_copy(struct embd_cuda_ctx *ctx, const struct embd_cache_moves *m,
			 void *const host_rows[3], void *const slot_rows[3],
			 const uint64_t row_bytes[3], struct embd_kernel_err *err);

/*
 * dst[i] += src[i] for n floats of device memory on the context's GPU (row-split tables'
 * partial sums, engine/backend_cuda.c). Returns 0 once enqueued, EMBD_EIO for a CUDA failure.
 */
int embd_cuda_add(struct embd_cuda_ctx *ctx, float *dst, const float *src, uint64_t n,
		  struct embd_kernel_err *err);

#ifdef __cplusplus
}
#endif

#endif /* EMBD_KERNELS_EMBEDDING_CUDA_H */
