/*
 * tests/unit/engine/test_ranks_cache.c - fused_uvm_caching through the ranks
 * (engine/ranks_cache.c) on the CPU backend, whose cache rows are host memory: forwards and
 * backwards equal the plain kernels on a shard of their own, bit for bit, while rows are
 * evicted, written back and calls overflow their set; a pull writes the dirty rows back, a
 * host write invalidates the cache, the lookups are counted and the memory is the rank's.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "engine/ranks.h"
#include "kernels/cache.h"
#include "kernels/embedding.h"

#define B 4
#define COLS 8

static const struct embd_shard_desc desc = {
	.table_id = 1, .num_embeddings = 100, .embedding_dim = COLS, .dtype = EMBD_DTYPE_FP32,
	.row_offset = 50, .rows = 40, .col_offset = 0, .cols = COLS,
	.optimizer = { .type = EMBD_OPT_ADAGRAD, .lr = 0.1f, .eps = 1e-8f },
};

struct call {
	struct embd_ranks *ranks;
	struct embd_shard *shard;
	struct embd_bag_batch *bb;
	uint32_t n;
	bool backward;
	int rc;
	struct embd_kernel_err kerr;
};

static void on_rank0(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct call *c = arg;

	if (rank != 0)
		return;
	c->rc = c->backward ? embd_ranks_backward(c->ranks, rank, exec, c->shard, c->bb, c->n,
						  &c->kerr)
			    : embd_ranks_forward(c->ranks, rank, exec, c->bb, c->n, &c->kerr);
}

static void init_host(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct call *c = arg;

	if (rank == 0)
		embd_shard_init_weights(embd_ranks_shard_host(c->ranks, c->shard), 9, exec);
}

static void expect_equal(struct embd_shard *got, const struct embd_shard *want, int step)
{
	uint64_t wb, m1, m2;
	char err[128];

	cr_assert_eq(embd_shard_sizes(&desc, &wb, &m1, &m2, err, sizeof(err)), 0);
	cr_assert_eq(got->step, want->step, "step %d: step %lld, expected %lld", step,
		     (long long)got->step, (long long)want->step);
	for (int64_t r = 0; r < desc.rows; r++) {
		cr_assert_eq(memcmp((float *)got->weights + r * COLS, (float *)want->weights + r * COLS,
				    COLS * 4), 0, "step %d: row %lld's weights differ", step,
			     (long long)(r + desc.row_offset));
		cr_assert_eq(memcmp(got->momentum1 + r * COLS, want->momentum1 + r * COLS, COLS * 4), 0,
			     "step %d: row %lld's adagrad state differs", step,
			     (long long)(r + desc.row_offset));
	}
}

Test(ranks_cache, equals_the_plain_kernels_through_evictions_and_overflow)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard, *ref;

	cr_assert_eq(embd_ranks_create_on(EMBD_DEVICE_CPU, 1, 2, &ranks, err, sizeof(err)), 0,
		     "%s", err);
	/* 40 rows at 0.2: one set of 8 ways; calls of up to 24 distinct rows overflow it */
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_FUSED_UVM_CACHING, 0.2,
					    &shard, err, sizeof(err)), 0, "%s", err);
	struct embd_shard *host = embd_ranks_shard_host(ranks, shard);
	cr_assert(host && host != shard, "a cached shard's host view is its host rows");
	uint64_t wb, m1, m2;
	cr_assert_eq(embd_shard_sizes(&desc, &wb, &m1, &m2, err, sizeof(err)), 0);
	const uint64_t row_bytes = (wb + m1 + m2) / desc.rows;
	cr_assert_geq(embd_ranks_memory_bytes(ranks, 0), wb + m1 + m2 + 8 * row_bytes,
		      "host rows and 8 cache rows at least: %llu",
		      (unsigned long long)embd_ranks_memory_bytes(ranks, 0));

	struct call c = { .ranks = ranks, .shard = shard };
	embd_ranks_run(ranks, init_host, &c);
	embd_ranks_shard_changed(ranks, shard);
	cr_assert_eq(embd_shard_create(&desc, &ref, err, sizeof(err)), 0, "%s", err);
	embd_shard_init_weights(ref, 9, NULL);

	int64_t offsets[2][B + 1], ids[2][32];
	float pooled[B][2 * COLS], expect[B][2 * COLS], grad[B][2 * COLS];
	struct embd_bag_batch bb[2], rb[2];
	uint64_t lookups = 0;
	srand(11);
	for (int step = 0; step < 60; step++) {
		/* two features' batches on the shard: hot rows 50..59, cold ones anywhere */
		for (int f = 0; f < 2; f++) {
			offsets[f][0] = 0;
			for (int s = 0; s < B; s++)
				offsets[f][s + 1] = offsets[f][s] + rand() % 5;
			for (int64_t i = 0; i < offsets[f][B]; i++)
				ids[f][i] = 50 + (rand() % 3 ? rand() % 10 : rand() % 40);
			bb[f] = (struct embd_bag_batch){
				.shard = shard, .feature = (uint32_t)f, .batch_size = B,
				.offsets = offsets[f], .ids = ids[f], .num_ids = (uint64_t)offsets[f][B],
				.pooling = f ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM,
				.pooled = &pooled[0][0], .pooled_grad = &grad[0][0],
				.pooled_stride = 2 * COLS, .pooled_col = (uint32_t)f * COLS,
			};
			rb[f] = bb[f];
			rb[f].shard = ref;
			rb[f].pooled = &expect[0][0];
		}
		bool seen[40] = { false };
		for (int f = 0; f < 2; f++)
			for (int64_t i = 0; i < offsets[f][B]; i++)
				if (!seen[ids[f][i] - 50]) {
					seen[ids[f][i] - 50] = true;
					lookups++;
				}
		c.bb = bb;
		c.n = 2;
		c.backward = false;
		embd_ranks_run(ranks, on_rank0, &c);
		cr_assert_eq(c.rc, 0, "step %d: %s", step, c.kerr.msg);
		cr_assert_eq(embd_kernels_forward(NULL, rb, 2, NULL), 0);
		cr_assert_eq(memcmp(pooled, expect, sizeof(pooled)), 0, "step %d: forward differs",
			     step);
		for (int i = 0; i < B * 2 * COLS; i++)
			grad[i / (2 * COLS)][i % (2 * COLS)] = 0.01f * (float)((i * 7 + step) % 13 - 6);
		c.backward = true;
		embd_ranks_run(ranks, on_rank0, &c);
		cr_assert_eq(c.rc, 0, "step %d: %s", step, c.kerr.msg);
		cr_assert_eq(embd_kernels_backward(NULL, ref, rb, 2, NULL), 0);
		if (step % 10 == 9) {
			/* a checkpoint's pull: every dirty row written back, the step with them */
			cr_assert_eq(embd_ranks_shard_pull(ranks, shard, err, sizeof(err)), 0, "%s",
				     err);
			expect_equal(host, ref, step);
		}
		if (step == 29) {
			/* a live write of a row just cached: the host rows are newer, the cached
			 * copy must be dropped before the next lookup reads it */
			int64_t one_off[B + 1] = { 0, 1, 1, 1, 1 }, one_id = 53;
			struct embd_bag_batch one = bb[0];
			one.offsets = one_off;
			one.ids = &one_id;
			one.num_ids = 1;
			struct embd_bag_batch rone = one;
			rone.shard = ref;
			rone.pooled = &expect[0][0];
			c.bb = &one;
			c.n = 1;
			c.backward = false;
			embd_ranks_run(ranks, on_rank0, &c);
			cr_assert_eq(c.rc, 0, "%s", c.kerr.msg);
			lookups++;
			for (int k = 0; k < COLS; k++) {
				((float *)host->weights)[3 * COLS + k] = 0.5f + (float)k;
				((float *)ref->weights)[3 * COLS + k] = 0.5f + (float)k;
			}
			embd_ranks_shard_changed(ranks, shard);
			embd_ranks_run(ranks, on_rank0, &c);
			cr_assert_eq(c.rc, 0, "%s", c.kerr.msg);
			lookups++;
			cr_assert_eq(embd_kernels_forward(NULL, &rone, 1, NULL), 0);
			cr_assert_eq(memcmp(pooled, expect, sizeof(pooled)), 0, "the written row was "
				     "read from the cache");
		}
	}
	uint64_t hits = 0, misses = 0;
	cr_assert(embd_ranks_cache_counts(ranks, shard, &hits, &misses));
	cr_assert_eq(hits + misses, lookups, "%llu hits + %llu misses, %llu distinct rows looked up",
		     (unsigned long long)hits, (unsigned long long)misses,
		     (unsigned long long)lookups);
	cr_assert(hits > 0 && misses > 0, "hits %llu, misses %llu", (unsigned long long)hits,
		  (unsigned long long)misses);

	/* an id outside the shard: refused naming it, before any row moves */
	ids[1][0] = 7;
	offsets[1][1] = offsets[1][1] ? offsets[1][1] : 1;
	c.backward = false;
	embd_ranks_run(ranks, on_rank0, &c);
	cr_assert_eq(c.rc, EMBD_ERANGE, "expected EMBD_ERANGE, got %d", c.rc);
	cr_assert_eq(c.kerr.id, 7);
	cr_assert_eq(c.kerr.feature, 1);
	cr_assert_eq(c.kerr.sample, 0);

	embd_ranks_free_shard(ranks, shard);
	cr_assert_eq(embd_ranks_memory_bytes(ranks, 0), 0);
	embd_shard_destroy(ref);
	embd_ranks_destroy(ranks);
}

/* A call that overflows one set of a large cache by a row grows the room past the cache by
 * about what it overflowed, not by a share of the cache (which on a GPU the plan's HBM budget
 * may not have). */
Test(ranks_cache, an_overflowing_call_grows_by_its_overflow)
{
	const struct embd_shard_desc big = {
		.table_id = 1, .num_embeddings = 100000, .embedding_dim = COLS,
		.dtype = EMBD_DTYPE_FP32, .rows = 100000, .cols = COLS,
		.optimizer = { .type = EMBD_OPT_SGD, .lr = 0.1f },
	};
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard;
	struct embd_cache *geometry;

	cr_assert_eq(embd_ranks_create_on(EMBD_DEVICE_CPU, 1, 1, &ranks, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &big, EMBD_KERNEL_FUSED_UVM_CACHING, 0.2,
					    &shard, err, sizeof(err)), 0, "%s", err);
	struct call c = { .ranks = ranks, .shard = shard };
	embd_ranks_run(ranks, init_host, &c);
	embd_ranks_shard_changed(ranks, shard);
	const uint64_t before = embd_ranks_memory_bytes(ranks, 0);

	/* ways + 1 distinct rows of set 0, in one bag of one call */
	cr_assert_eq(embd_cache_create(big.rows, 0.2, &geometry, err, sizeof(err)), 0, "%s", err);
	const uint32_t n = geometry->ways + 1;
	int64_t ids[64], offsets[B + 1] = { 0 };
	uint32_t k = 0;
	for (int64_t row = 0; row < big.rows && k < n; row++)
		if (embd_cache_set(geometry, row) == 0)
			ids[k++] = row;
	embd_cache_destroy(geometry);
	cr_assert_eq(k, n, "set 0 has %u rows, wanted %u", k, n);
	for (int s = 1; s <= B; s++)
		offsets[s] = n;
	float pooled[B][COLS];
	struct embd_bag_batch bb = {
		.shard = shard, .batch_size = B, .offsets = offsets, .ids = ids, .num_ids = n,
		.pooling = EMBD_POOLING_SUM, .pooled = &pooled[0][0], .pooled_stride = COLS,
	};
	c.bb = &bb;
	c.n = 1;
	embd_ranks_run(ranks, on_rank0, &c);
	cr_assert_eq(c.rc, 0, "%s", c.kerr.msg);
	const uint64_t row_bytes = COLS * 4, grown = embd_ranks_memory_bytes(ranks, 0) - before;
	cr_expect(grown <= (1 + 64) * row_bytes, "one overflow row grew the rank's memory by %llu "
		  "bytes (%llu rows)", (unsigned long long)grown,
		  (unsigned long long)(grown / row_bytes));
	embd_ranks_destroy(ranks);
}

Test(ranks_cache, other_kernels_have_no_cache)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard;
	uint64_t hits = 0, misses = 0;

	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_FUSED, 0.2, &shard, err,
					    sizeof(err)), 0, "%s", err);
	cr_assert_not(embd_ranks_cache_counts(ranks, shard, &hits, &misses));
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_FUSED_UVM_CACHING, 0,
					    &shard, err, sizeof(err)), EMBD_EINVAL);
	cr_assert(strstr(err, "uvm_caching_ratio"), "%s", err);
	embd_ranks_destroy(ranks);
}
