/*
 * ipc/evloop.h - the service's one io_uring event loop: sleeping client doorbells, listening
 * and accepted sockets, and a timeout, all in a single io_uring_submit_and_wait.
 *
 * The one idea: every source is a one-shot request in the ring. A socket is polled for input
 * (IORING_OP_POLL_ADD) and re-armed by the loop itself after it fired; a doorbell is armed by
 * the caller with the value it saw before its last look at the ring (the NEED_WAKEUP
 * protocol of ring.h), as IORING_OP_FUTEX_WAIT on the word where the kernel supports it, or as
 * a read of the client's eventfd otherwise. Which of the two is in use is detected when the
 * loop is created (a trial futex wait) and reported by embd_evloop_doorbell_mode.
 */
#ifndef EMBD_IPC_EVLOOP_H
#define EMBD_IPC_EVLOOP_H

#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"
#include "ipc/doorbell.h"

enum embd_doorbell_mode {
	EMBD_DOORBELL_AUTO = 0,         /* futex where the kernel has it, else eventfd */
	EMBD_DOORBELL_FUTEX = 1,        /* IORING_OP_FUTEX_WAIT on the word (Linux >= 6.7) */
	EMBD_DOORBELL_EVENTFD = 2,      /* read an eventfd the client writes on every ring */
};

enum embd_event_kind {
	EMBD_EVENT_FD = 1,              /* a watched fd is readable (or hung up: result has POLL*) */
	EMBD_EVENT_DOORBELL = 2,        /* a doorbell moved (or was rung); re-arm before sleeping */
};

struct embd_event {
	uint64_t tag;                   /* the caller's tag of the source */
	enum embd_event_kind kind;
	int32_t result;                 /* FD: poll revents mask, or negative errno on error */
};

struct embd_evloop;

/*
 * Creates a loop for up to max_sources watched fds and doorbells. `mode` AUTO probes the
 * kernel; FUTEX fails with EMBD_ENOTSUP where the kernel rejects IORING_OP_FUTEX_WAIT.
 * Returns 0, EMBD_EINVAL, EMBD_ENOMEM, EMBD_ENOTSUP or EMBD_EIO (io_uring_queue_init), with
 * a message in err.
 */
int embd_evloop_create(struct embd_evloop **out, enum embd_doorbell_mode mode, uint32_t max_sources,
		       char *err, size_t err_len);

/* Cancels every pending request and frees the loop. NULL is a no-op. */
void embd_evloop_destroy(struct embd_evloop *loop);

/* FUTEX or EVENTFD: the mechanism this loop sleeps on doorbells with. */
enum embd_doorbell_mode embd_evloop_doorbell_mode(const struct embd_evloop *loop);

/* Watches `fd` for input until removed; each readiness yields one EMBD_EVENT_FD. */
int embd_evloop_add_fd(struct embd_evloop *loop, int fd, uint64_t tag);

/*
 * Registers a doorbell (not armed yet). In EVENTFD mode db->eventfd must be a valid eventfd
 * (EFD_NONBLOCK is fine) that the producer's doorbell writes; in FUTEX mode it is ignored.
 * The region holding db->word must stay mapped until embd_evloop_remove returns.
 */
int embd_evloop_add_doorbell(struct embd_evloop *loop, const struct embd_doorbell *db, uint64_t tag);

/*
 * Arms the doorbell `tag` to fire once the word differs from `seen` (FUTEX) or the eventfd
 * is written (EVENTFD). A no-op when already armed. Call after embd_ring_sleep_prepare said
 * the ring is empty. Returns 0, EMBD_ENOENT (no such tag) or EMBD_ENOSPC (io_uring SQ full).
 */
int embd_evloop_arm_doorbell(struct embd_evloop *loop, uint64_t tag, uint32_t seen);

/* Stops watching `tag` (its pending request is cancelled). Returns 0 or EMBD_ENOENT. */
int embd_evloop_remove(struct embd_evloop *loop, uint64_t tag);

/*
 * Submits what is armed and waits up to timeout_ms (< 0: no limit, 0: poll) for events;
 * stores up to max_events in events and their count in *n_out (0 on timeout).
 * Returns 0 or EMBD_EIO.
 */
int embd_evloop_wait(struct embd_evloop *loop, struct embd_event *events, uint32_t max_events,
		     int timeout_ms, uint32_t *n_out);

#endif /* EMBD_IPC_EVLOOP_H */
