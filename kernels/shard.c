/*
 * Shards: checking a shard's description, its memory, and the deterministic weight init.
 *
 * The init draws each weight from a hash of its GLOBAL coordinates (seed, table, row, col)
 * rather than from a sequential random stream, so a table initialises to the same numbers
 * however it is split into shards, and any shard can be initialised in parallel.
 */
#include "kernels/embedding.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/device.h"
#include "kernels/optim_row.h"

#define SHARD_ALIGN_BYTES 64
#define HUGE_PAGE_BYTES (2u << 20)

int embd_shard_sizes(const struct embd_shard_desc *d, uint64_t *weights_bytes,
		     uint64_t *momentum1_bytes, uint64_t *momentum2_bytes, char *err, size_t err_len)
{
	if (d->num_embeddings <= 0 || d->embedding_dim == 0) {
		snprintf(err, err_len, "table %u: num_embeddings %lld and embedding_dim %u must be > 0",
			 d->table_id, (long long)d->num_embeddings, d->embedding_dim);
		return EMBD_EINVAL;
	}
	if (d->rows <= 0 || d->row_offset < 0 || d->row_offset > d->num_embeddings - d->rows) {
		snprintf(err, err_len, "table %u: rows [%lld, +%lld) outside the table's %lld rows",
			 d->table_id, (long long)d->row_offset, (long long)d->rows,
			 (long long)d->num_embeddings);
		return EMBD_EINVAL;
	}
	if (d->cols == 0 || d->col_offset > d->embedding_dim - d->cols || d->cols > d->embedding_dim) {
		snprintf(err, err_len, "table %u: cols [%u, +%u) outside the table's %u columns",
			 d->table_id, d->col_offset, d->cols, d->embedding_dim);
		return EMBD_EINVAL;
	}
	if (d->dtype != EMBD_DTYPE_FP32 && d->dtype != EMBD_DTYPE_FP16) {
		snprintf(err, err_len, "table %u: unknown data type %d", d->table_id, (int)d->dtype);
		return EMBD_EINVAL;
	}
	if ((unsigned)d->optimizer.type > EMBD_OPT_ADAM) {
		snprintf(err, err_len, "table %u: unknown optimizer %d", d->table_id,
			 (int)d->optimizer.type);
		return EMBD_EINVAL;
	}
	/* rows * cols * 4 must not overflow: rows < 2^62 / cols keeps it in 64 bits */
	if ((uint64_t)d->rows > (UINT64_MAX / 8) / d->cols) {
		snprintf(err, err_len, "table %u: %lld x %u elements overflow", d->table_id,
			 (long long)d->rows, d->cols);
		return EMBD_EINVAL;
	}
	uint64_t rows = (uint64_t)d->rows;
	*weights_bytes = rows * d->cols * embd_dtype_bytes(d->dtype);
	*momentum1_bytes = rows * embd_optim_state_floats(d->optimizer.type, d->cols, 0) * 4;
	*momentum2_bytes = rows * embd_optim_state_floats(d->optimizer.type, d->cols, 1) * 4;
	return 0;
}

/*
 * Rows are read at random, so with 4 KiB pages nearly every row is a TLB miss (and under
 * virtualization a costly nested page walk). Memory of 2 MiB and more is therefore 2 MiB
 * aligned and advised to transparent huge pages; where THP is off this changes nothing.
 */
void *embd_rows_alloc(uint64_t bytes, bool zero)
{
	if (!bytes)
		return NULL;
	uint64_t align = bytes >= HUGE_PAGE_BYTES ? HUGE_PAGE_BYTES : SHARD_ALIGN_BYTES;
	/* aligned_alloc wants a multiple of the alignment */
	uint64_t rounded = (bytes + align - 1) & ~(align - 1);
	void *p = aligned_alloc(align, rounded);
	if (!p)
		return NULL;
	if (align == HUGE_PAGE_BYTES)
		madvise(p, rounded, MADV_HUGEPAGE);
	if (zero)
		memset(p, 0, rounded);
	return p;
}

int embd_shard_create(const struct embd_shard_desc *desc, struct embd_shard **out, char *err,
		      size_t err_len)
{
	uint64_t wb, m1b, m2b;
	struct embd_shard *s = NULL;
	int rc;

	*out = NULL;
	rc = embd_shard_sizes(desc, &wb, &m1b, &m2b, err, err_len);
	if (rc)
		return rc;
	rc = EMBD_ENOMEM;
	s = calloc(1, sizeof(*s));
	if (!s)
		goto out;
	s->desc = *desc;
	s->owns_memory = true;
	s->weights = embd_rows_alloc(wb, false);
	s->momentum1 = embd_rows_alloc(m1b, true);
	s->momentum2 = embd_rows_alloc(m2b, true);
	if (!s->weights || (m1b && !s->momentum1) || (m2b && !s->momentum2))
		goto out;
	*out = s;
	return 0;
out:
	snprintf(err, err_len, "table %u: out of memory for a shard of %llu + %llu + %llu bytes",
		 desc->table_id, (unsigned long long)wb, (unsigned long long)m1b,
		 (unsigned long long)m2b);
	embd_shard_destroy(s);
	return rc;
}

int embd_shard_create_in(const struct embd_shard_desc *desc, void *weights, float *momentum1,
			 float *momentum2, struct embd_shard **out, char *err, size_t err_len)
{
	uint64_t wb, m1b, m2b;
	struct embd_shard *s;
	int rc;

	*out = NULL;
	rc = embd_shard_sizes(desc, &wb, &m1b, &m2b, err, err_len);
	if (rc)
		return rc;
	if (!weights || (!momentum1) != (m1b == 0) || (!momentum2) != (m2b == 0)) {
		snprintf(err, err_len, "table %u: memory given (weights %s, momentum1 %s, momentum2 %s) "
			 "does not match the optimizer's state", desc->table_id,
			 weights ? "set" : "NULL", momentum1 ? "set" : "NULL", momentum2 ? "set" : "NULL");
		return EMBD_EINVAL;
	}
	s = calloc(1, sizeof(*s));
	if (!s) {
		snprintf(err, err_len, "out of memory");
		return EMBD_ENOMEM;
	}
	s->desc = *desc;
	s->weights = weights;
	s->momentum1 = momentum1;
	s->momentum2 = momentum2;
	*out = s;
	return 0;
}

void embd_shard_destroy(struct embd_shard *s)
{
	if (!s)
		return;
	if (s->owns_memory) {
		free(s->weights);
		free(s->momentum1);
		free(s->momentum2);
	}
	free(s);
}

static uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* The hash of a weight's coordinates as a uniform value in [-1, 1). */
static double init_unit(uint64_t seed, uint32_t table_id, int64_t row, uint32_t col)
{
	uint64_t h = splitmix64(seed ^ splitmix64(table_id));
	h = splitmix64(h ^ (uint64_t)row);
	h = splitmix64(h ^ col);
	return 2.0 * ((double)(h >> 11) * 0x1p-53) - 1.0;
}

static double init_bound(int64_t num_embeddings)
{
	return sqrt(1.0 / (double)num_embeddings);
}

float embd_init_value(uint64_t seed, uint32_t table_id, int64_t num_embeddings, int64_t row,
		      uint32_t col)
{
	return (float)(init_unit(seed, table_id, row, col) * init_bound(num_embeddings));
}

struct init_job {
	struct embd_shard *shard;
	uint64_t seed;
};

static void init_rows(void *arg, uint32_t worker, uint32_t num_workers)
{
	const struct init_job *job = arg;
	struct embd_shard *s = job->shard;
	const struct embd_shard_desc *d = &s->desc;
	uint64_t rows = (uint64_t)d->rows;
	uint64_t first = rows * worker / num_workers, last = rows * (worker + 1) / num_workers;
	uint64_t m1 = embd_optim_state_floats(d->optimizer.type, d->cols, 0);
	uint64_t m2 = embd_optim_state_floats(d->optimizer.type, d->cols, 1);
	double bound = init_bound(d->num_embeddings);

	for (uint64_t r = first; r < last; r++) {
		for (uint32_t c = 0; c < d->cols; c++) {
			/* embd_init_value() with the bound hoisted out of the loop */
			float v = (float)(init_unit(job->seed, d->table_id, d->row_offset + (int64_t)r,
						    d->col_offset + c) * bound);
			if (d->dtype == EMBD_DTYPE_FP16)
				((uint16_t *)s->weights)[r * d->cols + c] = embd_fp32_to_fp16(v);
			else
				((float *)s->weights)[r * d->cols + c] = v;
		}
	}
	if (m1)
		memset(s->momentum1 + first * m1, 0, (last - first) * m1 * sizeof(float));
	if (m2)
		memset(s->momentum2 + first * m2, 0, (last - first) * m2 * sizeof(float));
}

void embd_shard_init_weights(struct embd_shard *shard, uint64_t seed, const struct embd_exec *exec)
{
	struct init_job job = { .shard = shard, .seed = seed };

	embd_workers_run(exec ? exec->workers : NULL, init_rows, &job);
	shard->step = 0;
}
