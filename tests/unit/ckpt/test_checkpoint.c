/*
 * Checkpoints (ckpt/manifest.h, ckpt/checkpoint.h, ckpt/ckpt_service.h): manifests
 * round-trip and refuse bad fields; directories are found newest-valid-first, a damaged one
 * (flipped byte, truncated file, broken manifest, leftover .tmp) is reported by name and
 * skipped; retention keeps K; and resharding: tables written under one plan restore under
 * another (table-wise -> row-wise, row-wise -> column-wise, 2 ranks -> 1 rank, fp16 <-> fp32
 * weights) equal to the original exactly, through embd_ckpt_load and through the service's
 * restore into a real step engine. Per-row optimizer state across a column merge becomes the
 * column-weighted mean.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/embedding.h"
#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_service.h"
#include "engine/step.h"
#include "tests/support/dist_util.h"

static char root[64];

static void setup(void)
{
	snprintf(root, sizeof(root), "/tmp/embd-ckpt-XXXXXX");
	cr_assert_not_null(mkdtemp(root));
}

static void teardown(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(checkpoint, .init = setup, .fini = teardown, .timeout = 60);

/* A cluster node's tests also need a store to talk to (nobody else on it). */
static void cluster_setup(void)
{
	setup();
	tu_server_start();
}

static void cluster_teardown(void)
{
	tu_server_stop();
	teardown();
}

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
	/* rewriting a damaged step replaces it; an intact one is never overwritten */
	write_shards(rw3, 3, 40);
	sk.n = 0;
	cr_expect_eq(newest(&sk), 40);
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

static int count_entries(const char *prefix)
{
	DIR *d = opendir(root);
	int n = 0;
	for (struct dirent *e; (e = readdir(d));)
		n += !strncmp(e->d_name, prefix, strlen(prefix));
	closedir(d);
	return n;
}

Test(checkpoint, retention_keeps_the_newest)
{
	char path[256], err[512];
	struct skips sk = { 0 };

	for (uint64_t s = 1; s <= 5; s++)
		write_shards(tw, 1, s * 100);
	snprintf(path, sizeof(path), "%s/.tmp-step-900", root);
	cr_assert_eq(mkdir(path, 0755), 0);
	int removed = embd_ckpt_retain(root, 2, UINT64_MAX, UINT64_MAX, err, sizeof(err));
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
	int removed = embd_ckpt_retain(root, 1, UINT64_MAX, 300, err, sizeof(err));
	cr_expect_eq(removed, 3, "expected steps 100, 200 and 400 removed, got %d (%s)", removed,
		     err);
	snprintf(path, sizeof(path), "%s/step-300", root);
	cr_expect_eq(access(path, F_OK), 0, "expected step-300 spared");
	snprintf(path, sizeof(path), "%s/step-500", root);
	cr_expect_eq(access(path, F_OK), 0, "expected step-500 kept (the newest)");
	cr_expect_eq(count_entries("step-"), 2);
}

/* ---- the service: restore into a step engine under another plan -------------------------- */

struct node {
	struct embd_table_spec specs[2];
	struct embd_table_constraints cons[2];
	struct embd_ckpt_settings config;
	struct embd_plan plan;
	struct embd_plan_table ptables[2];
	struct embd_plan_shard pshards[2][4];
	struct embd_ranks *ranks;
	struct embd_step *step;
	struct embd_ckpt_service *ck;
};

/* Tables t0 (40 x 16, adagrad) and t1 (23 x 8, rowwise_adagrad), sharded as `kind`. */
static void node_start(struct node *n, const char *kind, uint32_t num_ranks)
{
	struct embd_optimizer_spec ada = { .type = EMBD_OPT_ADAGRAD, .lr = 0.1f, .eps = 1e-8f };
	struct embd_optimizer_spec rwa = { .type = EMBD_OPT_ROWWISE_ADAGRAD, .lr = 0.1f, .eps = 1e-8f };
	char err[512] = "";

	memset(n, 0, sizeof(*n));
	n->specs[0] = (struct embd_table_spec){ .name = "t0", .num_embeddings = 40,
		.embedding_dim = 16, .optimizer = ada, .num_features = 1, .feature_names = { "a" } };
	n->specs[1] = (struct embd_table_spec){ .name = "t1", .num_embeddings = 23,
		.embedding_dim = 8, .optimizer = rwa, .num_features = 1, .feature_names = { "b" } };
	n->config.tables = (struct embd_tables){ .count = 2, .specs = n->specs, .constraints = n->cons };
	snprintf(n->config.checkpoint_dir, sizeof(n->config.checkpoint_dir), "%s", root);
	n->config.checkpoint_keep = 3;
	embd_plan_topology_default(&n->plan.topology, (int32_t)num_ranks);
	n->plan.topology.batch_size = 4;
	n->plan.topology.compute_device = EMBD_DEVICE_CPU;
	n->config.num_nodes = 1;
	n->plan.num_tables = 2;
	n->plan.tables = n->ptables;
	for (uint32_t t = 0; t < 2; t++) {
		struct embd_plan_table *pt = &n->ptables[t];
		int64_t rows = n->specs[t].num_embeddings;
		int32_t dim = n->specs[t].embedding_dim;
		strcpy(pt->name, n->specs[t].name);
		pt->compute_kernel = EMBD_KERNEL_FUSED;
		pt->shards = n->pshards[t];
		if (!strcmp(kind, "tw")) {
			pt->sharding_type = EMBD_SHARD_TABLE_WISE;
			pt->num_shards = 1;
			pt->shards[0] = (struct embd_plan_shard){ (int32_t)(t % num_ranks), 0, rows, 0, dim };
		} else if (!strcmp(kind, "rw")) {
			pt->sharding_type = EMBD_SHARD_ROW_WISE;
			pt->num_shards = num_ranks;
			int64_t block = (rows + num_ranks - 1) / num_ranks;
			for (uint32_t r = 0; r < num_ranks; r++)
				pt->shards[r] = (struct embd_plan_shard){ (int32_t)r, block * r,
					r + 1 < num_ranks ? block : rows - block * r, 0, dim };
		} else {
			pt->sharding_type = EMBD_SHARD_COLUMN_WISE;
			pt->num_shards = 2;
			pt->shards[0] = (struct embd_plan_shard){ 0, 0, rows, 0, dim / 4 };
			pt->shards[1] = (struct embd_plan_shard){ (int32_t)(1 % num_ranks), 0, rows,
								  dim / 4, dim - dim / 4 };
		}
	}
	cr_assert_eq(embd_ranks_create(num_ranks, 1, &n->ranks, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_step_create(&n->config.tables, &n->plan, n->ranks, 7, 2, &n->step, err,
				      sizeof(err)), 0, "%s", err);
	int rc = embd_ckpt_service_create(&n->config, n->step, &n->plan, &n->ck, err, sizeof(err));
	cr_assert_eq(rc, 0, "ckpt_service_create: %d %s", rc, err);
}

static void node_stop(struct node *n)
{
	embd_ckpt_service_destroy(n->ck);
	embd_step_destroy(n->step);
	embd_ranks_destroy(n->ranks);
}

/* Distinctive weights and state: w = f(table, row, col); per-row state = g(row, shard cols). */
static void node_fill(struct node *n)
{
	for (uint32_t i = 0; i < embd_step_num_shards(n->step); i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(n->step, i, &v);
		const struct embd_shard_desc *d = &v.shard->desc;
		for (int64_t r = 0; r < d->rows; r++) {
			for (uint32_t c = 0; c < d->cols; c++) {
				float w = (float)(v.table * 1000 + (d->row_offset + r) * 17 + d->col_offset + c) / 8.0f;
				((float *)v.shard->weights)[r * d->cols + c] = w;
				if (v.table == 0)
					v.shard->momentum1[r * d->cols + c] = w * 2;
			}
			if (v.table == 1)
				v.shard->momentum1[r] = (float)(d->row_offset + r) + (float)d->col_offset;
		}
		v.shard->step = 11;
	}
}

/* A node sharded as kind on num_ranks writes its filled shards as checkpoint `step`. */
static void node_write(const char *kind, uint32_t num_ranks, uint64_t step)
{
	struct node a;

	node_start(&a, kind, num_ranks);
	node_fill(&a);
	cr_assert_eq(embd_ckpt_service_final(a.ck, step), 0);
	node_stop(&a);
}

Test(checkpoint, service_restores_under_another_plan)
{
	struct node b;
	char err[512] = "";
	uint64_t step;

	node_write("cw", 2, 17);
	node_start(&b, "rw", 1);         /* CW on 2 ranks -> RW (one row block) on 1 rank */
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_assert_eq(rc, 0, "restore: %d %s", rc, err);
	cr_expect_eq(step, 17);
	uint32_t bad = 0;
	for (uint32_t t = 0; t < 2; t++)
		for (int64_t r = 0; r < b.specs[t].num_embeddings; r++)
			for (uint32_t c = 0; c < (uint32_t)b.specs[t].embedding_dim; c++) {
				float got, want = (float)(t * 1000 + r * 17 + c) / 8.0f;
				cr_assert_eq(embd_step_read_weight(b.step, t, r, c, 0, &got), 0);
				if (got != want && bad++ < 5)
					cr_expect(false, "t%u (%lld, %u): expected %g, got %g", t,
						  (long long)r, c, want, got);
			}
	cr_expect_eq(bad, 0, "%u weights differ", bad);
	struct embd_step_shard_view v;
	for (uint32_t i = 0; i < embd_step_num_shards(b.step); i++) {
		embd_step_shard_view(b.step, i, &v);
		const struct embd_shard_desc *d = &v.shard->desc;
		cr_expect_eq(v.shard->step, 11, "optimizer step restored");
		for (int64_t r = 0; r < d->rows; r++) {
			if (v.table == 0) {
				float w = (float)((d->row_offset + r) * 17 + 3) / 8.0f;
				cr_expect_eq(v.shard->momentum1[r * d->cols + 3], w * 2);
				continue;
			}
			/* source shards: cols [0, 2) with state row + 0, cols [2, 8) with row + 2 */
			float want = ((float)(d->row_offset + r) * 2 + (float)(d->row_offset + r + 2) * 6) / 8;
			cr_expect(fabsf(v.shard->momentum1[r] - want) < 1e-5f,
				  "t1 row %lld per-row state: expected the column-weighted mean %g, got %g",
				  (long long)(d->row_offset + r), want, v.shard->momentum1[r]);
		}
	}
	node_stop(&b);
}

Test(checkpoint, service_refuses_other_tables)
{
	struct node b;
	char err[512] = "";
	uint64_t step;

	node_write("tw", 2, 3);
	node_start(&b, "tw", 2);
	b.specs[1].num_embeddings = 24;  /* the config changed the table's rows */
	int rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EMISMATCH, "expected EMBD_EMISMATCH, got %d (%s)", rc, err);
	cr_expect(strstr(err, "'t1'") && strstr(err, "23 x 8"), "got '%s'", err);
	b.specs[1].num_embeddings = 23;
	strcpy(b.specs[1].name, "t9");
	rc = embd_ckpt_service_restore(b.ck, &step, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EMISMATCH);
	cr_expect(strstr(err, "'t9'"), "got '%s'", err);
	node_stop(&b);
}

/* Waits (up to 10 s) until the service finished checkpoint seq. */
static void wait_written(struct node *n, uint64_t seq)
{
	for (int i = 0; i < 1000 && embd_ckpt_service_reap(n->ck) < seq; i++)
		usleep(10000);
	cr_assert_geq(embd_ckpt_service_reap(n->ck), seq, "checkpoint %llu not written in 10 s",
		      (unsigned long long)seq);
}

static bool has_step(uint64_t step)
{
	char dir[4200];
	embd_ckpt_dir_name(root, step, dir, sizeof(dir));
	return access(dir, F_OK) == 0;
}

Test(checkpoint, service_triggers_and_retention)
{
	struct node n;
	char *json = NULL;

	node_start(&n, "tw", 1);
	n.config.checkpoint_every_steps = 3;
	n.config.checkpoint_keep = 2;
	embd_ckpt_service_poll(n.ck, 1);
	embd_ckpt_service_poll(n.ck, 2);
	cr_expect_eq(embd_ckpt_service_reap(n.ck), 0, "nothing is due before step 3");
	embd_ckpt_service_poll(n.ck, 3);
	wait_written(&n, 1);
	cr_expect(has_step(3));
	embd_ckpt_service_poll(n.ck, 5);
	embd_ckpt_service_poll(n.ck, 6);
	wait_written(&n, 2);
	embd_ckpt_service_poll(n.ck, 9);
	wait_written(&n, 3);
	cr_expect(has_step(6) && has_step(9) && !has_step(3), "keep 2: steps 6 and 9 stay");
	/* every T seconds: only once T passed, and only when steps ran since the last one */
	n.config.checkpoint_every_steps = 0;
	n.config.checkpoint_every_seconds = 1;
	embd_ckpt_service_poll(n.ck, 10);
	cr_expect_eq(embd_ckpt_service_reap(n.ck), 3, "not due before a second passed");
	usleep(1100000);
	embd_ckpt_service_poll(n.ck, 10);
	wait_written(&n, 4);
	cr_expect(has_step(10));
	usleep(1100000);
	embd_ckpt_service_poll(n.ck, 10);
	cr_expect_eq(embd_ckpt_service_reap(n.ck), 4, "no new step, no new checkpoint");
	/* a request for a step already on disk completes at once, successfully */
	uint64_t seq = embd_ckpt_service_request(n.ck);
	embd_ckpt_service_poll(n.ck, 10);
	wait_written(&n, seq);
	cr_assert_eq(embd_ckpt_service_result_json(n.ck, &json), 0);
	cr_expect(strstr(json, "\"ok\":true") && strstr(json, "step-10"), "got %s", json);
	free(json);
	node_stop(&n);
}

/* A cluster's every_steps are the multiples of N, not N after the last one this node took (an
 * agreed one, or one a node took alone while the cluster re-formed), so every node is due at
 * the same steps. Node 0 of 2 with no node 1: each write fails after store_timeout_ms. */
Test(checkpoint, cluster_every_steps_are_its_multiples, .init = cluster_setup,
     .fini = cluster_teardown)
{
	struct node n;
	char err[512] = "";

	node_start(&n, "tw", 1);
	embd_ckpt_service_destroy(n.ck);
	n.config.num_nodes = 2;
	snprintf(n.config.master_addr, sizeof(n.config.master_addr), "127.0.0.1");
	n.config.master_port = tu_port;
	n.config.store_timeout_ms = 200;
	n.config.checkpoint_every_steps = 5;
	int rc = embd_ckpt_service_create(&n.config, n.step, &n.plan, &n.ck, err, sizeof(err));
	cr_assert_eq(rc, 0, "ckpt_service_create on a cluster: %d %s", rc, err);
	embd_ckpt_service_agreed(n.ck);
	cr_expect(embd_ckpt_service_poll(n.ck, 3), "an agreed checkpoint at step 3");
	wait_written(&n, 1);
	cr_expect(embd_ckpt_service_poll(n.ck, 5), "step 5: due (a multiple of 5)");
	wait_written(&n, 2);
	cr_expect(!embd_ckpt_service_poll(n.ck, 8), "step 8: not due (5 after step 3)");
	cr_expect(embd_ckpt_service_poll(n.ck, 10), "step 10: due");
	wait_written(&n, 3);
	node_stop(&n);
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
	cr_expect_eq(embd_ckpt_retain(root, 1, 7, UINT64_MAX, err, sizeof(err)), 0,
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
