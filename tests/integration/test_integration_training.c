/*
 * Integration: real embd processes and real trainer processes training together. For every
 * sharding type (forced by a table constraint), trainers forked from the test run K steps of
 * forward + backward and every pooled output equals the unsharded reference (tests/support/reference.c)
 * trained on the concatenated global batch from embd_init_value weights; 4 trainers at once;
 * a trainer killed with SIGKILL mid-step (the others get EMBD_ECANCELED, the service survives
 * without leaking fds and the next step runs); malformed batches refused with the field named.
 * Tables, batches and the reference check: training_common.h.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "libclient/client_internal.h"
#include "tests/integration/ctl_query.h"
#include "tests/integration/service_fixture.h"
#include "tests/integration/training_common.h"

static char config_path[128];
static const char *extra_json = "";     /* more config keys: ", \"key\": value" */

/* ---- the service -------------------------------------------------------------------------- */

static void write_config(const char *sharding, uint32_t trainers)
{
	FILE *f = fopen(config_path, "w");

	cr_assert_not_null(f, "cannot write %s: %s", config_path, strerror(errno));
	fprintf(f, "{ ");
	write_tables(f, sharding);
	fprintf(f, ", \"topology\": {");
	write_topology_device(f);
	fprintf(f, ", \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", "
		"\"batch_size\": %d},\n \"trainers_per_node\": %u, \"seed\": %u, "
		"\"threads_per_rank\": 1, \"busy_poll_us\": 20%s }\n", BATCH, trainers, SEED,
		extra_json);
	fclose(f);
}

static void start(const char *sharding, uint32_t trainers)
{
	snprintf(config_path, sizeof(config_path), "/tmp/embd-train-%d.json", (int)getpid());
	write_config(sharding, trainers);
	service_spawn(config_path, "error");
}

/* Criterion fini: runs after a failed assertion too, so no embd outlives its test. */
static void stop(void)
{
	int status;

	tu_kill_children();
	service_stop_within(3000, &status);
	unlink(config_path);
	unlink(service.log);
}

TestSuite(training, .fini = stop, .timeout = 60);

static void train_and_check(const char *sharding, uint32_t trainers)
{
	start(sharding, trainers);
	struct shared *sh = shared_map();
	const char *sockets[] = { service.socket };
	run_trainers(sh, trainers, sockets, trainers);
	check_against_reference(sh, trainers, sharding ? sharding : "any sharding");
	cr_expect_eq(kill(service.pid, 0), 0, "embd (pid %d) should still run after training",
		     (int)service.pid);
	munmap(sh, sizeof(*sh));
}

/*
 * Row-split partial sums go from rank to rank device to device (engine/step.c, reduce_rank:
 * GPU peer access; on the CPU, and in the device_copy run whose partials are unreadable to
 * host code, the backend's copies), never summed in host memory: stats count the bytes of
 * each path. A table_wise run has no partial sums at all. The device_copy run also finds
 * every host array its kernels read or write registered for DMA.
 */
static void partials_case(const char *sharding, bool split)
{
	train_and_check(sharding, 2);
	cJSON *stats = ctl_ask_json(service.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats, "no STATS reply");
	const double device = ctl_json_num(stats, "partial_device_bytes");
	const double host = ctl_json_num(stats, "partial_host_bytes");
	const cJSON *ranks = cJSON_GetObjectItemCaseSensitive(stats, "ranks");
	const int num_ranks = cJSON_GetArraySize(ranks);
	cJSON_Delete(stats);
	/* On GPUs (tests/gpu/run.sh) the ranks are the machine's GPUs: one GPU splits no row,
	 * and a pair without peer access sums on the host, so only the total is certain. */
	if (test_on_gpus()) {
		if (split && num_ranks >= 2)
			cr_expect_gt(device + host, 0, "%s on %d GPUs: no partial sum was counted",
				     sharding, num_ranks);
		else
			cr_expect_eq(device + host, 0, "%s on %d GPUs: %g + %g bytes of partial "
				     "sums without a row split", sharding, num_ranks, device, host);
		return;
	}
	cr_expect_eq(num_ranks, 2, "%s: the test's CPU topology has 2 ranks", sharding);
	cr_expect_eq(host, 0, "%s: %g bytes of partial sums went through host memory", sharding,
		     host);
	/* under device_copy every array a kernel call copies must be registered for DMA (the
	 * double logs the first one that is not): ids, partials, the server's gradients */
	static char log[1 << 16];
	FILE *f = fopen(service.log, "r");
	cr_assert_not_null(f, "cannot read %s", service.log);
	log[fread(log, 1, sizeof(log) - 1, f)] = 0;
	fclose(f);
	cr_expect_null(strstr(log, "not registered for DMA"), "%s: %s", sharding, log);
	if (split)
		cr_expect_gt(device, 0, "%s: no partial sum went from rank to rank", sharding);
	else
		cr_expect_eq(device, 0, "%s: %g bytes of partial sums without a row split",
			     sharding, device);
}

/*
 * A column-split table's shards on the node step from one check and sort of its ids per
 * backward (engine/step.c): stats count the tables so prepared and their shards, at least two
 * each. Not where a shard's backward maps its ids to cache slots (fused_uvm_caching), nor on
 * GPUs (each shard sorts on its device): none there. Table_wise shares nothing.
 */
static void shared_prepare_case(const char *sharding, bool shared)
{
	train_and_check(sharding, 2);
	cJSON *stats = ctl_ask_json(service.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats, "no STATS reply");
	const double prepares = ctl_json_num(stats, "backward_prepares");
	const double shards = ctl_json_num(stats, "backward_shared_shards");
	cJSON_Delete(stats);
	const char *kernel = getenv("EMBD_TEST_CPU_KERNEL");
	if (test_on_gpus() || (kernel && !strcmp(kernel, "fused_uvm_caching")))
		shared = false;
	if (shared) {
		cr_expect_gt(prepares, 0, "%s: no table prepared its ids once for its shards",
			     sharding);
		cr_expect_geq(shards, 2 * prepares, "%s: %g shards for %g shared prepares",
			      sharding, shards, prepares);
	} else {
		cr_expect_eq(prepares + shards, 0, "%s: %g prepares shared by %g shards", sharding,
			     prepares, shards);
	}
}

Test(training, column_wise_shards_share_their_prepare) { shared_prepare_case("column_wise", true); }
Test(training, table_column_wise_shards_share_their_prepare)
{
	shared_prepare_case("table_column_wise", true);
}
Test(training, table_wise_shares_no_prepare) { shared_prepare_case("table_wise", false); }

/* The stats split each step's latency into forward, trainers and backward: every part was
 * measured (the trainers compute between lookup and gradient), none longer than the slowest
 * step. */
Test(training, stats_split_the_step_into_phases)
{
	train_and_check("table_wise", 2);
	cJSON *stats = ctl_ask_json(service.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats, "no STATS reply");
	const cJSON *phases = cJSON_GetObjectItem(stats, "step_phases_p50_us");
	cr_assert(cJSON_IsObject(phases), "no step_phases_p50_us");
	const double p99 = ctl_json_num(stats, "step_p99_us");
	static const char *const names[3] = { "forward", "trainers", "backward" };
	for (int k = 0; k < 3; k++) {
		const double us = ctl_json_num(phases, names[k]);
		cr_expect(us > 0 && us <= p99, "%s: p50 %g us, the slowest step %g us", names[k], us,
			  p99);
	}
	cJSON_Delete(stats);
}

Test(training, row_wise_partials_go_rank_to_rank) { partials_case("row_wise", true); }
Test(training, table_row_wise_partials_go_rank_to_rank) { partials_case("table_row_wise", true); }
Test(training, table_wise_has_no_partials) { partials_case("table_wise", false); }

Test(training, table_wise_equals_reference) { train_and_check("table_wise", 2); }
Test(training, row_wise_equals_reference) { train_and_check("row_wise", 2); }
Test(training, column_wise_equals_reference) { train_and_check("column_wise", 2); }
Test(training, table_row_wise_equals_reference) { train_and_check("table_row_wise", 2); }
Test(training, table_column_wise_equals_reference) { train_and_check("table_column_wise", 2); }
Test(training, data_parallel_equals_reference) { train_and_check("data_parallel", 2); }
Test(training, four_concurrent_trainers_equal_reference) { train_and_check(NULL, 4); }

/* Batches of 8, 5 and 2 samples (the last batch of an epoch): each output has its batch's
 * rows and the steps train as the reference on the shorter global batch. */
static void train_short(const char *sharding, uint32_t trainers)
{
	short_batches = true;
	train_and_check(sharding, trainers);
}

Test(training, short_batches_row_wise_equal_reference) { train_short("row_wise", 2); }

/* "gradient_scaling": "sum": the trainers' gradients summed as they are, so the same learning
 * rate moves rows 3 times as far with 3 trainers (and the default's reference fails). */
Test(training, summed_gradients_equal_the_summing_reference)
{
	extra_json = ", \"gradient_scaling\": \"sum\"";
	sum_gradients = true;
	train_and_check("table_wise", 3);
}
Test(training, short_batches_column_wise_equal_reference) { train_short("column_wise", 3); }
Test(training, short_batches_data_parallel_equal_reference) { train_short("data_parallel", 2); }

/*
 * Pipelined steps: trainers that post FORWARD k + 1 before BACKWARD k get every step after the
 * first routed while the one before waited (stats pipelined_steps), and outputs bit-identical
 * to the same training unpipelined; so do trainers of which one posts it right after its
 * BACKWARD (mode PIPE_MIXED: every step prepared as well, training_common.h).
 */
static void pipelined_case(const char *sharding, int mode)
{
	static struct shared plain;
	const char *sockets[1];
	struct shared *sh = shared_map();

	start(sharding, 2);
	sockets[0] = service.socket;
	run_trainers(sh, 2, sockets, 2);
	memcpy(&plain, sh, sizeof(plain));
	stop();
	start(sharding, 2);
	pipelined_trainers = mode;
	run_trainers(sh, 2, sockets, 2);
	pipelined_trainers = PIPE_OFF;
	check_against_reference(sh, 2, sharding);
	cr_expect(!memcmp(plain.pooled, sh->pooled, sizeof(plain.pooled)),
		  "%s: pipelined outputs differ from the unpipelined run's", sharding);
	cJSON *stats = ctl_ask_json(service.socket, EMBD_CTL_STATS_REQUEST);
	cr_assert_not_null(stats, "no STATS reply");
	double pipelined = ctl_json_num(stats, "pipelined_steps");
	cr_expect_eq(pipelined, K_STEPS - 1, "%s: expected %d pipelined steps, got %g", sharding,
		     K_STEPS - 1, pipelined);
	cr_expect_eq(ctl_json_num(stats, "steps"), K_STEPS);
	cJSON_Delete(stats);
	munmap(sh, sizeof(*sh));
}

Test(training, pipelined_steps_equal_unpipelined_table_wise)
{
	pipelined_case("table_wise", PIPE_BEFORE);
}
Test(training, pipelined_steps_equal_unpipelined_row_wise) { pipelined_case("row_wise", PIPE_BEFORE); }
Test(training, pipelined_steps_mixed_order_equal_unpipelined)
{
	pipelined_case("column_wise", PIPE_MIXED);
}

/* ---- a trainer killed mid-step ----------------------------------------------------------- */

/* Blocking forward + backward of trainer tr's deterministic step-k batch. */
static int one_step(struct embd_client *c, uint32_t tr, uint32_t k, uint64_t step)
{
	struct embd_batch b;
	const uint32_t D = embd_layout(c)->total_dim;

	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch(k, tr, b.lengths, b.values);
	int rc = embd_forward(c, 0, step, n, 0);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < BATCH * D; i++)
		b.grad[i] = gen_grad(k, tr, i / D, i % D);
	return embd_backward(c, 0, step, n, 0);
}

/*
 * Forks trainer 1: it connects, runs the FORWARD of step s (its step-0 batch), writes 'y' ('n':
 * the forward failed) to the pipe whose read end is *ready_fd and waits to be killed there,
 * before its BACKWARD.
 */
static pid_t fork_trainer_1_stopping_after_forward(uint64_t s, int *ready_fd)
{
	char err[256];
	int pipefd[2];

	cr_assert_eq(pipe(pipefd), 0);
	pid_t kid = tu_fork_child();
	if (kid == 0) {
		struct embd_client *c;
		struct embd_batch b;
		char ok = 'y';
		close(pipefd[0]);
		if (embd_connect(service.socket, 1, 5000, &c, err, sizeof(err)))
			_exit(2);
		embd_batch_get(c, 0, &b);
		uint64_t n = gen_batch(0, 1, b.lengths, b.values);
		if (embd_forward(c, 0, s, n, 0))
			ok = 'n';
		if (write(pipefd[1], &ok, 1) != 1)
			_exit(3);
		pause();  /* killed here: after FORWARD, before BACKWARD */
		_exit(4);
	}
	close(pipefd[1]);
	*ready_fd = pipefd[0];
	return kid;
}

Test(training, killed_trainer_cancels_step_and_service_recovers)
{
	struct embd_client *t0, *t1;
	struct embd_completion done;
	char err[256];

	start(NULL, 2);
	int fds_idle = tu_embd_count_fds(&service);
	cr_assert_gt(fds_idle, 0, "cannot read /proc/%d/fd", (int)service.pid);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	int fds_one = tu_embd_count_fds(&service);
	uint64_t s = embd_layout(t0)->resumed_step;
	int ready;
	pid_t kid = fork_trainer_1_stopping_after_forward(s, &ready);
	/* trainer 0 runs the forward of step s with trainer 1 */
	struct embd_batch b;
	embd_batch_get(t0, 0, &b);
	uint64_t n = gen_batch(0, 0, b.lengths, b.values);
	int rc = embd_forward(t0, 0, s, n, 0);
	cr_assert_eq(rc, 0, "trainer 0 forward of step %llu: expected 0, got %d (%s)",
		     (unsigned long long)s, rc, embd_last_error(t0));
	struct pollfd pfd = { .fd = ready, .events = POLLIN };
	char ok = 0;
	cr_assert_eq(poll(&pfd, 1, 5000), 1, "trainer 1 did not finish its forward within 5 s");
	cr_assert_eq(read(ready, &ok, 1), 1);
	close(ready);
	cr_assert_eq(ok, 'y', "trainer 1's forward of step %llu failed", (unsigned long long)s);
	memset(b.grad, 0, (size_t)BATCH * embd_layout(t0)->total_dim * sizeof(float));
	struct embd_request req = { .op = EMBD_REQUEST_BACKWARD, .slot = 0, .step = s,
				    .num_values = n, .user_data = 77 };
	cr_assert_eq(embd_submit(t0, &req), 0, "%s", embd_last_error(t0));
	int st;
	kill(kid, SIGKILL);
	waitpid(kid, &st, 0);
	cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
		  "trainer 1: expected death by SIGKILL, got status 0x%x", st);
	rc = embd_wait(t0, &done, 5000);
	cr_assert_eq(rc, 0, "trainer 0 waiting for its backward: expected a completion within "
		     "5 s, got %d (%s)", rc, embd_last_error(t0));
	cr_expect_eq(done.user_data, 77, "expected the backward's completion, got user_data %llu",
		     (unsigned long long)done.user_data);
	cr_expect_eq(done.result, EMBD_ECANCELED, "backward of step %llu after trainer 1 died: "
		     "expected EMBD_ECANCELED (%d), got %d (%s)", (unsigned long long)s,
		     EMBD_ECANCELED, done.result, embd_last_error(t0));
	cr_expect_eq(kill(service.pid, 0), 0, "embd should survive a killed trainer");
	int fds = tu_embd_wait_fds(&service, fds_one, FDS_SETTLE_MS);
	cr_expect_eq(fds, fds_one, "embd's open fds after the dead trainer was dropped: expected "
		     "%d (one trainer connected), got %d", fds_one, fds);
	/* the service still answers, and trainer 1 comes back under the same index */
	req = (struct embd_request){ .op = EMBD_REQUEST_NOP, .user_data = 5 };
	cr_assert_eq(embd_submit(t0, &req), 0, "%s", embd_last_error(t0));
	rc = embd_wait(t0, &done, 5000);
	cr_expect(rc == 0 && done.result == 0 && done.user_data == 5,
		  "NOP after the kill: expected result 0 for user_data 5, got rc %d result %d "
		  "user_data %llu", rc, done.result, (unsigned long long)done.user_data);
	rc = embd_connect(service.socket, 1, 5000, &t1, err, sizeof(err));
	cr_assert_eq(rc, 0, "reconnect as trainer 1: expected 0, got %d (%s)", rc, err);
	uint64_t next = embd_layout(t1)->resumed_step;
	cr_expect_eq(next, s + 1, "reconnected trainer 1: expected to resume at step %llu, got "
		     "%llu", (unsigned long long)(s + 1), (unsigned long long)next);
	pid_t kid1 = tu_fork_child();
	if (kid1 == 0)
		_exit(one_step(t1, 1, 1, next) ? 1 : 0);
	rc = one_step(t0, 0, 1, next);
	cr_expect_eq(rc, 0, "trainer 0's step %llu after the kill: expected 0, got %d (%s)",
		     (unsigned long long)next, rc, embd_last_error(t0));
	waitpid(kid1, &st, 0);
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
		  "reconnected trainer 1's step %llu: expected success, got status 0x%x",
		  (unsigned long long)next, st);
	embd_close(t1);
	embd_close(t0);
	fds = tu_embd_wait_fds(&service, fds_idle, FDS_SETTLE_MS);
	cr_expect_eq(fds, fds_idle, "embd's open fds with no trainer: expected %d as before the "
		     "test, got %d", fds_idle, fds);
}

/*
 * A trainer posts FORWARD s + 1 (pipelined) before BACKWARD s, and step s is aborted (trainer
 * 1 killed after its FORWARD s) before that BACKWARD: the kept FORWARD runs as step s + 1 with
 * the trainers left, and the late BACKWARD s is still answered EMBD_ECANCELED, as without
 * pipelining, not refused as a step this trainer takes no part in.
 */
Test(training, backward_of_a_step_aborted_while_the_next_was_posted_is_canceled)
{
	struct embd_client *t0;
	struct embd_completion done;
	struct embd_batch b0, b1;
	char err[256];

	start(NULL, 2);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	uint64_t s = embd_layout(t0)->resumed_step;
	int ready;
	pid_t kid = fork_trainer_1_stopping_after_forward(s, &ready);
	embd_batch_get(t0, 0, &b0);
	embd_batch_get(t0, 1, &b1);
	uint64_t n0 = gen_batch(0, 0, b0.lengths, b0.values);
	int rc = embd_forward(t0, 0, s, n0, 0);
	cr_assert_eq(rc, 0, "trainer 0 forward of step %llu: got %d (%s)", (unsigned long long)s,
		     rc, embd_last_error(t0));
	char ok = 0;
	cr_assert_eq(read(ready, &ok, 1), 1);
	close(ready);
	cr_assert_eq(ok, 'y', "trainer 1's forward of step %llu failed", (unsigned long long)s);
	uint64_t n1 = gen_batch(1, 0, b1.lengths, b1.values);
	struct embd_request fwd = { .op = EMBD_REQUEST_FORWARD, .slot = 1, .step = s + 1,
				    .num_values = n1, .user_data = 1 };
	cr_assert_eq(embd_submit(t0, &fwd), 0, "%s", embd_last_error(t0));
	int st;
	kill(kid, SIGKILL);
	waitpid(kid, &st, 0);
	rc = embd_wait(t0, &done, 5000);
	cr_assert(rc == 0 && done.user_data == 1 && done.result == 0,
		  "FORWARD %llu after step %llu was aborted: expected it to run (result 0), got rc "
		  "%d user_data %llu result %d (%s)", (unsigned long long)(s + 1),
		  (unsigned long long)s, rc, (unsigned long long)done.user_data, done.result,
		  embd_last_error(t0));
	memset(b0.grad, 0, (size_t)BATCH * embd_layout(t0)->total_dim * sizeof(float));
	struct embd_request bwd = { .op = EMBD_REQUEST_BACKWARD, .slot = 0, .step = s,
				    .num_values = n0, .user_data = 2 };
	cr_assert_eq(embd_submit(t0, &bwd), 0, "%s", embd_last_error(t0));
	rc = embd_wait(t0, &done, 5000);
	cr_expect(rc == 0 && done.user_data == 2 && done.result == EMBD_ECANCELED,
		  "late BACKWARD of aborted step %llu: expected EMBD_ECANCELED (%d), got rc %d "
		  "result %d (%s)", (unsigned long long)s, EMBD_ECANCELED, rc, done.result,
		  embd_last_error(t0));
	memset(b1.grad, 0, (size_t)BATCH * embd_layout(t0)->total_dim * sizeof(float));
	bwd = (struct embd_request){ .op = EMBD_REQUEST_BACKWARD, .slot = 1, .step = s + 1,
				     .num_values = n1, .user_data = 3 };
	cr_assert_eq(embd_submit(t0, &bwd), 0, "%s", embd_last_error(t0));
	rc = embd_wait(t0, &done, 5000);
	cr_expect(rc == 0 && done.user_data == 3 && done.result == 0,
		  "BACKWARD of step %llu: expected 0, got rc %d result %d (%s)",
		  (unsigned long long)(s + 1), rc, done.result, embd_last_error(t0));
	embd_close(t0);
}

/* ---- malformed batches ------------------------------------------------------------------- */

/* Every bag one id (id 1); returns the id count. */
static uint64_t fill_ones(struct embd_client *c)
{
	struct embd_batch b;
	uint64_t n = (uint64_t)NUM_F * BATCH;

	embd_batch_get(c, 0, &b);
	for (uint64_t i = 0; i < n; i++) {
		b.lengths[i] = 1;
		b.values[i] = 1;
	}
	memset(b.grad, 0, (size_t)BATCH * embd_layout(c)->total_dim * sizeof(float));
	return n;
}

/* The good trainer's forward + backward of step s with bounded waits; 0 or why not. */
static int good_step(struct embd_client *good, uint64_t s, char *why, size_t why_len)
{
	struct embd_completion done;
	uint64_t n = fill_ones(good);

	for (int op = EMBD_REQUEST_FORWARD; op <= EMBD_REQUEST_BACKWARD; op++) {
		struct embd_request req = { .op = (enum embd_request_op)op, .step = s,
					    .num_values = n };
		int rc = embd_submit(good, &req);
		if (!rc)
			rc = embd_wait(good, &done, 3000);
		if (!rc)
			rc = done.result;
		if (rc) {
			snprintf(why, why_len, "%s of step %llu: %d (%s)",
				 op == EMBD_REQUEST_FORWARD ? "forward" : "backward",
				 (unsigned long long)s, rc, embd_last_error(good));
			return rc;
		}
	}
	return 0;
}

/* Waits for the bad trainer's completion and checks it is an error naming both words. */
static void expect_refused(struct embd_client *bad, const char *what, const char *word1,
			   const char *word2)
{
	struct embd_completion done;
	int rc = embd_wait(bad, &done, 3000);

	cr_assert_eq(rc, 0, "%s: expected an error completion within 3 s, got %d (%s)", what, rc,
		     embd_last_error(bad));
	cr_expect_lt(done.result, 0, "%s: expected an error, got %d", what, done.result);
	const char *msg = embd_last_error(bad);
	cr_expect(strstr(msg, word1) && (!word2 || strstr(msg, word2)),
		  "%s: expected an error naming '%s'%s%s, got '%s'", what, word1,
		  word2 ? " and " : "", word2 ? word2 : "", msg);
}

/* An out-of-range id: refused by the step's forward while the good trainer's step runs. */
static void bad_id_case(struct embd_client *good, struct embd_client *bad, uint64_t s, int64_t id,
			const char *what, const char *word)
{
	struct embd_batch b;
	char why[320];
	uint64_t n = fill_ones(bad);

	embd_batch_get(bad, 0, &b);
	b.values[3] = id;  /* feature f_a, bag 3 */
	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .step = s, .num_values = n };
	cr_assert_eq(embd_submit(bad, &req), 0, "%s", embd_last_error(bad));
	int rc = good_step(good, s, why, sizeof(why));
	cr_expect_eq(rc, 0, "%s: the good trainer's step: expected 0, got %s", what, why);
	expect_refused(bad, what, word, "f_a");
}

/* A descriptor refused by validation; then the good trainer's step must still run. */
static void bad_sqe_case(struct embd_client *good, struct embd_client *bad, uint64_t s,
			 const struct embd_sqe *sqe, const char *what, const char *word)
{
	char why[320];

	cr_assert_eq(embd_client_push_sqe(bad, sqe), 0);
	expect_refused(bad, what, word, NULL);
	int rc = good_step(good, s, why, sizeof(why));
	cr_expect_eq(rc, 0, "after %s: the good trainer's step: expected 0, got %s", what, why);
}

Test(training, malformed_batches_are_named_and_others_run)
{
	struct embd_client *good, *bad;
	struct embd_sqe sqe;
	char err[256];

	start(NULL, 2);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &good, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_connect(service.socket, 1, 5000, &bad, err, sizeof(err)), 0, "%s", err);
	uint64_t s = embd_layout(good)->resumed_step;
	bad_id_case(good, bad, s++, -1, "a negative id", "-1");
	bad_id_case(good, bad, s++, tables[0].rows, "an id == num_embeddings", "id 64");

	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .step = s,
				    .num_values = fill_ones(bad) };
	cr_assert_eq(embd_client_sqe_build(bad, &req, &sqe), 0);
	sqe.batch_size = BATCH + 1;
	bad_sqe_case(good, bad, s++, &sqe, "a wrong batch size", "batch_size");

	/* a backward whose gradient has other rows than its forward's output (every bag of
	 * fill_ones holds one id, so BATCH - 1 samples hold NUM_F fewer) */
	req = (struct embd_request){ .op = EMBD_REQUEST_FORWARD, .step = s, .batch_size = BATCH - 1,
				     .num_values = fill_ones(bad) - NUM_F };
	cr_assert_eq(embd_submit(bad, &req), 0, "%s", embd_last_error(bad));
	struct embd_request fwd = { .op = EMBD_REQUEST_FORWARD, .step = s,
				    .num_values = fill_ones(good) };
	cr_assert_eq(embd_submit(good, &fwd), 0, "%s", embd_last_error(good));
	struct embd_completion done;
	cr_assert_eq(embd_wait(bad, &done, 3000), 0, "%s", embd_last_error(bad));
	cr_assert_eq(done.result, 0, "short forward: %s", embd_last_error(bad));
	cr_assert_eq(embd_wait(good, &done, 3000), 0, "%s", embd_last_error(good));
	req.op = EMBD_REQUEST_BACKWARD;
	req.batch_size = BATCH;
	req.num_values += NUM_F;
	cr_assert_eq(embd_submit(bad, &req), 0, "%s", embd_last_error(bad));
	expect_refused(bad, "a backward of another batch size", "batch_size: 8 samples",
		       "forward had 7");
	req.batch_size = BATCH - 1;
	req.num_values -= NUM_F;
	fwd.op = EMBD_REQUEST_BACKWARD;
	cr_assert_eq(embd_submit(bad, &req), 0, "%s", embd_last_error(bad));
	cr_assert_eq(embd_submit(good, &fwd), 0, "%s", embd_last_error(good));
	cr_assert_eq(embd_wait(bad, &done, 3000), 0, "%s", embd_last_error(bad));
	cr_expect_eq(done.result, 0, "short backward: %s", embd_last_error(bad));
	cr_assert_eq(embd_wait(good, &done, 3000), 0, "%s", embd_last_error(good));
	cr_expect_eq(done.result, 0, "good backward: %s", embd_last_error(good));
	s++;

	req = (struct embd_request){ .op = EMBD_REQUEST_FORWARD, .step = s,
				     .num_values = fill_ones(bad) };
	cr_assert_eq(embd_client_sqe_build(bad, &req, &sqe), 0);
	sqe.step = s;
	srand(4242);
	do
		sqe.opcode = (uint16_t)(rand() & 0xffff);
	while (sqe.opcode <= 3);  /* NOP, FORWARD, BACKWARD, EVAL are the valid ones */
	bad_sqe_case(good, bad, s++, &sqe, "a garbage opcode", "opcode");

	cr_expect_eq(kill(service.pid, 0), 0, "embd should survive malformed batches");
	embd_close(good);
	embd_close(bad);
}
