/*
 * The cost model: storage and time of one shard, TorchRec's EmbeddingStorageEstimator and
 * EmbeddingPerfEstimator (shard_estimators.py, estimator/estimator.py) rewritten in C.
 *
 * Reproduces TorchRec's numbers (the golden values of test_shard_estimators.py, within 1e-6)
 * for the default pipeline without cache statistics. Where embd differs, and why:
 *  - row_wise and table_row_wise on cpu: TorchRec has none (Gloo lacks reduce-scatter); embd
 *    runs them on cpu, so they are estimated with the same formulas at the cpu kernel's
 *    bandwidth (DDR) and the host's collective bandwidths. Both are memory-bound the same way.
 *  - cpu storage: TorchRec counts a cpu shard as DDR; embd counts it against the rank's HBM
 *    (on cpu the rank's share of host memory, plan.h), so cpu ranks are balanced and capped.
 *  - prefetch_compute is 0: it needs cache statistics, which tables files do not carry (as
 *    TorchRec without CacheParams.stats).
 *  - optimizer state is what embd's shards hold (kernels/shard.c): fp32 whatever the rows'
 *    data type, and rowwise_adagrad one float per row of every shard, column shards too.
 *    TorchRec multiplies the weights' bytes instead (fp16 state for fp16 rows, a 1/D share of
 *    a row's float for a column shard). Both agree for fp32 rows that are not column-split.
 */
#include "planner/planner_internal.h"

#include <math.h>

#define BIGINT_BYTES 8.0
#define COMM_ELEM_BYTES 4.0          /* fp32 all-to-all / reduce-scatter, TorchRec's default */
#define FULL_BLOCK_EMB_DIM 128
#define HALF_BLOCK_PENALTY 1.15
#define QUARTER_BLOCK_PENALTY 1.75
#define WEIGHTED_KERNEL_MULTIPLIER 1.1
#define BATCHED_COPY_PERF_FACTOR 2.455
#define DP_ELEMENTWISE_KERNELS_PERF_FACTOR 9.22

enum collective { ALL_TO_ALL, REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE };

/* BasicCommsBandwidths.get_bw: one NIC per GPU for all-reduce, else intra- or inter-host. */
static double comms_bw(const struct embd_topology *topo, int32_t world, int32_t local,
		       enum collective type)
{
	if (type == ALL_REDUCE)
		return topo->inter_host_bw_bytes_per_ms * local;
	return world <= local ? topo->intra_host_bw_bytes_per_ms : topo->inter_host_bw_bytes_per_ms;
}

/* kernel_bw_lookup; 0 where the kernel does not exist on the device. */
static double kernel_bw(const struct embd_topology *topo, enum embd_compute_kernel kernel)
{
	double r = topo->uvm_caching_ratio;

	if (topo->compute_device == EMBD_DEVICE_CPU) {
		switch (kernel) {
		case EMBD_KERNEL_DENSE: return 0.5 * topo->ddr_mem_bw_bytes_per_ms;
		case EMBD_KERNEL_FUSED: return topo->ddr_mem_bw_bytes_per_ms;
		default: return 0;
		}
	}
	switch (kernel) {
	case EMBD_KERNEL_DENSE: return 0.5 * topo->hbm_mem_bw_bytes_per_ms;
	case EMBD_KERNEL_FUSED: return topo->hbm_mem_bw_bytes_per_ms;
	case EMBD_KERNEL_FUSED_UVM: return topo->hbm_to_ddr_mem_bw_bytes_per_ms / 10;
	case EMBD_KERNEL_FUSED_UVM_CACHING:
		return (r * topo->hbm_mem_bw_bytes_per_ms +
			(1 - r) * topo->hbm_to_ddr_mem_bw_bytes_per_ms) / 10;
	default: return 0;
	}
}

static double block_penalty(int32_t dim)
{
	if (dim >= FULL_BLOCK_EMB_DIM)
		return 1.0;
	return dim >= 64 ? HALF_BLOCK_PENALTY : QUARTER_BLOCK_PENALTY;
}

/* Bytes of optimizer state beside weight_bytes of a shard cols wide with ts-byte rows. */
static double state_bytes(const struct embd_table_spec *t, double weight_bytes, int32_t cols,
			  double ts)
{
	const double floats = weight_bytes / ts;   /* the weights' elements */

	switch (t->optimizer.type) {
	case EMBD_OPT_SGD: return 0;
	case EMBD_OPT_ADAM: return 2 * floats * 4;
	case EMBD_OPT_ROWWISE_ADAGRAD: return floats / cols * 4;
	default: return floats * 4;
	}
}

void planner_batch_io(const struct embd_table_spec *t, const struct embd_table_constraints *c,
		      const struct embd_topology *topo, double *batch_inputs,
		      double *batch_outputs)
{
	double bi = 0, bo = 0;

	for (uint32_t f = 0; f < t->num_features; f++) {
		double pf = c && c->num_pooling_factors ? c->pooling_factors[f] : 1.0;
		double np = c && c->num_num_poolings ? c->num_poolings[f] : 1.0;
		double bs = c && c->num_batch_sizes ? c->batch_sizes[f] : topo->batch_size;
		bi += pf * np * bs;
		bo += (pf < 1.0 ? pf : 1.0) * np * bs;
	}
	*batch_inputs = bi;
	*batch_outputs = bo;
}

int embd_plan_estimate_shard(const struct embd_table_spec *t,
			     const struct embd_table_constraints *c,
			     const struct embd_topology *topo, enum embd_sharding_type type,
			     enum embd_compute_kernel kernel, int64_t rows, int32_t cols,
			     struct embd_shard_perf *perf, struct embd_shard_storage *storage)
{
	double bw = kernel_bw(topo, kernel);
	if (bw <= 0 || (type == EMBD_SHARD_DATA_PARALLEL) != (kernel == EMBD_KERNEL_DENSE))
		return EMBD_ENOTSUP;

	double ts = embd_dtype_bytes(t->data_type);
	double W = topo->world_size, L = topo->local_world_size, nodes = W / L;
	double D = cols, bi, bo;
	bool weighted = c && c->is_weighted;
	planner_batch_io(t, c, topo, &bi, &bo);

	/* Inputs (ids) read, rows looked up and outputs written, per sharding type. */
	double divisor = type == EMBD_SHARD_ROW_WISE ? W :
			 type == EMBD_SHARD_TABLE_ROW_WISE ? L : 1;
	double in_bytes, lookup_bytes, out_bytes, penalty = 1.0;
	if (type == EMBD_SHARD_DATA_PARALLEL) {
		in_bytes = ceil(bi * BIGINT_BYTES);
		lookup_bytes = bi * D * ts;
		out_bytes = bo * D * ts;
	} else {
		in_bytes = ceil(bi / divisor * W * BIGINT_BYTES);
		lookup_bytes = bi / divisor * W * D * ts;
		out_bytes = bo * W * D * COMM_ELEM_BYTES;
		if (divisor == 1) {     /* table_wise, column_wise, table_column_wise */
			lookup_bytes = bi * W * (D > 32 ? D : 32) * ts;
			penalty = block_penalty(cols);
		}
	}
	if (weighted)
		in_bytes *= 2;

	double fwd = (in_bytes + lookup_bytes + out_bytes) * penalty / bw;
	double bwd = fwd * topo->bwd_compute_multiplier;
	if (weighted)
		bwd += fwd * WEIGHTED_KERNEL_MULTIPLIER;

	double fwd_comms = 0, bwd_comms = 0;
	int32_t Wi = topo->world_size, Li = topo->local_world_size;
	switch (type) {
	case EMBD_SHARD_TABLE_WISE:
	case EMBD_SHARD_COLUMN_WISE:
	case EMBD_SHARD_TABLE_COLUMN_WISE:
		fwd_comms = bwd_comms = out_bytes / comms_bw(topo, Wi, Li, ALL_TO_ALL);
		break;
	case EMBD_SHARD_ROW_WISE:
		fwd_comms = out_bytes / comms_bw(topo, Wi, Li, REDUCE_SCATTER);
		bwd_comms = out_bytes / comms_bw(topo, Wi, Li, ALL_GATHER) +
			    out_bytes * BATCHED_COPY_PERF_FACTOR / bw;
		break;
	case EMBD_SHARD_TABLE_ROW_WISE: {
		/* reduce-scatter inside the node, then the node's share crosses hosts */
		double inter = 0;
		if (nodes > 1)
			inter = bo * nodes * D * COMM_ELEM_BYTES /
				comms_bw(topo, (int32_t)nodes, 1, ALL_TO_ALL);
		fwd_comms = out_bytes / comms_bw(topo, Li, Li, REDUCE_SCATTER) + inter;
		bwd_comms = inter + out_bytes / comms_bw(topo, Li, Li, ALL_GATHER) +
			    out_bytes * BATCHED_COPY_PERF_FACTOR / bw;
		break;
	}
	case EMBD_SHARD_DATA_PARALLEL: {
		double table_bytes = (double)rows * D * ts;
		double n = nodes < 2 ? nodes : 2;
		double all_reduce = table_bytes * (2 * n - 1) / n /
				    comms_bw(topo, Wi, Li, ALL_REDUCE);
		if (W > 2 * L)
			all_reduce *= 2;
		bwd_comms = all_reduce + table_bytes * DP_ELEMENTWISE_KERNELS_PERF_FACTOR / bw;
		break;
	}
	default:
		return EMBD_EINVAL;
	}
	perf->fwd_compute_ms = fwd;
	perf->bwd_compute_ms = bwd;
	perf->fwd_comms_ms = fwd_comms;
	perf->bwd_comms_ms = bwd_comms;

	/* Storage: weights (+ optimizer state, + cache metadata) and the IO buffers. */
	double table_rows = (double)t->num_embeddings, table_dim = t->embedding_dim;
	double shard_elems = (double)rows * cols;
	double table_bytes = table_rows * table_dim * ts;
	bool uvm = kernel == EMBD_KERNEL_FUSED_UVM || kernel == EMBD_KERNEL_FUSED_UVM_CACHING;
	uint64_t weights_hbm = 0, weights_ddr = 0;
	double share = type == EMBD_SHARD_DATA_PARALLEL ? 1.0 :
		       shard_elems / (table_rows * table_dim);
	if (uvm) {
		double ddr = ceil(table_bytes * share);
		weights_ddr = (uint64_t)(ddr + ceil(state_bytes(t, ddr, cols, ts)));
		if (kernel == EMBD_KERNEL_FUSED_UVM_CACHING) {
			double clf = topo->uvm_caching_ratio;
			/* Python's round() of the cached bytes; ties cannot occur for clf 0.2 */
			double cached = ceil(nearbyint(table_bytes * clf) * share);
			weights_hbm = (uint64_t)(cached + ceil(state_bytes(t, cached, cols, ts)) +
						 ceil((double)rows * (4 + clf * 16)));
		}
	} else {
		double w = ceil(table_bytes * share);
		weights_hbm = (uint64_t)(w + ceil(state_bytes(t, w, cols, ts)));
	}

	double in_size = 0, out_size = 0;
	if (type == EMBD_SHARD_DATA_PARALLEL) {
		in_size = ceil(bi * BIGINT_BYTES);
		out_size = ceil(bo * table_dim * ts);
	} else if (shard_elems > 0) {
		in_size = ceil(bi / divisor * W * BIGINT_BYTES);
		out_size = ceil(bo * W * cols * ts);
	}
	/* cpu has no uvm kernels: all of a cpu shard lands in HBM, the rank's share of memory */
	storage->hbm_bytes = weights_hbm + (uint64_t)(in_size + out_size);
	storage->ddr_bytes = weights_ddr;
	return 0;
}
