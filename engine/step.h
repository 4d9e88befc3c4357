/*
 * engine/step.h - the step engine: one node's shards (placed by a plan on the node's ranks)
 * and the forward and backward of one training step over the batches of all its trainers.
 *
 * A step runs in phases, each explicit so that the cross-node exchanges (below) sit between
 * them:
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
 *
 * An evaluation (embd_step_eval) runs the forward phases 1-3 alone, in buffers of its own.
 *
 * On several nodes (embd_step_create_cluster) each node holds the shards of its own ranks and
 * runs the same phases with three collectives in forward and one in backward between them
 * (engine/step_dist.c): a fixed-size exchange of sizes, accept counts and status; ONE
 * all-to-all of the ids routed to other nodes; after lookup ONE all-to-all of the pooled
 * partials back to the trainers' nodes; in backward ONE all-to-all of the gradients (with
 * every node's abort flag) to the owners. The global batch is node 0's batches, then node
 * 1's, ... Every node calls forward and backward for every step, even with no batch of its
 * own, so that the collectives line up.
 */
#ifndef EMBD_ENGINE_STEP_H
#define EMBD_ENGINE_STEP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "engine/ranks.h"

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
 * pooled_grad: dL/d(pooled), same shape, read by backward. grad_from (or NULL): memory the
 * caller does not trust to hold still (a trainer's slab, written whenever the trainer likes);
 * backward first copies it into grad_copy (B x total_dim floats of the caller's) and sets
 * pooled_grad to grad_copy, on every rank's threads at once, checking each value as it lies
 * in the copy: what is checked is what is used. status and err are outputs: forward sets them
 * per trainer (0, or why this trainer's batch was refused).
 */
struct embd_step_batch {
	struct embd_kjt kjt;
	float *pooled;
	const float *pooled_grad;
	const float *grad_from;
	float *grad_copy;
	uint32_t trainer;               /* its trainer's index on this node: named in errors */
	int status;
	char err[224];
};

/* This node's place in a cluster of embd nodes (NULL or num_nodes 1: one node, no comm). */
struct embd_comm;
struct embd_store;
struct embd_step_cluster {
	uint32_t node, num_nodes;
	struct embd_comm *comm;         /* one participant per node; used from the caller's thread;
					   NULL: broken until embd_step_comm_set (a rejoining node) */
	struct embd_store *store;       /* to name the node that did not answer; may be NULL */
	int timeout_ms;                 /* the comm's collective timeout (for messages) */
};

/* The collectives of a step on several nodes, in order (engine/step_dist.c). */
enum embd_step_exchange {
	EMBD_STEP_SIZES = 0,            /* forward: sizes, accept flags, status */
	EMBD_STEP_INPUT = 1,            /* forward: ids, weights, offsets */
	EMBD_STEP_OUTPUT = 2,           /* forward: pooled partials back */
	EMBD_STEP_GRADS = 3,            /* backward: gradients of the pooled outputs */
	EMBD_STEP_EXCHANGES
};

/* Work counters of the last forward (for stats). */
struct embd_step_counts {
	uint64_t ids;                   /* ids in the accepted batches */
	uint64_t lookups;               /* row reads by all ranks (column shards read a row each) */
	uint64_t input_bytes;           /* lengths, ids and weights copied in */
	uint64_t output_bytes;          /* pooled floats written to trainers */
	uint64_t sent_bytes;            /* bytes sent to other nodes (forward and backward) */
	uint64_t exchange_bytes[EMBD_STEP_EXCHANGES];  /* sent_bytes by exchange */
	/* row-split partial sums for this node's trainers' outputs: copied device to device to
	 * the summing rank (peer access; the CPU's memcpy: n - 1 of a table's n shards, the
	 * summing rank's own stays), or through host memory (every partial of a table with
	 * shards on other nodes, summed on the host; a GPU pair without peer access's copies) */
	uint64_t partial_device_bytes, partial_host_bytes;
	/* of the last backward (embd_step_backward): */
	uint32_t nonfinite_grads;       /* this node's batches refused for a non-finite gradient */
	uint64_t nonfinite_rows;        /* rows the update left NaN or infinite, this node's */
	uint32_t nonfinite_table;       /* ... the first one's table and global row */
	int64_t nonfinite_row;
	/* tables whose column shards on this node applied one prep of their occurrences (ids
	 * checked and sorted by row once, not once per shard: engine/step.c), and those shards */
	uint32_t backward_prepares;
	uint32_t backward_shared_shards;
};

struct embd_step;
struct embd_shard;
struct embd_bag_batch;

/*
 * Allocates and initialises (embd_init_value with seed) the shards of every table of plan
 * that live on ranks [0, embd_ranks_count(ranks)), checked against tables; max_trainers
 * bounds the trainers of one step. Errors name the table or shard.
 */
int embd_step_create(const struct embd_tables *tables, const struct embd_plan *plan,
		     struct embd_ranks *ranks, uint64_t seed, uint32_t max_trainers,
		     struct embd_step **out, char *err, size_t err_len);
/*
 * The same for one node of a cluster: only the shards of the node's global ranks
 * [node * L, (node + 1) * L) are allocated (L = embd_ranks_count(ranks) = the plan's
 * local_world_size), and max_trainers is at most 64 (the accept flags of one node).
 */
int embd_step_create_cluster(const struct embd_tables *tables, const struct embd_plan *plan,
			     struct embd_ranks *ranks, uint64_t seed, uint32_t max_trainers,
			     const struct embd_step_cluster *cluster, struct embd_step **out,
			     char *err, size_t err_len);
/* Frees the shards. NULL is a no-op. */
void embd_step_destroy(struct embd_step *step);

const struct embd_step_layout *embd_step_layout(const struct embd_step *step);

/*
 * Forward of one step for n trainers (n <= max_trainers). Each batch is checked (sizes,
 * lengths, ids against their table's rows) and copied in; a refused batch gets status < 0 and
 * err naming the field, and the step runs without it. Returns the number of accepted batches
 * (>= 0), or a negative EMBD_E* code when the step itself failed (err in every batch).
 * The accepted trainers' routing is kept for embd_step_backward. On a cluster a failure of
 * any node (or of a collective: EMBD_ETIMEDOUT naming the node) fails the step everywhere.
 * After a collective failed, every later step fails at once with EMBD_EIO: the comm is broken
 * and the nodes may disagree on parameters, until embd_step_comm_set hands the engine the comm
 * of a re-formed cluster (dist/regroup.h decides whether the parameters still agree).
 */
int embd_step_forward(struct embd_step *step, struct embd_step_batch *batches, uint32_t n);

/*
 * Pipelined steps (TorchRec's TrainPipelineSparseDist idea): while a step waits for its
 * backward, the n batches of the NEXT step may be prepared: checked and routed (their ids
 * copied into the ranks' input buffers, a bad one refusing its batch: status and err set now)
 * in a training pass of their own, the pending step's items untouched. The next
 * embd_step_forward of the same batches array and n then goes on from there (on a cluster:
 * the exchanges, in the same order as ever; the lookup, after the backward), so the result is
 * bit-identical to an unpipelined step; a forward of other batches drops the preparation,
 * as do embd_step_abort and embd_step_comm_set (once embd_step_backward_overlapped ran its
 * input exchange, dropping it breaks the comm). The batches (kjt, pooled) must stay valid
 * until that forward. Returns the batches accepted on this node, or EMBD_EINVAL (inside an
 * evaluation, n > max_trainers, or a preparation already exchanged). Caller's thread, no
 * forward or backward running.
 */
int embd_step_prepare(struct embd_step *step, struct embd_step_batch *batches, uint32_t n);
/* Whether a preparation waits for its forward. */
bool embd_step_prepared(const struct embd_step *step);

/* Accepted batches of the last forward over the whole cluster (= forward's result on one
 * node). When it is > 0 every node must call backward or abort, even with none of its own. */
uint32_t embd_step_cluster_accepted(const struct embd_step *step);

/*
 * An evaluation: the forward of n batches (checked and refused per batch as in forward) on the
 * rows as they are now, with nothing kept for a backward and no parameter changed. It has
 * buffers of its own, so it may run between a step's forward and its backward and leaves
 * that step's pending backward intact (the rows it reads are then those before that step's
 * update, as in TorchRec, whose update happens in the backward). Returns the batches accepted
 * on this node, or an error as forward (err in every batch).
 * On a cluster it is a collective round of its own, as a forward: every node calls
 * embd_step_eval (or embd_step_follow) for the same evaluation round, in the same order
 * relative to its steps; a node that runs a step's forward at that point instead fails the
 * round on every node with EMBD_EMISMATCH and breaks the comm (the trainers disagree on the
 * order of their steps and evaluations).
 */
int embd_step_eval(struct embd_step *step, struct embd_step_batch *batches, uint32_t n);

/*
 * On a cluster, for a node none of whose trainers has a batch (none connected): joins the
 * next round the other nodes run, whichever it is. *eval says which it was: an evaluation
 * (nothing pending), or a training step's forward of no batch (then, as after forward,
 * backward or abort is due when embd_step_cluster_accepted > 0). EMBD_EINVAL while a forward
 * is pending; otherwise returns as forward. On one node: a forward of no batch.
 */
int embd_step_follow(struct embd_step *step, bool *eval);

/* Checkpoints a cluster agrees on (ckpt/ckpt_service.h): _want sets this node's flag in the
 * HELLO of the next forwards; _cluster_checkpoint says whether any node's HELLO of the last
 * forward carried it, the same answer on every node (false on one node, and when the forward
 * failed before or in HELLO). */
void embd_step_want_checkpoint(struct embd_step *step, bool want);
bool embd_step_cluster_checkpoint(const struct embd_step *step);

/*
 * Backward of the step last forwarded: batches is the same array as forward's (pooled_grad,
 * or grad_from and grad_copy, set for every accepted batch). Applies the fused optimizer to
 * every shard once, with the gradients of all trainers summed (each divided by the grad
 * divisor when one is set). EMBD_EINVAL when no forward is pending.
 *
 * Every accepted gradient is checked first (kernels/finite.h; split over the ranks' threads,
 * copied as it is checked where grad_from is set): one with a NaN or infinite element
 * refuses the whole step as an abort does, before any row changes anywhere (one
 * trainer's NaN would reach every row it touches, for every trainer and every later
 * checkpoint): EMBD_ECANCELED, every batch's err naming the trainer, sample, column and
 * feature; on a cluster through the gradient exchange's abort flag, so every node refuses the
 * step alike. counts.nonfinite_grads says how many of this node's batches were refused.
 * A huge but finite gradient is applied: clipping is the trainer's job. A row the update
 * leaves NaN or infinite (weights or optimizer state, e.g. adagrad's sum of squares
 * overflowing from gradients near 1e19) is kept, but counted and named in counts
 * (nonfinite_rows: the CPU and the CUDA kernels check every row they update; the CUDA check
 * has not run on a GPU yet).
 */
int embd_step_backward(struct embd_step *step, struct embd_step_batch *batches, uint32_t n);

/*
 * Backward as embd_step_backward, and on a cluster whose comm moves host memory (gloo), when a
 * preparation waits (embd_step_prepare): once the gradient exchange succeeded, the ranks apply
 * the update while the engine's comm thread runs the prepared step's input exchange (HELLO,
 * INPUT), so that its communication hides behind the optimizer. The collectives keep their
 * order (gradients of step s, then step s + 1's sizes and ids), so the other nodes need not
 * pipeline. applied (may be NULL) is called once on this thread with backward's result as soon
 * as the update is applied (or the backward failed), while that exchange may still run: it may
 * hand out the backward's completions (the batches' status and err are set) but must not call
 * the engine. Returns backward's result once the exchange is done too; embd_step_exchanged then
 * says whether it ran, and if it did the next call must be embd_step_forward of the prepared
 * batches, which goes on with the lookup and returns the exchange's outcome (anything else
 * breaks the comm: the other nodes are in that step's output exchange). The exchange starts
 * before the update, so it may have run even when the backward then failed: check
 * embd_step_exchanged after every result. Without the overlap (one node, nccl, no
 * preparation, the step aborted before the update) it is embd_step_backward.
 */
typedef void (*embd_step_applied_fn)(void *arg, int rc);
int embd_step_backward_overlapped(struct embd_step *step, struct embd_step_batch *batches,
				  uint32_t n, embd_step_applied_fn applied, void *arg);
/* Whether the prepared step's input exchange ran in the last backward (above). */
bool embd_step_exchanged(const struct embd_step *step);

/*
 * Drops the pending forward (and a prepared next step) without touching any parameter (a
 * trainer died). On a cluster
 * this is this node's part of the backward collective with an abort flag and why, so that
 * every node drops the step (their backward returns EMBD_ECANCELED with why); it returns the
 * collective's failure, if any.
 */
int embd_step_abort(struct embd_step *step, const char *why);

/* On a cluster: true when a failed collective (or embd_step_comm_break) broke the comm, with
 * *why (may be NULL) the failure, naming the node; false on one node. */
bool embd_step_comm_broken(const struct embd_step *step, const char **why);
/* Breaks the comm from outside (another node opened a new generation): steps are refused. */
void embd_step_comm_break(struct embd_step *step, const char *why);
/* Between steps (none pending): the comm of generation gen, same size and rank (the caller
 * keeps owning it); exchanges count from 0 again. EMBD_EINVAL otherwise. */
int embd_step_comm_set(struct embd_step *step, struct embd_comm *comm, uint64_t gen);

/*
 * TorchRec's gradient division: from the next backward on, every trainer's dL/d(pooled) is
 * divided by divisor before the gradients are summed (TorchRec divides by its world size,
 * the number of trainers, so that a learning rate means the same whatever their number). 0
 * or 1 (the default): summed as they are. Between steps.
 */
void embd_step_set_grad_divisor(struct embd_step *step, uint32_t divisor);

/* Counters of the last forward. */
void embd_step_counts(const struct embd_step *step, struct embd_step_counts *out);
/* Row reads of table (its index in the tables) by this node's ranks since creation, over every
 * forward that ran its lookups (steps aborted later included); 0 for an unknown table. */
uint64_t embd_step_table_lookups(const struct embd_step *step, uint32_t table);
/* A fused_uvm_caching table's cache lookups on this node's shards (engine/ranks.h,
 * embd_ranks_cache_counts: distinct rows of each forward call, found or fetched) into *hits
 * and *misses; false (both 0) for a table of another kernel or none here. */
bool embd_step_table_cache(const struct embd_step *step, uint32_t table, uint64_t *hits,
			   uint64_t *misses);

/* For tests and checkpoints: weight (row, col) of table t as fp32, read from whichever shard
 * holds it (data_parallel: replica on rank `replica`); EMBD_ENOENT when none does. */
int embd_step_read_weight(const struct embd_step *step, uint32_t table, int64_t row,
			  uint32_t col, uint32_t replica, float *out);

/* ---- live table access ---------------------------------------------------------------------
 * Rows of one table in table coordinates, read or written between steps (no forward or
 * backward running) on the caller's thread, whatever the sharding (engine/step_tables.c).
 * Arrays: the weights (num_embeddings x embedding_dim, fp16 tables converted), the optimizer
 * state momentum1 (adagrad's sum of squares, adam's m: x embedding_dim; rowwise_adagrad's: x
 * one value per column shard of the row, 1 unless the table is column-split) and momentum2
 * (adam's v). A data_parallel table is read from this node's replica and written to all of
 * them. On a cluster only what this node holds: a row or columns on another node give
 * EMBD_ENOENT naming it. */
enum embd_step_array {
	EMBD_STEP_WEIGHTS = 0,
	EMBD_STEP_MOMENTUM1 = 1,
	EMBD_STEP_MOMENTUM2 = 2,
};

struct embd_step_table_info {
	int64_t num_embeddings;
	uint32_t cols;                  /* floats per row of the array; 0: the optimizer has none */
	int64_t optimizer_step;         /* optimizer steps the table's shards applied (adam's t) */
};

/* The shape of array a of table t. EMBD_ENOENT: no such table or array. */
int embd_step_table_info(const struct embd_step *step, uint32_t table, enum embd_step_array a,
			 struct embd_step_table_info *out);

/* n rows: ids[0..n) when ids is not NULL, else row_begin .. row_begin + n - 1. */
struct embd_step_rows {
	const int64_t *ids;
	int64_t row_begin;
	uint64_t n;
};

/*
 * Reads the rows of array a of table t into out (float[n][info.cols]). Returns 0, EMBD_ENOENT
 * (no such table; a part on another node, named in err), EMBD_EINVAL (the optimizer keeps no
 * such array), EMBD_ERANGE (a row outside the table, named).
 */
int embd_step_table_read(const struct embd_step *step, uint32_t table, enum embd_step_array a,
			 const struct embd_step_rows *rows, float *out, char *err, size_t err_len);

/*
 * Writes in (float[n][info.cols], every value finite) into the rows of array a of table t:
 * the next forward reads them. Every row is checked before any is written, and the update
 * hook (a running checkpoint's copy-before-write) sees them first. Returns as read, and
 * EMBD_EINVAL for a value that is not finite (named).
 */
int embd_step_table_write(struct embd_step *step, uint32_t table, enum embd_step_array a,
			  const struct embd_step_rows *rows, const float *in, char *err,
			  size_t err_len);

/* ---- shards, for checkpoints ---------------------------------------------------------------
 * Between steps (no forward or backward running) the shards may be read and, before the first
 * step, written through these views; a data_parallel table's replicas beyond the first are
 * marked so a checkpoint saves one copy and a restore fills all. */
struct embd_step_shard_view {
	uint32_t table;                 /* index into the tables the step was created with */
	uint32_t rank;
	bool replica;                   /* a data_parallel copy other than the table's first */
	struct embd_shard *shard;       /* desc, weights, momentum1/2, step: the host view */
};

/*
 * Called on the rank worker that runs a backward, before the optimizer updates any row of
 * shard: the batches' ids name the rows about to change (ids outside the shard are refused by
 * the kernel and change nothing). A checkpoint's copy-before-write (ckpt/ckpt_snapshot.h)
 * saves those rows first. Set it between steps; NULL removes it.
 */
typedef void (*embd_step_update_hook)(void *arg, const struct embd_shard *shard,
				      const struct embd_bag_batch *batches, uint32_t n);
void embd_step_set_update_hook(struct embd_step *s, embd_step_update_hook hook, void *arg);

/*
 * The views' shards are host memory (engine/ranks.h's host view): on GPU ranks a copy of an
 * HBM shard or the rows of a fused_uvm one. Before reading them between steps bring them up to
 * date (a device -> host copy of each shard a backward changed since; nothing on CPU ranks);
 * after writing them say so, and the devices get the rows before the next step.
 */
int embd_step_shards_pull(struct embd_step *step, char *err, size_t err_len);
void embd_step_shards_changed(struct embd_step *step);

/* Shards of every table on this node, in plan order. */
uint32_t embd_step_num_shards(const struct embd_step *step);

/* Shard i (< embd_step_num_shards). */
void embd_step_shard_view(const struct embd_step *step, uint32_t i,
			  struct embd_step_shard_view *out);

#endif /* EMBD_ENGINE_STEP_H */
