/*
 * Private declarations shared by the planner's files: the shard layout every sharding type
 * follows (one function, so the builder and the checker can never disagree), a growable
 * string for the JSON writer and the stats table, FNV-1a, and error formatting.
 */
#ifndef EMBD_PLANNER_INTERNAL_H
#define EMBD_PLANNER_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/file.h"
#include "embd/plan.h"

#define PLAN_SCHEMA_VERSION 1
#define MIN_CW_DIM 128
#define KJT_RESERVE_MULTIPLIER 20    /* HeuristicalStorageReservation: 20 x the KJT bytes */

/* Ids (BI) and pooled outputs (BO) of one table per local batch, TorchRec's batch_inputs. */
void planner_batch_io(const struct embd_table_spec *t, const struct embd_table_constraints *c,
		      const struct embd_topology *topo, double *batch_inputs,
		      double *batch_outputs);

/*
 * How a table of `rows` x `dim` splits for a sharding type: shard i of num_shards covers
 * rows [row_offset, +rows) and cols [col_offset, +cols). Row splits (row_wise over the
 * world, table_row_wise over a node) use blocks of ceil(rows / n), so the last shards may be
 * short or empty (TorchRec's 10 rows on 4 ranks: 3, 3, 3, 1); column splits use col_block.
 * data_parallel has world_size full replicas; table_wise one shard.
 */
struct shard_layout {
	uint32_t num_shards;
	int64_t row_block;       /* rows of a full row shard */
	int32_t col_block;       /* cols of a column shard */
	int64_t rows;
	int32_t dim;
	enum embd_sharding_type type;
};

void planner_layout(struct shard_layout *l, const struct embd_table_spec *t,
		    const struct embd_topology *topo, enum embd_sharding_type type,
		    int32_t col_block);
void planner_layout_shard(const struct shard_layout *l, uint32_t i, int64_t *row_offset,
			  int64_t *rows, int32_t *col_offset, int32_t *cols);

/* Usable HBM of every rank after the storage reservation (fraction + 20 x KJT bytes). */
uint64_t planner_hbm_budget(const struct embd_topology *topo, const struct embd_table_spec *t,
			    const struct embd_table_constraints *c, uint32_t n);

/* ---- between the planner (plan.c) and its partitioners (partition.c) -------------------- */

/* Estimated time and storage of one shard; an option's shards fall into few such classes. */
struct shard_class {
	double ms;
	uint64_t hbm, ddr;
};

struct option {
	uint8_t type, kernel;
	struct shard_layout layout;
	/* shards [0, n_full) are full, then n_tail short ones, then n_empty empty row shards */
	uint32_t n_full, n_tail, n_empty;
	struct shard_class full, tail, empty;
	double total_ms, max_ms;
	uint64_t max_hbm, max_ddr;
};

/* A rank or node in a min-heap: ordered by key, then id, so ties never depend on memory. */
struct heap_entry {
	double key;
	uint32_t id;
};

struct free_shard;

struct planner {
	const struct embd_table_spec *tables;
	const struct embd_table_constraints *constraints;
	uint32_t n;
	const struct embd_topology *topo;
	uint32_t W, L, nodes;
	uint64_t hbm_budget, ddr_cap;
	struct option *opts;       /* all options, table after table */
	uint32_t *opt_start;       /* n + 1: options of table t are [opt_start[t], opt_start[t+1]) */
	/* partition scratch */
	double *load_ms, *diff_ms;
	int64_t *hbm, *ddr, *diff_hbm, *diff_ddr;
	struct heap_entry *heap;    /* 2 x max(W, nodes) + 2: the heap and the entries set aside */
	struct free_shard *free_list;
	double *node_ms;            /* L: a node's ranks while a table_column_wise table is tried */
	int64_t *node_hbm, *node_ddr;
	uint32_t *node_pick;        /* shards of the table being tried */
	size_t free_cap;
	uint32_t max_node_shards;
};

static inline const struct shard_class *shard_class_of(const struct option *o, uint32_t i)
{
	return i < o->n_full ? &o->full : i < o->n_full + o->n_tail ? &o->tail : &o->empty;
}

/* ---- partitioners ----------------------------------------------------------------------- */

enum partitioner { PART_GREEDY_PERF, PART_GREEDY_STORAGE, PART_MEMORY_BALANCED, PART_COUNT };

/* A shard to place on any one rank (or, for node tables, a whole table: shard 0). */
struct free_shard {
	double ms;
	uint64_t hbm;
	uint32_t table, shard;
	uint32_t rank;            /* where the partitioner put it */
};

struct result {
	bool feasible;
	double max_ms;
	int64_t max_hbm;
	uint32_t fail_table;      /* when !feasible */
	uint64_t fail_need_bytes, fail_room_bytes;
	bool fail_ddr;
};

static inline const struct option *chosen(const struct planner *p, const uint32_t *choice,
					  uint32_t t)
{
	return &p->opts[choice[t]];
}

extern const char *const planner_partitioner_names[PART_COUNT];

/*
 * One partition of the proposal `choice` (an option index per table) with the given
 * partitioner: fixed placements, then node placements, then free shards, then a local search
 * over at most refine_steps shard pairs. places (may be NULL) receives the rank of shard i of
 * table t at places[place_base[t] + i].
 */
void planner_partition(struct planner *p, const uint32_t *choice, enum partitioner kind,
		       uint64_t refine_steps, uint32_t *places, const size_t *place_base,
		       struct result *res);

/* A growable NUL-terminated string; on allocation failure it sets failed and stops. */
struct sbuf {
	char *data;
	size_t len, cap;
	int failed;
};

void sbuf_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sbuf_json_string(struct sbuf *b, const char *s);

#define FNV64_OFFSET 0xcbf29ce484222325ull
uint64_t fnv1a64(uint64_t h, const void *data, size_t len);

/* EMBD_EPARSE naming the line and byte offset of `at` (cJSON's parse end) inside text. */
int planner_syntax_err(char *err, size_t err_len, const char *what, const char *text,
		       size_t len, const char *at);

/* Rewrites err as "prefix: err" (a file name before a parser's message). */
void planner_prefix_err(char *err, size_t err_len, const char *prefix);

/* ---- cost model (planner/estimate.c; its unit tests call it directly) ---------------------- */

struct embd_shard_perf {
	double fwd_compute_ms, fwd_comms_ms, bwd_compute_ms, bwd_comms_ms;
};

struct embd_shard_storage {
	uint64_t hbm_bytes, ddr_bytes;
};

/*
 * Estimates one shard of `rows` x `cols` of table t (constraints c, may be NULL) sharded as
 * type with kernel on topo. Baseline: TorchRec's EmbeddingPerfEstimator and
 * EmbeddingStorageEstimator (default pipeline, no cache statistics), reproduced to 1e-6; the
 * differences are listed in planner/estimate.c and are only for cases TorchRec rejects
 * (row_wise / table_row_wise on cpu). EMBD_ENOTSUP when kernel does not exist on the device.
 */
int embd_plan_estimate_shard(const struct embd_table_spec *t,
			     const struct embd_table_constraints *c,
			     const struct embd_topology *topo, enum embd_sharding_type type,
			     enum embd_compute_kernel kernel, int64_t rows, int32_t cols,
			     struct embd_shard_perf *perf, struct embd_shard_storage *storage);

static inline double embd_shard_perf_total_ms(const struct embd_shard_perf *p)
{
	return p->fwd_compute_ms + p->fwd_comms_ms + p->bwd_compute_ms + p->bwd_comms_ms;
}

#endif
