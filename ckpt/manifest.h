/*
 * ckpt/manifest.h - the manifest of a checkpoint: which step, which tables, which plan,
 * and for every file its size, CRC-32C, and the part of which table it holds. It is the only
 * thing a reader trusts about a checkpoint directory, and it is written last (checkpoint.h).
 *
 * Format (JSON, format_version 1):
 *   { "format": "embd-checkpoint", "format_version": 1, "step": 120, "created_unix_ms": ...,
 *     "node": 0, "num_nodes": 1, ["layout": "per_node",] "plan_hash": "16 hex digits",
 *     "plan": { plan JSON },
 *     "tables": [ {"name": "t", "num_embeddings": 64, "embedding_dim": 8,
 *                  "data_type": "fp32", "optimizer": "adagrad"}, ... ],
 *     "files": [ {"name": "t.r0.c0.weight.npy", "bytes": 2176, "crc32c": 123456789,
 *                 "table": "t", "state": "weight", "row_offset": 0, "rows": 64,
 *                 "col_offset": 0, "cols": 8, "dtype": "<f4", "optimizer_step": 120,
 *                 "node": 0}, ... ] }
 * state is "weight" (shape rows x cols), "momentum1" (adagrad's sum of squares and adam's m:
 * rows x cols; rowwise_adagrad's per-row sum: shape (rows,)) or "momentum2" (adam's v).
 * col_offset/cols are the columns of the shard the state belongs to, also for per-row state.
 * "layout": "per_node" marks one node's part of a per_node cluster checkpoint (node k of
 * num_nodes, only its shards; ckpt/checkpoint.h); absent (or "shared"): a whole checkpoint.
 * The parser refuses, naming the field: unknown format or version, a file name that is not
 * [A-Za-z0-9._-]+ (no path can escape the directory), a duplicate name, a table that is not
 * listed, coordinates outside the table, a state the table's optimizer does not have, and two
 * files of one table and state that overlap.
 */
#ifndef EMBD_CKPT_MANIFEST_H
#define EMBD_CKPT_MANIFEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"
#include "ckpt/npy.h"

#define EMBD_MANIFEST_NAME "manifest.json"
#define EMBD_MANIFEST_VERSION 1u
#define EMBD_CKPT_FILE_NAME_MAX 160

enum embd_ckpt_state {
	EMBD_CKPT_WEIGHT = 0,
	EMBD_CKPT_MOMENTUM1 = 1,
	EMBD_CKPT_MOMENTUM2 = 2,
};

struct embd_ckpt_table {
	char name[EMBD_NAME_MAX];
	int64_t num_embeddings;
	int32_t embedding_dim;
	enum embd_data_type data_type;
	enum embd_optimizer_type optimizer;
};

struct embd_ckpt_file {
	char name[EMBD_CKPT_FILE_NAME_MAX];
	uint64_t bytes;
	uint32_t crc32c;
	uint32_t table;                 /* index into the manifest's tables */
	enum embd_ckpt_state state;
	int64_t row_offset, rows;       /* global rows */
	uint32_t col_offset, cols;      /* global columns of the shard */
	enum embd_npy_dtype dtype;
	int64_t optimizer_step;         /* the shard's optimizer steps (adam's t) */
	uint32_t node;                  /* the node that wrote it */
};

struct embd_ckpt_manifest {
	uint64_t step;                  /* steps completed: the step a restore resumes at */
	uint64_t created_unix_ms;
	uint32_t node, num_nodes;
	bool node_part;                 /* "layout": "per_node": node's shards only */
	uint64_t plan_hash;
	char *plan_json;                /* owned; NULL or the plan's JSON text */
	uint32_t num_tables;
	struct embd_ckpt_table *tables; /* owned */
	uint32_t num_files;
	struct embd_ckpt_file *files;   /* owned */
};

const char *embd_ckpt_state_name(enum embd_ckpt_state state);

/* Number of state arrays (beyond the weights) an optimizer keeps: 0, 1 or 2. */
uint32_t embd_ckpt_optimizer_states(enum embd_optimizer_type type);

/* The manifest as JSON text (malloc'ed, NUL-terminated). EMBD_ENOMEM or EMBD_EPARSE when
 * plan_json is not JSON. */
int embd_ckpt_manifest_write(const struct embd_ckpt_manifest *m, char **out);

/* Parses and checks manifest text (len bytes) into *out (zeroed first; free with
 * embd_ckpt_manifest_free even on error). EMBD_EPARSE / EMBD_ENOTSUP name the field; text
 * after the JSON object is EMBD_EPARSE too. */
int embd_ckpt_manifest_parse(const char *text, size_t len, struct embd_ckpt_manifest *out,
			     char *err, size_t err_len);

/*
 * One manifest from the per-node manifests of one cluster checkpoint: parts[k] must be node
 * k's (node == k, num_nodes == n), all of the same step, plan hash and tables; the files are
 * concatenated (each keeps its node) and checked for overlaps across nodes. EMBD_EMISMATCH
 * names what differs. *out is zeroed first; free it with embd_ckpt_manifest_free.
 */
int embd_ckpt_manifest_merge(const struct embd_ckpt_manifest *parts, uint32_t n,
			     struct embd_ckpt_manifest *out, char *err, size_t err_len);

/* Releases what a manifest owns. NULL and zeroed are fine. */
void embd_ckpt_manifest_free(struct embd_ckpt_manifest *m);

#endif /* EMBD_CKPT_MANIFEST_H */
