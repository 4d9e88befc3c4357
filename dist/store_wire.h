/*
 * dist/store_wire.h - the wire protocol of the rendezvous store (dist/store.h), shared by
 * the server (store_server.c) and the client (store.c). This comment is the protocol's
 * reference.
 *
 * One TCP connection per client, TCP_NODELAY. Every integer is big-endian. A client sends one
 * request and reads its response before it sends the next one (the server does not read a
 * connection's next request while one is parked).
 *
 *   request   u32 body_len | u8 op | op fields                  (body_len counts op + fields)
 *   response  u32 body_len | i32 status | result                (body_len counts status + result)
 *
 *   key       u16 key_len | key bytes   (1..EMBD_STORE_KEY_MAX bytes, no NUL byte)
 *
 *   op           fields                                   result when status == 0
 *   1 SET        key | u32 value_len | value               -
 *   2 GET        u32 timeout_ms | key                      the value (the rest of the body)
 *   3 ADD        key | i64 delta                           i64 the new value
 *   4 CHECK      key                                       u8 1 = exists, 0 = does not
 *   5 WAIT       u32 timeout_ms | u16 n | n keys           -
 *   6 DELETE     key                                       -   (status EMBD_ENOENT if absent)
 *
 * status is 0 or a negative EMBD_E* code; when it is negative, result is a message in UTF-8
 * (not NUL-terminated) such as "timed out after 300 ms waiting for 'rank_1'". GET and WAIT
 * are parked on the server until every key exists or timeout_ms passes (then
 * EMBD_ETIMEDOUT). ADD keeps its counter as decimal ASCII, so GET of a counter reads "3"; ADD
 * on a value that is not such a number is EMBD_EINVAL. A body larger than
 * EMBD_STORE_BODY_MAX, an unknown op, a field running past the body or bytes left over are
 * protocol errors: the server answers EMBD_EPROTO (best effort) and closes that connection.
 */
#ifndef EMBD_DIST_STORE_WIRE_H
#define EMBD_DIST_STORE_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"
#include "dist/store.h"

enum embd_store_op {
	EMBD_STORE_OP_SET = 1,
	EMBD_STORE_OP_GET = 2,
	EMBD_STORE_OP_ADD = 3,
	EMBD_STORE_OP_CHECK = 4,
	EMBD_STORE_OP_WAIT = 5,
	EMBD_STORE_OP_DELETE = 6,
};

#define EMBD_STORE_WAIT_KEYS_MAX 1024u                           /* keys of one WAIT */
#define EMBD_STORE_BODY_MAX (EMBD_STORE_VALUE_MAX + 1024u)       /* a SET of the largest value */
#define EMBD_STORE_HEADER_BYTES 4u

/* ---- writing: a growable buffer; an allocation failure sticks and is checked once ---------- */

struct embd_wbuf {
	uint8_t *data;
	size_t len, cap;
	bool failed;
};

static inline void embd_wbuf_put(struct embd_wbuf *b, const void *p, size_t n)
{
	if (b->failed)
		return;
	if (b->len + n > b->cap) {
		size_t cap = b->cap ? b->cap : 256;
		while (cap < b->len + n)
			cap *= 2;
		uint8_t *d = realloc(b->data, cap);
		if (!d) {
			b->failed = true;
			return;
		}
		b->data = d;
		b->cap = cap;
	}
	if (n)
		memcpy(b->data + b->len, p, n);
	b->len += n;
}

static inline void embd_wbuf_u8(struct embd_wbuf *b, uint8_t v)
{
	embd_wbuf_put(b, &v, 1);
}

static inline void embd_wbuf_u16(struct embd_wbuf *b, uint16_t v)
{
	uint8_t p[2] = { (uint8_t)(v >> 8), (uint8_t)v };
	embd_wbuf_put(b, p, 2);
}

static inline void embd_wire_put_u32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static inline void embd_wire_put_u64(uint8_t *p, uint64_t v)
{
	embd_wire_put_u32(p, (uint32_t)(v >> 32));
	embd_wire_put_u32(p + 4, (uint32_t)v);
}

static inline void embd_wbuf_u32(struct embd_wbuf *b, uint32_t v)
{
	uint8_t p[4];
	embd_wire_put_u32(p, v);
	embd_wbuf_put(b, p, 4);
}

static inline void embd_wbuf_u64(struct embd_wbuf *b, uint64_t v)
{
	uint8_t p[8];
	embd_wire_put_u64(p, v);
	embd_wbuf_put(b, p, 8);
}

static inline void embd_wbuf_key(struct embd_wbuf *b, const char *key, size_t len)
{
	embd_wbuf_u16(b, (uint16_t)len);
	embd_wbuf_put(b, key, len);
}

/* Starts a frame: reserves the u32 length, filled in by embd_wbuf_frame_end. */
static inline size_t embd_wbuf_frame_begin(struct embd_wbuf *b)
{
	size_t at = b->len;
	embd_wbuf_u32(b, 0);
	return at;
}

static inline void embd_wbuf_frame_end(struct embd_wbuf *b, size_t at)
{
	if (b->failed)
		return;
	embd_wire_put_u32(b->data + at, (uint32_t)(b->len - at - EMBD_STORE_HEADER_BYTES));
}

/* ---- reading: a cursor over a received body; running past the end sets bad ------------ */

struct embd_rbuf {
	const uint8_t *p;
	size_t left;
	bool bad;
};

static inline const uint8_t *embd_rbuf_take(struct embd_rbuf *r, size_t n)
{
	if (r->bad || r->left < n) {
		r->bad = true;
		return NULL;
	}
	const uint8_t *p = r->p;
	r->p += n;
	r->left -= n;
	return p;
}

static inline uint32_t embd_wire_get_u32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline uint8_t embd_rbuf_u8(struct embd_rbuf *r)
{
	const uint8_t *p = embd_rbuf_take(r, 1);
	return p ? p[0] : 0;
}

static inline uint16_t embd_rbuf_u16(struct embd_rbuf *r)
{
	const uint8_t *p = embd_rbuf_take(r, 2);
	return p ? (uint16_t)(p[0] << 8 | p[1]) : 0;
}

static inline uint32_t embd_rbuf_u32(struct embd_rbuf *r)
{
	const uint8_t *p = embd_rbuf_take(r, 4);
	return p ? embd_wire_get_u32(p) : 0;
}

static inline uint64_t embd_rbuf_u64(struct embd_rbuf *r)
{
	uint64_t hi = embd_rbuf_u32(r);
	return hi << 32 | embd_rbuf_u32(r);
}

/* A key: 1..EMBD_STORE_KEY_MAX bytes without NUL; anything else sets bad. *len set. */
static inline const char *embd_rbuf_key(struct embd_rbuf *r, size_t *len)
{
	size_t n = embd_rbuf_u16(r);
	const uint8_t *p = embd_rbuf_take(r, n);
	if (!p || n == 0 || n > EMBD_STORE_KEY_MAX || memchr(p, 0, n)) {
		r->bad = true;
		return NULL;
	}
	*len = n;
	return (const char *)p;
}

#endif /* EMBD_DIST_STORE_WIRE_H */
