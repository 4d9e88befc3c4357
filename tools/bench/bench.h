/*
 * Benchmarks of embd-bench. Each prints one JSON object per line on stdout and puts every
 * figure beside a reference measured in the same run (DEVELOPERS.md: only ratios are stable on
 * noisy machines). Each returns a process exit code.
 */
#ifndef EMBD_BENCH_H
#define EMBD_BENCH_H

#include <stddef.h>
#include <stdint.h>

struct bench_command {
	const char *name;
	const char *summary;
	int (*run)(int argc, char **argv);
};

/* Monotonic clock in nanoseconds. */
uint64_t bench_now_ns(void);

/* Median of n doubles (sorts values in place); 0 when n == 0. */
double bench_median(double *values, size_t n);

/* Percentile p in [0, 100] of n doubles (sorts values in place), nearest-rank. */
double bench_percentile(double *values, size_t n, double p);

/* embd-bench planner (bench_planner.c) */
int bench_planner_run(int argc, char **argv);

/* embd-bench kernels (bench_kernels.c) */
int bench_kernels_run(int argc, char **argv);

#endif
