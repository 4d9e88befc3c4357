/*
 * service/step.h - the step engine: one node's shards (placed by a plan on the node's ranks)
 * and the forward and backward of one training step over the batches of all its trainers.
 *
 * A step runs in phases, each explicit so that a later issue can put the cross-node
 * all-to-all between routing and lookup:
 *   1. route     each trainer's KJT is checked (on the caller's thread) and copied, by every
 *                rank on its own workers, into per-rank INPUT buffers (the ids
 *                each rank must look up: whole bags for table_wise / column_wise /
 *                table_column_wise and one replica of data_parallel, the ids of the rank's row
 *                range for row_wise / table_row_wise);
 *   2. lookup    every rank pools its input on its own workers, all ranks in parallel, writing
 *                column-disjoint results straight into the trainers' outputs and row-split
 *                partial sums into its per-rank OUTPUT buffer;
 *   3. assemble  the partial sums of row_wise / table_row_wise tables are added into the
 *                trainers' outputs (mean divides by the FULL bag length inside the kernel);
 *   4. backward  (only once every participant's gradient is in) every rank applies the fused
 *                optimizer to each of its shards once, with the gradients of all trainers
 *                combined; every data_parallel replica gets the same update.
 * The global batch is the concatenation of the trainers' batches, so the result equals one
 * unsharded table trained on it. A step whose backward never runs changed no parameter.
 */
#ifndef EMBD_SERVICE_STEP_H
#define EMBD_SERVICE_STEP_H

#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "service/ranks.h"

/* What a trainer's batches and outputs look like: the WELCOME layout. */
struct embd_step_layout {
	uint32_t num_features;          /* F: features of every table, tables in config order */
	uint32_t batch_size;            /* B: topology batch_size (local batch per trainer) */
	uint32_t total_dim;             /* columns of the pooled output */
	uint64_t max_values;            /* most ids one trainer's batch may hold */
	const char (*feature_names)[EMBD_NAME_MAX];   /* F */
	const uint32_t *feature_dims;                 /* F */
	const uint32_t *feature_offsets;              /* F: first output column */
	const uint32_t *feature_tables;               /* F: index into the tables */
};

/*
 * One trainer's part of a step. kjt: its batch (keys may be NULL; when given they must be the
 * layout's names in order). pooled: its output float[B][total_dim], written by forward.
 * pooled_grad: dL/d(pooled), same shape, read by backward. status and err are outputs:
 * forward sets them per trainer (0, or why this trainer's batch was refused).
 */
struct embd_step_batch {
	struct embd_kjt kjt;
	float *pooled;
	const float *pooled_grad;
	int status;
	char err[224];
};

/* Work counters of the last forward (for stats). */
struct embd_step_counts {
	uint64_t ids;                   /* ids in the accepted batches */
	uint64_t lookups;               /* row reads by all ranks (column shards read a row each) */
	uint64_t input_bytes;           /* lengths, ids and weights copied in */
	uint64_t output_bytes;          /* pooled floats written to trainers */
};

struct embd_step;

/*
 * Allocates and initialises (embd_init_value with seed) the shards of every table of plan
 * that live on ranks [0, embd_ranks_count(ranks)), checked against tables; max_trainers
 * bounds the trainers of one step. Errors name the table or shard.
 */
int embd_step_create(const struct embd_tables *tables, const struct embd_plan *plan,
		     struct embd_ranks *ranks, uint64_t seed, uint32_t max_trainers,
		     struct embd_step **out, char *err, size_t err_len);
/* Frees the shards. NULL is a no-op. */
void embd_step_destroy(struct embd_step *step);

const struct embd_step_layout *embd_step_layout(const struct embd_step *step);

/*
 * Forward of one step for n trainers (n <= max_trainers). Each batch is checked (sizes,
 * lengths, ids against their table's rows) and copied in; a refused batch gets status < 0 and
 * err naming the field, and the step runs without it. Returns the number of accepted batches
 * (>= 0), or a negative EMBD_E* code when the step itself failed (err in every batch).
 * The accepted trainers' routing is kept for embd_step_backward.
 */
int embd_step_forward(struct embd_step *step, struct embd_step_batch *batches, uint32_t n);

/*
 * Backward of the step last forwarded: batches is the same array as forward's (pooled_grad
 * set for every accepted batch). Applies the fused optimizer to every shard once.
 * EMBD_EINVAL when no forward is pending.
 */
int embd_step_backward(struct embd_step *step, struct embd_step_batch *batches, uint32_t n);

/* Drops the pending forward without touching any parameter (a trainer died). */
void embd_step_abort(struct embd_step *step);

/* Counters of the last forward. */
void embd_step_counts(const struct embd_step *step, struct embd_step_counts *out);

/* For tests and checkpoints: weight (row, col) of table t as fp32, read from whichever shard
 * holds it (data_parallel: replica on rank `replica`); EMBD_ENOENT when none does. */
int embd_step_read_weight(const struct embd_step *step, uint32_t table, int64_t row,
			  uint32_t col, uint32_t replica, float *out);

#endif /* EMBD_SERVICE_STEP_H */
