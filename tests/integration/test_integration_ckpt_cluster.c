/*
 * Integration: checkpoints of a cluster in one shared checkpoint_dir (service/checkpoint.h,
 * "shared directory"), with the real embd nodes of dist_fixture.h. Two nodes checkpoint every
 * K steps, are stopped and restarted: the trainers resume at step K and every later pooled
 * output equals the reference's after 2 K steps (the one of a run without the stop; trainers
 * that reconnect to a running cluster are no such run: the steps go on without them), and
 * the cluster's next checkpoint restored on one node goes on like the reference too. A
 * checkpoint one node wrote under
 * table_wise restores on two nodes under row_wise: every output afterwards equals the one
 * node's own continuation of the same global batch; `embctl checkpoint` on a cluster is
 * refused, and so is checkpoint_every_seconds at start. A node that dies before it reported its
 * files leaves no step directory and no .tmp one, and node 0 names it.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/integration/dist_fixture.h"

static char ckpt_root[128];

static void remove_root(void)
{
	char cmd[192];

	if (!ckpt_root[0] || getenv("EMBD_TEST_KEEP"))
		return;
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", ckpt_root);
	if (system(cmd))
		fprintf(stderr, "cannot remove %s\n", ckpt_root);
}

static void fini(void)
{
	stop_cluster();
	remove_root();
}

TestSuite(ckpt_cluster, .fini = fini, .timeout = 40);

/* A fresh checkpoint_dir for this test and the config keys that point at it. */
static void use_checkpoints(uint32_t every_steps)
{
	snprintf(ckpt_root, sizeof(ckpt_root), "/tmp/embd-ckpt-cluster-%d", (int)getpid());
	snprintf(dist_extra_json, sizeof(dist_extra_json), ", \"checkpoint_dir\": \"%s\", "
		 "\"checkpoint_every_steps\": %u, \"checkpoint_keep\": 0", ckpt_root, every_steps);
}

static bool has_step(uint64_t step, bool tmp)
{
	char path[192];

	snprintf(path, sizeof(path), "%s/%sstep-%llu%s", ckpt_root, tmp ? ".tmp-" : "",
		 (unsigned long long)step, tmp ? "" : "/manifest.json");
	return access(path, F_OK) == 0;
}

static void wait_for_step(uint64_t step)
{
	for (int i = 0; i < 500 && !has_step(step, false); i++)
		usleep(20000);
	cr_assert(has_step(step, false), "expected %s/step-%llu within 10 s", ckpt_root,
		  (unsigned long long)step);
}

/* Stops every node (SIGTERM), keeping the checkpoint directory. */
static void stop_nodes(void)
{
	for (uint32_t n = 0; n < num_nodes; n++)
		stop_node(n, SIGTERM);
}

/* N nodes of sharding, trainers_per_node each, run K_STEPS into a new mapping. */
static struct shared *train(uint32_t N, const char *sharding, uint32_t per_node)
{
	const char *sockets[MAX_NODES];
	struct shared *sh = shared_map();

	dist_trainers_per_node = per_node;
	start_cluster(N, sharding);
	for (uint32_t n = 0; n < N; n++)
		sockets[n] = nodes[n].socket;
	run_trainers(sh, N * per_node, sockets, per_node);
	return sh;
}

static void expect_resumed(const struct shared *sh, uint32_t trainers, uint64_t step,
			   const char *what)
{
	for (uint32_t g = 0; g < trainers; g++)
		cr_expect_eq(sh->resumed_step[g], step, "%s: trainer %u: expected resumed step %llu, "
			     "got %llu", what, g, (unsigned long long)step,
			     (unsigned long long)sh->resumed_step[g]);
}

static void expect_same_outputs(const struct shared *want, const struct shared *got,
				uint32_t trainers, const char *what)
{
	uint32_t mismatches = 0;

	cr_assert_eq(want->total_dim, got->total_dim);
	for (uint32_t k = 0; k < K_STEPS; k++)
		for (uint32_t g = 0; g < trainers; g++)
			for (uint32_t i = 0; i < BATCH * want->total_dim; i++)
				if (!close_enough(want->pooled[k][g][i], got->pooled[k][g][i]) &&
				    mismatches++ < 5)
					cr_expect(false, "%s: step %u trainer %u output %u: expected %.9g, "
						  "got %.9g", what, k, g, i, want->pooled[k][g][i],
						  got->pooled[k][g][i]);
	cr_expect_eq(mismatches, 0, "%s: expected every pooled output as in the run it is compared "
		     "with, got %u mismatches", what, mismatches);
}

Test(ckpt_cluster, two_nodes_stopped_and_restarted_resume_at_the_checkpoint)
{
	const uint32_t T = 2 * RANKS;

	/* K steps, the checkpoint of step K, stop, restart, K more: as 2 K steps of the reference */
	use_checkpoints(K_STEPS);
	struct shared *first = train(2, "row_wise", RANKS);
	check_against_reference(first, T, "2 nodes before the checkpoint");
	wait_for_step(K_STEPS);
	stop_nodes();
	struct shared *resumed = train(2, "row_wise", RANKS);
	expect_resumed(resumed, T, K_STEPS, "restarted cluster");
	check_against_reference_after(resumed, T, "restarted cluster", 1);
	/* the cluster's checkpoint of step 2 K restores on one node (all T trainers there) */
	wait_for_step(2 * K_STEPS);
	stop_cluster();
	use_checkpoints(0);
	struct shared *one = train(1, "table_wise", T);
	expect_resumed(one, T, 2 * K_STEPS, "1 node restoring the cluster's checkpoint");
	check_against_reference_after(one, T, "1 node restoring the cluster's checkpoint", 2);
	munmap(first, sizeof(*first));
	munmap(resumed, sizeof(*resumed));
	munmap(one, sizeof(*one));
}

Test(ckpt_cluster, one_node_table_wise_checkpoint_restores_on_two_nodes_row_wise)
{
	/* 1 node, 2 trainers: the checkpoint of step K under table_wise */
	use_checkpoints(K_STEPS);
	struct shared *before = train(1, "table_wise", 2);
	wait_for_step(K_STEPS);
	stop_cluster();
	/* 2 nodes row_wise, one trainer each (the same global batch), from that checkpoint */
	use_checkpoints(0);
	struct shared *two = train(2, "row_wise", 1);
	expect_resumed(two, 2, K_STEPS, "2 nodes restoring 1 node's checkpoint");
	check_against_reference_after(two, 2, "2 nodes restoring 1 node's checkpoint", 1);
	/* one node of a cluster cannot choose a step for all: embctl checkpoint is refused */
	char cmd[512], reply[512] = "";
	snprintf(cmd, sizeof(cmd), "%s checkpoint --socket %s 2>&1", EMBCTL_BINARY,
		 nodes[1].socket);
	FILE *p = popen(cmd, "r");
	cr_assert_not_null(p);
	size_t got = fread(reply, 1, sizeof(reply) - 1, p);
	reply[got] = 0;
	cr_expect_neq(pclose(p), 0, "embctl checkpoint on a cluster: expected a failure, got: %s",
		      reply);
	cr_expect(strstr(reply, "checkpoint_every_steps") != NULL, "embctl checkpoint on a "
		  "cluster: expected the refusal to name checkpoint_every_steps, got: %s", reply);
	stop_nodes();
	cr_expect(!has_step(2 * K_STEPS, false), "a cluster takes no checkpoint at SIGTERM");
	/* the one node's own continuation from the same checkpoint */
	struct shared *one = train(1, "table_wise", 2);
	expect_resumed(one, 2, K_STEPS, "1 node restoring its checkpoint");
	expect_same_outputs(one, two, 2, "2 nodes (row_wise) vs 1 node (table_wise) after restore");
	munmap(before, sizeof(*before));
	munmap(two, sizeof(*two));
	munmap(one, sizeof(*one));
}

Test(ckpt_cluster, node_killed_before_reporting_leaves_no_checkpoint)
{
	char path[256], log[8192] = "";

	/* node 1's first file of step K is a FIFO: its writer blocks opening it, never reports */
	use_checkpoints(K_STEPS);
	dist_store_timeout_ms = 3000;
	snprintf(path, sizeof(path), "%s/.tmp-step-%d", ckpt_root, K_STEPS);
	cr_assert(mkdir(ckpt_root, 0755) == 0 && mkdir(path, 0755) == 0, "mkdir %s", path);
	snprintf(path, sizeof(path), "%s/.tmp-step-%d/t0-t_sum.r32.c0.n1.weight.npy", ckpt_root,
		 K_STEPS);
	cr_assert(mkfifo(path, 0644) == 0, "mkfifo %s", path);
	struct shared *sh = train(2, "row_wise", RANKS);
	usleep(300000);
	stop_node(1, SIGKILL);
	for (int i = 0; i < 400 && !strstr(log, "node 1 did not report"); i++) {
		usleep(20000);
		read_log(0, log, sizeof(log));
	}
	cr_expect(strstr(log, "node 1 did not report") != NULL, "node 0 should name node 1 as "
		  "missing within store_timeout_ms; its log: %s", log);
	cr_expect(!has_step(K_STEPS, false), "expected no step-%d after node 1 died", K_STEPS);
	cr_expect(!has_step(K_STEPS, true), "expected node 0 to remove .tmp-step-%d", K_STEPS);
	cr_expect_eq(kill(nodes[0].pid, 0), 0, "node 0 should keep running");
	munmap(sh, sizeof(*sh));
}

Test(ckpt_cluster, every_seconds_is_refused_on_a_cluster)
{
	char log[8192];
	int st = 0;

	use_checkpoints(0);
	strcat(dist_extra_json, ", \"checkpoint_every_seconds\": 5");
	num_nodes = 2;
	pick_port();
	for (uint32_t n = 0; n < 2; n++) {
		node_paths(n);
		write_config(n, NULL, 2, NULL);
		spawn(n);
	}
	for (uint32_t n = 0; n < 2; n++) {
		bool exited = false;
		for (int i = 0; i < 500 && !exited; i++) {
			exited = waitpid(nodes[n].pid, &st, WNOHANG) == nodes[n].pid;
			if (!exited)
				usleep(20000);
		}
		read_log(n, log, sizeof(log));
		cr_assert(exited, "node %u: expected it to refuse to start within 10 s: %s", n, log);
		nodes[n].pid = 0;
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) != 0, "node %u: expected a failing exit, "
			  "got status 0x%x", n, st);
		cr_expect(strstr(log, "checkpoint_every_seconds") != NULL, "node %u: expected the "
			  "refusal to name checkpoint_every_seconds, got: %s", n, log);
	}
}
