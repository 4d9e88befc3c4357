/*
 * embd/client.h - libembdclient: how a training process looks up pooled embeddings and
 * applies their gradients through the node's `embd` service.
 *
 * The one idea: batches never get copied. embd_connect maps a shared region from the service;
 * the trainer writes each KJT straight into one of EMBD_CLIENT_SLOTS batch slots of that
 * region (embd_batch_get), posts FORWARD for step s, reads the pooled output from the same
 * slot, writes dL/d(pooled) into the slot's grad buffer and posts BACKWARD for step s. Two
 * slots let a trainer fill step s + 1 while step s runs.
 *
 * Threading: a handle is used by one thread at a time (calls on one handle must be
 * serialised by the caller); different handles are independent. embd_last_error belongs to
 * the handle, so read it on the thread that made the failing call.
 *
 * Returns: every int function returns 0 (or a count where stated) or a negative EMBD_E* code
 * from embd/types.h; embd_last_error(client) then names the field or the cause, including the
 * service's text for error completions. embd_strerror(code) gives the code's short name.
 */
#ifndef EMBD_CLIENT_H
#define EMBD_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMBD_CLIENT_API __attribute__((visibility("default")))

#define EMBD_CLIENT_SLOTS 2              /* batch slots in the region */
#define EMBD_CLIENT_ANY_INDEX (-1)       /* embd_connect: any free trainer index */

struct embd_client;

struct embd_client_table {
	char name[EMBD_NAME_MAX];
	int64_t num_embeddings;
	int32_t embedding_dim;
	enum embd_pooling pooling;
};

/* A feature of the KJT, in key order, and its columns in the pooled output. */
struct embd_client_feature {
	char name[EMBD_NAME_MAX];
	uint32_t table;                  /* index into tables */
	uint32_t dim;
	uint32_t offset;                 /* first column in float[batch_size][total_dim] */
};

struct embd_client_layout {
	int32_t index;                   /* this trainer's local index, 0..trainers_per_node-1 */
	uint32_t trainers_per_node;
	uint32_t batch_size;             /* B of every batch this trainer posts */
	uint32_t total_dim;              /* columns of the pooled output */
	uint64_t max_values;             /* most ids one batch may hold */
	uint64_t resumed_step;           /* the first step this trainer posts; after a
					    completion with EMBD_ERESUMED (a cluster that re-formed
					    after a node failed), the step to post next */
	uint32_t num_tables, num_features;
	const struct embd_client_table *tables;      /* num_tables */
	const struct embd_client_feature *features;  /* num_features, KJT key order */
};

/*
 * One batch slot, inside the shared region. The trainer fills lengths (feature-major,
 * num_features * batch_size) and the first num_values entries of values (and weights for a
 * weighted batch); forward writes pooled; the trainer writes grad before backward.
 * The pointers stay valid until embd_close.
 */
struct embd_batch {
	int32_t *lengths;
	int64_t *values;                 /* max_values entries */
	float *weights;                  /* max_values entries */
	float *pooled;                   /* float[batch_size][total_dim], written by forward */
	float *grad;                     /* float[batch_size][total_dim], read by backward */
};

enum embd_request_op {
	EMBD_REQUEST_NOP = 0,            /* completes at once (round-trip measurement) */
	EMBD_REQUEST_FORWARD = 1,
	EMBD_REQUEST_BACKWARD = 2,
};

/* What one request asks for. */
struct embd_request {
	enum embd_request_op op;
	uint32_t slot;                   /* batch slot, < EMBD_CLIENT_SLOTS */
	uint64_t step;
	uint64_t num_values;             /* ids in the slot's batch (sum of its lengths) */
	int weighted;                    /* nonzero: the slot's weights are used */
	uint64_t user_data;              /* echoed in the completion */
};

struct embd_completion {
	uint64_t user_data;
	uint64_t step;
	int result;                      /* 0 or a negative EMBD_E*; EMBD_ECANCELED: step aborted */
};

/*
 * Connects to the service at socket_path, says HELLO with wanted_index (0..T-1 or
 * EMBD_CLIENT_ANY_INDEX), receives WELCOME (the layout) and maps the region.
 * On success *out is a new handle; on failure *out is NULL and, when err is non-NULL, the
 * reason (the service's refusal text, e.g. for a uid it does not allow) is copied there.
 * Returns 0, EMBD_ENOENT (no socket), EMBD_EACCES (refused), EMBD_EBUSY (index taken),
 * EMBD_EPROTO, EMBD_EIO, EMBD_ENOMEM, EMBD_ETIMEDOUT (no WELCOME within timeout_ms; < 0
 * waits without limit).
 */
EMBD_CLIENT_API int embd_connect(const char *socket_path, int wanted_index, int timeout_ms,
				 struct embd_client **out, char *err, size_t err_len);

/* Disconnects and unmaps. NULL is a no-op. Requests in flight are dropped by the service
 * (a step this trainer took part in is aborted for the node). */
EMBD_CLIENT_API void embd_close(struct embd_client *client);

/* The layout from WELCOME; valid until embd_close. Never NULL for a connected handle. */
EMBD_CLIENT_API const struct embd_client_layout *embd_layout(const struct embd_client *client);

/* Pointers of batch slot `slot` into the region. Returns 0 or EMBD_EINVAL (slot). */
EMBD_CLIENT_API int embd_batch_get(struct embd_client *client, uint32_t slot,
				   struct embd_batch *out);

/*
 * Posts one request (async). Returns 0, EMBD_EINVAL (slot, op, num_values over max_values),
 * EMBD_ENOSPC (submission ring full: wait for completions first; the service takes requests
 * only while the completion ring has room for theirs), EMBD_EPROTO or EMBD_EIO.
 */
EMBD_CLIENT_API int embd_submit(struct embd_client *client, const struct embd_request *req);

/*
 * Takes the oldest completion without waiting. Returns 0, EMBD_EAGAIN (none yet),
 * EMBD_ECONNRESET (the service went away) or EMBD_EPROTO (corrupt ring). An error
 * completion is returned with 0 here and its result and text in *out / embd_last_error.
 */
EMBD_CLIENT_API int embd_poll(struct embd_client *client, struct embd_completion *out);

/*
 * Waits for the oldest completion: busy-polls briefly, then sleeps on the completion
 * doorbell, at most timeout_ms (< 0: no limit). Returns as embd_poll, or EMBD_ETIMEDOUT.
 */
EMBD_CLIENT_API int embd_wait(struct embd_client *client, struct embd_completion *out,
			      int timeout_ms);

/*
 * Blocking forward / backward of step `step` on slot `slot`: submit, then wait for that
 * completion. Returns its result (0, EMBD_ECANCELED when the step was aborted because
 * another trainer died, or the validation error of this batch, named in embd_last_error).
 * On a cluster also: an error naming the node that failed; EMBD_EAGAIN while the cluster
 * re-forms (post the same step again a little later); EMBD_ERESUMED when it re-formed at
 * another step (embd_layout(client)->resumed_step is then the step to post).
 * Do not call with async requests in flight on the same handle.
 */
EMBD_CLIENT_API int embd_forward(struct embd_client *client, uint32_t slot, uint64_t step,
				 uint64_t num_values, int weighted);
EMBD_CLIENT_API int embd_backward(struct embd_client *client, uint32_t slot, uint64_t step,
				  uint64_t num_values, int weighted);

/* The text of the handle's last failure ("" when none). Valid until the next call. */
EMBD_CLIENT_API const char *embd_last_error(const struct embd_client *client);

#ifdef __cplusplus
}
#endif

#endif /* EMBD_CLIENT_H */
