/*
 * `embctl plan`: builds a plan from a tables file and a topology given by flags (one flag
 * per topology field, spelled with dashes: --hbm-cap 16G) or a --topology JSON file, prints
 * the stats table or the plan JSON, and writes the plan with -o. `--check PLAN` validates
 * and re-estimates an existing plan (for example one converted from TorchRec) instead.
 * `--config FILE` plans from a service config through the service's own calls
 * (daemon/config_plan.h), env:// included, so the preview is the plan embd makes from that
 * file in this environment.
 */
#include "embctl.h"

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/config_plan.h"
#include "dist/rendezvous.h"
#include "embd/plan.h"

enum { OPT_TABLES = 1000, OPT_TOPOLOGY, OPT_JSON, OPT_CHECK, OPT_GREEDY, OPT_HELP, OPT_CONFIG,
       OPT_FIELD = 2000 };

#define MAX_FIELDS 32
#define FLAG_NAME_MAX 40

static void usage(FILE *out)
{
	fprintf(out, "usage: embctl plan --tables FILE [topology flags] [--json] [-o plan.json]\n"
		     "       embctl plan --config FILE [--json] [-o plan.json]\n"
		     "       embctl plan --check plan.json (--tables FILE | --config FILE) [--json]\n\n"
		     "  --tables FILE       tables JSON: an array, or {\"tables\": [...]}\n"
		     "                      (format: include/embd/plan.h)\n"
		     "  --config FILE       a service config (embd.conf(5)): the plan embd makes\n"
		     "                      from it (its tables, topology and plan_file, with\n"
		     "                      WORLD_SIZE etc. of env:// applied); no\n"
		     "                      --tables, --topology or topology flags with it\n"
		     "  --topology FILE     topology JSON object; flags given after it override it\n"
		     "  --json              print the plan JSON instead of the stats table\n"
		     "  -o FILE             write the plan JSON to FILE\n"
		     "  --check FILE        validate FILE against the tables and re-estimate it\n"
		     "  --greedy-only       only TorchRec's greedy proposal (for comparisons)\n\n"
		     "topology flags (TorchRec's fields and defaults; sizes take 16G, 512M;\n"
		     "bandwidths 25GB/s, or a bare number in bytes/ms):\n");
	for (size_t i = 0; embd_plan_topology_field(i); i++) {
		char flag[FLAG_NAME_MAX];
		snprintf(flag, sizeof(flag), "%s", embd_plan_topology_field(i));
		for (char *p = flag; *p; p++)
			*p = *p == '_' ? '-' : *p;
		fprintf(out, "  --%s\n", flag);
	}
}

static int write_file(const char *path, const char *data, size_t len)
{
	FILE *f = fopen(path, "wb");
	if (!f)
		return -1;
	size_t n = fwrite(data, 1, len, f);
	return fclose(f) || n != len ? -1 : 0;
}

static int print_plan(struct embd_plan *plan, bool json, const char *out_path)
{
	char *text = NULL;
	size_t len = 0;
	int rc = embd_plan_write_json(plan, &text, &len);
	if (rc) {
		fprintf(stderr, "embctl plan: %s\n", embd_strerror(rc));
		return 1;
	}
	if (out_path && write_file(out_path, text, len)) {
		fprintf(stderr, "embctl plan: cannot write %s\n", out_path);
		free(text);
		return 1;
	}
	if (json) {
		fwrite(text, 1, len, stdout);
	} else {
		char *stats;
		free(text);
		text = NULL;
		if (embd_plan_stats_text(plan, &stats)) {
			fprintf(stderr, "embctl plan: out of memory\n");
			return 1;
		}
		fputs(stats, stdout);
		free(stats);
	}
	free(text);
	return 0;
}

static int check_plan(const char *path, const struct embd_tables *tables, bool json)
{
	char err[1024];
	struct embd_plan *plan = NULL;
	int status = 1;

	if (embd_plan_load(path, &plan, err, sizeof(err))) {
		fprintf(stderr, "embctl plan: %s\n", err);
		return 1;
	}
	uint64_t claimed = plan->plan_hash;
	if (embd_plan_check(plan, tables->specs, tables->constraints, tables->count, err,
			    sizeof(err))) {
		fprintf(stderr, "embctl plan: %s is not valid: %s\n", path, err);
		goto out;
	}
	if (claimed && claimed != plan->plan_hash)
		fprintf(stderr, "embctl plan: note: %s says plan_hash %016llx, its canonical form "
			"hashes to %016llx (edited or converted)\n", path,
			(unsigned long long)claimed, (unsigned long long)plan->plan_hash);
	status = print_plan(plan, json, NULL);
	if (!status && !json)
		printf("%s: valid\n", path);
out:
	embd_plan_destroy(plan);
	return status;
}

/* The plan embd makes from the config at path (or --check of another plan against its tables). */
static int plan_config(const char *path, const char *check_path, bool json, const char *out_path)
{
	struct embd_config config;
	struct embd_plan *plan = NULL;
	char err[2048];
	int rc, status = 1;

	if (embd_config_load(path, &config, err, sizeof(err))) {
		fprintf(stderr, "embctl plan: %s\n", err);
		return 1;
	}
	struct embd_rendezvous env;
	if ((rc = embd_config_resolve_env(&config, &env, err, sizeof(err)))) {
		fprintf(stderr, "embctl plan: env://: %s\n", err);
	} else if (check_path) {
		status = check_plan(check_path, &config.tables, json);
	} else if ((rc = embd_config_plan(&config, &plan, err, sizeof(err)))) {
		fprintf(stderr, "embctl plan: %s: %s\n", embd_strerror(rc), err);
	} else {
		status = print_plan(plan, json, out_path);
		if (!status && !json && config.plan_file[0])
			printf("%s: plan_file %s: valid for its tables and topology\n", path,
			       config.plan_file);
	}
	embd_plan_destroy(plan);
	embd_config_free(&config);
	return status;
}

int embctl_plan(int argc, char **argv)
{
	struct option longopts[MAX_FIELDS + 16];
	char names[MAX_FIELDS][FLAG_NAME_MAX];
	const char *tables_path = NULL, *out_path = NULL, *check_path = NULL, *config_path = NULL;
	bool json = false, local_given = false, topology_given = false;
	struct embd_plan_options options = { 0 };
	struct embd_topology topo;
	struct embd_tables tables = { 0 };
	struct embd_plan *plan = NULL;
	char err[2048];
	size_t n = 0;
	int status = 2, opt;

	/* one --flag per topology field, from the planner's own field table */
	for (; embd_plan_topology_field(n) && n < MAX_FIELDS; n++) {
		snprintf(names[n], FLAG_NAME_MAX, "%s", embd_plan_topology_field(n));
		for (char *p = names[n]; *p; p++)
			*p = *p == '_' ? '-' : *p;
		longopts[n] = (struct option){ names[n], required_argument, NULL, OPT_FIELD + (int)n };
	}
	const struct option fixed[] = {
		{ "tables", required_argument, NULL, OPT_TABLES },
		{ "topology", required_argument, NULL, OPT_TOPOLOGY },
		{ "json", no_argument, NULL, OPT_JSON },
		{ "check", required_argument, NULL, OPT_CHECK },
		{ "greedy-only", no_argument, NULL, OPT_GREEDY },
		{ "help", no_argument, NULL, OPT_HELP },
		{ "config", required_argument, NULL, OPT_CONFIG },
		{ NULL, 0, NULL, 0 },
	};
	memcpy(&longopts[n], fixed, sizeof(fixed));

	embd_plan_topology_default(&topo, 1);
	while ((opt = getopt_long(argc, argv, "o:h", longopts, NULL)) != -1) {
		switch (opt) {
		case OPT_TABLES: tables_path = optarg; break;
		case OPT_JSON: json = true; break;
		case OPT_CHECK: check_path = optarg; break;
		case OPT_GREEDY: options.greedy_only = true; break;
		case OPT_CONFIG: config_path = optarg; break;
		case 'o': out_path = optarg; break;
		case 'h':
		case OPT_HELP: usage(stdout); return 0;
		case OPT_TOPOLOGY:
			if (embd_plan_topology_load(optarg, &topo, err, sizeof(err))) {
				fprintf(stderr, "embctl plan: %s\n", err);
				return 2;
			}
			local_given = true;     /* the file resolved local_world_size itself */
			topology_given = true;
			break;
		default:
			if (opt < OPT_FIELD || opt >= OPT_FIELD + (int)n) {
				usage(stderr);
				return 2;
			}
			const char *field = embd_plan_topology_field((size_t)(opt - OPT_FIELD));
			if (embd_plan_topology_set(&topo, field, optarg, err, sizeof(err))) {
				fprintf(stderr, "embctl plan: --%s: %s\n", names[opt - OPT_FIELD], err);
				return 2;
			}
			local_given |= !strcmp(field, "local_world_size");
			topology_given = true;
			break;
		}
	}
	const char *wrong = optind < argc ? "unexpected argument" :
			    !config_path && !tables_path ? "--tables FILE or --config FILE is required" :
			    config_path && (tables_path || topology_given || options.greedy_only) ?
			    "--config takes the tables and topology from the config: no --tables, "
			    "--topology, topology flag or --greedy-only with it" : NULL;
	if (wrong) {
		fprintf(stderr, "embctl plan: %s\n", wrong);
		usage(stderr);
		return 2;
	}
	if (config_path)
		return plan_config(config_path, check_path, json, out_path);
	if (!local_given)       /* TorchRec's default: one node */
		topo.local_world_size = topo.world_size;
	status = 1;
	if (embd_plan_tables_load(tables_path, &tables, err, sizeof(err))) {
		fprintf(stderr, "embctl plan: %s\n", err);
		goto out;
	}
	if (check_path) {
		status = check_plan(check_path, &tables, json);
		goto out;
	}
	int rc = embd_plan_build(tables.specs, tables.constraints, tables.count, &topo, &options,
				 &plan, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "embctl plan: %s: %s\n", embd_strerror(rc), err);
		goto out;
	}
	status = print_plan(plan, json, out_path);
out:
	embd_plan_destroy(plan);
	embd_plan_tables_free(&tables);
	return status;
}
