/*
 * Integration: evaluations (EVAL, embd_eval) against real embd nodes (dist_fixture.h; one node
 * is a cluster of one). Every trainer evaluates its next step's batch before posting that
 * step's FORWARD (and a short first part of it), and on one node the same batch again between
 * FORWARD and BACKWARD: each evaluation returns exactly what the training forward returns (the
 * rows before the step's update), and the training, evaluations and all, still equals the
 * unsharded reference, so evaluations changed nothing. On a cluster the evaluations of every
 * node's trainers run as rounds of their own between the steps. Refusals: a FORWARD while the
 * trainer's BACKWARD is due (at once, naming the step), on a cluster an EVAL while the
 * BACKWARD is due or while another trainer of the node posted a FORWARD, and a cluster whose
 * nodes disagree on training and evaluating.
 */
#include <criterion/criterion.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "tests/integration/dist_fixture.h"

TestSuite(eval, .fini = stop_cluster, .timeout = 60);

#define SHORT 3                         /* samples of the short evaluation */

/* What the trainers evaluated, beside training_common's struct shared. */
struct evals {
	float before[K_STEPS][MAX_T][BATCH * MAX_COLS];  /* step k's batch, before FORWARD k */
	float part[K_STEPS][MAX_T][SHORT * MAX_COLS];    /* its first SHORT samples */
	float mid[K_STEPS][MAX_T][BATCH * MAX_COLS];     /* between FORWARD k and BACKWARD k */
	int mid_rc[MAX_T];                               /* on a cluster: the refusal */
	char mid_err[MAX_T][256];
};

/* Evaluates trainer tr's step-k batch of nb samples in slot 1 into out. */
static int eval_into(struct embd_client *c, uint32_t k, uint32_t tr, uint32_t nb, float *out)
{
	struct embd_batch b;
	const uint32_t D = embd_layout(c)->total_dim;

	embd_batch_get(c, 1, &b);
	int rc = embd_eval(c, 1, nb, gen_batch_n(k, tr, nb, b.lengths, b.values), 0);
	if (!rc)
		memcpy(out, b.pooled, (size_t)nb * D * sizeof(float));
	return rc;
}

/* Global trainer tr (index local on socket): K steps on slot 0, each preceded by evaluations
 * of its batch and, in the middle of the step, evaluated again (refused on a cluster). */
static int eval_trainer_run(struct shared *sh, struct evals *ev, const char *socket,
			    uint32_t local, uint32_t tr)
{
	struct embd_client *c;
	char *err = sh->err[tr];
	int rc = trainer_connect(sh, socket, local, tr, &c);

	if (rc)
		return rc;
	const struct embd_client_layout *l = embd_layout(c);
	for (uint32_t k = 0; k < K_STEPS && !rc; k++) {
		const uint64_t step = l->resumed_step + k;
		struct embd_batch b;
		rc = eval_into(c, k, tr, BATCH, ev->before[k][tr]);
		if (!rc)
			rc = eval_into(c, k, tr, SHORT, ev->part[k][tr]);
		if (rc) {
			snprintf(err, 256, "step %u evaluations: %s", k, embd_last_error(c));
			break;
		}
		embd_batch_get(c, 0, &b);
		uint64_t n = gen_batch(k, tr, b.lengths, b.values);
		rc = embd_forward(c, 0, step, n, 0);
		if (rc) {
			snprintf(err, 256, "step %u forward: %s", k, embd_last_error(c));
			break;
		}
		memcpy(sh->pooled[k][tr], b.pooled, (size_t)BATCH * l->total_dim * sizeof(float));
		int mid = eval_into(c, k, tr, BATCH, ev->mid[k][tr]);
		if (mid) {
			ev->mid_rc[tr] = mid;
			snprintf(ev->mid_err[tr], 256, "%s", embd_last_error(c));
		}
		for (uint32_t i = 0; i < BATCH; i++)
			for (uint32_t col = 0; col < l->total_dim; col++)
				b.grad[i * l->total_dim + col] = gen_grad(k, tr, i, col);
		rc = embd_backward(c, 0, step, n, 0);
		if (rc)
			snprintf(err, 256, "step %u backward: %s", k, embd_last_error(c));
	}
	embd_close(c);
	return rc;
}

/* Every evaluation of step k's batch equals what FORWARD k returned, bit for bit. */
static void check_evals(const struct shared *sh, const struct evals *ev, uint32_t trainers,
			bool mid)
{
	const uint32_t D = sh->total_dim;

	for (uint32_t k = 0; k < K_STEPS; k++)
		for (uint32_t tr = 0; tr < trainers; tr++) {
			const float *fwd = sh->pooled[k][tr];
			for (uint32_t i = 0; i < BATCH * D; i++) {
				cr_assert_eq(ev->before[k][tr][i], fwd[i], "step %u trainer %u sample %u "
					     "col %u: evaluation before the step %.9g, forward %.9g", k,
					     tr, i / D, i % D, ev->before[k][tr][i], fwd[i]);
				if (i < SHORT * D)
					cr_assert_eq(ev->part[k][tr][i], fwd[i], "step %u trainer %u: short "
						     "evaluation sample %u col %u: %.9g, forward %.9g", k,
						     tr, i / D, i % D, ev->part[k][tr][i], fwd[i]);
				if (mid)
					cr_assert_eq(ev->mid[k][tr][i], fwd[i], "step %u trainer %u "
						     "sample %u col %u: evaluation between forward and "
						     "backward %.9g, forward %.9g", k, tr, i / D, i % D,
						     ev->mid[k][tr][i], fwd[i]);
			}
		}
}

/* N nodes (1: one node) of sharding, RANKS trainers each, evaluating as they train. */
static void train_with_evals(uint32_t N, const char *sharding)
{
	const uint32_t T = N * RANKS;
	pid_t kids[MAX_T];

	start_cluster(N, sharding);
	struct shared *sh = shared_map();
	struct evals *ev = mmap(NULL, sizeof(*ev), PROT_READ | PROT_WRITE,
				MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(ev != MAP_FAILED);
	memset(ev, 0, sizeof(*ev));
	for (uint32_t g = 0; g < T; g++) {
		sh->rc[g] = 1;
		kids[g] = tu_fork_child();
		if (kids[g] == 0) {
			sh->rc[g] = eval_trainer_run(sh, ev, nodes[g / RANKS].embd.socket, g % RANKS,
						     g);
			_exit(0);
		}
	}
	for (uint32_t g = 0; g < T; g++)
		waitpid(kids[g], NULL, 0);
	for (uint32_t g = 0; g < T; g++) {
		cr_assert_eq(sh->rc[g], 0, "trainer %u: %d (%s)", g, sh->rc[g], sh->err[g]);
		if (N > 1)
			cr_expect(ev->mid_rc[g] == EMBD_EINVAL &&
				  strstr(ev->mid_err[g], "BACKWARD of step") &&
				  strstr(ev->mid_err[g], "between steps"),
				  "trainer %u: an evaluation between forward and backward on a "
				  "cluster: expected EMBD_EINVAL naming the backward, got %d '%s'", g,
				  ev->mid_rc[g], ev->mid_err[g]);
		else
			cr_expect_eq(ev->mid_rc[g], 0, "trainer %u: %s", g, ev->mid_err[g]);
	}
	check_evals(sh, ev, T, N == 1);
	check_against_reference(sh, T, "training with evaluations");
	munmap(ev, sizeof(*ev));
	munmap(sh, sizeof(*sh));
}

Test(eval, one_node_row_wise) { train_with_evals(1, "row_wise"); }
Test(eval, one_node_column_wise) { train_with_evals(1, "column_wise"); }
Test(eval, one_node_data_parallel) { train_with_evals(1, "data_parallel"); }
Test(eval, two_nodes_row_wise) { train_with_evals(2, "row_wise"); }
Test(eval, two_nodes_column_wise) { train_with_evals(2, "column_wise"); }
Test(eval, two_nodes_table_wise) { train_with_evals(2, "table_wise"); }
Test(eval, two_nodes_data_parallel) { train_with_evals(2, "data_parallel"); }
Test(eval, three_nodes_table_row_wise) { train_with_evals(3, "table_row_wise"); }

/* ---- refusals ---------------------------------------------------------------------------- */

/* Trainer c (global g) posts step k's batch in slot 0 (no wait); returns its id count. */
static uint64_t post(struct embd_client *c, enum embd_request_op op, uint32_t g, uint32_t k,
		     uint64_t step)
{
	struct embd_batch b;

	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch(k, g, b.lengths, b.values);
	struct embd_request req = { .op = op, .step = step, .num_values = n };
	cr_assert_eq(embd_submit(c, &req), 0, "%s", embd_last_error(c));
	return n;
}

static void expect_completion(struct embd_client *c, int want, const char *what,
			      const char *word)
{
	struct embd_completion done;
	int rc = embd_wait(c, &done, 3000);

	cr_assert_eq(rc, 0, "%s: no completion within 3 s (%d %s)", what, rc, embd_last_error(c));
	cr_expect_eq(done.result, want, "%s: expected %d, got %d (%s)", what, want, done.result,
		     embd_last_error(c));
	cr_expect(!word || strstr(embd_last_error(c), word), "%s: expected '%s' in '%s'", what,
		  word, embd_last_error(c));
}

/* Two row_wise nodes with every trainer connected (c[g]: global trainer g). */
static void connect_two_nodes(struct embd_client **c)
{
	char err[256];

	start_cluster(2, "row_wise");
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		cr_assert_eq(embd_connect(nodes[g / RANKS].embd.socket, (int)(g % RANKS), 5000, &c[g],
					  err, sizeof(err)), 0, "%s", err);
}

/* Two nodes: node 0's trainer 0 posts FORWARD while its trainer 1 posts EVAL: the EVAL is
 * refused naming trainer 0, and the step runs once trainer 1 posts its FORWARD. */
Test(eval, cluster_eval_beside_a_forward_is_refused)
{
	struct embd_client *c[2 * RANKS];

	connect_two_nodes(c);
	uint64_t s = embd_layout(c[0])->resumed_step;
	post(c[0], EMBD_REQUEST_FORWARD, 0, 0, s);
	post(c[1], EMBD_REQUEST_EVAL, 1, 0, 0);
	expect_completion(c[1], EMBD_EINVAL, "EVAL beside trainer 0's FORWARD", "trainer 0");
	for (uint32_t g = 1; g < 2 * RANKS; g++)
		post(c[g], EMBD_REQUEST_FORWARD, g, 0, s);
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		expect_completion(c[g], 0, "the step's forward", NULL);
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		embd_close(c[g]);
}

/* Two nodes: node 0's trainers evaluate while node 1's post a step's FORWARD: the cluster
 * cannot go on, and both say why (then it re-forms). */
Test(eval, cluster_nodes_that_disagree_fail_with_a_reason)
{
	struct embd_client *c[2 * RANKS];

	connect_two_nodes(c);
	uint64_t s = embd_layout(c[0])->resumed_step;
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		post(c[g], g < RANKS ? EMBD_REQUEST_EVAL : EMBD_REQUEST_FORWARD, g, 0, s);
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		expect_completion(c[g], EMBD_EMISMATCH, g < RANKS ? "node 0's evaluation" :
				  "node 1's forward", "evaluates");
	for (uint32_t g = 0; g < 2 * RANKS; g++)
		embd_close(c[g]);
}
