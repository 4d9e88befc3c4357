/*
 * dist/comm.c - the front of the collective engines (dist/comm.h): checks arguments,
 * dispatches through the engine's function table (dist/comm_internal.h) and keeps the rule
 * that a failed collective breaks the handle. Argument errors found here are reported before
 * any byte moves, so they leave the handle usable; an engine failure means the participants
 * may disagree about what was exchanged, so every later call repeats that failure.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"
#include "dist/comm_internal.h"

static const struct embd_comm_engine *engine_of(enum embd_comm_backend backend)
{
	switch (backend) {
	case EMBD_COMM_GLOO:
#ifdef EMBD_HAVE_GLOO
		return &embd_comm_gloo_engine;
#else
		return NULL;
#endif
	case EMBD_COMM_NCCL:
#ifdef EMBD_HAVE_NCCL
		return &embd_comm_nccl_engine;
#else
		return NULL;
#endif
	}
	return NULL;
}

const char *embd_comm_backend_name(enum embd_comm_backend backend)
{
	switch (backend) {
	case EMBD_COMM_GLOO:
		return "gloo";
	case EMBD_COMM_NCCL:
		return "nccl";
	}
	return NULL;
}

int embd_comm_backend_from_name(const char *name, enum embd_comm_backend *out)
{
	if (name && strcmp(name, "gloo") == 0)
		*out = EMBD_COMM_GLOO;
	else if (name && strcmp(name, "nccl") == 0)
		*out = EMBD_COMM_NCCL;
	else
		return EMBD_EINVAL;
	return 0;
}

int embd_comm_available(enum embd_comm_backend backend)
{
	if (backend != EMBD_COMM_GLOO && backend != EMBD_COMM_NCCL)
		return EMBD_EINVAL;
	return engine_of(backend) ? 0 : EMBD_ENOTSUP;
}

int embd_comm_fail(struct embd_comm *comm, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(comm->err, sizeof(comm->err), fmt, ap);
	va_end(ap);
	return rc;
}

int embd_comm_create(const struct embd_comm_options *options, struct embd_store *store,
		     struct embd_comm **out, char *err, size_t err_len)
{
	int rc;

	if (err_len)
		err[0] = '\0';
	*out = NULL;
	const char *name = embd_comm_backend_name(options->backend);
	if (!name) {
		snprintf(err, err_len, "comm: unknown backend %d", (int)options->backend);
		return EMBD_EINVAL;
	}
	const struct embd_comm_engine *engine = engine_of(options->backend);
	if (!engine) {
		snprintf(err, err_len, "comm %s: not in this build (%s)", name,
			 options->backend == EMBD_COMM_NCCL ? "built without CUDA and NCCL"
							    : "built without Gloo");
		return EMBD_ENOTSUP;
	}
	if (options->size == 0 || options->rank >= options->size) {
		snprintf(err, err_len, "comm %s: rank %u of size %u", name, options->rank,
			 options->size);
		return EMBD_EINVAL;
	}
	if (options->timeout_ms <= 0) {
		snprintf(err, err_len, "comm %s: timeout_ms %d (must be > 0)", name,
			 options->timeout_ms);
		return EMBD_EINVAL;
	}
	if (options->lanes > EMBD_COMM_LANES_MAX) {
		snprintf(err, err_len, "comm %s: %u lanes (at most %u)", name, options->lanes,
			 EMBD_COMM_LANES_MAX);
		return EMBD_EINVAL;
	}
	if (!store) {
		snprintf(err, err_len, "comm %s: no store to rendezvous through", name);
		return EMBD_EINVAL;
	}
	struct embd_comm *comm = calloc(1, sizeof(*comm));
	if (!comm) {
		snprintf(err, err_len, "comm %s: out of memory", name);
		return EMBD_ENOMEM;
	}
	comm->engine = engine;
	comm->rank = options->rank;
	comm->size = options->size;
	comm->lanes = options->lanes ? options->lanes : 1;
	comm->timeout_ms = options->timeout_ms;
	rc = engine->create(comm, options, store);
	if (rc < 0) {
		snprintf(err, err_len, "comm %s rank %u/%u: %s", name, comm->rank, comm->size,
			 comm->err);
		free(comm);
		return rc;
	}
	*out = comm;
	return 0;
}

void embd_comm_destroy(struct embd_comm *comm)
{
	if (!comm)
		return;
	comm->engine->destroy(comm->impl);
	free(comm);
}

/* Every collective starts here: a broken handle repeats its failure. */
static int usable(struct embd_comm *comm)
{
	comm->err[0] = '\0';
	if (!comm->broken)
		return 0;
	snprintf(comm->err, sizeof(comm->err),
		 "comm broken by an earlier failure (%s): destroy it and create a new one",
		 embd_strerror(comm->broken));
	return comm->broken;
}

/* An engine's result: a failure breaks the handle. */
static int engine_result(struct embd_comm *comm, int rc)
{
	if (rc < 0)
		comm->broken = rc;
	return rc;
}

/* The collectives with one buffer per participant need one lane (comm.h). */
static int one_lane(struct embd_comm *comm, const char *op)
{
	if (comm->lanes == 1)
		return 0;
	return embd_comm_fail(comm, EMBD_EINVAL, "%s: the comm has %u lanes (one buffer per lane: "
			      "use embd_comm_sendrecv)", op, comm->lanes);
}

/* One direction's transfers: peers and lanes in range, none to self, no (peer, lane) twice
 * (seen: size * lanes flags, cleared here). */
static int check_xfers(struct embd_comm *comm, const char *dir, const struct embd_comm_xfer *x,
		       size_t n, uint8_t *seen)
{
	memset(seen, 0, (size_t)comm->size * comm->lanes);
	if (n && !x)
		return embd_comm_fail(comm, EMBD_EINVAL, "sendrecv: NULL list of %zu %ss", n, dir);
	for (size_t i = 0; i < n; i++) {
		const struct embd_comm_xfer *t = &x[i];
		if (t->peer >= comm->size || t->peer == comm->rank || t->lane >= comm->lanes)
			return embd_comm_fail(comm, EMBD_EINVAL, "sendrecv: %s %zu: peer %u lane %u "
					      "(this is participant %u of %u, %u lanes)", dir, i,
					      t->peer, t->lane, comm->rank, comm->size, comm->lanes);
		if (!t->bytes || !t->buf)
			return embd_comm_fail(comm, EMBD_EINVAL, "sendrecv: %s %zu: %llu bytes at %p",
					      dir, i, (unsigned long long)t->bytes, t->buf);
		uint8_t *s = &seen[(size_t)t->peer * comm->lanes + t->lane];
		if (*s)
			return embd_comm_fail(comm, EMBD_EINVAL, "sendrecv: two %ss to peer %u on "
					      "lane %u", dir, t->peer, t->lane);
		*s = 1;
	}
	return 0;
}

int embd_comm_sendrecv(struct embd_comm *comm, const struct embd_comm_xfer *sends,
		       size_t num_sends, const struct embd_comm_xfer *recvs, size_t num_recvs)
{
	int rc = usable(comm);
	if (rc < 0)
		return rc;
	uint8_t *seen = malloc((size_t)comm->size * comm->lanes);
	if (!seen)
		return embd_comm_fail(comm, EMBD_ENOMEM, "sendrecv: out of memory");
	rc = check_xfers(comm, "send", sends, num_sends, seen);
	if (!rc)
		rc = check_xfers(comm, "recv", recvs, num_recvs, seen);
	free(seen);
	if (rc < 0 || (!num_sends && !num_recvs))
		return rc;
	return engine_result(comm, comm->engine->sendrecv(comm, sends, num_sends, recvs,
							    num_recvs));
}

int embd_comm_alltoallv(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
			void *recv, const uint64_t *recv_bytes)
{
	int rc = usable(comm);
	if (rc < 0 || (rc = one_lane(comm, "alltoallv")) < 0)
		return rc;
	uint64_t total_send = 0, total_recv = 0;
	for (uint32_t p = 0; p < comm->size; p++) {
		if (__builtin_add_overflow(total_send, send_bytes[p], &total_send) ||
		    __builtin_add_overflow(total_recv, recv_bytes[p], &total_recv))
			return embd_comm_fail(comm, EMBD_EINVAL, "alltoallv: sizes overflow at peer %u",
					      p);
	}
	if ((total_send && !send) || (total_recv && !recv))
		return embd_comm_fail(comm, EMBD_EINVAL, "alltoallv: NULL buffer for %llu bytes",
				      (unsigned long long)(send ? total_recv : total_send));
	if (send_bytes[comm->rank] != recv_bytes[comm->rank])
		return embd_comm_fail(comm, EMBD_EINVAL,
				      "alltoallv: %llu bytes to self but %llu expected from self",
				      (unsigned long long)send_bytes[comm->rank],
				      (unsigned long long)recv_bytes[comm->rank]);
	return engine_result(comm, comm->engine->alltoallv(comm, send, send_bytes, recv,
							     recv_bytes));
}

static int allreduce(struct embd_comm *comm, void *data, size_t count,
		     enum embd_comm_dtype dtype)
{
	int rc = usable(comm);
	if (rc < 0 || (rc = one_lane(comm, "allreduce")) < 0 || count == 0)
		return rc;
	if (!data)
		return embd_comm_fail(comm, EMBD_EINVAL, "allreduce: NULL buffer for %zu values",
				      count);
	return engine_result(comm, comm->engine->allreduce(comm, data, count, dtype));
}

int embd_comm_allreduce_f32(struct embd_comm *comm, float *data, size_t count)
{
	return allreduce(comm, data, count, EMBD_COMM_F32);
}

int embd_comm_allreduce_u64(struct embd_comm *comm, uint64_t *data, size_t count)
{
	return allreduce(comm, data, count, EMBD_COMM_U64);
}

int embd_comm_broadcast(struct embd_comm *comm, void *data, size_t bytes, uint32_t root)
{
	int rc = usable(comm);
	if (rc < 0 || (rc = one_lane(comm, "broadcast")) < 0)
		return rc;
	if (root >= comm->size)
		return embd_comm_fail(comm, EMBD_EINVAL, "broadcast: root %u of size %u", root,
				      comm->size);
	if (bytes == 0)
		return 0;
	if (!data)
		return embd_comm_fail(comm, EMBD_EINVAL, "broadcast: NULL buffer for %zu bytes",
				      bytes);
	return engine_result(comm, comm->engine->broadcast(comm, data, bytes, root));
}

int embd_comm_barrier(struct embd_comm *comm)
{
	int rc = usable(comm);
	if (rc < 0)
		return rc;
	return engine_result(comm, comm->engine->barrier(comm));
}

uint32_t embd_comm_rank(const struct embd_comm *comm)
{
	return comm->rank;
}

uint32_t embd_comm_size(const struct embd_comm *comm)
{
	return comm->size;
}

uint32_t embd_comm_lanes(const struct embd_comm *comm)
{
	return comm->lanes;
}

bool embd_comm_device_buffers(const struct embd_comm *comm)
{
	return comm->engine->device_buffers;
}

const char *embd_comm_error(const struct embd_comm *comm)
{
	return comm->err;
}
