/*
 * The CPU backend with a device of its own, for tests (EMBD_TEST_CPU_KERNEL=device_copy,
 * engine/ranks.h): fused and dense shards are kept as the CUDA backend keeps them in HBM, the
 * rows the kernels compute on in an allocation of their own apart from the host view, with
 * pull and push copying rows, state and step between the two. So the CPU tests run what GPU
 * ranks run between the two copies: the ranks' bookkeeping of which side is newer
 * (engine/ranks.c), and every pull and push of initialisation, checkpoints, restores, live
 * table access and the copy-before-write hook.
 *
 * Outside the rank's kernel calls and the copies the "device" rows are mapped PROT_NONE: host
 * code that reads a shard's rows instead of its host view faults at once, as it would read
 * garbage (or fault) on a GPU. So are the rank's partial sums (row-split tables' pooled rows,
 * summed across ranks by copy_peer and add, engine/step.c) outside the kernels and those
 * calls. Everything else (kernels, fused_uvm_caching's slots) is the CPU backend's, called
 * through its table.
 */
#include "engine/backend.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/log.h"

/* One shard's device rows: its three arrays, each a mapping of its own. */
struct device_rows {
	struct embd_shard *shard;       /* over the mappings */
	void *mem[3];
	uint64_t map_bytes[3];          /* page-rounded; 0 where the array is unused */
};

#define DEVICE_MAX_PEERS 64

/* A rank's device: the device rows of its shards, and its partial sums' buffer (a mapping,
 * readable while `partial_users` calls use it: another rank's copy_peer reads it from that
 * rank's thread). Handed out as struct embd_backend_rank. */
struct device {
	struct device_rows **rows;
	uint32_t num, cap;
	void *partials;
	uint64_t partial_bytes;         /* page-rounded; 0: none mapped */
	uint32_t partial_users;         /* under partials_mu */
	/* the ranks peer_open made this one able to read (copy_peer refuses any other, as a GPU
	 * without peer access would stage) */
	const struct device *peers[DEVICE_MAX_PEERS];
	uint32_t num_peers;
};

/* Serialises the partial buffers' protection: ranks' threads open each other's. */
static pthread_mutex_t partials_mu = PTHREAD_MUTEX_INITIALIZER;

/* dev's partial sums readable for one more user (on), or one fewer (the last: unreadable). */
static int partials_access(struct device *dev, bool on)
{
	int rc = 0;

	pthread_mutex_lock(&partials_mu);
	if (dev->partial_bytes && (on ? dev->partial_users++ == 0 : --dev->partial_users == 0) &&
	    mprotect(dev->partials, dev->partial_bytes, on ? PROT_READ | PROT_WRITE : PROT_NONE))
		rc = EMBD_EIO;
	pthread_mutex_unlock(&partials_mu);
	return rc;
}

static struct device *device_of(struct embd_backend_rank *r)
{
	return (struct device *)r;
}

static int set_access(struct device_rows *d, bool on)
{
	for (int i = 0; i < 3; i++)
		if (d->map_bytes[i] &&
		    mprotect(d->mem[i], d->map_bytes[i], on ? PROT_READ | PROT_WRITE : PROT_NONE))
			return EMBD_EIO;
	return 0;
}

/* Every device row of the rank and its partial sums readable (a kernel call on its thread),
 * or none again. */
static int rank_access(struct device *dev, bool on)
{
	int rc = partials_access(dev, on);

	for (uint32_t i = 0; i < dev->num && !rc; i++)
		rc = set_access(dev->rows[i], on);
	return rc;
}

/* s's device rows; NULL for a shard whose rows are its host view's (fused_uvm_caching). */
static struct device_rows *rows_of(const struct device *dev, const struct embd_backend_shard *s)
{
	for (uint32_t i = 0; i < dev->num; i++)
		if (dev->rows[i]->shard == s->shard)
			return dev->rows[i];
	return NULL;
}

static int dev_count(uint32_t *count, char *err, size_t err_len)
{
	return embd_backend_cpu.count(count, err, err_len);
}

static int dev_numa_node(uint32_t rank)
{
	return embd_backend_cpu.numa_node(rank);
}

static int dev_rank_open(uint32_t rank, struct embd_backend_rank **out, char *err,
			 size_t err_len)
{
	(void)rank;
	struct device *dev = calloc(1, sizeof(*dev));

	if (!dev) {
		snprintf(err, err_len, "out of memory");
		return EMBD_ENOMEM;
	}
	*out = (struct embd_backend_rank *)dev;
	return 0;
}

static void dev_rank_close(struct embd_backend_rank *r)
{
	struct device *dev = device_of(r);

	if (!dev)
		return;
	if (dev->partial_bytes)
		munmap(dev->partials, dev->partial_bytes);
	free(dev->rows);
	free(dev);
}

static void rows_free(struct device_rows *d)
{
	if (!d)
		return;
	embd_shard_destroy(d->shard);
	for (int i = 0; i < 3; i++)
		if (d->map_bytes[i])
			munmap(d->mem[i], d->map_bytes[i]);
	free(d);
}

/* Device rows for s's host view, zeroed (a GPU shard's state starts zeroed), not accessible. */
static int rows_alloc(const struct embd_backend_shard *s, struct device_rows **out, char *err,
		      size_t err_len)
{
	const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
	struct device_rows *d = calloc(1, sizeof(*d));
	int rc = 0;

	*out = NULL;
	if (!d)
		return EMBD_ENOMEM;
	for (int i = 0; i < 3 && !rc; i++) {
		if (!s->bytes[i])
			continue;
		uint64_t n = (s->bytes[i] + page - 1) / page * page;
		void *p = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED) {
			snprintf(err, err_len, "cannot map %llu bytes of device rows",
				 (unsigned long long)n);
			rc = EMBD_ENOMEM;
			break;
		}
		d->mem[i] = p;
		d->map_bytes[i] = n;
	}
	if (!rc)
		rc = embd_shard_create_in(&s->host->desc, d->mem[0], d->mem[1], d->mem[2], &d->shard,
					  err, err_len);
	if (rc) {
		rows_free(d);
		return rc;
	}
	*out = d;
	return 0;
}

static int dev_shard_alloc(struct embd_backend_rank *r, bool numa, int node,
			   const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			   struct embd_backend_shard *out, char *err, size_t err_len)
{
	struct device *dev = device_of(r);
	struct device_rows *d = NULL;
	int rc = embd_backend_cpu.shard_alloc(NULL, numa, node, desc, kernel, out, err, err_len);

	if (rc || (kernel != EMBD_KERNEL_FUSED && kernel != EMBD_KERNEL_DENSE))
		return rc;
	if (dev->num == dev->cap) {
		uint32_t cap = dev->cap ? 2 * dev->cap : 8;
		void *p = realloc(dev->rows, cap * sizeof(*dev->rows));
		if (!p) {
			rc = EMBD_ENOMEM;
			snprintf(err, err_len, "out of memory");
			goto fail;
		}
		dev->rows = p;
		dev->cap = cap;
	}
	if ((rc = rows_alloc(out, &d, err, err_len)))
		goto fail;
	dev->rows[dev->num++] = d;
	out->shard = d->shard;
	out->device_bytes = out->bytes[0] + out->bytes[1] + out->bytes[2];
	return 0;
fail:
	embd_backend_cpu.shard_free(NULL, numa, out);
	return rc;
}

static void dev_shard_free(struct embd_backend_rank *r, bool numa, struct embd_backend_shard *s)
{
	struct device *dev = device_of(r);
	struct device_rows *d = rows_of(dev, s);

	if (d) {
		for (uint32_t i = 0; i < dev->num; i++)
			if (dev->rows[i] == d)
				dev->rows[i] = dev->rows[--dev->num];
		rows_free(d);
		s->shard = s->host;     /* the CPU backend frees the host view */
	}
	embd_backend_cpu.shard_free(NULL, numa, s);
}

/* Rows and state from one shard to another of the same layout (s->bytes of each array). */
static void copy_arrays(const struct embd_backend_shard *s, struct embd_shard *to,
			const struct embd_shard *from)
{
	void *dst[3] = { to->weights, to->momentum1, to->momentum2 };
	const void *src[3] = { from->weights, from->momentum1, from->momentum2 };

	for (int i = 0; i < 3; i++)
		if (s->bytes[i])
			memcpy(dst[i], src[i], s->bytes[i]);
}

static int copy(struct device *dev, struct embd_backend_shard *s, bool to_host, char *err,
		size_t err_len)
{
	struct device_rows *d = rows_of(dev, s);
	struct embd_shard *host = s->host, *shard = s->shard;

	if (!d) {       /* rows the kernels share with the host view: only the step to copy */
		if (to_host)
			host->step = shard->step;
		else
			shard->step = host->step;
		return 0;
	}
	if (set_access(d, true)) {
		snprintf(err, err_len, "mprotect of the device rows failed");
		return EMBD_EIO;
	}
	if (to_host) {
		copy_arrays(s, host, shard);
		host->step = shard->step;
	} else {
		copy_arrays(s, shard, host);
		shard->step = host->step;
	}
	if (set_access(d, false)) {
		snprintf(err, err_len, "mprotect of the device rows failed");
		return EMBD_EIO;
	}
	return 0;
}

static int dev_pull(struct embd_backend_rank *r, struct embd_backend_shard *s, char *err,
		    size_t err_len)
{
	return copy(device_of(r), s, true, err, err_len);
}

static int dev_push(struct embd_backend_rank *r, struct embd_backend_shard *s, char *err,
		    size_t err_len)
{
	return copy(device_of(r), s, false, err, err_len);
}

static uint64_t unregistered_bytes;     /* atomic */

uint64_t embd_backend_unregistered_bytes(void)
{
	return __atomic_load_n(&unregistered_bytes, __ATOMIC_RELAXED);
}

/* One host array a GPU would copy by DMA: registered (host_register), or counted and named in
 * the log once. The rank's partial sums are its device memory. */
static void check_dma(const struct device *dev, const void *p, uint64_t bytes,
		      const char *what, uint32_t batch)
{
	static bool logged;
	const uintptr_t b = (uintptr_t)p, partials = (uintptr_t)dev->partials;

	if (!p || !bytes || (partials && b >= partials && b - partials < dev->partial_bytes) ||
	    embd_backend_host_registered(p, bytes))
		return;
	__atomic_fetch_add(&unregistered_bytes, bytes, __ATOMIC_RELAXED);
	if (!__atomic_exchange_n(&logged, true, __ATOMIC_RELAXED))
		embd_log(EMBD_LOG_ERROR, "device_copy: batch %u's %s (%" PRIu64 " bytes) is not "
			 "registered for DMA", batch, what, bytes);
}

/* Every host array of the call's batches, as a GPU rank copies them (engine/backend_cuda.c). */
static void check_batches(const struct device *dev, const struct embd_bag_batch *b, uint32_t n,
			  bool backward)
{
	for (uint32_t i = 0; i < n; i++) {
		const uint64_t B = b[i].batch_size, cols = b[i].shard ? b[i].shard->desc.cols : 0;
		const uint64_t rows = B && cols ? ((B - 1) * b[i].pooled_stride + cols) * 4 : 0;
		check_dma(dev, b[i].offsets, (B + 1) * 8, "offsets", i);
		check_dma(dev, b[i].ids, b[i].num_ids * 8, "ids", i);
		check_dma(dev, b[i].weights, b[i].num_ids * 4, "weights", i);
		check_dma(dev, b[i].mean_lengths, B * 4, "mean lengths", i);
		if (backward)
			check_dma(dev, b[i].pooled_grad ? b[i].pooled_grad + b[i].pooled_col : NULL,
				  rows, "gradient", i);
		else
			check_dma(dev, b[i].pooled ? b[i].pooled + b[i].pooled_col : NULL, rows,
				  "pooled rows", i);
	}
}

static int kernel_fail(struct embd_kernel_err *err)
{
	err->feature = 0;
	err->sample = err->id = -1;
	snprintf(err->msg, sizeof(err->msg), "mprotect of the device rows failed");
	return EMBD_EIO;
}

static int dev_forward(struct embd_backend_rank *r, const struct embd_exec *exec,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err)
{
	struct device *dev = device_of(r);

	check_batches(dev, batches, n, false);
	if (rank_access(dev, true))
		return kernel_fail(err);
	int rc = embd_backend_cpu.forward(NULL, exec, batches, n, err);
	if (rank_access(dev, false) && !rc)
		rc = kernel_fail(err);
	return rc;
}

static int dev_backward(struct embd_backend_rank *r, const struct embd_exec *exec,
			struct embd_shard *shard, const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err)
{
	struct device *dev = device_of(r);

	check_batches(dev, batches, n, true);
	if (rank_access(dev, true))
		return kernel_fail(err);
	int rc = embd_backend_cpu.backward(NULL, exec, shard, batches, n, err);
	if (rank_access(dev, false) && !rc)
		rc = kernel_fail(err);
	return rc;
}

static int dev_backward_apply(struct embd_backend_rank *r, const struct embd_exec *exec,
			      struct embd_shard *shard, const struct embd_backward_prep *prep,
			      const struct embd_bag_batch *batches, uint32_t n,
			      struct embd_kernel_err *err)
{
	struct device *dev = device_of(r);

	check_batches(dev, batches, n, true);
	if (rank_access(dev, true))
		return kernel_fail(err);
	int rc = embd_backend_cpu.backward_apply(NULL, exec, shard, prep, batches, n, err);
	if (rank_access(dev, false) && !rc)
		rc = kernel_fail(err);
	return rc;
}

static int dev_slots_resize(struct embd_backend_rank *r, struct embd_backend_shard *s,
			    uint64_t rows, uint64_t keep, char *err, size_t err_len)
{
	(void)r;
	return embd_backend_cpu.slots_resize(NULL, s, rows, keep, err, err_len);
}

static int dev_slots_copy(struct embd_backend_rank *r, struct embd_backend_shard *s,
			  const struct embd_cache_moves *m, char *err, size_t err_len)
{
	(void)r;
	return embd_backend_cpu.slots_copy(NULL, s, m, err, err_len);
}

/* A fresh mapping when it grows (nothing reads it then: the lookup's embd_ranks_run). */
static int dev_partial_buffer(struct embd_backend_rank *r, uint64_t bytes, void **out,
			      char *err, size_t err_len)
{
	struct device *dev = device_of(r);
	const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);

	if (bytes > dev->partial_bytes) {
		const uint64_t n = (bytes + page - 1) / page * page;
		if (dev->partial_bytes)
			munmap(dev->partials, dev->partial_bytes);
		dev->partial_bytes = 0;
		void *p = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return snprintf(err, err_len, "cannot map %llu bytes of partial sums",
					(unsigned long long)n), EMBD_ENOMEM;
		dev->partials = p;
		dev->partial_bytes = n;
	}
	*out = dev->partials;
	return 0;
}

static int access_fail(char *err, size_t err_len)
{
	snprintf(err, err_len, "mprotect of the partial sums failed");
	return EMBD_EIO;
}

static void dev_peer_open(struct embd_backend_rank *r, struct embd_backend_rank *from)
{
	struct device *dev = device_of(r);

	if (dev->num_peers < DEVICE_MAX_PEERS)
		dev->peers[dev->num_peers++] = device_of(from);
}

static int dev_copy_peer(struct embd_backend_rank *r, void *dst, struct embd_backend_rank *from,
			 const void *src, uint64_t bytes, bool *direct, char *err, size_t err_len)
{
	struct device *to = device_of(r), *peer = device_of(from);
	bool opened = false;

	for (uint32_t i = 0; i < to->num_peers; i++)
		opened |= to->peers[i] == peer;
	if (!opened) {
		snprintf(err, err_len, "copy from a rank whose memory this one was never opened to "
			 "(peer_open at the ranks' start)");
		return EMBD_EIO;
	}

	if (partials_access(to, true))
		return access_fail(err, err_len);
	if (partials_access(peer, true)) {
		partials_access(to, false);
		return access_fail(err, err_len);
	}
	int rc = embd_backend_cpu.copy_peer(NULL, dst, NULL, src, bytes, direct, err, err_len);
	if ((partials_access(peer, false) | partials_access(to, false)) && !rc)
		rc = access_fail(err, err_len);
	return rc;
}

static int dev_add(struct embd_backend_rank *r, float *dst, const float *src, uint64_t n,
		   char *err, size_t err_len)
{
	struct device *dev = device_of(r);

	if (partials_access(dev, true))
		return access_fail(err, err_len);
	int rc = embd_backend_cpu.add(NULL, dst, src, n, err, err_len);
	if (partials_access(dev, false) && !rc)
		rc = access_fail(err, err_len);
	return rc;
}

static int dev_rows_out(struct embd_backend_rank *r, float *host, uint64_t stride,
			const float *src, uint64_t rows, uint64_t cols, char *err, size_t err_len)
{
	struct device *dev = device_of(r);

	if (partials_access(dev, true))
		return access_fail(err, err_len);
	int rc = embd_backend_cpu.rows_out(NULL, host, stride, src, rows, cols, err, err_len);
	if (partials_access(dev, false) && !rc)
		rc = access_fail(err, err_len);
	return rc;
}

static int dev_host_register(struct embd_backend_rank *r, void *p, size_t bytes, char *err,
			     size_t err_len)
{
	(void)r;
	return embd_backend_cpu.host_register(NULL, p, bytes, err, err_len);
}

static void dev_host_unregister(struct embd_backend_rank *r, void *p)
{
	(void)r;
	embd_backend_cpu.host_unregister(NULL, p);
}

const struct embd_backend embd_backend_cpu_device = {
	.name = "cpu",
	.count = dev_count,
	.numa_node = dev_numa_node,
	.rank_open = dev_rank_open,
	.rank_close = dev_rank_close,
	.shard_alloc = dev_shard_alloc,
	.shard_free = dev_shard_free,
	.pull = dev_pull,
	.push = dev_push,
	.forward = dev_forward,
	.backward = dev_backward,
	.backward_apply = dev_backward_apply,
	.slots_resize = dev_slots_resize,
	.slots_copy = dev_slots_copy,
	.partial_buffer = dev_partial_buffer,
	.peer_open = dev_peer_open,
	.copy_peer = dev_copy_peer,
	.add = dev_add,
	.rows_out = dev_rows_out,
	.host_register = dev_host_register,
	.host_unregister = dev_host_unregister,
};
