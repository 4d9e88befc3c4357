/* Helpers for the kernels' unit tests (kernel_test_util.h). */
#include "tests/unit/kernels/kernel_test_util.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/support/mix.h"

uint64_t trng_u64(struct trng *r)
{
	return tu_mix_next(&r->s);
}

uint64_t trng_below(struct trng *r, uint64_t n)
{
	return n ? trng_u64(r) % n : 0;
}

float trng_float(struct trng *r, float lo, float hi)
{
	return lo + (hi - lo) * (float)((trng_u64(r) >> 40) * 0x1p-24);
}

void tbags_random(struct tbags *t, struct trng *r, uint32_t batch_size, uint32_t max_len,
		  uint32_t zero_pct, int64_t rows, uint32_t hot_pct, bool weighted)
{
	memset(t, 0, sizeof(*t));
	t->batch_size = batch_size;
	t->lengths = malloc((batch_size ? batch_size : 1) * sizeof(*t->lengths));
	t->offsets = malloc((batch_size + 1) * sizeof(*t->offsets));
	cr_assert(t->lengths && t->offsets);
	t->offsets[0] = 0;
	for (uint32_t b = 0; b < batch_size; b++) {
		t->lengths[b] = trng_below(r, 100) < zero_pct ? 0 : (int32_t)trng_below(r, max_len + 1);
		t->offsets[b + 1] = t->offsets[b] + t->lengths[b];
	}
	t->num_ids = (uint64_t)t->offsets[batch_size];
	t->ids = malloc((t->num_ids ? t->num_ids : 1) * sizeof(*t->ids));
	t->weights = weighted ? malloc((t->num_ids ? t->num_ids : 1) * sizeof(float)) : NULL;
	cr_assert(t->ids && (!weighted || t->weights));
	for (uint64_t i = 0; i < t->num_ids; i++) {
		bool hot = trng_below(r, 100) < hot_pct;
		t->ids[i] = (int64_t)trng_below(r, hot ? (rows < 4 ? (uint64_t)rows : 4) : (uint64_t)rows);
		if (weighted)
			t->weights[i] = trng_float(r, -1.5f, 1.5f);
	}
}

void tbags_free(struct tbags *t)
{
	free(t->lengths);
	free(t->offsets);
	free(t->ids);
	free(t->weights);
}

int tisas(enum embd_isa isas[3])
{
	static const enum embd_isa all[] = { EMBD_ISA_SCALAR, EMBD_ISA_AVX2, EMBD_ISA_AVX512 };
	int n = 0;

	for (int i = 0; i < 3; i++)
		if (embd_kernels_isa_supported(all[i]))
			isas[n++] = all[i];
	return n;
}

struct embd_shard *tshard(const struct embd_ref_table *ref, uint64_t seed, int64_t row_offset,
			  int64_t rows, uint32_t col_offset, uint32_t cols)
{
	struct embd_shard_desc d = {
		.table_id = ref->table_id,
		.num_embeddings = ref->rows,
		.embedding_dim = ref->dim,
		.dtype = ref->dtype,
		.row_offset = row_offset,
		.rows = rows,
		.col_offset = col_offset,
		.cols = cols,
		.optimizer = ref->opt,
	};
	struct embd_shard *s;
	char err[160];

	int rc = embd_shard_create(&d, &s, err, sizeof(err));
	cr_assert_eq(rc, 0, "embd_shard_create: %d %s", rc, err);
	embd_shard_init_weights(s, seed, NULL);
	return s;
}

void texpect_equal(const char *what, const float *expected, const float *got, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		uint32_t a, b;
		memcpy(&a, &expected[i], 4);
		memcpy(&b, &got[i], 4);
		if (a != b && !(expected[i] != expected[i] && got[i] != got[i]))
			cr_assert_fail("%s[%llu]: expected %.9g (0x%08x), got %.9g (0x%08x)", what,
				 (unsigned long long)i, expected[i], a, got[i], b);
	}
}
