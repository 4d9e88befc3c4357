/*
 * engine/ranks_internal.h - the ranks' state, shared by engine/ranks.c (threads, shards, which
 * side is newer) and engine/ranks_cache.c (fused_uvm_caching's cache over the backends' slot
 * rows). Private to engine/.
 */
#ifndef EMBD_ENGINE_RANKS_INTERNAL_H
#define EMBD_ENGINE_RANKS_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "engine/backend.h"
#include "engine/ranks.h"

/* Which copy of a shard's rows is newer; both are equal where the host view is the shard. */
enum side { SIDE_SAME, SIDE_DEVICE_NEWER, SIDE_HOST_NEWER };

struct rank_alloc {
	struct rank_alloc *next;
	struct embd_backend_shard b;
	uint32_t rank;
	enum side side;
	struct embd_cache *cache;       /* fused_uvm_caching's (engine/ranks_cache.c) */
};

struct rank {
	struct embd_ranks *owner;
	uint32_t index;
	int node;
	int *cpus;                      /* threads_per_rank */
	pthread_t thread;
	bool started;
	struct embd_workers *workers;
	struct embd_backend_rank *dev;  /* the backend's, opened on the driver thread */
	bool dev_open;
	uint64_t memory_bytes;
	/* a cached call's batches, local rows, slots and slot ids (engine/ranks_cache.c) */
	struct embd_bag_batch *sub;
	uint32_t sub_cap;
	int64_t *rows, *ids;
	uint64_t *slots;
	uint64_t ids_cap;
	bool ids_registered;            /* ids: embd_ranks_dma_alloc */
	uint32_t cached_shards;         /* fused_uvm_caching shards of the rank */
};

struct embd_ranks {
	uint32_t num_ranks, threads_per_rank;
	enum embd_compute_device device;
	const struct embd_backend *backend;
	bool numa;
	struct rank *ranks;
	struct rank_alloc *allocs;
	pthread_mutex_t mu;
	pthread_cond_t go, done;
	uint64_t generation;
	uint32_t pending;
	bool stop;
	embd_ranks_fn fn;
	void *arg;
	bool cpu_caching;               /* EMBD_TEST_CPU_KERNEL=fused_uvm_caching: tests */
	uint64_t peer_bytes[2];         /* embd_ranks_partial_copy: device, host (atomic) */
	bool dma_warned;                /* a failed embd_ranks_dma_register was logged (atomic) */
	int start_rc;
	char start_err[256];
};

/* ---- engine/ranks_cache.c -------------------------------------------------------------- */

/* a's cache at ratio and its first slot rows; on failure a has none. */
int ranks_cache_open(struct embd_ranks *rs, struct rank_alloc *a, double ratio, char *err,
		     size_t err_len);
void ranks_cache_close(struct rank_alloc *a);
/* The rank's slot ids freed (registered with the ranks: while the ranks run). */
void ranks_cache_free_ids(struct rank *r);
/* The backend's forward with the batches on rank's cached shards mapped to their slots. */
int ranks_cache_forward(struct embd_ranks *rs, uint32_t rank, const struct embd_exec *exec,
			const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err);
/* The backend's backward of a's shard on its slots; the rows it updated become dirty. */
int ranks_cache_backward(struct embd_ranks *rs, struct rank_alloc *a,
			 const struct embd_exec *exec, const struct embd_bag_batch *batches,
			 uint32_t n, struct embd_kernel_err *err);
/* Dirty rows written back, the step with them: the host view reads as the shard. */
int ranks_cache_flush(struct embd_ranks *rs, struct rank_alloc *a, char *err, size_t err_len);
/* The host view is newer: every cached row forgotten, the step taken from it. */
void ranks_cache_invalidate(struct rank_alloc *a);

#endif /* EMBD_ENGINE_RANKS_INTERNAL_H */
