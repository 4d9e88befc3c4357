/*
 * tests/gpu/gpu_util.h - what the GPU test and the GPU benchmark share: the no-GPU exit, checked
 * device memory, and random bags. Test-only code: a CUDA failure here ends the program with a
 * message, since nothing after it could be trusted.
 */
#ifndef EMBD_TESTS_GPU_UTIL_H
#define EMBD_TESTS_GPU_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/embedding_cuda.h"

/* The exit code of a program that found no GPU (ctest's SKIP_RETURN_CODE). */
#define GPU_SKIP_EXIT 77

/* Exits GPU_SKIP_EXIT with a message when this machine has no usable GPU. */
void gpu_require(const char *prog);

/* Prints and exits 1. */
void gpu_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

void *dev_alloc(size_t bytes);
/* Copies that are complete, and ordered after all GPU work, when they return. */
void dev_copy_in(void *dev, const void *host, size_t bytes);
void *dev_upload(const void *host, size_t bytes);     /* NULL for a NULL host or 0 bytes */
void dev_download(void *host, const void *dev, size_t bytes);
void dev_zero(void *dev, size_t bytes);
void dev_free(void *dev);

/* xorshift64*: deterministic per seed. */
struct grng {
	uint64_t s;
};
uint64_t grng_u64(struct grng *r);
uint64_t grng_below(struct grng *r, uint64_t n);      /* [0, n), 0 for n = 0 */
float grng_float(struct grng *r, float lo, float hi);

/*
 * One feature's bags in host memory: B lengths in [0, max_len] (zero_pct of them empty), ids
 * in [id_lo, id_lo + id_span), per-id weights when weighted.
 */
struct gbags {
	uint32_t batch_size;
	int32_t *lengths;
	int64_t *offsets;               /* B + 1 */
	int64_t *ids;
	float *weights;                 /* or NULL */
	uint64_t num_ids;
};
void gbags_random(struct gbags *g, struct grng *r, uint32_t batch_size, uint32_t max_len,
		  uint32_t zero_pct, int64_t id_lo, uint64_t id_span, int weighted);
void gbags_free(struct gbags *g);

#endif /* EMBD_TESTS_GPU_UTIL_H */
