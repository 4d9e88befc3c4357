/*
 * The planner end to end: coverage and non-overlap of shards (checked here cell by cell,
 * independently of embd_plan_check), caps, constraints, determinism, JSON round trip,
 * infeasibility messages, node-aware placement, parse errors and topology suffixes.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "embd/plan.h"

static char err[1024];

static struct embd_tables parse(const char *json)
{
	struct embd_tables t;
	int rc = embd_plan_tables_parse_text(json, strlen(json), &t, err, sizeof(err));
	cr_assert_eq(rc, 0, "tables parse: expected 0, got %d (%s)", rc, err);
	return t;
}

/* n tables "t<i>" of rows x dim, each with one feature, as a tables array. */
static struct embd_tables uniform_tables(uint32_t n, int64_t rows, int32_t dim)
{
	struct embd_tables t = { n, calloc(n, sizeof(*t.specs)), calloc(n, sizeof(*t.constraints)) };
	for (uint32_t i = 0; i < n; i++) {
		struct embd_table_spec *s = &t.specs[i];
		snprintf(s->name, sizeof(s->name), "t%u", i);
		snprintf(s->feature_names[0], sizeof(s->feature_names[0]), "f%u", i);
		s->num_features = 1;
		s->num_embeddings = rows + i;   /* not all alike, so shard sizes differ */
		s->embedding_dim = dim;
	}
	return t;
}

static struct embd_plan *build(const struct embd_tables *t, const struct embd_topology *topo)
{
	struct embd_plan *plan;
	int rc = embd_plan_build(t->specs, t->constraints, t->count, topo, NULL, &plan, err,
				 sizeof(err));
	cr_assert_eq(rc, 0, "build: expected 0, got %d (%s)", rc, err);
	return plan;
}

/* Every cell of every table is covered exactly once (data_parallel: once per rank). */
static void expect_exact_cover(const struct embd_plan *plan, const struct embd_tables *t)
{
	for (uint32_t i = 0; i < plan->num_tables; i++) {
		const struct embd_plan_table *pt = &plan->tables[i];
		const struct embd_table_spec *s = &t->specs[i];
		cr_assert_str_eq(pt->name, s->name);
		size_t cells = (size_t)s->num_embeddings * s->embedding_dim;
		unsigned char *hits = calloc(cells, 1);
		for (uint32_t k = 0; k < pt->num_shards; k++) {
			const struct embd_plan_shard *sh = &pt->shards[k];
			cr_assert(sh->rank >= 0 && sh->rank < plan->topology.world_size,
				  "table %s shard %u: rank %d out of range", pt->name, k, sh->rank);
			for (int64_t r = sh->row_offset; r < sh->row_offset + sh->rows; r++)
				for (int32_t c = sh->col_offset; c < sh->col_offset + sh->cols; c++)
					hits[r * s->embedding_dim + c]++;
		}
		unsigned want = pt->sharding_type == EMBD_SHARD_DATA_PARALLEL ?
					(unsigned)plan->topology.world_size : 1;
		for (size_t c = 0; c < cells; c++)
			cr_assert_eq(hits[c], want, "table %s (%s) cell %zu: covered %u times, expected %u",
				     pt->name, embd_plan_sharding_name(pt->sharding_type), c, hits[c],
				     want);
		free(hits);
	}
}

Test(planner, covers_every_cell_once)
{
	struct embd_tables t = uniform_tables(40, 300, 256);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 8);
	topo.local_world_size = 4;
	/* push the planner to split tables: force a variety of sharding types */
	const enum embd_sharding_type forced[] = { EMBD_SHARD_ROW_WISE, EMBD_SHARD_COLUMN_WISE,
						   EMBD_SHARD_TABLE_ROW_WISE,
						   EMBD_SHARD_TABLE_COLUMN_WISE,
						   EMBD_SHARD_DATA_PARALLEL };
	for (uint32_t i = 0; i < 5; i++)
		t.constraints[i].sharding_types = 1u << forced[i];
	struct embd_plan *plan = build(&t, &topo);
	expect_exact_cover(plan, &t);
	for (uint32_t i = 0; i < 5; i++)
		cr_expect_eq(plan->tables[i].sharding_type, forced[i],
			     "table %u: expected %s, got %s", i, embd_plan_sharding_name(forced[i]),
			     embd_plan_sharding_name(plan->tables[i].sharding_type));
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
}

Test(planner, caps_respected_and_balanced)
{
	/* 64 tables of 4 MiB on 4 ranks with 100 MiB each: fits only when spread */
	struct embd_tables t = uniform_tables(64, 8192, 128);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 4);
	topo.hbm_cap_bytes = 100ull << 20;
	struct embd_plan *plan = build(&t, &topo);
	uint64_t budget = (uint64_t)(0.85 * (double)topo.hbm_cap_bytes);
	for (int r = 0; r < 4; r++)
		cr_expect(plan->ranks[r].hbm_bytes <= budget, "rank %d: %llu bytes over %llu", r,
			  (unsigned long long)plan->ranks[r].hbm_bytes, (unsigned long long)budget);
	double imbalance = embd_plan_imbalance(plan);
	/* the local search evens out what greedy placement leaves on the last rank */
	cr_expect(imbalance < 1.002, "64 near-equal tables on 4 ranks: imbalance %.4f, expected "
		  "< 1.002", imbalance);
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
}

Test(planner, constraints_honoured)
{
	struct embd_tables t = parse(
		"[{\"name\": \"a\", \"num_embeddings\": 1000, \"embedding_dim\": 64,"
		"  \"constraints\": {\"sharding_types\": [\"row_wise\"]}},"
		" {\"name\": \"b\", \"num_embeddings\": 1000, \"embedding_dim\": 64,"
		"  \"constraints\": {\"compute_kernels\": [\"fused_uvm\"]}},"
		" {\"name\": \"c\", \"num_embeddings\": 1000, \"embedding_dim\": 256,"
		"  \"constraints\": {\"sharding_types\": [\"column_wise\"], \"min_partition\": 64}}]");
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 4);
	struct embd_plan *plan = build(&t, &topo);
	cr_expect_eq(plan->tables[0].sharding_type, EMBD_SHARD_ROW_WISE);
	cr_expect_eq(plan->tables[0].num_shards, 4u, "row_wise on 4 ranks: expected 4 shards, got %u",
		     plan->tables[0].num_shards);
	cr_expect_eq(plan->tables[1].compute_kernel, EMBD_KERNEL_FUSED_UVM);
	cr_expect_eq(plan->tables[2].sharding_type, EMBD_SHARD_COLUMN_WISE);
	for (uint32_t i = 0; i < plan->tables[2].num_shards; i++)
		cr_expect(plan->tables[2].shards[i].cols >= 64, "column shard %u has %d cols < 64", i,
			  plan->tables[2].shards[i].cols);
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
}

static char *plan_json(struct embd_plan *plan)
{
	char *json;
	size_t len;
	cr_assert_eq(embd_plan_write_json(plan, &json, &len), 0);
	cr_assert_eq(strlen(json), len);
	return json;
}

Test(planner, deterministic_and_round_trips)
{
	struct embd_tables t = uniform_tables(200, 5000, 64);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 16);
	topo.local_world_size = 8;
	struct embd_plan *a = build(&t, &topo), *b = build(&t, &topo), *c;
	char *ja = plan_json(a), *jb = plan_json(b);
	cr_expect_str_eq(ja, jb, "two builds of the same input differ");
	cr_expect_eq(a->plan_hash, b->plan_hash);

	cr_assert_eq(embd_plan_parse_json(ja, strlen(ja), &c, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_plan_check(c, t.specs, t.constraints, t.count, err, sizeof(err)), 0, "%s",
		     err);
	char *jc = plan_json(c);
	cr_expect_str_eq(jc, ja, "parse + check + write changed the plan");
	cr_expect_eq(c->max_rank_time_ms, a->max_rank_time_ms);
	free(ja);
	free(jb);
	free(jc);
	embd_plan_destroy(a);
	embd_plan_destroy(b);
	embd_plan_destroy(c);
	embd_plan_tables_free(&t);
}

Test(planner, check_rejects_bad_plans)
{
	struct embd_tables t = uniform_tables(4, 1000, 64);
	t.constraints[0].sharding_types = 1u << EMBD_SHARD_ROW_WISE;
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 4);
	struct embd_plan *plan = build(&t, &topo);

	plan->tables[0].shards[1].row_offset += 1;     /* a gap and an overlap */
	int rc = embd_plan_check(plan, t.specs, t.constraints, t.count, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EINVAL, "overlapping shards: expected EINVAL, got %d", rc);
	cr_expect(strstr(err, "'t0'") != NULL, "error should name t0: %s", err);
	plan->tables[0].shards[1].row_offset -= 1;

	plan->tables[1].shards[0].rank = 9;
	rc = embd_plan_check(plan, t.specs, t.constraints, t.count, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EINVAL, "rank 9 of 4: expected EINVAL, got %d", rc);
	cr_expect(strstr(err, "rank 9") != NULL, "error should name rank 9: %s", err);
	plan->tables[1].shards[0].rank = 0;

	plan->topology.hbm_cap_bytes = 1 << 20;
	rc = embd_plan_check(plan, t.specs, t.constraints, t.count, err, sizeof(err));
	cr_expect_eq(rc, EMBD_ENOSPC, "1 MiB ranks: expected ENOSPC, got %d (%s)", rc, err);
	cr_expect(strstr(err, "short by") != NULL, "error should state the shortfall: %s", err);
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
}

Test(planner, infeasible_names_tables_and_shortfall)
{
	struct embd_tables t = parse(
		"[{\"name\": \"small\", \"num_embeddings\": 100, \"embedding_dim\": 16},"
		" {\"name\": \"huge\", \"num_embeddings\": 100000000, \"embedding_dim\": 128,"
		"  \"constraints\": {\"sharding_types\": [\"table_wise\"], "
		"                    \"compute_kernels\": [\"fused\"]}}]");
	struct embd_topology topo;
	struct embd_plan *plan;
	embd_plan_topology_default(&topo, 2);
	topo.hbm_cap_bytes = 1ull << 30;
	int rc = embd_plan_build(t.specs, t.constraints, t.count, &topo, NULL, &plan, err,
				 sizeof(err));
	cr_expect_eq(rc, EMBD_EINFEASIBLE, "expected EINFEASIBLE, got %d", rc);
	cr_expect(strstr(err, "'huge'") && strstr(err, "short by"), "message: %s", err);
	cr_expect(strstr(err, "'small'") == NULL, "small fits, must not be named: %s", err);
	cr_expect_null(plan);

	/* together too big: 8 tables of ~400 MiB in HBM on 2 ranks of 1 GiB */
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
	t = uniform_tables(8, 800000, 128);
	for (uint32_t i = 0; i < t.count; i++)
		t.constraints[i].compute_kernels = 1u << EMBD_KERNEL_FUSED;
	rc = embd_plan_build(t.specs, t.constraints, t.count, &topo, NULL, &plan, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EINFEASIBLE, "expected EINFEASIBLE, got %d", rc);
	cr_expect(strstr(err, "short by") != NULL, "message: %s", err);
	embd_plan_tables_free(&t);

	/* contradictory constraints */
	t = parse("[{\"name\": \"dp\", \"num_embeddings\": 100, \"embedding_dim\": 16,"
		  "  \"constraints\": {\"sharding_types\": [\"data_parallel\"],"
		  "                    \"compute_kernels\": [\"fused\"]}}]");
	rc = embd_plan_build(t.specs, t.constraints, t.count, &topo, NULL, &plan, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EINFEASIBLE, "expected EINFEASIBLE, got %d", rc);
	cr_expect(strstr(err, "'dp'") && strstr(err, "constraints"), "message: %s", err);
	embd_plan_tables_free(&t);
}

Test(planner, node_aware_placement)
{
	struct embd_tables t = uniform_tables(12, 4000, 512);
	for (uint32_t i = 0; i < 12; i++)
		t.constraints[i].sharding_types = 1u << (i % 2 ? EMBD_SHARD_TABLE_ROW_WISE :
								 EMBD_SHARD_TABLE_COLUMN_WISE);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 16);
	topo.local_world_size = 4;
	struct embd_plan *plan = build(&t, &topo);
	int used_nodes = 0;
	for (uint32_t i = 0; i < plan->num_tables; i++) {
		const struct embd_plan_table *pt = &plan->tables[i];
		int node = pt->shards[0].rank / 4;
		used_nodes |= 1 << node;
		cr_expect(pt->num_shards > 1, "table %s: expected a split, got 1 shard", pt->name);
		for (uint32_t k = 0; k < pt->num_shards; k++)
			cr_expect_eq(pt->shards[k].rank / 4, node, "table %s shard %u on node %d, shard 0 "
				     "on node %d", pt->name, k, pt->shards[k].rank / 4, node);
	}
	cr_expect_eq(used_nodes, 0xf, "12 node-placed tables should use all 4 nodes, mask 0x%x",
		     used_nodes);
	expect_exact_cover(plan, &t);
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
}

Test(planner, parse_errors_name_field_and_position)
{
	struct embd_tables t;
	const char *bad_field = "[{\"name\": \"ok\", \"num_embeddings\": 10, \"embedding_dim\": 4},\n"
				" {\"name\": \"t1\", \"num_embeddings\": -3, \"embedding_dim\": 4}]";
	cr_expect_eq(embd_plan_tables_parse_text(bad_field, strlen(bad_field), &t, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "table 1") && strstr(err, "'t1'") && strstr(err, "num_embeddings"),
		  "message: %s", err);

	const char *syntax = "[{\"name\": \"a\",\n \"num_embeddings\": 10,, }]";
	cr_expect_eq(embd_plan_tables_parse_text(syntax, strlen(syntax), &t, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "line 2") != NULL, "syntax error should name line 2: %s", err);

	const char *typo = "[{\"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4,"
			   " \"constraints\": {\"sharding_type\": [\"row_wise\"]}}]";
	cr_expect_eq(embd_plan_tables_parse_text(typo, strlen(typo), &t, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "sharding_type") != NULL, "message: %s", err);

	const char *dup = "[{\"name\": \"a\", \"num_embeddings\": 1, \"embedding_dim\": 4},"
			  " {\"name\": \"a\", \"num_embeddings\": 1, \"embedding_dim\": 4}]";
	cr_expect_eq(embd_plan_tables_parse_text(dup, strlen(dup), &t, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "'a'") != NULL, "message: %s", err);

	/* a feature in two tables, or twice in one: every trainer's WELCOME would fail */
	const char *two_tables = "[{\"name\": \"a\", \"num_embeddings\": 1, \"embedding_dim\": 4,"
				 " \"feature_names\": [\"f\", \"g\"]},"
				 " {\"name\": \"b\", \"num_embeddings\": 1, \"embedding_dim\": 4},"
				 " {\"name\": \"c\", \"num_embeddings\": 1, \"embedding_dim\": 4,"
				 " \"feature_names\": [\"g\"]}]";
	cr_expect_eq(embd_plan_tables_parse_text(two_tables, strlen(two_tables), &t, err,
						 sizeof(err)), EMBD_EPARSE);
	cr_expect(strstr(err, "'g'") && strstr(err, "table 0 ('a')") && strstr(err, "table 2 ('c')"),
		  "a feature in two tables should name it and both tables: %s", err);
	const char *twice = "[{\"name\": \"a\", \"num_embeddings\": 1, \"embedding_dim\": 4,"
			    " \"feature_names\": [\"f\", \"f\"]}]";
	cr_expect_eq(embd_plan_tables_parse_text(twice, strlen(twice), &t, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "'f'") && strstr(err, "twice") && strstr(err, "'a'"), "message: %s",
		  err);
	/* a table's default feature is its own name */
	const char *by_default = "[{\"name\": \"a\", \"num_embeddings\": 1, \"embedding_dim\": 4},"
				 " {\"name\": \"b\", \"num_embeddings\": 1, \"embedding_dim\": 4,"
				 " \"feature_names\": [\"a\"]}]";
	cr_expect_eq(embd_plan_tables_parse_text(by_default, strlen(by_default), &t, err,
						 sizeof(err)), EMBD_EPARSE);
	cr_expect(strstr(err, "'a'") && strstr(err, "table 1 ('b')"), "message: %s", err);

	struct embd_plan *plan;
	const char *bad_plan = "{\"version\": 1, \"topology\": {\"world_size\": 2},"
			       " \"tables\": [{\"name\": \"a\", \"sharding_type\": \"table_wise\","
			       " \"compute_kernel\": \"fused\", \"shards\": [{\"rank\": 0,"
			       " \"row_offset\": 0, \"rows\": 1.5, \"col_offset\": 0, \"cols\": 4}]}]}";
	cr_expect_eq(embd_plan_parse_json(bad_plan, strlen(bad_plan), &plan, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "tables[0]") && strstr(err, "shards[0]") && strstr(err, "rows"),
		  "message: %s", err);
}

/* Every optimizer hyperparameter has its real range, checked also in fp32 (what the kernels
 * compute with): beta 1 would make adam's bias correction 0 and the rows NaN after a step. */
Test(planner, optimizer_hyperparameters_in_range)
{
	static const struct { const char *opt, *needle; } bad[] = {
		{ "\"type\": \"adam\", \"beta1\": 1", "'optimizer.beta1' = 1 is outside [0, 1)" },
		{ "\"type\": \"adam\", \"beta2\": 1.5", "optimizer.beta2" },
		{ "\"type\": \"adam\", \"beta2\": 0.999999999", "in fp32" },
		{ "\"type\": \"adam\", \"beta1\": -0.1", "optimizer.beta1" },
		{ "\"type\": \"adagrad\", \"eps\": 0", "'optimizer.eps' = 0 is outside (0, 1e+06]" },
		{ "\"type\": \"adagrad\", \"eps\": 1e-50", "in fp32" },
		{ "\"type\": \"sgd\", \"lr\": 0", "optimizer.lr" },
		{ "\"type\": \"sgd\", \"lr\": -0.01", "optimizer.lr" },
		{ "\"type\": \"sgd\", \"weight_decay\": -0.001", "optimizer.weight_decay" },
		{ "\"type\": \"sgd\", \"lr\": \"0.1\"", "must be a number" },
	};
	char text[512];
	struct embd_tables t;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		snprintf(text, sizeof(text), "[{\"name\": \"a\", \"num_embeddings\": 1, "
			 "\"embedding_dim\": 4, \"optimizer\": {%s}}]", bad[i].opt);
		int rc = embd_plan_tables_parse_text(text, strlen(text), &t, err, sizeof(err));
		cr_expect_eq(rc, EMBD_EPARSE, "{%s}: expected EMBD_EPARSE, got %d", bad[i].opt, rc);
		cr_expect(strstr(err, bad[i].needle) && strstr(err, "'a'"),
			  "{%s}: expected the error to say '%s', got '%s'", bad[i].opt, bad[i].needle,
			  err);
		if (!rc)
			embd_plan_tables_free(&t);
	}
	/* the closed ends are in */
	t = parse("[{\"name\": \"a\", \"num_embeddings\": 1, \"embedding_dim\": 4, \"optimizer\": "
		  "{\"type\": \"adam\", \"lr\": 1e6, \"eps\": 1e-30, \"beta1\": 0, \"beta2\": 0.9999, "
		  "\"weight_decay\": 0}}]");
	cr_expect_eq(t.specs[0].optimizer.beta1, 0.0f);
	cr_expect_eq(t.specs[0].optimizer.beta2, 0.9999f);
	cr_expect_eq(t.specs[0].optimizer.lr, 1e6f);
	embd_plan_tables_free(&t);
}

/* One JSON value per file: text after it (a second object pasted below, a stray brace) is
 * refused naming the line and byte where it starts, in every file the planner reads. */
Test(planner, text_after_the_json_value_refused)
{
	const char *tables = "[{\"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4}]\n"
			     "[{\"name\": \"b\"}]\n";
	struct embd_tables t;
	cr_expect_eq(embd_plan_tables_parse_text(tables, strlen(tables), &t, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "after the JSON value") && strstr(err, "line 2"), "message: %s", err);
	/* whitespace after it is fine */
	const char *spaced = "[{\"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4}]\n\t \r\n";
	t = parse(spaced);
	embd_plan_tables_free(&t);
	/* a NUL inside the text is not its end */
	const char nul[] = "[{\"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4}]\0}";
	cr_expect_eq(embd_plan_tables_parse_text(nul, sizeof(nul) - 1, &t, err, sizeof(err)),
		     EMBD_EPARSE, "a NUL and a brace after the array: %s", err);

	struct embd_plan *plan;
	const char *plan_text = "{\"version\": 1} }";
	cr_expect_eq(embd_plan_parse_json(plan_text, strlen(plan_text), &plan, err, sizeof(err)),
		     EMBD_EPARSE);
	cr_expect(strstr(err, "plan") && strstr(err, "byte 15"), "message: %s", err);

	char path[] = "/tmp/embd_test_topology_XXXXXX";
	int fd = mkstemp(path);
	cr_assert_geq(fd, 0);
	const char *topo_text = "{\"world_size\": 2}\n{\"world_size\": 4}\n";
	cr_assert_eq(write(fd, topo_text, strlen(topo_text)), (ssize_t)strlen(topo_text));
	close(fd);
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 1);
	int rc = embd_plan_topology_load(path, &topo, err, sizeof(err));
	unlink(path);
	cr_expect_eq(rc, EMBD_EPARSE, "topology with a second object: expected EMBD_EPARSE, got %d",
		     rc);
	cr_expect(strstr(err, path) && strstr(err, "after the JSON value"), "message: %s", err);
}

/* {"tables": [...]} is the array itself; any other key in it is refused, never dropped. */
Test(planner, tables_object_form)
{
	const char *array = "[{\"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4}]";
	char object[256];
	snprintf(object, sizeof(object), "{\"tables\": %s}", array);
	struct embd_tables t1 = parse(array), t2 = parse(object);
	cr_assert_eq(t2.count, 1);
	cr_expect_eq(embd_plan_tables_hash(t1.specs, t1.count), embd_plan_tables_hash(t2.specs, t2.count),
		     "the object form should parse to the same tables as the array");
	embd_plan_tables_free(&t1);
	embd_plan_tables_free(&t2);

	struct embd_tables t;
	const char *bad[][2] = {
		{ "{\"tables\": [{\"name\": \"a\", \"num_embeddings\": 10, \"embedding_dim\": 4}],"
		  " \"topology\": {\"world_size\": 2}}", "'topology'" },
		{ "{\"tables\": [], \"tables\": []}", "twice" },
		{ "{}", "no key" },
		{ "{\"tables\": {\"name\": \"a\"}}", "array" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = embd_plan_tables_parse_text(bad[i][0], strlen(bad[i][0]), &t, err, sizeof(err));
		cr_expect_eq(rc, EMBD_EPARSE, "%s: expected EMBD_EPARSE, got %d", bad[i][0], rc);
		cr_expect(strstr(err, bad[i][1]) != NULL, "%s: expected the message to say %s: %s",
			  bad[i][0], bad[i][1], err);
		cr_expect_eq(t.count, 0);
	}
}

Test(planner, topology_fields_and_suffixes)
{
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 1);
	cr_assert_eq(embd_plan_topology_set(&topo, "hbm_cap", "16G", err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(topo.hbm_cap_bytes, 16ull << 30);
	cr_assert_eq(embd_plan_topology_set(&topo, "ddr_cap", "512MB", err, sizeof(err)), 0);
	cr_expect_eq(topo.ddr_cap_bytes, 512ull << 20);
	cr_assert_eq(embd_plan_topology_set(&topo, "inter_host_bw", "25GB/s", err, sizeof(err)), 0);
	cr_expect_float_eq(topo.inter_host_bw_bytes_per_ms, 25.0 * (1 << 30) / 1000, 1e-3);
	cr_assert_eq(embd_plan_topology_set(&topo, "compute_device", "cpu", err, sizeof(err)), 0);
	cr_expect_eq(topo.compute_device, EMBD_DEVICE_CPU);
	cr_expect_eq(embd_plan_topology_set(&topo, "hbm_cap", "16Q", err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "hbm_cap") != NULL, "message: %s", err);
	cr_expect_eq(embd_plan_topology_set(&topo, "hbm_capp", "1", err, sizeof(err)), EMBD_EINVAL);

	const char *json = "{\"world_size\": 8, \"local_world_size\": 3}";
	struct embd_plan *plan;
	char text[256];
	snprintf(text, sizeof(text), "{\"version\": 1, \"topology\": %s, \"tables\": []}", json);
	cr_expect_eq(embd_plan_parse_json(text, strlen(text), &plan, err, sizeof(err)), EMBD_EPARSE);
	cr_expect(strstr(err, "local_world_size") != NULL, "8 ranks, 3 per node: %s", err);
}

Test(planner, cpu_offers_row_wise)
{
	/* one huge-traffic table on 4 cpu ranks: row_wise spreads it, TorchRec could not */
	struct embd_tables t = parse(
		"[{\"name\": \"big\", \"num_embeddings\": 4000000, \"embedding_dim\": 128,"
		"  \"constraints\": {\"pooling_factors\": [50]}},"
		" {\"name\": \"s0\", \"num_embeddings\": 1000, \"embedding_dim\": 128}]");
	struct embd_topology topo;
	embd_plan_topology_default(&topo, 4);
	topo.compute_device = EMBD_DEVICE_CPU;
	topo.hbm_cap_bytes = 4ull << 30;
	struct embd_plan *plan = build(&t, &topo);
	enum embd_sharding_type st = plan->tables[0].sharding_type;
	cr_expect(st == EMBD_SHARD_ROW_WISE || st == EMBD_SHARD_TABLE_ROW_WISE ||
		  st == EMBD_SHARD_COLUMN_WISE || st == EMBD_SHARD_TABLE_COLUMN_WISE,
		  "the heavy table should be split, got %s", embd_plan_sharding_name(st));
	expect_exact_cover(plan, &t);
	embd_plan_destroy(plan);
	embd_plan_tables_free(&t);
}
