/*
 * The node's CPU ranks (engine/ranks.h). Each rank is a driver thread that sleeps on one
 * condition variable shared by all ranks; embd_ranks_run bumps a generation number, every
 * driver runs the function once for that generation, and the last one to finish wakes the
 * caller. A step has a handful of such phases, so a condvar round trip per phase is cheap next
 * to the lookups themselves.
 */
#include "engine/ranks.h"

#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct rank_alloc {
	struct rank_alloc *next;
	struct embd_shard *shard;
	uint32_t rank;
	void *mem[3];                   /* weights, momentum1, momentum2 */
	uint64_t bytes[3];
};

struct rank {
	struct embd_ranks *owner;
	uint32_t index;
	int node;
	int *cpus;                      /* threads_per_rank */
	pthread_t thread;
	bool started;
	struct embd_workers *workers;
	uint64_t memory_bytes;
};

struct embd_ranks {
	uint32_t num_ranks, threads_per_rank;
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
	int start_rc;
	char start_err[256];
};

static void *rank_main(void *p)
{
	struct rank *r = p;
	struct embd_ranks *rs = r->owner;
	char err[256] = "";
	uint64_t seen = 0;

	/* the pool pins this thread to cpus[0]: it is worker 0 of every kernel call */
	int rc = embd_workers_create(rs->threads_per_rank, r->cpus, &r->workers, err, sizeof(err));
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
		r->node = (int)((uint64_t)i * (uint64_t)nodes / rs->num_ranks);
		/* position of rank i among the ranks of its node */
		uint32_t first = 0;
		while ((int)((uint64_t)first * (uint64_t)nodes / rs->num_ranks) != r->node)
			first++;
		uint32_t n = node_cpus(rs->numa, r->node, avail, CPU_SETSIZE);
		if (!n) {
			free(avail);
			snprintf(err, err_len, "rank %u: no CPU is allowed for this process", i);
			return EMBD_EINVAL;
		}
		for (uint32_t t = 0; t < rs->threads_per_rank; t++)
			r->cpus[t] = avail[((i - first) * rs->threads_per_rank + t) % n];
	}
	free(avail);
	return 0;
}

int embd_ranks_create(uint32_t num_ranks, uint32_t threads_per_rank, struct embd_ranks **out,
		      char *err, size_t err_len)
{
	struct embd_ranks *rs;
	int rc;

	*out = NULL;
	if (!num_ranks || !threads_per_rank) {
		snprintf(err, err_len, "ranks %u and threads_per_rank %u must be at least 1",
			 num_ranks, threads_per_rank);
		return EMBD_EINVAL;
	}
	rs = calloc(1, sizeof(*rs));
	if (!rs)
		return EMBD_ENOMEM;
	pthread_mutex_init(&rs->mu, NULL);
	pthread_cond_init(&rs->go, NULL);
	pthread_cond_init(&rs->done, NULL);
	rs->num_ranks = num_ranks;
	rs->threads_per_rank = threads_per_rank;
	rs->numa = numa_available() >= 0;
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
	if (rs->ranks) {
		pthread_mutex_lock(&rs->mu);
		rs->stop = true;
		pthread_cond_broadcast(&rs->go);
		pthread_mutex_unlock(&rs->mu);
		for (uint32_t i = 0; i < rs->num_ranks; i++) {
			if (rs->ranks[i].started)
				pthread_join(rs->ranks[i].thread, NULL);
			free(rs->ranks[i].cpus);
		}
	}
	while (rs->allocs)
		embd_ranks_free_shard(rs, rs->allocs->shard);
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

static void free_mem(bool numa, void *p, uint64_t bytes)
{
	if (!p)
		return;
	if (numa)
		numa_free(p, bytes);
	else
		free(p);
}

static void *alloc_mem(bool numa, int node, uint64_t bytes)
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

int embd_ranks_alloc_shard(struct embd_ranks *rs, uint32_t rank,
			   const struct embd_shard_desc *desc, struct embd_shard **out, char *err,
			   size_t err_len)
{
	struct rank_alloc *a = NULL;
	int rc;

	*out = NULL;
	if (rank >= rs->num_ranks) {
		snprintf(err, err_len, "rank %u: only %u ranks", rank, rs->num_ranks);
		return EMBD_EINVAL;
	}
	a = calloc(1, sizeof(*a));
	if (!a)
		return EMBD_ENOMEM;
	rc = embd_shard_sizes(desc, &a->bytes[0], &a->bytes[1], &a->bytes[2], err, err_len);
	if (rc)
		goto out;
	rc = EMBD_ENOMEM;
	for (int i = 0; i < 3; i++) {
		a->mem[i] = alloc_mem(rs->numa, rs->ranks[rank].node, a->bytes[i]);
		if (a->bytes[i] && !a->mem[i]) {
			snprintf(err, err_len, "rank %u: cannot allocate %llu bytes on NUMA node %d",
				 rank, (unsigned long long)a->bytes[i], rs->ranks[rank].node);
			goto out;
		}
	}
	rc = embd_shard_create_in(desc, a->mem[0], a->mem[1], a->mem[2], &a->shard, err, err_len);
	if (rc)
		goto out;
	a->rank = rank;
	a->next = rs->allocs;
	rs->allocs = a;
	rs->ranks[rank].memory_bytes += a->bytes[0] + a->bytes[1] + a->bytes[2];
	*out = a->shard;
	return 0;
out:
	for (int i = 0; i < 3; i++)
		free_mem(rs->numa, a->mem[i], a->bytes[i]);
	free(a);
	return rc;
}

void embd_ranks_free_shard(struct embd_ranks *rs, struct embd_shard *shard)
{
	for (struct rank_alloc **p = &rs->allocs; *p; p = &(*p)->next) {
		struct rank_alloc *a = *p;
		if (a->shard != shard)
			continue;
		*p = a->next;
		embd_shard_destroy(a->shard);
		for (int i = 0; i < 3; i++)
			free_mem(rs->numa, a->mem[i], a->bytes[i]);
		rs->ranks[a->rank].memory_bytes -= a->bytes[0] + a->bytes[1] + a->bytes[2];
		free(a);
		return;
	}
}
