/*
 * ipc/ipc_err.h - private to ipc/: formatting an error message into a caller's
 * (char *err, size_t err_len) buffer. err may be NULL; the message is always NUL-terminated.
 */
#ifndef EMBD_IPC_ERR_H
#define EMBD_IPC_ERR_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

__attribute__((format(printf, 4, 5)))
static inline int ipc_fail(char *err, size_t err_len, int code, const char *fmt, ...)
{
	va_list ap;

	if (err && err_len) {
		va_start(ap, fmt);
		vsnprintf(err, err_len, fmt, ap);
		va_end(ap);
	}
	return code;
}

#endif /* EMBD_IPC_ERR_H */
