/*
 * Where a table's shards fall for each sharding type, and how much of a rank's HBM the
 * planner may fill. Builder and checker both use these, so a plan the builder emits always
 * has the geometry the checker expects.
 */
#include "planner/planner_internal.h"

#include <math.h>

void planner_layout(struct shard_layout *l, const struct embd_table_spec *t,
		    const struct embd_topology *topo, enum embd_sharding_type type,
		    int32_t col_block)
{
	l->type = type;
	l->rows = t->num_embeddings;
	l->dim = t->embedding_dim;
	l->row_block = t->num_embeddings;
	l->col_block = t->embedding_dim;
	switch (type) {
	case EMBD_SHARD_ROW_WISE:
	case EMBD_SHARD_TABLE_ROW_WISE: {
		int64_t n = type == EMBD_SHARD_ROW_WISE ? topo->world_size : topo->local_world_size;
		l->num_shards = (uint32_t)n;
		l->row_block = (t->num_embeddings + n - 1) / n;
		break;
	}
	case EMBD_SHARD_COLUMN_WISE:
	case EMBD_SHARD_TABLE_COLUMN_WISE:
		l->col_block = col_block;
		l->num_shards = (uint32_t)((t->embedding_dim + col_block - 1) / col_block);
		break;
	case EMBD_SHARD_DATA_PARALLEL:
		l->num_shards = (uint32_t)topo->world_size;
		break;
	default:
		l->num_shards = 1;
		break;
	}
}

void planner_layout_shard(const struct shard_layout *l, uint32_t i, int64_t *row_offset,
			  int64_t *rows, int32_t *col_offset, int32_t *cols)
{
	*row_offset = 0;
	*rows = l->rows;
	*col_offset = 0;
	*cols = l->dim;
	if (l->type == EMBD_SHARD_ROW_WISE || l->type == EMBD_SHARD_TABLE_ROW_WISE) {
		int64_t start = (int64_t)i * l->row_block;
		if (start > l->rows)
			start = l->rows;
		int64_t end = start + l->row_block;
		*row_offset = start;
		*rows = (end > l->rows ? l->rows : end) - start;
	} else if (l->type == EMBD_SHARD_COLUMN_WISE || l->type == EMBD_SHARD_TABLE_COLUMN_WISE) {
		int32_t start = (int32_t)i * l->col_block;
		int32_t end = start + l->col_block;
		*col_offset = start;
		*cols = (end > l->dim ? l->dim : end) - start;
	}
}

uint64_t planner_hbm_budget(const struct embd_topology *topo, const struct embd_table_spec *t,
			    const struct embd_table_constraints *c, uint32_t n)
{
	double kjt_ids = 0;
	for (uint32_t i = 0; i < n; i++) {
		double bi, bo;
		planner_batch_io(&t[i], c ? &c[i] : NULL, topo, &bi, &bo);
		kjt_ids += bi;
	}
	double budget = floor((1.0 - topo->storage_reservation) * (double)topo->hbm_cap_bytes) -
			KJT_RESERVE_MULTIPLIER * ceil(kjt_ids * 8.0);
	return budget > 0 ? (uint64_t)budget : 0;
}
