/*
 * daemon/server_internal.h - the server's state (daemon/server.h), shared by server.c (the
 * loop, the sessions and the step schedule) and server_ckpt.c (the checkpoint requests).
 * Everything here runs on the server's one thread.
 */
#ifndef EMBD_SERVICE_SERVER_PRIV_H
#define EMBD_SERVICE_SERVER_PRIV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ipc/control.h"
#include "ipc/doorbell.h"
#include "ipc/protocol.h"
#include "daemon/server.h"
#include "daemon/stats.h"

#define MAX_CLIENTS 256u
/* SIGTERM on a cluster with checkpoints: how long to wait for a step to carry the final
 * checkpoint's flag (steps run every few ms while trainers train) before taking it idle, and
 * how often the loop looks at the clock meanwhile. */
#define STOP_DRAIN_MS 1000u
#define STOP_TICK_MS 20

enum tag_kind { TAG_LISTEN = 1, TAG_SIGNAL, TAG_SOCKET, TAG_DOORBELL, TAG_CKPT, TAG_PIDFD };
#define TAG(kind, slot) (((uint64_t)(kind) << 32) | (slot))

struct client {
	bool used;
	int sock;
	int pidfd;                      /* the peer process, or -1: its exit drops the client even
					 * when a child it forked keeps the socket open */
	struct embd_ctl_peer peer;
	int32_t index;                  /* trainer index, -1 before HELLO (embctl stays -1) */
	struct embd_region *region;
	int eventfd;
	struct embd_doorbell sq_db, cq_db;
	bool db_armed;
	struct embd_batch_limits limits;
	int32_t *lengths;               /* private copy of the posted batch's lengths */
	/* the step in flight, from this trainer's side */
	bool has_fwd, has_bwd, participant;
	struct embd_sqe fwd, bwd;
	uint64_t fwd_popped_ns, bwd_popped_ns;
	struct embd_kjt kjt;
	uint64_t sat_out;               /* step + 1 of a refused FORWARD/descriptor: skip it */
	uint64_t requests, errors;
	uint64_t ckpt_wait;             /* embctl checkpoint --wait: the checkpoint it waits for */
};

enum phase { COLLECT, WAIT_BACKWARD };

struct embd_server {
	const struct embd_config *config;
	struct embd_step *step;
	struct embd_ranks *ranks;
	uint64_t plan_hash;
	struct embd_evloop *loop;
	int listen_fd, sigfd;
	bool stop, first_step_done;
	bool cluster;                   /* several nodes: every step is collective */
	struct client clients[MAX_CLIENTS];
	uint32_t slots_end;             /* 1 + the highest slot in use: per-pass loops stop here */
	bool dirty;                     /* something advance() looks at changed since it last ran */
	uint64_t s;                     /* the step being collected or run */
	enum phase phase;
	uint64_t step_start_ns;
	uint64_t canceled_step;         /* step + 1 of the last aborted or dropped step */
	char canceled_why[EMBD_CQE_MSG_BYTES];  /* what a late BACKWARD of it is told */
	struct embd_step_batch *batches;
	uint32_t batch_slot[MAX_CLIENTS];
	uint32_t num_batches;
	struct embd_stats stats;
	struct embd_layout *layout;
	uint8_t *msgbuf;
	struct embd_ckpt_service *ckpt; /* NULL without checkpoint_dir */
	bool ckpt_agreed;               /* the cluster agreed on a checkpoint after this step */
	bool stopping;                  /* SIGTERM on a cluster: the final checkpoint first */
	uint64_t stop_deadline_ns;      /* ... then stop once no step came by this time */
	/* re-forming the cluster after a failure (server_regroup.c); rg NULL on one node */
	struct embd_regroup *rg;
	enum regroup_state { RG_RUNNING, RG_FORMING, RG_LOST, RG_DETACHED } rg_state;
	uint64_t rg_next_ns;            /* the next look at the store */
	uint64_t applied;               /* the step after the last one the cluster completed:
					   its update applied, or none anywhere (every batch
					   refused, or aborted); a failed one never counts */
	bool lost;                      /* restarted into a running cluster: shards are gone */
	bool regrouped;                 /* re-formed once: a FORWARD of another step learns it */
	char rg_msg[EMBD_CQE_MSG_BYTES];/* why FORWARDs are refused while not running */
};

/* A completion for sqe of client c (server.c). */
void embd_server_complete(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			  uint64_t popped_ns, int result, const char *msg);
/* Step sv->s ends with no update (aborted, or dropped by re-forming): a BACKWARD of it that
 * comes later is answered EMBD_ECANCELED with why. */
static inline void embd_server_cancel_step(struct embd_server *sv, const char *why)
{
	sv->canceled_step = sv->s + 1;
	snprintf(sv->canceled_why, sizeof(sv->canceled_why), "%s", why);
}

/* ---- server_regroup.c ---- */

/* Every pass of the loop: notices a failed collective or a newer generation and drives the
 * forming of the next one (short store looks, at most every few tens of ms). */
void embd_server_regroup_tick(struct embd_server *sv);
/* A FORWARD the cluster cannot run now (re-forming, state lost, or of another step than the
 * one a re-formed cluster resumed at) is completed here: true. */
bool embd_server_regroup_gate(struct embd_server *sv, struct client *c,
			      const struct embd_sqe *sqe, uint64_t popped_ns);
/* Whether steps may run (no re-forming, no refusal). */
bool embd_server_regroup_running(const struct embd_server *sv);
/* Adds the "cluster" object (daemon/stats.h) to the status JSON text *status. */
int embd_server_regroup_status_add(const struct embd_server *sv, char **status);
/* How long the loop may sleep (ms): short while forming. */
int embd_server_regroup_sleep_ms(const struct embd_server *sv, int idle_ms);

/* embctl checkpoint [--wait] from client c (server_ckpt.c). */
int embd_server_checkpoint_request(struct embd_server *sv, struct client *c,
				   const struct embd_ctl_msg *msg, char *err, size_t err_len);
/* SIGTERM or SIGINT: stop now, or (a cluster with checkpoints) ask for the cluster's final
 * checkpoint and stop after it, or at the drain deadline. */
void embd_server_checkpoint_signal(struct embd_server *sv, uint32_t signo);
/* A background checkpoint write ended (its fd fired in the loop). */
void embd_server_checkpoint_done(struct embd_server *sv);
/* A re-formed cluster restored (rc 0, at step) or failed to: embd_ckpt_service_restore_running
 * dropped the pending request, so its `--wait` clients are answered with an error saying so
 * (the ones of the write it joined, with that write's result). */
void embd_server_checkpoint_restored(struct embd_server *sv, int rc, uint64_t step);

#endif /* EMBD_SERVICE_SERVER_PRIV_H */
