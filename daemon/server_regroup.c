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
 *
 * The state lives in struct embd_server_regroup below, changed only here; on one node (no
 * regroup handle) every function answers as for a node that always runs.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/err.h"
#include "common/log.h"
#include "dist/regroup.h"
#include "daemon/server_internal.h"

#define RUNNING_LOOK_NS 250000000ull    /* running: a look for a newer generation */
#define FORMING_LOOK_MS 50              /* forming: a look for the missing nodes */
#define DETACHED_LOOK_NS 500000000ull   /* detached: a try at node 0's store */
#define FORMING_LOG_NS 30000000000ull   /* forming: what it waits for, logged again this often */

enum regroup_state { RG_RUNNING, RG_FORMING, RG_LOST, RG_DETACHED };

struct embd_server_regroup {
	struct embd_regroup *rg;
	enum regroup_state state;
	uint64_t next_ns;               /* the next look at the store */
	uint64_t applied;               /* the step after the last one the cluster completed:
					   its update applied, or none anywhere (every batch
					   refused, or aborted); a failed one never counts */
	bool lost;                      /* restarted into a running cluster: shards are gone */
	bool regrouped;                 /* re-formed once: a FORWARD of another step learns it */
	char msg[EMBD_CQE_MSG_BYTES];   /* why FORWARDs are refused while not running */
	char waits[512];                /* forming: what the log last said it waits for */
	uint64_t waits_logged_ns;
};

int embd_server_set_regroup(struct embd_server *sv, struct embd_regroup *rg, bool lost,
			    uint64_t resumed_step, char *err, size_t err_len)
{
	struct embd_server_regroup *r = calloc(1, sizeof(*r));

	if (!r)
		return embd_fail(err, err_len, EMBD_ENOMEM, "regroup: out of memory");
	r->rg = rg;
	r->lost = lost;
	r->applied = resumed_step;
	r->state = lost ? RG_FORMING : RG_RUNNING;
	if (lost)
		snprintf(r->msg, sizeof(r->msg), "node %u restarted: rejoining the cluster",
			 sv->config->node_rank);
	sv->rg = r;
	return 0;
}

void embd_server_regroup_free(struct embd_server *sv)
{
	free(sv->rg);
	sv->rg = NULL;
}

bool embd_server_regroup_running(const struct embd_server *sv)
{
	return !sv->rg || (sv->rg->state == RG_RUNNING && !embd_step_comm_broken(sv->step, NULL));
}

bool embd_server_cluster_running(const struct embd_server *sv, char *why, size_t why_len)
{
	const char *broken = NULL;

	why[0] = 0;
	if (embd_server_regroup_running(sv))
		return true;
	if (sv->rg->state == RG_RUNNING && embd_step_comm_broken(sv->step, &broken))
		snprintf(why, why_len, "a collective failed: %s", broken);
	else
		snprintf(why, why_len, "%s", sv->rg->msg);
	return false;
}

void embd_server_regroup_applied(struct embd_server *sv, uint64_t step)
{
	if (sv->rg)
		sv->rg->applied = step;
}

int embd_server_regroup_sleep_ms(const struct embd_server *sv, int idle_ms)
{
	const struct embd_server_regroup *r = sv->rg;

	if (!r)
		return idle_ms;
	if (r->state == RG_FORMING || r->state == RG_DETACHED)
		return FORMING_LOOK_MS;
	/* running: the look for a newer generation is due this often even when idle */
	return r->state == RG_RUNNING && idle_ms > (int)(RUNNING_LOOK_NS / 1000000) ?
	       (int)(RUNNING_LOOK_NS / 1000000) : idle_ms;
}

static void refuse_all(struct embd_server *sv, enum regroup_state state, const char *fmt,
		       const char *what)
{
	struct embd_server_regroup *r = sv->rg;

	r->state = state;
	snprintf(r->msg, sizeof(r->msg), fmt, what);
	embd_step_comm_break(sv->step, r->msg);         /* the step in flight runs no collective */
	embd_server_drop_step(sv, r->msg);
	embd_log_error("node %u: every step is refused: %s", sv->config->node_rank, r->msg);
}

/* The store failed: steps wait (EMBD_EAGAIN) while the node tries node 0's store again. */
static void detach(struct embd_server *sv, const char *err)
{
	embd_log_error("node %u: %s", sv->config->node_rank, err);
	refuse_all(sv, RG_DETACHED, "%s", "node 0 (the store) does not answer: waiting for it");
	sv->rg->next_ns = embd_now_ns() + DETACHED_LOOK_NS;
}

static void start(struct embd_server *sv, const char *why)
{
	struct embd_server_regroup *r = sv->rg;
	char err[512];

	embd_step_comm_break(sv->step, why);
	snprintf(r->msg, sizeof(r->msg), "cluster re-forming after: %s", why);
	embd_server_drop_step(sv, r->msg);
	if (embd_regroup_start(r->rg, err, sizeof(err))) {
		detach(sv, err);
		return;
	}
	r->state = RG_FORMING;
	r->next_ns = 0;
	r->waits[0] = 0;
	embd_log_warning("node %u: re-forming the cluster (generation %" PRIu64 ") after: %s",
			 sv->config->node_rank, embd_regroup_generation(r->rg), why);
}

/* The RESTORE decision: every node restores the chosen checkpoint, and hears whether every
 * other one did. 0: restored everywhere (*step); EMBD_EIO: the state is lost, every step is
 * refused; another error: this generation failed (the next one is formed, or the node is
 * detached). */
static int restore(struct embd_server *sv, const struct embd_regroup_decision *d,
		   uint64_t *step)
{
	struct embd_server_regroup *r = sv->rg;
	char err[512], key[96], outcome[512];

	snprintf(key, sizeof(key), "%srestore", embd_regroup_prefix(r->rg));
	const uint64_t t0 = embd_now_ns();
	int rc = embd_server_checkpoint_restore(sv, key, step, err, sizeof(err));
	const int restore_ms = (int)((embd_now_ns() - t0) / 1000000);
	if (rc) {
		embd_log_error("restore after %s: %s", d->why, err);
	} else {
		/* this node's parameters are at step now, whatever comes next: a later
		 * generation weighs them so, and does not restore them again */
		r->applied = *step;
		r->lost = false;
	}
	/* every node hears whether every other one restored, and all take one decision:
	 * a transient failure anywhere tries the next generation, a data failure is lost */
	rc = embd_regroup_restored(r->rg, rc, err, restore_ms, outcome, sizeof(outcome));
	if (rc == EMBD_EIO) {
		embd_log_error("node %u: %s", sv->config->node_rank, outcome);
		refuse_all(sv, RG_LOST, "cluster state lost, %.80s", outcome);
		return rc;
	}
	if (rc) {
		embd_log_warning("node %u: %s", sv->config->node_rank, outcome);
		if (rc != EMBD_EAGAIN)
			detach(sv, outcome);
		else
			snprintf(r->msg, sizeof(r->msg), "cluster re-forming: %.80s", outcome);
	}
	return rc;
}

/* Carries out the decision every node took; false when the generation failed meanwhile. */
static bool apply(struct embd_server *sv, const struct embd_regroup_decision *d)
{
	struct embd_server_regroup *r = sv->rg;
	const uint64_t gen = embd_regroup_generation(r->rg);
	char err[512];
	uint64_t step = d->step;
	int rc;

	/* the checkpoints' own store handle may have failed while the cluster re-formed */
	embd_server_checkpoint_regrouped(sv, gen);
	if (d->verdict == EMBD_REGROUP_LOST) {
		refuse_all(sv, RG_LOST, "cluster state lost (%.50s): restore from a checkpoint",
			   d->why);
		return true;
	}
	if (d->verdict == EMBD_REGROUP_RESTORE && (rc = restore(sv, d, &step)))
		return rc == EMBD_EIO;  /* refused for good, or to be tried again */
	/* nobody steps before everybody restored (the outcomes above: a barrier that waited as
	 * long as a restore; this one only sees the others leave it) */
	if ((rc = embd_regroup_finish(r->rg, err, sizeof(err)))) {
		if (rc != EMBD_EAGAIN)
			detach(sv, err);
		return false;
	}
	rc = embd_step_comm_set(sv->step, embd_regroup_comm(r->rg), gen);
	if (rc) {
		refuse_all(sv, RG_LOST, "%s", "cluster comm refused by the step engine");
		return true;
	}
	embd_server_resume_at(sv, step);
	r->applied = step;
	r->regrouped = true;
	r->state = RG_RUNNING;
	embd_log_warning("node %u: cluster re-formed (generation %" PRIu64 "): %s at step %" PRIu64
			"%s%s", sv->config->node_rank, gen,
			d->verdict == EMBD_REGROUP_RESTORE ? "restored the checkpoint" : "resuming",
			step, d->why[0] ? " after " : "", d->why);
	return true;
}

/* Running: a failed collective, or another node that opened a newer generation, starts one. */
static void tick_running(struct embd_server *sv, uint64_t now)
{
	struct embd_server_regroup *r = sv->rg;
	const char *why;
	char err[512];

	if (embd_step_comm_broken(sv->step, &why)) {
		char copy[256];
		snprintf(copy, sizeof(copy), "%s", why);
		start(sv, copy);
		return;
	}
	if (now < r->next_ns)
		return;
	r->next_ns = now + RUNNING_LOOK_NS;
	uint32_t by;
	int rc = embd_regroup_newer(r->rg, &by, err, sizeof(err));
	if (rc < 0) {
		detach(sv, err);
	} else if (rc && by == UINT32_MAX) {
		start(sv, "another node re-forms the cluster");
	} else if (rc) {
		char why[64];
		snprintf(why, sizeof(why), "node %u re-forms the cluster", by);
		start(sv, why);
	}
}

void embd_server_regroup_tick(struct embd_server *sv)
{
	struct embd_server_regroup *r = sv->rg;
	struct embd_regroup_decision d;
	char err[512];
	int rc;

	if (!r)
		return;
	const uint64_t now = embd_now_ns();
	if (r->state == RG_RUNNING) {
		tick_running(sv, now);
		return;
	}
	if (r->state == RG_DETACHED && now >= r->next_ns) {
		/* node 0 stalled comes back with the same store; a restarted one is not resumed */
		r->next_ns = now + DETACHED_LOOK_NS;
		rc = embd_regroup_reattach(r->rg, err, sizeof(err));
		if (rc == 1)
			start(sv, "node 0's store answers again");
		else if (strstr(err, "restarted"))
			refuse_all(sv, RG_LOST, "%.40s: restart every embd node", err);
		return;
	}
	if (r->state != RG_FORMING || now < r->next_ns)
		return;
	r->next_ns = now + FORMING_LOOK_MS * 1000000ull;
	struct embd_regroup_state mine = { .applied = r->applied, .lost = r->lost };
	rc = embd_regroup_poll(r->rg, &mine, sv->ckpt != NULL, &d, err, sizeof(err));
	if (rc == 0 || rc == EMBD_EAGAIN) {
		if (err[0])
			snprintf(r->msg, sizeof(r->msg), "cluster re-forming: %.80s", err);
		/* a wait that may last: the log says what for when it changes, and again now
		 * and then while it does not (a failed generation logged itself) */
		if (rc == 0 && err[0] &&
		    (strcmp(r->waits, err) || now - r->waits_logged_ns >= FORMING_LOG_NS)) {
			snprintf(r->waits, sizeof(r->waits), "%s", err);
			r->waits_logged_ns = now;
			embd_log_warning("node %u: cluster re-forming: %s", sv->config->node_rank,
					 r->waits);
		}
		return;
	}
	if (rc < 0) {
		detach(sv, err);
		return;
	}
	apply(sv, &d);
}

bool embd_server_regroup_gate(struct embd_server *sv, struct client *c,
			      const struct embd_sqe *sqe, uint64_t popped_ns, bool early)
{
	const struct embd_server_regroup *r = sv->rg;
	const uint64_t s = embd_server_step(sv);
	const char *why;
	char msg[EMBD_CQE_MSG_BYTES];

	if (!r)
		return false;
	if (r->state == RG_FORMING || r->state == RG_DETACHED) {
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EAGAIN, r->msg);
		return true;
	}
	if (r->state != RG_RUNNING) {
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EIO, r->msg);
		return true;
	}
	if (embd_step_comm_broken(sv->step, &why)) {
		snprintf(msg, sizeof(msg), "cluster re-forming after: %s", why);
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EAGAIN, msg);
		return true;
	}
	if (r->regrouped && sqe->step != s && !early) {
		/* the completion carries the step to post */
		struct embd_sqe at = *sqe;
		at.step = s;
		snprintf(msg, sizeof(msg), "cluster resumed at step %" PRIu64 " (generation %" PRIu64
			 "): post that step", s, embd_regroup_generation(r->rg));
		embd_server_complete(sv, c, &at, popped_ns, EMBD_ERESUMED, msg);
		return true;
	}
	return false;
}

void embd_server_regroup_metrics(const struct embd_server *sv, struct embd_metrics_snapshot *s)
{
	const struct embd_server_regroup *r = sv->rg;

	s->cluster = r != NULL;
	if (!r)
		return;
	s->generation = embd_regroup_generation(r->rg);
	s->applied_step = r->applied;
	s->node = sv->config->node_rank;
	s->state = (uint32_t)r->state;
}

int embd_server_regroup_status_add(const struct embd_server *sv, char **status)
{
	static const char *const names[] = { "running", "forming", "lost", "detached" };
	const struct embd_server_regroup *r = sv->rg;
	cJSON *root, *o;

	if (!r)
		return 0;
	root = cJSON_Parse(*status);
	if (!root || !(o = cJSON_AddObjectToObject(root, "cluster"))) {
		cJSON_Delete(root);
		return EMBD_ENOMEM;
	}
	cJSON_AddNumberToObject(o, "generation", (double)embd_regroup_generation(r->rg));
	cJSON_AddStringToObject(o, "state", names[r->state]);
	cJSON_AddNumberToObject(o, "applied_step", (double)r->applied);
	cJSON_AddStringToObject(o, "message", r->state == RG_RUNNING ? "" : r->msg);
	return embd_server_status_replace(status, root);
}
