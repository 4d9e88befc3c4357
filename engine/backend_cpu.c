/*
 * The CPU backend (engine/backend.h): a rank is a group of pinned worker threads, a shard is
 * host memory on the rank's NUMA node and is its own host view, and the kernels are
 * kernels/'s CPU ones run on the rank's workers. Also the host memory every backend's host
 * views live in. fused_uvm_caching (which the planner assigns on GPUs only) runs here with its
 * slots in host memory too, so the CPU tests run the cache of engine/ranks_cache.c whole.
 * Device outputs are refused (no GPU memory), but for the tests' host-memory double.
 */
#include "engine/backend.h"

#include <errno.h>
#include <fcntl.h>
#include <numa.h>
#include <pthread.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* host_register's ranges, every CPU ranks of the process together (tests create several). */
struct host_range {
	const uint8_t *p;
	uint64_t bytes;
};

static struct {
	pthread_mutex_t mu;
	struct host_range *ranges;
	uint32_t num, cap;
} registry = { .mu = PTHREAD_MUTEX_INITIALIZER };

static int cpu_host_register(struct embd_backend_rank *r, void *p, size_t bytes, char *err,
			     size_t err_len)
{
	int rc = 0;

	(void)r;
	pthread_mutex_lock(&registry.mu);
	/* as cudaHostRegister: memory already registered is refused, so a caller that lets two
	 * registered arrays overlap fails here too */
	for (uint32_t i = 0; i < registry.num; i++) {
		const struct host_range *h = &registry.ranges[i];
		if ((const uint8_t *)p < h->p + h->bytes && h->p < (const uint8_t *)p + bytes) {
			pthread_mutex_unlock(&registry.mu);
			return snprintf(err, err_len, "%zu bytes at %p overlap %" PRIu64 " registered "
					"at %p", bytes, p, h->bytes, (const void *)h->p), EMBD_EINVAL;
		}
	}
	if (registry.num == registry.cap) {
		uint32_t cap = registry.cap ? 2 * registry.cap : 64;
		void *q = realloc(registry.ranges, cap * sizeof(*registry.ranges));
		if (q) {
			registry.ranges = q;
			registry.cap = cap;
		}
	}
	if (registry.num < registry.cap)
		registry.ranges[registry.num++] = (struct host_range){ p, bytes };
	else
		rc = EMBD_ENOMEM;
	pthread_mutex_unlock(&registry.mu);
	if (rc)
		snprintf(err, err_len, "out of memory registering host memory");
	return rc;
}

static void cpu_host_unregister(struct embd_backend_rank *r, void *p)
{
	(void)r;
	pthread_mutex_lock(&registry.mu);
	for (uint32_t i = 0; i < registry.num; i++)
		if (registry.ranges[i].p == p) {
			registry.ranges[i] = registry.ranges[--registry.num];
			break;
		}
	if (!registry.num) {
		free(registry.ranges);
		registry.ranges = NULL;
		registry.cap = 0;
	}
	pthread_mutex_unlock(&registry.mu);
}

bool embd_backend_host_registered(const void *p, uint64_t bytes)
{
	const uint8_t *b = p;
	bool found = false;

	pthread_mutex_lock(&registry.mu);
	for (uint32_t i = 0; i < registry.num && !found; i++)
		found = b >= registry.ranges[i].p &&
			b + bytes <= registry.ranges[i].p + registry.ranges[i].bytes;
	pthread_mutex_unlock(&registry.mu);
	return found;
}

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
		/* Random row reads miss the TLB on 4 KiB pages (the Zen 4 VM: adagrad D 128's
		 * backward 1.4x the time, docs/benchmarks.md): let transparent huge pages back
		 * the 2 MiB-aligned parts. */
		if (p && bytes >= (2u << 20))
			madvise(p, bytes, MADV_HUGEPAGE);
		return p;
	}
	return embd_rows_alloc(bytes, false);
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

/* A CPU rank's state beyond its threads: the buffer of its partial sums. Handed out as struct
 * embd_backend_rank. */
struct cpu_rank {
	float *partials;
	uint64_t partial_bytes;
};

static int cpu_rank_open(uint32_t rank, struct embd_backend_rank **out, char *err,
			 size_t err_len)
{
	struct cpu_rank *r = calloc(1, sizeof(*r));

	(void)rank;
	*out = (struct embd_backend_rank *)r;
	if (!r)
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	return 0;
}

static void cpu_rank_close(struct embd_backend_rank *r)
{
	struct cpu_rank *c = (struct cpu_rank *)r;

	if (!c)
		return;
	free(c->partials);
	free(c);
}

/* Grown to a power of two, so a step whose batches grow a little does not reallocate. */
static int cpu_partial_buffer(struct embd_backend_rank *r, uint64_t bytes, void **out,
			      char *err, size_t err_len)
{
	struct cpu_rank *c = (struct cpu_rank *)r;

	if (bytes > c->partial_bytes) {
		uint64_t want = 1ull << 16;
		while (want < bytes)
			want <<= 1;
		free(c->partials);
		c->partial_bytes = 0;
		if (!(c->partials = aligned_alloc(64, want)))
			return snprintf(err, err_len, "cannot allocate %llu bytes of partial sums",
					(unsigned long long)want), EMBD_ENOMEM;
		c->partial_bytes = want;
	}
	*out = c->partials;
	return 0;
}

/* Every rank's memory is the host's: a copy between two ranks is one memcpy, device to device
 * as far as the CPU has devices. */
static int cpu_copy_peer(struct embd_backend_rank *r, void *dst, struct embd_backend_rank *from,
			 const void *src, uint64_t bytes, bool *direct, char *err, size_t err_len)
{
	(void)r;
	(void)from;
	(void)err;
	(void)err_len;
	memcpy(dst, src, bytes);
	*direct = true;
	return 0;
}

static int cpu_add(struct embd_backend_rank *r, float *dst, const float *src, uint64_t n,
		   char *err, size_t err_len)
{
	(void)r;
	(void)err;
	(void)err_len;
	for (uint64_t i = 0; i < n; i++)
		dst[i] += src[i];
	return 0;
}

static int cpu_rows_out(struct embd_backend_rank *r, float *host, uint64_t stride,
			const float *src, uint64_t rows, uint64_t cols, char *err, size_t err_len)
{
	(void)r;
	(void)err;
	(void)err_len;
	for (uint64_t i = 0; i < rows; i++)
		memcpy(host + i * stride, src + i * cols, cols * sizeof(float));
	return 0;
}

void embd_backend_slots_desc(const struct embd_shard_desc *desc, uint64_t rows,
			     struct embd_shard_desc *out)
{
	*out = *desc;
	out->num_embeddings = (int64_t)rows;
	out->row_offset = 0;
	out->rows = (int64_t)rows;
}

uint64_t embd_backend_row_bytes(const struct embd_backend_shard *s, int i)
{
	return s->bytes[i] / (uint64_t)s->host->desc.rows;
}

static int cpu_shard_alloc(struct embd_backend_rank *r, bool numa, int node,
			   const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			   struct embd_backend_shard *out, char *err, size_t err_len)
{
	(void)r;
	/* dense and fused alike: host rows with the optimizer fused into the backward */
	int rc = embd_backend_host_shard(numa, node, desc, out, err, err_len);

	if (rc)
		return rc;
	out->kernel = kernel;
	out->shard = out->host;
	if (kernel != EMBD_KERNEL_FUSED_UVM_CACHING)
		return 0;
	/* the rows as the "device" sees them: a shard of its own over the host view's memory,
	 * whose step is the device's (ranks_cache.c hands it over) */
	rc = embd_shard_create_in(desc, out->mem[0], out->mem[1], out->mem[2], &out->shard, err,
				  err_len);
	if (rc)
		embd_backend_host_shard_free(numa, out);
	return rc;
}

static void free_slots(struct embd_backend_shard *s)
{
	if (!s->slots)
		return;
	void *mem[3] = { s->slots->weights, s->slots->momentum1, s->slots->momentum2 };
	embd_shard_destroy(s->slots);
	for (int i = 0; i < 3; i++)
		free(mem[i]);
	s->slots = NULL;
	s->slot_rows = 0;
	s->device_bytes = 0;
}

static void cpu_shard_free(struct embd_backend_rank *r, bool numa, struct embd_backend_shard *s)
{
	(void)r;
	if (s->shard != s->host)
		embd_shard_destroy(s->shard);   /* the struct: its rows are the host view's */
	free_slots(s);
	embd_backend_host_shard_free(numa, s);
	s->shard = NULL;
}

static int cpu_slots_resize(struct embd_backend_rank *r, struct embd_backend_shard *s,
			    uint64_t rows, uint64_t keep, char *err, size_t err_len)
{
	struct embd_shard_desc desc;
	void *mem[3] = { NULL, NULL, NULL };
	struct embd_shard *slots = NULL;
	uint64_t bytes = 0;
	int rc = 0;

	(void)r;
	embd_backend_slots_desc(&s->host->desc, rows, &desc);
	for (int i = 0; i < 3 && !rc; i++) {
		uint64_t n = embd_backend_row_bytes(s, i) * rows;
		if (!n)
			continue;
		mem[i] = embd_backend_host_alloc(false, -1, n);
		bytes += n;
		if (!mem[i]) {
			snprintf(err, err_len, "cannot allocate %llu bytes of cache rows",
				 (unsigned long long)n);
			rc = EMBD_ENOMEM;
		} else if (s->slots && keep) {
			void *old[3] = { s->slots->weights, s->slots->momentum1, s->slots->momentum2 };
			memcpy(mem[i], old[i], embd_backend_row_bytes(s, i) * keep);
		}
	}
	if (!rc)
		rc = embd_shard_create_in(&desc, mem[0], mem[1], mem[2], &slots, err, err_len);
	if (rc) {
		for (int i = 0; i < 3; i++)
			free(mem[i]);
		return rc;
	}
	if (s->slots) {
		slots->step = s->slots->step;
		slots->nonfinite_rows = s->slots->nonfinite_rows;
	}
	free_slots(s);
	s->slots = slots;
	s->slot_rows = rows;
	s->device_bytes = bytes;
	return 0;
}

static void copy_rows(struct embd_backend_shard *s, bool to_host, uint64_t n,
		      const uint64_t *slot, const int64_t *row)
{
	uint8_t *host[3] = { s->mem[0], s->mem[1], s->mem[2] };
	uint8_t *dev[3] = { s->slots->weights, (uint8_t *)s->slots->momentum1,
			    (uint8_t *)s->slots->momentum2 };

	for (int i = 0; i < 3; i++) {
		const uint64_t rb = embd_backend_row_bytes(s, i);
		if (!rb)
			continue;
		for (uint64_t k = 0; k < n; k++) {
			uint8_t *h = host[i] + (uint64_t)row[k] * rb, *d = dev[i] + slot[k] * rb;
			memcpy(to_host ? h : d, to_host ? d : h, rb);
		}
	}
}

static int cpu_slots_copy(struct embd_backend_rank *r, struct embd_backend_shard *s,
			  const struct embd_cache_moves *m, char *err, size_t err_len)
{
	(void)r;
	(void)err;
	(void)err_len;
	copy_rows(s, true, m->num_writebacks, m->wb_slot, m->wb_row);
	copy_rows(s, false, m->num_fetches, m->fetch_slot, m->fetch_row);
	return 0;
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

static int cpu_backward_apply(struct embd_backend_rank *r, const struct embd_exec *exec,
			      struct embd_shard *shard, const struct embd_backward_prep *prep,
			      const struct embd_bag_batch *batches, uint32_t n,
			      struct embd_kernel_err *err)
{
	(void)r;
	return embd_kernels_backward_apply(exec, shard, prep, batches, n, err);
}

/*
 * Device outputs: a CPU rank has no GPU memory to export. With EMBD_TEST_CPU_DEVICE_OUTPUTS=1
 * in the environment (tests) a sealed memfd of host memory stands in for it, exported as
 * EMBD_EXPORT_HOST (the wire says so: a trainer maps it with mmap, never as CUDA memory), so
 * the CPU tests run the messages, the fd, the server's copies and the lifetime of the path
 * whole, everything but the device calls of engine/backend_cuda.c and the trainer's import.
 */
static bool host_exports(void)
{
	const char *k = getenv("EMBD_TEST_CPU_DEVICE_OUTPUTS");

	return k && !strcmp(k, "1");
}

static void cpu_export_free(struct embd_export *x)
{
	if (x->state)
		munmap(x->state, x->bytes);
	if (x->fd >= 0)
		close(x->fd);
	*x = (struct embd_export){ .fd = -1 };
}

static int cpu_export_alloc(const uint8_t uuid[16], uint64_t bytes, struct embd_export *out,
			    char *err, size_t err_len)
{
	(void)uuid;     /* the double has one "GPU": whichever the trainer names */
	*out = (struct embd_export){ .memory = EMBD_EXPORT_HOST, .fd = -1 };
	if (!host_exports()) {
		snprintf(err, err_len, "the ranks compute on the CPU (compute_device cpu): there is "
			 "no GPU memory to export; pooled outputs and gradients stay in the slab");
		return EMBD_ENOTSUP;
	}
	out->bytes = (bytes + 4095) & ~(uint64_t)4095;
	out->fd = memfd_create("embd-device-outputs", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (out->fd < 0 || ftruncate(out->fd, (off_t)out->bytes) != 0)
		goto fail;
	void *map = mmap(NULL, out->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, out->fd, 0);
	if (map == MAP_FAILED)
		goto fail;
	out->state = map;
	/* the trainer maps it too: sealed, so neither side can shrink it into a SIGBUS */
	if (fcntl(out->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
		goto fail;
	return 0;
fail:;
	const int e = errno;
	snprintf(err, err_len, "host memory for device outputs (%llu bytes): %s",
		 (unsigned long long)out->bytes, strerror(e));
	cpu_export_free(out);
	return e == ENOMEM ? EMBD_ENOMEM : EMBD_EIO;
}

static int cpu_export_copy(const struct embd_export *x, uint64_t offset, void *host,
			   uint64_t bytes, bool to_device, char *err, size_t err_len)
{
	uint8_t *at = (uint8_t *)x->state + offset;

	(void)err;
	(void)err_len;
	memcpy(to_device ? at : host, to_device ? host : at, bytes);
	return 0;
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
	.backward_apply = cpu_backward_apply,
	.slots_resize = cpu_slots_resize,
	.slots_copy = cpu_slots_copy,
	.partial_buffer = cpu_partial_buffer,
	.copy_peer = cpu_copy_peer,
	.add = cpu_add,
	.rows_out = cpu_rows_out,
	.host_register = cpu_host_register,
	.host_unregister = cpu_host_unregister,
	.export_alloc = cpu_export_alloc,
	.export_copy = cpu_export_copy,
	.export_free = cpu_export_free,
};
