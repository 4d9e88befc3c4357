/*
 * Small text helpers of the planner: a growable string (the JSON writer and the stats table
 * build their output with it), JSON string escaping, FNV-1a 64 (plan and tables hashes), and
 * the strict JSON parse every file the planner, the daemon and embctl read goes through, with
 * its errors naming the position.
 */
#include "planner/planner_internal.h"
#include "planner/plan_json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sbuf_printf(struct sbuf *b, const char *fmt, ...)
{
	va_list ap;

	if (b->failed)
		return;
	for (;;) {
		size_t room = b->cap - b->len;
		va_start(ap, fmt);
		int n = vsnprintf(b->data ? b->data + b->len : NULL, room, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->failed = 1;
			return;
		}
		if ((size_t)n < room) {
			b->len += (size_t)n;
			return;
		}
		size_t cap = b->cap ? b->cap * 2 : 4096;
		while (cap - b->len <= (size_t)n)
			cap *= 2;
		char *grown = realloc(b->data, cap);
		if (!grown) {
			b->failed = 1;
			return;
		}
		b->data = grown;
		b->cap = cap;
	}
}

void sbuf_json_string(struct sbuf *b, const char *s)
{
	sbuf_printf(b, "\"");
	for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
		if (*p == '"' || *p == '\\')
			sbuf_printf(b, "\\%c", *p);
		else if (*p < 0x20)
			sbuf_printf(b, "\\u%04x", *p);
		else
			sbuf_printf(b, "%c", *p);
	}
	sbuf_printf(b, "\"");
}

uint64_t fnv1a64(uint64_t h, const void *data, size_t len)
{
	const unsigned char *p = data;
	for (size_t i = 0; i < len; i++) {
		h ^= p[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

int planner_syntax_err(char *err, size_t err_len, const char *what, const char *text,
		       size_t len, const char *at)
{
	size_t offset = at && at >= text && at <= text + len ? (size_t)(at - text) : len;
	unsigned line = 1;
	for (size_t i = 0; i < offset; i++)
		line += text[i] == '\n';
	return embd_fail(err, err_len, EMBD_EPARSE, "%s: JSON syntax error at line %u, byte %zu",
			   what, line, offset);
}

void planner_prefix_err(char *err, size_t err_len, const char *prefix)
{
	char inner[1024];
	if (!err || !err_len)
		return;
	snprintf(inner, sizeof(inner), "%s", err);
	snprintf(err, err_len, "%s: %s", prefix, inner);
}

int embd_plan_json_parse(const char *text, size_t len, const char *what, cJSON **root,
			 char *err, size_t err_len)
{
	const char *end = NULL;

	*root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
	if (!*root)
		return planner_syntax_err(err, err_len, what, text, len, end);
	/* cJSON stops after the value; "require null terminated" would want a NUL inside len */
	size_t at = (size_t)(end - text);
	while (at < len && (text[at] == ' ' || text[at] == '\t' || text[at] == '\n' ||
			    text[at] == '\r'))
		at++;
	if (at == len)
		return 0;
	cJSON_Delete(*root);
	*root = NULL;
	unsigned line = 1;
	for (size_t i = 0; i < at; i++)
		line += text[i] == '\n';
	return embd_fail(err, err_len, EMBD_EPARSE,
			 "%s: text after the JSON value at line %u, byte %zu", what, line, at);
}
