/*
 * tests/support/embd_process.c - the real embd as a child of a test (embd_process.h). Waits
 * poll waitpid(WNOHANG) on the monotonic clock; a wait for ever blocks in waitpid.
 */
#include "tests/support/embd_process.h"

#include <criterion/criterion.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"

#define POLL_US 5000

static void exec_embd(struct tu_embd *p, const struct tu_embd_opts *o, int pipe_w)
{
	const char *argv[10];
	int argc = 0;

	if (pipe_w >= 0) {
		dup2(pipe_w, STDERR_FILENO);
		close(pipe_w);
	} else if (p->log[0]) {
		int log = open(p->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (log >= 0)
			dup2(log, STDERR_FILENO);
	}
	if (o->child_setup)
		o->child_setup(o->child_arg);
	argv[argc++] = "embd";
	if (o->config) {
		argv[argc++] = "--config";
		argv[argc++] = o->config;
	}
	argv[argc++] = "--socket";
	argv[argc++] = p->socket;
	if (o->log_level) {
		argv[argc++] = "--log-level";
		argv[argc++] = o->log_level;
	}
	argv[argc] = NULL;
	/* EMBD_TEST_BINARY: another embd than the build's (tests/gpu/run.sh's bundle) */
	const char *bin = getenv("EMBD_TEST_BINARY") ? getenv("EMBD_TEST_BINARY") : EMBD_BINARY;
	execv(bin, (char *const *)argv);
	fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
	_exit(127);
}

void tu_embd_start(struct tu_embd *p, const struct tu_embd_opts *o)
{
	int fds[2] = { -1, -1 };

	p->stderr_fd = -1;
	unlink(p->socket);
	if (o->stderr_pipe)
		cr_assert_eq(pipe(fds), 0, "pipe: %s", strerror(errno));
	fflush(NULL);
	p->pid = fork();
	cr_assert(p->pid >= 0, "fork: %s", strerror(errno));
	if (p->pid == 0) {
		if (fds[0] >= 0)
			close(fds[0]);
		exec_embd(p, o, fds[1]);
	}
	if (fds[1] >= 0)
		close(fds[1]);
	p->stderr_fd = fds[0];
}

/* What a failure message says about the log: its head, or where it went. */
static const char *log_head(const struct tu_embd *p)
{
	static char text[4096];

	if (!p->log[0])
		return "(its stderr is the test's)";
	tu_embd_read_log(p, text, sizeof(text));
	return text;
}

static void reaped(struct tu_embd *p, int status)
{
	p->pid = 0;
	p->status = status;
}

void tu_embd_await_socket(struct tu_embd *p, int timeout_ms, const char *name)
{
	const int64_t deadline = embd_now_ms() + timeout_ms;

	cr_assert_gt(p->pid, 0, "%s was not started", name);
	while (access(p->socket, F_OK) != 0 && embd_now_ms() < deadline) {
		int st;
		if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
			reaped(p, st);
			cr_assert_fail("%s exited (status 0x%x) before listening on %s: %s", name, st,
				       p->socket, log_head(p));
		}
		usleep(10000);
	}
	cr_assert(access(p->socket, F_OK) == 0, "%s did not listen on %s within %d ms: %s", name,
		  p->socket, timeout_ms, log_head(p));
}

bool tu_embd_wait(struct tu_embd *p, int timeout_ms, int *status)
{
	const int64_t deadline = embd_now_ms() + timeout_ms;
	int st;

	while (p->pid > 0 && timeout_ms < 0) {
		pid_t r = waitpid(p->pid, &st, 0);
		if (r == p->pid)
			reaped(p, st);
		else if (r < 0 && errno != EINTR)
			return false;   /* not a child of this process */
	}
	while (p->pid > 0) {
		if (waitpid(p->pid, &st, WNOHANG) == p->pid)
			reaped(p, st);
		else if (embd_now_ms() >= deadline)
			return false;
		else
			usleep(POLL_US);
	}
	*status = p->status;
	return true;
}

bool tu_embd_stop(struct tu_embd *p, int sig, int timeout_ms, int *status)
{
	bool exited = true;
	int st = p->status;

	if (p->pid > 0) {
		kill(p->pid, sig);
		exited = tu_embd_wait(p, timeout_ms, &st);
		if (!exited) {
			kill(p->pid, SIGKILL);
			waitpid(p->pid, &st, 0);
			reaped(p, st);
		}
	}
	if (status)
		*status = st;
	/* Under the device_copy double (EMBD_TEST_CPU_KERNEL) every host array a kernel call
	 * copies must be registered for DMA; the double logs the first one that is not. */
	const char *kernel = getenv("EMBD_TEST_CPU_KERNEL");
	if (kernel && !strcmp(kernel, "device_copy"))
		cr_expect(!tu_embd_log_has(p, "not registered for DMA"),
			  "embd (log %s) copied an array not registered for DMA", p->log);
	return exited;
}

void tu_embd_read_log(const struct tu_embd *p, char *out, size_t len)
{
	FILE *f = p->log[0] ? fopen(p->log, "r") : NULL;
	size_t got = f ? fread(out, 1, len - 1, f) : 0;

	out[got] = 0;
	if (f)
		fclose(f);
}

bool tu_embd_log_has(const struct tu_embd *p, const char *text)
{
	char line[1024];
	bool found = false;
	FILE *f = p->log[0] ? fopen(p->log, "r") : NULL;

	while (f && !found && fgets(line, sizeof(line), f))
		found = strstr(line, text) != NULL;
	if (f)
		fclose(f);
	return found;
}

/* embd's open fds counted, each also named on stderr when log is set; -1 when unreadable. */
static int scan_fds(const struct tu_embd *p, bool log)
{
	char dir[64], path[320], target[256];
	int n = 0;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)p->pid);
	DIR *d = p->pid > 0 ? opendir(dir) : NULL;
	if (!d)
		return -1;
	for (struct dirent *e; (e = readdir(d));) {
		if (e->d_name[0] == '.')
			continue;
		n++;
		if (!log)
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		ssize_t len = readlink(path, target, sizeof(target) - 1);
		target[len > 0 ? len : 0] = '\0';
		fprintf(stderr, "embd pid %d fd %s -> %s\n", (int)p->pid, e->d_name, target);
	}
	closedir(d);
	return n;
}

int tu_embd_count_fds(const struct tu_embd *p)
{
	return scan_fds(p, false);
}

long tu_embd_rss_kb(const struct tu_embd *p)
{
	char path[64], line[256];
	long kb = -1;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)p->pid);
	FILE *f = p->pid > 0 ? fopen(path, "r") : NULL;
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
			break;
	if (f)
		fclose(f);
	return kb;
}

int tu_embd_wait_fds(const struct tu_embd *p, int want, int timeout_ms)
{
	const int64_t deadline = embd_now_ms() + timeout_ms;
	int n = tu_embd_count_fds(p);

	while (n != want && embd_now_ms() < deadline) {
		usleep(10000);
		n = tu_embd_count_fds(p);
	}
	if (n != want)
		scan_fds(p, true);      /* a count that did not settle names its fds */
	return n;
}
