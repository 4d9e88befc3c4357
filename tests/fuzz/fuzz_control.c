/*
 * Fuzz target for control messages: bytes = one packet, parsed and then decoded as its type.
 */
#include <stdint.h>
#include <stdlib.h>

#include "ipc/control.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct embd_layout layout;
	struct embd_ctl_hello hello;
	struct embd_ctl_msg msg;
	struct embd_ctl_checkpoint ckpt;
	char err[128], text[256];
	int code;

	if (embd_ctl_parse(data, size, &msg, err, sizeof(err)) != 0)
		return 0;
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
	default:
		break;
	}
	return 0;
}
