/*
 * embctl's and embd's command lines against the real binaries: --version of both, `embctl
 * plan --config` printing the very plan a running embd made from the same file (its STATUS
 * plan_hash), a config's plan_file checked as the service checks it, and --tables files that
 * hold {"tables": [...]} instead of the bare array.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "service_fixture.h"

static char dir[64];
static char out[1 << 16];

static void setup(void)
{
	snprintf(dir, sizeof(dir), "/tmp/embd-embctl-%d", (int)getpid());
	cr_assert_eq(mkdir(dir, 0700), 0, "mkdir %s", dir);
}

static void teardown(void)
{
	service_stop_within(10000, NULL);
	unlink(service.log);
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(embctl, .init = setup, .fini = teardown);

/* Runs cmd through the shell with its stdout in out (stderr joined when join_stderr); returns
 * its exit status, or -1 when it did not exit normally. */
static int run(bool join_stderr, const char *fmt, ...)
{
	char cmd[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(cmd, sizeof(cmd), fmt, ap);
	va_end(ap);
	cr_assert(n > 0 && (size_t)n < sizeof(cmd) - 8);
	if (join_stderr)
		strcat(cmd, " 2>&1");
	FILE *p = popen(cmd, "r");
	cr_assert_not_null(p, "popen %s", cmd);
	size_t len = fread(out, 1, sizeof(out) - 1, p);
	out[len] = 0;
	int st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_file(const char *name, const char *text)
{
	char path[128];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f, "%s", path);
	fputs(text, f);
	fclose(f);
}

/* plan_hash of the JSON in out (a plan or a STATUS reply). */
static char *plan_hash_of_out(void)
{
	static char hash[2][17];
	static int which;
	cJSON *root = cJSON_Parse(out);
	cr_assert_not_null(root, "not JSON: %s", out);
	const cJSON *h = cJSON_GetObjectItemCaseSensitive(root, "plan_hash");
	cr_assert(cJSON_IsString(h) && strlen(h->valuestring) == 16, "no plan_hash in %s", out);
	which ^= 1;
	snprintf(hash[which], sizeof(hash[which]), "%s", h->valuestring);
	cJSON_Delete(root);
	return hash[which];
}

static const char tables[] =
	"[ { \"name\": \"ads\", \"num_embeddings\": 40000, \"embedding_dim\": 32,"
	"    \"feature_names\": [\"ad_id\"] },"
	"  { \"name\": \"pages\", \"num_embeddings\": 3000, \"embedding_dim\": 16, \"pooling\": \"mean\","
	"    \"feature_names\": [\"page\", \"referrer\"],"
	"    \"constraints\": { \"sharding_types\": [\"row_wise\"] } },"
	"  { \"name\": \"geo\", \"num_embeddings\": 200, \"embedding_dim\": 8 } ]";

/* A service config with the tables above on 3 CPU ranks, batch 96. */
static void write_config(const char *name, const char *plan_file)
{
	char text[4096];
	snprintf(text, sizeof(text),
		 "{ \"tables\": %s,\n"
		 "  \"topology\": { \"world_size\": 3, \"local_world_size\": 3,"
		 " \"compute_device\": \"cpu\", \"batch_size\": 96 },\n"
		 "  %s%s%s \"trainers_per_node\": 1 }\n",
		 tables, plan_file ? "\"plan_file\": \"" : "", plan_file ? plan_file : "",
		 plan_file ? "\"," : "");
	write_file(name, text);
}

Test(embctl, versions)
{
	char want[64];

	cr_assert_eq(run(false, "%s --version", EMBCTL_BINARY), 0);
	snprintf(want, sizeof(want), "embctl %s\n", EMBD_VERSION);
	cr_expect_str_eq(out, want);
	cr_assert_eq(run(false, "%s -V", EMBCTL_BINARY), 0);
	cr_expect_str_eq(out, want);
	cr_assert_eq(run(false, "%s --version", EMBD_BINARY), 0);
	snprintf(want, sizeof(want), "embd %s\n", EMBD_VERSION);
	cr_expect_str_eq(out, want);
	cr_expect_eq(run(true, "%s --version --config %s/missing.json", EMBD_BINARY, dir), 0,
		     "--version should not read the config: %s", out);
}

Test(embctl, plan_config_is_the_plan_embd_makes)
{
	char config[128], preview[17], served[17];

	write_config("embd.conf", NULL);
	snprintf(config, sizeof(config), "%s/embd.conf", dir);
	cr_assert_eq(run(true, "%s plan --config %s --json", EMBCTL_BINARY, config), 0, "%s", out);
	snprintf(preview, sizeof(preview), "%s", plan_hash_of_out());
	cJSON *plan = cJSON_Parse(out);
	const cJSON *topo = cJSON_GetObjectItemCaseSensitive(plan, "topology");
	cr_expect_eq(cJSON_GetObjectItemCaseSensitive(topo, "world_size")->valuedouble, 3);
	cr_expect_eq(cJSON_GetObjectItemCaseSensitive(topo, "batch_size")->valuedouble, 96);
	cr_expect_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(plan, "tables")), 3);
	cJSON_Delete(plan);

	service_spawn(config, "error");
	cr_assert_eq(run(true, "%s status --socket %s", EMBCTL_BINARY, service.socket), 0, "%s", out);
	snprintf(served, sizeof(served), "%s", plan_hash_of_out());
	cr_expect_str_eq(preview, served, "embctl plan --config printed plan %s, embd made %s",
			 preview, served);

	/* the human form names the config's tables; the -o file is the same plan */
	cr_assert_eq(run(true, "%s plan --config %s -o %s/plan.json", EMBCTL_BINARY, config, dir), 0,
		     "%s", out);
	cr_expect(strstr(out, "pages") && strstr(out, "3 tables on 3 ranks"), "%s", out);
	cr_assert_eq(run(true, "cat %s/plan.json", dir), 0);
	cr_expect_str_eq(plan_hash_of_out(), served);
}

Test(embctl, plan_config_applies_env_like_embd)
{
	char config[128];

	/* a cluster's size from torch's env:// variables, as embd would take it */
	write_config("embd.conf", NULL);
	snprintf(config, sizeof(config), "%s/embd.conf", dir);
	cr_assert_eq(run(true, "WORLD_SIZE=6 LOCAL_WORLD_SIZE=3 %s plan --config %s --json",
			 EMBCTL_BINARY, config), 0, "%s", out);
	cJSON *plan = cJSON_Parse(out);
	const cJSON *topo = cJSON_GetObjectItemCaseSensitive(plan, "topology");
	cr_expect_eq(cJSON_GetObjectItemCaseSensitive(topo, "world_size")->valuedouble, 6, "%s", out);
	cr_expect_eq(cJSON_GetObjectItemCaseSensitive(topo, "local_world_size")->valuedouble, 3);
	cJSON_Delete(plan);

	cr_expect_eq(run(true, "WORLD_SIZE=5 LOCAL_WORLD_SIZE=3 %s plan --config %s", EMBCTL_BINARY,
			 config), 1, "%s", out);
	cr_expect(strstr(out, "env://") && strstr(out, "WORLD_SIZE 5"), "%s", out);
}

Test(embctl, plan_config_checks_its_plan_file)
{
	char config[128];

	/* a plan for 2 ranks where the config has 3: refused as the service refuses it */
	write_file("tables.json", tables);
	cr_assert_eq(run(true, "%s plan --tables %s/tables.json --world-size 2 --batch-size 96 -o "
			 "%s/two.json", EMBCTL_BINARY, dir, dir), 0, "%s", out);
	snprintf(config, sizeof(config), "%s/two.conf", dir);
	char plan_file[128];
	snprintf(plan_file, sizeof(plan_file), "%s/two.json", dir);
	write_config("two.conf", plan_file);
	cr_expect_eq(run(true, "%s plan --config %s", EMBCTL_BINARY, config), 1, "%s", out);
	cr_expect(strstr(out, "plan_file") && strstr(out, "world_size 2"), "%s", out);

	/* the plan the config itself makes, as plan_file: valid */
	snprintf(config, sizeof(config), "%s/embd.conf", dir);
	write_config("embd.conf", NULL);
	cr_assert_eq(run(true, "%s plan --config %s -o %s/three.json", EMBCTL_BINARY, config, dir), 0,
		     "%s", out);
	snprintf(plan_file, sizeof(plan_file), "%s/three.json", dir);
	write_config("three.conf", plan_file);
	snprintf(config, sizeof(config), "%s/three.conf", dir);
	cr_expect_eq(run(true, "%s plan --config %s", EMBCTL_BINARY, config), 0, "%s", out);
	cr_expect(strstr(out, "valid") != NULL, "%s", out);
}

Test(embctl, plan_config_refuses_other_inputs)
{
	char config[128];

	write_config("embd.conf", NULL);
	snprintf(config, sizeof(config), "%s/embd.conf", dir);
	cr_expect_eq(run(true, "%s plan --config %s --world-size 4", EMBCTL_BINARY, config), 2);
	cr_expect(strstr(out, "--config takes") != NULL, "%s", out);
	cr_expect_eq(run(true, "%s plan --config %s --tables %s", EMBCTL_BINARY, config, config), 2);
	cr_expect_eq(run(true, "%s plan --config %s/missing.conf", EMBCTL_BINARY, dir), 1);
	cr_expect(strstr(out, "missing.conf") != NULL, "%s", out);
}

Test(embctl, tables_file_holding_an_object)
{
	char wrapped[4096], hash[17];

	write_file("array.json", tables);
	snprintf(wrapped, sizeof(wrapped), "{ \"tables\": %s }\n", tables);
	write_file("object.json", wrapped);
	cr_assert_eq(run(true, "%s plan --tables %s/array.json --world-size 2 --json", EMBCTL_BINARY,
			 dir), 0, "%s", out);
	snprintf(hash, sizeof(hash), "%s", plan_hash_of_out());
	cr_assert_eq(run(true, "%s plan --tables %s/object.json --world-size 2 --json", EMBCTL_BINARY,
			 dir), 0, "%s", out);
	cr_expect_str_eq(plan_hash_of_out(), hash, "the object form should plan like the array");

	/* a whole service config is not a tables file: its topology would be ignored */
	write_config("embd.conf", NULL);
	cr_expect_eq(run(true, "%s plan --tables %s/embd.conf", EMBCTL_BINARY, dir), 1, "%s", out);
	cr_expect(strstr(out, "'topology'") != NULL, "%s", out);
}

/* A GPU machine's config plans offline on a machine without one (the GPUs are counted only by
 * embd at start): fused kernels and HBM on every rank. */
Test(embctl, plan_config_of_cuda_ranks)
{
	char config[128];

	write_file("cuda.conf", "{ \"topology\": { \"world_size\": 8, \"local_world_size\": 8, "
		   "\"compute_device\": \"cuda\", \"batch_size\": 512 },\n \"tables\": [ { \"name\": "
		   "\"t\", \"num_embeddings\": 1000000, \"embedding_dim\": 128, \"feature_names\": "
		   "[\"f\"] } ] }\n");
	snprintf(config, sizeof(config), "%s/cuda.conf", dir);
	cr_assert_eq(run(true, "%s plan --config %s", EMBCTL_BINARY, config), 0, "%s", out);
	cr_expect(strstr(out, "8 per node, cuda") != NULL, "%s", out);
	cr_expect(strstr(out, "HBM") != NULL, "%s", out);
}
