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

#endif /* EMBD_COMMON_CLOCK_H */
