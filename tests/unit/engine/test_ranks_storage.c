/*
 * The planner's storage estimate against what the ranks allocate for the same plan: every
 * data type, optimizer and sharding type, and fused_uvm_caching's cache. A rank's estimate is
 * its shards' weights and optimizer state (HBM or DDR) plus TorchRec's IO buffers per shard;
 * the ranks allocate the first exactly, the step engine the IO buffers (sized by the batch,
 * not per shard), so the test takes the IO estimate out by its formula.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/plan.h"
#include "engine/ranks.h"
#include "engine/step.h"

#define RANKS 2
#define ROWS 1024
#define DIM 64

/* TorchRec's IO estimate of one shard `cols` wide at batch size 1 and pooling factor 1
 * (planner/estimate.c): its ids, 8 bytes each, and pooled rows, every rank's, except that a
 * data_parallel shard counts its own batch and a row_wise shard a share of the ids. */
static uint64_t io_bytes(const char *sharding, uint32_t cols, uint32_t dtype_bytes)
{
	if (!strcmp(sharding, "data_parallel"))
		return 8 + (uint64_t)cols * dtype_bytes;
	uint64_t ids = !strcmp(sharding, "row_wise") ? 8 : RANKS * 8;
	return ids + (uint64_t)RANKS * cols * dtype_bytes;
}

struct storage_case {
	const char *dtype, *optimizer, *sharding, *kernel;
};

static void plan_and_allocate(const struct storage_case *c)
{
	char text[1024], err[512] = "", what[160];
	struct embd_tables tables;
	struct embd_topology topo;
	struct embd_plan *plan = NULL;
	struct embd_ranks *ranks = NULL;
	struct embd_step *step = NULL;
	const bool caching = !strcmp(c->kernel, "fused_uvm_caching");

	snprintf(what, sizeof(what), "%s %s %s %s", c->dtype, c->optimizer, c->sharding,
		 c->kernel);
	snprintf(text, sizeof(text),
		 "[ { \"name\": \"t\", \"num_embeddings\": %d, \"embedding_dim\": %d,"
		 " \"data_type\": \"%s\", \"optimizer\": { \"type\": \"%s\", \"lr\": 0.1 },"
		 " \"constraints\": { \"sharding_types\": [\"%s\"], \"compute_kernels\": [\"%s\"],"
		 " \"min_partition\": %d } } ]",
		 ROWS, DIM, c->dtype, c->optimizer, c->sharding, c->kernel, DIM / 2);
	cr_assert_eq(embd_plan_tables_parse_text(text, strlen(text), &tables, err, sizeof(err)), 0,
		     "%s: %s", what, err);
	embd_plan_topology_default(&topo, RANKS);
	/* the cache is a GPU kernel: planned for cuda, run by the CPU ranks' test cache */
	topo.compute_device = caching ? EMBD_DEVICE_CUDA : EMBD_DEVICE_CPU;
	topo.batch_size = 1;
	cr_assert_eq(embd_plan_build(tables.specs, tables.constraints, tables.count, &topo, NULL,
				     &plan, err, sizeof(err)), 0, "%s: %s", what, err);
	cr_assert_str_eq(embd_plan_kernel_name(plan->tables[0].compute_kernel), c->kernel, "%s",
			 what);
	if (caching)
		setenv("EMBD_TEST_CPU_KERNEL", "fused_uvm_caching", 1);
	cr_assert_eq(embd_ranks_create(RANKS, 1, &ranks, err, sizeof(err)), 0, "%s", err);
	unsetenv("EMBD_TEST_CPU_KERNEL");
	cr_assert_eq(embd_step_create(&tables, plan, ranks, 1, 1, &step, err, sizeof(err)), 0,
		     "%s: %s", what, err);

	const uint32_t dtype_bytes = strcmp(c->dtype, "fp16") ? 4 : 2;
	for (uint32_t r = 0; r < RANKS; r++) {
		uint64_t io = 0;
		for (uint32_t k = 0; k < plan->tables[0].num_shards; k++)
			if (plan->tables[0].shards[k].rank == (int32_t)r)
				io += io_bytes(c->sharding, (uint32_t)plan->tables[0].shards[k].cols,
					       dtype_bytes);
		const uint64_t planned = plan->ranks[r].hbm_bytes + plan->ranks[r].ddr_bytes;
		const uint64_t allocated = embd_ranks_memory_bytes(ranks, r);
		if (!caching) {
			cr_expect_eq(planned, allocated + io, "%s rank %u: planned %llu bytes (%llu "
				     "of them IO buffers), the rank allocated %llu", what, r,
				     (unsigned long long)planned, (unsigned long long)io,
				     (unsigned long long)allocated);
			continue;
		}
		/* fused_uvm_caching: the plan counts TorchRec's cache metadata (4 + 16 x ratio
		 * bytes a row, in HBM), which embd keeps in host memory, and ceil(rows x ratio)
		 * cached rows, of which the cache keeps whole sets of 32 ways (up to 31 fewer) */
		const uint64_t state = !strcmp(c->optimizer, "adam") ? 2 * DIM * 4 :
				       !strcmp(c->optimizer, "adagrad") ? DIM * 4 :
				       !strcmp(c->optimizer, "rowwise_adagrad") ? 4 : 0;
		const uint64_t metadata = (uint64_t)(ROWS * (4 + 16 * topo.uvm_caching_ratio) + 1);
		const uint64_t sets_rounding = 32 * (DIM * 4 + state);
		cr_expect(allocated + io <= planned && planned - io - allocated <= metadata +
			  sets_rounding, "%s rank %u: planned %llu bytes (%llu of them IO buffers, "
			  "%llu cache metadata), the rank allocated %llu", what, r,
			  (unsigned long long)planned, (unsigned long long)io,
			  (unsigned long long)metadata, (unsigned long long)allocated);
	}
	embd_step_destroy(step);
	embd_ranks_destroy(ranks);
	embd_plan_destroy(plan);
	embd_plan_tables_free(&tables);
}

Test(ranks_storage, the_plan_counts_what_the_ranks_allocate)
{
	static const char *const dtypes[] = { "fp32", "fp16" };
	static const char *const optimizers[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };
	static const char *const shardings[] = { "table_wise", "column_wise", "row_wise",
						 "data_parallel" };

	for (size_t d = 0; d < 2; d++)
		for (size_t o = 0; o < 4; o++)
			for (size_t s = 0; s < 4; s++) {
				struct storage_case c = { dtypes[d], optimizers[o], shardings[s],
							  s == 3 ? "dense" : "fused" };
				plan_and_allocate(&c);
			}
}

Test(ranks_storage, fused_uvm_caching_counts_its_cache_and_host_rows)
{
	static const char *const optimizers[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };

	for (size_t o = 0; o < 4; o++) {
		struct storage_case c = { "fp32", optimizers[o], "table_wise", "fused_uvm_caching" };
		plan_and_allocate(&c);
	}
}
