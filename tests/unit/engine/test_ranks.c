/*
 * tests/unit/engine/test_ranks.c - the ranks over their device backends (engine/ranks.h): the
 * CPU backend's shards are their own host views and its kernels the CPU's; the host-view
 * bookkeeping the GPU ranks rely on, run by the tests' CPU device with rows apart from their
 * host views (device_copy); and, on a machine without a GPU (CI), the refusal of CUDA ranks
 * naming why. Device outputs: CPU ranks refuse them, or with the tests' knob export a sealed
 * memfd that the copies reach.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/backend.h"
#include "engine/ranks.h"
#include "kernels/embedding.h"

static const struct embd_shard_desc desc = {
	.table_id = 3, .num_embeddings = 64, .embedding_dim = 8, .dtype = EMBD_DTYPE_FP32,
	.row_offset = 16, .rows = 32, .col_offset = 0, .cols = 8,
	.optimizer = { .type = EMBD_OPT_ADAGRAD, .lr = 0.1f, .eps = 1e-8f },
};

struct run {
	struct embd_ranks *ranks;
	struct embd_shard *shard;
	struct embd_bag_batch *bb;
	int rc;
	struct embd_kernel_err kerr;
	bool backward;
};

static void run_kernels(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct run *r = arg;

	if (rank != 0)
		return;
	r->rc = r->backward ? embd_ranks_backward(r->ranks, rank, exec, r->shard, r->bb, 1,
						  &r->kerr)
			    : embd_ranks_forward(r->ranks, rank, exec, r->bb, 1, &r->kerr);
}

static void init_rank0(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct run *r = arg;

	if (rank == 0)
		embd_shard_init_weights(embd_ranks_shard_host(r->ranks, r->shard), 5, exec);
}

/* Two bags over the shard (ids 16, 40 | 47) with a gradient: bb on the rank's shard, rb the
 * same on a reference shard, pooling into expect. */
struct bags {
	int64_t offsets[3], ids[3];
	float pooled[2][8], expect[2][8], grad[2][8];
	struct embd_bag_batch bb, rb;
};

static void bags_init(struct bags *b, struct embd_shard *shard, struct embd_shard *ref)
{
	*b = (struct bags){ .offsets = { 0, 2, 3 }, .ids = { 16, 40, 47 } };
	for (int i = 0; i < 16; i++)
		b->grad[i / 8][i % 8] = 0.25f * (float)(i - 7);
	b->bb = (struct embd_bag_batch){
		.shard = shard, .batch_size = 2, .offsets = b->offsets, .ids = b->ids, .num_ids = 3,
		.pooling = EMBD_POOLING_SUM, .pooled = &b->pooled[0][0],
		.pooled_grad = &b->grad[0][0], .pooled_stride = 8,
	};
	b->rb = b->bb;
	b->rb.shard = ref;
	b->rb.pooled = &b->expect[0][0];
}

Test(ranks, cpu_shard_is_its_host_view_and_runs_the_cpu_kernels)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard, *ref;

	cr_assert_eq(embd_ranks_create_on(EMBD_DEVICE_CPU, 2, 1, &ranks, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_ranks_device(ranks), EMBD_DEVICE_CPU);
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_FUSED, 0.2, &shard, err,
					    sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ranks_shard_host(ranks, shard), shard,
		     "a CPU shard is its own host view");
	uint64_t wb, m1, m2;
	cr_assert_eq(embd_shard_sizes(&desc, &wb, &m1, &m2, err, sizeof(err)), 0);
	cr_assert_eq(embd_ranks_memory_bytes(ranks, 0), wb + m1 + m2, "expected %llu, got %llu",
		     (unsigned long long)(wb + m1 + m2),
		     (unsigned long long)embd_ranks_memory_bytes(ranks, 0));
	cr_assert_eq(embd_ranks_memory_bytes(ranks, 1), 0);

	struct run r = { .ranks = ranks, .shard = shard };
	embd_ranks_run(ranks, init_rank0, &r);
	embd_ranks_shard_changed(ranks, shard);         /* nothing to hand over on the CPU */
	cr_assert_eq(embd_ranks_shard_push(ranks, shard, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_shard_create(&desc, &ref, err, sizeof(err)), 0, "%s", err);
	embd_shard_init_weights(ref, 5, NULL);

	static struct bags b;
	bags_init(&b, shard, ref);
	r.bb = &b.bb;
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, 0, "%s", r.kerr.msg);
	cr_assert_eq(embd_kernels_forward(NULL, &b.rb, 1, NULL), 0);
	cr_assert_eq(memcmp(b.pooled, b.expect, sizeof(b.pooled)), 0,
		     "forward differs from the kernel's");

	r.backward = true;
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, 0, "%s", r.kerr.msg);
	cr_assert_eq(embd_kernels_backward(NULL, ref, &b.rb, 1, NULL), 0);
	cr_assert_eq(embd_ranks_shard_pull(ranks, shard, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(shard->step, 1);
	cr_assert_eq(memcmp(shard->weights, ref->weights, wb), 0, "backward differs");
	cr_assert_eq(memcmp(shard->momentum1, ref->momentum1, m1), 0, "adagrad state differs");

	/* an id outside the shard is refused through the rank as by the kernel */
	b.ids[1] = 99;
	r.backward = false;
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, EMBD_ERANGE, "expected EMBD_ERANGE, got %d", r.rc);
	cr_assert_eq(r.kerr.id, 99);

	char page[4096];
	cr_assert_eq(embd_ranks_host_register(ranks, page, sizeof(page), err, sizeof(err)), 0,
		     "registering host memory is a no-op on the CPU: %s", err);
	embd_ranks_host_unregister(ranks, page);
	embd_ranks_free_shard(ranks, shard);
	cr_assert_eq(embd_ranks_memory_bytes(ranks, 0), 0);
	embd_shard_destroy(ref);
	embd_ranks_destroy(ranks);
}

/* Whether the process may read bytes at p: a pipe's write reads them in the kernel, which
 * answers EFAULT for memory mapped PROT_NONE instead of raising a signal. */
static bool readable(const void *p, size_t bytes)
{
	int fds[2];

	cr_assert_eq(pipe(fds), 0);
	ssize_t n = write(fds[1], p, bytes);
	int e = errno;
	close(fds[0]);
	close(fds[1]);
	cr_assert(n == (ssize_t)bytes || (n < 0 && e == EFAULT), "write: %zd, errno %d", n, e);
	return n == (ssize_t)bytes;
}

/*
 * The CPU device the tests run GPU ranks' bookkeeping on (EMBD_TEST_CPU_KERNEL=device_copy):
 * a fused shard's rows apart from its host view, unreadable outside the rank's kernel calls;
 * push hands the host view over, the kernels change only the device rows (and the device's
 * step), pull brings them back; a write of the host view reaches the next kernel call.
 */
Test(ranks, device_copy_keeps_the_rows_apart_until_pulled_and_pushed)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard, *ref, *init;

	setenv("EMBD_TEST_CPU_KERNEL", "device_copy", 1);
	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	unsetenv("EMBD_TEST_CPU_KERNEL");
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_FUSED, 0.2, &shard, err,
					    sizeof(err)), 0, "%s", err);
	struct embd_shard *host = embd_ranks_shard_host(ranks, shard);
	cr_assert(host && host != shard && host->weights != shard->weights &&
		  host->momentum1 != shard->momentum1, "the rows must be apart from the host view");
	uint64_t wb, m1, m2;
	cr_assert_eq(embd_shard_sizes(&desc, &wb, &m1, &m2, err, sizeof(err)), 0);
	cr_assert_eq(embd_ranks_memory_bytes(ranks, 0), wb + m1 + m2,
		     "the device rows count, their host copy does not: expected %llu, got %llu",
		     (unsigned long long)(wb + m1 + m2),
		     (unsigned long long)embd_ranks_memory_bytes(ranks, 0));
	cr_assert(!readable(shard->weights, 4) && !readable(shard->momentum1, 4),
		  "device rows must not be readable outside kernel calls and copies");

	struct run r = { .ranks = ranks, .shard = shard };
	embd_ranks_run(ranks, init_rank0, &r);
	embd_ranks_shard_changed(ranks, shard);
	cr_assert_eq(embd_ranks_shard_push(ranks, shard, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_shard_create(&desc, &ref, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_shard_create(&desc, &init, err, sizeof(err)), 0, "%s", err);
	embd_shard_init_weights(ref, 5, NULL);
	embd_shard_init_weights(init, 5, NULL);

	static struct bags b;
	bags_init(&b, shard, ref);
	r.bb = &b.bb;
	r.backward = true;
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, 0, "%s", r.kerr.msg);
	cr_assert_eq(embd_kernels_backward(NULL, ref, &b.rb, 1, NULL), 0);
	cr_assert(!readable(shard->weights, 4), "the rows must be unreadable again after a call");
	cr_assert_eq(host->step, 0, "the host view is not pulled yet");
	cr_assert_eq(memcmp(host->weights, init->weights, wb), 0, "the host view is not pulled yet");
	cr_assert_eq(embd_ranks_shard_step(ranks, shard), 1, "the device applied one step");
	cr_assert_eq(embd_ranks_shard_pull(ranks, shard, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(host->step, 1);
	cr_assert_eq(memcmp(host->weights, ref->weights, wb), 0, "pulled rows differ");
	cr_assert_eq(memcmp(host->momentum1, ref->momentum1, m1), 0, "pulled adagrad state differs");

	/* a write of the host view (a restore, a live write) is what the next call reads */
	((float *)host->weights)[3] = 42.0f;
	((float *)ref->weights)[3] = 42.0f;
	host->step = 9;
	embd_ranks_shard_changed(ranks, shard);
	cr_assert_eq(embd_ranks_shard_step(ranks, shard), 9, "the written host view is newer");
	r.backward = false;
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, 0, "%s", r.kerr.msg);
	cr_assert_eq(embd_kernels_forward(NULL, &b.rb, 1, NULL), 0);
	cr_assert_eq(memcmp(b.pooled, b.expect, sizeof(b.pooled)), 0,
		     "forward after the write differs");
	cr_assert_eq(embd_ranks_shard_step(ranks, shard), 9);

	embd_ranks_free_shard(ranks, shard);
	cr_assert_eq(embd_ranks_memory_bytes(ranks, 0), 0);
	embd_shard_destroy(ref);
	embd_shard_destroy(init);
	embd_ranks_destroy(ranks);
}

/*
 * The device_copy double checks every host array of a kernel call the way a GPU rank copies it
 * (engine/backend_cuda.c): registered with the ranks (embd_ranks_host_register, the CPU's
 * record of it), or counted as a copy the driver would have staged. Unregistered, the bags'
 * offsets, ids and gradient are counted; registered, nothing is, and unregistered again they
 * are counted again.
 */
Test(ranks, device_copy_counts_kernel_arrays_not_registered_for_dma)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard, *ref;
	static struct bags b;

	setenv("EMBD_TEST_CPU_KERNEL", "device_copy", 1);
	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	unsetenv("EMBD_TEST_CPU_KERNEL");
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_FUSED, 0.2, &shard, err,
					    sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_shard_create(&desc, &ref, err, sizeof(err)), 0, "%s", err);
	bags_init(&b, shard, ref);
	struct run r = { .ranks = ranks, .shard = shard, .bb = &b.bb, .backward = true };
	/* offsets (3 x 8), ids (3 x 8), the gradient (2 x 8 floats) */
	const uint64_t arrays = 24 + 24 + 64;

	uint64_t before = embd_backend_unregistered_bytes();
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, 0, "%s", r.kerr.msg);
	cr_assert_eq(embd_backend_unregistered_bytes() - before, arrays,
		     "unregistered arrays: expected %llu bytes counted, got %llu",
		     (unsigned long long)arrays,
		     (unsigned long long)(embd_backend_unregistered_bytes() - before));

	cr_assert_eq(embd_ranks_host_register(ranks, &b, sizeof(b), err, sizeof(err)), 0, "%s",
		     err);
	before = embd_backend_unregistered_bytes();
	embd_ranks_run(ranks, run_kernels, &r);
	r.backward = false;
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_eq(r.rc, 0, "%s", r.kerr.msg);
	cr_assert_eq(embd_backend_unregistered_bytes(), before, "registered arrays were counted");

	embd_ranks_host_unregister(ranks, &b);
	embd_ranks_run(ranks, run_kernels, &r);
	cr_assert_gt(embd_backend_unregistered_bytes(), before, "unregistered again: not counted");

	embd_ranks_free_shard(ranks, shard);
	embd_shard_destroy(ref);
	embd_ranks_destroy(ranks);
}

/*
 * Partial sums between ranks (engine/ranks.h, embd_ranks_partial_*) on the device_copy double:
 * each rank pools the same bags on its own shard into its partial buffer; rank 1 copies rank
 * 0's into its own, adds, and copies the sum out strided: twice the reference's rows. The copy
 * is counted device to device, and the buffers are unreadable outside the ranks' calls. The
 * double refuses a copy between ranks that embd_ranks_create did not open to each other
 * (backend peer_open, as the CUDA backend enables peer access for every pair at the start).
 */
struct partials_run {
	struct embd_ranks *ranks;
	struct embd_shard *shard[2];
	struct embd_bag_batch bb[2];
	float *buf[2];
	float out[2][10];
	int rc[2];
	struct embd_kernel_err kerr[2];
};

static void partial_init(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct partials_run *p = arg;

	embd_shard_init_weights(embd_ranks_shard_host(p->ranks, p->shard[rank]), 5, exec);
}

static void partial_lookup(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct partials_run *p = arg;
	void *buf;

	p->rc[rank] = embd_ranks_partial_buffer(p->ranks, rank, 64 * sizeof(float), &buf,
						p->kerr[rank].msg, sizeof(p->kerr[rank].msg));
	p->buf[rank] = buf;
	p->bb[rank].pooled = buf;
	if (!p->rc[rank])
		p->rc[rank] = embd_ranks_forward(p->ranks, rank, exec, &p->bb[rank], 1,
						 &p->kerr[rank]);
}

static void partial_sum(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct partials_run *p = arg;
	char *err = p->kerr[1].msg;
	const size_t len = sizeof(p->kerr[1].msg);

	(void)exec;
	if (rank != 1)
		return;
	p->rc[1] = embd_ranks_partial_copy(p->ranks, 1, p->buf[1] + 32, 0, p->buf[0],
					   16 * sizeof(float), err, len);
	if (!p->rc[1])
		p->rc[1] = embd_ranks_partial_add(p->ranks, 1, p->buf[1], p->buf[1] + 32, 16, err,
						  len);
	if (!p->rc[1])
		p->rc[1] = embd_ranks_partial_out(p->ranks, 1, &p->out[0][1], 10, p->buf[1], 2, 8,
						  err, len);
}

Test(ranks, partial_sums_move_rank_to_rank_on_the_device_double)
{
	char err[256] = "";
	static struct partials_run p;
	static struct bags b;
	struct embd_shard *ref;
	uint64_t device, host;

	setenv("EMBD_TEST_CPU_KERNEL", "device_copy", 1);
	cr_assert_eq(embd_ranks_create(2, 1, &p.ranks, err, sizeof(err)), 0, "%s", err);
	unsetenv("EMBD_TEST_CPU_KERNEL");
	for (uint32_t r = 0; r < 2; r++)
		cr_assert_eq(embd_ranks_alloc_shard(p.ranks, r, &desc, EMBD_KERNEL_FUSED, 0.2,
						    &p.shard[r], err, sizeof(err)), 0, "%s", err);
	embd_ranks_run(p.ranks, partial_init, &p);
	for (uint32_t r = 0; r < 2; r++) {
		embd_ranks_shard_changed(p.ranks, p.shard[r]);
		cr_assert_eq(embd_ranks_shard_push(p.ranks, p.shard[r], err, sizeof(err)), 0, "%s",
			     err);
	}
	cr_assert_eq(embd_shard_create(&desc, &ref, err, sizeof(err)), 0, "%s", err);
	embd_shard_init_weights(ref, 5, NULL);
	bags_init(&b, p.shard[0], ref);
	cr_assert_eq(embd_kernels_forward(NULL, &b.rb, 1, NULL), 0);
	p.bb[0] = p.bb[1] = b.bb;
	p.bb[1].shard = p.shard[1];

	embd_ranks_run(p.ranks, partial_lookup, &p);
	cr_assert(!p.rc[0] && !p.rc[1], "%s %s", p.kerr[0].msg, p.kerr[1].msg);
	cr_assert(p.buf[0] && p.buf[1] && p.buf[0] != p.buf[1]);
	cr_assert(!readable(p.buf[0], 4) && !readable(p.buf[1], 4),
		  "partial sums must not be readable outside the ranks' calls");
	embd_ranks_partial_counts(p.ranks, &device, &host);
	cr_assert_eq(device + host, 0);
	embd_ranks_run(p.ranks, partial_sum, &p);
	cr_assert_eq(p.rc[1], 0, "%s", p.kerr[1].msg);
	embd_ranks_partial_counts(p.ranks, &device, &host);
	cr_assert_eq(device, 16 * sizeof(float), "device to device: %llu bytes",
		     (unsigned long long)device);
	cr_assert_eq(host, 0);
	cr_assert(!readable(p.buf[1], 4), "partial sums must be unreadable again after the calls");
	for (int i = 0; i < 2; i++) {
		cr_assert(p.out[i][0] == 0.0f && p.out[i][9] == 0.0f, "row %d: written outside", i);
		for (int c = 0; c < 8; c++)
			cr_assert_eq(p.out[i][1 + c], 2.0f * b.expect[i][c], "row %d col %d: %g, "
				     "expected %g", i, c, p.out[i][1 + c], 2.0f * b.expect[i][c]);
	}
	for (uint32_t r = 0; r < 2; r++)
		embd_ranks_free_shard(p.ranks, p.shard[r]);
	embd_shard_destroy(ref);
	embd_ranks_destroy(p.ranks);
}

Test(ranks, dense_on_cpu_is_a_host_shard)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard;

	/* dense and fused alike: host rows, the optimizer fused into the backward */
	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &desc, EMBD_KERNEL_DENSE, 0.2, &shard, err,
					    sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ranks_shard_host(ranks, shard), shard);
	embd_ranks_destroy(ranks);      /* frees the shard still allocated */
}

/*
 * Whether the mapping that holds p is advised to transparent huge pages: its VmFlags in
 * /proc/self/smaps carry "hg" (set by madvise(MADV_HUGEPAGE) whatever THP's mode, so the test
 * holds where THP is "never" too). False where no such mapping is found.
 */
static bool advised_huge_pages(const void *p)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char line[512];
	bool inside = false, advised = false;

	cr_assert_not_null(f, "/proc/self/smaps: %s", strerror(errno));
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {     /* a mapping's first line */
			inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
			continue;
		}
		if (inside && !strncmp(line, "VmFlags:", 8)) {
			advised = strstr(line, " hg") != NULL;
			break;
		}
	}
	fclose(f);
	return advised;
}

/* Whether this kernel takes madvise(MADV_HUGEPAGE): EINVAL where it has no transparent huge
 * pages (nor the "hg" flag). */
static bool kernel_has_thp(void)
{
	const size_t len = 2u << 20;
	void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	cr_assert_neq(m, MAP_FAILED, "mmap: %s", strerror(errno));
	bool ok = madvise(m, len, MADV_HUGEPAGE) == 0;
	munmap(m, len);
	return ok;
}

/*
 * Rows are read at random: host memory of 2 MiB or more for a shard is advised to huge pages
 * on the NUMA path and where NUMA does not work (numa_available() < 0, as in a container that
 * refuses its system calls), where the service would otherwise run every table on 4 KiB pages
 * in THP's "madvise" mode; without NUMA it also lies on 2 MiB boundaries, which a huge page
 * needs.
 */
Test(ranks, host_rows_are_advised_to_huge_pages)
{
	const uint64_t bytes = (8u << 20) + 4096;
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_shard *shard;

	/* without transparent huge pages madvise is refused and no mapping is flagged */
	const bool thp = kernel_has_thp();
	void *p = embd_backend_host_alloc(false, -1, bytes);
	cr_assert_not_null(p);
	cr_assert_eq((uintptr_t)p % (2u << 20), 0, "without NUMA: %p not on a 2 MiB boundary", p);
	cr_assert(!thp || advised_huge_pages(p), "without NUMA: %p not advised to huge pages", p);
	embd_backend_host_free(false, p, bytes);
	p = embd_backend_host_alloc(false, -1, 4096);
	cr_assert_not_null(p);
	cr_assert_eq((uintptr_t)p % 64, 0, "a small block is 64-byte aligned");
	embd_backend_host_free(false, p, 4096);

	/* a shard of 4096 x 1024 floats (16 MiB) as the ranks allocate it, NUMA or not */
	struct embd_shard_desc big = desc;
	big.num_embeddings = 8192;
	big.embedding_dim = 1024;
	big.rows = 4096;
	big.cols = 1024;
	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ranks_alloc_shard(ranks, 0, &big, EMBD_KERNEL_FUSED, 0.2, &shard, err,
					    sizeof(err)), 0, "%s", err);
	cr_assert(!thp || advised_huge_pages(embd_ranks_shard_host(ranks, shard)->weights),
		  "the shard's weights are not advised to huge pages");
	embd_ranks_destroy(ranks);
}

/* This test runs where no GPU is (CI): the refusal must say so and carry the driver's reason. */
Test(ranks, cuda_without_a_gpu_is_refused_with_the_reason)
{
	char err[256] = "";
	struct embd_ranks *ranks = NULL;
	uint32_t count = 7;

	int rc = embd_ranks_device_count(EMBD_DEVICE_CUDA, &count, err, sizeof(err));
	if (rc == 0)
		cr_skip_test("this machine has %u CUDA devices", count);
	cr_assert_eq(rc, EMBD_ENOTSUP, "expected EMBD_ENOTSUP, got %d", rc);
	cr_assert_eq(count, 0);
	cr_assert(strstr(err, "no CUDA device: ") == err, "got '%s'", err);
#ifdef EMBD_HAVE_CUDA
	/* the runtime's own words follow the call that gave them */
	cr_assert(strstr(err, "cudaGetDeviceCount: ") && strlen(err) > 40, "got '%s'", err);
#else
	cr_assert(strstr(err, "built without CUDA"), "got '%s'", err);
#endif
	cr_assert(!strchr(err, '\n'), "one line: '%s'", err);
	char err2[256] = "";
	cr_assert_eq(embd_ranks_create_on(EMBD_DEVICE_CUDA, 1, 1, &ranks, err2, sizeof(err2)),
		     EMBD_ENOTSUP);
	cr_assert_null(ranks);
	cr_assert_str_eq(err2, err);
}

/* Open fds of this process. */
static int count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	int n = 0;

	cr_assert_not_null(d);
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

static const uint8_t some_gpu[16] = { 0x8e, 0x6f };

Test(ranks, cpu_ranks_refuse_device_outputs_naming_why)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_export x;

	unsetenv("EMBD_TEST_CPU_DEVICE_OUTPUTS");
	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	const int fds = count_fds();
	cr_expect_eq(embd_ranks_export_alloc(ranks, some_gpu, 4096, &x, err, sizeof(err)),
		     EMBD_ENOTSUP);
	cr_expect(strstr(err, "the ranks compute on the CPU (compute_device cpu)"), "got \"%s\"",
		  err);
	cr_expect_eq(x.fd, -1);
	cr_expect_null(x.state);
	embd_ranks_export_free(ranks, &x);      /* a refused one: nothing to free */
	cr_expect_eq(count_fds(), fds, "a refusal leaves no fd behind");
	embd_ranks_destroy(ranks);
}

/* The tests' double: host memory in a sealed memfd, whole pages, the copies in both directions
 * reaching what a second mapping of the fd (the trainer's) sees; freed without an fd left. */
Test(ranks, cpu_ranks_export_host_memory_under_the_test_knob)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	struct embd_export x;
	float rows[6] = { 1, 2, 3, 4, 5, 6 }, back[6] = { 0 };

	setenv("EMBD_TEST_CPU_DEVICE_OUTPUTS", "1", 1);
	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	const int fds = count_fds();
	cr_assert_eq(embd_ranks_export_alloc(ranks, some_gpu, 5000, &x, err, sizeof(err)), 0, "%s",
		     err);
	cr_expect_eq(x.memory, EMBD_EXPORT_HOST);
	cr_expect_eq(x.bytes, 8192u, "expected whole pages, got %llu bytes",
		     (unsigned long long)x.bytes);
	int seals = fcntl(x.fd, F_GET_SEALS);
	cr_expect(seals >= 0 && (seals & F_SEAL_SHRINK) && (seals & F_SEAL_GROW),
		  "expected a memfd sealed against resizing, got seals 0x%x", seals);
	float *trainer = mmap(NULL, x.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, x.fd, 0);
	cr_assert(trainer != MAP_FAILED);
	cr_assert_eq(embd_ranks_export_copy(ranks, &x, 4096, rows, sizeof(rows), true, err,
					    sizeof(err)), 0, "%s", err);
	cr_expect_eq(trainer[1024 + 5], 6.0f, "the trainer sees what was copied in");
	trainer[2048 - 1] = -7.5f;
	cr_assert_eq(embd_ranks_export_copy(ranks, &x, 8192 - 4, back, 4, false, err, sizeof(err)),
		     0, "%s", err);
	cr_expect_eq(back[0], -7.5f, "a copy out reads what the trainer wrote");
	cr_expect_eq(embd_ranks_export_copy(ranks, &x, 8192 - 4, back, 8, false, err, sizeof(err)),
		     EMBD_ERANGE);
	cr_expect(strstr(err, "[8188, +8) is outside the 8192 exported bytes"), "got \"%s\"", err);
	munmap(trainer, x.bytes);
	embd_ranks_export_free(ranks, &x);
	cr_expect_eq(x.fd, -1);
	embd_ranks_export_free(ranks, &x);      /* twice: a no-op */
	cr_expect_eq(count_fds(), fds, "freed, the export leaves no fd behind");
	unsetenv("EMBD_TEST_CPU_DEVICE_OUTPUTS");
	embd_ranks_destroy(ranks);
}

/*
 * Registration is a matter of speed: embd_ranks_dma_alloc hands out whole pages registered
 * with the ranks, and memory a device cannot register (here: already registered, which the
 * CPU's record refuses as cudaHostRegister does) stays usable, unregistered, with no error.
 */
Test(ranks, dma_memory_is_whole_registered_pages_or_plain_when_registration_fails)
{
	char err[256] = "";
	struct embd_ranks *ranks;
	const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);

	cr_assert_eq(embd_ranks_create(1, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	bool registered = false;
	uint8_t *p = embd_ranks_dma_alloc(ranks, 100, &registered, "test array");
	cr_assert_not_null(p);
	cr_assert(registered, "a fresh page was not registered");
	cr_assert_eq((uintptr_t)p % page, 0, "not page-aligned");
	cr_assert(embd_backend_host_registered(p, page), "the whole page is not registered");
	memset(p, 7, page);     /* all of it is the caller's */

	cr_assert_neq(embd_ranks_host_register(ranks, p + 64, 64, err, sizeof(err)), 0,
		      "memory registered twice was accepted");
	cr_assert(!embd_ranks_dma_register(ranks, p + 64, 64, "overlapping test array"),
		  "an overlapping registration reported success");
	cr_assert(!embd_ranks_dma_register(ranks, p, page, "again"), "second failure");

	embd_ranks_dma_free(ranks, p, registered);
	cr_assert(!embd_backend_host_registered(p, 1), "freed memory still registered");
	embd_ranks_dma_free(ranks, NULL, false);
	embd_ranks_destroy(ranks);
}
