/*
 * ipc/control_msg.c - encoding and decoding of control-message payloads (HELLO, WELCOME,
 * ERROR, text replies); framing lives in control.c.
 *
 * Decoders see payloads that embd_ctl_parse has length-checked against the fixed part of
 * their type; everything variable (counts, names, indices, offsets) is checked here, and
 * every fixed struct is memcpy'd out so that no unaligned or aliased read happens.
 */
#include "ipc/control.h"

#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "common/err.h"

void embd_ctl_hello_encode(const struct embd_ctl_hello *hello, void *payload_out)
{
	memcpy(payload_out, hello, sizeof(*hello));
}

int embd_ctl_hello_decode(const struct embd_ctl_msg *msg, struct embd_ctl_hello *out, char *err,
			  size_t err_len)
{
	if (msg->type != EMBD_CTL_HELLO || msg->length != sizeof(*out))
		return embd_fail(err, err_len, EMBD_EPROTO, "hello: message type %u is not HELLO",
				(unsigned)msg->type);
	memcpy(out, msg->payload, sizeof(*out));
	if (out->protocol_version != msg->version)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"hello.protocol_version: %" PRIu32 " but the header says version %u",
				out->protocol_version, (unsigned)msg->version);
	if (out->protocol_version != EMBD_CTL_VERSION)
		return embd_fail(err, err_len, EMBD_EMISMATCH,
				"hello.protocol_version: service speaks %u, client %" PRIu32,
				EMBD_CTL_VERSION, out->protocol_version);
	if (out->wanted_rank < -1)
		return embd_fail(err, err_len, EMBD_EPROTO, "hello.wanted_rank: %" PRId32 " (want >= -1)",
				out->wanted_rank);
	if (out->reserved != 0)
		return embd_fail(err, err_len, EMBD_EPROTO, "hello.reserved: must be zero");
	return 0;
}

static uint64_t welcome_bytes(uint32_t num_tables, uint32_t num_features)
{
	return sizeof(struct embd_layout_fixed) +
	       (uint64_t)num_tables * sizeof(struct embd_layout_table) +
	       (uint64_t)num_features * sizeof(struct embd_layout_feature);
}

int embd_ctl_welcome_encode(const struct embd_layout *layout, void *buf, size_t cap, uint32_t *len_out)
{
	const struct embd_layout_fixed *f = &layout->fixed;
	unsigned char *p = buf;
	uint64_t bytes;

	*len_out = 0;
	if (f->num_tables > EMBD_LAYOUT_TABLES_MAX || f->num_features > EMBD_LAYOUT_FEATURES_MAX)
		return EMBD_EINVAL;
	bytes = welcome_bytes(f->num_tables, f->num_features);
	if (bytes > cap || bytes > EMBD_CTL_MSG_MAX - sizeof(struct embd_ctl_header))
		return EMBD_ENOSPC;
	memcpy(p, f, sizeof(*f));
	p += sizeof(*f);
	memcpy(p, layout->tables, f->num_tables * sizeof(layout->tables[0]));
	p += f->num_tables * sizeof(layout->tables[0]);
	memcpy(p, layout->features, f->num_features * sizeof(layout->features[0]));
	*len_out = (uint32_t)bytes;
	return 0;
}

/* A name field must hold a NUL and at least one character before it. */
static bool name_ok(const char name[EMBD_NAME_MAX])
{
	return name[0] != '\0' && memchr(name, '\0', EMBD_NAME_MAX) != NULL;
}

static int check_tables(const struct embd_layout *l, char *err, size_t err_len)
{
	for (uint32_t t = 0; t < l->fixed.num_tables; t++) {
		const struct embd_layout_table *tb = &l->tables[t];

		if (!name_ok(tb->name))
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.tables[%" PRIu32 "].name: empty or not NUL-terminated", t);
		for (uint32_t u = 0; u < t; u++)
			if (strcmp(l->tables[u].name, tb->name) == 0)
				return embd_fail(err, err_len, EMBD_EPROTO,
						"welcome.tables[%" PRIu32 "].name: \"%s\" repeats tables[%" PRIu32 "]",
						t, tb->name, u);
		if (tb->num_embeddings <= 0)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.tables[%" PRIu32 "].num_embeddings: %" PRId64 " (want > 0)",
					t, tb->num_embeddings);
		if (tb->embedding_dim <= 0)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.tables[%" PRIu32 "].embedding_dim: %" PRId32 " (want > 0)",
					t, tb->embedding_dim);
		if (tb->pooling != EMBD_POOLING_SUM && tb->pooling != EMBD_POOLING_MEAN)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.tables[%" PRIu32 "].pooling: unknown value %" PRIu32, t, tb->pooling);
		if (tb->data_type != EMBD_DTYPE_FP32 && tb->data_type != EMBD_DTYPE_FP16)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.tables[%" PRIu32 "].data_type: unknown value %" PRIu32, t,
					tb->data_type);
		if (tb->reserved != 0)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.tables[%" PRIu32 "].reserved: must be zero", t);
	}
	return 0;
}

static int check_features(const struct embd_layout *l, char *err, size_t err_len)
{
	uint64_t next_offset = 0;

	for (uint32_t i = 0; i < l->fixed.num_features; i++) {
		const struct embd_layout_feature *fe = &l->features[i];

		if (!name_ok(fe->name))
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.features[%" PRIu32 "].name: empty or not NUL-terminated", i);
		for (uint32_t u = 0; u < i; u++)
			if (strcmp(l->features[u].name, fe->name) == 0)
				return embd_fail(err, err_len, EMBD_EPROTO,
						"welcome.features[%" PRIu32 "].name: \"%s\" repeats features[%" PRIu32 "]",
						i, fe->name, u);
		if (fe->table >= l->fixed.num_tables)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.features[%" PRIu32 "].table: %" PRIu32 " but there are %" PRIu32
					" tables", i, fe->table, l->fixed.num_tables);
		if (fe->dim != (uint32_t)l->tables[fe->table].embedding_dim)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.features[%" PRIu32 "].dim: %" PRIu32 " but table %" PRIu32
					" has dim %" PRId32, i, fe->dim, fe->table,
					l->tables[fe->table].embedding_dim);
		if (fe->offset != next_offset)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.features[%" PRIu32 "].offset: %" PRIu32 ", expected %" PRIu64
					" (features tile the output in order)", i, fe->offset, next_offset);
		if (fe->reserved != 0)
			return embd_fail(err, err_len, EMBD_EPROTO,
					"welcome.features[%" PRIu32 "].reserved: must be zero", i);
		next_offset += fe->dim;
	}
	if (next_offset != l->fixed.total_dim)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"welcome.total_dim: %" PRIu32 " but the features span %" PRIu64 " columns",
				l->fixed.total_dim, next_offset);
	return 0;
}

int embd_ctl_welcome_decode(const struct embd_ctl_msg *msg, struct embd_layout *out, char *err,
			    size_t err_len)
{
	struct embd_layout_fixed *f = &out->fixed;
	const uint8_t *p = msg->payload;
	uint64_t want;
	int rc;

	memset(f, 0, sizeof(*f));
	if (msg->type != EMBD_CTL_WELCOME || msg->length < sizeof(*f))
		return embd_fail(err, err_len, EMBD_EPROTO, "welcome: message type %u is not WELCOME",
				(unsigned)msg->type);
	memcpy(f, p, sizeof(*f));
	if (f->num_tables == 0 || f->num_tables > EMBD_LAYOUT_TABLES_MAX)
		return embd_fail(err, err_len, EMBD_EPROTO, "welcome.num_tables: %" PRIu32 " not in [1, %u]",
				f->num_tables, EMBD_LAYOUT_TABLES_MAX);
	if (f->num_features == 0 || f->num_features > EMBD_LAYOUT_FEATURES_MAX)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"welcome.num_features: %" PRIu32 " not in [1, %u]", f->num_features,
				EMBD_LAYOUT_FEATURES_MAX);
	want = welcome_bytes(f->num_tables, f->num_features);
	if (msg->length != want)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"welcome: payload of %" PRIu32 " bytes, %" PRIu32 " tables and %" PRIu32
				" features need %" PRIu64, msg->length, f->num_tables, f->num_features, want);
	if (f->rank < 0 || (uint32_t)f->rank >= f->local_world_size)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"welcome.rank: %" PRId32 " not in [0, local_world_size %" PRIu32 ")",
				f->rank, f->local_world_size);
	if (f->batch_size == 0)
		return embd_fail(err, err_len, EMBD_EPROTO, "welcome.batch_size: must be > 0");
	if (f->flags & ~EMBD_LAYOUT_EVENTFD)
		return embd_fail(err, err_len, EMBD_EPROTO, "welcome.flags: unknown bits 0x%" PRIx32,
				f->flags & ~EMBD_LAYOUT_EVENTFD);
	if (f->reserved != 0)
		return embd_fail(err, err_len, EMBD_EPROTO, "welcome.reserved: must be zero");
	if (msg->nfds != 0 && msg->nfds != ((f->flags & EMBD_LAYOUT_EVENTFD) ? 2u : 1u))
		return embd_fail(err, err_len, EMBD_EPROTO, "welcome: %u fds attached, flags want %u",
				msg->nfds, (f->flags & EMBD_LAYOUT_EVENTFD) ? 2u : 1u);
	p += sizeof(*f);
	memcpy(out->tables, p, f->num_tables * sizeof(out->tables[0]));
	p += f->num_tables * sizeof(out->tables[0]);
	memcpy(out->features, p, f->num_features * sizeof(out->features[0]));
	rc = check_tables(out, err, err_len);
	if (rc)
		return rc;
	return check_features(out, err, err_len);
}

int embd_ctl_send_error(int sock, int code, const char *text, char *err, size_t err_len)
{
	unsigned char buf[sizeof(int32_t) + EMBD_CTL_TEXT_MAX];
	int32_t code32 = code;
	size_t len = strnlen(text ? text : "", EMBD_CTL_TEXT_MAX);

	memcpy(buf, &code32, sizeof(code32));
	if (len)
		memcpy(buf + sizeof(code32), text, len);
	return embd_ctl_send(sock, EMBD_CTL_ERROR, buf, (uint32_t)(sizeof(code32) + len), NULL, 0,
			     err, err_len);
}

/* Copies payload bytes [skip, length) into text as a string; EMBD_EPROTO for embedded NULs. */
static int copy_text(const struct embd_ctl_msg *msg, size_t skip, char *text, size_t text_cap,
		     const char *what, char *err, size_t err_len)
{
	size_t len = msg->length - skip;

	if (memchr(msg->payload + skip, '\0', len))
		return embd_fail(err, err_len, EMBD_EPROTO, "%s: text holds a NUL byte", what);
	if (len >= text_cap)
		return embd_fail(err, err_len, EMBD_ENOSPC, "%s: %zu bytes of text, buffer holds %zu",
				what, len, text_cap ? text_cap - 1 : 0);
	memcpy(text, msg->payload + skip, len);
	text[len] = '\0';
	return 0;
}

int embd_ctl_error_decode(const struct embd_ctl_msg *msg, int *code_out, char *text, size_t text_cap,
			  char *err, size_t err_len)
{
	int32_t code;

	if (msg->type != EMBD_CTL_ERROR || msg->length < sizeof(code))
		return embd_fail(err, err_len, EMBD_EPROTO, "error: message type %u is not ERROR",
				(unsigned)msg->type);
	memcpy(&code, msg->payload, sizeof(code));
	if (code >= 0)
		return embd_fail(err, err_len, EMBD_EPROTO, "error.code: %" PRId32 " is not negative", code);
	if (msg->length - sizeof(code) > EMBD_CTL_TEXT_MAX)
		return embd_fail(err, err_len, EMBD_EPROTO, "error.text: longer than %u bytes",
				EMBD_CTL_TEXT_MAX);
	*code_out = code;
	return copy_text(msg, sizeof(code), text, text_cap, "error.text", err, err_len);
}

int embd_ctl_text_decode(const struct embd_ctl_msg *msg, char *text, size_t text_cap, char *err,
			 size_t err_len)
{
	if (msg->type != EMBD_CTL_STATS_REPLY && msg->type != EMBD_CTL_STATUS_REPLY &&
	    msg->type != EMBD_CTL_CHECKPOINT_REPLY)
		return embd_fail(err, err_len, EMBD_EPROTO, "reply: message type %u carries no text",
				(unsigned)msg->type);
	return copy_text(msg, 0, text, text_cap, "reply", err, err_len);
}

int embd_ctl_checkpoint_decode(const struct embd_ctl_msg *msg, struct embd_ctl_checkpoint *out,
			       char *err, size_t err_len)
{
	if (msg->type != EMBD_CTL_CHECKPOINT_REQUEST || msg->length != sizeof(*out))
		return embd_fail(err, err_len, EMBD_EPROTO, "checkpoint: type %u, %u bytes",
				(unsigned)msg->type, msg->length);
	memcpy(out, msg->payload, sizeof(*out));
	if (out->flags & ~EMBD_CTL_CHECKPOINT_WAIT)
		return embd_fail(err, err_len, EMBD_EPROTO, "checkpoint.flags: unknown bits 0x%x",
				out->flags & ~EMBD_CTL_CHECKPOINT_WAIT);
	if (out->reserved)
		return embd_fail(err, err_len, EMBD_EPROTO, "checkpoint.reserved: must be zero");
	return 0;
}
