/*
 * Checkpoint directories (ckpt/manifest.h, ckpt/checkpoint.h): manifests round-trip and refuse
 * bad fields; directories are found newest-valid-first, a damaged one (flipped byte, truncated
 * file, broken manifest, leftover .tmp) is reported by name and skipped; retention keeps K
 * valid ones and moves damaged ones aside; a failed write leaves no .tmp; the directory lock
 * refuses a second owner; and resharding: tables written under one plan load under another
 * (table-wise -> row-wise, row-wise -> column-wise, 2 ranks -> 1 rank) equal to the original
 * exactly. The service's side (restore into a real step engine, triggers): test_ckpt_service.c.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/embedding.h"
#include "ckpt/checkpoint.h"
#include "tests/support/dir_util.h"

static char root[64];

static void setup(void)
{
	tu_tmpdir(root, sizeof(root), "embd-ckpt");
}

static void teardown(void)
{
	tu_rmtree(root);
}

TestSuite(checkpoint, .init = setup, .fini = teardown, .timeout = 60);

/* ---- a table and its shards as plain arrays ---------------------------------------------- */

#define ROWS 37
#define DIM 12

static float table_value(int64_t r, uint32_t c)
{
	return (float)(r * 100 + c) / 64.0f - 3.0f;
}

struct rect {
	int64_t row, rows;
	uint32_t col, cols;
};

/* The manifest of one table "emb" (adagrad: one state per weight) and arrays of its shards. */
static void make_shards(struct embd_ckpt_manifest *m, struct embd_ckpt_table *tab,
			const struct rect *shards, uint32_t n, struct embd_ckpt_array *arrays,
			float **bufs, uint64_t step)
{
	*tab = (struct embd_ckpt_table){ .name = "emb", .num_embeddings = ROWS, .embedding_dim = DIM,
					 .data_type = EMBD_DTYPE_FP32, .optimizer = EMBD_OPT_ADAGRAD };
	*m = (struct embd_ckpt_manifest){ .step = step, .num_nodes = 1, .plan_hash = 0x1234,
					  .num_tables = 1, .tables = tab };
	for (uint32_t k = 0; k < n; k++) {
		const struct rect *s = &shards[k];
		for (int st = 0; st < 2; st++) {
			float *b = bufs[2 * k + st] = malloc(sizeof(float) * (size_t)(s->rows * s->cols));
			cr_assert_not_null(b);
			for (int64_t r = 0; r < s->rows; r++)
				for (uint32_t c = 0; c < s->cols; c++)
					b[r * s->cols + c] = table_value(s->row + r, s->col + c) * (st ? -1.0f : 1.0f);
			struct embd_ckpt_array *a = &arrays[2 * k + st];
			*a = (struct embd_ckpt_array){ 0 };
			a->ndim = 2;
			a->data = b;
			a->file = (struct embd_ckpt_file){ .state = st ? EMBD_CKPT_MOMENTUM1 : EMBD_CKPT_WEIGHT,
				.row_offset = s->row, .rows = s->rows, .col_offset = s->col,
				.cols = s->cols, .dtype = EMBD_NPY_F4, .optimizer_step = 9 };
			snprintf(a->file.name, sizeof(a->file.name), "emb.%u.%s.npy", k,
				 st ? "m1" : "w");
		}
	}
}

static void write_shards(const struct rect *shards, uint32_t n, uint64_t step)
{
	struct embd_ckpt_manifest m;
	struct embd_ckpt_table tab;
	struct embd_ckpt_array arrays[16];
	float *bufs[16];
	char err[512];
	uint64_t bytes;

	cr_assert(n <= 8);
	make_shards(&m, &tab, shards, n, arrays, bufs, step);
	int rc = embd_ckpt_write_dir(root, &m, arrays, 2 * n, true, &bytes, err, sizeof(err));
	cr_assert_eq(rc, 0, "write_dir: %d %s", rc, err);
	cr_expect_gt(bytes, 0);
	for (uint32_t i = 0; i < 2 * n; i++)
		free(bufs[i]);
	free(m.files);
}

/* Loads the checkpoint into targets shaped as `shards` and checks every value exactly. */
static void check_restore_into(const struct rect *shards, uint32_t n)
{
	char dir[4200], err[512];
	struct embd_ckpt_manifest m;
	struct embd_ckpt_target t[8];

	int rc = embd_ckpt_find(root, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err, sizeof(err));
	cr_assert_eq(rc, 0, "find: %d %s", rc, err);
	for (uint32_t k = 0; k < n; k++) {
		const struct rect *s = &shards[k];
		t[k] = (struct embd_ckpt_target){ .table = 0, .row_offset = s->row, .rows = s->rows,
			.col_offset = s->col, .cols = s->cols, .dtype = EMBD_DTYPE_FP32,
			.weights = calloc((size_t)(s->rows * s->cols), sizeof(float)),
			.momentum1 = calloc((size_t)(s->rows * s->cols), sizeof(float)) };
	}
	rc = embd_ckpt_load(dir, &m, t, n, err, sizeof(err));
	cr_assert_eq(rc, 0, "load: %d %s", rc, err);
	uint32_t bad = 0;
	for (uint32_t k = 0; k < n; k++) {
		const struct rect *s = &shards[k];
		for (int64_t r = 0; r < s->rows; r++)
			for (uint32_t c = 0; c < s->cols; c++) {
				float w = ((float *)t[k].weights)[r * s->cols + c];
				float m1 = t[k].momentum1[r * s->cols + c];
				float want = table_value(s->row + r, s->col + c);
				if ((w != want || m1 != -want) && bad++ < 5)
					cr_expect(false, "target %u row %lld col %u: expected %g / %g, got "
						  "%g / %g", k, (long long)(s->row + r), s->col + c, want,
						  -want, w, m1);
			}
		cr_expect_eq(t[k].optimizer_step, 9);
		free(t[k].weights);
		free(t[k].momentum1);
	}
	cr_expect_eq(bad, 0, "expected every restored value equal to the original, %u differ", bad);
	embd_ckpt_manifest_free(&m);
}

static const struct rect tw[] = { { 0, ROWS, 0, DIM } };
static const struct rect rw3[] = { { 0, 13, 0, DIM }, { 13, 13, 0, DIM }, { 26, 11, 0, DIM } };
static const struct rect cw3[] = { { 0, ROWS, 0, 3 }, { 0, ROWS, 3, 3 }, { 0, ROWS, 6, 6 } };
/* 2 ranks of a table_row_wise-like plan: a 2 x 2 grid of row and column blocks */
static const struct rect grid[] = { { 0, 20, 0, 6 }, { 0, 20, 6, 6 }, { 20, 17, 0, 6 },
				    { 20, 17, 6, 6 } };

Test(checkpoint, table_wise_restores_as_row_wise)
{
	write_shards(tw, 1, 5);
	check_restore_into(rw3, 3);
}

Test(checkpoint, row_wise_restores_as_column_wise)
{
	write_shards(rw3, 3, 5);
	check_restore_into(cw3, 3);
}

Test(checkpoint, two_ranks_restore_as_one)
{
	write_shards(grid, 4, 5);
	check_restore_into(tw, 1);
}

Test(checkpoint, incomplete_weights_are_refused)
{
	write_shards(rw3, 2, 5);        /* the last row block is missing */
	char dir[4200], err[512];
	struct embd_ckpt_manifest m;
	cr_assert_eq(embd_ckpt_find(root, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err,
				    sizeof(err)), 0);
	float w[ROWS * DIM];
	struct embd_ckpt_target t = { .table = 0, .rows = ROWS, .cols = DIM, .weights = w };
	int rc = embd_ckpt_load(dir, &m, &t, 1, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EPARSE, "expected EMBD_EPARSE, got %d", rc);
	cr_expect(strstr(err, "'emb'") && strstr(err, "cover"), "got '%s'", err);
	embd_ckpt_manifest_free(&m);
}

/* ---- manifests --------------------------------------------------------------------------- */

Test(checkpoint, manifest_round_trip)
{
	struct embd_ckpt_manifest m, back;
	struct embd_ckpt_table tab;
	struct embd_ckpt_array arrays[6];
	float *bufs[6];
	char *text, err[512];

	make_shards(&m, &tab, rw3, 3, arrays, bufs, 42);
	struct embd_ckpt_file files[6];
	for (int i = 0; i < 6; i++) {
		files[i] = arrays[i].file;
		files[i].bytes = 1000u + (uint64_t)i;
		files[i].crc32c = 0xfedcba98u - (uint32_t)i;
		free(bufs[i]);
	}
	m.files = files;
	m.num_files = 6;
	m.plan_json = "{\"version\": 1}";
	m.created_unix_ms = 1700000000123ull;
	cr_assert_eq(embd_ckpt_manifest_write(&m, &text), 0);
	int rc = embd_ckpt_manifest_parse(text, strlen(text), &back, err, sizeof(err));
	cr_assert_eq(rc, 0, "parse: %d %s\n%s", rc, err, text);
	cr_expect_eq(back.step, 42);
	cr_expect_eq(back.plan_hash, 0x1234);
	cr_expect_eq(back.created_unix_ms, 1700000000123ull);
	cr_expect_str_eq(back.plan_json, "{\"version\":1}");
	cr_assert_eq(back.num_files, 6);
	for (int i = 0; i < 6; i++) {
		cr_expect_str_eq(back.files[i].name, files[i].name);
		cr_expect_eq(back.files[i].crc32c, files[i].crc32c);
		cr_expect_eq(back.files[i].bytes, files[i].bytes);
		cr_expect_eq(back.files[i].row_offset, files[i].row_offset);
		cr_expect_eq(back.files[i].state, files[i].state);
	}
	embd_ckpt_manifest_free(&back);
	/* one JSON value: a second object appended is refused, not ignored */
	char appended[8192];
	snprintf(appended, sizeof(appended), "%s\n{}\n", text);
	rc = embd_ckpt_manifest_parse(appended, strlen(appended), &back, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EPARSE, "a manifest with text after it: expected EMBD_EPARSE, got %d",
		     rc);
	cr_expect(strstr(err, "manifest") && strstr(err, "after the JSON value"), "got '%s'", err);
	embd_ckpt_manifest_free(&back);
	free(text);
}

static void expect_manifest_refused(const char *from, const char *to, const char *field)
{
	struct embd_ckpt_manifest m, back;
	struct embd_ckpt_table tab;
	struct embd_ckpt_array arrays[6];
	struct embd_ckpt_file files[6];
	float *bufs[6];
	char *text, err[512] = "";

	make_shards(&m, &tab, rw3, 3, arrays, bufs, 1);
	for (int i = 0; i < 6; i++) {
		files[i] = arrays[i].file;
		free(bufs[i]);
	}
	m.files = files;
	m.num_files = 6;
	cr_assert_eq(embd_ckpt_manifest_write(&m, &text), 0);
	char *at = strstr(text, from);
	cr_assert_not_null(at, "'%s' not in %s", from, text);
	char edited[8192];
	snprintf(edited, sizeof(edited), "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
	int rc = embd_ckpt_manifest_parse(edited, strlen(edited), &back, err, sizeof(err));
	cr_expect_neq(rc, 0, "'%s' -> '%s': expected refused", from, to);
	cr_expect(strstr(err, field), "'%s' -> '%s': expected the error to name %s, got '%s'", from,
		  to, field, err);
	embd_ckpt_manifest_free(&back);
	free(text);
}

Test(checkpoint, manifest_refuses_bad_fields)
{
	expect_manifest_refused("\"emb.0.w.npy\"", "\"../emb.0.w.npy\"", "name");
	expect_manifest_refused("\"format_version\":1", "\"format_version\":7", "format_version");
	expect_manifest_refused("\"table\":\"emb\"", "\"table\":\"nope\"", "table");
	expect_manifest_refused("\"state\":\"momentum1\"", "\"state\":\"momentum2\"", "state");
	expect_manifest_refused("\"row_offset\":13", "\"row_offset\":12", "overlaps");
	expect_manifest_refused("\"rows\":11", "\"rows\":12", "rows");
	expect_manifest_refused("\"emb.1.w.npy\"", "\"emb.0.w.npy\"", "repeats");
	expect_manifest_refused("\"step\":1", "\"step\":-1", "step");
	expect_manifest_refused("\"plan_hash\":\"0000000000001234\"", "\"plan_hash\":\"12g4\"",
				"plan_hash");
}

/* ---- directories: newest valid, damage, retention ---------------------------------------- */

struct skips {
	int n;
	char dirs[8][256];
};

static void on_skip(void *arg, const char *dir, const char *why)
{
	struct skips *s = arg;
	(void)why;
	if (s->n < 8)
		snprintf(s->dirs[s->n], sizeof(s->dirs[0]), "%s", dir);
	s->n++;
}

static bool has_dir(const char *name)
{
	return tu_has_entry(root, name);
}

static uint64_t newest(struct skips *sk)
{
	char dir[4200], err[512];
	struct embd_ckpt_manifest m;
	int rc = embd_ckpt_find(root, UINT64_MAX, on_skip, sk, dir, sizeof(dir), &m, err, sizeof(err));
	cr_assert_eq(rc, 0, "find: %d %s", rc, err);
	uint64_t s = m.step;
	embd_ckpt_manifest_free(&m);
	return s;
}

static void flip_byte(const char *path, off_t at)
{
	int fd = open(path, O_RDWR);
	uint8_t b;
	cr_assert(fd >= 0, "open %s", path);
	cr_assert_eq(pread(fd, &b, 1, at), 1);
	b ^= 0x40;
	cr_assert_eq(pwrite(fd, &b, 1, at), 1);
	close(fd);
}

static int count_entries(const char *prefix)
{
	return tu_count_entries(root, prefix);
}

static int count_damaged(const char *prefix)
{
	return tu_count_damaged(root, prefix);
}

Test(checkpoint, damaged_checkpoints_are_skipped_by_name)
{
	char path[256];
	struct skips sk = { 0 };

	write_shards(rw3, 3, 10);
	write_shards(rw3, 3, 20);
	write_shards(rw3, 3, 30);
	write_shards(rw3, 3, 40);
	cr_expect_eq(newest(&sk), 40);
	cr_expect_eq(sk.n, 0);
	/* step 40: one flipped bit in a weight; 30: a truncated state file; 20: broken manifest */
	snprintf(path, sizeof(path), "%s/step-40/emb.1.w.npy", root);
	flip_byte(path, 200);
	snprintf(path, sizeof(path), "%s/step-30/emb.2.m1.npy", root);
	cr_assert_eq(truncate(path, 100), 0);
	snprintf(path, sizeof(path), "%s/step-20/manifest.json", root);
	cr_assert_eq(truncate(path, 50), 0);
	/* a half-written checkpoint (no rename yet) is not even looked at */
	snprintf(path, sizeof(path), "%s/.tmp-step-50", root);
	cr_assert_eq(mkdir(path, 0755), 0);
	cr_expect_eq(newest(&sk), 10, "expected the only intact checkpoint, step 10");
	cr_expect_eq(sk.n, 3, "expected 3 skipped, got %d", sk.n);
	cr_expect(strstr(sk.dirs[0], "step-40") && strstr(sk.dirs[1], "step-30") &&
		  strstr(sk.dirs[2], "step-20"), "skipped in order 40, 30, 20: got %s %s %s",
		  sk.dirs[0], sk.dirs[1], sk.dirs[2]);
	/* rewriting a damaged step moves the damaged one aside; an intact one is never
	 * overwritten */
	write_shards(rw3, 3, 40);
	sk.n = 0;
	cr_expect_eq(newest(&sk), 40);
	cr_expect_eq(count_damaged("step-40-"), 1, "the damaged step-40 must be kept in damaged/");
	struct embd_ckpt_manifest m;
	struct embd_ckpt_table tab;
	struct embd_ckpt_array arrays[6];
	float *bufs[6];
	char err[512];
	uint64_t bytes;
	make_shards(&m, &tab, rw3, 3, arrays, bufs, 40);
	cr_expect_eq(embd_ckpt_write_dir(root, &m, arrays, 6, false, &bytes, err, sizeof(err)),
		     EMBD_EBUSY);
	for (int i = 0; i < 6; i++)
		free(bufs[i]);
	free(m.files);
}

Test(checkpoint, retention_keeps_the_newest)
{
	char path[256], err[512];
	struct skips sk = { 0 };

	for (uint64_t s = 1; s <= 5; s++)
		write_shards(tw, 1, s * 100);
	snprintf(path, sizeof(path), "%s/.tmp-step-900", root);
	cr_assert_eq(mkdir(path, 0755), 0);
	int removed = embd_ckpt_retain(root, 2, UINT64_MAX, UINT64_MAX, NULL, NULL, err, sizeof(err));
	cr_expect_eq(removed, 4, "expected 3 old checkpoints and 1 .tmp removed, got %d (%s)",
		     removed, err);
	cr_expect_eq(count_entries("step-"), 2);
	cr_expect_eq(count_entries(".tmp-"), 0);
	cr_expect_eq(newest(&sk), 500);
	snprintf(path, sizeof(path), "%s/step-400", root);
	cr_expect_eq(access(path, F_OK), 0, "step-400 kept");
}

Test(checkpoint, retention_spares_the_step_every_node_holds)
{
	char path[256], err[512];

	/* per-node directories: 300 is the newest step every node holds, 400 and 500 are this
	 * node's part of cluster checkpoints that failed elsewhere */
	for (uint64_t s = 1; s <= 5; s++)
		write_shards(tw, 1, s * 100);
	int removed = embd_ckpt_retain(root, 1, UINT64_MAX, 300, NULL, NULL, err, sizeof(err));
	cr_expect_eq(removed, 3, "expected steps 100, 200 and 400 removed, got %d (%s)", removed,
		     err);
	snprintf(path, sizeof(path), "%s/step-300", root);
	cr_expect_eq(access(path, F_OK), 0, "expected step-300 spared");
	snprintf(path, sizeof(path), "%s/step-500", root);
	cr_expect_eq(access(path, F_OK), 0, "expected step-500 kept (the newest)");
	cr_expect_eq(count_entries("step-"), 2);
}

/* Every checkpoint newer than the valid one is damaged: retention used to keep those and
 * delete the valid ones, down to the one just written. */
Test(checkpoint, retention_counts_only_valid_checkpoints)
{
	char path[256], err[512];
	struct skips mv = { 0 };        /* the moved ones: their new paths */

	write_shards(tw, 1, 10);
	write_shards(tw, 1, 20);
	for (uint64_t s = 30; s <= 50; s += 10)
		write_shards(tw, 1, s);
	/* 30: a file gone; 40: a truncated file; 50: no manifest */
	snprintf(path, sizeof(path), "%s/step-30/emb.0.m1.npy", root);
	cr_assert_eq(unlink(path), 0);
	snprintf(path, sizeof(path), "%s/step-40/emb.0.w.npy", root);
	cr_assert_eq(truncate(path, 64), 0);
	snprintf(path, sizeof(path), "%s/step-50/manifest.json", root);
	cr_assert_eq(unlink(path), 0);
	write_shards(tw, 1, 5);         /* the checkpoint just written (spared) */
	int removed = embd_ckpt_retain(root, 2, UINT64_MAX, 5, on_skip, &mv, err, sizeof(err));
	cr_expect_eq(removed, 0, "keep 2 valid (20, 10) and the one just written: got %d removed "
		     "(%s)", removed, err);
	cr_expect(has_dir("step-20") && has_dir("step-10") && has_dir("step-5"),
		  "every valid checkpoint must stay");
	cr_expect_eq(mv.n, 3, "expected 3 damaged checkpoints moved aside, got %d", mv.n);
	cr_expect_eq(count_entries("step-"), 3);
	cr_expect(count_damaged("step-30-") == 1 && count_damaged("step-40-") == 1 &&
		  count_damaged("step-50-") == 1, "damaged ones must be moved to damaged/, not deleted");
	cr_expect(strstr(mv.dirs[0], "/damaged/step-50-"), "reported with its new path: %s",
		  mv.dirs[0]);
	/* with keep 1, the newest valid one stays whatever is spared */
	removed = embd_ckpt_retain(root, 1, UINT64_MAX, UINT64_MAX, on_skip, &mv, err, sizeof(err));
	cr_expect_eq(removed, 2, "steps 10 and 5 removed, got %d (%s)", removed, err);
	cr_expect(has_dir("step-20") && !has_dir("step-5"), "the newest valid step stays");
}

/* A service resumes from step 20 while step-30 and step-40 are there (a per_node cluster's
 * node holds steps another node lacks): they go to abandoned/, never deleted, and step 20 and
 * older stay. */
Test(checkpoint, steps_after_the_resumed_one_are_set_aside)
{
	char err[512], aside[256];
	struct skips mv = { 0 };

	for (uint64_t s = 10; s <= 40; s += 10)
		write_shards(tw, 1, s);
	int moved = embd_ckpt_set_aside_after(root, 20, on_skip, &mv, err, sizeof(err));
	cr_expect_eq(moved, 2, "expected steps 30 and 40 moved, got %d (%s)", moved, err);
	cr_expect(has_dir("step-10") && has_dir("step-20") && !has_dir("step-30") &&
		  !has_dir("step-40"), "only the steps above 20 move");
	snprintf(aside, sizeof(aside), "%s/abandoned", root);
	cr_expect(tu_count_entries(aside, "step-30-") == 1 && tu_count_entries(aside, "step-40-") == 1,
		  "both must be in abandoned/, not deleted");
	cr_expect(mv.n == 2 && strstr(mv.dirs[0], "/abandoned/step-40-"),
		  "reported newest first with its new path: %s", mv.dirs[0]);
	cr_expect_eq(newest(&mv), 20);
	cr_expect_eq(embd_ckpt_set_aside_after(root, 20, NULL, NULL, err, sizeof(err)), 0,
		     "nothing above 20 any more");
	/* a fresh start (step 0) sets every step but 0 aside */
	cr_expect_eq(embd_ckpt_set_aside_after(root, 0, NULL, NULL, err, sizeof(err)), 2);
	cr_expect_eq(count_entries("step-"), 0);
	cr_expect_eq(tu_count_entries(aside, "step-"), 4);
	cr_expect_eq(embd_ckpt_count_damaged(root), 0, "abandoned/ holds no damaged ones");
}

/* A checkpoint that cannot be read now (here its manifest is a directory: read fails with
 * EISDIR, as EACCES, EMFILE or a stale NFS handle would) is not damage: retention neither
 * moves nor removes it nor counts it, and a restore fails instead of falling back to an older
 * checkpoint. */
Test(checkpoint, unreadable_is_not_damaged)
{
	char path[256], dir[4200], err[512];
	struct skips mv = { 0 };
	struct embd_ckpt_manifest m;

	write_shards(tw, 1, 10);
	write_shards(tw, 1, 20);
	snprintf(path, sizeof(path), "%s/step-20/manifest.json", root);
	cr_assert_eq(unlink(path), 0);
	cr_assert_eq(mkdir(path, 0700), 0);
	int removed = embd_ckpt_retain(root, 1, UINT64_MAX, UINT64_MAX, on_skip, &mv, err,
				       sizeof(err));
	cr_expect_eq(removed, 0, "nothing removed: step 10 is the one valid step, got %d", removed);
	cr_expect_eq(mv.n, 0, "an unreadable checkpoint is not moved aside (%d moved)", mv.n);
	cr_expect(has_dir("step-20") && has_dir("step-10"));
	int rc = embd_ckpt_find(root, UINT64_MAX, on_skip, &mv, dir, sizeof(dir), &m, err,
				sizeof(err));
	cr_expect_eq(rc, EMBD_EIO, "expected the restore to fail with EMBD_EIO, got %d (%s)", rc,
		     err);
	if (!rc)
		embd_ckpt_manifest_free(&m);
	cr_expect_eq(mv.n, 0);
}

/* A write that fails (here the file size limit, as a full disk) leaves no .tmp behind. */
Test(checkpoint, a_failed_write_removes_its_tmp_at_once)
{
	struct embd_ckpt_manifest m;
	struct embd_ckpt_table tab;
	struct embd_ckpt_array arrays[6];
	float *bufs[6];
	char err[512];
	uint64_t bytes;
	struct rlimit lim = { 1024, 1024 }, old;

	make_shards(&m, &tab, rw3, 3, arrays, bufs, 12);
	signal(SIGXFSZ, SIG_IGN);
	cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
	cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
	int rc = embd_ckpt_write_dir(root, &m, arrays, 6, true, &bytes, err, sizeof(err));
	setrlimit(RLIMIT_FSIZE, &old);
	cr_expect_neq(rc, 0, "the write must fail past the file size limit");
	cr_expect_eq(count_entries(".tmp-"), 0, "the failed write's .tmp-step-12 must be gone");
	cr_expect_eq(count_entries("step-"), 0);
	for (int i = 0; i < 6; i++)
		free(bufs[i]);
	free(m.files);
}

Test(checkpoint, lock_refuses_a_second_owner_naming_its_pid)
{
	struct embd_ckpt_lock *a, *b, *c;
	char err[1024], pid[32];

	snprintf(pid, sizeof(pid), "pid %d", (int)getpid());
	cr_assert_eq(embd_ckpt_lock_take(root, false, 0, "embd node 0 of 1", &a, err, sizeof(err)),
		     0, "%s", err);
	cr_expect_eq(embd_ckpt_lock_take(root, false, 0, "second", &b, err, sizeof(err)),
		     EMBD_EBUSY);
	cr_expect(strstr(err, pid) && strstr(err, "embd node 0 of 1"), "got '%s'", err);
	cr_expect_eq(embd_ckpt_lock_take(root, true, 1, "cluster node", &b, err, sizeof(err)),
		     EMBD_EBUSY, "a shared-layout node must not join a lone service's directory");
	embd_ckpt_lock_release(a);
	/* a shared-layout cluster: one lock per node rank */
	cr_assert_eq(embd_ckpt_lock_take(root, true, 0, "node 0 of 2", &a, err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(embd_ckpt_lock_take(root, true, 1, "node 1 of 2", &b, err, sizeof(err)), 0,
		     "%s", err);
	cr_expect_eq(embd_ckpt_lock_take(root, true, 1, "node 1 again", &c, err, sizeof(err)),
		     EMBD_EBUSY, "two services claiming node rank 1");
	cr_expect(strstr(err, "node 1 of 2") && strstr(err, pid), "got '%s'", err);
	cr_expect_eq(embd_ckpt_lock_take(root, false, 0, "lone", &c, err, sizeof(err)), EMBD_EBUSY);
	cr_expect(strstr(err, "node 0 of 2") && strstr(err, "node 1 of 2"), "both nodes named: '%s'",
		  err);
	embd_ckpt_lock_release(a);
	embd_ckpt_lock_release(b);
	cr_assert_eq(embd_ckpt_lock_take(root, false, 0, "lone", &c, err, sizeof(err)), 0,
		     "released locks must free the directory: %s", err);
	embd_ckpt_lock_release(c);
}

/* ---- per-node directories ------------------------------------------------------------------ */

/* Node `node` of num_nodes writes its shards as step under <root>/n<node> (part NULL) or, as
 * its part of a shared-directory checkpoint, into <root>/.tmp-step-<step>; *part then gets
 * its manifest (free with embd_ckpt_manifest_free). */
static void write_node_part(const struct rect *shards, uint32_t n, uint64_t step, uint32_t node,
			    uint32_t num_nodes, struct embd_ckpt_manifest *part)
{
	struct embd_ckpt_manifest m;
	struct embd_ckpt_table tab;
	struct embd_ckpt_array arrays[16];
	float *bufs[16];
	char dir[128], err[512];
	uint64_t bytes;

	make_shards(&m, &tab, shards, n, arrays, bufs, step);
	m.node = node;
	m.num_nodes = num_nodes;
	for (uint32_t i = 0; i < 2 * n; i++) {
		arrays[i].file.node = node;
		memmove(arrays[i].file.name + 3, arrays[i].file.name, strlen(arrays[i].file.name) + 1);
		memcpy(arrays[i].file.name, "n0.", 3);
		arrays[i].file.name[1] = (char)('0' + node);
	}
	snprintf(dir, sizeof(dir), "%s/n%u", root, node);
	int rc = part ? embd_ckpt_write_part(root, &m, arrays, 2 * n, false, &bytes, err, sizeof(err))
		      : embd_ckpt_write_dir(dir, &m, arrays, 2 * n, false, &bytes, err, sizeof(err));
	cr_assert_eq(rc, 0, "node %u write: %s", node, err);
	for (uint32_t i = 0; i < 2 * n; i++)
		free(bufs[i]);
	if (!part) {
		free(m.files);
		return;
	}
	*part = m;
	part->tables = malloc(sizeof(tab));
	cr_assert_not_null(part->tables);
	*part->tables = tab;
}

static void write_node(const struct rect *shards, uint32_t n, uint64_t step, uint32_t node,
		       uint32_t num_nodes)
{
	write_node_part(shards, n, step, node, num_nodes, NULL);
}

Test(checkpoint, per_node_directories_restore_the_newest_step_every_node_has)
{
	static const struct rect node0[] = { { 0, 20, 0, DIM } }, node1[] = { { 20, 17, 0, 6 },
									      { 20, 17, 6, 6 } };
	char roots[2][128], dirs[2][EMBD_CKPT_PATH_MAX + 64], err[512];
	const char *rp[2] = { roots[0], roots[1] };
	struct embd_ckpt_manifest m;
	struct skips sk = { 0 };

	write_node(node0, 1, 5, 0, 2);
	write_node(node1, 2, 5, 1, 2);
	write_node(node0, 1, 8, 0, 2); /* node 1 died before it wrote step 8 */
	snprintf(roots[0], sizeof(roots[0]), "%s/n0", root);
	snprintf(roots[1], sizeof(roots[1]), "%s/n1", root);
	int rc = embd_ckpt_find_nodes(rp, 2, UINT64_MAX, on_skip, &sk, dirs, &m, err, sizeof(err));
	cr_assert_eq(rc, 0, "find_nodes: %d %s", rc, err);
	cr_expect_eq(m.step, 5, "expected step 5 (step 8 is on node 0 only), got %llu",
		     (unsigned long long)m.step);
	cr_expect_eq(sk.n, 1, "step 8 reported as skipped");
	cr_expect_eq(m.num_files, 6);
	float w[ROWS * DIM], m1[ROWS * DIM];
	struct embd_ckpt_target t = { .table = 0, .rows = ROWS, .cols = DIM, .weights = w,
				      .momentum1 = m1 };
	const char *dp[2] = { dirs[0], dirs[1] };
	rc = embd_ckpt_load_nodes(dp, 2, &m, &t, 1, err, sizeof(err));
	cr_assert_eq(rc, 0, "load_nodes: %s", err);
	for (int64_t r = 0; r < ROWS; r++)
		for (uint32_t c = 0; c < DIM; c++)
			cr_assert(w[r * DIM + c] == table_value(r, c) && m1[r * DIM + c] == -table_value(r, c),
				  "row %lld col %u: expected %g, got %g", (long long)r, c,
				  table_value(r, c), w[r * DIM + c]);
	embd_ckpt_manifest_free(&m);
	/* node manifests that disagree (another step count of nodes) are refused */
	write_node(node1, 2, 9, 1, 3);
	write_node(node0, 1, 9, 0, 2);
	rc = embd_ckpt_find_nodes(rp, 2, 9, NULL, NULL, dirs, &m, err, sizeof(err));
	cr_expect_eq(m.step, 5, "step 9's node manifests disagree: expected step 5 again");
	embd_ckpt_manifest_free(&m);
}

/* ---- a shared directory: every node's part, node 0's commit ---------------------------------- */

Test(checkpoint, shared_directory_parts_appear_only_when_committed)
{
	static const struct rect node0[] = { { 0, 20, 0, DIM } }, node1[] = { { 20, 17, 0, 6 },
									      { 20, 17, 6, 6 } };
	struct embd_ckpt_manifest parts[2], m;
	char dir[EMBD_CKPT_PATH_MAX + 64], err[512];

	write_node_part(node0, 1, 7, 0, 2, &parts[0]);
	write_node_part(node1, 2, 7, 1, 2, &parts[1]);
	/* both parts on disk, no manifest: nothing to restore, and retention leaves them alone */
	cr_expect_eq(embd_ckpt_find(root, UINT64_MAX, NULL, NULL, dir, sizeof(dir), &m, err,
				    sizeof(err)), EMBD_ENOENT, "uncommitted parts must not be found");
	cr_expect_eq(embd_ckpt_retain(root, 1, 7, UINT64_MAX, NULL, NULL, err, sizeof(err)), 0,
		     "retention must keep the .tmp of the step being written");
	cr_expect_eq(count_entries(".tmp-step-7"), 1);
	int rc = embd_ckpt_manifest_merge(parts, 2, &m, err, sizeof(err));
	cr_assert_eq(rc, 0, "merge: %s", err);
	rc = embd_ckpt_commit(root, &m, false, err, sizeof(err));
	cr_assert_eq(rc, 0, "commit: %d %s", rc, err);
	cr_expect_eq(embd_ckpt_commit(root, &m, false, err, sizeof(err)), EMBD_EBUSY,
		     "a committed step is never overwritten");
	embd_ckpt_manifest_free(&m);
	embd_ckpt_manifest_free(&parts[0]);
	embd_ckpt_manifest_free(&parts[1]);
	cr_expect_eq(count_entries(".tmp-"), 0);
	check_restore_into(tw, 1);      /* 2 nodes' row and column shards into one table */
	/* a step some node never reported: node 0 discards it */
	write_node_part(node0, 1, 9, 0, 2, &parts[0]);
	embd_ckpt_manifest_free(&parts[0]);
	cr_expect_eq(embd_ckpt_discard(root, 9, err, sizeof(err)), 0, "discard: %s", err);
	cr_expect_eq(count_entries(".tmp-"), 0);
	struct skips sk = { 0 };
	cr_expect_eq(newest(&sk), 7);
}
