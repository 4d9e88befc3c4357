/*
 * dist/comm_internal.h - what one collective engine (comm_gloo.cc, comm_nccl.c) implements
 * behind dist/comm.h: one small table of functions. comm.c checks the arguments, keeps the
 * handle's state (rank, size, broken-after-failure) and dispatches; an engine only moves bytes
 * and turns its library's failures into an EMBD_E* code plus a message (embd_comm_fail).
 *
 * Engines are compiled in C++ or CUDA, hence the extern "C" below: this header is the whole
 * boundary between them and the C side.
 */
#ifndef EMBD_DIST_COMM_INTERNAL_H
#define EMBD_DIST_COMM_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dist/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMBD_COMM_ERR_MAX 512

enum embd_comm_dtype {
	EMBD_COMM_F32 = 0,
	EMBD_COMM_U64 = 1,
};

struct embd_comm_engine {
	const char *name;
	/* Connects; sets comm->impl. Every participant calls it (it rendezvouses via store). */
	int (*create)(struct embd_comm *comm, const struct embd_comm_options *options,
		      struct embd_store *store);
	void (*destroy)(void *impl);
	int (*alltoallv)(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
			 void *recv, const uint64_t *recv_bytes);
	int (*allreduce)(struct embd_comm *comm, void *data, size_t count,
			 enum embd_comm_dtype dtype);
	int (*broadcast)(struct embd_comm *comm, void *data, size_t bytes, uint32_t root);
	int (*barrier)(struct embd_comm *comm);
	/* The transfers, checked by comm.c (peers, lanes, no self, no pair twice). */
	int (*sendrecv)(struct embd_comm *comm, const struct embd_comm_xfer *sends, size_t ns,
			const struct embd_comm_xfer *recvs, size_t nr);
	bool device_buffers;            /* buffers in device memory (comm.h) */
};

struct embd_comm {
	const struct embd_comm_engine *engine;
	void *impl;                     /* the engine's state */
	uint32_t rank, size;
	uint32_t lanes;                 /* >= 1 */
	int timeout_ms;
	int broken;                     /* 0, or the code of the failure that broke the handle */
	char err[EMBD_COMM_ERR_MAX];
};

/* Records a failure's message in comm->err and returns rc. */
int embd_comm_fail(struct embd_comm *comm, int rc, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* The engines this build has: gloo in the service's build (EMBD_HAVE_GLOO; tests/gpu builds
 * without it), nccl where CUDA and NCCL are found (EMBD_HAVE_NCCL). */
#ifdef EMBD_HAVE_GLOO
extern const struct embd_comm_engine embd_comm_gloo_engine;
#endif
#ifdef EMBD_HAVE_NCCL
extern const struct embd_comm_engine embd_comm_nccl_engine;
#endif

#ifdef __cplusplus
}
#endif

#endif /* EMBD_DIST_COMM_INTERNAL_H */
