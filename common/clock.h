/*
 * common/clock.h - the monotonic clock every timeout, deadline and duration in embd is measured
 * on (CLOCK_MONOTONIC: never jumps with the wall clock, so a settimeofday cannot expire or
 * stretch a wait). Wall-clock time appears only in log lines and checkpoint manifests.
 *
 * static inline because the kernels, ipc/ and libembdclient use it without linking common/.
 */
#ifndef EMBD_COMMON_CLOCK_H
#define EMBD_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds since an arbitrary start (boot). */
static inline uint64_t embd_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Milliseconds on the same clock; signed so deadlines can be subtracted. */
static inline int64_t embd_now_ms(void)
{
	return (int64_t)(embd_now_ns() / 1000000ull);
}

/* How long a loop about to sleep idle_ms may sleep so that it wakes by due_ns (this clock):
 * 0 once due_ns passed, rounded up to whole ms before it, idle_ms when due_ns is 0 (none) or
 * further away. */
static inline int embd_sleep_ms_until(uint64_t due_ns, int idle_ms)
{
	uint64_t now = embd_now_ns();

	if (!due_ns)
		return idle_ms;
	if (due_ns <= now)
		return 0;
	uint64_t left_ms = (due_ns - now) / 1000000 + 1;
	return left_ms < (uint64_t)idle_ms ? (int)left_ms : idle_ms;
}

#endif /* EMBD_COMMON_CLOCK_H */
