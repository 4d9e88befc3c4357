/*
 * Integration: a hostile but realistic operator and trainer against the real embd and embctl
 * (issue 13). Checkpoints: a directory whose every checkpoint is damaged makes embd refuse to
 * start from the initial weights until checkpoint_allow_fresh_start, and the damaged ones end
 * up in damaged/, never deleted (and while they are all there and no valid one is left, the
 * refusal stands); a second embd (or an embctl import) on a directory a running
 * embd owns is refused with its pid. embctl: numbers parsed strictly on every command line,
 * export never writes into the checkpoint it reads, import refuses non-finite arrays and a
 * table given twice and says which checkpoint embd will restore, and `embctl checkpoint`
 * against a service that never answers gives up after its default timeout.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "embd/client.h"
#include "ckpt/checkpoint.h"
#include "ckpt/npy.h"
#include "tests/support/dir_util.h"
#include "tests/support/embd_process.h"

#define B 4
#define ROWS 64
#define DIM 8

static char base[64], config_path[160], ckdir[128], out_path[160];

static struct tu_embd services[2];
static uint32_t trainers = 1;           /* trainers_per_node of write_config */

static void setup(void)
{
	snprintf(base, sizeof(base), "/tmp/embd-hostile-XXXXXX");
	cr_assert_not_null(mkdtemp(base));
	snprintf(config_path, sizeof(config_path), "%s/embd.json", base);
	snprintf(ckdir, sizeof(ckdir), "%s/ck", base);
	snprintf(out_path, sizeof(out_path), "%s/out.txt", base);
}

static void stop(struct tu_embd *s)
{
	tu_embd_stop(s, SIGKILL, 5000, NULL);
}

static void teardown(void)
{
	char cmd[128];

	for (int i = 0; i < 2; i++)
		stop(&services[i]);
	trainers = 1;
	snprintf(cmd, sizeof(cmd), "rm -rf %s", base);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(hostile_operator, .init = setup, .fini = teardown, .timeout = 120);

/* One table "t" (adagrad) of ROWS x DIM, `trainers` trainers; extra: more keys or "". */
static void write_config(const char *extra)
{
	FILE *f = fopen(config_path, "w");

	cr_assert_not_null(f);
	fprintf(f, "{ \"tables\": [{\"name\": \"t\", \"num_embeddings\": %d, \"embedding_dim\": %d, "
		"\"pooling\": \"sum\", \"feature_names\": [\"f\"], \"optimizer\": {\"type\": "
		"\"adagrad\", \"lr\": 0.1, \"eps\": 1e-8}}],\n"
		" \"topology\": {\"world_size\": 1, \"local_world_size\": 1, \"compute_device\": "
		"\"cpu\", \"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", \"batch_size\": %d},\n"
		" \"trainers_per_node\": %u, \"seed\": 5, \"busy_poll_us\": 10,\n"
		" \"checkpoint_dir\": \"%s\"%s }\n", ROWS, DIM, B, trainers, ckdir, extra);
	fclose(f);
}

/* Starts embd i; returns once it listens (true) or exited (false, its status in *status). */
static bool start(int i, int *status)
{
	struct tu_embd *s = &services[i];
	const struct tu_embd_opts o = { .config = config_path, .log_level = "info" };

	snprintf(s->socket, sizeof(s->socket), "%s/s%d.sock", base, i);
	snprintf(s->log, sizeof(s->log), "%s/embd%d.log", base, i);
	tu_embd_start(s, &o);
	for (int k = 0; k < 1000; k++) {
		if (tu_embd_wait(s, 10, status))
			return false;
		if (!access(s->socket, F_OK))
			return true;
	}
	cr_assert_fail("embd %d neither listened nor exited within 10 s", i);
	return false;
}

/* Whether file path holds text. */
static bool file_has(const char *path, const char *text)
{
	static char buf[65536];
	FILE *f = fopen(path, "r");
	size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;

	if (f)
		fclose(f);
	buf[n] = 0;
	return strstr(buf, text) != NULL;
}

/* Runs `embctl <args>` with its stdout and stderr in out_path; returns its exit code. */
static int embctl(const char *args)
{
	char cmd[2048];

	snprintf(cmd, sizeof(cmd), "%s %s > %s 2>&1", EMBCTL_BINARY, args, out_path);
	int st = system(cmd);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_npy(const char *path, float value, uint32_t bad_at, float bad)
{
	float v[ROWS * DIM];
	uint64_t shape[2] = { ROWS, DIM };
	char err[256];

	for (uint32_t i = 0; i < ROWS * DIM; i++)
		v[i] = i == bad_at ? bad : value;
	cr_assert_eq(embd_npy_write_file(path, EMBD_NPY_F4, 2, shape, v, false, NULL, NULL, err,
					 sizeof(err)), 0, "%s", err);
}

/* Imports a -i file of `value`s as step `step` of table t. */
static void import_step(uint64_t step, float value)
{
	char npy[192], args[512];

	snprintf(npy, sizeof(npy), "%s/w%llu.npy", base, (unsigned long long)step);
	write_npy(npy, value, UINT32_MAX, 0);
	snprintf(args, sizeof(args), "import --config %s --step %llu --table t -i %s", config_path,
		 (unsigned long long)step, npy);
	cr_assert_eq(embctl(args), 0, "embctl import of step %llu failed", (unsigned long long)step);
}

/* ---- damaged checkpoints ------------------------------------------------------------------ */

Test(hostile_operator, every_checkpoint_damaged_refuses_a_fresh_start)
{
	char path[256];
	int st;

	write_config("");
	import_step(10, 0.5f);
	import_step(20, 0.25f);
	snprintf(path, sizeof(path), "%s/step-10/t0.import.weight.npy", ckdir);
	cr_assert_eq(truncate(path, 200), 0);
	snprintf(path, sizeof(path), "%s/step-20/manifest.json", ckdir);
	cr_assert_eq(truncate(path, 30), 0);
	cr_assert(!start(0, &st), "embd must refuse to start from the initial weights over "
		  "damaged checkpoints");
	cr_expect(WIFEXITED(st) && WEXITSTATUS(st) != 0, "expected a failing exit, got 0x%x", st);
	cr_expect(tu_embd_log_has(&services[0], "checkpoint_allow_fresh_start") &&
		  tu_embd_log_has(&services[0], "step-20"), "the log must name the damaged checkpoints "
		  "and the key (see %s)", services[0].log);
	cr_expect_eq(tu_count_entries(ckdir, "step-"), 2, "a refusal leaves them in place");
	/* the operator says so: embd starts afresh, the damaged ones kept in damaged/ */
	write_config(", \"checkpoint_allow_fresh_start\": true");
	cr_assert(start(0, &st), "with checkpoint_allow_fresh_start embd starts (exit 0x%x)", st);
	char dmg[192];
	snprintf(dmg, sizeof(dmg), "%s/damaged", ckdir);
	cr_expect_eq(tu_count_entries(ckdir, "step-"), 0);
	cr_expect(tu_count_entries(dmg, "step-10-") == 1 && tu_count_entries(dmg, "step-20-") == 1,
		  "both damaged checkpoints must be in damaged/");
	/* stopped before it wrote a checkpoint: no step-<N> at all, the training is in damaged/,
	 * and a start without the key still refuses */
	stop(&services[0]);
	write_config("");
	cr_assert(!start(0, &st), "embd must refuse a fresh start while damaged/ holds "
		  "checkpoints and no valid one is left");
	cr_expect(tu_embd_log_has(&services[0], "damaged/ holds 2 damaged checkpoints") &&
		  tu_embd_log_has(&services[0], "checkpoint_allow_fresh_start"), "the log must say "
		  "what damaged/ holds and name the key (see %s)", services[0].log);
	write_config(", \"checkpoint_allow_fresh_start\": true");
	cr_assert(start(0, &st), "allowed again, embd starts (exit 0x%x)", st);
	/* and its checkpoints count: none of the damaged ones takes a checkpoint_keep slot */
	char args[256];
	snprintf(args, sizeof(args), "checkpoint --wait --socket %s", services[0].socket);
	cr_expect_eq(embctl(args), 0, "embctl checkpoint --wait after the fresh start");
	cr_expect_eq(tu_count_entries(ckdir, "step-0"), 1, "the new checkpoint of step 0 is kept");
	cr_expect_eq(tu_count_entries(dmg, "step-"), 2, "damaged checkpoints are never deleted");
}

/* ---- one owner per checkpoint directory --------------------------------------------------- */

Test(hostile_operator, a_second_embd_on_the_same_checkpoint_dir_is_refused)
{
	char pid[32], args[1024], npy[192];
	int st;

	write_config("");
	cr_assert(start(0, &st), "the first embd (exit 0x%x)", st);
	snprintf(pid, sizeof(pid), "pid %d", (int)services[0].pid);
	cr_expect(!start(1, &st), "a second embd on the same checkpoint_dir must be refused");
	cr_expect(tu_embd_log_has(&services[1], pid) && tu_embd_log_has(&services[1], ckdir),
		  "the refusal names the holder's %s and the directory (see %s)", pid,
		  services[1].log);
	/* embctl import would write a step the running embd might remove or restore */
	snprintf(npy, sizeof(npy), "%s/w.npy", base);
	write_npy(npy, 0.5f, UINT32_MAX, 0);
	snprintf(args, sizeof(args), "import --config %s --step 7 --table t -i %s", config_path, npy);
	cr_expect_eq(embctl(args), 1, "embctl import into a running embd's directory");
	cr_expect(file_has(out_path, pid), "the import refusal names %s", pid);
	cr_expect_eq(tu_count_entries(ckdir, "step-7"), 0);
	/* once it stopped (even killed), the directory is free */
	stop(&services[0]);
	cr_expect_eq(embctl(args), 0, "embctl import after embd exited");
	cr_expect(start(1, &st), "an embd after the first one died (exit 0x%x)", st);
}

/* ---- NaN and infinite gradients ----------------------------------------------------------- */

/* Posts op of `step` for both trainers (slot = step % 2) and waits for both completions. */
static void both(struct embd_client **c, enum embd_request_op op, uint64_t step, int *result)
{
	for (int i = 0; i < 2; i++) {
		struct embd_request req = { .op = op, .slot = (uint32_t)(step % 2), .step = step,
					    .num_values = B };
		cr_assert_eq(embd_submit(c[i], &req), 0, "%s", embd_last_error(c[i]));
	}
	for (int i = 0; i < 2; i++) {
		struct embd_completion done;
		cr_assert_eq(embd_wait(c[i], &done, 10000), 0, "trainer %d: %s", i,
			     embd_last_error(c[i]));
		result[i] = done.result;
	}
}

/* One trainer's NaN gradient: the step is refused for both trainers, nothing is applied (the
 * next forward pools the same rows to the same values), the log and stats say so. */
Test(hostile_operator, a_nan_gradient_is_refused_for_every_trainer)
{
	struct embd_client *c[2];
	struct embd_batch b[2][2];
	float before[2][B * DIM];
	char err[256], args[256];
	int st, res[2];

	trainers = 2;
	write_config("");
	cr_assert(start(0, &st), "embd (exit 0x%x)", st);
	for (int i = 0; i < 2; i++) {
		cr_assert_eq(embd_connect(services[0].socket, i, 10000, &c[i], err, sizeof(err)), 0,
			     "%s", err);
		for (uint32_t slot = 0; slot < 2; slot++) {
			embd_batch_get(c[i], slot, &b[i][slot]);
			for (uint32_t k = 0; k < B; k++) {
				b[i][slot].lengths[k] = 1;
				b[i][slot].values[k] = 3 + k;   /* both trainers on rows 3..6 */
			}
			for (uint32_t k = 0; k < B * DIM; k++)
				b[i][slot].grad[k] = 0.25f;
		}
	}
	b[1][0].grad[2 * DIM + 5] = NAN;                 /* trainer 1: sample 2, column 5 */
	both(c, EMBD_REQUEST_FORWARD, 0, res);
	cr_assert(res[0] == 0 && res[1] == 0, "forward: %d %d", res[0], res[1]);
	for (int i = 0; i < 2; i++)
		memcpy(before[i], b[i][0].pooled, sizeof(before[i]));
	both(c, EMBD_REQUEST_BACKWARD, 0, res);
	for (int i = 0; i < 2; i++) {
		cr_expect_eq(res[i], EMBD_ECANCELED, "trainer %d: the step must be refused for every "
			     "trainer, got %d", i, res[i]);
		cr_expect(strstr(embd_last_error(c[i]), "trainer 1 of node 0") &&
			  strstr(embd_last_error(c[i]), "NaN at sample 2, column 5 (feature 'f')"),
			  "trainer %d's error must name trainer, sample, column: '%s'", i,
			  embd_last_error(c[i]));
	}
	both(c, EMBD_REQUEST_FORWARD, 1, res);
	cr_assert(res[0] == 0 && res[1] == 0, "the next step runs: %d %d", res[0], res[1]);
	for (int i = 0; i < 2; i++)
		cr_expect(!memcmp(before[i], b[i][1].pooled, sizeof(before[i])), "trainer %d: the "
			  "refused step must have changed no row", i);
	both(c, EMBD_REQUEST_BACKWARD, 1, res);
	cr_expect(res[0] == 0 && res[1] == 0, "a finite step trains: %d %d", res[0], res[1]);
	snprintf(args, sizeof(args), "stats --json --socket %s", services[0].socket);
	cr_expect_eq(embctl(args), 0);
	cr_expect(file_has(out_path, "\"nonfinite_grads\":1") &&
		  file_has(out_path, "\"aborted_steps\":1"), "stats count it (see %s)", out_path);
	cr_expect(tu_embd_log_has(&services[0], "sent a gradient that is NaN"), "the log says why");
	embd_close(c[0]);
	embd_close(c[1]);
}

/* The hostile trainer's other hand: flips one gradient element between 0.25 and NaN, about
 * every 100 ns, while the service checks and applies the gradient. */
struct flipper {
	volatile float *at;
	atomic_bool stop;
};

static void *flip(void *arg)
{
	struct flipper *f = arg;

	while (!atomic_load_explicit(&f->stop, memory_order_relaxed))
		for (int v = 0; v < 2; v++) {
			*f->at = v ? 0.25f : NAN;
			for (volatile int spin = 0; spin < 50; spin++)
				;
		}
	*f->at = 0.25f;
	return NULL;
}

/* A trainer rewrites its gradient in the slab while the service works on its BACKWARD: a step
 * is refused or trains on finite values, never a NaN row (the service checks and uses its own
 * copy, daemon/server_schedule.c). The flips must hit both ways for the test to mean anything:
 * some steps refused, some applied. */
Test(hostile_operator, a_gradient_rewritten_during_the_backward_never_reaches_a_row)
{
	struct embd_client *c;
	struct embd_batch b[2];
	struct flipper f;
	pthread_t th;
	char err[256];
	uint32_t applied = 0, refused = 0, step = 0;
	int st, rc;

	write_config("");
	cr_assert(start(0, &st), "embd (exit 0x%x)", st);
	cr_assert_eq(embd_connect(services[0].socket, 0, 10000, &c, err, sizeof(err)), 0, "%s", err);
	for (uint32_t slot = 0; slot < 2; slot++) {
		embd_batch_get(c, slot, &b[slot]);
		for (uint32_t k = 0; k < B; k++) {
			b[slot].lengths[k] = 1;
			b[slot].values[k] = 3 + k;
		}
		for (uint32_t k = 0; k < B * DIM; k++)
			b[slot].grad[k] = 0.25f;
	}
	uint64_t until = (uint64_t)time(NULL) + 4;
	for (; step < 5000 && (applied < 50 || refused < 50) && (uint64_t)time(NULL) < until; step++) {
		const uint32_t slot = step % 2;
		cr_assert_eq(rc = embd_forward(c, slot, step, B, 0), 0, "forward %u: %d %s", step, rc,
			     embd_last_error(c));
		for (uint32_t k = 0; k < B * DIM; k++)
			cr_assert(isfinite(b[slot].pooled[k]), "step %u: a row became %g after %u steps "
				  "applied, %u refused: a non-finite gradient reached it", step,
				  b[slot].pooled[k], applied, refused);
		f = (struct flipper){ .at = &b[slot].grad[1 * DIM + 2] };
		cr_assert_eq(pthread_create(&th, NULL, flip, &f), 0);
		rc = embd_backward(c, slot, step, B, 0);
		atomic_store(&f.stop, true);
		pthread_join(th, NULL);
		cr_assert(rc == 0 || rc == EMBD_ECANCELED, "backward %u: %d %s", step, rc,
			  embd_last_error(c));
		applied += rc == 0;
		refused += rc == EMBD_ECANCELED;
	}
	cr_expect(applied > 0 && refused > 0, "the flips must race the check both ways: %u steps "
		  "applied, %u refused", applied, refused);
	cr_log_info("%u steps: %u applied, %u refused", step, applied, refused);
	embd_close(c);
}

/* ---- embctl ------------------------------------------------------------------------------- */

Test(hostile_operator, embctl_numbers_are_parsed_strictly)
{
	static const struct { const char *args, *flag, *value; } bad[] = {
		{ "import --config %s --step -5 --table t -i x.npy", "--step", "'-5'" },
		{ "import --config %s --step abc --table t -i x.npy", "--step", "'abc'" },
		{ "import --config %s --step 5x --table t -i x.npy", "--step", "'5x'" },
		{ "import --config %s --step 99999999999999999999 --table t -i x.npy", "--step", "'9999" },
		{ "export --config %s --step -1 --table t -o x.npy", "--step", "'-1'" },
		{ "export --config %s --step 1e3 --table t -o x.npy", "--step", "'1e3'" },
		{ "stats --watch abc --socket %s", "--watch", "'abc'" },
		{ "checkpoint --timeout -3 --socket %s", "--timeout", "'-3'" },
		{ "checkpoint --timeout ' 5' --socket %s", "--timeout", "' 5'" },
	};
	char args[512];

	write_config("");
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		snprintf(args, sizeof(args), bad[i].args, config_path);
		cr_expect_eq(embctl(args), 2, "embctl %s: expected a usage error", args);
		cr_expect(file_has(out_path, bad[i].flag) && file_has(out_path, bad[i].value),
			  "embctl %s: the error must name %s and %s", args, bad[i].flag, bad[i].value);
	}
	cr_expect_eq(tu_count_entries(ckdir, "step-"), 0, "nothing written (step-18446744073709551611 was)");
}

Test(hostile_operator, embctl_export_never_writes_into_the_checkpoint_it_reads)
{
	char args[1024], target[256], link[192];

	write_config("");
	import_step(3, 0.5f);
	snprintf(target, sizeof(target), "%s/step-3/t0.import.weight.npy", ckdir);
	snprintf(args, sizeof(args), "export --dir %s --table t -o %s", ckdir, target);
	cr_expect_eq(embctl(args), 1, "export -o onto the checkpoint's own file");
	cr_expect(file_has(out_path, "inside the checkpoint"), "got: see %s", out_path);
	snprintf(link, sizeof(link), "%s/link.npy", base);
	cr_assert_eq(symlink(target, link), 0);
	snprintf(args, sizeof(args), "export --dir %s --table t -o %s", ckdir, link);
	cr_expect_eq(embctl(args), 1, "export -o through a symlink into the checkpoint");
	snprintf(args, sizeof(args), "export --dir %s --table t -o %s/step-3/more.npy", ckdir, ckdir);
	cr_expect_eq(embctl(args), 1, "export -o of a new file inside the checkpoint");
	struct embd_ckpt_manifest m;
	char dir[4300], err[512];
	cr_expect_eq(embd_ckpt_find(ckdir, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err,
				    sizeof(err)), 0, "the checkpoint must still be valid: %s", err);
	embd_ckpt_manifest_free(&m);
	snprintf(args, sizeof(args), "export --dir %s --table t -o %s/t.npy", ckdir, base);
	cr_expect_eq(embctl(args), 0, "export -o outside the checkpoint");
}

Test(hostile_operator, embctl_import_refuses_what_would_train_nan)
{
	char args[1024], npy[192], ok[192];

	write_config("");
	snprintf(npy, sizeof(npy), "%s/nan.npy", base);
	snprintf(ok, sizeof(ok), "%s/ok.npy", base);
	write_npy(ok, 0.5f, UINT32_MAX, 0);
	/* all NaN, one NaN, one infinity */
	const float bad[3] = { NAN, NAN, INFINITY };
	const uint32_t at[3] = { UINT32_MAX, 3 * DIM + 5, 17 };
	for (int k = 0; k < 3; k++) {
		write_npy(npy, k ? 0.5f : NAN, at[k], bad[k]);
		snprintf(args, sizeof(args), "import --config %s --table t -i %s", config_path, npy);
		cr_expect_eq(embctl(args), 1, "import of a non-finite array (case %d)", k);
		cr_expect(file_has(out_path, k == 2 ? "infinite" : "NaN") &&
			  file_has(out_path, k == 1 ? "(3, 5)" : k == 2 ? "(2, 1)" : "(0, 0)"),
			  "case %d: the error names the element (see %s)", k, out_path);
	}
	snprintf(args, sizeof(args), "import --config %s --table t -i %s --table t -i %s",
		 config_path, ok, npy);
	cr_expect_eq(embctl(args), 1, "the same table twice in one import");
	cr_expect(file_has(out_path, "given twice"), "see %s", out_path);
	cr_expect_eq(tu_count_entries(ckdir, "step-"), 0, "no refused import writes anything");
}

Test(hostile_operator, embctl_import_says_which_checkpoint_embd_restores)
{
	char expect[256];

	write_config("");
	import_step(10, 0.5f);
	cr_expect(file_has(out_path, "embd restores it"), "the newest: see %s", out_path);
	import_step(5, 0.25f);
	snprintf(expect, sizeof(expect), "embd restores %s/step-10", ckdir);
	cr_expect(file_has(out_path, expect), "an import older than step 10: expected '%s' (see %s)",
		  expect, out_path);
}

/* A socket that takes connections and never answers: a hung or stopped service. */
Test(hostile_operator, embctl_checkpoint_gives_up_on_a_service_that_never_answers)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	char args[256];
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	snprintf(a.sun_path, sizeof(a.sun_path), "%s/mute.sock", base);
	cr_assert(fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof(a)) && !listen(fd, 8),
		  "mute socket: %s", strerror(errno));
	cr_expect_eq(embctl("checkpoint --help"), 2);
	cr_expect(file_has(out_path, "default 10"), "the help says the default (see %s)", out_path);
	for (int wait = 0; wait < 2; wait++) {
		struct timespec t0, t1;
		snprintf(args, sizeof(args), "checkpoint %s--socket %s", wait ? "--wait " : "",
			 a.sun_path);
		clock_gettime(CLOCK_MONOTONIC, &t0);
		int rc = embctl(args);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
		cr_expect_eq(rc, 1, "embctl %s: expected a failure", args);
		cr_expect(s > 9 && s < 20, "embctl %s gave up after %.1f s, expected the 10 s default "
			  "(it waited 3600 s)", args, s);
	}
	close(fd);
}
