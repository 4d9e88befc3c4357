/*
 * Integration: a malformed batch is refused with an error naming the field while the other
 * trainer's step runs, and peers are let in by what the config allows: a uid that is not
 * allowed is refused (EMBD_EACCES, rate-limited log lines), one that is allowed reaches the
 * socket whatever its groups. Each test starts the real embd (EMBD_BINARY) on a private
 * socket: the embedded default config, or one naming other uids; the tests that connect as
 * another uid fork a child that becomes it (they need root).
 */
#include <criterion/criterion.h>
#include <grp.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "embd/client.h"
#include "ipc/control.h"
#include "tests/integration/service_fixture.h"
#include "tests/support/children.h"
#include "libclient/client_internal.h"

TestSuite(integration, .init = start_service, .fini = stop_service, .timeout = 60);

/* One id per feature and sample, all id 1; returns the id count. */
static uint64_t fill_valid(struct embd_client *c, uint32_t slot)
{
	const struct embd_client_layout *l = embd_layout(c);
	struct embd_batch b;
	uint64_t n = (uint64_t)l->num_features * l->batch_size;

	embd_batch_get(c, slot, &b);
	for (uint64_t i = 0; i < n; i++) {
		b.lengths[i] = 1;
		b.values[i] = 1;
	}
	return n;
}

Test(integration, malformed_batch_is_named_and_others_run)
{
	struct embd_client *good, *bad;
	char err[256];

	cr_assert_eq(embd_connect(service.socket, 0, 5000, &good, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_connect(service.socket, 1, 5000, &bad, err, sizeof(err)), 0, "%s", err);
	uint64_t n = fill_valid(bad, 0);
	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = 0, .step = 0,
				    .num_values = n - 1 };  /* lengths sum to n */
	cr_assert_eq(embd_submit(bad, &req), 0, "%s", embd_last_error(bad));
	struct embd_completion done;
	cr_assert_eq(embd_wait(bad, &done, 5000), 0, "%s", embd_last_error(bad));
	cr_expect_lt(done.result, 0, "a batch whose lengths do not sum to num_values: expected an "
		     "error, got %d", done.result);
	cr_expect(strstr(embd_last_error(bad), "num_values") || strstr(embd_last_error(bad), "length"),
		  "error should name lengths/num_values, got '%s'", embd_last_error(bad));
	/* a descriptor with an output span outside the slab */
	struct embd_sqe sqe;
	req.num_values = n;
	cr_assert_eq(embd_client_sqe_build(bad, &req, &sqe), 0);
	sqe.output.offset = embd_client_slab_bytes(bad);
	cr_assert_eq(embd_client_push_sqe(bad, &sqe), 0);
	cr_assert_eq(embd_wait(bad, &done, 5000), 0, "%s", embd_last_error(bad));
	cr_expect_lt(done.result, 0, "output outside the slab: expected an error, got %d", done.result);
	cr_expect(strstr(embd_last_error(bad), "output") != NULL,
		  "error should name the output span, got '%s'", embd_last_error(bad));
	/* the good trainer's step 0 runs without the bad one */
	n = fill_valid(good, 0);
	int rc = embd_forward(good, 0, 0, n, 0);
	cr_expect_eq(rc, 0, "good trainer's forward: expected 0, got %d (%s)", rc,
		     embd_last_error(good));
	struct embd_batch b;
	embd_batch_get(good, 0, &b);
	memset(b.grad, 0, (size_t)embd_layout(good)->batch_size * embd_layout(good)->total_dim * 4);
	rc = embd_backward(good, 0, 0, n, 0);
	cr_expect_eq(rc, 0, "good trainer's backward: expected 0, got %d (%s)", rc,
		     embd_last_error(good));
	embd_close(good);
	embd_close(bad);
}

/*
 * A uid the config does not allow is refused by the service itself: the socket's mode lets
 * this process connect (it owns the socket, or it is root), so the refusal can only be the
 * SO_PEERCRED check, answered with EMBD_EACCES and logged with the peer's uid.
 */
TestSuite(refusal, .fini = stop_service, .timeout = 60);

struct outcome {
	int rc;
	char err[256];
};

/* embd_connect as a trainer from a child that became uid (and gid) `uid`, with no
 * supplementary groups: what it got. */
static struct outcome connect_as(uid_t uid)
{
	struct outcome o = { .rc = 1, .err = "the child said nothing" };
	int p[2];

	cr_assert_eq(pipe(p), 0);
	pid_t child = tu_fork_child();
	if (child == 0) {
		struct embd_client *c = NULL;
		close(p[0]);
		if (setgroups(0, NULL) || setgid(uid) || setuid(uid))
			o = (struct outcome){ .rc = 1, .err = "setuid failed" };
		else
			o.rc = embd_connect(service.socket, EMBD_CLIENT_ANY_INDEX, 5000, &c, o.err,
					    sizeof(o.err));
		embd_close(c);
		_exit(write(p[1], &o, sizeof(o)) == (ssize_t)sizeof(o) ? 0 : 1);
	}
	close(p[1]);
	if (read(p[0], &o, sizeof(o)) != (ssize_t)sizeof(o))
		o.rc = 1;
	close(p[0]);
	waitpid(child, NULL, 0);
	return o;
}

Test(refusal, unauthorised_uid_is_refused)
{
	char err[256], logged[96];
	struct embd_client *c = NULL;
	uid_t me = getuid(), other = me == 0 ? 65534 : 0;

	snprintf(logged, sizeof(logged), "\"allowed_uids\": [%u]", (unsigned)other);
	service_spawn_keys(logged, "warning");
	int rc = embd_connect(service.socket, EMBD_CLIENT_ANY_INDEX, 5000, &c, err, sizeof(err));
	cr_assert_eq(rc, EMBD_EACCES, "connect as uid %u with allowed_uids [%u]: expected "
		     "EMBD_EACCES (%d), got %d (%s)", (unsigned)me, (unsigned)other, EMBD_EACCES, rc,
		     err);
	cr_assert_null(c);
	snprintf(logged, sizeof(logged), "uid %u", (unsigned)me);
	cr_expect(strstr(err, logged) != NULL, "the refusal should name %s, got '%s'", logged, err);
	/* the service logs its refusal before it answers, so the line is there already */
	snprintf(logged, sizeof(logged), "refused peer uid %u", (unsigned)me);
	cr_expect(tu_embd_log_has(&service, logged), "the service's log (%s) should say '%s'",
		  service.log, logged);
}

/* allowed_uids names a uid outside the service's group: the socket's mode lets it reach the
 * socket (SO_PEERCRED admits it), and a uid not named is refused by the check itself. */
Test(refusal, allowed_uid_outside_the_group_connects)
{
	struct stat st;
	char keys[96];

	if (geteuid() != 0)
		cr_skip_test("connecting as another uid needs root");
	snprintf(keys, sizeof(keys), "\"allowed_uids\": [%u, 1001]", (unsigned)getuid());
	service_spawn_keys(keys, "warning");
	cr_assert_eq(stat(service.socket, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0666, "socket mode with uid 1001 allowed: expected 0666, "
		     "got 0%o", st.st_mode & 0777);
	struct outcome o = connect_as(1001);
	cr_expect_eq(o.rc, 0, "uid 1001 (allowed, not in the service's group): expected 0, got %d "
		     "(%s)", o.rc, o.err);
	o = connect_as(1002);
	cr_expect_eq(o.rc, EMBD_EACCES, "uid 1002 (not allowed): expected EMBD_EACCES (%d), got %d "
		     "(%s)", EMBD_EACCES, o.rc, o.err);
	cr_expect(strstr(o.err, "uid 1002") != NULL, "the refusal should name uid 1002: %s", o.err);
}

/* Only the service's own uid is allowed: the socket is 0600, and a client the mode keeps out
 * is told EMBD_EACCES (not an I/O error). */
Test(refusal, uid_kept_out_by_the_mode_gets_eacces)
{
	struct stat st;

	if (geteuid() != 0)
		cr_skip_test("connecting as another uid needs root");
	service_spawn(NULL, "warning");
	cr_assert_eq(stat(service.socket, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0600, "socket mode for the owner alone: expected 0600, got "
		     "0%o", st.st_mode & 0777);
	struct outcome o = connect_as(1001);
	cr_expect_eq(o.rc, EMBD_EACCES, "uid 1001 kept out by the mode: expected EMBD_EACCES (%d), "
		     "got %d (%s)", EMBD_EACCES, o.rc, o.err);
}

/* A peer refused in a loop makes EMBD_LOG_LIMIT_BURST log lines, not one per connection. */
Test(refusal, refusals_are_rate_limited_in_the_log)
{
	char keys[64], line[1024], logged[64];
	uint8_t buf[4096];
	struct embd_ctl_msg msg;
	int refused = 0;

	snprintf(keys, sizeof(keys), "\"allowed_uids\": [%u]", getuid() == 0 ? 65534u : 0u);
	service_spawn_keys(keys, "warning");
	for (int i = 0; i < 2000; i++) {
		int sock, rc = embd_ctl_connect(service.socket, &sock, NULL, 0);
		cr_assert_eq(rc, 0, "connect %d: %d", i, rc);
		/* the ERROR comes at accept: the service has logged (or not) this refusal */
		if (embd_ctl_recv(sock, buf, sizeof(buf), 5000, &msg, NULL, 0) == 0 &&
		    msg.type == EMBD_CTL_ERROR)
			refused++;
		close(sock);
	}
	cr_expect_eq(refused, 2000, "expected every connection refused, %d were", refused);
	snprintf(logged, sizeof(logged), "refused peer uid %u", (unsigned)getuid());
	FILE *f = fopen(service.log, "r");
	cr_assert_not_null(f, "cannot read %s", service.log);
	int lines = 0;
	while (fgets(line, sizeof(line), f))
		lines += strstr(line, logged) != NULL;
	fclose(f);
	cr_expect(lines >= 1 && lines <= (int)EMBD_LOG_LIMIT_BURST, "2000 refusals: expected 1 to %u "
		  "log lines, got %d", EMBD_LOG_LIMIT_BURST, lines);
}
