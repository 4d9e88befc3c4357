/*
 * Integration: several real embd processes as the nodes of one cluster on 127.0.0.1 (each
 * with its own socket and config, one MASTER_PORT per test), 2 ranks per node and one trainer
 * process per rank. For every sharding type, with 2 and with 3 nodes, a plan that spreads the
 * tables over the nodes (table_row_wise / table_column_wise inside one node, each table on
 * another node; row_wise and data_parallel over every rank; column_wise with its two column
 * shards on two nodes) trains K steps and every pooled output equals the unsharded reference
 * of the global batch (node 0's trainers, then node 1's, ...), within training_common.h's
 * tolerance. Failures: a node killed with SIGKILL mid-step gives the other node's trainers an
 * error naming it within collective_timeout_ms (no hang) and later steps EMBD_EAGAIN while
 * the cluster re-forms, naming the node it waits for;
 * a bad batch is refused for its trainer only while the cluster's step runs; nodes whose
 * tables or world size differ are refused at join; NODE_RANK from the environment wins.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "common/clock.h"
#include "tests/integration/ctl_query.h"
#include "tests/integration/dist_fixture.h"

TestSuite(dist, .fini = stop_cluster, .timeout = 40);

/* ---- training every sharding type -------------------------------------------------------- */

static void train_and_check(uint32_t N, const char *sharding)
{
	train_cluster(N, sharding, "");
	for (uint32_t n = 0; n < N; n++)
		cr_expect_eq(kill(nodes[n].embd.pid, 0), 0, "node %u should still run after training",
			     n);
}

Test(dist, two_nodes_table_wise) { train_and_check(2, "table_wise"); }
Test(dist, two_nodes_row_wise) { train_and_check(2, "row_wise"); }
Test(dist, two_nodes_column_wise) { train_and_check(2, "column_wise"); }
Test(dist, two_nodes_table_row_wise) { train_and_check(2, "table_row_wise"); }
Test(dist, two_nodes_table_column_wise) { train_and_check(2, "table_column_wise"); }
Test(dist, two_nodes_data_parallel) { train_and_check(2, "data_parallel"); }
Test(dist, three_nodes_table_wise) { train_and_check(3, "table_wise"); }
Test(dist, three_nodes_row_wise) { train_and_check(3, "row_wise"); }
Test(dist, three_nodes_column_wise) { train_and_check(3, "column_wise"); }
Test(dist, three_nodes_table_row_wise) { train_and_check(3, "table_row_wise"); }
Test(dist, three_nodes_table_column_wise) { train_and_check(3, "table_column_wise"); }
Test(dist, three_nodes_data_parallel) { train_and_check(3, "data_parallel"); }

/* Short batches (8, 5, 2 samples) across the nodes: each item on the wire has its own size. */
static void train_short(uint32_t N, const char *sharding)
{
	short_batches = true;
	train_and_check(N, sharding);
}

Test(dist, two_nodes_short_batches_row_wise) { train_short(2, "row_wise"); }
Test(dist, two_nodes_short_batches_column_wise) { train_short(2, "column_wise"); }
Test(dist, two_nodes_short_batches_table_row_wise) { train_short(2, "table_row_wise"); }
Test(dist, three_nodes_short_batches_data_parallel) { train_short(3, "data_parallel"); }

/*
 * Pipelined steps on a cluster: a pipelining node routes step k + 1 while step k waits for its
 * backward and exchanges its ids while step k's update is applied (stats pipelined_steps and
 * overlapped_steps; nccl's lanes stage through the rank threads, so it overlaps nothing), and
 * the outputs equal the unsharded reference and, bit for bit, the same training unpipelined.
 * Only the trainers from global trainer `from` on pipeline: RANKS leaves node 0 unpipelined,
 * which must not matter to either node.
 */
static void pipelined_cluster(const char *sharding, uint32_t from)
{
	static struct shared plain;
	const char *sockets[MAX_NODES];
	struct shared *sh = shared_map();
	const double overlaps = strcmp(dist_backend(), "gloo") ? 0 : K_STEPS - 1;

	for (int pipelined = 0; pipelined < 2; pipelined++) {
		start_cluster(2, sharding);
		for (uint32_t n = 0; n < 2; n++)
			sockets[n] = nodes[n].embd.socket;
		pipelined_trainers = pipelined ? PIPE_BEFORE : PIPE_OFF;
		pipelined_from_trainer = from;
		run_trainers(sh, 2 * RANKS, sockets, RANKS);
		pipelined_trainers = PIPE_OFF;
		pipelined_from_trainer = 0;
		if (pipelined)
			break;
		memcpy(&plain, sh, sizeof(plain));
		stop_cluster();
	}
	check_against_reference(sh, 2 * RANKS, sharding);
	cr_expect(!memcmp(plain.pooled, sh->pooled, sizeof(plain.pooled)),
		  "%s: pipelined outputs differ from the unpipelined run's", sharding);
	for (uint32_t n = 0; n < 2; n++) {
		const bool piped = n * RANKS >= from;
		cJSON *stats = ctl_ask_json(nodes[n].embd.socket, EMBD_CTL_STATS_REQUEST);
		cr_assert_not_null(stats, "node %u: no STATS reply", n);
		cr_expect_eq(ctl_json_num(stats, "pipelined_steps"), piped ? K_STEPS - 1 : 0,
			     "%s, node %u: expected %d pipelined steps, got %g", sharding, n,
			     piped ? K_STEPS - 1 : 0, ctl_json_num(stats, "pipelined_steps"));
		cr_expect_eq(ctl_json_num(stats, "overlapped_steps"), piped ? overlaps : 0,
			     "%s, node %u: expected %g steps whose id exchange overlapped the update "
			     "before, got %g", sharding, n, piped ? overlaps : 0,
			     ctl_json_num(stats, "overlapped_steps"));
		cJSON_Delete(stats);
	}
	munmap(sh, sizeof(*sh));
}

Test(dist, two_nodes_pipelined_table_wise) { pipelined_cluster("table_wise", 0); }
Test(dist, two_nodes_pipelined_row_wise) { pipelined_cluster("row_wise", 0); }
Test(dist, two_nodes_pipelined_column_wise) { pipelined_cluster("column_wise", 0); }
Test(dist, two_nodes_pipelined_table_row_wise) { pipelined_cluster("table_row_wise", 0); }
Test(dist, two_nodes_pipelined_table_column_wise) { pipelined_cluster("table_column_wise", 0); }
Test(dist, two_nodes_pipelined_data_parallel) { pipelined_cluster("data_parallel", 0); }
Test(dist, two_nodes_only_node_1_pipelines_row_wise) { pipelined_cluster("row_wise", RANKS); }
Test(dist, two_nodes_only_node_1_pipelines_data_parallel)
{
	pipelined_cluster("data_parallel", RANKS);
}

/* env:// wins: nodes 1 and 2 have node_rank 0 in their configs and NODE_RANK in the env. */
Test(dist, node_rank_from_the_environment)
{
	nodes[1].rank_from_env = nodes[2].rank_from_env = true;
	train_and_check(3, "table_wise");
}

/* ---- a node killed mid-step -------------------------------------------------------------- */

/* Forward (and backward) of global trainer g's step-k batch as step `step`. */
static int forward_backward(struct embd_client *c, uint32_t g, uint32_t k, uint64_t step,
			    bool backward, uint64_t *num_values)
{
	struct embd_batch b;
	const uint32_t D = embd_layout(c)->total_dim;

	embd_batch_get(c, 0, &b);
	*num_values = gen_batch(k, g, b.lengths, b.values);
	int rc = embd_forward(c, 0, step, *num_values, 0);
	if (rc || !backward)
		return rc;
	for (uint32_t i = 0; i < BATCH * D; i++)
		b.grad[i] = gen_grad(k, g, i / D, i % D);
	return embd_backward(c, 0, step, *num_values, 0);
}

/* What each trainer of the kill test reports. */
struct kill_report {
	int step0_rc, fwd1_rc, bwd1_rc, step2_rc;
	uint64_t bwd1_ms;
	char err1[256], err2[256];
};

/* Trainer g: step 0, forward of step 1, "ready"; node 0's trainers then post the backward of
 * step 1 (node 1 is killed meanwhile) and try step 2; node 1's wait to be killed. */
static void kill_trainer(struct kill_report *rep, uint32_t g, int ready_fd)
{
	struct embd_client *c;
	char err[256], ok = 'y';
	uint64_t n;

	if (embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 10000, &c, err,
			 sizeof(err)))
		_exit(2);
	uint64_t s = embd_layout(c)->resumed_step;
	rep->step0_rc = forward_backward(c, g, 0, s, true, &n);
	rep->fwd1_rc = forward_backward(c, g, 1, s + 1, false, &n);
	if (write(ready_fd, &ok, 1) != 1)
		_exit(3);
	if (g / RANKS != 0)
		pause();
	struct embd_batch b;
	embd_batch_get(c, 0, &b);
	memset(b.grad, 0, (size_t)BATCH * embd_layout(c)->total_dim * sizeof(float));
	int64_t t0 = embd_now_ms();
	rep->bwd1_rc = embd_backward(c, 0, s + 1, n, 0);
	rep->bwd1_ms = embd_now_ms() - t0;
	snprintf(rep->err1, sizeof(rep->err1), "%s", embd_last_error(c));
	rep->step2_rc = forward_backward(c, g, 2, s + 2, false, &n);
	snprintf(rep->err2, sizeof(rep->err2), "%s", embd_last_error(c));
	embd_close(c);
	_exit(0);
}

/* bytes shared with the trainer processes forked next, zeroed. */
static void *shared_reports(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	cr_assert(p != MAP_FAILED);
	memset(p, 0, bytes);
	return p;
}

/* Forks every trainer g of two nodes as a process running trainer(reports, g, ready_fd) (it
 * _exits), then waits until `ready` of them wrote their byte to ready_fd (having done `what`),
 * 10 s at most. */
static void fork_trainers(pid_t *kids, void (*trainer)(void *, uint32_t, int), void *reports,
			  uint32_t ready, const char *what)
{
	int pipefd[2];

	cr_assert_eq(pipe(pipefd), 0);
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0) {
			close(pipefd[0]);
			trainer(reports, g, pipefd[1]);
		}
	}
	close(pipefd[1]);
	for (uint32_t g = 0; g < ready; g++) {
		struct pollfd pfd = { .fd = pipefd[0], .events = POLLIN };
		char ok;
		cr_assert_eq(poll(&pfd, 1, 10000), 1, "trainers did not finish %s within 10 s (%u "
			     "of %u did)", what, g, ready);
		cr_assert_eq(read(pipefd[0], &ok, 1), 1);
	}
	close(pipefd[0]);
}

static void kill_trainer_main(void *reports, uint32_t g, int ready_fd)
{
	kill_trainer(&((struct kill_report *)reports)[g], g, ready_fd);
}

/* Node 1 dies (SIGKILL) or stalls (SIGSTOP) while node 0's trainers are in the backward of a
 * step: node 0's trainers get an error naming node 1 within the timeout, later steps
 * EMBD_EAGAIN while node 0 waits for node 1 to re-form the cluster, and node 0 keeps running. */
static void peer_failure(int sig)
{
	pid_t kids[2 * RANKS];

	start_cluster(2, "row_wise");
	struct kill_report *rep = shared_reports(sizeof(*rep) * 2 * RANKS);
	fork_trainers(kids, kill_trainer_main, rep, 2 * RANKS, "step 0 and the forward of step 1");
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		cr_assert(rep[g].step0_rc == 0 && rep[g].fwd1_rc == 0, "trainer %u: step 0 %d, "
			  "forward of step 1 %d: expected 0 and 0", g, rep[g].step0_rc, rep[g].fwd1_rc);
	/* node 0's trainers are in the backward of step 1, waiting for node 1: kill it */
	usleep(200000);
	if (sig == SIGKILL)
		stop_node(1, SIGKILL);
	else
		kill(nodes[1].embd.pid, sig);
	for (uint32_t g = 0; g < RANKS; g++) {
		int st;
		waitpid(kids[g], &st, 0);
	}
	stop_node(1, SIGKILL);
	for (uint32_t g = 0; g < RANKS; g++) {
		cr_expect_lt(rep[g].bwd1_rc, 0, "trainer %u: backward of step 1 with node 1 killed: "
			     "expected an error, got %d", g, rep[g].bwd1_rc);
		cr_expect(strstr(rep[g].err1, "node 1") != NULL, "trainer %u: expected the error to "
			  "name node 1, got '%s'", g, rep[g].err1);
		cr_expect_leq(rep[g].bwd1_ms, TIMEOUT_MS + 1500, "trainer %u: the error came after "
			      "%llu ms, expected within collective_timeout_ms %d (+1.5 s)", g,
			      (unsigned long long)rep[g].bwd1_ms, TIMEOUT_MS);
		cr_expect_eq(rep[g].step2_rc, EMBD_EAGAIN, "trainer %u: step 2 after the failure: "
			     "expected EMBD_EAGAIN (the cluster re-forms), got %d", g,
			     rep[g].step2_rc);
		cr_expect(strstr(rep[g].err2, "re-forming") && strstr(rep[g].err2, "node 1"),
			  "trainer %u: step 2's refusal should say the cluster re-forms, naming node "
			  "1, got '%s'", g, rep[g].err2);
	}
	cr_expect_eq(kill(nodes[0].embd.pid, 0), 0, "node 0 should survive its peer's failure");
	munmap(rep, sizeof(*rep) * 2 * RANKS);
}

Test(dist, killed_node_fails_the_step_on_the_others) { peer_failure(SIGKILL); }
Test(dist, stalled_node_fails_the_step_on_the_others_within_the_timeout) { peer_failure(SIGSTOP); }

/* ---- pipelined steps and failures ------------------------------------------------------ */

/* Posts trainer g's BACKWARD of step k (slot k % 2, user_data 1000 + k), its gradient written. */
static int post_backward(struct embd_client *c, uint32_t g, uint32_t k, uint64_t first_step)
{
	const uint32_t D = embd_layout(c)->total_dim;
	struct embd_batch b;

	embd_batch_get(c, k % 2, &b);
	for (uint32_t i = 0; i < BATCH * D; i++)
		b.grad[i] = gen_grad(k, g, i / D, i % D);
	const struct embd_request req = { .op = EMBD_REQUEST_BACKWARD, .slot = k % 2,
					  .step = first_step + k, .batch_size = BATCH,
					  .user_data = 1000 + k };
	return embd_submit(c, &req);
}

/* What each trainer of the overlap failure test reports. */
struct overlap_report {
	int fwd0_rc, bwd0_rc, fwd1_rc, step2_rc;
	int64_t bwd0_at_ms, fwd1_at_ms;         /* when their completions came (embd_now_ms) */
	char err1[256], err2[256];
};

/* Trainer g: node 1's step 0 unpipelined, then "ready", and they never post step 1; node 0's
 * forward of step 0, then FORWARD 1 and BACKWARD 0 (so node 0 exchanges step 1's ids while it
 * applies step 0), both completions, then step 2. */
static void overlap_trainer(void *reports, uint32_t g, int ready_fd)
{
	struct overlap_report *rep = &((struct overlap_report *)reports)[g];
	struct embd_client *c;
	struct embd_completion done;
	char err[256], ok = 'y';
	uint64_t n;

	if (embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 10000, &c, err,
			 sizeof(err)))
		_exit(2);
	const uint64_t s = embd_layout(c)->resumed_step;
	if (g / RANKS == 1) {
		rep->fwd0_rc = forward_backward(c, g, 0, s, true, &n);
		if (write(ready_fd, &ok, 1) != 1)
			_exit(3);
		pause();
	}
	rep->fwd0_rc = post_forward(c, g, 0, s);
	if (!rep->fwd0_rc)
		rep->fwd0_rc = embd_wait(c, &done, 10000);
	if (!rep->fwd0_rc)
		rep->fwd0_rc = done.result;
	if (rep->fwd0_rc || post_forward(c, g, 1, s) || post_backward(c, g, 0, s))
		_exit(4);
	rep->bwd0_rc = rep->fwd1_rc = 1;        /* "no completion" */
	for (int i = 0; i < 2; i++) {
		if (embd_wait(c, &done, 20000))
			break;
		if (done.user_data == 1000) {
			rep->bwd0_rc = done.result;
			rep->bwd0_at_ms = embd_now_ms();
		} else {
			rep->fwd1_rc = done.result;
			rep->fwd1_at_ms = embd_now_ms();
			snprintf(rep->err1, sizeof(rep->err1), "%s", embd_last_error(c));
		}
	}
	rep->step2_rc = forward_backward(c, g, 2, s + 2, false, &n);
	snprintf(rep->err2, sizeof(rep->err2), "%s", embd_last_error(c));
	embd_close(c);
	_exit(0);
}

/* Node 1 dies while node 0 exchanges step 1's ids during step 0's update (node 0's trainers
 * pipeline, node 1's do not and hold back step 1): node 0's trainers got their BACKWARD of
 * step 0 applied before the failure, their FORWARD of step 1 fails naming node 1 within the
 * timeout, and step 2 is EMBD_EAGAIN while node 0 waits for node 1 to re-form the cluster. */
Test(dist, killed_node_during_an_overlapped_id_exchange)
{
	pid_t kids[2 * RANKS];

	start_cluster(2, "row_wise");
	struct overlap_report *rep = shared_reports(sizeof(*rep) * 2 * RANKS);
	fork_trainers(kids, overlap_trainer, rep, RANKS, "node 1's step 0");
	/* step 0's gradients are exchanged; node 0 now waits for node 1 in step 1's HELLO */
	usleep(300000);
	const int64_t killed_at_ms = embd_now_ms();
	stop_node(1, SIGKILL);
	for (uint32_t g = 0; g < RANKS; g++) {
		int st;
		waitpid(kids[g], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer %u: status 0x%x", g, st);
	}
	for (uint32_t g = 0; g < RANKS; g++) {
		const struct overlap_report *r = &rep[g];
		cr_expect_eq(r->fwd0_rc, 0, "trainer %u: forward of step 0: %d", g, r->fwd0_rc);
		cr_expect_eq(r->bwd0_rc, 0, "trainer %u: backward of step 0: expected 0, got %d", g,
			     r->bwd0_rc);
		cr_expect_lt(r->bwd0_at_ms, killed_at_ms, "trainer %u: the backward of step 0 was "
			     "completed %lld ms after node 1 was killed: held behind step 1's exchange",
			     g, (long long)(r->bwd0_at_ms - killed_at_ms));
		cr_expect_lt(r->fwd1_rc, 0, "trainer %u: forward of step 1 with node 1 killed: "
			     "expected an error, got %d", g, r->fwd1_rc);
		cr_expect(strstr(r->err1, "node 1") != NULL, "trainer %u: expected the error to name "
			  "node 1, got '%s'", g, r->err1);
		cr_expect_leq(r->fwd1_at_ms - killed_at_ms, TIMEOUT_MS + 1500, "trainer %u: the "
			      "error came %lld ms after the kill, expected within "
			      "collective_timeout_ms %d (+1.5 s)", g,
			      (long long)(r->fwd1_at_ms - killed_at_ms), TIMEOUT_MS);
		cr_expect_eq(r->step2_rc, EMBD_EAGAIN, "trainer %u: step 2 after the failure: "
			     "expected EMBD_EAGAIN (the cluster re-forms), got %d (%s)", g,
			     r->step2_rc, r->err2);
		cr_expect(strstr(r->err2, "re-forming") && strstr(r->err2, "node 1"), "trainer %u: "
			  "step 2's refusal should say the cluster re-forms, naming node 1, got "
			  "'%s'", g, r->err2);
	}
	cr_expect_eq(kill(nodes[0].embd.pid, 0), 0, "node 0 should survive its peer's failure");
	cJSON *stats = ctl_ask_json(nodes[0].embd.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats, "node 0: no STATS reply");
	const double overlaps = strcmp(dist_backend(), "gloo") ? 0 : 1;
	cr_expect_eq(ctl_json_num(stats, "overlapped_steps"), overlaps, "node 0: expected %g "
		     "overlapped step(s) (step 1's, which failed), got %g", overlaps,
		     ctl_json_num(stats, "overlapped_steps"));
	cJSON_Delete(stats);
	munmap(rep, sizeof(*rep) * 2 * RANKS);
}

/* Trainer g of the abort test: step 0's forward, then FORWARD 1 (slot 1); the victim then
 * leaves once every other trainer posted its BACKWARD 0 too (posted counts them), the others
 * wait for BACKWARD 0 (aborted), FORWARD 1 and run BACKWARD 1. 0, or 1 + why on stderr. */
static int abort_pipelined_trainer(uint32_t g, uint32_t victim, uint32_t *posted)
{
	struct embd_client *c;
	struct embd_completion done;
	char err[256];
	uint64_t n;
	int fails = 0;

	if (embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 10000, &c, err,
			 sizeof(err)))
		return fprintf(stderr, "trainer %u: %s\n", g, err), 1;
	const uint64_t s = embd_layout(c)->resumed_step;
	int rc = forward_backward(c, g, 0, s, false, &n);
	if (!rc)
		rc = post_forward(c, g, 1, s);
	if (!rc && g != victim)
		rc = post_backward(c, g, 0, s);
	if (rc)
		return fprintf(stderr, "trainer %u: step 0: %d (%s)\n", g, rc, embd_last_error(c)), 1;
	if (g == victim) {
		for (int ms = 0; __atomic_load_n(posted, __ATOMIC_ACQUIRE) < 2 * RANKS - 1 &&
				 ms < 10000; ms++)
			usleep(1000);
		usleep(200000);         /* their BACKWARDs are taken */
		_exit(0);               /* hangs up inside step 0: it is aborted everywhere */
	}
	__atomic_add_fetch(posted, 1, __ATOMIC_RELEASE);
	for (int i = 0; i < 2; i++) {
		if ((rc = embd_wait(c, &done, 20000)))
			return fprintf(stderr, "trainer %u: wait: %d\n", g, rc), 1;
		bool backward = done.user_data == 1000;
		int want = backward ? EMBD_ECANCELED : 0;
		if (done.result != want || (backward && !strstr(embd_last_error(c), "trainer 1")))
			fails += fprintf(stderr, "trainer %u: %s: expected %d%s, got %d (%s)\n", g,
					 backward ? "backward of the aborted step 0" : "forward of step 1",
					 want, backward ? " naming trainer 1" : "", done.result,
					 embd_last_error(c)) > 0;
	}
	if ((rc = post_backward(c, g, 1, s)) == 0 && (rc = embd_wait(c, &done, 20000)) == 0)
		rc = done.result;
	if (rc)
		fails += fprintf(stderr, "trainer %u: backward of step 1: %d (%s)\n", g, rc,
				 embd_last_error(c)) > 0;
	embd_close(c);
	return fails != 0;
}

/* A trainer of node 0 hangs up inside step 0 while every trainer pipelines: the step is
 * aborted on both nodes (the others' BACKWARD: EMBD_ECANCELED naming it), no node overlaps
 * step 1's exchange with an update that never came, node 1's prepared step 1 runs (node 0's
 * preparation, which held the victim's batch, is dropped) and the cluster trains on. */
Test(dist, a_trainer_lost_mid_step_drops_the_overlap)
{
	const uint32_t victim = 1;     /* node 0's trainer 1 */
	pid_t kids[2 * RANKS];

	start_cluster(2, "table_wise");
	uint32_t *posted = shared_reports(sizeof(*posted));
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0)
			_exit(abort_pipelined_trainer(g, victim, posted));
	}
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		int st;
		waitpid(kids[g], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer %u: expected exit 0, got "
			  "status 0x%x (its stderr says why)", g, st);
	}
	for (uint32_t n = 0; n < 2; n++) {
		cJSON *stats = ctl_ask_json(nodes[n].embd.socket, EMBD_CTL_STATS_REQUEST);
		cr_assert_not_null(stats, "node %u: no STATS reply", n);
		cr_expect_eq(ctl_json_num(stats, "aborted_steps"), 1, "node %u: aborted_steps %g",
			     n, ctl_json_num(stats, "aborted_steps"));
		cr_expect_eq(ctl_json_num(stats, "pipelined_steps"), n == 1, "node %u: expected %d "
			     "pipelined step(s), got %g", n, n == 1,
			     ctl_json_num(stats, "pipelined_steps"));
		cr_expect_eq(ctl_json_num(stats, "overlapped_steps"), 0, "node %u: %g overlapped "
			     "steps after an aborted update", n, ctl_json_num(stats, "overlapped_steps"));
		cJSON_Delete(stats);
	}
	munmap(posted, sizeof(*posted));
}

/* ---- one bad batch ----------------------------------------------------------------------- */

/* Trainer g of the bad-batch test: 0 when it got what it should, else 1 + why on stderr. */
static int bad_batch_trainer(uint32_t g, uint32_t bad)
{
	struct embd_client *c;
	struct embd_batch b;
	char err[256];
	uint64_t n;

	if (embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 10000, &c, err,
			 sizeof(err)))
		return fprintf(stderr, "trainer %u: %s\n", g, err), 1;
	uint64_t s = embd_layout(c)->resumed_step;
	if (g != bad) {
		int rc = forward_backward(c, g, 0, s, true, &n);
		if (rc)
			fprintf(stderr, "trainer %u: step with a bad batch elsewhere: expected 0, got %d "
				"(%s)\n", g, rc, embd_last_error(c));
		embd_close(c);
		return rc != 0;
	}
	embd_batch_get(c, 0, &b);
	n = gen_batch(0, g, b.lengths, b.values);
	b.values[0] = tables[0].rows;   /* one id past its table */
	int rc = embd_forward(c, 0, s, n, 0);
	bool named = strstr(embd_last_error(c), "values[0]") != NULL;
	if (rc >= 0 || !named)
		fprintf(stderr, "trainer %u: bad batch: expected an error naming values[0], got %d "
			"(%s)\n", g, rc, embd_last_error(c));
	embd_close(c);
	return rc >= 0 || !named;
}

Test(dist, bad_batch_is_refused_for_its_trainer_only)
{
	const uint32_t bad = 3;         /* node 1's second trainer */
	pid_t kids[2 * RANKS];

	start_cluster(2, "table_wise");
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0)
			_exit(bad_batch_trainer(g, bad));
	}
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		int st;
		waitpid(kids[g], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer %u (bad one: %u): expected "
			  "exit 0, got status 0x%x (its stderr says why)", g, bad, st);
	}
}

/* ---- refused at join --------------------------------------------------------------------- */

/* Starts node 0 as configured and node 1 with its own tables or world size; node 1 must exit
 * with an error mentioning word within store_timeout_ms (+ slack). A port node 0 could not
 * listen on is retried with another one (node0_lost_port). */
static void expect_join_refused(const char *tables_json, uint32_t world_nodes, const char *word)
{
	char log[8192];
	int st = 0;
	bool exited;

	num_nodes = 2;
	for (int attempt = 0;; attempt++) {
		port = tu_free_port();
		for (uint32_t n = 0; n < 2; n++)
			node_paths(n);
		write_config(0, NULL, 2, NULL);
		write_config(1, NULL, world_nodes, tables_json);
		spawn(0);
		spawn(1);
		exited = tu_embd_wait(&nodes[1].embd, 12000, &st);
		/* node 1 may have given up on whoever took the port before node 0 tried it */
		if (!tu_embd_log_has(&nodes[1].embd, word))
			tu_embd_wait(&nodes[0].embd, 2000, &(int){ 0 });
		if (attempt == 3 || !node0_lost_port())
			break;
		for (uint32_t n = 0; n < 2; n++)
			stop_node(n, SIGKILL);
	}
	read_log(1, log, sizeof(log));
	cr_assert(exited, "node 1 with a mismatched %s should refuse to start; after 12 s it still "
		  "runs: %s", word, log);
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) != 0, "node 1: expected a failing exit, got "
		  "status 0x%x", st);
	cr_expect(strstr(log, word) != NULL, "node 1's refusal should name '%s', got: %s", word,
		  log);
}

/* Trainer g's steps for the NaN test: step s with a NaN in trainer `bad`'s gradient (sample 0,
 * column 5), then step s + 1 on the same batch; the pooled outputs of both into sh. */
static int nan_trainer(struct shared *sh, uint32_t g, uint32_t bad)
{
	struct embd_client *c;
	struct embd_batch b;
	char err[256];

	if (embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 10000, &c, err,
			 sizeof(err)))
		return fprintf(stderr, "trainer %u: %s\n", g, err), 1;
	const uint32_t D = embd_layout(c)->total_dim;
	uint64_t s = embd_layout(c)->resumed_step;
	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch(0, g, b.lengths, b.values);
	int fails = 0;
	for (uint64_t k = 0; k < 2; k++) {
		int rc = embd_forward(c, 0, s + k, n, 0);
		if (rc)
			return fprintf(stderr, "trainer %u step %llu: forward %d (%s)\n", g,
				       (unsigned long long)(s + k), rc, embd_last_error(c)), 1;
		memcpy(sh->pooled[k][g], b.pooled, sizeof(float) * BATCH * D);
		for (uint32_t i = 0; i < BATCH * D; i++)
			b.grad[i] = gen_grad(0, g, i / D, i % D);
		if (k == 0 && g == bad)
			b.grad[5] = NAN;
		rc = embd_backward(c, 0, s + k, n, 0);
		bool named = strstr(embd_last_error(c), "trainer 1 of node 1 sent a gradient that is "
				    "NaN at sample 0, column 5") != NULL;
		if (k == 0 && (rc != EMBD_ECANCELED || !named))
			fails += fprintf(stderr, "trainer %u: a NaN gradient on node 1: expected "
					 "EMBD_ECANCELED naming it, got %d (%s)\n", g, rc,
					 embd_last_error(c)) > 0;
		if (k == 1 && rc)
			fails += fprintf(stderr, "trainer %u: the next step: %d (%s)\n", g, rc,
					 embd_last_error(c)) > 0;
	}
	embd_close(c);
	return fails != 0;
}

/* A NaN gradient from a trainer of node 1 is refused for every trainer of every node (the
 * gradient exchange's abort flag), and no node applies the step: the next forward of the same
 * batches gives the same outputs everywhere. */
Test(dist, a_nan_gradient_is_refused_on_every_node)
{
	const uint32_t bad = 3;         /* node 1's trainer 1 */
	pid_t kids[2 * RANKS];

	start_cluster(2, "row_wise");
	struct shared *sh = shared_map();
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0)
			_exit(nan_trainer(sh, g, bad));
	}
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		int st;
		waitpid(kids[g], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer %u: expected exit 0, got "
			  "status 0x%x (its stderr says why)", g, st);
	}
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		cr_expect(!memcmp(sh->pooled[0][g], sh->pooled[1][g], sizeof(float) * BATCH *
				  MAX_COLS), "trainer %u: the refused step changed rows on some node", g);
	munmap(sh, sizeof(*sh));
}

Test(dist, mismatched_tables_refused_at_join)
{
	expect_join_refused("\"tables\": [{\"name\": \"t_sum\", \"num_embeddings\": 65, "
			    "\"embedding_dim\": 8, \"feature_names\": [\"f_a\", \"f_b\"]}, "
			    "{\"name\": \"t_mean\", \"num_embeddings\": 40, \"embedding_dim\": 8, "
			    "\"pooling\": \"mean\", \"feature_names\": [\"f_c\"]}]", 2, "table");
}

Test(dist, mismatched_world_size_refused_at_join)
{
	expect_join_refused(NULL, 3, "world_size");
}

/* Nodes that would combine the trainers' gradients differently never form a cluster. */
Test(dist, mismatched_gradient_scaling_refused_at_join)
{
	snprintf(dist_node_json[1], sizeof(dist_node_json[1]), ", \"gradient_scaling\": \"sum\"");
	expect_join_refused(NULL, 2, "gradient_scaling");
}
