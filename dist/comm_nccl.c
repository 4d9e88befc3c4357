/*
 * dist/comm_nccl.c - the NCCL engine of dist/comm.h: one communicator per lane (a local GPU),
 * all of every node's in one clique over the global ranks (lane l of node n is global rank
 * n * lanes + l), buffers in device memory. Built only with CUDA (EMBD_HAVE_NCCL); plain C
 * over the CUDA runtime and NCCL's C API, no device code.
 *
 * The idea: the communicators are non-blocking (ncclConfig_t.blocking = 0), so no NCCL call
 * can hang. Every call (init included) is one group over the lanes (one thread drives all of
 * the node's GPUs, which NCCL allows only in a group), followed by polling each lane's
 * ncclCommGetAsyncError and stream until all finish, one fails, or options.timeout_ms pass;
 * then every lane is aborted (ncclCommAbort), NCCL's only way out of an operation a peer never
 * joins. The unique id travels through embd's store: node 0 sets <prefix>nccl_id, the others
 * get it (a new prefix per generation: new communicators). Calls return when their work on
 * the GPUs is complete.
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

struct nccl_lane {
	ncclComm_t comm;        /* NULL once aborted */
	cudaStream_t stream;
	int *barrier_word;      /* one int of device memory, reduced by barrier */
	int device;
};

struct nccl_engine {
	uint32_t lanes;
	int timeout_ms;
	struct nccl_lane lane[];
};

static bool ok(ncclResult_t r)
{
	return r == ncclSuccess || r == ncclInProgress;
}

static int cuda_fail(struct embd_comm *comm, const char *op, cudaError_t e)
{
	int rc = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
			 e == cudaErrorInvalidDevice
		 ? EMBD_ENOTSUP
		 : e == cudaErrorMemoryAllocation ? EMBD_ENOMEM : EMBD_EIO;
	return embd_comm_fail(comm, rc, "%s: CUDA: %s", op, cudaGetErrorString(e));
}

static int nccl_fail(struct embd_comm *comm, ncclComm_t c, const char *op, ncclResult_t r)
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
	const char *last = c ? ncclGetLastError(c) : NULL;
	return embd_comm_fail(comm, rc, "%s: NCCL %s%s%s", op, ncclGetErrorString(r),
			      last && *last ? ": " : "", last ? last : "");
}

/* Gives up on every lane: nothing can complete on them any more. */
static void abort_all(struct nccl_engine *n)
{
	for (uint32_t l = 0; l < n->lanes; l++) {
		if (n->lane[l].comm)
			ncclCommAbort(n->lane[l].comm);
		n->lane[l].comm = NULL;
	}
}

/* One lane's state: 1 done, 0 still running, < 0 failed (comm->err set). */
static int lane_done(struct embd_comm *comm, struct nccl_lane *ln, const char *op, bool stream)
{
	ncclResult_t async = ncclSuccess, q = ncclCommGetAsyncError(ln->comm, &async);
	ncclResult_t r = q != ncclSuccess ? q : async;
	if (r == ncclInProgress)
		return 0;
	if (r != ncclSuccess)
		return nccl_fail(comm, ln->comm, op, r);
	cudaError_t e = stream ? cudaStreamQuery(ln->stream) : cudaSuccess;
	if (e == cudaErrorNotReady)
		return 0;
	return e == cudaSuccess ? 1 : cuda_fail(comm, op, e);
}

/*
 * After a group over the lanes (r: what ncclGroupEnd or the calls returned): waits until
 * every lane has no call in progress and (with stream) its stream's work is done. A failure
 * or the deadline aborts every lane.
 */
static int finish(struct embd_comm *comm, struct nccl_engine *n, const char *op,
		  ncclResult_t r, bool stream)
{
	int64_t deadline = embd_now_ms() + n->timeout_ms;
	if (!ok(r)) {
		int rc = nccl_fail(comm, n->lane[0].comm, op, r);
		abort_all(n);
		return rc;
	}
	for (;;) {
		uint32_t done = 0;
		for (uint32_t l = 0; l < n->lanes; l++) {
			int d = lane_done(comm, &n->lane[l], op, stream);
			if (d < 0) {
				abort_all(n);
				return d;
			}
			done += (uint32_t)d;
		}
		if (done == n->lanes)
			return 0;
		if (embd_now_ms() >= deadline) {
			abort_all(n);
			return embd_comm_fail(comm, EMBD_ETIMEDOUT,
					      "%s: not complete after %d ms (a peer did not join "
					      "or stalled); communicators aborted", op, n->timeout_ms);
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
		return embd_comm_fail(comm, rc, "rendezvous: node 0 did not publish the NCCL id: %s",
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

/* finalize flushes outstanding work, destroy frees; a lane that does not finalize in time is
 * aborted. */
static void close_lane(struct nccl_lane *ln, int timeout_ms)
{
	cudaSetDevice(ln->device);
	if (ln->comm) {
		ncclResult_t r = ncclCommFinalize(ln->comm), async = ncclInProgress;
		int64_t deadline = embd_now_ms() + timeout_ms;
		while (r == ncclSuccess && async == ncclInProgress && embd_now_ms() < deadline) {
			if (ncclCommGetAsyncError(ln->comm, &async) != ncclSuccess)
				break;
			if (async == ncclInProgress)
				usleep(POLL_US);
		}
		if (ok(r) && async == ncclSuccess)
			ncclCommDestroy(ln->comm);
		else
			ncclCommAbort(ln->comm);
	}
	if (ln->barrier_word)
		cudaFree(ln->barrier_word);
	if (ln->stream)
		cudaStreamDestroy(ln->stream);
}

static void nccl_destroy(void *p)
{
	struct nccl_engine *n = p;
	if (!n)
		return;
	for (uint32_t l = 0; l < n->lanes; l++)
		close_lane(&n->lane[l], n->timeout_ms);
	free(n);
}

static int nccl_create(struct embd_comm *comm, const struct embd_comm_options *o,
		       struct embd_store *store)
{
	const uint32_t L = comm->lanes;
	ncclUniqueId id;
	cudaError_t e;
	int rc;
	struct nccl_engine *n = calloc(1, sizeof(*n) + L * sizeof(struct nccl_lane));
	if (!n)
		return embd_comm_fail(comm, EMBD_ENOMEM, "out of memory");
	n->lanes = L;
	n->timeout_ms = o->timeout_ms;
	for (uint32_t l = 0; l < L; l++) {
		struct nccl_lane *ln = &n->lane[l];
		ln->device = o->cuda_devices ? o->cuda_devices[l] : (int)l;
		if ((e = cudaSetDevice(ln->device)) != cudaSuccess ||
		    (e = cudaStreamCreateWithFlags(&ln->stream, cudaStreamNonBlocking)) !=
			    cudaSuccess ||
		    (e = cudaMalloc((void **)&ln->barrier_word, sizeof(int))) != cudaSuccess) {
			rc = cuda_fail(comm, "cuda device", e);
			goto out;
		}
	}
	if ((rc = exchange_id(comm, o, store, &id)) < 0)
		goto out;
	/* one thread initialises every lane: only in one group (NCCL's rule) */
	ncclResult_t r = ncclGroupStart();
	for (uint32_t l = 0; l < L && ok(r); l++) {
		ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
		config.blocking = 0;
		cudaSetDevice(n->lane[l].device);
		r = ncclCommInitRankConfig(&n->lane[l].comm, (int)(comm->size * L), id,
					   (int)(comm->rank * L + l), &config);
	}
	ncclResult_t end = ncclGroupEnd();
	if (ok(r))
		r = end;
	if (!ok(r)) {
		rc = nccl_fail(comm, NULL, "rendezvous: ncclCommInitRankConfig", r);
		abort_all(n);
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

/* Lane 0 alone (comm.c lets these run with one lane only). */
static int nccl_alltoallv(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
			  void *recv, const uint64_t *recv_bytes)
{
	struct nccl_engine *n = comm->impl;
	struct nccl_lane *ln = &n->lane[0];
	const uint8_t *s = send;
	uint8_t *d = recv;
	uint64_t s_off = 0, d_off = 0;
	cudaSetDevice(ln->device);
	ncclResult_t r = ncclGroupStart();
	for (uint32_t p = 0; p < comm->size && ok(r); p++) {
		if (send_bytes[p])
			r = ncclSend(s + s_off, send_bytes[p], ncclUint8, (int)p, ln->comm, ln->stream);
		if (recv_bytes[p] && ok(r))
			r = ncclRecv(d + d_off, recv_bytes[p], ncclUint8, (int)p, ln->comm, ln->stream);
		s_off += send_bytes[p];
		d_off += recv_bytes[p];
	}
	ncclResult_t end = ncclGroupEnd();
	return finish(comm, n, "alltoallv", ok(r) ? end : r, true);
}

static int nccl_allreduce(struct embd_comm *comm, void *data, size_t count,
			  enum embd_comm_dtype dtype)
{
	struct nccl_engine *n = comm->impl;
	struct nccl_lane *ln = &n->lane[0];
	cudaSetDevice(ln->device);
	ncclResult_t r = ncclAllReduce(data, data, count,
				       dtype == EMBD_COMM_F32 ? ncclFloat32 : ncclUint64, ncclSum,
				       ln->comm, ln->stream);
	return finish(comm, n, "allreduce", r, true);
}

static int nccl_broadcast(struct embd_comm *comm, void *data, size_t bytes, uint32_t root)
{
	struct nccl_engine *n = comm->impl;
	struct nccl_lane *ln = &n->lane[0];
	cudaSetDevice(ln->device);
	ncclResult_t r = ncclBroadcast(data, data, bytes, ncclUint8, (int)root, ln->comm,
				       ln->stream);
	return finish(comm, n, "broadcast", r, true);
}

/* Every global rank takes part: an allreduce on every lane, in one group. */
static int nccl_barrier(struct embd_comm *comm)
{
	struct nccl_engine *n = comm->impl;
	ncclResult_t r = ncclGroupStart();
	for (uint32_t l = 0; l < n->lanes && ok(r); l++) {
		struct nccl_lane *ln = &n->lane[l];
		cudaSetDevice(ln->device);
		r = ncclAllReduce(ln->barrier_word, ln->barrier_word, 1, ncclInt32, ncclSum, ln->comm,
				  ln->stream);
	}
	ncclResult_t end = ncclGroupEnd();
	return finish(comm, n, "barrier", ok(r) ? end : r, true);
}

/* Lane l's transfers with node p go to global rank p * lanes + l, on lane l's communicator. */
static int nccl_sendrecv(struct embd_comm *comm, const struct embd_comm_xfer *sends, size_t ns,
			 const struct embd_comm_xfer *recvs, size_t nr)
{
	struct nccl_engine *n = comm->impl;
	ncclResult_t r = ncclGroupStart();
	for (size_t i = 0; i < ns + nr && ok(r); i++) {
		const struct embd_comm_xfer *x = i < ns ? &sends[i] : &recvs[i - ns];
		struct nccl_lane *ln = &n->lane[x->lane];
		int peer = (int)(x->peer * n->lanes + x->lane);
		cudaSetDevice(ln->device);
		r = i < ns ? ncclSend(x->buf, x->bytes, ncclUint8, peer, ln->comm, ln->stream)
			   : ncclRecv(x->buf, x->bytes, ncclUint8, peer, ln->comm, ln->stream);
	}
	ncclResult_t end = ncclGroupEnd();
	return finish(comm, n, "sendrecv", ok(r) ? end : r, true);
}

const struct embd_comm_engine embd_comm_nccl_engine = {
	.name = "nccl",
	.create = nccl_create,
	.destroy = nccl_destroy,
	.alltoallv = nccl_alltoallv,
	.allreduce = nccl_allreduce,
	.broadcast = nccl_broadcast,
	.barrier = nccl_barrier,
	.sendrecv = nccl_sendrecv,
	.device_buffers = true,
};
