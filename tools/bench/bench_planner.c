/*
 * `embd-bench planner`: times embd_plan_build on synthetic DLRM-like tables (row counts
 * log-uniform over 1e3..1e7, dims 16..256, pooling factors 1..40, seeded, so every run plans
 * the same tables) and prints one JSON line per configuration. The reference beside each
 * figure is the same run's greedy-only plan (only TorchRec's GreedyProposer proposal, through
 * the same partitioners): its plan time and its slowest rank. TorchRec itself is measured by
 * tools/bench/torchrec_planner.py. --emit-tables N writes the tables JSON instead,
 * so tools/bench/torchrec_planner.py can hand TorchRec exactly the same tables.
 */
#include "bench.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/plan.h"

/* xorshift64*: fixed sequence on every machine */
static uint64_t next_random(uint64_t *s)
{
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * 0x2545f4914f6cdd1dull;
}

static double uniform01(uint64_t *s)
{
	return (double)(next_random(s) >> 11) / 9007199254740992.0;
}

static struct embd_tables synthetic_tables(uint32_t n, uint64_t seed)
{
	static const int32_t dims[] = { 16, 32, 64, 128, 128, 256 };
	struct embd_tables t = { n, calloc(n, sizeof(*t.specs)), calloc(n, sizeof(*t.constraints)) };
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
	for (uint32_t i = 0; t.specs && t.constraints && i < n; i++) {
		struct embd_table_spec *spec = &t.specs[i];
		snprintf(spec->name, sizeof(spec->name), "table_%u", i);
		snprintf(spec->feature_names[0], sizeof(spec->feature_names[0]), "feature_%u", i);
		spec->num_features = 1;
		spec->num_embeddings = (int64_t)pow(10.0, 3.0 + 4.0 * uniform01(&s));
		spec->embedding_dim = dims[next_random(&s) % 6];
		spec->optimizer.type = EMBD_OPT_ROWWISE_ADAGRAD;
		spec->optimizer.lr = 0.01f;
		t.constraints[i].num_pooling_factors = 1;
		t.constraints[i].pooling_factors[0] = floor(1.0 + 39.0 * uniform01(&s));
	}
	return t;
}

static void emit_tables(const struct embd_tables *t, FILE *out)
{
	fprintf(out, "[\n");
	for (uint32_t i = 0; i < t->count; i++) {
		const struct embd_table_spec *s = &t->specs[i];
		fprintf(out, "  {\"name\": \"%s\", \"num_embeddings\": %lld, \"embedding_dim\": %d, "
			"\"feature_names\": [\"%s\"], \"optimizer\": {\"type\": \"rowwise_adagrad\", "
			"\"lr\": 0.01}, \"constraints\": {\"pooling_factors\": [%.1f]}}%s\n", s->name,
			(long long)s->num_embeddings, s->embedding_dim, s->feature_names[0],
			t->constraints[i].pooling_factors[0], i + 1 < t->count ? "," : "");
	}
	fprintf(out, "]\n");
}

/* Median plan time over `repeat` builds; *out keeps the last plan. */
static int timed_build(const struct embd_tables *t, const struct embd_topology *topo,
		       bool greedy_only, int repeat, double *plan_ms, struct embd_plan **out)
{
	struct embd_plan_options options = { .greedy_only = greedy_only };
	double ms[16];
	char err[1024];
	*out = NULL;
	for (int r = 0; r < repeat; r++) {
		embd_plan_destroy(*out);
		uint64_t t0 = bench_now_ns();
		int rc = embd_plan_build(t->specs, t->constraints, t->count, topo, &options, out, err,
					 sizeof(err));
		ms[r] = (double)(bench_now_ns() - t0) / 1e6;
		if (rc) {
			fprintf(stderr, "embd-bench planner: %s\n", err);
			return rc;
		}
	}
	*plan_ms = bench_median(ms, (size_t)repeat);
	return 0;
}

static int run_config(uint32_t tables, int32_t world, int32_t local, int repeat)
{
	struct embd_tables t = synthetic_tables(tables, tables);
	struct embd_topology topo;
	struct embd_plan *plan = NULL, *greedy = NULL;
	double plan_ms, greedy_ms;
	int status = 1;

	if (!t.specs || !t.constraints)
		goto out;
	embd_plan_topology_default(&topo, world);
	topo.local_world_size = local;
	if (timed_build(&t, &topo, false, repeat, &plan_ms, &plan) ||
	    timed_build(&t, &topo, true, repeat, &greedy_ms, &greedy))
		goto out;
	printf("{\"bench\": \"planner\", \"tables\": %u, \"world_size\": %d, \"local_world_size\": %d, "
	       "\"plan_ms\": %.3f, \"max_rank_time_ms\": %.6f, \"imbalance\": %.4f, "
	       "\"proposer\": \"%s\", \"partitioner\": \"%s\", "
	       "\"greedy_plan_ms\": %.3f, \"greedy_max_rank_time_ms\": %.6f, \"greedy_imbalance\": %.4f, "
	       "\"repeat\": %d}\n", tables, world, local, plan_ms, plan->max_rank_time_ms,
	       embd_plan_imbalance(plan), plan->proposer, plan->partitioner, greedy_ms,
	       greedy->max_rank_time_ms, embd_plan_imbalance(greedy), repeat);
	fflush(stdout);
	status = 0;
out:
	embd_plan_destroy(plan);
	embd_plan_destroy(greedy);
	embd_plan_tables_free(&t);
	return status;
}

int bench_planner_run(int argc, char **argv)
{
	static const struct { uint32_t tables; int32_t world, local; } standard[] = {
		{ 100, 8, 8 }, { 1000, 128, 8 }, { 10000, 1024, 8 },
	};
	const struct option longopts[] = {
		{ "tables", required_argument, NULL, 't' },
		{ "world-size", required_argument, NULL, 'w' },
		{ "local-world-size", required_argument, NULL, 'l' },
		{ "repeat", required_argument, NULL, 'r' },
		{ "emit-tables", required_argument, NULL, 'e' },
		{ NULL, 0, NULL, 0 },
	};
	long tables = 0, world = 0, local = 8, repeat = 3;
	int opt;
	while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (opt) {
		case 't': tables = strtol(optarg, NULL, 10); break;
		case 'w': world = strtol(optarg, NULL, 10); break;
		case 'l': local = strtol(optarg, NULL, 10); break;
		case 'r': repeat = strtol(optarg, NULL, 10); break;
		case 'e': {
			struct embd_tables t = synthetic_tables((uint32_t)strtol(optarg, NULL, 10),
								(uint64_t)strtol(optarg, NULL, 10));
			emit_tables(&t, stdout);
			embd_plan_tables_free(&t);
			return 0;
		}
		default:
			fprintf(stderr, "usage: embd-bench planner [--tables N --world-size W "
				"[--local-world-size L]] [--repeat R] | --emit-tables N\n");
			return 2;
		}
	}
	if (repeat < 1 || repeat > 16 || tables < 0 || world < 0 || local < 1) {
		fprintf(stderr, "embd-bench planner: --repeat is 1..16, sizes positive\n");
		return 2;
	}
	if (tables && world)
		return run_config((uint32_t)tables, (int32_t)world,
				  (int32_t)(local < world ? local : world), (int)repeat);
	for (size_t i = 0; i < sizeof(standard) / sizeof(standard[0]); i++)
		if (run_config(standard[i].tables, standard[i].world, standard[i].local,
			       standard[i].tables >= 10000 ? 1 : (int)repeat))
			return 1;
	return 0;
}
