/*
 * ipc/control_table.c - the payloads of live table access (control.h: TABLE_READ, TABLE_DATA,
 * TABLE_WRITE, TABLE_DONE). A request or reply is a fixed head, memcpy'd out, then arrays whose
 * sizes the head announces: every count is bounded by one table message's bytes before it is
 * multiplied, and the payload must hold exactly what the head announces. The arrays are used
 * where they lie: ids at offset 32 and rows after them are 8- and 4-byte aligned in a buffer
 * that is 8-byte aligned, which the decoders check rather than assume.
 */
#include "ipc/control.h"

#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "common/err.h"

static bool is_table_request(uint16_t type)
{
	return type == EMBD_CTL_TABLE_READ || type == EMBD_CTL_TABLE_WRITE;
}

/* Bytes of ids and rows after a request's head: what a table message may carry at most. */
static uint64_t request_body_bytes(const struct embd_ctl_table_request *r, bool write)
{
	return (r->flags & EMBD_CTL_TABLE_IDS ? (uint64_t)r->num_rows * 8 : 0) +
	       (write ? (uint64_t)r->num_rows * r->cols * 4 : 0);
}

int embd_ctl_table_request_encode(const struct embd_ctl_table_request *req, const int64_t *ids,
				  const float *rows, void *buf, size_t cap, uint32_t *len_out)
{
	const bool write = rows != NULL;
	const uint64_t ids_bytes = req->flags & EMBD_CTL_TABLE_IDS ? (uint64_t)req->num_rows * 8 : 0;
	const uint64_t body = request_body_bytes(req, write);
	uint8_t *p = buf;

	*len_out = 0;
	if (req->num_rows > EMBD_CTL_TABLE_BYTES_MAX || req->cols > EMBD_CTL_TABLE_BYTES_MAX ||
	    body > EMBD_CTL_TABLE_BYTES_MAX || sizeof(*req) + body > cap)
		return EMBD_EINVAL;
	memcpy(p, req, sizeof(*req));
	if (ids_bytes)
		memcpy(p + sizeof(*req), ids, ids_bytes);
	if (write)
		memcpy(p + sizeof(*req) + ids_bytes, rows, body - ids_bytes);
	*len_out = (uint32_t)(sizeof(*req) + body);
	return 0;
}

int embd_ctl_table_request_decode(const struct embd_ctl_msg *msg, struct embd_ctl_table_request *out,
				  const int64_t **ids, const float **rows, char *err, size_t err_len)
{
	const bool write = msg->type == EMBD_CTL_TABLE_WRITE;

	*ids = NULL;
	*rows = NULL;
	if (!is_table_request(msg->type) || msg->length < sizeof(*out))
		return embd_fail(err, err_len, EMBD_EPROTO, "table request: message type %u",
				(unsigned)msg->type);
	memcpy(out, msg->payload, sizeof(*out));
	if (out->flags & ~EMBD_CTL_TABLE_IDS || out->reserved)
		return embd_fail(err, err_len, EMBD_EPROTO, "table.flags 0x%" PRIx32 " or reserved %"
				PRIu32 ": unknown", out->flags, out->reserved);
	if ((out->flags & EMBD_CTL_TABLE_IDS) && out->row_begin)
		return embd_fail(err, err_len, EMBD_EPROTO, "table.row_begin: %" PRId64 " beside ids",
				out->row_begin);
	if (!write && out->cols)
		return embd_fail(err, err_len, EMBD_EPROTO, "table.cols: %" PRIu32 " in a read",
				out->cols);
	/* bounded before they are multiplied */
	if (out->num_rows > EMBD_CTL_TABLE_BYTES_MAX || out->cols > EMBD_CTL_TABLE_BYTES_MAX ||
	    request_body_bytes(out, write) > EMBD_CTL_TABLE_BYTES_MAX)
		return embd_fail(err, err_len, EMBD_EPROTO, "table.num_rows: %" PRIu32 " rows of %"
				PRIu32 " floats exceed a table message", out->num_rows, out->cols);
	if (msg->length - sizeof(*out) != request_body_bytes(out, write))
		return embd_fail(err, err_len, EMBD_EPROTO, "table request: %" PRIu32 " bytes, its head "
				"announces %" PRIu64, msg->length,
				sizeof(*out) + request_body_bytes(out, write));
	const uint8_t *at = msg->payload + sizeof(*out);
	if ((uintptr_t)at % 8)
		return embd_fail(err, err_len, EMBD_EPROTO, "table request: payload not 8-byte aligned");
	if (out->flags & EMBD_CTL_TABLE_IDS) {
		*ids = (const int64_t *)(const void *)at;
		at += (uint64_t)out->num_rows * 8;
	}
	if (write)
		*rows = (const float *)(const void *)at;
	return 0;
}

int embd_ctl_table_reply_encode(enum embd_ctl_type type, const struct embd_ctl_table_reply *rep,
				const float *rows, void *buf, size_t cap, uint32_t *len_out)
{
	const uint64_t body = type == EMBD_CTL_TABLE_DATA ? (uint64_t)rep->num_rows * rep->cols * 4
							  : 0;

	*len_out = 0;
	if ((type != EMBD_CTL_TABLE_DATA && type != EMBD_CTL_TABLE_DONE) ||
	    body > EMBD_CTL_TABLE_BYTES_MAX || sizeof(*rep) + body > cap)
		return EMBD_EINVAL;
	memcpy(buf, rep, sizeof(*rep));
	if (body)
		memcpy((uint8_t *)buf + sizeof(*rep), rows, body);
	*len_out = (uint32_t)(sizeof(*rep) + body);
	return 0;
}

int embd_ctl_table_reply_decode(const struct embd_ctl_msg *msg, struct embd_ctl_table_reply *out,
				const float **rows, char *err, size_t err_len)
{
	const bool data = msg->type == EMBD_CTL_TABLE_DATA;

	*rows = NULL;
	if ((!data && msg->type != EMBD_CTL_TABLE_DONE) || msg->length < sizeof(*out))
		return embd_fail(err, err_len, EMBD_EPROTO, "table reply: message type %u",
				(unsigned)msg->type);
	memcpy(out, msg->payload, sizeof(*out));
	if (out->reserved)
		return embd_fail(err, err_len, EMBD_EPROTO, "table reply: reserved must be zero");
	uint64_t body = 0;
	if (data) {
		if (out->num_rows > EMBD_CTL_TABLE_BYTES_MAX || out->cols > EMBD_CTL_TABLE_BYTES_MAX)
			return embd_fail(err, err_len, EMBD_EPROTO, "table reply: %" PRIu32 " rows of %"
					PRIu32 " floats", out->num_rows, out->cols);
		body = (uint64_t)out->num_rows * out->cols * 4;
	}
	if (msg->length - sizeof(*out) != body)
		return embd_fail(err, err_len, EMBD_EPROTO, "table reply: %" PRIu32 " bytes, its head "
				"announces %" PRIu64, msg->length, sizeof(*out) + body);
	const uint8_t *at = msg->payload + sizeof(*out);
	if ((uintptr_t)at % 8)
		return embd_fail(err, err_len, EMBD_EPROTO, "table reply: payload not 8-byte aligned");
	if (data)
		*rows = (const float *)(const void *)at;
	return 0;
}
