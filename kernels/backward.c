/*
 * Fused backward + optimizer on one shard, with no dense gradient of the table: only one row
 * of it per worker exists at any time (the batch's gradient, B x the shard's columns, is read
 * where it lies, or first copied to rows of that width when it comes strided).
 *
 *   1. serial   snapshot the offsets and check them, so that later phases trust them
 *   2. workers  (split by bags) check every id, write its occurrence {row, bag, coef} and count
 *               occurrences by the top bits of the row
 *   3. workers  (same split) scatter the occurrences stably into those buckets
 *   4. workers  (grab chunks of buckets) sort each bucket by the remaining bits (stable: LSD
 *               radix, or insertion when small), then sum each row's run and apply the
 *               optimizer to the row once
 * When the bits under the bucket's are few (at most LOW_BITS_MAX) and the occurrences at least
 * as many as their values, 3 and 4's sort are instead two stable passes over the whole batch:
 * by those low bits (counted in 2, beside the buckets), then by bucket. One counter array
 * for the batch replaces one per bucket, and each occurrence moves twice rather than three
 * times or more (Zen 4, P 20: the whole backward 8-10% faster at D 64 on one thread, -4% to
 * +9% on two, the same at D 128).
 * Buckets hold disjoint rows, so workers never write the same row; every sort is stable, so a
 * row's gradient is summed in batch order whatever the number of workers. Nothing is written
 * to the shard before phases 1-2 have checked every offset and id. Each row updated is
 * checked for NaN and infinity while it is in cache, and counted on the shard.
 *
 * Phases 1-3 depend on the bags and the shard's rows only, never on its columns: prepare runs
 * them, and 4's sort, once for shards that share the bags (a table's column shards), and each
 * shard's apply walks the same sorted occurrences; embd_kernels_backward, when it sorts by
 * bucket, sorts each chunk of buckets as a worker takes it, so that the sort overlaps the
 * prefetches of rows it applies.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/clock.h"
#include "kernels/cpu_kernels.h"
#include "kernels/pool_row.h"

#define TOP_BITS_MAX 12                 /* at most 4096 buckets */
#define OCC_PER_BUCKET_LOG2 6           /* aim for >= 64 occurrences per bucket */
#define RADIX_BITS_MAX 8
#define LOW_BITS_MAX 11                 /* a whole-batch pass on the bits under the bucket's */
#define INSERTION_SORT_MAX 32
#define OCC_PER_CHUNK 512               /* a worker takes about this many occurrences at a time */
#define CHUNKS_PER_WORKER_MIN 8         /* ... but leaves enough chunks to even out the workers */

/* The prepared occurrences (embedding.h): what every shard of the same rows and bags shares. */
struct embd_backward_prep {
	int64_t row_offset;             /* the rows the occurrences index: [row_offset, +rows) */
	int64_t rows;
	uint32_t n;                     /* batches */
	uint64_t *bag_base;             /* n + 1: first global bag of each batch */
	uint64_t *id_base;              /* n + 1: first occurrence of each batch */
	uint32_t shift;                 /* bucket = row >> shift */
	uint32_t num_buckets;
	uint64_t *bucket_start;         /* num_buckets + 1 */
	struct embd_occ *bucketed;      /* id_base[n], grouped by bucket; sorted by row if sorted */
	struct embd_occ *occ;           /* id_base[n], the radix sort's other half; NULL once sorted */
	bool sorted;
};

/*
 * The occurrence arrays (two a prep, ~16 bytes an id) come from a small pool of buffers kept
 * between calls, 2 MiB aligned and advised for transparent huge pages. Fresh malloc'd arrays
 * every call left the phases over them at the mercy of where the heap's pages lay: on the Zen 4
 * VM, with two workers, collect took 250-290 us a call in about half the processes against
 * 50-60 us in the rest (sgd D 64 P 20), with the cores at full speed; with the pool a slow
 * collect in 3 of 18 runs against 10 of 18, and sgd/64 read .887 of its limit at the median
 * against .684, rowwise_adagrad/64 .844 against .671 (2026-12-05, docs/benchmarks.md). Two
 * arrays both at the start of their 2 MiB fell in the same cache sets and scattered between
 * them 2.5x slower, so a prep's first and second array come from two classes of buffer whose
 * data start at different lines. The pool is one for the process: ranks on other NUMA nodes
 * may get a buffer first touched on another (not measured; the VM has one node). Under
 * AddressSanitizer the arrays are plain malloc, so that it sees their exact bounds.
 */
#if defined(__SANITIZE_ADDRESS__)
#define OCC_BUF_POOL 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define OCC_BUF_POOL 0
#endif
#endif
#ifndef OCC_BUF_POOL
#define OCC_BUF_POOL 1
#endif
#define OCC_BUF_ALIGN ((size_t)2 << 20)
#define OCC_BUF_KEEP 8                          /* buffers the pool keeps ... */
#define OCC_BUF_KEEP_BYTES ((size_t)128 << 20)  /* ... and bytes, at most */

struct occ_buf_head {                            /* the 64 bytes before a buffer's data */
	void *base;                             /* what aligned_alloc returned */
	size_t cap;                             /* bytes of data */
	size_t bytes;                           /* of the allocation */
	int cls;                                /* 0 or 1: where its data starts */
};

static pthread_mutex_t occ_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct occ_buf_head *occ_pool[OCC_BUF_KEEP];
static size_t occ_pool_bytes;

/* A buffer of class cls (0 or 1) of at least bytes for occurrences, or NULL. */
static void *occ_buf_get(size_t bytes, int cls)
{
	if (!OCC_BUF_POOL)
		return malloc(bytes ? bytes : 1);

	struct occ_buf_head *h = NULL;
	int best = -1;

	pthread_mutex_lock(&occ_pool_lock);
	for (int i = 0; i < OCC_BUF_KEEP; i++)
		if (occ_pool[i] && occ_pool[i]->cls == cls && occ_pool[i]->cap >= bytes &&
		    (best < 0 || occ_pool[i]->cap < occ_pool[best]->cap))
			best = i;
	if (best >= 0) {
		h = occ_pool[best];
		occ_pool[best] = NULL;
		occ_pool_bytes -= h->bytes;
	}
	pthread_mutex_unlock(&occ_pool_lock);
	if (h)
		return (uint8_t *)h + 64;

	/* the data 1 line (class 0) or 67 lines (class 1) past the 2 MiB boundary, the head in
	 * the line before it */
	size_t off = ((size_t)cls * 66 + 1) * 64;
	if (bytes > SIZE_MAX - off - OCC_BUF_ALIGN)
		return NULL;
	size_t total = (off + bytes + OCC_BUF_ALIGN - 1) / OCC_BUF_ALIGN * OCC_BUF_ALIGN;
	uint8_t *base = aligned_alloc(OCC_BUF_ALIGN, total);
	if (!base)
		return NULL;
	(void)madvise(base, total, MADV_HUGEPAGE); /* a hint: without it, 4 KiB pages */
	h = (struct occ_buf_head *)(base + off - 64);
	*h = (struct occ_buf_head){ .base = base, .cap = total - off, .bytes = total, .cls = cls };
	return base + off;
}

/*
 * Gives a buffer of occ_buf_get back (NULL: nothing). A full pool makes room for a larger
 * buffer by freeing smaller ones, so that the sizes a process keeps asking for stay pooled.
 */
static void occ_buf_put(void *data)
{
	if (!OCC_BUF_POOL || !data) {
		free(data);
		return;
	}
	struct occ_buf_head *h = (struct occ_buf_head *)((uint8_t *)data - 64);
	void *evicted[OCC_BUF_KEEP];
	int n_evicted = 0;

	pthread_mutex_lock(&occ_pool_lock);
	for (;;) {
		int slot = -1, smallest = -1;
		for (int i = 0; i < OCC_BUF_KEEP; i++) {
			if (!occ_pool[i])
				slot = slot < 0 ? i : slot;
			else if (occ_pool[i]->bytes < h->bytes &&
				 (smallest < 0 || occ_pool[i]->bytes < occ_pool[smallest]->bytes))
				smallest = i;
		}
		if (slot >= 0 && occ_pool_bytes + h->bytes <= OCC_BUF_KEEP_BYTES) {
			occ_pool[slot] = h;
			occ_pool_bytes += h->bytes;
			h = NULL;
			break;
		}
		if (smallest < 0 || h->bytes > OCC_BUF_KEEP_BYTES)
			break;
		evicted[n_evicted++] = occ_pool[smallest]->base;
		occ_pool_bytes -= occ_pool[smallest]->bytes;
		occ_pool[smallest] = NULL;
	}
	pthread_mutex_unlock(&occ_pool_lock);
	for (int i = 0; i < n_evicted; i++)
		free(evicted[i]);
	if (h)
		free(h->base);
}

/* Phases 1-3 (and 4's sort when the prep is shared): the batches' occurrences into prep. */
struct prep_job {
	const struct embd_bag_batch *batches;
	struct embd_backward_prep *p;
	uint32_t nw;
	const int64_t *offsets;         /* snapshot: batch i's B + 1 offsets at off_base[i] */
	const uint64_t *off_base;       /* n + 1 */
	uint64_t *hist;                 /* nw x num_buckets: counts, then scatter positions */
	uint64_t *hist_low;             /* NULL, or nw x 2^shift: counts by the bits under the
					 * bucket's, then their pass's positions */
	uint64_t *occ_range;            /* nw x 2: the occurrences each worker wrote */
	struct embd_first_err *errs;    /* one per worker */
	uint32_t chunk_buckets;         /* buckets a worker sorts at a time */
	atomic_uint_fast64_t next_bucket;
};

/* Phase 4 on one shard. */
struct bwd_job {
	const struct embd_cpu_kernels *k;
	struct embd_bwd_rows ctx;
	const struct embd_backward_prep *p;
	struct embd_backward_prep *sort_here; /* p, when its buckets are sorted as they are taken */
	uint32_t chunk_buckets;         /* buckets a worker takes at a time */
	uint64_t *bad;                  /* nw x 2: rows left non-finite, the lowest of them */
	float *scratch;                 /* nw x 2 cols */
	uint64_t *phase_ns;             /* NULL, or nw x 2: each worker's time sorting, applying */
	atomic_uint_fast64_t next_bucket;
};

/* Worker w's bags: a contiguous slice of the global bag index. */
static void worker_bags(const struct prep_job *job, uint32_t w, uint64_t *first, uint64_t *last)
{
	uint64_t total = job->p->bag_base[job->p->n];

	*first = total * w / job->nw;
	*last = total * (w + 1) / job->nw;
}

/* The occurrences of global bags [g, g_last): [*first, *last) of p->occ (empty when none). */
static void bags_occ_span(const struct prep_job *job, uint64_t g, uint64_t g_last, uint64_t *first,
			  uint64_t *last)
{
	const struct embd_backward_prep *p = job->p;
	uint32_t i = 0, j;

	*first = *last = 0;
	if (g >= g_last)
		return;
	while (p->bag_base[i + 1] <= g)
		i++;
	for (j = i; p->bag_base[j + 1] < g_last; j++)
		;
	*first = p->id_base[i] + (uint64_t)job->offsets[job->off_base[i] + (g - p->bag_base[i])];
	*last = p->id_base[j] + (uint64_t)job->offsets[job->off_base[j] + (g_last - p->bag_base[j])];
}

/*
 * The worker's span of occurrences is cleared first in one memset, then written. Its lines were
 * mostly last held by other workers (the previous call's scatters, sorts and apply), and the
 * loop's three stores an occurrence took them over line by line as they came; the string
 * stores of memset take whole lines, many at a time.
 * When the host slows this VM's cores (docs/benchmarks.md, "The prepare's slow state"), collect
 * took 126-150 us a call with the memset against 166-307 without, and within 6 us otherwise
 * (54-57 us against 48-57; Zen 4, two workers, P 20).
 */
static void collect_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct prep_job *job = arg;
	const struct embd_backward_prep *p = job->p;
	uint64_t *hist = job->hist + (uint64_t)w * p->num_buckets;
	uint64_t *hist_low = job->hist_low ? job->hist_low + ((uint64_t)w << p->shift) : NULL;
	const uint64_t low_mask = ((uint64_t)1 << p->shift) - 1;
	uint64_t g, g_last, occ_first, occ_last;
	uint32_t i = 0;

	(void)nw;
	worker_bags(job, w, &g, &g_last);
	bags_occ_span(job, g, g_last, &occ_first, &occ_last);
	memset(p->occ + occ_first, 0, (occ_last - occ_first) * sizeof(*p->occ));
	for (; g < g_last; g++) {
		while (p->bag_base[i + 1] <= g)
			i++;
		const struct embd_bag_batch *bt = &job->batches[i];
		uint64_t b = g - p->bag_base[i];
		const int64_t *off = job->offsets + job->off_base[i];
		int64_t s = off[b], e = off[b + 1];
		int64_t divisor = bt->mean_lengths ? bt->mean_lengths[b] : e - s;
		float scale = embd_grad_scale(bt->pooling, divisor, bt->grad_divisor);
		struct embd_occ *out = p->occ + p->id_base[i];

		for (int64_t k = s; k < e; k++) {
			int64_t id = bt->ids[k]; /* read once */
			uint64_t r = (uint64_t)id - (uint64_t)p->row_offset;
			if (r >= (uint64_t)p->rows) {
				struct embd_kernel_err ke;
				embd_kernel_fail(&ke, EMBD_ERANGE, bt->feature, (int64_t)b, id,
						 "feature %u sample %llu: id %lld outside the shard's rows [%lld, %lld)",
						 bt->feature, (unsigned long long)b, (long long)id,
						 (long long)p->row_offset, (long long)(p->row_offset + p->rows));
				embd_first_err_note(&job->errs[w], EMBD_ERANGE, i, &ke);
				return;
			}
			out[k].row = r;
			out[k].bag = (uint32_t)g;
			out[k].coef = embd_grad_coef(bt->weights ? bt->weights[k] : 1.0f, scale);
			hist[r >> p->shift]++;
			if (hist_low)
				hist_low[r & low_mask]++;
		}
	}
	/* once, at the end: the workers' ranges share a cache line */
	job->occ_range[2 * w] = occ_first;
	job->occ_range[2 * w + 1] = occ_last;
}

static void scatter_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct prep_job *job = arg;
	struct embd_backward_prep *p = job->p;
	uint64_t *pos = job->hist + (uint64_t)w * p->num_buckets;

	(void)nw;
	for (uint64_t j = job->occ_range[2 * w]; j < job->occ_range[2 * w + 1]; j++) {
		const struct embd_occ *o = &p->occ[j];
		p->bucketed[pos[o->row >> p->shift]++] = *o;
	}
}

/* The whole batch's occurrences by the bits under the bucket's, stably: occ -> bucketed. */
static void low_scatter_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct prep_job *job = arg;
	struct embd_backward_prep *p = job->p;
	uint64_t *pos = job->hist_low + ((uint64_t)w << p->shift);
	const uint64_t mask = ((uint64_t)1 << p->shift) - 1;

	(void)nw;
	for (uint64_t j = job->occ_range[2 * w]; j < job->occ_range[2 * w + 1]; j++) {
		const struct embd_occ *o = &p->occ[j];
		p->bucketed[pos[o->row & mask]++] = *o;
	}
}

/* Counts worker w's range of occ by bucket (the low pass's order, several workers). */
static void top_count_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct prep_job *job = arg;
	const struct embd_backward_prep *p = job->p;
	uint64_t *hist = job->hist + (uint64_t)w * p->num_buckets;

	(void)nw;
	memset(hist, 0, p->num_buckets * sizeof(*hist));
	for (uint64_t j = job->occ_range[2 * w]; j < job->occ_range[2 * w + 1]; j++)
		hist[p->occ[j].row >> p->shift]++;
}

/* Stable sort of a[0, n) by row, whose bits at and above `bits` are all equal, in place; tmp
 * is n long. */
static void sort_bucket(struct embd_occ *a, struct embd_occ *tmp, uint64_t n, uint32_t bits)
{
	struct embd_occ *in = a;

	if (n <= INSERTION_SORT_MAX) {
		for (uint64_t i = 1; i < n; i++) {
			struct embd_occ x = a[i];
			uint64_t j = i;
			for (; j > 0 && a[j - 1].row > x.row; j--)
				a[j] = a[j - 1];
			a[j] = x;
		}
		return;
	}
	uint32_t passes = (bits + RADIX_BITS_MAX - 1) / RADIX_BITS_MAX;
	for (uint32_t p = 0, lo = 0; p < passes; p++) {
		uint32_t width = (bits - lo + (passes - p) - 1) / (passes - p);
		uint64_t mask = (1ull << width) - 1, count[1u << RADIX_BITS_MAX];

		/* only this pass's digits: buckets of ~64 occurrences sort 5-bit digits, and clearing
		 * all 256 counters (a 2 KiB rep stos) was ~6% of their sort time */
		memset(count, 0, (mask + 1) * sizeof(*count));
		for (uint64_t i = 0; i < n; i++)
			count[(a[i].row >> lo) & mask]++;
		for (uint64_t dgt = 0, sum = 0; dgt <= mask; dgt++) {
			uint64_t c = count[dgt];
			count[dgt] = sum;
			sum += c;
		}
		for (uint64_t i = 0; i < n; i++)
			tmp[count[(a[i].row >> lo) & mask]++] = a[i];
		struct embd_occ *t = a;
		a = tmp;
		tmp = t;
		lo += width;
	}
	if (a != in)
		memcpy(in, a, n * sizeof(*a));
}

/* Sorts buckets [b0, b1) of p in place (p->occ: the other half of the radix sort). */
static void sort_buckets(struct embd_backward_prep *p, uint64_t b0, uint64_t b1)
{
	for (uint64_t b = b0; b < b1; b++) {
		uint64_t s = p->bucket_start[b];
		sort_bucket(p->bucketed + s, p->occ + s, p->bucket_start[b + 1] - s, p->shift);
	}
}

/* Buckets [*b0, *b1): the next chunk of atomic counter next, chunk buckets of num_buckets. */
static bool take_chunk(atomic_uint_fast64_t *next, uint64_t chunk, uint64_t num_buckets,
		       uint64_t *b0, uint64_t *b1)
{
	*b0 = atomic_fetch_add_explicit(next, chunk, memory_order_relaxed);
	if (*b0 >= num_buckets)
		return false;
	*b1 = num_buckets - *b0 < chunk ? num_buckets : *b0 + chunk;
	return true;
}

/* A shared prep's phase 4 sort, ahead of every shard's apply. */
static void sort_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct prep_job *job = arg;
	uint64_t b0, b1;

	(void)w;
	(void)nw;
	while (take_chunk(&job->next_bucket, job->chunk_buckets, job->p->num_buckets, &b0, &b1))
		sort_buckets(job->p, b0, b1);
}

/*
 * The next chunk of buckets for this worker, each bucket sorted (in place here unless the prep
 * came sorted): *sorted holds *n occurrences sorted by row (buckets are ascending ranges of
 * rows). False when none is left.
 */
static bool next_chunk(struct bwd_job *job, struct embd_occ **sorted, uint64_t *n)
{
	const struct embd_backward_prep *p = job->p;
	uint64_t b0, b1;

	if (!take_chunk(&job->next_bucket, job->chunk_buckets, p->num_buckets, &b0, &b1))
		return false;
	if (job->sort_here)
		sort_buckets(job->sort_here, b0, b1);
	*sorted = p->bucketed + p->bucket_start[b0];
	*n = p->bucket_start[b1] - p->bucket_start[b0];
	return true;
}

/*
 * Workers take chunks of buckets (a few hundred occurrences: one counter update each, and one
 * prefetch stream through the chunk's rows). Each takes (and, unless the prep came sorted,
 * sorts) the chunk it applies next before applying the one it holds, so that the rows of the
 * next chunk's head are prefetched while this one's tail is applied, not waited on one by one.
 */
static void apply_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bwd_job *job = arg;
	float *scratch = job->scratch + (uint64_t)w * 2 * job->ctx.shard->desc.cols;
	struct embd_occ *cur = NULL, *next = NULL;
	uint64_t n = 0, next_n = 0, t0, t1;
	uint64_t *bad = job->bad + 2 * (uint64_t)w;    /* rows left non-finite, the first one */
	size_t prefetched = 0;

	(void)nw;
	bad[0] = 0;
	bad[1] = UINT64_MAX;
	t0 = job->phase_ns ? embd_now_ns() : 0;
	bool more = next_chunk(job, &cur, &n);
	for (; more; cur = next, n = next_n) {
		more = next_chunk(job, &next, &next_n);
		t1 = job->phase_ns ? embd_now_ns() : 0;
		prefetched = job->k->apply_rows(&job->ctx, cur, n, more ? next : NULL, more ? next_n : 0,
						prefetched, scratch, &bad[0], &bad[1]);
		if (job->phase_ns) {
			job->phase_ns[2 * w] += t1 - t0;
			t0 = embd_now_ns();
			job->phase_ns[2 * w + 1] += t0 - t1;
		}
	}
}

/* Adds the time since t to *phase and returns now. */
static uint64_t phase_done(uint64_t t, uint64_t *phase)
{
	uint64_t now = embd_now_ns();
	*phase += now - t;
	return now;
}

/* Adds phase 4's wall time ns to t, split as the workers' time in it was (embedding.h). */
static void note_apply_phase(struct embd_backward_times *t, const uint64_t *phase_ns, uint32_t nw,
			     uint64_t ns)
{
	uint64_t sort = 0, apply = 0;

	for (uint32_t w = 0; w < nw; w++) {
		sort += phase_ns[2 * w];
		apply += phase_ns[2 * w + 1];
	}
	uint64_t sort_share = sort + apply ? (uint64_t)((double)ns * (double)sort / (double)(sort + apply)) : 0;
	t->sort_ns += sort_share;
	t->apply_ns += ns - sort_share;
}

/* Copies batch i's offsets into the snapshot and checks them. */
static int snapshot_offsets(const struct embd_bag_batch *bt, int64_t *snap,
			    struct embd_kernel_err *err)
{
	memcpy(snap, bt->offsets, ((uint64_t)bt->batch_size + 1) * sizeof(*snap));
	if (snap[0] != 0 || (uint64_t)snap[bt->batch_size] != bt->num_ids)
		return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, -1, snap[0],
					"feature %u: offsets run from %lld to %lld, not from 0 to num_ids %llu",
					bt->feature, (long long)snap[0], (long long)snap[bt->batch_size],
					(unsigned long long)bt->num_ids);
	for (uint32_t b = 0; b < bt->batch_size; b++)
		if (snap[b + 1] < snap[b])
			return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, b, snap[b + 1],
						"feature %u sample %u: offsets decrease (%lld then %lld)",
						bt->feature, b, (long long)snap[b], (long long)snap[b + 1]);
	return 0;
}

static uint32_t bits_for(uint64_t x)
{
	return x ? 64 - (uint32_t)__builtin_clzll(x) : 0;
}

/* Buckets a worker takes at a time out of p's, for nw workers. */
static uint32_t chunk_buckets(const struct embd_backward_prep *p, uint32_t nw)
{
	uint64_t num_occ = p->id_base[p->n];
	uint64_t chunk = num_occ ? ((uint64_t)p->num_buckets * OCC_PER_CHUNK) / num_occ : 1;
	uint64_t chunk_max = p->num_buckets / ((uint64_t)CHUNKS_PER_WORKER_MIN * nw);

	chunk = chunk < chunk_max ? chunk : chunk_max;
	return chunk ? (uint32_t)chunk : 1;
}

/* What the batches promise (embedding.h), checked against shard; their bags and ids counted. */
static int check_batches(const struct embd_shard *shard, const struct embd_bag_batch *batches,
			 uint32_t n, uint64_t *num_bags, uint64_t *num_occ, struct embd_kernel_err *err)
{
	*num_bags = *num_occ = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (batches[i].shard && batches[i].shard != shard)
			return embd_kernel_fail(err, EMBD_EINVAL, batches[i].feature, -1, 0,
						"feature %u: batch names another shard", batches[i].feature);
		int rc = embd_bag_batch_check(&batches[i], shard, true, err);
		if (rc)
			return rc;
		/* offsets are int64: more ids than that can only be a count that lies, and a sum
		 * that wrapped would size the occurrence arrays short */
		if (batches[i].num_ids > (uint64_t)INT64_MAX - *num_occ)
			return embd_kernel_fail(err, EMBD_EINVAL, batches[i].feature, -1, 0,
						"feature %u: num_ids %llu takes the call past 2^63 - 1 ids",
						batches[i].feature,
						(unsigned long long)batches[i].num_ids);
		*num_occ += batches[i].num_ids;
		*num_bags += batches[i].batch_size;
	}
	if (*num_bags > UINT32_MAX)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "%llu bags in one call, at most 2^32 - 1",
					(unsigned long long)*num_bags);
	return 0;
}

void embd_backward_prep_free(struct embd_backward_prep *p)
{
	if (!p)
		return;
	occ_buf_put(p->occ);
	occ_buf_put(p->bucketed);
	free(p->bag_base);
	free(p);
}

/* Phases 1-3, and 4's sort when sort: the batches' checked occurrences into *out (phase
 * times added to ph). */
static int prepare_occurrences(const struct embd_exec *exec, const struct embd_shard *shard,
			       const struct embd_bag_batch *batches, uint32_t n, bool sort,
			       struct embd_backward_prep **out, struct embd_backward_times *ph,
			       struct embd_kernel_err *err)
{
	struct embd_workers *workers = exec ? exec->workers : NULL;
	uint64_t t = embd_now_ns();
	struct prep_job job = { .batches = batches, .nw = embd_workers_count(workers) };
	struct embd_backward_prep *p = NULL;
	uint64_t num_occ, num_bags, *work = NULL;
	int64_t *offsets = NULL;
	bool lsd = false;
	int rc;

	*out = NULL;
	if (!shard)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "no shard");
	rc = check_batches(shard, batches, n, &num_bags, &num_occ, err);
	if (rc)
		return rc;

	uint32_t row_bits = bits_for((uint64_t)shard->desc.rows - 1);
	uint32_t want = bits_for(num_occ >> OCC_PER_BUCKET_LOG2);
	uint32_t top = want < row_bits ? want : row_bits;
	top = top < TOP_BITS_MAX ? top : TOP_BITS_MAX;
	p = calloc(1, sizeof(*p));
	if (p) {
		*p = (struct embd_backward_prep){
			.row_offset = shard->desc.row_offset, .rows = shard->desc.rows, .n = n,
			.shift = row_bits - top, .num_buckets = 1u << top,
		};
		p->bag_base = malloc((2 * ((uint64_t)n + 1) + p->num_buckets + 1) *
				     sizeof(*p->bag_base));
		/* an impossible count fails here, not in the multiplication */
		bool fits = num_occ <= SIZE_MAX / 2 / sizeof(*p->occ);
		p->occ = fits ? occ_buf_get(num_occ * sizeof(*p->occ), 0) : NULL;
		p->bucketed = fits ? occ_buf_get(num_occ * sizeof(*p->bucketed), 1) : NULL;
		/* off_base (n + 1), occ_range (nw x 2), hist (nw x num_buckets), and hist_low
		 * (nw x 2^shift) when the buckets are sorted by one pass over the whole batch */
		lsd = p->shift > 0 && p->shift <= LOW_BITS_MAX && num_occ >= (uint64_t)1 << p->shift;
		work = malloc(((uint64_t)n + 1 + 2 * job.nw + (uint64_t)job.nw * p->num_buckets +
			       (lsd ? (uint64_t)job.nw << p->shift : 0)) * sizeof(*work));
	}
	offsets = malloc((num_bags + n) * sizeof(*offsets));
	job.errs = calloc(job.nw, sizeof(*job.errs));
	if (!p || !p->bag_base || !p->occ || !p->bucketed || !work || !offsets || !job.errs) {
		rc = embd_kernel_fail(err, EMBD_ENOMEM, 0, -1, 0, "out of memory for %llu occurrences",
				      (unsigned long long)num_occ);
		goto out;
	}
	uint64_t *off_base = work;
	p->id_base = p->bag_base + n + 1;
	p->bucket_start = p->id_base + n + 1;
	job.p = p;
	job.occ_range = off_base + n + 1;
	job.hist = job.occ_range + 2 * job.nw;
	memset(job.hist, 0, (uint64_t)job.nw * p->num_buckets * sizeof(*job.hist));
	if (lsd) {
		job.hist_low = job.hist + (uint64_t)job.nw * p->num_buckets;
		memset(job.hist_low, 0, ((uint64_t)job.nw << p->shift) * sizeof(*job.hist_low));
	}
	off_base[0] = p->bag_base[0] = p->id_base[0] = 0;
	for (uint32_t i = 0; i < n; i++) {
		off_base[i + 1] = off_base[i] + batches[i].batch_size + 1;
		p->bag_base[i + 1] = p->bag_base[i] + batches[i].batch_size;
		p->id_base[i + 1] = p->id_base[i] + batches[i].num_ids;
		rc = snapshot_offsets(&batches[i], offsets + off_base[i], err);
		if (rc)
			goto out;
	}
	job.offsets = offsets;
	job.off_base = off_base;
	t = phase_done(t, &ph->setup_ns);

	embd_workers_run(workers, collect_worker, &job);
	t = phase_done(t, &ph->collect_ns);
	struct embd_first_err first = { 0 };
	for (uint32_t w = 0; w < job.nw; w++)
		embd_first_err_note(&first, job.errs[w].rc, job.errs[w].batch, &job.errs[w].e);
	rc = first.rc;
	if (rc) {
		if (err)
			*err = first.e;
		goto out;
	}

	if (lsd) {
		/* the low bits first, over the whole batch (positions digit-major, worker-minor:
		 * stable), then the buckets' bits from that order (stable too): sorted by row,
		 * each row's occurrences in batch order, as the buckets' sort leaves them */
		const uint64_t digits = (uint64_t)1 << p->shift;
		uint64_t at = 0;
		for (uint64_t dgt = 0; dgt < digits; dgt++)
			for (uint32_t w = 0; w < job.nw; w++) {
				uint64_t c = job.hist_low[(w << p->shift) + dgt];
				job.hist_low[(w << p->shift) + dgt] = at;
				at += c;
			}
		embd_workers_run(workers, low_scatter_worker, &job);
		/* the scatter by bucket below reads that order, each worker an even slice of it */
		struct embd_occ *by_low = p->bucketed;
		p->bucketed = p->occ;
		p->occ = by_low;
		for (uint32_t w = 0; w < job.nw; w++) {
			job.occ_range[2 * w] = num_occ * w / job.nw;
			job.occ_range[2 * w + 1] = num_occ * (w + 1) / job.nw;
		}
		/* one worker's counts by bucket are the batch's, whatever the order; several
		 * workers count their slices again */
		if (job.nw > 1)
			embd_workers_run(workers, top_count_worker, &job);
		t = phase_done(t, &ph->sort_ns);
	}
	/* counts -> scatter positions: bucket-major, worker-minor, so the scatter is stable */
	uint64_t pos = 0;
	for (uint32_t dgt = 0; dgt < p->num_buckets; dgt++) {
		p->bucket_start[dgt] = pos;
		for (uint32_t w = 0; w < job.nw; w++) {
			uint64_t c = job.hist[(uint64_t)w * p->num_buckets + dgt];
			job.hist[(uint64_t)w * p->num_buckets + dgt] = pos;
			pos += c;
		}
	}
	p->bucket_start[p->num_buckets] = pos;
	embd_workers_run(workers, scatter_worker, &job);
	t = phase_done(t, &ph->scatter_ns);

	if (lsd) {
		occ_buf_put(p->occ);
		p->occ = NULL;
		p->sorted = true;
	} else if (sort) {
		job.chunk_buckets = chunk_buckets(p, job.nw);
		atomic_init(&job.next_bucket, 0);
		embd_workers_run(workers, sort_worker, &job);
		occ_buf_put(p->occ);
		p->occ = NULL;
		p->sorted = true;
		phase_done(t, &ph->sort_ns);
	}
	*out = p;
	p = NULL;
	rc = 0;
out:
	free(job.errs);
	free(offsets);
	free(work);
	embd_backward_prep_free(p);
	return rc;
}

/* Phase 4 on shard (whose rows p indexes) with the batches' gradient columns (phase times
 * added to ph when timed); p is only read unless it comes unsorted. */
static int apply_occurrences(const struct embd_exec *exec, const struct embd_cpu_kernels *k,
			     struct embd_shard *shard, const struct embd_backward_prep *p,
			     struct embd_backward_prep *unsorted,
			     const struct embd_bag_batch *batches, bool timed,
			     struct embd_backward_times *ph, struct embd_kernel_err *err)
{
	struct embd_workers *workers = exec ? exec->workers : NULL;
	uint64_t t = embd_now_ns();
	uint32_t nw = embd_workers_count(workers);
	struct bwd_job job = { .k = k, .p = p, .sort_here = p->sorted ? NULL : unsorted,
			       .chunk_buckets = chunk_buckets(p, nw) };
	uint64_t num_bags = p->bag_base[p->n], strided = 0;
	const uint32_t cols = shard->desc.cols;
	const float **bag_grad = malloc((num_bags ? num_bags : 1) * sizeof(*bag_grad));
	float *dense = NULL;
	int rc = 0;

	for (uint32_t i = 0; i < p->n; i++)
		strided += batches[i].pooled_stride != cols ? batches[i].batch_size : 0;
	if (strided)
		dense = malloc(strided * cols * sizeof(float));

	job.bad = calloc(2 * (uint64_t)nw, sizeof(*job.bad));
	job.scratch = malloc((uint64_t)nw * 2 * shard->desc.cols * sizeof(float));
	job.phase_ns = timed ? calloc(2 * (uint64_t)nw, sizeof(*job.phase_ns)) : NULL;
	if (!bag_grad || !job.bad || !job.scratch || (timed && !job.phase_ns) || (strided && !dense)) {
		rc = embd_kernel_fail(err, EMBD_ENOMEM, 0, -1, 0, "out of memory for %llu occurrences",
				      (unsigned long long)p->id_base[p->n]);
		goto out;
	}
	/*
	 * A batch whose gradient rows hold other features' columns too (the engine's: stride the
	 * trainer's total width) is copied to rows of this shard's columns alone first. Read in
	 * place, the rows a bag's occurrences read lie one stride apart; at a stride that is a
	 * power of two they fall in a fraction of the L2's sets and miss it (stride 512 floats, D 64,
	 * B 4096, one thread, Zen 4: the backward 16-18% faster with the copy).
	 */
	float *to = dense;
	for (uint32_t i = 0; i < p->n; i++) {
		const struct embd_bag_batch *bt = &batches[i];
		for (uint64_t b = 0; b < bt->batch_size; b++) {
			const float *g = bt->pooled_grad + b * bt->pooled_stride + bt->pooled_col;
			if (bt->pooled_stride != cols) {
				memcpy(to, g, cols * sizeof(float));
				g = to;
				to += cols;
			}
			bag_grad[p->bag_base[i] + b] = g;
		}
	}
	job.ctx = (struct embd_bwd_rows){
		.shard = shard, .params = embd_optim_params_make(&shard->desc.optimizer, shard->step + 1),
		.bag_grad = bag_grad,
	};
	t = phase_done(t, &ph->setup_ns);

	atomic_init(&job.next_bucket, 0);
	embd_workers_run(workers, apply_worker, &job);
	uint64_t bad_rows = 0, bad_row = UINT64_MAX;
	for (uint32_t w = 0; w < nw; w++) {
		bad_rows += job.bad[2 * w];
		bad_row = job.bad[2 * w + 1] < bad_row ? job.bad[2 * w + 1] : bad_row;
	}
	if (bad_rows) {
		shard->nonfinite_rows += bad_rows;
		shard->nonfinite_row = shard->desc.row_offset + (int64_t)bad_row;
	}
	if (timed)
		note_apply_phase(ph, job.phase_ns, nw, embd_now_ns() - t);
	shard->step++;
out:
	free(dense);
	free(job.phase_ns);
	free(job.scratch);
	free(job.bad);
	free(bag_grad);
	return rc;
}

static void add_times(struct embd_backward_times *to, const struct embd_backward_times *ph)
{
	to->calls += ph->calls;
	to->setup_ns += ph->setup_ns;
	to->collect_ns += ph->collect_ns;
	to->scatter_ns += ph->scatter_ns;
	to->sort_ns += ph->sort_ns;
	to->apply_ns += ph->apply_ns;
}

static const struct embd_cpu_kernels *kernels_of(const struct embd_exec *exec,
						 struct embd_kernel_err *err)
{
	const struct embd_cpu_kernels *k = embd_cpu_kernels_get(exec ? exec->isa : EMBD_ISA_AUTO);

	if (!k)
		embd_kernel_fail(err, EMBD_ENOTSUP, 0, -1, 0, "instruction set %s not supported here",
				 embd_kernels_isa_name(exec->isa));
	return k;
}

int embd_kernels_backward_prepare(const struct embd_exec *exec, const struct embd_shard *shard,
				  const struct embd_bag_batch *batches, uint32_t n,
				  struct embd_backward_prep **out, struct embd_kernel_err *err)
{
	struct embd_backward_times *times = exec ? exec->backward_times : NULL;
	struct embd_backward_times ph = { 0 };
	int rc = prepare_occurrences(exec, shard, batches, n, true, out, &ph, err);

	if (!rc && times)
		add_times(times, &ph);
	return rc;
}

int embd_kernels_backward_apply(const struct embd_exec *exec, struct embd_shard *shard,
				const struct embd_backward_prep *prep,
				const struct embd_bag_batch *batches, uint32_t n,
				struct embd_kernel_err *err)
{
	struct embd_backward_times *times = exec ? exec->backward_times : NULL;
	struct embd_backward_times ph = { .calls = 1 };
	const struct embd_cpu_kernels *k = kernels_of(exec, err);
	uint64_t num_bags, num_occ;
	int rc;

	if (!k)
		return EMBD_ENOTSUP;
	if (!shard || !prep)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "no %s", shard ? "prepared occurrences" : "shard");
	if (shard->desc.row_offset != prep->row_offset || shard->desc.rows != prep->rows)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0,
					"the shard's rows [%lld, %lld) are not the prepared ones [%lld, %lld)",
					(long long)shard->desc.row_offset,
					(long long)(shard->desc.row_offset + shard->desc.rows),
					(long long)prep->row_offset, (long long)(prep->row_offset + prep->rows));
	if (n != prep->n)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "%u batches, %u prepared", n, prep->n);
	rc = check_batches(shard, batches, n, &num_bags, &num_occ, err);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++)
		if (batches[i].batch_size != prep->bag_base[i + 1] - prep->bag_base[i] ||
		    batches[i].num_ids != prep->id_base[i + 1] - prep->id_base[i])
			return embd_kernel_fail(err, EMBD_EINVAL, batches[i].feature, -1, 0,
						"feature %u: %u bags of %llu ids, prepared %llu of %llu",
						batches[i].feature, batches[i].batch_size,
						(unsigned long long)batches[i].num_ids,
						(unsigned long long)(prep->bag_base[i + 1] - prep->bag_base[i]),
						(unsigned long long)(prep->id_base[i + 1] - prep->id_base[i]));
	/* sorted (prepare sorts): only read, so applies on other shards may share it at once */
	rc = apply_occurrences(exec, k, shard, prep, NULL, batches, times != NULL, &ph, err);
	if (!rc && times)
		add_times(times, &ph);
	return rc;
}

int embd_kernels_backward(const struct embd_exec *exec, struct embd_shard *shard,
			  const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err)
{
	struct embd_backward_times *times = exec ? exec->backward_times : NULL;
	struct embd_backward_times ph = { .calls = 1 }; /* this call's; a few clock reads */
	const struct embd_cpu_kernels *k = kernels_of(exec, err);
	struct embd_backward_prep *p = NULL;
	int rc;

	if (!k)
		return EMBD_ENOTSUP;
	/* unsorted: each apply worker sorts the buckets it takes, between its rows' prefetches */
	rc = prepare_occurrences(exec, shard, batches, n, false, &p, &ph, err);
	if (!rc)
		rc = apply_occurrences(exec, k, shard, p, p, batches, times != NULL, &ph, err);
	embd_backward_prep_free(p);
	if (!rc && times)
		add_times(times, &ph);
	return rc;
}
