/*
 * Integration: the life cycle of the service around trainers that die. A trainer killed at
 * any point of a step must not keep the service from exiting 0 on the first SIGTERM; a dead
 * trainer whose socket lives on in a child it forked is still noticed (by its pidfd) and
 * dropped; and connecting and killing trainers again and again leaves the service's open fds
 * and resident memory where they were. Each test runs the real embd (EMBD_BINARY) with a
 * small two-trainer config written here, its log kept in the fixture's log file.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "common/clock.h"
#include "tests/integration/service_fixture.h"
#include "tests/support/children.h"

#define BATCH 8
/* how long SIGTERM may take to stop embd: 5 s, because an ASan build on 2 loaded cores runs
 * its leak check at exit (the bug this guards against never exited at all) */
#define STOP_MS 5000

static char config_path[128];

/* One table, two features, two ranks (row_wise, so both ranks work on every step), local
 * batch `batch` (the region grows with it). */
static void start_batch(unsigned busy_poll_us, unsigned batch)
{
	snprintf(config_path, sizeof(config_path), "/tmp/embd-life-%d.json", (int)getpid());
	FILE *f = fopen(config_path, "w");
	cr_assert_not_null(f, "cannot write %s: %s", config_path, strerror(errno));
	fprintf(f, "{ \"tables\": [ {\"name\": \"t\", \"num_embeddings\": 256, \"embedding_dim\": 8,"
		" \"feature_names\": [\"f0\", \"f1\"], \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1},"
		" \"constraints\": {\"sharding_types\": [\"row_wise\"]} } ],\n"
		" \"topology\": {\"world_size\": 2, \"local_world_size\": 2, \"compute_device\": \"cpu\","
		" \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", \"batch_size\": %u},\n"
		" \"trainers_per_node\": 2, \"threads_per_rank\": 1, \"busy_poll_us\": %u }\n",
		batch, busy_poll_us);
	fclose(f);
	service_spawn(config_path, "info");
}

static void start(unsigned busy_poll_us)
{
	start_batch(busy_poll_us, BATCH);
}

/* Criterion fini: no trainer or embd outlives its test, even after a failed assertion. */
static void stop(void)
{
	tu_kill_children();
	service_stop_within(STOP_MS, NULL);
	unlink(config_path);
	unlink(service.log);
}

TestSuite(lifecycle, .fini = stop, .timeout = 60);

/* Every bag two ids; returns the id count. */
static uint64_t fill(struct embd_client *c, uint32_t salt)
{
	const struct embd_client_layout *l = embd_layout(c);
	struct embd_batch b;
	uint64_t n = 0;

	embd_batch_get(c, 0, &b);
	for (uint32_t i = 0; i < l->num_features * l->batch_size; i++) {
		b.lengths[i] = 2;
		b.values[n] = (int64_t)((i * 7u + salt) % 256u);
		b.values[n + 1] = (int64_t)((i * 13u + salt + 1) % 256u);
		n += 2;
	}
	memset(b.grad, 0, (size_t)l->batch_size * l->total_dim * sizeof(float));
	return n;
}

static int submit(struct embd_client *c, enum embd_request_op op, uint64_t step, uint64_t n)
{
	struct embd_request req = { .op = op, .step = step, .num_values = n, .user_data = step };

	return embd_submit(c, &req);
}

/* Where in a step trainer 1 is killed. */
enum kill_point {
	KILL_FORWARD_POSTED,    /* its FORWARD is in, trainer 0's is not: the step is collecting */
	KILL_BEFORE_BACKWARD,   /* both forwards ran; trainer 0 posted BACKWARD, 1 did not */
	KILL_BOTH_IDLE,         /* both forwards ran; nobody posted BACKWARD yet */
	KILL_IN_WAIT,           /* trainer 1 sleeps in embd_wait for its BACKWARD */
};

static const char *const kill_point_name[] = {
	"forward posted", "before backward", "both idle", "in embd_wait",
};

/*
 * Trainer 1 in a child: connects and writes its resumed step s to `ready` (a trainer that
 * joins between two forwards of the others joins at the next step, so the parent waits for
 * it), posts FORWARD s (and waits for it unless the step is to stay collecting), then for
 * KILL_IN_WAIT posts BACKWARD and waits for it; writes one byte to `ready` before it waits or
 * pauses. Never returns.
 */
static void trainer1(int ready, enum kill_point at)
{
	struct embd_client *c;
	char err[256], ok = 'y';

	if (embd_connect(service.socket, 1, 5000, &c, err, sizeof(err)))
		_exit(2);
	uint64_t s = embd_layout(c)->resumed_step, n = fill(c, 1);
	if (write(ready, &s, sizeof(s)) != sizeof(s))
		_exit(3);
	if (at == KILL_FORWARD_POSTED) {
		ok = submit(c, EMBD_REQUEST_FORWARD, s, n) ? 'n' : 'y';
	} else {
		ok = embd_forward(c, 0, s, n, 0) ? 'n' : 'y';
		if (at == KILL_IN_WAIT && submit(c, EMBD_REQUEST_BACKWARD, s, n))
			ok = 'n';
	}
	if (write(ready, &ok, 1) != 1)
		_exit(3);
	if (at == KILL_IN_WAIT) {
		struct embd_completion done;
		embd_wait(c, &done, -1);
	}
	pause();
	_exit(4);
}

/* Forks trainer1(at); *ready_fd is the read end of its pipe. */
static pid_t spawn_trainer1(enum kill_point at, int *ready_fd)
{
	int pipefd[2];

	cr_assert_eq(pipe(pipefd), 0);
	pid_t kid = tu_fork_child();
	if (kid == 0) {
		close(pipefd[0]);
		trainer1(pipefd[1], at);
	}
	close(pipefd[1]);
	*ready_fd = pipefd[0];
	return kid;
}

/* The step trainer 1 joined at. */
static uint64_t wait_joined(int fd, const char *what)
{
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	uint64_t s = 0;

	cr_assert_eq(poll(&pfd, 1, 5000), 1, "%s: trainer 1 did not connect within 5 s", what);
	cr_assert_eq(read(fd, &s, sizeof(s)), (ssize_t)sizeof(s), "%s: trainer 1 could not connect",
		     what);
	return s;
}

static void wait_ready(int fd, const char *what)
{
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	char ok = 0;

	cr_assert_eq(poll(&pfd, 1, 5000), 1, "%s: trainer 1 did not get ready within 5 s", what);
	cr_assert_eq(read(fd, &ok, 1), 1, "%s: trainer 1 died before it was ready", what);
	cr_assert_eq(ok, 'y', "%s: trainer 1's requests failed", what);
}

/* One SIGTERM stops embd with exit 0 within STOP_MS. */
static void expect_clean_stop(void)
{
	int status;
	bool exited = service_stop_within(STOP_MS, &status);

	cr_expect(exited && WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "SIGTERM: expected exit 0 within %d ms, got %s 0x%x", STOP_MS,
		  exited ? "status" : "no exit,", status);
}

/* Trainer 1 dies at `at`; trainer 0 (this process) stays connected; delay_us later one
 * SIGTERM must stop embd with exit status 0 within STOP_MS. */
static void sigterm_after_kill(enum kill_point at, unsigned busy_poll_us, unsigned delay_us)
{
	const char *what = kill_point_name[at];
	struct embd_client *t0;
	char err[256];
	int ready, status;

	start(busy_poll_us);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	uint64_t n = fill(t0, 0);
	pid_t kid = spawn_trainer1(at, &ready);
	uint64_t s = wait_joined(ready, what);
	if (at != KILL_FORWARD_POSTED) {
		int rc = embd_forward(t0, 0, s, n, 0);
		cr_assert_eq(rc, 0, "%s: trainer 0's forward of step %llu: expected 0, got %d (%s)",
			     what, (unsigned long long)s, rc, embd_last_error(t0));
	}
	wait_ready(ready, what);
	close(ready);
	if (at == KILL_BEFORE_BACKWARD)
		cr_assert_eq(submit(t0, EMBD_REQUEST_BACKWARD, s, n), 0, "%s", embd_last_error(t0));
	tu_kill_child(kid);
	usleep(delay_us);       /* 0: SIGTERM races the hangup; else the hangup is seen first */
	uint64_t t_ns = embd_now_ns();
	bool exited = service_stop_within(STOP_MS, &status);
	cr_assert(exited, "%s, busy_poll_us %u, SIGTERM %u us after the kill: embd did not exit within %d ms of SIGTERM (log %s)",
		  what, busy_poll_us, delay_us, STOP_MS, service.log);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: embd's exit status: expected "
		  "exit 0, got 0x%x", what, status);
	cr_log_info("%s, busy_poll_us %u: embd exited %.0f ms after SIGTERM", what, busy_poll_us,
		    (double)(embd_now_ns() - t_ns) / 1e6);
	embd_close(t0);
	stop();
}

Test(lifecycle, sigterm_stops_embd_after_a_trainer_died_mid_step)
{
	/* each kill point with the default spin and with none, SIGTERM racing the hangup and
	 * after it, twice over: a stall like this one shows only now and then */
	for (int round = 0; round < 4; round++)
		for (int at = KILL_FORWARD_POSTED; at <= KILL_IN_WAIT; at++) {
			sigterm_after_kill((enum kill_point)at, 50, round % 2 ? 20000 : 0);
			sigterm_after_kill((enum kill_point)at, 0, round % 2 ? 20000 : 0);
		}
}

/* ---- a dead trainer whose socket lives on in its child ----------------------------------- */

Test(lifecycle, dead_trainer_with_socket_in_a_child_is_dropped)
{
	struct embd_client *t0;
	struct embd_completion done;
	char err[256];
	int pipefd[2];

	start(50);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	uint64_t s = embd_layout(t0)->resumed_step, n = fill(t0, 0);
	cr_assert_eq(pipe(pipefd), 0);
	pid_t kid = tu_fork_child();
	if (kid == 0) {
		/* trainer 1: forwards step s, forks a child that keeps every fd (its socket too,
		 * as a data loader worker would), and dies before its BACKWARD */
		close(pipefd[0]);
		struct embd_client *c;
		char ok = 'y';
		if (embd_connect(service.socket, 1, 5000, &c, err, sizeof(err)))
			_exit(2);
		if (embd_forward(c, 0, s, fill(c, 1), 0))
			ok = 'n';
		pid_t grandchild = fork();
		if (grandchild == 0) {
			close(pipefd[1]);
			pause();
			_exit(0);
		}
		/* the grandchild's pid goes first, then the verdict */
		if (write(pipefd[1], &grandchild, sizeof(grandchild)) != sizeof(grandchild) ||
		    write(pipefd[1], &ok, 1) != 1)
			_exit(3);
		pause();
		_exit(4);
	}
	close(pipefd[1]);
	int rc = embd_forward(t0, 0, s, n, 0);
	cr_assert_eq(rc, 0, "trainer 0's forward: expected 0, got %d (%s)", rc, embd_last_error(t0));
	pid_t grandchild = 0;
	struct pollfd pfd = { .fd = pipefd[0], .events = POLLIN };
	cr_assert_eq(poll(&pfd, 1, 5000), 1, "trainer 1 did not get ready within 5 s");
	cr_assert_eq(read(pipefd[0], &grandchild, sizeof(grandchild)), (ssize_t)sizeof(grandchild));
	cr_assert_gt(grandchild, 0, "trainer 1 could not fork");
	tu_track_process(grandchild);           /* not our child: fini only kills it */
	wait_ready(pipefd[0], "socket held by a child");
	close(pipefd[0]);
	cr_assert_eq(submit(t0, EMBD_REQUEST_BACKWARD, s, n), 0, "%s", embd_last_error(t0));
	tu_kill_child(kid);
	/* the socket stays open in the grandchild: only the pidfd can tell the service */
	rc = embd_wait(t0, &done, 3000);
	cr_assert_eq(rc, 0, "trainer 0's backward after trainer 1 died (its socket still open in "
		     "pid %d): expected a completion within 3 s, got %d (%s)", (int)grandchild, rc,
		     embd_last_error(t0));
	cr_expect_eq(done.result, EMBD_ECANCELED, "trainer 0's backward: expected EMBD_ECANCELED "
		     "(%d), got %d (%s)", EMBD_ECANCELED, done.result, embd_last_error(t0));
	cr_expect(tu_embd_log_has(&service, "trainer 1 (pid"),
		  "the service should log trainer 1 leaving");
	/* trainer 1's index is free again while the old socket still lingers */
	struct embd_client *t1;
	rc = embd_connect(service.socket, 1, 5000, &t1, err, sizeof(err));
	cr_expect_eq(rc, 0, "reconnect as trainer 1: expected 0, got %d (%s)", rc, err);
	embd_close(t1);
	embd_close(t0);
	expect_clean_stop();
}

/* ---- no fd or memory left behind --------------------------------------------------------- */

#define LEAK_ROUNDS 30
#define LEAK_BATCH 512          /* the service touches ~64 KiB of each region: 30 leaked ones
				 * add ~2 MiB to VmRSS (and 30 fds) */
#define RSS_SLACK_KB 1024       /* allocator noise: measured growth is under 100 KiB */

/*
 * One round: trainer 1 connects in a child, both trainers run the forward of step s, trainer
 * 1 is killed before its BACKWARD, and trainer 0's BACKWARD is cancelled.
 */
static void kill_round(struct embd_client *t0, int round)
{
	struct embd_completion done;
	int ready;
	pid_t kid = spawn_trainer1(KILL_BOTH_IDLE, &ready);
	uint64_t s = wait_joined(ready, "leak round"), n = fill(t0, (uint32_t)round);
	int rc = embd_forward(t0, 0, s, n, 0);
	cr_assert_eq(rc, 0, "round %d: trainer 0's forward of step %llu: expected 0, got %d (%s)",
		     round, (unsigned long long)s, rc, embd_last_error(t0));
	wait_ready(ready, "leak round");
	close(ready);
	cr_assert_eq(submit(t0, EMBD_REQUEST_BACKWARD, s, n), 0, "%s", embd_last_error(t0));
	tu_kill_child(kid);
	rc = embd_wait(t0, &done, 3000);
	cr_assert(rc == 0 && done.result == EMBD_ECANCELED, "round %d: trainer 0's backward after "
		  "the kill: expected EMBD_ECANCELED, got rc %d result %d (%s)", round, rc,
		  done.result, embd_last_error(t0));
}

Test(lifecycle, killed_trainers_leave_no_fds_or_memory)
{
	struct embd_client *t0;
	char err[256];

	start_batch(50, LEAK_BATCH);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	/* the baseline: trainer 0 alone. A round's cancellation reaches trainer 0 before the
	 * service has closed the dead trainer's fds, so each count below waits to settle. */
	int fds0 = tu_embd_count_fds(&service);
	cr_assert(fds0 > 0, "cannot read /proc/%d/fd", (int)service.pid);
	/* two rounds first: the step engine's buffers and the allocator's arenas grow once */
	for (int round = 0; round < 2; round++)
		kill_round(t0, round);
	int settled = tu_embd_wait_fds(&service, fds0, FDS_SETTLE_MS);
	cr_assert_eq(settled, fds0, "embd's open fds after 2 killed trainers: expected %d, got %d",
		     fds0, settled);
	long rss0 = tu_embd_rss_kb(&service);
	cr_assert_gt(rss0, 0, "cannot read /proc/%d/status", (int)service.pid);
	for (int round = 2; round < 2 + LEAK_ROUNDS; round++)
		kill_round(t0, round);
	int fds = tu_embd_wait_fds(&service, fds0, FDS_SETTLE_MS);
	long rss = tu_embd_rss_kb(&service);
	cr_log_info("after %d killed trainers: %d fds (baseline %d), VmRSS %ld kB (baseline %ld kB)",
		    LEAK_ROUNDS, fds, fds0, rss, rss0);
	cr_expect_eq(fds, fds0, "embd's open fds after %d killed trainers: expected %d as before, "
		     "got %d", LEAK_ROUNDS, fds0, fds);
	cr_expect_leq(rss, rss0 + RSS_SLACK_KB, "embd's VmRSS after %d killed trainers: expected "
		      "at most %ld kB (baseline %ld + %d), got %ld kB", LEAK_ROUNDS,
		      rss0 + RSS_SLACK_KB, rss0, RSS_SLACK_KB, rss);
	embd_close(t0);
	expect_clean_stop();
}
