/*
 * Fused backward + optimizer on one shard, with no dense gradient of the table: only one row
 * of it per worker exists at any time (the batch's gradient, B x the shard's columns, is read
 * where it lies, or first copied to rows of that width when it comes strided).
 *
 *   1. serial   snapshot the offsets and check them, so that later phases trust them
 *   2. workers  (split by bags) check every id and count the worker's ids by bucket (the top
 *               bits of the row); serially, the buckets are dealt out to the workers as
 *               owners, in even shares of the occurrences
 *   3. workers  (same split) read the ids again and write each one's occurrence, an 8-byte
 *               key of its row and its bag (or, where ids carry weights, its place among the
 *               ids, beside which its bag and coefficient go), into the worker's own region
 *               (its bags' span), one part per owner, in batch order (a single worker does 2
 *               and 3 in one pass, collect_worker)
 *   4. workers  (by owner) an LSD radix sort of the owner's parts into its range of the
 *               sorted order: the bits under the buckets' (one pass when they are at most
 *               LOW_BITS_MAX), then by bucket
 *   5. workers  (grab chunks of buckets) sum each row's run and apply the optimizer to the
 *               row once
 * Phases 3 and 4 write only where the same worker wrote last (its region lies about where its
 * own range of the sorted order does): the whole batch sorted by two radix passes, with the
 * workers scattering into places next to each other's, took longer with two workers than with
 * one (Intel Xeon, sgd D 64 P 20, 2026-12-06, docs/benchmarks.md). Every pass is stable and
 * the parts are read in region order, so a row's gradient is summed in batch order whatever
 * the number of workers. Nothing is written to the shard before phases 1-4 have checked every
 * offset and id; with several workers, an id that changes between 2 and 3 (a client still
 * writing its batch) fills a part or a bucket past what phase 2 counted, which fails the call
 * before it writes there.
 * Each row updated is checked for NaN and infinity while it is in cache, and counted on the
 * shard.
 *
 * Phases 1-4 depend on the bags and the shard's rows only, never on its columns: prepare runs
 * them once for shards that share the bags (a table's column shards), and each shard's apply
 * walks the same sorted occurrences.
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
#define OCC_PER_BUCKET_LOG2 6           /* aim for ~64 occurrences per bucket */
#define LOW_BITS_MAX 11                 /* bits of the row a radix pass under the buckets' sorts */
#define OCC_PER_CHUNK 512               /* a worker takes about this many occurrences at a time */
#define CHUNKS_PER_WORKER_MIN 8         /* ... but leaves enough chunks to even out the workers */
#define IDS_AHEAD 256                   /* ids prefetched ahead of the bag read (prefetch_ids_ahead) */

/* The prepared occurrences (embedding.h): what every shard of the same rows and bags shares. */
struct embd_backward_prep {
	int64_t row_offset;             /* the rows the occurrences index: [row_offset, +rows) */
	int64_t rows;
	uint32_t n;                     /* batches */
	uint64_t *bag_base;             /* n + 1: first global bag of each batch */
	uint64_t *id_base;              /* n + 1: first occurrence of each batch */
	uint32_t shift;                 /* bucket = row >> shift */
	uint32_t num_buckets;
	uint64_t *bucket_start;         /* num_buckets + 1: each bucket's place in the sorted order */
	uint32_t idx_bits;              /* a key's bits under its row (cpu_kernels.h) */
	embd_occ_key *sorted;           /* id_base[n], sorted by row (a row's in batch order); after
					 * them in the same buffer, what their keys name: */
	float *bag_coef;                /* no batch weighted: keys name bags, each bag's coefficient */
	struct embd_occ_side *side;     /* else keys name places among the ids: each one's; or NULL */
	int sorted_cls;                 /* the pool's class of sorted's buffer (occ_buf_get) */
};

/*
 * The occurrence arrays (a prepare's two, 8 bytes an id each, the one the sort ends in followed
 * by what its keys name) and the apply's copy of strided gradients come from a small pool of
 * buffers kept between calls, 2 MiB aligned and advised for transparent huge pages. Fresh
 * malloc'd arrays every call left the phases over them at the mercy of where the heap's pages lay: on the Zen 4
 * VM, with two workers, collect took 250-290 us a call in about half the processes against
 * 50-60 us in the rest (sgd D 64 P 20), with the cores at full speed; with the pool a slow
 * collect in 3 of 18 runs against 10 of 18, and sgd/64 read .887 of its limit at the median
 * against .684, rowwise_adagrad/64 .844 against .671 (2026-12-05, docs/benchmarks.md). Two
 * arrays both at the start of their 2 MiB fell in the same cache sets and scattered between
 * them 2.5x slower, so a prepare's first and second array come from two classes of buffer
 * whose data start at different lines. The gradients' copy (1 MiB a table in the training
 * step's table_wise), malloc'd and freed every call, left that step's sort phases at 1.9 ms a
 * rank against 1.3 (Intel Xeon, 2026-12-06; the cause was not pinned down: munmap's TLB
 * shootdowns on the other rank's core are a guess). A column_wise step holds every table's
 * prep until its halves are applied: with 8 buffers kept, its apply's setup took 3.7-6.0 ms a
 * step against ~1.1 with 16, the others paying for fresh pages. The pool is one for the
 * process: ranks on other NUMA nodes may get a buffer first touched on another (not measured;
 * the VM has one node). Under AddressSanitizer the arrays are plain malloc, so that it sees
 * their exact bounds.
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
#define OCC_BUF_KEEP 16                         /* buffers the pool keeps ... */
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

/* Phases 2-4: the batches' occurrences sorted into a prep. */
struct prep_job {
	const struct embd_bag_batch *batches;
	struct embd_backward_prep *p;
	uint32_t nw;
	const int64_t *offsets;         /* snapshot: batch i's B + 1 offsets at off_base[i] */
	const uint64_t *off_base;       /* n + 1 */
	/* each worker's row of these starts a cache line of its own: counted in a line that the
	 * other worker wrote too, phase 3 took ~10x as long (Intel Xeon, sgd D 128 P 20) */
	uint64_t hist_stride;           /* num_buckets, rounded up to a line's worth */
	uint64_t part_stride;           /* nw, likewise */
	uint64_t *hist;                 /* nw x hist_stride: each worker's ids by bucket (phase 2);
					 * then each owner's next place in the sort's bucket pass */
	uint16_t *owner;                /* num_buckets: the worker that sorts each bucket */
	uint64_t *owner_start;          /* nw + 1: owner o sorts buckets [owner_start[o], [o + 1]) */
	uint64_t *part_start;           /* nw x part_stride: worker w's part of owner o's buckets in its
					 * region of `in` (regions in worker order) ... */
	uint64_t *part_pos;             /* ... where its next occurrence goes (phase 3) ... */
	uint64_t *part_end;             /* ... and where it ends */
	uint32_t low_passes;            /* the sort's radix passes under the buckets' bits ... */
	uint32_t low_width;             /* ... the first one's bits */
	uint64_t *low_count;            /* one worker: its occurrences by the first pass's digit
					 * (2^low_width), counted as they were written; else NULL */
	embd_occ_key *in;               /* phase 3's regions */
	embd_occ_key *other;            /* the radix sort's other half */
	struct embd_first_err *errs;    /* one per worker */
};

/* Phase 5 on one shard. */
struct bwd_job {
	const struct embd_cpu_kernels *k;
	struct embd_bwd_rows ctx;
	const struct embd_backward_prep *p;
	uint32_t chunk_buckets;         /* buckets a worker takes at a time */
	uint64_t *bad;                  /* nw x 2: rows left non-finite, the lowest of them */
	float *scratch;                 /* nw x 2 cols */
	atomic_uint_fast64_t next_bucket;
};

/* Worker w's bags: a contiguous slice of the global bag index. */
static void worker_bags(const struct prep_job *job, uint32_t w, uint64_t *first, uint64_t *last)
{
	uint64_t total = job->p->bag_base[job->p->n];

	*first = total * w / job->nw;
	*last = total * (w + 1) / job->nw;
}

/* The batch global bag g lies in: its index, found from *i (the batch of an earlier bag) on. */
static inline uint32_t batch_of(const struct embd_backward_prep *p, uint64_t g, uint32_t i)
{
	while (p->bag_base[i + 1] <= g)
		i++;
	return i;
}

/* Notes in job's errors for worker w that batch i's bag b read ids[k] = id outside the
 * shard's rows, or (changed) one that overfilled its part: not what phase 2 counted. */
static void note_bad_id(struct prep_job *job, uint32_t w, uint32_t i, uint64_t b, int64_t k,
			int64_t id, bool changed)
{
	const struct embd_bag_batch *bt = &job->batches[i];
	const struct embd_backward_prep *p = job->p;
	struct embd_kernel_err ke;
	int rc = changed ? EMBD_EINVAL : EMBD_ERANGE;

	if (changed)
		embd_kernel_fail(&ke, rc, bt->feature, (int64_t)b, id,
				 "feature %u sample %llu: ids changed while the backward read them "
				 "(ids[%lld] = %lld is not what was counted)",
				 bt->feature, (unsigned long long)b, (long long)k, (long long)id);
	else
		embd_kernel_fail(&ke, rc, bt->feature, (int64_t)b, id,
				 "feature %u sample %llu: id %lld outside the shard's rows [%lld, %lld)",
				 bt->feature, (unsigned long long)b, (long long)id,
				 (long long)p->row_offset, (long long)(p->row_offset + p->rows));
	embd_first_err_note(&job->errs[w], rc, i, &ke);
}

/*
 * Before reading a bag's ids [s, e), as many ids IDS_AHEAD past them (at most
 * embd_prefetch_bytes' lines): the batch's ids were last read by its forward and come from
 * DRAM, where the hardware's prefetcher alone left the passes that read them waiting on their
 * loads (64% of one worker's collect samples right after the id's load). With it collect took
 * 154-158 us against 279-311 at the training step's per-table batch (sgd D 64, B 4096, one
 * worker; Intel Xeon, 2026-12-06). The address is computed as an integer: it may lie past the
 * batch's ids (which a prefetch may touch), and a batch without ids may have none.
 */
static inline __attribute__((always_inline)) void prefetch_ids_ahead(const int64_t *ids, int64_t s,
									   int64_t e)
{
	uintptr_t at = (uintptr_t)ids + ((uintptr_t)e + IDS_AHEAD) * sizeof(*ids);

	embd_prefetch_bytes((const void *)at, (uint64_t)(e - s) * sizeof(*ids));
}

/*
 * Global bag g of a worker's walk in order: its batch (*i, found from the previous bag's on),
 * its sample *b in it and its ids [*s, *e), whose successors are prefetched.
 */
static inline __attribute__((always_inline)) const struct embd_bag_batch *
bag_at(const struct prep_job *job, uint64_t g, uint32_t *i, uint64_t *b, int64_t *s, int64_t *e)
{
	const struct embd_backward_prep *p = job->p;

	*i = batch_of(p, g, *i);
	*b = g - p->bag_base[*i];
	const int64_t *off = job->offsets + job->off_base[*i];
	*s = off[*b];
	*e = off[*b + 1];
	prefetch_ids_ahead(job->batches[*i].ids, *s, *e);
	return &job->batches[*i];
}

/* Phase 2: worker w's ids checked against the shard's rows and counted by bucket. */
static void count_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct prep_job *job = arg;
	const struct embd_backward_prep *p = job->p;
	uint64_t *count = job->hist + w * job->hist_stride;
	uint64_t g, g_last;
	uint32_t i = 0;

	(void)nw;
	worker_bags(job, w, &g, &g_last);
	for (; g < g_last; g++) {
		uint64_t b;
		int64_t s, e;
		const struct embd_bag_batch *bt = bag_at(job, g, &i, &b, &s, &e);

		for (int64_t k = s; k < e; k++) {
			/* read once in this pass: the client may be writing it */
			int64_t id = __atomic_load_n(&bt->ids[k], __ATOMIC_RELAXED);
			uint64_t r = (uint64_t)id - (uint64_t)p->row_offset;
			if (r >= (uint64_t)p->rows) {
				note_bad_id(job, w, i, b, k, id, false);
				return;
			}
			count[r >> p->shift]++;
		}
	}
}

/*
 * Phase 3: worker w's occurrences (keys; where ids carry weights, the side too), in batch
 * order, into one part per owner (the worker that sorts their buckets), each part inside the
 * range its owner sorts. The ids are read a second time: one that is no longer what phase 2
 * counted (outside the rows, or past its part) fails the call before it is written anywhere.
 * counting: phases 2 and 3 of a single worker in one pass instead, each id read once, checked,
 * written (the one owner's one part) and counted by bucket and by the sort's first digit. With
 * two workers the owners must be known before anything is written; one need not read the ids
 * twice, and doing so took its prepare ~30% longer (Intel Xeon, sgd D 64 P 20): every rank of
 * a two-core machine runs one worker.
 */
static inline __attribute__((always_inline)) void
write_occurrences(struct prep_job *job, uint32_t w, uint32_t nw, const bool counting)
{
	const struct embd_backward_prep *p = job->p;
	uint64_t single_pos = 0;
	uint64_t *pos = counting ? &single_pos : job->part_pos + w * job->part_stride;
	const uint64_t *end = job->part_end + w * job->part_stride;
	const uint16_t *owner = job->owner;
	uint64_t *count = job->hist, *low = job->low_count;
	const uint64_t low_mask = ((uint64_t)1 << job->low_width) - 1;
	embd_occ_key *out = job->in;
	struct embd_occ_side *side = p->side;
	const uint32_t idx_bits = p->idx_bits;
	uint64_t g, g_last;
	uint32_t i = 0;

	/* the region cleared first, in whole lines (string stores) rather than taken over line by
	 * line by the loop's stores: sgd D 64 and 128 P 20 2-3% faster a batch, the other
	 * optimizers within the noise (Intel Xeon, 2026-12-06, measured on 16-byte occurrences) */
	if (counting)
		memset(out, 0, p->id_base[p->n] * sizeof(*out));
	else
		memset(out + job->part_start[w * job->part_stride], 0,
		       (end[nw - 1] - job->part_start[w * job->part_stride]) * sizeof(*out));
	worker_bags(job, w, &g, &g_last);
	for (; g < g_last; g++) {
		uint64_t b;
		int64_t s, e;
		const struct embd_bag_batch *bt = bag_at(job, g, &i, &b, &s, &e);
		int64_t divisor = bt->mean_lengths ? bt->mean_lengths[b] : e - s;
		float scale = embd_grad_scale(bt->pooling, divisor, bt->grad_divisor);
		uint64_t at = p->id_base[i];    /* the batch's first place among the call's ids */

		if (!side)
			p->bag_coef[g] = embd_grad_coef(1.0f, scale);

		for (int64_t k = s; k < e; k++) {
			/* read once in this pass: the client may be writing it */
			int64_t id = __atomic_load_n(&bt->ids[k], __ATOMIC_RELAXED);
			uint64_t r = (uint64_t)id - (uint64_t)p->row_offset;
			uint32_t o = 0;
			if (counting) {
				if (r >= (uint64_t)p->rows) {
					note_bad_id(job, w, i, b, k, id, false);
					return;
				}
			} else {
				o = r < (uint64_t)p->rows ? owner[r >> p->shift] : 0;
				if (r >= (uint64_t)p->rows || pos[o] == end[o]) {
					note_bad_id(job, w, i, b, k, id, true);
					return;
				}
			}
			if (side) {
				out[pos[o]++] = r << idx_bits | (at + (uint64_t)k);
				side[at + (uint64_t)k] = (struct embd_occ_side){
					.bag = (uint32_t)g,
					.coef = embd_grad_coef(bt->weights ? bt->weights[k] : 1.0f, scale),
				};
			} else {
				out[pos[o]++] = r << idx_bits | g;
			}
			if (counting) {
				count[r >> p->shift]++;
				low[r & low_mask]++;
			}
		}
	}
}

static void place_worker(void *arg, uint32_t w, uint32_t nw)
{
	write_occurrences(arg, w, nw, false);
}

static void collect_worker(void *arg, uint32_t w, uint32_t nw)
{
	write_occurrences(arg, w, nw, true);
}

/* A radix pass's counts of its digits [0, digits) -> where each digit's first one goes. */
static void counts_to_places(uint64_t *count, uint64_t digits)
{
	for (uint64_t dgt = 0, sum = 0; dgt < digits; dgt++) {
		uint64_t c = count[dgt];
		count[dgt] = sum;
		sum += c;
	}
}

/*
 * Phase 4, first half: owner o's parts (one per worker's region, in region order: batch order)
 * sorted by the lowest bits under the buckets', stably, into its range of other. The regions
 * may lie under other owners' ranges, so nothing writes `in` until every owner has read its
 * parts (the second half).
 */
static void sort_low_worker(void *arg, uint32_t o, uint32_t nw)
{
	struct prep_job *job = arg;
	const struct embd_backward_prep *p = job->p;
	const uint64_t lo = p->bucket_start[job->owner_start[o]];
	const embd_occ_key *in = job->in;
	embd_occ_key *out = job->other + lo;
	uint64_t own_count[(uint64_t)1 << LOW_BITS_MAX];
	const uint64_t mask = ((uint64_t)1 << job->low_width) - 1;
	const uint32_t at = p->idx_bits;        /* the digit's lowest bit in a key */
	/* a single worker counted as it wrote (its one owner's only use of them) */
	uint64_t *count = job->low_count ? job->low_count : own_count;

	if (!job->low_count) {
		memset(count, 0, (mask + 1) * sizeof(*count));
		for (uint64_t w = 0; w < nw; w++)
			for (uint64_t j = job->part_start[w * job->part_stride + o];
			     j < job->part_end[w * job->part_stride + o]; j++)
				count[(in[j] >> at) & mask]++;
	}
	counts_to_places(count, mask + 1);
	for (uint64_t w = 0; w < nw; w++)
		for (uint64_t j = job->part_start[w * job->part_stride + o];
		     j < job->part_end[w * job->part_stride + o]; j++)
			out[count[(in[j] >> at) & mask]++] = in[j];
}

/*
 * Phase 4, second half: owner o's range, sorted by its lowest bits in other, sorted by the
 * rest of the bits under the buckets' (passes of at most LOW_BITS_MAX bits, where they do not
 * fit one), then by bucket, stably (an LSD radix sort); every owner makes the same passes, so
 * all end in the same one of the two arrays. A bucket that gets more occurrences than phase 2
 * counted (an id that changed between phases 2 and 3 but stayed among the owner's buckets)
 * fails the call.
 */
static void sort_rest_worker(void *arg, uint32_t o, uint32_t nw)
{
	struct prep_job *job = arg;
	const struct embd_backward_prep *p = job->p;
	const uint64_t b_first = job->owner_start[o], b_last = job->owner_start[o + 1];
	const uint64_t lo = p->bucket_start[b_first], n = p->bucket_start[b_last] - lo;
	embd_occ_key *in = job->other + lo, *out = job->in + lo, *t;
	uint64_t count[(uint64_t)1 << LOW_BITS_MAX];
	const uint32_t passes = job->low_passes;
	uint32_t bit = job->low_width;

	(void)nw;
	for (uint32_t k = 1; k < passes; k++) {
		uint32_t width = (p->shift - bit + (passes - k) - 1) / (passes - k);
		uint64_t mask = ((uint64_t)1 << width) - 1;
		uint32_t at = p->idx_bits + bit;

		memset(count, 0, (mask + 1) * sizeof(*count));
		for (uint64_t j = 0; j < n; j++)
			count[(in[j] >> at) & mask]++;
		counts_to_places(count, mask + 1);
		for (uint64_t j = 0; j < n; j++)
			out[count[(in[j] >> at) & mask]++] = in[j];
		t = in;
		in = out;
		out = t;
		bit += width;
	}
	/* by bucket, into each bucket's place: its start less the range's */
	uint64_t *pos = job->hist + o * job->hist_stride;
	for (uint64_t b = b_first; b < b_last; b++)
		pos[b - b_first] = p->bucket_start[b] - lo;
	const uint32_t bucket_at = p->idx_bits + p->shift;
	for (uint64_t j = 0; j < n; j++) {
		uint64_t b = (in[j] >> bucket_at) - b_first;
		if (b >= b_last - b_first || pos[b] == p->bucket_start[b_first + b + 1] - lo) {
			uint64_t named = in[j] & (((uint64_t)1 << p->idx_bits) - 1);
			uint64_t bag = p->side ? p->side[named].bag : named;
			uint32_t i = batch_of(p, bag, 0);
			struct embd_kernel_err ke;
			embd_kernel_fail(&ke, EMBD_EINVAL, job->batches[i].feature,
					 (int64_t)(bag - p->bag_base[i]),
					 (int64_t)(in[j] >> p->idx_bits) + p->row_offset,
					 "feature %u sample %llu: ids changed while the backward read them (a "
					 "bucket got more ids than counted, the last of them this sample's)",
					 job->batches[i].feature, (unsigned long long)(bag - p->bag_base[i]));
			embd_first_err_note(&job->errs[o], EMBD_EINVAL, i, &ke);
			return;
		}
		out[pos[b]++] = in[j];
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

/* The next chunk of buckets for this worker: *n occurrences sorted by row from *sorted
 * (buckets are ascending ranges of rows). False when none is left. */
static bool next_chunk(struct bwd_job *job, const embd_occ_key **sorted, uint64_t *n)
{
	const struct embd_backward_prep *p = job->p;
	uint64_t b0, b1;

	if (!take_chunk(&job->next_bucket, job->chunk_buckets, p->num_buckets, &b0, &b1))
		return false;
	*sorted = p->sorted + p->bucket_start[b0];
	*n = p->bucket_start[b1] - p->bucket_start[b0];
	return true;
}

/*
 * Workers take chunks of buckets (a few hundred occurrences: one counter update each, and one
 * prefetch stream through the chunk's rows). Each takes the chunk it applies next before
 * applying the one it holds, so that the rows of the next chunk's head are prefetched while
 * this one's tail is applied, not waited on one by one.
 */
static void apply_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bwd_job *job = arg;
	float *scratch = job->scratch + (uint64_t)w * 2 * job->ctx.shard->desc.cols;
	const embd_occ_key *cur = NULL, *next = NULL;
	uint64_t n = 0, next_n = 0;
	uint64_t *bad = job->bad + 2 * (uint64_t)w;    /* rows left non-finite, the first one */
	size_t prefetched = 0;

	(void)nw;
	bad[0] = 0;
	bad[1] = UINT64_MAX;
	bool more = next_chunk(job, &cur, &n);
	for (; more; cur = next, n = next_n) {
		more = next_chunk(job, &next, &next_n);
		prefetched = job->k->apply_rows(&job->ctx, cur, n, more ? next : NULL, more ? next_n : 0,
						prefetched, scratch, &bad[0], &bad[1]);
	}
}

/* Adds the time since t to *phase and returns now. */
static uint64_t phase_done(uint64_t t, uint64_t *phase)
{
	uint64_t now = embd_now_ns();
	*phase += now - t;
	return now;
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

/* n 8-byte words, rounded up to whole cache lines. */
static uint64_t round_up_line(uint64_t n)
{
	const uint64_t per_line = EMBD_CACHE_LINE_BYTES / sizeof(uint64_t);

	return (n + per_line - 1) / per_line * per_line;
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
	occ_buf_put(p->sorted);
	free(p->bag_base);
	free(p);
}

/* Runs fn on the workers and returns the first error they noted (into *err), or 0. */
static int run_checked(struct embd_workers *workers, embd_workers_fn fn, struct prep_job *job,
		       struct embd_kernel_err *err)
{
	struct embd_first_err first = { 0 };

	embd_workers_run(workers, fn, job);
	for (uint32_t w = 0; w < job->nw; w++)
		embd_first_err_note(&first, job->errs[w].rc, job->errs[w].batch, &job->errs[w].e);
	if (first.rc && err)
		*err = first.e;
	return first.rc;
}

/*
 * Phase 2's counts -> the buckets' places in the sorted order, the owners' buckets (even
 * shares of the occurrences, whole buckets) and each worker's part of each owner's buckets:
 * worker-major, owner-minor, so that each worker writes a region of its own in phase 3 (its
 * bags' span of the batch, about where its own range ends up), as the owner's sort then
 * writes its range: where the one writing a line held it last, not the other core.
 */
static void plan_parts(struct prep_job *job, uint64_t num_occ)
{
	struct embd_backward_prep *p = job->p;
	const uint64_t nb = p->num_buckets, nw = job->nw;

	p->bucket_start[0] = 0;
	for (uint64_t b = 0; b < nb; b++) {
		uint64_t size = 0;
		for (uint64_t w = 0; w < nw; w++)
			size += job->hist[w * job->hist_stride + b];
		p->bucket_start[b + 1] = p->bucket_start[b] + size;
	}
	job->owner_start[0] = 0;
	for (uint64_t o = 1, b = 0; o < nw; o++) {
		uint64_t share = (uint64_t)((double)num_occ * (double)o / (double)nw);
		while (b < nb && p->bucket_start[b] < share)
			b++;
		job->owner_start[o] = b;
	}
	job->owner_start[nw] = nb;
	for (uint64_t o = 0; o < nw; o++)
		for (uint64_t b = job->owner_start[o]; b < job->owner_start[o + 1]; b++)
			job->owner[b] = (uint16_t)o;
	uint64_t at = 0;
	for (uint64_t w = 0; w < nw; w++)
		for (uint64_t o = 0; o < nw; o++) {
			uint64_t size = 0;
			for (uint64_t b = job->owner_start[o]; b < job->owner_start[o + 1]; b++)
				size += job->hist[w * job->hist_stride + b];
			uint64_t k = w * job->part_stride + o;
			job->part_start[k] = job->part_pos[k] = at;
			at += size;
			job->part_end[k] = at;
		}
}

/* Phases 1-4: the batches' checked occurrences, sorted by row, into *out (phase times added
 * to ph). */
static int prepare_occurrences(const struct embd_exec *exec, const struct embd_shard *shard,
			       const struct embd_bag_batch *batches, uint32_t n,
			       struct embd_backward_prep **out, struct embd_backward_times *ph,
			       struct embd_kernel_err *err)
{
	struct embd_workers *workers = exec ? exec->workers : NULL;
	uint64_t t = embd_now_ns();
	struct prep_job job = { .batches = batches, .nw = embd_workers_count(workers) };
	struct embd_backward_prep *p = NULL;
	uint64_t num_occ, num_bags, *work = NULL;
	int64_t *offsets = NULL;
	bool sorted_in_other = false;
	int rc;

	*out = NULL;
	if (!shard)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "no shard");
	rc = check_batches(shard, batches, n, &num_bags, &num_occ, err);
	if (rc)
		return rc;

	const uint64_t nw = job.nw;
	uint32_t row_bits = bits_for((uint64_t)shard->desc.rows - 1);
	bool weighted = false;
	for (uint32_t i = 0; i < n; i++)
		weighted |= batches[i].weights != NULL;
	/* what a key names under its row: its bag, or where ids carry weights its own place */
	uint64_t named = weighted ? num_occ : num_bags;
	uint32_t idx_bits = named ? bits_for(named - 1) : 0;
	/* a row and what its key names past 63 bits: billions of rows and of ids (or bags) in one
	 * call */
	if (row_bits + idx_bits >= 64)
		return embd_kernel_fail(err, EMBD_ERANGE, 0, -1, 0,
					"%lld rows and %llu %s in one call: a row and its %s take %u bits, "
					"more than the backward's 63-bit sort keys",
					(long long)shard->desc.rows, (unsigned long long)named,
					weighted ? "ids" : "bags", weighted ? "id's place" : "bag",
					row_bits + idx_bits);
	uint32_t want = bits_for(num_occ >> OCC_PER_BUCKET_LOG2);
	uint32_t top = want < row_bits ? want : row_bits;
	top = top < TOP_BITS_MAX ? top : TOP_BITS_MAX;
	p = calloc(1, sizeof(*p));
	if (p) {
		*p = (struct embd_backward_prep){
			.row_offset = shard->desc.row_offset, .rows = shard->desc.rows, .n = n,
			.shift = row_bits - top, .num_buckets = 1u << top, .idx_bits = idx_bits,
		};
		p->bag_base = malloc((2 * ((uint64_t)n + 1) + p->num_buckets + 1) *
				     sizeof(*p->bag_base));
		job.low_passes = (p->shift + LOW_BITS_MAX - 1) / LOW_BITS_MAX;
		job.low_width = job.low_passes ? (p->shift + job.low_passes - 1) / job.low_passes : 0;
		/* the array the sort ends in holds the side after its keys, so that the prep keeps
		 * one buffer: the first half ends in other (its one pass, or a copy where no bits
		 * lie under the buckets'), and each pass after it alternates, the low ones left and
		 * the bucket pass */
		sorted_in_other = job.low_passes >= 2 && job.low_passes % 2 == 0;
		/* an impossible count fails here, not in the multiplication */
		bool fits = num_occ <= SIZE_MAX / 4 / sizeof(*job.in);
		size_t keys = num_occ * sizeof(*job.in);
		size_t both = keys + (weighted ? num_occ * sizeof(*p->side)
					       : num_bags * sizeof(*p->bag_coef));
		job.in = fits ? occ_buf_get(sorted_in_other ? keys : both, 0) : NULL;
		job.other = fits ? occ_buf_get(sorted_in_other ? both : keys, 1) : NULL;
		if (job.in && job.other) {
			embd_occ_key *after = (sorted_in_other ? job.other : job.in) + num_occ;
			if (weighted)
				p->side = (struct embd_occ_side *)after;
			else
				p->bag_coef = (float *)after;
		}
		/* off_base (n + 1), hist (nw x hist_stride), owner_start (nw + 1), part_start,
		 * part_pos and part_end (nw x part_stride each), each array from a line */
		job.hist_stride = round_up_line(p->num_buckets);
		job.part_stride = round_up_line(nw);
		/* and with one worker low_count (2^low_width) */
		uint64_t low_words = nw == 1 ? round_up_line((uint64_t)1 << job.low_width) : 0;
		work = aligned_alloc(EMBD_CACHE_LINE_BYTES,
				     (round_up_line((uint64_t)n + 1) + nw * job.hist_stride +
				      round_up_line(nw + 1) + 3 * nw * job.part_stride + low_words) *
				     sizeof(*work));
		job.owner = malloc(p->num_buckets * sizeof(*job.owner));
	}
	offsets = malloc((num_bags + n) * sizeof(*offsets));
	job.errs = calloc(nw, sizeof(*job.errs));
	if (!p || !p->bag_base || !job.in || !job.other || !work || !job.owner || !offsets ||
	    !job.errs) {
		rc = embd_kernel_fail(err, EMBD_ENOMEM, 0, -1, 0, "out of memory for %llu occurrences",
				      (unsigned long long)num_occ);
		goto out;
	}
	uint64_t *off_base = work;
	p->id_base = p->bag_base + n + 1;
	p->bucket_start = p->id_base + n + 1;
	job.p = p;
	job.hist = off_base + round_up_line((uint64_t)n + 1);
	job.owner_start = job.hist + nw * job.hist_stride;
	job.part_start = job.owner_start + round_up_line(nw + 1);
	job.part_pos = job.part_start + nw * job.part_stride;
	job.part_end = job.part_pos + nw * job.part_stride;
	memset(job.hist, 0, nw * job.hist_stride * sizeof(*job.hist));
	if (nw == 1) {
		job.low_count = job.part_end + job.part_stride;
		memset(job.low_count, 0, ((uint64_t)1 << job.low_width) * sizeof(*job.low_count));
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

	/* one worker writes its occurrences as it counts them; several count, then write */
	rc = run_checked(workers, nw == 1 ? collect_worker : count_worker, &job, err);
	if (rc)
		goto out;
	plan_parts(&job, num_occ);
	t = phase_done(t, &ph->collect_ns);
	if (nw > 1) {
		rc = run_checked(workers, place_worker, &job, err);
		if (rc)
			goto out;
		t = phase_done(t, &ph->scatter_ns);
	}
	embd_workers_run(workers, sort_low_worker, &job);
	rc = run_checked(workers, sort_rest_worker, &job, err);
	if (rc)
		goto out;
	phase_done(t, &ph->sort_ns);
	p->sorted = sorted_in_other ? job.other : job.in;
	p->sorted_cls = sorted_in_other;
	if (sorted_in_other)
		job.other = NULL;
	else
		job.in = NULL;
	*out = p;
	p = NULL;
	rc = 0;
out:
	occ_buf_put(job.in);
	occ_buf_put(job.other);
	free(job.errs);
	free(offsets);
	free(job.owner);
	free(work);
	embd_backward_prep_free(p);
	return rc;
}

/* Phase 5 on shard (whose rows p indexes) with the batches' gradient columns (phase times
 * added to ph); p is only read. */
static int apply_occurrences(const struct embd_exec *exec, const struct embd_cpu_kernels *k,
			     struct embd_shard *shard, const struct embd_backward_prep *p,
			     const struct embd_bag_batch *batches, struct embd_backward_times *ph,
			     struct embd_kernel_err *err)
{
	struct embd_workers *workers = exec ? exec->workers : NULL;
	uint64_t t = embd_now_ns();
	uint32_t nw = embd_workers_count(workers);
	struct bwd_job job = { .k = k, .p = p, .chunk_buckets = chunk_buckets(p, nw) };
	uint64_t num_bags = p->bag_base[p->n], strided = 0;
	const uint32_t cols = shard->desc.cols;
	struct embd_bag_grad *bags = malloc((num_bags ? num_bags : 1) * sizeof(*bags));
	float *dense = NULL;
	int rc = 0;

	for (uint32_t i = 0; i < p->n; i++)
		strided += batches[i].pooled_stride != cols ? batches[i].batch_size : 0;
	if (strided)
		dense = occ_buf_get(strided * cols * sizeof(float), !p->sorted_cls); /* other sets */

	job.bad = calloc(2 * (uint64_t)nw, sizeof(*job.bad));
	job.scratch = malloc((uint64_t)nw * 2 * shard->desc.cols * sizeof(float));
	if (!bags || !job.bad || !job.scratch || (strided && !dense)) {
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
			bags[p->bag_base[i] + b] = (struct embd_bag_grad){
				.row = g, .coef = p->bag_coef ? p->bag_coef[p->bag_base[i] + b] : 0.0f,
			};
		}
	}
	job.ctx = (struct embd_bwd_rows){
		.shard = shard, .params = embd_optim_params_make(&shard->desc.optimizer, shard->step + 1),
		.bags = bags, .side = p->side,
		.idx_bits = p->idx_bits,
		.prefetch_rows = embd_backward_prefetch_distance(
			(uint64_t)cols * embd_dtype_bytes(shard->desc.dtype) +
			4 * (embd_optim_state_floats(shard->desc.optimizer.type, cols, 0) +
			     embd_optim_state_floats(shard->desc.optimizer.type, cols, 1))),
		.prefetch_near = embd_backward_prefetch_l1(shard->desc.optimizer.type),
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
	phase_done(t, &ph->apply_ns);
	shard->step++;
out:
	occ_buf_put(dense);
	free(job.scratch);
	free(job.bad);
	free(bags);
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
	int rc = prepare_occurrences(exec, shard, batches, n, out, &ph, err);

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
	/* only read, so applies on other shards may share it at once */
	rc = apply_occurrences(exec, k, shard, prep, batches, &ph, err);
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
	rc = prepare_occurrences(exec, shard, batches, n, &p, &ph, err);
	if (!rc)
		rc = apply_occurrences(exec, k, shard, p, batches, &ph, err);
	embd_backward_prep_free(p);
	if (!rc && times)
		add_times(times, &ph);
	return rc;
}
