/*
 * common/log.h - the log of the daemon and its libraries: one line per event on stderr, with a level.
 *
 * Under systemd (JOURNAL_STREAM set) every line starts with the syslog priority "<N>" so that
 * journald files it at the right level, and the timestamp is left to journald; otherwise a
 * line starts with a UTC timestamp in milliseconds. Lines are written with one write(2), so
 * threads never interleave inside a line.
 */
#ifndef EMBD_COMMON_LOG_H
#define EMBD_COMMON_LOG_H

#include <stdint.h>

/* syslog's numbers, which journald's "<N>" prefix uses */
enum embd_log_level {
	EMBD_LOG_ERROR = 3,
	EMBD_LOG_WARNING = 4,
	EMBD_LOG_NOTICE = 5,
	EMBD_LOG_INFO = 6,
	EMBD_LOG_DEBUG = 7,
};

/* "error", "warning", "notice", "info", "debug"; 0 and *out set, or EMBD_EINVAL. */
int embd_log_level_from_name(const char *name, enum embd_log_level *out);
const char *embd_log_level_name(enum embd_log_level level);

/* Lines above level are dropped (default info). Call before threads start. */
void embd_log_set_level(enum embd_log_level level);
/* Reads JOURNAL_STREAM once; call before threads start. */
void embd_log_init(void);

void embd_log(enum embd_log_level level, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/*
 * Lines a peer can cause at will (a refused connection, a client that broke the protocol)
 * go through a limit of their own, so a peer looping on it cannot flood the log: at most
 * EMBD_LOG_LIMIT_BURST lines per EMBD_LOG_LIMIT_WINDOW_MS, the rest counted and the count
 * named on the next line written ("(N more like it not logged)"). One limit per kind of
 * line, owned by the thread that logs it; a zeroed struct is a fresh limit.
 */
#define EMBD_LOG_LIMIT_BURST 10u
#define EMBD_LOG_LIMIT_WINDOW_MS 10000u
struct embd_log_limit {
	uint64_t window_start_ns;       /* CLOCK_MONOTONIC (common/clock.h) */
	uint32_t lines;                 /* written in the window */
	uint32_t dropped;               /* not written since the last line that was */
};

void embd_log_limited(struct embd_log_limit *limit, enum embd_log_level level,
		      const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#define embd_log_error(...) embd_log(EMBD_LOG_ERROR, __VA_ARGS__)
#define embd_log_warning(...) embd_log(EMBD_LOG_WARNING, __VA_ARGS__)
#define embd_log_notice(...) embd_log(EMBD_LOG_NOTICE, __VA_ARGS__)
#define embd_log_info(...) embd_log(EMBD_LOG_INFO, __VA_ARGS__)
#define embd_log_debug(...) embd_log(EMBD_LOG_DEBUG, __VA_ARGS__)

#endif /* EMBD_COMMON_LOG_H */
