/*
 * tests/support/dist_util.c - forking and joining children for the distribution tests
 * (dist_util.h).
 */
#include "tests/support/dist_util.h"

#include <criterion/criterion.h>

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "common/clock.h"
#include "dist/store.h"

/* Forks a child that first waits until gate_fd reads EOF (or -1: no gate). */
static pid_t spawn_gated(tu_child_fn fn, int index, void *arg, int gate_fd, int gate_w)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		char c;
		if (gate_fd >= 0) {
			close(gate_w);
			while (read(gate_fd, &c, 1) < 0)
				;
		}
		/* _exit: the parent's atexit handlers (Criterion's) are not the child's to run. No
		 * LeakSanitizer check here: in a child forked from the threaded test process it can
		 * deadlock (it stops threads that exist only in the parent). */
		int rc = fn(index, arg);
		fflush(NULL);
		_exit(rc);
	}
	return pid;
}

pid_t tu_spawn(tu_child_fn fn, int index, void *arg)
{
	return spawn_gated(fn, index, arg, -1, -1);
}

void tu_spawn_n(tu_child_fn fn, int n, void *arg, pid_t *pids)
{
	int gate[2];
	if (pipe(gate) < 0)
		abort();
	for (int i = 0; i < n; i++)
		pids[i] = spawn_gated(fn, i, arg, gate[0], gate[1]);
	close(gate[0]);
	close(gate[1]);         /* EOF: every child starts now */
}

int tu_join(const pid_t *pids, int n, int timeout_ms, int *codes)
{
	int64_t deadline = embd_now_ms() + timeout_ms;
	int pending = n, failed = 0;

	for (int i = 0; i < n; i++)
		codes[i] = pids[i] > 0 ? TU_HUNG : 127;
	for (int i = 0; i < n; i++)
		if (pids[i] <= 0)
			pending--;
	while (pending > 0 && embd_now_ms() < deadline) {
		for (int i = 0; i < n; i++) {
			int status;
			if (codes[i] != TU_HUNG || waitpid(pids[i], &status, WNOHANG) != pids[i])
				continue;
			codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
			pending--;
		}
		if (pending > 0)
			usleep(2000);
	}
	for (int i = 0; i < n; i++) {
		if (codes[i] == TU_HUNG) {
			kill(pids[i], SIGKILL);
			waitpid(pids[i], NULL, 0);
		}
		failed += codes[i] != 0;
	}
	return failed;
}

struct embd_store_server *tu_server;
uint16_t tu_port;

void tu_server_start(void)
{
	char err[256] = "";
	int rc = embd_store_server_start("127.0.0.1", 0, &tu_server, err, sizeof(err));
	cr_assert_eq(rc, 0, "store server: %d %s", rc, err);
	tu_port = embd_store_server_port(tu_server);
	cr_assert_neq(tu_port, 0);
}

void tu_server_stop(void)
{
	embd_store_server_stop(tu_server);
	tu_server = NULL;
}

static pid_t server_pid;

void tu_server_process_start(void)
{
	int port_pipe[2];
	cr_assert_eq(pipe(port_pipe), 0);
	fflush(NULL);
	server_pid = fork();
	cr_assert_geq(server_pid, 0);
	if (server_pid == 0) {
		char err[256] = "";
		struct embd_store_server *server = NULL;
		close(port_pipe[0]);
		if (embd_store_server_start("127.0.0.1", 0, &server, err, sizeof(err)) < 0) {
			fprintf(stderr, "store server: %s\n", err);
			_exit(1);
		}
		uint16_t port = embd_store_server_port(server);
		if (write(port_pipe[1], &port, sizeof(port)) != (ssize_t)sizeof(port))
			_exit(1);
		for (;;)
			pause();        /* until tu_server_process_stop's SIGKILL */
	}
	close(port_pipe[1]);
	ssize_t got = read(port_pipe[0], &tu_port, sizeof(tu_port));
	close(port_pipe[0]);
	cr_assert_eq(got, (ssize_t)sizeof(tu_port), "the store server process did not start");
}

void tu_server_process_stop(void)
{
	if (server_pid > 0) {
		kill(server_pid, SIGKILL);
		waitpid(server_pid, NULL, 0);
	}
	server_pid = 0;
}
