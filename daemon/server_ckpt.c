/*
 * daemon/server_ckpt.c - the server's side of checkpoints (ckpt/ckpt_service.h): the
 * service handle and resumed step, `embctl checkpoint [--wait]` requests, answering the
 * waiters when a background write ends (or a re-formed cluster's restore drops the request),
 * and SIGTERM on a cluster (the final checkpoint is agreed like any other, and taken only while
 * the cluster runs). On the server's thread, like the rest of the server.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "ipc/evloop.h"
#include "ckpt/ckpt_service.h"
#include "common/log.h"
#include "daemon/server_internal.h"

int embd_server_set_checkpoints(struct embd_server *sv, struct embd_ckpt_service *ckpt,
				uint64_t resumed_step)
{
	sv->ckpt = ckpt;
	sv->s = resumed_step;
	return embd_evloop_add_fd(sv->loop, embd_ckpt_service_fd(ckpt), TAG(TAG_CKPT, 0));
}

uint64_t embd_server_step(const struct embd_server *sv)
{
	return sv->s;
}

static void send_json(struct client *c, const char *text)
{
	embd_ctl_send(c->sock, EMBD_CTL_CHECKPOINT_REPLY, text, (uint32_t)strlen(text), NULL, 0,
		      NULL, 0);
}

/* One node: a checkpoint due now (a request, a trigger that came due during the last write)
 * starts. A cluster's nodes take checkpoints only at the boundaries of steps they completed
 * together while running (server.c, next_step): a poll here, at a moment of this node only,
 * could start one (every_steps missed at a boundary while re-forming) the others never take. */
static void poll_running(struct embd_server *sv)
{
	if (!sv->cluster)
		embd_ckpt_service_poll(sv->ckpt, sv->s);
}

bool embd_server_cluster_running(const struct embd_server *sv, char *why, size_t why_len)
{
	const char *broken = NULL;

	why[0] = 0;
	if (!sv->rg || embd_server_regroup_running(sv))
		return true;
	if (sv->rg_state == RG_RUNNING && embd_step_comm_broken(sv->step, &broken))
		snprintf(why, why_len, "a collective failed: %s", broken);
	else
		snprintf(why, why_len, "%s", sv->rg_msg);
	return false;
}

/* Outside a step phase the shards hold "sv->s steps completed", so on one node the snapshot
 * runs now. */
int embd_server_checkpoint_request(struct embd_server *sv, struct client *c,
				   const struct embd_ctl_msg *msg, char *err, size_t err_len)
{
	struct embd_ctl_checkpoint req;
	char text[96];
	int rc = embd_ctl_checkpoint_decode(msg, &req, err, err_len);

	if (rc)
		return rc;
	if (!sv->ckpt) {
		embd_ctl_send_error(c->sock, EMBD_ENOTSUP, "checkpoint: no checkpoint_dir configured",
				    NULL, 0);
		return 0;
	}
	/* on a cluster the next step's HELLO carries the request (ckpt_service.h): the
	 * checkpoint is of the boundary after that step, on every node */
	uint64_t seq = embd_ckpt_service_request(sv->ckpt);
	poll_running(sv);
	if (req.flags & EMBD_CTL_CHECKPOINT_WAIT) {
		c->ckpt_wait = seq;
		return 0;
	}
	if (sv->cluster)
		snprintf(text, sizeof(text), "{\"requested\":%" PRIu64 ",\"step_at_least\":%" PRIu64
			 "}", seq, sv->s + 1);
	else
		snprintf(text, sizeof(text), "{\"started\":%" PRIu64 ",\"step\":%" PRIu64 "}", seq,
			 sv->s);
	send_json(c, text);
	return 0;
}

void embd_server_checkpoint_signal(struct embd_server *sv, uint32_t signo)
{
	if (!sv->cluster || !sv->ckpt || sv->stopping) {
		embd_log_notice("signal %u: stopping", signo);
		sv->stop = true;
		return;
	}
	/* the final checkpoint must be the cluster's: the next step's HELLO asks for it; with no
	 * step by the deadline, embd_ckpt_service_final takes it idle (every node stopping) */
	embd_log_notice("signal %u: stopping after the cluster's final checkpoint", signo);
	sv->stopping = true;
	sv->stop_deadline_ns = embd_now_ns() + STOP_DRAIN_MS * 1000000ull;
	embd_ckpt_service_stopping(sv->ckpt);
}

/* Answers the `--wait` clients whose checkpoint finished (done: the last finished one) with
 * its result; dropped (NULL: none), the others with {"ok":false,"error":dropped}. */
static void answer_waiters(struct embd_server *sv, uint64_t done, const char *dropped)
{
	char *text = NULL, *refusal = NULL;
	cJSON *o = dropped ? cJSON_CreateObject() : NULL;

	if (o && cJSON_AddBoolToObject(o, "ok", false) &&
	    cJSON_AddStringToObject(o, "error", dropped))
		refusal = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (!c->used || !c->ckpt_wait || (c->ckpt_wait > done && !dropped))
			continue;
		if (c->ckpt_wait > done) {
			if (refusal)
				send_json(c, refusal);
			else
				embd_ctl_send_error(c->sock, EMBD_ECANCELED, dropped, NULL, 0);
		} else if (text || !embd_ckpt_service_result_json(sv->ckpt, &text)) {
			send_json(c, text);
		} else {
			continue;       /* out of memory: answered at the next one */
		}
		c->ckpt_wait = 0;
	}
	free(text);
	free(refusal);
}

/* A background write ended: answer who waited for it, and start one that came due meanwhile. */
void embd_server_checkpoint_done(struct embd_server *sv)
{
	answer_waiters(sv, embd_ckpt_service_reap(sv->ckpt), NULL);
	poll_running(sv);
}

void embd_server_checkpoint_restored(struct embd_server *sv, int rc, uint64_t step)
{
	char why[160];

	/* the restore joined the write in flight: its waiters get its result */
	if (rc)
		snprintf(why, sizeof(why), "checkpoint request dropped: the cluster re-formed and "
			 "its restore failed (see the log); ask again once steps run");
	else
		snprintf(why, sizeof(why), "checkpoint request dropped: the cluster re-formed and "
			 "restored the checkpoint of step %" PRIu64 "; ask again", step);
	answer_waiters(sv, embd_ckpt_service_reap(sv->ckpt), why);
}
