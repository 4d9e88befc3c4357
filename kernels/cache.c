/*
 * The row cache's bookkeeping (kernels/cache.h). A map works on the call's distinct rows, found
 * with an open-addressing table in O(n): first every hit claims its way (so no miss of the
 * same call can evict it), then every miss takes the least recently used way of its set that
 * the call has not claimed, or an overflow slot when the call claimed them all.
 */
#include "kernels/cache.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"

int embd_cache_geometry(int64_t rows, double ratio, uint64_t *sets, uint32_t *ways, char *err,
			size_t err_len)
{
	if (rows < 1 || !(ratio > 0 && ratio <= 1)) {
		snprintf(err, err_len, "uvm_caching_ratio %g for %lld rows: needs a ratio in (0, 1] "
			 "and a row", ratio, (long long)rows);
		return EMBD_EINVAL;
	}
	double want = ceil((double)rows * ratio);
	uint64_t slots = want < 1 ? 1 : want > (double)rows ? (uint64_t)rows : (uint64_t)want;
	*ways = slots < EMBD_CACHE_WAYS ? (uint32_t)slots : EMBD_CACHE_WAYS;
	*sets = slots / *ways ? slots / *ways : 1;
	return 0;
}

int embd_cache_create(int64_t rows, double ratio, struct embd_cache **out, char *err,
		      size_t err_len)
{
	uint64_t sets;
	uint32_t ways;
	int rc = embd_cache_geometry(rows, ratio, &sets, &ways, err, err_len);

	*out = NULL;
	return rc ? rc : embd_cache_create_sets(rows, sets, ways, out, err, err_len);
}

int embd_cache_create_sets(int64_t rows, uint64_t sets, uint32_t ways, struct embd_cache **out,
			   char *err, size_t err_len)
{
	struct embd_cache *c;

	*out = NULL;
	if (rows < 1 || !sets || !ways || sets > UINT64_MAX / ways / sizeof(int64_t)) {
		snprintf(err, err_len, "a cache of %llu sets x %u ways for %lld rows: needs a set, "
			 "a way and a row", (unsigned long long)sets, ways, (long long)rows);
		return EMBD_EINVAL;
	}
	c = calloc(1, sizeof(*c));
	if (!c)
		return EMBD_ENOMEM;
	c->rows = rows;
	c->sets = sets;
	c->ways = ways;
	uint64_t n = sets * ways;
	c->tag = malloc(n * sizeof(*c->tag));
	c->used = calloc(n, sizeof(*c->used));
	c->call = calloc(n, sizeof(*c->call));
	c->dirty = calloc(n, sizeof(*c->dirty));
	if (!c->tag || !c->used || !c->call || !c->dirty) {
		embd_cache_destroy(c);
		snprintf(err, err_len, "cannot allocate the tags of %llu cache slots",
			 (unsigned long long)n);
		return EMBD_ENOMEM;
	}
	for (uint64_t i = 0; i < n; i++)
		c->tag[i] = -1;
	*out = c;
	return 0;
}

void embd_cache_destroy(struct embd_cache *c)
{
	if (!c)
		return;
	free(c->tag);
	free(c->used);
	free(c->call);
	free(c->dirty);
	free(c->overflow_row);
	free(c->mapped);
	free(c->wb_slot);
	free(c->wb_row);
	free(c->fetch_slot);
	free(c->fetch_row);
	free(c->prev_row);
	free(c->prev_dirty);
	free(c->uniq);
	free(c->uniq_slot);
	free(c->index);
	free(c);
}

/* *p grown to hold want elements of size bytes (cap updated by the caller's last grow). */
static int grow(void **p, uint64_t want, size_t size)
{
	void *q = realloc(*p, (want ? want : 1) * size);

	if (!q)
		return EMBD_ENOMEM;
	*p = q;
	return 0;
}

/* Room for a call of n rows: every array a map may fill, before anything changes. */
static int reserve(struct embd_cache *c, uint64_t n)
{
	if (n > c->uniq_cap) {
		uint64_t cap = n + n / 2;
		if (grow((void **)&c->uniq, cap, sizeof(*c->uniq)) ||
		    grow((void **)&c->uniq_slot, cap, sizeof(*c->uniq_slot)) ||
		    grow((void **)&c->mapped, cap, sizeof(*c->mapped)) ||
		    grow((void **)&c->overflow_row, cap, sizeof(*c->overflow_row)) ||
		    grow((void **)&c->wb_slot, cap, sizeof(*c->wb_slot)) ||
		    grow((void **)&c->wb_row, cap, sizeof(*c->wb_row)) ||
		    grow((void **)&c->fetch_slot, cap, sizeof(*c->fetch_slot)) ||
		    grow((void **)&c->fetch_row, cap, sizeof(*c->fetch_row)) ||
		    grow((void **)&c->prev_row, cap, sizeof(*c->prev_row)) ||
		    grow((void **)&c->prev_dirty, cap, sizeof(*c->prev_dirty)))
			return EMBD_ENOMEM;
		c->uniq_cap = c->mapped_cap = c->overflow_cap = c->plan_cap = cap;
	}
	uint64_t want = 16;
	while (want < 2 * n)
		want *= 2;
	if (want > c->index_cap) {
		if (grow((void **)&c->index, want, sizeof(*c->index)))
			return EMBD_ENOMEM;
		c->index_cap = want;
	}
	return 0;
}

/* The distinct rows of rows[] into c->uniq (first seen first); slot_of[i] = uniq index. */
static uint64_t distinct(struct embd_cache *c, const int64_t *rows, uint64_t n, uint64_t *slot_of)
{
	const uint64_t mask = c->index_cap - 1;
	uint64_t u = 0;

	memset(c->index, 0, c->index_cap * sizeof(*c->index));
	for (uint64_t i = 0; i < n; i++) {
		uint64_t h = ((uint64_t)rows[i] * 0x9e3779b97f4a7c15ull) >> 20;
		for (;; h++) {
			uint32_t *e = &c->index[h & mask];
			if (!*e) {
				c->uniq[u] = rows[i];
				*e = (uint32_t)++u;
				break;
			}
			if (c->uniq[*e - 1] == rows[i])
				break;
		}
		slot_of[i] = c->index[h & mask] - 1;
	}
	return u;
}

/* The way of set s holding row, or -1. */
static int64_t find_way(const struct embd_cache *c, uint64_t s, int64_t row)
{
	for (uint32_t w = 0; w < c->ways; w++)
		if (c->tag[s * c->ways + w] == row)
			return (int64_t)(s * c->ways + w);
	return -1;
}

/* The victim of set s for this call: an empty way, else the least recently used one the call
 * has not claimed; -1 when it claimed every way. */
static int64_t victim(const struct embd_cache *c, uint64_t s)
{
	int64_t best = -1;

	for (uint32_t w = 0; w < c->ways; w++) {
		uint64_t i = s * c->ways + w;
		if (c->call[i] == c->calls)
			continue;
		if (c->tag[i] < 0)
			return (int64_t)i;
		if (best < 0 || c->used[i] < c->used[best])
			best = (int64_t)i;
	}
	return best;
}

static void plan_out(const struct embd_cache *c, struct embd_cache_moves *m)
{
	*m = (struct embd_cache_moves){
		.num_writebacks = c->num_wb, .wb_slot = c->wb_slot, .wb_row = c->wb_row,
		.num_fetches = c->num_fetch, .fetch_slot = c->fetch_slot, .fetch_row = c->fetch_row,
	};
}

int embd_cache_map(struct embd_cache *c, const int64_t *rows, uint64_t n, bool count,
		   uint64_t *slot_of, struct embd_cache_moves *moves)
{
	const uint64_t none = UINT64_MAX;

	if (reserve(c, n))
		return EMBD_ENOMEM;
	c->overflow = 0;
	c->num_mapped = c->num_wb = c->num_fetch = 0;
	c->calls++;
	uint64_t u = distinct(c, rows, n, slot_of);
	/* hits first: they claim their ways before any miss looks for a victim */
	for (uint64_t k = 0; k < u; k++) {
		int64_t i = find_way(c, embd_cache_set(c, c->uniq[k]), c->uniq[k]);
		c->uniq_slot[k] = i < 0 ? none : (uint64_t)i;
		if (i >= 0) {
			c->used[i] = ++c->tick;
			c->call[i] = c->calls;
			c->mapped[c->num_mapped++] = (uint64_t)i;
		}
	}
	uint64_t hits = c->num_mapped;
	for (uint64_t k = 0; k < u; k++) {
		if (c->uniq_slot[k] != none)
			continue;
		int64_t i = victim(c, embd_cache_set(c, c->uniq[k]));
		uint64_t slot;
		if (i < 0) {
			slot = embd_cache_slots(c) + c->overflow;
			c->overflow_row[c->overflow++] = c->uniq[k];
		} else {
			slot = (uint64_t)i;
			c->prev_row[c->num_fetch] = c->tag[i];
			c->prev_dirty[c->num_fetch] = c->dirty[i];
			if (c->tag[i] >= 0 && c->dirty[i]) {
				c->wb_slot[c->num_wb] = slot;
				c->wb_row[c->num_wb++] = c->tag[i];
			}
			c->tag[i] = c->uniq[k];
			c->dirty[i] = false;
			c->used[i] = ++c->tick;
			c->call[i] = c->calls;
			c->mapped[c->num_mapped++] = slot;
		}
		c->uniq_slot[k] = slot;
		c->fetch_slot[c->num_fetch] = slot;
		c->fetch_row[c->num_fetch++] = c->uniq[k];
	}
	c->counted_hits = count ? hits : 0;
	c->counted_misses = count ? u - hits : 0;
	c->hits += c->counted_hits;
	c->misses += c->counted_misses;
	for (uint64_t i = 0; i < n; i++)
		slot_of[i] = c->uniq_slot[slot_of[i]];
	plan_out(c, moves);
	return 0;
}

void embd_cache_undo(struct embd_cache *c)
{
	for (uint64_t k = 0; k < c->num_fetch; k++) {
		uint64_t slot = c->fetch_slot[k];
		if (slot >= embd_cache_slots(c))
			continue;
		c->tag[slot] = c->prev_row[k];
		c->dirty[slot] = c->prev_dirty[k];
		c->call[slot] = 0;
	}
	c->hits -= c->counted_hits;
	c->misses -= c->counted_misses;
	c->counted_hits = c->counted_misses = 0;
	c->overflow = c->num_mapped = c->num_wb = c->num_fetch = 0;
}

void embd_cache_end(struct embd_cache *c, bool wrote, struct embd_cache_moves *moves)
{
	c->num_wb = c->num_fetch = 0;
	if (wrote) {
		for (uint64_t i = 0; i < c->num_mapped; i++)
			c->dirty[c->mapped[i]] = true;
		for (uint64_t i = 0; i < c->overflow; i++) {
			c->wb_slot[c->num_wb] = embd_cache_slots(c) + i;
			c->wb_row[c->num_wb++] = c->overflow_row[i];
		}
	}
	c->overflow = 0;
	c->num_mapped = 0;
	plan_out(c, moves);
}

int embd_cache_flush(struct embd_cache *c, struct embd_cache_moves *moves)
{
	uint64_t n = embd_cache_slots(c), dirty = 0;

	for (uint64_t i = 0; i < n; i++)
		dirty += c->dirty[i];
	c->num_wb = c->num_fetch = 0;
	plan_out(c, moves);
	/* the plan arrays hold a call's rows; a flush may need more (every slot) */
	if (dirty > c->plan_cap && reserve(c, dirty))
		return EMBD_ENOMEM;
	for (uint64_t i = 0; i < n; i++) {
		if (!c->dirty[i])
			continue;
		c->wb_slot[c->num_wb] = i;
		c->wb_row[c->num_wb++] = c->tag[i];
		c->dirty[i] = false;
	}
	plan_out(c, moves);
	return 0;
}

void embd_cache_invalidate(struct embd_cache *c)
{
	uint64_t n = embd_cache_slots(c);

	for (uint64_t i = 0; i < n; i++) {
		c->tag[i] = -1;
		c->dirty[i] = false;
		c->used[i] = 0;
	}
	c->overflow = 0;
	c->num_mapped = c->num_wb = c->num_fetch = 0;
}

int64_t embd_cache_row_of(const struct embd_cache *c, uint64_t slot)
{
	uint64_t n = embd_cache_slots(c);

	if (slot < n)
		return c->tag[slot];
	return slot - n < c->overflow ? c->overflow_row[slot - n] : -1;
}
