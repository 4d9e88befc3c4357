/*
 * The partitioners: put the shards of one proposal onto ranks. Fixed placements (row_wise
 * shard i on rank i, data_parallel everywhere) are range adds on difference arrays, node
 * placements (table_row_wise, table_column_wise) pop a heap of nodes keyed by load, and free
 * shards (table_wise, column_wise) pop a heap of ranks keyed by (load or HBM, rank) until one
 * fits. Three orders: by perf (LPT), by storage (TorchRec's greedy), memory-balanced.
 */
#include "planner/planner_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *const planner_partitioner_names[PART_COUNT] = {
	"greedy_perf", "greedy_storage_order", "memory_balanced",
};

/* ---- heaps ------------------------------------------------------------------------------ */

static bool heap_less(const struct heap_entry *a, const struct heap_entry *b)
{
	return a->key < b->key || (a->key == b->key && a->id < b->id);
}

static void heap_push(struct heap_entry *h, uint32_t *n, struct heap_entry e)
{
	uint32_t i = (*n)++;
	while (i && heap_less(&e, &h[(i - 1) / 2])) {
		h[i] = h[(i - 1) / 2];
		i = (i - 1) / 2;
	}
	h[i] = e;
}

static struct heap_entry heap_pop(struct heap_entry *h, uint32_t *n)
{
	struct heap_entry top = h[0], last = h[--(*n)];
	uint32_t i = 0;
	for (;;) {
		uint32_t c = 2 * i + 1;
		if (c >= *n)
			break;
		if (c + 1 < *n && heap_less(&h[c + 1], &h[c]))
			c++;
		if (!heap_less(&h[c], &last))
			break;
		h[i] = h[c];
		i = c;
	}
	if (*n)
		h[i] = last;
	return top;
}

static bool fits(const struct planner *p, uint32_t r, const struct shard_class *s)
{
	return p->hbm[r] + (int64_t)s->hbm <= (int64_t)p->hbm_budget &&
	       p->ddr[r] + (int64_t)s->ddr <= (int64_t)p->ddr_cap;
}

static void place(struct planner *p, uint32_t r, const struct shard_class *s)
{
	p->load_ms[r] += s->ms;
	p->hbm[r] += (int64_t)s->hbm;
	p->ddr[r] += (int64_t)s->ddr;
}

static void unplace(struct planner *p, uint32_t r, const struct shard_class *s)
{
	p->load_ms[r] -= s->ms;
	p->hbm[r] -= (int64_t)s->hbm;
	p->ddr[r] -= (int64_t)s->ddr;
}

static void range_add(struct planner *p, uint32_t lo, uint32_t hi, const struct shard_class *s)
{
	if (lo >= hi)
		return;
	p->diff_ms[lo] += s->ms;
	p->diff_ms[hi] -= s->ms;
	p->diff_hbm[lo] += (int64_t)s->hbm;
	p->diff_hbm[hi] -= (int64_t)s->hbm;
	p->diff_ddr[lo] += (int64_t)s->ddr;
	p->diff_ddr[hi] -= (int64_t)s->ddr;
}

static void fail_at(const struct planner *p, struct result *res, uint32_t t,
		    const struct shard_class *s)
{
	/* the most room any rank has left, to state the shortfall */
	int64_t room = INT64_MIN, room_ddr = INT64_MIN;
	for (uint32_t r = 0; r < p->W; r++) {
		int64_t h = (int64_t)p->hbm_budget - p->hbm[r], d = (int64_t)p->ddr_cap - p->ddr[r];
		if (h > room)
			room = h;
		if (d > room_ddr)
			room_ddr = d;
	}
	res->feasible = false;
	res->fail_table = t;
	res->fail_ddr = (int64_t)s->hbm <= room;
	res->fail_need_bytes = res->fail_ddr ? s->ddr : s->hbm;
	int64_t left = res->fail_ddr ? room_ddr : room;
	res->fail_room_bytes = left > 0 ? (uint64_t)left : 0;
}

static int compare_free(const void *a, const void *b, bool by_storage)
{
	const struct free_shard *x = a, *y = b;
	double kx = by_storage ? (double)x->hbm : x->ms, ky = by_storage ? (double)y->hbm : y->ms;
	double sx = by_storage ? x->ms : (double)x->hbm, sy = by_storage ? y->ms : (double)y->hbm;
	if (kx != ky)
		return kx > ky ? -1 : 1;
	if (sx != sy)
		return sx > sy ? -1 : 1;
	if (x->table != y->table)
		return x->table < y->table ? -1 : 1;
	return (x->shard > y->shard) - (x->shard < y->shard);
}

static int compare_by_perf(const void *a, const void *b) { return compare_free(a, b, false); }
static int compare_by_storage(const void *a, const void *b) { return compare_free(a, b, true); }

/*
 * Places one table inside node `node`: table_row_wise shard j on local rank j,
 * table_column_wise shards each on the least-loaded local rank that fits (tried on a copy of
 * the node first). Returns false and changes nothing when it does not fit.
 */
static bool place_in_node(struct planner *p, const struct option *o, uint32_t node,
			  uint32_t *ranks_out)
{
	uint32_t base = node * p->L, n = o->layout.num_shards;
	if (o->type == EMBD_SHARD_TABLE_ROW_WISE) {
		for (uint32_t j = 0; j < n; j++)
			if (!fits(p, base + j, shard_class_of(o, j)))
				return false;
		for (uint32_t j = 0; j < n; j++) {
			place(p, base + j, shard_class_of(o, j));
			if (ranks_out)
				ranks_out[j] = base + j;
		}
		return true;
	}
	double *ms = p->node_ms;
	int64_t *hbm = p->node_hbm, *ddr = p->node_ddr;
	for (uint32_t i = 0; i < p->L; i++) {
		ms[i] = p->load_ms[base + i];
		hbm[i] = p->hbm[base + i];
		ddr[i] = p->ddr[base + i];
	}
	for (uint32_t j = 0; j < n; j++) {
		const struct shard_class *s = shard_class_of(o, j);
		uint32_t best = UINT32_MAX;
		for (uint32_t i = 0; i < p->L; i++)
			if (hbm[i] + (int64_t)s->hbm <= (int64_t)p->hbm_budget &&
			    ddr[i] + (int64_t)s->ddr <= (int64_t)p->ddr_cap &&
			    (best == UINT32_MAX || ms[i] < ms[best]))
				best = i;
		if (best == UINT32_MAX)
			return false;
		ms[best] += s->ms;
		hbm[best] += (int64_t)s->hbm;
		ddr[best] += (int64_t)s->ddr;
		p->node_pick[j] = best;
	}
	for (uint32_t j = 0; j < n; j++) {
		place(p, base + p->node_pick[j], shard_class_of(o, j));
		if (ranks_out)
			ranks_out[j] = base + p->node_pick[j];
	}
	return true;
}

static double node_load(const struct planner *p, uint32_t node)
{
	double sum = 0;
	for (uint32_t r = node * p->L; r < (node + 1) * p->L; r++)
		sum += p->load_ms[r];
	return sum;
}

/* Whether rank r can trade `out` for `in` (either may be NULL) within its caps. */
static bool fits_swap(const struct planner *p, uint32_t r, const struct shard_class *out,
		      const struct shard_class *in)
{
	int64_t h = p->hbm[r] - (out ? (int64_t)out->hbm : 0) + (in ? (int64_t)in->hbm : 0);
	int64_t d = p->ddr[r] - (out ? (int64_t)out->ddr : 0) + (in ? (int64_t)in->ddr : 0);
	return h <= (int64_t)p->hbm_budget && d <= (int64_t)p->ddr_cap;
}

/*
 * Local search after the greedy placement: take the slowest rank and make the one move of a
 * free shard to the fastest rank, or swap with a smaller free shard anywhere, that lowers
 * the pair's slower side the most; stop when none helps or after `steps` shard pairs looked
 * at (a count, not a clock, so every node stops at the same plan). Greedy LPT leaves a tail
 * on the last rank filled; this removes most of it.
 */
static void refine(struct planner *p, const uint32_t *choice, size_t nfree, uint64_t steps)
{
	uint64_t done = 0;
	while (done < steps) {
		uint32_t slow = 0, fast = 0;
		for (uint32_t r = 1; r < p->W; r++) {
			if (p->load_ms[r] > p->load_ms[slow])
				slow = r;
			if (p->load_ms[r] < p->load_ms[fast])
				fast = r;
		}
		double top = p->load_ms[slow], best_gain = 0;
		size_t best_a = SIZE_MAX, best_b = SIZE_MAX;
		for (size_t a = 0; a < nfree && done < steps; a++) {
			const struct free_shard *fa = &p->free_list[a];
			if (fa->rank != slow)
				continue;
			const struct shard_class *sa = shard_class_of(chosen(p, choice, fa->table),
								      fa->shard);
			double after = fmax(top - sa->ms, p->load_ms[fast] + sa->ms);
			if (fast != slow && top - after > best_gain && fits_swap(p, fast, NULL, sa)) {
				best_gain = top - after;
				best_a = a;
				best_b = SIZE_MAX;
			}
			for (size_t b = 0; b < nfree; b++) {
				const struct free_shard *fb = &p->free_list[b];
				done++;
				if (fb->rank == slow || fb->ms >= sa->ms)
					continue;
				const struct shard_class *sb =
					shard_class_of(chosen(p, choice, fb->table), fb->shard);
				double d = sa->ms - sb->ms;
				after = fmax(top - d, p->load_ms[fb->rank] + d);
				if (top - after > best_gain && fits_swap(p, slow, sa, sb) &&
				    fits_swap(p, fb->rank, sb, sa)) {
					best_gain = top - after;
					best_a = a;
					best_b = b;
				}
			}
		}
		if (best_a == SIZE_MAX)
			return;
		struct free_shard *fa = &p->free_list[best_a];
		const struct shard_class *sa = shard_class_of(chosen(p, choice, fa->table), fa->shard);
		uint32_t to = best_b == SIZE_MAX ? fast : p->free_list[best_b].rank;
		unplace(p, slow, sa);
		place(p, to, sa);
		fa->rank = to;
		if (best_b != SIZE_MAX) {
			struct free_shard *fb = &p->free_list[best_b];
			const struct shard_class *sb = shard_class_of(chosen(p, choice, fb->table),
								      fb->shard);
			unplace(p, to, sb);
			place(p, slow, sb);
			fb->rank = slow;
		}
	}
}

/*
 * One partition of the proposal `choice`. places[] (may be NULL) receives, per table, the
 * ranks of its shards at places[place_base[t] + i].
 */
void planner_partition(struct planner *p, const uint32_t *choice, enum partitioner kind,
		       uint64_t refine_steps, uint32_t *places, const size_t *place_base,
		       struct result *res)
{
	uint32_t W = p->W;
	memset(p->diff_ms, 0, (W + 1) * sizeof(*p->diff_ms));
	memset(p->diff_hbm, 0, (W + 1) * sizeof(*p->diff_hbm));
	memset(p->diff_ddr, 0, (W + 1) * sizeof(*p->diff_ddr));
	*res = (struct result){ .feasible = true };

	/* 1. fixed placements: row_wise shard i on rank i, data_parallel on every rank */
	for (uint32_t t = 0; t < p->n; t++) {
		const struct option *o = chosen(p, choice, t);
		if (o->type != EMBD_SHARD_ROW_WISE && o->type != EMBD_SHARD_DATA_PARALLEL)
			continue;
		range_add(p, 0, o->n_full, &o->full);
		range_add(p, o->n_full, o->n_full + o->n_tail, &o->tail);
		range_add(p, o->n_full + o->n_tail, W, &o->empty);
		for (uint32_t i = 0; places && i < o->layout.num_shards; i++)
			places[place_base[t] + i] = i;
	}
	double ms = 0;
	int64_t h = 0, d = 0;
	for (uint32_t r = 0; r < W; r++) {
		ms += p->diff_ms[r];
		h += p->diff_hbm[r];
		d += p->diff_ddr[r];
		p->load_ms[r] = ms;
		p->hbm[r] = h;
		p->ddr[r] = d;
	}
	for (uint32_t r = 0; r < W; r++)
		if (p->hbm[r] > (int64_t)p->hbm_budget || p->ddr[r] > (int64_t)p->ddr_cap) {
			/* name the largest fixed table on the overfull rank */
			uint32_t worst = 0;
			uint64_t worst_bytes = 0;
			for (uint32_t t = 0; t < p->n; t++) {
				const struct option *o = chosen(p, choice, t);
				if ((o->type == EMBD_SHARD_ROW_WISE ||
				     o->type == EMBD_SHARD_DATA_PARALLEL) && o->max_hbm >= worst_bytes) {
					worst = t;
					worst_bytes = o->max_hbm;
				}
			}
			bool ddr = p->hbm[r] <= (int64_t)p->hbm_budget;
			res->feasible = false;
			res->fail_table = worst;
			res->fail_ddr = ddr;
			res->fail_need_bytes = (uint64_t)(ddr ? p->ddr[r] : p->hbm[r]);
			res->fail_room_bytes = ddr ? p->ddr_cap : p->hbm_budget;
			return;
		}

	/* 2. node placements: the least-loaded node that fits */
	/* largest node footprint first, as free shards below */
	uint32_t nnode = 0, nheap = 0;
	for (uint32_t t = 0; t < p->n; t++) {
		const struct option *o = chosen(p, choice, t);
		if (o->type == EMBD_SHARD_TABLE_ROW_WISE || o->type == EMBD_SHARD_TABLE_COLUMN_WISE)
			p->free_list[nnode++] = (struct free_shard){
				o->total_ms, o->max_hbm * o->layout.num_shards, t, 0, 0 };
	}
	qsort(p->free_list, nnode, sizeof(*p->free_list), compare_by_storage);
	for (uint32_t node = 0; nnode && node < p->nodes; node++)
		heap_push(p->heap, &nheap, (struct heap_entry){ node_load(p, node), node });
	for (uint32_t k = 0; k < nnode; k++) {
		uint32_t t = p->free_list[k].table, popped = 0;
		const struct option *o = chosen(p, choice, t);
		struct heap_entry *aside = p->heap + p->nodes;
		bool ok = false;
		while (nheap && !ok) {
			struct heap_entry e = heap_pop(p->heap, &nheap);
			ok = place_in_node(p, o, e.id, places ? places + place_base[t] : NULL);
			e.key = node_load(p, e.id);
			aside[popped++] = e;
		}
		for (uint32_t i = 0; i < popped; i++)
			heap_push(p->heap, &nheap, aside[i]);
		if (!ok) {
			fail_at(p, res, t, &o->full);
			return;
		}
	}

	/* 3. free shards (table_wise, column_wise) onto single ranks */
	size_t nfree = 0;
	for (uint32_t t = 0; t < p->n; t++) {
		const struct option *o = chosen(p, choice, t);
		if (o->type != EMBD_SHARD_TABLE_WISE && o->type != EMBD_SHARD_COLUMN_WISE)
			continue;
		for (uint32_t i = 0; i < o->layout.num_shards; i++) {
			const struct shard_class *s = shard_class_of(o, i);
			p->free_list[nfree++] = (struct free_shard){ s->ms, s->hbm, t, i, 0 };
		}
	}
	qsort(p->free_list, nfree, sizeof(*p->free_list),
	      kind == PART_GREEDY_PERF ? compare_by_perf : compare_by_storage);
	bool by_memory = kind == PART_MEMORY_BALANCED;
	nheap = 0;
	for (uint32_t r = 0; r < W; r++)
		heap_push(p->heap, &nheap,
			  (struct heap_entry){ by_memory ? (double)p->hbm[r] : p->load_ms[r], r });
	for (size_t k = 0; k < nfree; k++) {
		const struct free_shard *f = &p->free_list[k];
		const struct shard_class *s = shard_class_of(chosen(p, choice, f->table), f->shard);
		struct heap_entry *aside = p->heap + W;
		uint32_t popped = 0;
		bool ok = false;
		while (nheap) {
			struct heap_entry e = heap_pop(p->heap, &nheap);
			if (fits(p, e.id, s)) {
				place(p, e.id, s);
				p->free_list[k].rank = e.id;
				e.key = by_memory ? (double)p->hbm[e.id] : p->load_ms[e.id];
				heap_push(p->heap, &nheap, e);
				ok = true;
				break;
			}
			aside[popped++] = e;
		}
		for (uint32_t i = 0; i < popped; i++)
			heap_push(p->heap, &nheap, aside[i]);
		if (!ok) {
			fail_at(p, res, f->table, s);
			return;
		}
	}
	refine(p, choice, nfree, refine_steps);
	for (size_t k = 0; places && k < nfree; k++)
		places[place_base[p->free_list[k].table] + p->free_list[k].shard] =
			p->free_list[k].rank;
	for (uint32_t r = 0; r < W; r++) {
		res->max_ms = fmax(res->max_ms, p->load_ms[r]);
		if (p->hbm[r] > res->max_hbm)
			res->max_hbm = p->hbm[r];
	}
}
