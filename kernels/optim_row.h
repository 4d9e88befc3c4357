/*
 * kernels/optim_row.h - one fused optimizer step on one embedding row, shared by the CPU and
 * CUDA kernels: sgd, adagrad, rowwise_adagrad and adam, each with L2 weight decay added to the
 * gradient (g' = g + weight_decay * w; 0 disables it).
 *
 * The caller has already combined every occurrence of the row in the step into one fp32
 * gradient (FBGEMM's EXACT_* semantics), so each row is updated once per step. State is fp32:
 *   adagrad          momentum1[c] += g'^2;  w -= lr * g' / (sqrt(momentum1[c]) + eps)
 *   rowwise_adagrad  momentum1 += sum_c(g'^2) / cols (one float per row; the sum's order is
 *                    embd_optim_sum_sq's);
 *                    w -= lr / (sqrt(momentum1) + eps) * g'
 *   adam             m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2   (momentum1 = m, momentum2 = v)
 *                    w -= step * m / (sqrt(v) + eps'),  t = 1 on the first step, where
 *                    step = lr sqrt(1-b2^t) / (1-b1^t) and eps' = eps sqrt(1-b2^t), at least
 *                    the least positive float
 * adam's form is FBGEMM's and torch.optim.Adam's, w -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t))
 * + eps), with numerator and denominator multiplied by sqrt(1-b2^t): the same function, rounded
 * differently (within ~3 ulps of the exact step, where the old form's float bias corrections
 * strayed by up to hundreds at beta2 0.9999). It is the reordering Kingma and Ba suggest, with
 * eps scaled so that the function stays the same (torch.optim.SparseAdam reorders without
 * scaling eps: another function). It leaves one division and one square root an element, not
 * three and one, and the divider is what adam's row waits on: on an Intel Xeon (2026-12-06,
 * docs/benchmarks.md) adam D 128 took 17% less time a batch (D 64 9%). The floor on eps' keeps
 * 0 / 0 out of a row whose m and v are 0 when a subnormal eps would scale to 0. step and eps'
 * are computed once per step on the host, in double (embd_optim_params_make), and passed to
 * every row, so the CPU and the GPU use the same constants.
 */
#ifndef EMBD_KERNELS_OPTIM_ROW_H
#define EMBD_KERNELS_OPTIM_ROW_H

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "embd/types.h"
#include "kernels/device.h"

/* Everything one step of one optimizer needs, the same for every row of the step. */
struct embd_optim_params {
	enum embd_optimizer_type type;
	float lr;
	float eps;
	float beta1, beta2;
	float weight_decay;
	float adam_step;                /* adam: lr sqrt(1 - beta2^t) / (1 - beta1^t) */
	float adam_eps;                 /* adam: eps sqrt(1 - beta2^t), at least the least float */
};

/* The parameters of step t (t >= 1: the number of this update, counting from 1). Host code. */
static inline struct embd_optim_params embd_optim_params_make(const struct embd_optimizer_spec *spec,
							      int64_t t)
{
	struct embd_optim_params p;

	p.type = spec->type;
	p.lr = spec->lr;
	p.eps = spec->eps;
	p.beta1 = spec->beta1;
	p.beta2 = spec->beta2;
	p.weight_decay = spec->weight_decay;
	const double correction1 = 1.0 - pow((double)spec->beta1, (double)t);
	const double root2 = sqrt(1.0 - pow((double)spec->beta2, (double)t));
	p.adam_step = (float)((double)spec->lr * root2 / correction1);
	/* a subnormal eps may scale to 0, and a row whose m and v are 0 would then take 0 / 0 */
	p.adam_eps = fmaxf((float)((double)spec->eps * root2), FLT_TRUE_MIN);
	return p;
}

/* fp32 state floats per row for an optimizer over rows of `cols` columns, per state array. */
static inline EMBD_HOST_DEVICE uint64_t embd_optim_state_floats(enum embd_optimizer_type type,
								 uint32_t cols, int which)
{
	switch (type) {
	case EMBD_OPT_ADAGRAD: return which == 0 ? cols : 0;
	case EMBD_OPT_ROWWISE_ADAGRAD: return which == 0 ? 1 : 0;
	case EMBD_OPT_ADAM: return cols;
	default: return 0;
	}
}

/* g' = g + weight_decay * w. */
static inline EMBD_HOST_DEVICE float embd_optim_decay(const struct embd_optim_params *p, float g, float w)
{
	return p->weight_decay != 0.0f ? fmaf(p->weight_decay, w, g) : g;
}

/*
 * One element of an element-wise optimizer (sgd, adagrad, adam): returns the new weight and
 * updates the element's state (m1: adagrad sum or adam m; m2: adam v; unused ones may be NULL).
 */
static inline EMBD_HOST_DEVICE float embd_optim_elem(const struct embd_optim_params *p, float w, float g,
						     float *m1, float *m2)
{
	float gd = embd_optim_decay(p, g, w);

	switch (p->type) {
	case EMBD_OPT_SGD:
		return fmaf(-p->lr, gd, w);
	case EMBD_OPT_ADAGRAD: {
		float s = fmaf(gd, gd, *m1);
		*m1 = s;
		return w - p->lr * gd / (sqrtf(s) + p->eps);
	}
	case EMBD_OPT_ADAM: {
		float m = p->beta1 * *m1 + (1.0f - p->beta1) * gd;
		float v = p->beta2 * *m2 + (1.0f - p->beta2) * (gd * gd);
		*m1 = m;
		*m2 = v;
		return w - p->adam_step * m / (sqrtf(v) + p->adam_eps);
	}
	default:
		return w;
	}
}

/*
 * rowwise_adagrad's sum over c of g'[c]^2 on the CPU, in a fixed order that vectors of any
 * width reproduce: element c is added (fmaf, c ascending) into lane c % EMBD_SUM_SQ_LANES, then
 * the lanes are halved, lane i += lane i + half, until one is left. One chain of dependent
 * fmafs instead took longer than the row's whole memory traffic (4 cycles of latency per
 * column). A GPU sums with a reduction of its own (a different order).
 */
#define EMBD_SUM_SQ_LANES 16
#if EMBD_SUM_SQ_LANES != 16
#error "embd_optim_sum_sq's halvings are written out for 16 lanes"
#endif

static inline EMBD_HOST_DEVICE float embd_optim_sum_sq(const struct embd_optim_params *p,
							const float *EMBD_RESTRICT w,
							const float *EMBD_RESTRICT g, uint32_t cols)
{
	float lane[EMBD_SUM_SQ_LANES] = { 0.0f };
	uint32_t full = cols / EMBD_SUM_SQ_LANES, tail = cols % EMBD_SUM_SQ_LANES;

	/* pointers, not g[c + j]: a 32-bit index may wrap, and compilers then gather lane by lane */
	for (uint32_t i = 0; i < full; i++, w += EMBD_SUM_SQ_LANES, g += EMBD_SUM_SQ_LANES)
		for (uint32_t j = 0; j < EMBD_SUM_SQ_LANES; j++) {
			float gd = embd_optim_decay(p, g[j], w[j]);
			lane[j] = fmaf(gd, gd, lane[j]);
		}
	for (uint32_t j = 0; j < tail; j++) {
		float gd = embd_optim_decay(p, g[j], w[j]);
		lane[j] = fmaf(gd, gd, lane[j]);
	}
	/* the halvings written out: GCC 12 does not unroll a loop over half, and reduces the
	 * lanes through the stack, a chain of stores and reloads on every row (written out,
	 * rowwise_adagrad with its rows in cache, one thread, ~10% less time a batch) */
	for (uint32_t j = 0; j < 8; j++)
		lane[j] += lane[j + 8];
	for (uint32_t j = 0; j < 4; j++)
		lane[j] += lane[j + 4];
	for (uint32_t j = 0; j < 2; j++)
		lane[j] += lane[j + 2];
	return lane[0] + lane[1];
}

/*
 * rowwise_adagrad, part 1: folds the row's sum of g'^2 into its state and returns the step size
 * lr / (sqrt(state) + eps) that every element of the row uses.
 */
static inline EMBD_HOST_DEVICE float embd_optim_rowwise_mult(const struct embd_optim_params *p,
							     float *row_state, float sum_sq, uint32_t cols)
{
	float s = *row_state + sum_sq / (float)cols;
	*row_state = s;
	return p->lr / (sqrtf(s) + p->eps);
}

/* rowwise_adagrad, part 2: one element's new weight. */
static inline EMBD_HOST_DEVICE float embd_optim_rowwise_elem(const struct embd_optim_params *p, float w,
							     float g, float mult)
{
	return fmaf(-mult, embd_optim_decay(p, g, w), w);
}

/*
 * One step on one fp32 row: w[cols], its combined gradient g[cols], and its state (m1: cols
 * floats for adagrad and adam, one float for rowwise_adagrad, unused for sgd; m2: adam's v).
 * Returns non-zero when it left a weight or a state value NaN or infinite (checked in the
 * same loop as it is written, rather than read again afterwards; a caller that checks its
 * rows another way ignores it, and the compiler drops the check).
 * The parameters are copied to a local and the optimizer is chosen outside the loops, so that
 * compilers can keep them in registers and vectorize each loop (same arithmetic per element).
 */
static inline EMBD_HOST_DEVICE uint32_t embd_optim_row_fp32(const struct embd_optim_params *params,
							    float *EMBD_RESTRICT w,
							    const float *EMBD_RESTRICT g,
							    float *EMBD_RESTRICT m1,
							    float *EMBD_RESTRICT m2, uint32_t cols)
{
	const struct embd_optim_params p = *params;
	uint32_t bad = 0;

	switch (p.type) {
	case EMBD_OPT_SGD:
		for (uint32_t c = 0; c < cols; c++) {
			w[c] = embd_optim_elem(&p, w[c], g[c], 0, 0);
			bad |= embd_nonfinite_bit(w[c]);
		}
		break;
	case EMBD_OPT_ADAGRAD:
		for (uint32_t c = 0; c < cols; c++) {
			w[c] = embd_optim_elem(&p, w[c], g[c], &m1[c], 0);
			bad |= embd_nonfinite_bit(w[c]) | embd_nonfinite_bit(m1[c]);
		}
		break;
	case EMBD_OPT_ROWWISE_ADAGRAD: {
		float mult = embd_optim_rowwise_mult(&p, m1, embd_optim_sum_sq(&p, w, g, cols), cols);
		bad = embd_nonfinite_bit(*m1);
		for (uint32_t c = 0; c < cols; c++) {
			w[c] = embd_optim_rowwise_elem(&p, w[c], g[c], mult);
			bad |= embd_nonfinite_bit(w[c]);
		}
		break;
	}
	case EMBD_OPT_ADAM:
		for (uint32_t c = 0; c < cols; c++) {
			w[c] = embd_optim_elem(&p, w[c], g[c], &m1[c], &m2[c]);
			bad |= embd_nonfinite_bit(w[c]) | embd_nonfinite_bit(m1[c]) |
			       embd_nonfinite_bit(m2[c]);
		}
		break;
	}
	return bad;
}

/*
 * The same for an fp16 row: widened to fp32 into tmp[cols] (caller's scratch), updated there
 * with the fp32 arithmetic, and rounded back to nearest even. Weights are checked as stored
 * too: a finite fp32 value can round to an fp16 infinity.
 */
static inline EMBD_HOST_DEVICE uint32_t embd_optim_row_fp16(const struct embd_optim_params *params,
							    uint16_t *w, const float *g, float *m1,
							    float *m2, float *tmp, uint32_t cols)
{
	uint32_t bad;

	for (uint32_t c = 0; c < cols; c++)
		tmp[c] = embd_fp16_to_fp32(w[c]);
	bad = embd_optim_row_fp32(params, tmp, g, m1, m2, cols);
	for (uint32_t c = 0; c < cols; c++) {
		w[c] = embd_fp32_to_fp16(tmp[c]);
		bad |= (w[c] & 0x7c00u) == 0x7c00u;
	}
	return bad;
}

#endif /* EMBD_KERNELS_OPTIM_ROW_H */
