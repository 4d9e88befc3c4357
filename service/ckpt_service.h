/*
 * service/ckpt_service.h - checkpoints of the running service: when to take one (every N
 * steps, every T seconds, on request, at SIGTERM), taking it without stalling the steps, and
 * restoring the newest valid one at start.
 *
 * Snapshot, copied before write (service/ckpt_snapshot.h). At a step boundary the shards are
 * only marked "not copied"; a copier thread then copies them into a preallocated buffer while
 * the steps go on, each backward first saving the rows it updates that the copier has not
 * reached, and the writer thread writes each array from the buffer as soon as it is
 * complete. The steps' cost (status "stall_ms", embd-bench checkpoint): the boundary
 * (microseconds) plus, per step while the copier runs, the copies of that step's updated
 * rows. Why not a plain memcpy at the boundary (the first version): the steps waited ~95 ms
 * per GiB, 10-30% of the write time. Why not copy-on-write in the kernels: a hook before the
 * kernels, on the ids they are given, needs no change to any CPU or CUDA kernel. The cost is
 * memory: a second copy of the node's shards in host RAM (allocated and touched at start
 * when checkpoint_dir is set).
 *
 * Threading: every call comes from the service's thread, outside embd_step_forward/backward
 * (the shards are then at "steps completed = step": a forward changes no parameter). At most
 * one write runs; a trigger that comes due meanwhile is taken when it ends. On a cluster
 * (shared directory, checkpoint.h) only checkpoint_every_steps triggers, and a due step whose
 * previous write still runs waits for it (a stall), so that every node takes the same steps;
 * the writer thread reports through its own store handle.
 */
#ifndef EMBD_SERVICE_CKPT_SERVICE_H
#define EMBD_SERVICE_CKPT_SERVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "service/config.h"
#include "service/step.h"

struct embd_ckpt_service;

/* For config->checkpoint_dir (must be set). Keeps pointers to config and step. */
int embd_ckpt_service_create(const struct embd_config *config, struct embd_step *step,
			     struct embd_plan *plan, struct embd_ckpt_service **out, char *err,
			     size_t err_len);
/* Waits for a running write, then frees everything. NULL is a no-op. */
void embd_ckpt_service_destroy(struct embd_ckpt_service *ck);

/*
 * Restores the newest valid checkpoint into the step's shards (before any step ran), logging
 * every damaged one it skips; on a cluster the one node 0 chose (checkpoint.h). *step_out: its step (0 when there is none, which returns 0 too).
 * EMBD_EMISMATCH when the checkpoint's tables differ from the config's (err names the table).
 */
int embd_ckpt_service_restore(struct embd_ckpt_service *ck, uint64_t *step_out, char *err,
			      size_t err_len);

/*
 * The same while the service runs, when a re-formed cluster decided to restore
 * (service/regroup.h): between steps, no forward pending. Waits for a running write first.
 * Node 0 publishes its choice at restore_key (one key per generation), the others restore that
 * one. EMBD_ENOENT when there is no valid checkpoint (on every node alike).
 */
int embd_ckpt_service_restore_running(struct embd_ckpt_service *ck, const char *restore_key,
				      uint64_t *step_out, char *err, size_t err_len);

/* An eventfd that becomes readable when a background write finished: call _reap then. */
int embd_ckpt_service_fd(const struct embd_ckpt_service *ck);

/* Asks for a checkpoint as soon as possible; returns the sequence number that will hold it. */
uint64_t embd_ckpt_service_request(struct embd_ckpt_service *ck);

/* Starts a checkpoint of `step` (steps completed) if one is due and none is being written. */
void embd_ckpt_service_poll(struct embd_ckpt_service *ck, uint64_t step);

/* Joins a finished write (logging its result); returns the sequence number of the last
 * finished checkpoint (0: none yet). Call when the fd fired; harmless otherwise. */
uint64_t embd_ckpt_service_reap(struct embd_ckpt_service *ck);

/* The result of the last finished checkpoint as JSON text (malloc'ed):
 * {"ok":true,"step":N,"dir":"...","bytes":..,"write_ms":..,"stall_ms":..} or {"ok":false,...}.
 * When ok is false, the error is in "error". */
int embd_ckpt_service_result_json(const struct embd_ckpt_service *ck, char **out);

/* Adds "resumed_step" and a "checkpoint" object (config, last result, in progress, worst
 * stall) to the status JSON text *status (replaced by a new malloc'ed text). */
int embd_ckpt_service_status_add(const struct embd_ckpt_service *ck, char **status);

/* The final checkpoint at SIGTERM: waits for a running write, then writes `step` on this
 * thread unless it is already on disk (one node only: a cluster's nodes do not stop at one
 * step they agreed on, so a cluster only waits for the running write). */
int embd_ckpt_service_final(struct embd_ckpt_service *ck, uint64_t step);

/* Worst snapshot copy so far (ms) and the last write's figures, for the benchmark. */
struct embd_ckpt_figures {
	double max_stall_ms, last_stall_ms, last_write_ms;
	uint64_t last_bytes;
	uint64_t written;               /* checkpoints written */
};
void embd_ckpt_service_figures(const struct embd_ckpt_service *ck, struct embd_ckpt_figures *out);

#endif /* EMBD_SERVICE_CKPT_SERVICE_H */
