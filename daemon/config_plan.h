/*
 * daemon/config_plan.h - the plan a service config makes: the one planner call of embd at start
 * (node 0 of a cluster, or a node alone) and of `embctl plan --config`, so that the operator's
 * preview and the service can never plan differently.
 */
#ifndef EMBD_DAEMON_CONFIG_PLAN_H
#define EMBD_DAEMON_CONFIG_PLAN_H

#include <stddef.h>

#include "daemon/config.h"
#include "embd/plan.h"

struct embd_rendezvous;

/*
 * Builds the plan for c's tables and topology, or, when c names a plan_file, loads it and
 * checks it against them: its topology must have c's world_size, local_world_size,
 * batch_size and compute_device (EMBD_EMISMATCH otherwise) and its shards must cover c's
 * tables (embd_plan_check). On success *out is the caller's (embd_plan_destroy); errors come
 * from the planner or the file and are described in err.
 */
int embd_config_plan(const struct embd_config *c, struct embd_plan **out, char *err,
		     size_t err_len);

/*
 * env:// over the config (dist/rendezvous.h): MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
 * LOCAL_WORLD_SIZE, NODE_RANK and GLOO_SOCKET_IFNAME in the environment win over c's keys;
 * c's topology, master address and node rank are updated and *r holds the whole result.
 * Called before embd_config_plan by embd and by `embctl plan --config`, so both plan for the
 * topology the environment gives. EMBD_EINVAL names the variable or key that is wrong.
 */
int embd_config_resolve_env(struct embd_config *c, struct embd_rendezvous *r, char *err,
			    size_t err_len);

#endif /* EMBD_DAEMON_CONFIG_PLAN_H */
