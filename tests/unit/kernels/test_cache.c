/*
 * The row cache's bookkeeping (kernels/cache.h) against a reference model written as plainly
 * as possible: each set a list of rows in recency order, least recent first. Random call
 * sequences (hot and cold rows, repeats, more rows in a set than ways) must give the model's
 * hits, misses, write-backs, fetches and contents; and rows that travel through the cache's
 * moves (a "device" of plain arrays) must equal rows updated in place once flushed.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"
#include "kernels/cache.h"

#define MAX_WAYS 8
#define MAX_SETS 16
#define MAX_IDS 256

struct model_way {
	int64_t row;
	bool dirty, pinned;
};

struct model {
	uint32_t ways;
	uint32_t len[MAX_SETS];
	struct model_way set[MAX_SETS][MAX_WAYS];       /* [0] least recently used */
	uint64_t hits, misses;
};

struct model_call {
	int64_t wb[MAX_IDS], fetched[MAX_IDS], overflow[MAX_IDS];
	uint32_t num_wb, num_fetched, num_overflow;
};

static int model_find(const struct model *m, uint64_t s, int64_t row)
{
	for (uint32_t i = 0; i < m->len[s]; i++)
		if (m->set[s][i].row == row)
			return (int)i;
	return -1;
}

/* way i of set s becomes the most recently used */
static void model_touch(struct model *m, uint64_t s, uint32_t i)
{
	struct model_way w = m->set[s][i];

	memmove(&m->set[s][i], &m->set[s][i + 1], (m->len[s] - i - 1) * sizeof(w));
	m->set[s][m->len[s] - 1] = w;
}

static void model_map(struct model *m, const struct embd_cache *c, const int64_t *rows,
		      uint32_t n, bool count, struct model_call *out)
{
	int64_t uniq[MAX_IDS];
	uint32_t u = 0, hits = 0;
	bool hit[MAX_IDS];

	memset(out, 0, sizeof(*out));
	for (uint32_t i = 0; i < n; i++) {
		bool seen = false;
		for (uint32_t k = 0; k < u && !seen; k++)
			seen = uniq[k] == rows[i];
		if (!seen)
			uniq[u++] = rows[i];
	}
	for (uint32_t s = 0; s < MAX_SETS; s++)
		for (uint32_t i = 0; i < m->len[s]; i++)
			m->set[s][i].pinned = false;
	for (uint32_t k = 0; k < u; k++) {
		uint64_t s = embd_cache_set(c, uniq[k]);
		int i = model_find(m, s, uniq[k]);
		hit[k] = i >= 0;
		if (i >= 0) {
			m->set[s][i].pinned = true;
			model_touch(m, s, (uint32_t)i);
			hits++;
		}
	}
	for (uint32_t k = 0; k < u; k++) {
		if (hit[k])
			continue;
		uint64_t s = embd_cache_set(c, uniq[k]);
		out->fetched[out->num_fetched++] = uniq[k];
		if (m->len[s] < m->ways) {
			m->set[s][m->len[s]++] = (struct model_way){ uniq[k], false, true };
			continue;
		}
		uint32_t i = 0;
		while (i < m->len[s] && m->set[s][i].pinned)
			i++;
		if (i == m->len[s]) {
			out->overflow[out->num_overflow++] = uniq[k];
			continue;
		}
		if (m->set[s][i].dirty)
			out->wb[out->num_wb++] = m->set[s][i].row;
		m->set[s][i] = (struct model_way){ uniq[k], false, true };
		model_touch(m, s, i);
	}
	if (count) {
		m->hits += hits;
		m->misses += u - hits;
	}
}

static void model_wrote(struct model *m)
{
	for (uint32_t s = 0; s < MAX_SETS; s++)
		for (uint32_t i = 0; i < m->len[s]; i++)
			if (m->set[s][i].pinned)
				m->set[s][i].dirty = true;
}

static int cmp_i64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return (x > y) - (x < y);
}

/* The same multiset of rows, order aside. */
static void expect_rows(const char *what, uint32_t step, const int64_t *got, uint64_t n_got,
			int64_t *want, uint32_t n_want)
{
	int64_t sorted[MAX_IDS * 2];

	cr_assert_eq(n_got, n_want, "call %u: %s: %llu rows, the model has %u", step, what,
		     (unsigned long long)n_got, n_want);
	memcpy(sorted, got, n_got * sizeof(*got));
	qsort(sorted, n_got, sizeof(*sorted), cmp_i64);
	qsort(want, n_want, sizeof(*want), cmp_i64);
	for (uint32_t i = 0; i < n_want; i++)
		cr_assert_eq(sorted[i], want[i], "call %u: %s: row %lld, the model has %lld", step,
			     what, (long long)sorted[i], (long long)want[i]);
}

/* Everything a map must be: the model's moves, and slots consistent with the rows. */
static void check_map(const struct embd_cache *c, const struct model *m, uint32_t step,
		      const int64_t *rows, uint32_t n, const uint64_t *slot_of,
		      const struct embd_cache_moves *mv, struct model_call *want)
{
	const uint64_t slots = embd_cache_slots(c);

	expect_rows("write-backs", step, mv->wb_row, mv->num_writebacks, want->wb, want->num_wb);
	expect_rows("fetches", step, mv->fetch_row, mv->num_fetches, want->fetched,
		    want->num_fetched);
	cr_assert_eq(c->overflow, want->num_overflow, "call %u: %llu overflow rows, model %u", step,
		     (unsigned long long)c->overflow, want->num_overflow);
	for (uint32_t i = 0; i < n; i++) {
		uint64_t s = embd_cache_set(c, rows[i]);
		cr_assert_eq(embd_cache_row_of(c, slot_of[i]), rows[i], "call %u: id %u: slot %llu "
			     "holds row %lld, not %lld", step, i, (unsigned long long)slot_of[i],
			     (long long)embd_cache_row_of(c, slot_of[i]), (long long)rows[i]);
		cr_assert(slot_of[i] >= slots || slot_of[i] / c->ways == s, "call %u: row %lld in "
			  "slot %llu outside its set %llu", step, (long long)rows[i],
			  (unsigned long long)slot_of[i], (unsigned long long)s);
		for (uint32_t j = 0; j < i; j++)
			cr_assert_eq(rows[i] == rows[j], slot_of[i] == slot_of[j], "call %u: ids %u "
				     "and %u share slots or rows but not both", step, j, i);
	}
	for (uint64_t s = 0; s < c->sets; s++) {
		uint32_t held = 0;
		for (uint32_t w = 0; w < c->ways; w++) {
			int64_t row = c->tag[s * c->ways + w];
			if (row < 0)
				continue;
			held++;
			cr_assert(model_find(m, s, row) >= 0, "call %u: set %llu holds row %lld, the "
				  "model does not", step, (unsigned long long)s, (long long)row);
		}
		cr_assert_eq(held, m->len[s], "call %u: set %llu holds %u rows, the model %u", step,
			     (unsigned long long)s, held, m->len[s]);
	}
}

/* The moves made on a "device": slots and host rows of one float each. */
static void apply(const struct embd_cache_moves *mv, float *slot_val, float *host)
{
	for (uint64_t i = 0; i < mv->num_writebacks; i++)
		host[mv->wb_row[i]] = slot_val[mv->wb_slot[i]];
	for (uint64_t i = 0; i < mv->num_fetches; i++)
		slot_val[mv->fetch_slot[i]] = host[mv->fetch_row[i]];
}

/*
 * calls random maps of up to max_n ids over rows rows (hot: the first quarter gets most ids),
 * each a backward (rows += 1 + its index) or a forward; now and then a flush (+ an
 * invalidation, as after a checkpoint restore).
 */
static void run_against_model(int64_t rows, uint64_t sets, uint32_t ways, uint32_t calls,
			      uint32_t max_n, unsigned seed)
{
	struct embd_cache *c;
	char err[128];
	struct model m = { .ways = ways };
	float *host = calloc((size_t)rows, sizeof(float)), *truth = calloc((size_t)rows, sizeof(float));
	float *slot_val = calloc(sets * ways + MAX_IDS, sizeof(float));
	int64_t ids[MAX_IDS];
	uint64_t slot_of[MAX_IDS];
	struct embd_cache_moves mv;
	struct model_call want;

	cr_assert(sets <= MAX_SETS && ways <= MAX_WAYS && max_n <= MAX_IDS);
	cr_assert_eq(embd_cache_create_sets(rows, sets, ways, &c, err, sizeof(err)), 0, "%s", err);
	srand(seed);
	for (uint32_t step = 0; step < calls; step++) {
		uint32_t n = 1 + (uint32_t)rand() % max_n;
		for (uint32_t i = 0; i < n; i++)
			ids[i] = rand() % 4 ? rand() % (rows / 4 + 1) : rand() % rows;
		bool backward = rand() % 2, count = rand() % 3 != 0;
		model_map(&m, c, ids, n, count, &want);
		cr_assert_eq(embd_cache_map(c, ids, n, count, slot_of, &mv), 0);
		check_map(c, &m, step, ids, n, slot_of, &mv, &want);
		apply(&mv, slot_val, host);
		if (backward) {
			/* the kernel: each distinct row updated once, through its slot */
			for (uint32_t i = 0; i < n; i++) {
				bool first = true;
				for (uint32_t j = 0; j < i; j++)
					first &= ids[j] != ids[i];
				if (!first)
					continue;
				slot_val[slot_of[i]] += 1.0f + (float)(step % 7);
				truth[ids[i]] += 1.0f + (float)(step % 7);
			}
			model_wrote(&m);
		}
		embd_cache_end(c, backward, &mv);
		cr_assert_eq(mv.num_fetches, 0);
		cr_assert_eq(mv.num_writebacks, backward ? want.num_overflow : 0, "call %u: end wrote "
			     "back %llu rows, %u overflowed", step,
			     (unsigned long long)mv.num_writebacks, want.num_overflow);
		apply(&mv, slot_val, host);
		cr_assert_eq(c->hits, m.hits, "call %u: %llu hits, the model %llu", step,
			     (unsigned long long)c->hits, (unsigned long long)m.hits);
		cr_assert_eq(c->misses, m.misses, "call %u: %llu misses, the model %llu", step,
			     (unsigned long long)c->misses, (unsigned long long)m.misses);
		if (step % 37 == 36) {
			cr_assert_eq(embd_cache_flush(c, &mv), 0);
			apply(&mv, slot_val, host);
			for (int64_t r = 0; r < rows; r++)
				cr_assert_eq(host[r], truth[r], "call %u: row %lld flushed %g, updated "
					     "in place %g", step, (long long)r, host[r], truth[r]);
			for (uint32_t s = 0; s < MAX_SETS; s++)
				for (uint32_t i = 0; i < m.len[s]; i++)
					m.set[s][i].dirty = false;
			if (step % 74 == 73) {
				embd_cache_invalidate(c);
				memset(m.len, 0, sizeof(m.len));
			}
		}
	}
	cr_assert_eq(embd_cache_flush(c, &mv), 0);
	apply(&mv, slot_val, host);
	for (int64_t r = 0; r < rows; r++)
		cr_assert_eq(host[r], truth[r], "row %lld: flushed %g, updated in place %g",
			     (long long)r, host[r], truth[r]);
	cr_assert_eq(embd_cache_flush(c, &mv), 0);
	cr_assert_eq(mv.num_writebacks, 0, "a second flush wrote %llu rows back",
		     (unsigned long long)mv.num_writebacks);
	embd_cache_destroy(c);
	free(host);
	free(truth);
	free(slot_val);
}

Test(cache, one_id_per_call_is_a_plain_lru_cache)
{
	run_against_model(64, 4, 2, 2000, 1, 1);
	run_against_model(1000, 16, 8, 2000, 1, 2);
}

Test(cache, calls_of_many_ids_pin_their_rows)
{
	run_against_model(200, 8, 4, 1500, 24, 3);
	run_against_model(5000, 16, 8, 800, 64, 4);
}

Test(cache, more_ids_in_a_set_than_ways_overflow)
{
	/* one set of 2 ways and calls of up to 40 ids: most calls overflow */
	run_against_model(100, 1, 2, 1500, 40, 5);
	run_against_model(300, 2, 4, 1500, 200, 6);
}

Test(cache, lru_order_by_hand)
{
	struct embd_cache *c;
	struct embd_cache_moves mv;
	uint64_t slot[4];
	char err[128];

	/* one set of 2 ways: A B (hits), A again, C evicts B (least recent), B evicts A */
	cr_assert_eq(embd_cache_create_sets(10, 1, 2, &c, err, sizeof(err)), 0, "%s", err);
	int64_t a = 1, b = 2, cc = 3;
	cr_assert_eq(embd_cache_map(c, &a, 1, true, slot, &mv), 0);
	cr_assert_eq(mv.num_fetches, 1);
	embd_cache_end(c, true, &mv);       /* A dirty */
	cr_assert_eq(embd_cache_map(c, &b, 1, true, slot, &mv), 0);
	embd_cache_end(c, false, &mv);
	cr_assert_eq(embd_cache_map(c, &a, 1, true, slot, &mv), 0);
	cr_assert_eq(mv.num_fetches, 0, "A is cached");
	embd_cache_end(c, false, &mv);
	cr_assert_eq(embd_cache_map(c, &cc, 1, true, slot, &mv), 0);
	cr_assert_eq(mv.num_writebacks, 0, "B was clean");
	cr_assert_eq(embd_cache_row_of(c, slot[0]), 3);
	embd_cache_end(c, false, &mv);
	cr_assert_eq(embd_cache_map(c, &b, 1, true, slot, &mv), 0);
	cr_assert_eq(mv.num_writebacks, 1, "A, the least recent, was dirty");
	cr_assert_eq(mv.wb_row[0], 1);
	cr_assert_eq(mv.wb_slot[0], slot[0], "B goes where A was");
	embd_cache_end(c, false, &mv);
	cr_assert_eq(c->hits, 1);
	cr_assert_eq(c->misses, 4);
	/* a call of A B C in one set of 2: two get ways, the third an overflow slot */
	int64_t abc[4] = { 1, 2, 3, 1 };
	cr_assert_eq(embd_cache_map(c, abc, 4, false, slot, &mv), 0);
	cr_assert_eq(c->overflow, 1);
	cr_assert_eq(slot[0], slot[3]);
	cr_assert(slot[0] >= 2 || slot[1] >= 2 || slot[2] >= 2, "one row past the ways");
	embd_cache_end(c, true, &mv);
	cr_assert_eq(mv.num_writebacks, 1, "the overflow row goes back after a backward");
	embd_cache_destroy(c);
}

Test(cache, geometry_from_the_ratio)
{
	uint64_t sets;
	uint32_t ways;
	char err[128];

	cr_assert_eq(embd_cache_geometry(1000, 0.2, &sets, &ways, err, sizeof(err)), 0);
	cr_assert_eq(ways, EMBD_CACHE_WAYS);
	cr_assert_eq(sets, 6, "200 rows wanted: 6 sets of 32, never more than asked");
	cr_assert_eq(embd_cache_geometry(10, 0.2, &sets, &ways, err, sizeof(err)), 0);
	cr_assert(sets == 1 && ways == 2, "2 rows: one set of 2, got %llu x %u",
		  (unsigned long long)sets, ways);
	cr_assert_eq(embd_cache_geometry(3, 1e-6, &sets, &ways, err, sizeof(err)), 0);
	cr_assert(sets == 1 && ways == 1, "at least one slot");
	cr_assert_eq(embd_cache_geometry(1 << 20, 1, &sets, &ways, err, sizeof(err)), 0);
	cr_assert_eq(sets * ways, 1 << 20, "ratio 1 caches every row");
	for (int64_t rows = 1; rows < 5000; rows += 37)
		for (double r = 0.01; r <= 1; r += 0.07) {
			cr_assert_eq(embd_cache_geometry(rows, r, &sets, &ways, err, sizeof(err)), 0);
			double want = (double)rows * r;
			cr_assert(sets * ways <= (uint64_t)rows && (sets * ways <= want + 1 || sets *
				  ways == 1) && sets * ways + ways > want, "%lld rows at %g: %llu x %u",
				  (long long)rows, r, (unsigned long long)sets, ways);
		}
	cr_assert_eq(embd_cache_geometry(10, 0, &sets, &ways, err, sizeof(err)), EMBD_EINVAL);
	cr_assert(strstr(err, "uvm_caching_ratio"), "%s", err);
	cr_assert_eq(embd_cache_geometry(10, 1.5, &sets, &ways, err, sizeof(err)), EMBD_EINVAL);
	cr_assert_eq(embd_cache_geometry(0, 0.5, &sets, &ways, err, sizeof(err)), EMBD_EINVAL);
}
