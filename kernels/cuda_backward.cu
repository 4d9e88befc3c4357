/*
 * Fused backward + optimizer on the GPU, with no dense gradient:
 *   1. collect  a warp per bag checks its offsets and ids, and writes each occurrence, in batch
 *               order, as key = shard-local row, value = (bag << 32) | bits of its coefficient;
 *               keys start as all ones, a row no shard has, so a slot no bag wrote (offsets
 *               that changed under the kernel) sorts last and is never applied
 *   2. latch    a bad offset or id is latched here; nothing below changes a row
 *   3. sort     cub's LSD radix sort over the row bits only; it is stable, so the occurrences
 *               of a row stay in batch order, the order the CPU sums them in
 *   4. runs     run-length encode the sorted rows; a prefix sum gives each run's start
 *   5. update   G lanes per unique row sum its occurrences' dL/d(pooled) with pool_row.h and
 *               apply optim_row.h to the row once (a persistent grid over the runs); a row
 *               left NaN or infinite (weights as stored, or state) is counted, and the lowest
 *               such row kept, in the call's record (cuda_internal.cuh), as the CPU does
 * Bit for bit the CPU's result, except rowwise_adagrad's sum of squares: a tree over lanes.
 */
#include "kernels/cuda_internal.cuh"

#include <limits.h>
#include <stdlib.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#define DY_IN_FLIGHT 4                  /* gradient rows loaded before the first is added */

template <typename K>
static __global__ void __launch_bounds__(EMBD_CUDA_BLOCK)
collect_kernel(const struct embd_cuda_bags *descs, uint32_t n, uint64_t total_bags, K *keys,
	       uint64_t *vals, const float **bag_dy, struct embd_cuda_fault *fault)
{
	if (fault->code)
		return;
	uint64_t g = ((uint64_t)blockIdx.x * EMBD_CUDA_BLOCK + threadIdx.x) / 32;
	if (g >= total_bags)
		return;
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t i = embd_cuda_bags_find(descs, n, g);
	const struct embd_cuda_bags d = descs[i];
	const uint64_t b = g - d.bag_base;
	const uint64_t key = (uint64_t)i << 32 | b;
	const int64_t s = d.offsets[b], e = d.offsets[b + 1];

	/* the bags must tile [0, num_ids): every occurrence slot gets written exactly once */
	bool cover = (b == 0 && s != 0) || (b + 1 == d.batch_size && (uint64_t)e != d.num_ids);
	if (cover || s < 0 || s > e || (uint64_t)e > d.num_ids) {
		if (lane == 0)
			embd_cuda_fault_note(fault, key);
		return;
	}
	int64_t divisor = d.mean_lengths ? d.mean_lengths[b] : e - s;
	float scale = embd_grad_scale(d.mean ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM, divisor,
				      d.grad_divisor);
	if (lane == 0)
		bag_dy[g] = d.pooled_grad + b * d.pooled_stride;
	for (int64_t k0 = s; k0 < e; k0 += 32) {
		int64_t k = k0 + lane;
		bool bad = false;
		if (k < e) {
			uint64_t r = (uint64_t)d.ids[k] - d.row_offset; /* read once */
			bad = r >= d.num_rows;
			if (!bad) {
				float coef = embd_grad_coef(d.weights ? d.weights[k] : 1.0f, scale);
				keys[d.id_base + k] = (K)r;
				vals[d.id_base + k] = g << 32 | embd_f32_bits(coef);
			}
		}
		if (__ballot_sync(0xffffffffu, bad)) {
			if (lane == 0)
				embd_cuda_fault_note(fault, key);
			return;
		}
	}
}

/* The shard and the step: what the update needs besides the runs. */
struct update_args {
	void *w;
	float *m1, *m2;
	uint64_t num_rows;
	uint32_t cols;
	bool fp16;
	bool vec;                       /* w, m1, m2 rows may be accessed 4 elements at a time */
	struct embd_optim_params p;
	/* the call's non-finite record: rows counted, the lowest shard-local row */
	unsigned long long *nonfinite_rows, *nonfinite_first;
};

/* Whether any of this lane's 4 columns (those below cols) of x is NaN or infinite. */
static __device__ __forceinline__ bool nonfinite4(const float x[4], uint32_t c, uint32_t cols)
{
	bool bad = false;

#pragma unroll
	for (int j = 0; j < 4; j++)
		bad |= c + j < cols && embd_cuda_nonfinite(x[j]);
	return bad;
}

/* g[0..3] = this lane's columns of the row's gradient: its cnt occurrences v, in order. */
template <int G>
static __device__ __forceinline__ void row_grad(const uint64_t *v, uint32_t cnt,
						const float *const *bag_dy, uint32_t c, uint32_t cols,
						unsigned mask, uint32_t lane, float g[4])
{
	g[0] = g[1] = g[2] = g[3] = 0.0f;
	for (uint32_t t0 = 0; t0 < cnt; t0 += G) {
		/* the group fetches G occurrences and their rows' addresses at once */
		const float *dy = NULL;
		float coef = 0.0f;
		if (t0 + lane < cnt) {
			uint64_t o = v[t0 + lane];
			dy = bag_dy[o >> 32];
			coef = embd_bits_f32((uint32_t)o);
		}
		const uint32_t m = min((uint32_t)G, cnt - t0);
		uint32_t j = 0;
		for (; j + DY_IN_FLIGHT <= m; j += DY_IN_FLIGHT) {
			float x[DY_IN_FLIGHT][4], cj[DY_IN_FLIGHT];
#pragma unroll
			for (int u = 0; u < DY_IN_FLIGHT; u++) {
				const float *p = (const float *)__shfl_sync(mask, (unsigned long long)dy, j + u, G) + c;
				cj[u] = __shfl_sync(mask, coef, j + u, G);
				embd_cuda_load4<true>(p, ((uintptr_t)p & 15) == 0, c, cols, x[u]);
			}
#pragma unroll
			for (int u = 0; u < DY_IN_FLIGHT; u++)
				embd_grad_accum_row(g, x[u], cj[u], 4);
		}
		for (; j < m; j++) {
			float x[4];
			const float *p = (const float *)__shfl_sync(mask, (unsigned long long)dy, j, G) + c;
			float cu = __shfl_sync(mask, coef, j, G);
			embd_cuda_load4<true>(p, ((uintptr_t)p & 15) == 0, c, cols, x);
			embd_grad_accum_row(g, x, cu, 4);
		}
	}
}

/*
 * This lane's 4 weights of a row of the shard back from fp32 (rounded for fp16), and whether
 * any is NaN or infinite as stored: an fp32 weight above fp16's range is infinite as fp16.
 */
static __device__ __forceinline__ bool weights_store(const struct update_args &a, uint64_t row, uint32_t c,
						     const float w[4])
{
	if (!a.fp16) {
		embd_cuda_store4((float *)a.w + row * a.cols + c, a.vec, c, a.cols, w);
		return nonfinite4(w, c, a.cols);
	}
	bool bad = false;
	embd_cuda_store4((uint16_t *)a.w + row * a.cols + c, a.vec, c, a.cols, w);
#pragma unroll
	for (int j = 0; j < 4; j++)
		bad |= c + j < a.cols && embd_cuda_nonfinite_fp16(embd_fp32_to_fp16(w[j]));
	return bad;
}

/* The update of one row by its group; whether this lane's part of the row (weights, state)
 * came out NaN or infinite. */
template <int G>
static __device__ bool update_row(const struct update_args &a, uint64_t row, const uint64_t *v,
				  uint32_t cnt, const float *const *bag_dy, unsigned mask, uint32_t lane)
{
	const uint32_t cols = a.cols;
	const struct embd_optim_params *p = &a.p;
	float g[4], w[4];
	bool bad = false;

	if (p->type == EMBD_OPT_ROWWISE_ADAGRAD) {
		/* part 1 over the whole row (optim_row.h), then part 2; one chunk keeps g */
		float sum_sq = 0.0f;
		for (uint32_t c0 = 0; c0 < cols; c0 += 4 * G) {
			uint32_t c = c0 + 4 * lane;
			row_grad<G>(v, cnt, bag_dy, c, cols, mask, lane, g);
			embd_cuda_row_load4<false>(a.w, a.fp16, row, cols, c, a.vec, w);
#pragma unroll
			for (int j = 0; j < 4; j++) {
				float gd = embd_optim_decay(p, g[j], w[j]);
				if (c + j < cols)
					sum_sq = fmaf(gd, gd, sum_sq);
			}
		}
#pragma unroll
		for (int o = G / 2; o > 0; o /= 2)
			sum_sq += __shfl_xor_sync(mask, sum_sq, o, G);
		float mult = 0.0f;
		if (lane == 0) { /* one lane reads and writes the row's state */
			mult = embd_optim_rowwise_mult(p, &a.m1[row], sum_sq, cols);
			bad = embd_cuda_nonfinite(a.m1[row]);
		}
		mult = __shfl_sync(mask, mult, 0, G);
		for (uint32_t c0 = 0; c0 < cols; c0 += 4 * G) {
			uint32_t c = c0 + 4 * lane;
			if (cols > 4 * G)
				row_grad<G>(v, cnt, bag_dy, c, cols, mask, lane, g);
			embd_cuda_row_load4<false>(a.w, a.fp16, row, cols, c, a.vec, w);
#pragma unroll
			for (int j = 0; j < 4; j++)
				w[j] = embd_optim_rowwise_elem(p, w[j], g[j], mult);
			bad |= weights_store(a, row, c, w);
		}
		return bad;
	}
	for (uint32_t c0 = 0; c0 < cols; c0 += 4 * G) {
		uint32_t c = c0 + 4 * lane;
		float m1[4] = { 0.0f, 0.0f, 0.0f, 0.0f }, m2[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
		float *m1p = a.m1 ? a.m1 + row * cols + c : NULL;
		float *m2p = a.m2 ? a.m2 + row * cols + c : NULL;

		row_grad<G>(v, cnt, bag_dy, c, cols, mask, lane, g);
		embd_cuda_row_load4<false>(a.w, a.fp16, row, cols, c, a.vec, w);
		if (m1p)
			embd_cuda_load4<false>(m1p, a.vec, c, cols, m1);
		if (m2p)
			embd_cuda_load4<false>(m2p, a.vec, c, cols, m2);
#pragma unroll
		for (int j = 0; j < 4; j++)
			w[j] = embd_optim_elem(p, w[j], g[j], &m1[j], &m2[j]);
		bad |= weights_store(a, row, c, w);
		if (m1p) {
			embd_cuda_store4(m1p, a.vec, c, cols, m1);
			bad |= nonfinite4(m1, c, cols);
		}
		if (m2p) {
			embd_cuda_store4(m2p, a.vec, c, cols, m2);
			bad |= nonfinite4(m2, c, cols);
		}
	}
	return bad;
}

template <int G, typename K>
static __global__ void __launch_bounds__(EMBD_CUDA_BLOCK)
update_kernel(const K *rows, const uint32_t *run_start, const uint32_t *run_len,
	      const uint32_t *num_runs, const uint64_t *vals, const float *const *bag_dy,
	      struct update_args a, struct embd_cuda_fault *fault)
{
	if (fault->code)
		return; /* this call's collect, or an earlier call, failed: change nothing */
	const unsigned mask = embd_cuda_group_mask<G>();
	const uint32_t lane = threadIdx.x % G;
	const uint64_t groups = (uint64_t)gridDim.x * EMBD_CUDA_BLOCK / G;
	const uint32_t runs = *num_runs;

	for (uint64_t r = ((uint64_t)blockIdx.x * EMBD_CUDA_BLOCK + threadIdx.x) / G; r < runs; r += groups) {
		uint64_t row = rows[r];
		if (row >= a.num_rows) /* the run of unwritten slots */
			continue;
		bool bad = update_row<G>(a, row, vals + run_start[r], run_len[r], bag_dy, mask, lane);
		/* the whole group's row: once, by lane 0 (the group takes the same rows together) */
		if (__any_sync(mask, bad) && lane == 0) {
			atomicAdd(a.nonfinite_rows, 1ull);
			atomicMin(a.nonfinite_first, (unsigned long long)row);
		}
	}
}

static uint32_t bits_for(uint64_t x)
{
	return x ? 64 - (uint32_t)__builtin_clzll(x) : 0;
}

/* Stages 1-5 for a shard whose rows fit keys of type K. */
template <typename K>
static int backward_run(struct embd_cuda_ctx *ctx, const struct embd_cuda_bags *descs, uint32_t n,
			uint64_t bags, uint64_t ids, const struct update_args &a, uint64_t rows,
			uint32_t call, struct embd_kernel_err *err)
{
	const int N = (int)ids;
	/* enough bits for `rows` itself: all ones then sorts apart from every real row */
	const int end_bit = (int)bits_for(rows);
	size_t t_sort = 0, t_rle = 0, t_scan = 0;
	struct embd_cuda_carve cv = { NULL, 0 };
	K *keys_in = NULL, *keys_out = NULL, *uniq = NULL;
	uint64_t *vals_in = NULL, *vals_out = NULL;
	uint32_t *run_len = NULL, *run_start = NULL, *num_runs = NULL;
	const float **bag_dy = NULL;
	void *temp = NULL;
	cudaError_t e;
	const char *what;
	int rc;

	/* the sizes cub needs: these calls only compute them */
	cub::DeviceRadixSort::SortPairs(NULL, t_sort, keys_in, keys_out, vals_in, vals_out, N, 0, end_bit,
					ctx->stream);
	cub::DeviceRunLengthEncode::Encode(NULL, t_rle, keys_out, uniq, run_len, num_runs, N, ctx->stream);
	cub::DeviceScan::ExclusiveSum(NULL, t_scan, run_len, run_start, N, ctx->stream);
	size_t t_max = t_sort > t_rle ? t_sort : t_rle;
	t_max = t_max > t_scan ? t_max : t_scan;

	/* one pass to size, one to place */
	for (int pass = 0; pass < 2; pass++) {
		if (pass && (rc = embd_cuda_carve_alloc(ctx, &cv, err)))
			return rc;
		keys_in = (K *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(K));
		keys_out = (K *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(K));
		uniq = (K *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(K));
		vals_in = (uint64_t *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(uint64_t));
		vals_out = (uint64_t *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(uint64_t));
		run_len = (uint32_t *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(uint32_t));
		run_start = (uint32_t *)embd_cuda_carve_take(&cv, (uint64_t)N * sizeof(uint32_t));
		num_runs = (uint32_t *)embd_cuda_carve_take(&cv, sizeof(uint32_t));
		bag_dy = (const float **)embd_cuda_carve_take(&cv, bags * sizeof(*bag_dy));
		temp = embd_cuda_carve_take(&cv, t_max);
	}

	unsigned blocks = (unsigned)((bags * 32 + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK);
	what = "clearing the sort keys";
	e = cudaMemsetAsync(keys_in, 0xff, (uint64_t)N * sizeof(K), ctx->stream);
	if (e != cudaSuccess)
		goto fail;
	what = "launching the backward collect kernel";
	collect_kernel<K><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(descs, n, bags, keys_in, vals_in,
									bag_dy, ctx->fault);
	e = cudaGetLastError();
	if (e != cudaSuccess)
		goto fail;
	rc = embd_cuda_bags_latch(ctx, descs, true, call, err);
	if (rc)
		goto out;
	if (N) {
		/* a stopped call sorts what collect left; update then returns before reading it */
		what = "cub radix sort";
		e = cub::DeviceRadixSort::SortPairs(temp, t_sort, keys_in, keys_out, vals_in, vals_out, N,
						    0, end_bit, ctx->stream);
		if (e == cudaSuccess) {
			what = "cub run-length encode";
			e = cub::DeviceRunLengthEncode::Encode(temp, t_rle, keys_out, uniq, run_len,
							       num_runs, N, ctx->stream);
		}
		if (e == cudaSuccess) {
			what = "cub exclusive sum";
			e = cub::DeviceScan::ExclusiveSum(temp, t_scan, run_len, run_start, N, ctx->stream);
		}
		if (e != cudaSuccess)
			goto fail;
		int G = embd_cuda_group_lanes(a.cols);
		uint64_t want = ((uint64_t)N * G + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK;
		uint64_t resident = (uint64_t)ctx->num_sms * (2048 / EMBD_CUDA_BLOCK);
		blocks = (unsigned)(want < resident ? want : resident);
		what = "launching the backward update kernel";
		if (G == 8)
			update_kernel<8, K><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
				uniq, run_start, run_len, num_runs, vals_out, bag_dy, a, ctx->fault);
		else if (G == 16)
			update_kernel<16, K><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
				uniq, run_start, run_len, num_runs, vals_out, bag_dy, a, ctx->fault);
		else
			update_kernel<32, K><<<blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
				uniq, run_start, run_len, num_runs, vals_out, bag_dy, a, ctx->fault);
		e = cudaGetLastError();
		if (e != cudaSuccess)
			goto fail;
	}
	rc = 0;
	goto out;
fail:
	rc = embd_cuda_fail(err, e, what);
out:
	embd_cuda_scratch_free(ctx, cv.base);
	return rc;
}

int embd_cuda_backward(struct embd_cuda_ctx *ctx, struct embd_shard *shard,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err)
{
	const struct embd_shard_desc *d;
	struct embd_cuda_bags *descs = NULL;
	uint64_t bags = 0, ids = 0;
	int rc;

	if (!shard)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "no shard");
	d = &shard->desc;
	cudaSetDevice(ctx->device);
	if ((rc = embd_cuda_bwd_reserve(ctx, err)))
		return rc;
	rc = embd_cuda_bags_prepare(ctx, batches, n, shard, &descs, &bags, &ids, err);
	if (rc)
		return rc;
	if (ids > INT_MAX) {
		embd_cuda_scratch_free(ctx, descs);
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "%llu ids in one call, at most 2^31 - 1",
					(unsigned long long)ids);
	}

	struct update_args a;
	a.w = shard->weights;
	a.m1 = shard->momentum1;
	a.m2 = shard->momentum2;
	a.num_rows = (uint64_t)d->rows;
	a.cols = d->cols;
	a.fp16 = d->dtype == EMBD_DTYPE_FP16;
	a.vec = d->cols % 4 == 0 && embd_cuda_aligned16(a.w) && embd_cuda_aligned16(a.m1) && embd_cuda_aligned16(a.m2);
	a.p = embd_optim_params_make(&d->optimizer, shard->step + 1);
	a.nonfinite_rows = ctx->nonfinite.rows + ctx->num_bwd;
	a.nonfinite_first = ctx->nonfinite.first + ctx->num_bwd;
	uint32_t call = ctx->calls++;
	if (bags) {
		if ((uint64_t)d->rows <= UINT32_MAX) /* all ones stays above every row */
			rc = backward_run<uint32_t>(ctx, descs, n, bags, ids, a, (uint64_t)d->rows, call, err);
		else
			rc = backward_run<uint64_t>(ctx, descs, n, bags, ids, a, (uint64_t)d->rows, call, err);
	}
	embd_cuda_scratch_free(ctx, descs);
	if (rc)
		return rc;
	shard->step++;
	ctx->bwd[ctx->num_bwd].shard = shard;
	ctx->bwd[ctx->num_bwd].call = call;
	ctx->num_bwd++;
	return 0;
}
