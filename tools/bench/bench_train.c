/*
 * embd-bench train: training steps per second of Python trainers through embd against
 * TorchRec's own sharded EmbeddingBagCollection (DistributedModelParallel over gloo, the fused
 * kernel with SGD), same machine, same run, same batches (tools/bench/train_bench.py runs both
 * in the same trainer processes, rounds alternating; this file makes the batches, measures
 * the step's memory limits and prints the lines). Default: the configuration of issue 17,
 * 8 tables x 1M rows x 64, 2 ranks, 2 trainers, B 2048 per trainer, 20 ids per bag.
 *
 * The limit of a step is the memory traffic it cannot avoid, timed with the limits of
 * `embd-bench kernels` (bench_limits.c) on this machine's pinned workers over the same ids:
 * per table, the gather of every id's row of the global batch (all trainers) with the pooled
 * rows stored, then the read-modify-write of its distinct rows after each one's occurrences'
 * gradient rows are read.
 * ratio_to_limit = steps/s / limit_steps_per_s (1: the step is all unavoidable traffic);
 * pipelined_ratio_to_limit the same of the pipelined embd steps (embd_pipelined_steps_per_s).
 * The limits are measured before the trainers start and again after they end, and the
 * faster of the two is the limit: a shared host's speed drifts over the minute the rounds
 * take. Both are printed (limit_steps_per_s_before, _after), so that a ratio above 1 can be
 * told from drift.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bench.h"
#include "bench_limits.h"
#include "kernels/cpu_kernels.h"
#include "kernels/embedding.h"
#include "kernels/workers.h"

#define TRAIN_BATCHES 4                 /* distinct global batches, cycled */
#define TRAIN_SEED 2026

struct train_opts {
	uint32_t tables, dim, batch, ids_per_bag, trainers, ranks, steps, rounds, warmup;
	uint64_t rows;
	char shardings[256];
	const char *python;
	bool limits;
};

struct limits {
	double ms, gather_ms, rmw_ms;   /* per global step, medians */
	double step_bytes;
	double before_ms, after_ms;     /* ms measured before the trainers and after them */
};

/* ids[k][trainer][feature][B * P]: what the trainers post (the file train_bench.py reads). */
static int64_t *make_ids(const struct train_opts *o, uint64_t *count)
{
	uint64_t n = (uint64_t)TRAIN_BATCHES * o->trainers * o->tables * o->batch * o->ids_per_bag;
	int64_t *ids = malloc(n * sizeof(*ids));
	uint64_t s = TRAIN_SEED;

	for (uint64_t i = 0; ids && i < n; i++)
		ids[i] = (int64_t)(bench_rng_next(&s) % o->rows);
	*count = n;
	return ids;
}

/* The global batch k of feature f (every trainer's bags, in trainer order) into g, and what
 * its update touches into r (bench_rmw_rows_make; scratch 2 x its ids). */
static void global_batch(const struct train_opts *o, const int64_t *ids, uint32_t k, uint32_t f,
			 int64_t *g, uint64_t *scratch, struct bench_rmw *r, uint64_t *rows,
			 uint64_t *first, uint32_t *bags)
{
	const uint64_t per = (uint64_t)o->batch * o->ids_per_bag;

	for (uint32_t t = 0; t < o->trainers; t++)
		memcpy(g + t * per, ids + (((uint64_t)k * o->trainers + t) * o->tables + f) * per,
		       per * sizeof(*g));
	r->n = bench_rmw_rows_make(g, per * o->trainers, o->ids_per_bag, scratch, rows, first, bags);
	r->rows = rows;
	r->first = first;
	r->bags = bags;
}

/* The workers: one per allowed CPU, pinned in order (as the kernels' benchmark pins them). */
static int make_workers(struct embd_workers **out)
{
	int cpus[BENCH_LIMIT_MAX_WORKERS];
	uint32_t n = 0;
	cpu_set_t set;
	char err[256];

	if (sched_getaffinity(0, sizeof(set), &set) == 0)
		for (int c = 0; c < CPU_SETSIZE && n < BENCH_LIMIT_MAX_WORKERS; c++)
			if (CPU_ISSET(c, &set))
				cpus[n++] = c;
	if (!n)
		cpus[n++] = 0;
	if (embd_workers_create(n, cpus, out, err, sizeof(err))) {
		fprintf(stderr, "embd-bench train: workers: %s\n", err);
		return -1;
	}
	return 0;
}

/* The limits of one global step over the batches' ids, on one shard per table. The workers
 * pin this thread to the first CPU (kernels/workers.h): its affinity is put back afterwards,
 * or the trainers and the service this process starts would inherit one CPU between them. */
static int measure_limits(const struct train_opts *o, const int64_t *ids, struct limits *out)
{
	cpu_set_t affinity;
	bool restore = sched_getaffinity(0, sizeof(affinity), &affinity) == 0;
	const uint64_t per = (uint64_t)o->batch * o->ids_per_bag * o->trainers;
	const uint64_t bags = (uint64_t)o->batch * o->trainers;
	const enum embd_isa isa = embd_kernels_isa_best();
	struct embd_workers *workers = NULL;
	struct embd_shard *shard = NULL;
	int64_t *g = malloc(per * sizeof(*g));
	uint64_t *rows = malloc(per * sizeof(*rows)), *first = malloc((per + 1) * sizeof(*first));
	uint64_t *scratch = malloc(2 * per * sizeof(*scratch));
	uint32_t *occ_bags = malloc(per * sizeof(*occ_bags));
	float *pooled = malloc(bags * o->dim * sizeof(float));
	float *grad = calloc(bags * o->dim, sizeof(float));
	enum { REPS = 5 };
	double gather[REPS], rmw[REPS], bytes = 0;
	char err[256];
	int rc = -1;

	if (!g || !rows || !first || !scratch || !occ_bags || !pooled || !grad ||
	    make_workers(&workers))
		goto out;
	/* one table's shard serves every table: each is far larger than the caches, so a
	 * table's rows are as cold as they would be in its own */
	struct embd_shard_desc d = {
		.num_embeddings = (int64_t)o->rows, .embedding_dim = o->dim,
		.dtype = EMBD_DTYPE_FP32, .rows = (int64_t)o->rows, .cols = o->dim,
		.optimizer = { .type = EMBD_OPT_SGD, .lr = 0.01f },
	};
	if (embd_shard_create(&d, &shard, err, sizeof(err))) {
		fprintf(stderr, "embd-bench train: shard: %s\n", err);
		goto out;
	}
	struct embd_exec exec = { .workers = workers, .isa = isa };
	embd_shard_init_weights(shard, TRAIN_SEED, &exec);
	struct bench_gather ga = {
		.table = shard->weights, .row_bytes = (uint64_t)o->dim * 4,
		.pass_bytes = (uint64_t)embd_forward_pass_cols(isa, o->dim) * 4,
		.out = (uint8_t *)pooled, .out_row_bytes = (uint64_t)o->dim * 4,
		.ids_per_out = o->ids_per_bag, .isa = isa, .ids = g, .n = per,
	};
	struct bench_rmw rm = {
		.arrays = { shard->weights }, .row_bytes = { (uint64_t)o->dim * 4 }, .num_arrays = 1,
		.grad = (const uint8_t *)grad, .grad_row_bytes = (uint64_t)o->dim * 4, .isa = isa,
	};
	for (int r = 0; r < REPS + 1; r++) {    /* the first round warms up */
		uint64_t gns = 0, rns = 0;
		uint32_t k = (uint32_t)(r % TRAIN_BATCHES);
		for (uint32_t f = 0; f < o->tables; f++) {
			global_batch(o, ids, k, f, g, scratch, &rm, rows, first, occ_bags);
			uint64_t t0 = bench_now_ns();
			bench_gather_run(workers, &ga);
			uint64_t t1 = bench_now_ns();
			bench_rmw_run(workers, &rm);
			gns += t1 - t0;
			rns += bench_now_ns() - t1;
			if (r == 1)
				bytes += (double)per * o->dim * 4 + (double)bags * o->dim * 4 +
					 2.0 * (double)rm.n * o->dim * 4 + (double)bags * o->dim * 4;
		}
		if (r) {
			gather[r - 1] = (double)gns / 1e6;
			rmw[r - 1] = (double)rns / 1e6;
		}
	}
	out->gather_ms = bench_median(gather, REPS);
	out->rmw_ms = bench_median(rmw, REPS);
	out->ms = out->gather_ms + out->rmw_ms;
	out->step_bytes = bytes;
	fprintf(stderr, "embd-bench train: limits measured (checksum %llu)\n",
		(unsigned long long)bench_gather_checksum(&ga));
	rc = 0;
out:
	embd_shard_destroy(shard);
	embd_workers_destroy(workers);
	if (restore && sched_setaffinity(0, sizeof(affinity), &affinity)) {
		perror("embd-bench train: sched_setaffinity");
		rc = -1;
	}
	free(g);
	free(rows);
	free(first);
	free(scratch);
	free(occ_bags);
	free(pooled);
	free(grad);
	return rc;
}

/* The job train_bench.py reads. */
static int write_job(const struct train_opts *o, const char *path, const char *ids_path)
{
	long nproc = sysconf(_SC_NPROCESSORS_ONLN);
	uint32_t cpus = nproc > 0 ? (uint32_t)nproc : 1;
	cJSON *j = cJSON_CreateObject(), *sh = cJSON_AddArrayToObject(j, "shardings");
	char list[sizeof(o->shardings)], *save = NULL;

	snprintf(list, sizeof(list), "%s", o->shardings);
	for (char *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save))
		cJSON_AddItemToArray(sh, cJSON_CreateString(t));
	/* TorchRec shards no table row_wise on CPU: its table_wise is the comparison there */
	cJSON_AddStringToObject(cJSON_AddObjectToObject(j, "torchrec_sharding"), "row_wise",
				"table_wise");
	const struct { const char *k; double v; } nums[] = {
		{ "tables", o->tables }, { "rows", (double)o->rows }, { "dim", o->dim },
		{ "batch_size", o->batch }, { "ids_per_bag", o->ids_per_bag },
		{ "trainers", o->trainers }, { "ranks", o->ranks }, { "steps", o->steps },
		{ "rounds", o->rounds }, { "warmup", o->warmup }, { "batches", TRAIN_BATCHES },
		{ "lr", 0.01 }, { "min_partition", o->dim / 2 >= 4 ? o->dim / 2 : 4 },
		{ "threads_per_rank", cpus / o->ranks ? cpus / o->ranks : 1 },
		{ "torch_threads", cpus / o->trainers ? cpus / o->trainers : 1 },
		{ "timeout_s", 3600 },
	};
	for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
		cJSON_AddNumberToObject(j, nums[i].k, nums[i].v);
	cJSON_AddStringToObject(j, "ids_file", ids_path);
	char *text = cJSON_Print(j);
	cJSON_Delete(j);
	FILE *f = text ? fopen(path, "w") : NULL;
	int rc = f && fputs(text, f) >= 0 ? 0 : -1;
	if (f && fclose(f))
		rc = -1;
	free(text);
	return rc;
}

/* One line of train_bench.py with this run's limits, machine and configuration added. */
static void print_line(const struct train_opts *o, const char *line, const struct limits *lim,
		       const char *cpu, const char *isa)
{
	cJSON *j = cJSON_Parse(line);
	if (!j) {
		fputs(line, stdout);
		return;
	}
	const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "embd_steps_per_s");
	const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "torchrec_steps_per_s");
	const cJSON *ep = cJSON_GetObjectItemCaseSensitive(j, "embd_pipelined_steps_per_s");
	cJSON *out = cJSON_CreateObject();
	cJSON_AddStringToObject(out, "name", "train");
	for (cJSON *it = j->child; it; it = it->next)
		cJSON_AddItemToObject(out, it->string, cJSON_Duplicate(it, true));
	if (o->limits && lim->ms > 0) {
		double limit_sps = 1e3 / lim->ms;
		cJSON_AddNumberToObject(out, "limit_steps_per_s", limit_sps);
		cJSON_AddNumberToObject(out, "limit_steps_per_s_before", 1e3 / lim->before_ms);
		if (lim->after_ms > 0)
			cJSON_AddNumberToObject(out, "limit_steps_per_s_after", 1e3 / lim->after_ms);
		cJSON_AddNumberToObject(out, "ratio_to_limit",
					cJSON_IsNumber(e) ? e->valuedouble / limit_sps : 0);
		cJSON_AddNumberToObject(out, "torchrec_ratio_to_limit",
					cJSON_IsNumber(t) ? t->valuedouble / limit_sps : 0);
		cJSON_AddNumberToObject(out, "pipelined_ratio_to_limit",
					cJSON_IsNumber(ep) ? ep->valuedouble / limit_sps : 0);
		cJSON_AddNumberToObject(out, "step_bytes", lim->step_bytes);
		cJSON_AddNumberToObject(out, "limit_gather_ms", lim->gather_ms);
		cJSON_AddNumberToObject(out, "limit_rmw_ms", lim->rmw_ms);
	}
	const struct { const char *k; double v; } conf[] = {
		{ "tables", o->tables }, { "rows", (double)o->rows }, { "dim", o->dim },
		{ "batch_size", o->batch }, { "ids_per_bag", o->ids_per_bag },
		{ "trainers", o->trainers }, { "ranks", o->ranks }, { "steps_per_round", o->steps },
	};
	for (size_t i = 0; i < sizeof(conf) / sizeof(conf[0]); i++)
		cJSON_AddNumberToObject(out, conf[i].k, conf[i].v);
	cJSON_AddStringToObject(out, "optimizer", "sgd");
	cJSON_AddStringToObject(out, "cpu", cpu);
	cJSON_AddStringToObject(out, "isa", isa);
	char *text = cJSON_PrintUnformatted(out);
	if (text)
		printf("%s\n", text);
	fflush(stdout);
	free(text);
	cJSON_Delete(out);
	cJSON_Delete(j);
}

/* Runs train_bench.py on the job and keeps its lines (*lines, *n of them, each and the array
 * to free); returns its exit status, or -1 also when a line could not be kept. */
static int run_python(const struct train_opts *o, const char *embd, const char *job,
		      char ***lines, int *n)
{
	char build[4096], cmd[8192], line[8192];

	/* the build's embd is <build>/daemon/embd: support.py finds embd and embctl there */
	snprintf(build, sizeof(build), "%s", embd);
	for (int up = 0; up < 2; up++) {
		char *slash = strrchr(build, '/');
		if (slash)
			*slash = 0;
	}
	snprintf(cmd, sizeof(cmd), "EMBD_BUILD_DIR='%s' '%s' '%s/train_bench.py' '%s'", build,
		 o->python, EMBD_BENCH_SCRIPT_DIR, job);
	FILE *p = popen(cmd, "r");
	if (!p) {
		perror("embd-bench train: popen");
		return -1;
	}
	bool kept = true;
	while (fgets(line, sizeof(line), p)) {
		char **grown = realloc(*lines, (size_t)(*n + 1) * sizeof(**lines));
		char *copy = strdup(line);
		if (grown)
			*lines = grown;
		if (!grown || !copy) {
			free(copy);
			kept = false;
			continue;
		}
		(*lines)[(*n)++] = copy;
	}
	int st = pclose(p);
	if (!kept)
		fprintf(stderr, "embd-bench train: out of memory for train_bench.py's lines\n");
	return st == 0 && kept ? 0 : -1;
}

static void usage(void)
{
	fprintf(stderr, "usage: embd-bench train [--tables N (8)] [--rows R (1000000)] [--dim D (64)]"
		" [--batch B (2048)] [--ids P per bag (20)] [--trainers T (2)] [--ranks N (2)]"
		" [--steps S per round (10)] [--rounds R (3)] [--warmup W (3)]"
		" [--sharding table_wise,column_wise] [--python PATH ($EMBD_BENCH_PYTHON, .venv)]"
		" [--no-limits] [--embd PATH]\n");
}

static int parse(int argc, char **argv, struct train_opts *o)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		uint32_t *u = !strcmp(a, "--tables") ? &o->tables : !strcmp(a, "--dim") ? &o->dim :
			      !strcmp(a, "--batch") ? &o->batch : !strcmp(a, "--ids") ? &o->ids_per_bag :
			      !strcmp(a, "--trainers") ? &o->trainers : !strcmp(a, "--ranks") ? &o->ranks :
			      !strcmp(a, "--steps") ? &o->steps : !strcmp(a, "--rounds") ? &o->rounds :
			      !strcmp(a, "--warmup") ? &o->warmup : NULL;
		if (!strcmp(a, "--no-limits")) {
			o->limits = false;
			continue;
		}
		if (!v)
			return -1;
		i++;
		if (u)
			*u = (uint32_t)strtoul(v, NULL, 0);
		else if (!strcmp(a, "--rows"))
			o->rows = strtoull(v, NULL, 0);
		else if (!strcmp(a, "--sharding"))
			snprintf(o->shardings, sizeof(o->shardings), "%s", v);
		else if (!strcmp(a, "--python"))
			o->python = v;
		else if (strcmp(a, "--embd"))
			return -1;
	}
	if (!o->tables || !o->rows || o->dim < 4 || o->dim % 4 || !o->batch || !o->ids_per_bag ||
	    !o->trainers || !o->ranks || !o->steps || !o->rounds)
		return -1;
	return 0;
}

int bench_train_run(int argc, char **argv)
{
	const char *embd = bench_embd_path(argc, argv);
	struct train_opts o = {
		.tables = 8, .rows = 1000000, .dim = 64, .batch = 2048, .ids_per_bag = 20,
		.trainers = 2, .ranks = 2, .steps = 10, .rounds = 3, .warmup = 3,
		.shardings = "table_wise,column_wise", .python = getenv("EMBD_BENCH_PYTHON"),
		.limits = true,
	};
	char job[64] = "/tmp/embd-bench-train-XXXXXX", ids_path[80], job_path[80];
	struct limits lim = { 0 }, after = { 0 };
	char **lines = NULL, cpu[128];
	const char *isa = embd_kernels_isa_name(embd_kernels_isa_best());
	int num_lines = 0;
	uint64_t n = 0;
	int rc = 1;

	if (parse(argc, argv, &o)) {
		usage();
		return 2;
	}
	if (!o.python)
		o.python = EMBD_BENCH_SCRIPT_DIR "/../../.venv/bin/python";
	if (!mkdtemp(job)) {
		perror("embd-bench train: mkdtemp");
		return 1;
	}
	snprintf(ids_path, sizeof(ids_path), "%s/ids.bin", job);
	snprintf(job_path, sizeof(job_path), "%s/job.json", job);
	int64_t *ids = make_ids(&o, &n);
	FILE *f = ids ? fopen(ids_path, "wb") : NULL;
	if (!f || fwrite(ids, sizeof(*ids), n, f) != n || fclose(f)) {
		fprintf(stderr, "embd-bench train: cannot write %s\n", ids_path);
		goto out;
	}
	/* before the trainers start: the limits' shard is freed when they run */
	if (o.limits && measure_limits(&o, ids, &lim))
		goto out;
	lim.before_ms = lim.ms;
	if (write_job(&o, job_path, ids_path))
		goto out;
	rc = run_python(&o, embd, job_path, &lines, &num_lines) ? 1 : 0;
	/* after the trainers end, and the faster of the two is the limit */
	if (o.limits && num_lines && measure_limits(&o, ids, &after) == 0) {
		after.before_ms = lim.before_ms;
		after.after_ms = lim.after_ms = after.ms;
		if (after.ms < lim.ms)
			lim = after;
	}
	bench_cpu_model(cpu, sizeof(cpu));
	for (int i = 0; i < num_lines; i++)
		print_line(&o, lines[i], &lim, cpu, isa);
out:
	for (int i = 0; i < num_lines; i++)
		free(lines[i]);
	free(lines);
	free(ids);
	unlink(ids_path);
	unlink(job_path);
	rmdir(job);
	return rc;
}
