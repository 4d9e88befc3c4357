/*
 * kernels/embedding.h - the CPU embedding kernels: table shards, pooled forward, and the fused
 * backward + optimizer (TorchRec's FUSED compute kernel on CPU).
 *
 * A shard is the part of one table that one rank holds: a global row range and a column range,
 * stored row-major. Kernels take GLOBAL ids and check every one against the shard's row range
 * inside the loop that reads it (a client may rewrite its memory after validation): an id
 * outside is an error for the caller to route, and is never read. The arithmetic is the one of
 * kernels/pool_row.h and kernels/optim_row.h, so results equal a plain loop bit for bit
 * whatever the instruction set or the number of threads.
 *
 * Threading: a call runs on the workers of exec (or the calling thread). Calls on different
 * shards may run concurrently on different worker pools; a backward call must not overlap any
 * other call that reads or writes its shard.
 */
#ifndef EMBD_KERNELS_EMBEDDING_H
#define EMBD_KERNELS_EMBEDDING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"
#include "kernels/workers.h"

/* ---- instruction sets ------------------------------------------------------------------- */

enum embd_isa {
	EMBD_ISA_AUTO = 0,              /* the best one this CPU supports */
	EMBD_ISA_SCALAR = 1,            /* plain C, any CPU */
	EMBD_ISA_AVX2 = 2,              /* AVX2 + FMA + F16C */
	EMBD_ISA_AVX512 = 3,            /* AVX-512 F/BW/VL + FMA + F16C */
};

/*
 * $EMBD_ISA (scalar, avx2 or avx512), read once per process, caps the best isa: with
 * EMBD_ISA=avx2 an AVX-512 machine runs, tests and benchmarks the AVX2 kernels as an AVX2-only
 * machine would, and an explicit request for avx512 is refused as unsupported. A cap above
 * what this CPU has changes nothing; "auto", an empty or an unknown value is ignored.
 */

/* Whether this build and this CPU (under $EMBD_ISA) can run isa (AUTO: always). */
bool embd_kernels_isa_supported(enum embd_isa isa);

/* The isa AUTO stands for on this CPU, under $EMBD_ISA. */
enum embd_isa embd_kernels_isa_best(void);

/* "scalar", "avx2", "avx512" or "auto". */
const char *embd_kernels_isa_name(enum embd_isa isa);

/* The isa named name (as embd_kernels_isa_name() spells it) into *out: 0, or EMBD_EINVAL. */
int embd_kernels_isa_parse(const char *name, enum embd_isa *out);

/*
 * Where the time of backward calls went, in wall-clock ns per phase (backward.c describes
 * them), added up over the calls that were given it.
 */
struct embd_backward_times {
	uint64_t calls;
	uint64_t setup_ns;              /* allocation, offsets snapshot and checks */
	uint64_t collect_ns;            /* ids checked and counted by bucket, buckets dealt to the
					 * workers that sort them */
	uint64_t scatter_ns;            /* occurrences written, each worker's into its own region
					 * (a single worker writes them in collect) */
	uint64_t sort_ns;               /* each worker's buckets sorted by row: the rest of the
					 * deduplication */
	uint64_t apply_ns;              /* gradients summed per row, optimizer on weights and state */
};

/* How many ids ahead the forward prefetches rows of row_bytes and elements of elem_bytes, on
 * this CPU (embd_forward_prefetch_rows in cpu_kernels.h). It follows the CPU's vendor, or
 * $EMBD_CPU_VENDOR (intel or other) where set when first asked. Every row goes to L2 (some
 * also to L1, a few ids ahead: embd_forward_prefetch_near). On a Zen 4 every row size pooled
 * fastest prefetched into L2 (2026-12-05). On an Intel Xeon with AVX-512 fp32 rows of 512
 * bytes (D 128) pooled 11-17% faster prefetched into L1 than into L2 at 20 and 100 ids a bag,
 * both 12 ids ahead (2026-12-06), but into L2 48 ids ahead they took 17-31% less time a batch
 * than into L1 12 ahead, and into L1 48 ahead 34-56% more than into L2 (2026-12-07,
 * docs/benchmarks.md), so there is no L1 loop for them. */
uint32_t embd_forward_prefetch_distance(uint64_t row_bytes, uint32_t elem_bytes);

/* Whether the forward's lean loop, run with isa (not AUTO), also prefetches rows of row_bytes
 * and elements of elem_bytes into L1 a few ids ahead on this CPU (embd_forward_prefetch_l1_near
 * in cpu_kernels.h; the vendor as for embd_forward_prefetch_distance). */
bool embd_forward_prefetch_near(enum embd_isa isa, uint64_t row_bytes, uint32_t elem_bytes);

/* How many rows ahead the backward's apply prefetches rows that bring row_bytes of weights and
 * optimizer state each, on this CPU (embd_backward_prefetch_rows in cpu_kernels.h). */
uint32_t embd_backward_prefetch_distance(uint64_t row_bytes);

/* Whether the backward's apply also prefetches into L1 the row of the occurrence after the next
 * row's first, for optimizer type (embd_backward_prefetch_l1_near in cpu_kernels.h; the same on
 * every CPU). */
bool embd_backward_prefetch_l1(enum embd_optimizer_type type);

/* How a kernel call runs. A NULL exec means the calling thread and the best isa. */
struct embd_exec {
	struct embd_workers *workers;   /* NULL: the calling thread only */
	enum embd_isa isa;              /* EMBD_ISA_AUTO, or one to force (tests, benchmarks) */
	struct embd_backward_times *backward_times; /* NULL, or where backward adds its phases */
};

/* Where and why a kernel call failed: the batch's feature, the sample and the offending id. */
struct embd_kernel_err {
	uint32_t feature;               /* embd_bag_batch.feature of the failing batch */
	int64_t sample;                 /* sample in that batch, -1 when not about one sample */
	int64_t id;                     /* the id (or offset) that was out of range */
	char msg[192];
};

/* ---- shards ----------------------------------------------------------------------------- */

/* What a shard is: which part of which table, stored how, trained by what. */
struct embd_shard_desc {
	uint32_t table_id;              /* feeds the weight init, so every plan inits alike */
	int64_t num_embeddings;         /* rows of the whole table */
	uint32_t embedding_dim;         /* columns of the whole table */
	enum embd_data_type dtype;
	int64_t row_offset;             /* global rows [row_offset, row_offset + rows) */
	int64_t rows;
	uint32_t col_offset;            /* global columns [col_offset, col_offset + cols) */
	uint32_t cols;
	struct embd_optimizer_spec optimizer;
};

/*
 * A shard and its memory. weights: rows x cols elements of dtype, row-major, 64-byte aligned
 * when embd_shard_create allocated it. Optimizer state is fp32 (kernels/optim_row.h):
 * momentum1 = adagrad's sum of squares (rows x cols), rowwise_adagrad's (rows), adam's m
 * (rows x cols); momentum2 = adam's v (rows x cols); NULL where the optimizer has none.
 */
struct embd_shard {
	struct embd_shard_desc desc;
	void *weights;
	float *momentum1;
	float *momentum2;
	int64_t step;                   /* optimizer steps applied; adam's t of the last one */
	/* rows a backward left NaN or infinite (weights as stored, or state), over all steps,
	 * and the global row of the last backward's first one (lowest row): the CPU kernels
	 * check every row they update while it is in cache (kernels/cpu_kernels.c), the CUDA kernels
	 * likewise (added at embd_cuda_sync; not yet run on a GPU). A fused_uvm_caching shard
	 * names the row of its lowest cache slot, not always the lowest row */
	uint64_t nonfinite_rows;
	int64_t nonfinite_row;
	bool owns_memory;
};

/* Bytes of the shard's weights and of each state array (0 where unused). Checks desc. */
int embd_shard_sizes(const struct embd_shard_desc *desc, uint64_t *weights_bytes,
		     uint64_t *momentum1_bytes, uint64_t *momentum2_bytes, char *err, size_t err_len);

/*
 * Allocates a shard with 64-byte aligned weights and zeroed state. The weights are left
 * uninitialised: call embd_shard_init_weights() or load a checkpoint.
 */
int embd_shard_create(const struct embd_shard_desc *desc, struct embd_shard **out, char *err,
		      size_t err_len);

/*
 * A shard over memory the caller provides (e.g. from libnuma), of embd_shard_sizes() bytes
 * each (momentum pointers NULL where the size is 0). Nothing is initialised or zeroed, and
 * destroy frees only the struct.
 */
int embd_shard_create_in(const struct embd_shard_desc *desc, void *weights, float *momentum1,
			 float *momentum2, struct embd_shard **out, char *err, size_t err_len);

/*
 * Memory for rows read at random (a shard's weights and state, cache rows): 64-byte aligned,
 * and from 2 MiB on 2 MiB aligned and advised to transparent huge pages, which spare the
 * kernels a TLB miss on nearly every row (THP in "madvise" mode gives huge pages only where
 * advised). Zeroed when zero. free() releases it; NULL for 0 bytes or out of memory.
 */
void *embd_rows_alloc(uint64_t bytes, bool zero);

/* Frees the shard (and its memory if it allocated it). NULL is a no-op. */
void embd_shard_destroy(struct embd_shard *shard);

/*
 * The initial value of weight (row, col) of a table (global coordinates): uniform in
 * [-sqrt(1/num_embeddings), sqrt(1/num_embeddings)) as TorchRec initialises, drawn from a hash
 * of (seed, table_id, row, col) so that any sharding of a table inits to the same numbers.
 */
float embd_init_value(uint64_t seed, uint32_t table_id, int64_t num_embeddings, int64_t row,
		      uint32_t col);

/* Sets every weight to embd_init_value (rounded to fp16 for fp16 shards), and state to 0. */
void embd_shard_init_weights(struct embd_shard *shard, uint64_t seed, const struct embd_exec *exec);

/* ---- forward and backward --------------------------------------------------------------- */

/*
 * The bags of one feature of a batch against one shard, and where their pooled rows go.
 * Bag b holds ids[offsets[b] .. offsets[b + 1]); offsets has batch_size + 1 entries with
 * offsets[0] == 0, non-decreasing, offsets[batch_size] == num_ids. Pooled bag b covers columns
 * [pooled_col, pooled_col + shard cols) of row b of a float matrix with pooled_stride floats
 * per row (a KeyedTensor: pooled_col is the feature's offset plus the shard's col_offset).
 */
struct embd_bag_batch {
	const struct embd_shard *shard;
	uint32_t feature;               /* reported in errors */
	uint32_t batch_size;            /* B */
	const int64_t *offsets;         /* B + 1 */
	const int64_t *ids;             /* num_ids global row ids */
	const float *weights;           /* num_ids per-id weights, or NULL for 1 */
	uint64_t num_ids;
	enum embd_pooling pooling;
	/*
	 * MEAN only: the FULL length of each of the B bags, or NULL to use offsets. A row_wise shard
	 * sees only its part of a bag; dividing by the whole length makes the partial sums of all
	 * shards add up to the mean.
	 */
	const int32_t *mean_lengths;
	float *pooled;                  /* forward: written, B x shard cols */
	const float *pooled_grad;       /* backward: dL/d(pooled), same layout */
	/* backward: dL/d(pooled) counts divided by it (TorchRec's gradient division by the
	 * number of trainers; kernels/pool_row.h embd_grad_scale); 0 or 1: not divided */
	uint32_t grad_divisor;
	uint64_t pooled_stride;         /* floats between the rows of pooled / pooled_grad */
	uint32_t pooled_col;
};

/*
 * Pooled forward of n bag batches, each against its own shard (any mix of shards, each
 * batch's output columns disjoint from the others'). Writes every pooled bag, zero for empty
 * ones. Returns 0; EMBD_EINVAL for a malformed batch (offsets, missing pointers); EMBD_ERANGE
 * for an id outside its shard's rows, with feature, sample and id in err (may be NULL). On
 * error the outputs are unspecified.
 */
int embd_kernels_forward(const struct embd_exec *exec, const struct embd_bag_batch *batches,
			 uint32_t n, struct embd_kernel_err *err);

/*
 * One fused backward + optimizer step on one shard: every batch must name this shard (or
 * NULL). The gradient of each row is the sum over all its occurrences in all batches,
 * combined in batch order, and the optimizer updates each touched row once (EXACT semantics);
 * no dense gradient is formed. shard->step is incremented even when no id touches the shard,
 * so call it once per training step for every shard. All ids are checked before any row
 * changes: on error (EMBD_EINVAL, EMBD_ERANGE as for forward, EMBD_ENOMEM) nothing was
 * updated and step is unchanged.
 */
int embd_kernels_backward(const struct embd_exec *exec, struct embd_shard *shard,
			  const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err);

/*
 * The same step in two parts, for shards that see the same bags: the column shards of one
 * table (column_wise, table_column_wise) get the same ids, offsets, weights and scales and
 * differ only in their columns and their gradient columns (pooled_grad, pooled_col,
 * pooled_stride). embd_kernels_backward_prepare checks the batches against shard exactly as
 * embd_kernels_backward does (the same errors, nothing written to any shard) and makes *out:
 * their occurrences, checked and sorted by row, for the rows of shard (row_offset, rows).
 * embd_kernels_backward_apply is the rest of embd_kernels_backward on a shard of those same
 * rows (any columns), with batches that describe the same bags as the prepared ones (same n,
 * and per batch the same ids, offsets, weights, pooling, mean_lengths and grad_divisor: the
 * caller's promise; the counts of bags and ids are checked, EMBD_EINVAL otherwise) and name
 * this shard or NULL. Preparing once and applying to each shard gives every shard the bits
 * embd_kernels_backward gives it. A prep is only read by apply: applies on different shards
 * may share it at once, from any threads; free it after the last. On error *out is NULL.
 * backward_times: prepare adds phases 1-4 (setup to sort), apply the rest and one call.
 */
struct embd_backward_prep;
int embd_kernels_backward_prepare(const struct embd_exec *exec, const struct embd_shard *shard,
				  const struct embd_bag_batch *batches, uint32_t n,
				  struct embd_backward_prep **out, struct embd_kernel_err *err);
int embd_kernels_backward_apply(const struct embd_exec *exec, struct embd_shard *shard,
				const struct embd_backward_prep *prep,
				const struct embd_bag_batch *batches, uint32_t n,
				struct embd_kernel_err *err);
/* NULL is a no-op. */
void embd_backward_prep_free(struct embd_backward_prep *prep);

#endif /* EMBD_KERNELS_EMBEDDING_H */
