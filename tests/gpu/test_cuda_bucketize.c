/*
 * tests/gpu/test_cuda_bucketize.c - embd_cuda_bucketize() against embd_jagged_bucketize() on
 * random KJTs (lengths, values, weights and the permutation, every one bit for bit), and its
 * errors: a negative length, lengths that do not add up to num_values, an id outside its table.
 */
#include <stdlib.h>
#include <string.h>

#include "tests/gpu/test_cuda.h"

/* One KJT and the outputs of both sides. */
struct bk {
	uint32_t F, B, W;
	uint64_t nseg, nval;
	int32_t *lengths;
	int64_t *values, *rows;
	float *weights;
	int32_t *ol;                    /* CPU outputs, then the GPU's in *_back */
	int64_t *ov;
	float *ow;
	uint64_t *op;
	int32_t *ol_back;
	int64_t *ov_back;
	float *ow_back;
	uint64_t *op_back;
	int32_t *d_len, *d_ol;          /* device */
	int64_t *d_val, *d_ov;
	float *d_w, *d_ow;
	uint64_t *d_op;
};

static void *xmalloc(size_t bytes)
{
	void *p = malloc(bytes ? bytes : 1);
	if (!p)
		gpu_die("out of memory for %zu bytes", bytes);
	return p;
}

static void bk_make(struct bk *k, struct grng *r, uint32_t F, uint32_t B, uint32_t W, uint32_t max_len,
		    bool weighted)
{
	memset(k, 0, sizeof(*k));
	k->F = F, k->B = B, k->W = W, k->nseg = (uint64_t)F * B;
	k->rows = xmalloc(F * sizeof(*k->rows));
	for (uint32_t f = 0; f < F; f++) /* some tables smaller than the bucket count */
		k->rows[f] = 1 + (int64_t)grng_below(r, grng_below(r, 4) ? 100000 : 6);
	k->lengths = xmalloc(k->nseg * sizeof(*k->lengths));
	for (uint64_t i = 0; i < k->nseg; i++) {
		k->lengths[i] = grng_below(r, 5) ? (int32_t)grng_below(r, max_len + 1) : 0;
		k->nval += (uint64_t)k->lengths[i];
	}
	k->values = xmalloc(k->nval * sizeof(*k->values));
	k->weights = weighted ? xmalloc(k->nval * sizeof(*k->weights)) : NULL;
	for (uint64_t seg = 0, j = 0; seg < k->nseg; seg++)
		for (int32_t i = 0; i < k->lengths[seg]; i++, j++) {
			k->values[j] = (int64_t)grng_below(r, (uint64_t)k->rows[seg / B]);
			if (weighted)
				k->weights[j] = grng_float(r, -2.0f, 2.0f);
		}
	uint64_t nout = k->nseg * W;
	k->ol = xmalloc(nout * sizeof(int32_t));
	k->ol_back = xmalloc(nout * sizeof(int32_t));
	k->ov = xmalloc(k->nval * sizeof(int64_t));
	k->ov_back = xmalloc(k->nval * sizeof(int64_t));
	k->ow = xmalloc(k->nval * sizeof(float));
	k->ow_back = xmalloc(k->nval * sizeof(float));
	k->op = xmalloc(k->nval * sizeof(uint64_t));
	k->op_back = xmalloc(k->nval * sizeof(uint64_t));
	k->d_len = dev_upload(k->lengths, k->nseg * sizeof(int32_t));
	k->d_val = dev_upload(k->values, k->nval * sizeof(int64_t));
	k->d_w = dev_upload(k->weights, weighted ? k->nval * sizeof(float) : 0);
	k->d_ol = dev_alloc(nout * sizeof(int32_t));
	k->d_ov = dev_alloc(k->nval * sizeof(int64_t));
	k->d_ow = dev_alloc(k->nval * sizeof(float));
	k->d_op = dev_alloc(k->nval * sizeof(uint64_t));
}

static void bk_free(struct bk *k)
{
	free(k->rows);
	free(k->lengths);
	free(k->values);
	free(k->weights);
	free(k->ol), free(k->ol_back), free(k->ov), free(k->ov_back);
	free(k->ow), free(k->ow_back), free(k->op), free(k->op_back);
	dev_free(k->d_len), dev_free(k->d_val), dev_free(k->d_w), dev_free(k->d_ol);
	dev_free(k->d_ov), dev_free(k->d_ow), dev_free(k->d_op);
}

/* Copies changed lengths and values to the device again. */
static void bk_reupload(struct bk *k)
{
	dev_copy_in(k->d_len, k->lengths, k->nseg * sizeof(int32_t));
	dev_copy_in(k->d_val, k->values, k->nval * sizeof(int64_t));
}

/* Both sides with num_values values; returns the CPU's code in *crc, the GPU's in *grc. */
static void bk_run(struct bk *k, uint64_t num_values, int *crc, int *grc, struct embd_kernel_err *ge)
{
	char msg[256];
	struct embd_bucketize_args a = {
		.num_features = k->F, .batch_size = k->B, .lengths = k->lengths, .values = k->values,
		.weights = k->weights, .num_values = num_values, .feature_rows = k->rows,
		.num_buckets = k->W, .out_lengths = k->ol, .out_values = k->ov,
		.out_weights = k->weights ? k->ow : NULL, .out_permute = k->op,
	};

	*crc = embd_jagged_bucketize(&a, msg, sizeof(msg));
	a.lengths = k->d_len, a.values = k->d_val, a.weights = k->d_w;
	a.out_lengths = k->d_ol, a.out_values = k->d_ov, a.out_weights = k->weights ? k->d_ow : NULL;
	a.out_permute = k->d_op;
	*grc = embd_cuda_bucketize(ctx, &a, ge);
	if (!*grc)
		*grc = embd_cuda_sync(ctx, ge);
}

static void bucketize_case(struct grng *r, uint32_t F, uint32_t B, uint32_t W, uint32_t max_len,
			   bool weighted)
{
	struct bk k;
	struct embd_kernel_err ge;
	char label[128];
	int crc, grc;

	bk_make(&k, r, F, B, W, max_len, weighted);
	snprintf(label, sizeof(label), "bucketize F %u B %u W %u values %llu%s", F, B, W,
		 (unsigned long long)k.nval, weighted ? " weighted" : "");
	bk_run(&k, k.nval, &crc, &grc, &ge);
	cmp_err(label, crc, NULL, grc, &ge);
	if (!crc && !grc) {
		char what[160];
		dev_download(k.ol_back, k.d_ol, k.nseg * W * sizeof(int32_t));
		dev_download(k.ov_back, k.d_ov, k.nval * sizeof(int64_t));
		dev_download(k.op_back, k.d_op, k.nval * sizeof(uint64_t));
		snprintf(what, sizeof(what), "%s out_lengths", label);
		cmp_bytes(what, k.ol, k.ol_back, sizeof(int32_t), k.nseg * W);
		snprintf(what, sizeof(what), "%s out_values", label);
		cmp_bytes(what, k.ov, k.ov_back, sizeof(int64_t), k.nval);
		snprintf(what, sizeof(what), "%s out_permute", label);
		cmp_bytes(what, k.op, k.op_back, sizeof(uint64_t), k.nval);
		if (weighted) {
			dev_download(k.ow_back, k.d_ow, k.nval * sizeof(float));
			snprintf(what, sizeof(what), "%s out_weights", label);
			cmp_f32(what, k.ow, k.ow_back, k.nval, 0, 0);
		}
	}
	bk_free(&k);
}

/* The GPU's error names the planted feature, sample and value. */
static void expect_at(const char *label, int want_rc, int crc, int grc, const struct embd_kernel_err *ge,
		      uint32_t feature, int64_t sample, int64_t value)
{
	checks++;
	if (crc != want_rc || grc != want_rc)
		FAIL("%s: expected %d (%s) from both, got CPU %d, GPU %d (%s)", label, want_rc,
		     embd_strerror(want_rc), crc, grc, ge->msg);
	else if (ge->feature != feature || ge->sample != sample || ge->id != value)
		FAIL("%s: expected feature %u sample %lld value %lld, got feature %u sample %lld value %lld (%s)",
		     label, feature, (long long)sample, (long long)value, ge->feature,
		     (long long)ge->sample, (long long)ge->id, ge->msg);
}

static void bucketize_errors(struct grng *r)
{
	struct bk k;
	struct embd_kernel_err ge;
	int crc, grc;

	bk_make(&k, r, 3, 50, 4, 6, true);
	uint64_t seg = k.nseg / 2, j = 0;
	while (seg < k.nseg && k.lengths[seg] == 0)
		seg++;
	if (seg == k.nseg)
		gpu_die("bucketize_errors: the random KJT has no value past its middle");
	for (uint64_t i = 0; i < seg; i++)
		j += (uint64_t)k.lengths[i];

	/* an id one past its table's last row */
	int64_t saved = k.values[j];
	k.values[j] = k.rows[seg / k.B];
	bk_reupload(&k);
	bk_run(&k, k.nval, &crc, &grc, &ge);
	expect_at("bucketize id outside the table", EMBD_ERANGE, crc, grc, &ge, (uint32_t)(seg / k.B),
		  (int64_t)(seg % k.B), k.values[j]);
	k.values[j] = saved;

	/* lengths that add up to one more than num_values */
	bk_reupload(&k);
	bk_run(&k, k.nval - 1, &crc, &grc, &ge);
	expect_at("bucketize lengths sum", EMBD_EINVAL, crc, grc, &ge, 0, -1, (int64_t)k.nval);

	/* a negative length (the id fault is planted too: lengths are checked first) */
	k.values[j] = -5;
	k.lengths[seg + 1 < k.nseg ? seg + 1 : seg] = -3;
	uint64_t neg = seg + 1 < k.nseg ? seg + 1 : seg;
	bk_reupload(&k);
	bk_run(&k, k.nval, &crc, &grc, &ge);
	expect_at("bucketize negative length", EMBD_EINVAL, crc, grc, &ge, (uint32_t)(neg / k.B),
		  (int64_t)(neg % k.B), -3);
	bk_free(&k);
}

void test_bucketize(struct grng *r)
{
	for (int i = 0; i < 40; i++)
		bucketize_case(r, 1 + (uint32_t)grng_below(r, 4), 1 + (uint32_t)grng_below(r, 64),
			       1 + (uint32_t)grng_below(r, 9), (uint32_t)grng_below(r, 40), i % 2);
	/* about a million values: many blocks, long segments */
	bucketize_case(r, 8, 4096, 8, 60, true);
	bucketize_case(r, 2, 3, 5, 2000, false);
	bucketize_errors(r);
	printf("bucketize: %d checks so far, %d failures\n", checks, failures);
}
