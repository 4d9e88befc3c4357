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

int embd_comm_alltoallv(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
			void *recv, const uint64_t *recv_bytes)
{
	int rc = usable(comm);
	if (rc < 0)
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
	if (rc < 0 || count == 0)
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
	if (rc < 0)
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

const char *embd_comm_error(const struct embd_comm *comm)
{
	return comm->err;
}
