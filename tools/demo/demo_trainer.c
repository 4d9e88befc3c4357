/*
 * embd-demo-trainer: a small click-through model trained through embd, linking only
 * libembdclient. Synthetic data with a planted signal: every id of every feature has a
 * hidden score of +1 or -1 (a hash), and a sample is clicked with probability
 * sigmoid(SIGNAL * sum over features of the feature's pooled score), pooled as its table pools
 * (sum, or mean). That logit is linear in the pooled embeddings, so logistic regression over
 * them (dense weights kept in this process) can reach the data's own noise floor, far below
 * the 0.69 of guessing; the embeddings are trained by embd's fused optimizer from
 * dL/d(pooled). The printed loss falls only if both halves learn.
 */
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/client.h"

#define VOCAB 200u          /* distinct ids per feature: small, so each id recurs often */
#define DENSE_LR 0.5f
#define SIGNAL 1.0          /* logit per unit of pooled hidden score: the noise floor is ~0.3 */

static uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	return x ^ (x >> 33);
}

static float hidden_score(uint32_t feature, int64_t id)
{
	return (mix((uint64_t)id * 1315423911u + feature) & 1) ? 1.0f : -1.0f;
}

static double uniform01(uint64_t *state)
{
	*state = mix(*state + 0x9e3779b97f4a7c15ULL);
	return (double)(*state >> 11) / 9007199254740992.0;
}

/*
 * Fills a batch slot with one synthetic batch (1..3 ids per feature and sample, within
 * max_values) and its labels; score is B-entry scratch (the logits). Returns the id count,
 * and in *floor the mean log loss of the true click probabilities on these labels: the best
 * any model can do on this batch.
 */
static uint64_t make_batch(const struct embd_client_layout *l, struct embd_batch *b,
			   float *labels, float *score, uint64_t *rng, double *floor)
{
	uint32_t B = l->batch_size, F = l->num_features;
	uint64_t per_sample = l->max_values / ((uint64_t)B * F), n = 0;

	if (per_sample > 3)
		per_sample = 3;
	if (per_sample < 1)
		per_sample = 1;
	memset(score, 0, B * sizeof(float));
	for (uint32_t f = 0; f < F; f++) {
		const struct embd_client_table *t = &l->tables[l->features[f].table];
		uint32_t vocab = t->num_embeddings < VOCAB ? (uint32_t)t->num_embeddings : VOCAB;
		for (uint32_t s = 0; s < B; s++) {
			int32_t len = 1 + (int32_t)(uniform01(rng) * (double)per_sample);
			if (len > (int32_t)per_sample)
				len = (int32_t)per_sample;
			b->lengths[f * B + s] = len;
			float bag = 0;
			for (int32_t k = 0; k < len; k++) {
				int64_t id = (int64_t)(uniform01(rng) * vocab);
				b->values[n++] = id;
				bag += hidden_score(f, id);
			}
			score[s] += t->pooling == EMBD_POOLING_MEAN ? bag / (float)len : bag;
		}
	}
	*floor = 0;
	for (uint32_t s = 0; s < B; s++) {
		double p = 1.0 / (1.0 + exp(-SIGNAL * score[s]));
		labels[s] = uniform01(rng) < p ? 1.0f : 0.0f;
		*floor -= labels[s] ? log(p) : log(1 - p);
	}
	*floor /= B;
	return n;
}

/*
 * Logistic regression over the pooled row of each sample: writes dL/d(pooled) into grad,
 * updates the dense weights w (D + 1, bias last) and returns the mean log loss.
 */
static double dense_step(const struct embd_client_layout *l, const struct embd_batch *b,
			 const float *labels, float *w)
{
	uint32_t B = l->batch_size, D = l->total_dim;
	double loss = 0;

	for (uint32_t s = 0; s < B; s++) {
		const float *x = b->pooled + (uint64_t)s * D;
		double z = w[D];
		for (uint32_t j = 0; j < D; j++)
			z += (double)w[j] * x[j];
		double p = 1.0 / (1.0 + exp(-z));
		loss -= labels[s] ? log(p + 1e-12) : log(1 - p + 1e-12);
		float g = (float)(p - labels[s]) / (float)B;   /* dL/dz of the mean loss */
		for (uint32_t j = 0; j < D; j++) {
			b->grad[(uint64_t)s * D + j] = g * w[j];
			w[j] -= DENSE_LR * g * x[j];
		}
		w[D] -= DENSE_LR * g;
	}
	return loss / B;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: embd-demo-trainer [--socket PATH] [--index I] [--steps N] [--print-every N]\n"
		"  trains a click-through model through embd and prints its loss; exits 1 when the\n"
		"  mean loss of the last print interval is not below that of the first\n");
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' }, { "index", required_argument, NULL, 'i' },
		{ "steps", required_argument, NULL, 'n' }, { "print-every", required_argument, NULL, 'p' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	const char *socket_path = "/run/embd/embd.sock";
	int index = EMBD_CLIENT_ANY_INDEX, opt, rc = 1;
	long steps = 1000, every = 100;
	struct embd_client *c = NULL;
	float *labels = NULL, *score = NULL, *w = NULL;
	char err[1200];

	while ((opt = getopt_long(argc, argv, "s:i:n:p:h", opts, NULL)) != -1) {
		switch (opt) {
		case 's': socket_path = optarg; break;
		case 'i': index = atoi(optarg); break;
		case 'n': steps = atol(optarg); break;
		case 'p': every = atol(optarg); break;
		case 'h': usage(); return 0;
		default: usage(); return 2;
		}
	}
	if (steps < 2 || every < 1 || every > steps) {
		usage();
		return 2;
	}
	int erc = embd_connect(socket_path, index, 10000, &c, err, sizeof(err));
	if (erc) {
		fprintf(stderr, "demo: connect %s: %s (%s)\n", socket_path, err, embd_strerror(erc));
		return 1;
	}
	const struct embd_client_layout *l = embd_layout(c);
	uint32_t B = l->batch_size, D = l->total_dim;
	labels = calloc(B, sizeof(float));
	score = calloc(B, sizeof(float));
	w = calloc(D + 1, sizeof(float));
	if (!labels || !score || !w)
		goto out;
	uint64_t rng = 0x5eed0000u + (uint64_t)l->index;
	for (uint32_t j = 0; j < D; j++)
		w[j] = (float)(uniform01(&rng) - 0.5) * 0.2f;
	double start = 0, first = -1, last = 0, sum = 0, floor_sum = 0, floor_last = 0;
	uint64_t step = l->resumed_step;
	for (long i = 0; i < steps; i++, step++) {
		struct embd_batch b;
		uint32_t slot = (uint32_t)(step % EMBD_CLIENT_SLOTS);
		embd_batch_get(c, slot, &b);
		double floor;
		uint64_t n = make_batch(l, &b, labels, score, &rng, &floor);
		erc = embd_forward(c, slot, step, n, 0);
		if (!erc) {
			double loss = dense_step(l, &b, labels, w);
			if (i == 0)
				start = loss;
			sum += loss;
			floor_sum += floor;
			erc = embd_backward(c, slot, step, n, 0);
		}
		if (erc) {
			fprintf(stderr, "demo: trainer %d step %llu: %s\n", l->index,
				(unsigned long long)step, embd_last_error(c));
			goto out;
		}
		if ((i + 1) % every == 0) {
			last = sum / every;
			floor_last = floor_sum / every;
			if (first < 0)
				first = last;
			printf("trainer %d step %llu loss %.4f (noise floor %.4f)\n", l->index,
			       (unsigned long long)step, last, floor_last);
			fflush(stdout);
			sum = floor_sum = 0;
		}
	}
	rc = last < first ? 0 : 1;
	printf("trainer %d: loss %.4f at its first step, %.4f over its first %ld steps, %.4f over "
	       "its last %ld (noise floor %.4f): %s\n", l->index, start, first, every, last, every,
	       floor_last, rc ? "did NOT fall" : "fell");
out:
	free(labels);
	free(score);
	free(w);
	embd_close(c);
	return rc;
}
