/*
 * Integration: a cluster of real embd nodes (dist_fixture.h) that re-forms after a node
 * failed (dist/regroup.h). Trainers post step s with global batch s, and go on like a real
 * training loop would: EMBD_EAGAIN -> the same step again a little later, EMBD_ERESUMED -> the
 * step the completion names, another error -> the next step. The pooled outputs of the steps
 * that completed are compared with the unsharded reference trained on batches 0, 1, 2.
 *  - node 1 SIGSTOPped while every trainer is between forward and backward of step 1, then
 *    SIGCONTed: node 0's trainers get an error naming node 1, then the cluster resumes at
 *    step 1 and the outputs equal the reference; the same with node 0 (and its store); the
 *    stalled node's trainers' backward of step 1 fails, or is EMBD_ECANCELED as re-forming;
 *  - step 0 refused everywhere (every id outside its table), then node 1 stalled during
 *    step 1: the cluster resumes at step 1, the step refused everywhere counted as done;
 *  - node 0 SIGSTOPped while its checkpoint of step 1 is being written (slowed by the write
 *    delay hook) until node 1's wait for the verdict failed on its broken store handle: the
 *    cluster resumes, the checkpoints of steps 2 and 3 are committed (node 1 reconnected the
 *    handle) and the restarted cluster resumes at step 3 equal to the reference;
 *  - node 1 SIGKILLed and restarted after the cluster checkpoint of step 2 (and step 2 run):
 *    every node restores step 2, node 0's trainers learn it from EMBD_ERESUMED, and the
 *    outputs of the redone step 2 equal the reference;
 *  - the same without checkpoints: steps are refused, saying the cluster state was lost and
 *    naming node 1, within seconds;
 *  - the same with per-node checkpoint directories where node 1's step 2 is a copy of node
 *    0's (valid files, another node's shards): node 1's restore fails, node 0's succeeds, and
 *    both refuse steps naming node 1's failed restore (node 0 used to wait for it forever).
 */
#include <criterion/criterion.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "embd/client.h"
#include "ckpt/ckpt_cluster.h"
#include "common/clock.h"
#include "tests/integration/ckpt_cluster_fixture.h"

TestSuite(regroup, .fini = ckpt_cluster_fini, .timeout = 60);

/* What each trainer reports (shared mapping, one per global trainer). */
struct report {
	int rc;                         /* 0: its steps completed; 1: did not report */
	int resumed;                    /* EMBD_ERESUMED completions */
	uint64_t resumed_at;            /* the step the last one named */
	int failures;
	char first_err[256];            /* the first failure */
	char last_err[256];
	bool phase_done;                /* reached the pause point */
	int bwd_rc;                     /* stall: its backward of the step in flight */
	char bwd_err[256];
};

struct shared_all {
	struct shared *sh;              /* shared_map()'s */
	struct report rep[MAX_T];
};

/* Forward and backward of step `step` with global batch `step` (past the last batch: batch
 * step % K_STEPS, output not kept: a step the cluster should refuse); 0 or the failure. */
static int one_step(struct embd_client *c, struct shared *sh, uint32_t g, uint64_t step)
{
	const uint32_t D = embd_layout(c)->total_dim, k = (uint32_t)(step % K_STEPS);
	struct embd_batch b;

	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch(k, g, b.lengths, b.values);
	int rc = embd_forward(c, 0, step, n, 0);
	if (rc)
		return rc;
	if (step < K_STEPS)
		memcpy(sh->pooled[step][g], b.pooled, (size_t)BATCH * D * sizeof(float));
	for (uint32_t i = 0; i < BATCH * D; i++)
		b.grad[i] = gen_grad(k, g, i / D, i % D);
	return embd_backward(c, 0, step, n, 0);
}

/*
 * Runs steps from *step until step `end` completed (and, with must_resume, only after an
 * EMBD_ERESUMED), as a training loop that survives a cluster re-forming would; 0, or the
 * refusal that ends it (a lost state), or EMBD_ETIMEDOUT after 20 s.
 */
static int train_until(struct embd_client *c, struct shared_all *all, uint32_t g, uint64_t *step,
		       uint64_t end, bool must_resume)
{
	struct report *r = &all->rep[g];
	const int64_t deadline = embd_now_ms() + 20000;
	bool last_ok = false;

	while (embd_now_ms() < deadline) {
		if (*step >= end && last_ok && (!must_resume || r->resumed))
			return 0;
		int rc = one_step(c, all->sh, g, *step);
		last_ok = rc == 0;
		if (!rc) {
			(*step)++;
			continue;
		}
		r->failures++;
		if (!r->first_err[0])
			snprintf(r->first_err, sizeof(r->first_err), "%s", embd_last_error(c));
		snprintf(r->last_err, sizeof(r->last_err), "%s", embd_last_error(c));
		if (rc == EMBD_ERESUMED) {
			r->resumed++;
			*step = r->resumed_at = embd_layout(c)->resumed_step;
		} else if (rc == EMBD_EAGAIN) {
			usleep(20000);
		} else if (rc == EMBD_EIO && (strstr(embd_last_error(c), "state lost") ||
						 strstr(embd_last_error(c), "restart every"))) {
			return rc;
		} else {
			(*step)++;
		}
	}
	return EMBD_ETIMEDOUT;
}

static struct shared_all *map_all(void)
{
	struct shared_all *all = mmap(NULL, sizeof(*all), PROT_READ | PROT_WRITE,
				      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(all != MAP_FAILED);
	memset(all, 0, sizeof(*all));
	all->sh = shared_map();
	for (uint32_t g = 0; g < MAX_T; g++)
		all->rep[g].rc = 1;
	return all;
}

static struct embd_client *connect_trainer(struct shared_all *all, uint32_t g)
{
	struct embd_client *c = NULL;
	char err[256];

	if (embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 10000, &c, err,
			 sizeof(err))) {
		snprintf(all->rep[g].first_err, sizeof(all->rep[g].first_err), "connect: %.200s",
			 err);
		_exit(2);
	}
	if (g == 0) {
		const struct embd_client_layout *l = embd_layout(c);
		all->sh->total_dim = l->total_dim;
		for (uint32_t f = 0; f < NUM_F; f++) {
			all->sh->feature_offset[f] = l->features[f].offset;
			all->sh->feature_dim[f] = l->features[f].dim;
		}
	}
	return c;
}

static void wait_byte(int fd)
{
	char b;
	if (read(fd, &b, 1) != 1)
		_exit(3);
}

static void wait_until(struct shared_all *all, uint32_t first, uint32_t n, int timeout_ms,
		       const char *what)
{
	int64_t end = embd_now_ms() + timeout_ms;
	bool all_done = false;

	while (!all_done && embd_now_ms() < end) {
		all_done = true;
		for (uint32_t g = first; g < first + n; g++)
			all_done &= all->rep[g].phase_done;
		usleep(10000);
	}
	cr_assert(all_done, "trainers %u..%u did not %s within %d ms", first, first + n - 1, what,
		  timeout_ms);
}

static void join_trainers(const pid_t *kids, uint32_t n)
{
	for (uint32_t g = 0; g < n; g++) {
		int st;
		waitpid(kids[g], &st, 0);
	}
}

/* Two nodes, a trainer process each (trainer(all, g, go_fd)) run to its pause point; a
 * node's trainers go on once a byte per trainer is written to go[node][1]. */
static struct shared_all *start_paused(void (*trainer)(struct shared_all *, uint32_t, int),
				       pid_t *kids, int go[2][2], const char *what)
{
	start_cluster(2, "row_wise");
	struct shared_all *all = map_all();
	cr_assert(pipe(go[0]) == 0 && pipe(go[1]) == 0);
	for (uint32_t g = 0; g < 2 * RANKS; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0)
			trainer(all, g, go[g / RANKS][0]);
	}
	wait_until(all, 0, 2 * RANKS, 10000, what);
	return all;
}

/* ---- a stalled node resumes -------------------------------------------------------------- */

/* Trainer g: step 0, forward of step 1, pause (phase_done) until its go byte, backward of
 * step 1, then on to step 3. */
static void stall_trainer(struct shared_all *all, uint32_t g, int go_fd)
{
	struct embd_client *c = connect_trainer(all, g);
	struct report *r = &all->rep[g];
	uint64_t step = embd_layout(c)->resumed_step;
	const uint32_t D = embd_layout(c)->total_dim;
	struct embd_batch b;

	if (one_step(c, all->sh, g, step))
		_exit(4);
	step++;
	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch((uint32_t)step, g, b.lengths, b.values);
	if (embd_forward(c, 0, step, n, 0))
		_exit(5);
	r->phase_done = true;
	wait_byte(go_fd);
	memset(b.grad, 0, (size_t)BATCH * D * sizeof(float));
	int rc = embd_backward(c, 0, step, n, 0);
	r->bwd_rc = rc;
	snprintf(r->bwd_err, sizeof(r->bwd_err), "%s", rc ? embd_last_error(c) : "");
	if (rc) {
		r->failures++;
		snprintf(r->first_err, sizeof(r->first_err), "%s", embd_last_error(c));
		step++;
	} else {
		step++;         /* applied: this node's state is ahead (the test then fails) */
	}
	r->rc = train_until(c, all, g, &step, K_STEPS, false);
	embd_close(c);
	_exit(0);
}

/* Whether node n's log holds text, looking for up to ms. */
static bool log_shows(uint32_t n, const char *text, int ms)
{
	static char log[65536];
	int64_t end = embd_now_ms() + ms;

	do {
		read_log(n, log, sizeof(log));
		if (strstr(log, text))
			return true;
		usleep(20000);
	} while (embd_now_ms() < end);
	return false;
}

/* Node `victim` stalls while every trainer is between forward and backward of step 1; the
 * other node's trainers post their backward, then the victim continues and so do its. With
 * checkpoints (every step, one directory, node 0's writes slowed by 2.5 s), the victim is
 * node 0, stopped while it still writes the checkpoint of step 1, until node 1 gave up that
 * checkpoint: node 1's store handle for checkpoints failed on the stalled store. */
static void stall(uint32_t victim, bool checkpoints)
{
	const uint32_t T = 2 * RANKS, other = 1 - victim;
	int go[2][2];
	pid_t kids[2 * RANKS];
	char who[16];

	if (checkpoints) {
		use_checkpoints(1);
		dist_store_timeout_ms = 2000;
		snprintf(nodes[0].env, sizeof(nodes[0].env), "%s=2500", EMBD_CKPT_WRITE_DELAY_ENV);
	}
	struct shared_all *all = start_paused(stall_trainer, kids, go,
					      "finish step 0 and the forward of step 1");
	/* every trainer between forward and backward of step 1: the victim stalls */
	cr_assert_eq(kill(nodes[victim].embd.pid, SIGSTOP), 0);
	cr_assert_eq(write(go[other][1], "gg", 2), 2);
	/* the other node's trainers' backward fails within the timeout, naming the victim
	 * (node 0 stalled: its store too, which costs the other node up to 3 s more) */
	int64_t end = embd_now_ms() + TIMEOUT_MS + 6000;
	while (embd_now_ms() < end && (!all->rep[other * RANKS].failures ||
				  !all->rep[other * RANKS + 1].failures))
		usleep(10000);
	/* node 1's wait for the verdict: twice store_timeout_ms plus the store's reply slack */
	bool gave_up = !checkpoints || log_shows(1, "checkpoint of step 1 failed", 15000);
	/* node 0 re-forms without node 1, and its log says what it waits for */
	bool says_why = victim != 1 || log_shows(0, "cluster re-forming: waiting for node 1 to "
						 "join generation 1", 5000);
	kill(nodes[victim].embd.pid, SIGCONT);
	cr_assert(gave_up, "node 1 should give up the checkpoint of step 1 while node 0 stalls");
	cr_assert(says_why, "node 0 should log that it waits for node 1 to join generation 1");
	cr_assert_eq(write(go[victim][1], "gg", 2), 2);
	join_trainers(kids, T);
	snprintf(who, sizeof(who), "node %u", victim);
	for (uint32_t g = 0; g < T; g++) {
		const struct report *r = &all->rep[g];
		cr_expect_eq(r->rc, 0, "trainer %u: expected its steps to complete after the cluster "
			     "resumed, got %d (last error '%s')", g, r->rc, r->last_err);
		cr_expect(r->failures > 0, "trainer %u: expected a failed step", g);
		if (g / RANKS == other)
			cr_expect(strstr(r->first_err, who) != NULL, "trainer %u: expected the first "
				  "error to name %s, got '%s'", g, who, r->first_err);
		/* the victim's trainers post their backward once it runs again: its collective
		 * fails, or the victim dropped the step for re-forming first: then it is
		 * EMBD_ECANCELED with the re-forming message (post the step again), never a
		 * refusal that reads as a programming error */
		else
			cr_expect(r->bwd_rc != EMBD_EINVAL && (r->bwd_rc != EMBD_ECANCELED ||
							      strstr(r->bwd_err, "re-forming")),
				  "trainer %u: its backward of step 1 got %d '%s'", g, r->bwd_rc,
				  r->bwd_err);
	}
	const struct report *r = &all->rep[other * RANKS];
	cr_expect(r->resumed && r->resumed_at == 1, "trainer %u: expected EMBD_ERESUMED naming "
		  "step 1, got %d times, step %llu", other * RANKS, r->resumed,
		  (unsigned long long)r->resumed_at);
	check_against_reference(all->sh, T, victim ? "2 nodes after node 1 stalled" :
			       "2 nodes after node 0 (the store) stalled");
	for (uint32_t n = 0; n < 2; n++)
		cr_expect_eq(kill(nodes[n].embd.pid, 0), 0, "node %u should still run", n);
	munmap(all->sh, sizeof(*all->sh));
	munmap(all, sizeof(*all));
	if (!checkpoints)
		return;
	/* the checkpoints after the stall need node 1's store handle for checkpoints again */
	for (int i = 0; i < 500 && !has_step(K_STEPS, false); i++)
		usleep(20000);
	char log[8192];
	read_log(1, log, sizeof(log));
	cr_assert(has_step(2, false) && has_step(K_STEPS, false), "expected the checkpoints of "
		  "steps 2 and %d after the cluster resumed; node 1's log: %s", K_STEPS, log);
	kill_nodes();
	nodes[0].env[0] = 0;    /* the restarted cluster writes at full speed */
	struct shared *resumed = train(2, "row_wise", RANKS);
	expect_resumed(resumed, T, K_STEPS, "restarted after node 0 stalled");
	check_against_reference_after(resumed, T, "restarted after node 0 stalled", 1);
	munmap(resumed, sizeof(*resumed));
}

/* Trainer g: step 0 with every id outside its table (the whole cluster refuses every batch:
 * no update anywhere, the step counts as completed), pause until go, then steps from 1. */
static void refused_trainer(struct shared_all *all, uint32_t g, int go_fd)
{
	struct embd_client *c = connect_trainer(all, g);
	struct report *r = &all->rep[g];
	struct embd_batch b;
	uint64_t step = 0;

	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch(0, g, b.lengths, b.values);
	for (uint64_t i = 0; i < n; i++)
		b.values[i] = (int64_t)1 << 40;
	if (!n || embd_forward(c, 0, step, n, 0) != EMBD_ERANGE)
		_exit(4);
	step++;
	r->phase_done = true;
	wait_byte(go_fd);
	r->rc = train_until(c, all, g, &step, 2, false);
	embd_close(c);
	_exit(0);
}

/* A step the cluster completed with no update counts as applied: after a failure of the
 * next one the cluster resumes there (step 1), not before it (step 0). */
Test(regroup, a_step_refused_everywhere_counts_and_the_resume_lands_after_it)
{
	const uint32_t T = 2 * RANKS;
	int go[2][2];
	pid_t kids[2 * RANKS];

	struct shared_all *all = start_paused(refused_trainer, kids, go, "have step 0 refused");
	/* node 1 stalls: node 0's step 1 fails after the collective timeout and re-forms */
	cr_assert_eq(kill(nodes[1].embd.pid, SIGSTOP), 0);
	cr_assert_eq(write(go[0][1], "gg", 2), 2);
	int64_t end = embd_now_ms() + TIMEOUT_MS + 6000;
	while (embd_now_ms() < end && (!all->rep[0].failures || !all->rep[1].failures))
		usleep(10000);
	kill(nodes[1].embd.pid, SIGCONT);
	cr_assert_eq(write(go[1][1], "gg", 2), 2);
	join_trainers(kids, T);
	for (uint32_t g = 0; g < T; g++) {
		const struct report *r = &all->rep[g];
		cr_expect_eq(r->rc, 0, "trainer %u: expected steps 1 and on to complete, got %d "
			     "(last error '%s')", g, r->rc, r->last_err);
		cr_expect(!r->resumed || r->resumed_at == 1, "trainer %u: expected the cluster to "
			  "resume at step 1 (step 0 completed, refused everywhere), got EMBD_ERESUMED "
			  "naming step %llu", g, (unsigned long long)r->resumed_at);
	}
	cr_expect(all->rep[0].failures > 0, "trainer 0: expected step 1 to fail while node 1 "
		  "stalled");
	munmap(all->sh, sizeof(*all->sh));
	munmap(all, sizeof(*all));
}

Test(regroup, stalled_node_resumes_and_training_equals_the_reference) { stall(1, false); }
Test(regroup, stalled_node_0_and_its_store_resume) { stall(0, false); }
Test(regroup, checkpoints_after_node_0_stalled_mid_write_commit_and_restore) { stall(0, true); }

/* ---- a killed node restarts -------------------------------------------------------------- */

/* Trainer g of the surviving node: steps 0..2, pause until go, then post step 3 until the
 * cluster tells it where it resumed, and complete the steps up to 2 again. The other node's
 * first trainers stop after step 2 (their node is then killed). */
static void restart_trainer(struct shared_all *all, uint32_t g, int go_fd, uint32_t survivor)
{
	struct embd_client *c = connect_trainer(all, g);
	struct report *r = &all->rep[g];
	uint64_t step = embd_layout(c)->resumed_step;

	r->rc = train_until(c, all, g, &step, K_STEPS, false);
	if (r->rc)
		_exit(4);
	r->phase_done = true;
	if (g / RANKS == survivor) {
		wait_byte(go_fd);
		r->rc = 1;
		r->failures = 0;
		r->first_err[0] = 0;
		r->rc = train_until(c, all, g, &step, K_STEPS, true);
	}
	embd_close(c);
	_exit(0);
}

/* A trainer of the restarted node 1: from its WELCOME's step to the last one. */
static void late_trainer(struct shared_all *all, uint32_t g)
{
	struct embd_client *c = connect_trainer(all, g);
	uint64_t step = embd_layout(c)->resumed_step;

	all->rep[g].rc = train_until(c, all, g, &step, K_STEPS, false);
	embd_close(c);
	_exit(0);
}

enum checkpoints {
	NO_CHECKPOINTS,
	SHARED_DIR,                     /* one checkpoint_dir */
	PER_NODE_VICTIM_HOLDS_NODE_0S,  /* per_node; the victim's step-2 replaced by node 0's */
};

/* Node `victim` is killed after step 2 ran (and the cluster checkpoint of step 2 was
 * written, with checkpoints) and restarted (node 1 gets new trainers); the other node's
 * trainers then post step 3. */
static struct shared_all *kill_and_restart(enum checkpoints ck, uint32_t victim, pid_t *kids)
{
	const uint32_t T = 2 * RANKS, survivor = 1 - victim;
	const char *every = "\"checkpoint_every_steps\": 2, \"checkpoint_keep\": 0";
	char path[192], cmd[512];
	int go[2];

	snprintf(ckpt_root, sizeof(ckpt_root), "/tmp/embd-regroup-%s", dist_run_id());
	if (ck == SHARED_DIR)
		snprintf(dist_extra_json, sizeof(dist_extra_json), ", \"checkpoint_dir\": \"%s\", %s",
			 ckpt_root, every);
	for (uint32_t n = 0; ck == PER_NODE_VICTIM_HOLDS_NODE_0S && n < 2; n++) {
		snprintf(dist_extra_json, sizeof(dist_extra_json), ", \"checkpoint_layout\": "
			 "\"per_node\", %s", every);
		snprintf(dist_node_json[n], sizeof(dist_node_json[n]), ", \"checkpoint_dir\": "
			 "\"%s/node%u\"", ckpt_root, n);
	}
	start_cluster(2, "row_wise");
	struct shared_all *all = map_all();
	cr_assert(pipe(go) == 0);
	for (uint32_t g = 0; g < T; g++) {
		kids[g] = tu_fork_child();
		if (kids[g] == 0)
			restart_trainer(all, g, go[0], survivor);
	}
	wait_until(all, 0, T, 15000, "run steps 0..2");
	for (uint32_t g = victim * RANKS; g < (victim + 1) * RANKS; g++) {
		int st;
		waitpid(kids[g], &st, 0);
	}
	for (uint32_t n = 0; ck != NO_CHECKPOINTS && n < 2; n++) {
		snprintf(path, sizeof(path), "%s%s/step-2/manifest.json", ckpt_root,
			 ck == SHARED_DIR ? "" : n ? "/node1" : "/node0");
		for (int i = 0; i < 500 && access(path, F_OK) != 0; i++)
			usleep(20000);
		cr_assert(access(path, F_OK) == 0, "expected %s within 10 s", path);
	}
	if (ck == PER_NODE_VICTIM_HOLDS_NODE_0S) {
		/* valid files and manifest, but written by node 0: only the victim's load fails */
		stop_node(victim, SIGKILL);
		snprintf(cmd, sizeof(cmd), "rm -rf '%s/node%u/step-2' && cp -r '%s/node0/step-2' "
			 "'%s/node%u/step-2'", ckpt_root, victim, ckpt_root, ckpt_root, victim);
		cr_assert_eq(system(cmd), 0, "%s failed", cmd);
	}
	restart_node(victim);
	for (uint32_t g = RANKS; victim == 1 && g < T; g++) {
		all->rep[g].rc = 1;
		kids[g] = tu_fork_child();
		if (kids[g] == 0)
			late_trainer(all, g);
	}
	cr_assert_eq(write(go[1], "gg", 2), 2);
	join_trainers(kids + survivor * RANKS, RANKS);
	if (victim == 1)
		join_trainers(kids + RANKS, RANKS);
	return all;
}

Test(regroup, restarted_node_makes_the_cluster_restore_its_checkpoint)
{
	const uint32_t T = 2 * RANKS;
	pid_t kids[2 * RANKS];
	struct shared_all *all = kill_and_restart(SHARED_DIR, 1, kids);

	for (uint32_t g = 0; g < T; g++)
		cr_expect_eq(all->rep[g].rc, 0, "trainer %u: expected step 2 to run again after the "
			     "restore, got %d (last error '%s')", g, all->rep[g].rc,
			     all->rep[g].last_err);
	for (uint32_t g = 0; g < RANKS; g++)
		cr_expect(all->rep[g].resumed_at == 2, "trainer %u: expected EMBD_ERESUMED naming "
			  "step 2 (the checkpoint), got step %llu ('%s')", g,
			  (unsigned long long)all->rep[g].resumed_at, all->rep[g].last_err);
	/* step 2's outputs come from the redone step: equal only if node 0 restored too */
	check_against_reference(all->sh, T, "2 nodes after node 1 restarted (restored step 2)");
	munmap(all->sh, sizeof(*all->sh));
	munmap(all, sizeof(*all));
}

Test(regroup, restarted_node_without_checkpoints_refuses_steps_state_lost)
{
	const uint32_t T = 2 * RANKS;
	pid_t kids[2 * RANKS];
	int64_t t0 = embd_now_ms();
	struct shared_all *all = kill_and_restart(NO_CHECKPOINTS, 1, kids);

	for (uint32_t g = 0; g < T; g++) {
		const struct report *r = &all->rep[g];
		cr_expect_eq(r->rc, EMBD_EIO, "trainer %u: expected EMBD_EIO (state lost), got %d "
			     "('%s')", g, r->rc, r->last_err);
		cr_expect(strstr(r->last_err, "state lost") && strstr(r->last_err, "node 1"),
			  "trainer %u: expected the refusal to say the state was lost, naming node "
			  "1, got '%s'", g, r->last_err);
	}
	cr_expect_lt(embd_now_ms() - t0, 30000, "expected the refusals within 30 s of the start");
	munmap(all->sh, sizeof(*all->sh));
	munmap(all, sizeof(*all));
}

/* A restore that fails on node 1 only: every node learns it through the store and refuses
 * steps naming node 1 and why, instead of waiting for it. */
Test(regroup, restore_failing_on_node_1_is_refused_on_both_nodes_naming_it)
{
	const uint32_t T = 2 * RANKS;
	pid_t kids[2 * RANKS];
	char log[8192];
	struct shared_all *all = kill_and_restart(PER_NODE_VICTIM_HOLDS_NODE_0S, 1, kids);

	for (uint32_t g = 0; g < T; g++) {
		const struct report *r = &all->rep[g];
		cr_expect_eq(r->rc, EMBD_EIO, "trainer %u: expected EMBD_EIO (state lost), got %d "
			     "('%s')", g, r->rc, r->last_err);
		cr_expect(strstr(r->last_err, "state lost") &&
			  strstr(r->last_err, "node 1's restore failed"), "trainer %u: expected the "
			  "refusal to name node 1's failed restore, got '%s'", g, r->last_err);
	}
	read_log(0, log, sizeof(log));
	cr_expect(strstr(log, "node 1's restore failed") && strstr(log, "written by node 0"),
		  "node 0's log should say why node 1's restore failed: %s", log);
	munmap(all->sh, sizeof(*all->sh));
	munmap(all, sizeof(*all));
}

/* Node 0 restarted: a new store, so the cluster is not resumed; both sides say so. */
Test(regroup, restarted_node_0_is_refused_clearly_on_both_sides)
{
	pid_t kids[2 * RANKS];
	char log[8192];
	int st = 0;

	dist_store_timeout_ms = 3000;
	struct shared_all *all = kill_and_restart(NO_CHECKPOINTS, 0, kids);
	for (uint32_t g = RANKS; g < 2 * RANKS; g++) {
		const struct report *r = &all->rep[g];
		cr_expect_eq(r->rc, EMBD_EIO, "trainer %u: expected EMBD_EIO, got %d ('%s')", g, r->rc,
			     r->last_err);
		cr_expect(strstr(r->last_err, "node 0 restarted") != NULL, "trainer %u: expected "
			  "the refusal to say node 0 restarted, got '%s'", g, r->last_err);
	}
	/* the new node 0 gives up after store_timeout_ms, naming node 1 */
	tu_embd_wait(&nodes[0].embd, 10000, &st);
	read_log(0, log, sizeof(log));
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 1, "the new node 0: expected exit 1 within "
		  "10 s, got status 0x%x", st);
	cr_expect(strstr(log, "node(s) 1 still run the cluster node 0 had before it restarted"),
		  "the new node 0 should name node 1 as running the old cluster: %s", log);
	munmap(all->sh, sizeof(*all->sh));
	munmap(all, sizeof(*all));
}
