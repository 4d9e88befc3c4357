/*
 * common/err.h - the one way embd formats an error: a message into the caller's (err, err_len)
 * buffer and the EMBD_E* code returned beside it, so a failure reads
 * `return embd_fail(err, err_len, EMBD_EINVAL, "%s: ...", key);`.
 *
 * static inline because libembdclient compiles ipc/ without linking the rest of common/.
 */
#ifndef EMBD_COMMON_ERR_H
#define EMBD_COMMON_ERR_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* Writes the message (err may be NULL or err_len 0; the text is always NUL-terminated) and
 * returns code. */
__attribute__((format(printf, 4, 5)))
static inline int embd_fail(char *err, size_t err_len, int code, const char *fmt, ...)
{
	if (err && err_len) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, err_len, fmt, ap);
		va_end(ap);
	}
	return code;
}

#endif /* EMBD_COMMON_ERR_H */
