/*
 * fused_uvm_caching over any backend (engine/ranks_internal.h): the shard's rows stay in host
 * memory, the kernels compute on the backend's slot rows, and this file keeps the cache
 * (kernels/cache.h) between them. Every kernel call maps its ids first, the PREFETCH: the
 * call's distinct rows are looked up, misses get slots (dirty victims written back, the rows
 * fetched), and the batches go to the backend's own kernels with the ids replaced by slots.
 * A backward maps its rows too, so a forward or an evaluation in between cannot have evicted
 * them, and marks them dirty when it applied.
 *
 * Optimizer state is cached with its row: the kernels update both in one pass over a slot
 * (the same code as fused), an update never crosses PCIe, and the planner's HBM estimate for
 * this kernel counts the cached rows' state.
 */
#include "engine/ranks_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Overflow slots added past those a call needs, at least, when the room past the cache grows. */
#define OVERFLOW_SPARE 64

static int fail(struct embd_kernel_err *err, int rc, const char *msg)
{
	err->feature = 0;
	err->sample = err->id = -1;
	snprintf(err->msg, sizeof(err->msg), "fused_uvm_caching: %s", msg);
	return rc;
}

/* The backend's slots at rows (the cache's first rows kept), the rank's memory with them. */
static int resize(struct embd_ranks *rs, struct rank_alloc *a, uint64_t rows, char *err,
		  size_t err_len)
{
	struct rank *r = &rs->ranks[a->rank];
	uint64_t before = a->b.device_bytes;
	uint64_t keep = a->b.slots ? embd_cache_slots(a->cache) : 0;
	int rc = rs->backend->slots_resize(r->dev, &a->b, rows, keep, err, err_len);

	r->memory_bytes += a->b.device_bytes - before;
	return rc;
}

int ranks_cache_open(struct embd_ranks *rs, struct rank_alloc *a, double ratio, char *err,
		     size_t err_len)
{
	int rc = embd_cache_create(a->b.host->desc.rows, ratio, &a->cache, err, err_len);

	if (rc)
		return rc;
	if (!rs->backend->slots_resize || !rs->backend->slots_copy) {
		snprintf(err, err_len, "the %s backend has no cache rows", rs->backend->name);
		rc = EMBD_ENOTSUP;
	} else {
		/* the cache alone, as the plan counts it: a call that overflows its sets grows
		 * the slots then */
		rc = resize(rs, a, embd_cache_slots(a->cache), err, err_len);
	}
	if (rc) {
		embd_cache_destroy(a->cache);
		a->cache = NULL;
	}
	return rc;
}

void ranks_cache_close(struct rank_alloc *a)
{
	embd_cache_destroy(a->cache);
	a->cache = NULL;
}

void ranks_cache_free_ids(struct rank *r)
{
	embd_ranks_dma_free(r->owner, r->ids, r->ids_registered);
	r->ids = NULL;
	r->ids_cap = 0;
}

/* Room in the rank's scratch for n batches and ids ids. */
static int scratch(struct rank *r, uint32_t n, uint64_t ids)
{
	/* never NULL, even for no batches or ids: the callers copy batches into r->sub and
	 * point them at r->ids + offset */
	if (n > r->sub_cap || !r->sub_cap) {
		uint32_t cap = n ? n : 1;
		void *p = realloc(r->sub, cap * sizeof(*r->sub));
		if (!p)
			return EMBD_ENOMEM;
		r->sub = p;
		r->sub_cap = cap;
	}
	if (ids > r->ids_cap || !r->ids_cap) {
		uint64_t cap = ids + ids / 2 + 1;
		void *a = realloc(r->rows, cap * sizeof(*r->rows));
		if (a)
			r->rows = a;
		/* the slot ids the device reads by DMA (their contents are written after this
		 * call, so nothing is copied over) */
		bool registered;
		void *b = embd_ranks_dma_alloc(r->owner, cap * sizeof(*r->ids), &registered,
					       "a cached shard's slot ids");
		if (b) {
			ranks_cache_free_ids(r);
			r->ids = b;
			r->ids_registered = registered;
		}
		void *c = realloc(r->slots, cap * sizeof(*r->slots));
		if (c)
			r->slots = c;
		if (!a || !b || !c)
			return EMBD_ENOMEM;
		r->ids_cap = cap;
	}
	return 0;
}

/* The sample of batch b that id index i is in (for an error). */
static int64_t sample_of(const struct embd_bag_batch *b, uint64_t i)
{
	uint32_t s = 0;

	while (s < b->batch_size && (uint64_t)b->offsets[s + 1] <= i)
		s++;
	return s;
}

/*
 * The ids of a's batches in sub[0, n) into local rows, mapped, the moves made, and the batches
 * pointed at the slots (their slot ids from r->ids + *at on). count: lookups for the stats.
 */
static int map_batches(struct embd_ranks *rs, struct rank_alloc *a, struct embd_bag_batch *sub,
		       uint32_t n, bool count, uint64_t *at, struct embd_kernel_err *err)
{
	struct rank *r = &rs->ranks[a->rank];
	const struct embd_shard_desc *d = &a->b.shard->desc;
	struct embd_cache_moves mv;
	uint64_t k = 0;
	int rc;

	for (uint32_t i = 0; i < n; i++) {
		if (sub[i].shard != a->b.shard)
			continue;
		for (uint64_t j = 0; j < sub[i].num_ids; j++) {
			int64_t id = sub[i].ids[j];
			if (id < d->row_offset || id >= d->row_offset + d->rows) {
				err->feature = sub[i].feature;
				err->sample = sample_of(&sub[i], j);
				err->id = id;
				snprintf(err->msg, sizeof(err->msg), "id %lld outside the shard's rows "
					 "[%lld, %lld)", (long long)id, (long long)d->row_offset,
					 (long long)(d->row_offset + d->rows));
				return EMBD_ERANGE;
			}
			r->rows[*at + k++] = id - d->row_offset;
		}
	}
	if ((rc = embd_cache_map(a->cache, r->rows + *at, k, count, r->slots + *at, &mv)))
		return fail(err, rc, "no memory for the cache's plan");
	uint64_t need = embd_cache_slots(a->cache) + a->cache->overflow;
	/* room for half as many overflow rows again (64 at least), not a share of the cache:
	 * a cache of the plan's size grows by what calls overflow, not by a quarter of itself */
	uint64_t more = a->cache->overflow / 2 > OVERFLOW_SPARE ? a->cache->overflow / 2
								 : OVERFLOW_SPARE;
	if (need > a->b.slot_rows)
		rc = resize(rs, a, need + more, err->msg, sizeof(err->msg));
	if (!rc)
		rc = rs->backend->slots_copy(r->dev, &a->b, &mv, err->msg, sizeof(err->msg));
	if (rc) {
		embd_cache_undo(a->cache);
		err->feature = 0;
		err->sample = err->id = -1;
		return rc;
	}
	for (uint64_t j = 0; j < k; j++)
		r->ids[*at + j] = (int64_t)r->slots[*at + j];
	for (uint32_t i = 0; i < n; i++) {
		if (sub[i].shard != a->b.shard)
			continue;
		sub[i].ids = r->ids + *at;
		sub[i].shard = a->b.slots;
		*at += sub[i].num_ids;
	}
	return 0;
}

/* The ids of sub[0, n) on rank's cached shards. */
static uint64_t cached_ids(const struct embd_ranks *rs, uint32_t rank,
			   const struct embd_bag_batch *b, uint32_t n)
{
	uint64_t ids = 0;

	for (const struct rank_alloc *a = rs->allocs; a; a = a->next)
		if (a->rank == rank && a->cache)
			for (uint32_t i = 0; i < n; i++)
				ids += b[i].shard == a->b.shard ? b[i].num_ids : 0;
	return ids;
}

int ranks_cache_forward(struct embd_ranks *rs, uint32_t rank, const struct embd_exec *exec,
			const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err)
{
	struct rank *r = &rs->ranks[rank];
	struct embd_cache_moves none;
	uint64_t at = 0;
	int rc;

	if ((rc = scratch(r, n, cached_ids(rs, rank, batches, n))))
		return fail(err, rc, "no memory for a call's slots");
	memcpy(r->sub, batches, n * sizeof(*batches));
	/* every cached shard's rows mapped before the one kernel call that reads them all */
	struct rank_alloc *a = rs->allocs;
	for (; a && !rc; a = a->next)
		if (a->rank == rank && a->cache)
			rc = map_batches(rs, a, r->sub, n, true, &at, err);
	if (!rc)
		rc = rs->backend->forward(r->dev, exec, r->sub, n, err);
	for (struct rank_alloc *b = rs->allocs; b != a; b = b->next)
		if (b->rank == rank && b->cache)
			embd_cache_end(b->cache, false, &none);  /* a forward dirties nothing */
	return rc;
}

/* The first row a backward left non-finite, from its slot back to the shard's row. */
static void nonfinite_back(struct rank_alloc *a, uint64_t before)
{
	struct embd_shard *s = a->b.shard, *slots = a->b.slots;

	if (slots->nonfinite_rows == before)
		return;
	s->nonfinite_rows += slots->nonfinite_rows - before;
	int64_t row = embd_cache_row_of(a->cache, (uint64_t)slots->nonfinite_row);
	s->nonfinite_row = row < 0 ? -1 : row + s->desc.row_offset;
}

int ranks_cache_backward(struct embd_ranks *rs, struct rank_alloc *a,
			 const struct embd_exec *exec, const struct embd_bag_batch *batches,
			 uint32_t n, struct embd_kernel_err *err)
{
	struct rank *r = &rs->ranks[a->rank];
	struct embd_cache_moves mv;
	uint64_t at = 0;
	int rc;

	if ((rc = scratch(r, n, cached_ids(rs, a->rank, batches, n))))
		return fail(err, rc, "no memory for a call's slots");
	memcpy(r->sub, batches, n * sizeof(*batches));
	if ((rc = map_batches(rs, a, r->sub, n, false, &at, err)))
		return rc;
	for (uint32_t i = 0; i < n; i++)
		r->sub[i].shard = a->b.slots;   /* batches with no id name the shard as well */
	uint64_t before = a->b.slots->nonfinite_rows;
	a->b.slots->step = a->b.shard->step;
	rc = rs->backend->backward(r->dev, exec, a->b.slots, r->sub, n, err);
	a->b.shard->step = a->b.slots->step;
	nonfinite_back(a, before);
	/* a failed backward changed no row (kernels/embedding.h) */
	embd_cache_end(a->cache, !rc, &mv);
	char msg[sizeof(err->msg)];
	int wrc = rs->backend->slots_copy(r->dev, &a->b, &mv, msg, sizeof(msg));
	if (wrc && !rc) {
		/* the overflow rows' update is lost with the device that failed the copy */
		snprintf(err->msg, sizeof(err->msg), "%s", msg);
		err->feature = 0;
		err->sample = err->id = -1;
		rc = wrc;
	}
	return rc;
}

int ranks_cache_flush(struct embd_ranks *rs, struct rank_alloc *a, char *err, size_t err_len)
{
	struct embd_cache_moves mv;
	int rc = embd_cache_flush(a->cache, &mv);

	if (rc) {
		snprintf(err, err_len, "fused_uvm_caching: no memory to plan the write-back");
		return rc;
	}
	rc = rs->backend->slots_copy(rs->ranks[a->rank].dev, &a->b, &mv, err, err_len);
	a->b.host->step = a->b.shard->step;
	return rc;
}

void ranks_cache_invalidate(struct rank_alloc *a)
{
	embd_cache_invalidate(a->cache);
	a->b.shard->step = a->b.host->step;
}
