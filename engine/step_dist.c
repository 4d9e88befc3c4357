/*
 * The step engine's exchanges with the other nodes (engine/step.h, step_internal.h). Per step:
 *
 *   forward   1. HELLO  fixed-size all-to-all: every node tells every node its step number,
 *                       status, accepted batches, how many input bytes follow for it, and
 *                       whether it wants a checkpoint after this step (step.h);
 *             2. INPUT  all-to-all of the items staged for each node (ids, weights, offsets,
 *                       full bag lengths), sized exactly by HELLO; skipped by every node alike
 *                       when the cluster accepted nothing or a node failed;
 *             3. OUTPUT after lookup, all-to-all of the pooled blocks of the received items
 *                       back to their trainers' nodes, headed by each node's lookup status;
 *   backward  4. GRADS  all-to-all of dL/d(pooled) for every staged item (data_parallel too:
 *                       every replica trains on the gradients of the whole global batch),
 *                       headed by each node's abort flag; no node applies if any aborted.
 *
 * Sizes of 3 and 4 need no exchange: both ends derive them from the items of 2. Every node
 * sends every message (a failed node sends its status and zeros of the right size), so the
 * collectives stay in line and every node takes the same decision from the same headers.
 * A failed collective breaks the comm (comm.h): later steps fail at once until the service
 * re-forms the cluster (dist/regroup.h) and hands the engine the new generation's comm.
 * Data from peers is checked like trainer data: no index is used before it is checked.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>

#include "dist/comm.h"
#include "common/log.h"
#include "engine/step_internal.h"
#include "engine/step_wire.h"
#include "dist/store.h"

/* What this node received: one record per wire item, in arrival order. */
struct wire_rx {
	uint32_t peer, rank, cols, bsize;
	bool forward;
	uint64_t out_at;                        /* floats into io[rank].partial */
	uint64_t grad_at;                       /* bytes into the peer's GRADS block */
};

/* What one pass (a training step's, or an evaluation's: step_internal.h) keeps of its
 * exchanges; a training pass's received items live in `in` until its backward. Each training
 * pass has its own, so the next step's ids may arrive while the ranks apply the step before
 * (embd_step_backward_overlapped), whose backward reads its own pass's. */
struct dist_pass {
	struct vec in, out;                     /* bytes */
	struct vec rx;                          /* struct wire_rx */
	uint64_t *rx_first;                     /* nodes + 1: first rx of each peer */
	uint64_t *out_expect, *grad_expect;     /* per peer, from HELLO: OUTPUT / GRADS sizes */
	int local_status;                       /* this node's failure to unpack the input */
	char why[96];
	uint64_t exchange_bytes[EMBD_STEP_EXCHANGES];  /* of the last pass, sent to others */
};

struct step_dist {
	struct embd_comm *comm;
	struct embd_store *store;               /* only to name the missing node on failure */
	int timeout_ms;
	uint32_t nodes;
	uint64_t seq;                           /* forward rounds (training and evaluation) */
	uint64_t gen;                           /* the comm's generation (regroup.h), for keys */
	uint64_t *sbytes, *rbytes, *roff;       /* per peer, of the exchange at hand */
	struct vec send, grad;                  /* bytes; grad lives until backward */
	uint64_t *grad_off;                     /* per peer: its block in grad */
	struct dist_pass passes[3];             /* train[0]'s, train[1]'s, the evaluation's */
	bool broken;
	char broken_msg[256];
};

/* The running pass's. */
static struct dist_pass *dpass(const struct embd_step *s)
{
	return &s->dist->passes[s->pass->eval ? 2 : s->pass - s->train];
}

int step_dist_create(struct embd_step *s, const struct embd_step_cluster *cluster, char *err,
		     size_t err_len)
{
	struct step_dist *d = calloc(1, sizeof(*d));
	struct embd_comm *comm = cluster->comm;
	uint32_t N = s->num_nodes;

	if (!d)
		return EMBD_ENOMEM;
	s->dist = d;
	d->comm = comm;
	d->store = cluster->store;
	d->timeout_ms = cluster->timeout_ms;
	d->nodes = N;
	d->sbytes = calloc(N, sizeof(uint64_t));
	d->rbytes = calloc(N, sizeof(uint64_t));
	d->roff = calloc(N + 1, sizeof(uint64_t));
	d->grad_off = calloc(N + 1, sizeof(uint64_t));
	d->grad.dma = s->ranks;         /* other nodes' gradients, which the ranks read */
	/* a device comm's lanes (nccl) copy every message to and from the GPUs' staging */
	struct embd_ranks *staging = embd_ranks_comm_buffers(s->ranks) ? s->ranks : NULL;
	d->send.dma = staging;
	if (!d->sbytes || !d->rbytes || !d->roff || !d->grad_off)
		return EMBD_ENOMEM;
	for (int i = 0; i < 3; i++) {
		struct dist_pass *x = &d->passes[i];
		x->in.dma = s->ranks;   /* other nodes' ids and lengths, which the ranks read */
		x->out.dma = staging;
		x->rx_first = calloc(N + 1, sizeof(uint64_t));
		x->out_expect = calloc(N, sizeof(uint64_t));
		x->grad_expect = calloc(N, sizeof(uint64_t));
		if (!x->rx_first || !x->out_expect || !x->grad_expect)
			return EMBD_ENOMEM;
	}
	if (!comm) {
		/* a node that rejoins a running cluster: no step until it is in a generation */
		d->broken = true;
		snprintf(d->broken_msg, sizeof(d->broken_msg), "node %u restarted, rejoining",
			 s->node);
		return 0;
	}
	if (embd_comm_size(comm) != N || embd_comm_rank(comm) != s->node) {
		snprintf(err, err_len, "comm: participant %u of %u, the step engine is node %u of %u",
			 embd_comm_rank(comm), embd_comm_size(comm), s->node, N);
		return EMBD_EMISMATCH;
	}
	return step_lanes_create(s, comm, &s->lanes, err, err_len);
}

void step_dist_destroy(struct embd_step *s)
{
	struct step_dist *d = s->dist;

	if (!d)
		return;
	step_overlap_destroy(s);
	vec_free(&d->send);
	vec_free(&d->grad);
	for (int i = 0; i < 3; i++) {
		struct dist_pass *x = &d->passes[i];
		vec_free(&x->in);
		vec_free(&x->out);
		vec_free(&x->rx);
		free(x->rx_first);
		free(x->out_expect);
		free(x->grad_expect);
	}
	free(d->sbytes);
	free(d->rbytes);
	free(d->roff);
	free(d->grad_off);
	free(d);
	s->dist = NULL;
	step_lanes_destroy(s->lanes);
	s->lanes = NULL;
}

int step_dist_timeout_ms(const struct embd_step *s)
{
	return s->dist->timeout_ms;
}

void step_dist_counts(const struct embd_step *s, struct embd_step_counts *out)
{
	const struct dist_pass *x = &s->dist->passes[s->cur];

	out->sent_bytes = 0;
	for (int e = 0; e < EMBD_STEP_EXCHANGES; e++) {
		out->exchange_bytes[e] = x->exchange_bytes[e];
		out->sent_bytes += x->exchange_bytes[e];
	}
}

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
	nanosleep(&ts, NULL);
}

/*
 * Which nodes did not take part in the failed exchange: every node whose collective failed
 * marks itself in the store under this exchange's key and looks for the others' marks for a
 * moment; the ones missing are named. The store lives on node 0, so when it does not answer
 * either it is node 0 that is gone. Only runs after a failure.
 */
static void missing_nodes(struct embd_step *s, char *out, size_t len)
{
	struct step_dist *d = s->dist;
	const int window_ms = d->timeout_ms < 1000 ? d->timeout_ms : 1000;
	char key[96];
	bool seen[d->nodes];
	size_t at = 0;

	out[0] = 0;
	if (!d->store)
		return;
	embd_store_set_timeout(d->store, window_ms);
	snprintf(key, sizeof(key), "embd/failed/%" PRIu64 "/%" PRIu64 "/%u", d->gen, d->seq,
		 s->node);
	if (embd_store_set(d->store, key, "1", 1)) {
		snprintf(out, len, "node 0");
		return;
	}
	memset(seen, 0, sizeof(seen));
	seen[s->node] = true;
	for (int waited = 0; waited <= window_ms; waited += 20) {
		bool all = true;
		for (uint32_t p = 0; p < d->nodes; p++) {
			if (seen[p])
				continue;
			snprintf(key, sizeof(key), "embd/failed/%" PRIu64 "/%" PRIu64 "/%u", d->gen,
				 d->seq, p);
			seen[p] = embd_store_check(d->store, key) == 1;
			all &= seen[p];
		}
		if (all)
			break;
		sleep_ms(20);
	}
	for (uint32_t p = 0; p < d->nodes; p++)
		if (!seen[p] && at < len)
			at += (size_t)snprintf(out + at, len - at, "%snode %u", at ? ", " : "", p);
}

/* broken_msg := what failed, naming the node(s) that did not answer where that is known. */
static void describe_failure(struct embd_step *s, int rc, const char *what)
{
	struct step_dist *d = s->dist;
	const char *msg = embd_comm_error(d->comm), *peer = strstr(msg, "peer rank ");
	char who[64] = "";

	/* gloo's participants are the node ranks */
	if (peer && peer[10] >= '0' && peer[10] <= '9')
		snprintf(who, sizeof(who), "node %lu", strtoul(peer + 10, NULL, 10));
	else
		missing_nodes(s, who, sizeof(who));
	if (!who[0])
		snprintf(d->broken_msg, sizeof(d->broken_msg), "%s exchange failed: %.150s", what, msg);
	else if (rc == EMBD_ETIMEDOUT)
		snprintf(d->broken_msg, sizeof(d->broken_msg), "%s did not answer within %d ms (%s "
			 "exchange): %.100s", who, d->timeout_ms, what, msg);
	else
		snprintf(d->broken_msg, sizeof(d->broken_msg), "%s went away (%s exchange, %s): "
			 "%.100s", who, what, embd_strerror(rc), msg);
}

/* Sizes the receive buffer from rbytes, runs the all-to-all of send, and breaks the comm on
 * failure (every later step is refused: the nodes may now disagree). */
static int exchange(struct embd_step *s, struct vec *recv, enum embd_step_exchange which)
{
	static const char *const names[EMBD_STEP_EXCHANGES] = { "size", "input", "output",
								 "gradient" };
	struct step_dist *d = s->dist;
	struct dist_pass *x = dpass(s);
	const char *what = names[which];
	int rc;

	d->roff[0] = 0;
	x->exchange_bytes[which] = 0;
	for (uint32_t p = 0; p < d->nodes; p++) {
		d->roff[p + 1] = d->roff[p] + d->rbytes[p];
		if (p != s->node)
			x->exchange_bytes[which] += d->sbytes[p];
	}
	recv->len = 0;
	if ((rc = vec_reserve(recv, d->roff[d->nodes], 1)))
		return step_fail(s, rc, "out of memory for the %s exchange", what);
	recv->len = d->roff[d->nodes];
	bool comm_failed;
	char err[256] = "";
	rc = step_lanes_exchange(s, d->comm, d->send.p, d->sbytes, recv->p, d->rbytes,
				 &comm_failed, err, sizeof(err));
	if (!rc)
		return 0;
	d->broken = true;
	if (comm_failed)
		describe_failure(s, rc, what);
	else
		snprintf(d->broken_msg, sizeof(d->broken_msg), "%s exchange: %.200s", what, err);
	embd_log_error("%s", d->broken_msg);
	return step_fail(s, rc, "%s", d->broken_msg);
}

static int refuse_broken(struct embd_step *s)
{
	/* the completion message holds ~100 bytes: what happens first */
	return step_fail(s, EMBD_EIO, "cluster re-forming after: %s", s->dist->broken_msg);
}

bool embd_step_comm_broken(const struct embd_step *s, const char **why)
{
	if (!s->dist || !s->dist->broken)
		return false;
	if (why)
		*why = s->dist->broken_msg;
	return true;
}

void embd_step_comm_break(struct embd_step *s, const char *why)
{
	struct step_dist *d = s->dist;

	if (!d || d->broken)
		return;
	d->broken = true;
	snprintf(d->broken_msg, sizeof(d->broken_msg), "%s", why);
}

int embd_step_comm_set(struct embd_step *s, struct embd_comm *comm, uint64_t gen)
{
	struct step_dist *d = s->dist;

	struct step_lanes *lanes;
	char err[256];

	if (!d || s->pending || embd_comm_size(comm) != d->nodes ||
	    embd_comm_rank(comm) != s->node)
		return EMBD_EINVAL;
	int rc = step_lanes_create(s, comm, &lanes, err, sizeof(err));
	if (rc) {
		embd_log_error("%s", err);
		return rc;
	}
	step_lanes_destroy(s->lanes);
	s->lanes = lanes;
	s->prepared = s->exchanged = false;
	d->comm = comm;
	d->seq = 0;             /* every node counts the new comm's exchanges from 0 */
	d->gen = gen;
	d->broken = false;
	d->broken_msg[0] = 0;
	return 0;
}

static void put_head(struct step_dist *d, uint8_t *at, int status, const char *why)
{
	struct wire_head h = { .magic = WIRE_MAGIC, .seq = d->seq, .status = status };
	snprintf(h.why, sizeof(h.why), "%s", why ? why : "");
	memcpy(at, &h, sizeof(h));
}

/* Reads and checks every peer's head of the exchange just done: the first failure any node
 * reported (by node order, so every node picks the same) fails the step with prefix. */
static int check_heads(struct embd_step *s, const struct vec *recv, struct wire_head *heads,
		       int fail_code, const char *prefix)
{
	struct step_dist *d = s->dist;

	for (uint32_t p = 0; p < d->nodes; p++) {
		char err[256];
		int rc = step_wire_head(p, (const uint8_t *)recv->p + d->roff[p], d->rbytes[p], d->seq,
					s->node, &heads[p], err, sizeof(err));
		if (rc == EMBD_EMISMATCH) {
			d->broken = true;
			snprintf(d->broken_msg, sizeof(d->broken_msg), "%s", err);
		}
		if (rc)
			return step_fail(s, rc, "%s", err);
	}
	for (uint32_t p = 0; p < d->nodes; p++)
		if (heads[p].status)
			return step_fail(s, fail_code ? fail_code : (int)heads[p].status,
					 "%s node %u: %s", prefix, p, heads[p].why);
	return 0;
}

/* ---- forward ----------------------------------------------------------------------------- */

static uint64_t item_wire_bytes(const struct step_item *it, bool lengths)
{
	const uint32_t B = it->bsize;

	return sizeof(struct wire_item) + (B + 1ull) * 8 + it->num_ids * 8 +
	       (it->weighted ? wire_pad8(it->num_ids * 4) : 0) + (lengths ? wire_pad8(B * 4ull) : 0);
}

/* Bytes of the pooled blocks of the items staged for node m (forward ones only, or all):
 * what OUTPUT brings back from m, and what GRADS sends to m. */
static uint64_t staged_block_bytes(const struct embd_step *s, uint32_t m, bool forward_only)
{
	const struct rank_io *io = &s->pass->io[s->num_ranks + m];
	uint64_t bytes = 0;

	for (uint64_t i = 0; m != s->node && i < io->items.len; i++) {
		const struct step_item *it = VEC_AT(io->items, struct step_item, i);
		if (it->forward || !forward_only)
			bytes += (uint64_t)it->bsize * s->shards[it->shard].desc.cols * 4;
	}
	return bytes;
}

/* Packs the staged items of node m at out (exactly item_wire_bytes each). */
static void pack_items(const struct embd_step *s, uint32_t m, uint8_t *out)
{
	const struct rank_io *io = &s->pass->io[s->num_ranks + m];

	for (uint64_t i = 0; i < io->items.len; i++) {
		const struct step_item *it = VEC_AT(io->items, struct step_item, i);
		const uint32_t B = it->bsize;
		const bool lengths = it->lengths_at != NO_INDEX;
		struct wire_item w = {
			.gtrainer = it->gtrainer, .feature = it->feature, .shard = it->shard,
			.flags = (it->weighted ? WIRE_WEIGHTED : 0) | (lengths ? WIRE_LENGTHS : 0) |
				 (it->forward ? WIRE_FORWARD : 0),
			.num_ids = it->num_ids, .batch_size = B,
		};
		memcpy(out, &w, sizeof(w));
		out += sizeof(w);
		memcpy(out, VEC_AT(io->offsets, int64_t, it->offsets_at), (B + 1ull) * 8);
		out += (B + 1ull) * 8;
		memcpy(out, VEC_AT(io->ids, int64_t, it->ids_at), it->num_ids * 8);
		out += it->num_ids * 8;
		if (it->weighted) {
			memset(out, 0, wire_pad8(it->num_ids * 4));
			memcpy(out, VEC_AT(io->weights, float, it->ids_at), it->num_ids * 4);
			out += wire_pad8(it->num_ids * 4);
		}
		if (lengths) {
			memset(out, 0, wire_pad8(B * 4ull));
			memcpy(out, VEC_AT(io->lengths, int32_t, it->lengths_at), B * 4ull);
			out += wire_pad8(B * 4ull);
		}
	}
}

/* One received item for shard (on this node) onto its rank's io. */
static int add_rx_item(struct embd_step *s, uint32_t shard, const struct step_item *proto,
		       bool forward, uint64_t *partial_at)
{
	const uint32_t cols = s->shards[shard].desc.cols;
	struct rank_io *io = &s->pass->io[s->shards[shard].local];
	struct step_item it = *proto;
	uint64_t at;
	int rc;

	it.shard = shard;
	it.forward = forward;
	if (forward && *partial_at == NO_INDEX &&
	    (rc = vec_take(&io->partial, (uint64_t)proto->bsize * cols, sizeof(float),
			   partial_at)))
		return rc;
	it.partial_at = forward ? *partial_at : NO_INDEX;
	if ((rc = vec_take(&io->items, 1, sizeof(it), &at)))
		return rc;
	*VEC_AT(io->items, struct step_item, at) = it;
	return 0;
}

/* step_wire_input's walk over one peer's INPUT message: grad_at, bytes into its GRADS. */
struct unpack {
	struct embd_step *s;
	uint64_t grad_at;
};

/* One checked item of peer p's INPUT message onto local items (step_wire_item_fn). */
static int unpack_item(void *arg, uint32_t p, uint64_t seq, const struct step_wire_item *w)
{
	struct unpack *u = arg;
	struct embd_step *s = u->s;
	struct dist_pass *x = dpass(s);
	const uint32_t B = w->batch_size;
	const struct step_shard *ss = &s->shards[w->shard];
	const struct step_table *t = &s->tables[ss->table];
	const bool dp = t->type == EMBD_SHARD_DATA_PARALLEL;
	uint64_t rx_at, partial_at = NO_INDEX;
	int rc;

	(void)seq;
	struct step_item proto = {
		.shard = w->shard, .feature = w->feature, .batch = NO_BATCH,
		.gtrainer = w->gtrainer, .bsize = B, .weighted = w->weighted, .num_ids = w->num_ids,
		.lengths_at = NO_INDEX, .partial_at = NO_INDEX, .peer = p, .rx = x->rx.len,
		.r_offsets = w->offsets, .r_ids = w->ids, .r_weights = w->weights,
		.r_lengths = w->lengths,
	};
	if ((rc = vec_take(&x->rx, 1, sizeof(struct wire_rx), &rx_at)))
		return rc;
	/* no output until the lookup wrote it (out_at set below) */
	*VEC_AT(x->rx, struct wire_rx, rx_at) = (struct wire_rx){
		.peer = p, .rank = ss->local, .cols = ss->desc.cols, .bsize = B, .forward = false,
		.out_at = NO_INDEX, .grad_at = u->grad_at,
	};
	u->grad_at += (uint64_t)B * ss->desc.cols * 4;
	/* data_parallel: every replica of this node trains on it, none looks it up */
	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *rs = &s->shards[t->first_shard + k];
		if ((dp ? rs->node == s->node : t->first_shard + k == w->shard) &&
		    (rc = add_rx_item(s, t->first_shard + k, &proto, !dp, &partial_at)))
			return rc;
	}
	VEC_AT(x->rx, struct wire_rx, rx_at)->forward = !dp;
	VEC_AT(x->rx, struct wire_rx, rx_at)->out_at = partial_at;
	return 0;
}

/* HELLO: sizes, accepted batches and flags with every node; the round's kind from every
 * node's flags (a ROUND_FOLLOW pass becomes an evaluation when the others evaluate). */
static int exchange_hello(struct embd_step *s, enum step_round round, const uint64_t *payload,
			  struct wire_head *heads)
{
	struct step_dist *d = s->dist;
	const uint32_t N = d->nodes;
	const size_t H = sizeof(struct wire_head);
	const bool eval = round == ROUND_EVAL;
	uint64_t mask = 0, total = 0;
	int rc;

	for (uint32_t i = 0; i < s->pass->num_batches; i++)
		mask |= (uint64_t)(s->pass->batches[i].status == 0) << i;
	for (uint32_t m = 0; m < N; m++)
		total += payload[m];
	d->send.len = 0;
	if ((rc = vec_reserve(&d->send, N * H + total, 1)))
		return step_fail(s, rc, "out of memory for the input exchange");
	for (uint32_t m = 0; m < N; m++) {
		/* an evaluation announces no gradient: its items never train */
		struct wire_head h = { .magic = WIRE_MAGIC, .seq = d->seq, .bytes = payload[m],
				       .out_bytes = staged_block_bytes(s, m, true),
				       .grad_bytes = eval ? 0 : staged_block_bytes(s, m, false),
				       .accepted_mask = mask,
				       .flags = eval ? WIRE_HELLO_EVAL :
						(s->ckpt_want ? WIRE_HELLO_CHECKPOINT : 0) |
						(round == ROUND_FOLLOW ? WIRE_HELLO_IDLE : 0) };
		memcpy((uint8_t *)d->send.p + m * H, &h, H);
		d->sbytes[m] = d->rbytes[m] = H;
	}
	if ((rc = exchange(s, &dpass(s)->in, EMBD_STEP_SIZES)))
		return rc;
	if ((rc = check_heads(s, &dpass(s)->in, heads, 0, "size exchange:")))
		return rc;
	bool round_eval = false;
	for (uint32_t p = 0; p < N && !rc; p++)
		/* sizes a sane peer of this version can send; anything else is a broken peer */
		rc = step_wire_hello(p, &heads[p], d->broken_msg, sizeof(d->broken_msg));
	/* a node that trains while another evaluates: their trainers disagree on the order */
	if (!rc)
		rc = step_wire_round(heads, N, s->node, &round_eval, d->broken_msg,
				     sizeof(d->broken_msg));
	if (rc) {
		d->broken = true;
		return step_fail(s, rc, "%s", d->broken_msg);
	}
	if (round_eval && !s->pass->eval) {
		/* ROUND_FOLLOW: no batch here, so the evaluation pass starts empty */
		s->pass = &s->eval;
		step_pass_begin(s, NULL, 0);
		memset(dpass(s)->exchange_bytes, 0, sizeof(dpass(s)->exchange_bytes));
	}
	return 0;
}

int step_dist_input(struct embd_step *s, enum step_round round)
{
	struct step_dist *d = s->dist;
	const uint32_t N = d->nodes;
	struct wire_head heads[N];
	uint64_t payload[N];
	int rc;

	d->seq++;
	memset(dpass(s)->exchange_bytes, 0, sizeof(dpass(s)->exchange_bytes));
	if (d->broken)
		return refuse_broken(s);
	for (uint32_t m = 0; m < N; m++) {
		const struct rank_io *io = &s->pass->io[s->num_ranks + m];
		payload[m] = 0;
		for (uint64_t i = 0; m != s->node && i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			payload[m] += item_wire_bytes(it, it->lengths_at != NO_INDEX);
		}
	}
	/* 1. HELLO */
	if ((rc = exchange_hello(s, round, payload, heads)))
		return rc;
	struct dist_pass *x = dpass(s);         /* the evaluation's, if the round is one */
	x->rx.len = 0;
	s->pass->cluster_accepted = 0;
	for (uint32_t p = 0; p < N; p++) {
		s->pass->cluster_accepted += (uint32_t)__builtin_popcountll(heads[p].accepted_mask);
		if (!s->pass->eval)
			s->cluster_ckpt |= (heads[p].flags & WIRE_HELLO_CHECKPOINT) != 0;
		x->out_expect[p] = p == s->node ? 0 : heads[p].out_bytes;
		x->grad_expect[p] = p == s->node ? 0 : heads[p].grad_bytes;
	}
	if (!s->pass->cluster_accepted)
		return 0;
	/* 2. INPUT: exactly the staged items, nothing to oneself */
	uint8_t *out = d->send.p;
	for (uint32_t m = 0; m < N; m++) {
		pack_items(s, m, out);
		out += payload[m];
		d->sbytes[m] = payload[m];
		d->rbytes[m] = m == s->node ? 0 : heads[m].bytes;
	}
	if ((rc = exchange(s, &x->in, EMBD_STEP_INPUT)))
		return rc;
	/* bad peer data fails the step everywhere: the OUTPUT head carries it */
	x->local_status = 0;
	x->why[0] = 0;
	for (uint32_t p = 0; p < N; p++) {
		x->rx_first[p] = x->rx.len;
		struct unpack u = { .s = s };
		/* the gradients p announced must be exactly those of the items it sent */
		if (!x->local_status)
			x->local_status = step_wire_input(&s->wire, p,
							  (const uint8_t *)x->in.p + d->roff[p],
							  d->rbytes[p], x->grad_expect[p],
							  s->pass->eval, unpack_item, &u, x->why,
							  sizeof(x->why));
	}
	x->rx_first[N] = x->rx.len;
	return 0;
}

/* Packs the pooled blocks of peer p's forward items (exactly want bytes: zeros for what
 * could not be looked up) after the head; false when the sizes disagree. */
static bool pack_outputs(const struct embd_step *s, uint32_t p, uint8_t *out, uint64_t want)
{
	const struct dist_pass *x = dpass(s);
	uint64_t at = 0;

	memset(out, 0, want);
	for (uint64_t j = x->rx_first[p]; j < x->rx_first[p + 1]; j++) {
		const struct wire_rx *r = VEC_AT(x->rx, struct wire_rx, j);
		uint64_t block = (uint64_t)r->bsize * r->cols * 4;
		if (!r->forward)
			continue;
		if (block > want - at)
			return false;
		memcpy(out + at, VEC_AT(s->pass->io[r->rank].partial, float, r->out_at), block);
		at += block;
	}
	return at == want || x->local_status;
}

int step_dist_output(struct embd_step *s, int status, const char *why)
{
	struct step_dist *d = s->dist;
	struct dist_pass *x = dpass(s);
	const uint32_t N = d->nodes, F = s->layout.num_features;
	const size_t H = sizeof(struct wire_head);
	struct wire_head heads[N];
	uint64_t total = 0;
	int rc;

	if (!status && x->local_status) {
		status = x->local_status;
		why = x->why;
	}
	for (uint32_t p = 0; p < N; p++)
		total += H + x->out_expect[p];
	d->send.len = 0;
	if ((rc = vec_reserve(&d->send, total, 1)))
		return step_fail(s, rc, "out of memory for the output exchange");
	uint8_t *out = d->send.p;
	for (uint32_t p = 0; p < N; p++) {
		bool fits = pack_outputs(s, p, out + H, x->out_expect[p]);
		if (!fits && !status) {
			status = EMBD_EPROTO;
			why = "the items received and the output expected disagree";
		}
		d->sbytes[p] = H + x->out_expect[p];
		out += d->sbytes[p];
	}
	/* the head goes in last: status may have changed while packing */
	out = d->send.p;
	for (uint32_t p = 0; p < N; p++) {
		put_head(d, out, status, why);
		out += d->sbytes[p];
	}
	/* what comes back: exactly the blocks of the forward items staged for each node */
	for (uint32_t m = 0; m < N; m++)
		d->rbytes[m] = H + staged_block_bytes(s, m, true);
	if ((rc = exchange(s, &x->out, EMBD_STEP_OUTPUT)))
		return rc;
	if ((rc = check_heads(s, &x->out, heads, 0, "lookup failed on")))
		return rc;
	/* the staged items' blocks, in staging order, become sources of the assembly */
	const uint32_t M = s->max_table_shards;
	for (uint32_t m = 0; m < N; m++) {
		const struct rank_io *io = &s->pass->io[s->num_ranks + m];
		const uint8_t *at = (const uint8_t *)x->out.p + d->roff[m] + H;
		for (uint64_t i = 0; m != s->node && i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (!it->forward)
				continue;
			const struct step_table *t = &s->tables[s->shards[it->shard].table];
			s->pass->sources[((uint64_t)it->batch * F + it->feature) * M + it->shard -
				   t->first_shard] = (const float *)at;
			at += (uint64_t)it->bsize * s->shards[it->shard].desc.cols * 4;
		}
	}
	return 0;
}

/* ---- backward ---------------------------------------------------------------------------- */

int step_dist_grads(struct embd_step *s, int status, const char *why)
{
	struct step_dist *d = s->dist;
	const struct dist_pass *x = &d->passes[s->cur];        /* train[cur]'s: in backward */
	const uint32_t N = d->nodes, D = s->layout.total_dim;
	const size_t H = sizeof(struct wire_head);
	struct wire_head heads[N];
	uint64_t total = 0;
	int rc;

	if (d->broken)
		return refuse_broken(s);
	for (uint32_t m = 0; m < N; m++) {
		d->sbytes[m] = H + staged_block_bytes(s, m, false);
		total += d->sbytes[m];
	}
	d->send.len = 0;
	if ((rc = vec_reserve(&d->send, total, 1)))
		return step_fail(s, rc, "out of memory for the gradient exchange");
	uint8_t *out = d->send.p;
	for (uint32_t m = 0; m < N; m++) {
		const struct rank_io *io = &s->pass->io[s->num_ranks + m];
		put_head(d, out, status, why);
		float *g = (float *)(out + H);
		for (uint64_t i = 0; m != s->node && i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			const struct embd_shard_desc *sd = &s->shards[it->shard].desc;
			const float *src = s->pass->batches[it->batch].pooled_grad;
			for (uint32_t b = 0; b < it->bsize; b++, g += sd->cols) {
				if (status || !src)
					memset(g, 0, sd->cols * 4ull);
				else
					memcpy(g, src + (uint64_t)b * D + s->offsets[it->feature] +
					       sd->col_offset, sd->cols * 4ull);
			}
		}
		out += d->sbytes[m];
		d->rbytes[m] = H + x->grad_expect[m];
	}
	if ((rc = exchange(s, &d->grad, EMBD_STEP_GRADS)))
		return rc;
	for (uint32_t p = 0; p <= N; p++)
		d->grad_off[p] = d->roff[p] + H;
	return check_heads(s, &d->grad, heads, EMBD_ECANCELED, "step aborted on");
}

const float *step_dist_grad_of(const struct embd_step *s, const struct step_item *it)
{
	const struct step_dist *d = s->dist;
	const struct wire_rx *r = VEC_AT(d->passes[s->cur].rx, struct wire_rx, it->rx);

	return (const float *)((const uint8_t *)d->grad.p + d->grad_off[it->peer] + r->grad_at);
}
