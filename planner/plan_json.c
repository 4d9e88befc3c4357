/*
 * Plan JSON (schema in plan.h): the canonical writer, whose bytes are the plan's identity
 * (plan_hash is FNV-1a 64 over everything before the "plan_hash" key), and the parser.
 *
 * The writer prints by hand, never through cJSON_Print, so the key order and the number
 * formatting are fixed: integers as integers, topology reals as %.17g (they round-trip
 * exactly, so a parsed plan re-estimates to the same numbers), times as %.9g.
 */
#include "planner/planner_internal.h"
#include "planner/plan_json.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void embd_plan_destroy(struct embd_plan *plan)
{
	if (!plan)
		return;
	for (uint32_t t = 0; plan->tables && t < plan->num_tables; t++)
		free(plan->tables[t].shards);
	free(plan->tables);
	free(plan->ranks);
	free(plan);
}

static void write_topology(struct sbuf *b, const struct embd_topology *t)
{
	sbuf_printf(b, "{\"world_size\": %d, \"local_world_size\": %d, \"compute_device\": \"%s\", "
		    "\"hbm_cap\": %" PRIu64 ", \"ddr_cap\": %" PRIu64 ", \"hbm_mem_bw\": %.17g, "
		    "\"ddr_mem_bw\": %.17g, \"hbm_to_ddr_mem_bw\": %.17g, \"intra_host_bw\": %.17g, "
		    "\"inter_host_bw\": %.17g, \"batch_size\": %u, \"bwd_compute_multiplier\": %.17g, "
		    "\"uvm_caching_ratio\": %.17g, \"storage_reservation\": %.17g}",
		    t->world_size, t->local_world_size, embd_plan_device_name(t->compute_device),
		    t->hbm_cap_bytes, t->ddr_cap_bytes, t->hbm_mem_bw_bytes_per_ms,
		    t->ddr_mem_bw_bytes_per_ms, t->hbm_to_ddr_mem_bw_bytes_per_ms,
		    t->intra_host_bw_bytes_per_ms, t->inter_host_bw_bytes_per_ms, t->batch_size,
		    t->bwd_compute_multiplier, t->uvm_caching_ratio, t->storage_reservation);
}

static void write_body_c_locale(struct sbuf *b, const struct embd_plan *plan);

/*
 * Everything up to (not including) the plan_hash member, printed in the C locale whatever
 * the process set: a decimal comma would break the JSON and the hash.
 */
static void write_body(struct sbuf *b, const struct embd_plan *plan)
{
	locale_t c = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
	if (!c) {
		b->failed = 1;
		return;
	}
	locale_t old = uselocale(c);
	write_body_c_locale(b, plan);
	uselocale(old);
	freelocale(c);
}

static void write_body_c_locale(struct sbuf *b, const struct embd_plan *plan)
{
	sbuf_printf(b, "{\"version\": %u,\n\"topology\": ", plan->version);
	write_topology(b, &plan->topology);
	sbuf_printf(b, ",\n\"tables_hash\": \"%016" PRIx64 "\",\n\"tables\": [", plan->tables_hash);
	for (uint32_t t = 0; t < plan->num_tables; t++) {
		const struct embd_plan_table *pt = &plan->tables[t];
		sbuf_printf(b, "%s\n  {\"name\": ", t ? "," : "");
		sbuf_json_string(b, pt->name);
		sbuf_printf(b, ", \"sharding_type\": \"%s\", \"compute_kernel\": \"%s\", \"shards\": [",
			    embd_plan_sharding_name(pt->sharding_type),
			    embd_plan_kernel_name(pt->compute_kernel));
		for (uint32_t i = 0; i < pt->num_shards; i++) {
			const struct embd_plan_shard *s = &pt->shards[i];
			sbuf_printf(b, "%s{\"rank\": %d, \"row_offset\": %" PRId64 ", \"rows\": %" PRId64
				    ", \"col_offset\": %d, \"cols\": %d}", i ? ", " : "", s->rank,
				    s->row_offset, s->rows, s->col_offset, s->cols);
		}
		sbuf_printf(b, "]}");
	}
	sbuf_printf(b, "\n],\n\"ranks\": [");
	for (int32_t r = 0; plan->ranks && r < plan->topology.world_size; r++) {
		const struct embd_plan_rank *pr = &plan->ranks[r];
		sbuf_printf(b, "%s\n  {\"rank\": %d, \"hbm_bytes\": %" PRIu64 ", \"ddr_bytes\": %" PRIu64
			    ", \"est_time_ms\": %.9g}", r ? "," : "", r, pr->hbm_bytes, pr->ddr_bytes,
			    pr->est_time_ms);
	}
	sbuf_printf(b, "\n],\n\"max_rank_time_ms\": %.9g,\n", plan->max_rank_time_ms);
}

int embd_plan_hash(struct embd_plan *plan, uint64_t *out)
{
	struct sbuf b = { 0 };
	write_body(&b, plan);
	if (b.failed) {
		free(b.data);
		return EMBD_ENOMEM;
	}
	*out = fnv1a64(FNV64_OFFSET, b.data, b.len);
	free(b.data);
	return 0;
}

int embd_plan_write_json(struct embd_plan *plan, char **out, size_t *out_len)
{
	struct sbuf b = { 0 };
	write_body(&b, plan);
	if (!b.failed)
		plan->plan_hash = fnv1a64(FNV64_OFFSET, b.data, b.len);
	sbuf_printf(&b, "\"plan_hash\": \"%016" PRIx64 "\"}\n", plan->plan_hash);
	if (b.failed) {
		free(b.data);
		return EMBD_ENOMEM;
	}
	*out = b.data;
	*out_len = b.len;
	return 0;
}

/* ---- parser ----------------------------------------------------------------------------- */

static int get_int(const cJSON *obj, const char *key, double lo, double hi, double *out,
		   const char *where, char *err, size_t err_len)
{
	const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
	if (!cJSON_IsNumber(item) || item->valuedouble != floor(item->valuedouble) ||
	    !(item->valuedouble >= lo && item->valuedouble <= hi))
		return embd_fail(err, err_len, EMBD_EPARSE,
				   "plan: %s: '%s' must be a whole number in [%.0f, %.0f]", where, key,
				   lo, hi);
	*out = item->valuedouble;
	return 0;
}

static int get_hex(const cJSON *item, const char *key, uint64_t *out, char *err, size_t err_len)
{
	char *end;
	if (!cJSON_IsString(item) || strlen(item->valuestring) != 16 ||
	    (*out = strtoull(item->valuestring, &end, 16), *end))
		return embd_fail(err, err_len, EMBD_EPARSE, "plan: '%s' must be 16 hex digits", key);
	return 0;
}

static int parse_shards(const cJSON *arr, struct embd_plan_table *pt, const char *where,
			char *err, size_t err_len)
{
	if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0)
		return embd_fail(err, err_len, EMBD_EPARSE,
				   "plan: %s: 'shards' must be a non-empty array", where);
	pt->num_shards = (uint32_t)cJSON_GetArraySize(arr);
	pt->shards = calloc(pt->num_shards, sizeof(*pt->shards));
	if (!pt->shards)
		return EMBD_ENOMEM;
	const cJSON *s;
	uint32_t i = 0;
	cJSON_ArrayForEach(s, arr) {
		char at[EMBD_NAME_MAX + 64];
		double v[5];
		snprintf(at, sizeof(at), "%s shards[%u]", where, i);
		if (!cJSON_IsObject(s) || cJSON_GetArraySize(s) != 5)
			return embd_fail(err, err_len, EMBD_EPARSE,
					   "plan: %s: expected {rank, row_offset, rows, col_offset, cols}",
					   at);
		int rc = get_int(s, "rank", 0, INT32_MAX, &v[0], at, err, err_len);
		if (!rc)
			rc = get_int(s, "row_offset", 0, 0x1p50, &v[1], at, err, err_len);
		if (!rc)
			rc = get_int(s, "rows", 0, 0x1p50, &v[2], at, err, err_len);
		if (!rc)
			rc = get_int(s, "col_offset", 0, INT32_MAX / 2, &v[3], at, err, err_len);
		if (!rc)
			rc = get_int(s, "cols", 0, INT32_MAX / 2, &v[4], at, err, err_len);
		if (rc)
			return rc;
		pt->shards[i++] = (struct embd_plan_shard){ (int32_t)v[0], (int64_t)v[1],
							    (int64_t)v[2], (int32_t)v[3], (int32_t)v[4] };
	}
	return 0;
}

static int parse_table(const cJSON *obj, uint32_t index, struct embd_plan_table *pt, char *err,
		       size_t err_len)
{
	char where[EMBD_NAME_MAX + 32];
	snprintf(where, sizeof(where), "tables[%u]", index);
	const cJSON *name = cJSON_GetObjectItemCaseSensitive(obj, "name");
	const cJSON *type = cJSON_GetObjectItemCaseSensitive(obj, "sharding_type");
	const cJSON *kernel = cJSON_GetObjectItemCaseSensitive(obj, "compute_kernel");
	if (!cJSON_IsObject(obj) || cJSON_GetArraySize(obj) != 4)
		return embd_fail(err, err_len, EMBD_EPARSE,
				   "plan: %s: expected {name, sharding_type, compute_kernel, shards}",
				   where);
	if (!cJSON_IsString(name) || !name->valuestring[0] ||
	    strlen(name->valuestring) >= EMBD_NAME_MAX)
		return embd_fail(err, err_len, EMBD_EPARSE, "plan: %s: 'name' must be a string of 1 "
				   "to %d bytes", where, EMBD_NAME_MAX - 1);
	memcpy(pt->name, name->valuestring, strlen(name->valuestring) + 1);
	snprintf(where, sizeof(where), "tables[%u] ('%s')", index, pt->name);
	if (!cJSON_IsString(type) || embd_plan_sharding_from_name(type->valuestring,
								  &pt->sharding_type))
		return embd_fail(err, err_len, EMBD_EPARSE,
				   "plan: %s: 'sharding_type' is not a sharding type", where);
	if (!cJSON_IsString(kernel) || embd_plan_kernel_from_name(kernel->valuestring,
								  &pt->compute_kernel))
		return embd_fail(err, err_len, EMBD_EPARSE,
				   "plan: %s: 'compute_kernel' is not a compute kernel", where);
	return parse_shards(cJSON_GetObjectItemCaseSensitive(obj, "shards"), pt, where, err, err_len);
}

static int parse_root(const cJSON *root, struct embd_plan *plan, char *err, size_t err_len)
{
	if (!cJSON_IsObject(root))
		return embd_fail(err, err_len, EMBD_EPARSE, "plan: expected a JSON object");
	const cJSON *item;
	cJSON_ArrayForEach(item, root) {
		const char *k = item->string;
		if (strcmp(k, "version") && strcmp(k, "topology") && strcmp(k, "tables_hash") &&
		    strcmp(k, "tables") && strcmp(k, "ranks") && strcmp(k, "max_rank_time_ms") &&
		    strcmp(k, "plan_hash"))
			return embd_fail(err, err_len, EMBD_EPARSE, "plan: unknown field '%s'", k);
	}
	double version;
	int rc = get_int(root, "version", 0, 1e9, &version, "top level", err, err_len);
	if (rc)
		return rc;
	if (version != PLAN_SCHEMA_VERSION)
		return embd_fail(err, err_len, EMBD_EPARSE, "plan: version %.0f, this build reads %d",
				   version, PLAN_SCHEMA_VERSION);
	plan->version = PLAN_SCHEMA_VERSION;
	rc = embd_plan_topology_parse(cJSON_GetObjectItemCaseSensitive(root, "topology"),
				      &plan->topology, err, err_len);
	if (rc)
		return rc;
	if ((item = cJSON_GetObjectItemCaseSensitive(root, "tables_hash")) &&
	    (rc = get_hex(item, "tables_hash", &plan->tables_hash, err, err_len)))
		return rc;
	if ((item = cJSON_GetObjectItemCaseSensitive(root, "plan_hash")) &&
	    (rc = get_hex(item, "plan_hash", &plan->plan_hash, err, err_len)))
		return rc;
	const cJSON *tables = cJSON_GetObjectItemCaseSensitive(root, "tables");
	if (!cJSON_IsArray(tables) || cJSON_GetArraySize(tables) == 0)
		return embd_fail(err, err_len, EMBD_EPARSE, "plan: 'tables' must be a non-empty array");
	plan->tables = calloc((size_t)cJSON_GetArraySize(tables), sizeof(*plan->tables));
	if (!plan->tables)
		return EMBD_ENOMEM;
	cJSON_ArrayForEach(item, tables) {
		rc = parse_table(item, plan->num_tables, &plan->tables[plan->num_tables], err, err_len);
		plan->num_tables++;     /* counted even on failure, so destroy frees its shards */
		if (rc)
			return rc;
	}
	/* ranks[] and max_rank_time_ms are estimates: embd_plan_check recomputes them */
	return 0;
}

int embd_plan_parse_json(const char *text, size_t len, struct embd_plan **out, char *err,
			 size_t err_len)
{
	struct embd_plan *plan = NULL;
	cJSON *root;
	int rc;

	*out = NULL;
	rc = embd_plan_json_parse(text, len, "plan", &root, err, err_len);
	if (rc)
		return rc;
	plan = calloc(1, sizeof(*plan));
	rc = plan ? parse_root(root, plan, err, err_len) : EMBD_ENOMEM;
	cJSON_Delete(root);
	if (rc) {
		embd_plan_destroy(plan);
		return rc;
	}
	*out = plan;
	return 0;
}

int embd_plan_load(const char *path, struct embd_plan **out, char *err, size_t err_len)
{
	char *text = NULL;
	size_t len = 0;
	int rc = embd_read_file(path, &text, &len, err, err_len);
	*out = NULL;
	if (rc)
		return rc;
	rc = embd_plan_parse_json(text, len, out, err, err_len);
	if (rc)
		planner_prefix_err(err, err_len, path);
	free(text);
	return rc;
}
