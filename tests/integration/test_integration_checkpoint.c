/*
 * Integration: checkpoints of the real embd, and trainers that crash.
 *
 * crash_at_random_points: a golden run trains N steps and records every pooled output. Then
 * a run with checkpoint_every_steps = 1 is SIGKILLed over and over at random moments right
 * after a step boundary, i.e. while a checkpoint is being snapshotted, written, fsynced or
 * renamed; after each kill the test finds the newest complete checkpoint on disk itself
 * (manifest + every CRC), restarts embd, and checks that embd resumed exactly at that step
 * (WELCOME's resumed_step) and that every forward from there on equals the golden run's bit
 * for bit (so weights and optimizer state are the checkpoint's, and no half-written one was
 * loaded). At the end both runs stop with SIGTERM and their final checkpoints must hold the
 * same bytes for every table. Trials: EMBD_SOAK_TRIALS (default 20).
 *
 * trainer_restart_keeps_its_rank_and_state: of two trainers, one is SIGKILLed between steps
 * and a new process reconnects asking for its index; it gets the same rank, resumes at the
 * current step, and the pooled outputs of the whole run equal an uninterrupted run's.
 *
 * export_matches_numpy / import_sets_initial_weights: embctl export writes a .npy that numpy
 * loads with the service's weights; embctl import makes a checkpoint embd starts from.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "embd/client.h"
#include "ckpt/checkpoint.h"
#include "ckpt/npy.h"
#include "tests/support/children.h"
#include "tests/support/embd_process.h"
#include "tests/support/mix.h"
#include "tests/support/numpy_python.h"

#define B 8
#define BIG_ROWS 65536
#define BIG_DIM 32
#define SMALL_ROWS 100
#define SMALL_DIM 8
#define NUM_F 3
#define TOTAL_DIM (2 * BIG_DIM + SMALL_DIM)
#define OUT_FLOATS (B * TOTAL_DIM)

static char base[64], config_path[160];
static struct tu_embd service;          /* its stderr is the test's */

static void setup(void)
{
	snprintf(base, sizeof(base), "/tmp/embd-ckit-XXXXXX");
	cr_assert_not_null(mkdtemp(base));
	snprintf(service.socket, sizeof(service.socket), "%s/s.sock", base);
	snprintf(config_path, sizeof(config_path), "%s/embd.json", base);
}

/* sig, then waits for embd however long it takes (a final checkpoint is written at SIGTERM). */
static void kill_service(int sig)
{
	tu_embd_stop(&service, sig, -1, NULL);
}

static void teardown(void)
{
	char cmd[128];
	tu_kill_children();
	kill_service(SIGKILL);
	snprintf(cmd, sizeof(cmd), "rm -rf %s", base);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(checkpoint, .init = setup, .fini = teardown, .timeout = 600);

/* Two tables: "big" (adagrad, its state as large as its weights) and "small" (sgd, mean). */
static void write_config(const char *ckdir, uint32_t every_steps, uint32_t keep,
			 uint32_t trainers, const char *sharding)
{
	FILE *f = fopen(config_path, "w");
	char cons[128] = "";

	cr_assert_not_null(f);
	if (sharding)
		snprintf(cons, sizeof(cons), ", \"constraints\": {\"sharding_types\": [\"%s\"]}", sharding);
	fprintf(f, "{ \"tables\": [\n"
		"  {\"name\": \"big\", \"num_embeddings\": %d, \"embedding_dim\": %d, \"pooling\": \"sum\","
		"   \"feature_names\": [\"f_a\", \"f_b\"], \"optimizer\": {\"type\": \"adagrad\", "
		"\"lr\": 0.05, \"eps\": 1e-8}%s},\n"
		"  {\"name\": \"small\", \"num_embeddings\": %d, \"embedding_dim\": %d, \"pooling\": "
		"\"mean\", \"feature_names\": [\"f_c\"], \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.1}%s}],\n"
		" \"topology\": {\"world_size\": 2, \"local_world_size\": 2, \"compute_device\": \"cpu\","
		" \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", \"batch_size\": %d},\n"
		" \"trainers_per_node\": %u, \"seed\": 99, \"threads_per_rank\": 1, \"busy_poll_us\": 10,\n"
		" \"checkpoint_dir\": \"%s\", \"checkpoint_every_steps\": %u, \"checkpoint_keep\": %u }\n",
		BIG_ROWS, BIG_DIM, cons, SMALL_ROWS, SMALL_DIM, cons, B, trainers, ckdir, every_steps,
		keep);
	fclose(f);
}

static void start_service(void)
{
	const struct tu_embd_opts o = { .config = config_path, .log_level = "warning" };

	tu_embd_start(&service, &o);
	tu_embd_await_socket(&service, 10000, "embd");
}

/* Trainer tr's batch and gradient of step k (deterministic); ids of big in [0, 4096). */
static uint64_t fill_step(struct embd_batch *b, uint64_t k, uint32_t tr)
{
	uint64_t n = 0;
	for (uint32_t f = 0; f < NUM_F; f++)
		for (uint32_t i = 0; i < B; i++) {
			uint64_t h = tu_mix64((k << 40) ^ ((uint64_t)tr << 32) ^ (f << 16) ^ i);
			int32_t len = (int32_t)(h % 4);
			b->lengths[f * B + i] = len;
			for (int32_t j = 0; j < len; j++)
				b->values[n++] = (int64_t)(tu_mix64(h + (uint64_t)j + 1) %
							   (f < 2 ? 4096 : SMALL_ROWS));
		}
	for (uint32_t i = 0; i < OUT_FLOATS; i++)
		b->grad[i] = (float)((int)(tu_mix64(0x77ull ^ (k << 32) ^ ((uint64_t)tr << 24) ^ i) %
					   2001) - 1000) / 1000.0f;
	return n;
}

/* One step of one trainer: forward (pooled copied to out when not NULL), then backward. */
static int train_step(struct embd_client *c, uint64_t k, uint32_t tr, float *out)
{
	struct embd_batch b;
	embd_batch_get(c, (uint32_t)(k % 2), &b);
	uint64_t n = fill_step(&b, k, tr);
	int rc = embd_forward(c, (uint32_t)(k % 2), k, n, 0);
	if (rc)
		return rc;
	if (out)
		memcpy(out, b.pooled, sizeof(float) * OUT_FLOATS);
	return embd_backward(c, (uint32_t)(k % 2), k, n, 0);
}

static struct embd_client *connect_trainer(int index)
{
	struct embd_client *c = NULL;
	char err[256] = "";
	int rc;
	/* the socket file appears at bind(), a moment before listen() */
	for (int i = 0; i < 500; i++) {
		rc = embd_connect(service.socket, index, 20000, &c, err, sizeof(err));
		if (rc != EMBD_ECONNRESET)
			break;
		usleep(10000);
	}
	cr_assert_eq(rc, 0, "connect trainer %d: %d %s", index, rc, err);
	cr_assert_eq(embd_layout(c)->total_dim, TOTAL_DIM);
	return c;
}

/* Every table of the checkpoint in dir: weights and state, concatenated. */
static void *load_all(const char *root, uint64_t *bytes_out, uint64_t *step_out)
{
	char dir[4200], err[512];
	struct embd_ckpt_manifest m;
	int rc = embd_ckpt_find(root, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err, sizeof(err));
	cr_assert_eq(rc, 0, "find in %s: %d %s", root, rc, err);
	uint64_t total = 0;
	for (uint32_t t = 0; t < m.num_tables; t++)
		total += (uint64_t)m.tables[t].num_embeddings * m.tables[t].embedding_dim * 4 * 2;
	uint8_t *all = calloc(1, total);
	cr_assert_not_null(all);
	uint64_t off = 0;
	for (uint32_t t = 0; t < m.num_tables; t++) {
		uint64_t n = (uint64_t)m.tables[t].num_embeddings * m.tables[t].embedding_dim * 4;
		struct embd_ckpt_target tg = { .table = t, .rows = m.tables[t].num_embeddings,
			.cols = (uint32_t)m.tables[t].embedding_dim, .weights = all + off,
			.momentum1 = m.tables[t].optimizer == EMBD_OPT_ADAGRAD ? (float *)(all + off + n) : NULL };
		rc = embd_ckpt_load(dir, &m, &tg, 1, err, sizeof(err));
		cr_assert_eq(rc, 0, "load %s: %s", dir, err);
		off += 2 * n;
	}
	*bytes_out = total;
	*step_out = m.step;
	embd_ckpt_manifest_free(&m);
	return all;
}

/* The step of the newest valid checkpoint under root, 0 when none. */
static uint64_t newest_step(const char *root)
{
	char dir[4200], err[512];
	struct embd_ckpt_manifest m;
	if (embd_ckpt_find(root, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err, sizeof(err)))
		return 0;
	uint64_t s = m.step;
	embd_ckpt_manifest_free(&m);
	return s;
}

Test(checkpoint, crash_at_random_points)
{
	const char *env = getenv("EMBD_SOAK_TRIALS");
	uint32_t trials = env && atoi(env) > 0 ? (uint32_t)atoi(env) : 20;
	const uint64_t N = (uint64_t)trials * 4 + 8;
	float *golden = malloc(sizeof(float) * OUT_FLOATS * N), out[OUT_FLOATS];
	char gdir[128], cdir[128];
	uint64_t rng = (uint64_t)time(NULL) ^ (uint64_t)getpid(), seed = rng;

	cr_assert_not_null(golden);
	snprintf(gdir, sizeof(gdir), "%s/golden", base);
	snprintf(cdir, sizeof(cdir), "%s/crash", base);
	/* the golden run: no checkpoint but the final one */
	write_config(gdir, 0, 1, 1, NULL);
	start_service();
	struct embd_client *c = connect_trainer(0);
	for (uint64_t k = 0; k < N; k++)
		cr_assert_eq(train_step(c, k, 0, golden + k * OUT_FLOATS), 0, "golden step %llu: %s",
			     (unsigned long long)k, embd_last_error(c));
	embd_close(c);
	kill_service(SIGTERM);

	write_config(cdir, 1, 2, 1, NULL);
	uint32_t failures = 0, resumed_nonzero = 0, mid_write = 0;
	uint64_t expected = 0, k = 0;
	for (uint32_t t = 0; t <= trials; t++) {
		start_service();
		c = connect_trainer(0);
		uint64_t resumed = embd_layout(c)->resumed_step;
		if (resumed != expected) {
			failures++;
			cr_expect_eq(resumed, expected, "trial %u (seed %llu): expected embd to resume at "
				     "the newest complete checkpoint, step %llu, got %llu", t,
				     (unsigned long long)seed, (unsigned long long)expected,
				     (unsigned long long)resumed);
		}
		resumed_nonzero += resumed > 0;
		/* the last trial runs to N and stops cleanly */
		uint64_t steps = t == trials ? N - resumed : 1 + tu_mix64(rng++) % 4;
		for (k = resumed; k < resumed + steps && k < N; k++) {
			int rc = train_step(c, k, 0, out);
			cr_assert_eq(rc, 0, "trial %u step %llu: %s", t, (unsigned long long)k,
				     embd_last_error(c));
			if (memcmp(out, golden + k * OUT_FLOATS, sizeof(out))) {
				failures++;
				cr_expect(false, "trial %u (seed %llu) step %llu: pooled output differs "
					  "from the uninterrupted run", t, (unsigned long long)seed,
					  (unsigned long long)k);
				break;
			}
		}
		if (t == trials)
			break;
		/* every 4th trial first lets the checkpoint of step k finish, so restores happen
		 * however slow the disk; the others kill it while that checkpoint is snapshotted
		 * or written: 0-40 ms after the boundary */
		for (int w = 0; t % 4 == 3 && w < 1000 && newest_step(cdir) != k; w++)
			usleep(10000);
		usleep((useconds_t)(tu_mix64(rng++) % 40000));
		kill_service(SIGKILL);
		embd_close(c);
		expected = newest_step(cdir);
		mid_write += expected < k;     /* killed before the last boundary's rename */
	}
	embd_close(c);
	kill_service(SIGTERM);
	uint64_t gbytes, cbytes, gstep, cstep;
	void *g = load_all(gdir, &gbytes, &gstep), *cr = load_all(cdir, &cbytes, &cstep);
	cr_expect_eq(gstep, N, "golden final checkpoint at step %llu, expected %llu",
		     (unsigned long long)gstep, (unsigned long long)N);
	cr_expect_eq(cstep, N);
	cr_expect(gbytes == cbytes && !memcmp(g, cr, gbytes), "final tables and optimizer state of "
		  "the crashed run differ from the uninterrupted run's");
	free(g);
	free(cr);
	free(golden);
	fprintf(stderr, "checkpoint crash test: %u trials, %u failures, %u restores from a "
		"checkpoint, %u kills before the newest checkpoint was complete, seed %llu\n", trials,
		failures, resumed_nonzero, mid_write, (unsigned long long)seed);
	cr_expect_eq(failures, 0);
	cr_expect_geq(resumed_nonzero, trials / 4, "expected at least every 4th trial to restore a "
		      "checkpoint, got %u of %u", resumed_nonzero, trials);
}

/* ---- trainer restarts -------------------------------------------------------------------- */

#define RK 8                            /* steps of the restart test */
#define RKILL 4                         /* trainer 1 dies after step RKILL - 1 */

struct shared {
	float pooled[2][RK][OUT_FLOATS];
	volatile int t1_waiting, t1_back, connected[3];
	int rc[3];
	int index, resumed;
	char err[3][256];
};

/* Trainer tr trains steps [from, to); a "crashing" trainer 1 stops before RKILL and waits to
 * be killed; trainer 0 waits at RKILL until the new trainer 1 is back. */
static int trainer_body(struct shared *sh, uint32_t tr, int slot_rc, uint64_t from, uint64_t to,
			bool crash, bool wait_for_peer)
{
	struct embd_client *c;
	int rc;
	for (int i = 0; i < 500; i++) {
		rc = embd_connect(service.socket, (int)tr, 20000, &c, sh->err[slot_rc], 256);
		if (rc != EMBD_ECONNRESET)
			break;
		usleep(10000);
	}
	if (rc)
		return rc;
	sh->connected[slot_rc] = 1;
	if (from) {
		sh->index = embd_layout(c)->index;
		sh->resumed = (int)embd_layout(c)->resumed_step;
		sh->t1_back = 1;
	}
	for (uint64_t k = from; k < to && !rc; k++) {
		if (crash && k == RKILL) {
			sh->t1_waiting = 1;
			for (;;)
				pause();        /* SIGKILLed here: no embd_close, like a crash */
		}
		while (wait_for_peer && k == RKILL && !sh->t1_back)
			usleep(1000);
		rc = train_step(c, k, tr, sh->pooled[tr][k]);
		if (rc)
			snprintf(sh->err[slot_rc], 256, "step %llu: %s", (unsigned long long)k,
				 embd_last_error(c));
	}
	embd_close(c);
	return rc;
}

static pid_t spawn(struct shared *sh, uint32_t tr, int slot, uint64_t from, uint64_t to,
		   bool crash, bool wait_for_peer)
{
	pid_t pid = tu_fork_child();
	if (pid == 0) {
		sh->rc[slot] = trainer_body(sh, tr, slot, from, to, crash, wait_for_peer);
		_exit(0);
	}
	/* one at a time: the service concatenates the trainers' batches in the order they
	 * connected, and the float sums of shared rows' gradients follow that order */
	for (int i = 0; i < 20000 && !sh->connected[slot] && !sh->rc[slot]; i++)
		usleep(1000);
	return pid;
}

static void reap(pid_t pid)
{
	int st;
	waitpid(pid, &st, 0);
}

Test(checkpoint, trainer_restart_keeps_its_rank_and_state)
{
	struct shared *gold = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
				   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct shared *sh = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	char dir[128];

	cr_assert(gold != MAP_FAILED && sh != MAP_FAILED);
	memset(gold, 0, sizeof(*gold));
	memset(sh, 0, sizeof(*sh));
	snprintf(dir, sizeof(dir), "%s/restart", base);
	write_config(dir, 0, 1, 2, "row_wise");
	start_service();
	pid_t a = spawn(gold, 0, 0, 0, RK, false, false), b = spawn(gold, 1, 1, 0, RK, false, false);
	reap(a);
	reap(b);
	cr_assert(gold->rc[0] == 0 && gold->rc[1] == 0, "uninterrupted run: %s / %s", gold->err[0],
		  gold->err[1]);
	kill_service(SIGKILL);
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	cr_assert_eq(system(cmd), 0);

	start_service();
	a = spawn(sh, 0, 0, 0, RK, false, true);
	b = spawn(sh, 1, 1, 0, RK, true, false);
	for (int i = 0; i < 20000 && !sh->t1_waiting; i++)
		usleep(1000);
	cr_assert(sh->t1_waiting, "trainer 1 never reached step %d", RKILL);
	kill(b, SIGKILL);
	reap(b);
	pid_t again = spawn(sh, 1, 2, RKILL, RK, false, false);
	reap(again);
	reap(a);
	cr_assert(sh->rc[0] == 0 && sh->rc[2] == 0, "trainer 0: %d %s; restarted trainer 1: %d %s",
		  sh->rc[0], sh->err[0], sh->rc[2], sh->err[2]);
	cr_expect_eq(sh->index, 1, "the restarted trainer asked for index 1, got %d", sh->index);
	cr_expect_eq(sh->resumed, RKILL, "expected the restarted trainer to resume at step %d, got %d",
		     RKILL, sh->resumed);
	for (uint32_t tr = 0; tr < 2; tr++)
		for (uint32_t k = 0; k < RK; k++)
			for (uint32_t i = 0; i < OUT_FLOATS; i++)
				if (sh->pooled[tr][k][i] != gold->pooled[tr][k][i]) {
					cr_expect(false, "trainer %u step %u: pooled[%u] %.9g, the "
						  "uninterrupted run's %.9g", tr, k, i,
						  sh->pooled[tr][k][i], gold->pooled[tr][k][i]);
					break;
				}
	munmap(gold, sizeof(*gold));
	munmap(sh, sizeof(*sh));
}

/* ---- embctl export / import -------------------------------------------------------------- */

Test(checkpoint, export_matches_numpy)
{
	char dir[128], cmd[1024], npy[160];
	snprintf(dir, sizeof(dir), "%s/export", base);
	snprintf(npy, sizeof(npy), "%s/big.npy", base);
	write_config(dir, 0, 2, 1, "row_wise");
	start_service();
	struct embd_client *c = connect_trainer(0);
	for (uint64_t k = 0; k < 5; k++)
		cr_assert_eq(train_step(c, k, 0, NULL), 0, "%s", embd_last_error(c));
	snprintf(cmd, sizeof(cmd), "%s checkpoint --socket %s --wait > %s/reply.json", EMBCTL_BINARY,
		 service.socket, base);
	cr_assert_eq(system(cmd), 0, "embctl checkpoint --wait failed");
	embd_close(c);
	kill_service(SIGKILL);
	snprintf(cmd, sizeof(cmd), "%s export --table big --dir %s -o %s", EMBCTL_BINARY, dir, npy);
	cr_assert_eq(system(cmd), 0, "embctl export failed");
	uint64_t bytes, step;
	float *all = load_all(dir, &bytes, &step);
	cr_expect_eq(step, 5);
	struct embd_npy_header h;
	void *data;
	char err[256];
	cr_assert_eq(embd_npy_read_file(npy, &h, &data, err, sizeof(err)), 0, "%s", err);
	cr_expect(h.shape[0] == BIG_ROWS && h.shape[1] == BIG_DIM && h.dtype == EMBD_NPY_F4);
	cr_expect(!memcmp(data, all, (size_t)BIG_ROWS * BIG_DIM * 4), "export differs from the shards");
	free(data);
	free(all);
	const char *py = numpy_python();
	if (!py)
		cr_skip_test("python3 with numpy not found: the export was checked without numpy");
	/* numpy assembles the table from the shard files itself, by the manifest's coordinates */
	snprintf(cmd, sizeof(cmd), "%s -c \"\nimport json, numpy as np, sys\nd = '%s/step-5'\n"
		 "m = json.load(open(d + '/manifest.json'))\nt = np.load('%s')\n"
		 "a = np.full((%d, %d), np.nan, dtype=np.float32)\nn = 0\n"
		 "for f in m['files']:\n  if f['table'] == 'big' and f['state'] == 'weight':\n"
		 "    s = np.load(d + '/' + f['name'])\n"
		 "    a[f['row_offset']:f['row_offset'] + f['rows'], f['col_offset']:f['col_offset'] + "
		 "f['cols']] = s\n    n += 1\n"
		 "sys.exit(0 if n >= 2 and t.dtype == np.float32 and t.shape == a.shape and "
		 "np.array_equal(t, a) else 1)\n\"", py, dir, npy, BIG_ROWS, BIG_DIM);
	cr_expect_eq(system(cmd), 0, "numpy: the exported table differs from the shard files");
}

Test(checkpoint, import_sets_initial_weights)
{
	char dir[128], cmd[1024], npy[160], err[256];
	float vals[SMALL_ROWS * SMALL_DIM], out[OUT_FLOATS];
	uint64_t shape[2] = { SMALL_ROWS, SMALL_DIM };

	for (int i = 0; i < SMALL_ROWS * SMALL_DIM; i++)
		vals[i] = (float)i / 1024.0f - 0.25f;
	snprintf(dir, sizeof(dir), "%s/import", base);
	snprintf(npy, sizeof(npy), "%s/small.npy", base);
	cr_assert_eq(embd_npy_write_file(npy, EMBD_NPY_F4, 2, shape, vals, false, NULL, NULL, err,
					 sizeof(err)), 0, "%s", err);
	write_config(dir, 0, 2, 1, "table_wise");
	snprintf(cmd, sizeof(cmd), "%s import --config %s --table small -i %s", EMBCTL_BINARY,
		 config_path, npy);
	cr_assert_eq(system(cmd), 0, "embctl import failed");
	start_service();
	struct embd_client *c = connect_trainer(0);
	cr_expect_eq(embd_layout(c)->resumed_step, 0);
	/* one id per bag of f_c (mean of one row = the row), nothing for the big features */
	for (uint32_t round = 0; round < SMALL_ROWS / B; round++) {
		struct embd_batch b;
		embd_batch_get(c, round % 2, &b);
		memset(b.lengths, 0, sizeof(int32_t) * NUM_F * B);
		for (uint32_t i = 0; i < B; i++) {
			b.lengths[2 * B + i] = 1;
			b.values[i] = round * B + i;
		}
		cr_assert_eq(embd_forward(c, round % 2, round, B, 0), 0, "%s", embd_last_error(c));
		memcpy(out, b.pooled, sizeof(out));
		memset(b.grad, 0, sizeof(float) * OUT_FLOATS);
		cr_assert_eq(embd_backward(c, round % 2, round, B, 0), 0, "%s", embd_last_error(c));
		for (uint32_t i = 0; i < B; i++)
			for (uint32_t col = 0; col < SMALL_DIM; col++) {
				float want = vals[(round * B + i) * SMALL_DIM + col];
				float got = out[i * TOTAL_DIM + 2 * BIG_DIM + col];
				cr_expect_eq(got, want, "row %u col %u: expected the imported %g, got %g",
					     round * B + i, col, want, got);
			}
	}
	embd_close(c);
}
