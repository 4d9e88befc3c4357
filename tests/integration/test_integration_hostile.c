/*
 * Integration: clients that misbehave without breaking the protocol, against the real embd:
 * connections that never say anything, more embctl connections than the service takes.
 * None of them may lock the others out or stall them without a word. The hostile clients
 * speak the raw protocol through ipc/; the well-behaved ones use libembdclient.
 */
#include <criterion/criterion.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "embd/client.h"
#include "ipc/control.h"
#include "tests/integration/service_fixture.h"

TestSuite(hostile, .fini = stop_service, .timeout = 60);

/* The control connections the service holds at once (daemon/server.h). */
#define CONTROL_MAX 32

static uint8_t msgbuf[EMBD_CTL_MSG_MAX];

/* Waits up to timeout_ms for one message on sock: its type (or the negative error of the
 * receive) and, for an ERROR, its code in *code. */
static int next_message(int sock, int timeout_ms, int *code)
{
	struct embd_ctl_msg msg;
	char text[EMBD_CTL_TEXT_MAX + 1];
	int rc = embd_ctl_recv(sock, msgbuf, sizeof(msgbuf), timeout_ms, &msg, NULL, 0);

	if (rc)
		return rc;
	embd_ctl_msg_close_fds(&msg);
	*code = 0;
	if (msg.type == EMBD_CTL_ERROR)
		embd_ctl_error_decode(&msg, code, text, sizeof(text), NULL, 0);
	return msg.type;
}

/* A control connection that asked for the status: its socket, or -1 when the connect or the
 * request failed. */
static int ask_status(int *reply_type, int *code)
{
	int sock;

	*reply_type = -1;
	if (embd_ctl_connect(service.socket, &sock, NULL, 0))
		return -1;
	if (embd_ctl_send(sock, EMBD_CTL_STATUS_REQUEST, NULL, 0, NULL, 0, NULL, 0)) {
		close(sock);
		return -1;
	}
	*reply_type = next_message(sock, 5000, code);
	return sock;
}

static int count_log_lines(const char *needle)
{
	char line[2048];
	int n = 0;
	FILE *f = fopen(service.log, "r");

	cr_assert_not_null(f, "cannot read %s", service.log);
	while (fgets(line, sizeof(line), f))
		n += strstr(line, needle) != NULL;
	fclose(f);
	return n;
}

/*
 * 300 connections that never send a message: a trainer and embctl still get in at once (each
 * new connection closes the one pending longest, told EMBD_EBUSY), and the ones left are
 * closed after handshake_timeout_ms (EMBD_ETIMEDOUT), all in a few log lines.
 */
Test(hostile, idle_connections_lock_nobody_out)
{
	enum { IDLE = 300 };
	int idle[IDLE], type, code;
	char err[256];
	struct embd_client *trainer = NULL;

	service_spawn_keys("\"handshake_timeout_ms\": 1500", "warning");
	for (int i = 0; i < IDLE; i++)
		cr_assert_eq(embd_ctl_connect(service.socket, &idle[i], err, sizeof(err)), 0,
			     "idle connection %d: %s", i, err);
	int rc = embd_connect(service.socket, EMBD_CLIENT_ANY_INDEX, 5000, &trainer, err,
			      sizeof(err));
	cr_assert_eq(rc, 0, "a trainer behind %d idle connections: expected 0, got %d (%s)", IDLE,
		     rc, err);
	int status = ask_status(&type, &code);
	cr_expect_eq(type, EMBD_CTL_STATUS_REPLY, "embctl status behind %d idle connections: "
		     "expected a STATUS_REPLY, got type %d (code %d)", IDLE, type, code);
	if (status >= 0)
		close(status);
	type = next_message(idle[0], 5000, &code);
	cr_expect(type == EMBD_CTL_ERROR && code == EMBD_EBUSY, "the oldest idle connection: "
		  "expected ERROR EMBD_EBUSY (closed for room), got type %d code %d", type, code);
	type = next_message(idle[IDLE - 1], 5000, &code);
	cr_expect(type == EMBD_CTL_ERROR && code == EMBD_ETIMEDOUT, "the newest idle connection: "
		  "expected ERROR EMBD_ETIMEDOUT after handshake_timeout_ms, got type %d code %d",
		  type, code);
	int lines = count_log_lines("closed the connection of pid");
	/* two kinds of line (closed for room, closed at the timeout), each with its limit */
	cr_expect(lines >= 2 && lines <= 2 * (int)EMBD_LOG_LIMIT_BURST, "%d connections closed: "
		  "expected 2 to %u log lines, got %d", IDLE, 2 * EMBD_LOG_LIMIT_BURST, lines);
	cr_expect(tu_embd_log_has(&service, "no message within handshake_timeout_ms (1500 ms)"),
		  "the log (%s) should say why the idle connections were closed", service.log);
	/* the trainer was never one of them */
	struct embd_request nop = { .op = EMBD_REQUEST_NOP, .user_data = 7 };
	struct embd_completion done;
	cr_expect_eq(embd_submit(trainer, &nop), 0, "%s", embd_last_error(trainer));
	cr_expect_eq(embd_wait(trainer, &done, 5000), 0, "%s", embd_last_error(trainer));
	for (int i = 0; i < IDLE; i++)
		close(idle[i]);
	embd_close(trainer);
}

/* embctl connections are counted apart from trainers: CONTROL_MAX of them held open, one more
 * is refused with EMBD_EBUSY and a log line, and trainers still connect. */
Test(hostile, control_connections_counted_apart)
{
	int ctl[CONTROL_MAX], type, code;
	char err[256];
	struct embd_client *t0 = NULL, *t1 = NULL;

	service_spawn(NULL, "warning");
	for (int i = 0; i < CONTROL_MAX; i++) {
		ctl[i] = ask_status(&type, &code);
		cr_assert_eq(type, EMBD_CTL_STATUS_REPLY, "control connection %d: expected a reply, "
			     "got type %d code %d", i, type, code);
	}
	int extra = ask_status(&type, &code);
	cr_expect(type == EMBD_CTL_ERROR && code == EMBD_EBUSY, "control connection %d: expected "
		  "ERROR EMBD_EBUSY, got type %d code %d", CONTROL_MAX + 1, type, code);
	if (extra >= 0)
		close(extra);
	cr_expect(tu_embd_log_has(&service, "too many control connections"),
		  "the refusal should be in the log (%s)", service.log);
	cr_expect_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(embd_connect(service.socket, 1, 5000, &t1, err, sizeof(err)), 0, "%s", err);
	/* one control connection gone: another gets in */
	close(ctl[0]);
	for (int tries = 0; tries < 100; tries++) {
		extra = ask_status(&type, &code);
		if (extra >= 0)
			close(extra);
		if (type == EMBD_CTL_STATUS_REPLY)
			break;
		usleep(20000);
	}
	cr_expect_eq(type, EMBD_CTL_STATUS_REPLY, "after one control connection closed: expected a "
		     "reply, got type %d code %d", type, code);
	for (int i = 1; i < CONTROL_MAX; i++)
		close(ctl[i]);
	embd_close(t0);
	embd_close(t1);
}

/*
 * A trainer posts 100 NOPs and reads nothing until they are all posted: the completion ring
 * holds 64, so the service takes the rest only as completions are read, and all 100 come
 * back in order; none is dropped, nothing is logged.
 */
Test(hostile, full_completion_ring_loses_nothing)
{
	enum { REQUESTS = 100 };
	struct embd_client *c = NULL;
	struct embd_completion done;
	char err[256];

	service_spawn(NULL, "warning");
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &c, err, sizeof(err)), 0, "%s", err);
	for (uint64_t i = 1; i <= REQUESTS; i++) {
		struct embd_request nop = { .op = EMBD_REQUEST_NOP, .user_data = i };
		int rc;
		/* the submission ring holds 64 too: wait for the service to take some */
		for (int tries = 0; (rc = embd_submit(c, &nop)) == EMBD_ENOSPC && tries < 2000;
		     tries++)
			usleep(1000);
		cr_assert_eq(rc, 0, "NOP %llu: %s", (unsigned long long)i, embd_last_error(c));
	}
	/* a service that drops completions has dropped them by now */
	usleep(300 * 1000);
	for (uint64_t i = 1; i <= REQUESTS; i++) {
		int rc = embd_wait(c, &done, 3000);
		cr_assert_eq(rc, 0, "completion %llu of %d: expected 0, got %d (%s)",
			     (unsigned long long)i, REQUESTS, rc, embd_last_error(c));
		cr_assert_eq(done.user_data, i, "completion %llu: came for request %llu",
			     (unsigned long long)i, (unsigned long long)done.user_data);
		cr_assert_eq(done.result, 0);
	}
	cr_expect_eq(embd_poll(c, &done), EMBD_EAGAIN, "no completion beyond the %d requests",
		     REQUESTS);
	cr_expect(!tu_embd_log_has(&service, "completion ring"), "nothing about the completion "
		  "ring should be in the log (%s)", service.log);
	embd_close(c);
}
