/*
 * tests/integration/training_common.h - what the training integration tests share: the two
 * tables of every config, deterministic batches and gradients of global trainer tr at step k,
 * the trainer process body, and the check of every pooled output against the unsharded
 * reference (tests/support/reference.c) trained on the global batch (trainer 0's bags, then trainer
 * 1's, ...), every trainer's gradient divided by the number of trainers (the service's default
 * gradient_scaling, TorchRec's); with short_batches the trainers' batches have fewer samples
 * than BATCH. Tolerance: REL_TOL relative + ABS_TOL absolute (the service sums row-wise partial
 * sums and the trainers' gradients in another order than the reference).
 */
#ifndef EMBD_TESTS_TRAINING_COMMON_H
#define EMBD_TESTS_TRAINING_COMMON_H

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "tests/support/children.h"
#include "tests/support/mix.h"
#include "tests/support/reference.h"

#define K_STEPS 3
#define BATCH 8
#define SEED 2026u
#define MAX_T 6
#define MAX_COLS 32
#define MAX_F 4
#define REL_TOL 1e-5f
#define ABS_TOL 1e-6f

/* The tables of every config: table id = index (the service's convention, engine/step.c). */
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

/* ---- deterministic batches and gradients ------------------------------------------------- */

static uint32_t feature_table(uint32_t f)
{
	return f < 2 ? 0 : 1;
}

/* Set by a test before its trainers start: their batches have fewer samples than BATCH, as
 * the last batch of an epoch. */
static bool short_batches;

/* Set by a test whose service sums the trainers' gradients ("gradient_scaling": "sum"); by
 * default the service divides each by the trainers of the cluster (TorchRec's gradient
 * division), and so does the reference. */
static bool sum_gradients;

/* Samples of trainer tr's batch at step k: BATCH, or with short_batches 8, 5, 2, ... */
static uint32_t batch_samples(uint32_t k, uint32_t tr)
{
	return short_batches ? BATCH - 3 * ((k + tr) % 3) : BATCH;
}

/* Trainer `tr`'s batch of step k with nb samples (lengths stride nb): lengths 0..3, ids in
 * range; sample b's bags are the same whatever nb. Returns the id count. */
static uint64_t gen_batch_n(uint32_t k, uint32_t tr, uint32_t nb, int32_t *lengths,
			    int64_t *values)
{
	uint64_t n = 0;

	for (uint32_t f = 0; f < NUM_F; f++)
		for (uint32_t b = 0; b < nb; b++) {
			uint64_t h = tu_mix64(((uint64_t)k << 40) ^ ((uint64_t)tr << 32) ^
					      (f << 16) ^ b);
			int32_t len = (int32_t)(h % 4);
			lengths[f * nb + b] = len;
			for (int32_t j = 0; j < len; j++)
				values[n++] = (int64_t)(tu_mix64(h + (uint64_t)j + 1) %
							(uint64_t)tables[feature_table(f)].rows);
		}
	return n;
}

__attribute__((unused))         /* tests that only run trainer_run do not */
static uint64_t gen_batch(uint32_t k, uint32_t tr, int32_t *lengths, int64_t *values)
{
	return gen_batch_n(k, tr, BATCH, lengths, values);
}

/* dL/d(pooled) of trainer tr, step k, bag b, output column col: in [-1, 1]. */
static float gen_grad(uint32_t k, uint32_t tr, uint32_t b, uint32_t col)
{
	uint64_t h = tu_mix64(0x5151000000000000ull ^ ((uint64_t)k << 40) ^
			      ((uint64_t)tr << 32) ^ ((uint64_t)b << 16) ^ col);
	return (float)((int)(h % 2001) - 1000) / 1000.0f;
}

/* ---- trainer processes ------------------------------------------------------------------- */

/* What the trainer processes hand back, in a shared anonymous mapping. */
struct shared {
	uint32_t total_dim;
	uint32_t feature_offset[MAX_F];
	uint32_t feature_dim[MAX_F];
	int rc[MAX_T];
	uint64_t resumed_step[MAX_T];   /* the layout's, at connect */
	char err[MAX_T][256];
	float pooled[K_STEPS][MAX_T][BATCH * MAX_COLS];
	uint32_t late_forwards[K_STEPS];        /* PIPE_MIXED: FORWARDs of step k the odd trainers
						 * posted after their BACKWARD (atomics) */
};

__attribute__((unused))         /* the soak test keeps its own log */
static struct shared *shared_map(void)
{
	void *p = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(p != MAP_FAILED, "mmap: %s", strerror(errno));
	memset(p, 0, sizeof(struct shared));
	return p;
}

/* ---- the reference ----------------------------------------------------------------------- */

static bool close_enough(float want, float got)
{
	return fabsf(want - got) <= ABS_TOL + REL_TOL * fabsf(want);
}

/* Replays the K steps of `trainers` trainers on the unsharded reference and compares; with
 * rounds_before > 0 the reference first trains that many rounds of the same K batches (a
 * service that resumed from a checkpoint of step rounds_before * K). keep (may be NULL) gets
 * the reference's tables as trained (the caller destroys them). */
static void check_against_reference_keep(const struct shared *sh, uint32_t trainers,
					 const char *what, uint32_t rounds_before,
					 struct embd_ref_table **keep)
{
	struct embd_ref_table *ref[NUM_TABLES];
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
	for (uint32_t i = 0; i < (rounds_before + 1) * K_STEPS; i++) {
		const uint32_t k = i % K_STEPS;
		const bool compare = i >= rounds_before * K_STEPS;
		/* the global batch: trainer 0's bags, then trainer 1's, ... per feature; trainer
		 * tr's samples start at first[tr] of it */
		uint64_t pos[MAX_T] = { 0 };
		uint64_t gn[NUM_F] = { 0 };
		uint32_t nb[MAX_T], first[MAX_T + 1] = { 0 }, owner[MAX_T * BATCH];
		for (uint32_t tr = 0; tr < trainers; tr++) {
			nb[tr] = batch_samples(k, tr);
			first[tr + 1] = first[tr] + nb[tr];
			for (uint32_t b = 0; b < nb[tr]; b++)
				owner[first[tr] + b] = tr;
			gen_batch_n(k, tr, nb[tr], lengths[tr], values[tr]);
		}
		const uint32_t GB = first[trainers];
		for (uint32_t f = 0; f < NUM_F; f++)
			for (uint32_t tr = 0; tr < trainers; tr++)
				for (uint32_t b = 0; b < nb[tr]; b++) {
					int32_t len = lengths[tr][f * nb[tr] + b];
					glen[f][first[tr] + b] = len;
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
					const uint32_t tr = owner[g], b = g - first[tr];
					float want = gout[g * D + c];
					float got = sh->pooled[k][tr][b * sh->total_dim + off + c];
					if (compare && !close_enough(want, got) && mismatches++ < 5)
						cr_expect(false, "%s step %u feature %u trainer %u bag %u "
							  "col %u: expected %.9g, got %.9g", what, k, f,
							  tr, b, c, want, got);
					ggrad[f][g * D + c] = gen_grad(k, tr, b, off + c);
				}
		}
		for (uint32_t t = 0; t < NUM_TABLES; t++) {
			struct embd_ref_bags bags[2];
			uint32_t n = 0;
			for (uint32_t f = 0; f < NUM_F; f++)
				if (feature_table(f) == t)
					bags[n++] = (struct embd_ref_bags){
						.batch_size = GB, .lengths = glen[f], .ids = gids[f],
						.pooling = tables[t].pooling, .grad = ggrad[f],
						.grad_divisor = sum_gradients ? 1 : trainers };
			cr_assert_eq(embd_ref_backward(ref[t], bags, n), 0);
		}
	}
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		if (keep)
			keep[t] = ref[t];
		else
			embd_ref_table_destroy(ref[t]);
	}
	cr_expect_eq(mismatches, 0, "%s: expected every pooled output within %g rel + %g abs of "
		     "the reference, got %u mismatches", what, (double)REL_TOL, (double)ABS_TOL,
		     mismatches);
}

__attribute__((unused))
static void check_against_reference_after(const struct shared *sh, uint32_t trainers,
					  const char *what, uint32_t rounds_before)
{
	check_against_reference_keep(sh, trainers, what, rounds_before, NULL);
}

__attribute__((unused))
static void check_against_reference(const struct shared *sh, uint32_t trainers, const char *what)
{
	check_against_reference_keep(sh, trainers, what, 0, NULL);
}

/* The "tables" array of a config, every table forced to sharding (NULL: planner's choice). */
/*
 * The topology's device: EMBD_TEST_COMPUTE_DEVICE=cuda (tests/gpu/run.sh) leaves the ranks to
 * the GPU count (world_size and local_world_size unset); else 2 CPU ranks.
 */
/* Whether tests/gpu/run.sh runs the tests on GPUs (EMBD_TEST_COMPUTE_DEVICE=cuda). */
static inline bool test_on_gpus(void)
{
	const char *device = getenv("EMBD_TEST_COMPUTE_DEVICE");

	return device && !strcmp(device, "cuda");
}

static inline void write_topology_device(FILE *f)
{
	if (test_on_gpus())
		fprintf(f, "\"compute_device\": \"cuda\"");
	else
		fprintf(f, "\"world_size\": 2, \"local_world_size\": 2, "
			"\"compute_device\": \"cpu\"");
}

static void write_tables(FILE *f, const char *sharding)
{
	fprintf(f, "\"tables\": [\n");
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		const struct test_table *tt = &tables[t];
		fprintf(f, "  {\"name\": \"%s\", \"num_embeddings\": %lld, \"embedding_dim\": %u, "
			"\"pooling\": \"%s\", \"data_type\": \"fp32\", \"feature_names\": [",
			tt->name, (long long)tt->rows, tt->dim, tt->pooling_name);
		for (uint32_t k = 0; k < tt->num_features; k++)
			fprintf(f, "%s\"%s\"", k ? ", " : "", tt->features[k]);
		fprintf(f, "], \"optimizer\": %s", tt->opt_json);
		/* EMBD_TEST_COMPUTE_KERNEL (tests/gpu/run.sh: fused, fused_uvm): every table's
		 * kernel but data_parallel's, which the planner runs dense only */
		const char *kernel = getenv("EMBD_TEST_COMPUTE_KERNEL");
		bool dp = sharding && !strcmp(sharding, "data_parallel");
		if (sharding)
			fprintf(f, ", \"constraints\": {\"sharding_types\": [\"%s\"], "
				"\"min_partition\": 4%s%s%s}", sharding,
				kernel && !dp ? ", \"compute_kernels\": [\"" : "",
				kernel && !dp ? kernel : "", kernel && !dp ? "\"]" : "");
		fprintf(f, "}%s\n", t + 1 < NUM_TABLES ? "," : "");
	}
	fprintf(f, "]");
}

/*
 * Connects global trainer tr as index `local` of the service at socket into *out and checks
 * its layout; trainer 0 notes where each feature sits in the outputs (for the reference
 * check). 0 or a negative code (text in sh->err[tr]).
 */
static int trainer_connect(struct shared *sh, const char *socket, uint32_t local, uint32_t tr,
			   struct embd_client **out)
{
	char *err = sh->err[tr];
	int rc = embd_connect(socket, (int)local, 10000, out, err, 256);

	if (rc)
		return rc;
	const struct embd_client_layout *l = embd_layout(*out);
	if (l->num_features != NUM_F || l->batch_size != BATCH || l->total_dim > MAX_COLS) {
		snprintf(err, 256, "layout: %u features, B %u, %u columns; expected %u, %u, <= %u",
			 l->num_features, l->batch_size, l->total_dim, NUM_F, BATCH, MAX_COLS);
		embd_close(*out);
		return EMBD_EPROTO;
	}
	sh->resumed_step[tr] = l->resumed_step;
	if (tr == 0) {
		sh->total_dim = l->total_dim;
		for (uint32_t f = 0; f < NUM_F; f++) {
			sh->feature_offset[f] = l->features[f].offset;
			sh->feature_dim[f] = l->features[f].dim;
		}
	}
	return 0;
}

/* Set by a test before its trainers start: they pipeline their steps (engine/step.h,
 * embd_step_prepare), posting FORWARD k + 1 and BACKWARD k, then awaiting both. PIPE_BEFORE:
 * the FORWARD first, so the service holds every trainer's before the backward can run (every
 * step after the first is prepared); PIPE_MIXED: odd trainers post it right after their
 * BACKWARD, and the even ones post their BACKWARD only once every odd trainer's FORWARD is
 * posted, so the last BACKWARD finds every FORWARD of the next step posted (taken early or
 * still in its ring: either way every step after the first is prepared). */
enum { PIPE_OFF, PIPE_BEFORE, PIPE_MIXED };
static int pipelined_trainers;
/* ... for the global trainers from this one on; those before it step unpipelined (a cluster
 * whose first nodes do not pipeline). */
static uint32_t pipelined_from_trainer;

/* Writes trainer tr's batch of step k into slot k % 2 and posts its FORWARD (user_data k). */
static int post_forward(struct embd_client *c, uint32_t tr, uint32_t k, uint64_t first_step)
{
	struct embd_batch b;
	const uint32_t nb = batch_samples(k, tr);

	embd_batch_get(c, k % 2, &b);
	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = k % 2,
				    .step = first_step + k, .batch_size = nb, .user_data = k,
				    .num_values = gen_batch_n(k, tr, nb, b.lengths, b.values) };
	return embd_submit(c, &req);
}

/* The completions of n requests: 0, or the first failure (text in err). */
static int await_completions(struct embd_client *c, uint32_t n, char *err)
{
	for (uint32_t i = 0; i < n; i++) {
		struct embd_completion done;
		int rc = embd_wait(c, &done, 20000);
		if (!rc)
			rc = done.result;
		if (rc) {
			snprintf(err, 256, "request %llu: %s", (unsigned long long)done.user_data,
				 embd_last_error(c));
			return rc;
		}
	}
	return 0;
}

/* PIPE_MIXED: until n odd trainers posted their FORWARD of step k (20 s at most). */
static int await_late_forwards(struct shared *sh, uint32_t k, uint32_t n, char *err)
{
	for (int waited_ms = 0; __atomic_load_n(&sh->late_forwards[k], __ATOMIC_ACQUIRE) < n;
	     waited_ms++) {
		if (waited_ms == 20000) {
			snprintf(err, 256, "step %u: the odd trainers' FORWARDs never came", k);
			return EMBD_ETIMEDOUT;
		}
		usleep(1000);
	}
	return 0;
}

/* Set by a test whose trainers' pooled and grad are device memory (device outputs on a GPU):
 * copies bytes between host memory and them, complete on return (the service reads a
 * gradient once its BACKWARD is posted). NULL: memcpy. 0 or a code (text in err). */
static int (*trainer_copy)(void *dst, const void *src, size_t bytes, char *err);

/* Step k's pooled rows of trainer tr (nb samples) out of b into sh, its gradient into b. */
static int take_output_give_grad(struct shared *sh, struct embd_client *c,
				 const struct embd_batch *b, uint32_t k, uint32_t tr, uint32_t nb)
{
	const uint32_t D = embd_layout(c)->total_dim;
	const size_t bytes = (size_t)nb * D * sizeof(float);
	float grad[BATCH * MAX_COLS];

	for (uint32_t i = 0; i < nb; i++)
		for (uint32_t col = 0; col < D; col++)
			grad[i * D + col] = gen_grad(k, tr, i, col);
	if (!trainer_copy) {
		memcpy(sh->pooled[k][tr], b->pooled, bytes);
		memcpy(b->grad, grad, bytes);
		return 0;
	}
	int rc = trainer_copy(sh->pooled[k][tr], b->pooled, bytes, sh->err[tr]);
	return rc ? rc : trainer_copy(b->grad, grad, bytes, sh->err[tr]);
}

/* trainer_run's K steps on connected handle c, pipelined (pipelined_trainers). */
static int pipelined_steps(struct shared *sh, struct embd_client *c, uint32_t tr)
{
	const struct embd_client_layout *l = embd_layout(c);
	char *err = sh->err[tr];
	int rc = post_forward(c, tr, 0, l->resumed_step);

	if (!rc)
		rc = await_completions(c, 1, err);
	for (uint32_t k = 0; k < K_STEPS && !rc; k++) {
		struct embd_batch b;
		const uint32_t nb = batch_samples(k, tr);
		embd_batch_get(c, k % 2, &b);
		rc = take_output_give_grad(sh, c, &b, k, tr, nb);
		const struct embd_request bwd = { .op = EMBD_REQUEST_BACKWARD, .slot = k % 2,
						  .step = l->resumed_step + k, .batch_size = nb,
						  .user_data = 1000 + k };
		const bool next = k + 1 < K_STEPS;
		const bool first = pipelined_trainers == PIPE_BEFORE || tr % 2 == 0;
		if (!rc && next && first)
			rc = post_forward(c, tr, k + 1, l->resumed_step);
		if (!rc && next && pipelined_trainers == PIPE_MIXED && first)
			rc = await_late_forwards(sh, k + 1, l->trainers_per_node / 2, err);
		if (!rc)
			rc = embd_submit(c, &bwd);
		if (!rc && next && !first) {
			rc = post_forward(c, tr, k + 1, l->resumed_step);
			__atomic_add_fetch(&sh->late_forwards[k + 1], 1, __ATOMIC_RELEASE);
		}
		if (!rc)
			rc = await_completions(c, next ? 2 : 1, err);
	}
	return rc;
}

/* Set by a test before its trainers start: runs in each trainer once it connected, before
 * its first step (e.g. to ask for device outputs: the steps then go through them, as
 * embd_batch_get hands out their pointers). 0, or a code that ends the trainer (text in
 * sh->err[tr]). */
static int (*trainer_connected)(struct shared *sh, struct embd_client *c, uint32_t tr);

/* The body of global trainer tr, index `local` of the service at socket: K steps on slot
 * k % 2; 0 or a negative code (text in sh->err). */
static int trainer_run(struct shared *sh, const char *socket, uint32_t local, uint32_t tr)
{
	struct embd_client *c;
	char *err = sh->err[tr];
	int rc = trainer_connect(sh, socket, local, tr, &c);

	if (!rc && trainer_connected && (rc = trainer_connected(sh, c, tr)))
		embd_close(c);
	if (rc)
		return rc;
	const struct embd_client_layout *l = embd_layout(c);
	if (pipelined_trainers && tr >= pipelined_from_trainer) {
		rc = pipelined_steps(sh, c, tr);
		embd_close(c);
		return rc;
	}
	for (uint32_t k = 0; k < K_STEPS && !rc; k++) {
		struct embd_batch b;
		const uint32_t nb = batch_samples(k, tr);
		embd_batch_get(c, k % 2, &b);
		struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = k % 2,
					    .step = l->resumed_step + k, .batch_size = nb,
					    .num_values = gen_batch_n(k, tr, nb, b.lengths, b.values) };
		rc = embd_run(c, &req);
		if (rc) {
			snprintf(err, 256, "step %u forward: %s", k, embd_last_error(c));
			break;
		}
		if ((rc = take_output_give_grad(sh, c, &b, k, tr, nb)))
			break;
		req.op = EMBD_REQUEST_BACKWARD;
		rc = embd_run(c, &req);
		if (rc)
			snprintf(err, 256, "step %u backward: %s", k, embd_last_error(c));
	}
	embd_close(c);
	return rc;
}

/* Runs in each trainer process of run_trainers before it connects, with the index of its
 * socket (its node), or NULL: e.g. to enter the node's network namespace. */
static void (*trainer_setup)(uint32_t socket_index);

/* Runs trainers 0..n-1 as processes, trainer g on sockets[g / per_socket] with index
 * g % per_socket, and asserts that each finished its K steps. */
__attribute__((unused))        /* tests that drive their trainers step by step do not */
static void run_trainers(struct shared *sh, uint32_t n, const char *const *sockets,
			 uint32_t per_socket)
{
	pid_t kids[MAX_T];

	for (uint32_t g = 0; g < n; g++) {
		sh->rc[g] = 1;  /* "did not report" */
		kids[g] = tu_fork_child();
		if (kids[g] == 0) {
			if (trainer_setup)
				trainer_setup(g / per_socket);
			sh->rc[g] = trainer_run(sh, sockets[g / per_socket], g % per_socket, g);
			_exit(0);
		}
	}
	for (uint32_t g = 0; g < n; g++) {
		int st;
		waitpid(kids[g], &st, 0);
		cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0,
			  "trainer %u: expected exit 0, got status 0x%x", g, st);
	}
	for (uint32_t g = 0; g < n; g++)
		cr_assert_eq(sh->rc[g], 0, "trainer %u (on %s): expected 0, got %d (%s)", g,
			     sockets[g / per_socket], sh->rc[g], sh->err[g]);
}

#endif
