/*
 * Soak (opt-in: tests/soak/run.sh, docs/testing.md): the real embd with 4 trainer processes
 * for EMBD_SOAK_SECONDS (default 120). Trainers 0 and 1 train well; trainer 2 kills itself at
 * random points of a step (before or after it posts its FORWARD, after the FORWARD's
 * completion, after it posts its BACKWARD) and a new process reconnects as trainer 2; trainer
 * 3 posts good steps between bad batches (an id outside the table, lengths that do not add up
 * or are negative) and NaN or infinite gradients. At the end the tables embd holds must equal
 * the unsharded reference (tests/support/reference.c) trained on exactly the steps embd
 * applied, each with the batches of exactly its participants; embd holds the fds it held
 * before any trainer came, and its RSS grew by less than RSS_SLACK_KB since the run warmed up.
 *
 * Which steps were applied comes from the trainers themselves, through a log in shared
 * memory: a trainer notes that it posts the BACKWARD of step s before it posts it, and the
 * completion's result after. A step is applied when any trainer's BACKWARD of it succeeded;
 * its participants are then exactly the trainers that posted a BACKWARD of it (a participant
 * without one aborts the step: the crashed trainer after its FORWARD). Every batch and
 * gradient is a function of (step, trainer) (training_common.h), so the replay recomputes
 * them. The check must be able to fail: the replay is also run with the newest applied step
 * left out, and that one must differ from embd's tables.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "embd/client.h"
#include "tests/integration/service_fixture.h"
#include "tests/integration/training_common.h"

#define T 4                             /* trainers: 0, 1 good, 2 crashes, 3 hostile */
#define CRASHER 2
#define HOSTILE 3
#define MAX_STEPS (1u << 22)
#define WAIT_MS 30000                   /* one completion, even on a loaded machine */
#define SOAK_TOL_REL 1e-4f              /* thousands of steps summed in another order */
#define SOAK_TOL_ABS 1e-5f
#define RSS_SLACK_KB (16 * 1024)

enum { RES_NONE = 0, RES_OK = 1, RES_CANCELED = 2 };

/* The trainers' log, in a shared anonymous mapping. */
struct soak_log {
	uint8_t posted[MAX_STEPS][T];   /* a BACKWARD of step s was posted by trainer i */
	uint8_t result[MAX_STEPS][T];   /* ... and completed so (RES_*) */
	_Atomic uint64_t steps;         /* 1 + the highest step any trainer posted */
	_Atomic uint32_t crashes, bad_batches, refused, nonfinite, reconnects;
	_Atomic int failed;             /* a trainer met something it must not */
	char why[T][384];
};

static struct soak_log *lg;
static char config_path[128];
static uint64_t seed;
static pid_t kids[T];                   /* the trainer processes now (a crashed one replaced) */

static void soak_fini(void)
{
	for (uint32_t i = 0; i < T; i++)
		if (kids[i] > 0 && !kill(kids[i], SIGKILL))
			waitpid(kids[i], NULL, 0);
	service_stop_within(5000, NULL);
	unlink(config_path);
}

TestSuite(soak, .fini = soak_fini);

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void fail(uint32_t tr, const char *fmt, const char *what, int rc, const char *err)
{
	snprintf(lg->why[tr], sizeof(lg->why[tr]), fmt, what, rc, err);
	atomic_store(&lg->failed, 1);
}

/* The good batch of trainer tr at step s into slot b; its id count. */
static uint64_t good_batch(uint64_t s, uint32_t tr, struct embd_batch *b)
{
	return gen_batch_n((uint32_t)s, tr, BATCH, b->lengths, b->values);
}

static void good_grad(uint64_t s, uint32_t tr, uint32_t total_dim, float *grad)
{
	for (uint32_t i = 0; i < BATCH; i++)
		for (uint32_t col = 0; col < total_dim; col++)
			grad[i * total_dim + col] = gen_grad((uint32_t)s, tr, i, col);
}

/* Posts req and waits for its completion; crash (trainer 2 only) kills the process between
 * the two. Returns the completion's result or the client's error. */
static int post(struct embd_client *c, struct embd_request *req, bool crash)
{
	struct embd_completion done;
	int rc = embd_submit(c, req);

	if (rc)
		return rc;
	if (crash)
		raise(SIGKILL);
	rc = embd_wait(c, &done, WAIT_MS);
	return rc ? rc : done.result;
}

/* What the hostile trainer does in a step. */
enum act { GOOD, BAD_ID, BAD_LENGTHS, NEGATIVE_LENGTH, NAN_GRAD, INF_GRAD };

static enum act hostile_act(uint64_t r)
{
	static const enum act acts[10] = { GOOD, GOOD, GOOD, GOOD, GOOD,
					   BAD_ID, BAD_LENGTHS, NEGATIVE_LENGTH, NAN_GRAD, INF_GRAD };
	return acts[r % 10];
}

/* One trainer process until the deadline: 0, or 1 with lg->why set. */
static int trainer(uint32_t tr, uint64_t deadline_ms, uint64_t incarnation)
{
	struct embd_client *c = NULL;
	char err[256];
	int rc;

	/* a new trainer 2 may find its predecessor not yet dropped: EMBD_EBUSY for a moment */
	for (uint64_t until = now_ms() + WAIT_MS;;) {
		rc = embd_connect(service.socket, (int)tr, WAIT_MS, &c, err, sizeof(err));
		if (rc != EMBD_EBUSY || now_ms() > until)
			break;
		usleep(2000);
	}
	if (rc)
		return fail(tr, "%s: %d %s", "connect", rc, err), 1;
	const struct embd_client_layout *l = embd_layout(c);
	uint64_t s = l->resumed_step, rnd = tu_mix64(seed ^ (tr * 0x100000001ull) ^ incarnation);

	while (now_ms() < deadline_ms && s < MAX_STEPS && !atomic_load(&lg->failed)) {
		const uint32_t slot = (uint32_t)(s % 2);
		const uint64_t r = tu_mix_next(&rnd);
		/* trainer 2: one step in 40 ends in a crash, at one of four points */
		const int crash_at = tr == CRASHER && r % 40 == 0 ? (int)(r >> 8) % 4 : -1;
		enum act act = tr == HOSTILE ? hostile_act(r >> 16) : GOOD;
		struct embd_batch b;
		uint64_t seen = atomic_load(&lg->steps);

		while (s + 1 > seen && !atomic_compare_exchange_weak(&lg->steps, &seen, s + 1))
			;
		if (crash_at == 0)
			raise(SIGKILL);
		embd_batch_get(c, slot, &b);
		struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = slot, .step = s,
					    .num_values = good_batch(s, tr, &b) };
		if (act == BAD_ID && !req.num_values)
			act = BAD_LENGTHS;      /* no id to spoil */
		if (act == BAD_ID)
			b.values[r % req.num_values] = tables[0].rows + (int64_t)(r % 1000);
		else if (act == BAD_LENGTHS)
			req.num_values += 1 + r % 3;
		else if (act == NEGATIVE_LENGTH)
			b.lengths[r % (NUM_F * BATCH)] = -1 - (int32_t)(r % 5);
		/* after sitting a step out, this trainer may post before the service moved on */
		while ((rc = post(c, &req, crash_at == 1)) == EMBD_EINVAL &&
		       strstr(embd_last_error(c), "the service is at step") && now_ms() < deadline_ms)
			usleep(200);
		if (crash_at == 2)
			raise(SIGKILL);
		const bool bad = act == BAD_ID || act == BAD_LENGTHS || act == NEGATIVE_LENGTH;
		if (bad) {
			atomic_fetch_add(&lg->bad_batches, 1);
			if (rc == 0)
				return fail(tr, "%s: %d %s", "a bad batch was accepted", rc,
					    embd_last_error(c)), 1;
			s++;            /* refused: this trainer sits step s out */
			continue;
		}
		if (rc)
			return fail(tr, "%s: %d %s", "forward", rc, embd_last_error(c)), 1;
		good_grad(s, tr, l->total_dim, b.grad);
		if (act == NAN_GRAD || act == INF_GRAD)
			b.grad[r % (BATCH * l->total_dim)] = act == NAN_GRAD ? NAN : INFINITY;
		lg->posted[s][tr] = 1;
		req.op = EMBD_REQUEST_BACKWARD;
		rc = post(c, &req, crash_at == 3);
		if (rc && rc != EMBD_ECANCELED)
			return fail(tr, "%s: %d %s", "backward", rc, embd_last_error(c)), 1;
		if ((act == NAN_GRAD || act == INF_GRAD) && rc != EMBD_ECANCELED)
			return fail(tr, "%s: %d %s", "a non-finite gradient was applied", rc, ""), 1;
		lg->result[s][tr] = rc ? RES_CANCELED : RES_OK;
		if (rc)
			atomic_fetch_add(&lg->refused, 1);
		if (act == NAN_GRAD || act == INF_GRAD)
			atomic_fetch_add(&lg->nonfinite, 1);
		s++;
	}
	embd_close(c);
	return 0;
}

/* Not tu_fork_child: its registry is too small for hundreds of crashes; soak_fini kills
 * the ones in kids[]. */
static pid_t spawn_trainer(uint32_t tr, uint64_t deadline_ms, uint64_t incarnation)
{
	pid_t pid = fork();

	cr_assert(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0)
		_exit(trainer(tr, deadline_ms, incarnation));
	return pid;
}

/* ---- the replay ----------------------------------------------------------------------------- */

/* The reference trained on every applied step but `skip` (UINT64_MAX: none); the number of
 * applied steps into *applied. */
static void replay(struct embd_ref_table **ref, uint64_t skip, const uint32_t *feature_offset,
		   uint64_t *applied)
{
	static int32_t lengths[T][NUM_F * BATCH];
	static int64_t values[T][NUM_F * BATCH * 4];
	static int32_t glen[NUM_F][T * BATCH];
	static int64_t gids[NUM_F][T * BATCH * 4];
	static float ggrad[NUM_F][T * BATCH * MAX_COLS];
	const uint64_t steps = atomic_load(&lg->steps);

	*applied = 0;
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		ref[t] = embd_ref_table_create(t, tables[t].rows, tables[t].dim, EMBD_DTYPE_FP32,
					       &tables[t].opt, SEED);
		cr_assert_not_null(ref[t]);
	}
	for (uint64_t s = 0; s < steps; s++) {
		uint32_t in[T], n = 0;
		bool ok = false, canceled = false;
		for (uint32_t i = 0; i < T; i++) {
			ok |= lg->result[s][i] == RES_OK;
			canceled |= lg->result[s][i] == RES_CANCELED;
			if (lg->posted[s][i])
				in[n++] = i;
		}
		cr_assert(!(ok && canceled), "step %llu: applied for some trainers and canceled for "
			  "others", (unsigned long long)s);
		if (!ok)
			continue;
		++*applied;
		if (s == skip)
			continue;
		/* the global batch: the participants' bags in trainer order, per feature */
		uint64_t pos[T] = { 0 }, gn[NUM_F] = { 0 };
		for (uint32_t k = 0; k < n; k++)
			gen_batch_n((uint32_t)s, in[k], BATCH, lengths[k], values[k]);
		for (uint32_t f = 0; f < NUM_F; f++)
			for (uint32_t k = 0; k < n; k++)
				for (uint32_t b = 0; b < BATCH; b++) {
					int32_t len = lengths[k][f * BATCH + b];
					glen[f][k * BATCH + b] = len;
					for (int32_t j = 0; j < len; j++)
						gids[f][gn[f]++] = values[k][pos[k]++];
				}
		for (uint32_t f = 0; f < NUM_F; f++) {
			uint32_t D = tables[feature_table(f)].dim;
			for (uint32_t k = 0; k < n; k++)
				for (uint32_t b = 0; b < BATCH; b++)
					for (uint32_t c = 0; c < D; c++)
						ggrad[f][(k * BATCH + b) * D + c] =
							gen_grad((uint32_t)s, in[k], b, feature_offset[f] + c);
		}
		for (uint32_t t = 0; t < NUM_TABLES; t++) {
			struct embd_ref_bags bags[2];
			uint32_t nb = 0;
			for (uint32_t f = 0; f < NUM_F; f++)
				if (feature_table(f) == t)
					bags[nb++] = (struct embd_ref_bags){
						.batch_size = n * BATCH, .lengths = glen[f],
						.ids = gids[f], .pooling = tables[t].pooling,
						.grad = ggrad[f], .grad_divisor = T };
			cr_assert_eq(embd_ref_backward(ref[t], bags, nb), 0);
		}
	}
}

/* Differences between embd's table t and the reference beyond the tolerance; the largest
 * absolute one into *worst. */
static uint32_t compare(const struct embd_ref_table *ref, const float *w, const float *m1,
			uint32_t m1_cols, float *worst)
{
	uint32_t bad = 0;

	for (int64_t r = 0; r < ref->rows; r++)
		for (uint32_t c = 0; c < ref->dim; c++) {
			float want = embd_ref_weight(ref, r, c), got = w[r * ref->dim + c];
			float d = fabsf(want - got);
			*worst = d > *worst ? d : *worst;
			bad += !(d <= SOAK_TOL_ABS + SOAK_TOL_REL * fabsf(want));
			if (!m1 || c >= m1_cols)
				continue;
			want = ref->m1[r * m1_cols + c];
			got = m1[r * m1_cols + c];
			d = fabsf(want - got);
			bad += !(d <= SOAK_TOL_ABS + SOAK_TOL_REL * fabsf(want));
		}
	return bad;
}

Test(soak, trainers_crashing_and_hostile_beside_good_ones_train_exactly_the_accepted_steps)
{
	const char *env = getenv("EMBD_SOAK_SECONDS");
	const uint64_t seconds = env && atoi(env) > 0 ? (uint64_t)atoi(env) : 120;

	seed = getenv("EMBD_SOAK_SEED") ? strtoull(getenv("EMBD_SOAK_SEED"), NULL, 10) : 1;
	lg = mmap(NULL, sizeof(*lg), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(lg != MAP_FAILED, "mmap: %s", strerror(errno));
	snprintf(config_path, sizeof(config_path), "/tmp/embd-soak-%d.json", (int)getpid());
	FILE *f = fopen(config_path, "w");
	cr_assert_not_null(f);
	fprintf(f, "{ ");
	write_tables(f, "table_wise");
	fprintf(f, ", \"topology\": {\"world_size\": 2, \"local_world_size\": 2, "
		"\"compute_device\": \"cpu\", \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", "
		"\"batch_size\": %d},\n \"trainers_per_node\": %d, \"seed\": %u, "
		"\"threads_per_rank\": 1, \"busy_poll_us\": 20 }\n", BATCH, T, SEED);
	fclose(f);
	service_spawn(config_path, "warning");
	usleep(200000);
	const int fds_before = tu_embd_count_fds(&service);

	const uint64_t start = now_ms(), deadline = start + seconds * 1000;
	uint64_t incarnation = 0;
	long rss_warm = -1;
	for (uint32_t i = 0; i < T; i++)
		kids[i] = spawn_trainer(i, deadline, incarnation++);
	for (uint32_t alive = T; alive;) {
		int st;
		pid_t pid = waitpid(-1, &st, WNOHANG);
		if (rss_warm < 0 && now_ms() - start > seconds * 200)
			rss_warm = tu_embd_rss_kb(&service);         /* 20% in: every buffer grown */
		if (pid == 0) {
			usleep(5000);
			continue;
		}
		if (pid < 0)
			break;
		uint32_t i = 0;
		while (i < T && kids[i] != pid)
			i++;
		if (i == T)
			continue;
		if (i == CRASHER && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL &&
		    now_ms() < deadline) {
			atomic_fetch_add(&lg->crashes, 1);
			usleep((useconds_t)(tu_mix64(seed + incarnation) % 20000));
			atomic_fetch_add(&lg->reconnects, 1);
			kids[i] = spawn_trainer(i, deadline, incarnation++);
			continue;
		}
		cr_expect((WIFEXITED(st) && WEXITSTATUS(st) == 0) || (i == CRASHER && WIFSIGNALED(st)),
			  "trainer %u: exit status 0x%x: %s", i, st, lg->why[i]);
		kids[i] = 0;
		alive--;
	}
	cr_assert(!atomic_load(&lg->failed), "a trainer failed: %s | %s | %s | %s", lg->why[0],
		  lg->why[1], lg->why[2], lg->why[3]);
	const long rss_end = tu_embd_rss_kb(&service);

	/* the tables, read through a trainer connection once every trainer left */
	struct embd_client *c;
	char err[256];
	cr_assert_eq(embd_connect(service.socket, 0, WAIT_MS, &c, err, sizeof(err)), 0, "%s", err);
	const struct embd_client_layout *l = embd_layout(c);
	const uint64_t resumed_step = l->resumed_step;
	uint32_t feature_offset[NUM_F];
	for (uint32_t fi = 0; fi < NUM_F; fi++)
		feature_offset[fi] = l->features[fi].offset;
	static float w[NUM_TABLES][64 * MAX_COLS], m1[NUM_TABLES][64 * MAX_COLS];
	uint32_t m1_cols[NUM_TABLES] = { 0 };
	uint64_t applied_step = 0;
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		struct embd_table_info info;
		cr_assert_eq(embd_table_read(c, t, EMBD_TABLE_WEIGHTS, 0, (uint64_t)tables[t].rows,
					     w[t], &applied_step), 0, "%s", embd_last_error(c));
		if (tables[t].opt.type == EMBD_OPT_SGD)
			continue;
		cr_assert_eq(embd_table_info(c, t, EMBD_TABLE_MOMENTUM1, &info), 0);
		m1_cols[t] = info.cols;
		cr_assert_eq(embd_table_read(c, t, EMBD_TABLE_MOMENTUM1, 0, (uint64_t)tables[t].rows,
					     m1[t], NULL), 0, "%s", embd_last_error(c));
	}
	embd_close(c);
	const int fds_after = tu_embd_wait_fds(&service, fds_before, FDS_SETTLE_MS);

	struct embd_ref_table *ref[NUM_TABLES];
	uint64_t applied = 0, newest = 0;
	uint32_t bad = 0;
	float worst = 0;
	replay(ref, UINT64_MAX, feature_offset, &applied);
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		bad += compare(ref[t], w[t], m1_cols[t] ? m1[t] : NULL, m1_cols[t], &worst);
		embd_ref_table_destroy(ref[t]);
	}
	/* the check can fail: without the newest applied step the replay must differ */
	for (uint64_t s = atomic_load(&lg->steps); s-- > 0 && !newest;)
		for (uint32_t i = 0; i < T; i++)
			newest = lg->result[s][i] == RES_OK ? s : newest;
	uint64_t unused;
	uint32_t bad_without = 0;
	float worst_without = 0;
	replay(ref, newest, feature_offset, &unused);
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		bad_without += compare(ref[t], w[t], NULL, 0, &worst_without);
		embd_ref_table_destroy(ref[t]);
	}
	printf("{\"soak_seconds\":%llu,\"seed\":%llu,\"steps\":%llu,\"applied\":%llu,"
	       "\"canceled_completions\":%u,\"crashes\":%u,\"reconnects\":%u,\"bad_batches\":%u,"
	       "\"nonfinite_grads\":%u,\"max_abs_diff\":%g,\"mismatches\":%u,"
	       "\"mismatches_without_step_%llu\":%u,\"fds_before\":%d,\"fds_after\":%d,"
	       "\"rss_warm_kb\":%ld,\"rss_end_kb\":%ld}\n",
	       (unsigned long long)seconds, (unsigned long long)seed,
	       (unsigned long long)atomic_load(&lg->steps), (unsigned long long)applied,
	       atomic_load(&lg->refused), atomic_load(&lg->crashes), atomic_load(&lg->reconnects),
	       atomic_load(&lg->bad_batches), atomic_load(&lg->nonfinite), (double)worst, bad,
	       (unsigned long long)newest, bad_without, fds_before, fds_after, rss_warm, rss_end);
	fflush(stdout);
	cr_expect(applied > 0 && atomic_load(&lg->crashes) > 0 && atomic_load(&lg->bad_batches) > 0 &&
		  atomic_load(&lg->nonfinite) > 0, "the run must exercise every fault (too short?)");
	cr_expect_eq(bad, 0, "embd's tables must equal the reference of the %llu applied steps: "
		     "%u values off (largest difference %g)", (unsigned long long)applied, bad,
		     (double)worst);
	cr_expect_gt(bad_without, 0, "leaving step %llu out of the replay must show (the check "
		     "must be able to fail)", (unsigned long long)newest);
	cr_expect_eq(resumed_step, applied_step, "the rows hold every step before %llu, the "
		     "layout says %llu", (unsigned long long)applied_step,
		     (unsigned long long)resumed_step);
	cr_expect_eq(fds_after, fds_before, "embd must hold the fds it held before the trainers "
		     "(%d), holds %d", fds_before, fds_after);
	cr_expect(rss_warm > 0 && rss_end - rss_warm < RSS_SLACK_KB, "embd's RSS grew from %ld KiB "
		  "(20%% in) to %ld KiB (end): more than %d KiB", rss_warm, rss_end, RSS_SLACK_KB);
	munmap(lg, sizeof(*lg));
}
