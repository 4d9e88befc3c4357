/*
 * ipc/protocol.h - the descriptors that travel on a client's rings (SQE: client -> service,
 * CQE: service -> client) and their validation.
 *
 * The one idea: the service only ever validates a private copy. embd_ring_pop copies an SQE
 * out of shared memory; embd_sqe_validate checks every field of that copy against the slab;
 * embd_kjt_view_build copies the lengths out of the slab once and checks them there. Nothing
 * the client writes afterwards can change a value that was checked. Wire format: ipc/README.md.
 */
#ifndef EMBD_IPC_PROTOCOL_H
#define EMBD_IPC_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"

enum embd_op {
	EMBD_OP_NOP = 0,        /* no work; completes with result 0 (ping, IPC round-trip benchmark) */
	EMBD_OP_FORWARD = 1,    /* KJT in -> pooled output written to the output span */
	EMBD_OP_BACKWARD = 2,   /* KJT + dL/d(pooled) in the grad span -> fused optimizer update */
	EMBD_OP_EVAL = 3,       /* KJT in -> pooled output of the rows as they are; trains nothing
				 * and is no part of a training step (ipc/README.md) */
};

#define EMBD_SQE_WEIGHTED (1u << 0)     /* the batch carries per-id weights */
#define EMBD_SQE_DEVICE (1u << 1)       /* output (FORWARD, EVAL) or grad (BACKWARD) is a span of
					 * the trainer's device buffers (control.h's
					 * DEVICE_OUTPUTS), not of the slab */
#define EMBD_SQE_FLAGS_ALL (EMBD_SQE_WEIGHTED | EMBD_SQE_DEVICE)

/* A byte range of the slab (or, for output and grad under EMBD_SQE_DEVICE, of the device
 * buffers): [offset, offset + bytes). bytes == 0 means "absent". */
struct embd_slab_span {
	uint64_t offset;
	uint64_t bytes;
};

/*
 * Submission descriptor, 128 bytes. Spans by opcode (others must be zero), with b =
 * batch_size the samples of this batch:
 *   FORWARD   lengths, values, weights (iff WEIGHTED), output (float[b][total_dim], written)
 *   EVAL      as FORWARD; step must be 0 (evaluations are not numbered by the trainer)
 *   BACKWARD  lengths, values, weights (iff WEIGHTED), grad (float[b][total_dim], read)
 *   NOP       none
 * b may be below the layout's batch size (the last batch of an epoch: TorchRec's stride);
 * the lengths are then feature-major with stride b (lengths[f * b + i]) and the output has b
 * rows. A BACKWARD names the b of its step's FORWARD.
 */
struct embd_sqe {
	uint16_t opcode;                /* enum embd_op */
	uint16_t flags;                 /* EMBD_SQE_* */
	uint32_t batch_size;            /* b: 1 .. the layout's batch size */
	uint64_t user_data;             /* echoed in the CQE */
	uint64_t step;                  /* training step this batch belongs to */
	uint64_t num_values;            /* ids in the batch; lengths must sum to it */
	struct embd_slab_span lengths;  /* int32[num_features * b], 4-byte aligned */
	struct embd_slab_span values;   /* int64[num_values], 8-byte aligned */
	struct embd_slab_span weights;  /* float[num_values], 4-byte aligned */
	struct embd_slab_span grad;     /* float[b * total_dim], 4-byte aligned */
	struct embd_slab_span output;   /* float[b * total_dim], 4-byte aligned */
	uint64_t reserved[2];           /* must be zero */
};
_Static_assert(sizeof(struct embd_sqe) == 128, "SQE is 128 bytes on the wire");

#define EMBD_CQE_MSG_BYTES 104          /* NUL-terminated error text, empty on success */

/* Completion descriptor, 128 bytes. */
struct embd_cqe {
	uint64_t user_data;             /* from the SQE */
	uint64_t step;                  /* from the SQE */
	int32_t result;                 /* 0 or a negative EMBD_E* code */
	uint32_t reserved;              /* zero */
	char message[EMBD_CQE_MSG_BYTES];
};
_Static_assert(sizeof(struct embd_cqe) == 128, "CQE is 128 bytes on the wire");

/* What the service expects of every batch of one client (from its layout). */
struct embd_batch_limits {
	uint64_t slab_bytes;            /* size of the client's slab */
	uint32_t num_features;          /* F */
	uint32_t batch_size;            /* B: the most samples of one batch */
	uint32_t total_dim;             /* columns of the pooled output */
	uint64_t max_values;            /* cap on num_values per batch */
	uint64_t device_bytes;          /* of the trainer's device buffers; 0: it has none, and
					 * EMBD_SQE_DEVICE is refused */
};

/*
 * Checks a private copy of an SQE: opcode, flags, reserved words, batch size (1 .. B), value
 * count, and for each span its size (exact, from the limits and the SQE's batch size),
 * alignment and bounds within the slab, or for output and grad with EMBD_SQE_DEVICE within
 * lim->device_bytes (overflow-safe), and that an output span in the slab does not overlap an
 * input span.
 * Returns 0, or EMBD_EINVAL (bad opcode, flags, reserved, batch size, span size or alignment),
 * EMBD_ERANGE (span outside the slab or num_values over the cap) with a message naming the
 * field in err (may be NULL).
 */
int embd_sqe_validate(const struct embd_sqe *sqe, const struct embd_batch_limits *lim,
		      char *err, size_t err_len);

/*
 * Builds a safe KJT view of a validated FORWARD/EVAL/BACKWARD SQE whose slab is mapped at
 * `slab`.
 * Copies lengths (F * b int32, b the SQE's batch size, which the view carries) from the slab
 * into lengths_buf (lengths_cap entries) with one
 * read, then checks every length >= 0 and that they sum to sqe->num_values. On success *out
 * has lengths -> lengths_buf (private), keys = NULL, and values/weights pointing into the
 * slab.
 *
 * Values and weights stay in shared memory, so the client can change them while the service
 * works: every later use must treat each id as untrusted and bounds-check it against the
 * shard's row range before touching memory (the kernels do so for every id), and nothing may
 * re-derive a size or offset from them. Weights are floats whose worst case is a bad result
 * for this client's own batch.
 * Returns 0, EMBD_EINVAL (negative length, sum mismatch), EMBD_ENOSPC (lengths_cap too small).
 */
int embd_kjt_view_build(const struct embd_sqe *sqe, const struct embd_batch_limits *lim,
			const void *slab, int32_t *lengths_buf, size_t lengths_cap,
			struct embd_kjt *out, char *err, size_t err_len);

/* Fills a CQE answering `sqe` with `result`; `message` (may be NULL) is truncated to fit. */
void embd_cqe_fill(struct embd_cqe *cqe, const struct embd_sqe *sqe, int result, const char *message);

#endif /* EMBD_IPC_PROTOCOL_H */
