/*
 * Integration: real embd processes and real trainer processes training together. For every
 * sharding type (forced by a table constraint), trainers forked from the test run K steps of
 * forward + backward and every pooled output equals the unsharded reference (tests/reference)
 * trained on the concatenated global batch from embd_init_value weights; 4 trainers at once;
 * a trainer killed with SIGKILL mid-step (the others get EMBD_ECANCELED, the service survives
 * without leaking fds and the next step runs); malformed batches refused with the field named.
 * Tolerance: REL_TOL relative + ABS_TOL absolute (the service sums row-wise partial sums and
 * the trainers' gradients in another order than the reference).
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
#include "libclient/client_priv.h"
#include "tests/integration/service_fixture.h"
#include "tests/reference/reference.h"

#define K_STEPS 3
#define BATCH 8
#define SEED 2026u
#define MAX_T 4
#define MAX_COLS 32
#define MAX_F 4
#define REL_TOL 1e-5f
#define ABS_TOL 1e-6f

/* The tables of every config: table id = index (the service's convention, service/step.c). */
struct test_table {
	const char *name;
	int64_t rows;
	uint32_t dim;
	enum embd_pooling pooling;
	const char *pooling_name;
	uint32_t num_features;
	const char *features[2];
	struct embd_optimizer_spec opt;
	const char *opt_json;
};

static const struct test_table tables[] = {
	{ "t_sum", 64, 8, EMBD_POOLING_SUM, "sum", 2, { "f_a", "f_b" },
	  { .type = EMBD_OPT_SGD, .lr = 0.1f }, "{\"type\": \"sgd\", \"lr\": 0.1}" },
	{ "t_mean", 40, 8, EMBD_POOLING_MEAN, "mean", 1, { "f_c", NULL },
	  { .type = EMBD_OPT_ADAGRAD, .lr = 0.05f, .eps = 1e-8f },
	  "{\"type\": \"adagrad\", \"lr\": 0.05, \"eps\": 1e-8}" },
};
#define NUM_TABLES 2
#define NUM_F 3

static char config_path[128];
static pid_t children[8];               /* trainer processes, killed by stop() if still alive */
static unsigned num_children;

static pid_t fork_child(void)
{
	pid_t pid = fork();

	cr_assert(pid >= 0, "fork: %s", strerror(errno));
	if (pid > 0 && num_children < sizeof(children) / sizeof(children[0]))
		children[num_children++] = pid;
	return pid;
}

/* ---- the service -------------------------------------------------------------------------- */

static void write_config(const char *sharding, uint32_t trainers)
{
	FILE *f = fopen(config_path, "w");

	cr_assert_not_null(f, "cannot write %s: %s", config_path, strerror(errno));
	fprintf(f, "{ \"tables\": [\n");
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		const struct test_table *tt = &tables[t];
		fprintf(f, "  {\"name\": \"%s\", \"num_embeddings\": %lld, \"embedding_dim\": %u, "
			"\"pooling\": \"%s\", \"data_type\": \"fp32\", \"feature_names\": [",
			tt->name, (long long)tt->rows, tt->dim, tt->pooling_name);
		for (uint32_t k = 0; k < tt->num_features; k++)
			fprintf(f, "%s\"%s\"", k ? ", " : "", tt->features[k]);
		fprintf(f, "], \"optimizer\": %s", tt->opt_json);
		if (sharding)
			fprintf(f, ", \"constraints\": {\"sharding_types\": [\"%s\"], "
				"\"min_partition\": 4}", sharding);
		fprintf(f, "}%s\n", t + 1 < NUM_TABLES ? "," : "");
	}
	fprintf(f, "], \"topology\": {\"world_size\": 2, \"local_world_size\": 2, "
		"\"compute_device\": \"cpu\", \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", "
		"\"batch_size\": %d},\n \"trainers_per_node\": %u, \"seed\": %u, "
		"\"threads_per_rank\": 1, \"busy_poll_us\": 20 }\n", BATCH, trainers, SEED);
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

	for (unsigned i = 0; i < num_children; i++)
		if (waitpid(children[i], &status, WNOHANG) == 0) {
			kill(children[i], SIGKILL);
			waitpid(children[i], &status, 0);
		}
	num_children = 0;
	service_stop_within(3000, &status);
	unlink(config_path);
	unlink(service_log_path);
}

TestSuite(training, .fini = stop, .timeout = 60);

/* ---- deterministic batches and gradients ------------------------------------------------- */

static uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static uint32_t feature_table(uint32_t f)
{
	return f < 2 ? 0 : 1;
}

/* Trainer `tr`'s batch of step k: lengths 0..3, ids in range. Returns the id count. */
static uint64_t gen_batch(uint32_t k, uint32_t tr, int32_t *lengths, int64_t *values)
{
	uint64_t n = 0;

	for (uint32_t f = 0; f < NUM_F; f++)
		for (uint32_t b = 0; b < BATCH; b++) {
			uint64_t h = mix(((uint64_t)k << 40) ^ ((uint64_t)tr << 32) ^ (f << 16) ^ b);
			int32_t len = (int32_t)(h % 4);
			lengths[f * BATCH + b] = len;
			for (int32_t j = 0; j < len; j++)
				values[n++] = (int64_t)(mix(h + (uint64_t)j + 1) %
							(uint64_t)tables[feature_table(f)].rows);
		}
	return n;
}

/* dL/d(pooled) of trainer tr, step k, bag b, output column col: in [-1, 1]. */
static float gen_grad(uint32_t k, uint32_t tr, uint32_t b, uint32_t col)
{
	uint64_t h = mix(0x5151000000000000ull ^ ((uint64_t)k << 40) ^ ((uint64_t)tr << 32) ^
			 ((uint64_t)b << 16) ^ col);
	return (float)((int)(h % 2001) - 1000) / 1000.0f;
}

/* ---- trainer processes ------------------------------------------------------------------- */

/* What the trainer processes hand back, in a shared anonymous mapping. */
struct shared {
	uint32_t total_dim;
	uint32_t feature_offset[MAX_F];
	uint32_t feature_dim[MAX_F];
	int rc[MAX_T];
	char err[MAX_T][256];
	float pooled[K_STEPS][MAX_T][BATCH * MAX_COLS];
};

static struct shared *shared_map(void)
{
	void *p = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(p != MAP_FAILED, "mmap: %s", strerror(errno));
	memset(p, 0, sizeof(struct shared));
	return p;
}

/* The body of trainer tr: K steps on slot k % 2; 0 or a negative code (text in sh->err). */
static int trainer_run(struct shared *sh, uint32_t tr)
{
	struct embd_client *c;
	char *err = sh->err[tr];
	int rc = embd_connect(socket_path, (int)tr, 10000, &c, err, 256);

	if (rc)
		return rc;
	const struct embd_client_layout *l = embd_layout(c);
	if (l->num_features != NUM_F || l->batch_size != BATCH || l->total_dim > MAX_COLS) {
		snprintf(err, 256, "layout: %u features, B %u, %u columns; expected %u, %u, <= %u",
			 l->num_features, l->batch_size, l->total_dim, NUM_F, BATCH, MAX_COLS);
		embd_close(c);
		return EMBD_EPROTO;
	}
	if (tr == 0) {
		sh->total_dim = l->total_dim;
		for (uint32_t f = 0; f < NUM_F; f++) {
			sh->feature_offset[f] = l->features[f].offset;
			sh->feature_dim[f] = l->features[f].dim;
		}
	}
	for (uint32_t k = 0; k < K_STEPS && !rc; k++) {
		struct embd_batch b;
		uint64_t step = l->resumed_step + k;
		embd_batch_get(c, k % 2, &b);
		uint64_t n = gen_batch(k, tr, b.lengths, b.values);
		rc = embd_forward(c, k % 2, step, n, 0);
		if (rc) {
			snprintf(err, 256, "step %u forward: %s", k, embd_last_error(c));
			break;
		}
		memcpy(sh->pooled[k][tr], b.pooled, (size_t)BATCH * l->total_dim * sizeof(float));
		for (uint32_t i = 0; i < BATCH; i++)
			for (uint32_t col = 0; col < l->total_dim; col++)
				b.grad[i * l->total_dim + col] = gen_grad(k, tr, i, col);
		rc = embd_backward(c, k % 2, step, n, 0);
		if (rc)
			snprintf(err, 256, "step %u backward: %s", k, embd_last_error(c));
	}
	embd_close(c);
	return rc;
}

static void run_trainers(struct shared *sh, uint32_t trainers)
{
	pid_t kids[MAX_T];

	for (uint32_t i = 0; i < trainers; i++) {
		sh->rc[i] = 1;  /* "did not report" */
		kids[i] = fork_child();
		if (kids[i] == 0) {
			sh->rc[i] = trainer_run(sh, i);
			_exit(0);
		}
	}
	for (uint32_t i = 0; i < trainers; i++) {
		int st;
		waitpid(kids[i], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
			  "trainer %u: expected exit 0, got status 0x%x", i, st);
	}
	for (uint32_t i = 0; i < trainers; i++)
		cr_assert_eq(sh->rc[i], 0, "trainer %u: expected 0, got %d (%s)", i, sh->rc[i],
			     sh->err[i]);
}

/* ---- the reference ----------------------------------------------------------------------- */

static bool close_enough(float want, float got)
{
	return fabsf(want - got) <= ABS_TOL + REL_TOL * fabsf(want);
}

/* Replays the K steps of `trainers` trainers on the unsharded reference and compares. */
static void check_against_reference(const struct shared *sh, uint32_t trainers, const char *what)
{
	struct embd_ref_table *ref[NUM_TABLES];
	const uint32_t GB = BATCH * trainers;
	static int32_t lengths[MAX_T][NUM_F * BATCH];
	static int64_t values[MAX_T][NUM_F * BATCH * 4];
	static int32_t glen[NUM_F][MAX_T * BATCH];
	static int64_t gids[NUM_F][MAX_T * BATCH * 4];
	static float gout[MAX_T * BATCH * MAX_COLS];
	static float ggrad[NUM_F][MAX_T * BATCH * MAX_COLS];
	uint32_t mismatches = 0;

	for (uint32_t f = 0; f < NUM_F; f++)
		cr_assert_eq(sh->feature_dim[f], tables[feature_table(f)].dim,
			     "feature %u: expected dim %u, got %u", f, tables[feature_table(f)].dim,
			     sh->feature_dim[f]);
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		ref[t] = embd_ref_table_create(t, tables[t].rows, tables[t].dim, EMBD_DTYPE_FP32,
					       &tables[t].opt, SEED);
		cr_assert_not_null(ref[t]);
	}
	for (uint32_t k = 0; k < K_STEPS; k++) {
		/* the global batch: trainer 0's bags, then trainer 1's, ... per feature */
		uint64_t pos[MAX_T] = { 0 };
		uint64_t gn[NUM_F] = { 0 };
		for (uint32_t tr = 0; tr < trainers; tr++)
			gen_batch(k, tr, lengths[tr], values[tr]);
		for (uint32_t f = 0; f < NUM_F; f++)
			for (uint32_t tr = 0; tr < trainers; tr++)
				for (uint32_t b = 0; b < BATCH; b++) {
					int32_t len = lengths[tr][f * BATCH + b];
					glen[f][tr * BATCH + b] = len;
					for (int32_t j = 0; j < len; j++)
						gids[f][gn[f]++] = values[tr][pos[tr]++];
				}
		for (uint32_t f = 0; f < NUM_F; f++) {
			uint32_t t = feature_table(f), D = tables[t].dim, off = sh->feature_offset[f];
			struct embd_ref_bags bags = { .batch_size = GB, .lengths = glen[f],
						      .ids = gids[f], .pooling = tables[t].pooling };
			embd_ref_forward(ref[t], &bags, gout);
			for (uint32_t g = 0; g < GB; g++)
				for (uint32_t c = 0; c < D; c++) {
					float want = gout[g * D + c];
					float got = sh->pooled[k][g / BATCH][(g % BATCH) * sh->total_dim +
									   off + c];
					if (!close_enough(want, got) && mismatches++ < 5)
						cr_expect(false, "%s step %u feature %u trainer %u bag %u "
							  "col %u: expected %.9g, got %.9g", what, k, f,
							  g / BATCH, g % BATCH, c, want, got);
					ggrad[f][g * D + c] = gen_grad(k, g / BATCH, g % BATCH, off + c);
				}
		}
		for (uint32_t t = 0; t < NUM_TABLES; t++) {
			struct embd_ref_bags bags[2];
			uint32_t n = 0;
			for (uint32_t f = 0; f < NUM_F; f++)
				if (feature_table(f) == t)
					bags[n++] = (struct embd_ref_bags){
						.batch_size = GB, .lengths = glen[f], .ids = gids[f],
						.pooling = tables[t].pooling, .grad = ggrad[f] };
			cr_assert_eq(embd_ref_backward(ref[t], bags, n), 0);
		}
	}
	for (uint32_t t = 0; t < NUM_TABLES; t++)
		embd_ref_table_destroy(ref[t]);
	cr_expect_eq(mismatches, 0, "%s: expected every pooled output within %g rel + %g abs of "
		     "the reference, got %u mismatches", what, (double)REL_TOL, (double)ABS_TOL,
		     mismatches);
}

static void train_and_check(const char *sharding, uint32_t trainers)
{
	start(sharding, trainers);
	struct shared *sh = shared_map();
	run_trainers(sh, trainers);
	check_against_reference(sh, trainers, sharding ? sharding : "any sharding");
	cr_expect_eq(kill(service_pid, 0), 0, "embd (pid %d) should still run after training",
		     (int)service_pid);
	munmap(sh, sizeof(*sh));
}

Test(training, table_wise_equals_reference) { train_and_check("table_wise", 2); }
Test(training, row_wise_equals_reference) { train_and_check("row_wise", 2); }
Test(training, column_wise_equals_reference) { train_and_check("column_wise", 2); }
Test(training, table_row_wise_equals_reference) { train_and_check("table_row_wise", 2); }
Test(training, table_column_wise_equals_reference) { train_and_check("table_column_wise", 2); }
Test(training, data_parallel_equals_reference) { train_and_check("data_parallel", 2); }
Test(training, four_concurrent_trainers_equal_reference) { train_and_check(NULL, 4); }

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

Test(training, killed_trainer_cancels_step_and_service_recovers)
{
	struct embd_client *t0, *t1;
	struct embd_completion done;
	char err[256];
	int pipefd[2];

	start(NULL, 2);
	int fds_idle = service_count_fds(service_pid);
	cr_assert_gt(fds_idle, 0, "cannot read /proc/%d/fd", (int)service_pid);
	cr_assert_eq(embd_connect(socket_path, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	int fds_one = service_count_fds(service_pid);
	uint64_t s = embd_layout(t0)->resumed_step;
	cr_assert_eq(pipe(pipefd), 0);
	pid_t kid = fork_child();
	if (kid == 0) {
		struct embd_client *c;
		struct embd_batch b;
		char ok = 'y';
		close(pipefd[0]);
		if (embd_connect(socket_path, 1, 5000, &c, err, sizeof(err)))
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
	/* trainer 0 runs the forward of step s with trainer 1 */
	struct embd_batch b;
	embd_batch_get(t0, 0, &b);
	uint64_t n = gen_batch(0, 0, b.lengths, b.values);
	int rc = embd_forward(t0, 0, s, n, 0);
	cr_assert_eq(rc, 0, "trainer 0 forward of step %llu: expected 0, got %d (%s)",
		     (unsigned long long)s, rc, embd_last_error(t0));
	struct pollfd pfd = { .fd = pipefd[0], .events = POLLIN };
	char ok = 0;
	cr_assert_eq(poll(&pfd, 1, 5000), 1, "trainer 1 did not finish its forward within 5 s");
	cr_assert_eq(read(pipefd[0], &ok, 1), 1);
	close(pipefd[0]);
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
	cr_expect_eq(kill(service_pid, 0), 0, "embd should survive a killed trainer");
	int fds = service_wait_fds(fds_one);
	cr_expect_eq(fds, fds_one, "embd's open fds after the dead trainer was dropped: expected "
		     "%d (one trainer connected), got %d", fds_one, fds);
	/* the service still answers, and trainer 1 comes back under the same index */
	req = (struct embd_request){ .op = EMBD_REQUEST_NOP, .user_data = 5 };
	cr_assert_eq(embd_submit(t0, &req), 0, "%s", embd_last_error(t0));
	rc = embd_wait(t0, &done, 5000);
	cr_expect(rc == 0 && done.result == 0 && done.user_data == 5,
		  "NOP after the kill: expected result 0 for user_data 5, got rc %d result %d "
		  "user_data %llu", rc, done.result, (unsigned long long)done.user_data);
	rc = embd_connect(socket_path, 1, 5000, &t1, err, sizeof(err));
	cr_assert_eq(rc, 0, "reconnect as trainer 1: expected 0, got %d (%s)", rc, err);
	uint64_t next = embd_layout(t1)->resumed_step;
	cr_expect_eq(next, s + 1, "reconnected trainer 1: expected to resume at step %llu, got "
		     "%llu", (unsigned long long)(s + 1), (unsigned long long)next);
	pid_t kid1 = fork_child();
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
	fds = service_wait_fds(fds_idle);
	cr_expect_eq(fds, fds_idle, "embd's open fds with no trainer: expected %d as before the "
		     "test, got %d", fds_idle, fds);
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
	cr_assert_eq(embd_connect(socket_path, 0, 5000, &good, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_connect(socket_path, 1, 5000, &bad, err, sizeof(err)), 0, "%s", err);
	uint64_t s = embd_layout(good)->resumed_step;
	bad_id_case(good, bad, s++, -1, "a negative id", "-1");
	bad_id_case(good, bad, s++, tables[0].rows, "an id == num_embeddings", "id 64");

	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .step = s,
				    .num_values = fill_ones(bad) };
	cr_assert_eq(embd_client_sqe_build(bad, &req, &sqe), 0);
	sqe.batch_size = BATCH + 1;
	bad_sqe_case(good, bad, s++, &sqe, "a wrong batch size", "batch_size");

	cr_assert_eq(embd_client_sqe_build(bad, &req, &sqe), 0);
	sqe.step = s;
	srand(4242);
	do
		sqe.opcode = (uint16_t)(rand() & 0xffff);
	while (sqe.opcode <= 2);  /* NOP, FORWARD, BACKWARD are the valid ones */
	bad_sqe_case(good, bad, s++, &sqe, "a garbage opcode", "opcode");

	cr_expect_eq(kill(service_pid, 0), 0, "embd should survive malformed batches");
	embd_close(good);
	embd_close(bad);
}
