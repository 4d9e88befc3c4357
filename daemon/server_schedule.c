/*
 * daemon/server_schedule.c - the step schedule (the contract in daemon/server.h): every
 * request a client posted is checked here and recorded as FORWARD / BACKWARD s of its trainer;
 * the forward of step s runs once every connected trainer is in for it (or sat it out), the
 * backward once every participant is. A request that must wait for a later phase is kept
 * (one per trainer and phase), and the client's ring is not polled until then: it keeps the
 * rest. On a cluster each phase is collective, so it runs even when no trainer of this node
 * takes part, and may hold the thread up to collective_timeout_ms. A phase that waits for
 * trainers is timed from the first request it kept (or, for the backward, from the forward's
 * end): past step_wait_warn_ms it names them, past step_wait_abort_ms it gives up.
 * Pipelined steps: a trainer may post FORWARD s + 1 before or right after BACKWARD s; once
 * every trainer of the node did, that forward is routed while step s still waits (or just
 * before its backward runs), on a cluster its ids are exchanged while step s's update is
 * applied (overlap_next), and it is looked up right after the backward (engine/step.h,
 * embd_step_prepare, embd_step_backward_overlapped: bit-identical to an unpipelined step).
 * Evaluations (EVAL) are no part of the steps: on one node each runs as soon as it is popped;
 * on a cluster the node runs an evaluation round, between steps, once every trainer posted
 * one (or sat it out), and a node with no trainer follows the others' rounds.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
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
	/* room was made sure of before the request was taken (embd_server_client_ready): only
	 * a head the client moved where it cannot be fails here */
	if (embd_ring_push(embd_region_cq(c->region), &cqe)) {
		if (!c->cq_broken)
			embd_log_warning("trainer %d (pid %d): completion ring corrupt; dropping the "
					 "client", c->index, (int)c->peer.pid);
		c->cq_broken = true;
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

/* The phase starts waiting for trainers now (now_ns 0: nobody waits any more). */
static void wait_from(struct embd_server *sv, uint64_t now_ns)
{
	sv->wait_since_ns = now_ns;
	sv->wait_warned = false;
}

void embd_server_resume_at(struct embd_server *sv, uint64_t step)
{
	sv->prepared = false;
	sv->unpreparable = 0;
	sv->s = step;
	sv->phase = COLLECT;
	sv->dirty = true;
	wait_from(sv, 0);
}

/* Step s ends with no update (aborted, or dropped by re-forming): a BACKWARD of it that comes
 * later is answered code (EMBD_ECANCELED, or EMBD_ETIMEDOUT) with why. */
static void cancel_step(struct embd_server *sv, int code, const char *why)
{
	sv->canceled_step = sv->s + 1;
	sv->canceled_code = code;
	snprintf(sv->canceled_why, sizeof(sv->canceled_why), "%.*s",
		 (int)sizeof(sv->canceled_why) - 1, why);
}

static void handle_sqe(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
		       uint64_t popped_ns);

/* Whether client slot i's early FORWARD is in the prepared step. */
static bool in_prepared(const struct embd_server *sv, uint32_t i)
{
	for (uint32_t k = 0; sv->prepared && k < sv->num_next; k++)
		if (sv->next_slot[k] == i)
			return true;
	return false;
}

/* On to step s + 1: FORWARDs that came early for it are checked now, as if just arrived
 * (those of a prepared step were: their batches become the step's). */
static void next_step(struct embd_server *sv)
{
	sv->s++;
	sv->phase = COLLECT;
	wait_from(sv, 0);
	if (embd_server_checkpoint_boundary(sv)) {
		sv->stop = true;
		return;
	}
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && c->has_fwd && in_prepared(sv, i)) {
			int32_t *lengths = c->lengths;
			c->lengths = c->next_lengths;
			c->next_lengths = lengths;
			c->kjt = c->next_kjt;   /* its lengths are now c->lengths */
			c->sat_out = 0;
			sv->dirty = true;
			if (!sv->wait_since_ns)
				wait_from(sv, embd_now_ns());
		} else if (c->used && c->has_fwd) {
			struct embd_sqe sqe = c->fwd;
			c->has_fwd = false;
			c->requests--;  /* counted when it first arrived */
			handle_sqe(sv, c, &sqe, c->fwd_popped_ns);
		}
	}
}

/* A participant left, or stalled, before backward: the step is dropped here and, through the
 * backward's collective, on every node (collectives may hold this thread up to
 * collective_timeout_ms). The BACKWARDs kept are answered code (EMBD_ECANCELED: it left,
 * EMBD_ETIMEDOUT: it stalled). */
static void abort_step(struct embd_server *sv, int code, const char *why)
{
	char msg[256];

	embd_log_warning("step %" PRIu64 " aborted: %s", sv->s, why);
	sv->prepared = false;           /* the engine's abort drops it too */
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
			embd_server_complete(sv, c, &c->bwd, c->bwd_popped_ns, code, msg);
		c->has_bwd = c->participant = false;
	}
	cancel_step(sv, code, msg);
	next_step(sv);
}

void embd_server_schedule_leave(struct embd_server *sv, struct client *c, const char *why)
{
	if (in_prepared(sv, (uint32_t)(c - sv->clients)))
		sv->prepared = false;   /* its slot may be taken before the forward runs */
	if (c->participant && sv->phase == WAIT_BACKWARD) {
		char what[200];
		snprintf(what, sizeof(what), "trainer %d on node %u %.150s", c->index,
			 sv->config->node_rank, why);
		c->participant = false;
		abort_step(sv, EMBD_ECANCELED, what);
	}
}

void embd_server_drop_step(struct embd_server *sv, const char *why)
{
	char msg[EMBD_CQE_MSG_BYTES];

	snprintf(msg, sizeof(msg), "%s", why);
	sv->prepared = false;
	if (sv->phase == WAIT_BACKWARD) {
		embd_step_abort(sv->step, why);         /* refused at once: no collective */
		sv->stats.aborted_steps++;
		cancel_step(sv, EMBD_ECANCELED, msg);
	}
	wait_from(sv, 0);
	embd_server_checkpoint_step_dropped(sv);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (!c->used)
			continue;
		if (c->has_bwd)
			embd_server_complete(sv, c, &c->bwd, c->bwd_popped_ns, EMBD_ECANCELED, msg);
		if (c->has_fwd)
			embd_server_complete(sv, c, &c->fwd, c->fwd_popped_ns, EMBD_EAGAIN, msg);
		if (c->has_eval)
			embd_server_complete(sv, c, &c->eval, c->eval_popped_ns, EMBD_EAGAIN, msg);
		c->has_bwd = c->has_fwd = c->has_eval = c->eval_sat_out = c->participant = false;
		c->sat_out = 0;
	}
	sv->phase = COLLECT;
}

bool embd_server_client_ready(const struct embd_server *sv, struct client *c, bool *held)
{
	if (!c->used || !c->region || c->cq_broken)
		return false;
	/* a participant may post FORWARD s + 1 after BACKWARD s (pipelined steps) */
	bool takes = sv->phase == COLLECT || !c->participant ? !c->has_fwd && !c->has_eval :
							      !c->has_bwd || !c->has_fwd;
	if (!takes)
		return false;
	/* every request gets one completion: now, or later for one kept (has_fwd, has_bwd,
	 * has_eval) */
	int room = embd_ring_room(embd_region_cq(c->region),
				  1u + c->has_fwd + c->has_bwd + c->has_eval);
	if (room < 0)
		c->cq_broken = true;
	if (held)
		*held = room == 0;
	return room == 1;
}

/* The gradient must have the rows of the forward's output: the engine routes it by them. */
static void backward_batch_size_refused(struct embd_server *sv, struct client *c,
					const struct embd_sqe *sqe, uint64_t popped_ns)
{
	char err[EMBD_CQE_MSG_BYTES];

	snprintf(err, sizeof(err), "batch_size: %" PRIu32 " samples, step %" PRIu64 "'s forward had "
		 "%" PRIu32, sqe->batch_size, sqe->step, c->kjt.batch_size);
	embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL, err);
}

static void handle_backward(struct embd_server *sv, struct client *c,
			    const struct embd_sqe *sqe, uint64_t popped_ns)
{
	/* The BACKWARD of the step canceled last: its trainer may already be in the step after
	 * it (its FORWARD came early, pipelined, and ran once the step was aborted), or be in a
	 * redone step of that number (dropped by re-forming) whose BACKWARD this is. */
	if (sqe->step + 1 == sv->canceled_step && (!c->participant || sqe->step != sv->s))
		embd_server_complete(sv, c, sqe, popped_ns, sv->canceled_code, sv->canceled_why);
	else if (sv->phase != WAIT_BACKWARD || !c->participant || sqe->step != sv->s)
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL,
				     "step: this trainer takes no part in that step's backward");
	else if (c->has_bwd)
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL,
				     "step: this trainer's BACKWARD of that step is pending already");
	else if (sqe->batch_size != c->kjt.batch_size)
		backward_batch_size_refused(sv, c, sqe, popped_ns);
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
	/* one FORWARD per trainer and step: a second one, or one of a step whose forward ran,
	 * would otherwise wait for a BACKWARD its blocked trainer never sends */
	if (c->has_fwd) {
		snprintf(err, sizeof(err), "step %" PRIu64 ": this trainer's FORWARD of step %" PRIu64
			 " is pending already", sqe->step, c->fwd.step);
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL, err);
		return;
	}
	if (early) {
		c->fwd = *sqe;
		c->fwd_popped_ns = popped_ns;
		c->has_fwd = true;
		return;
	}
	if (sqe->step != sv->s || sv->phase == WAIT_BACKWARD) {
		if (sqe->step != sv->s)
			snprintf(err, sizeof(err), "step: %" PRIu64 ", the service is at step %" PRIu64,
				 sqe->step, sv->s);
		else
			snprintf(err, sizeof(err), "step %" PRIu64 ": its forward ran %s; post %s",
				 sv->s, c->participant ? "already" : "without this trainer",
				 c->participant ? "its BACKWARD (EVAL looks up without training)" :
						  "FORWARD of the next step");
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
	if (!sv->wait_since_ns)
		wait_from(sv, embd_now_ns());
}

/* c's EVAL completes with st (err: the batch's message); a lookup that succeeded first goes to
 * its device buffers (EMBD_SQE_DEVICE), and one that cannot completes with EMBD_EIO. */
static void complete_eval(struct embd_server *sv, struct client *c, int st, const char *err)
{
	char why[EMBD_CQE_MSG_BYTES];

	if (!st && embd_server_output_done(sv, c, &c->eval, why, sizeof(why))) {
		st = EMBD_EIO;
		err = why;
	}
	embd_server_complete(sv, c, &c->eval, c->eval_popped_ns, st, st ? err : NULL);
}

/* One node: the evaluation of c's batch, now and alone. */
static void run_eval_now(struct embd_server *sv, struct client *c)
{
	struct embd_step_batch b = { .kjt = c->eval_kjt,
				     .pooled = embd_server_output(sv, c, &c->eval) };
	int rc = embd_step_eval(sv->step, &b, 1);

	complete_eval(sv, c, rc < 0 ? rc : b.status, b.err);
}

static void handle_eval(struct embd_server *sv, struct client *c, const struct embd_sqe *sqe,
			uint64_t popped_ns)
{
	char err[EMBD_CQE_MSG_BYTES];

	if (sv->cluster && sv->phase == WAIT_BACKWARD && c->participant) {
		snprintf(err, sizeof(err), "EVAL: the BACKWARD of step %" PRIu64 " is due first (on a "
			 "cluster evaluations run between steps)", sv->s);
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EINVAL, err);
		return;
	}
	if (!embd_server_regroup_running(sv)) {
		embd_server_complete(sv, c, sqe, popped_ns, EMBD_EAGAIN,
				     "EVAL: the cluster is re-forming; evaluate again later");
		return;
	}
	int rc = embd_kjt_view_build(sqe, &c->limits, embd_region_slab(c->region), c->eval_lengths,
				     (size_t)c->limits.num_features * c->limits.batch_size + 1,
				     &c->eval_kjt, err, sizeof(err));
	c->eval = *sqe;
	c->eval_popped_ns = popped_ns;
	if (rc) {
		c->eval_sat_out = sv->cluster;  /* its node's round goes on without it */
		embd_server_complete(sv, c, sqe, popped_ns, rc, err);
		return;
	}
	if (!sv->cluster) {
		run_eval_now(sv, c);
		return;
	}
	c->has_eval = true;
	c->eval_sat_out = false;
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
	else if (sqe->opcode == EMBD_OP_EVAL)
		handle_eval(sv, c, sqe, popped_ns);
	else
		handle_forward(sv, c, sqe, popped_ns);
}

/* The slots of the clients holding a FORWARD, in trainer order (the global batch is node 0's
 * trainers in order, then node 1's, ...). Returns how many. */
static uint32_t forward_slots(const struct embd_server *sv, uint32_t *slots)
{
	uint32_t n = 0;

	for (int32_t index = 0; index < (int32_t)sv->config->trainers_per_node; index++)
		for (uint32_t i = 0; i < sv->slots_end; i++) {
			const struct client *c = &sv->clients[i];
			if (c->used && c->has_fwd && c->index == index)
				slots[n++] = i;
		}
	return n;
}

/* The forward of step s over the FORWARDs kept; follow: no trainer is connected, so the node
 * joins whichever round the other nodes run (an evaluation changes nothing here). */
static void run_forward(struct embd_server *sv, bool follow)
{
	uint32_t n = 0;
	bool evaluated = false;
	int rc;

	n = forward_slots(sv, sv->batch_slot);
	for (uint32_t k = 0; k < n; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		sv->batches[k] = (struct embd_step_batch){
			.kjt = c->kjt, .pooled = embd_server_output(sv, c, &c->fwd),
			.trainer = (uint32_t)c->index };
	}
	sv->step_start_ns = embd_now_ns();
	if (sv->prepared && embd_step_prepared(sv->step) && n == sv->num_next &&
	    !memcmp(sv->batch_slot, sv->next_slot, n * sizeof(sv->batch_slot[0]))) {
		/* the same trainers as prepared: the engine goes on from their routed batches */
		struct embd_step_batch *b = sv->batches;
		sv->batches = sv->next_batches;
		sv->next_batches = b;
		sv->stats.pipelined_steps++;
	}
	sv->prepared = false;
	sv->num_batches = n;
	if (embd_step_exchanged(sv->step)) {
		/* its HELLO (with the checkpoint flag) went out in the backward before */
		sv->step_start_ns = sv->next_start_ns;
		sv->stats.overlapped_steps++;
	} else {
		embd_server_checkpoint_forward_begin(sv, sv->s);
	}
	if (follow)
		rc = embd_step_follow(sv->step, &evaluated);
	else
		rc = embd_step_forward(sv->step, sv->batches, n);
	embd_server_checkpoint_forward_end(sv, rc);
	if (evaluated) {
		if (rc < 0)
			embd_log_error("an evaluation round of the cluster failed: %s",
				       embd_strerror(rc));
		return;
	}
	char lost[256] = "";    /* why an output could not reach its trainer's GPU */
	for (uint32_t k = 0; k < n; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		int st = rc < 0 ? rc : sv->batches[k].status;
		const char *msg = sv->batches[k].err;
		char why[EMBD_CQE_MSG_BYTES];
		if (!st && embd_server_output_done(sv, c, &c->fwd, why, sizeof(why))) {
			st = EMBD_EIO;
			msg = why;
			snprintf(lost, sizeof(lost), "trainer %d's pooled output did not reach its "
				 "GPU: %s", c->index, why);
		}
		embd_server_complete(sv, c, &c->fwd, c->fwd_popped_ns, st, st ? msg : NULL);
		c->has_fwd = false;
		c->participant = st == 0;
	}
	sv->forward_done_ns = embd_now_ns();
	sv->first_step_done = true;
	/* on a cluster the backward is collective: this node takes part in it even when none
	 * of its own trainers does (then advance() runs it at once) */
	if (rc >= 0 && embd_step_cluster_accepted(sv->step)) {
		sv->phase = WAIT_BACKWARD;
		wait_from(sv, embd_now_ns());
		/* that trainer is out of the step, as one that left: nobody's update runs */
		if (lost[0])
			abort_step(sv, EMBD_ECANCELED, lost);
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

/* A cluster's evaluation round over the EVALs kept (trainers that sat it out have none). */
static void run_eval_round(struct embd_server *sv)
{
	const uint32_t T = sv->config->trainers_per_node;
	struct embd_step_batch batches[T];
	uint32_t slot[T], n = 0;

	for (int32_t index = 0; index < (int32_t)T; index++)
		for (uint32_t i = 0; i < sv->slots_end; i++) {
			struct client *c = &sv->clients[i];
			if (!c->used || c->index != index)
				continue;
			c->eval_sat_out = false;
			if (!c->has_eval)
				continue;
			batches[n] = (struct embd_step_batch){
				.kjt = c->eval_kjt, .pooled = embd_server_output(sv, c, &c->eval) };
			slot[n++] = i;
		}
	int rc = embd_step_eval(sv->step, batches, n);
	for (uint32_t k = 0; k < n; k++) {
		struct client *c = &sv->clients[slot[k]];
		complete_eval(sv, c, rc < 0 ? rc : batches[k].status, batches[k].err);
		c->has_eval = false;
	}
	if (rc < 0)
		embd_log_error("an evaluation round of the cluster failed: %s",
			       n ? batches[0].err : embd_strerror(rc));
}

/* A trainer of the node posted a FORWARD (or sits step s out) while others posted EVALs: the
 * node cannot run both, so the EVALs are refused, naming that trainer. */
static void refuse_mixed_evals(struct embd_server *sv, const struct client *trainer)
{
	char err[EMBD_CQE_MSG_BYTES];

	snprintf(err, sizeof(err), "EVAL: trainer %d is in step %" PRIu64 " (on a cluster every "
		 "trainer evaluates at the same point)", trainer->index, sv->s);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && c->has_eval)
			embd_server_complete(sv, c, &c->eval, c->eval_popped_ns, EMBD_EINVAL, err);
		c->has_eval = c->eval_sat_out = false;
	}
}

/* Rows an update left NaN or infinite (engine/step.h): counted in stats and said, at most every
 * 10 s (a row that stays NaN counts at every update of it). */
static void warn_nonfinite_rows(struct embd_server *sv, const struct embd_step_counts *c)
{
	static uint64_t last_ns;
	uint64_t now = embd_now_ns();

	if (!c->nonfinite_rows || (last_ns && now - last_ns < 10000000000ull))
		return;
	last_ns = now;
	embd_log_warning("step %" PRIu64 ": the update left %" PRIu64 " row(s) NaN or infinite "
			 "(first: table '%s' row %lld; %" PRIu64 " so far, stats nonfinite_rows): their "
			 "gradients are too large for the optimizer; clip them in the trainer", sv->s,
			 c->nonfinite_rows, sv->config->tables.specs[c->nonfinite_table].name,
			 (long long)c->nonfinite_row, sv->stats.nonfinite_rows);
}

/*
 * The gradients out of the trainers' slabs (or device outputs) into sv->grads, where the engine
 * checks that they are finite and then reads them (engine/step.h). A trainer writes its slab
 * whenever it likes: read in place, a gradient checked finite could turn NaN before the
 * kernels and the gradient exchange read it again, and a NaN would reach shared rows on some
 * ranks or nodes after others applied theirs. The copy the engine checks is the one it uses,
 * and a gradient the trainer changes during the copy is at worst refused. Checking in the
 * kernels instead could only stop in the middle of an update. The cost: one copy of
 * batch_size x total_dim floats per trainer and step, which the engine makes as it checks
 * (engine/step.h, grad_from), split over the ranks' threads. A trainer with device outputs
 * (server_device.c) hands its gradient in on its GPU: one copy, device to host, here; the
 * engine then checks it in place.
 */
static int copy_grads(struct embd_server *sv, char *why, size_t why_len)
{
	float *to = sv->grads;

	for (uint32_t k = 0; k < sv->num_batches; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		struct embd_step_batch *b = &sv->batches[k];
		char err[EMBD_CQE_MSG_BYTES];
		if (b->status)
			continue;
		/* grad.bytes are the forward's batch_size x total_dim floats: BACKWARD's batch_size
		 * was checked against the forward's (handle_backward), the span against it
		 * (embd_sqe_validate); from the slab, or from the trainer's GPU */
		if (embd_server_grad_in(sv, c, &c->bwd, to, b, err, sizeof(err)))
			return snprintf(why, why_len, "trainer %d's gradient did not come from its "
					"GPU: %s", c->index, err), EMBD_EIO;
		to += c->bwd.grad.bytes / sizeof(float);
	}
	return 0;
}

/*
 * Whether step s's backward may run step s + 1's input exchange while the ranks apply
 * (engine/step.h, embd_step_backward_overlapped). Every trainer of the node is in the prepared
 * step, so its forward runs right after the backward: no loop pass comes between the exchange
 * and the rest of the step, in which a trainer could join, leave or evaluate. And the boundary
 * between the two takes no checkpoint: the next step's HELLO asks for the checkpoint wanted
 * after it, which a checkpoint at this boundary could have satisfied, and SIGTERM's final
 * checkpoint stops the server there, before the next step.
 */
static bool overlap_next(const struct embd_server *sv)
{
	if (!sv->cluster || !sv->prepared || !embd_step_prepared(sv->step) ||
	    !embd_server_checkpoint_quiet_boundary(sv))
		return false;
	for (uint32_t i = 0; i < sv->slots_end; i++)
		if (sv->clients[i].used && sv->clients[i].index >= 0 && !in_prepared(sv, i))
			return false;
	return true;
}

/* The backward's completions, as soon as the update is applied (engine/step.h: with the next
 * step's input exchange overlapped, that may still run: no engine call here). */
static void backward_applied(void *arg, int rc)
{
	struct embd_server *sv = arg;

	sv->applied_ns = embd_now_ns();
	for (uint32_t k = 0; k < sv->num_batches; k++) {
		struct client *c = &sv->clients[sv->batch_slot[k]];
		if (!c->participant)
			continue;
		embd_server_complete(sv, c, &c->bwd, c->bwd_popped_ns, rc,
				     rc ? sv->batches[k].err : NULL);
		c->has_bwd = c->participant = false;
	}
}

/* end - start, or 0 when end comes first. */
static uint64_t since(uint64_t start, uint64_t end)
{
	return end > start ? end - start : 0;
}

static void run_backward(struct embd_server *sv)
{
	char why[256];
	int rc;

	if (copy_grads(sv, why, sizeof(why))) {
		/* no update without every gradient: the step is dropped as for a trainer that left */
		abort_step(sv, EMBD_ECANCELED, why);
		return;
	}
	if (overlap_next(sv)) {
		embd_server_checkpoint_forward_begin(sv, sv->s + 1);
		sv->next_start_ns = embd_now_ns();
		rc = embd_step_backward_overlapped(sv->step, sv->batches, sv->num_batches,
						   backward_applied, sv);
	} else {
		rc = embd_step_backward(sv->step, sv->batches, sv->num_batches);
		backward_applied(sv, rc);
	}
	if (rc == 0 || rc == EMBD_ECANCELED)   /* or dropped alike (a participant left) */
		embd_server_regroup_applied(sv, sv->s + 1);
	if (rc == EMBD_ECANCELED) {
		/* a participant hung up on another node, or a gradient was not finite (step.h) */
		const char *why = "step aborted by the cluster";
		for (uint32_t k = sv->num_batches; k-- > 0;)
			if (sv->batches[k].status == EMBD_ECANCELED)
				why = sv->batches[k].err;
		sv->stats.aborted_steps++;
		cancel_step(sv, EMBD_ECANCELED, why);
		embd_log_warning("step %" PRIu64 ": %s", sv->s, why);
	} else if (rc) {
		embd_log_error("step %" PRIu64 " backward failed: %s", sv->s, embd_strerror(rc));
	}
	struct embd_step_counts counts;
	embd_step_counts(sv->step, &counts);
	const struct embd_stats_phases phases = {
		.forward_ns = since(sv->step_start_ns, sv->forward_done_ns),
		.trainers_ns = since(sv->forward_done_ns, sv->backward_start_ns),
		.backward_ns = since(sv->backward_start_ns, sv->applied_ns),
	};
	embd_stats_step(&sv->stats, &counts, sv->applied_ns - sv->step_start_ns, &phases);
	warn_nonfinite_rows(sv, &counts);
	next_step(sv);
	/* the other nodes are in step s + 1's lookup already */
	if (embd_step_exchanged(sv->step))
		run_forward(sv, false);
}

/* ---- pipelined steps ---------------------------------------------------------------------- */

/* Routes step s + 1 now when every trainer of the node posted its FORWARD early (engine/step.h,
 * embd_step_prepare). A batch whose lengths fail their checks leaves the step unprepared: the
 * FORWARDs are then checked at next_step as ever and that one refused there. */
static void prepare_next(struct embd_server *sv)
{
	char err[EMBD_CQE_MSG_BYTES];
	uint32_t n = 0;

	if (sv->prepared || sv->phase != WAIT_BACKWARD || sv->unpreparable == sv->s + 1 ||
	    !embd_server_regroup_running(sv))
		return;
	for (uint32_t i = 0; i < sv->slots_end; i++)
		if (sv->clients[i].used && sv->clients[i].index >= 0 && !sv->clients[i].has_fwd)
			return;
	n = forward_slots(sv, sv->next_slot);
	for (uint32_t k = 0; k < n; k++) {
		struct client *c = &sv->clients[sv->next_slot[k]];
		if (embd_kjt_view_build(&c->fwd, &c->limits, embd_region_slab(c->region),
					c->next_lengths,
					(size_t)c->limits.num_features * c->limits.batch_size + 1,
					&c->next_kjt, err, sizeof(err))) {
			sv->unpreparable = sv->s + 1;   /* a posted FORWARD does not change */
			return;
		}
		sv->next_batches[k] = (struct embd_step_batch){
			.kjt = c->next_kjt, .pooled = embd_server_output(sv, c, &c->fwd),
			.trainer = (uint32_t)c->index };
	}
	sv->num_next = n;
	sv->prepared = n && embd_step_prepare(sv->step, sv->next_batches, n) >= 0;
	if (!sv->prepared)
		sv->unpreparable = sv->s + 1;
}

/* Before the backward runs: a FORWARD s + 1 posted right after BACKWARD s may still be in a
 * participant's ring; taken now, the next step can be prepared before the backward. */
static void take_early_forwards(struct embd_server *sv)
{
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		struct embd_sqe sqe;
		if (!c->used || c->has_fwd || !embd_server_client_ready(sv, c, NULL) ||
		    embd_ring_pop(embd_region_sq(c->region), &sqe))
			continue;       /* a corrupt ring is dropped by the next poll */
		handle_sqe(sv, c, &sqe, embd_now_ns());
	}
}

/* ---- trainers the step waits for ---------------------------------------------------------- */

/* Whether the phase waits for client c: a trainer that neither posted the FORWARD of the step
 * being collected nor sat it out, or a participant whose BACKWARD is missing. */
static bool waits_for(const struct embd_server *sv, const struct client *c)
{
	if (!c->used || c->index < 0)
		return false;
	if (sv->phase == COLLECT)
		return !c->has_fwd && c->sat_out != sv->s + 1;
	return c->participant && !c->has_bwd;
}

/* Requests kept while the phase waits (a FORWARD of this step, or a BACKWARD of it or an
 * early FORWARD of the next): someone is kept waiting. */
static uint32_t kept_requests(const struct embd_server *sv)
{
	uint32_t n = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++)
		n += sv->clients[i].used && (sv->clients[i].has_fwd || sv->clients[i].has_bwd);
	return n;
}

/* How long the phase has kept someone waiting, once that is step_wait_warn_ms (else 0). */
static uint64_t stalled_ms(const struct embd_server *sv)
{
	uint64_t ms = sv->wait_since_ns ? (embd_now_ns() - sv->wait_since_ns) / 1000000 : 0;

	if (!sv->config->step_wait_warn_ms || ms < sv->config->step_wait_warn_ms ||
	    !kept_requests(sv))
		return 0;
	return ms;
}

static const char *awaited_request(const struct embd_server *sv)
{
	return sv->phase == COLLECT ? "FORWARD" : "BACKWARD";
}

/* "trainer 1 (pid 42)" or "trainers 1 (pid 42), 3 (pid 50)": those the phase waits for, into
 * out. Returns how many. */
static uint32_t name_awaited(const struct embd_server *sv, char *out, size_t len)
{
	char list[192] = "";
	size_t at = 0;
	uint32_t n = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		const struct client *c = &sv->clients[i];
		if (!waits_for(sv, c))
			continue;
		if (at < sizeof(list))
			at += (size_t)snprintf(list + at, sizeof(list) - at, "%s%d (pid %d)",
					       n ? ", " : "", c->index, (int)c->peer.pid);
		n++;
	}
	snprintf(out, len, "trainer%s %s", n > 1 ? "s" : "", list);
	return n;
}

/* step_wait_abort_ms ran out: the requests kept for the phase are answered EMBD_ETIMEDOUT
 * naming who. A backward is aborted as when a participant leaves (on every node, moving on
 * to the next step); a forward that never ran leaves the step where it is, so the trainers
 * answered may post it again. */
static void give_up(struct embd_server *sv, const char *who)
{
	char why[320], msg[340];

	snprintf(why, sizeof(why), "%s on node %u sent no %s in %u ms", who,
		 sv->config->node_rank, awaited_request(sv), sv->config->step_wait_abort_ms);
	sv->stats.step_timeouts++;
	if (sv->phase == WAIT_BACKWARD) {
		abort_step(sv, EMBD_ETIMEDOUT, why);
		return;
	}
	embd_log_warning("step %" PRIu64 " forward given up: %s", sv->s, why);
	snprintf(msg, sizeof(msg), "step aborted: %s", why);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && c->has_fwd)
			embd_server_complete(sv, c, &c->fwd, c->fwd_popped_ns, EMBD_ETIMEDOUT, msg);
		c->has_fwd = false;
	}
	wait_from(sv, 0);
	sv->dirty = true;
}

void embd_server_schedule_tick(struct embd_server *sv, uint64_t now_ns)
{
	const struct embd_config *cf = sv->config;
	char who[224];

	if (!sv->wait_since_ns || sv->stop || !embd_server_regroup_running(sv))
		return;
	uint64_t ms = (now_ns - sv->wait_since_ns) / 1000000;
	bool warn = cf->step_wait_warn_ms && !sv->wait_warned && ms >= cf->step_wait_warn_ms;
	bool abort = cf->step_wait_abort_ms && ms >= cf->step_wait_abort_ms;
	if (!warn && !abort)
		return;
	if (!name_awaited(sv, who, sizeof(who)) || !kept_requests(sv)) {
		/* nobody is kept waiting by a trainer (the first step waits for trainers to
		 * connect, or those who posted left): count again from now */
		wait_from(sv, now_ns);
		return;
	}
	if (warn) {
		sv->wait_warned = true;
		embd_log_warning("step %" PRIu64 ": waited %" PRIu64 " ms for the %s of %s", sv->s, ms,
				 awaited_request(sv), who);
	}
	if (abort)
		give_up(sv, who);
}

int embd_server_schedule_sleep_ms(const struct embd_server *sv, int idle_ms)
{
	const struct embd_config *cf = sv->config;
	uint32_t next_ms = !sv->wait_warned && cf->step_wait_warn_ms ? cf->step_wait_warn_ms :
			   cf->step_wait_abort_ms;

	if (!sv->wait_since_ns || !next_ms || sv->stop || !embd_server_regroup_running(sv))
		return idle_ms;
	return embd_sleep_ms_until(sv->wait_since_ns + (uint64_t)next_ms * 1000000, idle_ms);
}

uint64_t embd_server_stalling_ms(const struct embd_server *sv, const struct client *c)
{
	return waits_for(sv, c) ? stalled_ms(sv) : 0;
}

int embd_server_schedule_status_add(const struct embd_server *sv, char **status)
{
	cJSON *root, *o, *arr;
	uint64_t ms = stalled_ms(sv);

	if (!ms)
		return 0;
	root = cJSON_Parse(*status);
	if (!root || !(o = cJSON_AddObjectToObject(root, "stalled")) ||
	    !(arr = cJSON_CreateArray())) {
		cJSON_Delete(root);
		return EMBD_ENOMEM;
	}
	cJSON_AddNumberToObject(o, "step", (double)sv->s);
	cJSON_AddStringToObject(o, "waiting_for", awaited_request(sv));
	cJSON_AddNumberToObject(o, "waited_ms", (double)ms);
	cJSON_AddItemToObject(o, "trainers", arr);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		const struct client *c = &sv->clients[i];
		cJSON *t;
		if (!waits_for(sv, c) || !(t = cJSON_CreateObject()))
			continue;
		cJSON_AddNumberToObject(t, "index", c->index);
		cJSON_AddNumberToObject(t, "pid", c->peer.pid);
		cJSON_AddItemToArray(arr, t);
	}
	return embd_server_status_replace(status, root);
}

/* Runs the phase everyone is in for, if any (only when something changed since last time).
 * Between steps each trainer votes with what it posted: FORWARD s (or sitting s out), or on a
 * cluster EVAL (or sitting the evaluation round out). */
static void advance(struct embd_server *sv)
{
	uint32_t trainers = 0, waiting = 0, posted = 0, evals = 0;
	const struct client *in_step = NULL;

	if (!sv->dirty || sv->stop || !embd_server_regroup_running(sv))
		return;
	sv->dirty = false;

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		const struct client *c = &sv->clients[i];
		if (!c->used || c->index < 0)
			continue;
		trainers++;
		if (sv->phase == COLLECT) {
			const bool step = c->has_fwd || c->sat_out == sv->s + 1;
			const bool eval = c->has_eval || c->eval_sat_out;
			posted += c->has_fwd;
			evals += eval;
			waiting += !step && !eval;
			if (step && !in_step)
				in_step = c;
		} else if (c->participant) {
			waiting += !c->has_bwd;
		}
	}
	if (sv->phase == COLLECT) {
		if (in_step && evals) {
			refuse_mixed_evals(sv, in_step);
			return;
		}
		if (!sv->first_step_done && trainers < sv->config->trainers_per_node)
			return;
		if (waiting)
			return;
		/* a cluster's step is collective: a node whose trainers all sat it out (or left)
		 * still joins it, and waits in it for the others up to collective_timeout_ms */
		if (evals)
			run_eval_round(sv);
		else if (posted || sv->cluster)
			run_forward(sv, sv->cluster && !trainers);
	} else {
		if (!waiting) {
			/* the step's phases (daemon/stats.h): routing the next step now is the
			 * service's time, not the trainers' */
			sv->backward_start_ns = embd_now_ns();
			take_early_forwards(sv);
		}
		prepare_next(sv);
		if (!waiting)
			run_backward(sv);
	}
}

uint32_t embd_server_poll_rings(struct embd_server *sv)
{
	uint32_t handled = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && c->cq_broken) {
			embd_server_drop_client(sv, c, "corrupt completion ring");
			continue;
		}
		while (embd_server_client_ready(sv, c, NULL)) {
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
