/*
 * ipc/evloop.c - the service's io_uring event loop (see evloop.h).
 *
 * Each source owns one slot; its in-flight request carries user_data = generation << 32 |
 * slot, so a completion that arrives after the slot was removed and reused is recognised and
 * dropped. A removed source with a request still in the kernel stays a "zombie" slot until the
 * cancellation's completion arrives. Debian's liburing 2.3 has no io_uring_prep_futex_wait,
 * so the FUTEX_WAIT SQE is built here by hand from the kernel's ABI (io_uring/futex.c):
 * fd = futex2 flags, addr = word, off = expected value, addr3 = bitset mask.
 */
#include "ipc/evloop.h"

#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"

#define EVLOOP_OP_FUTEX_WAIT 51         /* IORING_OP_FUTEX_WAIT, Linux 6.7 */
#define EVLOOP_FUTEX2_SIZE_U32 0x02u    /* FUTEX2_SIZE_U32; no FUTEX2_PRIVATE: cross-process */
#define EVLOOP_FUTEX_BITSET_ANY 0xffffffffu
#define EVLOOP_CANCEL_DATA UINT64_MAX   /* user_data of cancel requests, whose CQEs are dropped */
#ifdef IORING_OP_FUTEX_WAIT
_Static_assert(IORING_OP_FUTEX_WAIT == EVLOOP_OP_FUTEX_WAIT, "io_uring futex opcode");
#endif

struct source {
	bool in_use;                    /* registered by the caller */
	bool pending;                   /* a request is in the kernel */
	bool is_doorbell;
	uint32_t gen;
	uint64_t tag;
	int fd;                         /* polled fd, or the doorbell's eventfd */
	_Atomic uint32_t *word;         /* doorbell word (FUTEX mode) */
};

struct embd_evloop {
	struct io_uring ring;
	enum embd_doorbell_mode mode;
	uint32_t max_sources;
	uint32_t sources_end;           /* 1 + the highest slot ever taken: scans stop here */
	struct source *src;
};

static void prep_futex_wait(struct io_uring_sqe *sqe, _Atomic uint32_t *word, uint32_t seen)
{
	io_uring_prep_rw(EVLOOP_OP_FUTEX_WAIT, sqe, (int)EVLOOP_FUTEX2_SIZE_U32, (void *)word, 0, seen);
	sqe->rw_flags = 0;              /* the kernel's sqe->futex_flags: must be zero */
	sqe->addr3 = EVLOOP_FUTEX_BITSET_ANY;
}

/* An SQE, flushing the submission queue once when it is full. */
static struct io_uring_sqe *get_sqe(struct embd_evloop *loop)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(&loop->ring);

	if (!sqe) {
		io_uring_submit(&loop->ring);
		sqe = io_uring_get_sqe(&loop->ring);
	}
	return sqe;
}

/*
 * A trial wait on a private word whose value differs from the expected one: a kernel that
 * knows IORING_OP_FUTEX_WAIT completes it at once with -EAGAIN; an older one says -EINVAL.
 */
static bool futex_wait_supported(struct io_uring *ring)
{
	_Atomic uint32_t word = 0;
	struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
	struct io_uring_cqe *cqe;
	bool ok;

	if (!sqe)
		return false;
	prep_futex_wait(sqe, &word, 1);
	sqe->user_data = EVLOOP_CANCEL_DATA;
	if (io_uring_submit_and_wait(ring, 1) < 0 || io_uring_wait_cqe(ring, &cqe) != 0)
		return false;
	ok = cqe->res == -EAGAIN;
	io_uring_cqe_seen(ring, cqe);
	return ok;
}

int embd_evloop_create(struct embd_evloop **out, enum embd_doorbell_mode mode, uint32_t max_sources,
		       char *err, size_t err_len)
{
	struct embd_evloop *loop;
	unsigned entries = 8;
	int rc;

	*out = NULL;
	if (max_sources == 0 || max_sources > 65536)
		return embd_fail(err, err_len, EMBD_EINVAL, "max_sources: %u is not in [1, 65536]",
				max_sources);
	while (entries < 2 * max_sources + 8)
		entries *= 2;
	loop = calloc(1, sizeof(*loop));
	if (!loop)
		return embd_fail(err, err_len, EMBD_ENOMEM, "evloop: out of memory");
	loop->src = calloc(max_sources, sizeof(*loop->src));
	if (!loop->src) {
		free(loop);
		return embd_fail(err, err_len, EMBD_ENOMEM, "evloop: out of memory");
	}
	loop->max_sources = max_sources;
	rc = io_uring_queue_init(entries, &loop->ring, 0);
	if (rc < 0) {
		free(loop->src);
		free(loop);
		return embd_fail(err, err_len, rc == -ENOMEM ? EMBD_ENOMEM : EMBD_EIO,
				"evloop: io_uring_queue_init(%u): %s", entries, strerror(-rc));
	}
	if (mode != EMBD_DOORBELL_EVENTFD) {
		bool futex = futex_wait_supported(&loop->ring);
		if (!futex && mode == EMBD_DOORBELL_FUTEX) {
			embd_evloop_destroy(loop);
			return embd_fail(err, err_len, EMBD_ENOTSUP,
					"evloop: the kernel rejects IORING_OP_FUTEX_WAIT");
		}
		mode = futex ? EMBD_DOORBELL_FUTEX : EMBD_DOORBELL_EVENTFD;
	}
	loop->mode = mode;
	*out = loop;
	return 0;
}

void embd_evloop_destroy(struct embd_evloop *loop)
{
	if (!loop)
		return;
	io_uring_queue_exit(&loop->ring);       /* cancels and reaps every request */
	free(loop->src);
	free(loop);
}

enum embd_doorbell_mode embd_evloop_doorbell_mode(const struct embd_evloop *loop)
{
	return loop->mode;
}

static struct source *find(struct embd_evloop *loop, uint64_t tag)
{
	for (uint32_t i = 0; i < loop->sources_end; i++)
		if (loop->src[i].in_use && loop->src[i].tag == tag)
			return &loop->src[i];
	return NULL;
}

static int add_source(struct embd_evloop *loop, uint64_t tag, int fd, _Atomic uint32_t *word,
		      bool is_doorbell)
{
	if (find(loop, tag))
		return EMBD_EBUSY;
	for (uint32_t i = 0; i < loop->max_sources; i++) {
		struct source *s = &loop->src[i];
		if (s->in_use || s->pending)
			continue;
		s->in_use = true;
		s->is_doorbell = is_doorbell;
		s->gen++;
		s->tag = tag;
		s->fd = fd;
		s->word = word;
		if (i >= loop->sources_end)
			loop->sources_end = i + 1;
		return 0;
	}
	return EMBD_ENOSPC;
}

int embd_evloop_add_fd(struct embd_evloop *loop, int fd, uint64_t tag)
{
	if (fd < 0)
		return EMBD_EINVAL;
	return add_source(loop, tag, fd, NULL, false);
}

int embd_evloop_add_doorbell(struct embd_evloop *loop, const struct embd_doorbell *db, uint64_t tag)
{
	if (loop->mode == EMBD_DOORBELL_EVENTFD && db->eventfd < 0)
		return EMBD_EINVAL;
	return add_source(loop, tag, db->eventfd, db->word, true);
}

static uint64_t source_data(const struct embd_evloop *loop, const struct source *s)
{
	return (uint64_t)s->gen << 32 | (uint64_t)(s - loop->src);
}

/* Queues the request that makes `s` fire; EMBD_ENOSPC when the SQ stays full. */
static int arm(struct embd_evloop *loop, struct source *s, uint32_t seen)
{
	struct io_uring_sqe *sqe = get_sqe(loop);

	if (!sqe)
		return EMBD_ENOSPC;
	if (s->is_doorbell && loop->mode == EMBD_DOORBELL_FUTEX)
		prep_futex_wait(sqe, s->word, seen);
	else
		io_uring_prep_poll_add(sqe, s->fd, POLLIN);
	io_uring_sqe_set_data64(sqe, source_data(loop, s));
	s->pending = true;
	return 0;
}

int embd_evloop_arm_doorbell(struct embd_evloop *loop, uint64_t tag, uint32_t seen)
{
	struct source *s = find(loop, tag);

	if (!s || !s->is_doorbell)
		return EMBD_ENOENT;
	if (s->pending)
		return 0;
	return arm(loop, s, seen);
}

int embd_evloop_remove(struct embd_evloop *loop, uint64_t tag)
{
	struct source *s = find(loop, tag);
	struct io_uring_sqe *sqe;

	if (!s)
		return EMBD_ENOENT;
	s->in_use = false;
	if (!s->pending)
		return 0;
	/* the slot stays reserved until the cancelled request's completion is reaped */
	sqe = get_sqe(loop);
	if (sqe) {
		io_uring_prep_cancel64(sqe, source_data(loop, s), 0);
		io_uring_sqe_set_data64(sqe, EVLOOP_CANCEL_DATA);
		io_uring_submit(&loop->ring);
	}
	return 0;
}

/* Drains an eventfd after its poll fired; a blocking eventfd cannot block here (POLLIN). */
static void drain_eventfd(int fd)
{
	uint64_t count;
	ssize_t n = read(fd, &count, sizeof(count));

	(void)n;        /* EAGAIN: another reader drained it; the ring is re-checked anyway */
}

/* Turns one CQE into an event; returns false when it is not reported (cancel, stale). */
static bool reap(struct embd_evloop *loop, const struct io_uring_cqe *cqe, struct embd_event *ev)
{
	uint64_t data = io_uring_cqe_get_data64(cqe);
	uint32_t idx = (uint32_t)data, gen = (uint32_t)(data >> 32);
	struct source *s;

	if (data == EVLOOP_CANCEL_DATA || idx >= loop->max_sources)
		return false;
	s = &loop->src[idx];
	if (s->gen != gen || !s->pending)
		return false;
	s->pending = false;
	if (!s->in_use || cqe->res == -ECANCELED)
		return false;
	ev->tag = s->tag;
	ev->kind = s->is_doorbell ? EMBD_EVENT_DOORBELL : EMBD_EVENT_FD;
	ev->result = cqe->res;
	if (s->is_doorbell) {
		if (loop->mode == EMBD_DOORBELL_EVENTFD && cqe->res > 0)
			drain_eventfd(s->fd);
		/* woken (0) and "word already moved" (-EAGAIN) both mean: look at the ring */
		if (cqe->res == -EAGAIN || cqe->res > 0)
			ev->result = 0;
	}
	return true;
}

int embd_evloop_wait(struct embd_evloop *loop, struct embd_event *events, uint32_t max_events,
		     int timeout_ms, uint32_t *n_out)
{
	struct __kernel_timespec ts;
	struct io_uring_cqe *cqe;
	uint32_t n = 0;
	int rc;

	*n_out = 0;
	/* sockets are level-triggered from the caller's view: re-poll each one that fired */
	for (uint32_t i = 0; i < loop->sources_end; i++) {
		struct source *s = &loop->src[i];
		if (s->in_use && !s->is_doorbell && !s->pending && arm(loop, s, 0) != 0)
			break;
	}
	if (timeout_ms == 0) {
		rc = io_uring_submit(&loop->ring);
	} else {
		ts.tv_sec = timeout_ms / 1000;
		ts.tv_nsec = (long long)(timeout_ms % 1000) * 1000000;
		rc = io_uring_submit_and_wait_timeout(&loop->ring, &cqe, 1, timeout_ms < 0 ? NULL : &ts, NULL);
	}
	if (rc < 0 && rc != -ETIME && rc != -EINTR && rc != -EBUSY)
		return EMBD_EIO;
	while (n < max_events && io_uring_peek_cqe(&loop->ring, &cqe) == 0) {
		if (reap(loop, cqe, &events[n]))
			n++;
		io_uring_cqe_seen(&loop->ring, cqe);
	}
	*n_out = n;
	return 0;
}
