/*
 * The CPU backend (engine/backend.h): a rank is a group of pinned worker threads, a shard is
 * host memory on the rank's NUMA node and is its own host view, and the kernels are
 * kernels/'s CPU ones run on the rank's workers. Also the host memory every backend's host
 * views live in.
 */
#include "engine/backend.h"

#include <numa.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

void embd_backend_host_free(bool numa, void *p, uint64_t bytes)
{
	if (!p)
		return;
	if (numa)
		numa_free(p, bytes);
	else
		free(p);
}

void *embd_backend_host_alloc(bool numa, int node, uint64_t bytes)
{
	if (!bytes)
		return NULL;
	if (numa) {
		void *p = numa_alloc_onnode(bytes, node);  /* page aligned (mmap) */
		/* Random row reads miss the TLB on 4 KiB pages (kernels/shard.c measured 5-10x on
		 * backward): let transparent huge pages back the 2 MiB-aligned parts. */
		if (p && bytes >= (2u << 20))
			madvise(p, bytes, MADV_HUGEPAGE);
		return p;
	}
	uint64_t rounded = (bytes + 63) & ~(uint64_t)63;
	return aligned_alloc(64, rounded);
}

int embd_backend_host_shard(bool numa, int node, const struct embd_shard_desc *desc,
			    struct embd_backend_shard *out, char *err, size_t err_len)
{
	int rc = embd_shard_sizes(desc, &out->bytes[0], &out->bytes[1], &out->bytes[2], err,
				  err_len);

	if (rc)
		return rc;
	for (int i = 0; i < 3; i++) {
		out->mem[i] = embd_backend_host_alloc(numa, node, out->bytes[i]);
		if (out->bytes[i] && !out->mem[i]) {
			snprintf(err, err_len, "cannot allocate %llu bytes on NUMA node %d",
				 (unsigned long long)out->bytes[i], node);
			rc = EMBD_ENOMEM;
			goto out;
		}
	}
	rc = embd_shard_create_in(desc, out->mem[0], out->mem[1], out->mem[2], &out->host, err,
				  err_len);
out:
	if (rc)
		embd_backend_host_shard_free(numa, out);
	return rc;
}

void embd_backend_host_shard_free(bool numa, struct embd_backend_shard *s)
{
	embd_shard_destroy(s->host);
	s->host = NULL;
	for (int i = 0; i < 3; i++) {
		embd_backend_host_free(numa, s->mem[i], s->bytes[i]);
		s->mem[i] = NULL;
	}
}

static int cpu_count(uint32_t *count, char *err, size_t err_len)
{
	(void)err;
	(void)err_len;
	*count = numa_available() >= 0 ? (uint32_t)numa_max_node() + 1 : 1;
	return 0;
}

/* The ranks spread over the NUMA nodes in order (engine/ranks.c decides): no device to ask. */
static int cpu_numa_node(uint32_t rank)
{
	(void)rank;
	return -1;
}

static int cpu_rank_open(uint32_t rank, struct embd_backend_rank **out, char *err,
			 size_t err_len)
{
	(void)rank;
	(void)err;
	(void)err_len;
	*out = NULL;    /* a CPU rank has no state beyond its threads */
	return 0;
}

static void cpu_rank_close(struct embd_backend_rank *r)
{
	(void)r;
}

static int cpu_shard_alloc(struct embd_backend_rank *r, bool numa, int node,
			   const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			   struct embd_backend_shard *out, char *err, size_t err_len)
{
	(void)r;
	/* dense and fused alike: host rows with the optimizer fused into the backward */
	int rc = embd_backend_host_shard(numa, node, desc, out, err, err_len);

	if (!rc) {
		out->shard = out->host;
		out->kernel = kernel;
	}
	return rc;
}

static void cpu_shard_free(struct embd_backend_rank *r, bool numa, struct embd_backend_shard *s)
{
	(void)r;
	embd_backend_host_shard_free(numa, s);
	s->shard = NULL;
}

static int cpu_forward(struct embd_backend_rank *r, const struct embd_exec *exec,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err)
{
	(void)r;
	return embd_kernels_forward(exec, batches, n, err);
}

static int cpu_backward(struct embd_backend_rank *r, const struct embd_exec *exec,
			struct embd_shard *shard, const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err)
{
	(void)r;
	return embd_kernels_backward(exec, shard, batches, n, err);
}

const struct embd_backend embd_backend_cpu = {
	.name = "cpu",
	.count = cpu_count,
	.numa_node = cpu_numa_node,
	.rank_open = cpu_rank_open,
	.rank_close = cpu_rank_close,
	.shard_alloc = cpu_shard_alloc,
	.shard_free = cpu_shard_free,
	.forward = cpu_forward,
	.backward = cpu_backward,
};
