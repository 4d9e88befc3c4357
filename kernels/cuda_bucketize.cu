/*
 * Block bucketize on the GPU (TorchRec's row-wise input split), with the output order of
 * embd_jagged_bucketize(): bucket-major, then feature-major, then sample, ids in input order.
 *   1. lengths  check every length >= 0 and copy it: later stages read only this copy
 *   2. offsets  inclusive sum -> each segment's end; one thread checks the total
 *   3. count    a warp per (feature, sample) checks its ids, stores each id's bucket and counts
 *               (bucket, feature, sample) with one atomic per bucket per 32 ids
 *   4. starts   exclusive sum of the counts: where each output segment begins
 *   5. scatter  a warp per (feature, sample) places its ids, ranking lanes of one bucket with
 *               __match_any_sync and moving one cursor per output segment
 * The scatter uses the buckets stored by the count, so even values rewritten in between can
 * never push an output segment past what was counted for it.
 */
#include "kernels/cuda_internal.cuh"

#include <limits.h>

#include <cub/device/device_scan.cuh>

struct bucket_feature {
	int64_t rows;
	int64_t block;                  /* ceil(rows / num_buckets) */
};

static __global__ void lengths_kernel(const int32_t *lengths, uint64_t nseg, int64_t *len,
				      struct embd_cuda_fault *fault)
{
	uint64_t seg = (uint64_t)blockIdx.x * EMBD_CUDA_BLOCK + threadIdx.x;

	if (fault->code || seg >= nseg)
		return;
	int32_t l = lengths[seg];
	len[seg] = l;
	if (l < 0)
		embd_cuda_fault_note(fault, seg);
}

/* Latches stage 1's fault, or checks that the lengths add up to num_values. One thread. */
static __global__ void lengths_latch(const int64_t *len, const int64_t *end, uint64_t nseg,
				     uint64_t num_values, uint32_t B, uint32_t call,
				     struct embd_cuda_fault *fault)
{
	uint64_t key = fault->key;

	if (fault->code)
		return;
	fault->call = call;
	if (key != EMBD_CUDA_NO_FAULT) {
		fault->kind = EMBD_FAULT_LENGTH;
		fault->feature = (uint32_t)(key / B);
		fault->sample = (int64_t)(key % B);
		fault->value = len[key];
		fault->code = EMBD_EINVAL;
		return;
	}
	int64_t total = nseg ? end[nseg - 1] : 0;
	if ((uint64_t)total != num_values) {
		fault->key = 0;
		fault->kind = EMBD_FAULT_LENGTH_SUM;
		fault->sample = -1;
		fault->value = total;
		fault->arg1 = (int64_t)num_values;
		fault->code = EMBD_EINVAL;
	}
}

static __global__ void __launch_bounds__(EMBD_CUDA_BLOCK)
count_kernel(const int64_t *len, const int64_t *end, const int64_t *values,
	     const struct bucket_feature *feat, uint32_t F, uint32_t B, uint64_t nseg,
	     uint32_t *bucket, int32_t *out_lengths, struct embd_cuda_fault *fault)
{
	uint64_t seg = ((uint64_t)blockIdx.x * EMBD_CUDA_BLOCK + threadIdx.x) / 32;

	if (fault->code || seg >= nseg)
		return; /* the whole warp: seg is the same for its lanes */
	const uint32_t lane = threadIdx.x & 31, f = (uint32_t)(seg / B), b = (uint32_t)(seg % B);
	const struct bucket_feature ft = feat[f];
	const int64_t e = end[seg], s = e - len[seg];

	for (int64_t k0 = s; k0 < e; k0 += 32) {
		int64_t k = k0 + lane;
		uint32_t r = UINT32_MAX;
		bool bad = false;
		if (k < e) {
			int64_t id = values[k];
			bad = id < 0 || id >= ft.rows;
			if (!bad) {
				r = (uint32_t)(id / ft.block);
				bucket[k] = r;
			}
		}
		if (__ballot_sync(0xffffffffu, bad)) {
			if (lane == 0)
				embd_cuda_fault_note(fault, seg);
			return;
		}
		unsigned peers = __match_any_sync(0xffffffffu, r);
		if (k < e && lane == (uint32_t)__ffs(peers) - 1)
			atomicAdd(&out_lengths[((uint64_t)r * F + f) * B + b], __popc(peers));
	}
}

/* Latches stage 3's fault: the first id of that segment outside its table. One thread. */
static __global__ void values_latch(const int64_t *len, const int64_t *end, const int64_t *values,
				    const struct bucket_feature *feat, uint32_t B, uint32_t call,
				    struct embd_cuda_fault *fault)
{
	uint64_t seg = fault->key;

	if (fault->code || seg == EMBD_CUDA_NO_FAULT)
		return;
	const uint32_t f = (uint32_t)(seg / B);
	const int64_t e = end[seg], rows = feat[f].rows;
	fault->kind = EMBD_FAULT_CHANGED;
	for (int64_t k = e - len[seg]; k < e; k++) {
		int64_t id = values[k];
		if (id < 0 || id >= rows) {
			fault->kind = EMBD_FAULT_VALUE;
			fault->value = id;
			fault->arg1 = k;
			fault->arg2 = rows;
			break;
		}
	}
	fault->feature = f;
	fault->sample = (int64_t)(seg % B);
	fault->call = call;
	fault->code = fault->kind == EMBD_FAULT_VALUE ? EMBD_ERANGE : EMBD_EINVAL;
}

static __global__ void __launch_bounds__(EMBD_CUDA_BLOCK)
scatter_kernel(const int64_t *len, const int64_t *end, const int64_t *values, const float *weights,
	       const uint32_t *bucket, uint32_t F, uint32_t B, uint64_t nseg, int32_t *cursor,
	       int64_t *out_values, float *out_weights, uint64_t *out_permute,
	       struct embd_cuda_fault *fault)
{
	uint64_t seg = ((uint64_t)blockIdx.x * EMBD_CUDA_BLOCK + threadIdx.x) / 32;

	if (fault->code || seg >= nseg)
		return;
	const uint32_t lane = threadIdx.x & 31, f = (uint32_t)(seg / B), b = (uint32_t)(seg % B);
	const int64_t e = end[seg], s = e - len[seg];

	for (int64_t k0 = s; k0 < e; k0 += 32) {
		int64_t k = k0 + lane;
		bool have = k < e;
		uint32_t r = have ? bucket[k] : UINT32_MAX;
		unsigned peers = __match_any_sync(0xffffffffu, r);
		uint64_t q = ((uint64_t)r * F + f) * B + b;
		int32_t base = 0;
		if (have) {
			/* this warp alone owns the cursors of its (feature, sample) */
			base = cursor[q];
			uint64_t dst = (uint64_t)base + __popc(peers & ((1u << lane) - 1));
			out_values[dst] = values[k];
			if (weights)
				out_weights[dst] = weights[k];
			if (out_permute)
				out_permute[k] = dst;
		}
		__syncwarp(); /* every lane has read its cursor before the leaders move them */
		if (have && lane == (uint32_t)__ffs(peers) - 1)
			cursor[q] = base + __popc(peers);
		__syncwarp();
	}
}

static int check_args(const struct embd_bucketize_args *a, struct embd_kernel_err *err)
{
	uint64_t nseg = (uint64_t)a->num_features * a->batch_size;
	const char *missing = NULL;

	if (!a->num_buckets)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "num_buckets is 0");
	if (nseg > INT_MAX || nseg * a->num_buckets > INT_MAX || a->num_values > INT_MAX)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0,
					"%llu lengths x %u buckets or %llu values: at most 2^31 - 1 each",
					(unsigned long long)nseg, a->num_buckets,
					(unsigned long long)a->num_values);
	if (a->num_features && !a->feature_rows)
		missing = "feature_rows";
	else if (nseg && (!a->lengths || !a->out_lengths))
		missing = "lengths";
	else if (a->num_values && (!a->values || !a->out_values))
		missing = "values";
	else if (a->num_values && a->weights && !a->out_weights)
		missing = "out_weights";
	if (missing)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "%s is missing", missing);
	for (uint32_t f = 0; f < a->num_features; f++)
		if (a->feature_rows[f] <= 0)
			return embd_kernel_fail(err, EMBD_EINVAL, f, -1, a->feature_rows[f],
						"feature %u: table rows %lld must be > 0", f,
						(long long)a->feature_rows[f]);
	return 0;
}

int embd_cuda_bucketize(struct embd_cuda_ctx *ctx, const struct embd_bucketize_args *a,
			struct embd_kernel_err *err)
{
	const uint32_t F = a->num_features, B = a->batch_size, W = a->num_buckets;
	const uint64_t nseg = (uint64_t)F * B, nout = nseg * W, nval = a->num_values;
	struct embd_cuda_carve cv = { NULL, 0 };
	struct bucket_feature *feat = NULL, *hfeat = NULL;
	int64_t *len = NULL, *end = NULL;
	int32_t *start = NULL;
	uint32_t *bucket = NULL;
	size_t t_inc = 0, t_exc = 0;
	void *temp = NULL;
	cudaError_t e = cudaSuccess;
	const char *what;
	int rc;

	rc = check_args(a, err);
	if (rc)
		return rc;
	cudaSetDevice(ctx->device);
	cub::DeviceScan::InclusiveSum(NULL, t_inc, len, end, (int)nseg, ctx->stream);
	cub::DeviceScan::ExclusiveSum(NULL, t_exc, a->out_lengths, start, (int)nout, ctx->stream);
	for (int pass = 0; pass < 2; pass++) {
		if (pass && (rc = embd_cuda_carve_alloc(ctx, &cv, err)))
			return rc;
		feat = (struct bucket_feature *)embd_cuda_carve_take(&cv, F * sizeof(*feat));
		len = (int64_t *)embd_cuda_carve_take(&cv, nseg * sizeof(*len));
		end = (int64_t *)embd_cuda_carve_take(&cv, nseg * sizeof(*end));
		start = (int32_t *)embd_cuda_carve_take(&cv, nout * sizeof(*start));
		bucket = (uint32_t *)embd_cuda_carve_take(&cv, nval * sizeof(*bucket));
		temp = embd_cuda_carve_take(&cv, t_inc > t_exc ? t_inc : t_exc);
	}

	rc = EMBD_ENOMEM;
	hfeat = (struct bucket_feature *)malloc((F ? F : 1) * sizeof(*hfeat));
	if (!hfeat) {
		embd_kernel_fail(err, rc, 0, -1, 0, "out of memory for %u features", F);
		goto out;
	}
	for (uint32_t f = 0; f < F; f++) {
		hfeat[f].rows = a->feature_rows[f];
		hfeat[f].block = (a->feature_rows[f] + W - 1) / W;
	}
	what = "copying the features";
	e = cudaMemcpyAsync(feat, hfeat, F * sizeof(*hfeat), cudaMemcpyHostToDevice, ctx->stream);
	if (e != cudaSuccess)
		goto done;

	{
		uint32_t call = ctx->calls++;
		unsigned seg_blocks = (unsigned)((nseg + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK);
		unsigned warp_blocks = (unsigned)((nseg * 32 + EMBD_CUDA_BLOCK - 1) / EMBD_CUDA_BLOCK);

		what = "bucketize stages 1-2";
		if (nseg) {
			lengths_kernel<<<seg_blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(a->lengths, nseg, len,
											 ctx->fault);
			e = cub::DeviceScan::InclusiveSum(temp, t_inc, len, end, (int)nseg, ctx->stream);
			if (e != cudaSuccess)
				goto done;
		}
		lengths_latch<<<1, 1, 0, ctx->stream>>>(len, end, nseg, nval, B ? B : 1, call, ctx->fault);
		e = cudaGetLastError();
		if (e != cudaSuccess || !nseg)
			goto done;
		what = "bucketize stages 3-5";
		e = cudaMemsetAsync(a->out_lengths, 0, nout * sizeof(*a->out_lengths), ctx->stream);
		if (e != cudaSuccess)
			goto done;
		count_kernel<<<warp_blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
			len, end, a->values, feat, F, B, nseg, bucket, a->out_lengths, ctx->fault);
		values_latch<<<1, 1, 0, ctx->stream>>>(len, end, a->values, feat, B, call, ctx->fault);
		e = cub::DeviceScan::ExclusiveSum(temp, t_exc, a->out_lengths, start, (int)nout, ctx->stream);
		if (e != cudaSuccess)
			goto done;
		scatter_kernel<<<warp_blocks, EMBD_CUDA_BLOCK, 0, ctx->stream>>>(
			len, end, a->values, a->weights, bucket, F, B, nseg, start, a->out_values,
			a->out_weights, a->out_permute, ctx->fault);
		e = cudaGetLastError();
	}
done:
	rc = e == cudaSuccess ? 0 : embd_cuda_fail(err, e, what);
out:
	free(hfeat);
	embd_cuda_scratch_free(ctx, cv.base);
	return rc;
}
