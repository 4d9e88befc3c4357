/*
 * kernels/pool_row.h - the per-row arithmetic of pooled lookup and of its gradient, shared by
 * the CPU kernels (scalar fallback, AVX2, AVX-512) and the CUDA kernels.
 *
 * The definition every implementation must reproduce bit for bit:
 *   forward   acc[c] = fmaf(weight_k, row_k[c], acc[c])  over the bag's ids k in order,
 *             out[c] = acc[c] * scale,   scale = 1 for SUM, 1/L for MEAN (0 when L == 0)
 *   backward  coef_k = weight_k * scale, grad_row[c] = fmaf(coef_k, dy[c], grad_row[c])
 *             over every occurrence of the row, in batch order.
 * fmaf is spelled out (rather than a*b+c) so that compilers that contract and compilers that
 * do not, and vector FMA instructions, all round the same way. fp16 rows are widened to fp32
 * exactly; accumulation is always fp32.
 */
#ifndef EMBD_KERNELS_POOL_ROW_H
#define EMBD_KERNELS_POOL_ROW_H

#include <math.h>
#include <stdint.h>

#include "embd/types.h"
#include "kernels/device.h"

/* One element: the accumulator after adding weight * x. */
static inline EMBD_HOST_DEVICE float embd_pool_elem(float acc, float x, float weight)
{
	return fmaf(weight, x, acc);
}

/* acc[c] += weight * row[c] for c in [0, cols). */
static inline EMBD_HOST_DEVICE void embd_pool_row_fp32(float *acc, const float *row, float weight,
						       uint32_t cols)
{
	for (uint32_t c = 0; c < cols; c++)
		acc[c] = embd_pool_elem(acc[c], row[c], weight);
}

/* acc[c] += weight * row[c] for an IEEE binary16 row. */
static inline EMBD_HOST_DEVICE void embd_pool_row_fp16(float *acc, const uint16_t *row, float weight,
						       uint32_t cols)
{
	for (uint32_t c = 0; c < cols; c++)
		acc[c] = embd_pool_elem(acc[c], embd_fp16_to_fp32(row[c]), weight);
}

/*
 * The factor a bag's sum is multiplied by: 1 for SUM; for MEAN 1/divisor, where divisor is the
 * bag's FULL length (a row-wise shard sees only part of the bag but must divide by all of it),
 * and 0 for an empty bag (TorchRec: the mean of an empty bag is 0).
 */
static inline EMBD_HOST_DEVICE float embd_pool_scale(enum embd_pooling pooling, int64_t divisor)
{
	if (pooling != EMBD_POOLING_MEAN)
		return 1.0f;
	return divisor > 0 ? 1.0f / (float)divisor : 0.0f;
}

/* out[c] = acc[c] * scale: finishes a bag (out may equal acc). */
static inline EMBD_HOST_DEVICE void embd_pool_finish(float *out, const float *acc, float scale,
						     uint32_t cols)
{
	for (uint32_t c = 0; c < cols; c++)
		out[c] = acc[c] * scale;
}

/*
 * The scale of a bag's gradient: its pool scale (embd_pool_scale), divided by grad_divisor
 * when that is above 1 (TorchRec's gradient division: dL/d(pooled) divided by the number of
 * trainers, so that a learning rate means the same as with its sharded modules).
 */
static inline EMBD_HOST_DEVICE float embd_grad_scale(enum embd_pooling pooling, int64_t divisor,
						     uint32_t grad_divisor)
{
	float s = embd_pool_scale(pooling, divisor);
	return grad_divisor > 1 ? s / (float)grad_divisor : s;
}

/* d(out)/d(row_k) of one occurrence: its per-id weight (1 when unweighted) times the bag's
 * gradient scale. */
static inline EMBD_HOST_DEVICE float embd_grad_coef(float weight, float scale)
{
	return weight * scale;
}

/* grad_row[c] = coef * dy[c] + 0: a row's first occurrence, as embd_grad_accum_row on a zeroed
 * row gives it (the same fmaf, so -0 products become +0 alike), without zeroing the row first. */
static inline EMBD_HOST_DEVICE void embd_grad_first_row(float *EMBD_RESTRICT grad_row,
							const float *EMBD_RESTRICT dy, float coef,
							uint32_t cols)
{
	for (uint32_t c = 0; c < cols; c++)
		grad_row[c] = fmaf(coef, dy[c], 0.0f);
}

/* grad_row[c] += coef * dy[c]: adds one occurrence's share of dL/d(pooled) to a row's gradient. */
static inline EMBD_HOST_DEVICE void embd_grad_accum_row(float *EMBD_RESTRICT grad_row,
							const float *EMBD_RESTRICT dy, float coef,
							uint32_t cols)
{
	for (uint32_t c = 0; c < cols; c++)
		grad_row[c] = fmaf(coef, dy[c], grad_row[c]);
}

#endif /* EMBD_KERNELS_POOL_ROW_H */
