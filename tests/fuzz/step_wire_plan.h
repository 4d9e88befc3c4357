/*
 * tests/fuzz/step_wire_plan.h - a small cluster plan as the step engine holds it (only the
 * fields engine/step_wire.c reads), seen from node 0 of 2, and a writer of INPUT items, for
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

static struct embd_table_spec wp_specs[3] = {
	{ .name = "ts", .num_embeddings = 50, .embedding_dim = 4, .pooling = EMBD_POOLING_SUM },
	{ .name = "rm", .num_embeddings = 40, .embedding_dim = 8, .pooling = EMBD_POOLING_MEAN },
	{ .name = "dp", .num_embeddings = 10, .embedding_dim = 2, .pooling = EMBD_POOLING_SUM },
};

static struct step_table wp_tables[3] = {
	{ .spec = &wp_specs[0], .type = EMBD_SHARD_TABLE_WISE, .first_shard = 0, .num_shards = 1,
	  .num_replicas = 1, .num_local = 1 },
	{ .spec = &wp_specs[1], .type = EMBD_SHARD_ROW_WISE, .first_shard = 1, .num_shards = 2,
	  .num_replicas = 1, .num_local = 1 },
	{ .spec = &wp_specs[2], .type = EMBD_SHARD_DATA_PARALLEL, .first_shard = 3,
	  .num_shards = 2, .num_replicas = 2, .num_local = 1 },
};

#define WP_SHARD(t, row, nrows, ncols, r, n) \
	{ .desc = { .table_id = t, .num_embeddings = 0, .row_offset = row, .rows = nrows, \
		    .cols = ncols }, .table = t, .rank = r, .node = n, .local = r % 2 }

static struct step_shard wp_shards[5] = {
	WP_SHARD(0, 0, 50, 4, 0, 0),
	WP_SHARD(1, 0, 20, 8, 1, 0),
	WP_SHARD(1, 20, 20, 8, 2, 1),
	WP_SHARD(2, 0, 10, 2, 0, 0),
	WP_SHARD(2, 0, 10, 2, 2, 1),
};

static uint32_t wp_feature_tables[3] = { 0, 1, 2 };

static struct embd_step wp_step = {
	.num_tables = 3, .num_shards = 5, .num_ranks = 2, .node = 0, .num_nodes = 2,
	.tables = wp_tables, .shards = wp_shards, .feature_tables = wp_feature_tables,
	.layout = { .num_features = 3, .batch_size = WP_B },
};

/*
 * Appends one item to out at *at (8-aligned, as the sender packs it): the head, offsets from
 * lens (B bag lengths), ids, weights when weights != NULL, full lengths when full != NULL.
 * Returns the bytes of gradient the item brings (B * cols * 4).
 */
__attribute__((unused)) static uint64_t wp_put_item(uint8_t *out, uint64_t *at, uint32_t feature, uint32_t shard,
			    uint32_t flags, const int32_t *lens, const int64_t *ids,
			    const float *weights, const int32_t *full)
{
	int64_t offsets[WP_B + 1] = { 0 };
	for (uint32_t b = 0; b < WP_B; b++)
		offsets[b + 1] = offsets[b] + lens[b];
	struct wire_item w = { .gtrainer = (WP_PEER << 16) | 1, .feature = feature,
			       .shard = shard, .flags = flags, .num_ids = (uint64_t)offsets[WP_B] };
	memcpy(out + *at, &w, sizeof(w));
	*at += sizeof(w);
	memcpy(out + *at, offsets, sizeof(offsets));
	*at += sizeof(offsets);
	memcpy(out + *at, ids, w.num_ids * 8);
	*at += w.num_ids * 8;
	if (weights) {
		memset(out + *at, 0, wire_pad8(w.num_ids * 4));
		memcpy(out + *at, weights, w.num_ids * 4);
		*at += wire_pad8(w.num_ids * 4);
	}
	if (full) {
		memset(out + *at, 0, wire_pad8(WP_B * 4));
		memcpy(out + *at, full, WP_B * 4);
		*at += wire_pad8(WP_B * 4);
	}
	return (uint64_t)WP_B * wp_shards[shard].desc.cols * 4;
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

	*grad_bytes = wp_put_item(out, &at, 0, 0, WIRE_FORWARD, lens, ts_ids, NULL, NULL);
	*grad_bytes += wp_put_item(out, &at, 1, 1, WIRE_FORWARD | WIRE_LENGTHS, lens, rm_ids, NULL,
				   full);
	*grad_bytes += wp_put_item(out, &at, 2, 3, WIRE_WEIGHTED, lens, dp_ids, weights, NULL);
	return at;
}

/* A HELLO head as node WP_PEER sends it. */
__attribute__((unused)) static struct wire_head wp_hello(uint64_t bytes, uint64_t grad_bytes)
{
	return (struct wire_head){ .magic = WIRE_MAGIC, .seq = WP_SEQ, .bytes = bytes,
				   .out_bytes = 0, .grad_bytes = grad_bytes, .accepted_mask = 3 };
}

#endif /* EMBD_TESTS_STEP_WIRE_PLAN_H */
