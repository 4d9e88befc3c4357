/*
 * Fused backward + optimizer on one shard, with no dense gradient: only one row of gradient
 * per worker exists at any time.
 *
 *   1. serial   snapshot the offsets and check them, so that later phases trust them
 *   2. workers  (split by bags) check every id, write its occurrence {row, bag, coef} and count
 *               occurrences by the top bits of the row
 *   3. workers  (same split) scatter the occurrences stably into those buckets
 *   4. workers  (grab chunks of buckets) sort each bucket by the remaining bits (stable: LSD
 *               radix, or insertion when small), then sum each row's run and apply the
 *               optimizer to the row once
 * Buckets hold disjoint rows, so workers never write the same row; every sort is stable, so a
 * row's gradient is summed in batch order whatever the number of workers. Nothing is written
 * to the shard before phases 1-2 have checked every offset and id. Each row updated is
 * checked for NaN and infinity while it is in cache, and counted on the shard.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "kernels/cpu_kernels.h"
#include "kernels/pool_row.h"

#define TOP_BITS_MAX 12                 /* at most 4096 buckets */
#define OCC_PER_BUCKET_LOG2 6           /* aim for >= 64 occurrences per bucket */
#define RADIX_BITS_MAX 8
#define INSERTION_SORT_MAX 32
#define OCC_PER_CHUNK 512               /* a worker takes about this many occurrences at a time */
#define CHUNKS_PER_WORKER_MIN 8         /* ... but leaves enough chunks to even out the workers */

struct bwd_job {
	const struct embd_cpu_kernels *k;
	struct embd_bwd_rows ctx;
	const struct embd_bag_batch *batches;
	uint32_t n;
	uint32_t nw;
	const int64_t *offsets;         /* snapshot: batch i's B + 1 offsets at off_base[i] */
	const uint64_t *off_base;       /* n + 1 */
	const uint64_t *bag_base;       /* n + 1: first global bag of each batch */
	const uint64_t *id_base;        /* n + 1: first occurrence of each batch */
	const float **bag_grad;         /* one per global bag */
	struct embd_occ *occ;           /* num_occ, in batch order */
	struct embd_occ *bucketed;      /* num_occ, grouped by bucket */
	uint32_t shift;                 /* bucket = row >> shift */
	uint32_t num_buckets;
	uint32_t chunk_buckets;         /* buckets a worker takes at a time */
	uint64_t *hist;                 /* nw x num_buckets: counts, then scatter positions */
	uint64_t *bucket_start;         /* num_buckets + 1 */
	uint64_t *occ_range;            /* nw x 2: the occurrences each worker wrote */
	struct embd_first_err *errs;    /* one per worker */
	uint64_t *bad;                  /* nw x 2: rows left non-finite, the lowest of them */
	float *scratch;                 /* nw x 2 cols */
	uint64_t *phase_ns;             /* NULL, or nw x 2: each worker's time sorting, applying */
	atomic_uint_fast64_t next_bucket;
};

/* Worker w's bags: a contiguous slice of the global bag index. */
static void worker_bags(const struct bwd_job *job, uint32_t w, uint64_t *first, uint64_t *last)
{
	uint64_t total = job->bag_base[job->n];

	*first = total * w / job->nw;
	*last = total * (w + 1) / job->nw;
}

static void collect_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bwd_job *job = arg;
	const struct embd_shard_desc *d = &job->ctx.shard->desc;
	uint64_t *hist = job->hist + (uint64_t)w * job->num_buckets;
	uint64_t g, g_last;
	uint32_t i = 0;

	(void)nw;
	worker_bags(job, w, &g, &g_last);
	job->occ_range[2 * w] = job->occ_range[2 * w + 1] = 0;
	for (bool first = true; g < g_last; g++) {
		while (job->bag_base[i + 1] <= g)
			i++;
		const struct embd_bag_batch *bt = &job->batches[i];
		uint64_t b = g - job->bag_base[i];
		const int64_t *off = job->offsets + job->off_base[i];
		int64_t s = off[b], e = off[b + 1];
		int64_t divisor = bt->mean_lengths ? bt->mean_lengths[b] : e - s;
		float scale = embd_grad_scale(bt->pooling, divisor, bt->grad_divisor);
		struct embd_occ *out = job->occ + job->id_base[i];

		if (first)
			job->occ_range[2 * w] = job->id_base[i] + (uint64_t)s;
		first = false;
		job->bag_grad[g] = bt->pooled_grad + b * bt->pooled_stride + bt->pooled_col;
		for (int64_t k = s; k < e; k++) {
			int64_t id = bt->ids[k]; /* read once */
			uint64_t r = (uint64_t)id - (uint64_t)d->row_offset;
			if (r >= (uint64_t)d->rows) {
				struct embd_kernel_err ke;
				embd_kernel_fail(&ke, EMBD_ERANGE, bt->feature, (int64_t)b, id,
						 "feature %u sample %llu: id %lld outside the shard's rows [%lld, %lld)",
						 bt->feature, (unsigned long long)b, (long long)id,
						 (long long)d->row_offset, (long long)(d->row_offset + d->rows));
				embd_first_err_note(&job->errs[w], EMBD_ERANGE, i, &ke);
				return;
			}
			out[k].row = r;
			out[k].bag = (uint32_t)g;
			out[k].coef = embd_grad_coef(bt->weights ? bt->weights[k] : 1.0f, scale);
			hist[r >> job->shift]++;
		}
		job->occ_range[2 * w + 1] = job->id_base[i] + (uint64_t)e;
	}
}

static void scatter_worker(void *arg, uint32_t w, uint32_t nw)
{
	struct bwd_job *job = arg;
	uint64_t *pos = job->hist + (uint64_t)w * job->num_buckets;

	(void)nw;
	for (uint64_t j = job->occ_range[2 * w]; j < job->occ_range[2 * w + 1]; j++) {
		const struct embd_occ *o = &job->occ[j];
		job->bucketed[pos[o->row >> job->shift]++] = *o;
	}
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

/*
 * The next chunk of buckets for this worker, each bucket sorted in place: *sorted holds *n
 * occurrences sorted by row (buckets are ascending ranges of rows). False when none is left.
 */
static bool next_chunk(struct bwd_job *job, struct embd_occ **sorted, uint64_t *n)
{
	uint64_t b0 = atomic_fetch_add_explicit(&job->next_bucket, job->chunk_buckets,
						memory_order_relaxed);
	if (b0 >= job->num_buckets)
		return false;
	uint64_t b1 = job->num_buckets - b0 < job->chunk_buckets ? job->num_buckets
								  : b0 + job->chunk_buckets;
	for (uint64_t b = b0; b < b1; b++) {
		uint64_t s = job->bucket_start[b];
		/* occ is free by now: the same index range serves as the radix sort's other half */
		sort_bucket(job->bucketed + s, job->occ + s, job->bucket_start[b + 1] - s, job->shift);
	}
	*sorted = job->bucketed + job->bucket_start[b0];
	*n = job->bucket_start[b1] - job->bucket_start[b0];
	return true;
}

/*
 * Workers take chunks of buckets (a few hundred occurrences: one counter update each, and one
 * prefetch stream through the chunk's rows). Each sorts the chunk it takes next before applying
 * the one it holds, so that the rows of the next chunk's head are prefetched while this one's
 * tail is applied, not waited on one by one.
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

/* The job's arrays, and the bases and offsets snapshot; EMBD_ENOMEM when one is missing. */
static int bwd_alloc(struct bwd_job *job, const struct embd_shard *shard, uint32_t n,
		     uint64_t num_bags, uint64_t num_occ, bool timed, uint64_t **bases,
		     int64_t **offsets)
{
	*bases = malloc((3 * (n + 1) + 2 * job->nw + (uint64_t)job->nw * job->num_buckets +
			 job->num_buckets + 1) * sizeof(**bases));
	*offsets = malloc((num_bags + n) * sizeof(**offsets));
	job->bag_grad = malloc((num_bags ? num_bags : 1) * sizeof(*job->bag_grad));
	job->occ = malloc((num_occ ? num_occ : 1) * sizeof(*job->occ));
	job->bucketed = malloc((num_occ ? num_occ : 1) * sizeof(*job->bucketed));
	job->errs = calloc(job->nw, sizeof(*job->errs));
	job->bad = calloc(2 * (uint64_t)job->nw, sizeof(*job->bad));
	job->scratch = malloc((uint64_t)job->nw * 2 * shard->desc.cols * sizeof(float));
	job->phase_ns = timed ? calloc(2 * (uint64_t)job->nw, sizeof(*job->phase_ns)) : NULL;
	if (!*bases || !*offsets || !job->bag_grad || !job->occ || !job->bucketed || !job->errs ||
	    !job->bad || !job->scratch || (timed && !job->phase_ns))
		return EMBD_ENOMEM;
	return 0;
}

int embd_kernels_backward(const struct embd_exec *exec, struct embd_shard *shard,
			  const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err)
{
	struct embd_workers *workers = exec ? exec->workers : NULL;
	struct embd_backward_times *times = exec ? exec->backward_times : NULL;
	struct embd_backward_times ph = { .calls = 1 }; /* this call's; a few clock reads */
	uint64_t t = embd_now_ns();
	struct bwd_job job = { .batches = batches, .n = n, .nw = embd_workers_count(workers) };
	uint64_t *bases = NULL, num_occ = 0, num_bags = 0;
	int64_t *offsets = NULL;
	int rc;

	job.k = embd_cpu_kernels_get(exec ? exec->isa : EMBD_ISA_AUTO);
	if (!job.k)
		return embd_kernel_fail(err, EMBD_ENOTSUP, 0, -1, 0, "instruction set %s not supported here",
					embd_kernels_isa_name(exec->isa));
	if (!shard)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "no shard");
	for (uint32_t i = 0; i < n; i++) {
		if (batches[i].shard && batches[i].shard != shard)
			return embd_kernel_fail(err, EMBD_EINVAL, batches[i].feature, -1, 0,
						"feature %u: batch names another shard", batches[i].feature);
		rc = embd_bag_batch_check(&batches[i], shard, true, err);
		if (rc)
			return rc;
		num_occ += batches[i].num_ids;
		num_bags += batches[i].batch_size;
	}
	if (num_bags > UINT32_MAX)
		return embd_kernel_fail(err, EMBD_EINVAL, 0, -1, 0, "%llu bags in one call, at most 2^32 - 1",
					(unsigned long long)num_bags);

	uint32_t row_bits = bits_for((uint64_t)shard->desc.rows - 1);
	uint32_t want = bits_for(num_occ >> OCC_PER_BUCKET_LOG2);
	uint32_t top = want < row_bits ? want : row_bits;
	top = top < TOP_BITS_MAX ? top : TOP_BITS_MAX;
	job.shift = row_bits - top;
	job.num_buckets = 1u << top;
	uint64_t chunk = num_occ ? ((uint64_t)job.num_buckets * OCC_PER_CHUNK) / num_occ : 1;
	uint64_t chunk_max = job.num_buckets / ((uint64_t)CHUNKS_PER_WORKER_MIN * job.nw);
	chunk = chunk < chunk_max ? chunk : chunk_max;
	job.chunk_buckets = chunk ? (uint32_t)chunk : 1;

	rc = bwd_alloc(&job, shard, n, num_bags, num_occ, times != NULL, &bases, &offsets);
	if (rc) {
		embd_kernel_fail(err, rc, 0, -1, 0, "out of memory for %llu occurrences",
				 (unsigned long long)num_occ);
		goto out;
	}
	uint64_t *off_base = bases, *bag_base = off_base + n + 1, *id_base = bag_base + n + 1;
	job.occ_range = id_base + n + 1;
	job.hist = job.occ_range + 2 * job.nw;
	job.bucket_start = job.hist + (uint64_t)job.nw * job.num_buckets;
	memset(job.hist, 0, (uint64_t)job.nw * job.num_buckets * sizeof(*job.hist));
	off_base[0] = bag_base[0] = id_base[0] = 0;
	for (uint32_t i = 0; i < n; i++) {
		off_base[i + 1] = off_base[i] + batches[i].batch_size + 1;
		bag_base[i + 1] = bag_base[i] + batches[i].batch_size;
		id_base[i + 1] = id_base[i] + batches[i].num_ids;
		rc = snapshot_offsets(&batches[i], offsets + off_base[i], err);
		if (rc)
			goto out;
	}
	job.ctx.shard = shard;
	job.offsets = offsets;
	job.off_base = off_base;
	job.bag_base = bag_base;
	job.id_base = id_base;
	t = phase_done(t, &ph.setup_ns);

	embd_workers_run(workers, collect_worker, &job);
	t = phase_done(t, &ph.collect_ns);
	struct embd_first_err first = { 0 };
	for (uint32_t w = 0; w < job.nw; w++)
		embd_first_err_note(&first, job.errs[w].rc, job.errs[w].batch, &job.errs[w].e);
	rc = first.rc;
	if (rc) {
		if (err)
			*err = first.e;
		goto out;
	}

	/* counts -> scatter positions: bucket-major, worker-minor, so the scatter is stable */
	uint64_t pos = 0;
	for (uint32_t dgt = 0; dgt < job.num_buckets; dgt++) {
		job.bucket_start[dgt] = pos;
		for (uint32_t w = 0; w < job.nw; w++) {
			uint64_t c = job.hist[(uint64_t)w * job.num_buckets + dgt];
			job.hist[(uint64_t)w * job.num_buckets + dgt] = pos;
			pos += c;
		}
	}
	job.bucket_start[job.num_buckets] = pos;
	embd_workers_run(workers, scatter_worker, &job);
	t = phase_done(t, &ph.scatter_ns);

	job.ctx.params = embd_optim_params_make(&shard->desc.optimizer, shard->step + 1);
	job.ctx.bag_grad = job.bag_grad;
	atomic_init(&job.next_bucket, 0);
	embd_workers_run(workers, apply_worker, &job);
	uint64_t bad_rows = 0, bad_row = UINT64_MAX;
	for (uint32_t w = 0; w < job.nw; w++) {
		bad_rows += job.bad[2 * w];
		bad_row = job.bad[2 * w + 1] < bad_row ? job.bad[2 * w + 1] : bad_row;
	}
	if (bad_rows) {
		shard->nonfinite_rows += bad_rows;
		shard->nonfinite_row = shard->desc.row_offset + (int64_t)bad_row;
	}
	if (times) {
		note_apply_phase(&ph, job.phase_ns, job.nw, embd_now_ns() - t);
		times->calls += ph.calls;
		times->setup_ns += ph.setup_ns;
		times->collect_ns += ph.collect_ns;
		times->scatter_ns += ph.scatter_ns;
		times->sort_ns += ph.sort_ns;
		times->apply_ns += ph.apply_ns;
	}
	shard->step++;
	rc = 0;
out:
	free(job.bad);
	free(job.phase_ns);
	free(job.scratch);
	free(job.errs);
	free(job.bucketed);
	free(job.occ);
	free(job.bag_grad);
	free(offsets);
	free(bases);
	return rc;
}
