/*
 * dist/comm_nccl.c - the NCCL engine of dist/comm.h: one communicator per local GPU
 * spanning every global rank, buffers in device memory. Built only with CUDA (EMBD_HAVE_NCCL);
 * plain C over the CUDA runtime and NCCL's C API, no device code.
 *
 * The idea: the communicator is non-blocking (ncclConfig_t.blocking = 0), so no NCCL call can
 * hang. Every call (init included) is followed by polling ncclCommGetAsyncError and the
 * stream until they finish, fail, or options.timeout_ms pass; then the communicator is
 * aborted (ncclCommAbort), which is NCCL's only way out of a collective a peer never joins.
 * The unique id travels through embd's store: rank 0 sets <prefix>nccl_id, the others get it.
 * Collectives return when their work on the GPU is complete.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "embd/types.h"
#include "common/clock.h"
#include "dist/comm_internal.h"
#include "dist/store.h"

#define POLL_US 20              /* between two looks at a running operation */

struct nccl_engine {
	ncclComm_t comm;        /* NULL once aborted */
	cudaStream_t stream;
	int *barrier_word;      /* one int of device memory, reduced by barrier */
	int device;
	int timeout_ms;
};

static int cuda_fail(struct embd_comm *comm, const char *op, cudaError_t e)
{
	int rc = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
			 e == cudaErrorInvalidDevice
		 ? EMBD_ENOTSUP
		 : e == cudaErrorMemoryAllocation ? EMBD_ENOMEM : EMBD_EIO;
	return embd_comm_fail(comm, rc, "%s: CUDA: %s", op, cudaGetErrorString(e));
}

static int nccl_fail(struct embd_comm *comm, struct nccl_engine *n, const char *op,
		     ncclResult_t r)
{
	int rc;
	switch (r) {
	case ncclInvalidArgument:
	case ncclInvalidUsage:
		rc = EMBD_EINVAL;
		break;
	case ncclRemoteError:
		rc = EMBD_ECONNRESET;   /* a peer failed or went away */
		break;
	case ncclSystemError:
	case ncclUnhandledCudaError:
	case ncclInternalError:
	default:
		rc = EMBD_EIO;
	}
	const char *last = n && n->comm ? ncclGetLastError(n->comm) : NULL;
	return embd_comm_fail(comm, rc, "%s: NCCL %s%s%s", op, ncclGetErrorString(r),
			      last && *last ? ": " : "", last ? last : "");
}

/* Gives up on the communicator: nothing can complete on it any more. */
static void abort_comm(struct nccl_engine *n)
{
	if (n->comm)
		ncclCommAbort(n->comm);
	n->comm = NULL;
}

/*
 * Waits until the communicator has no call in progress and (with stream set) the stream's
 * work is done. A failure or the deadline aborts the communicator.
 */
static int finish(struct embd_comm *comm, struct nccl_engine *n, const char *op,
		  ncclResult_t r, bool stream)
{
	int64_t deadline = embd_now_ms() + n->timeout_ms;
	for (;;) {
		if (r == ncclInProgress || r == ncclSuccess) {
			ncclResult_t async = ncclSuccess;
			ncclResult_t q = ncclCommGetAsyncError(n->comm, &async);
			r = q != ncclSuccess ? q : async;
		}
		if (r != ncclSuccess && r != ncclInProgress) {
			int rc = nccl_fail(comm, n, op, r);
			abort_comm(n);
			return rc;
		}
		if (r == ncclSuccess) {
			cudaError_t e = stream ? cudaStreamQuery(n->stream) : cudaSuccess;
			if (e == cudaSuccess)
				return 0;
			if (e != cudaErrorNotReady) {
				int rc = cuda_fail(comm, op, e);
				abort_comm(n);
				return rc;
			}
		}
		if (embd_now_ms() >= deadline) {
			abort_comm(n);
			return embd_comm_fail(comm, EMBD_ETIMEDOUT,
					      "%s: not complete after %d ms (a peer did not join "
					      "or stalled); communicator aborted", op, n->timeout_ms);
		}
		usleep(POLL_US);
	}
}

static int exchange_id(struct embd_comm *comm, const struct embd_comm_options *o,
		       struct embd_store *store, ncclUniqueId *id)
{
	char key[EMBD_STORE_KEY_MAX + 1];
	snprintf(key, sizeof(key), "%snccl_id", o->prefix ? o->prefix : "");
	if (o->rank == 0) {
		ncclResult_t r = ncclGetUniqueId(id);
		if (r != ncclSuccess)
			return nccl_fail(comm, NULL, "rendezvous", r);
		int rc = embd_store_set(store, key, id, sizeof(*id));
		return rc < 0 ? embd_comm_fail(comm, rc, "rendezvous: %s", embd_store_error(store))
			      : 0;
	}
	void *v = NULL;
	size_t len = 0;
	embd_store_set_timeout(store, o->timeout_ms);
	int rc = embd_store_get(store, key, &v, &len);
	if (rc < 0)
		return embd_comm_fail(comm, rc, "rendezvous: rank 0 did not publish the NCCL id: %s",
				      embd_store_error(store));
	if (len != sizeof(*id)) {
		free(v);
		return embd_comm_fail(comm, EMBD_EPROTO, "rendezvous: '%s' holds %zu bytes, an "
				      "ncclUniqueId has %zu", key, len, sizeof(*id));
	}
	memcpy(id, v, sizeof(*id));
	free(v);
	return 0;
}

static void nccl_destroy(void *p)
{
	struct nccl_engine *n = p;
	if (!n)
		return;
	cudaSetDevice(n->device);
	if (n->comm) {
		/* finalize flushes outstanding work; destroy frees. Both may take a while. */
		ncclResult_t r = ncclCommFinalize(n->comm), async = ncclInProgress;
		int64_t deadline = embd_now_ms() + n->timeout_ms;
		while (r == ncclSuccess && async == ncclInProgress && embd_now_ms() < deadline) {
			if (ncclCommGetAsyncError(n->comm, &async) != ncclSuccess)
				break;
			if (async == ncclInProgress)
				usleep(POLL_US);
		}
		if (r == ncclSuccess && async == ncclSuccess)
			ncclCommDestroy(n->comm);
		else
			ncclCommAbort(n->comm);
	}
	if (n->barrier_word)
		cudaFree(n->barrier_word);
	if (n->stream)
		cudaStreamDestroy(n->stream);
	free(n);
}

static int nccl_create(struct embd_comm *comm, const struct embd_comm_options *o,
		       struct embd_store *store)
{
	ncclUniqueId id;
	ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
	cudaError_t e;
	int rc;
	struct nccl_engine *n = calloc(1, sizeof(*n));
	if (!n)
		return embd_comm_fail(comm, EMBD_ENOMEM, "out of memory");
	n->device = o->cuda_device;
	n->timeout_ms = o->timeout_ms;
	if ((e = cudaSetDevice(o->cuda_device)) != cudaSuccess ||
	    (e = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking)) != cudaSuccess ||
	    (e = cudaMalloc((void **)&n->barrier_word, sizeof(int))) != cudaSuccess) {
		rc = cuda_fail(comm, "cuda device", e);
		goto out;
	}
	if ((rc = exchange_id(comm, o, store, &id)) < 0)
		goto out;
	config.blocking = 0;
	ncclResult_t r = ncclCommInitRankConfig(&n->comm, (int)o->size, id, (int)o->rank,
						&config);
	if (r != ncclSuccess && r != ncclInProgress) {
		n->comm = NULL;
		rc = nccl_fail(comm, NULL, "rendezvous: ncclCommInitRankConfig", r);
		goto out;
	}
	if ((rc = finish(comm, n, "rendezvous: ncclCommInitRankConfig", r, false)) < 0)
		goto out;
	comm->impl = n;
	return 0;
out:
	nccl_destroy(n);
	return rc;
}

static int nccl_alltoallv(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
			  void *recv, const uint64_t *recv_bytes)
{
	struct nccl_engine *n = comm->impl;
	const uint8_t *s = send;
	uint8_t *d = recv;
	uint64_t s_off = 0, d_off = 0;
	ncclResult_t r = ncclGroupStart();
	for (uint32_t p = 0; p < comm->size && (r == ncclSuccess || r == ncclInProgress); p++) {
		if (send_bytes[p])
			r = ncclSend(s + s_off, send_bytes[p], ncclUint8, (int)p, n->comm, n->stream);
		if (recv_bytes[p] && (r == ncclSuccess || r == ncclInProgress))
			r = ncclRecv(d + d_off, recv_bytes[p], ncclUint8, (int)p, n->comm, n->stream);
		s_off += send_bytes[p];
		d_off += recv_bytes[p];
	}
	ncclResult_t end = ncclGroupEnd();
	if (r == ncclSuccess || r == ncclInProgress)
		r = end;
	return finish(comm, n, "alltoallv", r, true);
}

static int nccl_allreduce(struct embd_comm *comm, void *data, size_t count,
			  enum embd_comm_dtype dtype)
{
	struct nccl_engine *n = comm->impl;
	ncclResult_t r = ncclAllReduce(data, data, count,
				       dtype == EMBD_COMM_F32 ? ncclFloat32 : ncclUint64, ncclSum,
				       n->comm, n->stream);
	return finish(comm, n, "allreduce", r, true);
}

static int nccl_broadcast(struct embd_comm *comm, void *data, size_t bytes, uint32_t root)
{
	struct nccl_engine *n = comm->impl;
	ncclResult_t r = ncclBroadcast(data, data, bytes, ncclUint8, (int)root, n->comm,
				       n->stream);
	return finish(comm, n, "broadcast", r, true);
}

static int nccl_barrier(struct embd_comm *comm)
{
	struct nccl_engine *n = comm->impl;
	ncclResult_t r = ncclAllReduce(n->barrier_word, n->barrier_word, 1, ncclInt32, ncclSum,
				       n->comm, n->stream);
	return finish(comm, n, "barrier", r, true);
}

const struct embd_comm_engine embd_comm_nccl_engine = {
	.name = "nccl",
	.create = nccl_create,
	.destroy = nccl_destroy,
	.alltoallv = nccl_alltoallv,
	.allreduce = nccl_allreduce,
	.broadcast = nccl_broadcast,
	.barrier = nccl_barrier,
};
