/*
 * The tables file: a JSON array of TorchRec-like table configs with optional
 * ParameterConstraints (format in plan.h). Every key is checked, unknown keys are errors,
 * and every error names the table (index and name) and the field, so an operator can find
 * the line. The service's config embeds the same array and calls embd_plan_tables_parse.
 */
#include "planner/planner_internal.h"
#include "planner/plan_json.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS (1ll << 40)
#define MAX_DIM 65536

struct ctx {
	char *err;
	size_t err_len;
	uint32_t index;
	const char *name;
};

__attribute__((format(printf, 2, 3)))
static int fail(const struct ctx *x, const char *fmt, ...)
{
	char what[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	return embd_fail(x->err, x->err_len, EMBD_EPARSE, "table %u ('%s'): %s", x->index,
			   x->name, what);
}

static int get_name(const struct ctx *x, const cJSON *item, const char *field, char *out)
{
	if (!cJSON_IsString(item))
		return fail(x, "'%s' must be a string", field);
	size_t n = strlen(item->valuestring);
	if (n == 0 || n >= EMBD_NAME_MAX)
		return fail(x, "'%s' must have 1 to %d bytes, has %zu", field, EMBD_NAME_MAX - 1, n);
	memcpy(out, item->valuestring, n + 1);
	return 0;
}

static int get_number(const struct ctx *x, const cJSON *item, const char *field, double lo,
		      double hi, bool integral, double *out)
{
	*out = 0; /* callers convert *out before they test the result */
	if (!cJSON_IsNumber(item))
		return fail(x, "'%s' must be a number", field);
	double v = item->valuedouble;
	if (!(v >= lo && v <= hi))
		return fail(x, "'%s' = %.17g is outside [%g, %g]", field, v, lo, hi);
	if (integral && v != floor(v))
		return fail(x, "'%s' = %.17g is not a whole number", field, v);
	*out = v;
	return 0;
}

/* An array of names mapped to a bitmask through from_name. */
static int get_mask(const struct ctx *x, const cJSON *item, const char *field,
		    int (*from_name)(const char *, int *), uint32_t *mask)
{
	if (!cJSON_IsArray(item) || cJSON_GetArraySize(item) == 0)
		return fail(x, "constraint '%s' must be a non-empty array of names", field);
	const cJSON *e;
	int i = 0;
	*mask = 0;
	cJSON_ArrayForEach(e, item) {
		int v;
		if (!cJSON_IsString(e) || from_name(e->valuestring, &v))
			return fail(x, "constraint '%s'[%d]: unknown value %s%s%s", field, i,
				    cJSON_IsString(e) ? "'" : "",
				    cJSON_IsString(e) ? e->valuestring : "(not a string)",
				    cJSON_IsString(e) ? "'" : "");
		*mask |= 1u << v;
		i++;
	}
	return 0;
}

static int sharding_from_name(const char *name, int *out)
{
	enum embd_sharding_type t;
	int rc = embd_plan_sharding_from_name(name, &t);
	*out = (int)t;
	return rc;
}

static int kernel_from_name(const char *name, int *out)
{
	enum embd_compute_kernel k;
	int rc = embd_plan_kernel_from_name(name, &k);
	*out = (int)k;
	return rc;
}

/* A per-feature array of numbers: one value for each of the table's features. */
static int get_per_feature(const struct ctx *x, const cJSON *item, const char *field,
			   uint32_t features, double lo, double hi, bool integral, double *out,
			   uint32_t *count)
{
	if (!cJSON_IsArray(item))
		return fail(x, "constraint '%s' must be an array", field);
	int n = cJSON_GetArraySize(item);
	if (n != (int)features)
		return fail(x, "constraint '%s' has %d values, the table has %u features", field, n,
			    features);
	const cJSON *e;
	int i = 0;
	cJSON_ArrayForEach(e, item) {
		char name[64];
		snprintf(name, sizeof(name), "%s[%d]", field, i);
		int rc = get_number(x, e, name, lo, hi, integral, &out[i]);
		if (rc)
			return rc;
		i++;
	}
	*count = (uint32_t)n;
	return 0;
}

static int parse_constraints(const struct ctx *x, const cJSON *obj, uint32_t features,
			     struct embd_table_constraints *c)
{
	if (!cJSON_IsObject(obj))
		return fail(x, "'constraints' must be an object");
	const cJSON *item;
	cJSON_ArrayForEach(item, obj) {
		const char *k = item->string;
		double v, tmp[EMBD_TABLE_FEATURES_MAX];
		int rc;
		if (!strcmp(k, "sharding_types")) {
			rc = get_mask(x, item, k, sharding_from_name, &c->sharding_types);
		} else if (!strcmp(k, "compute_kernels")) {
			rc = get_mask(x, item, k, kernel_from_name, &c->compute_kernels);
		} else if (!strcmp(k, "min_partition")) {
			rc = get_number(x, item, "constraints.min_partition", 1, MAX_DIM, true, &v);
			c->min_partition = (int32_t)v;
		} else if (!strcmp(k, "pooling_factors")) {
			rc = get_per_feature(x, item, k, features, 0, 1e6, false, c->pooling_factors,
					     &c->num_pooling_factors);
		} else if (!strcmp(k, "num_poolings")) {
			rc = get_per_feature(x, item, k, features, 0, 1e6, false, c->num_poolings,
					     &c->num_num_poolings);
		} else if (!strcmp(k, "batch_sizes")) {
			rc = get_per_feature(x, item, k, features, 1, 1 << 24, true, tmp,
					     &c->num_batch_sizes);
			for (uint32_t i = 0; !rc && i < c->num_batch_sizes; i++)
				c->batch_sizes[i] = (uint32_t)tmp[i];
		} else if (!strcmp(k, "is_weighted")) {
			rc = cJSON_IsBool(item) ? 0 : fail(x, "'constraints.is_weighted' must be a bool");
			c->is_weighted = cJSON_IsTrue(item);
		} else {
			rc = fail(x, "unknown constraint '%s'", k);
		}
		if (rc)
			return rc;
	}
	return 0;
}

/* One optimizer hyperparameter's range, open or closed at each end. The kernels compute in
 * fp32, so the value is checked again as they will see it: 0.999999999 is 1 in fp32. */
struct hyper {
	const char *name;
	size_t offset;                  /* its float in struct embd_optimizer_spec */
	double lo, hi;
	bool lo_open, hi_open;
};

#define HYPER(f) #f, offsetof(struct embd_optimizer_spec, f)

/* lr 0 trains nothing; eps 0 divides adagrad's and adam's step by sqrt(0); a beta of 1 never
 * forgets (adam's bias correction 1 - beta^t is then 0: NaN after one step); a negative
 * weight decay grows every row it touches. */
static const struct hyper hypers[] = {
	{ HYPER(lr), 0, 1e6, true, false },
	{ HYPER(eps), 0, 1e6, true, false },
	{ HYPER(beta1), 0, 1, false, true },
	{ HYPER(beta2), 0, 1, false, true },
	{ HYPER(weight_decay), 0, 1e6, false, false },
};

static bool in_range(const struct hyper *h, double v)
{
	return (h->lo_open ? v > h->lo : v >= h->lo) && (h->hi_open ? v < h->hi : v <= h->hi);
}

static int get_hyper(const struct ctx *x, const struct hyper *h, const cJSON *item,
		     struct embd_optimizer_spec *o)
{
	char range[64];

	snprintf(range, sizeof(range), "%c%g, %g%c", h->lo_open ? '(' : '[', h->lo, h->hi,
		 h->hi_open ? ')' : ']');
	if (!cJSON_IsNumber(item))
		return fail(x, "'optimizer.%s' must be a number", h->name);
	double v = item->valuedouble;
	float f = (float)v;
	if (!in_range(h, v))
		return fail(x, "'optimizer.%s' = %.17g is outside %s", h->name, v, range);
	if (!in_range(h, f))
		return fail(x, "'optimizer.%s' = %.17g is %.9g in fp32, outside %s", h->name, v,
			    (double)f, range);
	memcpy((char *)o + h->offset, &f, sizeof(f));
	return 0;
}

static int parse_optimizer(const struct ctx *x, const cJSON *obj, struct embd_optimizer_spec *o)
{
	static const char *const names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };
	if (!cJSON_IsObject(obj))
		return fail(x, "'optimizer' must be an object");
	const cJSON *type = cJSON_GetObjectItemCaseSensitive(obj, "type");
	if (!cJSON_IsString(type))
		return fail(x, "'optimizer.type' must be one of sgd, adagrad, rowwise_adagrad, adam");
	int t = -1;
	for (int i = 0; i < 4; i++)
		if (!strcmp(type->valuestring, names[i]))
			t = i;
	if (t < 0)
		return fail(x, "'optimizer.type' '%s' is not sgd, adagrad, rowwise_adagrad or adam",
			    type->valuestring);
	o->type = (enum embd_optimizer_type)t;
	const cJSON *item;
	cJSON_ArrayForEach(item, obj) {
		const struct hyper *h = NULL;
		if (!strcmp(item->string, "type"))
			continue;
		for (size_t i = 0; i < sizeof(hypers) / sizeof(hypers[0]); i++)
			if (!strcmp(item->string, hypers[i].name))
				h = &hypers[i];
		if (!h)
			return fail(x, "unknown optimizer field '%s'", item->string);
		int rc = get_hyper(x, h, item, o);
		if (rc)
			return rc;
	}
	return 0;
}

static int parse_table(struct ctx *x, const cJSON *obj, struct embd_table_spec *t,
		       struct embd_table_constraints *c)
{
	if (!cJSON_IsObject(obj))
		return fail(x, "expected an object");
	const cJSON *name = cJSON_GetObjectItemCaseSensitive(obj, "name");
	int rc = get_name(x, name, "name", t->name);
	if (rc)
		return rc;
	x->name = t->name;
	t->optimizer = (struct embd_optimizer_spec){ .type = EMBD_OPT_SGD, .lr = 0.01f,
						     .eps = 1e-8f, .beta1 = 0.9f, .beta2 = 0.999f };
	bool rows_seen = false, dim_seen = false;
	const cJSON *item, *constraints = NULL;
	cJSON_ArrayForEach(item, obj) {
		const char *k = item->string;
		double v;
		if (!strcmp(k, "name")) {
			continue;
		} else if (!strcmp(k, "num_embeddings")) {
			rc = get_number(x, item, k, 1, (double)MAX_ROWS, true, &v);
			t->num_embeddings = (int64_t)v;
			rows_seen = true;
		} else if (!strcmp(k, "embedding_dim")) {
			rc = get_number(x, item, k, 1, MAX_DIM, true, &v);
			t->embedding_dim = (int32_t)v;
			dim_seen = true;
		} else if (!strcmp(k, "pooling")) {
			bool sum = cJSON_IsString(item) && !strcmp(item->valuestring, "sum");
			bool mean = cJSON_IsString(item) && !strcmp(item->valuestring, "mean");
			rc = sum || mean ? 0 : fail(x, "'pooling' must be \"sum\" or \"mean\"");
			t->pooling = mean ? EMBD_POOLING_MEAN : EMBD_POOLING_SUM;
		} else if (!strcmp(k, "data_type")) {
			bool f32 = cJSON_IsString(item) && !strcmp(item->valuestring, "fp32");
			bool f16 = cJSON_IsString(item) && !strcmp(item->valuestring, "fp16");
			rc = f32 || f16 ? 0 : fail(x, "'data_type' must be \"fp32\" or \"fp16\"");
			t->data_type = f16 ? EMBD_DTYPE_FP16 : EMBD_DTYPE_FP32;
		} else if (!strcmp(k, "feature_names")) {
			int n = cJSON_IsArray(item) ? cJSON_GetArraySize(item) : 0;
			if (n < 1 || n > EMBD_TABLE_FEATURES_MAX)
				return fail(x, "'feature_names' must be an array of 1 to %d names",
					    EMBD_TABLE_FEATURES_MAX);
			const cJSON *e;
			t->num_features = 0;
			cJSON_ArrayForEach(e, item) {
				char field[32];
				snprintf(field, sizeof(field), "feature_names[%u]", t->num_features);
				rc = get_name(x, e, field, t->feature_names[t->num_features++]);
				if (rc)
					return rc;
			}
		} else if (!strcmp(k, "optimizer")) {
			rc = parse_optimizer(x, item, &t->optimizer);
		} else if (!strcmp(k, "constraints")) {
			constraints = item;     /* after feature_names: per-feature arrays */
		} else {
			rc = fail(x, "unknown field '%s'", k);
		}
		if (rc)
			return rc;
	}
	if (!rows_seen || !dim_seen)
		return fail(x, "'%s' is required", rows_seen ? "embedding_dim" : "num_embeddings");
	if (t->num_features == 0) {
		t->num_features = 1;
		memcpy(t->feature_names[0], t->name, sizeof(t->name));
	}
	return constraints ? parse_constraints(x, constraints, t->num_features, c) : 0;
}

static int compare_names(const void *a, const void *b)
{
	return strcmp((*(const struct embd_table_spec *const *)a)->name,
		      (*(const struct embd_table_spec *const *)b)->name);
}

struct feature_ref {
	const char *name;
	uint32_t table;
};

static int compare_features(const void *a, const void *b)
{
	const struct feature_ref *x = a, *y = b;
	int c = strcmp(x->name, y->name);

	return c ? c : (x->table > y->table) - (x->table < y->table);
}

/* A feature is looked up in one table: a batch's column of that name has one table to go to,
 * and the layout a trainer gets at WELCOME names each feature once. */
static int check_features(const struct embd_tables *t, char *err, size_t err_len)
{
	uint32_t n = 0;
	int rc = 0;

	for (uint32_t i = 0; i < t->count; i++)
		n += t->specs[i].num_features;
	struct feature_ref *f = calloc(n, sizeof(*f));
	if (!f)
		return EMBD_ENOMEM;
	n = 0;
	for (uint32_t i = 0; i < t->count; i++)
		for (uint32_t k = 0; k < t->specs[i].num_features; k++)
			f[n++] = (struct feature_ref){ t->specs[i].feature_names[k], i };
	qsort(f, n, sizeof(*f), compare_features);
	for (uint32_t k = 1; k < n && !rc; k++) {
		uint32_t a = f[k - 1].table, b = f[k].table;
		if (strcmp(f[k - 1].name, f[k].name))
			continue;
		if (a == b)
			rc = embd_fail(err, err_len, EMBD_EPARSE,
				       "table %u ('%s'): feature '%s' is listed twice", a,
				       t->specs[a].name, f[k].name);
		else
			rc = embd_fail(err, err_len, EMBD_EPARSE,
				       "feature '%s' is in table %u ('%s') and table %u ('%s'): a "
				       "feature looks up one table", f[k].name, a, t->specs[a].name,
				       b, t->specs[b].name);
	}
	free(f);
	return rc;
}

int embd_plan_tables_parse(const struct cJSON *array, struct embd_tables *out, char *err,
			   size_t err_len)
{
	struct embd_tables t = { 0 };
	const struct embd_table_spec **sorted = NULL;
	int rc = 0;

	*out = (struct embd_tables){ 0 };
	if (!cJSON_IsArray(array))
		return embd_fail(err, err_len, EMBD_EPARSE, "tables: expected a JSON array");
	int n = cJSON_GetArraySize(array);
	if (n == 0)
		return embd_fail(err, err_len, EMBD_EPARSE, "tables: the array is empty");
	t.specs = calloc((size_t)n, sizeof(*t.specs));
	t.constraints = calloc((size_t)n, sizeof(*t.constraints));
	sorted = calloc((size_t)n, sizeof(*sorted));
	if (!t.specs || !t.constraints || !sorted) {
		rc = EMBD_ENOMEM;
		goto out;
	}
	const cJSON *obj;
	cJSON_ArrayForEach(obj, array) {
		struct ctx x = { err, err_len, t.count, "" };
		rc = parse_table(&x, obj, &t.specs[t.count], &t.constraints[t.count]);
		if (rc)
			goto out;
		sorted[t.count] = &t.specs[t.count];
		t.count++;
	}
	qsort(sorted, t.count, sizeof(*sorted), compare_names);
	for (uint32_t i = 1; i < t.count; i++)
		if (!strcmp(sorted[i - 1]->name, sorted[i]->name)) {
			rc = embd_fail(err, err_len, EMBD_EPARSE,
					 "tables %td and %td are both named '%s'",
					 sorted[i - 1] - t.specs, sorted[i] - t.specs, sorted[i]->name);
			goto out;
		}
	rc = check_features(&t, err, err_len);
	if (!rc)
		*out = t;
out:
	free(sorted);
	if (rc)
		embd_plan_tables_free(&t);
	return rc;
}

int embd_plan_tables_parse_text(const char *text, size_t len, struct embd_tables *out,
				char *err, size_t err_len)
{
	cJSON *root;
	int rc = embd_plan_json_parse(text, len, "tables", &root, err, err_len);
	if (rc) {
		*out = (struct embd_tables){ 0 };
		return rc;
	}
	/* {"tables": [...]}: the form other tools write and the service config's key; any other
	 * key (a whole config's topology, say) would be silently dropped, so it is refused */
	const cJSON *array = root;
	if (cJSON_IsObject(root)) {
		array = NULL;
		for (const cJSON *k = root->child; k && !rc; k = k->next) {
			if (strcmp(k->string, "tables"))
				rc = embd_fail(err, err_len, EMBD_EPARSE, "tables: an object must hold "
					       "only the key \"tables\", not '%s'", k->string);
			else if (array)
				rc = embd_fail(err, err_len, EMBD_EPARSE, "tables: \"tables\" given twice");
			array = k;
		}
		if (!rc && !array)
			rc = embd_fail(err, err_len, EMBD_EPARSE, "tables: the object has no key "
				       "\"tables\"");
	}
	if (rc)
		*out = (struct embd_tables){ 0 };
	else
		rc = embd_plan_tables_parse(array, out, err, err_len);
	cJSON_Delete(root);
	return rc;
}

int embd_plan_tables_load(const char *path, struct embd_tables *out, char *err, size_t err_len)
{
	char *text = NULL;
	size_t len = 0;
	int rc = embd_read_file(path, &text, &len, err, err_len);
	if (rc) {
		*out = (struct embd_tables){ 0 };
		return rc;
	}
	rc = embd_plan_tables_parse_text(text, len, out, err, err_len);
	if (rc)
		planner_prefix_err(err, err_len, path);
	free(text);
	return rc;
}

void embd_plan_tables_free(struct embd_tables *tables)
{
	if (!tables)
		return;
	free(tables->specs);
	free(tables->constraints);
	*tables = (struct embd_tables){ 0 };
}

static uint32_t float_bits(float f)
{
	uint32_t bits;
	memcpy(&bits, &f, sizeof(bits));
	return bits;
}

uint64_t embd_plan_tables_hash(const struct embd_table_spec *tables, uint32_t num_tables)
{
	/* Field by field in a fixed text form (floats as their bits, so no locale or rounding
	 * enters), never the struct's padding. */
	uint64_t h = FNV64_OFFSET;
	for (uint32_t i = 0; i < num_tables; i++) {
		const struct embd_table_spec *t = &tables[i];
		const struct embd_optimizer_spec *o = &t->optimizer;
		char buf[256];
		int n = snprintf(buf, sizeof(buf), "%s|%lld|%d|%d|%d|%d|%08x|%08x|%08x|%08x|%08x|%u",
				 t->name, (long long)t->num_embeddings, t->embedding_dim,
				 (int)t->pooling, (int)t->data_type, (int)o->type, float_bits(o->lr),
				 float_bits(o->eps), float_bits(o->beta1), float_bits(o->beta2),
				 float_bits(o->weight_decay), t->num_features);
		h = fnv1a64(h, buf, (size_t)n);
		for (uint32_t f = 0; f < t->num_features && f < EMBD_TABLE_FEATURES_MAX; f++)
			h = fnv1a64(h, t->feature_names[f], strlen(t->feature_names[f]) + 1);
	}
	return h;
}
