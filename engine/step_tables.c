/*
 * Live table access (engine/step.h): rows of a table read and written between steps, in table
 * coordinates, whatever the sharding. A row's array is the concatenation of its "pieces": the
 * shards that hold the row, in column order (one data_parallel replica). Weights and the
 * element-wise optimizer state (adagrad's, adam's) have a piece's columns per piece, so their
 * rows are embedding_dim wide; rowwise_adagrad keeps one value per row of each shard, so its
 * rows have one value per column shard, as FBGEMM's TBE under TorchRec's column-wise sharding.
 * Every id is checked before any row is read or written; a write first hands its rows to the
 * update hook, so a checkpoint being copied keeps them as they were at its boundary.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/device.h"
#include "kernels/optim_row.h"
#include "engine/step_internal.h"

/* Floats of array a in one row of a shard. */
static uint32_t shard_floats(const struct embd_shard_desc *d, enum embd_step_array a)
{
	if (a == EMBD_STEP_WEIGHTS)
		return d->cols;
	return (uint32_t)embd_optim_state_floats(d->optimizer.type, d->cols, (int)a - 1);
}

static bool holds_row(const struct embd_shard_desc *d, int64_t row)
{
	return row >= d->row_offset && row - d->row_offset < d->rows;
}

/* Where shard k's part of a row starts in the table's row of array a: the floats of the
 * pieces left of it (0 for every data_parallel replica: each holds the whole row). */
static uint32_t piece_offset(const struct embd_step *s, const struct step_table *t, uint32_t k,
			     int64_t row, enum embd_step_array a)
{
	const struct embd_shard_desc *d = &s->shards[t->first_shard + k].desc;
	uint32_t at = 0;

	if (t->type == EMBD_SHARD_DATA_PARALLEL)
		return 0;
	for (uint32_t j = 0; j < t->num_shards; j++) {
		const struct embd_shard_desc *o = &s->shards[t->first_shard + j].desc;
		if (j != k && holds_row(o, row) && o->col_offset < d->col_offset)
			at += shard_floats(o, a);
	}
	return at;
}

/* Floats of a row of array a of table t (every row alike: the pieces of row 0). */
static uint32_t table_floats(const struct embd_step *s, const struct step_table *t,
			     enum embd_step_array a)
{
	uint32_t n = 0;

	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct embd_shard_desc *d = &s->shards[t->first_shard + k].desc;
		if (holds_row(d, 0))
			n += shard_floats(d, a);
		if (t->type == EMBD_SHARD_DATA_PARALLEL)
			break;
	}
	return n;
}


int embd_step_table_info(const struct embd_step *s, uint32_t table, enum embd_step_array a,
			 struct embd_step_table_info *out)
{
	if (table >= s->num_tables || a > EMBD_STEP_MOMENTUM2)
		return EMBD_ENOENT;
	const struct step_table *t = &s->tables[table];
	*out = (struct embd_step_table_info){ .num_embeddings = t->spec->num_embeddings,
					      .cols = table_floats(s, t, a) };
	/* the shards' own count, from whichever side is newer (a GPU's, or a restored host
	 * view's): every shard of a table applies every step, so any one of them says it */
	for (uint32_t k = 0; k < t->num_shards; k++)
		if (s->shards[t->first_shard + k].shard) {
			out->optimizer_step = embd_ranks_shard_step(s->ranks,
								    s->shards[t->first_shard + k].shard);
			break;
		}
	return 0;
}

/* Row i of the request, checked against the table's rows. */
static int row_at(const struct step_table *t, const struct embd_step_rows *rows, uint64_t i,
		  int64_t *row, char *err, size_t err_len)
{
	int64_t r = rows->ids ? rows->ids[i] : rows->row_begin + (int64_t)i;

	if (r < 0 || r >= t->spec->num_embeddings) {
		snprintf(err, err_len, "%s[%llu]: row %lld outside table '%s' rows [0, %lld)",
			 rows->ids ? "ids" : "rows", (unsigned long long)i, (long long)r,
			 t->spec->name, (long long)t->spec->num_embeddings);
		return EMBD_ERANGE;
	}
	*row = r;
	return 0;
}

static int check_rows(const struct step_table *t, const struct embd_step_rows *rows, char *err,
		      size_t err_len)
{
	int64_t row;

	if (!rows->ids && rows->n > (uint64_t)t->spec->num_embeddings) {
		snprintf(err, err_len, "rows: %llu from row %lld, table '%s' has %lld",
			 (unsigned long long)rows->n, (long long)rows->row_begin, t->spec->name,
			 (long long)t->spec->num_embeddings);
		return EMBD_ERANGE;
	}
	if (rows->ids) {
		for (uint64_t i = 0; i < rows->n; i++)
			if (row_at(t, rows, i, &row, err, err_len))
				return EMBD_ERANGE;
		return 0;
	}
	if (rows->n && (row_at(t, rows, 0, &row, err, err_len) ||
			row_at(t, rows, rows->n - 1, &row, err, err_len)))
		return EMBD_ERANGE;
	return 0;
}

/* The floats of array a of shard sh for its global row `row`. */
static float *state_row(const struct embd_shard *sh, enum embd_step_array a, int64_t row)
{
	uint64_t lr = (uint64_t)(row - sh->desc.row_offset);
	float *base = a == EMBD_STEP_MOMENTUM1 ? sh->momentum1 : sh->momentum2;

	return base + lr * shard_floats(&sh->desc, a);
}

static void copy_out(const struct embd_shard *sh, enum embd_step_array a, int64_t row, float *out)
{
	const uint32_t n = shard_floats(&sh->desc, a);
	const uint64_t lr = (uint64_t)(row - sh->desc.row_offset);

	if (a != EMBD_STEP_WEIGHTS) {
		const float *src = state_row(sh, a, row);
		for (uint32_t c = 0; c < n; c++)
			out[c] = src[c];
	} else if (sh->desc.dtype == EMBD_DTYPE_FP16) {
		const uint16_t *src = (const uint16_t *)sh->weights + lr * n;
		for (uint32_t c = 0; c < n; c++)
			out[c] = embd_fp16_to_fp32(src[c]);
	} else {
		const float *src = (const float *)sh->weights + lr * n;
		for (uint32_t c = 0; c < n; c++)
			out[c] = src[c];
	}
}

static void copy_in(struct embd_shard *sh, enum embd_step_array a, int64_t row, const float *in)
{
	const uint32_t n = shard_floats(&sh->desc, a);
	const uint64_t lr = (uint64_t)(row - sh->desc.row_offset);

	if (a != EMBD_STEP_WEIGHTS) {
		float *dst = state_row(sh, a, row);
		for (uint32_t c = 0; c < n; c++)
			dst[c] = in[c];
	} else if (sh->desc.dtype == EMBD_DTYPE_FP16) {
		uint16_t *dst = (uint16_t *)sh->weights + lr * n;
		for (uint32_t c = 0; c < n; c++)
			dst[c] = embd_fp32_to_fp16(in[c]);
	} else {
		float *dst = (float *)sh->weights + lr * n;
		for (uint32_t c = 0; c < n; c++)
			dst[c] = in[c];
	}
}

/* The host views of the table's shards on this node brought up to date (engine/step.h). */
static int pull_table(const struct embd_step *s, const struct step_table *t, char *err,
		      size_t err_len)
{
	for (uint32_t k = 0; k < t->num_shards; k++) {
		struct embd_shard *sh = s->shards[t->first_shard + k].shard;
		int rc = sh ? embd_ranks_shard_pull(s->ranks, sh, err, err_len) : 0;
		if (rc)
			return rc;
	}
	return 0;
}

/* A request's table, array and rows, checked: 0 with the table and its array's floats per
 * row, or the refusal. */
static int check_access(const struct embd_step *s, uint32_t table, enum embd_step_array a,
			const struct embd_step_rows *rows, const struct step_table **t,
			uint32_t *cols, char *err, size_t err_len)
{
	if (table >= s->num_tables) {
		snprintf(err, err_len, "table %u: there are %u", table, s->num_tables);
		return EMBD_ENOENT;
	}
	*t = &s->tables[table];
	*cols = a <= EMBD_STEP_MOMENTUM2 ? table_floats(s, *t, a) : 0;
	if (!*cols) {
		snprintf(err, err_len, "table '%s': array %d: its optimizer keeps no such state",
			 (*t)->spec->name, (int)a);
		return EMBD_EINVAL;
	}
	return check_rows(*t, rows, err, err_len);
}

int embd_step_table_read(const struct embd_step *s, uint32_t table, enum embd_step_array a,
			 const struct embd_step_rows *rows, float *out, char *err, size_t err_len)
{
	const struct step_table *t;
	uint32_t cols;
	int rc = check_access(s, table, a, rows, &t, &cols, err, err_len);

	if (rc || (rc = pull_table(s, t, err, err_len)))
		return rc;
	for (uint64_t i = 0; i < rows->n; i++) {
		int64_t row;
		row_at(t, rows, i, &row, err, err_len);
		bool dp_done = false;
		for (uint32_t k = 0; k < t->num_shards && !dp_done; k++) {
			const struct step_shard *ss = &s->shards[t->first_shard + k];
			if (!holds_row(&ss->desc, row))
				continue;
			if (t->type == EMBD_SHARD_DATA_PARALLEL && !ss->shard)
				continue;       /* another node's replica: this node has its own */
			if (!ss->shard) {
				snprintf(err, err_len, "table '%s' row %lld: columns [%u, +%u) are on "
					 "node %u, this is node %u: read them there", t->spec->name,
					 (long long)row, ss->desc.col_offset, ss->desc.cols, ss->node,
					 s->node);
				return EMBD_ENOENT;
			}
			copy_out(ss->host, a, row,
				 out + i * cols + piece_offset(s, t, k, row, a));
			dp_done = t->type == EMBD_SHARD_DATA_PARALLEL;
		}
	}
	return 0;
}

/* Hands the rows about to be written to the update hook (a checkpoint's copy-before-write),
 * shard by shard: the hook skips the ids outside the shard. */
static int before_write(struct embd_step *s, const struct step_table *t,
			const struct embd_step_rows *rows)
{
	int64_t *ids = NULL;
	const int64_t *list = rows->ids;

	if (!s->update_hook || !rows->n)
		return 0;
	if (!list) {
		ids = malloc(rows->n * sizeof(*ids));
		if (!ids)
			return EMBD_ENOMEM;
		for (uint64_t i = 0; i < rows->n; i++)
			ids[i] = rows->row_begin + (int64_t)i;
		list = ids;
	}
	int64_t offsets[2] = { 0, (int64_t)rows->n };
	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		struct embd_bag_batch bb = { .shard = ss->host, .batch_size = 1, .offsets = offsets,
					     .ids = list, .num_ids = rows->n };
		if (ss->host)
			s->update_hook(s->update_hook_arg, ss->host, &bb, 1);
	}
	free(ids);
	return 0;
}

int embd_step_table_write(struct embd_step *s, uint32_t table, enum embd_step_array a,
			  const struct embd_step_rows *rows, const float *in, char *err,
			  size_t err_len)
{
	const struct step_table *t;
	uint32_t cols;
	int rc = check_access(s, table, a, rows, &t, &cols, err, err_len);

	if (rc)
		return rc;
	for (uint64_t i = 0; i < rows->n * cols; i++)
		if (!isfinite(in[i])) {
			snprintf(err, err_len, "row %llu col %u: %g is not a finite value",
				 (unsigned long long)(i / cols), (unsigned)(i % cols), (double)in[i]);
			return EMBD_EINVAL;
		}
	for (uint64_t i = 0; i < rows->n; i++) {
		int64_t row;
		row_at(t, rows, i, &row, err, err_len);
		for (uint32_t k = 0; k < t->num_shards; k++) {
			const struct step_shard *ss = &s->shards[t->first_shard + k];
			if (holds_row(&ss->desc, row) && !ss->shard &&
			    t->type != EMBD_SHARD_DATA_PARALLEL) {
				snprintf(err, err_len, "table '%s' row %lld: columns [%u, +%u) are on "
					 "node %u, this is node %u", t->spec->name, (long long)row,
					 ss->desc.col_offset, ss->desc.cols, ss->node, s->node);
				return EMBD_ENOENT;
			}
		}
	}
	/* a GPU shard's host copy must be current before some of its rows change */
	if ((rc = pull_table(s, t, err, err_len)) || (rc = before_write(s, t, rows)))
		return rc;
	for (uint64_t i = 0; i < rows->n; i++) {
		int64_t row;
		row_at(t, rows, i, &row, err, err_len);
		/* every data_parallel replica here gets the row */
		for (uint32_t k = 0; k < t->num_shards; k++) {
			struct embd_shard *sh = s->shards[t->first_shard + k].host;
			if (sh && holds_row(&sh->desc, row))
				copy_in(sh, a, row, in + i * cols + piece_offset(s, t, k, row, a));
		}
	}
	for (uint32_t k = 0; k < t->num_shards; k++)
		if (s->shards[t->first_shard + k].shard)
			embd_ranks_shard_changed(s->ranks, s->shards[t->first_shard + k].shard);
	return 0;
}
