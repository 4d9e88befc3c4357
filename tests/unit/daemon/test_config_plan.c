/*
 * The plan a config makes (daemon/config_plan.h), which embd and `embctl plan --config` share:
 * without plan_file it is the planner's plan for the config's tables and topology; a plan_file
 * is loaded when it fits the config and refused, naming the difference, when it was built for
 * another topology or other tables.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/config_plan.h"

static struct embd_config config;
static char err[1024];
static char path[64];

static void setup(void)
{
	const char *text = embd_config_default_text();
	cr_assert_eq(embd_config_parse(text, strlen(text), &config, err, sizeof(err)), 0, "%s", err);
	snprintf(path, sizeof(path), "/tmp/embd-config-plan-%d.json", (int)getpid());
}

static void teardown(void)
{
	embd_config_free(&config);
	unlink(path);
}

static uint64_t hash_of(struct embd_plan *plan)
{
	uint64_t h = 0;
	cr_assert_eq(embd_plan_hash(plan, &h), 0);
	return h;
}

/* Writes the planner's plan for tables and topo to path and returns its hash. */
static uint64_t write_plan(const struct embd_tables *t, const struct embd_topology *topo)
{
	struct embd_plan *plan = NULL;
	char *json = NULL;
	size_t len = 0;

	cr_assert_eq(embd_plan_build(t->specs, t->constraints, t->count, topo, NULL, &plan, err,
				     sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_plan_write_json(plan, &json, &len), 0);
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	cr_assert_eq(fwrite(json, 1, len, f), len);
	fclose(f);
	free(json);
	uint64_t h = hash_of(plan);
	embd_plan_destroy(plan);
	return h;
}

TestSuite(config_plan, .init = setup, .fini = teardown);

Test(config_plan, plans_the_config_tables_and_topology)
{
	struct embd_plan *want = NULL, *got = NULL;
	const struct embd_tables *t = &config.tables;

	cr_assert_eq(embd_plan_build(t->specs, t->constraints, t->count, &config.topology, NULL,
				     &want, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_config_plan(&config, &got, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(got->topology.local_world_size, 2);
	cr_expect_eq(hash_of(got), hash_of(want), "expected the planner's plan for the config");
	embd_plan_destroy(want);
	embd_plan_destroy(got);
}

Test(config_plan, loads_a_plan_file_that_fits)
{
	struct embd_plan *got = NULL;

	uint64_t h = write_plan(&config.tables, &config.topology);
	snprintf(config.plan_file, sizeof(config.plan_file), "%s", path);
	cr_assert_eq(embd_config_plan(&config, &got, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(hash_of(got), h, "expected the plan of plan_file");
	embd_plan_destroy(got);
}

Test(config_plan, refuses_a_plan_file_for_another_topology)
{
	struct embd_plan *got = (struct embd_plan *)&got;
	struct embd_topology one = config.topology;

	one.world_size = one.local_world_size = 1;
	write_plan(&config.tables, &one);
	snprintf(config.plan_file, sizeof(config.plan_file), "%s", path);
	int rc = embd_config_plan(&config, &got, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EMISMATCH, "expected EMBD_EMISMATCH, got %d (%s)", rc, err);
	cr_expect(strstr(err, "plan_file") && strstr(err, "world_size 1"), "message: %s", err);
	cr_expect_null(got);
}

Test(config_plan, refuses_a_plan_file_for_other_tables)
{
	struct embd_plan *got = NULL;
	struct embd_tables fewer = config.tables;

	fewer.count--;          /* without query_terms */
	write_plan(&fewer, &config.topology);
	snprintf(config.plan_file, sizeof(config.plan_file), "%s", path);
	int rc = embd_config_plan(&config, &got, err, sizeof(err));
	cr_expect_neq(rc, 0, "a plan without query_terms should be refused");
	cr_expect(strstr(err, "3 tables") != NULL, "the message should count the tables: %s", err);
	cr_expect_null(got);
}

Test(config_plan, missing_plan_file_names_it)
{
	struct embd_plan *got = NULL;

	snprintf(config.plan_file, sizeof(config.plan_file), "%s", path);
	int rc = embd_config_plan(&config, &got, err, sizeof(err));
	cr_expect_neq(rc, 0);
	cr_expect(strstr(err, path) != NULL, "the message should name %s: %s", path, err);
	cr_expect_null(got);
}
