/*
 * daemon/server_ckpt.c - the server's side of checkpoints (ckpt/ckpt_service.h): the
 * service handle, `embctl checkpoint [--wait]` requests, answering the waiters when a
 * background write ends (or a re-formed cluster's restore drops the request), the cluster's
 * agreement carried by each step's forward, and SIGTERM on a cluster (the final checkpoint is
 * agreed like any other, and taken only while the cluster runs). On the server's thread, like
 * the rest of the server; every function here does nothing without checkpoint_dir.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/err.h"
#include "ipc/evloop.h"
#include "ckpt/ckpt_service.h"
#include "common/log.h"
#include "daemon/server_internal.h"

/* SIGTERM on a cluster with checkpoints: how long to wait for a step to carry the final
 * checkpoint's flag (steps run every few ms while trainers train) before taking it idle, and
 * how often the loop looks at the clock meanwhile. */
#define STOP_DRAIN_MS 1000u
#define STOP_TICK_MS 20

struct embd_server_ckpt {
	struct embd_ckpt_service *service;
	bool agreed;                    /* the cluster agreed on a checkpoint after this step */
	bool stopping;                  /* SIGTERM on a cluster: the final checkpoint first */
	uint64_t stop_deadline_ns;      /* ... then stop once no step came by this time */
	uint64_t wait[MAX_CLIENTS];     /* per client slot, embctl checkpoint --wait: the
					 * checkpoint it waits for (0: none) */
};

int embd_server_set_checkpoints(struct embd_server *sv, struct embd_ckpt_service *ckpt,
				uint64_t resumed_step, char *err, size_t err_len)
{
	struct embd_server_ckpt *k = calloc(1, sizeof(*k));

	if (!k)
		return embd_fail(err, err_len, EMBD_ENOMEM, "checkpoints: out of memory");
	k->service = ckpt;
	sv->ckpt = k;
	embd_server_resume_at(sv, resumed_step);
	if (embd_evloop_add_fd(sv->loop, embd_ckpt_service_fd(ckpt), TAG(TAG_CKPT, 0)))
		return embd_fail(err, err_len, EMBD_EIO, "cannot watch the checkpoint writer");
	return 0;
}

void embd_server_checkpoint_free(struct embd_server *sv)
{
	free(sv->ckpt);
	sv->ckpt = NULL;
}

static void send_json(struct client *c, const char *text)
{
	embd_ctl_send(c->sock, EMBD_CTL_CHECKPOINT_REPLY, text, (uint32_t)strlen(text), NULL, 0,
		      NULL, 0);
}

/* One node: a checkpoint due now (a request, a trigger that came due during the last write)
 * starts. A cluster's nodes take checkpoints only at the boundaries of steps they completed
 * together while running (embd_server_checkpoint_boundary): a poll here, at a moment of this
 * node only, could start one (every_steps missed at a boundary while re-forming) the others
 * never take. */
static void poll_running(struct embd_server *sv)
{
	if (!sv->cluster)
		embd_ckpt_service_poll(sv->ckpt->service, embd_server_step(sv));
}

/* Outside a step phase the shards hold "embd_server_step() steps completed", so on one node
 * the snapshot runs now. */
int embd_server_checkpoint_request(struct embd_server *sv, struct client *c,
				   const struct embd_ctl_msg *msg, char *err, size_t err_len)
{
	struct embd_server_ckpt *k = sv->ckpt;
	struct embd_ctl_checkpoint req;
	const uint64_t s = embd_server_step(sv);
	char text[96];
	int rc = embd_ctl_checkpoint_decode(msg, &req, err, err_len);

	if (rc)
		return rc;
	if (!k) {
		embd_ctl_send_error(c->sock, EMBD_ENOTSUP, "checkpoint: no checkpoint_dir configured",
				    NULL, 0);
		return 0;
	}
	/* on a cluster the next step's HELLO carries the request (ckpt_service.h): the
	 * checkpoint is of the boundary after that step, on every node */
	uint64_t seq = embd_ckpt_service_request(k->service);
	poll_running(sv);
	if (req.flags & EMBD_CTL_CHECKPOINT_WAIT) {
		k->wait[c - sv->clients] = seq;
		return 0;
	}
	if (sv->cluster)
		snprintf(text, sizeof(text), "{\"requested\":%" PRIu64 ",\"step_at_least\":%" PRIu64
			 "}", seq, s + 1);
	else
		snprintf(text, sizeof(text), "{\"started\":%" PRIu64 ",\"step\":%" PRIu64 "}", seq, s);
	send_json(c, text);
	return 0;
}

void embd_server_checkpoint_client_gone(struct embd_server *sv, uint32_t slot)
{
	if (sv->ckpt)
		sv->ckpt->wait[slot] = 0;
}

bool embd_server_checkpoint_signal(struct embd_server *sv, uint32_t signo)
{
	struct embd_server_ckpt *k = sv->ckpt;

	if (!sv->cluster || !k || k->stopping) {
		embd_log_notice("signal %u: stopping", signo);
		return true;
	}
	/* the final checkpoint must be the cluster's: the next step's HELLO asks for it; with no
	 * step by the deadline, embd_ckpt_service_final takes it idle (every node stopping) */
	embd_log_notice("signal %u: stopping after the cluster's final checkpoint", signo);
	k->stopping = true;
	k->stop_deadline_ns = embd_now_ns() + STOP_DRAIN_MS * 1000000ull;
	embd_ckpt_service_stopping(k->service);
	return false;
}

bool embd_server_checkpoint_drain_over(const struct embd_server *sv)
{
	if (!sv->ckpt || !sv->ckpt->stopping || embd_now_ns() < sv->ckpt->stop_deadline_ns)
		return false;
	embd_log_notice("no step within %u ms of the signal: stopping at step %" PRIu64,
			STOP_DRAIN_MS, embd_server_step(sv));
	return true;
}

int embd_server_checkpoint_sleep_ms(const struct embd_server *sv, int idle_ms)
{
	return sv->ckpt && sv->ckpt->stopping ? STOP_TICK_MS : idle_ms;
}

void embd_server_checkpoint_forward_begin(struct embd_server *sv, uint64_t step)
{
	if (sv->cluster && sv->ckpt)
		embd_step_want_checkpoint(sv->step, embd_ckpt_service_wanted(sv->ckpt->service,
									  step));
}

bool embd_server_checkpoint_quiet_boundary(const struct embd_server *sv)
{
	const struct embd_server_ckpt *k = sv->ckpt;

	return !k || (!k->agreed && !k->stopping &&
		      !embd_ckpt_service_due(k->service, embd_server_step(sv) + 1));
}

void embd_server_checkpoint_forward_end(struct embd_server *sv, int rc)
{
	/* taken at the boundary after this step (embd_server_checkpoint_boundary), never inside
	 * it */
	if (sv->ckpt)
		sv->ckpt->agreed = rc >= 0 && embd_step_cluster_checkpoint(sv->step);
}

bool embd_server_checkpoint_boundary(struct embd_server *sv)
{
	struct embd_server_ckpt *k = sv->ckpt;

	if (!k)
		return false;
	bool agreed = k->agreed;
	k->agreed = false;
	/* a cluster that is re-forming completed no step: nothing to checkpoint */
	if (!embd_server_regroup_running(sv))
		return false;
	if (agreed)
		embd_ckpt_service_agreed(k->service);
	/* SIGTERM on a cluster: this boundary's checkpoint is the final one */
	return embd_ckpt_service_poll(k->service, embd_server_step(sv)) && k->stopping;
}

void embd_server_checkpoint_step_dropped(struct embd_server *sv)
{
	if (sv->ckpt)
		sv->ckpt->agreed = false;       /* agreed for a step that did not complete */
}

void embd_server_checkpoint_metrics(const struct embd_server *sv, struct embd_metrics_snapshot *s)
{
	struct embd_ckpt_figures f;

	s->checkpoints = sv->ckpt != NULL;
	if (!sv->ckpt)
		return;
	embd_ckpt_service_figures(sv->ckpt->service, &f);
	s->ckpt_ok = f.written;
	s->ckpt_failed = f.failed;
	s->ckpt_last_step = f.last_step;
	s->ckpt_last_bytes = f.last_bytes;
	s->ckpt_write_ms_sum = f.write_ms_sum;
	s->ckpt_last_write_ms = f.last_write_ms;
	s->ckpt_last_stall_ms = f.last_stall_ms;
	s->ckpt_max_stall_ms = f.max_stall_ms;
	s->ckpt_in_progress = f.in_progress;
}

int embd_server_checkpoint_status_add(const struct embd_server *sv, char **status)
{
	return sv->ckpt ? embd_ckpt_service_status_add(sv->ckpt->service, status) : 0;
}

/* Answers the `--wait` clients whose checkpoint finished (done: the last finished one) with
 * its result; dropped (NULL: none), the others with {"ok":false,"error":dropped}. */
static void answer_waiters(struct embd_server *sv, uint64_t done, const char *dropped)
{
	struct embd_server_ckpt *k = sv->ckpt;
	char *text = NULL, *refusal = NULL;
	cJSON *o = dropped ? cJSON_CreateObject() : NULL;

	if (o && cJSON_AddBoolToObject(o, "ok", false) &&
	    cJSON_AddStringToObject(o, "error", dropped))
		refusal = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (!c->used || !k->wait[i] || (k->wait[i] > done && !dropped))
			continue;
		if (k->wait[i] > done) {
			if (refusal)
				send_json(c, refusal);
			else
				embd_ctl_send_error(c->sock, EMBD_ECANCELED, dropped, NULL, 0);
		} else if (text || !embd_ckpt_service_result_json(k->service, &text)) {
			send_json(c, text);
		} else {
			continue;       /* out of memory: answered at the next one */
		}
		k->wait[i] = 0;
	}
	free(text);
	free(refusal);
}

/* A background write ended: answer who waited for it, and start one that came due meanwhile. */
void embd_server_checkpoint_done(struct embd_server *sv)
{
	answer_waiters(sv, embd_ckpt_service_reap(sv->ckpt->service), NULL);
	poll_running(sv);
}

void embd_server_checkpoint_regrouped(struct embd_server *sv, uint64_t gen)
{
	if (sv->ckpt)
		embd_ckpt_service_regrouped(sv->ckpt->service, gen);
}

/* embd_ckpt_service_restore_running drops the pending request: its `--wait` clients are
 * answered with an error saying so (the ones of the write it joined, with that write's
 * result). */
int embd_server_checkpoint_restore(struct embd_server *sv, const char *key, uint64_t *step,
				   char *err, size_t err_len)
{
	struct embd_server_ckpt *k = sv->ckpt;
	char why[160];

	if (!k)
		return embd_fail(err, err_len, EMBD_ENOTSUP, "no checkpoint_dir configured");
	int rc = embd_ckpt_service_restore_running(k->service, key, step, err, err_len);
	if (rc)
		snprintf(why, sizeof(why), "checkpoint request dropped: the cluster re-formed and "
			 "its restore failed (see the log); ask again once steps run");
	else
		snprintf(why, sizeof(why), "checkpoint request dropped: the cluster re-formed and "
			 "restored the checkpoint of step %" PRIu64 "; ask again", *step);
	answer_waiters(sv, embd_ckpt_service_reap(k->service), why);
	return rc;
}
