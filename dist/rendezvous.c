/*
 * dist/rendezvous.c - torch.distributed's env:// for embd (dist/rendezvous.h): the
 * config's values, overridden one by one by the environment, then checked as a whole, and
 * the store every node rendezvouses through (served by node 0).
 *
 * Each field remembers where its value came from, so a message about two fields that do not
 * fit together says which one the operator should look at: the environment or the config.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdbool.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "embd/types.h"
#include "dist/rendezvous.h"
#include "dist/store.h"

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

	const char *ifname = getenv("GLOO_SOCKET_IFNAME");
	if (ifname && *ifname) {
		/* torch opens one Gloo device per name of a list; embd runs one per node */
		if (strlen(ifname) >= sizeof(out->gloo_ifname) || strchr(ifname, ',')) {
			snprintf(err, err_len, "GLOO_SOCKET_IFNAME=\"%.64s\" (environment): expected "
				 "one interface name of 1..%zu bytes", ifname,
				 sizeof(out->gloo_ifname) - 1);
			return EMBD_EINVAL;
		}
		strcpy(out->gloo_ifname, ifname);
		out->ifname_from_env = true;
		out->comm_addr[0] = 0;
	}

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

/* "GLOO_SOCKET_IFNAME=x (environment)" or "gloo_ifname \"x\" (config)", for messages. */
static const char *ifname_origin(const struct embd_rendezvous *r, char *buf, size_t len)
{
	snprintf(buf, len, r->ifname_from_env ? "GLOO_SOCKET_IFNAME=%s (environment)" :
		 "gloo_ifname \"%s\" (config)", r->gloo_ifname);
	return buf;
}

/* Numeric text of the address at sa. */
static int addr_text(const struct sockaddr *sa, char *out, size_t out_len)
{
	const void *a = sa->sa_family == AF_INET ?
		(const void *)&((const struct sockaddr_in *)sa)->sin_addr :
		(const void *)&((const struct sockaddr_in6 *)sa)->sin6_addr;
	return inet_ntop(sa->sa_family, a, out, (socklen_t)out_len) ? 0 : EMBD_EINVAL;
}

/* The interface's first IPv4 address, else its first IPv6 one that is not link-local (a
 * link-local address needs a scope that Gloo's address exchange does not carry). */
static int interface_addr(const struct embd_rendezvous *r, char *out, size_t out_len,
			  char *err, size_t err_len)
{
	const struct sockaddr *best = NULL;
	struct ifaddrs *all = NULL;
	char what[96];
	int rc = 0;

	if (!if_nametoindex(r->gloo_ifname)) {
		snprintf(err, err_len, "%s: no such network interface",
			 ifname_origin(r, what, sizeof(what)));
		return EMBD_EINVAL;
	}
	if (getifaddrs(&all)) {
		snprintf(err, err_len, "%s: getifaddrs: %s", ifname_origin(r, what, sizeof(what)),
			 strerror(errno));
		return EMBD_EIO;
	}
	for (const struct ifaddrs *i = all; i; i = i->ifa_next) {
		const struct sockaddr *sa = i->ifa_addr;
		if (!sa || strcmp(i->ifa_name, r->gloo_ifname))
			continue;
		if (sa->sa_family == AF_INET) {
			best = sa;
			break;
		}
		if (sa->sa_family == AF_INET6 && !best &&
		    !IN6_IS_ADDR_LINKLOCAL(&((const struct sockaddr_in6 *)sa)->sin6_addr))
			best = sa;
	}
	if (!best) {
		snprintf(err, err_len, "%s: the interface has no IPv4 or IPv6 address",
			 ifname_origin(r, what, sizeof(what)));
		rc = EMBD_EINVAL;
	} else {
		rc = addr_text(best, out, out_len);
	}
	freeifaddrs(all);
	return rc;
}

/* comm_addr, once a socket could bind to it: an address of this host. */
static int own_addr(const struct embd_rendezvous *r, char *out, size_t out_len, char *err,
		    size_t err_len)
{
	struct sockaddr_storage ss = { 0 };
	struct sockaddr_in *in = (struct sockaddr_in *)&ss;
	struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&ss;
	socklen_t len = sizeof(*in);
	int fd = -1, rc = 0;

	if (inet_pton(AF_INET, r->comm_addr, &in->sin_addr) == 1) {
		in->sin_family = AF_INET;
	} else if (inet_pton(AF_INET6, r->comm_addr, &in6->sin6_addr) == 1) {
		in6->sin6_family = AF_INET6;
		len = sizeof(*in6);
	} else {
		snprintf(err, err_len, "comm_addr \"%s\" (config): not a numeric IPv4 or IPv6 "
			 "address", r->comm_addr);
		return EMBD_EINVAL;
	}
	fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&ss, len)) {
		snprintf(err, err_len, "comm_addr \"%s\" (config): not an address of this host "
			 "(%s)", r->comm_addr, strerror(errno));
		rc = EMBD_EINVAL;
		goto out;
	}
	rc = addr_text((struct sockaddr *)&ss, out, out_len);
out:
	if (fd >= 0)
		close(fd);
	return rc;
}

/* The source address the kernel picks for master_addr:master_port. connect() on a UDP socket
 * only looks the route up; no packet leaves. */
static int route_addr(const struct embd_rendezvous *r, char *out, size_t out_len, char *err,
		      size_t err_len)
{
	struct addrinfo hints = { .ai_socktype = SOCK_DGRAM }, *res = NULL;
	char port[8];
	int rc, saved = 0;

	snprintf(port, sizeof(port), "%u", r->master_port);
	if ((rc = getaddrinfo(r->master_addr, port, &hints, &res))) {
		snprintf(err, err_len, "master_addr \"%.64s\": cannot resolve it to choose the "
			 "local address for gloo (%s); set GLOO_SOCKET_IFNAME or comm_addr",
			 r->master_addr, gai_strerror(rc));
		return EMBD_EIO;
	}
	rc = EMBD_EIO;
	for (const struct addrinfo *a = res; a && rc; a = a->ai_next) {
		struct sockaddr_storage ss;
		socklen_t len = sizeof(ss);
		int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
		if (fd < 0 || connect(fd, a->ai_addr, a->ai_addrlen) ||
		    getsockname(fd, (struct sockaddr *)&ss, &len))
			saved = errno;
		else
			rc = addr_text((struct sockaddr *)&ss, out, out_len);
		if (fd >= 0)
			close(fd);
	}
	freeaddrinfo(res);
	if (rc)
		snprintf(err, err_len, "master_addr \"%.64s\": no route to it to choose the local "
			 "address for gloo (%s); set GLOO_SOCKET_IFNAME or comm_addr",
			 r->master_addr, strerror(saved));
	return rc;
}

int embd_rendezvous_comm_addr(const struct embd_rendezvous *r, char *out, size_t out_len,
			      const char **how, char *err, size_t err_len)
{
	if (err_len)
		err[0] = '\0';
	if (r->gloo_ifname[0]) {
		*how = r->ifname_from_env ? "interface GLOO_SOCKET_IFNAME" : "interface gloo_ifname";
		return interface_addr(r, out, out_len, err, err_len);
	}
	if (r->comm_addr[0]) {
		*how = "comm_addr";
		return own_addr(r, out, out_len, err, err_len);
	}
	*how = "the route to master_addr";
	return route_addr(r, out, out_len, err, err_len);
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

/* 127.0.0.0/8, ::1 and the IPv4-mapped loopback, as numeric text. */
static bool is_loopback(const char *text)
{
	struct in_addr a4;
	struct in6_addr a6;

	if (inet_pton(AF_INET, text, &a4) == 1)
		return (ntohl(a4.s_addr) >> 24) == 127;
	if (inet_pton(AF_INET6, text, &a6) != 1)
		return false;
	if (IN6_IS_ADDR_V4MAPPED(&a6))
		return a6.s6_addr[12] == 127;
	return IN6_IS_ADDR_LOOPBACK(&a6);
}

#define SEEN_KEY "embd/node0-seen-by/"

int embd_rendezvous_comm_addr_settle(const struct embd_rendezvous *r, struct embd_store *store,
				     char *addr, size_t addr_len, const char **how, char *err,
				     size_t err_len)
{
	char key[64], seen[INET6_ADDRSTRLEN + 1];
	int32_t nodes = embd_rendezvous_num_nodes(r);
	int rc;

	if (err_len)
		err[0] = '\0';
	if (r->node_rank != 0) {
		struct sockaddr_storage ss;
		if ((rc = embd_store_server_addr(store, &ss)) ||
		    (rc = addr_text((struct sockaddr *)&ss, seen, sizeof(seen))))
			return snprintf(err, err_len, "store: its address as this node reaches it: "
					"not connected"), rc;
		snprintf(key, sizeof(key), SEEN_KEY "%d", r->node_rank);
		if ((rc = embd_store_set(store, key, seen, strlen(seen))))
			snprintf(err, err_len, "store: %s", embd_store_error(store));
		return rc;
	}
	if (r->gloo_ifname[0] || r->comm_addr[0] || !is_loopback(addr))
		return 0;       /* the operator's choice, or not on loopback */
	/* node 0's own route to master_addr stays on this host (master_addr names it, and the
	 * name may well resolve to 127.0.1.1): what its peers see tells whether they are here */
	for (int32_t k = 1; k < nodes; k++) {
		void *v = NULL;
		size_t len = 0;
		snprintf(key, sizeof(key), SEEN_KEY "%d", k);
		if ((rc = embd_store_get(store, key, &v, &len)))
			return snprintf(err, err_len, "store: waiting for node %d to say how it reaches "
					"node 0: %s", k, embd_store_error(store)), rc;
		snprintf(seen, sizeof(seen), "%.*s", (int)(len < sizeof(seen) ? len : sizeof(seen) - 1),
			 (const char *)v);
		free(v);
		if (!is_loopback(seen) && strlen(seen) < addr_len) {
			snprintf(addr, addr_len, "%s", seen);
			*how = "the address its peers reach it at";
			return 0;
		}
	}
	return 0;
}
