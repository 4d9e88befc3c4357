/*
 * Topology: TorchRec's defaults, one field table that both the JSON parser and embctl's
 * flags go through (so a field has one name, one unit and one range everywhere), the byte and
 * bandwidth suffixes, and the enum <-> name tables of the planner's vocabulary.
 */
#include "planner/planner_internal.h"
#include "planner/plan_json.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GIB (1024.0 * 1024.0 * 1024.0)

static const char *const sharding_names[EMBD_SHARD_COUNT] = {
	"table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise",
	"data_parallel",
};
static const char *const kernel_names[EMBD_KERNEL_COUNT] = {
	"dense", "fused", "fused_uvm", "fused_uvm_caching",
};

const char *embd_plan_sharding_name(enum embd_sharding_type type)
{
	return (unsigned)type < EMBD_SHARD_COUNT ? sharding_names[type] : NULL;
}

const char *embd_plan_kernel_name(enum embd_compute_kernel kernel)
{
	return (unsigned)kernel < EMBD_KERNEL_COUNT ? kernel_names[kernel] : NULL;
}

const char *embd_plan_device_name(enum embd_compute_device device)
{
	return device == EMBD_DEVICE_CPU ? "cpu" : device == EMBD_DEVICE_CUDA ? "cuda" : NULL;
}

int embd_plan_sharding_from_name(const char *name, enum embd_sharding_type *out)
{
	for (int i = 0; i < EMBD_SHARD_COUNT; i++)
		if (name && !strcmp(name, sharding_names[i])) {
			*out = (enum embd_sharding_type)i;
			return 0;
		}
	return EMBD_EINVAL;
}

int embd_plan_kernel_from_name(const char *name, enum embd_compute_kernel *out)
{
	for (int i = 0; i < EMBD_KERNEL_COUNT; i++)
		if (name && !strcmp(name, kernel_names[i])) {
			*out = (enum embd_compute_kernel)i;
			return 0;
		}
	return EMBD_EINVAL;
}

void embd_plan_topology_default(struct embd_topology *topo, int32_t world_size)
{
	*topo = (struct embd_topology){
		.world_size = world_size,
		.local_world_size = world_size,
		.compute_device = EMBD_DEVICE_CUDA,
		.hbm_cap_bytes = 32ull << 30,
		.ddr_cap_bytes = 128ull << 30,
		.hbm_mem_bw_bytes_per_ms = 897 * GIB / 1000,
		.ddr_mem_bw_bytes_per_ms = 51 * GIB / 1000,
		.hbm_to_ddr_mem_bw_bytes_per_ms = 32 * GIB / 1000,
		.intra_host_bw_bytes_per_ms = 600 * GIB / 1000,
		.inter_host_bw_bytes_per_ms = 12.5 * GIB / 1000,
		.batch_size = 512,
		.bwd_compute_multiplier = 2,
		.uvm_caching_ratio = 0.2,
		.storage_reservation = 0.15,
	};
}

enum field_kind { F_INT, F_BYTES, F_BW, F_REAL, F_DEVICE };

struct field {
	const char *name;
	enum field_kind kind;
	size_t offset;
	double min, max;        /* accepted range of the stored value */
};

#define FIELD(n, k, member, lo, hi) { n, k, offsetof(struct embd_topology, member), lo, hi }
static const struct field fields[] = {
	FIELD("world_size", F_INT, world_size, 1, 1 << 20),
	FIELD("local_world_size", F_INT, local_world_size, 1, 1 << 20),
	FIELD("compute_device", F_DEVICE, compute_device, 0, 1),
	FIELD("hbm_cap", F_BYTES, hbm_cap_bytes, 1, 0x1p62),
	FIELD("ddr_cap", F_BYTES, ddr_cap_bytes, 0, 0x1p62),
	FIELD("hbm_mem_bw", F_BW, hbm_mem_bw_bytes_per_ms, 1e-3, 1e15),
	FIELD("ddr_mem_bw", F_BW, ddr_mem_bw_bytes_per_ms, 1e-3, 1e15),
	FIELD("hbm_to_ddr_mem_bw", F_BW, hbm_to_ddr_mem_bw_bytes_per_ms, 1e-3, 1e15),
	FIELD("intra_host_bw", F_BW, intra_host_bw_bytes_per_ms, 1e-3, 1e15),
	FIELD("inter_host_bw", F_BW, inter_host_bw_bytes_per_ms, 1e-3, 1e15),
	FIELD("batch_size", F_INT, batch_size, 1, 1 << 24),
	FIELD("bwd_compute_multiplier", F_REAL, bwd_compute_multiplier, 0, 1e6),
	FIELD("uvm_caching_ratio", F_REAL, uvm_caching_ratio, 1e-6, 1),
	FIELD("storage_reservation", F_REAL, storage_reservation, 0, 0.99),
};
#define NUM_FIELDS (sizeof(fields) / sizeof(fields[0]))

const char *embd_plan_topology_field(size_t i)
{
	return i < NUM_FIELDS ? fields[i].name : NULL;
}

/*
 * "16G", "512MB", "1.5TiB", "25GB/s", "963146090.5". K/M/G/T are binary, as TorchRec's
 * constants (897 GB/s = 897 * 1024^3 B/s). A value with a unit is per second; a bare number
 * is bytes, or for bandwidths bytes per ms (the unit TorchRec's Topology takes).
 */
static int parse_quantity(const char *text, enum field_kind kind, double *out)
{
	char *end;
	double v = strtod(text, &end);
	if (end == text || !isfinite(v) || v < 0)
		return EMBD_EINVAL;
	double scale = 1;
	bool unit = false;
	switch (toupper((unsigned char)*end)) {
	case 'K': scale = 1024.0; break;
	case 'M': scale = 1024.0 * 1024; break;
	case 'G': scale = GIB; break;
	case 'T': scale = GIB * 1024; break;
	default: break;
	}
	if (scale != 1) {
		end++;
		unit = true;
		if (*end == 'i')
			end++;
	}
	if (*end == 'B') {
		end++;
		unit = true;
	}
	if (kind == F_BW && !strcmp(end, "/s")) {
		end += 2;
		unit = true;
	}
	if (*end)
		return EMBD_EINVAL;
	v *= scale;
	if (kind == F_BW && unit)
		v /= 1000;      /* per second -> per ms */
	*out = v;
	return 0;
}

static const struct field *find_field(const char *name)
{
	for (size_t i = 0; i < NUM_FIELDS; i++)
		if (!strcmp(fields[i].name, name))
			return &fields[i];
	return NULL;
}

static int store(struct embd_topology *topo, const struct field *f, double v, char *err,
		 size_t err_len)
{
	if (!(v >= f->min && v <= f->max))
		return embd_fail(err, err_len, EMBD_EINVAL,
				   "topology field '%s': %.17g is outside [%g, %g]", f->name, v,
				   f->min, f->max);
	if ((f->kind == F_INT || f->kind == F_BYTES) && v != floor(v))
		return embd_fail(err, err_len, EMBD_EINVAL,
				   "topology field '%s': %.17g is not a whole number", f->name, v);
	char *p = (char *)topo + f->offset;
	switch (f->kind) {
	case F_INT:
		if (f->offset == offsetof(struct embd_topology, batch_size))
			*(uint32_t *)p = (uint32_t)v;
		else
			*(int32_t *)p = (int32_t)v;
		break;
	case F_BYTES: *(uint64_t *)p = (uint64_t)v; break;
	case F_DEVICE: *(enum embd_compute_device *)p = (enum embd_compute_device)v; break;
	default: *(double *)p = v; break;
	}
	return 0;
}

int embd_plan_topology_set(struct embd_topology *topo, const char *field, const char *value,
			   char *err, size_t err_len)
{
	const struct field *f = find_field(field);
	if (!f)
		return embd_fail(err, err_len, EMBD_EINVAL, "unknown topology field '%s'", field);
	double v;
	if (f->kind == F_DEVICE) {
		if (!strcmp(value, "cpu"))
			v = EMBD_DEVICE_CPU;
		else if (!strcmp(value, "cuda"))
			v = EMBD_DEVICE_CUDA;
		else
			return embd_fail(err, err_len, EMBD_EINVAL,
					   "topology field 'compute_device': '%s' is not cpu or cuda",
					   value);
	} else if (f->kind == F_INT || f->kind == F_REAL) {
		char *end;
		v = strtod(value, &end);
		if (end == value || *end)
			return embd_fail(err, err_len, EMBD_EINVAL,
					   "topology field '%s': '%s' is not a number", field, value);
	} else if (parse_quantity(value, f->kind, &v)) {
		return embd_fail(err, err_len, EMBD_EINVAL,
				   "topology field '%s': cannot read '%s' (examples: %s)", field, value,
				   f->kind == F_BW ? "25GB/s, 900G, 963146090.5 bytes/ms" :
						     "16G, 512M, 1073741824");
	}
	return store(topo, f, v, err, err_len);
}

int embd_plan_topology_parse(const struct cJSON *object, struct embd_topology *topo,
			     char *err, size_t err_len)
{
	if (!cJSON_IsObject(object))
		return embd_fail(err, err_len, EMBD_EPARSE, "topology: expected a JSON object");
	embd_plan_topology_default(topo, 1);
	bool local_given = false;
	const cJSON *item;
	cJSON_ArrayForEach(item, object) {
		const struct field *f = item->string ? find_field(item->string) : NULL;
		if (!f)
			return embd_fail(err, err_len, EMBD_EPARSE, "topology: unknown field '%s'",
					   item->string ? item->string : "");
		int rc;
		if (cJSON_IsString(item))
			rc = embd_plan_topology_set(topo, f->name, item->valuestring, err, err_len);
		else if (cJSON_IsNumber(item) && f->kind != F_DEVICE)
			rc = store(topo, f, item->valuedouble, err, err_len);
		else
			rc = embd_fail(err, err_len, EMBD_EPARSE,
					 "topology field '%s': expected a %s", f->name,
					 f->kind == F_DEVICE ? "string" : "number or string");
		if (rc)
			return rc == EMBD_EINVAL ? EMBD_EPARSE : rc;
		local_given |= f->offset == offsetof(struct embd_topology, local_world_size);
	}
	if (!local_given)
		topo->local_world_size = topo->world_size;
	return embd_plan_topology_validate(topo, err, err_len) ? EMBD_EPARSE : 0;
}

int embd_plan_topology_validate(const struct embd_topology *topo, char *err, size_t err_len)
{
	for (size_t i = 0; i < NUM_FIELDS; i++) {
		const struct field *f = &fields[i];
		const char *p = (const char *)topo + f->offset;
		double v;
		switch (f->kind) {
		case F_INT:
			if (f->offset == offsetof(struct embd_topology, batch_size))
				v = *(const uint32_t *)p;
			else
				v = *(const int32_t *)p;
			break;
		case F_BYTES: v = (double)*(const uint64_t *)p; break;
		case F_DEVICE: v = *(const enum embd_compute_device *)p; break;
		default: v = *(const double *)p; break;
		}
		if (!(v >= f->min && v <= f->max))
			return embd_fail(err, err_len, EMBD_EINVAL,
					   "topology field '%s': %.17g is outside [%g, %g]", f->name,
					   v, f->min, f->max);
	}
	if (topo->local_world_size > topo->world_size ||
	    topo->world_size % topo->local_world_size)
		return embd_fail(err, err_len, EMBD_EINVAL,
				   "topology: world_size %d is not a multiple of local_world_size %d",
				   topo->world_size, topo->local_world_size);
	return 0;
}

int embd_plan_topology_load(const char *path, struct embd_topology *topo, char *err,
			    size_t err_len)
{
	char *text = NULL;
	size_t len = 0;
	cJSON *root = NULL;
	int rc = embd_read_file(path, &text, &len, err, err_len);
	if (rc)
		return rc;
	rc = embd_plan_json_parse(text, len, path, &root, err, err_len);
	if (!rc)
		rc = embd_plan_topology_parse(root, topo, err, err_len);
	if (rc && root)
		planner_prefix_err(err, err_len, path);
	cJSON_Delete(root);
	free(text);
	return rc;
}
