/*
 * dist/collective_plan.c - embd_collective_plan (dist/collective_plan.h): node 0's plan
 * becomes every node's, or every node refuses, each saying which field differs.
 *
 * The idea: each node describes what it was configured with as a JSON join record (the
 * tables field by field, the topology in the planner's own JSON form, sizes, backend) and
 * the records are compared by one generic walk over the two JSON trees, so a new field is
 * compared without new code and the message is the field's path: "table 'user'
 * num_embeddings 1000 here, 2000 on node 0". Node 0 compares every joiner's record and a
 * joiner compares node 0's, so both sides report; node 0 then publishes the outcome that all
 * nodes return. Store keys and the exchange are listed in rendezvous.h.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"
#include "dist/collective_plan.h"
#include "dist/store.h"

#define MSG_MAX 1024
#define OK "ok"

/* ---- join records ---------------------------------------------------------------------- */

static const char *pooling_name(enum embd_pooling p)
{
	return p == EMBD_POOLING_MEAN ? "mean" : "sum";
}

static const char *dtype_name(enum embd_data_type t)
{
	return t == EMBD_DTYPE_FP16 ? "fp16" : "fp32";
}

static const char *optimizer_name(enum embd_optimizer_type t)
{
	static const char *const names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };
	return (unsigned)t < sizeof(names) / sizeof(names[0]) ? names[t] : "unknown";
}

/* The topology as the planner writes it in plan JSON (one writer, the planner's). */
static cJSON *topology_json(const struct embd_topology *topo)
{
	struct embd_plan empty = { .version = 1, .topology = *topo };
	char *text = NULL;
	size_t len = 0;
	if (embd_plan_write_json(&empty, &text, &len) < 0)
		return NULL;
	cJSON *root = cJSON_ParseWithLength(text, len);
	free(text);
	cJSON *t = root ? cJSON_DetachItemFromObjectCaseSensitive(root, "topology") : NULL;
	cJSON_Delete(root);
	return t;
}

static cJSON *table_json(const struct embd_table_spec *t)
{
	cJSON *o = cJSON_CreateObject(), *opt = cJSON_CreateObject(), *f = cJSON_CreateArray();
	if (!o || !opt || !f) {
		cJSON_Delete(o);
		cJSON_Delete(opt);
		cJSON_Delete(f);
		return NULL;
	}
	cJSON_AddStringToObject(o, "name", t->name);
	cJSON_AddNumberToObject(o, "num_embeddings", (double)t->num_embeddings);
	cJSON_AddNumberToObject(o, "embedding_dim", t->embedding_dim);
	cJSON_AddStringToObject(o, "pooling", pooling_name(t->pooling));
	cJSON_AddStringToObject(o, "data_type", dtype_name(t->data_type));
	cJSON_AddStringToObject(opt, "type", optimizer_name(t->optimizer.type));
	cJSON_AddNumberToObject(opt, "lr", t->optimizer.lr);
	cJSON_AddNumberToObject(opt, "eps", t->optimizer.eps);
	cJSON_AddNumberToObject(opt, "beta1", t->optimizer.beta1);
	cJSON_AddNumberToObject(opt, "beta2", t->optimizer.beta2);
	cJSON_AddNumberToObject(opt, "weight_decay", t->optimizer.weight_decay);
	cJSON_AddItemToObject(o, "optimizer", opt);
	for (uint32_t i = 0; i < t->num_features && i < EMBD_TABLE_FEATURES_MAX; i++)
		cJSON_AddItemToArray(f, cJSON_CreateString(t->feature_names[i]));
	cJSON_AddItemToObject(o, "feature_names", f);
	return o;
}

/* This node's join record as JSON text (malloc'ed), or NULL when out of memory or when
 * settings is not a JSON object. */
static char *join_record(const struct embd_rendezvous *r, const struct embd_tables *tables,
			 const struct embd_topology *topo, const char *settings)
{
	char hash[17];
	char *text = NULL;
	cJSON *o = cJSON_CreateObject(), *arr = cJSON_CreateArray(), *t = topology_json(topo);
	cJSON *extra = settings ? cJSON_Parse(settings) : cJSON_CreateObject();
	if (!o || !arr || !t || !cJSON_IsObject(extra))
		goto out;
	/* the protocol first: when it differs, nothing after it is compared */
	cJSON_AddNumberToObject(o, "protocol", EMBD_RENDEZVOUS_PROTOCOL);
	cJSON_AddNumberToObject(o, "node_rank", r->node_rank);
	cJSON_AddNumberToObject(o, "world_size", r->world_size);
	cJSON_AddNumberToObject(o, "local_world_size", r->local_world_size);
	cJSON_AddStringToObject(o, "backend", embd_comm_backend_name(r->backend));
	for (uint32_t i = 0; i < tables->count; i++) {
		cJSON *tj = table_json(&tables->specs[i]);
		if (!tj)
			goto out;
		cJSON_AddItemToArray(arr, tj);
	}
	cJSON_AddItemToObject(o, "tables", arr);
	arr = NULL;
	cJSON_AddItemToObject(o, "topology", t);
	t = NULL;
	snprintf(hash, sizeof(hash), "%016" PRIx64,
		 embd_plan_tables_hash(tables->specs, tables->count));
	cJSON_AddStringToObject(o, "tables_hash", hash);
	/* the settings' members at the top, so that a message names them by their own key */
	while (extra->child) {
		cJSON *item = cJSON_DetachItemViaPointer(extra, extra->child);
		cJSON_AddItemToObject(o, item->string, item);
	}
	text = cJSON_PrintUnformatted(o);
out:
	cJSON_Delete(extra);
	cJSON_Delete(o);
	cJSON_Delete(arr);
	cJSON_Delete(t);
	return text;
}

/* ---- comparing two records ------------------------------------------------------------- */

struct diff {
	char msg[MSG_MAX];      /* the first difference */
	int count;
	const char *there;      /* "on node 0" */
};

/* A value as it reads in a message: strings bare, everything else as JSON. */
static char *value_text(const cJSON *v)
{
	if (!v)
		return strdup("missing");
	if (cJSON_IsString(v))
		return strdup(v->valuestring);
	return cJSON_PrintUnformatted(v);
}

static void differ(struct diff *d, const char *path, const cJSON *mine, const cJSON *theirs)
{
	if (d->count++)
		return;
	char *a = value_text(mine), *b = value_text(theirs);
	snprintf(d->msg, sizeof(d->msg), "%s %.200s here, %.200s %s", path, a ? a : "?",
		 b ? b : "?", d->there);
	free(a);
	free(b);
}

static void compare(struct diff *d, const char *path, const cJSON *mine, const cJSON *theirs);

static const cJSON *table_named(const cJSON *tables, const char *name, int *index)
{
	const cJSON *t;
	*index = 0;
	cJSON_ArrayForEach(t, tables) {
		const cJSON *n = cJSON_GetObjectItemCaseSensitive(t, "name");
		if (cJSON_IsString(n) && strcmp(n->valuestring, name) == 0)
			return t;
		(*index)++;
	}
	return NULL;
}

static const char *table_name(const cJSON *t)
{
	const cJSON *n = cJSON_GetObjectItemCaseSensitive(t, "name");
	return cJSON_IsString(n) ? n->valuestring : "?";
}

/* Tables are matched by name, so a missing or reordered table is named as such. */
static void compare_tables(struct diff *d, const cJSON *mine, const cJSON *theirs)
{
	const cJSON *t;
	char path[EMBD_NAME_MAX + 16];
	int i = 0, j;
	cJSON_ArrayForEach(t, mine) {
		const char *name = table_name(t);
		const cJSON *other = table_named(theirs, name, &j);
		snprintf(path, sizeof(path), "table '%s'", name);
		if (!other) {
			if (!d->count++)
				snprintf(d->msg, sizeof(d->msg), "%s exists here, not %s", path,
					 d->there);
		} else if (i != j) {
			if (!d->count++)
				snprintf(d->msg, sizeof(d->msg), "%s is table %d here, table %d %s",
					 path, i, j, d->there);
		} else {
			compare(d, path, t, other);
		}
		i++;
	}
	cJSON_ArrayForEach(t, theirs) {
		if (!table_named(mine, table_name(t), &j) && !d->count++)
			snprintf(d->msg, sizeof(d->msg), "table '%s' exists %s, not here",
				 table_name(t), d->there);
	}
}

static void compare(struct diff *d, const char *path, const cJSON *mine, const cJSON *theirs)
{
	char sub[256];
	const cJSON *c;

	if ((mine->type & 0xff) != (theirs->type & 0xff)) {
		differ(d, path, mine, theirs);
		return;
	}
	if (cJSON_IsObject(mine)) {
		cJSON_ArrayForEach(c, mine) {
			if (!strcmp(c->string, "node_rank"))
				continue;       /* differs by design */
			snprintf(sub, sizeof(sub), "%s%s%s", path, *path ? " " : "", c->string);
			const cJSON *o = cJSON_GetObjectItemCaseSensitive(theirs, c->string);
			if (!o)
				differ(d, sub, c, NULL);
			else if (!strcmp(c->string, "tables") && !*path)
				compare_tables(d, c, o);
			else
				compare(d, sub, c, o);
		}
		cJSON_ArrayForEach(c, theirs) {
			snprintf(sub, sizeof(sub), "%s%s%s", path, *path ? " " : "", c->string);
			if (!cJSON_GetObjectItemCaseSensitive(mine, c->string))
				differ(d, sub, NULL, c);
		}
		return;
	}
	/* numbers exactly (cJSON_Compare allows an epsilon), everything else as JSON */
	if (cJSON_IsNumber(mine) ? mine->valuedouble != theirs->valuedouble
				 : !cJSON_Compare(mine, theirs, 1))
		differ(d, path, mine, theirs);
}

/*
 * Compares two join records (text); 0, or EMBD_EMISMATCH / EMBD_EPROTO with the first
 * difference in msg. there says whose the other record is ("on node 0").
 */
static int compare_records(const char *mine, const char *theirs, size_t theirs_len,
			   const char *there, char *msg, size_t msg_len)
{
	struct diff d = { .there = there };
	int rc = 0;
	cJSON *a = cJSON_Parse(mine), *b = cJSON_ParseWithLength(theirs, theirs_len);
	if (!a || !b || !cJSON_IsObject(b)) {
		snprintf(msg, msg_len, "the join record %s is not a JSON object", there);
		rc = a ? EMBD_EPROTO : EMBD_ENOMEM;
		goto out;
	}
	const cJSON *pa = cJSON_GetObjectItemCaseSensitive(a, "protocol");
	const cJSON *pb = cJSON_GetObjectItemCaseSensitive(b, "protocol");
	if (!cJSON_IsNumber(pb) || pa->valuedouble != pb->valuedouble) {
		differ(&d, "protocol version", pa, pb);
	} else {
		compare(&d, "", a, b);
	}
	if (d.count) {
		if (d.count > 1)
			snprintf(d.msg + strlen(d.msg), sizeof(d.msg) - strlen(d.msg),
				 " (and %d more differences)", d.count - 1);
		snprintf(msg, msg_len, "%s", d.msg);
		rc = EMBD_EMISMATCH;
	}
out:
	cJSON_Delete(a);
	cJSON_Delete(b);
	return rc;
}

/* ---- the exchange ---------------------------------------------------------------------- */

struct exchange {
	struct embd_store *store;
	const char *prefix;
	int32_t node, nodes;
	int timeout_ms;
	char *err;
	size_t err_len;
};

__attribute__((format(printf, 4, 5)))
static const char *key(const struct exchange *x, char *buf, size_t len, const char *fmt, ...)
{
	int n = snprintf(buf, len, "%s", x->prefix);
	va_list ap;
	va_start(ap, fmt);
	if (n >= 0 && (size_t)n < len)
		vsnprintf(buf + n, len - (size_t)n, fmt, ap);
	va_end(ap);
	return buf;
}

__attribute__((format(printf, 3, 4)))
static int fail(const struct exchange *x, int rc, const char *fmt, ...)
{
	int n = snprintf(x->err, x->err_len, "collective_plan node %d: ", x->node);
	va_list ap;
	va_start(ap, fmt);
	if (n >= 0 && (size_t)n < x->err_len)
		vsnprintf(x->err + n, x->err_len - (size_t)n, fmt, ap);
	va_end(ap);
	return rc;
}

static int put(const struct exchange *x, const char *k, const char *text)
{
	int rc = embd_store_set(x->store, k, text, strlen(text));
	return rc < 0 ? fail(x, rc, "%s", embd_store_error(x->store)) : 0;
}

/* The value at k as a NUL-terminated string; what names it in a timeout message. */
static int fetch(const struct exchange *x, const char *k, const char *what, char **out,
		 size_t *len)
{
	void *v = NULL;
	int rc = embd_store_get(x->store, k, &v, len);
	if (rc < 0)
		return fail(x, rc, "%s: %s", what, embd_store_error(x->store));
	char *s = realloc(v, *len + 1);
	if (!s) {
		free(v);
		return fail(x, EMBD_ENOMEM, "out of memory for %s", what);
	}
	s[*len] = '\0';
	*out = s;
	return 0;
}

/* Waits for <prefix><kind>/<n> of every joiner; a timeout names the nodes still missing. */
static int wait_joiners(const struct exchange *x, const char *kind, const char *what)
{
	char (*names)[EMBD_STORE_KEY_MAX + 1] = calloc((size_t)x->nodes, sizeof(*names));
	const char **keys = calloc((size_t)x->nodes, sizeof(*keys));
	int rc = 0;
	if (!names || !keys) {
		rc = fail(x, EMBD_ENOMEM, "out of memory");
		goto out;
	}
	for (int32_t n = 1; n < x->nodes; n++)
		keys[n - 1] = key(x, names[n], sizeof(names[n]), "%s/%d", kind, n);
	rc = embd_store_wait(x->store, keys, (size_t)(x->nodes - 1));
	if (rc == EMBD_ETIMEDOUT) {
		char missing[256] = "", stale[256] = "", k[EMBD_STORE_KEY_MAX + 1];
		size_t at = 0, st = 0;
		for (int32_t n = 1; n < x->nodes && at + 16 < sizeof(missing); n++) {
			if (embd_store_check(x->store, keys[n - 1]) != 0)
				continue;
			at += (size_t)snprintf(missing + at, sizeof(missing) - at, "%s%d",
					       at ? ", " : "", n);
			/* a node of the cluster this node 0 replaces (dist/regroup.h) */
			if (embd_store_check(x->store, key(x, k, sizeof(k), "stale/%d", n)) == 1 &&
			    st + 16 < sizeof(stale))
				st += (size_t)snprintf(stale + st, sizeof(stale) - st, "%s%d",
						       st ? ", " : "", n);
		}
		if (st)
			rc = fail(x, rc, "node(s) %s did not %s within %d ms: node(s) %s still run the "
				  "cluster node 0 had before it restarted (a restarted node 0 is not "
				  "resumed): restart every embd node", missing, what, x->timeout_ms,
				  stale);
		else
			rc = fail(x, rc, "node(s) %s did not %s within %d ms", missing, what,
				  x->timeout_ms);
	} else if (rc < 0) {
		rc = fail(x, rc, "%s", embd_store_error(x->store));
	}
out:
	free(names);
	free(keys);
	return rc;
}

/* Registers this node; a node_rank that joined before is refused. */
static int count_in(const struct exchange *x)
{
	char k[EMBD_STORE_KEY_MAX + 1];
	int64_t n = 0;
	int rc = embd_store_add(x->store, key(x, k, sizeof(k), "joined/%d", x->node), 1, &n);
	if (rc < 0)
		return fail(x, rc, "%s", embd_store_error(x->store));
	if (n > 1)
		return fail(x, EMBD_EMISMATCH, "node_rank %d joined %lld times (is NODE_RANK "
			    "unique on every node?)", x->node, (long long)n);
	return 0;
}

static int node0(const struct exchange *x, const char *record, struct embd_plan *plan)
{
	char k[EMBD_STORE_KEY_MAX + 1], hash[17], first[MSG_MAX] = "", msg[MSG_MAX];
	char *json = NULL;
	size_t len = 0;
	int rc, first_rc = 0;

	if ((rc = embd_plan_write_json(plan, &json, &len)) < 0)
		return fail(x, rc, "cannot write the plan JSON");
	snprintf(hash, sizeof(hash), "%016" PRIx64, plan->plan_hash);
	rc = put(x, key(x, k, sizeof(k), "plan"), json);
	free(json);
	if (rc == 0)
		rc = put(x, key(x, k, sizeof(k), "plan_hash"), hash);
	if (rc == 0)
		rc = count_in(x);
	if (rc == 0)
		rc = put(x, key(x, k, sizeof(k), "join/0"), record);
	if (rc == 0 && x->nodes > 1)
		rc = wait_joiners(x, "join", "join");
	if (rc < 0)
		goto outcome;

	/* every joiner's record against ours; each gets its verdict */
	for (int32_t n = 1; n < x->nodes; n++) {
		char there[32], *theirs = NULL;
		int64_t times = 0;
		snprintf(there, sizeof(there), "on node %d", n);
		rc = fetch(x, key(x, k, sizeof(k), "join/%d", n), "join record", &theirs, &len);
		if (rc < 0)
			goto outcome;
		rc = compare_records(record, theirs, len, there, msg, sizeof(msg));
		free(theirs);
		if (rc == 0 && embd_store_add(x->store, key(x, k, sizeof(k), "joined/%d", n), 0,
					      &times) == 0 && times > 1) {
			snprintf(msg, sizeof(msg), "node_rank %d joined %lld times", n,
				 (long long)times);
			rc = EMBD_EMISMATCH;
		}
		if (rc < 0 && !first_rc) {
			first_rc = rc;
			snprintf(first, sizeof(first), "node %d: %.900s", n, msg);
		}
		rc = put(x, key(x, k, sizeof(k), "verdict/%d", n), rc < 0 ? msg : OK);
		if (rc < 0)
			goto outcome;
	}
	/* and every joiner's own check of the plan */
	if (x->nodes > 1 && (rc = wait_joiners(x, "result", "report their check")) < 0)
		goto outcome;
	for (int32_t n = 1; n < x->nodes && !first_rc; n++) {
		char *result = NULL;
		rc = fetch(x, key(x, k, sizeof(k), "result/%d", n), "result", &result, &len);
		if (rc < 0)
			goto outcome;
		if (strcmp(result, OK) != 0) {
			first_rc = EMBD_EMISMATCH;
			snprintf(first, sizeof(first), "node %d refused: %.900s", n, result);
		}
		free(result);
	}
	if (first_rc)
		rc = fail(x, first_rc, "%s", first);
outcome:
	/* whatever happened, the joiners hear it (best effort when the store itself failed) */
	embd_store_set(x->store, key(x, k, sizeof(k), "outcome"), rc < 0 ? x->err : OK,
		       strlen(rc < 0 ? x->err : OK));
	return rc;
}

/* A joiner's check of node 0's plan: parse, same topology, planner check, same hash. */
static int check_plan(const struct exchange *x, const struct embd_tables *tables,
		      const struct embd_topology *topo, struct embd_plan **out, char *msg,
		      size_t msg_len)
{
	char k[EMBD_STORE_KEY_MAX + 1], *json = NULL, *hash = NULL;
	size_t len = 0, hash_len = 0;
	struct embd_plan *plan = NULL;
	int rc = fetch(x, key(x, k, sizeof(k), "plan"), "node 0's plan", &json, &len);
	if (rc == 0)
		rc = fetch(x, key(x, k, sizeof(k), "plan_hash"), "node 0's plan hash", &hash,
			   &hash_len);
	if (rc < 0) {
		const char *what = strstr(x->err, ": ");     /* without fail()'s prefix */
		snprintf(msg, msg_len, "%s", what ? what + 2 : x->err);
		goto out;
	}
	if ((rc = embd_plan_parse_json(json, len, &plan, msg, msg_len)) < 0)
		goto out;
	cJSON *mine = topology_json(topo), *theirs = topology_json(&plan->topology);
	struct diff d = { .there = "in node 0's plan" };
	if (mine && theirs)
		compare(&d, "plan topology", mine, theirs);
	cJSON_Delete(mine);
	cJSON_Delete(theirs);
	if (d.count) {
		snprintf(msg, msg_len, "%s", d.msg);
		rc = EMBD_EMISMATCH;
		goto out;
	}
	char check_msg[MSG_MAX] = "";
	rc = embd_plan_check(plan, tables->specs, tables->constraints, tables->count, check_msg,
			     sizeof(check_msg));
	if (rc < 0) {
		snprintf(msg, msg_len, "node 0's plan fails the check here: %s", check_msg);
		rc = EMBD_EMISMATCH;
		goto out;
	}
	char here[17];
	snprintf(here, sizeof(here), "%016" PRIx64, plan->plan_hash);
	if (strcmp(here, hash) != 0) {
		snprintf(msg, msg_len, "plan hash %s here, %.16s on node 0", here, hash);
		rc = EMBD_EMISMATCH;
		goto out;
	}
	*out = plan;
	plan = NULL;
out:
	embd_plan_destroy(plan);
	free(json);
	free(hash);
	return rc;
}

static int joiner(const struct exchange *x, const char *record,
		  const struct embd_tables *tables, const struct embd_topology *topo,
		  struct embd_plan **out)
{
	char k[EMBD_STORE_KEY_MAX + 1], msg[MSG_MAX] = "", *theirs = NULL, *verdict = NULL;
	char *outcome = NULL;
	size_t len = 0;
	int rc = count_in(x), mine;

	if (rc == 0)
		rc = put(x, key(x, k, sizeof(k), "join/%d", x->node), record);
	if (rc < 0) {
		/* node 0 waits for a result either way */
		embd_store_set(x->store, key(x, k, sizeof(k), "result/%d", x->node), x->err,
			       strlen(x->err));
		return rc;
	}
	rc = fetch(x, key(x, k, sizeof(k), "join/0"), "node 0's join record", &theirs, &len);
	if (rc < 0)
		return rc;
	mine = compare_records(record, theirs, len, "on node 0", msg, sizeof(msg));
	free(theirs);
	rc = fetch(x, key(x, k, sizeof(k), "verdict/%d", x->node), "node 0's verdict", &verdict,
		   &len);
	if (rc < 0)
		return rc;
	if (mine == 0 && strcmp(verdict, OK) != 0) {
		snprintf(msg, sizeof(msg), "node 0 refused this node: %.900s", verdict);
		mine = EMBD_EMISMATCH;
	}
	free(verdict);
	if (mine == 0)
		mine = check_plan(x, tables, topo, out, msg, sizeof(msg));
	rc = put(x, key(x, k, sizeof(k), "result/%d", x->node), mine < 0 ? msg : OK);
	if (mine < 0 || rc < 0)
		goto refuse;
	/* agreed here; the cluster agrees only if every node did */
	rc = fetch(x, key(x, k, sizeof(k), "outcome"), "node 0's outcome", &outcome, &len);
	if (rc == 0 && strcmp(outcome, OK) != 0) {
		snprintf(msg, sizeof(msg), "node 0 aborted: %.900s", outcome);
		mine = EMBD_EMISMATCH;
	}
	free(outcome);
refuse:
	if (mine < 0 || rc < 0) {
		embd_plan_destroy(*out);
		*out = NULL;
	}
	if (mine < 0)
		return fail(x, mine, "%s", msg);
	return rc;
}

/* A restarted node: node 0's record and plan checked as a joiner does, without counting in. */
static int rejoiner(const struct exchange *x, const char *record,
		    const struct embd_tables *tables, const struct embd_topology *topo,
		    struct embd_plan **out)
{
	char k[EMBD_STORE_KEY_MAX + 1], msg[MSG_MAX] = "", *theirs = NULL;
	size_t len = 0;
	int rc = fetch(x, key(x, k, sizeof(k), "join/0"), "node 0's join record", &theirs, &len);

	if (rc < 0)
		return rc;
	rc = compare_records(record, theirs, len, "on node 0", msg, sizeof(msg));
	free(theirs);
	if (rc == 0)
		rc = check_plan(x, tables, topo, out, msg, sizeof(msg));
	return rc < 0 ? fail(x, rc, "rejoining: %s", msg) : 0;
}

int embd_collective_plan_rejoin(struct embd_store *store, const struct embd_rendezvous *r,
				const struct embd_tables *tables,
				const struct embd_topology *topo, const char *settings,
				int timeout_ms, struct embd_plan **plan, char *err, size_t err_len)
{
	struct exchange x = { store, "embd/", r->node_rank, embd_rendezvous_num_nodes(r),
			      timeout_ms, err, err_len };
	char k[EMBD_STORE_KEY_MAX + 1], *outcome = NULL;
	size_t len = 0;

	if (err_len)
		err[0] = '\0';
	if (r->node_rank == 0)
		return 0;       /* node 0's store is new whenever node 0 is; its plan stays */
	*plan = NULL;
	embd_store_set_timeout(store, timeout_ms);
	int rc = embd_store_check(store, key(&x, k, sizeof(k), "outcome"));
	if (rc <= 0)
		return rc < 0 ? fail(&x, rc, "%s", embd_store_error(store)) : 0;
	if ((rc = fetch(&x, k, "node 0's outcome", &outcome, &len)) < 0)
		return rc;
	rc = strcmp(outcome, OK) ? fail(&x, EMBD_EMISMATCH, "the cluster's start failed: %.900s",
					outcome) : 0;
	free(outcome);
	if (rc < 0)
		return rc;
	char *record = join_record(r, tables, topo, settings);
	if (!record)
		return fail(&x, EMBD_ENOMEM, "out of memory for the join record");
	rc = rejoiner(&x, record, tables, topo, plan);
	cJSON_free(record);
	return rc < 0 ? rc : 1;
}

int embd_collective_plan(struct embd_store *store, const struct embd_rendezvous *r,
			 const struct embd_tables *tables, const struct embd_topology *topo,
			 const char *settings, const char *prefix, int timeout_ms, struct embd_plan **plan,
			 char *err, size_t err_len)
{
	struct exchange x = { store, prefix ? prefix : "embd/", r->node_rank,
			      embd_rendezvous_num_nodes(r), timeout_ms, err, err_len };
	if (err_len)
		err[0] = '\0';
	if (topo->world_size != r->world_size || topo->local_world_size != r->local_world_size)
		return fail(&x, EMBD_EINVAL, "topology world_size %d, local_world_size %d but the "
			    "rendezvous has %d, %d (embd_rendezvous_apply_topology)",
			    topo->world_size, topo->local_world_size, r->world_size,
			    r->local_world_size);
	if ((r->node_rank == 0) != (*plan != NULL))
		return fail(&x, EMBD_EINVAL, "node 0 passes its plan, the others NULL");
	char *record = join_record(r, tables, topo, settings);
	if (!record)
		return fail(&x, EMBD_ENOMEM, "out of memory for the join record (or settings is "
			    "not a JSON object)");
	embd_store_set_timeout(store, timeout_ms);
	int rc = r->node_rank == 0 ? node0(&x, record, *plan)
				   : joiner(&x, record, tables, topo, plan);
	cJSON_free(record);
	return rc;
}
