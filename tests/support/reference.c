/*
 * The plain reference: whole tables, dense gradients, one loop per formula. Slow on purpose
 * and easy to check by eye; see reference.h for why it matches the kernels bit for bit.
 */
#include "tests/support/reference.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/device.h"
#include "kernels/embedding.h"

struct embd_ref_table *embd_ref_table_create(uint32_t table_id, int64_t rows, uint32_t dim,
					     enum embd_data_type dtype,
					     const struct embd_optimizer_spec *opt, uint64_t seed)
{
	struct embd_ref_table *t = calloc(1, sizeof(*t));
	uint64_t n = (uint64_t)rows * dim;

	if (!t)
		return NULL;
	t->table_id = table_id;
	t->rows = rows;
	t->dim = dim;
	t->dtype = dtype;
	t->opt = *opt;
	if (dtype == EMBD_DTYPE_FP16)
		t->w16 = malloc(n * sizeof(*t->w16));
	else
		t->w32 = malloc(n * sizeof(*t->w32));
	if (opt->type == EMBD_OPT_ADAGRAD || opt->type == EMBD_OPT_ADAM)
		t->m1 = calloc(n, sizeof(float));
	if (opt->type == EMBD_OPT_ROWWISE_ADAGRAD)
		t->m1 = calloc((uint64_t)rows, sizeof(float));
	if (opt->type == EMBD_OPT_ADAM)
		t->m2 = calloc(n, sizeof(float));
	if ((!t->w16 && !t->w32) || (opt->type != EMBD_OPT_SGD && !t->m1) ||
	    (opt->type == EMBD_OPT_ADAM && !t->m2)) {
		embd_ref_table_destroy(t);
		return NULL;
	}
	for (int64_t r = 0; r < rows; r++) {
		for (uint32_t c = 0; c < dim; c++) {
			float v = embd_init_value(seed, table_id, rows, r, c);
			if (t->w16)
				t->w16[(uint64_t)r * dim + c] = embd_fp32_to_fp16(v);
			else
				t->w32[(uint64_t)r * dim + c] = v;
		}
	}
	return t;
}

void embd_ref_table_destroy(struct embd_ref_table *t)
{
	if (!t)
		return;
	free(t->w32);
	free(t->w16);
	free(t->m1);
	free(t->m2);
	free(t);
}

float embd_ref_weight(const struct embd_ref_table *t, int64_t row, uint32_t col)
{
	uint64_t i = (uint64_t)row * t->dim + col;
	return t->w16 ? embd_fp16_to_fp32(t->w16[i]) : t->w32[i];
}

static void set_weight(struct embd_ref_table *t, int64_t row, uint32_t col, float v)
{
	uint64_t i = (uint64_t)row * t->dim + col;
	if (t->w16)
		t->w16[i] = embd_fp32_to_fp16(v);
	else
		t->w32[i] = v;
}

static float bag_scale(enum embd_pooling pooling, int32_t len)
{
	if (pooling == EMBD_POOLING_SUM)
		return 1.0f;
	return len > 0 ? 1.0f / (float)len : 0.0f;
}

/* The bag's scale with TorchRec's gradient division: dL/d(pooled) / grad_divisor. */
static float grad_scale(const struct embd_ref_bags *bags, int32_t len)
{
	float s = bag_scale(bags->pooling, len);
	return bags->grad_divisor > 1 ? s / (float)bags->grad_divisor : s;
}

void embd_ref_forward(const struct embd_ref_table *t, const struct embd_ref_bags *bags, float *out)
{
	const int64_t *id = bags->ids;
	const float *w = bags->weights;

	for (uint32_t b = 0; b < bags->batch_size; b++) {
		float *o = out + (uint64_t)b * t->dim;
		int32_t len = bags->lengths[b];

		for (uint32_t c = 0; c < t->dim; c++)
			o[c] = 0.0f;
		for (int32_t k = 0; k < len; k++, id++) {
			float wk = w ? *w++ : 1.0f;
			for (uint32_t c = 0; c < t->dim; c++)
				o[c] = fmaf(wk, embd_ref_weight(t, *id, c), o[c]);
		}
		float s = bag_scale(bags->pooling, len);
		for (uint32_t c = 0; c < t->dim; c++)
			o[c] = o[c] * s;
	}
}

/* One row of one optimizer, straight from the formulas in kernels/optim_row.h. */
static void step_row(struct embd_ref_table *t, int64_t r, const float *g, float adam_step,
		     float adam_eps)
{
	const struct embd_optimizer_spec *o = &t->opt;
	uint32_t D = t->dim;
	float gd[D > 0 ? D : 1];

	for (uint32_t c = 0; c < D; c++) {
		float w = embd_ref_weight(t, r, c);
		gd[c] = o->weight_decay != 0.0f ? fmaf(o->weight_decay, w, g[c]) : g[c];
	}
	if (o->type == EMBD_OPT_ROWWISE_ADAGRAD) {
		/* 16 lanes, c into lane c % 16, then halved pairwise (embd_optim_sum_sq) */
		float lane[16] = { 0.0f };
		for (uint32_t c = 0; c < D; c++)
			lane[c % 16] = fmaf(gd[c], gd[c], lane[c % 16]);
		for (uint32_t half = 8; half; half /= 2)
			for (uint32_t j = 0; j < half; j++)
				lane[j] += lane[j + half];
		float sum_sq = lane[0];
		t->m1[r] = t->m1[r] + sum_sq / (float)D;
		float mult = o->lr / (sqrtf(t->m1[r]) + o->eps);
		for (uint32_t c = 0; c < D; c++)
			set_weight(t, r, c, fmaf(-mult, gd[c], embd_ref_weight(t, r, c)));
		return;
	}
	for (uint32_t c = 0; c < D; c++) {
		uint64_t i = (uint64_t)r * D + c;
		float w = embd_ref_weight(t, r, c);
		if (o->type == EMBD_OPT_SGD) {
			w = fmaf(-o->lr, gd[c], w);
		} else if (o->type == EMBD_OPT_ADAGRAD) {
			t->m1[i] = fmaf(gd[c], gd[c], t->m1[i]);
			w = w - o->lr * gd[c] / (sqrtf(t->m1[i]) + o->eps);
		} else {
			t->m1[i] = o->beta1 * t->m1[i] + (1.0f - o->beta1) * gd[c];
			t->m2[i] = o->beta2 * t->m2[i] + (1.0f - o->beta2) * (gd[c] * gd[c]);
			w = w - adam_step * t->m1[i] / (sqrtf(t->m2[i]) + adam_eps);
		}
		set_weight(t, r, c, w);
	}
}

int embd_ref_backward(struct embd_ref_table *t, const struct embd_ref_bags *bags, uint32_t n)
{
	uint64_t size = (uint64_t)t->rows * t->dim;
	float *grad = calloc(size ? size : 1, sizeof(float));
	unsigned char *touched = calloc((uint64_t)t->rows, 1);

	if (!grad || !touched) {
		free(grad);
		free(touched);
		return EMBD_ENOMEM;
	}
	for (uint32_t f = 0; f < n; f++) {
		const int64_t *id = bags[f].ids;
		const float *w = bags[f].weights;
		for (uint32_t b = 0; b < bags[f].batch_size; b++) {
			int32_t len = bags[f].lengths[b];
			float s = grad_scale(&bags[f], len);
			const float *dy = bags[f].grad + (uint64_t)b * t->dim;
			for (int32_t k = 0; k < len; k++, id++) {
				float coef = (w ? *w++ : 1.0f) * s;
				float *g = grad + (uint64_t)*id * t->dim;
				for (uint32_t c = 0; c < t->dim; c++)
					g[c] = fmaf(coef, dy[c], g[c]);
				touched[*id] = 1;
			}
		}
	}
	t->step++;
	/* adam's step and eps, bias corrections folded in (kernels/optim_row.h) */
	double bc1 = 1.0 - pow((double)t->opt.beta1, (double)t->step);
	double root_bc2 = sqrt(1.0 - pow((double)t->opt.beta2, (double)t->step));
	float adam_step = (float)(t->opt.lr * root_bc2 / bc1);
	float adam_eps = fmaxf((float)(t->opt.eps * root_bc2), FLT_TRUE_MIN);
	for (int64_t r = 0; r < t->rows; r++)
		if (touched[r])
			step_row(t, r, grad + (uint64_t)r * t->dim, adam_step, adam_eps);
	free(grad);
	free(touched);
	return 0;
}

void embd_ref_bucketize(uint32_t num_features, uint32_t batch_size, const int32_t *lengths,
			const int64_t *values, const float *weights, const int64_t *feature_rows,
			uint32_t num_buckets, int32_t *out_lengths, int64_t *out_values,
			float *out_weights, uint64_t *out_permute)
{
	uint64_t pos = 0;

	for (uint32_t r = 0; r < num_buckets; r++) {
		uint64_t in = 0;
		for (uint32_t f = 0; f < num_features; f++) {
			int64_t block = (feature_rows[f] + num_buckets - 1) / num_buckets;
			for (uint32_t b = 0; b < batch_size; b++) {
				int32_t count = 0;
				for (int32_t k = 0; k < lengths[f * batch_size + b]; k++, in++) {
					if (values[in] / block != (int64_t)r)
						continue;
					out_values[pos] = values[in];
					if (weights)
						out_weights[pos] = weights[in];
					if (out_permute)
						out_permute[in] = pos;
					pos++;
					count++;
				}
				out_lengths[((uint64_t)r * num_features + f) * batch_size + b] = count;
			}
		}
	}
}

void embd_ref_permute(uint32_t num_segments, uint32_t segment_size, const uint32_t *perm,
		      const int32_t *lengths, const int64_t *values, const float *weights,
		      int32_t *out_lengths, int64_t *out_values, float *out_weights)
{
	uint64_t pos = 0;

	for (uint32_t s = 0; s < num_segments; s++) {
		/* find where segment perm[s] starts by summing everything before it */
		uint64_t start = 0;
		for (uint64_t i = 0; i < (uint64_t)perm[s] * segment_size; i++)
			start += (uint64_t)lengths[i];
		for (uint32_t i = 0; i < segment_size; i++) {
			int32_t len = lengths[(uint64_t)perm[s] * segment_size + i];
			out_lengths[(uint64_t)s * segment_size + i] = len;
			for (int32_t k = 0; k < len; k++, pos++, start++) {
				out_values[pos] = values[start];
				if (weights)
					out_weights[pos] = weights[start];
			}
		}
	}
}
