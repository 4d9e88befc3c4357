/*
 * ckpt/checkpoint.h - checkpoint directories on disk: writing one so that a crash at any
 * instant leaves the previous checkpoint or the new one complete, finding the newest valid
 * one, retention, and assembling tables from a checkpoint's shard files (resharding).
 *
 * Layout: <checkpoint_dir>/step-<N>/ holds one .npy file per shard and state (manifest.h
 * names them) and manifest.json. Writing (embd_ckpt_write_dir):
 *   1. mkdir <root>/.tmp-step-<N> (a leftover one is removed first);
 *   2. every array -> .npy, fsynced, its size and CRC-32C recorded;
 *   3. manifest.json.tmp written, fsynced, renamed to manifest.json, directory fsynced;
 *   4. .tmp-step-<N> renamed to step-<N>, <root> fsynced.
 * A reader looks only at step-<N> directories, so a crash before 4 leaves nothing it reads;
 * after 4 every byte is on disk. Readers (embd_ckpt_find) still check every file's size and
 * CRC-32C against the manifest (disks and operators damage files too): a damaged checkpoint
 * is reported by name through the skip callback and the previous one is tried.
 *
 * Multi-node. Every node writes its own shards of the same step N; a cluster checkpoint is
 * all-or-nothing. Two layouts (config key checkpoint_layout; the store protocol is
 * ckpt/ckpt_cluster.h):
 *   per-node directories ("per_node": each node its own local disk): node k does steps 1-4
 *     in its own <root_k> with a manifest of only its files (node = k, num_nodes = W), then
 *     reports "ok" through the store; node 0 logs the cluster checkpoint complete once every
 *     node reported (and names the nodes that did not). A step some node never finished or
 *     holds damaged is no cluster checkpoint: readers take the newest N that EVERY node holds
 *     valid (embd_ckpt_find_nodes offline, merging the manifests; the service agrees on it
 *     through the store). The service restores this layout only under the same plan and node
 *     count (each node reads only its own disk); resharding needs every node's directory in
 *     one place (embctl export --dir ..., or copy them into one shared directory). Retention
 *     keeps the newest K per node and never removes the newest step every node holds (the
 *     last one node 0 declared complete, or the restored one).
 *   shared directory ("shared", the default; NFS-like, or one machine): every node writes its
 *     files into <root>/.tmp-step-N/ (embd_ckpt_write_part; names carry n<k>), reports its
 *     manifest (node = k, its files only) to the store under "<gen>N/node/<k>" (or "error:
 *     why" when its write failed; <gen>: the comm generation's "embd/gen/<g>/ckpt/",
 *     ckpt_cluster.h); node 0 waits for every node's key within
 *     store_timeout_ms (the keys, not a counter: a timeout then names the missing nodes),
 *     merges the entries (embd_ckpt_manifest_merge), alone does steps 3 and 4
 *     (embd_ckpt_commit) and deletes the keys. A node that dies or fails before reporting
 *     leaves no manifest: node 0 logs it by rank and removes .tmp-step-N (embd_ckpt_discard),
 *     so step-N never appears. Retention runs on node 0 only and removes stale .tmp-step-M
 *     only for M < N (the nodes may be writing a later step). Restore: node 0 takes the newest
 *     valid step-N (embd_ckpt_find) and publishes N under "ckpt/restore" (the others wait
 *     store_timeout_ms for it, so it must cover node 0's CRC check); every other node
 *     opens that very directory (embd_ckpt_open_dir: a node that sees damage there fails,
 *     naming it) and loads its own shards by global coordinates, so any node count and plan
 *     restores any other.
 * In both layouts node 0 then publishes its verdict, which every node waits for, so every
 * node's result is the cluster's. Triggers on a cluster: ckpt/ckpt_service.h.
 *
 * Damaged checkpoints are never deleted: a step-<N> that fails its check (a restore's full
 * CRC check, retention's cheaper one, or a write of the same step that finds it) is moved to
 * <root>/damaged/step-<N>-<UTC time> (embd_ckpt_move_damaged) with a warning, where the
 * operator may inspect, repair or delete it. Retention counts only checkpoints that pass its
 * check, so damaged ones never hold a checkpoint_keep slot, and it never removes the newest
 * one. A service that finds damaged checkpoints (as step-<N>, or in damaged/) and no valid
 * one refuses to start from the initial weights (ckpt/ckpt_service.h,
 * checkpoint_allow_fresh_start).
 *
 * Ownership and identity. A checkpoint directory belongs to one service: it takes a lock at
 * start (embd_ckpt_lock_take: flock, held until it exits, released by the kernel when it
 * dies) and a second one is refused with the holder's pid. One node, and a per_node
 * layout's node, take <root>/.embd.lock exclusively; the nodes of a shared-layout cluster
 * share it (LOCK_SH) and each takes <root>/.embd.lock-node-<k> exclusively, so two services
 * claiming one node rank, or a cluster and a lone service, are refused alike. The identity a
 * restore checks: a checkpoint's tables must be the config's (names, rows, columns, and the
 * optimizer when it has state), and its manifest's node, num_nodes and "layout" say what it
 * is: a whole checkpoint (one node, or a shared cluster's merged manifest: restores under
 * any plan and node count) or one node's part (per_node: node k of N, only node k's shards,
 * restored only by node k of N under the same plan). A part is refused by a one-node or
 * shared-layout restore instead of failing on missing shards.
 */
#ifndef EMBD_CKPT_CHECKPOINT_H
#define EMBD_CKPT_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "ckpt/manifest.h"

#define EMBD_CKPT_PATH_MAX 4096

/* checkpoint_layout: where a cluster's nodes write (see the top of this file) */
enum embd_ckpt_layout { EMBD_CKPT_SHARED = 0, EMBD_CKPT_PER_NODE = 1 };

/* "shared" or "per_node". */
static inline const char *embd_ckpt_layout_name(enum embd_ckpt_layout layout)
{
	return layout == EMBD_CKPT_PER_NODE ? "per_node" : "shared";
}

/* One array of a checkpoint to write: its manifest entry (name, table, state, coordinates,
 * dtype, optimizer_step; bytes and crc32c are filled in by the write) and its data. */
struct embd_ckpt_array {
	struct embd_ckpt_file file;
	const void *data;
	uint32_t ndim;                  /* 2: rows x cols, 1: (rows,) per-row state */
	/* When set, called with await_arg and the array's index before data is read: blocks
	 * until data holds the array (a snapshot still being copied, ckpt_snapshot.h). */
	void (*await_data)(void *arg, uint32_t index);
	void *await_arg;
};

/* Called for every checkpoint a reader skips, with its directory and the reason. */
typedef void (*embd_ckpt_skip_fn)(void *arg, const char *dir, const char *why);

/* <root>/step-<step> into out (cap bytes). */
void embd_ckpt_dir_name(const char *root, uint64_t step, char *out, size_t cap);

/* mkdir -p root (0755). */
int embd_ckpt_mkdir(const char *root, char *err, size_t err_len);

/* Where checkpoints are moved aside, under root: damaged ones, and the steps above the one a
 * service resumed from (embd_ckpt_set_aside_after). Neither is ever read or deleted. */
#define EMBD_CKPT_DAMAGED_DIR "damaged"
#define EMBD_CKPT_ABANDONED_DIR "abandoned"

/* Moves the damaged checkpoint directory dir (under root) to <root>/damaged/<its name>-<UTC
 * time>, the new path into moved_to (cap bytes). Nothing is deleted. */
int embd_ckpt_move_damaged(const char *root, const char *dir, char *moved_to, size_t cap,
			   char *err, size_t err_len);

/*
 * A service that resumes from step (restored it, or starts afresh at 0) moves every step-<M>
 * with M > step under root to <root>/abandoned/step-<M>-<UTC time>: they belong to a training
 * history the service left, and the steps it trains next would otherwise meet them (a write
 * finds "already written" and keeps the old one; retention counts it). Matters on a per_node
 * cluster, where the nodes restore the newest step all of them hold valid, so a node may hold
 * newer ones of its own. moved (may be NULL) gets each new path and the old one. Returns how
 * many moved, or a negative code (err naming the directory; the ones not moved stay).
 */
int embd_ckpt_set_aside_after(const char *root, uint64_t step, embd_ckpt_skip_fn moved,
			      void *moved_arg, char *err, size_t err_len);

/* How many checkpoints <root>/damaged/ holds (0 when there is no such directory). */
uint32_t embd_ckpt_count_damaged(const char *root);

/*
 * Takes root's lock (created with root if missing) for the process's lifetime: exclusive for
 * one node or a per_node layout's node (shared_part false), shared plus node `node`'s own
 * for a shared-layout cluster's node (above). who describes the holder for the message a
 * second one gets ("embd node 0 of 2", "embctl import"). EMBD_EBUSY when another process
 * holds it, err naming its pid; EMBD_EIO when the lock file cannot be opened.
 */
struct embd_ckpt_lock;
int embd_ckpt_lock_take(const char *root, bool shared_part, uint32_t node, const char *who,
			struct embd_ckpt_lock **out, char *err, size_t err_len);
/* Releases it. NULL is a no-op. */
void embd_ckpt_lock_release(struct embd_ckpt_lock *lock);

/*
 * Writes step-<m->step> under root (created if missing) as described above. m's files are
 * replaced by one entry per array (with bytes and crc32c). With sync false nothing is
 * fsynced (tests of the format only). *bytes_out: bytes of all files written. Errors name the
 * file; a failed write removes its .tmp-step-<N> at once (a full disk gets its space back).
 * When step-<N> already holds a valid checkpoint, returns EMBD_EBUSY and writes nothing; a
 * damaged one is moved aside (returning 0, err then says where it went, else err is "").
 */
int embd_ckpt_write_dir(const char *root, struct embd_ckpt_manifest *m,
			const struct embd_ckpt_array *arrays, uint32_t num_arrays, bool sync,
			uint64_t *bytes_out, char *err, size_t err_len);

/*
 * Loads dir's manifest and checks every file it lists (size and CRC-32C). Returns 0 with *m
 * filled (free it with embd_ckpt_manifest_free), or EMBD_ENOENT / EMBD_EPARSE /
 * EMBD_ECHECKSUM / EMBD_EIO naming the file.
 */
int embd_ckpt_open_dir(const char *dir, struct embd_ckpt_manifest *m, char *err, size_t err_len);

/*
 * The newest valid checkpoint under root with step <= max_step (UINT64_MAX: any): its
 * directory into dir_out and its manifest into *m. Damaged ones are passed to skip (may be
 * NULL). EMBD_ENOENT when there is none.
 */
int embd_ckpt_find(const char *root, uint64_t max_step, embd_ckpt_skip_fn skip, void *skip_arg,
		   char *dir_out, size_t dir_cap, struct embd_ckpt_manifest *m, char *err,
		   size_t err_len);

/*
 * Retention: keeps the newest keep valid step-<N> (keep 0: removes none) and step-<spare>
 * (UINT64_MAX: none spared; the service spares the checkpoint it just wrote, per-node
 * directories the newest step every node holds), removes the older valid ones, and stale
 * .tmp-step-<M> directories with M < tmp_before (UINT64_MAX: all). Valid here: the manifest
 * parses, names the directory's step, and every file it lists exists with its size (no CRC:
 * reading every kept checkpoint at each write would cost more than the write). A directory
 * that fails is moved aside (embd_ckpt_move_damaged) and reported to moved (may be NULL)
 * with its new path and why. Returns the number removed or a negative code.
 */
int embd_ckpt_retain(const char *root, uint32_t keep, uint64_t tmp_before, uint64_t spare,
		     embd_ckpt_skip_fn moved, void *moved_arg, char *err, size_t err_len);

/*
 * Shared-directory cluster checkpoints (above). _write_part: step 2 only, into
 * <root>/.tmp-step-<m->step> (created if missing, never emptied: the other nodes write there
 * too); m's files become this node's entries. _commit: node 0, once every node's entries are
 * merged into m: steps 3 and 4 (EMBD_EBUSY when step-N is valid already; a damaged one is
 * moved aside, err saying where, as in embd_ckpt_write_dir). _discard: removes .tmp-step-<step> (a cluster checkpoint that cannot complete).
 */
int embd_ckpt_write_part(const char *root, struct embd_ckpt_manifest *m,
			 const struct embd_ckpt_array *arrays, uint32_t num_arrays, bool sync,
			 uint64_t *bytes_out, char *err, size_t err_len);
int embd_ckpt_commit(const char *root, struct embd_ckpt_manifest *m, bool sync, char *err,
		     size_t err_len);
int embd_ckpt_discard(const char *root, uint64_t step, char *err, size_t err_len);

/* A destination for embd_ckpt_load: a rectangle of a table, as in a shard. */
struct embd_ckpt_target {
	uint32_t table;                 /* index into the manifest's tables */
	int64_t row_offset, rows;
	uint32_t col_offset, cols;
	enum embd_data_type dtype;      /* of weights; state is fp32 */
	void *weights;                  /* rows x cols */
	float *momentum1;               /* rows x cols, or rows (rowwise_adagrad), or NULL */
	float *momentum2;               /* rows x cols or NULL */
	int64_t optimizer_step;         /* out: the largest of the source shards */
};

/*
 * Fills every target from dir's files by global coordinates (any plan to any plan). Weights
 * must be covered completely (EMBD_EPARSE names the table otherwise). A state with no file at
 * all (a checkpoint written by `embctl import`) is left as it is. Per-row state over a
 * different column split becomes the mean of the source shards' values weighted by the
 * columns they share with the target, which is exact for a column merge (each source holds
 * the mean of g^2 over its columns) and a copy for a split. Files are read one at a time.
 */
int embd_ckpt_load(const char *dir, const struct embd_ckpt_manifest *m,
		   struct embd_ckpt_target *targets, uint32_t num_targets, char *err,
		   size_t err_len);

/* The same over per-node directories: file f is read from dirs[f.node] (num_dirs > 1) or
 * from dirs[0] (one directory, e.g. shared by every node). */
int embd_ckpt_load_nodes(const char *const *dirs, uint32_t num_dirs,
			 const struct embd_ckpt_manifest *m, struct embd_ckpt_target *targets,
			 uint32_t num_targets, char *err, size_t err_len);

/*
 * Per-node directories: roots[k] holds node k's own checkpoints (manifest node = k,
 * num_nodes = num_roots). Finds the newest step <= max_step that EVERY node has, valid,
 * skipping (and reporting) steps some node lacks or has damaged, so a cluster checkpoint is
 * all-or-nothing without a cluster-wide file. dirs_out[k] gets node k's step directory
 * (each dir_cap bytes), *m the merged manifest (embd_ckpt_manifest_merge).
 */
int embd_ckpt_find_nodes(const char *const *roots, uint32_t num_roots, uint64_t max_step,
			 embd_ckpt_skip_fn skip, void *skip_arg, char (*dirs_out)[EMBD_CKPT_PATH_MAX + 64],
			 struct embd_ckpt_manifest *m, char *err, size_t err_len);

/* The index of table `name` in m, or -1. */
int embd_ckpt_table_index(const struct embd_ckpt_manifest *m, const char *name);

#endif /* EMBD_CKPT_CHECKPOINT_H */
