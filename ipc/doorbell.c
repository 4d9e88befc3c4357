/*
 * ipc/doorbell.c - futex doorbells between processes (see doorbell.h for the protocol).
 *
 * The futex calls are shared (no FUTEX_PRIVATE_FLAG) because waker and sleeper are different
 * processes mapping the same memfd page; the kernel keys the futex by inode and offset.
 */
#include "ipc/doorbell.h"
#include "common/clock.h"

#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* A pause hint for the spin loop: keeps a hyperthread sibling fed and saves power. */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() atomic_signal_fence(memory_order_seq_cst)
#endif

#define DOORBELL_TIGHT_SPINS 256u

static long futex_call(_Atomic uint32_t *word, int op, uint32_t val, const struct timespec *timeout)
{
	return syscall(SYS_futex, (uint32_t *)word, op, val, timeout, NULL, 0);
}

void embd_doorbell_init(struct embd_doorbell *db, const struct embd_ring *ring, int eventfd)
{
	db->word = embd_ring_doorbell_word(ring);
	db->eventfd = eventfd;
}

int embd_doorbell_ring(const struct embd_doorbell *db)
{
	atomic_fetch_add_explicit(db->word, 1, memory_order_release);
	if (futex_call(db->word, FUTEX_WAKE, INT32_MAX, NULL) < 0)
		return EMBD_EIO;
	if (db->eventfd >= 0) {
		uint64_t one = 1;
		/* EAGAIN: the counter is saturated, so the reader is due to wake anyway */
		if (write(db->eventfd, &one, sizeof(one)) != (ssize_t)sizeof(one) && errno != EAGAIN)
			return EMBD_EIO;
	}
	return 0;
}

int embd_doorbell_notify(const struct embd_ring *ring, const struct embd_doorbell *db)
{
	int rc;

	if (!embd_ring_needs_wakeup(ring))
		return 0;
	rc = embd_doorbell_ring(db);
	return rc ? rc : 1;
}

int embd_doorbell_sleep(const struct embd_doorbell *db, uint32_t seen, int timeout_ms)
{
	struct timespec ts, *tsp = NULL;

	if (timeout_ms >= 0) {
		ts.tv_sec = timeout_ms / 1000;
		ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000;
		tsp = &ts;
	}
	if (futex_call(db->word, FUTEX_WAIT, seen, tsp) == 0)
		return 0;
	switch (errno) {
	case EAGAIN:    /* the word moved before we slept */
	case EINTR:
		return 0;
	case ETIMEDOUT:
		return EMBD_ETIMEDOUT;
	default:
		return EMBD_EIO;
	}
}

int embd_doorbell_wait(struct embd_ring *ring, const struct embd_doorbell *db, uint32_t spin_iters,
		       int timeout_ms)
{
	int64_t deadline_ns = timeout_ms >= 0 ? (int64_t)embd_now_ns() + (int64_t)timeout_ms * 1000000 : INT64_MAX;
	int rc = 0;

	/* the first looks are back to back: a pause costs ~40 ns on recent x86, as much as a
	 * quarter of a whole round trip; later ones pause to spare an SMT sibling */
	for (uint32_t i = 0; i < spin_iters; i++) {
		if (embd_ring_count(ring) != 0)
			return 0;
		embd_ring_touch_next(ring);
		if (i >= DOORBELL_TIGHT_SPINS)
			cpu_relax();
	}
	for (;;) {
		uint32_t seen;
		int left_ms = -1;

		if (!embd_ring_sleep_prepare(ring, &seen))
			break;
		if (timeout_ms >= 0) {
			int64_t left_ns = deadline_ns - (int64_t)embd_now_ns();
			if (left_ns <= 0) {
				rc = EMBD_ETIMEDOUT;
				break;
			}
			left_ms = (int)((left_ns + 999999) / 1000000);
		}
		rc = embd_doorbell_sleep(db, seen, left_ms);
		if (rc == EMBD_EIO)
			break;
		rc = 0;         /* woken or timed out: the loop re-checks ring and deadline */
	}
	embd_ring_sleep_finish(ring);
	return rc;
}
