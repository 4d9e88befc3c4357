/*
 * Fuzz target for the plan parser (embd_plan_parse_json) and the checker: a parsed plan is
 * checked against a fixed set of three tables, written back and parsed again; none of it may
 * crash, whatever the plan claims (ranks, offsets and sizes out of range included).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "embd/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char tables_json[] =
	"[{\"name\": \"a\", \"num_embeddings\": 100, \"embedding_dim\": 16},"
	" {\"name\": \"b\", \"num_embeddings\": 1000, \"embedding_dim\": 256},"
	" {\"name\": \"c\", \"num_embeddings\": 10, \"embedding_dim\": 8}]";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct embd_tables tables;
	struct embd_plan *plan, *again;
	char err[512], *json;
	size_t len;

	if (!tables.count &&
	    embd_plan_tables_parse_text(tables_json, strlen(tables_json), &tables, err, sizeof(err)))
		abort();
	if (embd_plan_parse_json((const char *)data, size, &plan, err, sizeof(err)))
		return 0;
	/* checking walks every shard: bound the work a single input can ask for */
	if (plan->topology.world_size <= 4096 &&
	    !embd_plan_check(plan, tables.specs, tables.constraints, tables.count, err,
			     sizeof(err)) &&
	    !embd_plan_write_json(plan, &json, &len)) {
		if (embd_plan_parse_json(json, len, &again, err, sizeof(err)))
			abort();        /* the writer produced JSON its parser rejects */
		embd_plan_destroy(again);
		free(json);
	}
	embd_plan_destroy(plan);
	return 0;
}
