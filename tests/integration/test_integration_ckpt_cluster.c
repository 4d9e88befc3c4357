/*
 * Integration: checkpoints of a cluster, in one shared checkpoint_dir and in per-node
 * directories (ckpt/checkpoint.h), with the real embd nodes of dist_fixture.h. Two nodes
 * checkpoint every K steps, are stopped and restarted: the trainers resume at step K and every
 * later pooled output equals the reference's after 2 K steps (the one of a run without the
 * stop; trainers that reconnect to a running cluster are no such run: the steps go on without
 * them), and the cluster's next checkpoint restored on one node goes on like the reference
 * too; the same with per-node directories. A checkpoint one node wrote under table_wise
 * restores on two nodes under row_wise: every output afterwards equals the one node's own
 * continuation of the same global batch. A node that dies before it reported its files leaves
 * no step directory and no .tmp one, and node 0 names it; with per-node directories a node
 * whose newest step is damaged makes the cluster restore the previous common step, and a
 * node's own steps above the restored one are set aside rather than mixed into the cluster
 * checkpoints trained anew. Nodes
 * with different checkpoint settings refuse to start, naming the key.
 */
#include "tests/integration/ckpt_cluster_fixture.h"
#include "tests/support/dir_util.h"

TestSuite(ckpt_cluster, .fini = ckpt_cluster_fini, .timeout = 40);

/* The same in checkpoint_layout per_node: node n's checkpoint_dir is <root>/node<n>. */
static void use_per_node_checkpoints(uint32_t every_steps)
{
	snprintf(ckpt_root, sizeof(ckpt_root), "/tmp/embd-ckpt-cluster-%s", dist_run_id());
	snprintf(dist_extra_json, sizeof(dist_extra_json), ", \"checkpoint_layout\": \"per_node\", "
		 "\"checkpoint_every_steps\": %u, \"checkpoint_keep\": 0", every_steps);
	for (uint32_t n = 0; n < MAX_NODES; n++)
		snprintf(dist_node_json[n], sizeof(dist_node_json[n]), ", \"checkpoint_dir\": "
			 "\"%s/node%u\"", ckpt_root, n);
}

/* <root>/node<n>/step-<step>/manifest.json exists (per_node layout). */
static bool node_has_step(uint32_t n, uint64_t step)
{
	char path[192];

	snprintf(path, sizeof(path), "%s/node%u/step-%llu/manifest.json", ckpt_root, n,
		 (unsigned long long)step);
	return access(path, F_OK) == 0;
}

static void wait_for_step(uint64_t step)
{
	for (int i = 0; i < 500 && !has_step(step, false); i++)
		usleep(20000);
	cr_assert(has_step(step, false), "expected %s/step-%llu within 10 s", ckpt_root,
		  (unsigned long long)step);
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

	/* K steps, the checkpoint of step K, a crash (SIGKILL: no final checkpoint), restart, K
	 * more: as 2 K steps of the reference */
	use_checkpoints(K_STEPS);
	struct shared *first = train(2, "row_wise", RANKS);
	check_against_reference(first, T, "2 nodes before the checkpoint");
	wait_for_step(K_STEPS);
	kill_nodes();
	struct shared *resumed = train(2, "row_wise", RANKS);
	expect_resumed(resumed, T, K_STEPS, "restarted cluster");
	check_against_reference_after(resumed, T, "restarted cluster", 1);
	/* the cluster's checkpoint of step 2 K restores on one node (all T trainers there) */
	wait_for_step(2 * K_STEPS);
	kill_nodes();
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
	/* SIGKILL: no final checkpoint, so that the one node restores the same step K */
	kill_nodes();
	cr_expect(!has_step(2 * K_STEPS, false), "expected no step-%d after SIGKILL", 2 * K_STEPS);
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
	cr_expect_eq(kill(nodes[0].embd.pid, 0), 0, "node 0 should keep running");
	munmap(sh, sizeof(*sh));
}

/* Per-node directories: each node writes and commits its own step-K (every K steps) and its
 * own final one at SIGTERM; the cluster restarts from the newest like from a shared
 * directory. */
Test(ckpt_cluster, per_node_directories_stopped_and_restarted_resume_at_the_checkpoint)
{
	const uint32_t T = 2 * RANKS;
	char dir[192];
	int entries;

	use_per_node_checkpoints(K_STEPS);
	struct shared *first = train(2, "row_wise", RANKS);
	check_against_reference(first, T, "2 nodes (per-node directories) before the checkpoint");
	for (int i = 0; i < 500 && !(node_has_step(0, K_STEPS) && node_has_step(1, K_STEPS)); i++)
		usleep(20000);
	cr_assert(node_has_step(0, K_STEPS) && node_has_step(1, K_STEPS), "expected step-%d in "
		  "%s/node0 and node1 within 10 s", K_STEPS, ckpt_root);
	cr_expect(!has_step(K_STEPS, false), "expected nothing in the root itself");
	stop_nodes();
	/* the final checkpoint: K, or K + 1 after the empty step of the trainers' hangup */
	long long newest[2];
	for (uint32_t n = 0; n < 2; n++) {
		snprintf(dir, sizeof(dir), "%s/node%u", ckpt_root, n);
		newest[n] = newest_step(dir, &entries);
	}
	cr_assert(newest[0] == newest[1] && newest[0] >= K_STEPS && newest[0] <= K_STEPS + 1,
		  "expected both nodes' newest step at %d or %d, got %lld and %lld", K_STEPS,
		  K_STEPS + 1, newest[0], newest[1]);
	struct shared *resumed = train(2, "row_wise", RANKS);
	expect_resumed(resumed, T, (uint64_t)newest[0], "restarted cluster (per-node directories)");
	check_against_reference_after(resumed, T, "restarted cluster (per-node directories)", 1);
	munmap(first, sizeof(*first));
	munmap(resumed, sizeof(*resumed));
}

/* Node 1's newest step is damaged and node 0's newest is missing on node 1: the cluster
 * restores the newest step both hold valid. */
Test(ckpt_cluster, per_node_damaged_newest_step_restores_the_previous_common_one)
{
	char path[512];

	char dir0[192], dir1[192];
	int entries;

	use_per_node_checkpoints(1);
	struct shared *sh = train(2, "row_wise", RANKS);
	for (int i = 0; i < 500 && !(node_has_step(0, K_STEPS) && node_has_step(1, K_STEPS)); i++)
		usleep(20000);
	usleep(300000);         /* the empty step the trainers' hangup may trigger, and its write */
	kill_nodes();
	snprintf(dir0, sizeof(dir0), "%s/node0", ckpt_root);
	snprintf(dir1, sizeof(dir1), "%s/node1", ckpt_root);
	long long n0 = newest_step(dir0, &entries), N = newest_step(dir1, &entries);
	N = n0 < N ? n0 : N;
	cr_assert(N >= K_STEPS, "expected steps 1..%d at least on both nodes, got %lld", K_STEPS,
		  N);
	/* node 1: step N's weight file of table 0 loses a byte; step N - 1 is removed on node 0 */
	snprintf(path, sizeof(path), "%s/step-%lld/t0-t_sum.r32.c0.n1.weight.npy", dir1, N);
	struct stat st;
	cr_assert(stat(path, &st) == 0, "expected %s", path);
	cr_assert(truncate(path, st.st_size - 1) == 0, "truncate %s", path);
	snprintf(path, sizeof(path), "rm -rf %s/step-%lld", dir0, N - 1);
	cr_assert(system(path) == 0);
	/* any step above N on one node only (written as the other was killed) goes too */
	snprintf(path, sizeof(path), "rm -rf %s/step-%lld %s/step-%lld", dir0, N + 1, dir1, N + 1);
	cr_assert(system(path) == 0);
	struct shared *again = train(2, "row_wise", RANKS);
	expect_resumed(again, 2 * RANKS, (uint64_t)N - 2, "node 1's newest step damaged, node "
		       "0's previous one gone");
	char log[8192];
	read_log(1, log, sizeof(log));
	cr_expect(strstr(log, "damaged") != NULL, "node 1 should report its damaged step; log: %s",
		  log);
	munmap(sh, sizeof(*sh));
	munmap(again, sizeof(*again));
}

/* Waits up to 10 s for step in both nodes' directories. */
static void wait_for_node_steps(uint64_t step)
{
	for (int i = 0; i < 500 && !(node_has_step(0, step) && node_has_step(1, step)); i++)
		usleep(20000);
	cr_assert(node_has_step(0, step) && node_has_step(1, step), "expected step-%llu in "
		  "%s/node0 and node1 within 10 s", (unsigned long long)step, ckpt_root);
}

/* Per-node directories: node 1 holds a step M that node 0 lacks, so the cluster resumes from
 * an older step N. The training from N reaches M again, with other batches: node 1 must write
 * its new step M, not keep the one of the abandoned history ("already written"), or the
 * cluster checkpoint M mixes node 0's new shards with node 1's old ones. Restored, it must
 * train on as the reference of the accepted steps alone. */
Test(ckpt_cluster, per_node_restore_sets_a_nodes_newer_steps_aside, .timeout = 120)
{
	const uint32_t T = 2 * RANKS;
	char path[512];

	use_per_node_checkpoints(K_STEPS);
	/* steps 1..K with short batches: step K on both nodes */
	short_batches = true;
	struct shared *sh = train(2, "row_wise", RANKS);
	wait_for_node_steps(K_STEPS);
	kill_nodes();
	munmap(sh, sizeof(*sh));
	/* K..2K with full batches: the history that is then abandoned */
	short_batches = false;
	sh = train(2, "row_wise", RANKS);
	expect_resumed(sh, T, K_STEPS, "second run");
	wait_for_node_steps(2 * K_STEPS);
	kill_nodes();
	munmap(sh, sizeof(*sh));
	snprintf(path, sizeof(path), "rm -rf %s/node0/step-%d", ckpt_root, 2 * K_STEPS);
	cr_assert(system(path) == 0);
	/* the cluster resumes from K (the newest step both hold) and trains K..2K with short
	 * batches again: node 1's old step 2K goes to abandoned/ first */
	short_batches = true;
	sh = train(2, "row_wise", RANKS);
	expect_resumed(sh, T, K_STEPS, "node 0 lacks step 2K");
	wait_for_node_steps(2 * K_STEPS);
	char prefix[32];
	snprintf(path, sizeof(path), "%s/node1/abandoned", ckpt_root);
	snprintf(prefix, sizeof(prefix), "step-%d-", 2 * K_STEPS);
	cr_expect_eq(tu_count_entries(path, prefix), 1, "expected node 1's %s<time> of the "
		     "abandoned history in %s", prefix, path);
	usleep(300000);         /* the write of step 2K may still be under way on node 0 */
	kill_nodes();
	munmap(sh, sizeof(*sh));
	/* step 2K restored: as two rounds of the short batches, nothing of the full ones */
	sh = train(2, "row_wise", RANKS);
	expect_resumed(sh, T, 2 * K_STEPS, "restored step 2K");
	check_against_reference_after(sh, T, "restored step 2K of per-node directories where "
				      "node 1 held an abandoned step 2K", 2);
	munmap(sh, sizeof(*sh));
}

/* Checkpoint settings must agree at join: both nodes refuse, naming the key. A port node 0
 * could not listen on is retried with another one (node0_lost_port). */
Test(ckpt_cluster, different_checkpoint_settings_are_refused_at_join)
{
	char log[8192];
	bool exited[2];
	int status[2] = { 0, 0 };

	use_checkpoints(0);
	snprintf(dist_node_json[1], sizeof(dist_node_json[1]), ", \"checkpoint_every_seconds\": 5");
	num_nodes = 2;
	for (int attempt = 0;; attempt++) {
		port = tu_free_port();
		for (uint32_t n = 0; n < 2; n++) {
			node_paths(n);
			write_config(n, NULL, 2, NULL);
			spawn(n);
		}
		for (uint32_t n = 0; n < 2; n++)
			exited[n] = tu_embd_wait(&nodes[n].embd, 10000, &status[n]);
		if (attempt == 3 || !node0_lost_port())
			break;
		for (uint32_t n = 0; n < 2; n++)
			stop_node(n, SIGKILL);
	}
	for (uint32_t n = 0; n < 2; n++) {
		const int st = status[n];
		read_log(n, log, sizeof(log));
		cr_assert(exited[n], "node %u: expected it to refuse to start within 10 s: %s", n,
			  log);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) != 0, "node %u: expected a failing exit, "
			  "got status 0x%x", n, st);
		cr_expect(strstr(log, n ? "checkpoint_every_seconds 5 here, 0 on node 0"
					: "checkpoint_every_seconds 0 here, 5 on node 1") != NULL,
			  "node %u: expected the refusal to name checkpoint_every_seconds and both "
			  "values, got: %s", n, log);
	}
}
