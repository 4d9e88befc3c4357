/*
 * tests/support/reference.h - the plain, unsharded definition of what the kernels compute:
 * a whole table in one array, pooled and trained with the most direct loops possible (a dense
 * gradient of the whole table, rows updated in ascending order), plus naive bucketize and
 * permute. Tests compare the sharded, vectorized, multi-threaded kernels against it; the
 * service's integration tests compare a whole cluster against it.
 *
 * The formulas are those of kernels/pool_row.h and kernels/optim_row.h (their comments), written
 * out again here rather than included, with the same fmaf() and operation order, so that a
 * kernel over one unsplit shard equals it bit for bit. Init is embd_init_value() (the
 * definition of a table's initial weights).
 */
#ifndef EMBD_TESTS_REFERENCE_H
#define EMBD_TESTS_REFERENCE_H

#include <stdint.h>

#include "embd/types.h"

struct embd_ref_table {
	uint32_t table_id;
	int64_t rows;
	uint32_t dim;
	enum embd_data_type dtype;
	struct embd_optimizer_spec opt;
	float *w32;                     /* rows x dim when fp32 */
	uint16_t *w16;                  /* rows x dim when fp16 */
	float *m1;                      /* adagrad: rows x dim; rowwise_adagrad: rows; adam: m */
	float *m2;                      /* adam: v, rows x dim */
	int64_t step;
};

/* A table initialised as embd_shard_init_weights() would with this seed; NULL on ENOMEM. */
struct embd_ref_table *embd_ref_table_create(uint32_t table_id, int64_t rows, uint32_t dim,
					     enum embd_data_type dtype,
					     const struct embd_optimizer_spec *opt, uint64_t seed);
void embd_ref_table_destroy(struct embd_ref_table *t);

/* Weight (row, col) as fp32. */
float embd_ref_weight(const struct embd_ref_table *t, int64_t row, uint32_t col);

/* One feature's bags: B lengths, their ids (global rows, all in range), optional weights. */
struct embd_ref_bags {
	uint32_t batch_size;
	const int32_t *lengths;
	const int64_t *ids;
	const float *weights;           /* or NULL */
	enum embd_pooling pooling;
	const float *grad;              /* backward: B x dim dL/d(pooled) */
	uint32_t grad_divisor;          /* backward: grad counts divided by it (0, 1: not) */
};

/* out[b * dim + c] = pooled bag b. */
void embd_ref_forward(const struct embd_ref_table *t, const struct embd_ref_bags *bags, float *out);

/* One optimizer step with the gradient of n features' bags summed in the order given. */
int embd_ref_backward(struct embd_ref_table *t, const struct embd_ref_bags *bags, uint32_t n);

/* Naive block bucketize with the meaning of embd_jagged_bucketize (ids all valid). */
void embd_ref_bucketize(uint32_t num_features, uint32_t batch_size, const int32_t *lengths,
			const int64_t *values, const float *weights, const int64_t *feature_rows,
			uint32_t num_buckets, int32_t *out_lengths, int64_t *out_values,
			float *out_weights, uint64_t *out_permute);

/* Naive segment permute with the meaning of embd_jagged_permute. */
void embd_ref_permute(uint32_t num_segments, uint32_t segment_size, const uint32_t *perm,
		      const int32_t *lengths, const int64_t *values, const float *weights,
		      int32_t *out_lengths, int64_t *out_values, float *out_weights);

#endif /* EMBD_TESTS_REFERENCE_H */
