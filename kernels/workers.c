/*
 * Worker pool: fork-join over a fixed set of pthreads.
 *
 * A run publishes (fn, arg) and bumps `generation` under the mutex; workers wait until the
 * generation changes, run fn, and the last one to finish signals `done`. Waiting spins for up
 * to SPIN_NS first and only then sleeps on a condition variable: a futex wake-up costs tens of
 * microseconds under virtualization, as much as a whole small batch, while back-to-back runs
 * (a step's forward, backward, the next batch) find the workers still spinning. The kernels
 * split work inside fn, so the pool needs no queue.
 */
#include "kernels/workers.h"
#include "common/clock.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "embd/types.h"

#define SPIN_NS 200000ull               /* 0.2 ms: longer gaps between runs sleep */

struct worker {
	struct embd_workers *pool;
	uint32_t index;
	pthread_t thread;
};

struct embd_workers {
	uint32_t num_workers;
	pthread_mutex_t lock;
	pthread_cond_t start;
	pthread_cond_t done;
	_Atomic uint64_t generation;    /* bumped by every run (under lock); workers wait for a change */
	_Atomic uint32_t running;       /* threads still inside fn in this generation */
	bool stop;
	embd_workers_fn fn;
	void *arg;
	uint32_t started;               /* threads created, for destroy after a failed create */
	struct worker threads[];        /* num_workers - 1 entries: workers 1.. */
};

/* Spins until *word != value or SPIN_NS pass; returns whether it changed. */
static bool spin_while_equal(_Atomic uint64_t *word, uint64_t value)
{
	uint64_t start = embd_now_ns();

	for (unsigned i = 1;; i++) {
		if (atomic_load_explicit(word, memory_order_acquire) != value)
			return true;
		if (i % 64 == 0 && embd_now_ns() - start > SPIN_NS)
			return false;
	}
}

static void *worker_main(void *p)
{
	struct worker *w = p;
	struct embd_workers *pool = w->pool;
	uint64_t seen = 0;

	for (;;) {
		if (!spin_while_equal(&pool->generation, seen)) {
			pthread_mutex_lock(&pool->lock);
			while (atomic_load(&pool->generation) == seen && !pool->stop)
				pthread_cond_wait(&pool->start, &pool->lock);
			pthread_mutex_unlock(&pool->lock);
		}
		/* fn and arg were written before the generation's release (under the lock) */
		pthread_mutex_lock(&pool->lock);
		bool stop = pool->stop;
		seen = atomic_load(&pool->generation);
		embd_workers_fn fn = pool->fn;
		void *arg = pool->arg;
		pthread_mutex_unlock(&pool->lock);
		if (stop)
			break;

		fn(arg, w->index, pool->num_workers);

		if (atomic_fetch_sub_explicit(&pool->running, 1, memory_order_acq_rel) == 1) {
			pthread_mutex_lock(&pool->lock);
			pthread_cond_signal(&pool->done);
			pthread_mutex_unlock(&pool->lock);
		}
	}
	return NULL;
}

static int pin(pthread_t thread, int cpu)
{
	cpu_set_t set;

	if (cpu < 0 || cpu >= CPU_SETSIZE)
		return EMBD_EINVAL;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	return -pthread_setaffinity_np(thread, sizeof(set), &set);
}

int embd_workers_create(uint32_t num_workers, const int *cpus, struct embd_workers **out,
			char *err, size_t err_len)
{
	struct embd_workers *pool = NULL;
	int rc;

	*out = NULL;
	if (num_workers == 0 || num_workers > 4096) {
		snprintf(err, err_len, "num_workers %u outside [1, 4096]", num_workers);
		return EMBD_EINVAL;
	}
	pool = calloc(1, sizeof(*pool) + (num_workers - 1) * sizeof(pool->threads[0]));
	if (!pool) {
		snprintf(err, err_len, "out of memory for %u workers", num_workers);
		return EMBD_ENOMEM;
	}
	pool->num_workers = num_workers;
	pthread_mutex_init(&pool->lock, NULL);
	pthread_cond_init(&pool->start, NULL);
	pthread_cond_init(&pool->done, NULL);

	if (cpus) {
		rc = pin(pthread_self(), cpus[0]);
		if (rc) {
			snprintf(err, err_len, "cannot pin worker 0 to cpu %d: %s", cpus[0], strerror(-rc));
			goto out;
		}
	}
	for (uint32_t i = 1; i < num_workers; i++) {
		struct worker *w = &pool->threads[i - 1];

		w->pool = pool;
		w->index = i;
		rc = -pthread_create(&w->thread, NULL, worker_main, w);
		if (rc) {
			snprintf(err, err_len, "cannot start worker %u: %s", i, strerror(-rc));
			goto out;
		}
		pool->started++;
		if (cpus) {
			rc = pin(w->thread, cpus[i]);
			if (rc) {
				snprintf(err, err_len, "cannot pin worker %u to cpu %d: %s", i, cpus[i],
					 strerror(-rc));
				goto out;
			}
		}
	}
	*out = pool;
	return 0;
out:
	embd_workers_destroy(pool);
	return rc;
}

void embd_workers_destroy(struct embd_workers *pool)
{
	if (!pool)
		return;
	pthread_mutex_lock(&pool->lock);
	pool->stop = true;
	atomic_fetch_add(&pool->generation, 1); /* wakes spinning workers too */
	pthread_cond_broadcast(&pool->start);
	pthread_mutex_unlock(&pool->lock);
	for (uint32_t i = 0; i < pool->started; i++)
		pthread_join(pool->threads[i].thread, NULL);
	pthread_cond_destroy(&pool->done);
	pthread_cond_destroy(&pool->start);
	pthread_mutex_destroy(&pool->lock);
	free(pool);
}

uint32_t embd_workers_count(const struct embd_workers *pool)
{
	return pool ? pool->num_workers : 1;
}

void embd_workers_run(struct embd_workers *pool, embd_workers_fn fn, void *arg)
{
	if (!pool || pool->num_workers == 1) {
		fn(arg, 0, 1);
		return;
	}
	pthread_mutex_lock(&pool->lock);
	pool->fn = fn;
	pool->arg = arg;
	atomic_store_explicit(&pool->running, pool->num_workers - 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
	pthread_cond_broadcast(&pool->start);
	pthread_mutex_unlock(&pool->lock);

	fn(arg, 0, pool->num_workers);

	uint64_t start = embd_now_ns();
	for (unsigned i = 1; atomic_load_explicit(&pool->running, memory_order_acquire); i++) {
		if (i % 64 == 0 && embd_now_ns() - start > SPIN_NS) {
			pthread_mutex_lock(&pool->lock);
			while (atomic_load(&pool->running))
				pthread_cond_wait(&pool->done, &pool->lock);
			pthread_mutex_unlock(&pool->lock);
			break;
		}
	}
}
