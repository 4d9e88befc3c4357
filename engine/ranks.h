/*
 * engine/ranks.h - the node's CPU ranks: for each rank one driver thread that owns a pinned
 * worker pool (kernels/workers.h) and the memory of the rank's shards, taken from the rank's
 * NUMA node (libnuma) or from plain aligned allocation where NUMA is absent.
 *
 * The step engine hands every rank the same function at once (embd_ranks_run) and waits for
 * all: ranks work in parallel, each on its own shards, so no two threads ever touch one shard.
 * Shard memory is first touched (initialised) by its rank's driver thread, which keeps the
 * pages on the rank's node even where the kernel places memory on first touch.
 */
#ifndef EMBD_ENGINE_RANKS_H
#define EMBD_ENGINE_RANKS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/embedding.h"

struct embd_ranks;

/*
 * Starts num_ranks driver threads, each with threads_per_rank workers pinned to CPUs of its
 * NUMA node (rank r on node r * nodes / num_ranks; CPUs taken in order from the process's
 * allowed set of that node, wrapping when there are fewer CPUs than threads).
 */
int embd_ranks_create(uint32_t num_ranks, uint32_t threads_per_rank, struct embd_ranks **out,
		      char *err, size_t err_len);
/* Joins the threads and frees every shard still allocated. NULL is a no-op. */
void embd_ranks_destroy(struct embd_ranks *ranks);

uint32_t embd_ranks_count(const struct embd_ranks *ranks);
/* The NUMA node of rank (0 where NUMA is absent). */
int embd_ranks_node(const struct embd_ranks *ranks, uint32_t rank);
/* Bytes of shard memory (weights and optimizer state) allocated on rank. */
uint64_t embd_ranks_memory_bytes(const struct embd_ranks *ranks, uint32_t rank);

/* fn(arg, rank, exec) on every rank's driver thread at once; returns when all returned.
 * exec runs kernels on that rank's workers. Call from one thread at a time. */
typedef void (*embd_ranks_fn)(void *arg, uint32_t rank, const struct embd_exec *exec);
void embd_ranks_run(struct embd_ranks *ranks, embd_ranks_fn fn, void *arg);

/*
 * A shard of desc in rank's memory (uninitialised: initialise it from embd_ranks_run so the
 * rank's thread touches it first). Freed by embd_ranks_free_shard or embd_ranks_destroy.
 */
int embd_ranks_alloc_shard(struct embd_ranks *ranks, uint32_t rank,
			   const struct embd_shard_desc *desc, struct embd_shard **out, char *err,
			   size_t err_len);
void embd_ranks_free_shard(struct embd_ranks *ranks, struct embd_shard *shard);

#endif /* EMBD_ENGINE_RANKS_H */
