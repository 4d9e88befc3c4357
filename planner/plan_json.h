/*
 * planner/plan_json.h - the planner's JSON readers that take a cJSON tree, for a caller that
 * embeds tables or a topology in a document of its own (the daemon's config). Kept out of
 * include/embd/plan.h so the public API does not expose cJSON.
 */
#ifndef EMBD_PLANNER_PLAN_JSON_H
#define EMBD_PLANNER_PLAN_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "embd/plan.h"

/* Fills topo from a JSON object: what embd_plan_topology_load reads from a file. */
int embd_plan_topology_parse(const cJSON *object, struct embd_topology *topo, char *err,
			     size_t err_len);

/* Reads a tables array (include/embd/plan.h gives its format) from a cJSON tree. On success
 * *out owns its arrays: release them with embd_plan_tables_free. */
int embd_plan_tables_parse(const cJSON *array, struct embd_tables *out, char *err,
			   size_t err_len);

#endif /* EMBD_PLANNER_PLAN_JSON_H */
