/* Timing and statistics shared by every benchmark of embd-bench. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "bench.h"

#include <math.h>
#include <sched.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t bench_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint32_t bench_allowed_cpus(int *cpus)
{
	cpu_set_t allowed;
	uint32_t n = 0;

	if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
		for (int c = 0; c < CPU_SETSIZE; c++)
			if (CPU_ISSET(c, &allowed))
				cpus[n++] = c;
	if (!n)
		cpus[n++] = 0;
	return n;
}

static int compare_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

double bench_percentile(double *values, size_t n, double p)
{
	if (n == 0)
		return 0.0;
	qsort(values, n, sizeof(*values), compare_double);
	size_t rank = (size_t)ceil(p / 100.0 * (double)n);
	if (rank == 0)
		rank = 1;
	if (rank > n)
		rank = n;
	return values[rank - 1];
}

double bench_median(double *values, size_t n)
{
	if (n == 0)
		return 0.0;
	qsort(values, n, sizeof(*values), compare_double);
	return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

void bench_cpu_model(char *out, size_t len)
{
	char line[512];
	FILE *f = fopen("/proc/cpuinfo", "r");

	snprintf(out, len, "unknown");
	while (f && fgets(line, sizeof(line), f)) {
		char *colon = strchr(line, ':');
		if (strncmp(line, "model name", 10) || !colon)
			continue;
		colon += 1 + (colon[1] == ' ');
		colon[strcspn(colon, "\n")] = 0;
		/* printed inside JSON strings: keep it to characters that need no escaping */
		for (char *c = colon; *c; c++)
			if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20)
				*c = ' ';
		snprintf(out, len, "%s", colon);
		break;
	}
	if (f)
		fclose(f);
}

/* A TCP port that was free a moment ago on 127.0.0.1 (gloo's pairs take ephemeral ports
 * too, so a counter could collide); 0 when none could be had. */
uint16_t bench_free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	uint16_t port = 0;

	if (fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof(a)) &&
	    !getsockname(fd, (struct sockaddr *)&a, &len))
		port = ntohs(a.sin_port);
	if (fd >= 0)
		close(fd);
	return port;
}

uint64_t bench_rng_next(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}
