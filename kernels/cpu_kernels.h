/*
 * kernels/cpu_kernels.h - internal: the hot loops of the CPU kernels, one table of functions
 * per instruction set. cpu_kernels.c is compiled once per variant (scalar; AVX2; AVX-512) with
 * that variant's compiler flags, so the same source, and the same per-row arithmetic of
 * pool_row.h and optim_row.h, runs at every width; forward.c and backward.c pick a table at
 * run time (isa.c) and do everything that does not depend on it.
 */
#ifndef EMBD_KERNELS_CPU_KERNELS_H
#define EMBD_KERNELS_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/embedding.h"
#include "kernels/optim_row.h"

/* Rows of upcoming ids are prefetched this many ids ahead (a few DRAM latencies' worth). */
#define EMBD_PREFETCH_IDS 12

/* One occurrence of a row in a backward step, after its id was checked. */
struct embd_occ {
	uint64_t row;                   /* shard-local row */
	uint32_t bag;                   /* index into embd_bwd_rows.bag_grad */
	float coef;                     /* embd_grad_coef(): per-id weight times the bag's scale */
};

/* What applying combined gradients to a shard's rows needs. */
struct embd_bwd_rows {
	struct embd_shard *shard;
	struct embd_optim_params params;
	const float *const *bag_grad;   /* per bag: its dL/d(pooled) for the shard's columns */
};

struct embd_cpu_kernels {
	enum embd_isa isa;
	/*
	 * Pools bags [first, last) of batch into batch->pooled. 0, EMBD_EINVAL for offsets out of
	 * order or outside num_ids, EMBD_ERANGE for an id outside the shard; err says where.
	 */
	int (*forward_bags)(const struct embd_bag_batch *batch, uint32_t first, uint32_t last,
			    struct embd_kernel_err *err);
	/*
	 * occ[0, n) is sorted by row, each row's run in batch order: sums each run into grad_row
	 * (2 x cols floats of scratch) and applies the optimizer to the row once. Returns how
	 * many rows it left NaN or infinite (weights or state), the first (lowest) in *bad_row.
	 */
	uint64_t (*apply_rows)(const struct embd_bwd_rows *ctx, const struct embd_occ *occ,
			       size_t n, float *grad_row, uint64_t *bad_row);
};

extern const struct embd_cpu_kernels embd_cpu_kernels_scalar;
#ifdef EMBD_KERNELS_X86
extern const struct embd_cpu_kernels embd_cpu_kernels_avx2;
extern const struct embd_cpu_kernels embd_cpu_kernels_avx512;
#endif

/* The table for isa (AUTO: the best), or NULL when this CPU or build cannot run it. */
const struct embd_cpu_kernels *embd_cpu_kernels_get(enum embd_isa isa);

/* Fills err (may be NULL) and returns code. */
int embd_kernel_fail(struct embd_kernel_err *err, int code, uint32_t feature, int64_t sample,
		     int64_t id, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The first error by (batch, sample) among several found (per worker, then merged), so the
 * error reported does not depend on how work was scheduled. */
struct embd_first_err {
	int rc;                         /* 0: none yet */
	uint32_t batch;
	struct embd_kernel_err e;
};

/* Keeps (rc, batch, e) in f when it comes before what f holds. */
void embd_first_err_note(struct embd_first_err *f, int rc, uint32_t batch,
			 const struct embd_kernel_err *e);

/* Checks what a batch's description promises (pointers, pooling, stride) against its shard. */
int embd_bag_batch_check(const struct embd_bag_batch *bt, const struct embd_shard *shard,
			 bool backward, struct embd_kernel_err *err);

#endif /* EMBD_KERNELS_CPU_KERNELS_H */
