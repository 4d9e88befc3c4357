/*
 * The planner's cost model against TorchRec: the golden values of TorchRec's own
 * test_shard_estimators.py (test_1_table_perf) within 1e-6 relative, storage exactly, and
 * values computed by hand from TorchRec's formulas for tables with other optimizers,
 * pooling factors and kernels.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "embd/plan.h"
#include "planner/planner_internal.h"

static struct embd_table_spec table(int64_t rows, int32_t dim)
{
	struct embd_table_spec t = { .num_embeddings = rows, .embedding_dim = dim,
				     .num_features = 1 };
	strcpy(t.name, "t");
	strcpy(t.feature_names[0], "f");
	return t;
}

static void expect_rel(double got, double want, const char *what)
{
	double rel = fabs(got - want) / fabs(want);
	cr_expect(rel <= 1e-6, "%s: expected %.9g, got %.9g (relative error %.3g)", what, want, got,
		  rel);
}

/*
 * TorchRec 1.9.2's EmbeddingEnumerator + EmbeddingPerfEstimator + EmbeddingStorageEstimator
 * on Topology(world_size=2, compute_device="cuda"), batch 512, one 100 x 10 table (the
 * setting of test_1_table_perf; the values agree with its published ones to every digit
 * shown there). Columns: perf of shard 0 and its storage.
 */
static const struct golden {
	enum embd_sharding_type type;
	enum embd_compute_kernel kernel;
	int64_t rows;
	double fwd_compute, fwd_comms, bwd_compute, bwd_comms;
	uint64_t hbm, ddr;
} golden[] = {
	{ EMBD_SHARD_DATA_PARALLEL, EMBD_KERNEL_DENSE, 100, 9.356002212235228e-05, 0,
	  0.00018712004424470456, 0.000225593945387348, 28576, 0 },
	{ EMBD_SHARD_TABLE_WISE, EMBD_KERNEL_FUSED, 100, 0.000327460077428233,
	  6.357828776041667e-05, 0.000654920154856466, 6.357828776041667e-05, 53152, 0 },
	{ EMBD_SHARD_TABLE_WISE, EMBD_KERNEL_FUSED_UVM, 100, 0.09179115295410156,
	  6.357828776041667e-05, 0.18358230590820312, 6.357828776041667e-05, 49152, 4000 },
	{ EMBD_SHARD_TABLE_WISE, EMBD_KERNEL_FUSED_UVM_CACHING, 100, 0.01432837509527439,
	  6.357828776041667e-05, 0.02865675019054878, 6.357828776041667e-05, 50672, 4000 },
	{ EMBD_SHARD_COLUMN_WISE, EMBD_KERNEL_FUSED, 100, 0.000327460077428233,
	  6.357828776041667e-05, 0.000654920154856466, 6.357828776041667e-05, 53152, 0 },
	{ EMBD_SHARD_TABLE_COLUMN_WISE, EMBD_KERNEL_FUSED_UVM_CACHING, 100, 0.01432837509527439,
	  6.357828776041667e-05, 0.02865675019054878, 6.357828776041667e-05, 50672, 4000 },
	{ EMBD_SHARD_ROW_WISE, EMBD_KERNEL_FUSED, 50, 6.804365245261984e-05,
	  6.357828776041667e-05, 0.0001360873049052397, 0.00016798276699240525, 47056, 0 },
	{ EMBD_SHARD_ROW_WISE, EMBD_KERNEL_FUSED_UVM, 50, 0.019073486328125,
	  6.357828776041667e-05, 0.03814697265625, 0.029329458872477215, 45056, 2000 },
	{ EMBD_SHARD_ROW_WISE, EMBD_KERNEL_FUSED_UVM_CACHING, 50, 0.0029773246951219513,
	  6.357828776041667e-05, 0.0059546493902439025, 0.004631910866838161, 45816, 2000 },
	{ EMBD_SHARD_TABLE_ROW_WISE, EMBD_KERNEL_FUSED, 50, 6.804365245261984e-05,
	  6.357828776041667e-05, 0.0001360873049052397, 0.00016798276699240525, 47056, 0 },
	{ EMBD_SHARD_TABLE_ROW_WISE, EMBD_KERNEL_FUSED_UVM_CACHING, 50, 0.0029773246951219513,
	  6.357828776041667e-05, 0.0059546493902439025, 0.004631910866838161, 45816, 2000 },
};

Test(planner_cost, torchrec_golden_values)
{
	struct embd_table_spec t = table(100, 10);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 2);
	for (size_t i = 0; i < sizeof(golden) / sizeof(golden[0]); i++) {
		const struct golden *g = &golden[i];
		struct embd_shard_perf p;
		struct embd_shard_storage st;
		char what[96];
		int rc = embd_plan_estimate_shard(&t, NULL, &topo, g->type, g->kernel, g->rows, 10, &p,
						  &st);
		cr_assert_eq(rc, 0, "estimate %s/%s: expected 0, got %d",
			     embd_plan_sharding_name(g->type), embd_plan_kernel_name(g->kernel), rc);
		snprintf(what, sizeof(what), "%s/%s", embd_plan_sharding_name(g->type),
			 embd_plan_kernel_name(g->kernel));
		expect_rel(p.fwd_compute_ms, g->fwd_compute, what);
		expect_rel(p.bwd_compute_ms, g->bwd_compute, what);
		expect_rel(p.bwd_comms_ms, g->bwd_comms, what);
		if (g->fwd_comms)
			expect_rel(p.fwd_comms_ms, g->fwd_comms, what);
		else
			cr_expect_eq(p.fwd_comms_ms, 0, "%s fwd_comms: expected 0, got %g", what,
				     p.fwd_comms_ms);
		cr_expect_eq(st.hbm_bytes, g->hbm, "%s hbm: expected %llu, got %llu", what,
			     (unsigned long long)g->hbm, (unsigned long long)st.hbm_bytes);
		cr_expect_eq(st.ddr_bytes, g->ddr, "%s ddr: expected %llu, got %llu", what,
			     (unsigned long long)g->ddr, (unsigned long long)st.ddr_bytes);
	}
}

/*
 * Storage by hand, TorchRec's formulas: 1000 x 64 fp32 adam table, table_wise fused on
 * 4 cuda ranks, batch 512, pooling factor 2: weights 256000 + adam 2 x 256000, input
 * ceil(1024 x 4 x 8) = 32768, output ceil(512 x 4 x 64 x 4) = 524288.
 */
Test(planner_cost, storage_by_hand)
{
	struct embd_table_spec t = table(1000, 64);
	struct embd_table_constraints c = { .num_pooling_factors = 1, .pooling_factors = { 2.0 } };
	struct embd_topology topo;
	struct embd_shard_perf perf;
	struct embd_shard_storage st;
	t.optimizer.type = EMBD_OPT_ADAM;
	embd_plan_topology_default(&topo, 4);

	cr_assert_eq(embd_plan_estimate_shard(&t, &c, &topo, EMBD_SHARD_TABLE_WISE,
					      EMBD_KERNEL_FUSED, 1000, 64, &perf, &st), 0);
	cr_expect_eq(st.hbm_bytes, 256000 + 512000 + 32768 + 524288,
		     "tw adam hbm: expected %d, got %llu", 256000 + 512000 + 32768 + 524288,
		     (unsigned long long)st.hbm_bytes);
	cr_expect_eq(st.ddr_bytes, 0, "tw ddr: expected 0, got %llu",
		     (unsigned long long)st.ddr_bytes);

	/* fused_uvm_caching, rowwise_adagrad, a 250-row shard of the row_wise split:
	 * ddr = 64000 + ceil(64000 / 64) = 65000; hbm cache = round(256000 x 0.2) x 1/4 = 12800,
	 * + 200 optimizer + 250 x (4 + 3.2) = 1800 metadata + input ceil(256 x 4 x 8) = 8192 +
	 * output 512 x 4 x 64 x 4 = 524288 */
	t.optimizer.type = EMBD_OPT_ROWWISE_ADAGRAD;
	cr_assert_eq(embd_plan_estimate_shard(&t, &c, &topo, EMBD_SHARD_ROW_WISE,
					      EMBD_KERNEL_FUSED_UVM_CACHING, 250, 64, &perf, &st), 0);
	cr_expect_eq(st.ddr_bytes, 65000, "rw caching ddr: expected 65000, got %llu",
		     (unsigned long long)st.ddr_bytes);
	cr_expect_eq(st.hbm_bytes, 12800 + 200 + 1800 + 8192 + 524288,
		     "rw caching hbm: expected %d, got %llu", 12800 + 200 + 1800 + 8192 + 524288,
		     (unsigned long long)st.hbm_bytes);

	/* pooling factor 2 doubles the ids: tw fused fwd_compute by hand, penalty 1.15 (dim 64) */
	cr_assert_eq(embd_plan_estimate_shard(&t, &c, &topo, EMBD_SHARD_TABLE_WISE,
					      EMBD_KERNEL_FUSED, 1000, 64, &perf, &st), 0);
	double bw = 897.0 * 1024 * 1024 * 1024 / 1000;
	double bytes = 1024.0 * 4 * 8 + 1024.0 * 4 * 64 * 4 + 512.0 * 4 * 64 * 4;
	expect_rel(perf.fwd_compute_ms, bytes * 1.15 / bw, "tw pf2 fwd_compute");
}

/* embd's extension: row_wise on cpu runs at the DDR kernel bandwidth. */
Test(planner_cost, cpu_row_wise_uses_ddr_bandwidth)
{
	struct embd_table_spec t = table(100, 10);
	struct embd_topology topo;
	struct embd_shard_perf perf;
	struct embd_shard_storage st;
	embd_plan_topology_default(&topo, 2);
	topo.compute_device = EMBD_DEVICE_CPU;
	cr_assert_eq(embd_plan_estimate_shard(&t, NULL, &topo, EMBD_SHARD_ROW_WISE,
					      EMBD_KERNEL_FUSED, 50, 10, &perf, &st), 0);
	double ddr_bw = 51.0 * 1024 * 1024 * 1024 / 1000;
	expect_rel(perf.fwd_compute_ms, 65536.0 / ddr_bw, "cpu rw fwd_compute");
	cr_expect_eq(embd_plan_estimate_shard(&t, NULL, &topo, EMBD_SHARD_TABLE_WISE,
					      EMBD_KERNEL_FUSED_UVM, 100, 10, &perf, &st),
		     EMBD_ENOTSUP, "fused_uvm on cpu: expected ENOTSUP");
}
