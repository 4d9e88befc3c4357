/*
 * The CUDA kernels' host side: contexts (a stream, its fault word, a memory pool), device
 * shards, the batch descriptors of forward and backward, the latch that turns a fault key into
 * an error record, and embd_cuda_sync(), which reports it, rolls back the steps of the
 * backward calls that were stopped and adds the rows each backward left non-finite to its
 * shard. See cuda_internal.cuh for the fault protocol and the non-finite records.
 */
#include "kernels/cuda_internal.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int embd_cuda_fail(struct embd_kernel_err *err, cudaError_t e, const char *what)
{
	int code = e == cudaErrorMemoryAllocation ? EMBD_ENOMEM : EMBD_EIO;

	cudaGetLastError(); /* clears a non-sticky error so the context stays usable */
	return embd_kernel_fail(err, code, 0, -1, 0, "%s: %s (%s)", what, cudaGetErrorString(e),
				cudaGetErrorName(e));
}

int embd_cuda_device_count(int *count)
{
	cudaError_t e = cudaGetDeviceCount(count);

	if (e != cudaSuccess) {
		/* no device, no driver, or a driver too old: this machine has no usable GPU */
		cudaGetLastError();
		*count = 0;
	}
	return 0;
}

static const struct embd_cuda_fault fault_clear = { EMBD_CUDA_NO_FAULT, 0, 0, 0, 0, 0, 0, 0, 0 };

int embd_cuda_ctx_create(int device, cudaStream_t stream, struct embd_cuda_ctx **out, char *err,
			 size_t err_len)
{
	struct embd_cuda_ctx *ctx;
	struct embd_kernel_err ke;
	cudaMemPoolProps props;
	uint64_t keep_bytes = UINT64_MAX;
	cudaError_t e;
	const char *what;
	int rc;

	*out = NULL;
	ctx = (struct embd_cuda_ctx *)calloc(1, sizeof(*ctx));
	if (!ctx) {
		snprintf(err, err_len, "out of memory");
		return EMBD_ENOMEM;
	}
	ctx->device = device;
	what = "cudaSetDevice";
	e = cudaSetDevice(device);
	if (e == cudaSuccess) {
		what = "cudaDeviceGetAttribute(multiProcessorCount)";
		e = cudaDeviceGetAttribute(&ctx->num_sms, cudaDevAttrMultiProcessorCount, device);
	}
	if (e == cudaSuccess && !stream) {
		what = "cudaStreamCreateWithFlags";
		e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
		ctx->owns_stream = e == cudaSuccess;
	}
	ctx->stream = stream;
	if (e == cudaSuccess) {
		memset(&props, 0, sizeof(props));
		props.allocType = cudaMemAllocationTypePinned;
		props.location.type = cudaMemLocationTypeDevice;
		props.location.id = device;
		what = "cudaMemPoolCreate";
		e = cudaMemPoolCreate(&ctx->pool, &props);
	}
	if (e == cudaSuccess) {
		/* keep freed scratch in the pool across syncs: every step needs it again */
		what = "cudaMemPoolSetAttribute(ReleaseThreshold)";
		e = cudaMemPoolSetAttribute(ctx->pool, cudaMemPoolAttrReleaseThreshold, &keep_bytes);
	}
	if (e == cudaSuccess) {
		what = "cudaMalloc(fault word)";
		e = cudaMalloc((void **)&ctx->fault, sizeof(*ctx->fault));
	}
	if (e == cudaSuccess) {
		what = "clearing the fault word";
		e = cudaMemcpyAsync(ctx->fault, &fault_clear, sizeof(fault_clear),
				    cudaMemcpyHostToDevice, ctx->stream);
	}
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(ctx->stream);
	if (e != cudaSuccess) {
		rc = embd_cuda_fail(&ke, e, what);
		snprintf(err, err_len, "GPU %d: %s", device, ke.msg);
		embd_cuda_ctx_destroy(ctx);
		return rc;
	}
	*out = ctx;
	return 0;
}

void embd_cuda_ctx_destroy(struct embd_cuda_ctx *ctx)
{
	if (!ctx)
		return;
	cudaSetDevice(ctx->device);
	if (ctx->stream)
		cudaStreamSynchronize(ctx->stream);
	cudaFree(ctx->fault);
	cudaFree(ctx->nonfinite.rows);
	free(ctx->nonfinite.host);
	if (ctx->pool)
		cudaMemPoolDestroy(ctx->pool);
	if (ctx->owns_stream)
		cudaStreamDestroy(ctx->stream);
	free(ctx->bwd);
	free(ctx);
}

cudaStream_t embd_cuda_ctx_stream(const struct embd_cuda_ctx *ctx)
{
	return ctx->stream;
}

int embd_cuda_scratch(struct embd_cuda_ctx *ctx, void **p, uint64_t bytes, struct embd_kernel_err *err)
{
	cudaError_t e = cudaMallocFromPoolAsync(p, bytes ? bytes : 1, ctx->pool, ctx->stream);

	return e == cudaSuccess ? 0 : embd_cuda_fail(err, e, "scratch memory");
}

int embd_cuda_carve_alloc(struct embd_cuda_ctx *ctx, struct embd_cuda_carve *c,
			  struct embd_kernel_err *err)
{
	int rc = embd_cuda_scratch(ctx, (void **)&c->base, c->used, err);

	c->used = 0;
	return rc;
}

void embd_cuda_scratch_free(struct embd_cuda_ctx *ctx, void *p)
{
	if (p)
		cudaFreeAsync(p, ctx->stream);
}

/* The message of a latched fault, in the CPU kernels' words. */
static void fault_message(const struct embd_cuda_fault *f, struct embd_kernel_err *err)
{
	long long s = (long long)f->sample, v = (long long)f->value;
	long long a1 = (long long)f->arg1, a2 = (long long)f->arg2;

	switch (f->kind) {
	case EMBD_FAULT_BAG_OFFSETS:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "feature %u sample %lld: offsets [%lld, %lld) not inside the %lld ids",
				 f->feature, s, v, a1, a2);
		break;
	case EMBD_FAULT_BAG_COVER:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "feature %u: offsets must run from 0 to num_ids %lld, found %lld at sample %lld",
				 f->feature, a2, v, s);
		break;
	case EMBD_FAULT_BAG_ID:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "feature %u sample %lld: id %lld outside the shard's rows [%lld, %lld)",
				 f->feature, s, v, a1, a2);
		break;
	case EMBD_FAULT_LENGTH:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "feature %u sample %lld: length %lld is negative", f->feature, s, v);
		break;
	case EMBD_FAULT_LENGTH_SUM:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "lengths add up to %lld, num_values is %lld", v, a1);
		break;
	case EMBD_FAULT_VALUE:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "feature %u sample %lld: id %lld (value %lld) outside [0, %lld)",
				 f->feature, s, v, a1, a2);
		break;
	default:
		embd_kernel_fail(err, f->code, f->feature, f->sample, f->value,
				 "feature %u sample %lld: device data changed while it was checked",
				 f->feature, s);
		break;
	}
}

int embd_cuda_bwd_reserve(struct embd_cuda_ctx *ctx, struct embd_kernel_err *err)
{
	struct embd_cuda_nonfinite *nf = &ctx->nonfinite;
	unsigned long long *dev = NULL;
	const char *what = "cudaMalloc (non-finite row records)";
	cudaError_t e;

	if (ctx->num_bwd < ctx->cap_bwd)
		return 0;
	size_t cap = ctx->cap_bwd ? 2 * ctx->cap_bwd : 16;
	void *p = realloc(ctx->bwd, cap * sizeof(*ctx->bwd));
	if (!p)
		return embd_kernel_fail(err, EMBD_ENOMEM, 0, -1, 0, "out of memory");
	ctx->bwd = (struct embd_cuda_bwd_call *)p;
	p = realloc(nf->host, 2 * cap * sizeof(*nf->host));
	if (!p)
		return embd_kernel_fail(err, EMBD_ENOMEM, 0, -1, 0, "out of memory");
	nf->host = (unsigned long long *)p;
	e = cudaMalloc((void **)&dev, 2 * cap * sizeof(*dev));
	if (e == cudaSuccess) {
		what = "clearing the non-finite row records";
		e = cudaMemsetAsync(dev, 0, cap * sizeof(*dev), ctx->stream);
	}
	if (e == cudaSuccess)
		e = cudaMemsetAsync(dev + cap, 0xff, cap * sizeof(*dev), ctx->stream);
	/* the calls enqueued so far may still be adding to the old records: copied after them */
	if (e == cudaSuccess && nf->cap) {
		what = "copying the non-finite row records";
		e = cudaMemcpyAsync(dev, nf->rows, nf->cap * sizeof(*dev), cudaMemcpyDeviceToDevice,
				    ctx->stream);
		if (e == cudaSuccess)
			e = cudaMemcpyAsync(dev + cap, nf->first, nf->cap * sizeof(*dev),
					    cudaMemcpyDeviceToDevice, ctx->stream);
	}
	if (e == cudaSuccess) {
		what = "waiting for the non-finite row records";
		e = cudaStreamSynchronize(ctx->stream);
	}
	if (e != cudaSuccess) {
		cudaFree(dev);
		return embd_cuda_fail(err, e, what);
	}
	cudaFree(nf->rows);
	nf->rows = dev;
	nf->first = dev + cap;
	nf->cap = cap;
	ctx->cap_bwd = cap;
	return 0;
}

/*
 * The non-finite records of the backward calls since the last sync, copied to the host: added
 * to their shards as embd_kernels_backward adds them. A call stopped by a fault updated no row,
 * so its record is empty.
 */
static void nonfinite_apply(struct embd_cuda_ctx *ctx)
{
	const struct embd_cuda_nonfinite *nf = &ctx->nonfinite;
	const size_t n = ctx->num_bwd;

	for (size_t i = 0; i < n; i++) {
		struct embd_shard *sh = ctx->bwd[i].shard;
		if (!nf->host[i])
			continue;
		sh->nonfinite_rows += nf->host[i];
		sh->nonfinite_row = sh->desc.row_offset + (int64_t)nf->host[n + i];
	}
}

/* The records of the calls since the last sync cleared for the next calls (stream ordered). */
static cudaError_t nonfinite_clear(struct embd_cuda_ctx *ctx)
{
	struct embd_cuda_nonfinite *nf = &ctx->nonfinite;
	const size_t n = ctx->num_bwd;
	cudaError_t e = cudaMemsetAsync(nf->rows, 0, n * sizeof(*nf->rows), ctx->stream);

	if (e == cudaSuccess)
		e = cudaMemsetAsync(nf->first, 0xff, n * sizeof(*nf->first), ctx->stream);
	return e;
}

int embd_cuda_sync(struct embd_cuda_ctx *ctx, struct embd_kernel_err *err)
{
	struct embd_cuda_nonfinite *nf = &ctx->nonfinite;
	const size_t n = ctx->num_bwd;
	struct embd_cuda_fault f;
	struct embd_kernel_err ke;
	cudaError_t e;
	int rc = 0;

	cudaSetDevice(ctx->device);
	e = cudaStreamSynchronize(ctx->stream);
	if (e == cudaSuccess)
		e = cudaMemcpyAsync(&f, ctx->fault, sizeof(f), cudaMemcpyDeviceToHost, ctx->stream);
	if (e == cudaSuccess && n)
		e = cudaMemcpyAsync(nf->host, nf->rows, n * sizeof(*nf->host), cudaMemcpyDeviceToHost,
				    ctx->stream);
	if (e == cudaSuccess && n)
		e = cudaMemcpyAsync(nf->host + n, nf->first, n * sizeof(*nf->host),
				    cudaMemcpyDeviceToHost, ctx->stream);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(ctx->stream);
	if (e == cudaSuccess && n)
		nonfinite_apply(ctx);
	if (n) {
		/* cleared even when the copy failed: the next calls must not count these rows */
		cudaError_t ce = nonfinite_clear(ctx);
		e = e == cudaSuccess ? ce : e;
	}
	if (e != cudaSuccess) {
		rc = embd_cuda_fail(err ? err : &ke, e, "waiting for the GPU");
		goto out;
	}
	if (f.code) {
		rc = f.code;
		if (err)
			fault_message(&f, err);
		for (size_t i = 0; i < ctx->num_bwd; i++)
			if (ctx->bwd[i].call >= f.call)
				ctx->bwd[i].shard->step--;
		e = cudaMemcpyAsync(ctx->fault, &fault_clear, sizeof(fault_clear),
				    cudaMemcpyHostToDevice, ctx->stream);
		if (e == cudaSuccess)
			e = cudaStreamSynchronize(ctx->stream);
		if (e != cudaSuccess)
			rc = embd_cuda_fail(err ? err : &ke, e, "clearing the fault word");
	}
out:
	ctx->calls = 0;
	ctx->num_bwd = 0;
	return rc;
}

/* ---- shards ------------------------------------------------------------------------------- */

int embd_cuda_shard_create(struct embd_cuda_ctx *ctx, const struct embd_shard_desc *desc,
			   struct embd_shard **out, char *err, size_t err_len)
{
	uint64_t wb, m1b, m2b;
	uint8_t *mem = NULL;
	struct embd_kernel_err ke;
	cudaError_t e;
	int rc;

	*out = NULL;
	rc = embd_shard_sizes(desc, &wb, &m1b, &m2b, err, err_len);
	if (rc)
		return rc;
	uint64_t m1_at = embd_cuda_align(wb), m2_at = m1_at + embd_cuda_align(m1b);
	cudaSetDevice(ctx->device);
	e = cudaMalloc((void **)&mem, m2_at + m2b);
	if (e == cudaSuccess && m1b + m2b)
		e = cudaMemsetAsync(mem + m1_at, 0, m2_at + m2b - m1_at, ctx->stream);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(ctx->stream);
	if (e != cudaSuccess) {
		rc = embd_cuda_fail(&ke, e, "device shard");
		snprintf(err, err_len, "table %u: %llu bytes: %s", desc->table_id,
			 (unsigned long long)(m2_at + m2b), ke.msg);
		cudaFree(mem);
		return rc;
	}
	rc = embd_shard_create_in(desc, mem, m1b ? (float *)(mem + m1_at) : NULL,
				  m2b ? (float *)(mem + m2_at) : NULL, out, err, err_len);
	if (rc)
		cudaFree(mem);
	return rc;
}

void embd_cuda_shard_destroy(struct embd_shard *shard)
{
	if (!shard)
		return;
	cudaFree(shard->weights); /* the one allocation that also holds the state */
	shard->weights = NULL;
	embd_shard_destroy(shard);
}

int embd_cuda_shard_copy(struct embd_cuda_ctx *ctx, struct embd_shard *dst,
			 const struct embd_shard *src, char *err, size_t err_len)
{
	const struct embd_shard_desc *a = &dst->desc, *b = &src->desc;
	uint64_t wb, m1b, m2b;
	struct embd_kernel_err ke;
	cudaError_t e;
	int rc;

	if (a->rows != b->rows || a->cols != b->cols || a->dtype != b->dtype ||
	    a->optimizer.type != b->optimizer.type) {
		snprintf(err, err_len, "shards differ: %lld x %u dtype %d optimizer %d vs %lld x %u dtype %d optimizer %d",
			 (long long)a->rows, a->cols, (int)a->dtype, (int)a->optimizer.type,
			 (long long)b->rows, b->cols, (int)b->dtype, (int)b->optimizer.type);
		return EMBD_EINVAL;
	}
	rc = embd_shard_sizes(b, &wb, &m1b, &m2b, err, err_len);
	if (rc)
		return rc;
	cudaSetDevice(ctx->device);
	e = cudaMemcpyAsync(dst->weights, src->weights, wb, cudaMemcpyDefault, ctx->stream);
	if (e == cudaSuccess && m1b)
		e = cudaMemcpyAsync(dst->momentum1, src->momentum1, m1b, cudaMemcpyDefault, ctx->stream);
	if (e == cudaSuccess && m2b)
		e = cudaMemcpyAsync(dst->momentum2, src->momentum2, m2b, cudaMemcpyDefault, ctx->stream);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(ctx->stream);
	if (e != cudaSuccess) {
		rc = embd_cuda_fail(&ke, e, "copying a shard");
		snprintf(err, err_len, "%s", ke.msg);
		return rc;
	}
	dst->step = src->step;
	return 0;
}

/* ---- bag batches -------------------------------------------------------------------------- */

int embd_cuda_bags_prepare(struct embd_cuda_ctx *ctx, const struct embd_bag_batch *batches,
			   uint32_t n, struct embd_shard *shard, struct embd_cuda_bags **descs,
			   uint64_t *total_bags, uint64_t *total_ids, struct embd_kernel_err *err)
{
	bool backward = shard != NULL;
	struct embd_cuda_bags *h;
	uint64_t bags = 0, ids = 0;
	cudaError_t e;
	int rc;

	*descs = NULL;
	for (uint32_t i = 0; i < n; i++) {
		const struct embd_bag_batch *bt = &batches[i];
		if (backward && bt->shard && bt->shard != shard)
			return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, -1, 0,
						"feature %u: batch names another shard", bt->feature);
		if (backward && !bt->batch_size && bt->num_ids)
			return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, -1, 0,
						"feature %u: %llu ids in no bags", bt->feature,
						(unsigned long long)bt->num_ids);
		rc = embd_bag_batch_check(bt, backward ? shard : bt->shard, backward, err);
		if (rc)
			return rc;
		bags += bt->batch_size;
		ids += bt->num_ids;
	}
	if (bags > UINT32_MAX)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "%llu bags in one call, at most 2^32 - 1",
					(unsigned long long)bags);
	*total_bags = bags;
	*total_ids = ids;
	h = (struct embd_cuda_bags *)calloc(n ? n : 1, sizeof(*h));
	if (!h)
		return embd_kernel_fail(err, EMBD_ENOMEM, 0, -1, 0, "out of memory for %u batches", n);
	bags = ids = 0;
	for (uint32_t i = 0; i < n; i++) {
		const struct embd_bag_batch *bt = &batches[i];
		const struct embd_shard *sh = backward ? shard : bt->shard;
		const struct embd_shard_desc *d = &sh->desc;
		struct embd_cuda_bags *o = &h[i];

		o->offsets = bt->offsets;
		o->ids = bt->ids;
		o->weights = bt->weights;
		o->mean_lengths = bt->mean_lengths;
		o->rows = sh->weights;
		o->pooled = bt->pooled ? bt->pooled + bt->pooled_col : NULL;
		o->pooled_grad = bt->pooled_grad ? bt->pooled_grad + bt->pooled_col : NULL;
		o->pooled_stride = bt->pooled_stride;
		o->row_offset = (uint64_t)d->row_offset;
		o->num_rows = (uint64_t)d->rows;
		o->num_ids = bt->num_ids;
		o->bag_base = bags;
		o->id_base = ids;
		o->batch_size = bt->batch_size;
		o->cols = d->cols;
		o->feature = bt->feature;
		o->grad_divisor = bt->grad_divisor;
		o->fp16 = d->dtype == EMBD_DTYPE_FP16;
		o->mean = bt->pooling == EMBD_POOLING_MEAN;
		/* a row starts 16 (fp32) or 8 (fp16) bytes aligned when cols is a multiple of 4 */
		o->vec_rows = d->cols % 4 == 0 && embd_cuda_aligned16(sh->weights);
		const float *pp = backward ? o->pooled_grad : o->pooled;
		o->vec_pooled = d->cols % 4 == 0 && (bt->batch_size <= 1 || bt->pooled_stride % 4 == 0) &&
				embd_cuda_aligned16(pp);
		bags += bt->batch_size;
		ids += bt->num_ids;
	}
	rc = embd_cuda_scratch(ctx, (void **)descs, (uint64_t)(n ? n : 1) * sizeof(*h), err);
	if (!rc) {
		/* from pageable memory: staged before the call returns, so h may be freed now */
		e = cudaMemcpyAsync(*descs, h, (uint64_t)n * sizeof(*h), cudaMemcpyHostToDevice,
				    ctx->stream);
		if (e != cudaSuccess) {
			rc = embd_cuda_fail(err, e, "copying batch descriptors");
			embd_cuda_scratch_free(ctx, *descs);
			*descs = NULL;
		}
	}
	free(h);
	return rc;
}

/*
 * The first fault of one bag, found serially: what the parallel kernels found first. Returns
 * the code (0 if the bag is fine now) and fills kind, value, arg1, arg2.
 */
static __device__ int bag_fault(const struct embd_cuda_bags *d, uint64_t b, bool cover,
				struct embd_cuda_fault *f)
{
	int64_t s = d->offsets[b], e = d->offsets[b + 1];

	f->arg2 = (int64_t)d->num_ids;
	if (cover && ((b == 0 && s != 0) || (b + 1 == d->batch_size && (uint64_t)e != d->num_ids))) {
		f->kind = EMBD_FAULT_BAG_COVER;
		f->value = b == 0 && s != 0 ? s : e;
		return EMBD_EINVAL;
	}
	if (s < 0 || s > e || (uint64_t)e > d->num_ids) {
		f->kind = EMBD_FAULT_BAG_OFFSETS;
		f->value = s;
		f->arg1 = e;
		return EMBD_EINVAL;
	}
	for (int64_t k = s; k < e; k++) {
		int64_t id = d->ids[k];
		if ((uint64_t)id - d->row_offset >= d->num_rows) {
			f->kind = EMBD_FAULT_BAG_ID;
			f->value = id;
			f->arg1 = (int64_t)d->row_offset;
			f->arg2 = (int64_t)(d->row_offset + d->num_rows);
			return EMBD_ERANGE;
		}
	}
	return 0;
}

static __global__ void bags_latch_kernel(const struct embd_cuda_bags *descs, bool cover, uint32_t call,
					 struct embd_cuda_fault *fault)
{
	uint64_t key = fault->key;

	if (fault->code || key == EMBD_CUDA_NO_FAULT)
		return;
	const struct embd_cuda_bags *d = &descs[key >> 32];
	uint64_t b = key & 0xffffffffu;
	int code = bag_fault(d, b, cover, fault);
	if (!code) {
		fault->kind = EMBD_FAULT_CHANGED;
		code = EMBD_EINVAL;
	}
	fault->feature = d->feature;
	fault->sample = (int64_t)b;
	fault->call = call;
	fault->code = code;
}

int embd_cuda_bags_latch(struct embd_cuda_ctx *ctx, const struct embd_cuda_bags *descs, bool cover,
			 uint32_t call, struct embd_kernel_err *err)
{
	cudaError_t e;

	bags_latch_kernel<<<1, 1, 0, ctx->stream>>>(descs, cover, call, ctx->fault);
	e = cudaGetLastError();
	return e == cudaSuccess ? 0 : embd_cuda_fail(err, e, "launching the fault latch");
}
