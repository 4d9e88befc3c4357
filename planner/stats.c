/*
 * The stats table for people, after TorchRec's EmbeddingStats: per rank the memory used of
 * its cap, the estimated time and its four parts, tables and shards; per table the choice
 * and its ranks; and the imbalance (slowest rank over the mean), which is what the planner
 * minimises. Ranks and per-table rank lists are printed compactly for large worlds.
 */
#include "planner/planner_internal.h"

#include <stdlib.h>

#define GIB_F (1024.0 * 1024.0 * 1024.0)
#define MAX_RANK_ROWS 64       /* beyond this, only the busiest and idlest ranks are listed */
#define MAX_TABLE_ROWS 200

double embd_plan_imbalance(const struct embd_plan *plan)
{
	double sum = 0;
	int32_t W = plan->topology.world_size;
	if (!plan->ranks || W <= 0)
		return 0;
	for (int32_t r = 0; r < W; r++)
		sum += plan->ranks[r].est_time_ms;
	return sum > 0 ? plan->max_rank_time_ms / (sum / W) : 0;
}

static void rank_row(struct sbuf *b, const struct embd_plan *plan, int32_t r, uint64_t budget)
{
	const struct embd_plan_rank *pr = &plan->ranks[r];
	const struct embd_topology *t = &plan->topology;
	sbuf_printf(b, "%5d  %8.3f GB %5.1f%%  %8.3f GB %5.1f%%  %11.6f  %10.6f %10.6f %10.6f "
		    "%10.6f  %6u %6u\n", r, pr->hbm_bytes / GIB_F,
		    budget ? 100.0 * (double)pr->hbm_bytes / (double)budget : 0,
		    pr->ddr_bytes / GIB_F,
		    t->ddr_cap_bytes ? 100.0 * (double)pr->ddr_bytes / (double)t->ddr_cap_bytes : 0,
		    pr->est_time_ms, pr->fwd_compute_ms, pr->fwd_comms_ms, pr->bwd_compute_ms,
		    pr->bwd_comms_ms, pr->num_tables, pr->num_shards);
}

int embd_plan_stats_text(const struct embd_plan *plan, char **out)
{
	struct sbuf b = { 0 };
	const struct embd_topology *t = &plan->topology;
	int32_t W = t->world_size;
	/* the budget the checker used is not stored; show use against the cap after the
	 * percentage reservation, which is what an operator configures */
	uint64_t budget = (uint64_t)((1.0 - t->storage_reservation) * (double)t->hbm_cap_bytes);

	sbuf_printf(&b, "embd plan: %u tables on %d ranks (%d per node, %s), batch %u\n",
		    plan->num_tables, W, t->local_world_size, embd_plan_device_name(t->compute_device),
		    t->batch_size);
	if (plan->proposer)
		sbuf_printf(&b, "won by: proposer %s, partitioner %s\n", plan->proposer,
			    plan->partitioner);
	sbuf_printf(&b, "\n rank       HBM (of %.1f GB)       DDR (of %.1f GB)     perf ms  "
		    "fwd_comp   fwd_comm   bwd_comp   bwd_comm  tables shards\n",
		    budget / GIB_F, t->ddr_cap_bytes / GIB_F);
	int32_t slowest = 0, fastest = 0;
	for (int32_t r = 0; plan->ranks && r < W; r++) {
		if (plan->ranks[r].est_time_ms > plan->ranks[slowest].est_time_ms)
			slowest = r;
		if (plan->ranks[r].est_time_ms < plan->ranks[fastest].est_time_ms)
			fastest = r;
		if (W <= MAX_RANK_ROWS)
			rank_row(&b, plan, r, budget);
	}
	if (plan->ranks && W > MAX_RANK_ROWS) {
		sbuf_printf(&b, "(%d ranks; the slowest and the fastest:)\n", W);
		rank_row(&b, plan, slowest, budget);
		rank_row(&b, plan, fastest, budget);
	}

	sbuf_printf(&b, "\n %-32s %-18s %-18s %6s  ranks\n", "table", "sharding", "kernel",
		    "shards");
	for (uint32_t i = 0; i < plan->num_tables && i < MAX_TABLE_ROWS; i++) {
		const struct embd_plan_table *pt = &plan->tables[i];
		sbuf_printf(&b, " %-32s %-18s %-18s %6u  ", pt->name,
			    embd_plan_sharding_name(pt->sharding_type),
			    embd_plan_kernel_name(pt->compute_kernel), pt->num_shards);
		if (pt->sharding_type == EMBD_SHARD_DATA_PARALLEL ||
		    (pt->sharding_type == EMBD_SHARD_ROW_WISE && pt->num_shards == (uint32_t)W))
			sbuf_printf(&b, "all");
		else
			for (uint32_t s = 0; s < pt->num_shards && s < 16; s++)
				sbuf_printf(&b, "%s%d", s ? "," : "", pt->shards[s].rank);
		sbuf_printf(&b, "%s\n", pt->num_shards > 16 && pt->sharding_type !=
			    EMBD_SHARD_DATA_PARALLEL && pt->sharding_type != EMBD_SHARD_ROW_WISE ?
			    ",..." : "");
	}
	if (plan->num_tables > MAX_TABLE_ROWS)
		sbuf_printf(&b, " ... %u more tables (the JSON plan lists all)\n",
			    plan->num_tables - MAX_TABLE_ROWS);

	double mean = 0;
	for (int32_t r = 0; plan->ranks && r < W; r++)
		mean += plan->ranks[r].est_time_ms / W;
	sbuf_printf(&b, "\nmax rank time %.6f ms (rank %d), mean %.6f ms, min %.6f ms (rank %d); "
		    "imbalance (max / mean) %.4f\nplan_hash %016llx\n", plan->max_rank_time_ms,
		    slowest, mean, plan->ranks ? plan->ranks[fastest].est_time_ms : 0, fastest,
		    embd_plan_imbalance(plan), (unsigned long long)plan->plan_hash);
	if (b.failed) {
		free(b.data);
		return EMBD_ENOMEM;
	}
	*out = b.data;
	return 0;
}
