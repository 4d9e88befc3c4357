/*
 * kernels/finite.h - is a float array finite: the check of every trainer's gradient before a
 * backward (engine/step.c) and of every row an update wrote (kernels/cpu_kernels.c).
 *
 * Non-finite means an exponent of all ones (NaN or infinity): (bits & 0x7f800000) +
 * 0x00800000 carries into bit 31 exactly then. So the array is checked 16 lanes at a time
 * with integer AND, ADD and OR and no branch, which gcc vectorizes with the instruction set
 * it targets (SSE2 at least: 4 floats per instruction; 16 with AVX-512); only when some lane
 * saw one is the array searched element by element for the first. The cost is one read of
 * the array, which is either in cache (a row just updated) or read once anyway (a gradient).
 */
#ifndef EMBD_KERNELS_FINITE_H
#define EMBD_KERNELS_FINITE_H

#include <stdint.h>
#include <string.h>

#define EMBD_FINITE_BLOCK 16

static inline uint32_t embd_nonfinite_bit(float x)
{
	uint32_t b;

	memcpy(&b, &x, sizeof(b));
	return ((b & 0x7f800000u) + 0x00800000u) & 0x80000000u;
}

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

/* The same for fp16 elements (an exponent of all ones: 0x7c00). */
static inline uint64_t embd_first_nonfinite_fp16(const uint16_t *x, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++)
		if ((x[i] & 0x7c00u) == 0x7c00u)
			return i;
	return n;
}

#endif /* EMBD_KERNELS_FINITE_H */
