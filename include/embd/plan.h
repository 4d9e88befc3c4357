/*
 * embd/plan.h - the sharding planner: tables + topology + constraints -> a plan saying where
 * every shard of every table lives, plus the plan's JSON form, its hash, a validator and a
 * stats table for people.
 *
 * The model is TorchRec's EmbeddingShardingPlanner (enumerator -> storage and perf estimators
 * -> proposers -> partitioners -> the plan whose slowest rank is fastest), with TorchRec's
 * names, defaults and units: bandwidths in bytes per millisecond, times in milliseconds. The
 * result is deterministic: identical inputs give byte-identical plan JSON and the same
 * plan_hash on every machine (no pointer or hash-table order, fixed float formatting,
 * no floating-point contraction), which collective_plan relies on.
 *
 * Everything returns 0 or a negative EMBD_E* code and writes a message naming the field, table
 * or rank into err[err_len] (err may be NULL). Every JSON file read here (tables, topology,
 * plan) holds exactly one JSON value: text after it other than whitespace is EMBD_EPARSE,
 * naming its line and byte.
 */
#ifndef EMBD_PLAN_H
#define EMBD_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"

#ifdef __cplusplus
extern "C" {
#endif


/* ---- vocabulary ------------------------------------------------------------------------- */

enum embd_sharding_type {
	EMBD_SHARD_TABLE_WISE = 0,
	EMBD_SHARD_ROW_WISE = 1,
	EMBD_SHARD_COLUMN_WISE = 2,
	EMBD_SHARD_TABLE_ROW_WISE = 3,
	EMBD_SHARD_TABLE_COLUMN_WISE = 4,
	EMBD_SHARD_DATA_PARALLEL = 5,
	EMBD_SHARD_COUNT
};

enum embd_compute_kernel {
	EMBD_KERNEL_DENSE = 0,
	EMBD_KERNEL_FUSED = 1,
	EMBD_KERNEL_FUSED_UVM = 2,          /* cuda only: rows in host memory */
	EMBD_KERNEL_FUSED_UVM_CACHING = 3,  /* cuda only: host rows + HBM cache */
	EMBD_KERNEL_COUNT
};

enum embd_compute_device {
	EMBD_DEVICE_CPU = 0,
	EMBD_DEVICE_CUDA = 1,
};

/* TorchRec's value strings ("table_wise", "fused_uvm", "cuda"); NULL when out of range. */
const char *embd_plan_sharding_name(enum embd_sharding_type type);
const char *embd_plan_kernel_name(enum embd_compute_kernel kernel);
const char *embd_plan_device_name(enum embd_compute_device device);
/* Inverse lookups: 0 and *out set, or EMBD_EINVAL for an unknown name. */
int embd_plan_sharding_from_name(const char *name, enum embd_sharding_type *out);
int embd_plan_kernel_from_name(const char *name, enum embd_compute_kernel *out);

/* ---- topology --------------------------------------------------------------------------- */

/*
 * A cluster: world_size ranks, local_world_size per node (node = rank / local_world_size).
 * On cpu, "HBM" is a rank's share of host memory: every byte a cpu shard needs is counted
 * against hbm_cap_bytes (TorchRec counts cpu shards as DDR; embd's cpu ranks are NUMA-pinned
 * compute groups, and their own share of memory is what must not overflow).
 */
struct embd_topology {
	int32_t world_size;
	int32_t local_world_size;                 /* default world_size */
	enum embd_compute_device compute_device;  /* default cuda */
	uint64_t hbm_cap_bytes;                   /* default 32 GiB */
	uint64_t ddr_cap_bytes;                   /* default 128 GiB */
	double hbm_mem_bw_bytes_per_ms;           /* default 897 GiB/s */
	double ddr_mem_bw_bytes_per_ms;           /* default 51 GiB/s */
	double hbm_to_ddr_mem_bw_bytes_per_ms;    /* default 32 GiB/s */
	double intra_host_bw_bytes_per_ms;        /* default 600 GiB/s */
	double inter_host_bw_bytes_per_ms;        /* default 12.5 GiB/s */
	uint32_t batch_size;                      /* local batch per rank, default 512 */
	double bwd_compute_multiplier;            /* default 2 */
	double uvm_caching_ratio;                 /* cache load factor, default 0.2 */
	double storage_reservation;               /* fraction of HBM kept free, default 0.15 */
};

/* TorchRec's defaults for world_size ranks (local_world_size = world_size, cuda). */
void embd_plan_topology_default(struct embd_topology *topo, int32_t world_size);

/*
 * One field table serves JSON and embctl flags. Field names are TorchRec's: world_size,
 * local_world_size, compute_device, hbm_cap, ddr_cap, hbm_mem_bw, ddr_mem_bw,
 * hbm_to_ddr_mem_bw, intra_host_bw, inter_host_bw, batch_size, bwd_compute_multiplier,
 * uvm_caching_ratio, storage_reservation. Byte values accept K/M/G/T suffixes (binary:
 * "16G" = 16 GiB, "512MB" likewise), bandwidths accept "25GB/s", "900G" or a plain number of
 * bytes per second (GB = GiB, as TorchRec's constants are); both are stored in bytes and bytes
 * per ms. embd_plan_topology_set parses one field from text; embd_plan_topology_field(i)
 * names field i (NULL past the end), for usage texts.
 */
int embd_plan_topology_set(struct embd_topology *topo, const char *field, const char *value,
			   char *err, size_t err_len);
const char *embd_plan_topology_field(size_t i);
/* Reads a topology JSON file: an object of the fields above (defaults first, then every field
 * present; numbers or strings with suffixes). Unknown keys are errors, so a misspelt field is
 * never ignored; errors name the file, line and field. */
int embd_plan_topology_load(const char *path, struct embd_topology *topo, char *err,
			    size_t err_len);
/* Checks ranges and consistency (world_size divisible by local_world_size, caps > 0...). */
int embd_plan_topology_validate(const struct embd_topology *topo, char *err, size_t err_len);

/* ---- tables and constraints ------------------------------------------------------------- */

/* TorchRec's ParameterConstraints, per table. Zero / empty means "TorchRec's default". */
struct embd_table_constraints {
	uint32_t sharding_types;    /* bitmask of 1u << embd_sharding_type; 0 = all */
	uint32_t compute_kernels;   /* bitmask of 1u << embd_compute_kernel; 0 = all */
	int32_t min_partition;      /* smallest column shard; 0 = MIN_CW_DIM (128) */
	/* one value per feature of the table when given (count 0 = defaults 1.0 / batch_size) */
	uint32_t num_pooling_factors;
	double pooling_factors[EMBD_TABLE_FEATURES_MAX];
	uint32_t num_num_poolings;
	double num_poolings[EMBD_TABLE_FEATURES_MAX];
	uint32_t num_batch_sizes;
	uint32_t batch_sizes[EMBD_TABLE_FEATURES_MAX];
	bool is_weighted;
};

struct embd_tables {
	uint32_t count;
	struct embd_table_spec *specs;                 /* count */
	struct embd_table_constraints *constraints;    /* count, parallel to specs */
};

/*
 * Tables JSON: an array of objects, one per table:
 *   { "name": "t0", "num_embeddings": 1000000, "embedding_dim": 128,
 *     "pooling": "sum"|"mean", "feature_names": ["f0", ...], "data_type": "fp32"|"fp16",
 *     "optimizer": { "type": "sgd"|"adagrad"|"rowwise_adagrad"|"adam", "lr": 0.01,
 *                    "eps": 1e-8, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0 },
 *     "constraints": { "sharding_types": ["table_wise", ...], "compute_kernels": ["fused"],
 *                      "min_partition": 64, "pooling_factors": [20.0], "num_poolings": [1],
 *                      "batch_sizes": [512], "is_weighted": false } }
 * The optimizer's ranges: lr in (0, 1e6], eps in (0, 1e6], beta1 and beta2 in [0, 1),
 * weight_decay in [0, 1e6], each also as the fp32 value the kernels use (0.999999999 is 1);
 * eps, beta1 and beta2 default to 1e-8, 0.9, 0.999 and are read whatever the type.
 * pooling defaults to sum, data_type to fp32, optimizer to sgd lr 0.01, feature_names to
 * [name]. Table names are unique, and so are feature names across all tables (a feature
 * looks up one table; one listed twice is refused naming both tables). Errors name the table
 * (index and name) and the field.
 * embd_plan_tables_parse_text parses text (errors add the line and byte offset): the array,
 * or an object whose only key is "tables" holding it; _load reads a file the same way.
 * On success *out owns its arrays: release them with embd_plan_tables_free.
 */
int embd_plan_tables_parse_text(const char *text, size_t len, struct embd_tables *out,
				char *err, size_t err_len);
int embd_plan_tables_load(const char *path, struct embd_tables *out, char *err, size_t err_len);
void embd_plan_tables_free(struct embd_tables *tables);   /* NULL and zeroed are fine */

/* ---- the plan --------------------------------------------------------------------------- */

struct embd_plan_shard {
	int32_t rank;
	int64_t row_offset, rows;
	int32_t col_offset, cols;
};

struct embd_plan_table {
	char name[EMBD_NAME_MAX];
	enum embd_sharding_type sharding_type;
	enum embd_compute_kernel compute_kernel;
	uint32_t num_shards;
	struct embd_plan_shard *shards;   /* ordered by (row_offset, col_offset, rank) */
};

struct embd_plan_rank {
	uint64_t hbm_bytes, ddr_bytes;    /* estimated storage of the shards placed here */
	double est_time_ms;               /* sum of the estimated perf of those shards */
	double fwd_compute_ms, fwd_comms_ms, bwd_compute_ms, bwd_comms_ms;
	uint32_t num_shards, num_tables;
};

/*
 * Plan JSON (schema version 1), written in this key order by embd_plan_write_json:
 *   { "version": 1,
 *     "topology": { every field of struct embd_topology, bytes and bytes/ms as numbers },
 *     "tables_hash": "16 hex digits",     hash of the canonical tables the plan was built for
 *     "tables": [ { "name", "sharding_type", "compute_kernel",
 *                   "shards": [ { "rank", "row_offset", "rows", "col_offset", "cols" } ] } ],
 *     "ranks": [ { "rank", "hbm_bytes", "ddr_bytes", "est_time_ms" } ],
 *     "max_rank_time_ms": ..., "plan_hash": "16 hex digits" }
 * Tables appear in the tables file's order. plan_hash is FNV-1a 64 of every byte before
 * `"plan_hash"`, so it is the hash of the canonical JSON itself. Floats use "%.9g".
 */
struct embd_plan {
	uint32_t version;
	struct embd_topology topology;
	uint64_t tables_hash;
	uint32_t num_tables;
	struct embd_plan_table *tables;
	struct embd_plan_rank *ranks;     /* topology.world_size */
	double max_rank_time_ms;
	uint64_t plan_hash;
	const char *proposer;             /* static names of the proposer and partitioner whose */
	const char *partitioner;          /* plan won (build only; NULL for parsed plans) */
};

/* Planner knobs beyond the topology; zeroed = defaults. */
struct embd_plan_options {
	bool greedy_only;                 /* no search proposer: greedy (+ memory-first) only */
};

/*
 * Builds the plan for tables (constraints may be NULL) on topo. Proposals: greedy (each
 * table's least-perf option, TorchRec's GreedyProposer), the search proposer (caps on the
 * slowest shard at multiples of a lower bound on the slowest rank) and memory-first; each
 * goes through three partitioners (greedy by perf, greedy in storage order, memory-balanced)
 * and a local search that moves/swaps shards off the slowest rank. The plan whose slowest
 * rank is fastest wins (ties: less peak HBM, then the earlier proposal).
 * EMBD_EINFEASIBLE when a table fits nowhere (err names the tables and the shortfall in
 * bytes) or its constraints leave no option (err names the constraint), EMBD_EINVAL for a
 * bad topology or table. *out is allocated; release with embd_plan_destroy.
 */
int embd_plan_build(const struct embd_table_spec *tables,
		    const struct embd_table_constraints *constraints, uint32_t num_tables,
		    const struct embd_topology *topo, const struct embd_plan_options *options,
		    struct embd_plan **out, char *err, size_t err_len);
void embd_plan_destroy(struct embd_plan *plan);

/*
 * Re-estimates every rank of plan (ranks[], max_rank_time_ms) with embd's cost model for
 * tables on plan->topology, then validates it: each table of the plan is one of tables, each
 * table's shards cover it exactly once (data_parallel: once on every rank) without overlap,
 * ranks are in range, table_row_wise / table_column_wise shards stay inside one node, and
 * every rank's HBM and DDR fit the caps (after the storage reservation). Recomputes plan_hash.
 * EMBD_EINVAL / EMBD_ENOSPC / EMBD_ENOENT with the first violation named in err.
 */
int embd_plan_check(struct embd_plan *plan, const struct embd_table_spec *tables,
		    const struct embd_table_constraints *constraints, uint32_t num_tables,
		    char *err, size_t err_len);

/* Canonical plan JSON into a malloc'ed NUL-terminated string (*out_len without the NUL);
 * also stores the hash in plan->plan_hash. */
int embd_plan_write_json(struct embd_plan *plan, char **out, size_t *out_len);
/* Parses plan JSON (as written above; ranks, max_rank_time_ms and plan_hash are optional,
 * embd_plan_check recomputes them). Errors name the field, table and shard index, and for
 * syntax errors the line and byte offset. */
int embd_plan_parse_json(const char *text, size_t len, struct embd_plan **out,
			 char *err, size_t err_len);

/* Reads and parses a plan file (embd_plan_parse_json; errors are prefixed with the path). */
int embd_plan_load(const char *path, struct embd_plan **out, char *err, size_t err_len);

/* FNV-1a 64 of the canonical JSON of plan (what plan_hash holds). */
int embd_plan_hash(struct embd_plan *plan, uint64_t *out);
/* Hash of the canonical form of the tables (names, shapes, types, optimizers, features). */
uint64_t embd_plan_tables_hash(const struct embd_table_spec *tables, uint32_t num_tables);

/* TorchRec-EmbeddingStats-like text: per rank HBM/DDR used of cap, perf split, tables and
 * shards; per table its choice and ranks; imbalance (max / mean rank time). malloc'ed. */
int embd_plan_stats_text(const struct embd_plan *plan, char **out);
/* max rank time / mean rank time (1 = perfectly balanced; 0 for an empty plan). */
double embd_plan_imbalance(const struct embd_plan *plan);

#ifdef __cplusplus
}
#endif

#endif /* EMBD_PLAN_H */
