/*
 * tools/bench/bench_limits.h - the memory limits `embd-bench kernels` holds the kernels to
 * (bench_limits.c says what each one is and why it is one). Each limit runs one batch per
 * call on the kernels' own (pinned) worker pool, so fork-join costs are in the limit too.
 */
#ifndef EMBD_BENCH_LIMITS_H
#define EMBD_BENCH_LIMITS_H

#include <stdatomic.h>
#include <stdint.h>

#include "kernels/embedding.h"
#include "kernels/workers.h"

#define BENCH_LIMIT_MAX_WORKERS 64

/*
 * The forward limit: bags of ids_per_out ids of ids[0, n), the rows (row_bytes, a multiple of
 * 16) read once each in the kernel's passes of pass_bytes, with its prefetch distance, prefetch
 * bytes and vector width for isa, and each bag's out_row_bytes pooled row stored in out.
 */
struct bench_gather {
	const uint8_t *table;
	uint64_t row_bytes;
	uint64_t pass_bytes;            /* embd_forward_pass_cols() x the row's element size */
	uint8_t *out;
	uint64_t out_row_bytes;         /* row_bytes (fp32 rows) or twice it (fp16), a multiple of 64 */
	uint64_t ids_per_out;           /* the pooling factor */
	enum embd_isa isa;              /* the kernel's (not AUTO) */
	const int64_t *ids;             /* this batch's */
	uint64_t n;
	/* where the kernels' lean loop takes a row (embd_forward_lean) and a bag fits in a
	 * window (P <= EMBD_LEAN_WINDOW_IDS), read the ids from a window of them copied first,
	 * as that loop does (1), or straight from the batch (0); elsewhere ignored. Which is
	 * faster depends on the row (bench_limits.c), so the benchmarks run both and take the
	 * faster */
	int windowed;
	/* ids ahead whose rows it prefetches, at most EMBD_LEAN_WINDOW_PAD; 0: the kernel's
	 * (embd_forward_prefetch_distance). The distance the kernel needs is not always the one
	 * the limit's lighter loop does best with (bench_limits.c), so the benchmarks also run
	 * the other distance (bench_gather_other_prefetch_ids) and take the faster */
	uint32_t prefetch_ids;
	/* where the lean loop takes rows of 256 or 512 bytes of fp16 (embd_forward_prefetch_near),
	 * also prefetch each line of the row EMBD_PREFETCH_IDS_NEAR ids ahead into L1, as the
	 * kernel's loop does there. Which is faster depends on the machine and the hour (on an
	 * Intel Xeon the kernel read above the limit without it, bench_limits.c), so the
	 * benchmarks run both and take the faster; other rows ignore it */
	bool prefetch_near;
	/* where the 256-bit walk (AVX2's, and fp16 rows' on AVX-512) takes a row in the lean loop,
	 * hold the row's loads in line order, each line's prefetch after its load, as the kernel's
	 * loop issues them (the 512-bit walk always does), or leave gcc's order (it regroups the
	 * integer adds). Which is faster depends on the row (on an Intel Xeon AVX-512 fp16 D 128
	 * P 100 in order, fp16 D 256 and AVX2 fp32 D 64 gcc's, bench_limits.c), so the benchmarks
	 * run both and take the faster; elsewhere ignored */
	bool in_line_order;
	atomic_uint_fast64_t next;
	uint64_t sink[BENCH_LIMIT_MAX_WORKERS][8]; /* per worker: keeps the loads alive */
};

/* One batch (g->ids, g->n) of the gather limit. */
void bench_gather_run(struct embd_workers *workers, struct bench_gather *g);

/* The prefetch distance the gather limit also runs for rows of row_bytes and elements of
 * elem_bytes (bench_gather.prefetch_ids): of the two the kernels use (EMBD_PREFETCH_IDS and
 * EMBD_PREFETCH_IDS_FAR), the one the kernel (embd_forward_prefetch_distance) does not use for
 * these rows. Where it wins, the limit says the kernel's distance may be the wrong one. */
uint32_t bench_gather_other_prefetch_ids(uint64_t row_bytes, uint32_t elem_bytes);

/* The ways g can read its ids: 2 where bench_gather.windowed changes what it does, else 1. */
int bench_gather_ways(const struct bench_gather *g);

/* The ways g can prefetch its rows into L1 a few ids ahead: 2 where bench_gather.prefetch_near
 * changes what it does (the kernel's lean loop prefetches those rows so), else 1. */
int bench_gather_near_ways(const struct bench_gather *g);

/* The orders g can load a row's lines in: 2 where bench_gather.in_line_order changes what it
 * does, else 1. */
int bench_gather_order_ways(const struct bench_gather *g);

/*
 * The orders the read-modify-write limit can walk a row in: which is the fastest depends on the
 * isa and the optimizer (bench_limits.c), so the benchmarks run each and take the fastest.
 */
enum bench_rmw_order {
	BENCH_RMW_PREFETCH_FIRST,       /* the rows ahead prefetched, then the row's gradients read */
	BENCH_RMW_GRAD_FIRST,           /* the gradients read, then the rows ahead prefetched, as the
					 * kernel orders them */
	BENCH_RMW_GRAD_FIRST_UNROLLED,  /* GRAD_FIRST with the gradient rows' loads unrolled and the
					 * arrays of under a line a row written first, as the kernel's
					 * rowwise_adagrad reads its state first */
	BENCH_RMW_ORDERS
};

/*
 * The backward limit: every row of rows[0, n) (distinct, ascending) read and written back
 * unchanged in each array (the weights and each optimizer state array), with the kernels'
 * prefetch distance and vector width for isa, after the gradient rows of the row's
 * occurrences (bags[first[k], first[k + 1]) for row k) are read.
 */
struct bench_rmw {
	uint8_t *arrays[3];
	uint64_t row_bytes[3];          /* per row of each array; a multiple of 4 */
	int num_arrays;
	const uint8_t *grad;            /* the batch's dL/d(pooled): one row per bag */
	uint64_t grad_row_bytes;        /* a multiple of 4 */
	enum embd_isa isa;
	const uint64_t *rows;           /* this batch's distinct rows, ascending */
	const uint64_t *first;          /* n + 1 */
	const uint32_t *bags;           /* each occurrence's bag, grouped by row */
	uint64_t n;
	atomic_uint_fast64_t next;
	volatile uint32_t zero;         /* 0, unknown to the compiler: the stores stay */
	enum bench_rmw_order order;
};

/*
 * The rows, first and bags of bench_rmw for the n ids of a batch of bags of ids_per_bag ids
 * each (in order); rows and bags hold n, first n + 1, scratch 2n. Returns the number of
 * distinct rows.
 */
uint64_t bench_rmw_rows_make(const int64_t *ids, uint64_t n, uint64_t ids_per_bag,
			     uint64_t *scratch, uint64_t *rows, uint64_t *first, uint32_t *bags);

/* One batch (r->rows, r->n) of the read-modify-write limit. */
void bench_rmw_run(struct embd_workers *workers, struct bench_rmw *r);

/* The checksum of what the gather limit read, to print: nothing it loaded was dead code. */
uint64_t bench_gather_checksum(const struct bench_gather *g);

#endif /* EMBD_BENCH_LIMITS_H */
