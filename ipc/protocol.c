/*
 * ipc/protocol.c - validation of submission descriptors and of the KJT they describe.
 *
 * Every check runs on private memory: the SQE was copied off the ring by embd_ring_pop, and
 * the lengths are copied out of the slab once before they are summed. Span bounds use
 * "offset <= slab && bytes <= slab - offset", which cannot overflow for any 64-bit input.
 */
#include "ipc/protocol.h"

#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "common/err.h"

/* Bytes of `count` elements of `elem_bytes`, or UINT64_MAX on overflow (never a valid size). */
static uint64_t array_bytes(uint64_t count, uint64_t elem_bytes)
{
	if (count > UINT64_MAX / elem_bytes)
		return UINT64_MAX;
	return count * elem_bytes;
}

static int check_absent(const struct embd_slab_span *span, const char *name, const char *why,
			char *err, size_t err_len)
{
	if (span->offset != 0 || span->bytes != 0)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"sqe.%s: must be empty (offset 0, bytes 0) %s, got offset %" PRIu64
				" bytes %" PRIu64, name, why, span->offset, span->bytes);
	return 0;
}

/* space: "slab" or "device buffers", whichever the span's offsets count in */
static int check_span_in(const struct embd_slab_span *span, const char *name,
			 uint64_t want_bytes, uint64_t align, const char *space, uint64_t space_bytes,
			 char *err, size_t err_len)
{
	if (span->bytes != want_bytes)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"sqe.%s.bytes: expected %" PRIu64 ", got %" PRIu64,
				name, want_bytes, span->bytes);
	if (span->offset % align != 0)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"sqe.%s.offset: %" PRIu64 " is not %" PRIu64 "-byte aligned",
				name, span->offset, align);
	if (span->offset > space_bytes || span->bytes > space_bytes - span->offset)
		return embd_fail(err, err_len, EMBD_ERANGE,
				"sqe.%s: [%" PRIu64 ", +%" PRIu64 ") lies outside the %s of %" PRIu64
				" bytes", name, span->offset, span->bytes, space, space_bytes);
	return 0;
}

static int check_span(const struct embd_slab_span *span, const char *name, uint64_t want_bytes,
		      uint64_t align, uint64_t slab_bytes, char *err, size_t err_len)
{
	return check_span_in(span, name, want_bytes, align, "slab", slab_bytes, err, err_len);
}

/* output or grad: in the slab, or with EMBD_SQE_DEVICE in the trainer's device buffers */
static int check_result_span(const struct embd_sqe *sqe, const struct embd_slab_span *span,
			     const char *name, uint64_t want_bytes,
			     const struct embd_batch_limits *lim, char *err, size_t err_len)
{
	if (!(sqe->flags & EMBD_SQE_DEVICE))
		return check_span(span, name, want_bytes, sizeof(float), lim->slab_bytes, err,
				  err_len);
	if (!lim->device_bytes)
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.flags: DEVICE, but this trainer has "
				 "no device outputs (ask with DEVICE_REQUEST first)");
	return check_span_in(span, name, want_bytes, sizeof(float), "device buffers",
			     lim->device_bytes, err, err_len);
}

static bool spans_overlap(const struct embd_slab_span *a, const struct embd_slab_span *b)
{
	if (a->bytes == 0 || b->bytes == 0)
		return false;
	/* both spans passed check_span, so offset + bytes cannot overflow */
	return a->offset < b->offset + b->bytes && b->offset < a->offset + a->bytes;
}

static int check_batch(const struct embd_sqe *sqe, const struct embd_batch_limits *lim,
		       char *err, size_t err_len)
{
	uint64_t slab = lim->slab_bytes;
	uint64_t pooled_bytes = array_bytes((uint64_t)sqe->batch_size * lim->total_dim, sizeof(float));
	const struct embd_slab_span *inputs[3] = { &sqe->lengths, &sqe->values, &sqe->weights };
	static const char *const input_names[3] = { "lengths", "values", "weights" };
	int rc;

	/* fewer samples than B: the last batch of an epoch */
	if (sqe->batch_size == 0 || sqe->batch_size > lim->batch_size)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"sqe.batch_size: expected 1..%" PRIu32 ", got %" PRIu32,
				lim->batch_size, sqe->batch_size);
	if (sqe->num_values > lim->max_values)
		return embd_fail(err, err_len, EMBD_ERANGE,
				"sqe.num_values: %" PRIu64 " exceeds the cap of %" PRIu64,
				sqe->num_values, lim->max_values);
	rc = check_span(&sqe->lengths, "lengths",
			array_bytes((uint64_t)lim->num_features * sqe->batch_size, sizeof(int32_t)),
			sizeof(int32_t), slab, err, err_len);
	if (rc)
		return rc;
	rc = check_span(&sqe->values, "values", array_bytes(sqe->num_values, sizeof(int64_t)),
			sizeof(int64_t), slab, err, err_len);
	if (rc)
		return rc;
	if (sqe->flags & EMBD_SQE_WEIGHTED)
		rc = check_span(&sqe->weights, "weights", array_bytes(sqe->num_values, sizeof(float)),
				sizeof(float), slab, err, err_len);
	else
		rc = check_absent(&sqe->weights, "weights", "without the WEIGHTED flag", err, err_len);
	if (rc)
		return rc;

	if (sqe->opcode == EMBD_OP_FORWARD || sqe->opcode == EMBD_OP_EVAL) {
		const char *op = sqe->opcode == EMBD_OP_EVAL ? "for EVAL" : "for FORWARD";
		if (sqe->opcode == EMBD_OP_EVAL && sqe->step != 0)
			return embd_fail(err, err_len, EMBD_EINVAL,
					"sqe.step: must be 0 for EVAL, got %" PRIu64, sqe->step);
		rc = check_absent(&sqe->grad, "grad", op, err, err_len);
		if (rc)
			return rc;
		rc = check_result_span(sqe, &sqe->output, "output", pooled_bytes, lim, err, err_len);
		if (rc)
			return rc;
		/* the service writes output while it may still read the inputs */
		for (int i = 0; i < 3 && !(sqe->flags & EMBD_SQE_DEVICE); i++)
			if (spans_overlap(&sqe->output, inputs[i]))
				return embd_fail(err, err_len, EMBD_EINVAL,
						"sqe.output: overlaps sqe.%s", input_names[i]);
		return 0;
	}
	rc = check_absent(&sqe->output, "output", "for BACKWARD", err, err_len);
	if (rc)
		return rc;
	return check_result_span(sqe, &sqe->grad, "grad", pooled_bytes, lim, err, err_len);
}

int embd_sqe_validate(const struct embd_sqe *sqe, const struct embd_batch_limits *lim,
		      char *err, size_t err_len)
{
	const struct embd_slab_span *spans[5] = {
		&sqe->lengths, &sqe->values, &sqe->weights, &sqe->grad, &sqe->output,
	};
	static const char *const span_names[5] = { "lengths", "values", "weights", "grad", "output" };

	if (sqe->reserved[0] != 0 || sqe->reserved[1] != 0)
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.reserved: must be zero");
	if (sqe->flags & ~EMBD_SQE_FLAGS_ALL)
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.flags: unknown bits 0x%x",
				(unsigned)(sqe->flags & ~EMBD_SQE_FLAGS_ALL));
	switch (sqe->opcode) {
	case EMBD_OP_NOP:
		if (sqe->flags != 0)
			return embd_fail(err, err_len, EMBD_EINVAL, "sqe.flags: must be 0 for NOP");
		if (sqe->num_values != 0)
			return embd_fail(err, err_len, EMBD_EINVAL, "sqe.num_values: must be 0 for NOP");
		for (int i = 0; i < 5; i++) {
			int rc = check_absent(spans[i], span_names[i], "for NOP", err, err_len);
			if (rc)
				return rc;
		}
		return 0;
	case EMBD_OP_FORWARD:
	case EMBD_OP_EVAL:
	case EMBD_OP_BACKWARD:
		return check_batch(sqe, lim, err, err_len);
	default:
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.opcode: unknown opcode %u",
				(unsigned)sqe->opcode);
	}
}

int embd_kjt_view_build(const struct embd_sqe *sqe, const struct embd_batch_limits *lim,
			const void *slab, int32_t *lengths_buf, size_t lengths_cap,
			struct embd_kjt *out, char *err, size_t err_len)
{
	const unsigned char *base = slab;
	uint64_t count = (uint64_t)lim->num_features * sqe->batch_size;
	uint64_t sum = 0;

	if (sqe->opcode != EMBD_OP_FORWARD && sqe->opcode != EMBD_OP_EVAL &&
	    sqe->opcode != EMBD_OP_BACKWARD)
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.opcode: %u carries no batch",
				(unsigned)sqe->opcode);
	if (sqe->batch_size == 0 || sqe->batch_size > lim->batch_size)
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.batch_size: not validated");
	if (count > lengths_cap)
		return embd_fail(err, err_len, EMBD_ENOSPC,
				"lengths: %" PRIu64 " entries exceed the buffer of %zu", count, lengths_cap);
	if (sqe->lengths.bytes != count * sizeof(int32_t))
		return embd_fail(err, err_len, EMBD_EINVAL, "sqe.lengths.bytes: not validated");
	/* the single read of the lengths: from here on only the private copy is used */
	memcpy(lengths_buf, base + sqe->lengths.offset, count * sizeof(int32_t));
	for (uint64_t i = 0; i < count; i++) {
		if (lengths_buf[i] < 0)
			return embd_fail(err, err_len, EMBD_EINVAL,
					"lengths[%" PRIu64 "] (feature %" PRIu64 ", sample %" PRIu64
					"): negative length %" PRId32, i, i / sqe->batch_size,
					i % sqe->batch_size, lengths_buf[i]);
		sum += (uint64_t)lengths_buf[i];
	}
	if (sum != sqe->num_values)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"lengths: sum to %" PRIu64 " but sqe.num_values is %" PRIu64,
				sum, sqe->num_values);

	memset(out, 0, sizeof(*out));
	out->num_features = lim->num_features;
	out->batch_size = sqe->batch_size;
	out->keys = NULL;
	out->lengths = lengths_buf;
	out->num_values = sum;
	/* ids and weights stay shared: every use bounds-checks each id (see protocol.h) */
	out->values = (const int64_t *)(const void *)(base + sqe->values.offset);
	out->weights = (sqe->flags & EMBD_SQE_WEIGHTED) ?
		(const float *)(const void *)(base + sqe->weights.offset) : NULL;
	return 0;
}

void embd_cqe_fill(struct embd_cqe *cqe, const struct embd_sqe *sqe, int result, const char *message)
{
	memset(cqe, 0, sizeof(*cqe));
	cqe->user_data = sqe->user_data;
	cqe->step = sqe->step;
	cqe->result = result;
	if (message)
		snprintf(cqe->message, sizeof(cqe->message), "%s", message);
}
