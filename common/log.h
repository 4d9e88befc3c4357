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

#define embd_log_error(...) embd_log(EMBD_LOG_ERROR, __VA_ARGS__)
#define embd_log_warning(...) embd_log(EMBD_LOG_WARNING, __VA_ARGS__)
#define embd_log_notice(...) embd_log(EMBD_LOG_NOTICE, __VA_ARGS__)
#define embd_log_info(...) embd_log(EMBD_LOG_INFO, __VA_ARGS__)
#define embd_log_debug(...) embd_log(EMBD_LOG_DEBUG, __VA_ARGS__)

#endif /* EMBD_COMMON_LOG_H */
