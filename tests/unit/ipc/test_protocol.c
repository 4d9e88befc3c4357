/*
 * Tests for ipc/protocol.h: a good FORWARD passes; each bad field is refused with an error
 * that names it; the KJT view checks lengths from a private copy.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "ipc/protocol.h"

#define F 2
#define B 3
#define DIM 4

static const struct embd_batch_limits lim = {
	.slab_bytes = 4096, .num_features = F, .batch_size = B, .total_dim = DIM, .max_values = 64,
};

static struct embd_sqe good_forward(void)
{
	struct embd_sqe s = {
		.opcode = EMBD_OP_FORWARD, .batch_size = B, .user_data = 9, .step = 1, .num_values = 6,
		.lengths = { 0, F * B * 4 }, .values = { 64, 6 * 8 }, .output = { 1024, B * DIM * 4 },
	};
	return s;
}

static void expect_bad(struct embd_sqe s, int want_rc, const char *field)
{
	char err[256] = "";
	int rc = embd_sqe_validate(&s, &lim, err, sizeof(err));

	cr_expect_eq(rc, want_rc, "%s: expected %d, got %d (%s)", field, want_rc, rc, err);
	cr_expect(strstr(err, field) != NULL, "expected the error to name %s, got \"%s\"", field, err);
}

Test(protocol, good_descriptors_pass)
{
	char err[256] = "";
	struct embd_sqe s = good_forward();
	struct embd_sqe nop = { .opcode = EMBD_OP_NOP };

	cr_assert_eq(embd_sqe_validate(&s, &lim, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_sqe_validate(&nop, &lim, err, sizeof(err)), 0, "%s", err);
	s.opcode = EMBD_OP_BACKWARD;
	s.grad = s.output;
	s.output = (struct embd_slab_span){ 0, 0 };
	cr_assert_eq(embd_sqe_validate(&s, &lim, err, sizeof(err)), 0, "%s", err);
}

Test(protocol, every_bad_field_is_named)
{
	struct embd_sqe s;

	s = good_forward(); s.opcode = 77; expect_bad(s, EMBD_EINVAL, "sqe.opcode");
	s = good_forward(); s.flags = 0x80; expect_bad(s, EMBD_EINVAL, "sqe.flags");
	s = good_forward(); s.reserved[1] = 1; expect_bad(s, EMBD_EINVAL, "sqe.reserved");
	s = good_forward(); s.batch_size = B + 1; expect_bad(s, EMBD_EINVAL, "sqe.batch_size");
	s = good_forward(); s.batch_size = 0; expect_bad(s, EMBD_EINVAL, "sqe.batch_size");
	/* a short batch's spans are sized by its own samples */
	s = good_forward(); s.batch_size = 2; expect_bad(s, EMBD_EINVAL, "sqe.lengths.bytes");
	s = good_forward(); s.batch_size = 2; s.lengths.bytes = F * 2 * 4;
	expect_bad(s, EMBD_EINVAL, "sqe.output.bytes");
	s = good_forward(); s.num_values = 65; expect_bad(s, EMBD_ERANGE, "sqe.num_values");
	s = good_forward(); s.lengths.bytes = 20; expect_bad(s, EMBD_EINVAL, "sqe.lengths.bytes");
	s = good_forward(); s.lengths.offset = 4094; expect_bad(s, EMBD_EINVAL, "sqe.lengths.offset");
	s = good_forward(); s.values.offset = 4; expect_bad(s, EMBD_EINVAL, "sqe.values.offset");
	s = good_forward(); s.values.offset = 4096; expect_bad(s, EMBD_ERANGE, "sqe.values");
	s = good_forward(); s.values.offset = UINT64_MAX - 7; expect_bad(s, EMBD_ERANGE, "sqe.values");
	s = good_forward(); s.num_values = UINT64_MAX / 4; s.values.bytes = 0;
	expect_bad(s, EMBD_ERANGE, "sqe.num_values");
	s = good_forward(); s.weights.bytes = 24; expect_bad(s, EMBD_EINVAL, "sqe.weights");
	s = good_forward(); s.flags = EMBD_SQE_WEIGHTED; expect_bad(s, EMBD_EINVAL, "sqe.weights.bytes");
	s = good_forward(); s.grad = s.output; expect_bad(s, EMBD_EINVAL, "sqe.grad");
	s = good_forward(); s.output.offset = 4060; expect_bad(s, EMBD_ERANGE, "sqe.output");
	s = good_forward(); s.output.offset = 64; expect_bad(s, EMBD_EINVAL, "sqe.output: overlaps sqe.values");
	s = good_forward(); s.opcode = EMBD_OP_BACKWARD; expect_bad(s, EMBD_EINVAL, "sqe.output");
	s = (struct embd_sqe){ .opcode = EMBD_OP_NOP, .num_values = 1 };
	expect_bad(s, EMBD_EINVAL, "sqe.num_values");
	/* an evaluation: a forward's spans, no step */
	s = good_forward(); s.opcode = EMBD_OP_EVAL; expect_bad(s, EMBD_EINVAL, "sqe.step");
	s = good_forward(); s.opcode = EMBD_OP_EVAL; s.step = 0; s.grad = s.output;
	expect_bad(s, EMBD_EINVAL, "sqe.grad: must be empty (offset 0, bytes 0) for EVAL");
}

Test(protocol, kjt_view_checks_lengths)
{
	_Alignas(8) unsigned char slab[4096] = { 0 };
	int32_t lengths[F * B] = { 1, 0, 2, 1, 1, 1 }, priv[F * B];
	struct embd_sqe s = good_forward();
	struct embd_kjt kjt;
	char err[256] = "";

	memcpy(slab, lengths, sizeof(lengths));
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B, &kjt, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(kjt.lengths, priv, "lengths must point to the private copy");
	cr_assert_eq(kjt.num_values, 6u);
	cr_assert_eq((const void *)kjt.values, (const void *)(slab + 64));
	cr_assert_null(kjt.weights);
	/* the client changes the shared lengths afterwards: the private copy is unaffected */
	((int32_t *)slab)[0] = 1000;
	cr_assert_eq(kjt.lengths[0], 1);

	((int32_t *)slab)[0] = 2;       /* sum 7 != num_values 6 */
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B, &kjt, err, sizeof(err)), EMBD_EINVAL);
	cr_assert(strstr(err, "sum to 7"), "got \"%s\"", err);
	((int32_t *)slab)[0] = 1;
	((int32_t *)slab)[4] = -1;
	((int32_t *)slab)[5] = 3;
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B, &kjt, err, sizeof(err)), EMBD_EINVAL);
	cr_assert(strstr(err, "lengths[4] (feature 1, sample 1): negative"), "got \"%s\"", err);
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B - 1, &kjt, err, sizeof(err)), EMBD_ENOSPC);
	/* an evaluation is a forward without a step */
	((int32_t *)slab)[4] = 1;
	((int32_t *)slab)[5] = 1;
	s.opcode = EMBD_OP_EVAL;
	s.step = 0;
	cr_assert_eq(embd_sqe_validate(&s, &lim, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B, &kjt, err, sizeof(err)), 0,
		     "%s", err);
	cr_expect_eq(kjt.num_values, 6u);
}

/* A batch of 2 samples (B is 3): its lengths are F x 2 with stride 2, its output 2 rows. */
Test(protocol, short_batch_has_its_own_sizes)
{
	_Alignas(8) unsigned char slab[4096] = { 0 };
	int32_t lengths[F * 2] = { 1, 2, 0, 3 }, priv[F * B];
	struct embd_sqe s = good_forward();
	struct embd_kjt kjt;
	char err[256] = "";

	s.batch_size = 2;
	s.lengths.bytes = F * 2 * 4;
	s.output.bytes = 2 * DIM * 4;
	cr_assert_eq(embd_sqe_validate(&s, &lim, err, sizeof(err)), 0, "%s", err);
	memcpy(slab, lengths, sizeof(lengths));
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B, &kjt, err, sizeof(err)), 0,
		     "%s", err);
	cr_expect_eq(kjt.batch_size, 2);
	cr_expect_eq(kjt.num_values, 6u);
	cr_expect_eq(kjt.lengths[3], 3);
	((int32_t *)slab)[3] = -1;
	cr_assert_eq(embd_kjt_view_build(&s, &lim, slab, priv, F * B, &kjt, err, sizeof(err)),
		     EMBD_EINVAL);
	cr_assert(strstr(err, "lengths[3] (feature 1, sample 1): negative"), "got \"%s\"", err);
	s.opcode = EMBD_OP_BACKWARD;
	s.grad = s.output;
	s.output = (struct embd_slab_span){ 0, 0 };
	cr_assert_eq(embd_sqe_validate(&s, &lim, err, sizeof(err)), 0, "%s", err);
}

/* EMBD_SQE_DEVICE: output and grad are spans of the trainer's device buffers, checked against
 * their size and never against the slab's inputs; without device buffers the flag is refused. */
Test(protocol, device_spans_are_checked_against_the_device_buffers)
{
	struct embd_batch_limits dev = lim;
	struct embd_sqe s = good_forward();
	char err[256] = "";

	dev.device_bytes = 2 * B * DIM * 4;
	s.flags = EMBD_SQE_DEVICE;
	expect_bad(s, EMBD_EINVAL, "sqe.flags: DEVICE, but this trainer has no device outputs");
	/* offset 1024 lies outside buffers of 96 bytes, though inside the slab */
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), EMBD_ERANGE);
	cr_expect(strstr(err, "sqe.output: [1024, +48) lies outside the device buffers of 96 bytes"),
		  "got \"%s\"", err);
	/* offset 0 is the lengths' offset in the slab: another memory, no overlap */
	s.output.offset = 0;
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), 0, "%s", err);
	s.output.offset = B * DIM * 4;
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), 0, "%s", err);
	s.output.offset = 2;
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "sqe.output.offset: 2 is not 4-byte aligned"), "got \"%s\"", err);
	/* BACKWARD's grad alike; EVAL's output alike */
	s.output = (struct embd_slab_span){ 0, 0 };
	s.opcode = EMBD_OP_BACKWARD;
	s.grad = (struct embd_slab_span){ B * DIM * 4, B * DIM * 4 };
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), 0, "%s", err);
	s.grad.offset = B * DIM * 4 + 4;
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), EMBD_ERANGE);
	cr_expect(strstr(err, "sqe.grad: [52, +48) lies outside the device buffers"), "got \"%s\"",
		  err);
	s = good_forward();
	s.opcode = EMBD_OP_EVAL;
	s.step = 0;
	s.flags = EMBD_SQE_DEVICE | EMBD_SQE_WEIGHTED;
	s.weights = (struct embd_slab_span){ 128, 6 * 4 };
	s.output.offset = 48;
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), 0, "%s", err);
	/* the inputs stay in the slab, checked as ever */
	s.weights.offset = 4094;
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "sqe.weights.offset"), "got \"%s\"", err);
	/* a NOP has no flags */
	s = (struct embd_sqe){ .opcode = EMBD_OP_NOP, .flags = EMBD_SQE_DEVICE };
	cr_expect_eq(embd_sqe_validate(&s, &dev, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "sqe.flags: must be 0 for NOP"), "got \"%s\"", err);
}
