/*
 * kernels/jagged.h - moving KJT-shaped jagged data around between the client's batch and the
 * shards: lengths <-> offsets, block bucketize (TorchRec's row-wise input split) and permuting
 * whole segments (by feature, by rank).
 *
 * Lengths and values come from outside (a client's batch), so every function checks them
 * (negative lengths, sums that disagree with num_values, ids outside the table) and says which
 * position is wrong in err; nothing is read past the sizes given.
 */
#ifndef EMBD_KERNELS_JAGGED_H
#define EMBD_KERNELS_JAGGED_H

#include <stddef.h>
#include <stdint.h>

/*
 * offsets[0] = 0, offsets[i + 1] = offsets[i] + lengths[i] for i < n. EMBD_EINVAL when a
 * length is negative or the lengths do not add up to num_values.
 */
int embd_jagged_offsets(const int32_t *lengths, uint64_t n, uint64_t num_values, int64_t *offsets,
			char *err, size_t err_len);

/* lengths[i] = offsets[i + 1] - offsets[i]; EMBD_EINVAL when offsets decrease or a length
 * does not fit int32. */
int embd_jagged_lengths(const int64_t *offsets, uint64_t n, int32_t *lengths, char *err,
			size_t err_len);

/*
 * Block bucketize: the row-wise input split. Each id of feature f goes to bucket
 * id / block(f), block(f) = ceil(feature_rows[f] / num_buckets) (TorchRec's block size), and
 * keeps its global value. The output is what an all-to-all sends: bucket-major, then the KJT's
 * feature-major order, each (bucket, feature, sample) in input order:
 *   out_lengths[(r * F + f) * B + b]   ids of feature f, sample b that go to bucket r
 *   out_values, out_weights            num_values each (out_weights only when weights)
 *   out_permute                        optional: out position of input value i, to scatter
 *                                      per-id results (sequence embeddings) back
 * EMBD_EINVAL for bad lengths (see embd_jagged_offsets), EMBD_ERANGE for an id outside
 * [0, feature_rows[f]).
 */
struct embd_bucketize_args {
	uint32_t num_features;          /* F */
	uint32_t batch_size;            /* B */
	const int32_t *lengths;         /* F * B, feature-major */
	const int64_t *values;
	const float *weights;           /* or NULL */
	uint64_t num_values;
	const int64_t *feature_rows;    /* F: num_embeddings of each feature's table */
	uint32_t num_buckets;           /* world size of the row-wise split */
	int32_t *out_lengths;           /* num_buckets * F * B */
	int64_t *out_values;
	float *out_weights;
	uint64_t *out_permute;          /* or NULL */
};

int embd_jagged_bucketize(const struct embd_bucketize_args *args, char *err, size_t err_len);

/*
 * Reorders whole segments of a jagged array: the lengths are num_segments segments of
 * segment_size consecutive lengths (a feature's B lengths, or a (rank, feature) block), and
 * out segment i is in segment perm[i], with its values and weights. perm must be a
 * permutation of [0, num_segments). Permute by feature: segment_size = B; the inverse
 * permutation (embd_jagged_perm_invert) undoes it.
 */
struct embd_permute_args {
	uint32_t num_segments;
	uint32_t segment_size;
	const uint32_t *perm;
	const int32_t *lengths;         /* num_segments * segment_size */
	const int64_t *values;
	const float *weights;           /* or NULL */
	uint64_t num_values;
	int32_t *out_lengths;
	int64_t *out_values;
	float *out_weights;             /* when weights */
};

int embd_jagged_permute(const struct embd_permute_args *args, char *err, size_t err_len);

/* inv[perm[i]] = i; EMBD_EINVAL when perm is not a permutation of [0, n). */
int embd_jagged_perm_invert(const uint32_t *perm, uint32_t n, uint32_t *inv, char *err,
			    size_t err_len);

/*
 * The permutation that regroups rank-major segments [rank][feature] into feature-major
 * [feature][rank] (what a rank received from every peer -> one KJT whose batch is
 * num_ranks * B per feature): perm[f * num_ranks + r] = r * num_features + f.
 */
void embd_jagged_rank_to_feature_perm(uint32_t num_ranks, uint32_t num_features, uint32_t *perm);

#endif /* EMBD_KERNELS_JAGGED_H */
