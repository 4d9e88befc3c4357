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

/* Pipelined steps on a cluster: every node routes step k + 1 while step k waits for its
 * backward (stats pipelined_steps on each), and the outputs are bit-identical to the same
 * training unpipelined. */
static void pipelined_cluster(const char *sharding)
{
	static struct shared plain;
	const char *sockets[MAX_NODES];
	struct shared *sh = shared_map();

	for (int pipelined = 0; pipelined < 2; pipelined++) {
		start_cluster(2, sharding);
		for (uint32_t n = 0; n < 2; n++)
			sockets[n] = nodes[n].embd.socket;
		pipelined_trainers = pipelined ? PIPE_BEFORE : PIPE_OFF;
		run_trainers(sh, 2 * RANKS, sockets, RANKS);
		pipelined_trainers = PIPE_OFF;
		if (pipelined)
			break;
		memcpy(&plain, sh, sizeof(plain));
		stop_cluster();
	}
	check_against_reference(sh, 2 * RANKS, sharding);
	cr_expect(!memcmp(plain.pooled, sh->pooled, sizeof(plain.pooled)),
		  "%s: pipelined outputs differ from the unpipelined run's", sharding);
	for (uint32_t n = 0; n < 2; n++) {
		cJSON *stats = ctl_ask_json(nodes[n].embd.socket, EMBD_CTL_STATS_REQUEST);
		cr_assert_not_null(stats, "node %u: no STATS reply", n);
		cr_expect_eq(ctl_json_num(stats, "pipelined_steps"), K_STEPS - 1,
			     "node %u: expected %d pipelined steps, got %g", n, K_STEPS - 1,
			     ctl_json_num(stats, "pipelined_steps"));
		cJSON_Delete(stats);
	}
	munmap(sh, sizeof(*sh));
}

Test(dist, two_nodes_pipelined_row_wise) { pipelined_cluster("row_wise"); }
Test(dist, two_nodes_pipelined_column_wise) { pipelined_cluster("column_wise"); }

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

/* Node 1 dies (SIGKILL) or stalls (SIGSTOP) while node 0's trainers are in the backward of a
 * step: node 0's trainers get an error naming node 1 within the timeout, later steps
 * EMBD_EAGAIN while node 0 waits for node 1 to re-form the cluster, and node 0 keeps running. */
static void peer_failure(int sig)
{
	int pipefd[2];
	pid_t kids[2 * RANKS];

	start_cluster(2, "row_wise");
	struct kill_report *rep = mmap(NULL, sizeof(*rep) * 2 * RANKS, PROT_READ | PROT_WRITE,
				       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(rep != MAP_FAILED);
	memset(rep, 0, sizeof(*rep) * 2 * RANKS);
	cr_assert_eq(pipe(pipefd), 0);
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0) {
			close(pipefd[0]);
			kill_trainer(&rep[g], g, pipefd[1]);
		}
	}
	close(pipefd[1]);
	/* every trainer through step 0 and the forward of step 1 */
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		struct pollfd pfd = { .fd = pipefd[0], .events = POLLIN };
		char ok;
		cr_assert_eq(poll(&pfd, 1, 10000), 1, "trainers did not finish step 0 and the "
			     "forward of step 1 within 10 s (%u of 4 did)", g);
		cr_assert_eq(read(pipefd[0], &ok, 1), 1);
	}
	close(pipefd[0]);
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
 * with an error mentioning word within store_timeout_ms (+ slack). */
static void expect_join_refused(const char *tables_json, uint32_t world_nodes, const char *word)
{
	char log[8192];
	int st = 0;

	num_nodes = 2;
	port = tu_free_port();
	for (uint32_t n = 0; n < 2; n++)
		node_paths(n);
	write_config(0, NULL, 2, NULL);
	write_config(1, NULL, world_nodes, tables_json);
	spawn(0);
	spawn(1);
	bool exited = tu_embd_wait(&nodes[1].embd, 12000, &st);
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
