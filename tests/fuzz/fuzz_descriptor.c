/*
 * Fuzz target for the service's descriptor path: bytes = one SQE followed by slab contents.
 * The SQE is validated and, when valid, its KJT view built; every id the view exposes must lie
 * inside the slab (ASan catches a read outside it).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct embd_batch_limits lim = { .num_features = 2, .batch_size = 4, .total_dim = 8, .max_values = 256 };
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
	memcpy(slab, data + sizeof(sqe), lim.slab_bytes);
	if (embd_sqe_validate(&sqe, &lim, err, sizeof(err)) == 0 && sqe.opcode != EMBD_OP_NOP &&
	    embd_kjt_view_build(&sqe, &lim, slab, lengths, 8, &kjt, err, sizeof(err)) == 0) {
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
