/*
 * The service config (format in daemon/config.h): a strict JSON object walked key by key
 * against one table of known keys, so a misspelt key is an error rather than a silently
 * ignored setting. Tables and topology are the planner's own parsers, so the config and the
 * planner's files can never disagree on what a field means.
 */
#include "daemon/config.h"
#include "common/file.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Two CPU ranks on one node and the planner's demo tables (tests/data/planner/demo_tables.json). */
static const char default_text[] =
	"{\n"
	"  \"tables\": [\n"
	"    { \"name\": \"user_id\", \"num_embeddings\": 10000, \"embedding_dim\": 64,\n"
	"      \"pooling\": \"sum\", \"feature_names\": [\"user_id\"], \"data_type\": \"fp32\",\n"
	"      \"optimizer\": { \"type\": \"rowwise_adagrad\", \"lr\": 0.05, \"eps\": 1e-8 } },\n"
	"    { \"name\": \"item_id\", \"num_embeddings\": 20000, \"embedding_dim\": 64,\n"
	"      \"pooling\": \"sum\", \"feature_names\": [\"item_id\", \"clicked_item_id\"],\n"
	"      \"data_type\": \"fp32\",\n"
	"      \"optimizer\": { \"type\": \"rowwise_adagrad\", \"lr\": 0.05, \"eps\": 1e-8 },\n"
	"      \"constraints\": { \"pooling_factors\": [1.0, 8.0] } },\n"
	"    { \"name\": \"category\", \"num_embeddings\": 500, \"embedding_dim\": 32,\n"
	"      \"pooling\": \"mean\", \"feature_names\": [\"category\"], \"data_type\": \"fp32\",\n"
	"      \"optimizer\": { \"type\": \"sgd\", \"lr\": 0.1 } },\n"
	"    { \"name\": \"query_terms\", \"num_embeddings\": 5000, \"embedding_dim\": 32,\n"
	"      \"pooling\": \"sum\", \"feature_names\": [\"query_terms\"], \"data_type\": \"fp32\",\n"
	"      \"optimizer\": { \"type\": \"adam\", \"lr\": 0.001, \"beta1\": 0.9,\n"
	"                     \"beta2\": 0.999, \"eps\": 1e-8 },\n"
	"      \"constraints\": { \"pooling_factors\": [4.0] } }\n"
	"  ],\n"
	"  \"topology\": { \"world_size\": 2, \"local_world_size\": 2, \"compute_device\": \"cpu\",\n"
	"                \"hbm_cap\": \"1G\", \"ddr_cap\": \"4G\", \"batch_size\": 128 },\n"
	"  \"socket_path\": \"" EMBD_CONFIG_DEFAULT_SOCKET "\",\n"
	"  \"trainers_per_node\": 2,\n"
	"  \"seed\": 2026,\n"
	"  \"threads_per_rank\": 1,\n"
	"  \"log_level\": \"info\",\n"
	"  \"busy_poll_us\": 50\n"
	"}\n";

const char *embd_config_default_text(void)
{
	return default_text;
}

static int fail(char *err, size_t err_len, int rc, const char *fmt, const char *key)
{
	if (err && err_len)
		snprintf(err, err_len, fmt, key);
	return rc;
}

/* An integer in [min, max]: JSON numbers are doubles, so integrality is checked here. */
static int get_uint(const cJSON *item, double max, uint64_t *out, char *err, size_t err_len)
{
	if (!cJSON_IsNumber(item))
		return fail(err, err_len, EMBD_EINVAL, "config key '%s': expected a number",
			    item->string);
	double v = item->valuedouble;
	if (!(v >= 0 && v <= max) || floor(v) != v)
		return fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': expected a non-negative integer in range", item->string);
	*out = (uint64_t)v;
	return 0;
}

/* A count of things that must exist: 1..1024. */
static int get_count(const cJSON *item, uint32_t *out, char *err, size_t err_len)
{
	uint64_t v;
	int rc = get_uint(item, 1024, &v, err, err_len);

	if (!rc && v == 0)
		rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': must be at least 1",
			  item->string);
	*out = (uint32_t)v;
	return rc;
}

static int get_string(const cJSON *item, char *dst, size_t dst_len, char *err, size_t err_len)
{
	if (!cJSON_IsString(item))
		return fail(err, err_len, EMBD_EINVAL, "config key '%s': expected a string",
			    item->string);
	if (strlen(item->valuestring) >= dst_len)
		return fail(err, err_len, EMBD_EINVAL, "config key '%s': string too long",
			    item->string);
	strcpy(dst, item->valuestring);
	return 0;
}

static int get_ids(const cJSON *item, unsigned int *ids, uint32_t *count, char *err, size_t err_len)
{
	const cJSON *e;
	uint32_t n = 0;

	if (!cJSON_IsArray(item))
		return fail(err, err_len, EMBD_EINVAL, "config key '%s': expected an array of ids",
			    item->string);
	cJSON_ArrayForEach(e, item) {
		if (n == EMBD_CONFIG_IDS_MAX)
			return fail(err, err_len, EMBD_EINVAL, "config key '%s': more than 64 ids",
				    item->string);
		double v = cJSON_IsNumber(e) ? e->valuedouble : -1;
		/* (uint32_t)-1 is the kernel's "no id" value and never a real uid or gid */
		if (!(v >= 0 && v < 4294967295.0) || floor(v) != v)
			return fail(err, err_len, EMBD_EINVAL,
				    "config key '%s': every entry must be an integer id", item->string);
		ids[n++] = (unsigned int)v;
	}
	*count = n;
	return 0;
}

static int parse_key(const cJSON *item, struct embd_config *c, const cJSON **tables,
		     const cJSON **topology, char *err, size_t err_len)
{
	const char *k = item->string;
	uint64_t v;
	int rc;

	if (!strcmp(k, "tables")) {
		*tables = item;
		return 0;
	}
	if (!strcmp(k, "topology")) {
		*topology = item;
		return 0;
	}
	if (!strcmp(k, "plan_file"))
		return get_string(item, c->plan_file, sizeof(c->plan_file), err, err_len);
	if (!strcmp(k, "checkpoint_dir"))
		return get_string(item, c->checkpoint_dir, sizeof(c->checkpoint_dir), err, err_len);
	if (!strcmp(k, "checkpoint_layout")) {
		if (!cJSON_IsString(item) || (strcmp(item->valuestring, "shared") &&
					      strcmp(item->valuestring, "per_node")))
			return fail(err, err_len, EMBD_EINVAL, "config key '%s': expected shared or "
				    "per_node", k);
		c->checkpoint_layout = strcmp(item->valuestring, "shared") ? EMBD_CKPT_PER_NODE
									   : EMBD_CKPT_SHARED;
		return 0;
	}
	if (!strcmp(k, "checkpoint_every_steps") || !strcmp(k, "checkpoint_every_seconds") ||
	    !strcmp(k, "checkpoint_keep")) {
		rc = get_uint(item, 4294967295.0, &v, err, err_len);
		uint32_t *dst = !strcmp(k, "checkpoint_keep") ? &c->checkpoint_keep :
				!strcmp(k, "checkpoint_every_steps") ? &c->checkpoint_every_steps :
				&c->checkpoint_every_seconds;
		*dst = (uint32_t)v;
		return rc;
	}
	if (!strcmp(k, "socket_path")) {
		rc = get_string(item, c->socket_path, sizeof(c->socket_path), err, err_len);
		if (!rc && !c->socket_path[0])
			rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': must not be empty", k);
		return rc;
	}
	if (!strcmp(k, "allowed_uids"))
		return get_ids(item, c->allowed_uids, &c->num_allowed_uids, err, err_len);
	if (!strcmp(k, "allowed_gids"))
		return get_ids(item, c->allowed_gids, &c->num_allowed_gids, err, err_len);
	if (!strcmp(k, "log_level")) {
		if (!cJSON_IsString(item) || embd_log_level_from_name(item->valuestring, &c->log_level))
			return fail(err, err_len, EMBD_EINVAL,
				    "config key '%s': expected error, warning, notice, info or debug", k);
		return 0;
	}
	if (!strcmp(k, "seed")) {
		/* 2^53: the largest integer a JSON double carries exactly */
		rc = get_uint(item, 9007199254740992.0, &v, err, err_len);
		c->seed = v;
		return rc;
	}
	if (!strcmp(k, "trainers_per_node"))
		return get_count(item, &c->trainers_per_node, err, err_len);
	if (!strcmp(k, "threads_per_rank"))
		return get_count(item, &c->threads_per_rank, err, err_len);
	if (!strcmp(k, "master_addr")) {
		rc = get_string(item, c->master_addr, sizeof(c->master_addr), err, err_len);
		if (!rc && !c->master_addr[0])
			rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': must not be empty", k);
		return rc;
	}
	if (!strcmp(k, "gloo_ifname")) {
		rc = get_string(item, c->gloo_ifname, sizeof(c->gloo_ifname), err, err_len);
		if (!rc && (!c->gloo_ifname[0] || strchr(c->gloo_ifname, ',')))
			rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': expected one interface "
				  "name", k);
		return rc;
	}
	if (!strcmp(k, "comm_addr")) {
		unsigned char bin[sizeof(struct in6_addr)];
		rc = get_string(item, c->comm_addr, sizeof(c->comm_addr), err, err_len);
		if (!rc && inet_pton(AF_INET, c->comm_addr, bin) != 1 &&
		    inet_pton(AF_INET6, c->comm_addr, bin) != 1)
			rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': not a numeric IPv4 or "
				  "IPv6 address", k);
		return rc;
	}
	if (!strcmp(k, "master_port")) {
		rc = get_uint(item, 65535, &v, err, err_len);
		if (!rc && !v)
			rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': must be 1..65535", k);
		c->master_port = (uint16_t)v;
		return rc;
	}
	if (!strcmp(k, "node_rank")) {
		rc = get_uint(item, 1 << 20, &v, err, err_len);
		c->node_rank = (uint32_t)v;
		return rc;
	}
	if (!strcmp(k, "backend")) {
		if (!cJSON_IsString(item) || (strcmp(item->valuestring, "gloo") &&
					      strcmp(item->valuestring, "nccl")))
			return fail(err, err_len, EMBD_EINVAL, "config key '%s': expected gloo or nccl",
				    k);
		c->backend = strcmp(item->valuestring, "gloo") ? EMBD_COMM_NCCL : EMBD_COMM_GLOO;
		return 0;
	}
	if (!strcmp(k, "collective_timeout_ms") || !strcmp(k, "store_timeout_ms")) {
		rc = get_uint(item, 86400000, &v, err, err_len);
		if (!rc && !v && k[0] == 'c')
			rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': must be at least 1", k);
		*(k[0] == 'c' ? &c->collective_timeout_ms : &c->store_timeout_ms) = (int)v;
		return rc;
	}
	if (!strcmp(k, "busy_poll_us")) {
		rc = get_uint(item, 1000000, &v, err, err_len);
		c->busy_poll_us = (uint32_t)v;
		return rc;
	}
	if (!strcmp(k, "checkpoint_allow_fresh_start")) {
		if (!cJSON_IsBool(item))
			return fail(err, err_len, EMBD_EINVAL, "config key '%s': expected true or false",
				    k);
		c->checkpoint_allow_fresh_start = cJSON_IsTrue(item);
		return 0;
	}
	return fail(err, err_len, EMBD_EINVAL, "config key '%s': unknown key", k);
}

static int check(const struct embd_config *c, char *err, size_t err_len)
{
	const struct embd_topology *t = &c->topology;

	if (t->world_size % t->local_world_size)
		return fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': world_size must be a multiple of local_world_size",
			    "topology");
	if (c->node_rank >= embd_config_nodes(c))
		return fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': must be below world_size / local_world_size",
			    "node_rank");
	if (embd_config_nodes(c) > 1 && c->trainers_per_node > 64)
		return fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': at most 64 on several nodes", "trainers_per_node");
	if (c->gloo_ifname[0] && c->comm_addr[0])
		return fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': give comm_addr or gloo_ifname, not both", "comm_addr");
	if (c->backend == EMBD_COMM_NCCL && t->compute_device != EMBD_DEVICE_CUDA)
		return fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': nccl needs compute_device cuda; use gloo", "backend");
	if (t->compute_device != EMBD_DEVICE_CPU)
		return fail(err, err_len, EMBD_ENOTSUP,
			    "config key '%s': compute_device must be cpu in this build", "topology");
	if (c->tables.count == 0)
		return fail(err, err_len, EMBD_EINVAL, "config key '%s': no tables", "tables");
	return 0;
}

/* A config without "tables" or "topology" takes the default's, parsed the same way. */
static int parse_default_part(bool want_tables, struct embd_config *c, char *err, size_t err_len)
{
	cJSON *root = cJSON_Parse(default_text);
	int rc = EMBD_ENOMEM;

	if (!root)
		return rc;
	if (want_tables)
		rc = embd_plan_tables_parse(cJSON_GetObjectItemCaseSensitive(root, "tables"),
					    &c->tables, err, err_len);
	else
		rc = embd_plan_topology_parse(cJSON_GetObjectItemCaseSensitive(root, "topology"),
					      &c->topology, err, err_len);
	cJSON_Delete(root);
	return rc;
}

int embd_config_parse(const char *text, size_t len, struct embd_config *out, char *err,
		      size_t err_len)
{
	const cJSON *tables = NULL, *topology = NULL, *item;
	const char *end = NULL;
	cJSON *root;
	int rc = 0;

	memset(out, 0, sizeof(*out));
	root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
	if (!root) {
		size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : len;
		unsigned line = 1;
		for (size_t i = 0; i < at; i++)
			line += text[i] == '\n';
		if (err && err_len)
			snprintf(err, err_len, "config: JSON syntax error at line %u, byte %zu", line, at);
		return EMBD_EPARSE;
	}
	if (!cJSON_IsObject(root)) {
		rc = fail(err, err_len, EMBD_EINVAL, "config: %s", "expected a JSON object");
		goto out;
	}
	strcpy(out->socket_path, EMBD_CONFIG_DEFAULT_SOCKET);
	out->seed = 2026;
	out->threads_per_rank = 1;
	out->log_level = EMBD_LOG_INFO;
	out->busy_poll_us = 50;
	out->checkpoint_keep = 3;
	strcpy(out->master_addr, "127.0.0.1");
	out->master_port = 29500;
	out->backend = EMBD_COMM_GLOO;
	out->collective_timeout_ms = 30000;
	cJSON_ArrayForEach(item, root) {
		rc = parse_key(item, out, &tables, &topology, err, err_len);
		if (rc)
			goto out;
	}
	/* duplicate keys: cJSON keeps both; the strict reading refuses them */
	for (const cJSON *a = root->child; a; a = a->next)
		for (const cJSON *b = a->next; b; b = b->next)
			if (!strcmp(a->string, b->string)) {
				rc = fail(err, err_len, EMBD_EINVAL, "config key '%s': given twice",
					  a->string);
				goto out;
			}
	rc = topology ? embd_plan_topology_parse(topology, &out->topology, err, err_len)
		      : parse_default_part(false, out, err, err_len);
	if (!rc)
		rc = embd_plan_topology_validate(&out->topology, err, err_len);
	if (rc)
		goto out;
	rc = tables ? embd_plan_tables_parse(tables, &out->tables, err, err_len)
		    : parse_default_part(true, out, err, err_len);
	if (rc)
		goto out;
	if (!out->trainers_per_node)
		out->trainers_per_node = (uint32_t)out->topology.local_world_size;
	if (!out->num_allowed_uids && !cJSON_GetObjectItemCaseSensitive(root, "allowed_uids")) {
		out->allowed_uids[0] = getuid();
		out->num_allowed_uids = 1;
	}
	if (!out->store_timeout_ms)
		out->store_timeout_ms = out->collective_timeout_ms;
	rc = check(out, err, err_len);
out:
	cJSON_Delete(root);
	if (rc)
		embd_config_free(out);
	return rc;
}

int embd_config_load(const char *path, struct embd_config *out, char *err, size_t err_len)
{
	char *text;
	size_t len;
	int rc;

	memset(out, 0, sizeof(*out));
	rc = embd_read_file(path, &text, &len, err, err_len);
	if (rc)
		return rc;
	rc = embd_config_parse(text, len, out, err, err_len);
	if (rc && err && err_len) {
		/* prefix the path so the operator knows which file */
		char inner[512];
		snprintf(inner, sizeof(inner), "%s", err);
		snprintf(err, err_len, "%s: %s", path, inner);
	}
	free(text);
	return rc;
}

void embd_config_ckpt_settings(const struct embd_config *c, struct embd_ckpt_settings *out)
{
	*out = (struct embd_ckpt_settings){
		.tables = c->tables,
		.checkpoint_layout = c->checkpoint_layout,
		.checkpoint_every_steps = c->checkpoint_every_steps,
		.checkpoint_every_seconds = c->checkpoint_every_seconds,
		.checkpoint_keep = c->checkpoint_keep,
		.checkpoint_allow_fresh_start = c->checkpoint_allow_fresh_start,
		.node_rank = c->node_rank,
		.num_nodes = embd_config_nodes(c),
		.master_port = c->master_port,
		.store_timeout_ms = c->store_timeout_ms,
	};
	snprintf(out->checkpoint_dir, sizeof(out->checkpoint_dir), "%s", c->checkpoint_dir);
	snprintf(out->master_addr, sizeof(out->master_addr), "%s", c->master_addr);
}

int embd_config_join_settings(const struct embd_config *c, char **out)
{
	cJSON *o = cJSON_CreateObject();

	*out = NULL;
	if (!o)
		return EMBD_ENOMEM;
	/* the directory's path may differ (per-node disks, NFS mounted elsewhere): set or not */
	cJSON_AddStringToObject(o, "checkpoint_dir", c->checkpoint_dir[0] ? "set" : "unset");
	cJSON_AddStringToObject(o, "checkpoint_layout", embd_ckpt_layout_name(c->checkpoint_layout));
	cJSON_AddNumberToObject(o, "checkpoint_every_steps", c->checkpoint_every_steps);
	cJSON_AddNumberToObject(o, "checkpoint_every_seconds", c->checkpoint_every_seconds);
	cJSON_AddNumberToObject(o, "checkpoint_keep", c->checkpoint_keep);
	*out = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	return *out ? 0 : EMBD_ENOMEM;
}

void embd_config_free(struct embd_config *config)
{
	if (!config)
		return;
	embd_plan_tables_free(&config->tables);
}
