/*
 * engine/step_wire.c - the checks of what peer nodes send the step engine (step_wire.h).
 * The walk over an INPUT message bounds every length against the bytes left before it reads
 * or multiplies with it (counts come from the peer: num_ids * 8 is only formed once num_ids
 * is known to fit), and reads each array of the message once, in order.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "engine/step_wire.h"

int step_wire_head(uint32_t p, const uint8_t *msg, uint64_t len, uint64_t seq, uint32_t self,
		   struct wire_head *head, char *err, size_t err_len)
{
	if (len < sizeof(*head)) {
		snprintf(err, err_len, "node %u sent %" PRIu64 " bytes, less than a head", p, len);
		return EMBD_EPROTO;
	}
	memcpy(head, msg, sizeof(*head));
	head->why[sizeof(head->why) - 1] = 0;
	if (head->magic != WIRE_MAGIC || head->seq != seq) {
		snprintf(err, err_len, "node %u is at step exchange %" PRIu64 " (magic %016" PRIx64
			 "), node %u at %" PRIu64, p, head->seq, head->magic, self, seq);
		return EMBD_EMISMATCH;
	}
	return 0;
}

int step_wire_hello(uint32_t p, const struct wire_head *head, char *err, size_t err_len)
{
	if (head->bytes > MAX_MESSAGE_BYTES || head->out_bytes > MAX_MESSAGE_BYTES ||
	    head->grad_bytes > MAX_MESSAGE_BYTES) {
		snprintf(err, err_len, "node %u announced messages of %" PRIu64 "/%" PRIu64 "/%"
			 PRIu64 " bytes", p, head->bytes, head->out_bytes, head->grad_bytes);
		return EMBD_EPROTO;
	}
	if (head->bytes % 8) {
		snprintf(err, err_len, "node %u announced an input message of %" PRIu64 " bytes, "
			 "not whole items", p, head->bytes);
		return EMBD_EPROTO;
	}
	if (head->flags & ~(uint64_t)WIRE_HELLO_KNOWN) {
		snprintf(err, err_len, "node %u sent unknown flags 0x%" PRIx64 " in its sizes message", p,
			 head->flags);
		return EMBD_EPROTO;
	}
	return 0;
}

int step_wire_round(const struct wire_head *heads, uint32_t n, uint32_t self, bool *eval,
		    char *err, size_t err_len)
{
	int64_t trains = -1, evaluates = -1;

	for (uint32_t p = 0; p < n; p++) {
		const bool ev = heads[p].flags & WIRE_HELLO_EVAL;
		if (ev && (heads[p].flags & WIRE_HELLO_IDLE)) {
			snprintf(err, err_len, "node %u sent a sizes message both idle and "
				 "evaluating", p);
			return EMBD_EPROTO;
		}
		if (ev && heads[p].grad_bytes) {
			snprintf(err, err_len, "node %u announced %" PRIu64 " gradient bytes for an "
				 "evaluation", p, heads[p].grad_bytes);
			return EMBD_EPROTO;
		}
		if (ev && evaluates < 0)
			evaluates = p;
		if (!ev && !(heads[p].flags & WIRE_HELLO_IDLE) && trains < 0)
			trains = p;
	}
	if (trains >= 0 && evaluates >= 0) {
		snprintf(err, err_len, "node %lld runs a training step while node %lld evaluates "
			 "(this is node %u): every trainer of the cluster must post its evaluations "
			 "at the same point of its steps", (long long)trains, (long long)evaluates,
			 self);
		return EMBD_EMISMATCH;
	}
	*eval = evaluates >= 0;
	return 0;
}

/* The item's head: a shard of this node, a feature of its table, a trainer of p, the flags
 * of its table (an evaluation has no data_parallel item). */
static int check_item_head(const struct step_wire_plan *s, uint32_t p, uint64_t seq,
			   const struct wire_item *w, bool eval, char *err, size_t err_len)
{
	if (w->shard >= s->num_shards || s->shards[w->shard].node != s->node) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": shard %u is not on node %u",
			 p, seq, w->shard, s->node);
		return EMBD_EPROTO;
	}
	const struct step_wire_shard *ss = &s->shards[w->shard];
	if (w->feature >= s->num_features || s->feature_tables[w->feature] != ss->table) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": feature %u is not one of "
			 "shard %u's table %u", p, seq, w->feature, w->shard, ss->table);
		return EMBD_EPROTO;
	}
	if ((w->gtrainer >> 16) != p) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": trainer %#x is not node "
			 "%u's", p, seq, w->gtrainer, p);
		return EMBD_EPROTO;
	}
	if (w->batch_size == 0 || w->batch_size > s->batch_size || w->reserved) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": batch_size %u (1..%u), "
			 "reserved %u", p, seq, w->batch_size, s->batch_size, w->reserved);
		return EMBD_EPROTO;
	}
	const struct step_wire_table *t = &s->tables[ss->table];
	const bool dp = t->type == EMBD_SHARD_DATA_PARALLEL;
	const bool row_split = t->type == EMBD_SHARD_ROW_WISE || t->type == EMBD_SHARD_TABLE_ROW_WISE;
	const bool lengths = row_split && t->pooling == EMBD_POOLING_MEAN;
	if (dp && eval) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": table %u is data_parallel, "
			 "which every node evaluates in its own replica", p, seq, ss->table);
		return EMBD_EPROTO;
	}
	if (!!(w->flags & WIRE_FORWARD) != !dp || !!(w->flags & WIRE_LENGTHS) != lengths ||
	    (w->flags & ~7u)) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": flags %#x do not fit "
			 "table %u", p, seq, w->flags, ss->table);
		return EMBD_EPROTO;
	}
	return 0;
}

/* The item's arrays: offsets 0 .. num_ids, non-decreasing; ids in the shard's rows; each
 * full bag length at least the bag's ids here. */
static int check_item_data(const struct step_wire_plan *s, uint32_t p, uint64_t seq,
			   const struct step_wire_item *it, char *err, size_t err_len)
{
	const uint32_t B = it->batch_size;
	const struct step_wire_shard *d = &s->shards[it->shard];

	if (it->offsets[0] != 0 || it->offsets[B] != (int64_t)it->num_ids) {
		snprintf(err, err_len, "from node %u, item %" PRIu64 ": offsets [%lld .. %lld] "
			 "for %" PRIu64 " ids", p, seq, (long long)it->offsets[0],
			 (long long)it->offsets[B], it->num_ids);
		return EMBD_EPROTO;
	}
	for (uint32_t b = 0; b < B; b++) {
		if (it->offsets[b + 1] < it->offsets[b]) {
			snprintf(err, err_len, "from node %u, item %" PRIu64 ": offsets decrease at "
				 "bag %u", p, seq, b);
			return EMBD_EPROTO;
		}
		/* both are >= offsets[0] == 0: no overflow */
		int64_t n = it->offsets[b + 1] - it->offsets[b];
		if (it->lengths && it->lengths[b] < n) {
			snprintf(err, err_len, "from node %u, item %" PRIu64 ": lengths[%u] %d, "
				 "less than the bag's %lld ids", p, seq, b, it->lengths[b],
				 (long long)n);
			return EMBD_EPROTO;
		}
	}
	for (uint64_t i = 0; i < it->num_ids; i++)
		if (it->ids[i] < d->row_offset || it->ids[i] - d->row_offset >= d->rows) {
			snprintf(err, err_len, "from node %u, item %" PRIu64 ": ids[%" PRIu64 "] "
				 "%lld outside shard %u's rows [%lld, %lld)", p, seq, i,
				 (long long)it->ids[i], it->shard, (long long)d->row_offset,
				 (long long)(d->row_offset + d->rows));
			return EMBD_EPROTO;
		}
	return 0;
}

int step_wire_input(const struct step_wire_plan *s, uint32_t p, const uint8_t *buf, uint64_t len,
		    uint64_t grad_bytes, bool eval, step_wire_item_fn fn, void *arg, char *err,
		    size_t err_len)
{
	uint64_t at = 0, seq = 0, grads = 0;
	int rc;

	for (; at < len; seq++) {
		struct wire_item w;
		if (len - at < sizeof(w))
			goto bad_size;
		memcpy(&w, buf + at, sizeof(w));
		at += sizeof(w);
		if ((rc = check_item_head(s, p, seq, &w, eval, err, err_len)))
			return rc;
		const bool weighted = w.flags & WIRE_WEIGHTED, lengths = w.flags & WIRE_LENGTHS;
		const uint32_t B = w.batch_size;        /* checked: 1 .. the plan's */
		if (w.num_ids > (len - at) / 8)
			goto bad_size;
		uint64_t need = (B + 1ull) * 8 + w.num_ids * 8 +
				(weighted ? wire_pad8(w.num_ids * 4) : 0) +
				(lengths ? wire_pad8(B * 4ull) : 0);
		if (need > len - at)
			goto bad_size;
		/* the buffer is 8-aligned and every part a multiple of 8 bytes */
		const int64_t *offsets = (const int64_t *)(buf + at);
		struct step_wire_item it = {
			.gtrainer = w.gtrainer, .feature = w.feature, .shard = w.shard,
			.batch_size = B, .weighted = weighted, .forward = w.flags & WIRE_FORWARD,
			.num_ids = w.num_ids, .offsets = offsets, .ids = offsets + B + 1,
			.weights = weighted ? (const float *)(offsets + B + 1 + w.num_ids) : NULL,
			.lengths = lengths ? (const int32_t *)(buf + at + need - wire_pad8(B * 4ull)) :
				   NULL,
		};
		at += need;
		if ((rc = check_item_data(s, p, seq, &it, err, err_len)))
			return rc;
		if ((rc = fn(arg, p, seq, &it)))
			return rc;
		if (!eval)
			grads += (uint64_t)B * s->shards[w.shard].cols * 4;
	}
	/* the gradients p announced must be exactly those of the items it sent */
	if (grads != grad_bytes) {
		snprintf(err, err_len, "node %u announced %" PRIu64 " gradient bytes for items of %"
			 PRIu64, p, grad_bytes, grads);
		return EMBD_EPROTO;
	}
	return 0;
bad_size:
	snprintf(err, err_len, "from node %u: input message of %" PRIu64 " bytes ends inside item "
		 "%" PRIu64, p, len, seq);
	return EMBD_EPROTO;
}
