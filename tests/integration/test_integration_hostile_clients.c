/*
 * Integration: clients that misbehave without breaking the protocol, against the real embd:
 * connections that never say anything, more embctl connections than the service takes, a
 * completion ring nobody reads, a trainer that never posts, a second FORWARD of a step.
 * None of them may lock the others out, lose their completions or stall them without a word.
 * The hostile clients speak the raw protocol through ipc/; the others use libembdclient.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "embd/client.h"
#include "ipc/control.h"
#include "tests/integration/ctl_query.h"
#include "tests/integration/service_fixture.h"
#include "libclient/client_internal.h"

TestSuite(hostile_clients, .fini = stop_service, .timeout = 60);

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
Test(hostile_clients, idle_connections_lock_nobody_out)
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
Test(hostile_clients, control_connections_counted_apart)
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
Test(hostile_clients, full_completion_ring_loses_nothing)
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

/* ---- steps --------------------------------------------------------------------------------- */

/* Batch slot `slot` of c: every feature of every sample one id (1), zero gradients; returns the
 * id count. */
static uint64_t fill_batch(struct embd_client *c, uint32_t slot)
{
	const struct embd_client_layout *l = embd_layout(c);
	uint64_t n = (uint64_t)l->num_features * l->batch_size;
	struct embd_batch b;

	embd_batch_get(c, slot, &b);
	for (uint64_t i = 0; i < n; i++) {
		b.lengths[i] = 1;
		b.values[i] = 1;
	}
	memset(b.grad, 0, (size_t)l->batch_size * l->total_dim * sizeof(float));
	return n;
}

/* Posts op of step on c (slot step % 2) with user_data ud. */
static void post(struct embd_client *c, enum embd_request_op op, uint64_t step, uint64_t ud)
{
	uint32_t slot = (uint32_t)(step % EMBD_CLIENT_SLOTS);
	struct embd_request r = { .op = op, .slot = slot, .step = step,
				  .num_values = fill_batch(c, slot), .user_data = ud };

	cr_assert_eq(embd_submit(c, &r), 0, "submit step %llu: %s", (unsigned long long)step,
		     embd_last_error(c));
}

/* The next completion of c within timeout_ms: it must be for ud; returns its result (the
 * text in embd_last_error). */
static int completion(struct embd_client *c, uint64_t ud, int timeout_ms)
{
	struct embd_completion done;
	int rc = embd_wait(c, &done, timeout_ms);

	cr_assert_eq(rc, 0, "waiting for request %llu: %d (%s)", (unsigned long long)ud, rc,
		     embd_last_error(c));
	cr_assert_eq(done.user_data, ud, "expected the completion of request %llu, got %llu",
		     (unsigned long long)ud, (unsigned long long)done.user_data);
	return done.result;
}

/* Both trainers through FORWARD and BACKWARD of step; ud counts requests. */
static void full_step(struct embd_client *t0, struct embd_client *t1, uint64_t step, uint64_t *ud)
{
	uint64_t a = ++*ud, b = ++*ud;

	post(t0, EMBD_REQUEST_FORWARD, step, a);
	post(t1, EMBD_REQUEST_FORWARD, step, b);
	cr_assert_eq(completion(t0, a, 5000), 0, "step %llu forward: %s", (unsigned long long)step,
		     embd_last_error(t0));
	cr_assert_eq(completion(t1, b, 5000), 0, "%s", embd_last_error(t1));
	a = ++*ud, b = ++*ud;
	post(t0, EMBD_REQUEST_BACKWARD, step, a);
	post(t1, EMBD_REQUEST_BACKWARD, step, b);
	cr_assert_eq(completion(t0, a, 5000), 0, "step %llu backward: %s", (unsigned long long)step,
		     embd_last_error(t0));
	cr_assert_eq(completion(t1, b, 5000), 0, "%s", embd_last_error(t1));
}

/*
 * A FORWARD of a step whose forward ran (a trainer that blocks on it would wait for a
 * BACKWARD it never sends), or a second FORWARD or BACKWARD while one is pending, is refused
 * at once.
 */
Test(hostile_clients, second_forward_is_refused_at_once)
{
	struct embd_client *t0 = NULL, *t1 = NULL;
	char err[256];

	service_spawn(NULL, "warning");
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_connect(service.socket, 1, 5000, &t1, err, sizeof(err)), 0, "%s", err);
	post(t0, EMBD_REQUEST_FORWARD, 0, 1);
	post(t1, EMBD_REQUEST_FORWARD, 0, 101);
	cr_assert_eq(completion(t0, 1, 5000), 0, "%s", embd_last_error(t0));
	cr_assert_eq(completion(t1, 101, 5000), 0, "%s", embd_last_error(t1));
	/* the same step again, instead of its BACKWARD */
	post(t0, EMBD_REQUEST_FORWARD, 0, 2);
	int rc = completion(t0, 2, 2000);
	cr_expect_eq(rc, EMBD_EINVAL, "FORWARD 0 again: expected EMBD_EINVAL at once, got %d", rc);
	cr_expect(strstr(embd_last_error(t0), "forward ran already") != NULL, "got '%s'",
		  embd_last_error(t0));
	/* the next step early (kept), then once more */
	post(t0, EMBD_REQUEST_FORWARD, 1, 3);
	post(t0, EMBD_REQUEST_FORWARD, 1, 4);
	rc = completion(t0, 4, 2000);
	cr_expect_eq(rc, EMBD_EINVAL, "a second FORWARD 1: expected EMBD_EINVAL at once, got %d",
		     rc);
	cr_expect(strstr(embd_last_error(t0), "pending already") != NULL, "got '%s'",
		  embd_last_error(t0));
	/* the first of them is kept and runs with step 1 */
	post(t0, EMBD_REQUEST_BACKWARD, 0, 5);
	post(t1, EMBD_REQUEST_BACKWARD, 0, 102);
	cr_expect_eq(completion(t1, 102, 5000), 0, "%s", embd_last_error(t1));
	cr_expect_eq(completion(t0, 5, 5000), 0, "%s", embd_last_error(t0));
	post(t1, EMBD_REQUEST_FORWARD, 1, 103);
	cr_expect_eq(completion(t1, 103, 5000), 0, "%s", embd_last_error(t1));
	cr_expect_eq(completion(t0, 3, 5000), 0, "the kept FORWARD 1: %s", embd_last_error(t0));
	/* a second BACKWARD of step 1 while the first waits for trainer 1's: refused at once,
	 * and the first still runs */
	post(t0, EMBD_REQUEST_BACKWARD, 1, 6);
	post(t0, EMBD_REQUEST_BACKWARD, 1, 7);
	rc = completion(t0, 7, 2000);
	cr_expect_eq(rc, EMBD_EINVAL, "a second BACKWARD 1: expected EMBD_EINVAL at once, got %d",
		     rc);
	cr_expect(strstr(embd_last_error(t0), "BACKWARD of that step is pending already") != NULL,
		  "got '%s'", embd_last_error(t0));
	post(t1, EMBD_REQUEST_BACKWARD, 1, 104);
	cr_expect_eq(completion(t1, 104, 5000), 0, "%s", embd_last_error(t1));
	cr_expect_eq(completion(t0, 6, 5000), 0, "the first BACKWARD 1: %s", embd_last_error(t0));
	embd_close(t0);
	embd_close(t1);
}

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/*
 * Trainer 1 is connected but posts nothing: past step_wait_warn_ms the log, STATUS and STATS
 * name it; past step_wait_abort_ms trainer 0's FORWARD is answered EMBD_ETIMEDOUT naming it
 * and the step stays. Then trainer 1 stalls a backward: that step is aborted, trainer 0's
 * BACKWARD and trainer 1's late one answered EMBD_ETIMEDOUT, and the next step runs.
 */
Test(hostile_clients, stalled_trainer_is_named_then_given_up)
{
	struct embd_client *t0 = NULL, *t1 = NULL;
	char err[256], who[64];
	uint64_t ud = 10;

	service_spawn_keys("\"step_wait_warn_ms\": 300, \"step_wait_abort_ms\": 1500", "warning");
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_connect(service.socket, 1, 5000, &t1, err, sizeof(err)), 0, "%s", err);
	snprintf(who, sizeof(who), "trainer 1 (pid %d)", (int)getpid());

	uint64_t posted = now_ms();
	post(t0, EMBD_REQUEST_FORWARD, 0, 1);
	usleep(800 * 1000);
	cr_expect(tu_embd_log_has(&service, who), "past step_wait_warn_ms the log (%s) should "
		  "name %s", service.log, who);
	cJSON *status = ctl_ask_json(service.socket, EMBD_CTL_STATUS_REQUEST);
	cr_assert_not_null(status, "no status");
	const cJSON *stalled = cJSON_GetObjectItemCaseSensitive(status, "stalled");
	const cJSON *trainers = cJSON_GetObjectItemCaseSensitive(stalled, "trainers");
	cr_expect(cJSON_GetArraySize(trainers) == 1 &&
		  ctl_json_num(cJSON_GetArrayItem(trainers, 0), "index") == 1 &&
		  ctl_json_num(cJSON_GetArrayItem(trainers, 0), "pid") == getpid(),
		  "status should show the step stalled by trainer 1 (pid %d)", (int)getpid());
	const cJSON *wants = cJSON_GetObjectItemCaseSensitive(stalled, "waiting_for");
	cr_expect(cJSON_IsString(wants) && !strcmp(wants->valuestring, "FORWARD"),
		  "stalled.waiting_for: expected FORWARD");
	cr_expect_geq(ctl_json_num(stalled, "waited_ms"), 300);
	cJSON_Delete(status);
	cJSON *stats = ctl_ask_json(service.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats, "no stats");
	const cJSON *c;
	double stalling[2] = { -1, -1 };
	cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(stats, "clients"))
		if (ctl_json_num(c, "index") == 0 || ctl_json_num(c, "index") == 1)
			stalling[(int)ctl_json_num(c, "index")] = ctl_json_num(c, "stalling_ms");
	cr_expect(stalling[0] == 0 && stalling[1] >= 300, "stats stalling_ms: expected 0 for "
		  "trainer 0 and >= 300 for trainer 1, got %g and %g", stalling[0], stalling[1]);
	cJSON_Delete(stats);

	int rc = completion(t0, 1, 5000);
	uint64_t waited = now_ms() - posted;
	cr_expect_eq(rc, EMBD_ETIMEDOUT, "FORWARD 0 with trainer 1 silent: expected "
		     "EMBD_ETIMEDOUT, got %d (%s)", rc, embd_last_error(t0));
	cr_expect(strstr(embd_last_error(t0), "trainer 1 (pid") &&
		  strstr(embd_last_error(t0), "FORWARD"), "the error should name trainer 1 and "
		  "its FORWARD: '%s'", embd_last_error(t0));
	cr_expect_geq(waited, 1450, "given up after %llu ms, step_wait_abort_ms is 1500",
		      (unsigned long long)waited);

	/* the step stayed at 0: both run its forward, then trainer 1 stalls the backward */
	post(t0, EMBD_REQUEST_FORWARD, 0, 2);
	post(t1, EMBD_REQUEST_FORWARD, 0, 201);
	cr_assert_eq(completion(t0, 2, 5000), 0, "%s", embd_last_error(t0));
	cr_assert_eq(completion(t1, 201, 5000), 0, "%s", embd_last_error(t1));
	post(t0, EMBD_REQUEST_BACKWARD, 0, 3);
	rc = completion(t0, 3, 5000);
	cr_expect_eq(rc, EMBD_ETIMEDOUT, "BACKWARD 0 with trainer 1's missing: expected "
		     "EMBD_ETIMEDOUT, got %d (%s)", rc, embd_last_error(t0));
	cr_expect(strstr(embd_last_error(t0), "trainer 1 (pid") &&
		  strstr(embd_last_error(t0), "BACKWARD"), "got '%s'", embd_last_error(t0));
	post(t1, EMBD_REQUEST_BACKWARD, 0, 202);
	rc = completion(t1, 202, 5000);
	cr_expect_eq(rc, EMBD_ETIMEDOUT, "trainer 1's late BACKWARD 0: expected EMBD_ETIMEDOUT, "
		     "got %d (%s)", rc, embd_last_error(t1));
	full_step(t0, t1, 1, &ud);
	stats = ctl_ask_json(service.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats);
	cr_expect_eq(ctl_json_num(stats, "step_timeouts"), 2);
	cr_expect_eq(ctl_json_num(stats, "aborted_steps"), 1);
	cr_expect_eq(ctl_json_num(stats, "steps"), 1);
	cJSON_Delete(stats);
	embd_close(t0);
	embd_close(t1);
}

/* CPU seconds embd has used (utime + stime of /proc/PID/stat). */
static double embd_cpu_s(void)
{
	char path[64], buf[1024];
	unsigned long utime = 0, stime = 0;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)service.pid);
	FILE *f = fopen(path, "r");
	cr_assert_not_null(f);
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	/* after the ")" that ends the command name: state is field 3, utime 14, stime 15 */
	const char *p = strrchr(buf, ')');
	cr_assert_not_null(p);
	cr_assert_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime,
			    &stime), 2);
	return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

/* The first step waits for trainer 1 to connect: nobody is there to name, so nothing is
 * logged, and the service sleeps meanwhile instead of spinning on the passed deadline. */
Test(hostile_clients, waiting_for_a_trainer_to_connect_is_no_stall)
{
	struct embd_client *t0 = NULL;
	char err[256];

	service_spawn_keys("\"step_wait_warn_ms\": 100, \"step_wait_abort_ms\": 200", "warning");
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	post(t0, EMBD_REQUEST_FORWARD, 0, 1);
	usleep(300 * 1000);
	double cpu = embd_cpu_s();
	usleep(1000 * 1000);
	cpu = embd_cpu_s() - cpu;
	cr_expect_lt(cpu, 0.1, "embd used %.2f CPU s in 1 s while the step waited for a trainer "
		     "to connect", cpu);
	cr_expect(!tu_embd_log_has(&service, "waited"), "nothing to log: nobody stalls the step");
	struct embd_client *t1 = NULL;
	cr_assert_eq(embd_connect(service.socket, 1, 5000, &t1, err, sizeof(err)), 0, "%s", err);
	post(t1, EMBD_REQUEST_FORWARD, 0, 101);
	cr_expect_eq(completion(t0, 1, 5000), 0, "%s", embd_last_error(t0));
	cr_expect_eq(completion(t1, 101, 5000), 0, "%s", embd_last_error(t1));
	embd_close(t0);
	embd_close(t1);
}
