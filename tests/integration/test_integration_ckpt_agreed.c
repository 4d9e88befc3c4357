/*
 * Integration: the checkpoint triggers a cluster agrees on through its steps (ckpt/
 * ckpt_service.h), with the real embd nodes of dist_fixture.h and one shared checkpoint_dir.
 * `embctl checkpoint --wait` on node 1 answers with a committed cluster checkpoint of the step
 * it names, also when node 0's own write takes longer than node 1's first wait for the
 * verdict (twice store_timeout_ms; node 0 slowed by the write-delay hook); node 0's checkpoint_every_seconds timer produces a checkpoint both nodes restore;
 * SIGTERM to both idle nodes leaves a final checkpoint of the current step that the restarted
 * cluster resumes exactly from (equal to the reference); SIGTERM to one idle node alone ends
 * it in bounded time and leaves no checkpoint; SIGTERM to both while the cluster re-forms
 * leaves none either, each node saying why; a `--wait` pending when a re-formed cluster
 * restores is answered with an error naming the restore.
 */
#include "ckpt/ckpt_cluster.h"
#include "dist/store.h"
#include "tests/integration/ckpt_cluster_fixture.h"

TestSuite(ckpt_agreed, .fini = ckpt_cluster_fini, .timeout = 60);

/* `embctl checkpoint --wait` on node n in the background, its output into out. */
static pid_t embctl_wait_start(uint32_t n, char *out, size_t out_len)
{
	char cmd[512];

	snprintf(out, out_len, "/tmp/embd-ckpt-agreed-%s.out", dist_run_id());
	snprintf(cmd, sizeof(cmd), "%s checkpoint --wait --timeout 30 --socket %s > %s 2>&1",
		 EMBCTL_BINARY, nodes[n].embd.socket, out);
	pid_t ctl = tu_fork_child();
	if (ctl == 0)
		_exit(system(cmd) == 0 ? 0 : 1);
	return ctl;
}

/* Whether that embctl ended within ms (its wait status in *st); its output into reply. */
static bool embctl_wait_end(pid_t ctl, const char *out, int ms, char *reply, size_t len, int *st)
{
	bool ended = false;

	for (int waited = 0; waited <= ms && !ended; waited += 20) {
		ended = waitpid(ctl, st, WNOHANG) == ctl;
		if (!ended)
			usleep(20000);
	}
	FILE *f = fopen(out, "r");
	reply[0] = 0;
	if (f) {
		reply[fread(reply, 1, len - 1, f)] = 0;
		fclose(f);
	}
	unlink(out);
	return ended;
}

/* `embctl checkpoint --wait` on node 1 while the trainers run; node 0's write of its part
 * sleeps node0_delay_ms first (EMBD_CKPT_WRITE_DELAY_ENV, 0: none). */
static void checkpoint_wait_on_node_1(int node0_delay_ms)
{
	char out[160], reply[512] = "";
	int st = 0;

	use_checkpoints(0);
	dist_trainers_per_node = RANKS;
	if (node0_delay_ms) {
		dist_store_timeout_ms = 2000;
		snprintf(nodes[0].env, sizeof(nodes[0].env), "%s=%d", EMBD_CKPT_WRITE_DELAY_ENV,
			 node0_delay_ms);
	}
	start_cluster(2, "row_wise");
	/* embctl waits on node 1 before any step: the next step's HELLO carries the request */
	pid_t ctl = embctl_wait_start(1, out, sizeof(out));
	usleep(300000);
	const char *sockets[2] = { nodes[0].embd.socket, nodes[1].embd.socket };
	struct shared *sh = shared_map();
	run_trainers(sh, 2 * RANKS, sockets, RANKS);
	check_against_reference(sh, 2 * RANKS, "2 nodes with a checkpoint asked on node 1");
	embctl_wait_end(ctl, out, 20000, reply, sizeof(reply), &st);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "embctl checkpoint --wait on node 1: "
		  "expected exit 0, got status 0x%x: %s", st, reply);
	const char *at = strstr(reply, "\"step\":");
	cr_assert(strstr(reply, "\"ok\":true") && at, "expected ok and a step, got: %s", reply);
	unsigned long long step = strtoull(at + 7, NULL, 10);
	cr_expect(step >= 1 && step <= K_STEPS, "expected the checkpoint at a boundary of the "
		  "trainers' steps (1..%d), got %llu", K_STEPS, step);
	/* answered once committed: the step directory is there, and holds both nodes' files */
	cr_expect(has_step(step, false), "expected %s/step-%llu when embctl answered", ckpt_root,
		  step);
	char path[256];
	snprintf(path, sizeof(path), "%s/step-%llu/t0-t_sum.r32.c0.n1.weight.npy", ckpt_root, step);
	cr_expect(access(path, F_OK) == 0, "expected node 1's file %s", path);
	snprintf(path, sizeof(path), "%s/step-%llu/t0-t_sum.r0.c0.n0.weight.npy", ckpt_root, step);
	cr_expect(access(path, F_OK) == 0, "expected node 0's file %s", path);
	munmap(sh, sizeof(*sh));
}

Test(ckpt_agreed, embctl_checkpoint_wait_on_node_1_answers_with_the_cluster_checkpoint)
{
	checkpoint_wait_on_node_1(0);
}

/* node 0 writes 5 s, node 1's first wait for the verdict is 4 s (store_timeout_ms 2000) */
Test(ckpt_agreed, embctl_checkpoint_wait_on_node_1_outwaits_a_slow_node_0)
{
	checkpoint_wait_on_node_1(5000);
}

Test(ckpt_agreed, every_seconds_on_a_cluster_checkpoints_and_restores)
{
	use_checkpoints(0);
	strcat(dist_extra_json, ", \"checkpoint_every_seconds\": 1");
	dist_trainers_per_node = RANKS;
	start_cluster(2, "row_wise");
	/* node 0's timer is due from the second step on (the first trained nothing yet) */
	usleep(1300000);
	const char *sockets[2] = { nodes[0].embd.socket, nodes[1].embd.socket };
	struct shared *sh = shared_map();
	run_trainers(sh, 2 * RANKS, sockets, RANKS);
	uint64_t step = 0;
	for (int i = 0; i < 500 && !step; i++) {
		for (uint64_t s = 1; s <= K_STEPS && !step; s++)
			step = has_step(s, false) ? s : 0;
		if (!step)
			usleep(20000);
	}
	cr_assert(step, "expected a step directory of steps 1..%d in %s within 10 s", K_STEPS,
		  ckpt_root);
	/* SIGKILL: no final checkpoint, the restore must take the timer's one */
	kill_nodes();
	struct shared *again = train(2, "row_wise", RANKS);
	expect_resumed(again, 2 * RANKS, step, "restored every_seconds checkpoint");
	munmap(sh, sizeof(*sh));
	munmap(again, sizeof(*again));
}

Test(ckpt_agreed, sigterm_to_both_idle_nodes_leaves_a_final_checkpoint_both_resume_from)
{
	const uint32_t T = 2 * RANKS;

	int entries;

	use_checkpoints(0);
	struct shared *first = train(2, "row_wise", RANKS);
	stop_nodes();
	/* the current step: K, or K + 1 when the nodes ran the empty step their trainers' hangup
	 * triggers (a collective step with no batch, changing nothing) */
	long long step = newest_step(ckpt_root, &entries);
	cr_assert(step >= K_STEPS && step <= K_STEPS + 1 && entries == 1, "expected one final "
		  "checkpoint, %s/step-%d or -%d, after SIGTERM to both nodes; newest %lld of %d",
		  ckpt_root, K_STEPS, K_STEPS + 1, step, entries);
	struct shared *resumed = train(2, "row_wise", RANKS);
	expect_resumed(resumed, T, (uint64_t)step, "restarted after SIGTERM");
	check_against_reference_after(resumed, T, "restarted after SIGTERM", 1);
	munmap(first, sizeof(*first));
	munmap(resumed, sizeof(*resumed));
}

Test(ckpt_agreed, sigterm_while_steps_run_checkpoints_after_the_next_step_and_exits)
{
	struct shared *sh = shared_map();
	pid_t kids[2 * RANKS];
	int st = 0, entries;

	use_checkpoints(0);
	dist_trainers_per_node = RANKS;
	start_cluster(2, "row_wise");
	/* the signal first, then the trainers (well within the nodes' 1 s wait for a step): their
	 * first step carries the request, the nodes checkpoint step 1 and stop, so the trainers'
	 * later steps fail (not checked) */
	for (uint32_t n = 0; n < 2; n++)
		kill(nodes[n].embd.pid, SIGTERM);
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0) {
			sh->rc[g] = trainer_run(sh, nodes[g / RANKS].embd.socket, g % RANKS, g);
			_exit(0);
		}
	}
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		waitpid(kids[g], &st, 0);
	for (uint32_t n = 0; n < 2; n++) {
		char log[8192];
		bool exited = tu_embd_wait(&nodes[n].embd, 10000, &st);
		read_log(n, log, sizeof(log));
		cr_assert(exited && WIFEXITED(st) && WEXITSTATUS(st) == 0, "node %u: expected exit 0 "
			  "within 10 s of the trainers, got %s 0x%x: %s", n, exited ? "status" : "none",
			  st, log);
	}
	long long step = newest_step(ckpt_root, &entries);
	cr_assert(step == 1 && entries == 1, "expected one checkpoint, %s/step-1 (the boundary "
		  "after the first step), got newest %lld of %d", ckpt_root, step, entries);
	struct shared *again = train(2, "row_wise", RANKS);
	expect_resumed(again, 2 * RANKS, 1, "restarted after SIGTERM while steps ran");
	munmap(sh, sizeof(*sh));
	munmap(again, sizeof(*again));
}

Test(ckpt_agreed, sigterm_to_one_idle_node_alone_writes_nothing_and_ends)
{
	char log[8192];
	int st = 0;

	use_checkpoints(0);
	dist_store_timeout_ms = 2000;
	struct shared *sh = train(2, "row_wise", RANKS);
	/* idle: after the empty step the trainers' hangup may trigger (a step would carry the
	 * request, and the cluster would take it: the non-idle case) */
	usleep(500000);
	kill(nodes[1].embd.pid, SIGTERM);
	/* 1 s for a step that never comes, then up to twice store_timeout_ms for node 0 */
	bool exited = tu_embd_wait(&nodes[1].embd, 8000, &st);
	read_log(1, log, sizeof(log));
	cr_assert(exited, "node 1: expected it to exit within 8 s of SIGTERM: %s", log);
	cr_expect(strstr(log, "no final checkpoint") != NULL, "node 1: expected it to say why it "
		  "wrote none, got (exit status 0x%x): %s", st, log);
	int entries;
	long long step = newest_step(ckpt_root, &entries);
	cr_expect(entries == 0, "expected no step directory at all, got %d (newest %lld)", entries,
		  step);
	cr_expect_eq(kill(nodes[0].embd.pid, 0), 0, "node 0 should keep running");
	munmap(sh, sizeof(*sh));
}

/* A re-formed cluster's restore drops the pending checkpoint request: `embctl checkpoint
 * --wait` is answered at once with an error saying so (it waited for some later checkpoint,
 * or its timeout). Node 1 killed and restarted makes both nodes restore. */
Test(ckpt_agreed, embctl_checkpoint_wait_pending_at_a_restore_is_answered_with_an_error)
{
	char out[160], reply[512], log[8192];
	int st = 0;

	use_checkpoints(2);
	struct shared *sh = train(2, "row_wise", RANKS);
	for (int i = 0; i < 500 && !has_step(2, false); i++)
		usleep(20000);
	cr_assert(has_step(2, false), "expected the checkpoint of step 2 within 10 s");
	stop_node(1, SIGKILL);
	/* idle: no step carries the request */
	pid_t ctl = embctl_wait_start(0, out, sizeof(out));
	usleep(300000);
	restart_node(1);
	bool ended = embctl_wait_end(ctl, out, 10000, reply, sizeof(reply), &st);
	read_log(0, log, sizeof(log));
	cr_assert(ended, "embctl checkpoint --wait on node 0: expected an answer within 10 s of "
		  "the restore, got none; node 0's log: %s", log);
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 1, "expected embctl to fail, status 0x%x",
		  st);
	cr_expect(strstr(reply, "\"ok\":false") && strstr(reply, "request dropped") &&
		  strstr(reply, "restored the checkpoint of step"), "expected ok false naming the "
		  "restore, got: %s; node 0's log: %s", reply, log);
	munmap(sh, sizeof(*sh));
}

/* SIGTERM while the cluster re-forms: no final checkpoint on any node, each saying why (the
 * nodes' shards may differ after a failed gradient exchange, and the step counted ahead of
 * them); one was taken when every node stopped at the same step. Node 1 is stopped, so node 0
 * re-forms alone: the newer generation it sees is opened through the store, as a node whose
 * collective failed does. */
Test(ckpt_agreed, sigterm_while_the_cluster_re_forms_takes_no_final_checkpoint)
{
	struct embd_store *store = NULL;
	char err[256], log[8192];
	int st = 0, entries;

	use_checkpoints(0);
	struct shared *sh = train(2, "row_wise", RANKS);
	usleep(500000);
	kill(nodes[1].embd.pid, SIGSTOP);
	cr_assert_eq(embd_store_connect(dist_master_addr, port, 5000, &store, err, sizeof(err)), 0,
		     "store: %s", err);
	cr_assert_eq(embd_store_set(store, "embd/gen/1/open", "1", 1), 0);
	embd_store_close(store);
	log[0] = 0;
	for (int i = 0; i < 250 && !strstr(log, "re-forming the cluster"); i++) {
		usleep(20000);
		read_log(0, log, sizeof(log));
	}
	cr_assert(strstr(log, "re-forming the cluster"), "node 0 did not re-form: %s", log);
	kill(nodes[0].embd.pid, SIGTERM);
	usleep(1500000);        /* node 0 past its 1 s wait for a step: at its final checkpoint */
	kill(nodes[1].embd.pid, SIGTERM);
	kill(nodes[1].embd.pid, SIGCONT);
	for (uint32_t n = 0; n < 2; n++) {
		bool exited = tu_embd_wait(&nodes[n].embd, 12000, &st);
		read_log(n, log, sizeof(log));
		cr_expect(exited && strstr(log, "no final checkpoint: the cluster is not running"),
			  "node %u: expected it to exit saying it took no final checkpoint while "
			  "re-forming (%s, status 0x%x): %s", n, exited ? "exited" : "running", st, log);
	}
	long long step = newest_step(ckpt_root, &entries);
	cr_expect(entries == 0, "expected no step directory, got %d (newest %lld)", entries, step);
	munmap(sh, sizeof(*sh));
}
