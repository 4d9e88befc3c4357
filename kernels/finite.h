/*
 * kernels/finite.h - is a float array finite: the check of every trainer's gradient before a
 * backward (engine/step.c). The rows an update writes are checked as they are written
 * (kernels/optim_row.h; for fp32 rows of whole vectors, the apply in kernels/cpu_kernels.c).
 *
 * Non-finite means an exponent of all ones (NaN or infinity, embd_nonfinite_bit). The array
 * is checked 16 lanes at a time with integer AND, ADD and OR and no branch, which gcc
 * vectorizes with the instruction set it targets (SSE2 at least: 4 floats per instruction; 16
 * with AVX-512); only when some lane saw one is the array searched element by element for the
 * first. The cost is one read of the array, which is read once anyway.
 *
 * embd_copy_nonfinite copies an array out of memory another process may write (a trainer's
 * slab) and checks the copy in the same pass: each block is checked as it lies in the copy,
 * so the values checked are the values kept, whatever the source does meanwhile.
 */
#ifndef EMBD_KERNELS_FINITE_H
#define EMBD_KERNELS_FINITE_H

#include <stdint.h>

#include "kernels/device.h"

#define EMBD_FINITE_BLOCK 16

/* The index of the first NaN or infinity in x[0, n), or n when every element is finite. */
static inline uint64_t embd_first_nonfinite(const float *x, uint64_t n)
{
	uint32_t lane[EMBD_FINITE_BLOCK] = { 0 }, any = 0;
	uint64_t i = 0;

	/* lanes ORed over the whole array, no exit inside: the shape gcc vectorizes at -O2 and
	 * -O3 alike (an early exit per block stops its vectorizer at -O3) */
	for (; i + EMBD_FINITE_BLOCK <= n; i += EMBD_FINITE_BLOCK)
		for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
			lane[k] |= embd_nonfinite_bit(x[i + k]);
	for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
		any |= lane[k];
	for (i = any ? 0 : i; i < n; i++)
		if (embd_nonfinite_bit(x[i]))
			return i;
	return n;
}

/* Copies src[0, n) into dst (not overlapping) and returns nonzero when some element of the
 * copy is NaN or infinite (embd_first_nonfinite on dst then finds the first). */
static inline uint32_t embd_copy_nonfinite(float *restrict dst, const float *restrict src,
					   uint64_t n)
{
	uint32_t lane[EMBD_FINITE_BLOCK] = { 0 }, any = 0;
	uint64_t i = 0;

	for (; i + EMBD_FINITE_BLOCK <= n; i += EMBD_FINITE_BLOCK) {
		for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
			dst[i + k] = src[i + k];
		/* the check reads the copy: without this the compiler may read src again */
		__asm__ volatile("" ::: "memory");
		for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
			lane[k] |= embd_nonfinite_bit(dst[i + k]);
	}
	for (; i < n; i++) {
		dst[i] = src[i];
		__asm__ volatile("" ::: "memory");
		any |= embd_nonfinite_bit(dst[i]);
	}
	for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
		any |= lane[k];
	return any;
}

#endif /* EMBD_KERNELS_FINITE_H */
