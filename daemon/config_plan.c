/*
 * The plan a service config makes (daemon/config_plan.h). A plan_file is checked against the
 * config rather than trusted: a plan built for other tables or another topology would place
 * shards the ranks cannot hold or features the trainers do not send.
 */
#include "daemon/config_plan.h"

#include <stdio.h>

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
