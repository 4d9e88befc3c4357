/*
 * The plan a service config makes (daemon/config_plan.h). A plan_file is checked against the
 * config rather than trusted: a plan built for other tables or another topology would place
 * shards the ranks cannot hold or features the trainers do not send.
 */
#include "daemon/config_plan.h"

#include <stdio.h>

#include "dist/rendezvous.h"

int embd_config_plan(const struct embd_config *c, struct embd_plan **out, char *err,
		     size_t err_len)
{
	const struct embd_tables *t = &c->tables;
	int rc;

	*out = NULL;
	if (!c->plan_file[0])
		return embd_plan_build(t->specs, t->constraints, t->count, &c->topology, NULL, out,
				       err, err_len);
	rc = embd_plan_load(c->plan_file, out, err, err_len);
	if (rc)
		return rc;
	const struct embd_topology *p = &(*out)->topology, *q = &c->topology;
	if (p->world_size != q->world_size || p->local_world_size != q->local_world_size ||
	    p->batch_size != q->batch_size || p->compute_device != q->compute_device) {
		snprintf(err, err_len, "plan_file %.512s: built for world_size %d, local_world_size %d, "
			 "batch_size %u; the config has %d, %d, %u", c->plan_file, p->world_size,
			 p->local_world_size, p->batch_size, q->world_size, q->local_world_size,
			 q->batch_size);
		rc = EMBD_EMISMATCH;
	} else {
		rc = embd_plan_check(*out, t->specs, t->constraints, t->count, err, err_len);
	}
	if (rc) {
		embd_plan_destroy(*out);
		*out = NULL;
	}
	return rc;
}

int embd_config_resolve_env(struct embd_config *c, struct embd_rendezvous *r, char *err,
			    size_t err_len)
{
	struct embd_rendezvous from_config;
	int rc;

	embd_rendezvous_defaults(&from_config);
	snprintf(from_config.master_addr, sizeof(from_config.master_addr), "%s", c->master_addr);
	from_config.master_port = c->master_port;
	from_config.world_size = c->topology.world_size;
	from_config.local_world_size = c->topology.local_world_size;
	from_config.node_rank = (int32_t)c->node_rank;
	from_config.backend = c->backend;
	snprintf(from_config.gloo_ifname, sizeof(from_config.gloo_ifname), "%s", c->gloo_ifname);
	snprintf(from_config.comm_addr, sizeof(from_config.comm_addr), "%s", c->comm_addr);
	rc = embd_rendezvous_resolve(&from_config, r, err, err_len);
	if (rc)
		return rc;
	embd_rendezvous_apply_topology(r, &c->topology);
	snprintf(c->master_addr, sizeof(c->master_addr), "%s", r->master_addr);
	c->master_port = r->master_port;
	c->node_rank = (uint32_t)r->node_rank;
	if (embd_config_nodes(c) > 1 && c->trainers_per_node > 64)
		return snprintf(err, err_len, "trainers_per_node %u: at most 64 on several nodes",
				c->trainers_per_node), EMBD_EINVAL;
	return 0;
}
