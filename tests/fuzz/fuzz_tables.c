/*
 * Fuzz target for the tables parser (embd_plan_tables_parse_text) and, for inputs that
 * parse, the planner on a small topology: any bytes must give 0 or an error, never a crash,
 * and a plan that is built must pass its own check.
 */
#include <stdint.h>
#include <stdlib.h>

#include "embd/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct embd_tables t;
	char err[512];

	if (embd_plan_tables_parse_text((const char *)data, size, &t, err, sizeof(err)))
		return 0;
	/* keep each input cheap: plan only small inputs, on 4 ranks in 2 nodes */
	uint64_t cells = 0;
	for (uint32_t i = 0; i < t.count; i++)
		cells += (uint64_t)t.specs[i].num_embeddings;
	if (t.count <= 64 && cells <= (1ull << 32)) {
		struct embd_topology topo;
		struct embd_plan *plan;
		embd_plan_topology_default(&topo, 4);
		topo.local_world_size = 2;
		if (!embd_plan_build(t.specs, t.constraints, t.count, &topo, NULL, &plan, err,
				     sizeof(err))) {
			if (embd_plan_check(plan, t.specs, t.constraints, t.count, err, sizeof(err)))
				abort();        /* the builder emitted a plan its checker rejects */
			embd_plan_destroy(plan);
		}
	}
	embd_plan_tables_free(&t);
	return 0;
}
