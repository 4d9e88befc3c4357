/*
 * embd-bench ipc: the round trip of an empty request (NOP) through a real embd, once with the
 * service busy-polling its rings (busy_poll_us large) and once sleeping at once (busy_poll_us
 * 0), each beside the floor two threads of this process reach in the same run: a cache-line
 * ping-pong (an atomic flag bounced, both spinning) and a futex ping-pong (both sleeping).
 * In the sleeping run the client pauses (untimed, --gap-us) before each request so that the
 * service is really asleep: back to back, its loop may still find the next request awake.
 * The two ping-pong threads are pinned to two different CPUs (the service and the client run
 * on different CPUs too); unpinned, a futex wake is bimodal on VMs (same CPU ~5 us, across
 * ~50 us).
 * Also home of bench_embd_start / bench_embd_stop, which run a private embd for a benchmark.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "embd/client.h"

#ifndef EMBD_BENCH_EMBD
#define EMBD_BENCH_EMBD "embd"
#endif

/* ---- a private embd ---------------------------------------------------------------------- */

static pid_t live_pid;                  /* the embd to kill at exit or on a signal */
static char live_config[128], live_socket[108];
static cpu_set_t start_cpus;            /* affinity before any benchmark pinned this thread */
static bool have_start_cpus;

/* SIGTERM, then SIGKILL when embd has not exited within 3 s (async-signal-safe). */
static void stop_pid(pid_t pid)
{
	struct timespec ms10 = { 0, 10000000 };

	kill(pid, SIGTERM);
	for (int i = 0; i < 300; i++) {
		if (waitpid(pid, NULL, WNOHANG) == pid)
			return;
		nanosleep(&ms10, NULL);
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
}

static void kill_live(void)
{
	if (live_pid > 0) {
		stop_pid(live_pid);
		live_pid = 0;
	}
	if (live_config[0])
		unlink(live_config);
	if (live_socket[0])
		unlink(live_socket);
	live_config[0] = live_socket[0] = 0;
}

static void on_signal(int sig)
{
	if (live_pid > 0)
		stop_pid(live_pid);
	if (live_config[0])
		unlink(live_config);
	if (live_socket[0])
		unlink(live_socket);
	signal(sig, SIG_DFL);
	raise(sig);
}

const char *bench_embd_path(int argc, char **argv)
{
	const char *env = getenv("EMBD_BENCH_EMBD");

	if (!have_start_cpus)
		have_start_cpus = sched_getaffinity(0, sizeof(start_cpus), &start_cpus) == 0;

	for (int i = 1; i + 1 < argc; i++)
		if (!strcmp(argv[i], "--embd"))
			return argv[i + 1];
	return env && *env ? env : EMBD_BENCH_EMBD;
}

int bench_embd_start(const char *embd_path, const char *config_json, struct bench_embd *out)
{
	static bool hooked;
	FILE *f;
	int status;

	memset(out, 0, sizeof(*out));
	if (!hooked) {
		atexit(kill_live);
		signal(SIGINT, on_signal);
		signal(SIGTERM, on_signal);
		hooked = true;
	}
	kill_live();
	snprintf(live_config, sizeof(live_config), "/tmp/embd-bench-%d.json", (int)getpid());
	snprintf(live_socket, sizeof(live_socket), "/tmp/embd-bench-%d.sock", (int)getpid());
	f = fopen(live_config, "w");
	if (!f || fputs(config_json, f) < 0 || fclose(f)) {
		fprintf(stderr, "embd-bench: cannot write %s\n", live_config);
		return -1;
	}
	unlink(live_socket);
	pid_t pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		/* not the CPUs this thread may have been pinned to since: embd pins its own */
		if (have_start_cpus)
			sched_setaffinity(0, sizeof(start_cpus), &start_cpus);
		execl(embd_path, "embd", "--config", live_config, "--socket", live_socket,
		      "--log-level", "error", (char *)NULL);
		fprintf(stderr, "embd-bench: cannot run %s: %s\n", embd_path, strerror(errno));
		_exit(127);
	}
	live_pid = pid;
	for (int i = 0; i < 3000 && access(live_socket, F_OK) != 0; i++) {
		if (waitpid(pid, &status, WNOHANG) == pid) {
			live_pid = 0;
			fprintf(stderr, "embd-bench: %s exited before listening\n", embd_path);
			kill_live();
			return -1;
		}
		usleep(10000);
	}
	if (access(live_socket, F_OK) != 0) {
		fprintf(stderr, "embd-bench: %s did not create %s within 30 s\n", embd_path,
			live_socket);
		kill_live();
		return -1;
	}
	out->pid = pid;
	snprintf(out->socket_path, sizeof(out->socket_path), "%s", live_socket);
	return 0;
}

void bench_embd_stop(struct bench_embd *e)
{
	if (e->pid > 0 && e->pid == live_pid)
		kill_live();
	e->pid = 0;
}

/* ---- thread ping-pongs ------------------------------------------------------------------- */

struct pingpong {
	_Alignas(64) atomic_int flag;
	int n;
	int cpu;
	bool futex;
};

static void futex_wait(atomic_int *addr, int val)
{
	syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(atomic_int *addr)
{
	syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* The first two CPUs this process may use (the same one twice on a 1-CPU machine). */
static void two_cpus(int cpu[2])
{
	cpu_set_t set;
	int k = 0;

	cpu[0] = cpu[1] = 0;
	if (sched_getaffinity(0, sizeof(set), &set) == 0)
		for (int c = 0; c < CPU_SETSIZE && k < 2; c++)
			if (CPU_ISSET(c, &set))
				cpu[k++] = c;
	if (k == 1)
		cpu[1] = cpu[0];
}

static void pin_self(int cpu)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* The partner: waits for 1, answers 0. */
static void *pong(void *arg)
{
	struct pingpong *p = arg;

	pin_self(p->cpu);

	for (int i = 0; i < p->n; i++) {
		while (atomic_load_explicit(&p->flag, memory_order_acquire) != 1)
			if (p->futex)
				futex_wait(&p->flag, 0);
		atomic_store_explicit(&p->flag, 0, memory_order_release);
		if (p->futex)
			futex_wake(&p->flag);
	}
	return NULL;
}

/* Median round trip in us of n ping-pongs between this thread and another. */
static double pingpong_p50_us(int n, bool use_futex)
{
	struct pingpong p = { .n = n, .futex = use_futex };
	double *us = malloc((size_t)n * sizeof(double));
	pthread_t t;
	cpu_set_t saved;
	int cpu[2];

	two_cpus(cpu);
	p.cpu = cpu[1];
	atomic_init(&p.flag, 0);
	if (!us || pthread_create(&t, NULL, pong, &p)) {
		free(us);
		return 0;
	}
	bool restore = pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0;
	pin_self(cpu[0]);
	for (int i = 0; i < n; i++) {
		uint64_t t0 = bench_now_ns();
		atomic_store_explicit(&p.flag, 1, memory_order_release);
		if (use_futex)
			futex_wake(&p.flag);
		while (atomic_load_explicit(&p.flag, memory_order_acquire) != 0)
			if (use_futex)
				futex_wait(&p.flag, 1);
		us[i] = (double)(bench_now_ns() - t0) / 1e3;
	}
	pthread_join(t, NULL);
	if (restore)
		pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
	double r = bench_median(us, (size_t)n);
	free(us);
	return r;
}

/* ---- NOP round trips --------------------------------------------------------------------- */

static const char ipc_config_fmt[] =
	"{ \"tables\": [ { \"name\": \"t0\", \"num_embeddings\": 1000, \"embedding_dim\": 16,\n"
	"    \"constraints\": { \"sharding_types\": [\"table_wise\"] } } ],\n"
	"  \"topology\": { \"world_size\": 1, \"local_world_size\": 1, \"compute_device\": \"cpu\",\n"
	"                \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", \"batch_size\": 16 },\n"
	"  \"trainers_per_node\": 1, \"threads_per_rank\": 1, \"log_level\": \"error\",\n"
	"  \"busy_poll_us\": %u }\n";

/* n NOP round trips: the client waits in embd_wait (spins, then sleeps) or, with spin_poll,
 * spins on embd_poll (which makes a poll() syscall on every empty look); !busy: it sleeps
 * gap_us first. */
static int nop_round_trips(const char *embd, unsigned busy_poll_us, bool busy, bool spin_poll,
			   int n, unsigned gap_us, double *p50, double *p99)
{
	char config[1024], err[256];
	struct bench_embd e;
	struct embd_client *c = NULL;
	double *us = malloc((size_t)n * sizeof(double));
	int rc = -1;

	snprintf(config, sizeof(config), ipc_config_fmt, busy_poll_us);
	if (!us || bench_embd_start(embd, config, &e)) {
		free(us);
		return -1;
	}
	rc = embd_connect(e.socket_path, 0, 10000, &c, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "embd-bench ipc: connect: %s (%s)\n", embd_strerror(rc), err);
		goto out;
	}
	for (int i = -n / 10; i < n; i++) {         /* a tenth more first, untimed: warm-up */
		struct embd_request req = { .op = EMBD_REQUEST_NOP, .user_data = (uint64_t)i };
		struct embd_completion comp;
		if (!busy && gap_us)
			usleep(gap_us);
		uint64_t t0 = bench_now_ns();
		rc = embd_submit(c, &req);
		if (!rc) {
			if (spin_poll)
				while ((rc = embd_poll(c, &comp)) == EMBD_EAGAIN)
					;
			else
				rc = embd_wait(c, &comp, 10000);
		}
		if (!rc)
			rc = comp.result;
		if (rc) {
			fprintf(stderr, "embd-bench ipc: NOP: %s (%s)\n", embd_strerror(rc),
				embd_last_error(c));
			goto out;
		}
		if (i >= 0)
			us[i] = (double)(bench_now_ns() - t0) / 1e3;
	}
	*p99 = bench_percentile(us, (size_t)n, 99);
	*p50 = bench_percentile(us, (size_t)n, 50);
out:
	embd_close(c);
	bench_embd_stop(&e);
	free(us);
	return rc ? -1 : 0;
}

int bench_ipc_run(int argc, char **argv)
{
	const char *embd = bench_embd_path(argc, argv);
	int n = 20000;
	unsigned gap_us = 50;
	const char *only = "";
	bool spin_poll = false;
	double p50, p99, pp, fx;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--embd") && i + 1 < argc) {
			i++;
		} else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
			n = atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--gap-us") && i + 1 < argc) {
			gap_us = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--spin-poll")) {
			spin_poll = true;
		} else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
			only = argv[++i];
		} else {
			fprintf(stderr, "usage: embd-bench ipc [--iters N (20000)] [--gap-us U (50)]"
				" [--only busy|sleep] [--spin-poll] [--embd PATH]\n");
			return 2;
		}
	}
	if (n < 100)
		n = 100;

	if (strcmp(only, "sleep")) {
		pp = pingpong_p50_us(n, false);
		if (nop_round_trips(embd, 1000000, true, spin_poll, n, 0, &p50, &p99))
			return 1;
		printf("{\"name\":\"ipc_busy\",\"p50_us\":%.3f,\"p99_us\":%.3f,\"pingpong_p50_us\":%.3f,"
		       "\"ratio\":%.3f,\"iters\":%d,\"client\":\"%s\"}\n", p50, p99, pp,
		       pp > 0 ? p50 / pp : 0, n, spin_poll ? "embd_poll" : "embd_wait");
		fflush(stdout);
	}
	if (strcmp(only, "busy")) {
		fx = pingpong_p50_us(n, true);
		if (nop_round_trips(embd, 0, false, false, n, gap_us, &p50, &p99))
			return 1;
		printf("{\"name\":\"ipc_sleep\",\"p50_us\":%.3f,\"p99_us\":%.3f,\"futex_p50_us\":%.3f,"
		       "\"ratio\":%.3f,\"iters\":%d,\"gap_us\":%u}\n", p50, p99, fx, fx > 0 ? p50 / fx : 0,
		       n, gap_us);
	}
	return 0;
}
