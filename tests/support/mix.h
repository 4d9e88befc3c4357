/*
 * tests/support/mix.h - the seeded mixer the tests draw their ids, lengths and gradients from:
 * splitmix64's output function (Steele, Lea, Flood 2014), so a test's data is a pure function
 * of (seed, step, trainer, position) that any process recomputes without shared state.
 * Header-only: the kernels-only configuration builds tests that use it without this folder's
 * libraries.
 */
#ifndef EMBD_TEST_MIX_H
#define EMBD_TEST_MIX_H

#include <stdint.h>

#define TU_MIX_GAMMA 0x9e3779b97f4a7c15ull      /* splitmix64's increment: 2^64 / phi */

/* x's hash: every input bit moves about half the output bits. */
static inline uint64_t tu_mix64(uint64_t x)
{
	x += TU_MIX_GAMMA;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* splitmix64 as a generator: the next value of the sequence *state was seeded with. */
static inline uint64_t tu_mix_next(uint64_t *state)
{
	uint64_t x = tu_mix64(*state);

	*state += TU_MIX_GAMMA;
	return x;
}

#endif /* EMBD_TEST_MIX_H */
