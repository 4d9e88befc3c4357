/*
 * daemon/server.h - the running service: the control socket, the clients and their regions,
 * the step schedule, all driven by one io_uring event loop (ipc/evloop.h) on one thread.
 *
 * The step contract (what libembdclient implements from the other side): trainers connect,
 * HELLO with a wanted local index or -1, get WELCOME (layout, step) and a region; per step s
 * each posts FORWARD s, gets its completion once its pooled output is in its slab, posts
 * BACKWARD s, and gets its completion once the optimizer ran. Forward of step s runs once
 * every connected trainer posted FORWARD s (or sat s out after a refused batch); the very
 * first step also waits for trainers_per_node trainers. Backward runs once every participant
 * posted BACKWARD s. A participant hanging up aborts step s: nobody's parameters change, the
 * others get EMBD_ECANCELED for step s, and the node moves on to s + 1.
 *
 * A step waits for a trainer from the first FORWARD it kept (a trainer that posted nothing
 * yet is not waited for while nobody did), or for a participant's BACKWARD from the end of
 * the forward, as long as another trainer's request is kept waiting (the first step waiting
 * for trainers to connect is no stall). Past step_wait_warn_ms it logs those trainers
 * (index, pid) once and shows them
 * in STATUS ("stalled") and STATS ("stalling_ms"); past step_wait_abort_ms it gives up: in
 * backward the step is aborted as when a participant leaves, its kept BACKWARDs (and a late
 * one of the staller) answered EMBD_ETIMEDOUT naming them; in forward, which never ran, the
 * FORWARDs kept are answered EMBD_ETIMEDOUT and the schedule stays at step s (post it again).
 * One FORWARD per trainer and step: a FORWARD of a step whose forward ran, or a second one
 * while one is pending, is refused at once with EMBD_EINVAL.
 *
 * A request is taken from a client's submission ring only while its completion ring has room
 * for the request's completion besides those the client is owed (ipc/README.md): completions
 * are never dropped. A client that does not read them is held back: its requests wait in its
 * submission ring, so a step that needs its FORWARD or BACKWARD waits too (named after
 * step_wait_warn_ms, given up after step_wait_abort_ms when that is set).
 *
 * Connections are pending until their first message, then trainers (HELLO welcomed, up to
 * trainers_per_node) or control connections (embctl: any other first message, at most 32;
 * one more is refused with EMBD_EBUSY). At most 32 connections pend at a time: a new one
 * closes the one pending longest (it is told EMBD_EBUSY), and one that sends nothing within
 * handshake_timeout_ms is closed (EMBD_ETIMEDOUT), so idle sockets never lock trainers or
 * embctl out. Each kind has slots of its own. Lines a peer can cause (refusals, closed
 * connections, refused messages) are rate-limited in the log (common/log.h).
 *
 * On several nodes the schedule spans the cluster: node n runs the forward of step s when its
 * own trainers are in (or at once when all sat it out), then the step's collectives; backward
 * likewise, even with no participant of its own. An abort goes through the backward's
 * collective, so every node's trainers get EMBD_ECANCELED. Collectives run on the loop's
 * thread and may hold it up to collective_timeout_ms; a node that does not answer within it
 * fails the step here with an error naming it, and the nodes re-form the cluster
 * (dist/regroup.h, server_regroup.c): meanwhile FORWARDs are refused with EMBD_EAGAIN, then
 * the cluster resumes (a FORWARD of another step than the agreed one gets EMBD_ERESUMED with
 * that step), restores a checkpoint, or refuses every step when the state was lost.
 */
#ifndef EMBD_DAEMON_SERVER_H
#define EMBD_DAEMON_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "engine/step.h"

struct embd_server;

/*
 * The server of config->socket_path, watching the signalfd sigfd (SIGTERM / SIGINT, already
 * blocked by the caller) for the request to stop. The server keeps pointers to config, step
 * and ranks; they must outlive it. It listens once embd_server_listen is called.
 */
int embd_server_create(const struct embd_config *config, struct embd_step *step,
		       struct embd_ranks *ranks, uint64_t plan_hash, int sigfd,
		       struct embd_server **out, char *err, size_t err_len);
/*
 * Creates config->socket_path (and its directory) and listens on it. Call it when everything
 * else is set up: a socket that exists means a service whose descriptors, threads and
 * checkpoint state are all in place (tests count its fds from then).
 */
int embd_server_listen(struct embd_server *server, char *err, size_t err_len);

/* Runs until the signalfd fires: 0, or EMBD_EIO when the event loop failed. */
int embd_server_run(struct embd_server *server);

struct embd_ckpt_service;

/* Hands the server its checkpointer (ckpt/ckpt_service.h; it must outlive the server) and
 * the step a restore resumed at (the first step trainers post). Call before run. 0, or
 * EMBD_ENOMEM, or EMBD_EIO when the loop cannot watch the writer (err says which). */
int embd_server_set_checkpoints(struct embd_server *server, struct embd_ckpt_service *ckpt,
				uint64_t resumed_step, char *err, size_t err_len);

struct embd_regroup;

/* A cluster's node: hands the server the regroup handle (dist/regroup.h; it must outlive
 * the server) that re-forms the cluster after a failure; lost: this process restarted into a
 * running cluster (its shards are gone until a restore). resumed_step: the step its parameters
 * are at. Call before run. 0, or EMBD_ENOMEM (err says so). */
int embd_server_set_regroup(struct embd_server *server, struct embd_regroup *rg, bool lost,
			    uint64_t resumed_step, char *err, size_t err_len);

/* The step being collected or run (= steps completed outside a step phase). */
uint64_t embd_server_step(const struct embd_server *server);

/* True on one node, and on a cluster's node while the cluster runs with its comm intact: then
 * the shards are those of embd_server_step() on every node. False while it re-forms, lost its
 * state or lost node 0's store (why says which): a failed gradient exchange may have left the
 * update applied on some nodes only, and the step counted ahead of the parameters, so no
 * final checkpoint may be taken. */
bool embd_server_cluster_running(const struct embd_server *server, char *why, size_t why_len);

/* Disconnects every client (unmapping regions, closing fds) and unlinks the socket. */
void embd_server_destroy(struct embd_server *server);

#endif /* EMBD_DAEMON_SERVER_H */
