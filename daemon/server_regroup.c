/*
 * daemon/server_regroup.c - the server's side of re-forming a cluster (dist/regroup.h):
 * when a collective failed, or another node opened a newer generation, the step in flight is
 * dropped (no parameter changes), FORWARDs are refused with EMBD_EAGAIN while the nodes meet
 * in the new generation, and the decision is carried out between steps: resume at the agreed
 * step, restore the newest cluster checkpoint, or refuse every step naming the node that lost
 * its state. The loop keeps serving meanwhile; the store is looked at every FORMING_LOOK_MS.
 * When the store itself fails the node is detached and tries node 0's store again every
 * DETACHED_LOOK_NS (each try may hold the loop ~2 s while a stalled node 0 does not answer).
 *
 * A trainer learns the step to post from the refusal of its next FORWARD: EMBD_ERESUMED with
 * the completion's step set to it (libembdclient copies it into embd_layout()->resumed_step);
 * a trainer that connects later gets it in WELCOME.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "ckpt/ckpt_service.h"
#include "common/log.h"
#include "dist/regroup.h"
#include "daemon/server_internal.h"

#define RUNNING_LOOK_NS 250000000ull    /* running: a look for a newer generation */
#define FORMING_LOOK_MS 50              /* forming: a look for the missing nodes */
#define DETACHED_LOOK_NS 500000000ull   /* detached: a try at node 0's store */

void embd_server_set_regroup(struct embd_server *sv, struct embd_regroup *rg, bool lost,
			     uint64_t resumed_step)
{
	sv->rg = rg;
	sv->lost = lost;
	sv->applied = resumed_step;
	sv->rg_state = lost ? RG_FORMING : RG_RUNNING;
	if (lost)
		snprintf(sv->rg_msg, sizeof(sv->rg_msg), "node %u restarted: rejoining the cluster",
			 sv->config->node_rank);
}

bool embd_server_regroup_running(const struct embd_server *sv)
{
	return sv->rg_state == RG_RUNNING && !embd_step_comm_broken(sv->step, NULL);
}

int embd_server_regroup_sleep_ms(const struct embd_server *sv, int idle_ms)
{
	if (sv->rg_state == RG_FORMING || sv->rg_state == RG_DETACHED)
		return FORMING_LOOK_MS;
	/* running: the look for a newer generation is due this often even when idle */
	return sv->rg_state == RG_RUNNING && idle_ms > (int)(RUNNING_LOOK_NS / 1000000) ?
	       (int)(RUNNING_LOOK_NS / 1000000) : idle_ms;
}

/* Drops the step in flight on this node (its comm is broken: nothing was applied) and answers
 * every request kept for it; the trainers post again once the cluster runs. A BACKWARD of the
 * dropped step, kept or still to come, is EMBD_ECANCELED like an aborted step's: no parameter
 * changed, post the step again. */
static void drop_step(struct embd_server *sv, const char *why)
{
	char msg[EMBD_CQE_MSG_BYTES];

	snprintf(msg, sizeof(msg), "%s", why);
	if (sv->phase == WAIT_BACKWARD) {
		embd_step_abort(sv->step, why);         /* refused at once: no collective */
		sv->stats.aborted_steps++;
		embd_server_cancel_step(sv, msg);
	}
	sv->ckpt_agreed = false;                /* agreed for a step that did not complete */
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (!c->used)
			continue;
		if (c->has_bwd)
			embd_server_complete(sv, c, &c->bwd, c->bwd_popped_ns, EMBD_ECANCELED, msg);
		if (c->has_fwd)
			embd_server_complete(sv, c, &c->fwd, c->fwd_popped_ns, EMBD_EAGAIN, msg);
		c->has_bwd = c->has_fwd = c->participant = false;
		c->sat_out = 0;
	}
	sv->phase = COLLECT;
}

static void refuse_all(struct embd_server *sv, enum regroup_state state, const char *fmt,
		       const char *what)
{
	sv->rg_state = state;
	snprintf(sv->rg_msg, sizeof(sv->rg_msg), fmt, what);
	embd_step_comm_break(sv->step, sv->rg_msg);     /* the step in flight runs no collective */
	drop_step(sv, sv->rg_msg);
	embd_log_error("node %u: every step is refused: %s", sv->config->node_rank, sv->rg_msg);
}

/* The store failed: steps wait (EMBD_EAGAIN) while the node tries node 0's store again. */
static void detach(struct embd_server *sv, const char *err)
{
	embd_log_error("node %u: %s", sv->config->node_rank, err);
	refuse_all(sv, RG_DETACHED, "%s", "node 0 (the store) does not answer: waiting for it");
	sv->rg_next_ns = embd_now_ns() + DETACHED_LOOK_NS;
}

static void start(struct embd_server *sv, const char *why)
{
	char err[512];

	embd_step_comm_break(sv->step, why);
	snprintf(sv->rg_msg, sizeof(sv->rg_msg), "cluster re-forming after: %s", why);
	drop_step(sv, sv->rg_msg);
	if (embd_regroup_start(sv->rg, err, sizeof(err))) {
		detach(sv, err);
		return;
	}
	sv->rg_state = RG_FORMING;
	sv->rg_next_ns = 0;
	embd_log_warning("node %u: re-forming the cluster (generation %" PRIu64 ") after: %s",
			 sv->config->node_rank, embd_regroup_generation(sv->rg), why);
}

/* Carries out the decision every node took; false when the generation failed meanwhile. */
static bool apply(struct embd_server *sv, const struct embd_regroup_decision *d)
{
	const uint64_t gen = embd_regroup_generation(sv->rg);
	char err[512], key[96];
	uint64_t step = d->step;
	int rc;

	/* the checkpoints' own store handle may have failed while the cluster re-formed */
	if (sv->ckpt)
		embd_ckpt_service_regrouped(sv->ckpt, gen);
	if (d->verdict == EMBD_REGROUP_LOST) {
		refuse_all(sv, RG_LOST, "cluster state lost (%.50s): restore from a checkpoint",
			   d->why);
		return true;
	}
	if (d->verdict == EMBD_REGROUP_RESTORE) {
		snprintf(key, sizeof(key), "%srestore", embd_regroup_prefix(sv->rg));
		const uint64_t t0 = embd_now_ns();
		rc = embd_ckpt_service_restore_running(sv->ckpt, key, &step, err, sizeof(err));
		const int restore_ms = (int)((embd_now_ns() - t0) / 1000000);
		embd_server_checkpoint_restored(sv, rc, step);
		if (rc) {
			embd_log_error("restore after %s: %s", d->why, err);
		} else {
			/* this node's parameters are at step now, whatever comes next: a later
			 * generation weighs them so, and does not restore them again */
			sv->applied = step;
			sv->lost = false;
		}
		/* every node hears whether every other one restored, and all take one decision:
		 * a transient failure anywhere tries the next generation, a data failure is lost */
		char outcome[512];
		rc = embd_regroup_restored(sv->rg, rc, err, restore_ms, outcome, sizeof(outcome));
		if (rc == EMBD_EIO) {
			embd_log_error("node %u: %s", sv->config->node_rank, outcome);
			refuse_all(sv, RG_LOST, "cluster state lost, %.80s", outcome);
			return true;
		}
		if (rc) {
			embd_log_warning("node %u: %s", sv->config->node_rank, outcome);
			if (rc != EMBD_EAGAIN)
				detach(sv, outcome);
			else
				snprintf(sv->rg_msg, sizeof(sv->rg_msg), "cluster re-forming: %.80s",
					 outcome);
			return false;
		}
	}
	/* nobody steps before everybody restored (the outcomes above: a barrier that waited as
	 * long as a restore; this one only sees the others leave it) */
	if ((rc = embd_regroup_finish(sv->rg, err, sizeof(err)))) {
		if (rc != EMBD_EAGAIN)
			detach(sv, err);
		return false;
	}
	rc = embd_step_comm_set(sv->step, embd_regroup_comm(sv->rg), gen);
	if (rc) {
		refuse_all(sv, RG_LOST, "%s", "cluster comm refused by the step engine");
		return true;
	}
	sv->s = sv->applied = step;
	sv->phase = COLLECT;
	sv->regrouped = true;
	sv->rg_state = RG_RUNNING;
	sv->dirty = true;
	embd_log_warning("node %u: cluster re-formed (generation %" PRIu64 "): %s at step %" PRIu64
			"%s%s", sv->config->node_rank, gen,
			d->verdict == EMBD_REGROUP_RESTORE ? "restored the checkpoint" : "resuming",
			step, d->why[0] ? " after " : "", d->why);
	return true;
}

void embd_server_regroup_tick(struct embd_server *sv)
{
	const uint64_t now = embd_now_ns();
	struct embd_regroup_decision d;
	const char *why;
	char err[512];
	int rc;

	if (sv->rg_state == RG_RUNNING) {
		if (embd_step_comm_broken(sv->step, &why)) {
			char copy[256];
			snprintf(copy, sizeof(copy), "%s", why);
			start(sv, copy);
			return;
		}
		if (now < sv->rg_next_ns)
			return;
		sv->rg_next_ns = now + RUNNING_LOOK_NS;
		rc = embd_regroup_newer(sv->rg, err, sizeof(err));
		if (rc < 0)
			detach(sv, err);
		else if (rc)
			start(sv, "another node re-forms the cluster");
		return;
	}
	if (sv->rg_state == RG_DETACHED && now >= sv->rg_next_ns) {
		/* node 0 stalled comes back with the same store; a restarted one is not resumed */
		sv->rg_next_ns = now + DETACHED_LOOK_NS;
		rc = embd_regroup_reattach(sv->rg, err, sizeof(err));
		if (rc == 1)
			start(sv, "node 0's store answers again");
		else if (strstr(err, "restarted"))
			refuse_all(sv, RG_LOST, "%.40s: restart every embd node", err);
		return;
	}
	if (sv->rg_state != RG_FORMING || now < sv->rg_next_ns)
		return;
	sv->rg_next_ns = now + FORMING_LOOK_MS * 1000000ull;
	struct embd_regroup_state mine = { .applied = sv->applied, .lost = sv->lost };
	rc = embd_regroup_poll(sv->rg, &mine, sv->ckpt != NULL, &d, err, sizeof(err));
	if (rc == 0 || rc == EMBD_EAGAIN) {
		if (err[0])
			snprintf(sv->rg_msg, sizeof(sv->rg_msg), "cluster re-forming: %.80s", err);
		return;
	}
	if (rc < 0) {
		detach(sv, err);
		return;
	}
	apply(sv, &d);
}

bool embd_server_regroup_gate(struct embd_server *sv, struct client *c,
			      const struct embd_sqe *sqe, uint64_t popped_ns)
{
	const char *why;
	char msg[EMBD_CQE_MSG_BYTES];

	if (sv->rg_state == RG_FORMING || sv->rg_state == RG_DETACHED) {
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EAGAIN, sv->rg_msg);
		return true;
	}
	if (sv->rg_state != RG_RUNNING) {
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EIO, sv->rg_msg);
		return true;
	}
	if (embd_step_comm_broken(sv->step, &why)) {
		snprintf(msg, sizeof(msg), "cluster re-forming after: %s", why);
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EAGAIN, msg);
		return true;
	}
	bool early = sv->phase == WAIT_BACKWARD && sqe->step == sv->s + 1;
	if (sv->regrouped && sqe->step != sv->s && !early) {
		/* the completion carries the step to post */
		struct embd_sqe at = *sqe;
		at.step = sv->s;
		snprintf(msg, sizeof(msg), "cluster resumed at step %" PRIu64 " (generation %" PRIu64
			 "): post that step", sv->s, embd_regroup_generation(sv->rg));
		embd_server_complete(sv, c, &at, popped_ns, EMBD_ERESUMED, msg);
		return true;
	}
	return false;
}

int embd_server_regroup_status_add(const struct embd_server *sv, char **status)
{
	static const char *const names[] = { "running", "forming", "lost", "detached" };
	cJSON *root = cJSON_Parse(*status), *o;

	if (!root || !(o = cJSON_AddObjectToObject(root, "cluster"))) {
		cJSON_Delete(root);
		return EMBD_ENOMEM;
	}
	cJSON_AddNumberToObject(o, "generation", (double)embd_regroup_generation(sv->rg));
	cJSON_AddStringToObject(o, "state", names[sv->rg_state]);
	cJSON_AddNumberToObject(o, "applied_step", (double)sv->applied);
	cJSON_AddStringToObject(o, "message", sv->rg_state == RG_RUNNING ? "" : sv->rg_msg);
	char *text = cJSON_PrintUnformatted(root);
	cJSON_Delete(root);
	if (!text)
		return EMBD_ENOMEM;
	free(*status);
	*status = text;
	return 0;
}
