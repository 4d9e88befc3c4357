/*
 * The log's rate limit (common/log.h): a peer that makes the service log the same kind of line
 * thousands of times gets EMBD_LOG_LIMIT_BURST lines per window, and the first line of the
 * next window says how many were left out. The lines are caught by pointing fd 2 at a file.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"

static char path[64];
static int saved_stderr = -1;

/* fd 2 into a fresh file until read_back */
static void capture(void)
{
	snprintf(path, sizeof(path), "/tmp/embd-test-log-%d.txt", (int)getpid());
	int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
	cr_assert_geq(fd, 0, "cannot create %s", path);
	saved_stderr = dup(2);
	dup2(fd, 2);
	close(fd);
}

/* Lines holding needle in what was logged since capture(). */
static int read_back(const char *needle, char *last, size_t last_len)
{
	char line[4096];
	int n = 0;

	dup2(saved_stderr, 2);
	close(saved_stderr);
	FILE *f = fopen(path, "r");
	cr_assert_not_null(f);
	while (fgets(line, sizeof(line), f))
		if (strstr(line, needle)) {
			n++;
			snprintf(last, last_len, "%s", line);
		}
	fclose(f);
	unlink(path);
	return n;
}

Test(log, limited_lines_are_counted_not_written)
{
	struct embd_log_limit refused = { 0 }, other = { 0 };
	char last[4096] = "";

	embd_log_set_level(EMBD_LOG_INFO);
	capture();
	for (int i = 0; i < 20000; i++)
		embd_log_limited(&refused, EMBD_LOG_WARNING, "refused peer %d", i);
	/* another kind of line has a limit of its own */
	embd_log_limited(&other, EMBD_LOG_WARNING, "other line");
	/* below the level: neither written nor counted */
	embd_log_limited(&other, EMBD_LOG_DEBUG, "other line");
	int n = read_back("refused peer", last, sizeof(last));
	cr_expect_eq(n, (int)EMBD_LOG_LIMIT_BURST, "20000 refusals: expected %u lines, got %d",
		     EMBD_LOG_LIMIT_BURST, n);
	cr_expect_eq(refused.dropped, 20000u - EMBD_LOG_LIMIT_BURST);
	cr_expect_eq(other.lines, 1u, "a debug line under level info: expected 1 line counted, "
		     "got %u", other.lines);

	/* the window passes: the next line is written and names what was left out */
	refused.window_start_ns -= (EMBD_LOG_LIMIT_WINDOW_MS + 1) * 1000000ull;
	capture();
	embd_log_limited(&refused, EMBD_LOG_WARNING, "refused peer again");
	n = read_back("refused peer again", last, sizeof(last));
	cr_expect_eq(n, 1);
	char want[64];
	snprintf(want, sizeof(want), "(%u more like it not logged)", 20000u - EMBD_LOG_LIMIT_BURST);
	cr_expect(strstr(last, want) != NULL, "expected '%s' in '%s'", want, last);
	cr_expect_eq(refused.dropped, 0u);
}
