/*
 * dist/collective_plan.h - one plan for the whole cluster: node 0 publishes the plan it built
 * or loaded, every node proves it was built for the same tables, topology and settings, or
 * every node refuses, each naming the first difference. Runs over the rendezvous store once
 * every node is connected (dist/rendezvous.h gives the order of a service's start).
 */
#ifndef EMBD_DIST_COLLECTIVE_PLAN_H
#define EMBD_DIST_COLLECTIVE_PLAN_H

#include <stddef.h>

#include "embd/plan.h"
#include "dist/rendezvous.h"

struct embd_store;

/* Version of the join records and store keys of collective_plan; peers must agree. */
#define EMBD_RENDEZVOUS_PROTOCOL 2

/*
 * collective_plan. Every node calls it once with its own tables and topology (whose
 * world_size and local_world_size must equal r's); on node 0, *plan is the plan it built or
 * loaded and checked (kept, not copied); on the other nodes *plan is NULL on entry and
 * receives node 0's plan, parsed and checked here (release it with embd_plan_destroy).
 *
 * Every node publishes a join record (protocol version, world_size, local_world_size,
 * backend, the topology and the tables field by field, the tables hash, and the members of
 * settings: a JSON object of the caller's other keys every node must share, e.g.
 * {"checkpoint_every_steps": 10}; NULL = none; named by their own key in messages,
 * "checkpoint_every_steps 10 here, 0 on node 0"). A joiner compares
 * its record with node 0's; node 0 compares each joiner's; a difference is EMBD_EMISMATCH
 * on both sides with the first differing field named, e.g. "table 'user' num_embeddings
 * 1000 here, 2000 on node 0" (node 0 says "node 2: ... here, ... on node 2"). A joiner that
 * agrees fetches the plan, checks it against its own tables (embd_plan_check) and compares
 * the recomputed plan hash with node 0's. Node 0 then tells every node the outcome, so all
 * return 0 or all fail. A node that does not show up within timeout_ms is EMBD_ETIMEDOUT
 * naming it; the same node_rank joining twice is EMBD_EMISMATCH.
 *
 * The store handle's timeout is left at timeout_ms. prefix scopes the store keys (NULL =
 * "embd/"): a restarted cluster re-uses a store only
 * under a new prefix. Store keys: <prefix>join/<node>, joined/<node>, verdict/<node>,
 * result/<node>, plan, plan_hash, outcome; a node missing at the timeout that left
 * <prefix>stale/<node> (dist/regroup.h: it still runs the cluster of a node 0 that
 * restarted) is named as such.
 */
int embd_collective_plan(struct embd_store *store, const struct embd_rendezvous *r,
			 const struct embd_tables *tables, const struct embd_topology *topo,
			 const char *settings, const char *prefix, int timeout_ms, struct embd_plan **plan,
			 char *err, size_t err_len);

/*
 * A node other than node 0 that restarts into a running cluster (node 0 published a
 * successful outcome under "embd/" before): compares its join record with node 0's and
 * checks node 0's plan as a joiner does (same messages), without joining the start's
 * exchange again. Returns 1 with *plan set when the cluster was running, 0 when it was not
 * (node 0 always, its *plan untouched; call embd_collective_plan), or a negative code.
 */
int embd_collective_plan_rejoin(struct embd_store *store, const struct embd_rendezvous *r,
				const struct embd_tables *tables,
				const struct embd_topology *topo, const char *settings,
				int timeout_ms, struct embd_plan **plan, char *err, size_t err_len);

#endif /* EMBD_DIST_COLLECTIVE_PLAN_H */
