/*
 * tests/gpu/test_cuda.h - what the parts of the GPU test program share: the context, the
 * failure count, comparisons that print what they expected and what they got, and data held
 * twice, once for the CPU kernels and once in device memory for the CUDA kernels.
 */
#ifndef EMBD_TESTS_GPU_TEST_CUDA_H
#define EMBD_TESTS_GPU_TEST_CUDA_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "tests/gpu/gpu_util.h"

extern struct embd_cuda_ctx *ctx;
extern int failures, checks;

#define FAIL(...)                                  \
	do {                                       \
		failures++;                        \
		printf("FAIL " __VA_ARGS__);       \
		printf("\n");                      \
	} while (0)

/* Same bits (or within abs_tol + rel_tol * |want| when either is set). */
void cmp_f32(const char *label, const float *want, const float *got, uint64_t n, double rel_tol,
	     double abs_tol);
/* Same bits, or within ulps fp16 ulps of want. */
void cmp_f16(const char *label, const uint16_t *want, const uint16_t *got, uint64_t n, int ulps);
void cmp_bytes(const char *label, const void *want, const void *got, size_t elem, uint64_t n);
/* Same code and, when want is given, the same feature, sample and id. */
void cmp_err(const char *label, int want_rc, const struct embd_kernel_err *want, int got_rc,
	     const struct embd_kernel_err *got);

/* A shard description with the test's optimizer settings (lr 0.05, adam's betas). */
struct embd_shard_desc shard_desc(uint32_t table, int64_t rows, uint32_t dim, enum embd_data_type dt,
				  int64_t row_off, int64_t nrows, uint32_t col_off, uint32_t ncols,
				  enum embd_optimizer_type opt);

struct twin {
	struct embd_shard *cpu, *gpu;
};

/* A CPU shard with init weights and a GPU shard holding a copy. */
void twin_create(struct twin *t, const struct embd_shard_desc *d, uint64_t seed);
void twin_destroy(struct twin *t);
/* The GPU shard equals the CPU one: bit for bit, or with rowwise_adagrad's tolerances. */
void twin_compare(const struct twin *t, bool exact, const char *label);

/* A feature's bags as a CPU batch and as a GPU batch (device copies of every array). */
struct side_batch {
	struct gbags g;
	int32_t *mean_lengths;          /* host, or NULL */
	struct embd_bag_batch cpu, gpu;
};

/*
 * Random bags of feature `feature` against twin t (ids in the shard's rows, the first id_span
 * of them), with pooled_stride / pooled_col set; partial_mean adds full bag lengths.
 */
void side_make(struct side_batch *s, struct grng *r, const struct twin *t, uint32_t feature,
	       uint32_t B, uint32_t max_len, uint64_t id_span, bool weighted,
	       enum embd_pooling pooling, bool partial_mean, uint64_t stride, uint32_t col);
/* Copies the host offsets and ids (changed by a test) to the device again. */
void side_reupload(struct side_batch *s);
void side_free(struct side_batch *s);

/* A B x stride float matrix on both sides, equal: random, or a NaN sentinel. */
struct side_matrix {
	float *cpu, *gpu, *back;
	uint64_t n;
};

/* r NULL: every element NaN (a sentinel that any write replaces). */
void matrix_make(struct side_matrix *m, struct grng *r, uint64_t n);
void matrix_free(struct side_matrix *m);

/* Block bucketize and its errors (test_cuda_bucketize.c). */
void test_bucketize(struct grng *r);

#endif /* EMBD_TESTS_GPU_TEST_CUDA_H */
