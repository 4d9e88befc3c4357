/*
 * embd/client.h - libembdclient: how a training process looks up pooled embeddings and
 * applies their gradients through the node's `embd` service.
 *
 * The one idea: batches never get copied. embd_connect maps a shared region from the service;
 * the trainer writes each KJT straight into one of EMBD_CLIENT_SLOTS batch slots of that
 * region (embd_batch_get), posts FORWARD for step s, reads the pooled output from the same
 * slot, writes dL/d(pooled) into the slot's grad buffer and posts BACKWARD for step s. Two
 * slots let a trainer fill step s + 1 while step s runs. An EVAL (embd_eval) looks a batch up
 * without training: no step, no backward.
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
	/* num_tables: how the service stores each table's rows. A field of the layout rather
	 * than of embd_client_table, whose size clients built earlier have compiled in: the
	 * library allocates the layout, so fields appended here keep the ABI. */
	const enum embd_data_type *table_data_types;
};

/*
 * One batch slot, inside the shared region. A batch has b samples, 1 <= b <= the layout's
 * batch_size (b below it: the last batch of an epoch, TorchRec's KJT stride; the request
 * says b). The trainer fills lengths (feature-major with stride b: lengths[f * b + i] ids of
 * feature f in sample i) and the first num_values entries of values (and weights for a
 * weighted batch); forward writes the first b rows of pooled; the trainer writes the first
 * b rows of grad before backward. No padding to batch_size is needed. The pointers stay
 * valid until embd_close. With device outputs (embd_device_outputs) pooled and grad are the
 * slot's buffers on the GPU: device pointers.
 */
struct embd_batch {
	int32_t *lengths;                /* room for num_features * batch_size */
	int64_t *values;                 /* max_values entries */
	float *weights;                  /* max_values entries */
	float *pooled;                   /* float[b][total_dim], written by forward */
	float *grad;                     /* float[b][total_dim], read by backward */
};

/*
 * FORWARD s and BACKWARD s are a training step: every trainer of the node (of the cluster)
 * posts both. FORWARD s + 1 (in the other slot) may be posted before BACKWARD s or right
 * after it (pipelined steps, TorchRec's TrainPipelineSparseDist idea): once every trainer of
 * the node did, the service routes step s + 1 while step s waits for its backward (on a
 * cluster it also exchanges its ids with the other nodes while step s's update is applied)
 * and looks it up right after that backward, with exactly the result of posting it later; its
 * completion follows BACKWARD s's. Should step s be aborted first (a trainer left), FORWARD
 * s + 1 runs with the trainers left and BACKWARD s is answered EMBD_ECANCELED, as without
 * pipelining. A second FORWARD while one is pending, or a FORWARD of step s while its
 * BACKWARD is due, completes at once with EMBD_EINVAL.
 *
 * EVAL is an evaluation (TorchRec's eval mode): the pooled output of the slot's batch from
 * the rows as they are, nothing kept for a backward, no row changed, the training step
 * sequence neither advanced nor waited for. Its step must be 0 (libembdclient sets it).
 *   - On one node a trainer may post an EVAL whenever it likes; it runs as soon as the
 *     service pops it, alone. The rows it reads include the update of every step whose
 *     BACKWARD completed; between this trainer's FORWARD s and BACKWARD s (or while another
 *     trainer's BACKWARD s is missing) they are the rows step s's forward read: the update
 *     happens in the backward, as in TorchRec. Between steps they are therefore exactly the
 *     rows the next training FORWARD reads.
 *   - On a cluster every trainer of every node posts its EVAL together, as TorchRec's sharded
 *     modules need in eval: the node runs an evaluation round once each of its trainers has
 *     posted one (a trainer whose EVAL batch was refused sits the round out), exchanging ids
 *     and pooled blocks with the other nodes like a forward. Rounds are numbered apart from
 *     the steps and run between steps: an EVAL while this trainer's BACKWARD is due is
 *     refused (EMBD_EINVAL), and one posted while another trainer of the node posted a
 *     FORWARD (or sits a step out) is refused too, naming that trainer. Every trainer must
 *     post its evaluations at the same point of its steps: a node that trains while another
 *     evaluates fails both and the cluster re-forms (EMBD_EMISMATCH). While it re-forms an
 *     EVAL gets EMBD_EAGAIN.
 */
enum embd_request_op {
	EMBD_REQUEST_NOP = 0,            /* completes at once (round-trip measurement) */
	EMBD_REQUEST_FORWARD = 1,
	EMBD_REQUEST_BACKWARD = 2,
	EMBD_REQUEST_EVAL = 3,           /* an evaluation: forward only, see above */
};

/* What one request asks for. */
struct embd_request {
	enum embd_request_op op;
	uint32_t slot;                   /* batch slot, < EMBD_CLIENT_SLOTS */
	uint64_t step;                   /* FORWARD, BACKWARD; ignored for EVAL and NOP */
	uint64_t num_values;             /* ids in the slot's batch (sum of its lengths) */
	int weighted;                    /* nonzero: the slot's weights are used; they must be
					    finite (EMBD_EINVAL naming weights[j] otherwise) */
	uint64_t user_data;              /* echoed in the completion */
	uint32_t batch_size;             /* samples b of the batch, 1..layout batch_size; 0: the
					    layout's. A BACKWARD names its FORWARD's b */
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
 * Posts one request (async). Returns 0, EMBD_EINVAL (slot, op, num_values over max_values,
 * batch_size over the layout's), EMBD_ENOSPC (submission ring full: wait for completions
 * first; the service takes requests only while the completion ring has room for theirs),
 * EMBD_EPROTO or EMBD_EIO.
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
 * These post full batches (the layout's batch_size samples); embd_run posts any request.
 * Do not call with async requests in flight on the same handle.
 */
EMBD_CLIENT_API int embd_forward(struct embd_client *client, uint32_t slot, uint64_t step,
				 uint64_t num_values, int weighted);
EMBD_CLIENT_API int embd_backward(struct embd_client *client, uint32_t slot, uint64_t step,
				  uint64_t num_values, int weighted);

/*
 * Blocking evaluation (EMBD_REQUEST_EVAL) of the batch of batch_size samples (0: the layout's)
 * in slot `slot`: its pooled rows are in the slot's pooled buffer on return. Returns 0, the
 * batch's validation error, EMBD_EINVAL when this trainer's BACKWARD is due on a cluster, or
 * EMBD_EAGAIN while a cluster re-forms. Do not call with async requests in flight.
 */
EMBD_CLIENT_API int embd_eval(struct embd_client *client, uint32_t slot, uint32_t batch_size,
			      uint64_t num_values, int weighted);

/*
 * Blocking form of embd_submit: posts *req (its user_data is replaced by the handle's own)
 * and waits without limit for that completion. Returns embd_submit's or embd_wait's error,
 * else the request's result, as embd_forward. Do not call with async requests in flight.
 */
EMBD_CLIENT_API int embd_run(struct embd_client *client, const struct embd_request *req);

/* ---- live table access -------------------------------------------------------------------
 *
 * Rows of a table, read and written through the handle's control socket while the service
 * runs, for state_dict() / load_state_dict(). table is the index into embd_layout()->tables;
 * rows are in table coordinates (whatever the sharding), row-major float[n][cols]. Each
 * message is answered at a moment no step phase runs: between steps the rows read are
 * exactly the rows the next training forward reads, and rows written are what it reads
 * (written between a step's FORWARD and BACKWARD, that step's update lands on them, as in
 * TorchRec). Arrays beyond the weights are the fused optimizer's state, for a full round
 * trip. Large requests travel in chunks of embd_table_info's max_rows rows; a trainer that
 * reads or writes between its own steps holds every other trainer of its node at the next
 * step meanwhile, so no step runs between the chunks. These calls wait for the service
 * without limit (a service that goes away ends them with EMBD_ECONNRESET). Errors name the
 * table, the row or the value: EMBD_ENOENT (no such table; on a cluster, rows or columns on
 * another node, named), EMBD_EINVAL (an array the table's optimizer has not; a value that is
 * not finite), EMBD_ERANGE (a row outside the table), EMBD_ENOTSUP (a write on a cluster:
 * every node would have to agree on it; not supported).
 */
enum embd_table_array {
	EMBD_TABLE_WEIGHTS = 0,          /* num_embeddings x embedding_dim (fp16 tables converted) */
	EMBD_TABLE_MOMENTUM1 = 1,        /* adagrad's sum of squares and adam's m (embedding_dim
					    wide); rowwise_adagrad's: one value per column shard of
					    a row (1 wide unless the table is column-wise sharded) */
	EMBD_TABLE_MOMENTUM2 = 2,        /* adam's v (embedding_dim wide) */
};

struct embd_table_info {
	int64_t num_embeddings;          /* rows of the table */
	uint32_t cols;                   /* floats per row of the array */
	uint32_t max_rows;               /* rows of the array one message carries */
	uint64_t applied_step;           /* the rows hold the update of every step before it */
	int64_t optimizer_step;          /* the table's optimizer steps so far (adam's t) */
};

/* The shape of array `array` of table `table`. Returns 0 or an error as above (EMBD_EINVAL:
 * the optimizer keeps no such array). */
EMBD_CLIENT_API int embd_table_info(struct embd_client *client, uint32_t table,
				    enum embd_table_array array, struct embd_table_info *out);

/*
 * Reads rows row_begin .. row_begin + num_rows - 1 (or the num_ids rows ids[]) of an array into
 * out (num_rows x cols floats, cols from embd_table_info). *applied_step (may be NULL) gets the
 * steps the rows hold. EMBD_EAGAIN when a step ran between two chunks (another trainer or
 * node went on meanwhile: read again between steps).
 */
EMBD_CLIENT_API int embd_table_read(struct embd_client *client, uint32_t table,
				    enum embd_table_array array, int64_t row_begin,
				    uint64_t num_rows, float *out, uint64_t *applied_step);
EMBD_CLIENT_API int embd_table_read_ids(struct embd_client *client, uint32_t table,
					enum embd_table_array array, const int64_t *ids,
					uint64_t num_ids, float *out, uint64_t *applied_step);

/*
 * Writes rows (num_rows x cols floats, every one finite) into rows row_begin .. (or ids[]) of
 * an array: data_parallel tables on every replica. A chunk is checked whole before any of its
 * rows changes; chunks are applied one after the other. Not on a cluster (EMBD_ENOTSUP).
 */
EMBD_CLIENT_API int embd_table_write(struct embd_client *client, uint32_t table,
				     enum embd_table_array array, int64_t row_begin,
				     uint64_t num_rows, const float *rows);
EMBD_CLIENT_API int embd_table_write_ids(struct embd_client *client, uint32_t table,
					 enum embd_table_array array, const int64_t *ids,
					 uint64_t num_ids, const float *rows);

/* ---- device outputs ----------------------------------------------------------------------
 *
 * (Not yet run on a GPU: the protocol, refusals and lifetime are tested on CPU ranks through a
 * host-memory double; the driver calls on both sides have only been compiled.)
 * A trainer on a GPU may have the pooled outputs and gradients of its batch slots in memory of
 * that GPU instead of the shared slab: the service computes as ever, copies each forward's
 * pooled rows into the trainer's GPU memory before the FORWARD (or EVAL) completes and copies
 * each gradient out of it when the step's backward runs, so the trainer hands its framework
 * device pointers and never copies embeddings through host memory itself. The ids (lengths,
 * values, weights) stay in the slab.
 *
 * embd_device_outputs asks once per handle, any time after embd_connect (between requests of
 * the handle). On success every later FORWARD, EVAL and BACKWARD of the handle uses them:
 * embd_batch_get's pooled and grad then point into them too, and they are CUDA device pointers
 * (read and write them with CUDA, never on the host). A forward's rows are complete on the
 * device when its completion arrives; the trainer's writes of a gradient must be complete
 * (its stream synchronized) before it posts the BACKWARD. On failure nothing changes: the
 * handle goes on with the slab's buffers, and embd_last_error says why.
 *
 * cuda_device is a CUDA device ordinal of this process (after its CUDA_VISIBLE_DEVICES); the
 * library names the GPU to the service by its UUID, which is the same in every process
 * whatever either's CUDA_VISIBLE_DEVICES renumbers, so the service allocates on that GPU
 * whether it numbers it alike or not. The memory is a cuMemCreate allocation of the service,
 * passed as a file descriptor over the control socket and mapped here with the CUDA driver's
 * virtual memory management API. libembdclient does not link CUDA: it loads libcuda.so.1 when
 * this is called.
 *
 * Returns 0, or: EMBD_ENOTSUP (no CUDA driver in this process, or one older than CUDA 11.4's;
 * the service's ranks are CPU ranks; its driver cannot export that GPU's memory), EMBD_ENOENT
 * (no such device here, or the service does not see that GPU: it names those it sees),
 * EMBD_EBUSY (this handle has them already), EMBD_ENOMEM, EMBD_EIO (a driver call failed,
 * named), EMBD_EPROTO. A failure after the service allocated (an import refused by the
 * driver) leaves that allocation to the service until embd_close.
 */
struct embd_device_outputs {
	int cuda_device;                 /* the ordinal asked for */
	int on_device;                   /* 1: CUDA memory of that GPU; 0: host memory, from a
					    service whose CPU ranks run its test double
					    (EMBD_TEST_CPU_DEVICE_OUTPUTS, docs/testing.md) */
	uint64_t buffer_bytes;           /* of each buffer: batch_size x total_dim floats or more */
	float *pooled[EMBD_CLIENT_SLOTS];    /* slot s's pooled output, float[b][total_dim] */
	float *grad[EMBD_CLIENT_SLOTS];      /* slot s's dL/d(pooled), float[b][total_dim] */
};

EMBD_CLIENT_API int embd_device_outputs(struct embd_client *client, int cuda_device,
					struct embd_device_outputs *out);

/* The text of the handle's last failure ("" when none). Valid until the next call. */
EMBD_CLIENT_API const char *embd_last_error(const struct embd_client *client);

#ifdef __cplusplus
}
#endif

#endif /* EMBD_CLIENT_H */
