/*
 * kernels/workers.h - the worker threads a rank owns, over which the CPU kernels split a batch.
 *
 * A fixed set of pthreads, optionally pinned one per CPU, that run one function at a time
 * ("fork-join"): embd_workers_run() hands fn to every worker, the calling thread takes part as
 * worker 0, and it returns when all have finished. Kernels divide work inside fn (usually by
 * grabbing chunks from an atomic counter), so the pool itself knows nothing about embeddings.
 * One embd_workers_run() at a time per pool; the pool is not reentrant.
 */
#ifndef EMBD_KERNELS_WORKERS_H
#define EMBD_KERNELS_WORKERS_H

#include <stddef.h>
#include <stdint.h>

struct embd_workers;

/* fn(arg, worker, num_workers): worker in [0, num_workers); 0 is the caller of run(). */
typedef void (*embd_workers_fn)(void *arg, uint32_t worker, uint32_t num_workers);

/*
 * Starts num_workers - 1 threads (num_workers >= 1). cpus: NULL, or num_workers CPU numbers:
 * thread i >= 1 is pinned to cpus[i], and the calling thread, worker 0 of every run, is pinned
 * to cpus[0] here (so create the pool on the thread that will call run()).
 * Returns 0, EMBD_EINVAL, EMBD_ENOMEM, or the pthread/affinity error as a negative errno, with
 * a message in err.
 */
int embd_workers_create(uint32_t num_workers, const int *cpus, struct embd_workers **out,
			char *err, size_t err_len);

/* Stops and joins the threads. NULL is a no-op. */
void embd_workers_destroy(struct embd_workers *workers);

/* Number of workers, the caller included; 1 for NULL. */
uint32_t embd_workers_count(const struct embd_workers *workers);

/* Runs fn on every worker and returns when all have returned. workers NULL: fn(arg, 0, 1). */
void embd_workers_run(struct embd_workers *workers, embd_workers_fn fn, void *arg);

#endif /* EMBD_KERNELS_WORKERS_H */
