/*
 * daemon/server_schedule.c - the step schedule (the contract in daemon/server.h): every
 * request a client posted is checked here and recorded as FORWARD / BACKWARD s of its trainer;
 * the forward of step s runs once every connected trainer is in for it (or sat it out), the
 * backward once every participant is. A request that must wait for a later phase is kept
 * (one per trainer and phase), and the client's ring is not polled until then: it keeps the
 * rest. On a cluster each phase is collective, so it runs even when no trainer of this node
 * takes part, and may hold the thread up to collective_timeout_ms.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "ipc/region.h"
#include "daemon/server_internal.h"

void embd_server_complete(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			  uint64_t popped_ns, int result, const char *msg)
{
	struct embd_cqe cqe;

	embd_cqe_fill(&cqe, sqe, result, msg);
	if (result)
		c->errors++;
	/* the CQ holds as many entries as the SQ: a client can never have more in flight */
	if (embd_ring_push(embd_region_cq(c->region), &cqe)) {
		embd_log_warning("client %u (pid %d): completion ring full or corrupt, dropping it",
				 c->index, (int)c->peer.pid);
		return;
	}
	embd_doorbell_notify(embd_region_cq(c->region), &c->cq_db);
	embd_stats_request(&sv->stats, embd_now_ns() - popped_ns, result);
}

uint64_t embd_server_step(const struct embd_server *sv)
{
	return sv->s;
}

uint64_t embd_server_join_step(const struct embd_server *sv)
{
	/* step s already ran its forward without this trainer: it joins at s + 1 */
	return sv->s + (sv->phase == WAIT_BACKWARD);
}

void embd_server_resume_at(struct embd_server *sv, uint64_t step)
{
	sv->s = step;
	sv->phase = COLLECT;
	sv->dirty = true;
}

/* Step s ends with no update (aborted, or dropped by re-forming): a BACKWARD of it that comes
 * later is answered EMBD_ECANCELED with why. */
static void cancel_step(struct embd_server *sv, const char *why)
{
	sv->canceled_step = sv->s + 1;
	snprintf(sv->canceled_why, sizeof(sv->canceled_why), "%s", why);
}

static void handle_sqe(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
		       uint64_t popped_ns);

/* On to step s + 1: FORWARDs that came early for it are checked now, as if just arrived. */
static void next_step(struct embd_server *sv)
{
	sv->s++;
	sv->phase = COLLECT;
	if (embd_server_checkpoint_boundary(sv)) {
		sv->stop = true;
		return;
	}
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && c->has_fwd) {
			struct embd_sqe sqe = c->fwd;
			c->has_fwd = false;
			c->requests--;  /* counted when it first arrived */
			handle_sqe(sv, c, &sqe, c->fwd_popped_ns);
		}
	}
}

/* A participant left before backward: the step is dropped here and, through the backward's
 * collective, on every node (collectives may hold this thread up to collective_timeout_ms). */
static void abort_step(struct embd_server *sv, const char *why)
{
	char msg[256];

	embd_log_warning("step %" PRIu64 " aborted: %s", sv->s, why);
	int rc = embd_step_abort(sv->step, why);
	if (rc)
		embd_log_error("step %" PRIu64 ": telling the other nodes of the abort failed: %s",
			       sv->s, embd_strerror(rc));
	else
		embd_server_regroup_applied(sv, sv->s + 1);   /* dropped alike: nothing changed */
	snprintf(msg, sizeof(msg), "step aborted: %.200s", why);
	sv->stats.aborted_steps++;
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && c->has_bwd)
			embd_server_complete(sv, c, &c->bwd, c->bwd_popped_ns, EMBD_ECANCELED, msg);
		c->has_bwd = c->participant = false;
	}
	cancel_step(sv, "step aborted: a participant hung up");
	next_step(sv);
}

void embd_server_schedule_leave(struct embd_server *sv, struct client *c, const char *why)
{
	if (c->participant && sv->phase == WAIT_BACKWARD) {
		char what[200];
		snprintf(what, sizeof(what), "trainer %d on node %u %.150s", c->index,
			 sv->config->node_rank, why);
		c->participant = false;
		abort_step(sv, what);
	}
}

void embd_server_drop_step(struct embd_server *sv, const char *why)
{
	char msg[EMBD_CQE_MSG_BYTES];

	snprintf(msg, sizeof(msg), "%s", why);
	if (sv->phase == WAIT_BACKWARD) {
		embd_step_abort(sv->step, why);         /* refused at once: no collective */
		sv->stats.aborted_steps++;
		cancel_step(sv, msg);
	}
	embd_server_checkpoint_step_dropped(sv);
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

bool embd_server_client_ready(const struct embd_server *sv, const struct client *c)
{
	if (!c->used || !c->region)
		return false;
	if (sv->phase == COLLECT)
		return !c->has_fwd;
	return c->participant ? !c->has_bwd : !c->has_fwd;
}

static void handle_backward(struct embd_server *sv, struct client *c,
			    const struct embd_sqe *sqe, uint64_t popped_ns)
{
	if (sqe->step + 1 == sv->canceled_step && !c->participant)
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_ECANCELED, sv->canceled_why);
	else if (sv->phase != WAIT_BACKWARD || !c->participant || sqe->step != sv->s)
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL,
				     "step: this trainer takes no part in that step's backward");
	else {
		c->bwd = *sqe;
		c->bwd_popped_ns = popped_ns;
		c->has_bwd = true;
	}
}

static void handle_forward(struct embd_server *sv, struct client *c,
			   const struct embd_sqe *sqe, uint64_t popped_ns)
{
	char err[EMBD_CQE_MSG_BYTES];
	/* early for the next step: kept, and looked at again once step s is done */
	const bool early = sv->phase == WAIT_BACKWARD && sqe->step == sv->s + 1;

	if (embd_server_regroup_gate(sv, c, sqe, popped_ns, early))
		return;
	if (early) {
		c->fwd = *sqe;
		c->fwd_popped_ns = popped_ns;
		c->has_fwd = true;
		return;
	}
	if (sqe->step != sv->s) {
		snprintf(err, sizeof(err), "step: %" PRIu64 ", the service is at step %" PRIu64,
			 sqe->step, sv->s);
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL, err);
		return;
	}
	int rc = embd_kjt_view_build(sqe, &c->limits, embd_region_slab(c->region), c->lengths,
				     (size_t)c->limits.num_features * c->limits.batch_size + 1,
				     &c->kjt, err, sizeof(err));
	if (rc) {
		c->sat_out = sv->s + 1;
		embd_server_complete(sv, c, sqe, popped_ns, rc, err);
		return;
	}
	c->fwd = *sqe;
	c->fwd_popped_ns = popped_ns;
	c->has_fwd = true;
	c->sat_out = 0;
}

static void handle_sqe(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
		       uint64_t popped_ns)
{
	char err[EMBD_CQE_MSG_BYTES];
	int rc = embd_sqe_validate(sqe, &c->limits, err, sizeof(err));

	c->requests++;
	sv->dirty |= rc || sqe->opcode != EMBD_OP_NOP;  /* a NOP changes no step state */
	if (rc || sqe->opcode == EMBD_OP_NOP) {
		/* a refused descriptor (bad opcode, batch size, span) counts as a refused FORWARD:
		 * the trainer sits the collecting step out instead of stalling the others */
		if (rc && sv->phase == COLLECT && !c->has_fwd)
			c->sat_out = sv->s + 1;
		embd_server_complete(sv, c, sqe, popped_ns, rc, rc ? err : NULL);
		return;
	}
	if (sqe->opcode == EMBD_OP_BACKWARD)
		handle_backward(sv, c, sqe, popped_ns);
	else
		handle_forward(sv, c, sqe, popped_ns);
}

static void run_forward(struct embd_server *sv)
{
	uint32_t n = 0;

	/* in trainer order: the global batch is node 0's trainers in order, then node 1's, ... */
	for (int32_t index = 0; index < (int32_t)sv->config->trainers_per_node; index++)
		for (uint32_t i = 0; i < sv->slots_end; i++) {
			struct client *c = &sv->clients[i];
			if (!c->used || !c->has_fwd || c->index != index)
				continue;
			uint8_t *slab = embd_region_slab(c->region);
			sv->batches[n] = (struct embd_step_batch){
				.kjt = c->kjt, .pooled = (float *)(slab + c->fwd.output.offset) };
			sv->batch_slot[n++] = i;
		}
	sv->step_start_ns = embd_now_ns();
	sv->num_batches = n;
	embd_server_checkpoint_forward_begin(sv);
	int rc = embd_step_forward(sv->step, sv->batches, n);
	embd_server_checkpoint_forward_end(sv, rc);
	for (uint32_t k = 0; k < n; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		int st = rc < 0 ? rc : sv->batches[k].status;
		embd_server_complete(sv, c, &c->fwd, c->fwd_popped_ns, st,
				     st ? sv->batches[k].err : NULL);
		c->has_fwd = false;
		c->participant = st == 0;
	}
	sv->first_step_done = true;
	/* on a cluster the backward is collective: this node takes part in it even when none
	 * of its own trainers does (then advance() runs it at once) */
	if (rc >= 0 && embd_step_cluster_accepted(sv->step)) {
		sv->phase = WAIT_BACKWARD;
		return;
	}
	if (rc >= 0)    /* the cluster ran it, with no update anywhere */
		embd_server_regroup_applied(sv, sv->s + 1);
	if (rc >= 0 && sv->num_batches)
		embd_log_warning("step %" PRIu64 ": every batch was refused", sv->s);
	else if (rc < 0)
		embd_log_error("step %" PRIu64 " forward failed: %s", sv->s,
			       n ? sv->batches[0].err : embd_strerror(rc));
	next_step(sv);
}

static void run_backward(struct embd_server *sv)
{
	for (uint32_t k = 0; k < sv->num_batches; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		if (!sv->batches[k].status)
			sv->batches[k].pooled_grad =
				(const float *)((uint8_t *)embd_region_slab(c->region) + c->bwd.grad.offset);
	}
	int rc = embd_step_backward(sv->step, sv->batches, sv->num_batches);
	for (uint32_t k = 0; k < sv->num_batches; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		if (!c->participant)
			continue;
		embd_server_complete(sv, c, &c->bwd, c->bwd_popped_ns, rc,
				     rc ? sv->batches[k].err : NULL);
		c->has_bwd = c->participant = false;
	}
	if (rc == 0 || rc == EMBD_ECANCELED)   /* or dropped alike (a participant left) */
		embd_server_regroup_applied(sv, sv->s + 1);
	if (rc == EMBD_ECANCELED) {
		sv->stats.aborted_steps++;
		cancel_step(sv, "step aborted: a participant hung up");
		embd_log_warning("step %" PRIu64 " aborted by the cluster", sv->s);
	} else if (rc) {
		embd_log_error("step %" PRIu64 " backward failed: %s", sv->s, embd_strerror(rc));
	}
	struct embd_step_counts counts;
	embd_step_counts(sv->step, &counts);
	embd_stats_step(&sv->stats, &counts, embd_now_ns() - sv->step_start_ns);
	next_step(sv);
}

/* Runs the phase everyone is in for, if any (only when something changed since last time). */
static void advance(struct embd_server *sv)
{
	uint32_t trainers = 0, waiting = 0, posted = 0;

	if (!sv->dirty || sv->stop || !embd_server_regroup_running(sv))
		return;
	sv->dirty = false;

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		const struct client *c = &sv->clients[i];
		if (!c->used || c->index < 0)
			continue;
		trainers++;
		if (sv->phase == COLLECT) {
			posted += c->has_fwd;
			waiting += !c->has_fwd && c->sat_out != sv->s + 1;
		} else if (c->participant) {
			waiting += !c->has_bwd;
		}
	}
	if (sv->phase == COLLECT) {
		if (!sv->first_step_done && trainers < sv->config->trainers_per_node)
			return;
		/* a cluster's step is collective: a node whose trainers all sat it out (or left)
		 * still joins it, and waits in it for the others up to collective_timeout_ms */
		if (!waiting && (posted || sv->cluster))
			run_forward(sv);
	} else if (!waiting) {
		run_backward(sv);
	}
}

uint32_t embd_server_poll_rings(struct embd_server *sv)
{
	uint32_t handled = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		while (embd_server_client_ready(sv, c)) {
			struct embd_sqe sqe;
			int rc = embd_ring_pop(embd_region_sq(c->region), &sqe);
			if (rc == EMBD_EAGAIN)
				break;
			if (rc) {
				embd_server_drop_client(sv, c, "corrupt submission ring");
				break;
			}
			handle_sqe(sv, c, &sqe, embd_now_ns());
			handled++;
			advance(sv);
		}
	}
	advance(sv);
	return handled;
}
