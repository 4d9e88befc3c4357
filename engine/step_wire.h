/*
 * engine/step_wire.h - the messages the step engines of a cluster exchange (step_dist.c runs
 * the exchanges; the protocol is described at the top of step_dist.c) and the checks of every
 * byte that arrives from a peer node. Kept apart from the exchanges so that a fuzz target
 * (tests/fuzz/fuzz_step_wire.c) and a unit test (tests/unit/test_step_wire.c) reach the very
 * code that step_dist.c runs, on plain byte buffers and the plan alone (struct step_wire_plan:
 * the checks read nothing else of the engine, so the fuzz target links only this file).
 *
 * A peer is trusted for nothing: a message that fails a check gets EMBD_EPROTO (or
 * EMBD_EMISMATCH for another step or protocol) and a message naming the node and the field,
 * and no byte of it is used before it was checked.
 */
#ifndef EMBD_ENGINE_STEP_WIRE_H
#define EMBD_ENGINE_STEP_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"

#define WIRE_MAGIC 0x32504554534d4245ull        /* "EMBSTEP2" */
#define MAX_MESSAGE_BYTES (1ull << 36)

/* The head of every message between two nodes (160 bytes, a multiple of 8). */
struct wire_head {
	uint64_t magic;
	uint64_t seq;                           /* forwards run by the sender's engine */
	int64_t status;                         /* 0, or why the sender fails the step */
	uint64_t bytes;                         /* HELLO: bytes of the INPUT message to follow */
	uint64_t out_bytes;                     /* HELLO: bytes of OUTPUT the sender expects back */
	uint64_t grad_bytes;                    /* HELLO: bytes of GRADS the sender will send */
	uint64_t accepted_mask;                 /* HELLO: the sender's accepted batches */
	uint64_t flags;                         /* HELLO: WIRE_HELLO_* */
	char why[96];
};

/* The sender wants every node to checkpoint at the boundary after this step. */
#define WIRE_HELLO_CHECKPOINT 1u
/* This round is an evaluation (forward only, nothing trains), not a training step's forward:
 * the nodes' evaluations are rounds of their own between the steps, in the same order on
 * every node. */
#define WIRE_HELLO_EVAL 2u
/* The sender has no trainer with a batch: it runs whatever round the others run. */
#define WIRE_HELLO_IDLE 4u
#define WIRE_HELLO_KNOWN (WIRE_HELLO_CHECKPOINT | WIRE_HELLO_EVAL | WIRE_HELLO_IDLE)

/* One staged item on the wire, followed by int64 offsets[b + 1], int64 ids[num_ids], float
 * weights[num_ids] (WIRE_WEIGHTED) and int32 lengths[b] (WIRE_LENGTHS), each padded to 8, with
 * b = batch_size: the samples of its trainer's batch (1 .. the plan's batch size; a short
 * last batch of an epoch has fewer). Its pooled block and gradient are b x cols floats. */
struct wire_item {
	uint32_t gtrainer, feature, shard, flags;
	uint64_t num_ids;
	uint32_t batch_size;
	uint32_t reserved;                      /* zero */
};
#define WIRE_WEIGHTED 1u
#define WIRE_LENGTHS 2u
#define WIRE_FORWARD 4u

static inline uint64_t wire_pad8(uint64_t n)
{
	return (n + 7) & ~7ull;
}

/*
 * Copies the head of peer p's message (len bytes at msg) into *head (why NUL-terminated) and
 * checks it against this exchange: EMBD_EPROTO when len is shorter than a head, EMBD_EMISMATCH
 * when the magic or the step exchange number is not seq (the peer runs another step or
 * another protocol: the cluster cannot go on). err names the node (self: this node).
 */
int step_wire_head(uint32_t p, const uint8_t *msg, uint64_t len, uint64_t seq, uint32_t self,
		   struct wire_head *head, char *err, size_t err_len);

/*
 * The sizes a HELLO head announces: each at most MAX_MESSAGE_BYTES (what a sane peer of this
 * version can send) and the INPUT bytes a multiple of 8 (the receive buffer keeps every
 * peer's INPUT 8-aligned, which step_wire_input relies on); no flag this version does not
 * know. EMBD_EPROTO naming node p.
 */
int step_wire_hello(uint32_t p, const struct wire_head *head, char *err, size_t err_len);

/*
 * The kind of round every node's HELLO head (heads[0..n), checked by step_wire_hello) makes:
 * *eval when the nodes that are not IDLE evaluate (a training step when all are IDLE). Every
 * node that is not IDLE must run the same kind, and no node may both evaluate and be IDLE:
 * else EMBD_EMISMATCH naming a node that trains and one that evaluates (their trainers post
 * evaluations at another point of their steps; the cluster cannot go on). An evaluation
 * announces no gradient bytes (EMBD_EPROTO). self names this node in the message.
 */
int step_wire_round(const struct wire_head *heads, uint32_t n, uint32_t self, bool *eval,
		    char *err, size_t err_len);

/* A shard of the cluster as the checks see it. */
struct step_wire_shard {
	uint32_t table;                         /* index into step_wire_plan.tables */
	uint32_t node;                          /* the node that holds it */
	int64_t row_offset, rows;               /* its rows of the table */
	uint32_t cols;
};

struct step_wire_table {
	enum embd_sharding_type type;
	enum embd_pooling pooling;
};

/* The plan as the checks read it (the engine fills it once, engine/step.c): every shard of
 * the cluster in the plan's order (the shard numbers peers send), each feature's table, the
 * batch size (the most samples of one trainer's batch), this node. */
struct step_wire_plan {
	uint32_t node, batch_size;
	uint32_t num_tables, num_shards, num_features;
	const struct step_wire_table *tables;
	const struct step_wire_shard *shards;
	const uint32_t *feature_tables;         /* num_features */
};

/* One item of a peer's INPUT message, checked; its arrays point into the message. */
struct step_wire_item {
	uint32_t gtrainer, feature, shard;
	uint32_t batch_size;                    /* b: 1 .. the plan's batch size */
	bool weighted, forward;
	uint64_t num_ids;
	const int64_t *offsets;                 /* b + 1 */
	const int64_t *ids;                     /* num_ids, every one in the shard's rows */
	const float *weights;                   /* num_ids, or NULL */
	const int32_t *lengths;                 /* b full bag lengths (row-split mean), or NULL */
};

/* Called for every item in message order; a non-zero return stops the walk and is returned. */
typedef int (*step_wire_item_fn)(void *arg, uint32_t p, uint64_t seq,
				 const struct step_wire_item *item);

/*
 * Checks peer p's INPUT message (len bytes at buf, 8-aligned) against the plan and hands each item to
 * fn. Every item must be for a shard on this node whose table the feature reads, from one of
 * p's trainers, with a batch size of 1 .. the plan's, the flags its table needs, offsets from
 * 0 to num_ids never decreasing, ids inside the shard's rows, full bag lengths no shorter than
 * the bag's ids here, and the whole message made of whole items. The gradients p announced
 * (grad_bytes, from its HELLO) must be exactly b * cols * 4 per item. An evaluation's message
 * (eval) carries no data_parallel item (every node looks those up in its own replica) and
 * announces no gradient. Returns 0, fn's code, or EMBD_EPROTO with err naming the node, the
 * item and the field.
 */
int step_wire_input(const struct step_wire_plan *s, uint32_t p, const uint8_t *buf, uint64_t len,
		    uint64_t grad_bytes, bool eval, step_wire_item_fn fn, void *arg, char *err,
		    size_t err_len);

#endif /* EMBD_ENGINE_STEP_WIRE_H */
