/*
 * tests/integration/service_fixture.h - a Criterion suite fixture that starts the real embd
 * (EMBD_BINARY, the embedded default config) on a private socket before each test and stops
 * it with SIGTERM after, so no test leaves a service running. Shared by the client unit test
 * and the integration tests.
 */
#ifndef EMBD_TESTS_SERVICE_FIXTURE_H
#define EMBD_TESTS_SERVICE_FIXTURE_H

#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t service_pid;
static char socket_path[108];

static void start_service(void)
{
	snprintf(socket_path, sizeof(socket_path), "/tmp/embd-test-%d.sock", (int)getpid());
	service_pid = fork();
	cr_assert(service_pid >= 0);
	if (service_pid == 0) {
		execl(EMBD_BINARY, "embd", "--socket", socket_path, "--log-level", "error",
		      (char *)NULL);
		_exit(127);
	}
	for (int i = 0; i < 500 && access(socket_path, F_OK) != 0; i++)
		usleep(10000);
	cr_assert(access(socket_path, F_OK) == 0, "embd did not create %s within 5 s", socket_path);
}

static void stop_service(void)
{
	int status;

	if (service_pid > 0) {
		kill(service_pid, SIGTERM);
		waitpid(service_pid, &status, 0);
	}
}

#endif
