/*
 * How the step's node-level messages (step_dist.c) travel over the comm's lanes
 * (dist/comm.h). The wire format stays one message per pair of nodes; the transport splits
 * each message into one part per lane (whole 64-byte blocks dealt out evenly, so both ends
 * cut the same bytes from the size they agree on) and moves every part of every peer in one
 * grouped send/recv. Lane l of this node talks to lane l of every other node: on a GPU node
 * (nccl) lane l is rank l's GPU, so every GPU carries its share of every exchange; on a CPU
 * node (gloo) the lanes are slots of the one Gloo context, so every CI run drives this same
 * split and reassembly.
 *
 * A comm that moves device memory gets each lane's parts staged through a buffer on that
 * rank's device (engine/ranks.h: the backend allocates it), copied in and out on the ranks'
 * own threads, all ranks at once; a host comm reads and writes the engine's buffers in place.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist/comm.h"
#include "engine/ranks.h"
#include "engine/step_internal.h"

#define LANE_BLOCK 64u          /* bytes: parts are whole blocks, but the last */

struct step_lanes {
	uint32_t nodes, lanes;
	bool staged;                    /* the comm moves device memory: staging per rank */
	struct embd_comm_xfer *x;       /* sends then recvs, nodes * lanes each at most */
	uint8_t **host;                 /* each transfer's bytes in the engine's buffers */
	uint64_t *stage_at;             /* each transfer's offset in its lane's staging */
	uint64_t *stage_bytes;          /* per lane */
	size_t ns, nr;
	bool copy_out;                  /* the staging pass in flight: copy recvs back */
	int rc;                         /* the first staging failure of the pass */
	char err[256];
};

void step_lane_part(uint64_t bytes, uint32_t lanes, uint32_t l, uint64_t *off, uint64_t *len)
{
	const uint64_t blocks = (bytes + LANE_BLOCK - 1) / LANE_BLOCK;
	const uint64_t per = blocks / lanes, extra = blocks % lanes;
	const uint64_t first = l * per + (l < extra ? l : extra);
	const uint64_t begin = first * LANE_BLOCK, end = (first + per + (l < extra)) * LANE_BLOCK;

	*off = begin < bytes ? begin : bytes;
	*len = (end < bytes ? end : bytes) - *off;
}

int step_lanes_create(struct embd_step *s, struct embd_comm *comm, struct step_lanes **out,
		      char *err, size_t err_len)
{
	const uint32_t N = s->num_nodes, L = embd_comm_lanes(comm);
	const size_t max_x = 2ull * N * L;
	struct step_lanes *ln;

	*out = NULL;
	if (embd_comm_device_buffers(comm) &&
	    (!embd_ranks_comm_buffers(s->ranks) || L > s->num_ranks)) {
		snprintf(err, err_len, "comm: its %u lanes move device memory, one per GPU rank, and "
			 "this node has %u %s ranks", L, s->num_ranks,
			 embd_plan_device_name(embd_ranks_device(s->ranks)));
		return EMBD_EINVAL;
	}
	ln = calloc(1, sizeof(*ln));
	if (!ln)
		return EMBD_ENOMEM;
	ln->nodes = N;
	ln->lanes = L;
	ln->staged = embd_comm_device_buffers(comm);
	ln->x = calloc(max_x, sizeof(*ln->x));
	ln->host = calloc(max_x, sizeof(*ln->host));
	ln->stage_at = calloc(max_x, sizeof(*ln->stage_at));
	ln->stage_bytes = calloc(L, sizeof(*ln->stage_bytes));
	if (!ln->x || !ln->host || !ln->stage_at || !ln->stage_bytes) {
		step_lanes_destroy(ln);
		return EMBD_ENOMEM;
	}
	*out = ln;
	return 0;
}

void step_lanes_destroy(struct step_lanes *ln)
{
	if (!ln)
		return;
	free(ln->x);
	free(ln->host);
	free(ln->stage_at);
	free(ln->stage_bytes);
	free(ln);
}

bool step_lanes_staged(const struct step_lanes *ln)
{
	return ln->staged;
}

/* One part per lane of the message of bytes at host, as sends to (or recvs from) peer; every
 * send is added before the first recv. */
static void add_parts(struct step_lanes *ln, bool send, uint32_t peer, uint8_t *host,
		      uint64_t bytes)
{
	for (uint32_t l = 0; l < ln->lanes; l++) {
		uint64_t off, len;
		step_lane_part(bytes, ln->lanes, l, &off, &len);
		if (!len)
			continue;
		size_t i = ln->ns + ln->nr;
		ln->x[i] = (struct embd_comm_xfer){ .peer = peer, .lane = l, .buf = host + off,
						    .bytes = len };
		ln->host[i] = host + off;
		ln->stage_at[i] = ln->stage_bytes[l];
		ln->stage_bytes[l] += (len + 255) & ~255ull;    /* keep each part 256-aligned */
		*(send ? &ln->ns : &ln->nr) += 1;
	}
}

/* On rank l's thread: its lane's sends into staging (the transfers pointed there), or its
 * recvs back out. */
static void stage_lane(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct step_lanes *ln = s->lanes;
	char err[200] = "";
	void *buf = NULL;
	int rc = 0;

	(void)exec;
	if (rank >= ln->lanes || !ln->stage_bytes[rank])
		return;
	rc = embd_ranks_comm_buffer(s->ranks, rank, ln->stage_bytes[rank], &buf, err, sizeof(err));
	for (size_t i = 0; !rc && i < ln->ns + ln->nr; i++) {
		struct embd_comm_xfer *x = &ln->x[i];
		if (x->lane != rank)
			continue;
		x->buf = (uint8_t *)buf + ln->stage_at[i];
		if (ln->copy_out && i >= ln->ns)
			rc = embd_ranks_comm_copy(s->ranks, rank, ln->host[i], x->buf, x->bytes, err,
						  sizeof(err));
		else if (!ln->copy_out && i < ln->ns)
			rc = embd_ranks_comm_copy(s->ranks, rank, x->buf, ln->host[i], x->bytes, err,
						  sizeof(err));
	}
	/* ranks run at once: the first failure is kept (rank order decides nothing here) */
	if (rc && __atomic_exchange_n(&ln->rc, rc, __ATOMIC_ACQ_REL) == 0)
		snprintf(ln->err, sizeof(ln->err), "lane %u staging: %s", rank, err);
}

static int stage(struct embd_step *s, bool copy_out, char *err, size_t err_len)
{
	struct step_lanes *ln = s->lanes;

	ln->copy_out = copy_out;
	ln->rc = 0;
	embd_ranks_run(s->ranks, stage_lane, s);
	if (ln->rc)
		snprintf(err, err_len, "%s", ln->err);
	return ln->rc;
}

int step_lanes_exchange(struct embd_step *s, struct embd_comm *comm, const uint8_t *send,
			const uint64_t *sbytes, uint8_t *recv, const uint64_t *rbytes,
			bool *comm_failed, char *err, size_t err_len)
{
	struct step_lanes *ln = s->lanes;
	uint64_t soff = 0, roff = 0;
	int rc;

	*comm_failed = false;
	ln->ns = ln->nr = 0;
	memset(ln->stage_bytes, 0, ln->lanes * sizeof(*ln->stage_bytes));
	for (uint32_t p = 0; p < ln->nodes; soff += sbytes[p], p++)
		if (p != s->node)
			add_parts(ln, true, p, (uint8_t *)send + soff, sbytes[p]);
	soff = 0;
	for (uint32_t p = 0; p < ln->nodes; soff += sbytes[p], roff += rbytes[p], p++) {
		if (p == s->node)
			memcpy(recv + roff, send + soff, rbytes[p]);  /* step_dist: sizes agree */
		else
			add_parts(ln, false, p, recv + roff, rbytes[p]);
	}
	if (ln->staged && (rc = stage(s, false, err, err_len)))
		return rc;
	rc = embd_comm_sendrecv(comm, ln->x, ln->ns, ln->x + ln->ns, ln->nr);
	if (rc) {
		*comm_failed = true;
		return rc;
	}
	return ln->staged ? stage(s, true, err, err_len) : 0;
}
