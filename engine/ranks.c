/*
 * The node's ranks (engine/ranks.h). Each rank is a driver thread that sleeps on one
 * condition variable shared by all ranks; embd_ranks_run bumps a generation number, every
 * driver runs the function once for that generation, and the last one to finish wakes the
 * caller. A step has a handful of such phases, so a condvar round trip per phase is cheap next
 * to the lookups themselves. The device work of a rank goes through its backend
 * (engine/backend.h); which side of a shard is newer (device or host view) is kept here.
 */
#include "engine/ranks.h"
#include "engine/backend.h"
#include "engine/ranks_internal.h"
#include "common/log.h"

#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *rank_main(void *p)
{
	struct rank *r = p;
	struct embd_ranks *rs = r->owner;
	char err[256] = "";
	uint64_t seen = 0;

	/* the pool pins this thread to cpus[0]: it is worker 0 of every kernel call */
	int rc = embd_workers_create(rs->threads_per_rank, r->cpus, &r->workers, err, sizeof(err));
	/* a device context belongs to the thread that drives it (CUDA: its current device) */
	if (!rc)
		rc = rs->backend->rank_open(r->index, &r->dev, err, sizeof(err));
	r->dev_open = !rc;
	pthread_mutex_lock(&rs->mu);
	if (rc && !rs->start_rc) {
		rs->start_rc = rc;
		snprintf(rs->start_err, sizeof(rs->start_err), "rank %u: %.200s", r->index, err);
	}
	if (--rs->pending == 0)
		pthread_cond_broadcast(&rs->done);
	for (;;) {
		while (!rs->stop && rs->generation == seen)
			pthread_cond_wait(&rs->go, &rs->mu);
		if (rs->stop)
			break;
		seen = rs->generation;
		embd_ranks_fn fn = rs->fn;
		void *arg = rs->arg;
		pthread_mutex_unlock(&rs->mu);
		struct embd_exec exec = { .workers = r->workers, .isa = EMBD_ISA_AUTO };
		fn(arg, r->index, &exec);
		pthread_mutex_lock(&rs->mu);
		if (--rs->pending == 0)
			pthread_cond_broadcast(&rs->done);
	}
	pthread_mutex_unlock(&rs->mu);
	if (r->dev_open)
		rs->backend->rank_close(r->dev);
	embd_workers_destroy(r->workers);
	return NULL;
}

/* CPUs of node that this process may run on, in order; all allowed CPUs when none. */
static uint32_t node_cpus(bool numa, int node, int *cpus, uint32_t max)
{
	cpu_set_t allowed;
	uint32_t n = 0;

	if (sched_getaffinity(0, sizeof(allowed), &allowed))
		return 0;
	struct bitmask *mask = numa ? numa_allocate_cpumask() : NULL;
	if (mask && numa_node_to_cpus(node, mask)) {
		numa_free_cpumask(mask);
		mask = NULL;
	}
	for (int pass = 0; pass < 2 && n == 0; pass++)
		for (int c = 0; c < CPU_SETSIZE && n < max; c++)
			if (CPU_ISSET(c, &allowed) &&
			    (pass == 1 || !mask || numa_bitmask_isbitset(mask, (unsigned)c)))
				cpus[n++] = c;
	if (mask)
		numa_free_cpumask(mask);
	return n;
}

static int assign_cpus(struct embd_ranks *rs, char *err, size_t err_len)
{
	int nodes = rs->numa ? numa_max_node() + 1 : 1;
	int *avail = malloc(sizeof(int) * CPU_SETSIZE);

	if (!avail)
		return EMBD_ENOMEM;
	for (uint32_t i = 0; i < rs->num_ranks; i++) {
		struct rank *r = &rs->ranks[i];
		/* a device attached to a node keeps its rank there; CPU ranks spread in order */
		int dev_node = rs->backend->numa_node(i);
		r->node = dev_node >= 0 && dev_node < nodes ? dev_node :
			  (int)((uint64_t)i * (uint64_t)nodes / rs->num_ranks);
		/* position of rank i among the ranks of its node */
		uint32_t pos = 0;
		for (uint32_t j = 0; j < i; j++)
			pos += rs->ranks[j].node == r->node;
		uint32_t n = node_cpus(rs->numa, r->node, avail, CPU_SETSIZE);
		if (!n) {
			free(avail);
			snprintf(err, err_len, "rank %u: no CPU is allowed for this process", i);
			return EMBD_EINVAL;
		}
		for (uint32_t t = 0; t < rs->threads_per_rank; t++)
			r->cpus[t] = avail[(pos * rs->threads_per_rank + t) % n];
	}
	free(avail);
	return 0;
}

static const struct embd_backend *backend_of(enum embd_compute_device device, char *err,
					     size_t err_len)
{
	if (device == EMBD_DEVICE_CPU)
		return &embd_backend_cpu;
	if (device == EMBD_DEVICE_CUDA) {
#ifdef EMBD_HAVE_CUDA
		return &embd_backend_cuda;
#else
		snprintf(err, err_len, "no CUDA device: this embd was built without CUDA (no nvcc "
			 "at build time)");
		return NULL;
#endif
	}
	snprintf(err, err_len, "compute_device %d: unknown", (int)device);
	return NULL;
}

int embd_ranks_device_count(enum embd_compute_device device, uint32_t *count, char *err,
			    size_t err_len)
{
	const struct embd_backend *b = backend_of(device, err, err_len);

	*count = 0;
	return b ? b->count(count, err, err_len) : EMBD_ENOTSUP;
}

int embd_ranks_create(uint32_t num_ranks, uint32_t threads_per_rank, struct embd_ranks **out,
		      char *err, size_t err_len)
{
	return embd_ranks_create_on(EMBD_DEVICE_CPU, num_ranks, threads_per_rank, out, err,
				    err_len);
}

/* Every rank's device made able to read every other's (backend peer_open), on its thread. */
static void open_peers(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_ranks *rs = arg;

	(void)exec;
	for (uint32_t j = 0; j < rs->num_ranks; j++)
		if (j != rank)
			rs->backend->peer_open(rs->ranks[rank].dev, rs->ranks[j].dev);
}

int embd_ranks_create_on(enum embd_compute_device device, uint32_t num_ranks,
			 uint32_t threads_per_rank, struct embd_ranks **out, char *err,
			 size_t err_len)
{
	const struct embd_backend *backend = backend_of(device, err, err_len);
	struct embd_ranks *rs;
	uint32_t devices = 0;
	int rc;

	*out = NULL;
	if (!backend)
		return EMBD_ENOTSUP;
	if (!num_ranks || !threads_per_rank) {
		snprintf(err, err_len, "ranks %u and threads_per_rank %u must be at least 1",
			 num_ranks, threads_per_rank);
		return EMBD_EINVAL;
	}
	if (device != EMBD_DEVICE_CPU) {
		if ((rc = backend->count(&devices, err, err_len)))
			return rc;
		if (devices < num_ranks) {
			snprintf(err, err_len, "local_world_size %u asks for %u %s devices, this "
				 "machine has %u visible", num_ranks, num_ranks, backend->name,
				 devices);
			return EMBD_ENOTSUP;
		}
	}
	rs = calloc(1, sizeof(*rs));
	if (!rs)
		return EMBD_ENOMEM;
	pthread_mutex_init(&rs->mu, NULL);
	pthread_cond_init(&rs->go, NULL);
	pthread_cond_init(&rs->done, NULL);
	rs->device = device;
	/* tests: the CPU keeps fused and dense rows apart from their host views, as a GPU */
	const char *k = getenv("EMBD_TEST_CPU_KERNEL");
	if (device == EMBD_DEVICE_CPU && k && !strcmp(k, "device_copy"))
		backend = &embd_backend_cpu_device;
	rs->backend = backend;
	rs->num_ranks = num_ranks;
	rs->threads_per_rank = threads_per_rank;
	rs->numa = numa_available() >= 0;
	/* tests: the CPU runs fused_uvm_caching's cache (host memory as the "device") where the
	 * plan says fused, which the planner never assigns on the CPU */
	rs->cpu_caching = device == EMBD_DEVICE_CPU && k && !strcmp(k, "fused_uvm_caching");
	rs->ranks = calloc(num_ranks, sizeof(*rs->ranks));
	rc = EMBD_ENOMEM;
	if (!rs->ranks)
		goto out;
	for (uint32_t i = 0; i < num_ranks; i++) {
		rs->ranks[i].owner = rs;
		rs->ranks[i].index = i;
		rs->ranks[i].cpus = calloc(threads_per_rank, sizeof(int));
		if (!rs->ranks[i].cpus)
			goto out;
	}
	rc = assign_cpus(rs, err, err_len);
	if (rc)
		goto out;
	pthread_mutex_lock(&rs->mu);
	rs->pending = num_ranks;
	for (uint32_t i = 0; i < num_ranks; i++) {
		int prc = pthread_create(&rs->ranks[i].thread, NULL, rank_main, &rs->ranks[i]);
		if (prc) {
			rs->pending -= num_ranks - i;
			if (!rs->start_rc) {
				rs->start_rc = -prc;
				snprintf(rs->start_err, sizeof(rs->start_err),
					 "rank %u: cannot start its thread", i);
			}
			break;
		}
		rs->ranks[i].started = true;
	}
	while (rs->pending)
		pthread_cond_wait(&rs->done, &rs->mu);
	rc = rs->start_rc;
	pthread_mutex_unlock(&rs->mu);
	if (rc)
		snprintf(err, err_len, "%s", rs->start_err);
	else if (backend->peer_open && num_ranks > 1)
		embd_ranks_run(rs, open_peers, rs);
out:
	if (rc) {
		embd_ranks_destroy(rs);
		return rc;
	}
	*out = rs;
	return 0;
}

void embd_ranks_destroy(struct embd_ranks *rs)
{
	if (!rs)
		return;
	/* before the threads close their devices' contexts */
	while (rs->ranks && rs->allocs)
		embd_ranks_free_shard(rs, rs->allocs->b.shard);
	for (uint32_t i = 0; rs->ranks && i < rs->num_ranks; i++)
		ranks_cache_free_ids(&rs->ranks[i]);
	if (rs->ranks) {
		pthread_mutex_lock(&rs->mu);
		rs->stop = true;
		pthread_cond_broadcast(&rs->go);
		pthread_mutex_unlock(&rs->mu);
		for (uint32_t i = 0; i < rs->num_ranks; i++) {
			if (rs->ranks[i].started)
				pthread_join(rs->ranks[i].thread, NULL);
			free(rs->ranks[i].cpus);
			free(rs->ranks[i].sub);
			free(rs->ranks[i].rows);
			free(rs->ranks[i].slots);
		}
	}
	free(rs->ranks);
	pthread_cond_destroy(&rs->go);
	pthread_cond_destroy(&rs->done);
	pthread_mutex_destroy(&rs->mu);
	free(rs);
}

uint32_t embd_ranks_count(const struct embd_ranks *rs)
{
	return rs->num_ranks;
}

enum embd_compute_device embd_ranks_device(const struct embd_ranks *rs)
{
	return rs->device;
}

int embd_ranks_node(const struct embd_ranks *rs, uint32_t rank)
{
	return rank < rs->num_ranks ? rs->ranks[rank].node : -1;
}

uint64_t embd_ranks_memory_bytes(const struct embd_ranks *rs, uint32_t rank)
{
	return rank < rs->num_ranks ? rs->ranks[rank].memory_bytes : 0;
}

void embd_ranks_run(struct embd_ranks *rs, embd_ranks_fn fn, void *arg)
{
	pthread_mutex_lock(&rs->mu);
	rs->fn = fn;
	rs->arg = arg;
	rs->pending = rs->num_ranks;
	rs->generation++;
	pthread_cond_broadcast(&rs->go);
	while (rs->pending)
		pthread_cond_wait(&rs->done, &rs->mu);
	pthread_mutex_unlock(&rs->mu);
}

/* Bytes of a's shard the rank's memory counts: device memory, and host rows the device
 * computes on or caches (not the host copies of HBM shards). */
static uint64_t counted_bytes(const struct rank_alloc *a)
{
	bool host_rows = a->b.host == a->b.shard || a->b.registered ||
			 a->b.kernel == EMBD_KERNEL_FUSED_UVM_CACHING;

	return a->b.device_bytes +
	       (host_rows ? a->b.bytes[0] + a->b.bytes[1] + a->b.bytes[2] : 0);
}

int embd_ranks_alloc_shard(struct embd_ranks *rs, uint32_t rank,
			   const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			   double cache_ratio, struct embd_shard **out, char *err, size_t err_len)
{
	struct rank_alloc *a;
	char inner[192] = "";
	int rc;

	*out = NULL;
	if (rank >= rs->num_ranks) {
		snprintf(err, err_len, "rank %u: only %u ranks", rank, rs->num_ranks);
		return EMBD_EINVAL;
	}
	if (rs->cpu_caching && kernel == EMBD_KERNEL_FUSED)
		kernel = EMBD_KERNEL_FUSED_UVM_CACHING;
	a = calloc(1, sizeof(*a));
	if (!a)
		return EMBD_ENOMEM;
	rc = rs->backend->shard_alloc(rs->ranks[rank].dev, rs->numa, rs->ranks[rank].node, desc,
				      kernel, &a->b, inner, sizeof(inner));
	if (rc) {
		snprintf(err, err_len, "rank %u (%s): %s", rank, rs->backend->name, inner);
		free(a);
		return rc;
	}
	a->rank = rank;
	a->next = rs->allocs;
	rs->allocs = a;
	rs->ranks[rank].memory_bytes += counted_bytes(a);
	if (kernel == EMBD_KERNEL_FUSED_UVM_CACHING) {
		rc = ranks_cache_open(rs, a, cache_ratio, inner, sizeof(inner));
		if (rc) {
			embd_ranks_free_shard(rs, a->b.shard);
			snprintf(err, err_len, "rank %u (%s): %s", rank, rs->backend->name, inner);
			return rc;
		}
		rs->ranks[rank].cached_shards++;
	}
	*out = a->b.shard;
	return 0;
}

static struct rank_alloc *find(const struct embd_ranks *rs, const struct embd_shard *shard)
{
	for (struct rank_alloc *a = rs->allocs; a; a = a->next)
		if (a->b.shard == shard)
			return a;
	return NULL;
}

void embd_ranks_free_shard(struct embd_ranks *rs, struct embd_shard *shard)
{
	for (struct rank_alloc **p = &rs->allocs; *p; p = &(*p)->next) {
		struct rank_alloc *a = *p;
		if (a->b.shard != shard)
			continue;
		*p = a->next;
		struct rank *r = &rs->ranks[a->rank];
		r->memory_bytes -= counted_bytes(a);
		if (a->cache)
			r->cached_shards--;
		ranks_cache_close(a);
		rs->backend->shard_free(r->dev, rs->numa, &a->b);
		free(a);
		return;
	}
}

struct embd_shard *embd_ranks_shard_host(const struct embd_ranks *rs,
					 const struct embd_shard *shard)
{
	const struct rank_alloc *a = find(rs, shard);

	return a ? a->b.host : NULL;
}

int embd_ranks_shard_pull(struct embd_ranks *rs, struct embd_shard *shard, char *err,
			  size_t err_len)
{
	struct rank_alloc *a = find(rs, shard);
	int rc;

	if (!a || a->side != SIDE_DEVICE_NEWER)
		return 0;
	if (a->cache)
		rc = ranks_cache_flush(rs, a, err, err_len);
	else
		rc = rs->backend->pull(rs->ranks[a->rank].dev, &a->b, err, err_len);
	if (!rc)
		a->side = SIDE_SAME;
	return rc;
}

void embd_ranks_shard_changed(struct embd_ranks *rs, struct embd_shard *shard)
{
	struct rank_alloc *a = find(rs, shard);

	if (a && (rs->backend->push || a->cache))
		a->side = SIDE_HOST_NEWER;
}

int64_t embd_ranks_shard_step(const struct embd_ranks *rs, const struct embd_shard *shard)
{
	const struct rank_alloc *a = find(rs, shard);

	if (!a)
		return 0;
	return a->side == SIDE_HOST_NEWER ? a->b.host->step : a->b.shard->step;
}

static int push(struct embd_ranks *rs, struct rank_alloc *a, char *err, size_t err_len)
{
	if (a->side != SIDE_HOST_NEWER)
		return 0;
	int rc = 0;
	if (a->cache)
		ranks_cache_invalidate(a);
	else
		rc = rs->backend->push(rs->ranks[a->rank].dev, &a->b, err, err_len);
	if (!rc)
		a->side = SIDE_SAME;
	return rc;
}

int embd_ranks_shard_push(struct embd_ranks *rs, struct embd_shard *shard, char *err,
			  size_t err_len)
{
	struct rank_alloc *a = find(rs, shard);

	return a ? push(rs, a, err, err_len) : 0;
}

/* Before a rank's kernels run: the host views written since hand their rows to the device. */
static int push_rank(struct embd_ranks *rs, uint32_t rank, struct embd_kernel_err *kerr)
{
	for (struct rank_alloc *a = rs->allocs; a; a = a->next) {
		if (a->rank != rank)
			continue;
		int rc = push(rs, a, kerr->msg, sizeof(kerr->msg));
		if (rc) {
			kerr->feature = 0;
			kerr->sample = kerr->id = -1;
			return rc;
		}
	}
	return 0;
}

int embd_ranks_forward(struct embd_ranks *rs, uint32_t rank, const struct embd_exec *exec,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err)
{
	int rc = push_rank(rs, rank, err);

	if (rc)
		return rc;
	if (rs->ranks[rank].cached_shards)
		return ranks_cache_forward(rs, rank, exec, batches, n, err);
	return rs->backend->forward(rs->ranks[rank].dev, exec, batches, n, err);
}

int embd_ranks_backward(struct embd_ranks *rs, uint32_t rank, const struct embd_exec *exec,
			struct embd_shard *shard, const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err)
{
	struct rank_alloc *a = find(rs, shard);
	int rc = push_rank(rs, rank, err);

	if (rc)
		return rc;
	if (a && a->cache)
		rc = ranks_cache_backward(rs, a, exec, batches, n, err);
	else
		rc = rs->backend->backward(rs->ranks[rank].dev, exec, shard, batches, n, err);
	/* even a failed call may have changed rows on a device that reports late */
	if (a && (rs->backend->pull || a->cache))
		a->side = SIDE_DEVICE_NEWER;
	return rc;
}

bool embd_ranks_backward_shares(const struct embd_ranks *rs, const struct embd_shard *shard)
{
	const struct rank_alloc *a = find(rs, shard);

	return a && !a->cache && rs->backend->backward_apply;
}

int embd_ranks_backward_apply(struct embd_ranks *rs, uint32_t rank, const struct embd_exec *exec,
			      struct embd_shard *shard, const struct embd_backward_prep *prep,
			      const struct embd_bag_batch *batches, uint32_t n,
			      struct embd_kernel_err *err)
{
	struct rank_alloc *a = find(rs, shard);
	int rc;

	if (!embd_ranks_backward_shares(rs, shard)) {
		*err = (struct embd_kernel_err){ .sample = -1, .id = -1 };
		snprintf(err->msg, sizeof(err->msg), "rank %u: this shard takes no prepared occurrences",
			 rank);
		return EMBD_ENOTSUP;
	}
	if ((rc = push_rank(rs, rank, err)))
		return rc;
	rc = rs->backend->backward_apply(rs->ranks[rank].dev, exec, shard, prep, batches, n, err);
	if (rs->backend->pull)
		a->side = SIDE_DEVICE_NEWER;
	return rc;
}

bool embd_ranks_cache_counts(const struct embd_ranks *rs, const struct embd_shard *shard,
			     uint64_t *hits, uint64_t *misses)
{
	const struct rank_alloc *a = find(rs, shard);

	if (!a || !a->cache)
		return false;
	*hits += a->cache->hits;
	*misses += a->cache->misses;
	return true;
}

int embd_ranks_host_register(struct embd_ranks *rs, void *p, size_t bytes, char *err,
			     size_t err_len)
{
	/* registration is process-wide (every GPU may DMA): rank 0's device does it */
	if (!rs->backend->host_register || !rs->num_ranks)
		return 0;
	return rs->backend->host_register(rs->ranks[0].dev, p, bytes, err, err_len);
}

void embd_ranks_host_unregister(struct embd_ranks *rs, void *p)
{
	if (rs->backend->host_unregister && rs->num_ranks)
		rs->backend->host_unregister(rs->ranks[0].dev, p);
}

bool embd_ranks_dma_register(struct embd_ranks *rs, void *p, size_t bytes, const char *what)
{
	char err[192];

	if (!embd_ranks_host_register(rs, p, bytes, err, sizeof(err)))
		return true;
	if (!__atomic_exchange_n(&rs->dma_warned, true, __ATOMIC_RELAXED))
		embd_log_warning("%s (%zu bytes) stays unregistered for DMA: %s; the %s driver "
				 "stages its copies (slower), later failures are not logged",
				 what, bytes, err, rs->backend->name);
	return false;
}

void *embd_ranks_dma_alloc(struct embd_ranks *rs, size_t bytes, bool *registered,
			   const char *what)
{
	const size_t page = (size_t)sysconf(_SC_PAGESIZE);
	const size_t rounded = (bytes + page - 1) / page * page;
	void *p = aligned_alloc(page, rounded ? rounded : page);

	*registered = p && embd_ranks_dma_register(rs, p, rounded ? rounded : page, what);
	return p;
}

void embd_ranks_dma_free(struct embd_ranks *rs, void *p, bool registered)
{
	if (p && registered)
		embd_ranks_host_unregister(rs, p);
	free(p);
}

int embd_ranks_export_alloc(struct embd_ranks *rs, const uint8_t uuid[16], uint64_t bytes,
			    struct embd_export *out, char *err, size_t err_len)
{
	*out = (struct embd_export){ .fd = -1 };
	if (!rs->backend->export_alloc)
		return snprintf(err, err_len, "the %s ranks have no memory to export",
				rs->backend->name), EMBD_ENOTSUP;
	return rs->backend->export_alloc(uuid, bytes, out, err, err_len);
}

int embd_ranks_export_copy(struct embd_ranks *rs, const struct embd_export *x, uint64_t offset,
			   void *host, uint64_t bytes, bool to_device, char *err, size_t err_len)
{
	if (offset > x->bytes || bytes > x->bytes - offset)
		return snprintf(err, err_len, "[%llu, +%llu) is outside the %llu exported bytes",
				(unsigned long long)offset, (unsigned long long)bytes,
				(unsigned long long)x->bytes), EMBD_ERANGE;
	return rs->backend->export_copy(x, offset, host, bytes, to_device, err, err_len);
}

void embd_ranks_export_free(struct embd_ranks *rs, struct embd_export *x)
{
	if (x->state || x->fd >= 0)
		rs->backend->export_free(x);
}

bool embd_ranks_comm_buffers(const struct embd_ranks *rs)
{
	return rs->backend->comm_buffer && rs->backend->comm_copy;
}

int embd_ranks_comm_buffer(struct embd_ranks *rs, uint32_t rank, uint64_t bytes, void **out,
			   char *err, size_t err_len)
{
	if (!embd_ranks_comm_buffers(rs) || rank >= rs->num_ranks)
		return snprintf(err, err_len, "rank %u (%s): no comm staging", rank,
				rs->backend->name), EMBD_EINVAL;
	return rs->backend->comm_buffer(rs->ranks[rank].dev, bytes, out, err, err_len);
}

int embd_ranks_comm_copy(struct embd_ranks *rs, uint32_t rank, void *dst, const void *src,
			 uint64_t bytes, char *err, size_t err_len)
{
	if (!embd_ranks_comm_buffers(rs) || rank >= rs->num_ranks)
		return snprintf(err, err_len, "rank %u (%s): no comm staging", rank,
				rs->backend->name), EMBD_EINVAL;
	return rs->backend->comm_copy(rs->ranks[rank].dev, dst, src, bytes, err, err_len);
}

int embd_ranks_partial_buffer(struct embd_ranks *rs, uint32_t rank, uint64_t bytes,
			      void **out, char *err, size_t err_len)
{
	return rs->backend->partial_buffer(rs->ranks[rank].dev, bytes, out, err, err_len);
}

int embd_ranks_partial_copy(struct embd_ranks *rs, uint32_t rank, void *dst, uint32_t from,
			    const void *src, uint64_t bytes, char *err, size_t err_len)
{
	bool direct = false;
	int rc = rs->backend->copy_peer(rs->ranks[rank].dev, dst, rs->ranks[from].dev, src, bytes,
					&direct, err, err_len);

	if (!rc)
		__atomic_fetch_add(&rs->peer_bytes[direct ? 0 : 1], bytes, __ATOMIC_RELAXED);
	return rc;
}

int embd_ranks_partial_add(struct embd_ranks *rs, uint32_t rank, float *dst, const float *src,
			   uint64_t n, char *err, size_t err_len)
{
	return rs->backend->add(rs->ranks[rank].dev, dst, src, n, err, err_len);
}

int embd_ranks_partial_out(struct embd_ranks *rs, uint32_t rank, float *host, uint64_t stride,
			   const float *src, uint64_t rows, uint64_t cols, char *err,
			   size_t err_len)
{
	return rs->backend->rows_out(rs->ranks[rank].dev, host, stride, src, rows, cols, err,
				     err_len);
}

void embd_ranks_partial_counts(const struct embd_ranks *rs, uint64_t *device_bytes,
			       uint64_t *host_bytes)
{
	*device_bytes = __atomic_load_n(&rs->peer_bytes[0], __ATOMIC_RELAXED);
	*host_bytes = __atomic_load_n(&rs->peer_bytes[1], __ATOMIC_RELAXED);
}
