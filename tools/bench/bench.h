/*
 * Benchmarks of embd-bench. Each prints one JSON object per line on stdout and puts every
 * figure beside a reference measured in the same run (only ratios are stable on
 * noisy machines). Each returns a process exit code.
 */
#ifndef EMBD_BENCH_H
#define EMBD_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct bench_command {
	const char *name;
	const char *summary;
	int (*run)(int argc, char **argv);
};

/* Monotonic clock in nanoseconds. */
uint64_t bench_now_ns(void);

/* The next value of a splitmix64 sequence whose state is *s: the benchmarks' ids. */
uint64_t bench_rng_next(uint64_t *s);

/* Median of n doubles (sorts values in place); 0 when n == 0. */
double bench_median(double *values, size_t n);

/* Percentile p in [0, 100] of n doubles (sorts values in place), nearest-rank. */
double bench_percentile(double *values, size_t n, double p);

/* The CPUs this process may run on, in order, into cpus (room for CPU_SETSIZE); returns how
 * many, at least 1 (CPU 0 when the affinity cannot be read). */
uint32_t bench_allowed_cpus(int *cpus);

/* This machine's CPU model ("model name" of /proc/cpuinfo, "unknown" without one), safe to
 * print inside a JSON string. */
void bench_cpu_model(char *out, size_t len);

/* embd-bench planner (bench_planner.c) */
int bench_planner_run(int argc, char **argv);

/* embd-bench kernels (bench_kernels.c) */
int bench_kernels_run(int argc, char **argv);

/* A private embd started by a benchmark (bench_ipc.c). */
struct bench_embd {
	pid_t pid;
	char socket_path[108];
};

/* The embd binary: --embd PATH in argv, else $EMBD_BENCH_EMBD, else the one built alongside.
 * Call it first: it also notes the CPUs embd may use, before a benchmark pins its thread. */
const char *bench_embd_path(int argc, char **argv);

/* Writes config_json to a temp file and runs embd on a private socket under /tmp until it
 * listens; it is killed by bench_embd_stop, at exit and on SIGINT/SIGTERM. Returns 0 or -1. */
int bench_embd_start(const char *embd_path, const char *config_json, struct bench_embd *out);
void bench_embd_stop(struct bench_embd *e);

/* A TCP port that was free a moment ago on 127.0.0.1 (gloo's pairs take ephemeral ports
 * too, so a counter could collide); 0 when none could be had. */
uint16_t bench_free_port(void);

/* embd-bench ipc (bench_ipc.c) */
int bench_ipc_run(int argc, char **argv);

/* embd-bench e2e (bench_e2e.c) */
int bench_e2e_run(int argc, char **argv);

/* embd-bench checkpoint (bench_checkpoint.c) */
int bench_checkpoint_run(int argc, char **argv);
/* embd-bench dist (bench_dist.c) */
int bench_dist_run(int argc, char **argv);
/* embd-bench train (bench_train.c, with train_bench.py) */
int bench_train_run(int argc, char **argv);

#endif
