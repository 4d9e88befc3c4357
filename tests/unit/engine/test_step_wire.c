/*
 * The checks of what peer nodes send the step engine (engine/step_wire.h), on the plan of
 * tests/fuzz/step_wire_plan.h: a well-formed HELLO and INPUT pass with every item handed on
 * intact; each kind of malformed head or item is refused with EMBD_EPROTO (EMBD_EMISMATCH
 * for another step) and a message naming the node and the field, and no item after the bad
 * one is handed on.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "tests/fuzz/step_wire_plan.h"

#define CAP 4096

static uint8_t msg[CAP] __attribute__((aligned(8)));
static char err[256];

struct seen {
	uint32_t n;
	struct step_wire_item items[8];
	int fail_at;                    /* fn returns an error at this item (-1: never) */
};

static int collect(void *arg, uint32_t p, uint64_t seq, const struct step_wire_item *it)
{
	struct seen *s = arg;
	cr_assert_eq(p, WP_PEER);
	cr_assert_eq(seq, s->n);
	if ((int)s->n == s->fail_at)
		return EMBD_ENOMEM;
	s->items[s->n++] = *it;
	return 0;
}

static int input_of(uint64_t len, uint64_t grad_bytes, bool eval, struct seen *s)
{
	err[0] = 0;
	return step_wire_input(&wp_plan, WP_PEER, msg, len, grad_bytes, eval, collect, s, err,
			       sizeof(err));
}

static int input(uint64_t len, uint64_t grad_bytes, struct seen *s)
{
	return input_of(len, grad_bytes, false, s);
}

/* rc and an error naming node 1 and each of words. */
static void expect_refused(int rc, int want, const char *const *words)
{
	cr_expect_eq(rc, want, "expected %d, got %d (%s)", want, rc, err);
	cr_expect(strstr(err, "node 1") != NULL, "expected the error to name node 1: '%s'", err);
	for (; *words; words++)
		cr_expect(strstr(err, *words) != NULL, "expected '%s' in '%s'", *words, err);
}

#define REFUSED(rc, want, ...) expect_refused(rc, want, (const char *[]){ __VA_ARGS__, NULL })

Test(step_wire, good_input_hands_on_every_item)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);

	cr_assert_eq(input(len, grads, &s), 0, "%s", err);
	cr_assert_eq(s.n, 3);
	cr_expect(s.items[0].forward && !s.items[0].weighted && !s.items[0].lengths);
	cr_expect_eq(s.items[0].ids[1], 49);
	cr_expect_eq(s.items[1].shard, 1);
	cr_expect_eq(s.items[1].lengths[3], 2);
	cr_expect(!s.items[2].forward && s.items[2].weighted);
	cr_expect_eq(s.items[2].weights[3], -1.0f);
	cr_expect_eq(s.items[2].offsets[WP_B], 4);
	cr_expect_eq(input(0, 0, &s), 0, "an empty message is no items: %s", err);
}

Test(step_wire, good_hello_passes)
{
	struct wire_head h = wp_hello(64, 32), got;

	memcpy(msg, &h, sizeof(h));
	cr_assert_eq(step_wire_head(WP_PEER, msg, sizeof(h), WP_SEQ, 0, &got, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(step_wire_hello(WP_PEER, &got, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(got.grad_bytes, 32);
}

static int head_of(const struct wire_head *h, uint64_t len)
{
	struct wire_head got;
	memcpy(msg, h, sizeof(*h));
	return step_wire_head(WP_PEER, msg, len, WP_SEQ, 0, &got, err, sizeof(err));
}

Test(step_wire, bad_magic)
{
	struct wire_head h = wp_hello(0, 0);
	h.magic ^= 1;
	REFUSED(head_of(&h, sizeof(h)), EMBD_EMISMATCH, "magic");
}

Test(step_wire, wrong_seq)
{
	struct wire_head h = wp_hello(0, 0);
	h.seq = WP_SEQ + 1;
	REFUSED(head_of(&h, sizeof(h)), EMBD_EMISMATCH, "step exchange 8", "node 0 at 7");
}

Test(step_wire, short_head)
{
	struct wire_head h = wp_hello(0, 0);
	REFUSED(head_of(&h, sizeof(h) - 1), EMBD_EPROTO, "less than a head");
}

Test(step_wire, why_is_terminated)
{
	struct wire_head h = wp_hello(0, 0), got;
	memset(h.why, 'x', sizeof(h.why));
	memcpy(msg, &h, sizeof(h));
	cr_assert_eq(step_wire_head(WP_PEER, msg, sizeof(h), WP_SEQ, 0, &got, err, sizeof(err)), 0);
	cr_expect_eq(strlen(got.why), sizeof(got.why) - 1);
}

Test(step_wire, oversize_byte_counts)
{
	struct wire_head h = wp_hello(MAX_MESSAGE_BYTES + 8, 0);
	REFUSED(step_wire_hello(WP_PEER, &h, err, sizeof(err)), EMBD_EPROTO, "announced messages");
	h = wp_hello(0, UINT64_MAX);
	REFUSED(step_wire_hello(WP_PEER, &h, err, sizeof(err)), EMBD_EPROTO, "announced messages");
	h = wp_hello(0, 0);
	h.out_bytes = MAX_MESSAGE_BYTES + 1;
	REFUSED(step_wire_hello(WP_PEER, &h, err, sizeof(err)), EMBD_EPROTO, "announced messages");
}

Test(step_wire, unknown_hello_flags)
{
	struct wire_head h = wp_hello(0, 0);
	h.flags = WIRE_HELLO_CHECKPOINT | WIRE_HELLO_EVAL | WIRE_HELLO_IDLE;
	cr_expect_eq(step_wire_hello(WP_PEER, &h, err, sizeof(err)), 0, "%s", err);
	h.flags = 8;
	REFUSED(step_wire_hello(WP_PEER, &h, err, sizeof(err)), EMBD_EPROTO, "unknown flags 0x8");
}

/* The round three nodes' HELLO flags make (node 2 names itself in messages). */
static int round_of(uint64_t f0, uint64_t f1, uint64_t f2, bool *eval)
{
	struct wire_head h[3] = { wp_hello(0, 0), wp_hello(0, 0), wp_hello(0, 0) };
	h[0].flags = f0;
	h[1].flags = f1;
	h[2].flags = f2;
	err[0] = 0;
	*eval = false;
	return step_wire_round(h, 3, 2, eval, err, sizeof(err));
}

Test(step_wire, round_kind_from_every_node)
{
	const uint64_t E = WIRE_HELLO_EVAL, I = WIRE_HELLO_IDLE, C = WIRE_HELLO_CHECKPOINT;
	bool eval;

	cr_expect_eq(round_of(0, C, 0, &eval), 0, "%s", err);
	cr_expect(!eval, "every node trains: a training step");
	cr_expect_eq(round_of(E, E, E, &eval), 0, "%s", err);
	cr_expect(eval, "every node evaluates: an evaluation");
	cr_expect_eq(round_of(E, I, E, &eval), 0, "%s", err);
	cr_expect(eval, "an idle node follows the evaluation");
	cr_expect_eq(round_of(I, 0, I | C, &eval), 0, "%s", err);
	cr_expect(!eval, "idle nodes follow the training step");
	cr_expect_eq(round_of(I, I, I, &eval), 0, "%s", err);
	cr_expect(!eval, "every node idle: a training step of no batch");
	cr_expect_eq(round_of(E, 0, I, &eval), EMBD_EMISMATCH);
	cr_expect(strstr(err, "node 1 runs a training step while node 0 evaluates") &&
		  strstr(err, "this is node 2"), "got '%s'", err);
	cr_expect_eq(round_of(I, E | I, 0, &eval), EMBD_EPROTO);
	cr_expect(strstr(err, "node 1") != NULL, "got '%s'", err);
}

Test(step_wire, evaluation_announces_no_gradient)
{
	struct wire_head h[2] = { wp_hello(0, 0), wp_hello(0, 16) };
	bool eval;

	h[0].flags = h[1].flags = WIRE_HELLO_EVAL;
	REFUSED(step_wire_round(h, 2, 0, &eval, err, sizeof(err)), EMBD_EPROTO,
		"16 gradient bytes");
}

/* An evaluation: the table_wise and row_wise items pass with no gradient announced; the
 * data_parallel one is refused (every node evaluates its own replica). */
Test(step_wire, evaluation_items)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);
	REFUSED(input_of(len, 0, true, &s), EMBD_EPROTO, "item 2", "data_parallel");
	cr_expect_eq(s.n, 2);
	s.n = 0;
	uint64_t at = 0;
	static const int32_t lens[WP_B] = { 1, 0, 2, 1 };
	static const int64_t ids[4] = { 3, 1, 2, 9 };
	wp_put_item(msg, &at, 0, 0, WIRE_FORWARD, WP_B, lens, ids, NULL, NULL);
	cr_expect_eq(input_of(at, 0, true, &s), 0, "%s", err);
	cr_expect_eq(s.n, 1);
	s.n = 0;
	REFUSED(input_of(at, 64, true, &s), EMBD_EPROTO, "gradient bytes");
}

Test(step_wire, input_bytes_not_whole_items)
{
	struct wire_head h = wp_hello(36, 0);
	REFUSED(step_wire_hello(WP_PEER, &h, err, sizeof(err)), EMBD_EPROTO, "input message of 36");
}

/* The good message with item k's head changed by edit. */
static uint64_t edit_item(uint32_t k, void (*edit)(struct wire_item *), uint64_t *grads)
{
	uint64_t len = wp_good_input(msg, grads), at = 0;
	for (uint32_t i = 0; i < k; i++) {
		struct wire_item w;
		memcpy(&w, msg + at, sizeof(w));
		at += sizeof(w) + (WP_B + 1) * 8 + w.num_ids * 8 +
		      (w.flags & WIRE_WEIGHTED ? wire_pad8(w.num_ids * 4) : 0) +
		      (w.flags & WIRE_LENGTHS ? wire_pad8(WP_B * 4) : 0);
	}
	struct wire_item w;
	memcpy(&w, msg + at, sizeof(w));
	edit(&w);
	memcpy(msg + at, &w, sizeof(w));
	return len;
}

static void huge_count(struct wire_item *w) { w->num_ids = UINT64_MAX / 4; }
static void one_more_id(struct wire_item *w) { w->num_ids++; }
static void foreign_shard(struct wire_item *w) { w->shard = 2; }
static void no_such_shard(struct wire_item *w) { w->shard = 99; }
static void other_feature(struct wire_item *w) { w->feature = 0; }
static void other_trainer(struct wire_item *w) { w->gtrainer = 1; }
static void no_lengths(struct wire_item *w) { w->flags &= ~WIRE_LENGTHS; }
static void unknown_flag(struct wire_item *w) { w->flags |= 8; }
static void no_samples(struct wire_item *w) { w->batch_size = 0; }
static void too_many_samples(struct wire_item *w) { w->batch_size = WP_B + 1; }
static void reserved_set(struct wire_item *w) { w->reserved = 1; }

static void expect_item_refused(uint32_t k, void (*edit)(struct wire_item *),
				const char *const *words)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = edit_item(k, edit, &grads);
	expect_refused(input(len, grads, &s), EMBD_EPROTO, words);
	cr_expect_eq(s.n, k, "items before the bad one are handed on: expected %u, got %u", k,
		     s.n);
}

#define ITEM_REFUSED(k, edit, ...) \
	expect_item_refused(k, edit, (const char *[]){ __VA_ARGS__, NULL })

Test(step_wire, item_count_that_overruns) { ITEM_REFUSED(2, huge_count, "ends inside item 2"); }
Test(step_wire, item_count_one_too_many) { ITEM_REFUSED(1, one_more_id, "item 1"); }
Test(step_wire, shard_of_another_node) { ITEM_REFUSED(1, foreign_shard, "shard 2", "item 1"); }
Test(step_wire, shard_out_of_the_plan) { ITEM_REFUSED(0, no_such_shard, "shard 99"); }
Test(step_wire, feature_of_another_table) { ITEM_REFUSED(1, other_feature, "feature 0"); }
Test(step_wire, trainer_of_another_node) { ITEM_REFUSED(0, other_trainer, "trainer"); }
Test(step_wire, mean_lengths_missing) { ITEM_REFUSED(1, no_lengths, "flags"); }
Test(step_wire, unknown_flag) { ITEM_REFUSED(2, unknown_flag, "flags 0x9"); }
Test(step_wire, batch_of_no_samples) { ITEM_REFUSED(1, no_samples, "item 1", "batch_size 0"); }
Test(step_wire, batch_over_the_plan) { ITEM_REFUSED(0, too_many_samples, "batch_size 5 (1..4)"); }
Test(step_wire, item_reserved_word) { ITEM_REFUSED(2, reserved_set, "reserved 1"); }

/* A trainer's short last batch: items of 1 and 3 samples, each with b + 1 offsets, b full
 * lengths and b x cols of gradient. */
Test(step_wire, short_batches_pass_with_their_own_size)
{
	static const int32_t lens[3] = { 2, 0, 1 }, full[3] = { 2, 1, 1 };
	static const int64_t ids[3] = { 4, 5, 6 };
	struct seen s = { .fail_at = -1 };
	uint64_t at = 0, grads;

	grads = wp_put_item(msg, &at, 1, 1, WIRE_FORWARD | WIRE_LENGTHS, 3, lens, ids, NULL, full);
	grads += wp_put_item(msg, &at, 0, 0, WIRE_FORWARD, 1, lens, ids, NULL, NULL);
	cr_assert_eq(grads, (3 * 8 + 1 * 4) * 4ull);
	cr_assert_eq(input(at, grads, &s), 0, "%s", err);
	cr_assert_eq(s.n, 2);
	cr_expect_eq(s.items[0].batch_size, 3);
	cr_expect_eq(s.items[0].offsets[3], 3);
	cr_expect_eq(s.items[0].lengths[1], 1);
	cr_expect_eq(s.items[1].batch_size, 1);
	cr_expect_eq(s.items[1].num_ids, 2);
	cr_expect_eq(s.items[1].ids[1], 5);
	/* a gradient announced for full batches does not fit short ones */
	s.n = 0;
	REFUSED(input(at, (3 * 8 + 1 * 4) * 4ull * WP_B, &s), EMBD_EPROTO, "gradient bytes");
}

/* The flag promises weights the message does not hold: they would be read past its end. */
Test(step_wire, weights_flag_with_no_weights)
{
	static const int32_t lens[WP_B] = { 1, 1, 1, 1 };
	static const int64_t ids[4] = { 1, 2, 3, 4 };
	struct seen s = { .fail_at = -1 };
	uint64_t at = 0, grads;

	grads = wp_put_item(msg, &at, 0, 0, WIRE_FORWARD | WIRE_WEIGHTED, WP_B, lens, ids, NULL,
			    NULL);
	REFUSED(input(at, grads, &s), EMBD_EPROTO, "ends inside item 0");
	cr_expect_eq(s.n, 0);
}

Test(step_wire, truncated_item_arrays)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);

	for (uint64_t cut = 8; cut < len; cut += 8) {
		s.n = 0;
		int rc = input(len - cut, grads, &s);
		cr_expect_eq(rc, EMBD_EPROTO, "cut by %llu: expected EPROTO, got %d",
			     (unsigned long long)cut, rc);
		cr_expect(strstr(err, "node 1") != NULL, "cut by %llu: '%s'",
			  (unsigned long long)cut, err);
	}
}

/* Offsets, ids and lengths of the first item (table 0, ids at 24 + 5 * 8) or the second. */
static int64_t *item0_offsets(void) { return (int64_t *)(msg + sizeof(struct wire_item)); }
static int64_t *item0_ids(void) { return item0_offsets() + WP_B + 1; }

Test(step_wire, offsets_not_ending_at_num_ids)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);
	item0_offsets()[WP_B] = 3;
	REFUSED(input(len, grads, &s), EMBD_EPROTO, "item 0", "offsets");
}

Test(step_wire, offsets_decreasing)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);
	item0_offsets()[1] = INT64_MAX;
	item0_offsets()[2] = INT64_MIN;
	REFUSED(input(len, grads, &s), EMBD_EPROTO, "offsets decrease at bag 1");
}

Test(step_wire, ids_out_of_the_shard_rows)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);

	item0_ids()[1] = 50;
	REFUSED(input(len, grads, &s), EMBD_EPROTO, "ids[1] 50", "shard 0", "[0, 50)");
	item0_ids()[1] = -1;
	REFUSED(input(len, grads, &s), EMBD_EPROTO, "ids[1] -1");
	/* row-wise: shard 1 holds rows [0, 20) only; 25 is node 1's */
	len = wp_good_input(msg, &grads);
	uint64_t at = sizeof(struct wire_item) + (WP_B + 1) * 8 + 4 * 8;
	int64_t *ids = (int64_t *)(msg + at + sizeof(struct wire_item) + (WP_B + 1) * 8);
	ids[0] = 25;
	REFUSED(input(len, grads, &s), EMBD_EPROTO, "item 1", "ids[0] 25", "[0, 20)");
}

Test(step_wire, mean_lengths_shorter_than_the_bag)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);
	/* item 1's full lengths are its last 16 bytes before item 2 */
	uint64_t at = 2 * (sizeof(struct wire_item) + (WP_B + 1) * 8 + 4 * 8) + 16;
	int32_t *full = (int32_t *)(msg + at - 16);
	full[0] = 1;    /* bag 0 has 2 ids here */
	REFUSED(input(len, grads, &s), EMBD_EPROTO, "lengths[0] 1");
}

Test(step_wire, gradient_bytes_announced_wrong)
{
	struct seen s = { .fail_at = -1 };
	uint64_t grads, len = wp_good_input(msg, &grads);
	REFUSED(input(len, grads + 4, &s), EMBD_EPROTO, "gradient bytes");
	cr_expect_eq(s.n, 3);
}

Test(step_wire, callback_error_stops_the_walk)
{
	struct seen s = { .fail_at = 1 };
	uint64_t grads, len = wp_good_input(msg, &grads);
	cr_expect_eq(input(len, grads, &s), EMBD_ENOMEM);
	cr_expect_eq(s.n, 1);
}
