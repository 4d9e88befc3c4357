/*
 * The running service (daemon/server.h): one thread, one io_uring loop, every client's
 * submission ring. Each pass pops what clients posted (a private copy of every SQE, validated
 * by ipc/) and hands it to the step schedule (server_schedule.c), which runs a step phase once
 * everyone it waits for is in. Between passes the loop busy-polls the rings for busy_poll_us,
 * then advertises NEED_WAKEUP on every ring it may sleep on and sleeps in the loop (doorbells,
 * sockets, the signalfd, and a one-second tick). A client with a request that must wait for a
 * later phase is not polled at all until then: its ring keeps the rest of its requests.
 * Here: the loop, the sessions (accept, the pending / control / trainer kinds and their limits,
 * HELLO and its region, stats and status) and lifetime; server_tables.c and server_device.c
 * answer a client's table and device-output requests.
 */
#include "common/clock.h"
#include "daemon/server.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ipc/control.h"
#include "ipc/evloop.h"
#include "ipc/protocol.h"
#include "ipc/region.h"
#include "common/log.h"
#include "daemon/server_internal.h"
#include "daemon/stats.h"

#define RING_ENTRIES 64u
#define TICK_MS 1000

/* ---- clients ------------------------------------------------------------------------------ */

static uint32_t slot_of(const struct embd_server *sv, const struct client *c)
{
	return (uint32_t)(c - sv->clients);
}

void embd_server_drop_client(struct embd_server *sv, struct client *c, const char *why)
{
	uint32_t slot = slot_of(sv, c);

	if (c->index >= 0)
		embd_log_info("trainer %d (pid %d, uid %u) left: %s", c->index, (int)c->peer.pid,
			      (unsigned)c->peer.uid, why);
	embd_server_schedule_leave(sv, c, why);
	embd_evloop_remove(sv->loop, TAG(TAG_SOCKET, slot));
	if (c->pidfd >= 0) {
		embd_evloop_remove(sv->loop, TAG(TAG_PIDFD, slot));
		close(c->pidfd);
	}
	if (c->region)
		embd_evloop_remove(sv->loop, TAG(TAG_DOORBELL, slot));
	if (c->slab_registered)
		embd_ranks_host_unregister(sv->ranks, embd_region_slab(c->region));
	embd_server_device_free(sv, c);
	embd_region_destroy(c->region);
	if (c->eventfd >= 0)
		close(c->eventfd);
	close(c->sock);
	free(c->lengths);
	free(c->next_lengths);
	free(c->eval_lengths);
	memset(c, 0, sizeof(*c));
	embd_server_checkpoint_client_gone(sv, slot);
	while (sv->slots_end && !sv->clients[sv->slots_end - 1].used)
		sv->slots_end--;
	sv->dirty = true;
}

/* ---- sessions: pending, control and trainer connections --------------------------------- */

static uint64_t handshake_ns(const struct embd_server *sv)
{
	return (uint64_t)sv->config->handshake_timeout_ms * 1000000;
}

/* Closes pending client c, telling it why first (logged under limit). */
static void close_pending(struct embd_server *sv, struct embd_log_limit *limit, struct client *c,
			  int code, const char *why)
{
	embd_log_limited(limit, EMBD_LOG_WARNING,
			 "closed the connection of pid %d uid %u: %s", (int)c->peer.pid,
			 (unsigned)c->peer.uid, why);
	embd_ctl_send_error(c->sock, code, why, NULL, 0);
	embd_server_drop_client(sv, c, why);
}

/* The earliest handshake deadline of the pending connections; 0: none pends. */
static uint64_t handshake_due(const struct embd_server *sv)
{
	uint64_t due = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		const struct client *c = &sv->clients[i];
		if (c->used && !c->spoke && (!due || c->accepted_ns + handshake_ns(sv) < due))
			due = c->accepted_ns + handshake_ns(sv);
	}
	return due;
}

/* Closes the pending connections that said nothing within handshake_timeout_ms. */
static void sweep_pending(struct embd_server *sv, uint64_t now)
{
	char why[96];

	if (!sv->handshake_due_ns || now < sv->handshake_due_ns)
		return;
	snprintf(why, sizeof(why), "no message within handshake_timeout_ms (%u ms) of connecting",
		 sv->config->handshake_timeout_ms);
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (c->used && !c->spoke && now - c->accepted_ns >= handshake_ns(sv))
			close_pending(sv, &sv->silent_log, c, EMBD_ETIMEDOUT, why);
	}
	sv->handshake_due_ns = handshake_due(sv);
}

/* A free slot for a new connection. With MAX_PENDING connections pending, the one pending
 * longest is closed to make room: idle sockets, however many, delay nobody who speaks. */
static struct client *take_slot(struct embd_server *sv, uint64_t now)
{
	struct client *free_slot = NULL, *oldest = NULL;
	uint32_t pending = 0;
	char why[128];

	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		if (!c->used && !free_slot)
			free_slot = c;
		if (c->used && !c->spoke) {
			pending++;
			if (!oldest || c->accepted_ns < oldest->accepted_ns)
				oldest = c;
		}
	}
	if (!free_slot && sv->slots_end < MAX_CLIENTS)
		free_slot = &sv->clients[sv->slots_end];
	if (pending >= MAX_PENDING) {
		snprintf(why, sizeof(why), "no message in %" PRIu64 " ms, and %u newer connections "
			 "wait for their first", (now - oldest->accepted_ns) / 1000000,
			 MAX_PENDING - 1);
		if (!free_slot)
			free_slot = oldest;
		close_pending(sv, &sv->room_log, oldest, EMBD_EBUSY, why);
	}
	return free_slot;
}

/* The connections that sent something other than HELLO first (embctl's). */
static uint32_t control_count(const struct embd_server *sv)
{
	uint32_t n = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++)
		n += sv->clients[i].used && sv->clients[i].spoke && sv->clients[i].index < 0;
	return n;
}

static void accept_client(struct embd_server *sv)
{
	char err[256];
	uint64_t now = embd_now_ns();
	int fd = accept4(sv->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

	if (fd < 0)
		return;
	struct embd_ctl_peer peer;
	if (embd_ctl_peer_get(fd, &peer, err, sizeof(err))) {
		embd_log_limited(&sv->refusals_log, EMBD_LOG_WARNING, "refused a connection: %s",
				 err);
		close(fd);
		return;
	}
	const struct embd_config *cf = sv->config;
	if (embd_ctl_peer_check(&peer, cf->allowed_uids, cf->num_allowed_uids, cf->allowed_gids,
				cf->num_allowed_gids, err, sizeof(err))) {
		embd_log_limited(&sv->refusals_log, EMBD_LOG_WARNING,
				 "refused peer uid %u gid %u pid %d: %s", (unsigned)peer.uid,
				 (unsigned)peer.gid, (int)peer.pid, err);
		embd_ctl_refuse(fd, EMBD_EACCES, err);
		return;
	}
	struct client *c = take_slot(sv, now);
	if (!c) {       /* the limits leave a slot for every kind: only a bug gets here */
		embd_log_limited(&sv->refusals_log, EMBD_LOG_ERROR,
				 "refused pid %d uid %u: all %u client slots taken", (int)peer.pid,
				 (unsigned)peer.uid, MAX_CLIENTS);
		embd_ctl_refuse(fd, EMBD_EBUSY, "too many clients");
		return;
	}
	int pidfd;
	int rc = embd_ctl_peer_pidfd(fd, peer.pid, &pidfd, err, sizeof(err));
	if (rc == EMBD_ECONNRESET) {
		close(fd);
		return;
	}
	if (rc)
		embd_log_debug("client pid %d: %s; only a socket hangup will tell when it is gone",
			       (int)peer.pid, err);
	*c = (struct client){ .used = true, .sock = fd, .pidfd = pidfd, .peer = peer, .index = -1,
			      .eventfd = -1, .accepted_ns = now };
	uint32_t slot = slot_of(sv, c);
	if (slot >= sv->slots_end)
		sv->slots_end = slot + 1;
	if (!sv->handshake_due_ns)      /* else an older one is due first */
		sv->handshake_due_ns = now + handshake_ns(sv);
	if (embd_evloop_add_fd(sv->loop, fd, TAG(TAG_SOCKET, slot)) ||
	    (pidfd >= 0 && embd_evloop_add_fd(sv->loop, pidfd, TAG(TAG_PIDFD, slot)))) {
		embd_log_warning("client pid %d: cannot watch its socket and pidfd", (int)peer.pid);
		embd_server_drop_client(sv, c, "cannot watch it");
	}
}

static uint64_t slab_bytes_needed(const struct embd_step_layout *l)
{
	uint64_t out = (uint64_t)l->batch_size * l->total_dim * 4;
	uint64_t kjt = (uint64_t)l->num_features * l->batch_size * 4 + l->max_values * 12;
	/* two batches in flight (double buffering), each with its output and gradient */
	return 2 * (kjt + 2 * out) + 4 * EMBD_REGION_ALIGN;
}

static void fill_layout(struct embd_server *sv, int32_t index, uint64_t region_bytes)
{
	const struct embd_step_layout *l = embd_step_layout(sv->step);
	const struct embd_tables *t = &sv->config->tables;
	struct embd_layout *o = sv->layout;

	memset(o, 0, sizeof(*o));
	o->fixed = (struct embd_layout_fixed){
		.rank = index, .local_world_size = sv->config->trainers_per_node,
		.region_bytes = region_bytes, .max_values = l->max_values,
		.resumed_step = embd_server_join_step(sv),
		.batch_size = l->batch_size, .total_dim = l->total_dim, .num_tables = t->count,
		.num_features = l->num_features,
		.flags = embd_evloop_doorbell_mode(sv->loop) == EMBD_DOORBELL_EVENTFD ?
			 EMBD_LAYOUT_EVENTFD : 0,
	};
	for (uint32_t i = 0; i < t->count; i++) {
		memcpy(o->tables[i].name, t->specs[i].name, EMBD_NAME_MAX);
		o->tables[i].num_embeddings = t->specs[i].num_embeddings;
		o->tables[i].embedding_dim = t->specs[i].embedding_dim;
		o->tables[i].pooling = t->specs[i].pooling;
		o->tables[i].data_type = t->specs[i].data_type;
	}
	for (uint32_t f = 0; f < l->num_features; f++) {
		memcpy(o->features[f].name, l->feature_names[f], EMBD_NAME_MAX);
		o->features[f].table = l->feature_tables[f];
		o->features[f].dim = l->feature_dims[f];
		o->features[f].offset = l->feature_offsets[f];
	}
}

static int hello(struct embd_server *sv, struct client *c, const struct embd_ctl_msg *msg,
		 char *err, size_t err_len)
{
	const struct embd_step_layout *l = embd_step_layout(sv->step);
	struct embd_ctl_hello h;
	uint32_t T = sv->config->trainers_per_node, slot = slot_of(sv, c);
	int rc;

	if (c->index >= 0)
		return snprintf(err, err_len, "HELLO: already welcomed as trainer %d", c->index),
		       EMBD_EPROTO;
	rc = embd_ctl_hello_decode(msg, &h, err, err_len);
	if (rc)
		return rc;
	if (h.wanted_rank < -1 || h.wanted_rank >= (int32_t)T)
		return snprintf(err, err_len, "HELLO wanted_rank: %d, trainers are 0..%u or -1",
				h.wanted_rank, T - 1), EMBD_EINVAL;
	int32_t index = h.wanted_rank;
	for (int32_t i = 0; i < (int32_t)T && index < 0; i++) {
		bool taken = false;
		for (uint32_t k = 0; k < MAX_CLIENTS; k++)
			taken |= sv->clients[k].used && sv->clients[k].index == i;
		if (!taken)
			index = i;
	}
	for (uint32_t k = 0; index >= 0 && k < MAX_CLIENTS; k++)
		if (sv->clients[k].used && sv->clients[k].index == index)
			return snprintf(err, err_len, "HELLO wanted_rank: trainer %d is connected (pid %d)",
					index, (int)sv->clients[k].peer.pid), EMBD_EBUSY;
	if (index < 0)
		return snprintf(err, err_len, "HELLO: all %u trainers are connected", T), EMBD_EBUSY;
	struct embd_region_params p = { .sq_entries = RING_ENTRIES, .cq_entries = RING_ENTRIES,
					.slab_bytes = slab_bytes_needed(l) };
	char name[32];
	snprintf(name, sizeof(name), "embd-trainer-%d", index);
	rc = embd_region_create(&c->region, &p, name, err, err_len);
	if (rc)
		return rc;
	/* GPU ranks copy ids in and pooled rows out of the slab by DMA, without a bounce */
	c->slab_registered = embd_ranks_dma_register(sv->ranks, embd_region_slab(c->region),
						     embd_region_slab_bytes(c->region),
						     "a trainer's slab");
	c->lengths = calloc((uint64_t)l->num_features * l->batch_size + 1, sizeof(int32_t));
	c->next_lengths = calloc((uint64_t)l->num_features * l->batch_size + 1, sizeof(int32_t));
	c->eval_lengths = calloc((uint64_t)l->num_features * l->batch_size + 1, sizeof(int32_t));
	if (!c->lengths || !c->next_lengths || !c->eval_lengths)
		return EMBD_ENOMEM;
	int fds[2] = { embd_region_fd(c->region), -1 };
	if (embd_evloop_doorbell_mode(sv->loop) == EMBD_DOORBELL_EVENTFD) {
		c->eventfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
		if (c->eventfd < 0)
			return snprintf(err, err_len, "eventfd: %s", strerror(errno)), EMBD_EIO;
		fds[1] = c->eventfd;
	}
	embd_doorbell_init(&c->sq_db, embd_region_sq(c->region), c->eventfd);
	embd_doorbell_init(&c->cq_db, embd_region_cq(c->region), -1);
	rc = embd_evloop_add_doorbell(sv->loop, &c->sq_db, TAG(TAG_DOORBELL, slot));
	if (rc)
		return snprintf(err, err_len, "cannot watch the doorbell"), rc;
	c->limits = (struct embd_batch_limits){
		.slab_bytes = embd_region_slab_bytes(c->region), .num_features = l->num_features,
		.batch_size = l->batch_size, .total_dim = l->total_dim, .max_values = l->max_values,
	};
	fill_layout(sv, index, embd_region_bytes(c->region));
	uint32_t len;
	rc = embd_ctl_welcome_encode(sv->layout, sv->msgbuf, EMBD_CTL_MSG_MAX, &len);
	if (!rc)
		rc = embd_ctl_send(c->sock, EMBD_CTL_WELCOME, sv->msgbuf, len, fds, fds[1] < 0 ? 1 : 2,
				   err, err_len);
	if (rc)
		return rc;
	c->index = index;
	sv->dirty = true;
	embd_log_info("trainer %d joined (pid %d, uid %u), at step %" PRIu64, index,
		      (int)c->peer.pid, (unsigned)c->peer.uid, embd_server_step(sv));
	return 0;
}

static void fill_ranks(const struct embd_server *sv, struct embd_stats_rank *ranks)
{
	for (uint32_t r = 0; r < embd_ranks_count(sv->ranks); r++)
		ranks[r] = (struct embd_stats_rank){ r, embd_ranks_node(sv->ranks, r),
						     embd_ranks_memory_bytes(sv->ranks, r) };
}

static void fill_tables(const struct embd_server *sv, struct embd_stats_table *tables)
{
	for (uint32_t t = 0; t < sv->config->tables.count; t++) {
		tables[t] = (struct embd_stats_table){
			.name = sv->config->tables.specs[t].name,
			.lookups = embd_step_table_lookups(sv->step, t) };
		tables[t].cached = embd_step_table_cache(sv->step, t, &tables[t].cache_hits,
							 &tables[t].cache_misses);
	}
}

static uint32_t count_trainers(const struct embd_server *sv)
{
	uint32_t n = 0;

	for (uint32_t i = 0; i < sv->slots_end; i++)
		n += sv->clients[i].used && sv->clients[i].index >= 0;
	return n;
}

static void reply_text(struct embd_server *sv, struct client *c, enum embd_ctl_type type)
{
	struct embd_stats_rank ranks[embd_ranks_count(sv->ranks)];
	struct embd_stats_table tables[sv->config->tables.count ? sv->config->tables.count : 1];
	struct embd_stats_client clients[MAX_CLIENTS];
	uint32_t n = 0, trainers = 0;
	char *text = NULL;
	int rc;

	for (uint32_t i = 0; i < MAX_CLIENTS; i++) {
		const struct client *k = &sv->clients[i];
		if (!k->used || k->index < 0)
			continue;
		trainers++;
		int64_t sq = embd_ring_count(embd_region_sq(k->region));
		int64_t cq = embd_ring_count(embd_region_cq(k->region));
		clients[n++] = (struct embd_stats_client){
			.index = (uint32_t)k->index, .pid = k->peer.pid, .uid = k->peer.uid,
			.sq_used = sq < 0 ? 0 : (uint32_t)sq, .sq_entries = RING_ENTRIES,
			.cq_used = cq < 0 ? 0 : (uint32_t)cq, .cq_entries = RING_ENTRIES,
			.requests = k->requests, .errors = k->errors,
			.stalling_ms = embd_server_stalling_ms(sv, k),
		};
	}
	fill_ranks(sv, ranks);
	fill_tables(sv, tables);
	if (type == EMBD_CTL_STATS_REPLY)
		rc = embd_stats_json(&sv->stats, ranks, embd_ranks_count(sv->ranks), tables,
				     sv->config->tables.count, clients, n, &text);
	else
		rc = embd_stats_status_json(&sv->stats, sv->config, embd_server_step(sv),
					    sv->plan_hash, trainers, &text);
	if (!rc && type == EMBD_CTL_STATUS_REPLY)
		rc = embd_server_checkpoint_status_add(sv, &text);
	if (!rc && type == EMBD_CTL_STATUS_REPLY)
		rc = embd_server_regroup_status_add(sv, &text);
	if (!rc && type == EMBD_CTL_STATUS_REPLY)
		rc = embd_server_schedule_status_add(sv, &text);
	if (!rc && strlen(text) < EMBD_CTL_MSG_MAX - sizeof(struct embd_ctl_header))
		embd_ctl_send(c->sock, type, text, (uint32_t)strlen(text), NULL, 0, NULL, 0);
	else
		embd_ctl_send_error(c->sock, rc ? rc : EMBD_ENOSPC, "stats do not fit", NULL, 0);
	free(text);
}

int embd_server_status_replace(char **status, cJSON *root)
{
	char *text = root ? cJSON_PrintUnformatted(root) : NULL;

	cJSON_Delete(root);
	if (!text)
		return EMBD_ENOMEM;
	free(*status);
	*status = text;
	return 0;
}

/* A table or device-output request: 0 once answered (refusals included). */
static int answer_request(struct embd_server *sv, struct client *c, const struct embd_ctl_msg *msg,
			  char *err, size_t err_len)
{
	if (msg->type == EMBD_CTL_DEVICE_REQUEST)
		return embd_server_device_request(sv, c, msg, err, err_len);
	return embd_server_table_request(sv, c, msg, err, err_len);
}

static void socket_event(struct embd_server *sv, struct client *c)
{
	struct embd_ctl_msg msg;
	char err[256] = "";
	int rc = embd_ctl_recv(c->sock, sv->msgbuf, EMBD_CTL_MSG_MAX, 0, &msg, err, sizeof(err));

	if (rc == EMBD_ETIMEDOUT || rc == EMBD_EAGAIN)
		return;
	if (rc) {
		embd_server_drop_client(sv, c, rc == EMBD_ECONNRESET ? "hung up" : err);
		return;
	}
	c->spoke = true;
	if (msg.type != EMBD_CTL_HELLO && c->index < 0 && control_count(sv) > MAX_CONTROL) {
		snprintf(err, sizeof(err), "too many control connections (%u open)", MAX_CONTROL);
		embd_log_limited(&sv->refusals_log, EMBD_LOG_WARNING, "refused pid %d uid %u: %s",
				 (int)c->peer.pid, (unsigned)c->peer.uid, err);
		embd_ctl_msg_close_fds(&msg);
		embd_ctl_send_error(c->sock, EMBD_EBUSY, err, NULL, 0);
		embd_server_drop_client(sv, c, err);
		return;
	}
	switch (msg.type) {
	case EMBD_CTL_HELLO:
		rc = hello(sv, c, &msg, err, sizeof(err));
		break;
	case EMBD_CTL_STATS_REQUEST:
		reply_text(sv, c, EMBD_CTL_STATS_REPLY);
		break;
	case EMBD_CTL_STATUS_REQUEST:
		reply_text(sv, c, EMBD_CTL_STATUS_REPLY);
		break;
	case EMBD_CTL_CHECKPOINT_REQUEST:
		rc = embd_server_checkpoint_request(sv, c, &msg, err, sizeof(err));
		break;
	case EMBD_CTL_TABLE_READ:
	case EMBD_CTL_TABLE_WRITE:
	case EMBD_CTL_DEVICE_REQUEST:
		/* answered, a refusal too; only an answer that cannot be sent drops the client */
		if (answer_request(sv, c, &msg, err, sizeof(err))) {
			embd_ctl_msg_close_fds(&msg);
			embd_server_drop_client(sv, c, err);
			return;
		}
		break;
	default:
		rc = EMBD_EPROTO;
		snprintf(err, sizeof(err), "unexpected message type %u", msg.type);
	}
	embd_ctl_msg_close_fds(&msg);
	if (rc) {
		embd_log_limited(&sv->errors_log, EMBD_LOG_WARNING, "client pid %d uid %u: %s",
				 (int)c->peer.pid, (unsigned)c->peer.uid, err);
		embd_ctl_send_error(c->sock, rc, err, NULL, 0);
		embd_server_drop_client(sv, c, err);
	}
}

/* ---- the loop ---------------------------------------------------------------------------- */

/* A client held back until it reads its completions does not say when it did (the rings
 * have no doorbell in that direction): the loop looks again after this long. */
#define HELD_SLEEP_MS 1

/* Advertises NEED_WAKEUP on every ring the loop may sleep on; false when one is not empty.
 * *held: some client waits for room in its completion ring. */
static bool prepare_sleep(struct embd_server *sv, bool *held)
{
	bool empty = true;

	*held = false;
	for (uint32_t i = 0; i < sv->slots_end; i++) {
		struct client *c = &sv->clients[i];
		bool full = false;
		if (!embd_server_client_ready(sv, c, &full)) {
			*held |= full;
			continue;
		}
		uint32_t seen;
		struct embd_ring *sq = embd_region_sq(c->region);
		if (!embd_ring_sleep_prepare(sq, &seen)) {
			embd_ring_sleep_finish(sq);
			empty = false;
			continue;
		}
		embd_evloop_arm_doorbell(sv->loop, TAG(TAG_DOORBELL, i), seen);
	}
	return empty;
}

static void finish_sleep(struct embd_server *sv)
{
	for (uint32_t i = 0; i < sv->slots_end; i++)
		if (sv->clients[i].used && sv->clients[i].region)
			embd_ring_sleep_finish(embd_region_sq(sv->clients[i].region));
}

static void handle_events(struct embd_server *sv, int timeout_ms)
{
	struct embd_event ev[64];
	uint32_t n = 0;
	bool accept = false;

	if (embd_evloop_wait(sv->loop, ev, 64, timeout_ms, &n)) {
		embd_log_error("event loop failed; stopping");
		sv->stop = true;
		return;
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t kind = (uint32_t)(ev[i].tag >> 32), slot = (uint32_t)ev[i].tag;
		if (kind == TAG_LISTEN) {
			accept = true;
		} else if (kind == TAG_SIGNAL) {
			struct signalfd_siginfo si = { 0 };
			if (read(sv->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si) &&
			    embd_server_checkpoint_signal(sv, si.ssi_signo))
				sv->stop = true;
		} else if (kind == TAG_SOCKET && slot < MAX_CLIENTS && sv->clients[slot].used) {
			socket_event(sv, &sv->clients[slot]);
		} else if (kind == TAG_PIDFD && slot < MAX_CLIENTS && sv->clients[slot].used) {
			embd_server_drop_client(sv, &sv->clients[slot], "its process exited");
		}
		else if (kind == TAG_CKPT)
			embd_server_checkpoint_done(sv);
		/* TAG_DOORBELL: nothing to do but look at the rings again */
	}
	/* after the batch: a slot freed by it and taken by the newcomer must not receive the
	 * old client's events that came in the same batch */
	if (accept)
		accept_client(sv);
}

/* The deadlines the loop keeps: handshakes, and the step's wait for trainers. */
static void tick(struct embd_server *sv)
{
	uint64_t now = embd_now_ns();

	sweep_pending(sv, now);
	embd_server_schedule_tick(sv, now);
}

/* ---- metrics ----------------------------------------------------------------------------- */

/* At most this often the loop publishes its figures for scrapes (daemon/metrics.h); while idle
 * it wakes at least every TICK_MS and publishes then. */
#define METRICS_PERIOD_NS 1000000ull

static void metrics_tick(struct embd_server *sv)
{
	uint64_t now;

	if (!sv->metrics || (now = embd_now_ns()) - sv->metrics_ns < METRICS_PERIOD_NS)
		return;
	struct embd_metrics_snapshot *m = embd_metrics_draft(sv->metrics);
	const struct embd_stats *st = &sv->stats;
	m->uptime_s = (double)(now - st->start_ns) / 1e9;
	m->step = embd_server_step(sv);
	m->steps = st->steps;
	m->aborted_steps = st->aborted_steps;
	m->ids = st->ids;
	m->bytes_in = st->bytes_in;
	m->bytes_out = st->bytes_out;
	m->sent_bytes = st->sent_bytes;
	m->partial_device_bytes = st->partial_device_bytes;
	m->partial_host_bytes = st->partial_host_bytes;
	m->step_hist = st->step_hist;
	memcpy(m->phase_total_ns, st->phase_total_ns, sizeof(m->phase_total_ns));
	m->request_hist = st->ipc_hist;
	memcpy(m->refusals, st->refusals, sizeof(m->refusals));
	m->clients = count_trainers(sv);
	fill_tables(sv, m->tables);
	fill_ranks(sv, m->ranks);
	embd_server_checkpoint_metrics(sv, m);
	embd_server_regroup_metrics(sv, m);
	/* a scrape copying the last one: try again at the next tick */
	if (embd_metrics_publish(sv->metrics))
		sv->metrics_ns = now;
}

/* While busy-polling, sockets and signals are looked at every this many passes: a pass over
 * the rings costs nanoseconds, a look at the io_uring a system call. */
#define SPIN_EVENT_PASSES 64
/* Idle passes between two reads of the clock: an idle pass over the rings in use costs a few
 * nanoseconds, a clock read ~20 ns, and a request waits for the pass it arrived during. */
#define SPIN_CLOCK_PASSES 16

int embd_server_run(struct embd_server *sv)
{
	uint64_t idle_since = 0, passes = 0;    /* idle_since 0: busy, the clock not read yet */
	const uint64_t spin_ns = (uint64_t)sv->config->busy_poll_us * 1000;

	while (!sv->stop) {
		passes++;
		if (embd_server_checkpoint_drain_over(sv))
			break;
		if (passes % SPIN_EVENT_PASSES == 0) {
			handle_events(sv, 0);
			embd_server_regroup_tick(sv);
			tick(sv);
			metrics_tick(sv);
		}
		if (embd_server_poll_rings(sv)) {
			idle_since = 0;
			continue;
		}
		if (!idle_since)
			idle_since = embd_now_ns();
		if (spin_ns && (passes % SPIN_CLOCK_PASSES ||
				embd_now_ns() - idle_since < spin_ns))
			continue;
		metrics_tick(sv);
		/* up to the next handshake deadline and the step's wait deadline at most */
		int tick_ms = embd_server_schedule_sleep_ms(sv,
						embd_server_checkpoint_sleep_ms(sv, TICK_MS));
		tick_ms = embd_sleep_ms_until(sv->handshake_due_ns, tick_ms);
		bool held;
		int sleep_ms = embd_server_regroup_sleep_ms(sv, tick_ms);
		if (prepare_sleep(sv, &held))
			handle_events(sv, held && sleep_ms > HELD_SLEEP_MS ? HELD_SLEEP_MS : sleep_ms);
		finish_sleep(sv);
		idle_since = 0;
		embd_server_regroup_tick(sv);
		tick(sv);
		metrics_tick(sv);
	}
	return 0;
}

/* ---- lifetime ---------------------------------------------------------------------------- */

/* mkdir -p of the socket's directory (mode 0755). */
static int make_socket_dir(const char *path, char *err, size_t err_len)
{
	char dir[EMBD_CONFIG_SOCKET_MAX];

	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0;
	*slash = 0;
	for (char *p = dir + 1; ; p++) {
		if (*p && *p != '/')
			continue;
		char saved = *p;
		*p = 0;
		if (mkdir(dir, 0755) && errno != EEXIST) {
			snprintf(err, err_len, "socket_path: cannot create directory %s: %s", dir,
				 strerror(errno));
			return EMBD_EIO;
		}
		*p = saved;
		if (!saved)
			return 0;
	}
}

int embd_server_create(const struct embd_config *config, struct embd_step *step,
		       struct embd_ranks *ranks, uint64_t plan_hash, int sigfd,
		       struct embd_server **out, char *err, size_t err_len)
{
	struct embd_server *sv = calloc(1, sizeof(*sv));
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!sv)
		return rc;
	sv->config = config;
	sv->step = step;
	sv->ranks = ranks;
	sv->plan_hash = plan_hash;
	sv->sigfd = sigfd;
	sv->cluster = embd_config_nodes(config) > 1;
	sv->listen_fd = -1;
	embd_stats_init(&sv->stats);
	sv->batches = calloc(MAX_CLIENTS, sizeof(*sv->batches));
	sv->next_batches = calloc(MAX_CLIENTS, sizeof(*sv->next_batches));
	sv->layout = calloc(1, sizeof(*sv->layout));
	sv->msgbuf = malloc(EMBD_CTL_MSG_MAX);
	const struct embd_step_layout *l = embd_step_layout(step);
	/* the gradients the engine checks and uses: the ranks' devices read them by DMA, from
	 * pages of their own */
	sv->grads = embd_ranks_dma_alloc(ranks, (size_t)config->trainers_per_node * l->batch_size *
					 l->total_dim * sizeof(float), &sv->grads_registered,
					 "the trainers' gradients");
	if (!sv->batches || !sv->next_batches || !sv->layout || !sv->msgbuf || !sv->grads)
		goto out;
	/* a trainer's socket, pidfd and doorbell; the listener, the signalfd, the writer */
	rc = embd_evloop_create(&sv->loop, EMBD_DOORBELL_AUTO, 3 * MAX_CLIENTS + 3, err, err_len);
	if (rc)
		goto out;
	rc = embd_evloop_add_fd(sv->loop, sigfd, TAG(TAG_SIGNAL, 0));
	if (rc) {
		snprintf(err, err_len, "cannot watch the signalfd");
		goto out;
	}
	if (config->metrics_listen[0]) {
		const char *names[config->tables.count ? config->tables.count : 1];
		for (uint32_t t = 0; t < config->tables.count; t++)
			names[t] = config->tables.specs[t].name;
		rc = embd_metrics_create(config->metrics_listen, config->tables.count, names,
					 embd_ranks_count(ranks), &sv->metrics, err, err_len);
		if (rc)
			goto out;
	}
	*out = sv;
	return 0;
out:
	embd_server_destroy(sv);
	return rc;
}

int embd_server_listen(struct embd_server *sv, char *err, size_t err_len)
{
	const struct embd_config *config = sv->config;
	int rc = make_socket_dir(config->socket_path, err, err_len);

	if (rc)
		return rc;
	rc = embd_ctl_listen(config->socket_path, 128,
			     embd_config_socket_mode(config, geteuid(), getegid()), &sv->listen_fd,
			     err, err_len);
	if (rc)
		return rc;
	if (embd_evloop_add_fd(sv->loop, sv->listen_fd, TAG(TAG_LISTEN, 0))) {
		snprintf(err, err_len, "cannot watch the control socket");
		return EMBD_EIO;
	}
	return 0;
}

void embd_server_destroy(struct embd_server *sv)
{
	if (!sv)
		return;
	for (uint32_t i = 0; i < MAX_CLIENTS; i++)
		if (sv->clients[i].used)
			embd_server_drop_client(sv, &sv->clients[i], "service stopping");
	embd_metrics_destroy(sv->metrics);      /* its thread reads nothing of the server's */
	embd_server_checkpoint_free(sv);
	embd_server_regroup_free(sv);
	embd_evloop_destroy(sv->loop);
	if (sv->listen_fd >= 0) {
		close(sv->listen_fd);
		unlink(sv->config->socket_path);
	}
	free(sv->batches);
	free(sv->next_batches);
	embd_ranks_dma_free(sv->ranks, sv->grads, sv->grads_registered);
	free(sv->layout);
	free(sv->msgbuf);
	free(sv);
}
