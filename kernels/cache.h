/*
 * kernels/cache.h - the bookkeeping of fused_uvm_caching's row cache: a set-associative cache
 * of a shard's hot rows with LRU replacement, in host code that plans the copies a device
 * makes (engine/ranks_cache.c runs it; the backends copy the rows).
 *
 * A shard's rows live in host memory; the cache holds sets x ways of them (weights and their
 * optimizer state) in slots 0 .. sets * ways - 1. Row r may sit only in set embd_cache_set(r).
 * Each kernel call MAPS all of its rows at once: a row already cached is a hit (its way
 * becomes the most recently used); a miss takes the least recently used way of its set that
 * no row of this call holds (rows of the call are never evicted within it), the way's row
 * written back first when a backward dirtied it. A call with more distinct rows in one set
 * than ways still runs: the rows left over get OVERFLOW slots past the cache (sets * ways,
 * ...), fetched for this call only and, after a backward, written back at its end.
 *
 * The plan of one map is a list of write-backs (slot -> host row) and of fetches (host row
 * -> slot): a device performs every write-back before any fetch, since a slot may be in both.
 * Rows are LOCAL (0 .. rows - 1 of the shard). Not thread-safe: one cache per shard, used by
 * its rank's thread.
 */
#ifndef EMBD_KERNELS_CACHE_H
#define EMBD_KERNELS_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* FBGEMM's associativity on CUDA: one warp compares the 32 tags of a set at once. */
#define EMBD_CACHE_WAYS 32

/* Copies a device makes for one map, flush or end: every write-back, then every fetch. */
struct embd_cache_moves {
	uint64_t num_writebacks;
	const uint64_t *wb_slot;        /* from slot wb_slot[i] to host row wb_row[i] */
	const int64_t *wb_row;
	uint64_t num_fetches;
	const uint64_t *fetch_slot;     /* from host row fetch_row[i] to slot fetch_slot[i] */
	const int64_t *fetch_row;
};

struct embd_cache {
	int64_t rows;                   /* of the shard */
	uint64_t sets;
	uint32_t ways;
	int64_t *tag;                   /* sets * ways: the local row a way holds, -1 empty */
	uint64_t *used;                 /* sets * ways: the tick of the way's last use (LRU) */
	uint64_t *call;                 /* sets * ways: the map that last used the way */
	bool *dirty;                    /* sets * ways: changed since fetched or flushed */
	uint64_t tick, calls;
	uint64_t hits, misses;          /* distinct rows of the maps that asked to count */
	/* the current call */
	uint64_t overflow;              /* overflow slots in use (sets * ways + i holds row) */
	int64_t *overflow_row;
	uint64_t overflow_cap;
	uint64_t *mapped;               /* the distinct slots of the call */
	uint64_t num_mapped, mapped_cap;
	/* the plan and the call's scratch */
	uint64_t *wb_slot, *fetch_slot;
	int64_t *wb_row, *fetch_row;
	int64_t *prev_row;              /* per fetch: what its way held (embd_cache_undo) */
	bool *prev_dirty;
	uint64_t counted_hits, counted_misses;
	uint64_t num_wb, num_fetch, plan_cap;
	int64_t *uniq;                  /* distinct rows, first seen first */
	uint64_t *uniq_slot;
	uint32_t *index;                /* open-addressing table: row -> uniq index + 1 */
	uint64_t uniq_cap, index_cap;
};

/*
 * The geometry for a shard of rows rows at uvm_caching_ratio ratio (0 < ratio <= 1): the
 * cache holds about rows * ratio rows, never more (the planner's HBM estimate): ways =
 * min(EMBD_CACHE_WAYS, ceil(rows * ratio)), sets = max(1, ceil(rows * ratio) / ways).
 * EMBD_EINVAL (message in err) for rows < 1 or a ratio outside (0, 1].
 */
int embd_cache_geometry(int64_t rows, double ratio, uint64_t *sets, uint32_t *ways, char *err,
			size_t err_len);

/* An empty cache of that geometry (EMBD_EINVAL as above, EMBD_ENOMEM). */
int embd_cache_create(int64_t rows, double ratio, struct embd_cache **out, char *err,
		      size_t err_len);
/* The same with a geometry of the caller's (tests, benchmarks); EMBD_EINVAL for none. */
int embd_cache_create_sets(int64_t rows, uint64_t sets, uint32_t ways, struct embd_cache **out,
			   char *err, size_t err_len);
/* NULL is a no-op. */
void embd_cache_destroy(struct embd_cache *c);

/* The set row may live in: a multiplicative hash, so strided ids spread over the sets. */
static inline uint64_t embd_cache_set(const struct embd_cache *c, int64_t row)
{
	return (((uint64_t)row * 0x9e3779b97f4a7c15ull) >> 17) % c->sets;
}

/* Slots of the cache proper; overflow slots come after them. */
static inline uint64_t embd_cache_slots(const struct embd_cache *c)
{
	return c->sets * c->ways;
}

/*
 * Begins a call with the n rows rows[] (local, each in [0, c->rows): the caller checks; a
 * row may repeat): slot_of[i] is where rows[i] is for this call, and moves the copies to make
 * before the kernel runs (write-backs of dirty victims, fetches of misses and overflow rows).
 * count: add the distinct rows to hits and misses (lookups; a backward maps rows its forward
 * just fetched). The slots needed are embd_cache_slots(c) + c->overflow. Ends the call before
 * it, if any, without write-backs. EMBD_ENOMEM leaves the cache as it was.
 */
int embd_cache_map(struct embd_cache *c, const int64_t *rows, uint64_t n, bool count,
		   uint64_t *slot_of, struct embd_cache_moves *moves);

/*
 * Takes back the last map when its moves could not be made (no room for the slots, a failed
 * copy): the ways hold the rows and dirty marks they held before, the counts are as before.
 * Rows a failed copy half moved are not restored: a device that fails a copy is not trusted.
 */
void embd_cache_undo(struct embd_cache *c);

/*
 * Ends the call: wrote (its backward applied) marks its cached rows dirty and plans the
 * write-back of its overflow rows into moves (none otherwise); the overflow slots are free.
 */
void embd_cache_end(struct embd_cache *c, bool wrote, struct embd_cache_moves *moves);

/* Plans the write-back of every dirty row (before a checkpoint or a live read) and marks them
 * clean: once moves are made the host rows equal the cache's. EMBD_ENOMEM: nothing planned,
 * nothing marked. */
int embd_cache_flush(struct embd_cache *c, struct embd_cache_moves *moves);

/* Forgets every row without writing any back: the host rows are newer (a restore, a write). */
void embd_cache_invalidate(struct embd_cache *c);

/* The local row slot holds in the current call (overflow slots included); -1 for none. */
int64_t embd_cache_row_of(const struct embd_cache *c, uint64_t slot);

#endif /* EMBD_KERNELS_CACHE_H */
