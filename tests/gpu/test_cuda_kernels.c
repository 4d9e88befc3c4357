/*
 * tests/gpu/test_cuda_kernels.c - every CUDA kernel against the CPU kernels (embd_kernels) on
 * the same random data: forward (sum, mean, per-id weights, fp32/fp16, row and column shard
 * offsets, empty bags, several widths), fused backward + optimizer for all four optimizers with
 * duplicate ids over several steps, the rows a backward leaves NaN or infinite (counted and
 * named as the CPU kernels do), block bucketize, and the errors of bad ids, offsets and
 * lengths. Plain C, no Criterion: it must run where a GPU is, and exit 77 where none is.
 *
 * Tolerances: the GPU runs the same per-row arithmetic with contraction off, so forward,
 * bucketize, and sgd/adagrad/adam must be bit for bit equal. rowwise_adagrad sums a row's g^2
 * as a tree (a row of n columns may differ by n float epsilons): fp32 weights within 2e-6 + 1e-5
 * relative, its state within 1e-4 relative, fp16 weights within 4 fp16 ulps (a rounding flip
 * per step can carry over to the next).
 */
#include <stdio.h>
#include <string.h>

#include "tests/gpu/test_cuda.h"

/* ---- forward ---------------------------------------------------------------------------- */

/*
 * Two features in one KeyedTensor: f0 against a row shard (rows [300, 300 + 1700) of a 4000-row
 * table), f1 against a column shard (columns [dim / 3, dim) of another table). pad = 1 moves
 * the output's stride off a multiple of 4 floats, so its rows are not 16-byte aligned.
 */
static void forward_case(struct grng *r, uint32_t dim, enum embd_data_type dt, enum embd_pooling pool,
			 bool weighted, bool partial_mean, uint32_t B, uint32_t max_len, uint32_t pad)
{
	struct twin ta, tb;
	struct side_batch s[2];
	struct side_matrix out;
	struct embd_kernel_err ce, ge;
	char label[160];
	uint32_t coff = dim / 3, cols = dim - coff;
	struct embd_shard_desc da = shard_desc(1, 4000, dim, dt, 300, 1700, 0, dim, EMBD_OPT_SGD);
	struct embd_shard_desc db = shard_desc(2, 900, dim, dt, 0, 900, coff, cols, EMBD_OPT_SGD);
	uint64_t stride = dim + cols + pad;

	snprintf(label, sizeof(label), "forward dim %u %s %s%s%s B %u P<=%u pad %u", dim,
		 dt == EMBD_DTYPE_FP16 ? "fp16" : "fp32", pool == EMBD_POOLING_MEAN ? "mean" : "sum",
		 weighted ? " weighted" : "", partial_mean ? " partial-mean" : "", B, max_len, pad);
	twin_create(&ta, &da, 11);
	twin_create(&tb, &db, 12);
	side_make(&s[0], r, &ta, 0, B, max_len, UINT64_MAX, weighted, pool, partial_mean, stride, 0);
	side_make(&s[1], r, &tb, 1, B, max_len, UINT64_MAX, weighted, pool, partial_mean, stride, dim);
	matrix_make(&out, NULL, (uint64_t)B * stride);
	struct embd_bag_batch cb[2] = { s[0].cpu, s[1].cpu }, gb[2] = { s[0].gpu, s[1].gpu };
	cb[0].pooled = cb[1].pooled = out.cpu;
	gb[0].pooled = gb[1].pooled = out.gpu;

	int crc = embd_kernels_forward(NULL, cb, 2, &ce);
	int grc = embd_cuda_forward(ctx, gb, 2, &ge);
	if (!grc)
		grc = embd_cuda_sync(ctx, &ge);
	cmp_err(label, crc, NULL, grc, &ge);
	dev_download(out.back, out.gpu, out.n * sizeof(float));
	cmp_f32(label, out.cpu, out.back, out.n, 0, 0);

	matrix_free(&out);
	side_free(&s[0]);
	side_free(&s[1]);
	twin_destroy(&ta);
	twin_destroy(&tb);
}

static void test_forward(struct grng *r)
{
	static const uint32_t dims[] = { 1, 3, 4, 8, 30, 64, 100, 128, 260 };
	static const uint32_t batch[] = { 1, 7, 64, 300 };

	for (unsigned i = 0; i < sizeof(dims) / sizeof(dims[0]); i++)
		for (int dt = 0; dt < 2; dt++)
			for (int pool = 0; pool < 2; pool++)
				for (int wt = 0; wt < 2; wt++)
					forward_case(r, dims[i], (enum embd_data_type)dt,
						     (enum embd_pooling)pool, wt, pool && wt,
						     batch[grng_below(r, 4)], 1 + (uint32_t)grng_below(r, 40),
						     (uint32_t)grng_below(r, 2));
	/* a million ids, past every tail and into many blocks */
	forward_case(r, 128, EMBD_DTYPE_FP32, EMBD_POOLING_SUM, false, false, 16384, 127, 0);
	forward_case(r, 64, EMBD_DTYPE_FP16, EMBD_POOLING_MEAN, true, false, 8192, 255, 1);
}

/* ---- backward --------------------------------------------------------------------------- */

static const char *opt_name(enum embd_optimizer_type t)
{
	static const char *names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };
	return names[t];
}

/*
 * steps training steps on one shard (rows [1000, 3000), columns [coff, dim) of a 5000-row
 * table), two features per step: f0 weighted mean over a hot window of 40 rows (many
 * duplicates), f1 plain sum over the whole shard.
 */
static void backward_case(struct grng *r, enum embd_optimizer_type opt, enum embd_data_type dt,
			  uint32_t dim, uint32_t coff, float weight_decay, int steps, uint32_t B,
			  uint32_t max_len)
{
	struct twin t;
	char label[160];
	struct embd_shard_desc d = shard_desc(3, 5000, dim, dt, 1000, 2000, coff, dim - coff, opt);
	uint64_t stride = 2 * (uint64_t)dim;

	d.optimizer.weight_decay = weight_decay;
	twin_create(&t, &d, 21);
	for (int step = 0; step < steps; step++) {
		struct side_batch s[2];
		struct side_matrix dy;
		struct embd_kernel_err ce, ge;

		snprintf(label, sizeof(label), "backward %s %s dim %u cols [%u, %u) wd %g B %u step %d",
			 opt_name(opt), dt == EMBD_DTYPE_FP16 ? "fp16" : "fp32", dim, coff, dim,
			 weight_decay, B, step + 1);
		side_make(&s[0], r, &t, 0, B, max_len, 40, true, EMBD_POOLING_MEAN, step % 2, stride, coff);
		side_make(&s[1], r, &t, 1, B, max_len, UINT64_MAX, false, EMBD_POOLING_SUM, false, stride,
			  dim + coff);
		matrix_make(&dy, r, (uint64_t)B * stride);
		struct embd_bag_batch cb[2] = { s[0].cpu, s[1].cpu }, gb[2] = { s[0].gpu, s[1].gpu };
		cb[0].pooled_grad = cb[1].pooled_grad = dy.cpu;
		gb[0].pooled_grad = gb[1].pooled_grad = dy.gpu;
		/* every other step with TorchRec's gradient division (by 3 trainers) */
		for (int k = 0; k < 2; k++)
			cb[k].grad_divisor = gb[k].grad_divisor = step % 2 ? 3 : 0;

		int crc = embd_kernels_backward(NULL, t.cpu, cb, 2, &ce);
		int grc = embd_cuda_backward(ctx, t.gpu, gb, 2, &ge);
		if (!grc)
			grc = embd_cuda_sync(ctx, &ge);
		cmp_err(label, crc, NULL, grc, &ge);
		twin_compare(&t, opt != EMBD_OPT_ROWWISE_ADAGRAD, label);
		matrix_free(&dy);
		side_free(&s[0]);
		side_free(&s[1]);
	}
	twin_destroy(&t);
}

static void test_backward(struct grng *r)
{
	static const uint32_t dims[] = { 4, 30, 64, 128, 260 };

	for (int opt = 0; opt < 4; opt++)
		for (int dt = 0; dt < 2; dt++)
			for (unsigned i = 0; i < sizeof(dims) / sizeof(dims[0]); i++)
				backward_case(r, (enum embd_optimizer_type)opt, (enum embd_data_type)dt,
					      dims[i], i % 2 ? dims[i] / 3 : 0, i % 3 == 1 ? 0.01f : 0.0f,
					      3, 1 + (uint32_t)grng_below(r, 100), 1 + (uint32_t)grng_below(r, 30));
	/* about a million ids: a multi-pass radix sort and long runs of one row */
	backward_case(r, EMBD_OPT_ROWWISE_ADAGRAD, EMBD_DTYPE_FP32, 128, 0, 0, 2, 16384, 127);
	backward_case(r, EMBD_OPT_ADAM, EMBD_DTYPE_FP16, 64, 0, 0.01f, 2, 16384, 127);
}

/*
 * Rows an update leaves NaN or infinite are counted, and the lowest named, as the CPU kernels
 * count them (engine/step.h's nonfinite_rows): every other bag's gradient is 1e30, so adagrad's
 * sum of squares overflows in fp32 (its weights stay finite) and sgd's fp16 weights overflow
 * only as stored (w - 5e28 is finite in fp32). 20 calls on the two shards before one sync, so
 * the per-call records grow past their first 16 while calls are in flight; then calls with
 * ordinary gradients, which count again the rows whose state stays infinite.
 */
static void test_nonfinite_rows(struct grng *r)
{
	struct twin t[2];
	struct side_batch s[2];
	struct side_matrix dy;
	struct embd_kernel_err ce, ge;
	struct embd_shard_desc d[2] = {
		shard_desc(4, 3000, 32, EMBD_DTYPE_FP32, 1000, 1500, 0, 32, EMBD_OPT_ADAGRAD),
		shard_desc(5, 800, 24, EMBD_DTYPE_FP16, 0, 800, 0, 24, EMBD_OPT_SGD),
	};
	const uint64_t stride = 64;
	const uint32_t B = 50, calls = 20;
	char label[96];

	for (int k = 0; k < 2; k++)
		twin_create(&t[k], &d[k], 41 + (uint64_t)k);
	side_make(&s[0], r, &t[0], 0, B, 6, UINT64_MAX, false, EMBD_POOLING_SUM, false, stride, 0);
	side_make(&s[1], r, &t[1], 1, B, 6, UINT64_MAX, false, EMBD_POOLING_MEAN, false, stride, 32);
	for (int round = 0; round < 2; round++) {
		matrix_make(&dy, r, (uint64_t)B * stride);
		for (uint32_t b = 0; round == 0 && b < B; b += 2)
			for (uint64_t c = 0; c < stride; c++)
				dy.cpu[b * stride + c] = 1e30f;
		dev_copy_in(dy.gpu, dy.cpu, dy.n * sizeof(float));
		struct embd_bag_batch cb[2] = { s[0].cpu, s[1].cpu }, gb[2] = { s[0].gpu, s[1].gpu };
		cb[0].pooled_grad = cb[1].pooled_grad = dy.cpu;
		gb[0].pooled_grad = gb[1].pooled_grad = dy.gpu;
		int crc = 0, grc = 0;
		uint32_t n = round == 0 ? calls : 2;
		for (uint32_t i = 0; i < n && !crc; i++)
			crc = embd_kernels_backward(NULL, t[i % 2].cpu, &cb[i % 2], 1, &ce);
		for (uint32_t i = 0; i < n && !grc; i++)
			grc = embd_cuda_backward(ctx, t[i % 2].gpu, &gb[i % 2], 1, &ge);
		if (!grc)
			grc = embd_cuda_sync(ctx, &ge);
		snprintf(label, sizeof(label), "non-finite rows, %s gradients",
			 round == 0 ? "1e30" : "ordinary");
		cmp_err(label, crc, NULL, grc, &ge);
		for (int k = 0; k < 2; k++) {
			const struct embd_shard *c = t[k].cpu, *g = t[k].gpu;
			checks++;
			if (round == 0 && !c->nonfinite_rows)
				FAIL("%s, %s: the CPU kernels should have left rows non-finite, counted none",
				     label, opt_name(d[k].optimizer.type));
			else if (c->nonfinite_rows != g->nonfinite_rows || c->nonfinite_row != g->nonfinite_row)
				FAIL("%s, %s: expected %llu rows, the lowest of the last call %lld, got %llu "
				     "and %lld", label, opt_name(d[k].optimizer.type),
				     (unsigned long long)c->nonfinite_rows, (long long)c->nonfinite_row,
				     (unsigned long long)g->nonfinite_rows, (long long)g->nonfinite_row);
			twin_compare(&t[k], true, label);
		}
		matrix_free(&dy);
	}
	for (int k = 0; k < 2; k++) {
		side_free(&s[k]);
		twin_destroy(&t[k]);
	}
}

/* The first bag at or after b that holds an id (B when none). */
static uint32_t nonempty_from(const struct gbags *g, uint32_t b)
{
	while (b < g->batch_size && g->lengths[b] == 0)
		b++;
	return b;
}

/*
 * Bad device data: the GPU reports what the CPU reports (code, feature, sample, id), a stopped
 * context does nothing until the sync, a failed backward changes no row and no step, and the
 * context works again after the sync.
 */
static void test_errors(struct grng *r)
{
	struct twin ta, tb;
	struct side_batch s[2];
	struct side_matrix out, dy;
	struct embd_kernel_err ce, ge;
	struct embd_shard_desc da = shard_desc(1, 4000, 32, EMBD_DTYPE_FP32, 300, 1700, 0, 32, EMBD_OPT_ADAGRAD);
	struct embd_shard_desc db = shard_desc(2, 4000, 32, EMBD_DTYPE_FP16, 2000, 1000, 0, 32, EMBD_OPT_ADAM);
	const uint64_t stride = 64;
	const uint32_t B = 40;
	int crc, grc;

	twin_create(&ta, &da, 31);
	twin_create(&tb, &db, 32);
	side_make(&s[0], r, &ta, 0, B, 8, UINT64_MAX, true, EMBD_POOLING_SUM, false, stride, 0);
	side_make(&s[1], r, &tb, 1, B, 8, UINT64_MAX, false, EMBD_POOLING_MEAN, false, stride, 32);
	matrix_make(&out, NULL, (uint64_t)B * stride);
	matrix_make(&dy, r, (uint64_t)B * stride);
	struct embd_bag_batch cb[2] = { s[0].cpu, s[1].cpu }, gb[2] = { s[0].gpu, s[1].gpu };
	cb[0].pooled = cb[1].pooled = out.cpu;
	gb[0].pooled = gb[1].pooled = out.gpu;
	cb[0].pooled_grad = cb[1].pooled_grad = dy.cpu;
	gb[0].pooled_grad = gb[1].pooled_grad = dy.gpu;

	/* f1: an id below the shard's rows in one bag, one above in a later bag */
	uint32_t b1 = nonempty_from(&s[1].g, 3), b2 = nonempty_from(&s[1].g, b1 + 1);
	if (b2 >= B)
		gpu_die("test_errors: the random bags left no room for two bad ids");
	s[1].g.ids[s[1].g.offsets[b1 + 1] - 1] = db.row_offset - 1;
	s[1].g.ids[s[1].g.offsets[b2]] = db.row_offset + db.rows;
	side_reupload(&s[1]);
	crc = embd_kernels_forward(NULL, cb, 2, &ce);
	grc = embd_cuda_forward(ctx, gb, 2, &ge);
	if (!grc)
		grc = embd_cuda_sync(ctx, &ge);
	checks++;
	if (crc != EMBD_ERANGE || ce.sample != b1)
		FAIL("forward bad id: the CPU kernels should report ERANGE at sample %u, got %d at %lld",
		     b1, crc, (long long)ce.sample);
	cmp_err("forward bad id", crc, &ce, grc, &ge);

	/* a failed call stops the context: the valid backward after it must change nothing */
	grc = embd_cuda_forward(ctx, gb, 2, &ge);
	if (!grc)
		grc = embd_cuda_backward(ctx, ta.gpu, &gb[0], 1, &ge);
	checks++;
	if (grc || ta.gpu->step != 1)
		FAIL("stopped context: expected both calls enqueued and step 1, got rc %d step %lld",
		     grc, (long long)ta.gpu->step);
	grc = embd_cuda_sync(ctx, &ge);
	cmp_err("stopped context", crc, &ce, grc, &ge);
	twin_compare(&ta, true, "backward after a failed call");

	/* after the sync the context runs again (on fresh outputs: the failed calls left theirs) */
	matrix_free(&out);
	matrix_make(&out, NULL, (uint64_t)B * stride);
	cb[0].pooled = out.cpu;
	gb[0].pooled = out.gpu;
	grc = embd_cuda_forward(ctx, gb, 1, &ge);
	if (!grc)
		grc = embd_cuda_sync(ctx, &ge);
	crc = embd_kernels_forward(NULL, cb, 1, &ce);
	cmp_err("forward after a sync", crc, NULL, grc, &ge);
	dev_download(out.back, out.gpu, out.n * sizeof(float));
	cmp_f32("forward after a sync", out.cpu, out.back, out.n, 0, 0);

	/* a backward with a bad id changes no row and leaves the step */
	crc = embd_kernels_backward(NULL, tb.cpu, &cb[1], 1, &ce);
	grc = embd_cuda_backward(ctx, tb.gpu, &gb[1], 1, &ge);
	if (!grc)
		grc = embd_cuda_sync(ctx, &ge);
	cmp_err("backward bad id", crc, &ce, grc, &ge);
	twin_compare(&tb, true, "backward bad id");

	/* f0: offsets that decrease inside the batch */
	int64_t saved = s[0].g.offsets[3];
	s[0].g.offsets[3] = -1;
	side_reupload(&s[0]);
	crc = embd_kernels_forward(NULL, cb, 2, &ce);
	grc = embd_cuda_forward(ctx, gb, 2, &ge);
	if (!grc)
		grc = embd_cuda_sync(ctx, &ge);
	cmp_err("forward bad offsets", crc, &ce, grc, &ge);
	s[0].g.offsets[3] = saved;

	/* backward: offsets that do not start at 0 (the CPU says sample -1, so only the code) */
	s[0].g.offsets[0] = 1;
	side_reupload(&s[0]);
	crc = embd_kernels_backward(NULL, ta.cpu, &cb[0], 1, &ce);
	grc = embd_cuda_backward(ctx, ta.gpu, &gb[0], 1, &ge);
	if (!grc)
		grc = embd_cuda_sync(ctx, &ge);
	cmp_err("backward offsets not from 0", crc, NULL, grc, &ge);
	twin_compare(&ta, true, "backward offsets not from 0");

	matrix_free(&out);
	matrix_free(&dy);
	side_free(&s[0]);
	side_free(&s[1]);
	twin_destroy(&ta);
	twin_destroy(&tb);
}

int main(void)
{
	struct grng r = { 0x5eed1234abcdull };
	char msg[256];

	gpu_require("test_cuda_kernels");
	if (embd_cuda_ctx_create(0, NULL, &ctx, msg, sizeof(msg)))
		gpu_die("context: %s", msg);
	test_forward(&r);
	printf("forward: %d checks, %d failures\n", checks, failures);
	test_backward(&r);
	printf("forward+backward: %d checks, %d failures\n", checks, failures);
	test_nonfinite_rows(&r);
	test_bucketize(&r);
	test_errors(&r);
	embd_cuda_ctx_destroy(ctx);
	printf("%s: %d checks, %d failures\n", failures ? "FAILED" : "passed", checks, failures);
	return failures ? 1 : 0;
}
