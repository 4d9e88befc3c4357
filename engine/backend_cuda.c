/*
 * The CUDA backend (engine/backend.h): rank r is visible GPU r (the runtime applies
 * CUDA_VISIBLE_DEVICES), with its own kernels/embedding_cuda.h context (a stream, the device
 * error word, stream-ordered scratch) and a device buffer the arrays of one kernel call are
 * copied into. Kept thin: the arithmetic is kernels/'s, the orchestration engine/ranks.c's.
 *
 * Shards: fused and dense rows in HBM with a host copy on the GPU's NUMA node (the host view,
 * refreshed by pull and push); fused_uvm rows in host memory on that node, registered pinned
 * and mapped so the kernels read and update them in place (the host view is those rows);
 * fused_uvm_caching rows as fused_uvm's plus slot rows in HBM that the kernels compute on
 * (engine/ranks_cache.c keeps the cache; kernels/cuda_cache.cu copies rows in and out).
 * The engine's arrays are host memory: ids, offsets and weights go over with one copy each,
 * pooled rows and gradients with one strided copy straight to and from their place in the
 * trainer's slab, which the service registers (host_register) so those copies are DMA.
 * Device outputs (export_*): a cuMemCreate allocation on the GPU a trainer names, exported as
 * a POSIX fd, through the driver's VMM API (common/cuda_driver.h: dlopen, so embd still starts
 * without a driver for CPU ranks).
 */
#include "engine/backend.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/cuda_driver.h"
#include "common/log.h"
#include "kernels/embedding_cuda.h"

/* GPUs one rank tracks peer access to (CUDA_VISIBLE_DEVICES numbering); beyond it, staged. */
#define EMBD_CUDA_MAX_PEERS 64

enum { PEER_UNKNOWN, PEER_ENABLED, PEER_NONE };

struct embd_backend_rank {
	int device;
	struct embd_cuda_ctx *ctx;
	uint8_t *scratch;               /* device memory for one call's arrays */
	uint64_t scratch_bytes;
	struct embd_bag_batch *dev;     /* the call's batches over the scratch */
	uint32_t dev_cap;
	void *comm_buf;                 /* the cluster exchanges' staging (comm_buffer) */
	uint64_t comm_bytes;
	void *partials;                 /* row-split partial sums (partial_buffer) */
	uint64_t partial_bytes;
	void *bounce;                   /* host staging of copy_peer without peer access */
	uint64_t bounce_bytes;
	/* peer access from this GPU to GPU d: unknown, enabled, or impossible (logged once) */
	uint8_t peer[EMBD_CUDA_MAX_PEERS];
};

/* A CUDA runtime failure as a kernel error: the call and the runtime's words. The thread's
 * last error is cleared, so that a later call's check does not report this one again. */
static int cuda_fail(struct embd_kernel_err *err, cudaError_t e, const char *what)
{
	cudaGetLastError();
	err->feature = 0;
	err->sample = -1;
	err->id = -1;
	snprintf(err->msg, sizeof(err->msg), "%s: %s", what, cudaGetErrorString(e));
	return e == cudaErrorMemoryAllocation ? EMBD_ENOMEM : EMBD_EIO;
}

static int cuda_fail_msg(char *msg, size_t len, cudaError_t e, const char *what)
{
	struct embd_kernel_err ke;
	int rc = cuda_fail(&ke, e, what);

	snprintf(msg, len, "%s", ke.msg);
	return rc;
}

static int cuda_count(uint32_t *count, char *err, size_t err_len)
{
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);

	*count = 0;
	if (e != cudaSuccess) {
		snprintf(err, err_len, "no CUDA device: cudaGetDeviceCount: %s (%s)",
			 cudaGetErrorString(e), cudaGetErrorName(e));
		return EMBD_ENOTSUP;
	}
	if (n <= 0) {
		snprintf(err, err_len, "no CUDA device: cudaGetDeviceCount found none");
		return EMBD_ENOTSUP;
	}
	*count = (uint32_t)n;
	return 0;
}

/* /sys/bus/pci/devices/<bus id>/numa_node of the GPU; -1 when unknown. */
static int cuda_numa_node(uint32_t rank)
{
	char bus[32], path[96];
	int node = -1;

	if (cudaDeviceGetPCIBusId(bus, sizeof(bus), (int)rank) != cudaSuccess)
		return -1;
	for (char *c = bus; *c; c++)
		*c = (char)tolower((unsigned char)*c);     /* sysfs names are lower case */
	snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", bus);
	FILE *f = fopen(path, "re");
	if (!f)
		return -1;
	if (fscanf(f, "%d", &node) != 1)
		node = -1;
	fclose(f);
	return node;
}

static int cuda_rank_open(uint32_t rank, struct embd_backend_rank **out, char *err,
			  size_t err_len)
{
	struct embd_backend_rank *r = calloc(1, sizeof(*r));
	char inner[192];

	*out = NULL;
	if (!r)
		return EMBD_ENOMEM;
	r->device = (int)rank;
	int rc = embd_cuda_ctx_create(r->device, NULL, &r->ctx, inner, sizeof(inner));
	if (rc) {
		snprintf(err, err_len, "GPU %u: %s", rank, inner);
		free(r);
		return rc;
	}
	*out = r;
	return 0;
}

static void cuda_rank_close(struct embd_backend_rank *r)
{
	if (!r)
		return;
	cudaSetDevice(r->device);
	embd_cuda_ctx_destroy(r->ctx);
	cudaFree(r->scratch);
	cudaFree(r->comm_buf);
	cudaFree(r->partials);
	cudaFreeHost(r->bounce);
	free(r->dev);
	free(r);
}

/* fused_uvm: the host view's memory pinned and mapped; the kernels' shard over its device
 * addresses. */
static int map_host_rows(struct embd_backend_rank *r, const struct embd_shard_desc *desc,
			 struct embd_backend_shard *out, char *err, size_t err_len)
{
	void *dptr[3] = { NULL, NULL, NULL };
	cudaError_t e = cudaSuccess;
	int done = 0;

	cudaSetDevice(r->device);
	for (; done < 3; done++) {
		if (!out->mem[done])
			continue;
		e = cudaHostRegister(out->mem[done], out->bytes[done],
				     cudaHostRegisterMapped | cudaHostRegisterPortable);
		if (e != cudaSuccess)
			break;
		e = cudaHostGetDevicePointer(&dptr[done], out->mem[done], 0);
		if (e != cudaSuccess) {
			cudaHostUnregister(out->mem[done]);
			break;
		}
	}
	if (e != cudaSuccess) {
		for (int j = 0; j < done; j++)
			if (out->mem[j])
				cudaHostUnregister(out->mem[j]);
		return cuda_fail_msg(err, err_len, e, "registering fused_uvm rows (cudaHostRegister; "
				     "is the locked memory limit, LimitMEMLOCK, high enough?)");
	}
	out->registered = true;
	return embd_shard_create_in(desc, dptr[0], dptr[1], dptr[2], &out->shard, err, err_len);
}

static void unmap_host_rows(struct embd_backend_shard *s)
{
	for (int i = 0; i < 3; i++)
		if (s->mem[i])
			cudaHostUnregister(s->mem[i]);
	s->registered = false;
}

static int cuda_shard_alloc(struct embd_backend_rank *r, bool numa, int node,
			    const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			    struct embd_backend_shard *out, char *err, size_t err_len)
{
	int rc;

	if ((rc = embd_backend_host_shard(numa, node, desc, out, err, err_len)))
		return rc;
	out->kernel = kernel;
	if (kernel == EMBD_KERNEL_FUSED_UVM || kernel == EMBD_KERNEL_FUSED_UVM_CACHING) {
		/* caching: the slots come from slots_resize (engine/ranks_cache.c) */
		rc = map_host_rows(r, desc, out, err, err_len);
		if (rc && out->registered)
			unmap_host_rows(out);
	} else {
		/* fused and dense: HBM (dense: the service still applies the optimizer, docs) */
		rc = embd_cuda_shard_create(r->ctx, desc, &out->shard, err, err_len);
		if (!rc)
			out->device_bytes = out->bytes[0] + out->bytes[1] + out->bytes[2];
	}
	if (rc)
		embd_backend_host_shard_free(numa, out);
	return rc;
}

static void cuda_shard_free(struct embd_backend_rank *r, bool numa, struct embd_backend_shard *s)
{
	cudaSetDevice(r->device);
	if (s->kernel == EMBD_KERNEL_FUSED_UVM || s->kernel == EMBD_KERNEL_FUSED_UVM_CACHING) {
		embd_shard_destroy(s->shard);   /* the struct: its rows are the host view's */
		unmap_host_rows(s);
		embd_cuda_shard_destroy(s->slots);
		s->slots = NULL;
	} else {
		embd_cuda_shard_destroy(s->shard);
	}
	s->shard = NULL;
	embd_backend_host_shard_free(numa, s);
}

static int drain(struct embd_backend_rank *r, int rc);

/* The three arrays of a shard (weights, momentum1, momentum2). */
static void arrays(const struct embd_shard *s, void *out[3])
{
	out[0] = s->weights;
	out[1] = s->momentum1;
	out[2] = s->momentum2;
}

/* After a call enqueued with rc: synchronised (0) or drained (a failure), its error in err. */
static int finish(struct embd_backend_rank *r, int rc, struct embd_kernel_err *ke, char *err,
		  size_t err_len)
{
	if (!rc)
		rc = embd_cuda_sync(r->ctx, ke);
	else
		drain(r, rc);
	if (rc)
		snprintf(err, err_len, "%s", ke->msg);
	return rc;
}

static int cuda_slots_resize(struct embd_backend_rank *r, struct embd_backend_shard *s,
			     uint64_t rows, uint64_t keep, char *err, size_t err_len)
{
	struct embd_shard_desc desc;
	struct embd_shard *slots = NULL;
	void *to[3], *from[3];
	cudaError_t e = cudaSuccess;
	int rc;

	cudaSetDevice(r->device);
	embd_backend_slots_desc(&s->host->desc, rows, &desc);
	if ((rc = embd_cuda_shard_create(r->ctx, &desc, &slots, err, err_len)))
		return rc;
	arrays(slots, to);
	if (s->slots && keep) {
		arrays(s->slots, from);
		for (int i = 0; i < 3 && e == cudaSuccess; i++)
			if (embd_backend_row_bytes(s, i))
				e = cudaMemcpyAsync(to[i], from[i], embd_backend_row_bytes(s, i) * keep,
						    cudaMemcpyDeviceToDevice,
						    embd_cuda_ctx_stream(r->ctx));
		if (e == cudaSuccess)
			e = cudaStreamSynchronize(embd_cuda_ctx_stream(r->ctx));
	}
	if (e != cudaSuccess) {
		embd_cuda_shard_destroy(slots);
		return cuda_fail_msg(err, err_len, e, "growing the cache rows");
	}
	if (s->slots) {
		slots->step = s->slots->step;
		slots->nonfinite_rows = s->slots->nonfinite_rows;
		slots->nonfinite_row = s->slots->nonfinite_row;
		embd_cuda_shard_destroy(s->slots);
	}
	s->slots = slots;
	s->slot_rows = rows;
	s->device_bytes = 0;
	for (int i = 0; i < 3; i++)
		s->device_bytes += embd_backend_row_bytes(s, i) * rows;
	return 0;
}

static int cuda_slots_copy(struct embd_backend_rank *r, struct embd_backend_shard *s,
			   const struct embd_cache_moves *m, char *err, size_t err_len)
{
	struct embd_kernel_err ke;
	void *host[3], *slots[3];
	uint64_t row_bytes[3];

	if (!m->num_writebacks && !m->num_fetches)
		return 0;
	cudaSetDevice(r->device);
	arrays(s->shard, host);         /* the mapped rows' device addresses */
	arrays(s->slots, slots);
	for (int i = 0; i < 3; i++)
		row_bytes[i] = embd_backend_row_bytes(s, i);
	return finish(r, embd_cuda_cache_copy(r->ctx, m, host, slots, row_bytes, &ke), &ke, err,
		      err_len);
}

static int cuda_pull(struct embd_backend_rank *r, struct embd_backend_shard *s, char *err,
		     size_t err_len)
{
	if (s->kernel != EMBD_KERNEL_FUSED_UVM)
		return embd_cuda_shard_copy(r->ctx, s->host, s->shard, err, err_len);
	/* the rows are the host view's already: only the work on them must be over */
	cudaSetDevice(r->device);
	cudaError_t e = cudaStreamSynchronize(embd_cuda_ctx_stream(r->ctx));
	if (e != cudaSuccess)
		return cuda_fail_msg(err, err_len, e, "cudaStreamSynchronize");
	s->host->step = s->shard->step;
	return 0;
}

static int cuda_push(struct embd_backend_rank *r, struct embd_backend_shard *s, char *err,
		     size_t err_len)
{
	if (s->kernel != EMBD_KERNEL_FUSED_UVM)
		return embd_cuda_shard_copy(r->ctx, s->shard, s->host, err, err_len);
	s->shard->step = s->host->step;
	return 0;
}

static uint64_t align256(uint64_t bytes)
{
	return (bytes + 255) & ~(uint64_t)255;
}

/* Device bytes of batch b's arrays: offsets, ids, weights, mean lengths, pooled rows. */
static uint64_t batch_bytes(const struct embd_bag_batch *b)
{
	const uint64_t B = b->batch_size, cols = b->shard ? b->shard->desc.cols : 0;

	return align256((B + 1) * 8) + align256(b->num_ids * 8) +
	       (b->weights ? align256(b->num_ids * 4) : 0) +
	       (b->mean_lengths ? align256(B * 4) : 0) + align256(B * cols * 4);
}

static int reserve(struct embd_backend_rank *r, uint64_t bytes, uint32_t n,
		   struct embd_kernel_err *err)
{
	if (n > r->dev_cap) {
		void *p = realloc(r->dev, n * sizeof(*r->dev));
		if (!p)
			return cuda_fail(err, cudaErrorMemoryAllocation, "batches");
		r->dev = p;
		r->dev_cap = n;
	}
	if (bytes <= r->scratch_bytes)
		return 0;
	uint64_t want = bytes + bytes / 2;      /* room to grow without a realloc every step */
	cudaFree(r->scratch);
	r->scratch = NULL;
	r->scratch_bytes = 0;
	cudaError_t e = cudaMalloc((void **)&r->scratch, want);
	if (e != cudaSuccess)
		return cuda_fail(err, e, "scratch (cudaMalloc)");
	r->scratch_bytes = want;
	return 0;
}

/* One host array to its place in the scratch; at moves past it. */
static cudaError_t put(struct embd_backend_rank *r, uint64_t *at, const void *src,
		       uint64_t bytes, void **dst)
{
	*dst = r->scratch + *at;
	*at += align256(bytes);
	if (!bytes)
		return cudaSuccess;
	return cudaMemcpyAsync(*dst, src, bytes, cudaMemcpyHostToDevice,
			       embd_cuda_ctx_stream(r->ctx));
}

/*
 * The batches' host arrays copied into the scratch and r->dev describing them there (pooled
 * rows dense, shard cols wide). grad: the gradients come in (backward); else the pooled rows
 * get their room (forward).
 */
static int stage(struct embd_backend_rank *r, const struct embd_bag_batch *b, uint32_t n,
		 bool grad, struct embd_kernel_err *err)
{
	cudaStream_t stream = embd_cuda_ctx_stream(r->ctx);
	uint64_t bytes = 0, at = 0;
	cudaError_t e = cudaSuccess;
	int rc;

	for (uint32_t i = 0; i < n; i++)
		bytes += batch_bytes(&b[i]);
	if ((rc = reserve(r, bytes, n, err)))
		return rc;
	for (uint32_t i = 0; i < n && e == cudaSuccess; i++) {
		const uint64_t B = b[i].batch_size, cols = b[i].shard ? b[i].shard->desc.cols : 0;
		struct embd_bag_batch *d = &r->dev[i];
		void *p;
		*d = b[i];
		e = put(r, &at, b[i].offsets, (B + 1) * 8, &p);
		d->offsets = p;
		if (e == cudaSuccess)
			e = put(r, &at, b[i].ids, b[i].num_ids * 8, &p);
		d->ids = p;
		if (e == cudaSuccess && b[i].weights) {
			e = put(r, &at, b[i].weights, b[i].num_ids * 4, &p);
			d->weights = p;
		}
		if (e == cudaSuccess && b[i].mean_lengths) {
			e = put(r, &at, b[i].mean_lengths, B * 4, &p);
			d->mean_lengths = p;
		}
		float *rows = (float *)(r->scratch + at);
		at += align256(B * cols * 4);
		d->pooled_stride = cols;
		d->pooled_col = 0;
		if (grad) {
			d->pooled_grad = rows;
			d->pooled = NULL;
			if (e == cudaSuccess && B && cols)
				e = cudaMemcpy2DAsync(rows, cols * 4, b[i].pooled_grad + b[i].pooled_col,
						      b[i].pooled_stride * 4, cols * 4, B,
						      cudaMemcpyHostToDevice, stream);
		} else {
			d->pooled = rows;
			d->pooled_grad = NULL;
		}
	}
	return e == cudaSuccess ? 0 : cuda_fail(err, e, "copying a batch to the GPU");
}

/* After a failure: the stream drained (host arrays may be in flight) and its errors cleared. */
static int drain(struct embd_backend_rank *r, int rc)
{
	struct embd_kernel_err ignored;

	embd_cuda_sync(r->ctx, &ignored);
	return rc;
}

static int cuda_forward(struct embd_backend_rank *r, const struct embd_exec *exec,
			const struct embd_bag_batch *b, uint32_t n, struct embd_kernel_err *err)
{
	cudaStream_t stream = embd_cuda_ctx_stream(r->ctx);
	cudaError_t e = cudaSuccess;
	int rc;

	(void)exec;
	cudaSetDevice(r->device);
	if ((rc = stage(r, b, n, false, err)) || (rc = embd_cuda_forward(r->ctx, r->dev, n, err)))
		return drain(r, rc);
	/* each bag's pooled row straight to its columns (of the trainer's slab, or a partial) */
	for (uint32_t i = 0; i < n && e == cudaSuccess; i++) {
		const uint64_t B = b[i].batch_size, cols = b[i].shard->desc.cols;
		if (B && cols)
			/* Default: the host slab, or this GPU's partial sums (partial_buffer) */
			e = cudaMemcpy2DAsync(b[i].pooled + b[i].pooled_col, b[i].pooled_stride * 4,
					      r->dev[i].pooled, cols * 4, cols * 4, B,
					      cudaMemcpyDefault, stream);
	}
	if (e != cudaSuccess)
		return drain(r, cuda_fail(err, e, "copying pooled rows from the GPU"));
	return embd_cuda_sync(r->ctx, err);
}

static int cuda_backward(struct embd_backend_rank *r, const struct embd_exec *exec,
			 struct embd_shard *shard, const struct embd_bag_batch *b, uint32_t n,
			 struct embd_kernel_err *err)
{
	int rc;

	(void)exec;
	cudaSetDevice(r->device);
	if ((rc = stage(r, b, n, true, err)) ||
	    (rc = embd_cuda_backward(r->ctx, shard, r->dev, n, err)))
		return drain(r, rc);
	return embd_cuda_sync(r->ctx, err);
}

static int cuda_host_register(struct embd_backend_rank *r, void *p, size_t bytes, char *err,
			      size_t err_len)
{
	/* any context registers for every GPU (portable); the calling thread's device stays */
	int current = r->device;
	cudaGetDevice(&current);
	cudaSetDevice(r->device);
	cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
	cudaSetDevice(current);
	if (e == cudaSuccess)
		return 0;
	/* memory registered already (by another caller) is refused as the CPU's record does:
	 * the caller keeps it unregistered and never unregisters the other's */
	return cuda_fail_msg(err, err_len, e, "cudaHostRegister");
}

static void cuda_host_unregister(struct embd_backend_rank *r, void *p)
{
	int current = r->device;
	cudaGetDevice(&current);
	cudaSetDevice(r->device);
	if (cudaHostUnregister(p) != cudaSuccess)
		cudaGetLastError();     /* never registered (the register failed): nothing to undo */
	cudaSetDevice(current);
}

/* *buf of at least `bytes` of r's device memory, grown to a power of two (from 1 MiB) so that
 * a step whose messages or batches grow a little does not reallocate; contents not kept. */
static int grow_device(struct embd_backend_rank *r, void **buf, uint64_t *have, uint64_t bytes,
		       const char *what, char *err, size_t err_len)
{
	cudaSetDevice(r->device);
	if (bytes <= *have)
		return 0;
	uint64_t want = 1ull << 20;
	while (want < bytes)
		want <<= 1;
	cudaFree(*buf);
	*buf = NULL;
	*have = 0;
	cudaError_t e = cudaMalloc(buf, want);
	if (e != cudaSuccess)
		return cuda_fail_msg(err, err_len, e, what);
	*have = want;
	return 0;
}

static int cuda_comm_buffer(struct embd_backend_rank *r, uint64_t bytes, void **out, char *err,
			    size_t err_len)
{
	int rc = grow_device(r, &r->comm_buf, &r->comm_bytes, bytes, "cudaMalloc (comm staging)",
			     err, err_len);

	*out = r->comm_buf;
	return rc;
}

static int cuda_comm_copy(struct embd_backend_rank *r, void *dst, const void *src,
			  uint64_t bytes, char *err, size_t err_len)
{
	cudaSetDevice(r->device);
	cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
	return e == cudaSuccess ? 0 : cuda_fail_msg(err, err_len, e, "cudaMemcpy (comm staging)");
}

/* ---- partial sums between the GPUs of the node ---------------------------------------------- */

static int cuda_partial_buffer(struct embd_backend_rank *r, uint64_t bytes, void **out,
			       char *err, size_t err_len)
{
	int rc = grow_device(r, &r->partials, &r->partial_bytes, bytes, "cudaMalloc (partial sums)",
			     err, err_len);

	*out = r->partials;
	return rc;
}

/*
 * Peer access from r's GPU to GPU `from`, enabled once (peer_open at the ranks' start; the
 * rank's own thread, whose current device is r's): true when it is. A pair the driver cannot connect
 * (cudaDeviceCanAccessPeer 0: no NVLink or P2P over PCIe between them) is logged once and
 * staged through host memory from then on.
 */
static bool peer_enabled(struct embd_backend_rank *r, int from)
{
	if (from == r->device)
		return true;
	if (from < 0 || from >= EMBD_CUDA_MAX_PEERS) {
		static bool logged;
		if (!__atomic_exchange_n(&logged, true, __ATOMIC_RELAXED))
			embd_log(EMBD_LOG_WARNING, "GPU %d is beyond the %d whose peer access embd "
				 "tracks: row-split partial sums with it are staged through host memory",
				 from, EMBD_CUDA_MAX_PEERS);
		return false;
	}
	if (r->peer[from] != PEER_UNKNOWN)
		return r->peer[from] == PEER_ENABLED;
	int can = 0;
	cudaError_t e = cudaDeviceCanAccessPeer(&can, r->device, from);
	if (e == cudaSuccess && can) {
		e = cudaDeviceEnablePeerAccess(from, 0);
		if (e == cudaErrorPeerAccessAlreadyEnabled)
			e = cudaSuccess;
	}
	if (e != cudaSuccess || !can) {
		cudaGetLastError();
		embd_log(EMBD_LOG_WARNING, "GPU %d cannot read GPU %d's memory (%s): row-split partial "
			 "sums between them are staged through host memory", r->device, from,
			 e != cudaSuccess ? cudaGetErrorString(e) : "cudaDeviceCanAccessPeer: no");
	}
	r->peer[from] = e == cudaSuccess && can ? PEER_ENABLED : PEER_NONE;
	return r->peer[from] == PEER_ENABLED;
}

static void cuda_peer_open(struct embd_backend_rank *r, struct embd_backend_rank *from)
{
	cudaSetDevice(r->device);
	peer_enabled(r, from->device);
}

static int cuda_copy_peer(struct embd_backend_rank *r, void *dst, struct embd_backend_rank *from,
			  const void *src, uint64_t bytes, bool *direct, char *err, size_t err_len)
{
	cudaStream_t stream = embd_cuda_ctx_stream(r->ctx);
	cudaError_t e;

	cudaSetDevice(r->device);
	*direct = peer_enabled(r, from->device);
	if (*direct) {
		e = cudaMemcpyPeerAsync(dst, r->device, src, from->device, bytes, stream);
	} else {
		if (bytes > r->bounce_bytes) {
			cudaFreeHost(r->bounce);
			r->bounce = NULL;
			r->bounce_bytes = 0;
			if ((e = cudaMallocHost(&r->bounce, bytes)) != cudaSuccess)
				return cuda_fail_msg(err, err_len, e, "cudaMallocHost (partial sums)");
			r->bounce_bytes = bytes;
		}
		/* the source GPU's work is over (an earlier embd_ranks_run): a plain copy reads it */
		e = cudaMemcpy(r->bounce, src, bytes, cudaMemcpyDefault);
		if (e == cudaSuccess)
			e = cudaMemcpyAsync(dst, r->bounce, bytes, cudaMemcpyHostToDevice, stream);
	}
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(stream);
	return e == cudaSuccess ? 0 : cuda_fail_msg(err, err_len, e, *direct ?
						    "cudaMemcpyPeerAsync (partial sums)" :
						    "copying partial sums through host memory");
}

static int cuda_add(struct embd_backend_rank *r, float *dst, const float *src, uint64_t n,
		    char *err, size_t err_len)
{
	struct embd_kernel_err ke;

	cudaSetDevice(r->device);
	return finish(r, embd_cuda_add(r->ctx, dst, src, n, &ke), &ke, err, err_len);
}

static int cuda_rows_out(struct embd_backend_rank *r, float *host, uint64_t stride,
			 const float *src, uint64_t rows, uint64_t cols, char *err, size_t err_len)
{
	cudaStream_t stream = embd_cuda_ctx_stream(r->ctx);
	cudaError_t e = cudaSuccess;

	cudaSetDevice(r->device);
	if (rows && cols)
		e = cudaMemcpy2DAsync(host, stride * 4, src, cols * 4, cols * 4, rows,
				      cudaMemcpyDeviceToHost, stream);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(stream);
	return e == cudaSuccess ? 0 : cuda_fail_msg(err, err_len, e, "copying summed rows from "
						    "the GPU");
}

/* ---- device outputs ------------------------------------------------------------------------ */

/* An export's state: the allocation, this process's mapping of it, and a stream for copies. */
struct cuda_export {
	const struct embd_cuda_driver *drv;
	int ordinal;                    /* the GPU in this process's numbering */
	embd_cu_mem_handle handle;
	bool created, mapped;
	embd_cu_ptr va;                 /* 0: no address range reserved */
	cudaStream_t stream;
};


/* The GPU with uuid among those this process sees: its ordinal and device, or EMBD_ENOENT
 * naming every GPU it does see. */
static int find_gpu(const struct embd_cuda_driver *d, const uint8_t uuid[16], int *ordinal,
		    embd_cu_device *dev, char *err, size_t err_len)
{
	char want[EMBD_CUDA_UUID_TEXT], seen[720] = "";     /* 8 GPUs, about 60 bytes each */
	size_t at = 0;
	embd_cu_result e;
	int n = 0;

	if ((e = d->cuInit(0)))
		return embd_cuda_driver_fail(d, e, "cuInit", err, err_len);
	if ((e = d->cuDeviceGetCount(&n)))
		return embd_cuda_driver_fail(d, e, "cuDeviceGetCount", err, err_len);
	for (int i = 0; i < n; i++) {
		char text[EMBD_CUDA_UUID_TEXT], bus[32] = "?";
		uint8_t u[16];
		if ((e = d->cuDeviceGet(dev, i)) || (e = d->cuDeviceGetUuid_v2(u, *dev)))
			return embd_cuda_driver_fail(d, e, "cuDeviceGetUuid_v2", err, err_len);
		if (!memcmp(u, uuid, sizeof(u))) {
			*ordinal = i;
			return 0;
		}
		d->cuDeviceGetPCIBusId(bus, (int)sizeof(bus), *dev);
		if (at < sizeof(seen))
			at += (size_t)snprintf(seen + at, sizeof(seen) - at, "%s%d %s (%s)",
					       i ? ", " : "", i, embd_cuda_uuid_text(u, text), bus);
	}
	snprintf(err, err_len, "no GPU %s among the %d this service sees (its "
		 "CUDA_VISIBLE_DEVICES): %s", embd_cuda_uuid_text(uuid, want), n, n ? seen : "none");
	return EMBD_ENOENT;
}

static void cuda_export_free(struct embd_export *out)
{
	struct cuda_export *x = out->state;

	if (x) {
		if (x->stream) {
			cudaSetDevice(x->ordinal);
			cudaStreamSynchronize(x->stream);
			cudaStreamDestroy(x->stream);
		}
		if (x->mapped)
			x->drv->cuMemUnmap(x->va, out->bytes);
		if (x->va)
			x->drv->cuMemAddressFree(x->va, out->bytes);
		if (x->created)
			x->drv->cuMemRelease(x->handle);   /* the trainer's import keeps its own */
		free(x);
	}
	if (out->fd >= 0)
		close(out->fd);
	*out = (struct embd_export){ .fd = -1 };
}

/* Whether the driver can export memory of dev as a POSIX fd; EMBD_ENOTSUP saying why not. */
static int check_exportable(const struct embd_cuda_driver *d, embd_cu_device dev,
			    const uint8_t uuid[16], char *err, size_t err_len)
{
	char text[EMBD_CUDA_UUID_TEXT];
	int vmm = 0, posix_fd = 0;
	embd_cu_result e;

	if ((e = d->cuDeviceGetAttribute(&vmm, EMBD_CU_ATTR_VMM_SUPPORTED, dev)) ||
	    (e = d->cuDeviceGetAttribute(&posix_fd, EMBD_CU_ATTR_POSIX_FD_SUPPORTED, dev)))
		return embd_cuda_driver_fail(d, e, "cuDeviceGetAttribute", err, err_len);
	if (!vmm || !posix_fd)
		return snprintf(err, err_len, "GPU %s: the driver %s", embd_cuda_uuid_text(uuid, text),
				!vmm ? "has no virtual memory management on it "
				       "(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)"
				     : "cannot export its memory as a POSIX file descriptor "
				       "(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)"),
		       EMBD_ENOTSUP;
	return 0;
}

static int cuda_export_alloc(const uint8_t uuid[16], uint64_t bytes, struct embd_export *out,
			     char *err, size_t err_len)
{
	const struct embd_cuda_driver *d;
	struct cuda_export *x;
	embd_cu_device dev = 0;
	size_t granularity = 0;
	embd_cu_result e = 0;
	const char *what = "";
	int rc, fd = -1;

	*out = (struct embd_export){ .memory = EMBD_EXPORT_CUDA, .fd = -1 };
	if ((rc = embd_cuda_driver(&d, err, err_len)))
		return rc;
	if (!(x = calloc(1, sizeof(*x))))
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	x->drv = d;
	out->state = x;
	if ((rc = find_gpu(d, uuid, &x->ordinal, &dev, err, err_len)) ||
	    (rc = check_exportable(d, dev, uuid, err, err_len)))
		goto out;
	/* this thread's current device: the copies run here, and the driver finds its context */
	cudaError_t ce = cudaSetDevice(x->ordinal);
	if (ce == cudaSuccess)
		ce = cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking);
	if (ce != cudaSuccess) {
		rc = cuda_fail_msg(err, err_len, ce, "cudaStreamCreateWithFlags (device outputs)");
		goto out;
	}
	const struct embd_cu_alloc_prop prop = {
		.type = EMBD_CU_MEM_ALLOCATION_PINNED,
		.requested_handle_types = EMBD_CU_MEM_HANDLE_POSIX_FD,
		.location = { EMBD_CU_MEM_LOCATION_DEVICE, dev },
	};
	const struct embd_cu_access_desc access = { { EMBD_CU_MEM_LOCATION_DEVICE, dev },
						    EMBD_CU_MEM_ACCESS_READWRITE };
	what = "cuMemGetAllocationGranularity";
	if ((e = d->cuMemGetAllocationGranularity(&granularity, &prop,
						  EMBD_CU_GRANULARITY_RECOMMENDED)))
		goto driver;
	out->bytes = (bytes + granularity - 1) / granularity * granularity;
	what = "cuMemCreate";
	if ((e = d->cuMemCreate(&x->handle, out->bytes, &prop, 0)))
		goto driver;
	x->created = true;
	what = "cuMemExportToShareableHandle";
	if ((e = d->cuMemExportToShareableHandle(&fd, x->handle, EMBD_CU_MEM_HANDLE_POSIX_FD, 0)))
		goto driver;
	out->fd = fd;
	what = "cuMemAddressReserve";
	if ((e = d->cuMemAddressReserve(&x->va, out->bytes, 0, 0, 0)))
		goto driver;
	what = "cuMemMap";
	if ((e = d->cuMemMap(x->va, out->bytes, 0, x->handle, 0)))
		goto driver;
	x->mapped = true;
	what = "cuMemSetAccess";
	if ((e = d->cuMemSetAccess(x->va, out->bytes, &access, 1)))
		goto driver;
	/* fresh memory may hold what an earlier owner left in it: the trainer sees zeros */
	ce = cudaMemsetAsync((void *)(uintptr_t)x->va, 0, out->bytes, x->stream);
	if (ce == cudaSuccess)
		ce = cudaStreamSynchronize(x->stream);
	if (ce != cudaSuccess) {
		rc = cuda_fail_msg(err, err_len, ce, "clearing device outputs");
		goto out;
	}
	return 0;
driver:
	rc = embd_cuda_driver_fail(d, e, what, err, err_len);
out:
	cuda_export_free(out);
	return rc;
}

static int cuda_export_copy(const struct embd_export *out, uint64_t offset, void *host,
			    uint64_t bytes, bool to_device, char *err, size_t err_len)
{
	const struct cuda_export *x = out->state;
	void *dev = (void *)(uintptr_t)(x->va + offset);
	cudaError_t e = cudaSetDevice(x->ordinal);

	if (e == cudaSuccess)
		e = cudaMemcpyAsync(to_device ? dev : host, to_device ? host : dev, bytes,
				    to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
				    x->stream);
	/* complete, not only enqueued: the trainer reads it once the request completes */
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(x->stream);
	return e == cudaSuccess ? 0 : cuda_fail_msg(err, err_len, e, to_device ?
						    "copying pooled rows to a trainer's GPU" :
						    "copying a gradient from a trainer's GPU");
}

const struct embd_backend embd_backend_cuda = {
	.name = "cuda",
	.count = cuda_count,
	.numa_node = cuda_numa_node,
	.rank_open = cuda_rank_open,
	.rank_close = cuda_rank_close,
	.shard_alloc = cuda_shard_alloc,
	.shard_free = cuda_shard_free,
	.pull = cuda_pull,
	.push = cuda_push,
	.forward = cuda_forward,
	.backward = cuda_backward,
	/* the GPU checks, sorts (cub) and applies each shard's ids on the device in one pass
	 * (kernels/cuda_backward.cu), from ids it stages itself: occurrences sorted on the host
	 * would have to cross PCIe per shard, so column shards keep the per-shard backward */
	.backward_apply = NULL,
	.slots_resize = cuda_slots_resize,
	.slots_copy = cuda_slots_copy,
	.host_register = cuda_host_register,
	.host_unregister = cuda_host_unregister,
	.comm_buffer = cuda_comm_buffer,
	.comm_copy = cuda_comm_copy,
	.partial_buffer = cuda_partial_buffer,
	.peer_open = cuda_peer_open,
	.copy_peer = cuda_copy_peer,
	.add = cuda_add,
	.rows_out = cuda_rows_out,
	.export_alloc = cuda_export_alloc,
	.export_copy = cuda_export_copy,
	.export_free = cuda_export_free,
};
