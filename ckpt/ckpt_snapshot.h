/*
 * ckpt/ckpt_snapshot.h - a consistent copy of this node's shards at one step boundary,
 * taken while the steps go on: copy-before-write at row granularity.
 *
 * Why not one memcpy at the boundary: the steps would wait for the whole copy (~95 ms per GiB
 * of shards on a 2-core VM, 10-30% of the write time). Instead, at the boundary
 * embd_ckpt_snapshot_begin only marks every chunk of every shard "not copied" (microseconds);
 * a copier thread (embd_ckpt_snapshot_copy) then copies the chunks into the snapshot buffer
 * while the steps run, and before a backward updates a row of a chunk not yet copied, the
 * step engine's update hook (embd_ckpt_snapshot_before_update, on the rank worker that runs
 * the backward) copies that row first - weights and optimizer state - and marks it, so the
 * copier skips it. The buffer therefore holds every row as it was at the boundary. Forward
 * passes only read parameters and need nothing.
 *
 * Chunks are CHUNK_BYTES of rows (a multiple of 64 rows, so one bitmap word never spans two
 * chunks). Each has a state: PENDING, BUSY (held by the copier for the whole chunk, or by the
 * hook for one row) or DONE. Whoever moves it PENDING -> BUSY owns the chunk's rows and their
 * bits until it stores PENDING (hook) or DONE (copier) back, so the copier and a hook never
 * copy the same row concurrently, and a row is updated only after the snapshot has it. A hook
 * meeting a BUSY chunk waits for it (at most one chunk's copy); once the copier finished, a
 * hook costs one atomic load.
 *
 * The price of copy-before-write is the memory of a second copy of the shards (the buffer is
 * allocated and touched at create) and, while the copier runs, a check per updated id. The
 * steps' share of the work is reported as stall: the begin, plus the hooks' time in each step.
 *
 * Threads: begin on the service thread between steps (no backward running); the copy on one
 * thread of the caller's (the checkpoint writer starts one); the hook on rank workers, any
 * number at once, each shard on one of them; wait_array on the writer. A snapshot's buffer is
 * read only after wait_array said its array is complete.
 */
#ifndef EMBD_CKPT_CKPT_SNAPSHOT_H
#define EMBD_CKPT_CKPT_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/embedding.h"
#include "ckpt/checkpoint.h"
#include "engine/step.h"

struct embd_ckpt_snapshot;

/*
 * The layout of this node's arrays (one per shard and state: weights, momentum1, momentum2;
 * one copy of a data_parallel table) and a buffer for them; node numbers the file names.
 */
int embd_ckpt_snapshot_create(const struct embd_tables *tables, struct embd_step *step,
			      uint32_t node, struct embd_ckpt_snapshot **out, char *err,
			      size_t err_len);
/* NULL is a no-op. No copy may be running. */
void embd_ckpt_snapshot_destroy(struct embd_ckpt_snapshot *snap);

/* The arrays to write: manifest entries (optimizer_step as of the last begin) and data in the
 * buffer; each valid once embd_ckpt_snapshot_wait_array returned for it. */
const struct embd_ckpt_array *embd_ckpt_snapshot_arrays(const struct embd_ckpt_snapshot *snap,
							uint32_t *num_arrays);

/* Starts a snapshot of the shards as they are now. The previous copy must have ended. */
void embd_ckpt_snapshot_begin(struct embd_ckpt_snapshot *snap);

/* Copies every chunk the hooks have not; returns when the snapshot is complete. */
void embd_ckpt_snapshot_copy(struct embd_ckpt_snapshot *snap);

/* Blocks until array i of the snapshot is complete (the copy runs on another thread). */
void embd_ckpt_snapshot_wait_array(struct embd_ckpt_snapshot *snap, uint32_t i);

/* The step engine's update hook (embd_step_set_update_hook), snap as arg: copies the rows of
 * `shard` that the batches' ids are about to update, where the snapshot lacks them. */
void embd_ckpt_snapshot_before_update(void *snap, const struct embd_shard *shard,
				      const struct embd_bag_batch *batches, uint32_t n);

/* Nanoseconds the hooks spent copying since the last begin (summed over rank workers). */
uint64_t embd_ckpt_snapshot_hook_ns(struct embd_ckpt_snapshot *snap);

#endif /* EMBD_CKPT_CKPT_SNAPSHOT_H */
