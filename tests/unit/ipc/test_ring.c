/*
 * Tests for ipc/ring.h: wrap-around, full/empty, hostile indices, NEED_WAKEUP, and a million
 * descriptors with checksums between two threads and between two processes sharing a memfd.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ipc/ring.h"

#define RING_SIZE 8u
#define MILLION 1000000u

struct entry {
	uint64_t seq;
	uint64_t check;         /* seq * golden ratio: a corrupted or misordered entry shows */
};

static uint64_t check_of(uint64_t seq)
{
	return seq * 0x9e3779b97f4a7c15ull;
}

static void *ring_mem(uint32_t size)
{
	void *mem = aligned_alloc(64, (size_t)embd_ring_bytes(size, sizeof(struct entry)));
	cr_assert_not_null(mem);
	embd_ring_format(mem);
	return mem;
}

Test(ring, full_empty_and_wrap)
{
	void *mem = ring_mem(RING_SIZE);
	struct embd_ring p = { 0 }, c = { 0 };
	struct entry e;
	uint64_t next_push = 0, next_pop = 0;

	cr_assert_eq(embd_ring_attach(&p, mem, RING_SIZE, sizeof(e), EMBD_RING_PRODUCER), 0);
	cr_assert_eq(embd_ring_attach(&c, mem, RING_SIZE, sizeof(e), EMBD_RING_CONSUMER), 0);
	cr_assert_eq(embd_ring_pop(&c, &e), EMBD_EAGAIN, "a new ring must be empty");
	/* 100 rounds of "fill completely, drain half" walk the indices around the ring many times */
	for (int round = 0; round < 100; round++) {
		while (embd_ring_count(&p) < RING_SIZE) {
			e.seq = next_push;
			e.check = check_of(next_push++);
			cr_assert_eq(embd_ring_push(&p, &e), 0);
		}
		e.seq = 12345;
		cr_assert_eq(embd_ring_push(&p, &e), EMBD_ENOSPC, "push into a full ring must fail");
		for (uint32_t i = 0; i < RING_SIZE / 2; i++) {
			cr_assert_eq(embd_ring_pop(&c, &e), 0);
			cr_assert_eq(e.seq, next_pop, "expected seq %lu, got %lu",
				     (unsigned long)next_pop, (unsigned long)e.seq);
			cr_assert_eq(e.check, check_of(next_pop++));
		}
	}
	while (embd_ring_pop(&c, &e) == 0)
		cr_assert_eq(e.seq, next_pop++);
	cr_assert_eq(next_pop, next_push, "drained %lu of %lu", (unsigned long)next_pop,
		     (unsigned long)next_push);
	free(mem);
}

Test(ring, indices_wrap_at_2_pow_32)
{
	void *mem = ring_mem(RING_SIZE);
	struct embd_ring_shared *sh = mem;
	struct embd_ring p = { 0 }, c = { 0 };
	struct entry e;

	atomic_store(&sh->head, UINT32_MAX - 2);
	atomic_store(&sh->tail, UINT32_MAX - 2);
	cr_assert_eq(embd_ring_attach(&p, mem, RING_SIZE, sizeof(e), EMBD_RING_PRODUCER), 0);
	cr_assert_eq(embd_ring_attach(&c, mem, RING_SIZE, sizeof(e), EMBD_RING_CONSUMER), 0);
	for (uint64_t i = 0; i < 6; i++) {
		e.seq = i;
		cr_assert_eq(embd_ring_push(&p, &e), 0);
	}
	cr_assert_eq(embd_ring_count(&c), 6, "count across the wrap");
	cr_assert_lt(atomic_load(&sh->tail), 8u, "tail should have wrapped past zero");
	for (uint64_t i = 0; i < 6; i++) {
		cr_assert_eq(embd_ring_pop(&c, &e), 0);
		cr_assert_eq(e.seq, i);
	}
	free(mem);
}

Test(ring, hostile_indices_are_errors)
{
	void *mem = ring_mem(RING_SIZE);
	struct embd_ring_shared *sh = mem;
	struct embd_ring p = { 0 }, c = { 0 };
	struct entry e = { 0 };

	cr_assert_eq(embd_ring_attach(&c, mem, RING_SIZE, sizeof(e), EMBD_RING_CONSUMER), 0);
	cr_assert_eq(embd_ring_attach(&p, mem, RING_SIZE, sizeof(e), EMBD_RING_PRODUCER), 0);
	/* a hostile producer claims size + 1 entries, then a tail behind head */
	atomic_store(&sh->tail, RING_SIZE + 1);
	cr_assert_eq(embd_ring_pop(&c, &e), EMBD_EPROTO);
	atomic_store(&sh->tail, UINT32_MAX);
	cr_assert_eq(embd_ring_pop(&c, &e), EMBD_EPROTO);
	/* exactly size is legal (a full ring) */
	atomic_store(&sh->tail, RING_SIZE);
	cr_assert_eq(embd_ring_count(&c), RING_SIZE);
	/* a hostile consumer moves head past the producer's private tail */
	atomic_store(&sh->head, 5);
	cr_assert_eq(embd_ring_push(&p, &e), EMBD_EPROTO);
	cr_assert_eq(embd_ring_attach(&p, mem, 6, sizeof(e), EMBD_RING_PRODUCER), EMBD_EINVAL,
		     "size 6 is not a power of two");
	free(mem);
}

/* room(want) says whether want more pushes would succeed, from the cached head when that is
 * enough, and a corrupt head is an error there too. */
Test(ring, room_for_pushes_to_come)
{
	void *mem = ring_mem(RING_SIZE);
	struct embd_ring_shared *sh = mem;
	struct embd_ring p = { 0 }, c = { 0 };
	struct entry e = { 0 };

	cr_assert_eq(embd_ring_attach(&c, mem, RING_SIZE, sizeof(e), EMBD_RING_CONSUMER), 0);
	cr_assert_eq(embd_ring_attach(&p, mem, RING_SIZE, sizeof(e), EMBD_RING_PRODUCER), 0);
	cr_assert_eq(embd_ring_room(&p, RING_SIZE), 1);
	cr_assert_eq(embd_ring_room(&p, RING_SIZE + 1), 0);
	for (uint32_t i = 0; i < RING_SIZE - 2; i++)
		cr_assert_eq(embd_ring_push(&p, &e), 0);
	cr_assert_eq(embd_ring_room(&p, 2), 1);
	cr_assert_eq(embd_ring_room(&p, 3), 0, "6 of 8 in flight: 3 more do not fit");
	cr_assert_eq(embd_ring_pop(&c, &e), 0);
	cr_assert_eq(embd_ring_room(&p, 3), 1, "one consumed: 3 fit again");
	for (uint32_t i = 0; i < 3; i++)
		cr_assert_eq(embd_ring_push(&p, &e), 0);
	cr_assert_eq(embd_ring_room(&p, 1), 0, "full");
	cr_assert_eq(embd_ring_push(&p, &e), EMBD_ENOSPC);
	/* a hostile consumer's head past the producer's tail */
	atomic_store(&sh->head, atomic_load(&sh->tail) + 1);
	cr_assert_eq(embd_ring_room(&p, 1), EMBD_EPROTO);
	free(mem);
}

Test(ring, need_wakeup_flag)
{
	void *mem = ring_mem(RING_SIZE);
	struct embd_ring p = { 0 }, c = { 0 };
	struct entry e = { 0 };
	uint32_t seen;

	cr_assert_eq(embd_ring_attach(&p, mem, RING_SIZE, sizeof(e), EMBD_RING_PRODUCER), 0);
	cr_assert_eq(embd_ring_attach(&c, mem, RING_SIZE, sizeof(e), EMBD_RING_CONSUMER), 0);
	cr_assert(!embd_ring_needs_wakeup(&p), "a busy consumer needs no wakeup");
	cr_assert(embd_ring_sleep_prepare(&c, &seen), "empty ring: consumer may sleep");
	cr_assert(embd_ring_needs_wakeup(&p), "sleeping consumer must be advertised");
	cr_assert_eq(embd_ring_push(&p, &e), 0);
	cr_assert(!embd_ring_sleep_prepare(&c, &seen), "non-empty ring: consumer must not sleep");
	embd_ring_sleep_finish(&c);
	cr_assert(!embd_ring_needs_wakeup(&p));
	free(mem);
}

static void produce(void *mem)
{
	struct embd_ring p = { 0 };
	struct entry e;

	cr_assert_eq(embd_ring_attach(&p, mem, 64, sizeof(e), EMBD_RING_PRODUCER), 0);
	for (uint64_t i = 0; i < MILLION; i++) {
		e.seq = i;
		e.check = check_of(i);
		while (embd_ring_push(&p, &e) == EMBD_ENOSPC)
			;
	}
}

static void consume_all(void *mem)
{
	struct embd_ring c = { 0 };
	struct entry e;
	uint64_t sum = 0;

	cr_assert_eq(embd_ring_attach(&c, mem, 64, sizeof(e), EMBD_RING_CONSUMER), 0);
	for (uint64_t i = 0; i < MILLION; i++) {
		int rc;
		while ((rc = embd_ring_pop(&c, &e)) == EMBD_EAGAIN)
			;
		cr_assert_eq(rc, 0);
		cr_assert_eq(e.seq, i, "expected seq %lu, got %lu", (unsigned long)i, (unsigned long)e.seq);
		cr_assert_eq(e.check, check_of(i), "entry %lu corrupted", (unsigned long)i);
		sum += e.check;
	}
	uint64_t want = 0;
	for (uint64_t i = 0; i < MILLION; i++)
		want += check_of(i);
	cr_assert_eq(sum, want);
}

static void *producer_thread(void *mem)
{
	produce(mem);
	return NULL;
}

Test(ring, million_between_threads)
{
	void *mem = ring_mem(64);
	pthread_t t;

	cr_assert_eq(pthread_create(&t, NULL, producer_thread, mem), 0);
	consume_all(mem);
	pthread_join(t, NULL);
	free(mem);
}

Test(ring, million_between_processes)
{
	int fd = memfd_create("test-ring", MFD_CLOEXEC);
	size_t bytes = (size_t)embd_ring_bytes(64, sizeof(struct entry));
	void *mem;
	pid_t pid;
	int status;

	cr_assert_geq(fd, 0);
	cr_assert_eq(ftruncate(fd, (off_t)bytes), 0);
	mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert_neq(mem, MAP_FAILED);
	embd_ring_format(mem);
	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		/* the child maps the memfd afresh, as a client process would */
		void *child = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (child == MAP_FAILED)
			_exit(2);
		produce(child);
		_exit(0);
	}
	consume_all(mem);
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "producer process failed: %d", status);
	munmap(mem, bytes);
	close(fd);
}
