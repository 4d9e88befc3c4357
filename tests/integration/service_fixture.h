/*
 * tests/integration/service_fixture.h - one embd (tests/support/embd_process.h) on a private
 * socket for the single-node integration suites. The Criterion suite fixture (start_service /
 * stop_service) runs the embedded default config before each test and stops it with SIGTERM
 * after, so no test leaves a service running; service_spawn (a config file),
 * service_spawn_keys (a few keys) and service_stop_within let a test choose the config, keep
 * the service's log and require that SIGTERM alone stops it in time.
 */
#ifndef EMBD_TESTS_SERVICE_FIXTURE_H
#define EMBD_TESTS_SERVICE_FIXTURE_H

#include <criterion/criterion.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <unistd.h>

#include "tests/support/embd_process.h"

static struct tu_embd service;

/* How long the service's open fds may take to settle after a trainer left (tu_embd_wait_fds):
 * the trainers learn of a cancellation before the service closed the dead one's fds. */
#define FDS_SETTLE_MS 3000

/*
 * Starts embd with config_path (NULL: the embedded default) at log_level, its stderr in
 * service.log, and waits up to 5 s for its socket.
 */
static inline void service_spawn(const char *config_path, const char *log_level)
{
	const struct tu_embd_opts o = { .config = config_path, .log_level = log_level };

	snprintf(service.socket, sizeof(service.socket), "/tmp/embd-test-%d.sock", (int)getpid());
	snprintf(service.log, sizeof(service.log), "/tmp/embd-test-%d.log", (int)getpid());
	tu_embd_start(&service, &o);
	tu_embd_await_socket(&service, 5000, "embd");
}

/* service_spawn with a config of the given keys (a JSON object's members without the
 * braces; the rest take their defaults), written to a file removed once embd is up. */
static inline void service_spawn_keys(const char *keys, const char *log_level)
{
	char path[128];

	snprintf(path, sizeof(path), "/tmp/embd-test-%d.json", (int)getpid());
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f, "cannot write %s", path);
	fprintf(f, "{ %s }\n", keys);
	fclose(f);
	service_spawn(path, log_level);
	unlink(path);
}

/*
 * SIGTERM, then waits up to timeout_ms for embd to exit. Returns true with its wait status in
 * *status when it did; false when it had to be SIGKILLed. A no-op (true) when no service runs.
 */
static inline bool service_stop_within(int timeout_ms, int *status)
{
	bool exited = tu_embd_stop(&service, SIGTERM, timeout_ms, status);

	unlink(service.socket);
	return exited;
}

static inline void start_service(void)
{
	service_spawn(NULL, "error");
}

static inline void stop_service(void)
{
	service_stop_within(10000, NULL);
	unlink(service.log);
}

#endif
