/*
 * dist/comm.h - the collective engine between the embd services of a cluster, behind one
 * small function table with one file per engine (comm_gloo.cc: Gloo over TCP, one Gloo rank per
 * node; comm_nccl.c: NCCL, one communicator per local GPU spanning every global rank).
 *
 * Participants are numbered 0..size-1: the nodes. A participant moves its bytes over `lanes`
 * lanes (options.lanes, 1 by default): nccl has one communicator per lane, the node's GPU
 * ranks, which together with every other node's form one NCCL clique over all global ranks
 * (lane l of node n is global rank n * lanes + l, and talks to lane l of every other node);
 * gloo carries every lane over its one Gloo context per node (same transfers, host memory).
 * Every call is
 * collective: each participant calls it in the same order with agreeing sizes, and every call
 * fails with EMBD_ETIMEDOUT (message naming the peer that did not answer, where the engine
 * knows) once options.timeout_ms pass, instead of hanging. After a failure the handle is
 * broken: destroy it and create a new one (the cluster re-rendezvouses through the store,
 * under a new prefix: the keys of a rendezvous stay in the store, so a prefix serves one
 * create, e.g. "gloo/<generation>/"). An argument error (EMBD_EINVAL, found before any byte
 * moves) leaves the handle usable. Buffers are host memory for gloo and device memory for
 * nccl (a lane's buffers on that lane's GPU: embd_comm_device_buffers). One thread at a time
 * per handle; different handles are independent.
 *
 * Benchmarks: embd_comm_alltoallv over gloo is the raw Gloo reference. It is one
 * gloo::alltoallv on the caller's buffers (no staging copy; only a fresh tag per call), so
 * `embd-bench dist` times it directly as "raw gloo alltoallv" beside the step engine's input
 * and output dists. Over nccl it is one ncclGroupStart/ncclSend+ncclRecv per peer/End, which
 * is what NCCL's own alltoall tests run.
 */
#ifndef EMBD_DIST_COMM_H
#define EMBD_DIST_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct embd_store;
struct embd_comm;

#define EMBD_COMM_LANES_MAX 64

enum embd_comm_backend {
	EMBD_COMM_GLOO = 0,
	EMBD_COMM_NCCL = 1,
};

struct embd_comm_options {
	enum embd_comm_backend backend;
	uint32_t rank;                  /* this participant */
	uint32_t size;                  /* participants */
	int timeout_ms;                 /* every collective and rendezvous wait */
	const char *hostname;           /* gloo: address peers reach this node at ("" = 127.0.0.1) */
	uint32_t lanes;                 /* 0 = 1; nccl: the local GPUs, at most EMBD_COMM_LANES_MAX */
	const int *cuda_devices;        /* nccl: lane l's CUDA device (NULL: device l) */
	const char *prefix;             /* store key prefix, so several comms can coexist
					   (NULL = ""); one prefix per create, see above */
};

/* "gloo", "nccl" (NULL for other values); the inverse returns EMBD_EINVAL for other names. */
const char *embd_comm_backend_name(enum embd_comm_backend backend);
int embd_comm_backend_from_name(const char *name, enum embd_comm_backend *out);

/* Rendezvous through store (every participant calls it) and connect. err[err_len] names what
 * failed (err may be NULL when err_len is 0). The store handle's timeout is left at
 * options.timeout_ms; the comm does not use the store after create returns. */
int embd_comm_create(const struct embd_comm_options *options, struct embd_store *store,
		     struct embd_comm **out, char *err, size_t err_len);
void embd_comm_destroy(struct embd_comm *comm);

/* 0, or EMBD_ENOTSUP when this build lacks the backend (nccl without CUDA). */
int embd_comm_available(enum embd_comm_backend backend);

/*
 * One transfer of a grouped exchange (embd_comm_sendrecv): bytes to (a send) or from (a recv)
 * participant peer over lane, from or into buf.
 */
struct embd_comm_xfer {
	uint32_t peer, lane;
	void *buf;
	uint64_t bytes;                 /* > 0 */
};

/*
 * Grouped point-to-point: every send and every recv of the lists in flight at once (nccl: one
 * ncclGroupStart/End over the lanes' communicators; gloo: one unbound buffer each), returning
 * when all completed. A send from a to b on lane l pairs with the recv at b from a on lane l,
 * of the same size; at most one of each per (peer, lane) and direction per call, none to
 * oneself. Buffers as above (device memory of the lane's GPU for nccl).
 */
int embd_comm_sendrecv(struct embd_comm *comm, const struct embd_comm_xfer *sends,
		       size_t num_sends, const struct embd_comm_xfer *recvs, size_t num_recvs);

/*
 * All-to-all of bytes (one lane only; with more, EMBD_EINVAL: use embd_comm_sendrecv, whose
 * buffers are per lane): participant r sends send_bytes[p] bytes to p, taken contiguously from
 * send in peer order, and receives recv_bytes[p] bytes from p into recv in peer order. Sizes
 * must agree pairwise (exchange them first with a fixed-size alltoall). Zero sizes are fine.
 */
int embd_comm_alltoallv(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
			void *recv, const uint64_t *recv_bytes);
/* In-place sum over participants of count floats / count uint64s (one lane only, as
 * alltoallv). */
int embd_comm_allreduce_f32(struct embd_comm *comm, float *data, size_t count);
int embd_comm_allreduce_u64(struct embd_comm *comm, uint64_t *data, size_t count);
/* bytes from root to everyone, in place (one lane only). */
int embd_comm_broadcast(struct embd_comm *comm, void *data, size_t bytes, uint32_t root);
/* Every participant (every lane of it) reached the barrier. */
int embd_comm_barrier(struct embd_comm *comm);

uint32_t embd_comm_rank(const struct embd_comm *comm);
uint32_t embd_comm_size(const struct embd_comm *comm);
uint32_t embd_comm_lanes(const struct embd_comm *comm);
/* true when the engine moves device memory (nccl): each lane's buffers on its GPU. */
bool embd_comm_device_buffers(const struct embd_comm *comm);
/* The last error's message ("" when none). */
const char *embd_comm_error(const struct embd_comm *comm);

#endif /* EMBD_DIST_COMM_H */
