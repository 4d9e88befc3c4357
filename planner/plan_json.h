/*
 * planner/plan_json.h - the planner's JSON readers that take a cJSON tree, for a caller that
 * embeds tables or a topology in a document of its own (the daemon's config), and the one
 * strict parse of a JSON file's text that every reader (planner, config, manifest) uses. Kept
 * out of include/embd/plan.h so the public API does not expose cJSON.
 */
#ifndef EMBD_PLANNER_PLAN_JSON_H
#define EMBD_PLANNER_PLAN_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "embd/plan.h"

/*
 * Parses text (len bytes, no NUL needed) as exactly one JSON value: anything after it but
 * whitespace is refused, so a file cut and pasted together, or with a second object appended,
 * never loads half-read. 0 and *root (the caller's to cJSON_Delete), or EMBD_EPARSE with
 * "what: ..." naming the line and byte of the syntax error or of the first byte after the
 * value, and *root NULL.
 */
int embd_plan_json_parse(const char *text, size_t len, const char *what, cJSON **root,
			 char *err, size_t err_len);

/* Fills topo from a JSON object: what embd_plan_topology_load reads from a file. */
int embd_plan_topology_parse(const cJSON *object, struct embd_topology *topo, char *err,
			     size_t err_len);

/* Reads a tables array (include/embd/plan.h gives its format) from a cJSON tree. On success
 * *out owns its arrays: release them with embd_plan_tables_free. */
int embd_plan_tables_parse(const cJSON *array, struct embd_tables *out, char *err,
			   size_t err_len);

#endif /* EMBD_PLANNER_PLAN_JSON_H */
