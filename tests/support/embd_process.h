/*
 * tests/support/embd_process.h - the real embd binary as a child of an integration test:
 * started on a socket of the test's choosing with a config file (or the embedded default),
 * its stderr in a log file, a pipe or the test's own; up once its socket file exists; stopped
 * with a signal and a deadline, after which it is SIGKILLed, its wait status collected.
 *
 * Every suite that runs embd starts it here, so its command line and what "up" means are
 * written once. The socket file appears at bind(), a moment before listen(): a client that
 * connects at once may see ECONNRESET and retries, as embd_connect's callers do. The binary is
 * the EMBD_BINARY this library is compiled with (the build's embd).
 *
 * Failures to fork or to come up are Criterion assertions: call these from the test process,
 * never from a forked child.
 */
#ifndef EMBD_TEST_EMBD_PROCESS_H
#define EMBD_TEST_EMBD_PROCESS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

struct tu_embd {
	pid_t pid;                      /* 0: not running (never started, or reaped) */
	int status;                     /* the wait status of the last exit reaped */
	int stderr_fd;                  /* with tu_embd_opts.stderr_pipe: its read end (the
				 * caller's to close), else -1 */
	char socket[108];               /* --socket; set before tu_embd_start */
	char log[128];                  /* its stderr (truncated at start), or "": the test's */
};

struct tu_embd_opts {
	const char *config;             /* --config, or NULL: the embedded default */
	const char *log_level;          /* --log-level, or NULL: the binary's default */
	bool stderr_pipe;               /* stderr into a pipe (p->log ignored) */
	void (*child_setup)(void *arg); /* in the child, after stderr is set up, before exec */
	void *child_arg;
};

/* Forks and execs `embd [--config C] --socket p->socket [--log-level L]` after removing a
 * stale p->socket. Returns at once: tu_embd_await_socket waits for it. */
void tu_embd_start(struct tu_embd *p, const struct tu_embd_opts *o);

/* Waits up to timeout_ms for p->socket to exist; fails the test, naming `name`, the socket
 * and the head of the log, when embd exits first (it is reaped) or the time runs out. */
void tu_embd_await_socket(struct tu_embd *p, int timeout_ms, const char *name);

/* Waits up to timeout_ms (< 0: for ever) for embd to exit, sending nothing: true, with its
 * wait status in *status and p->pid 0, when it did (or had: p->pid already 0). */
bool tu_embd_wait(struct tu_embd *p, int timeout_ms, int *status);

/* Sends sig, waits up to timeout_ms (< 0: for ever) and SIGKILLs embd if it still runs: true
 * when it exited within the time. *status (may be NULL) gets its wait status either way.
 * Under EMBD_TEST_CPU_KERNEL=device_copy it also fails the test when the log shows a kernel
 * array that was not registered for DMA. */
bool tu_embd_stop(struct tu_embd *p, int sig, int timeout_ms, int *status);

/* The first len - 1 bytes of the log, NUL-terminated ("" when there is none). */
void tu_embd_read_log(const struct tu_embd *p, char *out, size_t len);
/* Whether a line of the log holds text (embd flushes its log line by line). */
bool tu_embd_log_has(const struct tu_embd *p, const char *text);

/* How many fds embd holds open (entries of /proc/PID/fd), or -1. */
int tu_embd_count_fds(const struct tu_embd *p);
/* Polls up to timeout_ms for that count to equal want; returns the last count. */
int tu_embd_wait_fds(const struct tu_embd *p, int want, int timeout_ms);
/* embd's resident memory (VmRSS of /proc/PID/status) in KiB, or -1. */
long tu_embd_rss_kb(const struct tu_embd *p);

#endif /* EMBD_TEST_EMBD_PROCESS_H */
