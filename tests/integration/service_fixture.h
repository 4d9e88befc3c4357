/*
 * tests/integration/service_fixture.h - starting and stopping the real embd (EMBD_BINARY) on
 * a private socket, shared by the client unit test and the integration tests. The Criterion
 * suite fixture (start_service / stop_service) runs the embedded default config before each
 * test and stops it with SIGTERM after, so no test leaves a service running; service_spawn
 * and service_stop_within let a test choose the config, keep the service's log and require
 * that SIGTERM alone stops it in time.
 */
#ifndef EMBD_TESTS_SERVICE_FIXTURE_H
#define EMBD_TESTS_SERVICE_FIXTURE_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t service_pid;
static char socket_path[108];
static char service_log_path[128];

/*
 * Starts embd with config_path (NULL: the embedded default) at log_level, its stderr in
 * service_log_path, and waits up to 5 s for its socket.
 */
static inline void service_spawn(const char *config_path, const char *log_level)
{
	snprintf(socket_path, sizeof(socket_path), "/tmp/embd-test-%d.sock", (int)getpid());
	snprintf(service_log_path, sizeof(service_log_path), "/tmp/embd-test-%d.log", (int)getpid());
	unlink(socket_path);
	service_pid = fork();
	cr_assert(service_pid >= 0);
	if (service_pid == 0) {
		int log = open(service_log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (log >= 0)
			dup2(log, STDERR_FILENO);
		if (config_path)
			execl(EMBD_BINARY, "embd", "--config", config_path, "--socket", socket_path,
			      "--log-level", log_level, (char *)NULL);
		else
			execl(EMBD_BINARY, "embd", "--socket", socket_path, "--log-level", log_level,
			      (char *)NULL);
		_exit(127);
	}
	for (int i = 0; i < 500 && access(socket_path, F_OK) != 0; i++) {
		int st;
		if (waitpid(service_pid, &st, WNOHANG) == service_pid) {
			service_pid = 0;
			cr_assert_fail("embd exited (status 0x%x) before creating its socket; log in %s",
				       st, service_log_path);
		}
		usleep(10000);
	}
	cr_assert(access(socket_path, F_OK) == 0, "embd did not create %s within 5 s", socket_path);
}

/*
 * SIGTERM, then waits up to timeout_ms for embd to exit. Returns true with its wait status in
 * *status when it did; false when it had to be SIGKILLed. A no-op (true, status 0) when no
 * service runs.
 */
static inline bool service_stop_within(int timeout_ms, int *status)
{
	bool exited = false;

	*status = 0;
	if (service_pid <= 0)
		return true;
	kill(service_pid, SIGTERM);
	for (int waited = 0; waited <= timeout_ms; waited += 5) {
		if (waitpid(service_pid, status, WNOHANG) == service_pid) {
			exited = true;
			break;
		}
		usleep(5000);
	}
	if (!exited) {
		kill(service_pid, SIGKILL);
		waitpid(service_pid, status, 0);
	}
	service_pid = 0;
	unlink(socket_path);
	return exited;
}

static inline void start_service(void)
{
	service_spawn(NULL, "error");
}

static inline void stop_service(void)
{
	int status;

	service_stop_within(10000, &status);
	unlink(service_log_path);
}

/* Open fds of pid (entries of /proc/PID/fd), or -1. */
static inline int service_count_fds(pid_t pid)
{
	char path[64];
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	DIR *d = opendir(path);
	if (!d)
		return -1;
	for (struct dirent *e; (e = readdir(d));)
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

/* Polls up to 3 s for the service's fd count to equal want; returns the last count. */
static inline int service_wait_fds(int want)
{
	int n = service_count_fds(service_pid);

	for (int i = 0; i < 300 && n != want; i++) {
		usleep(10000);
		n = service_count_fds(service_pid);
	}
	return n;
}

/* Whether the service's log holds `text` (the log is flushed line by line). */
static inline bool service_log_has(const char *text)
{
	char line[1024];
	bool found = false;
	FILE *f = fopen(service_log_path, "r");

	while (f && !found && fgets(line, sizeof(line), f))
		found = strstr(line, text) != NULL;
	if (f)
		fclose(f);
	return found;
}

#endif
