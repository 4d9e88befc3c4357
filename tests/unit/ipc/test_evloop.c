/*
 * Tests for ipc/evloop.h and ipc/doorbell.h: the io_uring loop wakes on a doorbell rung by
 * another process, on the futex path and on the eventfd path (each forced), and times out.
 */
#include <criterion/criterion.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ipc/evloop.h"
#include "ipc/protocol.h"
#include "ipc/region.h"

static void wake_from_child(enum embd_doorbell_mode mode)
{
	struct embd_region_params params = { .sq_entries = 8, .cq_entries = 8, .slab_bytes = 4096 };
	struct embd_region *svc = NULL;
	struct embd_evloop *loop = NULL;
	struct embd_doorbell db;
	struct embd_event ev[4];
	char err[256] = "";
	uint32_t seen, n = 0;
	int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	int rc, status;
	pid_t pid;

	rc = embd_evloop_create(&loop, mode, 4, err, sizeof(err));
	if (rc == EMBD_ENOTSUP)
		cr_skip_test("kernel lacks IORING_OP_FUTEX_WAIT: %s", err);
	cr_assert_eq(rc, 0, "%s", err);
	cr_assert_eq(embd_evloop_doorbell_mode(loop), mode);
	cr_assert_eq(embd_region_create(&svc, &params, NULL, err, sizeof(err)), 0, "%s", err);
	embd_doorbell_init(&db, embd_region_sq(svc), mode == EMBD_DOORBELL_EVENTFD ? efd : -1);
	cr_assert_eq(embd_evloop_add_doorbell(loop, &db, 42), 0);
	cr_assert(embd_ring_sleep_prepare(embd_region_sq(svc), &seen));
	cr_assert_eq(embd_evloop_arm_doorbell(loop, 42, seen), 0);
	cr_assert_eq(embd_evloop_wait(loop, ev, 4, 50, &n), 0);
	cr_assert_eq(n, 0, "nothing rang yet, got %u events", n);

	pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		struct embd_region *cli = NULL;
		struct embd_sqe sqe = { .opcode = EMBD_OP_NOP };
		struct embd_doorbell cdb;
		if (embd_region_attach(&cli, dup(embd_region_fd(svc)), NULL, 0) != 0)
			_exit(2);
		embd_doorbell_init(&cdb, embd_region_sq(cli), mode == EMBD_DOORBELL_EVENTFD ? efd : -1);
		usleep(20000);
		if (embd_ring_push(embd_region_sq(cli), &sqe) != 0)
			_exit(3);
		_exit(embd_doorbell_notify(embd_region_sq(cli), &cdb) == 1 ? 0 : 4);
	}
	cr_assert_eq(embd_evloop_wait(loop, ev, 4, 5000, &n), 0);
	cr_assert_eq(n, 1, "expected one doorbell event, got %u", n);
	cr_assert_eq(ev[0].tag, 42u);
	cr_assert_eq(ev[0].kind, EMBD_EVENT_DOORBELL);
	cr_assert_eq(ev[0].result, 0, "result %d", ev[0].result);
	embd_ring_sleep_finish(embd_region_sq(svc));
	cr_assert_eq(embd_ring_count(embd_region_sq(svc)), 1);
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
	cr_assert_eq(embd_evloop_remove(loop, 42), 0);
	embd_evloop_destroy(loop);
	embd_region_destroy(svc);
	close(efd);
}

Test(evloop, futex_doorbell_from_another_process)
{
	wake_from_child(EMBD_DOORBELL_FUTEX);
}

Test(evloop, eventfd_doorbell_from_another_process)
{
	wake_from_child(EMBD_DOORBELL_EVENTFD);
}

Test(evloop, socket_readable)
{
	struct embd_evloop *loop = NULL;
	struct embd_event ev[2];
	uint32_t n = 0;
	int sv[2];

	cr_assert_eq(embd_evloop_create(&loop, EMBD_DOORBELL_AUTO, 2, NULL, 0), 0);
	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
	cr_assert_eq(embd_evloop_add_fd(loop, sv[0], 7), 0);
	cr_assert_eq(embd_evloop_wait(loop, ev, 2, 20, &n), 0);
	cr_assert_eq(n, 0);
	cr_assert_eq(write(sv[1], "x", 1), 1);
	cr_assert_eq(embd_evloop_wait(loop, ev, 2, 2000, &n), 0);
	cr_assert_eq(n, 1, "expected the socket to be readable, got %u events", n);
	cr_assert_eq(ev[0].tag, 7u);
	cr_assert_eq(ev[0].kind, EMBD_EVENT_FD);
	embd_evloop_destroy(loop);
	close(sv[0]);
	close(sv[1]);
}
