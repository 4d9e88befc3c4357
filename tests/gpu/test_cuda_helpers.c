/* The shared helpers of the GPU test program (test_cuda.h). */
#include "tests/gpu/test_cuda.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/device.h"

struct embd_cuda_ctx *ctx;
int failures, checks;

void cmp_f32(const char *label, const float *want, const float *got, uint64_t n,
		    double rel_tol, double abs_tol)
{
	checks++;
	for (uint64_t i = 0; i < n; i++) {
		bool ok = rel_tol == 0 && abs_tol == 0
				  ? memcmp(&want[i], &got[i], sizeof(float)) == 0
				  : fabs((double)got[i] - want[i]) <= abs_tol + rel_tol * fabs(want[i]);
		if (!ok) {
			FAIL("%s: [%llu] expected %.9g (%a), got %.9g (%a)", label, (unsigned long long)i,
			     want[i], want[i], got[i], got[i]);
			return;
		}
	}
}

void cmp_f16(const char *label, const uint16_t *want, const uint16_t *got, uint64_t n,
		    int ulps)
{
	checks++;
	for (uint64_t i = 0; i < n; i++) {
		float w = embd_fp16_to_fp32(want[i]), g = embd_fp16_to_fp32(got[i]);
		/* one fp16 ulp at |w|: 2^(e - 10) for w = 1.m * 2^e, 2^-24 below 2^-14 and at 0 */
		int ex = 0;
		frexpf(w, &ex);
		double ulp = w == 0 || ex - 1 < -14 ? 0x1p-24 : ldexp(1.0, ex - 1 - 10);
		bool ok = ulps ? fabs((double)g - w) <= ulps * ulp : want[i] == got[i];
		if (!ok) {
			FAIL("%s: [%llu] expected %.6g (0x%04x), got %.6g (0x%04x)", label,
			     (unsigned long long)i, w, want[i], g, got[i]);
			return;
		}
	}
}

void cmp_bytes(const char *label, const void *want, const void *got, size_t elem, uint64_t n)
{
	checks++;
	for (uint64_t i = 0; i < n; i++) {
		if (memcmp((const char *)want + i * elem, (const char *)got + i * elem, elem)) {
			long long w = 0, g = 0;
			memcpy(&w, (const char *)want + i * elem, elem);
			memcpy(&g, (const char *)got + i * elem, elem);
			FAIL("%s: [%llu] expected %lld, got %lld", label, (unsigned long long)i, w, g);
			return;
		}
	}
}

void cmp_err(const char *label, int want_rc, const struct embd_kernel_err *want, int got_rc,
		    const struct embd_kernel_err *got)
{
	checks++;
	if (want_rc != got_rc)
		FAIL("%s: expected rc %d (%s), got %d (%s): %s", label, want_rc, embd_strerror(want_rc),
		     got_rc, embd_strerror(got_rc), got->msg);
	else if (want && (want->feature != got->feature || want->sample != got->sample || want->id != got->id))
		FAIL("%s: expected feature %u sample %lld id %lld (%s), got feature %u sample %lld id %lld (%s)",
		     label, want->feature, (long long)want->sample, (long long)want->id, want->msg,
		     got->feature, (long long)got->sample, (long long)got->id, got->msg);
}

/* ---- shards: a CPU shard and its GPU copy ----------------------------------------------- */

void twin_create(struct twin *t, const struct embd_shard_desc *d, uint64_t seed)
{
	char msg[256];

	if (embd_shard_create(d, &t->cpu, msg, sizeof(msg)) ||
	    embd_cuda_shard_create(ctx, d, &t->gpu, msg, sizeof(msg)))
		gpu_die("shard: %s", msg);
	embd_shard_init_weights(t->cpu, seed, NULL);
	if (embd_cuda_shard_copy(ctx, t->gpu, t->cpu, msg, sizeof(msg)))
		gpu_die("shard copy: %s", msg);
}

void twin_destroy(struct twin *t)
{
	embd_shard_destroy(t->cpu);
	embd_cuda_shard_destroy(t->gpu);
}

void twin_compare(const struct twin *t, bool exact, const char *label)
{
	const struct embd_shard_desc *d = &t->cpu->desc;
	struct embd_shard *h;
	uint64_t wb, m1b, m2b;
	char msg[256], what[300];

	if (embd_shard_create(d, &h, msg, sizeof(msg)) ||
	    embd_cuda_shard_copy(ctx, h, t->gpu, msg, sizeof(msg)) ||
	    embd_shard_sizes(d, &wb, &m1b, &m2b, msg, sizeof(msg)))
		gpu_die("%s: %s", label, msg);
	snprintf(what, sizeof(what), "%s weights", label);
	if (d->dtype == EMBD_DTYPE_FP16)
		cmp_f16(what, t->cpu->weights, h->weights, wb / 2, exact ? 0 : 4);
	else
		cmp_f32(what, t->cpu->weights, h->weights, wb / 4, exact ? 0 : 1e-5, exact ? 0 : 2e-6);
	snprintf(what, sizeof(what), "%s momentum1", label);
	cmp_f32(what, t->cpu->momentum1, h->momentum1, m1b / 4, exact ? 0 : 1e-4, exact ? 0 : 1e-12);
	snprintf(what, sizeof(what), "%s momentum2", label);
	cmp_f32(what, t->cpu->momentum2, h->momentum2, m2b / 4, 0, 0);
	checks++;
	if (t->cpu->step != h->step)
		FAIL("%s: expected step %lld, got %lld", label, (long long)t->cpu->step, (long long)h->step);
	embd_shard_destroy(h);
}

/* ---- bag batches on both sides ---------------------------------------------------------- */

void side_make(struct side_batch *s, struct grng *r, const struct twin *t, uint32_t feature,
		      uint32_t B, uint32_t max_len, uint64_t id_span, bool weighted,
		      enum embd_pooling pooling, bool partial_mean, uint64_t stride, uint32_t col)
{
	const struct embd_shard_desc *d = &t->cpu->desc;

	memset(s, 0, sizeof(*s));
	gbags_random(&s->g, r, B, max_len, 15, d->row_offset,
		     id_span < (uint64_t)d->rows ? id_span : (uint64_t)d->rows, weighted);
	if (partial_mean) {
		/* a row-wise shard's part of a bag: divide by a longer full length */
		s->mean_lengths = malloc((B ? B : 1) * sizeof(int32_t));
		for (uint32_t b = 0; b < B; b++)
			s->mean_lengths[b] = s->g.lengths[b] + (int32_t)grng_below(r, 3);
	}
	struct embd_bag_batch bt = {
		.shard = t->cpu, .feature = feature, .batch_size = B, .offsets = s->g.offsets,
		.ids = s->g.ids, .weights = s->g.weights, .num_ids = s->g.num_ids, .pooling = pooling,
		.mean_lengths = s->mean_lengths, .pooled_stride = stride, .pooled_col = col,
	};
	s->cpu = bt;
	bt.shard = t->gpu;
	bt.offsets = dev_upload(s->g.offsets, (B + 1) * sizeof(int64_t));
	bt.ids = dev_upload(s->g.ids, s->g.num_ids * sizeof(int64_t));
	bt.weights = dev_upload(s->g.weights, weighted ? s->g.num_ids * sizeof(float) : 0);
	bt.mean_lengths = dev_upload(s->mean_lengths, partial_mean ? B * sizeof(int32_t) : 0);
	s->gpu = bt;
}

void side_reupload(struct side_batch *s)
{
	dev_copy_in((void *)s->gpu.offsets, s->g.offsets, (s->g.batch_size + 1) * sizeof(int64_t));
	dev_copy_in((void *)s->gpu.ids, s->g.ids, s->g.num_ids * sizeof(int64_t));
}

void side_free(struct side_batch *s)
{
	dev_free((void *)s->gpu.offsets);
	dev_free((void *)s->gpu.ids);
	dev_free((void *)s->gpu.weights);
	dev_free((void *)s->gpu.mean_lengths);
	free(s->mean_lengths);
	gbags_free(&s->g);
}

void matrix_make(struct side_matrix *m, struct grng *r, uint64_t n)
{
	m->n = n;
	m->cpu = malloc((n ? n : 1) * sizeof(float));
	m->back = malloc((n ? n : 1) * sizeof(float));
	for (uint64_t i = 0; i < n; i++)
		m->cpu[i] = r ? grng_float(r, -1.0f, 1.0f) : nanf("");
	m->gpu = dev_upload(m->cpu, n * sizeof(float));
}

void matrix_free(struct side_matrix *m)
{
	free(m->cpu);
	free(m->back);
	dev_free(m->gpu);
}

struct embd_shard_desc shard_desc(uint32_t table, int64_t rows, uint32_t dim,
					 enum embd_data_type dt, int64_t row_off, int64_t nrows,
					 uint32_t col_off, uint32_t ncols, enum embd_optimizer_type opt)
{
	struct embd_shard_desc d = {
		.table_id = table, .num_embeddings = rows, .embedding_dim = dim, .dtype = dt,
		.row_offset = row_off, .rows = nrows, .col_offset = col_off, .cols = ncols,
		.optimizer = { .type = opt, .lr = 0.05f, .eps = opt == EMBD_OPT_ADAM ? 1e-8f : 1e-3f,
			       .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0 },
	};
	return d;
}

