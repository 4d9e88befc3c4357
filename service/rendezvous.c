/*
 * service/rendezvous.c - torch.distributed's env:// for embd (service/rendezvous.h): the
 * config's values, overridden one by one by the environment, then checked as a whole, and
 * the store every node rendezvouses through (served by node 0).
 *
 * Each field remembers where its value came from, so a message about two fields that do not
 * fit together says which one the operator should look at: the environment or the config.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"
#include "service/rendezvous.h"
#include "service/store.h"

void embd_rendezvous_defaults(struct embd_rendezvous *r)
{
	memset(r, 0, sizeof(*r));
	strcpy(r->master_addr, "127.0.0.1");
	r->master_port = EMBD_RENDEZVOUS_DEFAULT_PORT;
	r->world_size = 1;
	r->local_world_size = 0;
	r->node_rank = 0;
	r->backend = EMBD_COMM_GLOO;
}

/* An integer environment variable within [min, max]; 0 = unset (out untouched), 1 = set. */
static int env_int(const char *name, long min, long max, long *out, char *err, size_t err_len)
{
	const char *v = getenv(name);
	if (!v)
		return 0;
	char *end = NULL;
	errno = 0;
	long x = strtol(v, &end, 10);
	if (!*v || *end || errno || x < min || x > max) {
		snprintf(err, err_len, "%s=\"%.64s\" (environment): expected an integer in %ld..%ld",
			 name, v, min, max);
		return EMBD_EINVAL;
	}
	*out = x;
	return 1;
}

static const char *origin(int from_env)
{
	return from_env ? "environment" : "config";
}

int embd_rendezvous_resolve(const struct embd_rendezvous *config, struct embd_rendezvous *out,
			    char *err, size_t err_len)
{
	int env_world, env_local, env_node, rc;
	long v;

	if (err_len)
		err[0] = '\0';
	*out = *config;
	const char *addr = getenv("MASTER_ADDR");
	if (addr) {
		if (!*addr || strlen(addr) >= sizeof(out->master_addr)) {
			snprintf(err, err_len, "MASTER_ADDR=\"%.64s\" (environment): expected a host "
				 "name or address of 1..%zu bytes", addr, sizeof(out->master_addr) - 1);
			return EMBD_EINVAL;
		}
		strcpy(out->master_addr, addr);
	}
	if ((rc = env_int("MASTER_PORT", 1, 65535, &v, err, err_len)) < 0)
		return rc;
	if (rc)
		out->master_port = (uint16_t)v;
	if ((env_world = env_int("WORLD_SIZE", 1, INT32_MAX, &v, err, err_len)) < 0)
		return env_world;
	if (env_world)
		out->world_size = (int32_t)v;
	if ((env_local = env_int("LOCAL_WORLD_SIZE", 1, INT32_MAX, &v, err, err_len)) < 0)
		return env_local;
	if (env_local)
		out->local_world_size = (int32_t)v;
	if ((env_node = env_int("NODE_RANK", 0, INT32_MAX, &v, err, err_len)) < 0)
		return env_node;
	if (env_node)
		out->node_rank = (int32_t)v;

	/* the config's own values: env_int already bounded the environment's */
	if (!out->master_addr[0]) {
		snprintf(err, err_len, "master_addr (config): empty");
		return EMBD_EINVAL;
	}
	if (out->master_port == 0) {
		snprintf(err, err_len, "master_port (config): 0 is not a port");
		return EMBD_EINVAL;
	}
	if (out->world_size < 1) {
		snprintf(err, err_len, "world_size %d (config): must be >= 1", out->world_size);
		return EMBD_EINVAL;
	}
	if (out->local_world_size == 0)
		out->local_world_size = out->world_size;
	if (out->local_world_size < 0) {
		snprintf(err, err_len, "local_world_size %d (config): must be >= 1",
			 out->local_world_size);
		return EMBD_EINVAL;
	}
	if (out->node_rank < 0) {
		snprintf(err, err_len, "node_rank %d (config): must be >= 0", out->node_rank);
		return EMBD_EINVAL;
	}
	if (embd_comm_backend_name(out->backend) == NULL) {
		snprintf(err, err_len, "backend %d (config): not gloo or nccl", (int)out->backend);
		return EMBD_EINVAL;
	}
	if (out->world_size % out->local_world_size) {
		snprintf(err, err_len, "%s %d (%s) is not a multiple of %s %d (%s)",
			 env_world ? "WORLD_SIZE" : "world_size", out->world_size,
			 origin(env_world), env_local ? "LOCAL_WORLD_SIZE" : "local_world_size",
			 out->local_world_size, origin(env_local));
		return EMBD_EINVAL;
	}
	int32_t nodes = out->world_size / out->local_world_size;
	if (out->node_rank >= nodes) {
		snprintf(err, err_len, "%s %d (%s) is not below the %d nodes of world_size %d / "
			 "local_world_size %d", env_node ? "NODE_RANK" : "node_rank", out->node_rank,
			 origin(env_node), nodes, out->world_size, out->local_world_size);
		return EMBD_EINVAL;
	}
	return 0;
}

int32_t embd_rendezvous_num_nodes(const struct embd_rendezvous *r)
{
	return r->local_world_size > 0 ? r->world_size / r->local_world_size : 1;
}

void embd_rendezvous_apply_topology(const struct embd_rendezvous *r, struct embd_topology *topo)
{
	topo->world_size = r->world_size;
	topo->local_world_size = r->local_world_size;
}

int embd_rendezvous_store(const struct embd_rendezvous *r, int timeout_ms,
			  struct embd_store_server **server, struct embd_store **store,
			  char *err, size_t err_len)
{
	*server = NULL;
	*store = NULL;
	if (r->node_rank == 0) {
		int rc = embd_store_server_start("", r->master_port, server, err, err_len);
		if (rc < 0)
			return rc;
	}
	int rc = embd_store_connect(r->master_addr, r->master_port, timeout_ms, store, err,
				    err_len);
	if (rc < 0) {
		embd_store_server_stop(*server);
		*server = NULL;
	}
	return rc;
}
