/*
 * tests/fuzz/step_wire_plan.h - a small cluster plan as engine/step_wire.c reads it (struct
 * step_wire_plan), seen from node 0 of 2, and a writer of INPUT items, for
 * fuzz_step_wire.c and tests/unit/test_step_wire.c. One plan covers every kind of item check:
 *
 *   table 0 "ts" table_wise sum,  50 rows x 4: shard 0 on node 0          feature 0
 *   table 1 "rm" row_wise mean,   40 rows x 8: shard 1 rows [0, 20) node 0,
 *                                              shard 2 rows [20, 40) node 1 feature 1 (lengths)
 *   table 2 "dp" data_parallel,   10 rows x 2: shard 3 on node 0, shard 4 on node 1  feature 2
 */
#ifndef EMBD_TESTS_STEP_WIRE_PLAN_H
#define EMBD_TESTS_STEP_WIRE_PLAN_H

#include <stdint.h>
#include <string.h>

#include "engine/step_wire.h"

#define WP_B 4u                 /* batch size */
#define WP_PEER 1u              /* the node that sends */
#define WP_SEQ 7u               /* the step exchange both are at */

static const struct step_wire_table wp_tables[3] = {
	{ .type = EMBD_SHARD_TABLE_WISE, .pooling = EMBD_POOLING_SUM },         /* "ts" 50 x 4 */
	{ .type = EMBD_SHARD_ROW_WISE, .pooling = EMBD_POOLING_MEAN },          /* "rm" 40 x 8 */
	{ .type = EMBD_SHARD_DATA_PARALLEL, .pooling = EMBD_POOLING_SUM },      /* "dp" 10 x 2 */
};

static const struct step_wire_shard wp_shards[5] = {
	{ .table = 0, .node = 0, .row_offset = 0, .rows = 50, .cols = 4 },
	{ .table = 1, .node = 0, .row_offset = 0, .rows = 20, .cols = 8 },
	{ .table = 1, .node = 1, .row_offset = 20, .rows = 20, .cols = 8 },
	{ .table = 2, .node = 0, .row_offset = 0, .rows = 10, .cols = 2 },
	{ .table = 2, .node = 1, .row_offset = 0, .rows = 10, .cols = 2 },
};

static const uint32_t wp_feature_tables[3] = { 0, 1, 2 };

static const struct step_wire_plan wp_plan = {
	.node = 0, .batch_size = WP_B, .num_tables = 3, .num_shards = 5, .num_features = 3,
	.tables = wp_tables, .shards = wp_shards, .feature_tables = wp_feature_tables,
};

/*
 * Appends one item of a batch of nb samples (1..WP_B) to out at *at (8-aligned, as the sender
 * packs it): the head, offsets from lens (nb bag lengths), ids, weights when weights != NULL,
 * full lengths (nb) when full != NULL. Returns the bytes of gradient the item brings
 * (nb * cols * 4).
 */
__attribute__((unused)) static uint64_t wp_put_item(uint8_t *out, uint64_t *at, uint32_t feature,
						    uint32_t shard, uint32_t flags, uint32_t nb,
						    const int32_t *lens, const int64_t *ids,
						    const float *weights, const int32_t *full)
{
	int64_t offsets[WP_B + 1] = { 0 };
	for (uint32_t b = 0; b < nb; b++)
		offsets[b + 1] = offsets[b] + lens[b];
	struct wire_item w = { .gtrainer = (WP_PEER << 16) | 1, .feature = feature,
			       .shard = shard, .flags = flags, .num_ids = (uint64_t)offsets[nb],
			       .batch_size = nb };
	memcpy(out + *at, &w, sizeof(w));
	*at += sizeof(w);
	memcpy(out + *at, offsets, (nb + 1) * 8);
	*at += (nb + 1) * 8;
	memcpy(out + *at, ids, w.num_ids * 8);
	*at += w.num_ids * 8;
	if (weights) {
		memset(out + *at, 0, wire_pad8(w.num_ids * 4));
		memcpy(out + *at, weights, w.num_ids * 4);
		*at += wire_pad8(w.num_ids * 4);
	}
	if (full) {
		memset(out + *at, 0, wire_pad8(nb * 4));
		memcpy(out + *at, full, nb * 4);
		*at += wire_pad8(nb * 4);
	}
	return (uint64_t)nb * wp_shards[shard].cols * 4;
}

/* (unused attributes: the fuzz target only needs the plan) */
/* A well-formed INPUT message of three items (one per table) at out; returns its bytes and
 * the gradient bytes its HELLO announces in *grad_bytes. */
__attribute__((unused)) static uint64_t wp_good_input(uint8_t *out, uint64_t *grad_bytes)
{
	static const int32_t lens[WP_B] = { 2, 0, 1, 1 };
	static const int64_t ts_ids[4] = { 0, 49, 7, 7 }, rm_ids[4] = { 0, 19, 5, 3 },
			     dp_ids[4] = { 9, 0, 1, 2 };
	static const int32_t full[WP_B] = { 3, 0, 1, 2 };
	static const float weights[4] = { 0.5f, 1.0f, 2.0f, -1.0f };
	uint64_t at = 0;

	*grad_bytes = wp_put_item(out, &at, 0, 0, WIRE_FORWARD, WP_B, lens, ts_ids, NULL, NULL);
	*grad_bytes += wp_put_item(out, &at, 1, 1, WIRE_FORWARD | WIRE_LENGTHS, WP_B, lens, rm_ids,
				   NULL, full);
	*grad_bytes += wp_put_item(out, &at, 2, 3, WIRE_WEIGHTED, WP_B, lens, dp_ids, weights,
				   NULL);
	return at;
}

/* A HELLO head as node WP_PEER sends it. */
__attribute__((unused)) static struct wire_head wp_hello(uint64_t bytes, uint64_t grad_bytes)
{
	return (struct wire_head){ .magic = WIRE_MAGIC, .seq = WP_SEQ, .bytes = bytes,
				   .out_bytes = 0, .grad_bytes = grad_bytes, .accepted_mask = 3 };
}

#endif /* EMBD_TESTS_STEP_WIRE_PLAN_H */
