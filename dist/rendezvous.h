/*
 * dist/rendezvous.h - how the embd services of a cluster find each other and agree on one
 * plan before any shard memory is allocated: torch.distributed's env:// (MASTER_ADDR,
 * MASTER_PORT, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK; the environment wins over the
 * config) and collective_plan (node 0 publishes its plan; every node proves it was built for
 * the same tables and topology, or every node refuses, each naming the difference).
 *
 * The service's start, in order (node = one embd process per machine):
 *
 *   embd_rendezvous_resolve(&from_config, &r, err)      env:// over the config's values
 *   embd_rendezvous_apply_topology(&r, &config.topology) the topology follows the env
 *   node 0: build or load + check the plan (daemon/config_plan.h)
 *   embd_rendezvous_store(&r, timeout, &server, &store)  node 0 serves the store, all connect
 *   embd_collective_plan(store, &r, &tables, &topo, settings, NULL, timeout, &plan, err)
 *                                                       (dist/collective_plan.h)
 *   embd_comm_create({ .rank = node_rank, .lanes = local ranks, ... }, store, ...)
 *   ... run; at exit: comm destroy, store close, then (node 0) server stop
 *
 * Node 0 must keep its store server running while any node still uses the store.
 */
#ifndef EMBD_DIST_RENDEZVOUS_H
#define EMBD_DIST_RENDEZVOUS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "dist/comm.h"

struct embd_store;
struct embd_store_server;

#define EMBD_RENDEZVOUS_ADDR_MAX 256            /* bytes of master_addr, NUL included */
#define EMBD_RENDEZVOUS_IFNAME_MAX 16           /* IFNAMSIZ: an interface name, NUL included */
#define EMBD_RENDEZVOUS_COMM_ADDR_MAX 64        /* a numeric IPv4 or IPv6 address, NUL included */
#define EMBD_RENDEZVOUS_DEFAULT_PORT 29500      /* torch.distributed's MASTER_PORT default */

struct embd_rendezvous {
	char master_addr[EMBD_RENDEZVOUS_ADDR_MAX];     /* node 0's address (store server) */
	uint16_t master_port;
	int32_t world_size;                             /* ranks in the cluster */
	int32_t local_world_size;                       /* ranks per node (0 = world_size) */
	int32_t node_rank;                              /* this node, 0..nodes-1 */
	enum embd_comm_backend backend;                 /* gloo or nccl, as every node must */
	/* where this node's Gloo device listens (embd_rendezvous_comm_addr); "" = not given */
	char gloo_ifname[EMBD_RENDEZVOUS_IFNAME_MAX];   /* GLOO_SOCKET_IFNAME or the config's */
	bool ifname_from_env;
	char comm_addr[EMBD_RENDEZVOUS_COMM_ADDR_MAX];  /* the config's comm_addr */
};

/* torch's defaults: 127.0.0.1:29500, one node of one rank, gloo. */
void embd_rendezvous_defaults(struct embd_rendezvous *r);

/*
 * *out = *config, then each of MASTER_ADDR, MASTER_PORT, WORLD_SIZE, LOCAL_WORLD_SIZE,
 * NODE_RANK and GLOO_SOCKET_IFNAME (gloo_ifname; it also sets comm_addr aside, as torch's
 * variable wins over everything) that is set and not empty in the environment replaces its
 * field, then the whole is checked:
 * world_size >= 1, local_world_size divides it, node_rank < world_size / local_world_size.
 * EMBD_EINVAL names the variable (and its value) that is malformed or out of range, or the
 * fields that disagree and where each came from ("WORLD_SIZE=6 (environment) is not a
 * multiple of local_world_size 4 (config)").
 */
int embd_rendezvous_resolve(const struct embd_rendezvous *config, struct embd_rendezvous *out,
			    char *err, size_t err_len);

/*
 * The address this node's Gloo device listens on and advertises to its peers, as numeric
 * text in out[out_len] (EMBD_RENDEZVOUS_COMM_ADDR_MAX is enough), and in *how a few words on
 * where it came from, for the log. In order:
 *   gloo_ifname (GLOO_SOCKET_IFNAME or the config key)  that interface's first IPv4 address,
 *                                 else its first IPv6 address that is not link-local;
 *   comm_addr (config)           that address, which must belong to this host;
 *   neither                      the local address of the route to master_addr:master_port
 *                                (a UDP socket connected there, read back with getsockname:
 *                                nothing is sent), so 127.0.0.1 on a loopback cluster and the
 *                                outward address of each host on a real one.
 * EMBD_EINVAL names the variable or key and its value (no such interface, an interface
 * without an address, an address not of this host); EMBD_EIO names master_addr when it does
 * not resolve or there is no route to it.
 */
int embd_rendezvous_comm_addr(const struct embd_rendezvous *r, char *out, size_t out_len,
			      const char **how, char *err, size_t err_len);

/*
 * Once every node is connected to the store: node 0's choice by the route (neither
 * gloo_ifname nor comm_addr set) is its own loopback address whenever master_addr names node 0 itself (its hostname often
 * resolves to 127.0.1.1), which peers on other hosts cannot reach. So every other node
 * publishes the address it reaches the store (node 0) at, and node 0, when its own choice is
 * a loopback address, takes the first of those that is not (and keeps its own when all are:
 * every node is on this host). addr[addr_len] is node 0's choice, replaced in place, *how too.
 * Waits up to the store's timeout for each peer's word.
 */
int embd_rendezvous_comm_addr_settle(const struct embd_rendezvous *r, struct embd_store *store,
				     char *addr, size_t addr_len, const char **how, char *err,
				     size_t err_len);

/* world_size / local_world_size. */
int32_t embd_rendezvous_num_nodes(const struct embd_rendezvous *r);

/* Sets the topology's world_size and local_world_size from r (env:// wins over the file). */
void embd_rendezvous_apply_topology(const struct embd_rendezvous *r,
				    struct embd_topology *topo);

/*
 * Node 0 starts the store server on every interface at master_port (*server set; stop it
 * last), then every node, node 0 too, connects to master_addr:master_port, retrying until
 * timeout_ms while node 0 is still starting. Other nodes get *server = NULL.
 */
int embd_rendezvous_store(const struct embd_rendezvous *r, int timeout_ms,
			  struct embd_store_server **server, struct embd_store **store,
			  char *err, size_t err_len);

#endif /* EMBD_DIST_RENDEZVOUS_H */
