/*
 * Fuzz target for the service's descriptor path: bytes = one SQE followed by slab contents.
 * The SQE is validated and, when valid, its KJT view built; every id the view exposes must lie
 * inside the slab, and its output or grad span inside the slab or, with EMBD_SQE_DEVICE, inside
 * the trainer's device buffers (here DEVICE_BYTES of heap): ASan catches a read outside them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define DEVICE_BYTES 1024

/* Reads every byte of a span the service writes or reads whole (output, grad). */
static void touch_span(const uint8_t *space, const struct embd_slab_span *span)
{
	volatile uint8_t sink = 0;

	for (uint64_t i = 0; i < span->bytes; i++)
		sink ^= space[span->offset + i];
	(void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct embd_batch_limits lim = { .num_features = 2, .batch_size = 4, .total_dim = 8,
					 .max_values = 256, .device_bytes = DEVICE_BYTES };
	static uint8_t *device;
	struct embd_sqe sqe;
	struct embd_kjt kjt;
	int32_t lengths[8];
	char err[128];
	uint8_t *slab;

	if (size < sizeof(sqe))
		return 0;
	memcpy(&sqe, data, sizeof(sqe));
	lim.slab_bytes = size - sizeof(sqe);
	/* an exact-size heap copy so ASan sees any read past the slab */
	slab = malloc(lim.slab_bytes ? lim.slab_bytes : 1);
	if (!slab)
		return 0;
	if (!device && !(device = calloc(1, DEVICE_BYTES)))
		abort();
	memcpy(slab, data + sizeof(sqe), lim.slab_bytes);
	if (embd_sqe_validate(&sqe, &lim, err, sizeof(err)) == 0 && sqe.opcode != EMBD_OP_NOP &&
	    embd_kjt_view_build(&sqe, &lim, slab, lengths, 8, &kjt, err, sizeof(err)) == 0) {
		const uint8_t *results = sqe.flags & EMBD_SQE_DEVICE ? device : slab;
		touch_span(results, &sqe.output);
		touch_span(results, &sqe.grad);
		/* touch every id and weight the view exposes (unsigned: fuzzed ids wrap freely) */
		volatile uint64_t sink = 0;
		for (uint64_t i = 0; i < kjt.num_values; i++)
			sink += (uint64_t)kjt.values[i];
		if (kjt.weights)
			for (uint64_t i = 0; i < kjt.num_values; i++) {
				uint32_t bits;
				memcpy(&bits, &kjt.weights[i], sizeof(bits));
				sink += bits;
			}
		(void)sink;
	}
	free(slab);
	return 0;
}
