/*
 * Fuzz target for control messages: bytes = one packet, parsed and then decoded as its type;
 * every id and row a table message's decoder hands out is read, so an overrun shows, and every
 * buffer a DEVICE_OUTPUTS decoder accepts must lie inside its allocation, aligned, apart from
 * the others (the trainer adds those offsets to a base it mapped): a breach traps.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/control.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads n int64 ids and m floats (the decoders' arrays); unsigned: fuzzed ids wrap freely. */
static void touch(const int64_t *ids, uint64_t n, const float *rows, uint64_t m)
{
	volatile uint64_t sum = 0;
	volatile float fsum = 0;

	for (uint64_t i = 0; ids && i < n; i++)
		sum += (uint64_t)ids[i];
	for (uint64_t i = 0; rows && i < m; i++)
		fsum += rows[i];
	(void)sum;
	(void)fsum;
}

static void table_messages(const struct embd_ctl_msg *msg)
{
	struct embd_ctl_table_request req;
	struct embd_ctl_table_reply rep;
	const int64_t *ids;
	const float *rows;
	char err[128];

	if (msg->type == EMBD_CTL_TABLE_READ || msg->type == EMBD_CTL_TABLE_WRITE) {
		if (!embd_ctl_table_request_decode(msg, &req, &ids, &rows, err, sizeof(err)))
			touch(ids, req.num_rows, rows, (uint64_t)req.num_rows * req.cols);
	} else if (!embd_ctl_table_reply_decode(msg, &rep, &rows, err, sizeof(err))) {
		touch(NULL, 0, rows, rows ? (uint64_t)rep.num_rows * rep.cols : 0);
	}
}

/* What embd_ctl_device_outputs_decode promises of an accepted reply (control.h). */
static void check_device_outputs(const struct embd_ctl_msg *msg)
{
	struct embd_ctl_device_outputs o;
	uint64_t at[2 * EMBD_CTL_DEVICE_SLOTS];
	char err[128];

	if (embd_ctl_device_outputs_decode(msg, &o, err, sizeof(err)))
		return;
	memcpy(at, o.pooled, sizeof(o.pooled));
	memcpy(at + EMBD_CTL_DEVICE_SLOTS, o.grad, sizeof(o.grad));
	for (int i = 0; i < 2 * EMBD_CTL_DEVICE_SLOTS; i++) {
		if (at[i] % EMBD_CTL_DEVICE_ALIGN || o.buffer_bytes > o.bytes ||
		    at[i] > o.bytes - o.buffer_bytes)
			__builtin_trap();
		for (int j = 0; j < i; j++)
			if (at[i] < at[j] + o.buffer_bytes && at[j] < at[i] + o.buffer_bytes)
				__builtin_trap();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct embd_layout layout;
	struct embd_ctl_hello hello;
	struct embd_ctl_msg msg;
	struct embd_ctl_checkpoint ckpt;
	struct embd_ctl_device_request device;
	char err[128], text[256];
	int code;

	/* as embd_ctl_recv's buffer: 8-byte aligned */
	uint8_t *copy = malloc(size ? size : 1);
	if (!copy)
		return 0;
	memcpy(copy, data, size);
	if (embd_ctl_parse(copy, size, &msg, err, sizeof(err)) != 0) {
		free(copy);
		return 0;
	}
	switch (msg.type) {
	case EMBD_CTL_HELLO:
		embd_ctl_hello_decode(&msg, &hello, err, sizeof(err));
		break;
	case EMBD_CTL_WELCOME:
		embd_ctl_welcome_decode(&msg, &layout, err, sizeof(err));
		break;
	case EMBD_CTL_ERROR:
		embd_ctl_error_decode(&msg, &code, text, sizeof(text), err, sizeof(err));
		break;
	case EMBD_CTL_CHECKPOINT_REQUEST:
		embd_ctl_checkpoint_decode(&msg, &ckpt, err, sizeof(err));
		break;
	case EMBD_CTL_STATS_REPLY:
	case EMBD_CTL_STATUS_REPLY:
	case EMBD_CTL_CHECKPOINT_REPLY:
		embd_ctl_text_decode(&msg, text, sizeof(text), err, sizeof(err));
		break;
	case EMBD_CTL_TABLE_READ:
	case EMBD_CTL_TABLE_WRITE:
	case EMBD_CTL_TABLE_DATA:
	case EMBD_CTL_TABLE_DONE:
		table_messages(&msg);
		break;
	case EMBD_CTL_DEVICE_REQUEST:
		embd_ctl_device_request_decode(&msg, &device, err, sizeof(err));
		break;
	case EMBD_CTL_DEVICE_OUTPUTS:
		check_device_outputs(&msg);
		break;
	default:
		break;
	}
	free(copy);
	return 0;
}
