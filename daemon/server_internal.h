/*
 * daemon/server_internal.h - the server (daemon/server.h) in four files, one concept each, all
 * on the server's one thread:
 *   server.c           the loop, the sessions (accept, HELLO, stats), lifetime
 *   server_schedule.c  the step schedule: requests, the phases of step s, completions
 *   server_ckpt.c      checkpoints: embctl requests, --wait answers, SIGTERM's final one
 *   server_regroup.c   re-forming a cluster after a failure
 *   server_tables.c    live table access (TABLE_READ, TABLE_WRITE)
 *   server_device.c    device outputs (DEVICE_REQUEST): outputs and gradients on a GPU
 * struct embd_server holds the loop, the sessions and the schedule; the checkpoint and regroup
 * parts keep their state in their own structs, defined in their own files and reached only
 * through the functions below (each of which does nothing, or answers for a plain node, when
 * its part is not set).
 */
#ifndef EMBD_DAEMON_SERVER_INTERNAL_H
#define EMBD_DAEMON_SERVER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "ipc/control.h"
#include "ipc/doorbell.h"
#include "ipc/protocol.h"
#include "daemon/metrics.h"
#include "daemon/server.h"
#include "daemon/stats.h"

/* A connection is pending until its first message, then a trainer (HELLO welcomed) or a
 * control connection (embctl: anything else). Each kind has its own limit, and the slots hold
 * all of them at once, so idle connections never take a trainer's or embctl's place. */
#define MAX_PENDING 32u
#define MAX_CONTROL 32u
#define MAX_CLIENTS (EMBD_CONFIG_TRAINERS_MAX + MAX_PENDING + MAX_CONTROL)

enum tag_kind { TAG_LISTEN = 1, TAG_SIGNAL, TAG_SOCKET, TAG_DOORBELL, TAG_CKPT, TAG_PIDFD };
#define TAG(kind, slot) (((uint64_t)(kind) << 32) | (slot))

struct client {
	bool used;
	int sock;
	int pidfd;                      /* the peer process, or -1: its exit drops the client even
					 * when a child it forked keeps the socket open */
	struct embd_ctl_peer peer;
	int32_t index;                  /* trainer index, -1 before HELLO (embctl stays -1) */
	bool spoke;                     /* sent a message: no longer pending */
	uint64_t accepted_ns;
	struct embd_region *region;
	bool slab_registered;           /* with the ranks' devices (DMA straight to the slab) */
	int eventfd;
	struct embd_doorbell sq_db, cq_db;
	struct embd_batch_limits limits;
	int32_t *lengths;               /* private copy of the posted batch's lengths */
	int32_t *next_lengths;          /* ... of an early FORWARD being prepared (next_kjt) */
	struct embd_kjt next_kjt;
	/* the step in flight, from this trainer's side (server_schedule.c) */
	bool has_fwd, has_bwd, participant;
	struct embd_sqe fwd, bwd;
	uint64_t fwd_popped_ns, bwd_popped_ns;
	struct embd_kjt kjt;
	uint64_t sat_out;               /* step + 1 of a refused FORWARD/descriptor: skip it */
	bool cq_broken;                 /* its completion ring's head is corrupt: dropped at the
					 * next pass over the rings */
	/* its evaluation (EVAL): run at once on one node; on a cluster kept for the node's next
	 * evaluation round (server_schedule.c) */
	bool has_eval, eval_sat_out;    /* eval_sat_out: its EVAL was refused, the round goes on */
	struct embd_sqe eval;
	uint64_t eval_popped_ns;
	struct embd_kjt eval_kjt;
	int32_t *eval_lengths;          /* private copy of the evaluation batch's lengths */
	/* device outputs (server_device.c): its outputs and gradients in memory of its GPU, and
	 * the host rows the engine writes its EMBD_SQE_DEVICE outputs into first */
	bool has_device, staging_registered;
	struct embd_export device;
	float *staging;                 /* batch_size x total_dim floats */
	uint64_t requests, errors;
};

enum phase { COLLECT, WAIT_BACKWARD };

struct embd_server_ckpt;
struct embd_server_regroup;

struct embd_server {
	const struct embd_config *config;
	struct embd_step *step;
	struct embd_ranks *ranks;
	uint64_t plan_hash;
	bool cluster;                   /* several nodes: every step is collective */
	/* the loop and the sessions (server.c) */
	struct embd_evloop *loop;
	int listen_fd, sigfd;
	bool stop;
	struct client clients[MAX_CLIENTS];
	uint32_t slots_end;             /* 1 + the highest slot in use: per-pass loops stop here */
	bool dirty;                     /* something advance() looks at changed since it last ran */
	struct embd_stats stats;
	struct embd_log_limit refusals_log;     /* connections refused at accept */
	struct embd_log_limit silent_log;       /* pending ones closed at handshake_timeout_ms */
	struct embd_log_limit room_log;         /* ... or to make room for a newer one */
	struct embd_log_limit errors_log;       /* messages refused (protocol, HELLO) */
	uint64_t handshake_due_ns;              /* the oldest pending one's deadline; 0: none */
	struct embd_metrics *metrics;   /* NULL without metrics_listen */
	uint64_t metrics_ns;            /* when the metrics were last published */
	struct embd_layout *layout;
	uint8_t *msgbuf;
	/* the step schedule (server_schedule.c) */
	uint64_t s;                     /* the step being collected or run */
	enum phase phase;
	bool first_step_done;
	uint64_t step_start_ns;
	uint64_t forward_done_ns;       /* when the step's forward completions were posted */
	uint64_t backward_start_ns;     /* when every participant's BACKWARD was in */
	uint64_t applied_ns;            /* when the last backward's update was applied */
	uint64_t canceled_step;         /* step + 1 of the last aborted or dropped step */
	int canceled_code;              /* what a late BACKWARD of it is told: code and why */
	char canceled_why[EMBD_CQE_MSG_BYTES];
	uint64_t wait_since_ns;         /* the phase waits for trainers since (0: nobody is in
					 * yet): step_wait_warn_ms / step_wait_abort_ms count here */
	bool wait_warned;
	struct embd_step_batch *batches;
	uint32_t batch_slot[MAX_CLIENTS];
	uint32_t num_batches;
	/* pipelined steps: step s + 1 routed while step s waits for its backward */
	bool prepared;
	uint64_t unpreparable;          /* s + 1 when preparing it failed: not retried every
					 * loop turn (0: none) */
	struct embd_step_batch *next_batches;
	uint32_t next_slot[MAX_CLIENTS];
	uint32_t num_next;
	uint64_t next_start_ns;         /* when its HELLO went out, in the backward before
					 * (embd_step_backward_overlapped) */
	float *grads;                   /* the step's gradients, copied out of the trainers' slabs
					 * (trainers_per_node x batch_size x total_dim) before the
					 * engine checks and uses them: server_schedule.c */
	bool grads_registered;          /* with the ranks (embd_ranks_host_register) */
	/* the parts (NULL when not set) */
	struct embd_server_ckpt *ckpt;          /* server_ckpt.c: with checkpoint_dir */
	struct embd_server_regroup *rg;         /* server_regroup.c: on a cluster's node */
};

/* ---- server.c ---- */

/* Drops client c (its socket, pidfd and region), aborting the step it takes part in. */
void embd_server_drop_client(struct embd_server *sv, struct client *c, const char *why);
/* The status JSON text *status becomes root printed (the parts add their objects to it);
 * root is deleted either way. 0 or EMBD_ENOMEM. */
int embd_server_status_replace(char **status, cJSON *root);

/* ---- server_schedule.c ---- */

/* A completion for sqe of client c. */
void embd_server_complete(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			  uint64_t popped_ns, int result, const char *msg);
/* Pops what every ready client posted and runs the phases that became due. Returns how many
 * requests were handled. */
uint32_t embd_server_poll_rings(struct embd_server *sv);
/* Whether client c may hand in its next request now (else it stays in its ring): the schedule
 * takes one from it, and its completion ring has room for that request's completion besides
 * the ones it is owed already (back-pressure: a completion is never dropped). *held (may be
 * NULL) is set when only the room is missing: the client must read its completions first. */
bool embd_server_client_ready(const struct embd_server *sv, struct client *c, bool *held);
/* Every pass that reads the clock: a step that waits for trainers longer than
 * step_wait_warn_ms names them in the log, longer than step_wait_abort_ms gives up. */
void embd_server_schedule_tick(struct embd_server *sv, uint64_t now_ns);
/* How long the loop may sleep (ms): until the next of those limits at most. */
int embd_server_schedule_sleep_ms(const struct embd_server *sv, int idle_ms);
/* How long the step has waited for client c, when that is step_wait_warn_ms or more (else 0). */
uint64_t embd_server_stalling_ms(const struct embd_server *sv, const struct client *c);
/* Adds the "stalled" object (daemon/stats.h) to the status JSON text *status when the step
 * waits for trainers past step_wait_warn_ms. */
int embd_server_schedule_status_add(const struct embd_server *sv, char **status);
/* Client c leaves: the step it takes part in is aborted (why names it). */
void embd_server_schedule_leave(struct embd_server *sv, struct client *c, const char *why);
/* The first step a trainer welcomed now posts. */
uint64_t embd_server_join_step(const struct embd_server *sv);
/* Drops the step in flight on this node alone (its comm is broken: nothing was applied) and
 * answers every request kept for it: a BACKWARD EMBD_ECANCELED (now or when it comes), a
 * FORWARD EMBD_EAGAIN, with why. */
void embd_server_drop_step(struct embd_server *sv, const char *why);
/* The schedule starts over at step (a restore, or the cluster's agreed step). */
void embd_server_resume_at(struct embd_server *sv, uint64_t step);

/* ---- server_ckpt.c ---- */

/* embctl checkpoint [--wait] from client c. */
int embd_server_checkpoint_request(struct embd_server *sv, struct client *c,
				   const struct embd_ctl_msg *msg, char *err, size_t err_len);
/* SIGTERM or SIGINT: true to stop now; false when (a cluster with checkpoints) the cluster's
 * final checkpoint is asked for first: the server stops after it, or at the drain deadline. */
bool embd_server_checkpoint_signal(struct embd_server *sv, uint32_t signo);
/* True once the drain after the signal ran out with no step (it says so in the log). */
bool embd_server_checkpoint_drain_over(const struct embd_server *sv);
/* How long the loop may sleep (ms): short while draining. */
int embd_server_checkpoint_sleep_ms(const struct embd_server *sv, int idle_ms);
/* A background checkpoint write ended (its fd fired in the loop). */
void embd_server_checkpoint_done(struct embd_server *sv);
/* Around the forward of step: a cluster's first exchange carries the checkpoint wanted after
 * it; forward_end (rc: the forward's) notes whether the cluster agreed on it. */
void embd_server_checkpoint_forward_begin(struct embd_server *sv, uint64_t step);
void embd_server_checkpoint_forward_end(struct embd_server *sv, int rc);
/* The boundary before the step being collected: takes the checkpoint due there (on a cluster
 * only while it runs). True when that was the final one (SIGTERM): stop. */
bool embd_server_checkpoint_boundary(struct embd_server *sv);
/* Whether the boundary after the step in flight takes no checkpoint and does not stop the
 * server (SIGTERM's final checkpoint), as far as is known now. */
bool embd_server_checkpoint_quiet_boundary(const struct embd_server *sv);
/* The step in flight was dropped: a checkpoint agreed for it is not taken. */
void embd_server_checkpoint_step_dropped(struct embd_server *sv);
/* A re-formed cluster's generation gen: the checkpoints' store handle follows it. */
void embd_server_checkpoint_regrouped(struct embd_server *sv, uint64_t gen);
/* Restores the checkpoint the re-formed cluster chose (store key key) into the running node:
 * 0 and *step, or an error in err. The pending request it drops is answered either way. */
int embd_server_checkpoint_restore(struct embd_server *sv, const char *key, uint64_t *step,
				   char *err, size_t err_len);
/* The checkpoint figures of the metrics snapshot (nothing without checkpoints). */
void embd_server_checkpoint_metrics(const struct embd_server *sv, struct embd_metrics_snapshot *s);
/* Adds the "checkpoints" object to the status JSON text *status. */
int embd_server_checkpoint_status_add(const struct embd_server *sv, char **status);
/* The client in slot left: nobody waits there any more. */
void embd_server_checkpoint_client_gone(struct embd_server *sv, uint32_t slot);
void embd_server_checkpoint_free(struct embd_server *sv);

/* ---- server_tables.c ---- */

/* A TABLE_READ or TABLE_WRITE from client c: answered with the rows, DONE or an ERROR that
 * says why (the client stays). Returns only a failure to send the answer (the client is
 * gone), with err. */
int embd_server_table_request(struct embd_server *sv, struct client *c,
			      const struct embd_ctl_msg *msg, char *err, size_t err_len);

/* ---- server_device.c ---- */

/* A DEVICE_REQUEST from client c: answered with DEVICE_OUTPUTS and the memory's fd, or an
 * ERROR that says why not (the client stays, on its slab). Returns only a failure to send the
 * answer (the client is gone), with err. */
int embd_server_device_request(struct embd_server *sv, struct client *c,
			       const struct embd_ctl_msg *msg, char *err, size_t err_len);
/* Where the engine writes the pooled rows of c's FORWARD or EVAL sqe: its slab span, or with
 * EMBD_SQE_DEVICE the staging rows, which embd_server_output_done then copies to the span of
 * its device buffers (0, or an error with err; nothing to do for a slab span). */
float *embd_server_output(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe);
int embd_server_output_done(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			    char *err, size_t err_len);
/* The gradient of c's BACKWARD sqe for b, `to` (grad.bytes) its private copy: a slab span
 * is left for the engine to copy into `to` as it checks it (b->grad_from, engine/step.h); with
 * EMBD_SQE_DEVICE it is copied from the device buffers into `to` here (0, or an error with
 * err). */
int embd_server_grad_in(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			float *to, struct embd_step_batch *b, char *err, size_t err_len);
/* Frees c's device outputs and staging rows, if any (it leaves). */
void embd_server_device_free(struct embd_server *sv, struct client *c);

/* ---- server_regroup.c ---- */

/* Every pass of the loop: notices a failed collective or a newer generation and drives the
 * forming of the next one (short store looks, at most every few tens of ms). */
void embd_server_regroup_tick(struct embd_server *sv);
/* A FORWARD the cluster cannot run now (re-forming, state lost, or of another step than the
 * one a re-formed cluster resumed at, unless early: for the step after the one in backward)
 * is completed here: true. */
bool embd_server_regroup_gate(struct embd_server *sv, struct client *c,
			      const struct embd_sqe *sqe, uint64_t popped_ns, bool early);
/* Whether steps may run (one node, or no re-forming and no refusal). */
bool embd_server_regroup_running(const struct embd_server *sv);
/* Every node completed the steps before step alike (update applied, or none anywhere). */
void embd_server_regroup_applied(struct embd_server *sv, uint64_t step);
/* The cluster figures of the metrics snapshot (nothing on one node). */
void embd_server_regroup_metrics(const struct embd_server *sv, struct embd_metrics_snapshot *s);
/* Adds the "cluster" object (daemon/stats.h) to the status JSON text *status. */
int embd_server_regroup_status_add(const struct embd_server *sv, char **status);
/* How long the loop may sleep (ms): short while forming. */
int embd_server_regroup_sleep_ms(const struct embd_server *sv, int idle_ms);
void embd_server_regroup_free(struct embd_server *sv);

#endif /* EMBD_DAEMON_SERVER_INTERNAL_H */
