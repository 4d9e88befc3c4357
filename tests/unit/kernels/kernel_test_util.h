/*
 * Helpers shared by the kernels' unit tests: a seeded random generator, random batches in
 * the KJT's shape, shards cut from a table, the list of instruction sets to run, and float
 * comparisons that say where and by how much they differ.
 */
#ifndef EMBD_TEST_KERNELS_UTIL_H
#define EMBD_TEST_KERNELS_UTIL_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/embedding.h"
#include "tests/support/reference.h"

struct trng {
	uint64_t s;
};

uint64_t trng_u64(struct trng *r);
uint64_t trng_below(struct trng *r, uint64_t n);            /* [0, n) */
float trng_float(struct trng *r, float lo, float hi);       /* [lo, hi) */

/* One feature's random bags: B lengths in [0, max_len] (zero_pct percent of them 0), ids in
 * [0, rows) with hot_pct percent drawn from a few hot rows (duplicates), optional weights. */
struct tbags {
	uint32_t batch_size;
	int32_t *lengths;
	int64_t *offsets;               /* B + 1 */
	int64_t *ids;
	float *weights;                 /* NULL when unweighted */
	uint64_t num_ids;
};

void tbags_random(struct tbags *t, struct trng *r, uint32_t batch_size, uint32_t max_len,
		  uint32_t zero_pct, int64_t rows, uint32_t hot_pct, bool weighted);
void tbags_free(struct tbags *t);

/* The ISAs this CPU runs (scalar always first); returns how many. */
int tisas(enum embd_isa isas[3]);

/* A shard of (rows, cols) of table `ref`'s shape, initialised like ref with seed. */
struct embd_shard *tshard(const struct embd_ref_table *ref, uint64_t seed, int64_t row_offset,
			  int64_t rows, uint32_t col_offset, uint32_t cols);

/* Criterion-asserts a[i] == b[i] bit for bit (NaN == NaN), naming what and the index. */
void texpect_equal(const char *what, const float *expected, const float *got, uint64_t n);

#endif
