/*
 * The service config (format in daemon/config.h): a strict JSON object walked key by key
 * against one table of known keys (keys[]: each key's reader, field, range and default), so a
 * misspelt key is an error rather than a silently ignored setting, and adding a key is one
 * row. Tables and topology are the planner's own parsers, so the config and the planner's
 * files can never disagree on what a field means.
 */
#include "daemon/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <grp.h>
#include <math.h>
#include <pwd.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "common/file.h"
#include "planner/plan_json.h"

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

/*
 * A user or group name in allowed_uids / allowed_gids, resolved once when the file is read:
 * a packaged config names the group its package created, whose id differs per machine.
 * Returns 0 or an errno value (ENOENT: no such name).
 */
static int resolve_name(const char *name, bool group, unsigned int *id)
{
	size_t len = 1024;
	int rc;

	for (;;) {
		char *buf = malloc(len);
		struct passwd pw, *pwr = NULL;
		struct group gr, *grr = NULL;
		if (!buf)
			return ENOMEM;
		rc = group ? getgrnam_r(name, &gr, buf, len, &grr) : getpwnam_r(name, &pw, buf, len, &pwr);
		if (!rc && (grr || pwr))
			*id = group ? grr->gr_gid : pwr->pw_uid;
		else if (!rc)
			rc = ENOENT;
		free(buf);
		if (rc != ERANGE || len >= (1u << 20))
			return rc;
		len *= 2;       /* a group with many members */
	}
}

/* allowed_uids (group false), allowed_gids (group true): ids or names */
static int get_ids(const cJSON *v, const char *key, bool group, unsigned int *ids,
		   uint32_t *count, char *err, size_t err_len)
{
	const cJSON *e;
	uint32_t n = 0;

	if (!cJSON_IsArray(v))
		return embd_fail(err, err_len, EMBD_EINVAL,
				 "config key '%s': expected an array of ids", key);
	cJSON_ArrayForEach(e, v) {
		if (n == EMBD_CONFIG_IDS_MAX)
			return embd_fail(err, err_len, EMBD_EINVAL,
					 "config key '%s': more than 64 ids", key);
		if (cJSON_IsString(e)) {
			int rc = resolve_name(e->valuestring, group, &ids[n++]);
			if (rc)
				return embd_fail(err, err_len, rc == ENOMEM ? EMBD_ENOMEM : EMBD_EINVAL,
						 "config key '%s': %s '%.64s': %s", key,
						 group ? "group" : "user", e->valuestring,
						 rc == ENOENT ? "no such name" : strerror(rc));
			continue;
		}
		double d = cJSON_IsNumber(e) ? e->valuedouble : -1;
		/* (uint32_t)-1 is the kernel's "no id" value and never a real uid or gid */
		if (!(d >= 0 && d < 4294967295.0) || floor(d) != d)
			return embd_fail(err, err_len, EMBD_EINVAL,
					 "config key '%s': every entry must be an integer id or a name",
					 key);
		ids[n++] = (unsigned int)d;
	}
	*count = n;
	return 0;
}

/* ---- the keys ----------------------------------------------------------------------------- */

struct key;
typedef int parse_fn(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
		     size_t err_len);

struct choice {
	const char *name;
	int value;
};

/* One key of the file: how its value is read and where it goes. What each key means is
 * documented in daemon/config.h. */
struct key {
	const char *name;
	parse_fn *parse;                /* NULL: the planner's part, read after every other key */
	size_t offset, size;            /* the field of struct embd_config it sets */
	uint64_t min;                   /* parse_uint: values below fail with why */
	double max;                     /* parse_uint: values above fail as out of range */
	bool (*valid)(const char *s);   /* parse_string: a string it refuses fails with why */
	const struct choice *choices;   /* parse_choice: the names it takes, NULL-terminated */
	const char *why;                /* the key's own refusal, after "config key 'name': " */
	const char *def;                /* the default as JSON, read like a given value; NULL:
					 * zero, or derived from other keys (resolve_defaults) */
};

#define FIELD(f) .offset = offsetof(struct embd_config, f), \
		 .size = sizeof(((struct embd_config *)0)->f)

static void *field(struct embd_config *c, const struct key *k)
{
	return (char *)c + k->offset;
}

static int refuse(const struct key *k, char *err, size_t err_len)
{
	return embd_fail(err, err_len, EMBD_EINVAL, "config key '%s': %s", k->name, k->why);
}

/* Unsigned fields of 2, 4 or 8 bytes, and the int-sized ones (timeouts, enums) whose values
 * a key's range keeps non-negative. */
static void set_uint(struct embd_config *c, const struct key *k, uint64_t v)
{
	uint16_t u16 = (uint16_t)v;
	uint32_t u32 = (uint32_t)v;

	if (k->size == sizeof(u16))
		memcpy(field(c, k), &u16, sizeof(u16));
	else if (k->size == sizeof(u32))
		memcpy(field(c, k), &u32, sizeof(u32));
	else
		memcpy(field(c, k), &v, sizeof(v));
}

/* An integer in [0, max], then at least min: JSON numbers are doubles, so integrality is
 * checked here. */
static int parse_uint(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
		      size_t err_len)
{
	if (!cJSON_IsNumber(v))
		return embd_fail(err, err_len, EMBD_EINVAL, "config key '%s': expected a number",
				 k->name);
	double d = v->valuedouble;
	if (!(d >= 0 && d <= k->max) || floor(d) != d)
		return embd_fail(err, err_len, EMBD_EINVAL,
				 "config key '%s': expected a non-negative integer in range", k->name);
	if ((uint64_t)d < k->min)
		return refuse(k, err, err_len);
	set_uint(c, k, (uint64_t)d);
	return 0;
}

static int parse_string(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
			size_t err_len)
{
	if (!cJSON_IsString(v))
		return embd_fail(err, err_len, EMBD_EINVAL, "config key '%s': expected a string",
				 k->name);
	if (strlen(v->valuestring) >= k->size)
		return embd_fail(err, err_len, EMBD_EINVAL, "config key '%s': string too long",
				 k->name);
	if (k->valid && !k->valid(v->valuestring))
		return refuse(k, err, err_len);
	strcpy(field(c, k), v->valuestring);
	return 0;
}

static int parse_choice(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
			size_t err_len)
{
	for (const struct choice *ch = k->choices; cJSON_IsString(v) && ch->name; ch++)
		if (!strcmp(v->valuestring, ch->name)) {
			set_uint(c, k, (uint64_t)ch->value);
			return 0;
		}
	return refuse(k, err, err_len);
}

static int parse_bool(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
		      size_t err_len)
{
	if (!cJSON_IsBool(v))
		return refuse(k, err, err_len);
	*(bool *)field(c, k) = cJSON_IsTrue(v);
	return 0;
}

static int parse_log_level(const struct key *k, const cJSON *v, struct embd_config *c,
			   char *err, size_t err_len)
{
	if (!cJSON_IsString(v) || embd_log_level_from_name(v->valuestring, &c->log_level))
		return refuse(k, err, err_len);
	return 0;
}

static int parse_uids(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
		      size_t err_len)
{
	return get_ids(v, k->name, false, c->allowed_uids, &c->num_allowed_uids, err, err_len);
}

static int parse_gids(const struct key *k, const cJSON *v, struct embd_config *c, char *err,
		      size_t err_len)
{
	return get_ids(v, k->name, true, c->allowed_gids, &c->num_allowed_gids, err, err_len);
}

static bool not_empty(const char *s)
{
	return s[0] != 0;
}

/* GLOO_SOCKET_IFNAME may list several; the config takes one */
static bool one_ifname(const char *s)
{
	return s[0] && !strchr(s, ',');
}

static bool numeric_addr(const char *s)
{
	unsigned char bin[sizeof(struct in6_addr)];

	return inet_pton(AF_INET, s, bin) == 1 || inet_pton(AF_INET6, s, bin) == 1;
}

const char embd_config_listen_why[] =
	"expected \"address:port\": a numeric IPv4 address or [IPv6] address, port 1..65535";

bool embd_config_listen_addr(const char *text, struct sockaddr_storage *addr)
{
	const char *colon = strrchr(text, ':'), *port_text;
	struct sockaddr_in *v4 = (struct sockaddr_in *)addr;
	struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)addr;
	char host[INET6_ADDRSTRLEN], *end;
	size_t host_len;

	memset(addr, 0, sizeof(*addr));
	if (!colon)
		return false;
	host_len = (size_t)(colon - text);
	port_text = colon + 1;
	if (text[0] == '[') {
		if (host_len < 2 || text[host_len - 1] != ']')
			return false;
		text++;
		host_len -= 2;
	} else if (memchr(text, ':', host_len)) {
		return false;   /* an IPv6 address without brackets: where its port starts is a guess */
	}
	if (!host_len || host_len >= sizeof(host) || *port_text < '0' || *port_text > '9')
		return false;
	memcpy(host, text, host_len);
	host[host_len] = 0;
	errno = 0;
	unsigned long port = strtoul(port_text, &end, 10);
	if (*end || errno || port < 1 || port > 65535)
		return false;
	if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
		v4->sin_family = AF_INET;
		v4->sin_port = htons((uint16_t)port);
		return true;
	}
	if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
		v6->sin6_family = AF_INET6;
		v6->sin6_port = htons((uint16_t)port);
		return true;
	}
	return false;
}

static bool listen_addr(const char *s)
{
	struct sockaddr_storage addr;

	return !s[0] || embd_config_listen_addr(s, &addr);
}

static const struct choice layouts[] = {
	{ "shared", EMBD_CKPT_SHARED }, { "per_node", EMBD_CKPT_PER_NODE }, { NULL, 0 } };
static const struct choice scalings[] = {
	{ "mean_over_trainers", EMBD_GRADIENT_MEAN_OVER_TRAINERS }, { "sum", EMBD_GRADIENT_SUM },
	{ NULL, 0 } };
static const struct choice backends[] = {
	{ "gloo", EMBD_COMM_GLOO }, { "nccl", EMBD_COMM_NCCL }, { NULL, 0 } };

#define U32_MAX_D 4294967295.0
#define MS_PER_DAY 86400000.0

/* The one place keys are read: a key not here is refused as unknown. */
static const struct key keys[] = {
	{ "tables", NULL, FIELD(tables) },
	{ "topology", NULL, FIELD(topology) },
	{ "plan_file", parse_string, FIELD(plan_file) },
	{ "socket_path", parse_string, FIELD(socket_path), .valid = not_empty,
	  .why = "must not be empty", .def = "\"" EMBD_CONFIG_DEFAULT_SOCKET "\"" },
	{ "allowed_uids", parse_uids, FIELD(allowed_uids) },
	{ "allowed_gids", parse_gids, FIELD(allowed_gids) },
	{ "trainers_per_node", parse_uint, FIELD(trainers_per_node), .min = 1,
	  .max = EMBD_CONFIG_TRAINERS_MAX,
	  .why = "must be at least 1" },
	{ "gradient_scaling", parse_choice, FIELD(gradient_scaling), .choices = scalings,
	  .why = "expected mean_over_trainers or sum", .def = "\"mean_over_trainers\"" },
	/* 2^53: the largest integer a JSON double carries exactly */
	{ "seed", parse_uint, FIELD(seed), .max = 9007199254740992.0, .def = "2026" },
	{ "threads_per_rank", parse_uint, FIELD(threads_per_rank), .min = 1, .max = 1024,
	  .why = "must be at least 1", .def = "1" },
	{ "log_level", parse_log_level, FIELD(log_level),
	  .why = "expected error, warning, notice, info or debug", .def = "\"info\"" },
	{ "checkpoint_dir", parse_string, FIELD(checkpoint_dir) },
	{ "checkpoint_layout", parse_choice, FIELD(checkpoint_layout), .choices = layouts,
	  .why = "expected shared or per_node", .def = "\"shared\"" },
	{ "checkpoint_every_steps", parse_uint, FIELD(checkpoint_every_steps), .max = U32_MAX_D },
	{ "checkpoint_every_seconds", parse_uint, FIELD(checkpoint_every_seconds),
	  .max = U32_MAX_D },
	{ "checkpoint_keep", parse_uint, FIELD(checkpoint_keep), .max = U32_MAX_D, .def = "3" },
	{ "checkpoint_allow_fresh_start", parse_bool, FIELD(checkpoint_allow_fresh_start),
	  .why = "expected true or false" },
	{ "busy_poll_us", parse_uint, FIELD(busy_poll_us), .max = 1000000, .def = "50" },
	{ "handshake_timeout_ms", parse_uint, FIELD(handshake_timeout_ms), .min = 1,
	  .max = MS_PER_DAY, .why = "must be at least 1", .def = "5000" },
	{ "step_wait_warn_ms", parse_uint, FIELD(step_wait_warn_ms), .max = MS_PER_DAY,
	  .def = "10000" },
	{ "step_wait_abort_ms", parse_uint, FIELD(step_wait_abort_ms), .max = MS_PER_DAY },
	{ "master_addr", parse_string, FIELD(master_addr), .valid = not_empty,
	  .why = "must not be empty", .def = "\"127.0.0.1\"" },
	{ "master_port", parse_uint, FIELD(master_port), .min = 1, .max = 65535,
	  .why = "must be 1..65535", .def = "29500" },
	{ "gloo_ifname", parse_string, FIELD(gloo_ifname), .valid = one_ifname,
	  .why = "expected one interface name" },
	{ "comm_addr", parse_string, FIELD(comm_addr), .valid = numeric_addr,
	  .why = "not a numeric IPv4 or IPv6 address" },
	{ "node_rank", parse_uint, FIELD(node_rank), .max = 1 << 20 },
	{ "backend", parse_choice, FIELD(backend), .choices = backends,
	  .why = "expected gloo or nccl", .def = "\"gloo\"" },
	{ "collective_timeout_ms", parse_uint, FIELD(collective_timeout_ms), .min = 1,
	  .max = MS_PER_DAY, .why = "must be at least 1", .def = "30000" },
	{ "store_timeout_ms", parse_uint, FIELD(store_timeout_ms), .max = MS_PER_DAY },
	{ "metrics_listen", parse_string, FIELD(metrics_listen), .valid = listen_addr,
	  .why = embd_config_listen_why },
};

static const struct key *find_key(const char *name)
{
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
		if (!strcmp(keys[i].name, name))
			return &keys[i];
	return NULL;
}

/* Every key with a default takes it, through its own parser. */
static int set_defaults(struct embd_config *c, char *err, size_t err_len)
{
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		if (!keys[i].def)
			continue;
		cJSON *v = cJSON_Parse(keys[i].def);
		int rc = v ? keys[i].parse(&keys[i], v, c, err, err_len) : EMBD_ENOMEM;
		cJSON_Delete(v);
		if (rc)
			return rc;
	}
	return 0;
}

static int check(const struct embd_config *c, char *err, size_t err_len)
{
	const struct embd_topology *t = &c->topology;

	if (t->world_size % t->local_world_size)
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': world_size must be a multiple of local_world_size",
			    "topology");
	if (c->node_rank >= embd_config_nodes(c))
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': must be below world_size / local_world_size",
			    "node_rank");
	if (embd_config_nodes(c) > 1 && c->trainers_per_node > 64)
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': at most 64 on several nodes", "trainers_per_node");
	if (c->gloo_ifname[0] && c->comm_addr[0])
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': give comm_addr or gloo_ifname, not both", "comm_addr");
	if (c->backend == EMBD_COMM_NCCL && t->compute_device != EMBD_DEVICE_CUDA)
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': nccl needs compute_device cuda; use gloo", "backend");
	if (c->tables.count == 0)
		return embd_fail(err, err_len, EMBD_EINVAL, "config key '%s': no tables", "tables");
	if (c->step_wait_abort_ms && c->step_wait_abort_ms <= c->step_wait_warn_ms)
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': %u ms must be above step_wait_warn_ms (%u ms; 0 turns "
			    "the warning off)", "step_wait_abort_ms", c->step_wait_abort_ms,
			    c->step_wait_warn_ms);
	if (!c->num_allowed_uids && !c->num_allowed_gids)
		return embd_fail(err, err_len, EMBD_EINVAL,
			    "config key '%s': empty and no allowed_gids: nobody could connect",
			    "allowed_uids");
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

/* Every key but the planner's parts, checked against keys[]; a key given twice is refused
 * (cJSON keeps both). */
static int read_keys(const cJSON *root, struct embd_config *c, char *err, size_t err_len)
{
	const cJSON *item;
	int rc = set_defaults(c, err, err_len);

	if (rc)
		return rc;
	cJSON_ArrayForEach(item, root) {
		const struct key *k = find_key(item->string);
		if (!k)
			return embd_fail(err, err_len, EMBD_EINVAL, "config key '%s': unknown key",
					 item->string);
		if (k->parse && (rc = k->parse(k, item, c, err, err_len)))
			return rc;
	}
	for (const cJSON *a = root->child; a; a = a->next)
		for (const cJSON *b = a->next; b; b = b->next)
			if (!strcmp(a->string, b->string))
				return embd_fail(err, err_len, EMBD_EINVAL,
						 "config key '%s': given twice", a->string);
	return 0;
}

/* "topology" then "tables", by the planner's own parsers, or the embedded default's. */
static int read_planner_parts(const cJSON *root, struct embd_config *c, char *err,
			      size_t err_len)
{
	const cJSON *topology = cJSON_GetObjectItemCaseSensitive(root, "topology");
	const cJSON *tables = cJSON_GetObjectItemCaseSensitive(root, "tables");
	int rc = topology ? embd_plan_topology_parse(topology, &c->topology, err, err_len)
			  : parse_default_part(false, c, err, err_len);

	c->world_size_given = topology &&
			      cJSON_GetObjectItemCaseSensitive(topology, "world_size");
	c->local_world_size_given = topology &&
				    cJSON_GetObjectItemCaseSensitive(topology, "local_world_size");
	if (!rc)
		rc = embd_plan_topology_validate(&c->topology, err, err_len);
	if (!rc)
		rc = tables ? embd_plan_tables_parse(tables, &c->tables, err, err_len)
			    : parse_default_part(true, c, err, err_len);
	return rc;
}

/* The defaults that follow from other keys, or from whether a key was given at all. */
static void resolve_defaults(const cJSON *root, struct embd_config *c)
{
	c->trainers_per_node_given = c->trainers_per_node != 0;
	if (!c->trainers_per_node)
		c->trainers_per_node = (uint32_t)c->topology.local_world_size;
	/* an explicit empty list means nobody by uid */
	if (!c->num_allowed_uids && !cJSON_GetObjectItemCaseSensitive(root, "allowed_uids")) {
		c->allowed_uids[0] = getuid();
		c->num_allowed_uids = 1;
	}
	if (!c->store_timeout_ms)
		c->store_timeout_ms = c->collective_timeout_ms;
}

int embd_config_parse(const char *text, size_t len, struct embd_config *out, char *err,
		      size_t err_len)
{
	cJSON *root;
	int rc;

	memset(out, 0, sizeof(*out));
	rc = embd_plan_json_parse(text, len, "config", &root, err, err_len);
	if (rc)
		return rc;
	if (!cJSON_IsObject(root))
		rc = embd_fail(err, err_len, EMBD_EINVAL, "config: expected a JSON object");
	else
		rc = read_keys(root, out, err, err_len);
	if (!rc)
		rc = read_planner_parts(root, out, err, err_len);
	if (!rc) {
		resolve_defaults(root, out);
		rc = check(out, err, err_len);
	}
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

mode_t embd_config_socket_mode(const struct embd_config *c, uid_t owner, gid_t group)
{
	bool group_in = false, others_in = false;

	/* root passes any mode; the owner has its own bits */
	for (uint32_t i = 0; i < c->num_allowed_uids; i++)
		others_in |= c->allowed_uids[i] != owner && c->allowed_uids[i] != 0;
	for (uint32_t i = 0; i < c->num_allowed_gids; i++) {
		group_in |= c->allowed_gids[i] == group;
		others_in |= c->allowed_gids[i] != group;
	}
	/* a process in the socket's group is judged by the group bits, not the others' */
	return others_in ? 0666 : group_in ? 0660 : 0600;
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
	cJSON_AddStringToObject(o, "gradient_scaling",
				c->gradient_scaling == EMBD_GRADIENT_SUM ? "sum" : "mean_over_trainers");
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

int embd_config_resolve_devices(struct embd_config *c, uint32_t devices, char *err,
				size_t err_len)
{
	struct embd_topology *t = &c->topology;

	if (t->compute_device != EMBD_DEVICE_CUDA)
		return 0;
	if (!c->local_world_size_given && devices) {
		t->local_world_size = (int32_t)devices;
		if (!c->world_size_given)
			t->world_size = (int32_t)devices;
		if (!c->trainers_per_node_given)
			c->trainers_per_node = devices;
	}
	if ((uint32_t)t->local_world_size > devices)
		return embd_fail(err, err_len, EMBD_ENOTSUP,
			    "config key '%s': local_world_size %d asks for more GPUs than the %u "
			    "this process can use (CUDA_VISIBLE_DEVICES)", "topology",
			    t->local_world_size, devices);
	return check(c, err, err_len);
}
