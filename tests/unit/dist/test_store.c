/*
 * Tests for dist/store.h: the server in this process (or, for the tests that fork
 * while it serves, in a process of its own) and clients in forked processes:
 * set/get/add/check/wait/delete, a get parked until a later set, timeouts within bounds and
 * naming key and addr:port, connect retries while the server starts late, a closed handle
 * that connects again to a new server on the same port, and a server that keeps serving
 * after garbage bytes, a client that hangs up mid-frame or while parked.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "embd/types.h"
#include "common/clock.h"
#include "dist/store.h"
#include "dist/store_wire.h"
#include "tests/support/dist_util.h"
#include "tests/support/ports.h"

#define SLACK_MS 1500           /* scheduling slack of a loaded 2-core CI machine */

static struct embd_store *client(int timeout_ms)
{
	struct embd_store *s = NULL;
	char err[256] = "";
	int rc = embd_store_connect("127.0.0.1", tu_port, timeout_ms, &s, err, sizeof(err));
	cr_assert_eq(rc, 0, "connect: %d %s", rc, err);
	return s;
}

TestSuite(store, .init = tu_server_start, .fini = tu_server_stop, .timeout = 30);
/* Tests that fork clients while the server runs take it in a process of its own, so this
 * process has no thread at the fork (dist_util.h: tu_server_process_start). */
TestSuite(store_forked, .init = tu_server_process_start, .fini = tu_server_process_stop,
	  .timeout = 30);

Test(store, set_get_check_add_delete)
{
	struct embd_store *s = client(2000);
	const uint8_t bin[] = { 0, 1, 2, 0, 255 };
	void *v = NULL;
	size_t len = 0;
	int64_t n = 0;

	cr_assert_eq(embd_store_check(s, "k"), 0);
	cr_assert_eq(embd_store_set(s, "k", bin, sizeof(bin)), 0, "%s", embd_store_error(s));
	cr_assert_eq(embd_store_check(s, "k"), 1);
	cr_assert_eq(embd_store_get(s, "k", &v, &len), 0, "%s", embd_store_error(s));
	cr_assert_eq(len, sizeof(bin));
	cr_assert_arr_eq(v, bin, sizeof(bin));
	free(v);

	cr_assert_eq(embd_store_set(s, "empty", "", 0), 0);
	cr_assert_eq(embd_store_get(s, "empty", &v, &len), 0);
	cr_assert_eq(len, 0u);
	free(v);

	cr_assert_eq(embd_store_add(s, "ctr", 5, &n), 0, "%s", embd_store_error(s));
	cr_assert_eq(n, 5);
	cr_assert_eq(embd_store_add(s, "ctr", -7, &n), 0);
	cr_assert_eq(n, -2);
	cr_assert_eq(embd_store_get(s, "ctr", &v, &len), 0);
	cr_assert(len == 2 && memcmp(v, "-2", 2) == 0, "counter reads as text, got %zu bytes", len);
	free(v);
	cr_assert_eq(embd_store_add(s, "k", 1, &n), EMBD_EINVAL, "add on binary data");
	cr_assert(strstr(embd_store_error(s), "'k'"), "got \"%s\"", embd_store_error(s));

	cr_assert_eq(embd_store_delete(s, "k"), 0);
	cr_assert_eq(embd_store_check(s, "k"), 0);
	cr_assert_eq(embd_store_delete(s, "k"), EMBD_ENOENT);

	/* overwrite keeps one entry with the new value */
	cr_assert_eq(embd_store_set(s, "o", "one", 3), 0);
	cr_assert_eq(embd_store_set(s, "o", "two!", 4), 0);
	cr_assert_eq(embd_store_get(s, "o", &v, &len), 0);
	cr_assert(len == 4 && memcmp(v, "two!", 4) == 0);
	free(v);

	/* the handle is still usable after these server-answered errors */
	const char *keys[] = { "o", "ctr" };
	cr_assert_eq(embd_store_wait(s, keys, 2), 0, "%s", embd_store_error(s));
	embd_store_close(s);
}

Test(store, bad_arguments)
{
	struct embd_store *s = client(2000);
	char key[EMBD_STORE_KEY_MAX + 2];

	memset(key, 'x', sizeof(key) - 1);
	key[sizeof(key) - 1] = '\0';
	cr_assert_eq(embd_store_set(s, "", "v", 1), EMBD_EINVAL);
	cr_assert_eq(embd_store_set(s, key, "v", 1), EMBD_EINVAL);
	cr_assert(strstr(embd_store_error(s), "257 bytes"), "got \"%s\"", embd_store_error(s));
	key[EMBD_STORE_KEY_MAX] = '\0';     /* exactly the longest key */
	cr_assert_eq(embd_store_set(s, key, "v", 1), 0, "%s", embd_store_error(s));
	cr_assert_eq(embd_store_check(s, key), 1);
	cr_assert_eq(embd_store_wait(s, NULL, 0), 0);
	embd_store_close(s);
}

Test(store, large_value)
{
	struct embd_store *s = client(5000);
	size_t n = 3u << 20;
	uint8_t *big = malloc(n);
	void *v = NULL;
	size_t len = 0;

	for (size_t i = 0; i < n; i++)
		big[i] = (uint8_t)(i * 131 + 7);
	cr_assert_eq(embd_store_set(s, "plan", big, n), 0, "%s", embd_store_error(s));
	cr_assert_eq(embd_store_get(s, "plan", &v, &len), 0, "%s", embd_store_error(s));
	cr_assert_eq(len, n);
	cr_assert(memcmp(v, big, n) == 0, "3 MiB value came back different");
	free(v);
	free(big);
	embd_store_close(s);
}

/* ---- many clients ---------------------------------------------------------------------- */

#define NCHILD 5

static int child_counter(int i, void *arg)
{
	(void)arg;
	struct embd_store *s = NULL;
	char err[256], key[32];
	int64_t n;
	TU_CHECK(embd_store_connect("127.0.0.1", tu_port, 5000, &s, err, sizeof(err)) == 0, "%s", err);
	for (int k = 0; k < 20; k++)
		TU_CHECK(embd_store_add(s, "count", 1, &n) == 0, "%s", embd_store_error(s));
	snprintf(key, sizeof(key), "rank_%d", i);
	TU_CHECK(embd_store_set(s, key, &i, sizeof(i)) == 0, "%s", embd_store_error(s));
	/* everyone waits for everyone: parked WAITs answered by other clients' SETs */
	const char *keys[NCHILD];
	char names[NCHILD][32];
	for (int r = 0; r < NCHILD; r++) {
		snprintf(names[r], sizeof(names[r]), "rank_%d", r);
		keys[r] = names[r];
	}
	TU_CHECK(embd_store_wait(s, keys, NCHILD) == 0, "%s", embd_store_error(s));
	for (int r = 0; r < NCHILD; r++) {
		void *v;
		size_t len;
		TU_CHECK(embd_store_get(s, keys[r], &v, &len) == 0, "%s", embd_store_error(s));
		TU_CHECK(len == sizeof(int) && *(int *)v == r, "rank_%d holds %zu bytes", r, len);
		free(v);
	}
	embd_store_close(s);
	return 0;
}

Test(store_forked, many_clients_add_set_wait)
{
	pid_t pids[NCHILD];
	int codes[NCHILD];
	tu_spawn_n(child_counter, NCHILD, NULL, pids);
	int failed = tu_join(pids, NCHILD, 15000, codes);
	for (int i = 0; i < NCHILD; i++)
		cr_expect_eq(codes[i], 0, "child %d exited %d", i, codes[i]);
	cr_assert_eq(failed, 0);

	struct embd_store *s = client(2000);
	int64_t n = 0;
	cr_assert_eq(embd_store_add(s, "count", 0, &n), 0);
	cr_assert_eq(n, 20 * NCHILD, "expected %d adds, got %lld", 20 * NCHILD, (long long)n);
	embd_store_close(s);
}

static int child_late_setter(int i, void *arg)
{
	(void)i;
	(void)arg;
	struct embd_store *s = NULL;
	char err[256];
	usleep(300 * 1000);
	TU_CHECK(embd_store_connect("127.0.0.1", tu_port, 5000, &s, err, sizeof(err)) == 0, "%s", err);
	TU_CHECK(embd_store_set(s, "late", "here", 4) == 0, "%s", embd_store_error(s));
	usleep(100 * 1000);
	TU_CHECK(embd_store_set(s, "later", "x", 1) == 0, "%s", embd_store_error(s));
	embd_store_close(s);
	return 0;
}

Test(store_forked, get_waits_for_a_later_set)
{
	struct embd_store *s = client(5000);
	void *v = NULL;
	size_t len = 0;
	int code;
	pid_t pid = tu_spawn(child_late_setter, 0, NULL);
	int64_t t0 = embd_now_ms();

	cr_assert_eq(embd_store_get(s, "late", &v, &len), 0, "%s", embd_store_error(s));
	int64_t waited = embd_now_ms() - t0;
	cr_assert(len == 4 && memcmp(v, "here", 4) == 0);
	cr_assert(waited >= 250, "get returned after %lld ms, before the set", (long long)waited);
	free(v);
	const char *keys[] = { "late", "later" };
	cr_assert_eq(embd_store_wait(s, keys, 2), 0, "%s", embd_store_error(s));
	cr_assert_eq(tu_join(&pid, 1, 10000, &code), 0, "setter exited %d", code);
	embd_store_close(s);
}

/* ---- timeouts -------------------------------------------------------------------------- */

Test(store, timeouts_within_bounds_and_named)
{
	struct embd_store *s = client(300);
	char where[64];
	void *v = NULL;
	size_t len = 0;

	snprintf(where, sizeof(where), "127.0.0.1:%u", tu_port);
	int64_t t0 = embd_now_ms();
	cr_assert_eq(embd_store_get(s, "never", &v, &len), EMBD_ETIMEDOUT);
	int64_t took = embd_now_ms() - t0;
	cr_assert(took >= 280 && took <= 300 + SLACK_MS, "get timed out after %lld ms",
		  (long long)took);
	cr_assert(strstr(embd_store_error(s), "'never'"), "got \"%s\"", embd_store_error(s));
	cr_assert(strstr(embd_store_error(s), where), "got \"%s\"", embd_store_error(s));
	cr_assert_null(v);

	/* a wait names only the keys that are missing */
	cr_assert_eq(embd_store_set(s, "present", "1", 1), 0, "%s", embd_store_error(s));
	const char *keys[] = { "present", "absent_a", "absent_b" };
	embd_store_set_timeout(s, 200);
	t0 = embd_now_ms();
	cr_assert_eq(embd_store_wait(s, keys, 3), EMBD_ETIMEDOUT);
	took = embd_now_ms() - t0;
	cr_assert(took >= 180 && took <= 200 + SLACK_MS, "wait timed out after %lld ms",
		  (long long)took);
	const char *e = embd_store_error(s);
	cr_assert(strstr(e, "'absent_a'") && strstr(e, "'absent_b'") && !strstr(e, "'present'"),
		  "got \"%s\"", e);

	/* timeout 0 answers at once, and the handle stays in step after timeouts */
	embd_store_set_timeout(s, 0);
	cr_assert_eq(embd_store_get(s, "never", &v, &len), EMBD_ETIMEDOUT);
	cr_assert_eq(embd_store_get(s, "present", &v, &len), 0, "%s", embd_store_error(s));
	cr_assert(len == 1 && *(char *)v == '1');
	free(v);
	embd_store_close(s);
}

/* ---- the server goes away -------------------------------------------------------------- */

Test(store, server_gone_is_connreset)
{
	struct embd_store *s = client(2000);
	cr_assert_eq(embd_store_set(s, "a", "1", 1), 0);
	tu_server_stop();
	int64_t t0 = embd_now_ms();
	int rc = embd_store_set(s, "b", "1", 1);
	if (rc == 0)    /* the kernel may accept one send before the reset arrives */
		rc = embd_store_set(s, "b", "1", 1);
	cr_assert_eq(rc, EMBD_ECONNRESET, "got %d %s", rc, embd_store_error(s));
	cr_assert(embd_now_ms() - t0 < 1000, "noticed late");
	cr_assert_eq(embd_store_check(s, "a"), EMBD_ECONNRESET, "later calls fail too");
	embd_store_close(s);
	tu_server_start();     /* for .fini */
}

static void *stop_later(void *arg)
{
	usleep(300 * 1000);
	embd_store_server_stop(arg);
	return NULL;
}

Test(store, parked_get_sees_server_stop)
{
	struct embd_store *s = client(10000);
	void *v = NULL;
	size_t len = 0;
	pthread_t t;

	cr_assert_eq(pthread_create(&t, NULL, stop_later, tu_server), 0);
	tu_server = NULL;
	int64_t t0 = embd_now_ms();
	cr_assert_eq(embd_store_get(s, "x", &v, &len), EMBD_ECONNRESET, "%s", embd_store_error(s));
	int64_t took = embd_now_ms() - t0;
	cr_assert(took >= 250 && took < 300 + SLACK_MS, "get returned after %lld ms",
		  (long long)took);
	pthread_join(t, NULL);
	embd_store_close(s);
	tu_server_start();
}

/* ---- connecting ------------------------------------------------------------------------ */

enum { LATE_SERVER_NO_PORT = 2 }; /* child_late_server's exit code when it could not listen */

static int child_late_server(int i, void *arg)
{
	(void)i;
	struct embd_store_server *srv = NULL;
	struct embd_store *s = NULL;
	const char *up = "up";
	char err[256];
	uint16_t p = *(uint16_t *)arg;
	usleep(400 * 1000);
	if (embd_store_server_start("127.0.0.1", p, &srv, err, sizeof(err))) {
		/* another test took the port while this one waited (ports.h): the parent retries */
		fprintf(stderr, "[child %d] late server: %s\n", (int)getpid(), err);
		return LATE_SERVER_NO_PORT;
	}
	/* serve until the parent has connected and set "up" */
	TU_CHECK(embd_store_connect("127.0.0.1", p, 10000, &s, err, sizeof(err)) == 0, "%s", err);
	TU_CHECK(embd_store_wait(s, &up, 1) == 0, "%s", embd_store_error(s));
	embd_store_close(s);
	embd_store_server_stop(srv);
	return 0;
}

/* The port is free when the parent starts connecting and the server binds it 400 ms later: a
 * parallel test's socket may take it in between (the child then cannot listen, and the parent
 * may even have reached that test's listener), so the attempt is made again on another port. */
Test(store_forked, connect_retries_until_the_server_is_up)
{
	for (int attempt = 1;; attempt++) {
		uint16_t late_port = tu_free_port();
		struct embd_store *s = NULL;
		char err[256] = "";
		int code;
		pid_t pid = tu_spawn(child_late_server, 0, &late_port);
		int64_t t0 = embd_now_ms();

		int rc = embd_store_connect("127.0.0.1", late_port, 5000, &s, err, sizeof(err));
		const int64_t took = embd_now_ms() - t0;
		int set_rc = rc ? rc : embd_store_set(s, "up", "1", 1);
		if (!rc && set_rc)
			snprintf(err, sizeof(err), "%s", embd_store_error(s));
		if (!rc)
			embd_store_close(s);
		tu_join(&pid, 1, 10000, &code);
		if (code == LATE_SERVER_NO_PORT && attempt < 3)
			continue;
		cr_assert_eq(rc, 0, "connect: %d %s", rc, err);
		cr_assert(took >= 350, "connected before the server started");
		cr_assert_eq(set_rc, 0, "set: %s", err);
		cr_assert_eq(code, 0, "late server exited %d", code);
		return;
	}
}

/* A port some other test may have taken since tu_free_port (the connect then succeeds) is
 * tried again with another one. */
Test(store, connect_timeout_names_the_address)
{
	struct embd_store *s = NULL;
	char err[256] = "", where[64];
	int64_t took;
	int rc;

	for (int attempt = 1;; attempt++) {
		uint16_t dead_port = tu_free_port();
		snprintf(where, sizeof(where), "127.0.0.1:%u", dead_port);
		int64_t t0 = embd_now_ms();
		rc = embd_store_connect("127.0.0.1", dead_port, 300, &s, err, sizeof(err));
		took = embd_now_ms() - t0;
		if (rc != 0 || attempt == 3)
			break;
		embd_store_close(s);
		s = NULL;
	}
	cr_assert_eq(rc, EMBD_ETIMEDOUT, "got %d %s", rc, err);
	cr_assert_null(s);
	cr_assert(took >= 280 && took <= 300 + SLACK_MS, "gave up after %lld ms", (long long)took);
	cr_assert(strstr(err, where), "got \"%s\"", err);
}

/* ---- hostile peers --------------------------------------------------------------------- */

static int raw_connect(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(tu_port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	cr_assert_geq(fd, 0);
	cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	return fd;
}

/* Sends bytes, then reads until the server closes; returns the status of its first answer
 * (or 1 when it closed without one). */
static int32_t raw_exchange(const void *bytes, size_t len)
{
	int fd = raw_connect();
	uint8_t buf[1024];
	size_t got = 0;
	ssize_t n;

	cr_assert_eq(send(fd, bytes, len, MSG_NOSIGNAL), (ssize_t)len);
	struct timeval tv = { .tv_sec = 5 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	while ((n = recv(fd, buf + got, sizeof(buf) - got, 0)) > 0)
		got += (size_t)n;
	cr_assert_eq(n, 0, "the server should close the connection (recv %zd, errno %d)", n,
		     errno);
	close(fd);
	return got >= 8 ? (int32_t)embd_wire_get_u32(buf + 4) : 1;
}

static void assert_still_serving(void)
{
	struct embd_store *s = client(2000);
	int64_t n = 0;
	cr_assert_eq(embd_store_add(s, "alive", 1, &n), 0, "%s", embd_store_error(s));
	embd_store_close(s);
}

Test(store, survives_garbage_and_bad_frames)
{
	/* a length beyond the limit */
	const uint8_t huge[] = { 0xff, 0xff, 0xff, 0xff, 1, 2, 3 };
	cr_assert_eq(raw_exchange(huge, sizeof(huge)), EMBD_EPROTO);
	/* an unknown op */
	const uint8_t unknown[] = { 0, 0, 0, 1, 99 };
	cr_assert_eq(raw_exchange(unknown, sizeof(unknown)), EMBD_EPROTO);
	/* a key length running past the body */
	const uint8_t past[] = { 0, 0, 0, 4, EMBD_STORE_OP_CHECK, 0, 200, 'k' };
	cr_assert_eq(raw_exchange(past, sizeof(past)), EMBD_EPROTO);
	/* a key with a NUL byte, and an empty key */
	const uint8_t nul[] = { 0, 0, 0, 5, EMBD_STORE_OP_CHECK, 0, 2, 'k', 0 };
	cr_assert_eq(raw_exchange(nul, sizeof(nul)), EMBD_EPROTO);
	const uint8_t empty[] = { 0, 0, 0, 3, EMBD_STORE_OP_DELETE, 0, 0 };
	cr_assert_eq(raw_exchange(empty, sizeof(empty)), EMBD_EPROTO);
	/* bytes left over after a valid CHECK */
	const uint8_t extra[] = { 0, 0, 0, 5, EMBD_STORE_OP_CHECK, 0, 1, 'k', 7 };
	cr_assert_eq(raw_exchange(extra, sizeof(extra)), EMBD_EPROTO);
	/* a WAIT with too many keys */
	const uint8_t many[] = { 0, 0, 0, 7, EMBD_STORE_OP_WAIT, 0, 0, 0, 0, 0xff, 0xff };
	cr_assert_eq(raw_exchange(many, sizeof(many)), EMBD_EPROTO);
	/* a zero-length body */
	const uint8_t zero[] = { 0, 0, 0, 0 };
	cr_assert_eq(raw_exchange(zero, sizeof(zero)), EMBD_EPROTO);
	/* random bytes */
	uint8_t noise[512];
	srand(7);
	for (size_t i = 0; i < sizeof(noise); i++)
		noise[i] = (uint8_t)rand();
	noise[0] = 0x40;        /* a length far beyond the limit */
	cr_assert_eq(raw_exchange(noise, sizeof(noise)), EMBD_EPROTO);
	assert_still_serving();
}

Test(store, survives_hangups_mid_frame_and_while_parked)
{
	/* half a SET: the header promises 100 bytes, 10 arrive, then the peer is gone */
	int fd = raw_connect();
	const uint8_t half[] = { 0, 0, 0, 100, EMBD_STORE_OP_SET, 0, 1, 'k', 0, 0 };
	cr_assert_eq(send(fd, half, sizeof(half), MSG_NOSIGNAL), (ssize_t)sizeof(half));
	close(fd);
	/* a GET parked for 10 s, then the peer is gone */
	fd = raw_connect();
	const uint8_t get[] = { 0, 0, 0, 9, EMBD_STORE_OP_GET, 0, 0, 0x27, 0x10, 0, 2, 'n', 'o' };
	cr_assert_eq(send(fd, get, sizeof(get), MSG_NOSIGNAL), (ssize_t)sizeof(get));
	usleep(50 * 1000);
	close(fd);
	/* a header cut in two */
	fd = raw_connect();
	cr_assert_eq(send(fd, half, 2, MSG_NOSIGNAL), 2);
	close(fd);
	usleep(50 * 1000);
	assert_still_serving();
	/* and a SET after that wakes nobody stale */
	struct embd_store *s = client(2000);
	cr_assert_eq(embd_store_set(s, "no", "1", 1), 0, "%s", embd_store_error(s));
	embd_store_close(s);
	assert_still_serving();
}

Test(store, pipelined_requests_are_answered_in_order)
{
	/* two requests in one send: the server parks the first and answers the second after it */
	int fd = raw_connect();
	const uint8_t two[] = {
		0, 0, 0, 8, EMBD_STORE_OP_GET, 0, 0, 0, 100, 0, 1, 'p',         /* GET p, 100 ms */
		0, 0, 0, 4, EMBD_STORE_OP_CHECK, 0, 1, 'p',                     /* CHECK p */
	};
	uint8_t buf[64];
	size_t got = 0;
	ssize_t n;
	cr_assert_eq(send(fd, two, sizeof(two), MSG_NOSIGNAL), (ssize_t)sizeof(two));
	struct timeval tv = { .tv_sec = 5 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	while (got < 8 + 9 && (n = recv(fd, buf + got, sizeof(buf) - got, 0)) > 0)
		got += (size_t)n;
	close(fd);
	cr_assert_geq(got, 8u);
	uint32_t len0 = embd_wire_get_u32(buf);
	cr_assert_eq((int32_t)embd_wire_get_u32(buf + 4), EMBD_ETIMEDOUT, "first: the GET");
	cr_assert_geq(got, 4 + len0 + 9, "second answer missing (%zu bytes)", got);
	cr_assert_eq(embd_wire_get_u32(buf + 4 + len0), 5u);
	cr_assert_eq(embd_wire_get_u32(buf + 8 + len0), 0u);
	cr_assert_eq(buf[12 + len0], 0, "p does not exist");
}

/* ---- connecting again ------------------------------------------------------------------- */

/* A handle closed by a server that went away connects again to whatever serves the same
 * address later (the caller tells old from new by a key of its own: dist/regroup.h). */
/* One try of the test below on port p: true when someone else took p (the store server cannot
 * listen on it, or a reconnect with no server of ours finds one), which the test retries on
 * another port; else its checks ran. */
static bool reconnect_on(uint16_t p)
{
	struct embd_store_server *a = NULL, *b = NULL;
	struct embd_store *s = NULL;
	char err[256] = "";
	int rc = embd_store_server_start("127.0.0.1", p, &a, err, sizeof(err));

	if (rc == EMBD_EBUSY)
		return true;
	cr_assert_eq(rc, 0, "%s", err);
	cr_assert_eq(embd_store_connect("127.0.0.1", p, 2000, &s, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_store_reconnect(s, 100), 0, "an open handle: expected 0 at once");
	cr_assert_eq(embd_store_set(s, "old", "1", 1), 0, "%s", embd_store_error(s));
	embd_store_server_stop(a);
	rc = embd_store_check(s, "old");
	if (rc >= 0)    /* the kernel may take one request before the reset arrives */
		rc = embd_store_check(s, "old");
	cr_assert_eq(rc, EMBD_ECONNRESET, "server gone: expected ECONNRESET, got %d", rc);
	int64_t t0 = embd_now_ms();
	rc = embd_store_reconnect(s, 300);
	if (rc == 0) {
		embd_store_close(s);
		return true;
	}
	cr_assert_eq(rc, EMBD_ETIMEDOUT, "no server: expected ETIMEDOUT, got %d", rc);
	cr_assert(embd_now_ms() - t0 >= 250, "gave up after %lld ms, expected ~300",
		  (long long)(embd_now_ms() - t0));
	rc = embd_store_server_start("127.0.0.1", p, &b, err, sizeof(err));
	if (rc == EMBD_EBUSY) {
		embd_store_close(s);
		return true;
	}
	cr_assert_eq(rc, 0, "%s", err);
	rc = embd_store_reconnect(s, 2000);
	cr_assert_eq(rc, 0, "new server: expected 0, got %d (%s)", rc, embd_store_error(s));
	cr_assert_eq(embd_store_check(s, "old"), 0, "the new server should not hold 'old'");
	cr_assert_eq(embd_store_set(s, "new", "1", 1), 0, "%s", embd_store_error(s));
	embd_store_close(s);
	embd_store_server_stop(b);
	return false;
}

Test(store, reconnect_reaches_a_new_server_on_the_same_port)
{
	for (int attempt = 1; reconnect_on(tu_free_port()); attempt++)
		cr_assert(attempt < 3, "someone else took the port in each of 3 tries");
}
