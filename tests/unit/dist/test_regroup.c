/*
 * Tests for dist/regroup.h: the decision every node takes from the state records (resume
 * when every node applied the same step, restore or lost naming the node that restarted or the
 * nodes that disagree), the state record's text and its malformed forms, and generations
 * formed by forked processes through a real store with real Gloo comms: two nodes whose
 * collective failed meet in generation 1 and resume; a node that restarted (no comm) opens the
 * next generation, the running node sees it, and both decide to restore; with three nodes a
 * running node is told the one that opened the generation, not the last that joined it. After
 * a restore, every node reads the same outcome records: a node that did not report (its record
 * written by whoever gave up on it) or failed transiently sends both to the next generation,
 * one whose data failed is named on both with its reason, a slow restore is waited for.
 * Reattaching through a relay in front of the store that holds the read of node 0's instance
 * key (node 0 stalling again between the key check and the read): not a new store, tried again
 * later; a join whose writes the relay holds halfway leaves the node's generation, and the
 * retry joins the same one.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "embd/types.h"
#include "common/clock.h"
#include "dist/comm.h"
#include "dist/regroup.h"
#include "dist/store.h"
#include "dist/store_wire.h"
#include "tests/support/dist_util.h"

TestSuite(regroup, .timeout = 40);

/* ---- the decision ------------------------------------------------------------------------ */

Test(regroup, same_applied_step_resumes_there)
{
	struct embd_regroup_state st[3] = { { 7, false }, { 7, false }, { 7, false } };
	struct embd_regroup_decision d;

	embd_regroup_decide(st, 3, true, &d);
	cr_expect_eq(d.verdict, EMBD_REGROUP_RESUME, "expected RESUME, got %d", d.verdict);
	cr_expect_eq(d.step, 7, "expected step 7, got %llu", (unsigned long long)d.step);
}

Test(regroup, a_restarted_node_restores_or_is_named_lost)
{
	struct embd_regroup_state st[3] = { { 7, false }, { 0, true }, { 7, false } };
	struct embd_regroup_decision d;

	embd_regroup_decide(st, 3, true, &d);
	cr_expect_eq(d.verdict, EMBD_REGROUP_RESTORE, "with checkpoints: expected RESTORE, got %d",
		     d.verdict);
	embd_regroup_decide(st, 3, false, &d);
	cr_expect_eq(d.verdict, EMBD_REGROUP_LOST, "without: expected LOST, got %d", d.verdict);
	cr_expect(strstr(d.why, "node 1 restarted") != NULL, "expected the why to name node 1, "
		  "got '%s'", d.why);
	/* a restarted node with the same step number still lost its shards */
	st[1].applied = 7;
	embd_regroup_decide(st, 3, false, &d);
	cr_expect_eq(d.verdict, EMBD_REGROUP_LOST, "expected LOST, got %d", d.verdict);
}

Test(regroup, half_applied_gradient_exchange_is_not_resumed)
{
	struct embd_regroup_state st[2] = { { 5, false }, { 4, false } };
	struct embd_regroup_decision d;

	embd_regroup_decide(st, 2, false, &d);
	cr_expect_eq(d.verdict, EMBD_REGROUP_LOST, "expected LOST, got %d", d.verdict);
	cr_expect(strstr(d.why, "0 at 5") && strstr(d.why, "1 at 4"), "expected both nodes' steps "
		  "named, got '%s'", d.why);
	embd_regroup_decide(st, 2, true, &d);
	cr_expect_eq(d.verdict, EMBD_REGROUP_RESTORE, "expected RESTORE, got %d", d.verdict);
}

Test(regroup, state_records_round_trip_and_malformed_ones_are_refused)
{
	struct embd_regroup_state in = { 123456789012ull, true }, out = { 0 };
	char text[64];

	cr_assert_eq(embd_regroup_state_format(&in, text, sizeof(text)), 0);
	cr_assert_eq(embd_regroup_state_parse(text, strlen(text), &out), 0, "'%s' refused", text);
	cr_expect(out.applied == in.applied && out.lost, "expected 123456789012/lost, got %llu/%d",
		  (unsigned long long)out.applied, out.lost);
	static const char *const bad[] = { "", "applied 1", "applied -1 lost 0", "applied 1 lost 2",
					   "applied 1 lost 0 x", "lost 0 applied 1" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_expect_eq(embd_regroup_state_parse(bad[i], strlen(bad[i]), &out), EMBD_EPARSE,
			     "'%s': expected EMBD_EPARSE", bad[i]);
}

/* ---- generations through a real store ---------------------------------------------------- */

#define NODES 2
#define TIMEOUT_MS 3000

struct scenario {
	bool restarted;                 /* node 1 starts without a comm (restarted) */
};

static struct embd_regroup *node_start(int node, bool no_comm, struct embd_store **store)
{
	char err[512] = "";
	struct embd_comm *comm = NULL;
	struct embd_regroup *rg = NULL;

	if (embd_store_connect("127.0.0.1", tu_port, 5000, store, err, sizeof(err)) < 0) {
		fprintf(stderr, "[node %d] store: %s\n", node, err);
		return NULL;
	}
	struct embd_comm_options co = {
		.backend = EMBD_COMM_GLOO, .rank = (uint32_t)node, .size = NODES,
		.timeout_ms = TIMEOUT_MS, .hostname = "", .prefix = "embd/gen/0/gloo/",
	};
	if (embd_comm_create(&co, *store, &comm, err, sizeof(err))) {
		fprintf(stderr, "[node %d] comm: %s\n", node, err);
		return NULL;
	}
	/* both comms are up before either node goes on: a node that "restarts" below must not
	 * close its pairs while the other's generation 0 is still connecting */
	char up[32];
	const char *both[NODES] = { "test/gen0-up/0", "test/gen0-up/1" };
	snprintf(up, sizeof(up), "test/gen0-up/%d", node);
	if (embd_store_set(*store, up, "1", 1) || embd_store_wait(*store, both, NODES)) {
		fprintf(stderr, "[node %d] gen-0 barrier: %s\n", node, embd_store_error(*store));
		return NULL;
	}
	struct embd_regroup_options o = { .node = (uint32_t)node, .nodes = NODES,
					  .backend = EMBD_COMM_GLOO,
					  .collective_timeout_ms = TIMEOUT_MS,
					  .store_timeout_ms = TIMEOUT_MS };
	if (embd_regroup_create(&o, *store, comm, &rg))
		return NULL;
	if (!no_comm)
		return rg;
	/* a restart: the process that held generation 0 is gone, a new one has no comm */
	embd_regroup_destroy(rg);
	return embd_regroup_create(&o, *store, NULL, &rg) ? NULL : rg;
}

/* Polls until the generation formed (or 10 s); 1 = formed. */
static int form(struct embd_regroup *rg, const struct embd_regroup_state *mine,
		struct embd_regroup_decision *d, int node)
{
	char err[512];
	int64_t end = embd_now_ms() + 10000;

	while (embd_now_ms() < end) {
		int rc = embd_regroup_poll(rg, mine, true, d, err, sizeof(err));
		if (rc == 1)
			return embd_regroup_finish(rg, err, sizeof(err)) == 0;
		if (rc < 0 && rc != EMBD_EAGAIN) {
			fprintf(stderr, "[node %d] poll: %d %s\n", node, rc, err);
			return 0;
		}
		usleep(20000);
	}
	fprintf(stderr, "[node %d] not formed within 10 s: %s\n", node, err);
	return 0;
}

static int regroup_node(int node, void *arg)
{
	const struct scenario *sc = arg;
	struct embd_store *store = NULL;
	struct embd_regroup_decision d;
	char err[512];
	const bool restarted = sc->restarted && node == 1;
	struct embd_regroup *rg = node_start(node, restarted, &store);

	TU_CHECK(rg != NULL, "node %d could not start", node);
	struct embd_regroup_state mine = { .applied = restarted ? 0 : 3, .lost = restarted };
	if (!sc->restarted) {
		/* both saw their collective fail: both start generation 1 */
		TU_CHECK(embd_regroup_start(rg, err, sizeof(err)) == 0, "start: %s", err);
	} else if (!restarted) {
		/* running at generation 0 until the restarted node opens the next one */
		int64_t end = embd_now_ms() + 10000;
		uint32_t by = 0;
		int rc = 0;
		while (embd_now_ms() < end &&
		       (rc = embd_regroup_newer(rg, &by, err, sizeof(err))) == 0)
			usleep(20000);
		TU_CHECK(rc == 1, "expected to see a newer generation open, got %d (%s)", rc, err);
		TU_CHECK(by == 1, "expected node 1 to have opened it, got %u", by);
		TU_CHECK(embd_regroup_start(rg, err, sizeof(err)) == 0, "start: %s", err);
	}
	TU_CHECK(form(rg, &mine, &d, node), "node %d: generation not formed", node);
	TU_CHECK(embd_regroup_generation(rg) == 1, "expected generation 1, got %llu",
		 (unsigned long long)embd_regroup_generation(rg));
	if (sc->restarted) {
		TU_CHECK(d.verdict == EMBD_REGROUP_RESTORE && strstr(d.why, "node 1"),
			 "expected RESTORE naming node 1, got %d '%s'", d.verdict, d.why);
	} else {
		TU_CHECK(d.verdict == EMBD_REGROUP_RESUME && d.step == 3,
			 "expected RESUME at 3, got %d at %llu", d.verdict,
			 (unsigned long long)d.step);
	}
	/* the new comm works */
	uint64_t v = (uint64_t)node + 1;
	struct embd_comm *comm = embd_regroup_comm(rg);
	TU_CHECK(comm && embd_comm_allreduce_u64(comm, &v, 1) == 0 && v == 3,
		 "allreduce on generation 1: expected 3, got %llu", (unsigned long long)v);
	embd_regroup_destroy(rg);
	embd_store_close(store);
	return 0;
}

static void run(struct scenario *sc)
{
	pid_t pids[NODES];
	int codes[NODES];

	tu_spawn_n(regroup_node, NODES, sc, pids);
	tu_join(pids, NODES, 30000, codes);
	for (int i = 0; i < NODES; i++)
		cr_expect_eq(codes[i], 0, "node %d exited %d (%s)", i, codes[i],
			     codes[i] == TU_HUNG ? "hung" : "failed");
}

Test(regroup, failed_nodes_meet_in_the_next_generation_and_resume,
     .init = tu_server_process_start, .fini = tu_server_process_stop)
{
	struct scenario sc = { .restarted = false };
	run(&sc);
}

Test(regroup, a_restarted_node_opens_a_generation_the_others_join,
     .init = tu_server_process_start, .fini = tu_server_process_stop)
{
	struct scenario sc = { .restarted = true };
	run(&sc);
}

/* ---- every node's restore outcome -------------------------------------------------------- */

/* One node's embd_regroup_restored, run on a thread of its own so both nodes wait alike. */
struct turn {
	struct embd_regroup *rg;
	int restore_rc;
	const char *why;
	int restore_ms, delay_ms;       /* its restore's time; a sleep before it reports */
	int rc;
	char err[512];
};

static void *turn_run(void *arg)
{
	struct turn *t = arg;

	if (t->delay_ms)
		usleep((useconds_t)t->delay_ms * 1000);
	t->err[0] = 0;
	t->rc = embd_regroup_restored(t->rg, t->restore_rc, t->why, t->restore_ms, t->err,
				      sizeof(t->err));
	return NULL;
}

static void both_report(struct turn *t0, struct turn *t1)
{
	pthread_t th;

	cr_assert_eq(pthread_create(&th, NULL, turn_run, t1), 0);
	turn_run(t0);
	pthread_join(th, NULL);
}

/* Three nodes: node 2 restarts and opens generation 1, node 1 (running) joins it before node 0
 * looks: node 0 is told node 2 re-forms the cluster, not the last node that joined. */
Test(regroup, a_running_node_is_told_who_opened_the_newer_generation,
     .init = tu_server_start, .fini = tu_server_stop)
{
	const struct embd_regroup_options o = { .nodes = 3, .backend = EMBD_COMM_GLOO,
						.collective_timeout_ms = TIMEOUT_MS,
						.store_timeout_ms = 300 };
	struct embd_regroup_options on[3] = { o, o, o };
	struct embd_store *s[3] = { NULL };
	struct embd_regroup *rg[3] = { NULL };
	char err[512] = "";
	uint32_t by = 0;

	for (uint32_t n = 0; n < 3; n++) {
		on[n].node = n;
		cr_assert_eq(embd_store_connect("127.0.0.1", tu_port, 5000, &s[n], err, sizeof(err)),
			     0, "%s", err);
		cr_assert_eq(embd_regroup_create(&on[n], s[n], NULL, &rg[n]), 0);
	}
	cr_assert_eq(embd_regroup_newer(rg[0], &by, err, sizeof(err)), 0, "nothing open yet: %s",
		     err);
	/* node 2, restarted, opens generation 1 */
	cr_assert_eq(embd_regroup_start(rg[2], err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_regroup_generation(rg[2]), 1);
	/* node 1 sees it and joins (a handle made without a comm would open one of its own:
	 * its join's writes are the running node's) */
	cr_assert_eq(embd_regroup_newer(rg[1], &by, err, sizeof(err)), 1, "%s", err);
	cr_expect_eq(by, 2, "node 1: expected node 2 to re-form, got %u", by);
	int64_t joined = 0;
	cr_assert_eq(embd_store_add(s[1], "embd/gen/1/joined", 1, &joined), 0);
	cr_assert_eq(joined, 2, "node 1 should be the second to join, the count says %lld",
		     (long long)joined);
	cr_assert_eq(embd_store_set(s[1], "embd/gen/1/open", "1", 1), 0);
	cr_assert_eq(embd_store_set(s[1], "embd/gen/1/join/1", "1", 1), 0);
	by = 0;
	cr_assert_eq(embd_regroup_newer(rg[0], &by, err, sizeof(err)), 1, "%s", err);
	cr_expect_eq(by, 2, "node 0: expected node 2 (which opened generation 1) to re-form, got %u",
		     by);
	for (uint32_t n = 0; n < 3; n++) {
		embd_regroup_destroy(rg[n]);
		embd_store_close(s[n]);
	}
}

/* Two nodes' regroup handles in this process (no comm: the outcome needs only the store). */
Test(regroup, restore_outcomes_decide_alike_on_every_node,
     .init = tu_server_start, .fini = tu_server_stop)
{
	const struct embd_regroup_options o0 = { .node = 0, .nodes = NODES,
						  .backend = EMBD_COMM_GLOO,
						  .collective_timeout_ms = TIMEOUT_MS,
						  .store_timeout_ms = 300 };
	struct embd_regroup_options o1 = o0;
	struct embd_store *s0 = NULL, *s1 = NULL;
	struct embd_regroup *rg0 = NULL, *rg1 = NULL;
	char err[512] = "";

	o1.node = 1;
	cr_assert_eq(embd_store_connect("127.0.0.1", tu_port, 5000, &s0, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_store_connect("127.0.0.1", tu_port, 5000, &s1, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_regroup_create(&o0, s0, NULL, &rg0), 0);
	cr_assert_eq(embd_regroup_create(&o1, s1, NULL, &rg1), 0);
	/* handles made without a comm are restarted nodes, each opening a generation of its
	 * own at first: after that, both meet in the newest */
	cr_assert_eq(embd_regroup_start(rg0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_regroup_start(rg1, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_regroup_start(rg0, err, sizeof(err)), 0, "%s", err);
	const uint64_t g = embd_regroup_generation(rg1);
	cr_assert_eq(embd_regroup_generation(rg0), g);
	struct turn t0 = { .rg = rg0, .why = "" }, t1 = { .rg = rg1, .why = "" };

	/* node 0 says nothing within store_timeout_ms: node 1 writes node 0's record as late,
	 * node 0 reads that very record, and both move on to the next generation */
	int64_t t_start = embd_now_ms();
	t1.rc = embd_regroup_restored(rg1, 0, "", 0, t1.err, sizeof(t1.err));
	cr_expect(embd_now_ms() - t_start < 3000, "expected the wait to end after store_timeout_ms, "
		  "took %lld ms", (long long)(embd_now_ms() - t_start));
	t0.rc = embd_regroup_restored(rg0, 0, "", 0, t0.err, sizeof(t0.err));
	for (int n = 0; n < NODES; n++) {
		const struct turn *t = n ? &t1 : &t0;
		cr_expect(t->rc == EMBD_EAGAIN && strstr(t->err, "node 0 did not report its restore "
							   "within 300 ms"),
			  "node %d: expected EMBD_EAGAIN naming node 0 as late, got %d '%s'", n,
			  t->rc, t->err);
		cr_expect_eq(embd_regroup_generation(t->rg), g + 1, "node %d: expected generation "
			     "%llu, got %llu", n, (unsigned long long)g + 1,
			     (unsigned long long)embd_regroup_generation(t->rg));
	}

	/* a transient failure on node 1 (node 0's choice of checkpoint came too late): both
	 * try the next generation, none calls the state lost */
	t1.restore_rc = EMBD_ETIMEDOUT;
	t1.why = "store: waiting for node 0's choice of checkpoint: timed out";
	both_report(&t0, &t1);
	for (int n = 0; n < NODES; n++) {
		const struct turn *t = n ? &t1 : &t0;
		cr_expect(t->rc == EMBD_EAGAIN && strstr(t->err, "node 1's restore did not complete: "
							   "store: waiting"),
			  "node %d: expected EMBD_EAGAIN naming node 1, got %d '%s'", n, t->rc,
			  t->err);
		cr_expect_eq(embd_regroup_generation(t->rg), g + 2, "node %d: expected generation "
			     "%llu, got %llu", n, (unsigned long long)g + 2,
			     (unsigned long long)embd_regroup_generation(t->rg));
	}

	/* a restore that takes longer than store_timeout_ms on node 0: node 1 waits as long
	 * as its own restore took on top, and both go on */
	t1.restore_rc = 0;
	t0.delay_ms = 700;
	t0.restore_ms = t1.restore_ms = 1500;
	both_report(&t0, &t1);
	cr_expect(t0.rc == 0 && t1.rc == 0, "a slow restore: expected 0 on both, got %d '%s' and "
		  "%d '%s'", t0.rc, t0.err, t1.rc, t1.err);

	/* node 1's restore failed on its data: both name node 1 and why, state lost */
	cr_assert_eq(embd_regroup_start(rg0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_regroup_start(rg1, err, sizeof(err)), 0, "%s", err);
	t0.delay_ms = t0.restore_ms = t1.restore_ms = 0;
	t1.restore_rc = EMBD_EMISMATCH;
	t1.why = "step-2 was written by node 0";
	both_report(&t0, &t1);
	for (int n = 0; n < NODES; n++) {
		const struct turn *t = n ? &t1 : &t0;
		cr_expect(t->rc == EMBD_EIO && !strcmp(t->err, "node 1's restore failed: step-2 was "
							  "written by node 0"),
			  "node %d: expected EMBD_EIO naming node 1, got %d '%s'", n, t->rc, t->err);
	}
	embd_regroup_destroy(rg0);
	embd_regroup_destroy(rg1);
	embd_store_close(s0);
	embd_store_close(s1);
}

/* ---- reattaching to node 0's store -------------------------------------------------------- */

/* A relay in front of the real store: whole requests client -> store (store_wire.h framing),
 * bytes back as they come; while `hold_op` is set a request of that kind naming hold_key is
 * kept (never answered), as a node 0 that stalls in the middle of a node's requests would. */
static atomic_int hold_op;
static const char *hold_key;

static bool read_full(int fd, uint8_t *p, size_t n)
{
	for (size_t at = 0; at < n;) {
		ssize_t r = read(fd, p + at, n - at);
		if (r <= 0)
			return false;
		at += (size_t)r;
	}
	return true;
}

static void *relay_conn(void *arg)
{
	int cfd = (int)(intptr_t)arg, sfd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(tu_port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	uint8_t *b = malloc(1 << 16);

	if (!b || connect(sfd, (struct sockaddr *)&a, sizeof(a)))
		goto out;
	for (;;) {
		struct pollfd p[2] = { { cfd, POLLIN, 0 }, { sfd, POLLIN, 0 } };
		if (poll(p, 2, -1) < 0)
			break;
		if (p[1].revents) {
			ssize_t r = read(sfd, b, 1 << 16);
			if (r <= 0 || write(cfd, b, (size_t)r) != r)
				break;
		}
		if (!p[0].revents)
			continue;
		if (!read_full(cfd, b, 4))
			break;
		uint32_t len = ntohl(*(uint32_t *)b);
		if (len > (1 << 16) - 4 || !read_full(cfd, b + 4, len))
			break;
		int op = atomic_load(&hold_op);
		bool held = op && len > 1 && b[4] == op &&
			    memmem(b + 5, len - 1, hold_key, strlen(hold_key));
		if (!held && write(sfd, b, 4 + len) != (ssize_t)(4 + len))
			break;
	}
out:
	free(b);
	close(sfd);
	close(cfd);
	return NULL;
}

static void *relay_accept(void *arg)
{
	int lfd = (int)(intptr_t)arg, cfd;
	pthread_t th;

	while ((cfd = accept(lfd, NULL, NULL)) >= 0)
		if (!pthread_create(&th, NULL, relay_conn, (void *)(intptr_t)cfd))
			pthread_detach(th);
	return NULL;
}

/* The relay's port (it lives as long as the test process). */
static uint16_t relay_start(void)
{
	int lfd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t alen = sizeof(a);
	pthread_t th;

	cr_assert(lfd >= 0 && !bind(lfd, (struct sockaddr *)&a, sizeof(a)) && !listen(lfd, 8) &&
		  !getsockname(lfd, (struct sockaddr *)&a, &alen));
	cr_assert_eq(pthread_create(&th, NULL, relay_accept, (void *)(intptr_t)lfd), 0);
	pthread_detach(th);
	return ntohs(a.sin_port);
}

/* Node 1's regroup handle (made without a comm: restarted) on a store handle through the relay
 * (*s1), beside a direct one to the store (*direct) where node 0's instance key is set. */
static struct embd_regroup *node_1_through_the_relay(struct embd_store **direct,
						     struct embd_store **s1)
{
	const struct embd_regroup_options o = { .node = 1, .nodes = NODES,
						 .backend = EMBD_COMM_GLOO,
						 .collective_timeout_ms = TIMEOUT_MS,
						 .store_timeout_ms = 1000 };
	struct embd_regroup *rg = NULL;
	char err[512] = "";

	cr_assert_eq(embd_store_connect("127.0.0.1", tu_port, 5000, direct, err, sizeof(err)),
		     0, "%s", err);
	cr_assert_eq(embd_store_set(*direct, EMBD_REGROUP_INSTANCE_KEY, "node-0-a", 8), 0);
	uint16_t relay = relay_start();
	cr_assert_eq(embd_store_connect("127.0.0.1", relay, 5000, s1, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(embd_regroup_create(&o, *s1, NULL, &rg), 0);
	return rg;
}

Test(regroup, reattach_after_a_failed_read_of_node_0s_instance_tries_again,
     .init = tu_server_start, .fini = tu_server_stop)
{
	struct embd_store *direct = NULL, *s1 = NULL;
	struct embd_regroup *rg = node_1_through_the_relay(&direct, &s1);
	char err[512] = "";

	/* node 0 answers the key check, then stalls before the read */
	hold_key = EMBD_REGROUP_INSTANCE_KEY;
	atomic_store(&hold_op, EMBD_STORE_OP_GET);
	int rc = embd_regroup_reattach(rg, err, sizeof(err));
	cr_expect(rc == 0 && strstr(err, "does not answer") && !strstr(err, "restarted"),
		  "a failed read: expected 0 and 'does not answer', got %d '%s'", rc, err);
	cr_expect_eq(embd_store_check(direct, "embd/stale/1"), 0, "a failed read marked node 1 "
		     "stale in node 0's store");
	/* node 0 answers again: the same store */
	atomic_store(&hold_op, 0);
	rc = embd_regroup_reattach(rg, err, sizeof(err));
	cr_expect_eq(rc, 1, "node 0 answers again: expected 1 (the same store), got %d '%s'", rc,
		     err);
	/* a value that was read and differs is a new store (node 0 restarted) */
	cr_assert_eq(embd_store_set(direct, EMBD_REGROUP_INSTANCE_KEY, "node-0-b", 8), 0);
	rc = embd_regroup_reattach(rg, err, sizeof(err));
	cr_expect(rc == 0 && strstr(err, "restarted"), "another instance: expected 0 and "
		  "'restarted', got %d '%s'", rc, err);
	cr_expect_eq(embd_store_check(direct, "embd/stale/1"), 1, "expected node 1's stale mark");
	embd_regroup_destroy(rg);
	embd_store_close(s1);
	embd_store_close(direct);
}

/* A restarted node's join fails halfway (node 0 stalls after counting it in, before the
 * generation is open): the node stays where it was, and once node 0 answers again it joins
 * the same generation, not the one after it, which nobody else would look for. */
Test(regroup, a_join_failing_halfway_is_tried_again_in_the_same_generation,
     .init = tu_server_start, .fini = tu_server_stop)
{
	struct embd_store *direct = NULL, *s1 = NULL;
	struct embd_regroup *rg = node_1_through_the_relay(&direct, &s1);
	char err[512] = "";

	/* the writes of "opener" and "open" (one key names the other) are never answered */
	hold_key = "embd/gen/1/open";
	atomic_store(&hold_op, EMBD_STORE_OP_SET);
	int rc = embd_regroup_start(rg, err, sizeof(err));
	atomic_store(&hold_op, 0);
	cr_assert_neq(rc, 0, "the join's writes were held: expected the store's failure");
	cr_expect_eq(embd_store_check(direct, "embd/gen/1/joined"), 1, "the count should have "
		     "landed before the held write");
	cr_expect_eq(embd_store_check(direct, "embd/gen/1/open"), 0);
	cr_expect_eq(embd_regroup_generation(rg), 0, "a failed join left the node in generation "
		     "%llu", (unsigned long long)embd_regroup_generation(rg));
	/* node 0 answers again: the same store, and the same generation */
	rc = embd_regroup_reattach(rg, err, sizeof(err));
	cr_assert_eq(rc, 1, "expected the same store, got %d '%s'", rc, err);
	cr_assert_eq(embd_regroup_start(rg, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(embd_regroup_generation(rg), 1, "expected generation 1 again, got %llu",
		     (unsigned long long)embd_regroup_generation(rg));
	cr_expect_eq(embd_store_check(direct, "embd/gen/1/open"), 1);
	cr_expect_eq(embd_store_check(direct, "embd/gen/1/join/1"), 1);
	embd_regroup_destroy(rg);
	embd_store_close(s1);
	embd_store_close(direct);
}
