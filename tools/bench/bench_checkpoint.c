/*
 * embd-bench checkpoint: a checkpoint of a node's shards written while training steps run,
 * against the disk's own sequential write speed measured in the same directory in the same
 * run (dd-like: the same bytes in 4 MiB writes, then fsync). In process: the service's step
 * engine and checkpointer (ckpt/ckpt_service.h) on real CPU ranks, one trainer batch per
 * step; the checkpoint is requested at a step boundary and the loop keeps stepping until the
 * background write is on disk. Figures, medians over rounds (disk and checkpoint alternate):
 *   write_gbps         checkpoint bytes / write time (files, fsyncs, manifest, renames)
 *   disk_gbps          the dd-like reference
 *   max_step_stall_ms  the most one step spent on a checkpoint's behalf: the boundary where it
 *                      starts (marking the snapshot "not copied") and, in each step while the
 *                      copier runs, the rank workers' copy-before-write of the rows that step
 *                      updates (ckpt/ckpt_snapshot.h; the service's own accounting, the
 *                      larger of it and the boundary timed here), beside stall_fraction =
 *                      that / write time
 *   step_ms_*          a step's time before and during the background write
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "ckpt/ckpt_service.h"
#include "common/log.h"
#include "engine/ranks.h"
#include "engine/step.h"

#define CK_DIM 128
#define CK_TABLES 4
#define CK_BATCH 256
#define CK_ROUNDS 5
#define CK_STEPS_BEFORE 20

struct ck_bench {
	struct embd_table_spec specs[CK_TABLES];
	struct embd_table_constraints cons[CK_TABLES];
	struct embd_ckpt_settings config;
	struct embd_plan plan;
	struct embd_plan_table ptables[CK_TABLES];
	struct embd_plan_shard pshards[CK_TABLES][16];
	struct embd_ranks *ranks;
	struct embd_step *step;
	struct embd_ckpt_service *ck;
	int32_t *lengths;
	int64_t *values;
	float *pooled, *grad;
	struct embd_step_batch batch;
	uint64_t next_step;
};

/* CK_TABLES row_wise tables of rowwise_adagrad over `ranks` ranks, total_bytes of weights. */
static int setup(struct ck_bench *b, uint64_t total_bytes, uint32_t ranks, const char *dir)
{
	char err[512] = "";
	int64_t rows = (int64_t)(total_bytes / CK_TABLES / (CK_DIM * 4));
	struct embd_optimizer_spec opt = { .type = EMBD_OPT_ROWWISE_ADAGRAD, .lr = 0.05f,
					   .eps = 1e-8f };

	for (uint32_t t = 0; t < CK_TABLES; t++) {
		b->specs[t] = (struct embd_table_spec){ .num_embeddings = rows, .embedding_dim = CK_DIM,
			.optimizer = opt, .num_features = 1 };
		snprintf(b->specs[t].name, sizeof(b->specs[t].name), "t%u", t);
		snprintf(b->specs[t].feature_names[0], EMBD_NAME_MAX, "f%u", t);
	}
	b->config.tables = (struct embd_tables){ .count = CK_TABLES, .specs = b->specs,
						 .constraints = b->cons };
	snprintf(b->config.checkpoint_dir, sizeof(b->config.checkpoint_dir), "%s", dir);
	b->config.checkpoint_keep = 1;
	embd_plan_topology_default(&b->plan.topology, (int32_t)ranks);
	b->plan.topology.batch_size = CK_BATCH;
	b->plan.topology.compute_device = EMBD_DEVICE_CPU;
	b->config.num_nodes = 1;
	b->plan.num_tables = CK_TABLES;
	b->plan.tables = b->ptables;
	int64_t block = (rows + ranks - 1) / ranks;
	for (uint32_t t = 0; t < CK_TABLES; t++) {
		struct embd_plan_table *pt = &b->ptables[t];
		strcpy(pt->name, b->specs[t].name);
		pt->sharding_type = EMBD_SHARD_ROW_WISE;
		pt->compute_kernel = EMBD_KERNEL_FUSED;
		pt->shards = b->pshards[t];
		for (uint32_t r = 0; r < ranks && block * r < rows; r++)
			pt->shards[pt->num_shards++] = (struct embd_plan_shard){ (int32_t)r, block * r,
				rows - block * r < block ? rows - block * r : block, 0, CK_DIM };
	}
	if (embd_ranks_create(ranks, 1, &b->ranks, err, sizeof(err)) ||
	    embd_step_create(&b->config.tables, &b->plan, b->ranks, 1, 1, &b->step, err, sizeof(err)) ||
	    embd_ckpt_service_create(&b->config, b->step, &b->plan, &b->ck, err, sizeof(err))) {
		fprintf(stderr, "embd-bench checkpoint: %s\n", err);
		return -1;
	}
	/* one batch: 4 ids per bag, spread over the rows */
	uint64_t n = (uint64_t)CK_TABLES * CK_BATCH * 4;
	b->lengths = malloc(sizeof(int32_t) * CK_TABLES * CK_BATCH);
	b->values = malloc(sizeof(int64_t) * n);
	b->pooled = calloc((size_t)CK_BATCH * CK_TABLES * CK_DIM, sizeof(float));
	b->grad = malloc(sizeof(float) * CK_BATCH * CK_TABLES * CK_DIM);
	if (!b->lengths || !b->values || !b->pooled || !b->grad)
		return -1;
	for (uint32_t i = 0; i < CK_TABLES * CK_BATCH; i++)
		b->lengths[i] = 4;
	for (uint64_t i = 0; i < n; i++)
		b->values[i] = (int64_t)((i * 2654435761u) % (uint64_t)rows);
	for (uint32_t i = 0; i < CK_BATCH * CK_TABLES * CK_DIM; i++)
		b->grad[i] = (float)(i % 17) / 170.0f - 0.05f;
	b->batch = (struct embd_step_batch){
		.kjt = { .num_features = CK_TABLES, .batch_size = CK_BATCH, .lengths = b->lengths,
			 .values = b->values, .num_values = n },
		.pooled = b->pooled, .pooled_grad = b->grad,
	};
	return 0;
}

static void teardown(struct ck_bench *b)
{
	embd_ckpt_service_destroy(b->ck);
	embd_step_destroy(b->step);
	embd_ranks_destroy(b->ranks);
	free(b->lengths);
	free(b->values);
	free(b->pooled);
	free(b->grad);
}

/* One training step; its time in ms. */
static double one_step(struct ck_bench *b)
{
	uint64_t t0 = bench_now_ns();
	if (embd_step_forward(b->step, &b->batch, 1) != 1 ||
	    embd_step_backward(b->step, &b->batch, 1)) {
		fprintf(stderr, "embd-bench checkpoint: step failed: %s\n", b->batch.err);
		exit(1);
	}
	b->next_step++;
	return (double)(bench_now_ns() - t0) / 1e6;
}

struct round {
	double write_gbps, stall_ms, write_ms, step_before_ms, step_during_ms, step_max_ms;
	uint64_t bytes, steps_during;
};

static int ckpt_round(struct ck_bench *b, struct round *out)
{
	double before[CK_STEPS_BEFORE], during[4096];
	uint32_t n = 0;
	struct embd_ckpt_figures f0, f1;

	for (uint32_t i = 0; i < CK_STEPS_BEFORE; i++)
		before[i] = one_step(b);
	embd_ckpt_service_figures(b->ck, &f0);
	uint64_t seq = embd_ckpt_service_request(b->ck);
	uint64_t t0 = bench_now_ns();
	embd_ckpt_service_poll(b->ck, b->next_step);   /* the boundary: steps wait for this */
	double stall = (double)(bench_now_ns() - t0) / 1e6;
	/* keep training until the write is on disk */
	while (embd_ckpt_service_reap(b->ck) < seq) {
		if (n < 4096)
			during[n++] = one_step(b);
		else
			usleep(1000);
	}
	embd_ckpt_service_figures(b->ck, &f1);
	if (f1.written == f0.written) {
		fprintf(stderr, "embd-bench checkpoint: the checkpoint was not written (see log)\n");
		return -1;
	}
	if (f1.last_stall_ms > stall)
		stall = f1.last_stall_ms;
	*out = (struct round){ .stall_ms = stall, .write_ms = f1.last_write_ms,
			       .bytes = f1.last_bytes, .steps_during = n,
			       .write_gbps = (double)f1.last_bytes / (f1.last_write_ms * 1e6) };
	out->step_max_ms = 0;
	for (uint32_t i = 0; i < n; i++)
		if (during[i] > out->step_max_ms)
			out->step_max_ms = during[i];
	out->step_before_ms = bench_median(before, CK_STEPS_BEFORE);
	out->step_during_ms = bench_median(during, n);
	return 0;
}

/* dd-like: bytes to a new file in dir, 4 MiB writes, fsync; GB/s. */
static double disk_round(const char *dir, uint64_t bytes)
{
	const size_t chunk = 4u << 20;
	char path[4200];
	uint8_t *buf = aligned_alloc(4096, chunk);

	if (!buf)
		return -1;
	memset(buf, 0x5a, chunk);
	snprintf(path, sizeof(path), "%s/dd-reference.bin", dir);
	uint64_t t0 = bench_now_ns();
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	for (uint64_t done = 0; fd >= 0 && done < bytes;) {
		size_t n = bytes - done < chunk ? (size_t)(bytes - done) : chunk;
		ssize_t w = write(fd, buf, n);
		if (w <= 0) {
			close(fd);
			fd = -1;
			break;
		}
		done += (uint64_t)w;
	}
	double gbps = -1;
	if (fd >= 0 && !fsync(fd))
		gbps = (double)bytes / (double)(bench_now_ns() - t0);
	if (fd >= 0)
		close(fd);
	unlink(path);
	free(buf);
	return gbps;
}

int bench_checkpoint_run(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "dir", required_argument, NULL, 'd' }, { "mb", required_argument, NULL, 'm' },
		{ "ranks", required_argument, NULL, 'r' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *dir = "/tmp/embd-bench-checkpoint";
	uint64_t mb = 1024;
	uint32_t ranks = 2;
	int opt;

	while ((opt = getopt_long(argc, argv, "d:m:r:h", opts, NULL)) != -1) {
		switch (opt) {
		case 'd': dir = optarg; break;
		case 'm': mb = strtoull(optarg, NULL, 10); break;
		case 'r': ranks = (uint32_t)atoi(optarg); break;
		default:
			fprintf(stderr, "usage: embd-bench checkpoint [--dir DIR] [--mb MB of weights] "
				"[--ranks N]\n");
			return 2;
		}
	}
	if (!mb || !ranks || ranks > 16)
		return 2;
	struct ck_bench *b = calloc(1, sizeof(*b));
	embd_log_set_level(EMBD_LOG_WARNING);
	if (mkdir(dir, 0755) && errno != EEXIST) {
		fprintf(stderr, "embd-bench checkpoint: %s: %s\n", dir, strerror(errno));
		return 1;
	}
	if (!b || setup(b, mb << 20, ranks, dir))
		return 1;
	struct round r[CK_ROUNDS];
	double disk[CK_ROUNDS], wg[CK_ROUNDS], st[CK_ROUNDS], wm[CK_ROUNDS], sb[CK_ROUNDS],
	       sd[CK_ROUNDS], max_stall = 0, max_step = 0;
	for (uint32_t i = 0; i < CK_ROUNDS; i++) {
		/* the reference first, on a quiet disk; the previous checkpoint is already removed */
		disk[i] = disk_round(dir, i ? r[i - 1].bytes : mb << 20);
		if (ckpt_round(b, &r[i]))
			return 1;
		if (disk[i] <= 0) {
			fprintf(stderr, "embd-bench checkpoint: the reference write to %s failed: %s\n",
				dir, strerror(errno));
			return 1;
		}
		wg[i] = r[i].write_gbps;
		st[i] = r[i].stall_ms;
		wm[i] = r[i].write_ms;
		sb[i] = r[i].step_before_ms;
		sd[i] = r[i].step_during_ms;
		max_stall = r[i].stall_ms > max_stall ? r[i].stall_ms : max_stall;
		max_step = r[i].step_max_ms > max_step ? r[i].step_max_ms : max_step;
	}
	double write_gbps = bench_median(wg, CK_ROUNDS), disk_gbps = bench_median(disk, CK_ROUNDS);
	double write_ms = bench_median(wm, CK_ROUNDS);
	printf("{\"name\":\"checkpoint\",\"bytes\":%" PRIu64 ",\"write_gbps\":%.3f,\"disk_gbps\":%.3f,"
	       "\"ratio_to_disk\":%.3f,\"max_step_stall_ms\":%.2f,\"median_stall_ms\":%.2f,"
	       "\"write_ms\":%.1f,\"stall_fraction\":%.4f,\"step_ms_before\":%.3f,"
	       "\"step_ms_during_write\":%.3f,\"max_step_ms_during_write\":%.3f,"
	       "\"steps_during_write\":%" PRIu64 ",\"ranks\":%u,\"rounds\":%d,\"dir\":\"%s\"}\n",
	       r[CK_ROUNDS - 1].bytes, write_gbps, disk_gbps, write_gbps / disk_gbps, max_stall,
	       bench_median(st, CK_ROUNDS), write_ms, max_stall / write_ms, bench_median(sb, CK_ROUNDS),
	       bench_median(sd, CK_ROUNDS), max_step, r[CK_ROUNDS - 1].steps_during, ranks, CK_ROUNDS,
	       dir);
	teardown(b);
	free(b);
	return 0;
}
