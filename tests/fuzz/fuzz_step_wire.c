/*
 * Fuzz target for what a peer node sends the step engine (engine/step_wire.h): bytes = one
 * peer's HELLO head followed by its INPUT message, checked against the plan of
 * tests/fuzz/step_wire_plan.h exactly as step_dist.c checks them. Whatever the checks let
 * through is read in full (every offset, id, weight and length) and re-checked here, so an
 * array that overruns the message or an id outside its shard aborts.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/step_wire_plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads everything an accepted item points at and checks what the engine relies on. */
static int touch_item(void *arg, uint32_t p, uint64_t seq, const struct step_wire_item *it)
{
	const struct step_wire_shard *d = &wp_plan.shards[it->shard];
	volatile float sum = 0;

	(void)arg;
	(void)seq;
	if (p != WP_PEER || it->shard >= wp_plan.num_shards ||
	    wp_plan.shards[it->shard].node != wp_plan.node || it->offsets[0] != 0 ||
	    it->batch_size == 0 || it->batch_size > WP_B ||
	    it->offsets[it->batch_size] != (int64_t)it->num_ids)
		abort();
	for (uint32_t b = 0; b < it->batch_size; b++) {
		if (it->offsets[b + 1] < it->offsets[b])
			abort();
		if (it->lengths && it->lengths[b] < it->offsets[b + 1] - it->offsets[b])
			abort();
	}
	for (uint64_t i = 0; i < it->num_ids; i++) {
		if (it->ids[i] < d->row_offset || it->ids[i] >= d->row_offset + d->rows)
			abort();
		if (it->weights)
			sum += it->weights[i];     /* reads every weight, so ASan sees an overrun */
	}
	(void)sum;
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const size_t H = sizeof(struct wire_head);
	struct wire_head head = { 0 };
	char err[256];
	int rc;

	rc = step_wire_head(WP_PEER, data, size, WP_SEQ, 0, &head, err, sizeof(err));
	if (rc == 0)
		rc = step_wire_hello(WP_PEER, &head, err, sizeof(err));
	if (size <= H)
		return 0;
	/* the engine's receive buffer: malloc'ed, every peer's INPUT a multiple of 8 bytes */
	uint64_t len = (size - H) & ~7ull;
	uint8_t *buf = malloc(len ? len : 1);
	if (!buf)
		return 0;
	memcpy(buf, data + H, len);
	err[0] = 0;
	rc = step_wire_input(&wp_plan, WP_PEER, buf, len, head.grad_bytes,
			     (head.flags & WIRE_HELLO_EVAL) != 0, touch_item, NULL, err,
			     sizeof(err));
	if (rc && !err[0])
		abort();        /* every refusal says why */
	free(buf);
	return 0;
}
