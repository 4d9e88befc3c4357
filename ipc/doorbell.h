/*
 * ipc/doorbell.h - waking a sleeping ring consumer in another process, and sleeping as one.
 *
 * The one idea: a doorbell is a 32-bit futex word in the region (one per ring, see ring.h).
 * The producer rings only when the consumer advertised NEED_WAKEUP; ringing increments the
 * word and issues FUTEX_WAKE (shared, not private: the waiter is another process), plus an
 * eventfd write when the sleeper waits on an eventfd instead (service event loops on kernels
 * without IORING_OP_FUTEX_WAIT, see ipc/evloop.h). A consumer spins a bounded number of times,
 * then sleeps on the word with the value it read before its last look at the ring.
 */
#ifndef EMBD_IPC_DOORBELL_H
#define EMBD_IPC_DOORBELL_H

#include <stdatomic.h>
#include <stdint.h>

#include "embd/types.h"
#include "ipc/ring.h"

struct embd_doorbell {
	_Atomic uint32_t *word;         /* the ring's doorbell word, in the region */
	int eventfd;                    /* also written on every ring when >= 0; not owned */
};

/* Binds a doorbell to `ring`'s word; eventfd is -1 unless the sleeper reads an eventfd. */
void embd_doorbell_init(struct embd_doorbell *db, const struct embd_ring *ring, int eventfd);

/* Increments the word and wakes every sleeper (futex and eventfd). Returns 0 or EMBD_EIO. */
int embd_doorbell_ring(const struct embd_doorbell *db);

/*
 * Producer, after one or more embd_ring_push: rings the doorbell only when the consumer
 * advertised NEED_WAKEUP. Returns 1 when it rang, 0 when suppressed, or EMBD_EIO.
 */
int embd_doorbell_notify(const struct embd_ring *ring, const struct embd_doorbell *db);

/*
 * Sleeps on the word while it still equals `seen`, at most timeout_ms (< 0: no limit).
 * Returns 0 (woken, or the word had moved already), EMBD_ETIMEDOUT, or EMBD_EIO.
 * Spurious returns are allowed: callers re-check their ring.
 */
int embd_doorbell_sleep(const struct embd_doorbell *db, uint32_t seen, int timeout_ms);

/*
 * Consumer: returns once `ring` holds an entry. Polls it spin_iters times, then sets
 * NEED_WAKEUP and sleeps on the doorbell, for at most timeout_ms in all (< 0: no limit).
 * Returns 0 (an entry is ready, or the peer's index is corrupt: the next pop says which),
 * EMBD_ETIMEDOUT, or EMBD_EIO. NEED_WAKEUP is cleared again before it returns.
 */
int embd_doorbell_wait(struct embd_ring *ring, const struct embd_doorbell *db, uint32_t spin_iters,
		       int timeout_ms);

#endif /* EMBD_IPC_DOORBELL_H */
