/*
 * engine/step_internal.h - the step engine's private state, shared by step.c (creation, lookup,
 * backward on this node's ranks), step_route.c (batches into items) and step_dist.c (the
 * exchanges with the other nodes).
 *
 * Everything hangs off "items": one (trainer, feature, shard) bag batch. An item lives in the
 * rank_io of the rank that looks it up. io[0 .. L) are this node's ranks; io[L + m] is the
 * STAGING buffer of node m (m != this node): items routed there are packed for node m by the
 * input exchange, and their pooled partials come back in the output exchange. Items that
 * arrived from another node sit on the local rank's io with pointers into the receive buffer
 * (peer != NO_PEER); their outputs go to the rank's partial buffer and are sent back.
 *
 * The buffers of one pass over the trainers' batches form a struct step_pass. A training
 * step's pass keeps its items until its backward; an evaluation (embd_step_eval) runs in a
 * pass of its own, so that it may run while a step waits for its backward and leave it
 * intact. There are two training passes: while step s waits for its backward in train[cur],
 * embd_step_prepare routes step s + 1 into train[cur ^ 1] (pipelined steps), and that step's
 * forward goes on from there. On a cluster embd_step_backward_overlapped also runs step
 * s + 1's input exchange (HELLO, INPUT) into train[cur ^ 1] while the ranks apply step s from
 * train[cur]: the apply reads only train[cur] (and the gradient buffer), the exchange only
 * train[cur ^ 1], each with its own exchange buffers (step_dist.c). s->pass is the pass
 * running: train[cur] but inside an evaluation, a preparation or that exchange.
 */
#ifndef EMBD_ENGINE_STEP_INTERNAL_H
#define EMBD_ENGINE_STEP_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/embedding.h"
#include "engine/step.h"
#include "engine/step_wire.h"

#define NO_INDEX UINT64_MAX
#define NO_PEER UINT32_MAX
#define NO_BATCH UINT32_MAX
#define NO_IO UINT32_MAX

struct step_shard {
	struct embd_shard *shard;               /* NULL when the shard lives on another node;
						   the kernels' (device memory on a GPU rank) */
	struct embd_shard *host;                /* its host view (engine/ranks.h), or NULL */
	struct embd_shard_desc desc;            /* known for every shard of the plan */
	uint32_t table;
	uint32_t rank;                          /* global rank */
	uint32_t node;                          /* rank / local_world_size */
	uint32_t local;                         /* local rank, when node is this node */
	uint64_t nonfinite_seen;                /* shard->nonfinite_rows after the last backward */
};

struct step_table {
	const struct embd_table_spec *spec;
	enum embd_sharding_type type;
	uint32_t first_shard, num_shards;       /* into step->shards, in the plan's order */
	uint64_t lookups;                       /* row reads by this node's ranks, every forward */
	uint32_t num_replicas;                  /* data_parallel: = num_shards; else 1 */
	uint32_t num_local;                     /* shards of the table on this node */
	/* row-split with every shard on this node, all over the same columns: the local
	 * trainers' partial sums are summed on the ranks' devices (step.c, reduce_rank) */
	bool device_sum;
	/* column-split with several shards on this node, all over the same rows and able to take
	 * prepared occurrences (embd_ranks_backward_shares): the backward checks and sorts the
	 * table's ids once, on prep_rank (one of theirs, the tables spread over the ranks), for
	 * all of them (step.c, prepare_rank) */
	bool shares_prep;
	uint32_t prep_rank;
};

/* A table's occurrences prepared once for its shards on this node, in one backward. */
struct step_prep {
	bool shared;                            /* this backward: its shards apply prep */
	uint32_t lead;                          /* the shard whose items were prepared */
	struct embd_backward_prep *prep;
	int rc;                                 /* the prepare's error, its shards' error */
	struct embd_kernel_err kerr;
};

/* A shard's items in its rank's io, in one backward. */
struct item_span {
	uint64_t first, n;
};

struct step_item {
	uint32_t shard, feature;
	uint32_t batch;                         /* index into the step's batches, or NO_BATCH */
	uint32_t gtrainer;                      /* (node << 16) | batch: the global batch order */
	uint32_t bsize;                         /* samples of its trainer's batch (<= layout B) */
	bool forward;                           /* data_parallel: only the trainer's replica */
	bool weighted;
	bool copy;                              /* data_parallel: filled by its first replica's */
	/* fill: EMBD_ERANGE for bad_id at values[bad_at], or EMBD_EINVAL for the non-finite
	 * bad_weight at weights[bad_at] */
	int rc;
	int64_t bad_at, bad_id;
	float bad_weight;
	uint64_t offsets_at, ids_at, num_ids;
	uint64_t lengths_at;                    /* full bag lengths (row-split mean) or NO_INDEX */
	uint64_t partial_at;                    /* partial sums / remote outputs, or NO_INDEX */
	/* items from another node: their data in the receive buffer, rx: their wire record */
	uint32_t peer;
	uint64_t rx;
	const int64_t *r_offsets, *r_ids;
	const float *r_weights;
	const int32_t *r_lengths;
};

/* Where routing put one item: s->io[io], items[at] (io NO_IO: the shard gets no item). */
struct item_ref {
	uint32_t io;
	uint64_t at;
};

/* A growable array of elements of one type; len/cap in elements. With dma set (before its
 * first element) its memory is page-aligned and registered with those ranks while allocated
 * (embd_ranks_dma_alloc): arrays the ranks' devices copy by DMA (ids, partials, received
 * items and gradients), not staged by the driver unless registration failed (logged). */
struct vec {
	void *p;
	uint64_t len, cap;
	struct embd_ranks *dma;
	bool registered;                /* p is registered with dma */
};

#define VEC_AT(v, type, i) (&((type *)(v).p)[i])

int vec_reserve(struct vec *v, uint64_t extra, size_t elem);
int vec_take(struct vec *v, uint64_t n, size_t elem, uint64_t *at);
void vec_free(struct vec *v);

/* One rank's (or one remote node's staging) input and output buffers. */
struct rank_io {
	struct vec offsets, ids, weights, lengths, partial, items, batches;
	int rc;
	struct embd_kernel_err kerr;
};

/* The shards one local rank holds: indices into step->shards. */
struct rank_shards {
	uint32_t *shards;
	uint32_t num_shards;
	int init_rc;                            /* initialising the shards at creation */
	char init_err[192];
};

/* One pass over the batches, from routing to assembly (see the top of this file). */
struct step_pass {
	bool eval;                              /* forward only: no item trains */
	struct rank_io *io;                     /* num_io */
	int64_t *scratch_offsets;               /* max_trainers x (F * B + 1): private offsets */
	const float **sources;                  /* max_trainers * F * max_table_shards */
	uint32_t *source_ranks;                 /* the local rank of each device_sum source */
	struct item_ref *refs;                  /* max_trainers * F * max_table_shards */
	struct embd_step_batch *batches;
	uint32_t num_batches;
	uint32_t accepted;                      /* batches accepted by this node's routing */
	uint32_t cluster_accepted;
	struct embd_step_counts counts;
};

/* What a pass asks the other nodes for in its HELLO (step_dist_input). */
enum step_round {
	ROUND_TRAIN,                            /* a training step's forward */
	ROUND_EVAL,                             /* an evaluation */
	ROUND_FOLLOW,                           /* no batch of this node: whatever the others run */
};

struct step_dist;
struct step_lanes;
struct step_overlap;

struct embd_step {
	uint32_t num_tables, num_shards, num_ranks, max_trainers;
	uint32_t node, num_nodes;               /* this node, nodes of the cluster */
	uint32_t num_io;                        /* num_ranks + num_nodes */
	uint32_t max_table_shards;
	struct step_table *tables;
	struct step_shard *shards;
	/* the plan as the checks of peers' messages read it (step_wire.h), over the arrays below */
	struct step_wire_plan wire;
	struct step_wire_table *wire_tables;
	struct step_wire_shard *wire_shards;
	struct embd_ranks *ranks;
	struct rank_shards *rank_shards;        /* num_ranks */
	void **partials;                        /* num_ranks: device_sum partials of the lookup */
	struct step_prep *preps;                /* num_tables: the backward's shared preps */
	struct item_span *spans;                /* num_shards: the backward's items per shard */
	uint64_t max_sum_floats;                /* one device_sum partial at most (B x cols) */
	struct embd_step_layout layout;
	char (*names)[EMBD_NAME_MAX];
	uint32_t *dims, *offsets, *feature_tables;
	uint64_t seed;
	uint32_t grad_divisor;                  /* embd_step_set_grad_divisor; 0, 1: none */
	struct step_dist *dist;                 /* NULL on one node */
	struct step_lanes *lanes;               /* the comm's transport (step_lanes.c), or NULL */
	struct step_overlap *overlap;           /* the comm thread (step_overlap.c), or NULL */
	struct step_pass train[2], eval;
	uint32_t cur;                           /* train[cur]: the last step forwarded */
	bool prepared;                          /* train[cur ^ 1] holds the next step, routed */
	bool exchanged;                         /* ... and its input exchange ran (the other
						   nodes are in its lookup): its forward is due */
	int exchange_rc;                        /* what that exchange returned */
	struct step_pass *pass;                 /* the pass running (see the top of this file) */
	/* the step in flight */
	bool ckpt_want;                         /* this node's HELLO flag (embd_step_want_checkpoint) */
	bool cluster_ckpt;                      /* some node's HELLO of this step carried it */
	bool pending;
	embd_step_update_hook update_hook;      /* before a backward updates rows, or NULL */
	void *update_hook_arg;
};

static inline bool row_split(enum embd_sharding_type t)
{
	return t == EMBD_SHARD_ROW_WISE || t == EMBD_SHARD_TABLE_ROW_WISE;
}

/* Starts the running pass over n batches: its io emptied, counts zeroed. */
void step_pass_begin(struct embd_step *s, struct embd_step_batch *batches, uint32_t n);

/* Marks every accepted batch of the running pass failed with rc and a message (a training
 * step is no longer pending); returns rc. */
int step_fail(struct embd_step *s, int rc, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* The training pass of the step forwarded last (or being forwarded). */
static inline struct step_pass *train_pass(struct embd_step *s)
{
	return &s->train[s->cur];
}

/* ---- step_route.c ---- */

/* Starts the running pass over n batches and routes them: every batch checked and its items'
 * ids copied by the ranks' workers. Returns the batches accepted on this node, or
 * EMBD_EINVAL for more than max_trainers. */
int step_route_pass(struct embd_step *s, struct embd_step_batch *batches, uint32_t n);

/* Checks batch i into its private offsets and reserves its items; on a bad value rolls them
 * back and sets the batch's status and err. Event-loop thread. */
void step_route_batch(struct embd_step *s, uint32_t i);
/* After step_route_batch of every batch: the ranks' workers copy the items' ids, trainers with
 * a bad id are refused; returns the batches accepted on this node. */
uint32_t step_fill_batches(struct embd_step *s);

/* ---- step_lanes.c ---- */
/* Lane l's part of a message of bytes split over lanes: [*off, *off + *len). */
void step_lane_part(uint64_t bytes, uint32_t lanes, uint32_t l, uint64_t *off, uint64_t *len);
/* The transport for comm's lanes (EMBD_EINVAL naming why when a comm that moves device memory
 * has more lanes than this node has ranks able to stage, or the ranks are CPUs). */
int step_lanes_create(struct embd_step *s, struct embd_comm *comm, struct step_lanes **out,
		      char *err, size_t err_len);
void step_lanes_destroy(struct step_lanes *ln);
/* Whether the transfers are staged through the ranks' devices (on the rank threads). */
bool step_lanes_staged(const struct step_lanes *ln);
/*
 * The all-to-all of node messages over s->lanes: send holds sbytes[p] bytes for each node p in
 * node order, recv gets rbytes[p] from each (both sizes agree pairwise; this node's own part is
 * copied). A comm failure sets *comm_failed (embd_comm_error says what); a staging failure
 * writes err. Either way the comm may now be out of step with the others: break it.
 */
int step_lanes_exchange(struct embd_step *s, struct embd_comm *comm, const uint8_t *send,
			const uint64_t *sbytes, uint8_t *recv, const uint64_t *rbytes,
			bool *comm_failed, char *err, size_t err_len);

/* ---- step_overlap.c ---- */
/* The prepared step's input exchange (into train[cur ^ 1], exchange_rc, exchanged set) starts
 * on the comm thread; false when there is no thread (nothing started). */
bool step_overlap_start(struct embd_step *s);
/* Until the exchange started is done; logs what it waits for past the comm's timeouts. */
void step_overlap_wait(struct embd_step *s);
/* Stops the thread (none running an exchange). */
void step_overlap_destroy(struct embd_step *s);

/* ---- step_dist.c ---- */

int step_dist_create(struct embd_step *s, const struct embd_step_cluster *cluster, char *err,
		     size_t err_len);
void step_dist_destroy(struct embd_step *s);
/* After routing: sizes, accept counts and status with every node, then the ids. On return
 * the items from other nodes are on the local ranks' io. A ROUND_FOLLOW pass that finds the
 * others evaluating switches s->pass to the evaluation pass (its caller switches back). */
int step_dist_input(struct embd_step *s, enum step_round round);
/* After lookup: partials back to the trainers' nodes, with this node's status (0 or why the
 * lookup failed) agreed by all. Fills s->sources for the staged items. */
int step_dist_output(struct embd_step *s, int status, const char *why);
/* Backward: gradients to the owning nodes (status: 0, or why this node aborts). */
int step_dist_grads(struct embd_step *s, int status, const char *why);
/* Where the gradient of a received item lies. */
const float *step_dist_grad_of(const struct embd_step *s, const struct step_item *it);
/* The comm's collective timeout (for messages). */
int step_dist_timeout_ms(const struct embd_step *s);
/* sent_bytes and exchange_bytes of the last step. */
void step_dist_counts(const struct embd_step *s, struct embd_step_counts *out);

#endif /* EMBD_ENGINE_STEP_INTERNAL_H */
