/*
 * Loading a checkpoint's files into any set of table rectangles (embd_ckpt_load in
 * ckpt/checkpoint.h): the whole of resharding. Each source file is read once and copied
 * into every target it intersects, by global row and column coordinates, so a checkpoint of
 * any plan restores under any other plan and `embctl export` is the same call with one
 * target: the whole table.
 */
#include "ckpt/checkpoint.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/device.h"
#include "ckpt/npy.h"

int embd_ckpt_table_index(const struct embd_ckpt_manifest *m, const char *name)
{
	for (uint32_t i = 0; i < m->num_tables; i++)
		if (!strcmp(m->tables[i].name, name))
			return (int)i;
	return -1;
}

/* The intersection of a file's and a target's rectangles; false when empty. */
struct rect {
	int64_t r0, r1;
	uint32_t c0, c1;
};

static bool intersect(const struct embd_ckpt_file *f, const struct embd_ckpt_target *t,
		      struct rect *out)
{
	out->r0 = f->row_offset > t->row_offset ? f->row_offset : t->row_offset;
	int64_t fe = f->row_offset + f->rows, te = t->row_offset + t->rows;
	out->r1 = fe < te ? fe : te;
	out->c0 = f->col_offset > t->col_offset ? f->col_offset : t->col_offset;
	uint32_t fc = f->col_offset + f->cols, tc = t->col_offset + t->cols;
	out->c1 = fc < tc ? fc : tc;
	return out->r0 < out->r1 && out->c0 < out->c1;
}

static void copy_weights(const struct embd_ckpt_file *f, const void *src,
			 struct embd_ckpt_target *t, const struct rect *x)
{
	for (int64_t r = x->r0; r < x->r1; r++) {
		uint64_t si = (uint64_t)(r - f->row_offset) * f->cols + (x->c0 - f->col_offset);
		uint64_t di = (uint64_t)(r - t->row_offset) * t->cols + (x->c0 - t->col_offset);
		uint32_t n = x->c1 - x->c0;
		bool s16 = f->dtype == EMBD_NPY_F2, d16 = t->dtype == EMBD_DTYPE_FP16;
		if (s16 == d16) {
			uint32_t eb = d16 ? 2 : 4;
			memcpy((uint8_t *)t->weights + di * eb, (const uint8_t *)src + si * eb,
			       (size_t)n * eb);
		} else if (d16) {
			for (uint32_t c = 0; c < n; c++)
				((uint16_t *)t->weights)[di + c] = embd_fp32_to_fp16(((const float *)src)[si + c]);
		} else {
			for (uint32_t c = 0; c < n; c++)
				((float *)t->weights)[di + c] = embd_fp16_to_fp32(((const uint16_t *)src)[si + c]);
		}
	}
}

static void copy_state(const struct embd_ckpt_file *f, const float *src, float *dst,
		       const struct embd_ckpt_target *t, const struct rect *x, bool per_row)
{
	for (int64_t r = x->r0; r < x->r1; r++) {
		uint64_t sr = (uint64_t)(r - f->row_offset), dr = (uint64_t)(r - t->row_offset);
		if (per_row) {
			/* column-weighted mean of the source shards over the target's columns */
			dst[dr] += src[sr] * (float)(x->c1 - x->c0) / (float)t->cols;
			continue;
		}
		memcpy(dst + dr * t->cols + (x->c0 - t->col_offset),
		       src + sr * f->cols + (x->c0 - f->col_offset), sizeof(float) * (x->c1 - x->c0));
	}
}

/* Checks a loaded file's header against its manifest entry. */
static int check_header(const char *path, const struct embd_ckpt_file *f,
			const struct embd_ckpt_table *tab, const struct embd_npy_header *h,
			char *err, size_t err_len)
{
	bool per_row = f->state != EMBD_CKPT_WEIGHT && tab->optimizer == EMBD_OPT_ROWWISE_ADAGRAD;
	uint32_t ndim = per_row ? 1 : 2;

	if (h->dtype != f->dtype || h->ndim != ndim || h->shape[0] != (uint64_t)f->rows ||
	    (ndim == 2 && h->shape[1] != f->cols))
		return snprintf(err, err_len, "%s: dtype %s shape (%" PRIu64 ", %" PRIu64 ") ndim %u; "
				"the manifest says %s, %lld x %u, ndim %u", path,
				embd_npy_dtype_name(h->dtype), h->shape[0], h->ndim > 1 ? h->shape[1] : 0,
				h->ndim, embd_npy_dtype_name(f->dtype), (long long)f->rows,
				ndim == 2 ? f->cols : 1, ndim), EMBD_EPARSE;
	return 0;
}

int embd_ckpt_load(const char *dir, const struct embd_ckpt_manifest *m,
		   struct embd_ckpt_target *targets, uint32_t num_targets, char *err,
		   size_t err_len)
{
	return embd_ckpt_load_nodes(&dir, 1, m, targets, num_targets, err, err_len);
}

int embd_ckpt_load_nodes(const char *const *dirs, uint32_t num_dirs,
			 const struct embd_ckpt_manifest *m, struct embd_ckpt_target *targets,
			 uint32_t num_targets, char *err, size_t err_len)
{
	const char *dir = dirs[0];
	char path[EMBD_CKPT_PATH_MAX + 256];
	uint64_t *covered = calloc(num_targets + 1, sizeof(uint64_t));
	int rc = 0;

	if (!covered)
		return EMBD_ENOMEM;
	for (uint32_t k = 0; k < num_targets; k++) {
		struct embd_ckpt_target *t = &targets[k];
		t->optimizer_step = 0;
		if (t->table >= m->num_tables) {
			free(covered);
			return snprintf(err, err_len, "target %u: table %u not in the manifest", k,
					t->table), EMBD_EINVAL;
		}
		/* per-row state is accumulated, so it starts from 0 where a file will add to it */
		if (m->tables[t->table].optimizer == EMBD_OPT_ROWWISE_ADAGRAD && t->momentum1)
			for (uint32_t i = 0; i < m->num_files; i++)
				if (m->files[i].table == t->table && m->files[i].state == EMBD_CKPT_MOMENTUM1) {
					memset(t->momentum1, 0, sizeof(float) * (uint64_t)t->rows);
					break;
				}
	}
	for (uint32_t i = 0; i < m->num_files && !rc; i++) {
		const struct embd_ckpt_file *f = &m->files[i];
		const struct embd_ckpt_table *tab = &m->tables[f->table];
		bool wanted = false;
		struct rect x;
		for (uint32_t k = 0; k < num_targets && !wanted; k++)
			wanted = targets[k].table == f->table && intersect(f, &targets[k], &x);
		if (!wanted)
			continue;
		struct embd_npy_header h;
		void *data;
		if (num_dirs > 1 && f->node >= num_dirs) {
			rc = EMBD_EINVAL;
			snprintf(err, err_len, "%s: node %u, only %u node directories given", f->name,
				 f->node, num_dirs);
			break;
		}
		snprintf(path, sizeof(path), "%s/%s", dirs[num_dirs > 1 ? f->node : 0], f->name);
		if ((rc = embd_npy_read_file(path, &h, &data, err, err_len)))
			break;
		rc = check_header(path, f, tab, &h, err, err_len);
		bool per_row = f->state != EMBD_CKPT_WEIGHT && tab->optimizer == EMBD_OPT_ROWWISE_ADAGRAD;
		for (uint32_t k = 0; k < num_targets && !rc; k++) {
			struct embd_ckpt_target *t = &targets[k];
			if (t->table != f->table || !intersect(f, t, &x))
				continue;
			if (f->state == EMBD_CKPT_WEIGHT) {
				copy_weights(f, data, t, &x);
				covered[k] += (uint64_t)(x.r1 - x.r0) * (x.c1 - x.c0);
				if (f->optimizer_step > t->optimizer_step)
					t->optimizer_step = f->optimizer_step;
				continue;
			}
			float *dst = f->state == EMBD_CKPT_MOMENTUM1 ? t->momentum1 : t->momentum2;
			if (dst)
				copy_state(f, data, dst, t, &x, per_row);
		}
		free(data);
	}
	for (uint32_t k = 0; k < num_targets && !rc; k++) {
		const struct embd_ckpt_target *t = &targets[k];
		if (covered[k] == (uint64_t)t->rows * t->cols)
			continue;
		rc = EMBD_EPARSE;
		snprintf(err, err_len, "%s: table '%s' rows [%lld, +%lld) columns [%u, +%u): "
				      "the checkpoint's weight files cover %" PRIu64 " of %" PRIu64
				      " elements", dir, m->tables[t->table].name, (long long)t->row_offset,
				      (long long)t->rows, t->col_offset, t->cols, covered[k],
				      (uint64_t)t->rows * t->cols);
	}
	free(covered);
	return rc;
}
