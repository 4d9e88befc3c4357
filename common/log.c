/*
 * The daemon's log lines (common/log.h). A line is formatted into a stack buffer and written
 * with a single write(2) to fd 2: atomic for lines under PIPE_BUF on pipes and journald's
 * stream socket, and safe from any thread.
 */
#include "common/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "embd/types.h"

static enum embd_log_level log_level = EMBD_LOG_INFO;
static bool log_journal;

static const char *const level_names[] = {
	[EMBD_LOG_ERROR] = "error",
	[EMBD_LOG_WARNING] = "warning",
	[EMBD_LOG_NOTICE] = "notice",
	[EMBD_LOG_INFO] = "info",
	[EMBD_LOG_DEBUG] = "debug",
};

int embd_log_level_from_name(const char *name, enum embd_log_level *out)
{
	for (int l = EMBD_LOG_ERROR; l <= EMBD_LOG_DEBUG; l++)
		if (!strcmp(name, level_names[l])) {
			*out = (enum embd_log_level)l;
			return 0;
		}
	return EMBD_EINVAL;
}

const char *embd_log_level_name(enum embd_log_level level)
{
	if (level < EMBD_LOG_ERROR || level > EMBD_LOG_DEBUG)
		return "unknown";
	return level_names[level];
}

void embd_log_set_level(enum embd_log_level level)
{
	log_level = level;
}

void embd_log_init(void)
{
	log_journal = getenv("JOURNAL_STREAM") != NULL;
}

/* Formats and writes one line; suffix (may be "") goes after the message. */
static void write_line(enum embd_log_level level, const char *suffix, const char *fmt,
		       va_list ap)
{
	char line[2048];
	size_t n;

	if (log_journal) {
		n = (size_t)snprintf(line, sizeof(line), "<%d>%s: ", (int)level,
				     embd_log_level_name(level));
	} else {
		struct timespec ts;
		struct tm tm;
		clock_gettime(CLOCK_REALTIME, &ts);
		gmtime_r(&ts.tv_sec, &tm);
		n = strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
		n += (size_t)snprintf(line + n, sizeof(line) - n, ".%03ldZ embd[%d] %s: ",
				      ts.tv_nsec / 1000000, (int)getpid(), embd_log_level_name(level));
	}
	int m = vsnprintf(line + n, sizeof(line) - n, fmt, ap);
	n = m < 0 ? n : n + (size_t)m;
	if (n < sizeof(line) && suffix[0]) {
		m = snprintf(line + n, sizeof(line) - n, "%s", suffix);
		n = m < 0 ? n : n + (size_t)m;
	}
	/* a truncated line keeps its newline */
	if (n > sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	ssize_t w = write(2, line, n);
	(void)w; /* nowhere to report a failing stderr */
}

void embd_log(enum embd_log_level level, const char *fmt, ...)
{
	va_list ap;

	if (level > log_level)
		return;
	va_start(ap, fmt);
	write_line(level, "", fmt, ap);
	va_end(ap);
}

void embd_log_limited(struct embd_log_limit *limit, enum embd_log_level level,
		      const char *fmt, ...)
{
	char suffix[64] = "";
	uint64_t now = embd_now_ns();
	va_list ap;

	if (level > log_level)
		return;
	if (!limit->window_start_ns ||
	    now - limit->window_start_ns >= EMBD_LOG_LIMIT_WINDOW_MS * 1000000ull) {
		limit->window_start_ns = now;
		limit->lines = 0;
	}
	if (limit->lines == EMBD_LOG_LIMIT_BURST) {
		limit->dropped++;
		return;
	}
	limit->lines++;
	if (limit->dropped)
		snprintf(suffix, sizeof(suffix), " (%u more like it not logged)", limit->dropped);
	limit->dropped = 0;
	va_start(ap, fmt);
	write_line(level, suffix, fmt, ap);
	va_end(ap);
}
