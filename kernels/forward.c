/*
 * Pooled forward: checks each batch's description, then lets the workers grab chunks of bags
 * (any batch, any shard) from one atomic counter until none are left. A bag is pooled whole
 * by one worker, so the result does not depend on the number of workers.
 *
 * An error in one chunk stops that chunk only; the reported error is the first one by
 * (batch, sample) among those found, so it does not depend on scheduling either.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "kernels/cpu_kernels.h"

/*
 * A chunk is at least MIN_BAGS_PER_CHUNK bags and about CHUNK_IDS ids (from the batch's mean
 * bag length). Counting ids, not bags, is what matters at small pooling factors: a chunk's
 * first rows cannot be prefetched far ahead and each chunk costs an atomic on a shared line,
 * so 32 one-id bags per chunk spent a large part of a P = 1 batch on chunk edges.
 */
#define MIN_BAGS_PER_CHUNK 32
#define CHUNK_IDS 1024

static uint64_t bags_per_chunk(const struct embd_bag_batch *bt)
{
	uint64_t bags = bt->num_ids ? CHUNK_IDS * (uint64_t)bt->batch_size / bt->num_ids : bt->batch_size;
	return bags > MIN_BAGS_PER_CHUNK ? bags : MIN_BAGS_PER_CHUNK;
}

int embd_bag_batch_check(const struct embd_bag_batch *bt, const struct embd_shard *shard,
			 bool backward, struct embd_kernel_err *err)
{
	const char *missing = NULL;

	if (!shard || !shard->weights)
		missing = "shard";
	else if (!bt->offsets)
		missing = "offsets";
	else if (bt->num_ids && !bt->ids)
		missing = "ids";
	else if (bt->batch_size && !backward && !bt->pooled)
		missing = "pooled";
	else if (bt->batch_size && backward && !bt->pooled_grad)
		missing = "pooled_grad";
	if (missing)
		return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, -1, 0,
					"feature %u: %s is missing", bt->feature, missing);
	if (bt->pooling != EMBD_POOLING_SUM && bt->pooling != EMBD_POOLING_MEAN)
		return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, -1, 0,
					"feature %u: unknown pooling %d", bt->feature, (int)bt->pooling);
	if (bt->batch_size > 1 && bt->pooled_stride < (uint64_t)bt->pooled_col + shard->desc.cols)
		return embd_kernel_fail(err, EMBD_EINVAL, bt->feature, -1, 0,
					"feature %u: pooled_stride %llu < pooled_col %u + %u columns",
					bt->feature, (unsigned long long)bt->pooled_stride,
					bt->pooled_col, shard->desc.cols);
	return 0;
}

struct forward_job {
	const struct embd_cpu_kernels *k;
	const struct embd_bag_batch *batches;
	uint32_t n;
	const uint64_t *first_chunk;    /* n + 1: chunk index where each batch starts */
	const uint64_t *chunk_bags;     /* n: bags per chunk of each batch */
	atomic_uint_fast64_t next;
	struct embd_first_err *errs;        /* one per worker */
};

static void forward_worker(void *arg, uint32_t worker, uint32_t num_workers)
{
	struct forward_job *job = arg;
	struct embd_first_err *we = &job->errs[worker];
	uint64_t total = job->first_chunk[job->n];
	uint32_t i = 0;

	(void)num_workers;
	for (;;) {
		uint64_t chunk = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
		if (chunk >= total)
			break;
		while (job->first_chunk[i + 1] <= chunk)
			i++; /* chunks are handed out in increasing order */
		const struct embd_bag_batch *bt = &job->batches[i];
		uint64_t per = job->chunk_bags[i];
		uint64_t first = (chunk - job->first_chunk[i]) * per;
		uint64_t last = first + per < bt->batch_size ? first + per : bt->batch_size;
		struct embd_kernel_err e;
		int rc = job->k->forward_bags(bt, (uint32_t)first, (uint32_t)last, &e);
		embd_first_err_note(we, rc, i, &e);
	}
}

int embd_kernels_forward(const struct embd_exec *exec, const struct embd_bag_batch *batches,
			 uint32_t n, struct embd_kernel_err *err)
{
	struct embd_workers *workers = exec ? exec->workers : NULL;
	struct forward_job job = { .batches = batches, .n = n };
	uint64_t *first_chunk = NULL, *chunk_bags;
	struct embd_first_err *errs = NULL, first = { 0 };
	uint32_t nw = embd_workers_count(workers);
	int rc;

	job.k = embd_cpu_kernels_get(exec ? exec->isa : EMBD_ISA_AUTO);
	if (!job.k)
		return embd_kernel_fail(err, EMBD_ENOTSUP, 0, -1, 0, "instruction set %s not supported here",
					embd_kernels_isa_name(exec->isa));
	for (uint32_t i = 0; i < n; i++) {
		rc = embd_bag_batch_check(&batches[i], batches[i].shard, false, err);
		if (rc)
			return rc;
	}
	rc = EMBD_ENOMEM;
	first_chunk = malloc((2 * (uint64_t)n + 1) * sizeof(*first_chunk));
	errs = calloc(nw, sizeof(*errs));
	if (!first_chunk || !errs) {
		embd_kernel_fail(err, rc, 0, -1, 0, "out of memory for %u batches", n);
		goto out;
	}
	chunk_bags = first_chunk + n + 1;
	first_chunk[0] = 0;
	for (uint32_t i = 0; i < n; i++) {
		chunk_bags[i] = bags_per_chunk(&batches[i]);
		first_chunk[i + 1] = first_chunk[i] +
				     (batches[i].batch_size + chunk_bags[i] - 1) / chunk_bags[i];
	}
	job.first_chunk = first_chunk;
	job.chunk_bags = chunk_bags;
	job.errs = errs;
	atomic_init(&job.next, 0);
	embd_workers_run(workers, forward_worker, &job);

	for (uint32_t w = 0; w < nw; w++)
		embd_first_err_note(&first, errs[w].rc, errs[w].batch, &errs[w].e);
	rc = first.rc;
	if (rc && err)
		*err = first.e;
out:
	free(errs);
	free(first_chunk);
	return rc;
}
