/*
 * ipc/control_device.c - the payloads of device outputs (control.h: DEVICE_REQUEST,
 * DEVICE_OUTPUTS). Both are one fixed struct, memcpy'd out; the reply's offsets are what a
 * trainer turns into pointers into memory it maps, so every buffer is checked to lie inside
 * the allocation, aligned and apart from the others before anyone adds an offset to a base.
 */
#include "ipc/control.h"

#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "common/err.h"

int embd_ctl_device_request_decode(const struct embd_ctl_msg *msg,
				   struct embd_ctl_device_request *out, char *err, size_t err_len)
{
	if (msg->type != EMBD_CTL_DEVICE_REQUEST || msg->length != sizeof(*out))
		return embd_fail(err, err_len, EMBD_EPROTO, "device request: type %u, %" PRIu32
				 " bytes", (unsigned)msg->type, msg->length);
	memcpy(out, msg->payload, sizeof(*out));
	if (out->flags)
		return embd_fail(err, err_len, EMBD_EPROTO, "device_request.flags: unknown bits 0x%"
				 PRIx32, out->flags);
	if (out->reserved)
		return embd_fail(err, err_len, EMBD_EPROTO, "device_request.reserved: must be zero");
	return 0;
}

/* The name of buffer i of the reply's 2 x slots: pooled[s] then grad[s]. */
static void buffer_name(uint32_t i, char *buf, size_t len)
{
	snprintf(buf, len, "device_outputs.%s[%" PRIu32 "]",
		 i < EMBD_CTL_DEVICE_SLOTS ? "pooled" : "grad", i % EMBD_CTL_DEVICE_SLOTS);
}

int embd_ctl_device_outputs_decode(const struct embd_ctl_msg *msg,
				   struct embd_ctl_device_outputs *out, char *err, size_t err_len)
{
	uint64_t at[2 * EMBD_CTL_DEVICE_SLOTS];
	char name[48];

	if (msg->type != EMBD_CTL_DEVICE_OUTPUTS || msg->length != sizeof(*out))
		return embd_fail(err, err_len, EMBD_EPROTO, "device outputs: type %u, %" PRIu32
				 " bytes", (unsigned)msg->type, msg->length);
	memcpy(out, msg->payload, sizeof(*out));
	if (out->memory != EMBD_CTL_MEMORY_CUDA && out->memory != EMBD_CTL_MEMORY_HOST)
		return embd_fail(err, err_len, EMBD_EPROTO, "device_outputs.memory: unknown kind %"
				 PRIu32, out->memory);
	if (out->num_slots != EMBD_CTL_DEVICE_SLOTS)
		return embd_fail(err, err_len, EMBD_EPROTO, "device_outputs.num_slots: %" PRIu32
				 ", the protocol has %d", out->num_slots, EMBD_CTL_DEVICE_SLOTS);
	if (!out->bytes || out->bytes > EMBD_CTL_DEVICE_BYTES_MAX)
		return embd_fail(err, err_len, EMBD_EPROTO, "device_outputs.bytes: %" PRIu64
				 " not in [1, 2^40]", out->bytes);
	if (!out->buffer_bytes || out->buffer_bytes > out->bytes)
		return embd_fail(err, err_len, EMBD_EPROTO, "device_outputs.buffer_bytes: %" PRIu64
				 " not in [1, bytes %" PRIu64 "]", out->buffer_bytes, out->bytes);
	memcpy(at, out->pooled, sizeof(out->pooled));
	memcpy(at + EMBD_CTL_DEVICE_SLOTS, out->grad, sizeof(out->grad));
	for (uint32_t i = 0; i < 2 * EMBD_CTL_DEVICE_SLOTS; i++) {
		buffer_name(i, name, sizeof(name));
		if (at[i] % EMBD_CTL_DEVICE_ALIGN)
			return embd_fail(err, err_len, EMBD_EPROTO, "%s: offset %" PRIu64 " is not %u-"
					 "byte aligned", name, at[i], EMBD_CTL_DEVICE_ALIGN);
		/* buffer_bytes <= bytes, so the subtraction cannot wrap */
		if (at[i] > out->bytes - out->buffer_bytes)
			return embd_fail(err, err_len, EMBD_EPROTO, "%s: [%" PRIu64 ", +%" PRIu64 ") "
					 "lies outside the %" PRIu64 " bytes", name, at[i],
					 out->buffer_bytes, out->bytes);
		for (uint32_t j = 0; j < i; j++) {
			/* both inside the allocation: the sums cannot overflow */
			if (at[i] < at[j] + out->buffer_bytes && at[j] < at[i] + out->buffer_bytes) {
				char other[48];
				buffer_name(j, other, sizeof(other));
				return embd_fail(err, err_len, EMBD_EPROTO, "%s: overlaps %s", name,
						 other);
			}
		}
	}
	if (msg->nfds > 1)
		return embd_fail(err, err_len, EMBD_EPROTO, "device outputs: %u fds attached, the "
				 "message carries one", msg->nfds);
	return 0;
}
