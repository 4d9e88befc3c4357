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

void embd_log(enum embd_log_level level, const char *fmt, ...)
{
	char line[2048];
	size_t n;
	va_list ap;

	if (level > log_level)
		return;
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
	va_start(ap, fmt);
	int m = vsnprintf(line + n, sizeof(line) - n, fmt, ap);
	va_end(ap);
	/* a truncated line keeps its newline */
	n = m < 0 ? n : n + (size_t)m;
	if (n > sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	ssize_t w = write(2, line, n);
	(void)w; /* nowhere to report a failing stderr */
}
