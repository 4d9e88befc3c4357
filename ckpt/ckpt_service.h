/*
 * ckpt/ckpt_service.h - checkpoints of the running service: when to take one (every N
 * steps, every T seconds, on request, at SIGTERM), taking it without stalling the steps, and
 * restoring the newest valid one at start.
 *
 * Snapshot, copied before write (ckpt/ckpt_snapshot.h). At a step boundary the shards are
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
 * one write runs; a trigger that comes due meanwhile is taken when it ends.
 *
 * checkpoint_every_steps N when a write takes longer than N steps (one node): the steps never
 * wait for the disk. A checkpoint that comes due while a write runs is taken at the first
 * step boundary after that write ended, so with a slow disk the checkpoints land every
 * "write time" steps rather than every N (every 42-100 steps for N = 5 in one report). The
 * due boundaries that passed meanwhile are not queued (a queue behind a disk slower than the
 * steps only grows): each late checkpoint logs how many it replaced, and their total is
 * "skipped" in the status's "checkpoint" object (`embctl status`: checkpoint.skipped). Raise N
 * (or give the writes a faster disk) until skipped stays 0. A cluster waits instead (below).
 *
 * A cluster (either layout, checkpoint.h) must take every checkpoint at the same step on every
 * node. checkpoint_every_steps is known to all in advance: the multiples of it (not "N steps
 * after this node's last one", which drifts when a node missed a boundary). The other triggers are agreed
 * through the steps: a node that wants one (`embctl checkpoint`, node 0's every_seconds timer
 * alone, so that the nodes do not race, or a pending SIGTERM: embd_ckpt_service_wanted) sets
 * a flag in its HELLO, the first exchange of the next step, which every node sees in that same
 * step (embd_step_cluster_checkpoint); every node then calls embd_ckpt_service_agreed and takes
 * the checkpoint at the boundary after that step. A due step whose previous write still runs
 * waits for it (a stall). The writer thread reports through its own store handle, and every
 * node's result is the cluster's (node 0's verdict, ckpt_cluster.h), so `embctl checkpoint
 * --wait` answers alike on every node.
 */
#ifndef EMBD_CKPT_CKPT_SERVICE_H
#define EMBD_CKPT_CKPT_SERVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt/checkpoint.h"
#include "embd/plan.h"
#include "engine/step.h"

struct embd_ckpt_service;

/*
 * What the checkpoint service needs of the daemon's config (daemon/config.h documents each
 * key; embd_config_ckpt_settings fills this). tables borrows the caller's specs.
 */
struct embd_ckpt_settings {
	struct embd_tables tables;
	char checkpoint_dir[EMBD_CKPT_PATH_MAX];        /* must be set for a service */
	enum embd_ckpt_layout checkpoint_layout;
	uint32_t checkpoint_every_steps;                /* 0 = off */
	uint32_t checkpoint_every_seconds;              /* 0 = off */
	uint32_t checkpoint_keep;                       /* 0 = keep all */
	bool checkpoint_allow_fresh_start;              /* start afresh over damaged ones */
	uint32_t node_rank, num_nodes;
	char master_addr[256];                          /* node 0's store, on a cluster */
	uint16_t master_port;
	int store_timeout_ms;
};

/* For settings->checkpoint_dir (must be set, created if missing), whose lock it takes until
 * destroyed (embd_ckpt_lock_take: EMBD_EBUSY naming the holder's pid when another service
 * has it). Keeps pointers to settings and step. */
int embd_ckpt_service_create(const struct embd_ckpt_settings *settings, struct embd_step *step,
			     struct embd_plan *plan, struct embd_ckpt_service **out, char *err,
			     size_t err_len);
/* Waits for a running write, then frees everything. NULL is a no-op. */
void embd_ckpt_service_destroy(struct embd_ckpt_service *ck);

/*
 * Restores the newest valid checkpoint into the step's shards (before any step ran); on a
 * cluster the one node 0 chose (checkpoint.h). *step_out: its step (0 when there is none,
 * which returns 0 too). Every damaged checkpoint it skips is logged and, once the restore
 * goes ahead, moved to <checkpoint_dir>/damaged/ (checkpoint.h). With damaged ones (or a
 * damaged/ that holds checkpoints) and no valid one it refuses to start from the initial
 * weights (EMBD_ECHECKSUM naming them, the directories left in place) unless
 * checkpoint_allow_fresh_start is set: silently starting over would drop the training they
 * hold. Once it goes ahead from step N (0: afresh), this node's steps above N are moved to
 * abandoned/ (embd_ckpt_set_aside_after). EMBD_EMISMATCH when the checkpoint is not this
 * service's (checkpoint.h: its tables differ from the config's, err naming the table; one
 * node's part of a per_node checkpoint on one node or the shared layout; per_node: another
 * node, node count or plan).
 */
int embd_ckpt_service_restore(struct embd_ckpt_service *ck, uint64_t *step_out, char *err,
			      size_t err_len);

/*
 * The same while the service runs, when a re-formed cluster decided to restore
 * (dist/regroup.h): between steps, no forward pending. Waits for a running write first.
 * Node 0 publishes its choice at restore_key (one key per generation), the others restore that
 * one. EMBD_ENOENT when there is no valid checkpoint (on every node alike).
 */
int embd_ckpt_service_restore_running(struct embd_ckpt_service *ck, const char *restore_key,
				      uint64_t *step_out, char *err, size_t err_len);

/*
 * The cluster re-formed into `generation` (dist/regroup.h; the service thread, before the
 * decision is carried out): the writer's store handle may have failed meanwhile (a write
 * waited on node 0 while it stalled), and a failed handle fails every later call. It is
 * connected again to the same store (embd_store_reconnect, at once when it is still open) as
 * soon as no write runs: now, or when the running write is joined (_reap, _poll,
 * _restore_running), never under it. The next checkpoints' store keys are scoped by the
 * generation (ckpt_cluster.h), so keys an earlier generation left behind are never read.
 */
void embd_ckpt_service_regrouped(struct embd_ckpt_service *ck, uint64_t generation);

/* An eventfd that becomes readable when a background write finished: call _reap then. */
int embd_ckpt_service_fd(const struct embd_ckpt_service *ck);

/* Asks for a checkpoint as soon as possible (on a cluster: at the boundary after the next step,
 * as agreed); returns the sequence number that will hold it. */
uint64_t embd_ckpt_service_request(struct embd_ckpt_service *ck);

/* At a step boundary: starts a checkpoint of `step` (steps completed) if one is due and none
 * is being written (a cluster's due one waits for the running write). True when one started.
 * One node also calls it when a request comes or a write ends (it takes the due one then). On
 * a cluster call it only at the boundary of a step the cluster ran together while running
 * (daemon/server_ckpt.c, embd_server_checkpoint_boundary): every node must poll the same steps. */
bool embd_ckpt_service_poll(struct embd_ckpt_service *ck, uint64_t step);
/* Whether _poll at the boundary of `step` would start a checkpoint, as things stand: every
 * _steps or an agreed one (after the running write, if one runs), or on one node with no
 * write running a request or the timer. Changes nothing. */
bool embd_ckpt_service_due(const struct embd_ckpt_service *ck, uint64_t step);

/* A cluster's agreement: _wanted, this node's HELLO flag for the step about to run (a
 * request, node 0's timer, or SIGTERM); _agreed, some node flagged the step that just ran, so
 * the next _poll takes a checkpoint; _stopping, SIGTERM: flag every step from now on. */
bool embd_ckpt_service_wanted(const struct embd_ckpt_service *ck, uint64_t step);
void embd_ckpt_service_agreed(struct embd_ckpt_service *ck);
void embd_ckpt_service_stopping(struct embd_ckpt_service *ck);

/* Joins a finished write (logging its result); returns the sequence number of the last
 * finished checkpoint (0: none yet). Call when the fd fired; harmless otherwise. */
uint64_t embd_ckpt_service_reap(struct embd_ckpt_service *ck);

/* The result of the last finished checkpoint as JSON text (malloc'ed):
 * {"ok":true,"step":N,"dir":"...","bytes":..,"write_ms":..,"stall_ms":..} or {"ok":false,...}.
 * When ok is false, the error is in "error". */
int embd_ckpt_service_result_json(const struct embd_ckpt_service *ck, char **out);

/* Adds "resumed_step" and a "checkpoint" object (config, last result, in progress, written,
 * skipped (above), worst stall) to the status JSON text *status (replaced by a new malloc'ed
 * text). */
int embd_ckpt_service_status_add(const struct embd_ckpt_service *ck, char **status);

/* The final checkpoint at SIGTERM: waits for a running write, then writes `step` on this
 * thread unless it is already on disk (the last checkpoint's step, or the restored one with
 * nothing trained since). A cluster's node writes only when every node stops at `step`
 * (embd_ckpt_cluster_stop_barrier, store_timeout_ms): SIGTERM to one idle node alone
 * writes nothing. */
int embd_ckpt_service_final(struct embd_ckpt_service *ck, uint64_t step);

/* Worst snapshot copy so far (ms) and the last write's figures, for the benchmark and the
 * metrics (daemon/metrics.h). */
struct embd_ckpt_figures {
	double max_stall_ms, last_stall_ms, last_write_ms;
	uint64_t last_bytes, last_step;
	uint64_t written;               /* checkpoints written */
	uint64_t failed;                /* writes that failed */
	double write_ms_sum;            /* the written ones' write_ms */
	bool in_progress;
};
void embd_ckpt_service_figures(const struct embd_ckpt_service *ck, struct embd_ckpt_figures *out);

#endif /* EMBD_CKPT_CKPT_SERVICE_H */
