/*
 * Jagged utilities: lengths <-> offsets, block bucketize, segment permutes.
 *
 * Lengths come from a client that may still be writing them, so each function first copies
 * the lengths it needs into private memory and checks that copy; values are read once where
 * possible, and where bucketize must read them twice it checks that each output region is
 * not overrun, so a changing input gives an error and never a write out of bounds.
 */
#include "kernels/jagged.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"

int embd_jagged_offsets(const int32_t *lengths, uint64_t n, uint64_t num_values, int64_t *offsets,
			char *err, size_t err_len)
{
	uint64_t sum = 0;

	offsets[0] = 0;
	for (uint64_t i = 0; i < n; i++) {
		int32_t len = lengths[i];
		if (len < 0) {
			snprintf(err, err_len, "lengths[%llu] = %d is negative", (unsigned long long)i, len);
			return EMBD_EINVAL;
		}
		sum += (uint64_t)len;
		offsets[i + 1] = (int64_t)sum;
	}
	if (sum != num_values) {
		snprintf(err, err_len, "lengths add up to %llu, num_values is %llu",
			 (unsigned long long)sum, (unsigned long long)num_values);
		return EMBD_EINVAL;
	}
	return 0;
}

int embd_jagged_lengths(const int64_t *offsets, uint64_t n, int32_t *lengths, char *err,
			size_t err_len)
{
	for (uint64_t i = 0; i < n; i++) {
		int64_t a = offsets[i], b = offsets[i + 1];
		if (b < a || b - a > INT32_MAX) {
			snprintf(err, err_len, "offsets[%llu..%llu] = %lld, %lld is not a length of 0..2^31-1",
				 (unsigned long long)i, (unsigned long long)i + 1, (long long)a, (long long)b);
			return EMBD_EINVAL;
		}
		lengths[i] = (int32_t)(b - a);
	}
	return 0;
}

/* A private, checked copy of n lengths (NULL and err set on failure). */
static int32_t *copy_lengths(const int32_t *lengths, uint64_t n, uint64_t num_values, int *rc,
			     char *err, size_t err_len)
{
	int32_t *copy = malloc((n ? n : 1) * sizeof(*copy));
	int64_t *offsets = malloc((n + 1) * sizeof(*offsets));

	*rc = EMBD_ENOMEM;
	if (!copy || !offsets) {
		snprintf(err, err_len, "out of memory for %llu lengths", (unsigned long long)n);
		goto fail;
	}
	memcpy(copy, lengths, n * sizeof(*copy));
	*rc = embd_jagged_offsets(copy, n, num_values, offsets, err, err_len);
	if (*rc)
		goto fail;
	free(offsets);
	return copy;
fail:
	free(offsets);
	free(copy);
	return NULL;
}

int embd_jagged_bucketize(const struct embd_bucketize_args *a, char *err, size_t err_len)
{
	uint32_t F = a->num_features, B = a->batch_size, W = a->num_buckets;
	uint64_t nseg = (uint64_t)F * B;
	int32_t *len = NULL;
	uint64_t *cursor = NULL;
	int rc = EMBD_EINVAL;

	if (!W) {
		snprintf(err, err_len, "num_buckets is 0");
		return EMBD_EINVAL;
	}
	for (uint32_t f = 0; f < F; f++) {
		if (a->feature_rows[f] <= 0) {
			snprintf(err, err_len, "feature %u: table rows %lld must be > 0", f,
				 (long long)a->feature_rows[f]);
			return EMBD_EINVAL;
		}
	}
	len = copy_lengths(a->lengths, nseg, a->num_values, &rc, err, err_len);
	if (!len)
		return rc;
	rc = EMBD_ENOMEM;
	cursor = malloc(2 * ((uint64_t)W * F + 1) * sizeof(*cursor));
	if (!cursor) {
		snprintf(err, err_len, "out of memory for %u x %u buckets", W, F);
		goto out;
	}

	/* pass 1: check ids, count each (bucket, feature, sample) */
	memset(a->out_lengths, 0, (uint64_t)W * nseg * sizeof(*a->out_lengths));
	rc = EMBD_ERANGE;
	for (uint64_t seg = 0, j = 0; seg < nseg; seg++) {
		uint32_t f = (uint32_t)(seg / B), b = (uint32_t)(seg % B);
		int64_t rows = a->feature_rows[f], block = (rows + W - 1) / W;
		for (uint64_t end = j + (uint64_t)len[seg]; j < end; j++) {
			int64_t id = a->values[j];
			if (id < 0 || id >= rows) {
				snprintf(err, err_len, "feature %u sample %u: id %lld (value %llu) outside [0, %lld)",
					 f, b, (long long)id, (unsigned long long)j, (long long)rows);
				goto out;
			}
			a->out_lengths[((uint64_t)(id / block) * F + f) * B + b]++;
		}
	}

	/* (bucket, feature) regions of the output, bucket-major; samples inside stay in order */
	uint64_t *end = cursor + (uint64_t)W * F + 1, pos = 0;
	for (uint64_t rf = 0; rf < (uint64_t)W * F; rf++) {
		cursor[rf] = pos;
		for (uint32_t b = 0; b < B; b++)
			pos += (uint64_t)a->out_lengths[rf * B + b];
		end[rf] = pos;
	}

	/* pass 2: scatter, checking that the values still land where pass 1 counted them */
	rc = EMBD_EINVAL;
	for (uint64_t seg = 0, j = 0; seg < nseg; seg++) {
		uint32_t f = (uint32_t)(seg / B);
		int64_t rows = a->feature_rows[f], block = (rows + W - 1) / W;
		for (uint64_t stop = j + (uint64_t)len[seg]; j < stop; j++) {
			int64_t id = a->values[j];
			uint64_t rf = id < 0 || id >= rows ? UINT64_MAX : (uint64_t)(id / block) * F + f;
			if (rf == UINT64_MAX || cursor[rf] >= end[rf]) {
				snprintf(err, err_len, "value %llu changed while it was bucketized",
					 (unsigned long long)j);
				goto out;
			}
			uint64_t dst = cursor[rf]++;
			a->out_values[dst] = id;
			if (a->weights)
				a->out_weights[dst] = a->weights[j];
			if (a->out_permute)
				a->out_permute[j] = dst;
		}
	}
	rc = 0;
out:
	free(cursor);
	free(len);
	return rc;
}

int embd_jagged_perm_invert(const uint32_t *perm, uint32_t n, uint32_t *inv, char *err,
			    size_t err_len)
{
	for (uint32_t i = 0; i < n; i++)
		inv[i] = UINT32_MAX;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t p = perm[i];
		if (p >= n || inv[p] != UINT32_MAX) {
			snprintf(err, err_len, "perm[%u] = %u: %s", i, p,
				 p >= n ? "out of range" : "repeated");
			return EMBD_EINVAL;
		}
		inv[p] = i;
	}
	return 0;
}

int embd_jagged_permute(const struct embd_permute_args *a, char *err, size_t err_len)
{
	uint64_t S = a->segment_size, n = (uint64_t)a->num_segments * S;
	uint32_t nperm = a->num_segments ? a->num_segments : 1;
	uint32_t *perm = NULL, *inv = NULL;
	uint64_t *start = NULL;
	int32_t *len = NULL;
	int rc = EMBD_ENOMEM;

	perm = malloc(2 * (uint64_t)nperm * sizeof(*perm));
	start = malloc(((uint64_t)a->num_segments + 1) * sizeof(*start));
	if (!perm || !start) {
		snprintf(err, err_len, "out of memory for %u segments", a->num_segments);
		goto out;
	}
	/* checked once on a private copy, then used */
	memcpy(perm, a->perm, a->num_segments * sizeof(*perm));
	inv = perm + nperm;
	rc = embd_jagged_perm_invert(perm, a->num_segments, inv, err, err_len);
	if (rc)
		goto out;
	len = copy_lengths(a->lengths, n, a->num_values, &rc, err, err_len);
	if (!len)
		goto out;
	start[0] = 0;
	for (uint32_t s = 0; s < a->num_segments; s++) {
		uint64_t sum = 0;
		for (uint64_t i = 0; i < S; i++)
			sum += (uint64_t)len[s * S + i];
		start[s + 1] = start[s] + sum;
	}
	for (uint64_t s = 0, pos = 0; s < a->num_segments; s++) {
		uint32_t src = perm[s];
		uint64_t count = start[src + 1] - start[src];
		memcpy(a->out_lengths + s * S, len + src * S, S * sizeof(*len));
		memcpy(a->out_values + pos, a->values + start[src], count * sizeof(*a->values));
		if (a->weights)
			memcpy(a->out_weights + pos, a->weights + start[src], count * sizeof(*a->weights));
		pos += count;
	}
	rc = 0;
out:
	free(len);
	free(start);
	free(perm);
	return rc;
}

void embd_jagged_rank_to_feature_perm(uint32_t num_ranks, uint32_t num_features, uint32_t *perm)
{
	for (uint32_t f = 0; f < num_features; f++)
		for (uint32_t r = 0; r < num_ranks; r++)
			perm[f * num_ranks + r] = r * num_features + f;
}
