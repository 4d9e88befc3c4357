/*
 * The plan checker: re-estimates every rank with embd's cost model and validates the plan
 * against the tables and its topology. It is the one evaluation of a plan: embd_plan_build
 * ends with it (so built plans report exactly what a later check reports) and the TorchRec
 * comparison scores TorchRec's plans with it too.
 *
 * Coverage is checked per sharding type's shape, which keeps it O(shards log shards): row
 * splits must span all columns and tile the rows, column splits must span all rows and tile
 * the columns, table_wise is one full shard, data_parallel one full replica on every rank.
 */
#include "planner/planner_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct named {
	const char *name;
	uint32_t index;
};

static int compare_named(const void *a, const void *b)
{
	return strcmp(((const struct named *)a)->name, ((const struct named *)b)->name);
}

static int compare_intervals(const void *a, const void *b)
{
	const int64_t *x = a, *y = b;
	return (x[0] > y[0]) - (x[0] < y[0]);
}

/* Shards of pt (table t) tile it exactly once in the shape its sharding type prescribes. */
static int check_coverage(const struct embd_plan_table *pt, const struct embd_table_spec *t,
			  const struct embd_topology *topo, int64_t *scratch, char *err,
			  size_t err_len)
{
	enum embd_sharding_type type = pt->sharding_type;
	bool by_rows = type == EMBD_SHARD_ROW_WISE || type == EMBD_SHARD_TABLE_ROW_WISE;
	bool by_cols = type == EMBD_SHARD_COLUMN_WISE || type == EMBD_SHARD_TABLE_COLUMN_WISE;
	int32_t W = topo->world_size, L = topo->local_world_size;

	for (uint32_t i = 0; i < pt->num_shards; i++) {
		const struct embd_plan_shard *s = &pt->shards[i];
		bool full_rows = s->row_offset == 0 && s->rows == t->num_embeddings;
		bool full_cols = s->col_offset == 0 && s->cols == t->embedding_dim;
		if (s->rank < 0 || s->rank >= W)
			return embd_fail(err, err_len, EMBD_EINVAL, "table '%s' shard %u: rank %d is "
					   "outside [0, %d)", pt->name, i, s->rank, W);
		if (s->row_offset + s->rows > t->num_embeddings ||
		    (int64_t)s->col_offset + s->cols > t->embedding_dim)
			return embd_fail(err, err_len, EMBD_EINVAL, "table '%s' shard %u: rows [%lld, "
					   "+%lld) x cols [%d, +%d) leave the %lld x %d table", pt->name,
					   i, (long long)s->row_offset, (long long)s->rows, s->col_offset,
					   s->cols, (long long)t->num_embeddings, t->embedding_dim);
		if ((!by_rows && !full_rows) || (!by_cols && !full_cols) || (by_cols && s->cols == 0))
			return embd_fail(err, err_len, EMBD_EINVAL, "table '%s' shard %u: a %s shard "
					   "must span all %s", pt->name, i,
					   embd_plan_sharding_name(type), by_rows ? "columns" :
					   by_cols ? "rows" : "rows and columns");
		if ((type == EMBD_SHARD_TABLE_ROW_WISE || type == EMBD_SHARD_TABLE_COLUMN_WISE) &&
		    s->rank / L != pt->shards[0].rank / L)
			return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': %s shards must stay "
					   "in one node, shard %u is on node %d, shard 0 on node %d",
					   pt->name, embd_plan_sharding_name(type), i, s->rank / L,
					   pt->shards[0].rank / L);
		if (type == EMBD_SHARD_DATA_PARALLEL)
			scratch[i] = s->rank;
		else
			scratch[2 * i] = by_cols ? s->col_offset : s->row_offset,
			scratch[2 * i + 1] = by_cols ? s->cols : s->rows;
	}
	if (type == EMBD_SHARD_DATA_PARALLEL) {
		if (pt->num_shards != (uint32_t)W)
			return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': data_parallel needs "
					   "one replica on each of %d ranks, has %u", pt->name, W,
					   pt->num_shards);
		qsort(scratch, pt->num_shards, sizeof(*scratch), compare_intervals);
		for (uint32_t i = 0; i < pt->num_shards; i++)
			if (scratch[i] != i)
				return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': data_parallel "
						   "has no replica on rank %u", pt->name, i);
		return 0;
	}
	if (type == EMBD_SHARD_TABLE_WISE && pt->num_shards != 1)
		return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': table_wise has one shard, "
				   "not %u", pt->name, pt->num_shards);
	qsort(scratch, pt->num_shards, 2 * sizeof(*scratch), compare_intervals);
	int64_t next = 0, extent = by_cols ? t->embedding_dim : t->num_embeddings;
	for (uint32_t i = 0; i < pt->num_shards; i++) {
		if (scratch[2 * i] != next)
			return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': %s %lld %s", pt->name,
					   by_cols ? "column" : "row", (long long)next,
					   scratch[2 * i] > next ? "is in no shard" :
								   "is in two shards");
		next += scratch[2 * i + 1];
	}
	if (next != extent)
		return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': shards cover %lld of %lld "
				   "%s", pt->name, (long long)next, (long long)extent,
				   by_cols ? "columns" : "rows");
	return 0;
}

/* Adds the estimates of every shard of pt to the ranks; one estimate per distinct shape. */
static int add_estimates(struct embd_plan *plan, const struct embd_plan_table *pt, uint32_t ti,
			 const struct embd_table_spec *t, const struct embd_table_constraints *c,
			 uint32_t *last_table, char *err, size_t err_len)
{
	int64_t rows = -1;
	int32_t cols = -1;
	struct embd_shard_perf perf = { 0 };
	struct embd_shard_storage st = { 0 };

	for (uint32_t i = 0; i < pt->num_shards; i++) {
		const struct embd_plan_shard *s = &pt->shards[i];
		if (s->rows != rows || s->cols != cols) {
			rows = s->rows;
			cols = s->cols;
			int rc = embd_plan_estimate_shard(t, c, &plan->topology, pt->sharding_type,
							  pt->compute_kernel, rows, cols, &perf, &st);
			if (rc)
				return embd_fail(err, err_len, EMBD_EINVAL, "table '%s': %s with kernel "
						   "%s does not exist on %s", pt->name,
						   embd_plan_sharding_name(pt->sharding_type),
						   embd_plan_kernel_name(pt->compute_kernel),
						   embd_plan_device_name(plan->topology.compute_device));
		}
		struct embd_plan_rank *r = &plan->ranks[s->rank];
		r->hbm_bytes += st.hbm_bytes;
		r->ddr_bytes += st.ddr_bytes;
		r->fwd_compute_ms += perf.fwd_compute_ms;
		r->fwd_comms_ms += perf.fwd_comms_ms;
		r->bwd_compute_ms += perf.bwd_compute_ms;
		r->bwd_comms_ms += perf.bwd_comms_ms;
		r->est_time_ms += embd_shard_perf_total_ms(&perf);
		r->num_shards++;
		if (last_table[s->rank] != ti) {
			last_table[s->rank] = ti;
			r->num_tables++;
		}
	}
	return 0;
}

int embd_plan_check(struct embd_plan *plan, const struct embd_table_spec *tables,
		    const struct embd_table_constraints *constraints, uint32_t num_tables,
		    char *err, size_t err_len)
{
	struct named *index = NULL;
	uint32_t *seen = NULL, *last_table = NULL;
	int64_t *scratch = NULL;
	int rc = embd_plan_topology_validate(&plan->topology, err, err_len);
	if (rc)
		return rc;
	uint32_t W = (uint32_t)plan->topology.world_size, most = 1;
	if (plan->num_tables != num_tables) {
		rc = embd_fail(err, err_len, EMBD_EINVAL, "the plan has %u tables, the tables file %u",
				 plan->num_tables, num_tables);
		goto out;
	}
	for (uint32_t i = 0; i < plan->num_tables; i++)
		most = plan->tables[i].num_shards > most ? plan->tables[i].num_shards : most;
	free(plan->ranks);
	plan->ranks = calloc(W, sizeof(*plan->ranks));
	index = calloc(num_tables, sizeof(*index));
	seen = calloc(num_tables, sizeof(*seen));
	last_table = malloc(W * sizeof(*last_table));
	scratch = malloc(2 * (size_t)most * sizeof(*scratch));
	if (!plan->ranks || !index || !seen || !last_table || !scratch) {
		rc = EMBD_ENOMEM;
		goto out;
	}
	memset(last_table, 0xff, W * sizeof(*last_table));
	for (uint32_t i = 0; i < num_tables; i++)
		index[i] = (struct named){ tables[i].name, i };
	qsort(index, num_tables, sizeof(*index), compare_named);

	for (uint32_t i = 0; i < plan->num_tables; i++) {
		const struct embd_plan_table *pt = &plan->tables[i];
		struct named key = { pt->name, 0 };
		const struct named *hit = bsearch(&key, index, num_tables, sizeof(*index),
						  compare_named);
		if (!hit) {
			rc = embd_fail(err, err_len, EMBD_ENOENT, "plan table '%s' is not in the "
					 "tables file", pt->name);
			goto out;
		}
		if (seen[hit->index]++) {
			rc = embd_fail(err, err_len, EMBD_EINVAL, "table '%s' appears twice in the plan",
					 pt->name);
			goto out;
		}
		const struct embd_table_spec *t = &tables[hit->index];
		rc = check_coverage(pt, t, &plan->topology, scratch, err, err_len);
		if (!rc)
			rc = add_estimates(plan, pt, i, t, constraints ? &constraints[hit->index] : NULL,
					   last_table, err, err_len);
		if (rc)
			goto out;
	}

	uint64_t budget = planner_hbm_budget(&plan->topology, tables, constraints, num_tables);
	plan->max_rank_time_ms = 0;
	for (uint32_t r = 0; r < W; r++) {
		const struct embd_plan_rank *pr = &plan->ranks[r];
		if (pr->est_time_ms > plan->max_rank_time_ms)
			plan->max_rank_time_ms = pr->est_time_ms;
		if (pr->hbm_bytes > budget || pr->ddr_bytes > plan->topology.ddr_cap_bytes) {
			bool ddr = pr->hbm_bytes <= budget;
			uint64_t used = ddr ? pr->ddr_bytes : pr->hbm_bytes;
			uint64_t cap = ddr ? plan->topology.ddr_cap_bytes : budget;
			rc = embd_fail(err, err_len, EMBD_ENOSPC, "rank %u needs %llu bytes of %s, "
					 "has %llu%s: short by %llu bytes", r, (unsigned long long)used,
					 ddr ? "DDR" : "HBM", (unsigned long long)cap,
					 ddr ? "" : " after the storage reservation",
					 (unsigned long long)(used - cap));
			goto out;
		}
	}
	plan->tables_hash = embd_plan_tables_hash(tables, num_tables);
	rc = embd_plan_hash(plan, &plan->plan_hash);
out:
	free(index);
	free(seen);
	free(last_table);
	free(scratch);
	return rc;
}
