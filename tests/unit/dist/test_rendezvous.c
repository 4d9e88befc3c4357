/*
 * Tests for dist/rendezvous.h: env:// (the environment overrides the config, a bad value
 * is refused naming its variable, inconsistent sizes name where each came from), the address
 * of this node's Gloo device (the route to master_addr by default, GLOO_SOCKET_IFNAME or
 * gloo_ifname, comm_addr; bad ones refused naming the variable or key) and
 * collective_plan over forked nodes: agreeing nodes end with the same plan and hash; a node
 * with another table, world size or protocol, or a plan built for another topology, is
 * refused with a message naming the field, on both sides; a missing node is a timeout naming
 * it; a node_rank that joins twice is refused.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "embd/plan.h"
#include "embd/types.h"
#include "common/clock.h"
#include "dist/collective_plan.h"
#include "dist/rendezvous.h"
#include "dist/store.h"
#include "tests/support/dist_util.h"
#include "tests/support/ports.h"

/* ---- env:// ---------------------------------------------------------------------------- */

static const char *const env_names[] = { "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
					 "LOCAL_WORLD_SIZE", "NODE_RANK", "GLOO_SOCKET_IFNAME" };

static void clear_env(void)
{
	for (size_t i = 0; i < sizeof(env_names) / sizeof(env_names[0]); i++)
		unsetenv(env_names[i]);
}

static struct embd_rendezvous config_values(void)
{
	struct embd_rendezvous c;
	embd_rendezvous_defaults(&c);
	strcpy(c.master_addr, "node0.example");
	c.master_port = 4000;
	c.world_size = 8;
	c.local_world_size = 4;
	c.node_rank = 1;
	return c;
}

Test(rendezvous_env, config_values_without_env, .init = clear_env)
{
	struct embd_rendezvous c = config_values(), r;
	char err[256];
	cr_assert_eq(embd_rendezvous_resolve(&c, &r, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(r.master_addr, "node0.example");
	cr_assert_eq(r.master_port, 4000);
	cr_assert_eq(r.world_size, 8);
	cr_assert_eq(r.local_world_size, 4);
	cr_assert_eq(r.node_rank, 1);
	cr_assert_eq(embd_rendezvous_num_nodes(&r), 2);

	embd_rendezvous_defaults(&c);
	cr_assert_eq(embd_rendezvous_resolve(&c, &r, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(r.master_addr, "127.0.0.1");
	cr_assert_eq(r.master_port, 29500);
	cr_assert_eq(r.local_world_size, 1, "local_world_size 0 means world_size");
	cr_assert_eq(r.backend, EMBD_COMM_GLOO);
}

Test(rendezvous_env, environment_wins, .init = clear_env)
{
	struct embd_rendezvous c = config_values(), r;
	struct embd_topology topo;
	char err[256];
	setenv("MASTER_ADDR", "10.1.2.3", 1);
	setenv("MASTER_PORT", "1234", 1);
	setenv("WORLD_SIZE", "12", 1);
	setenv("LOCAL_WORLD_SIZE", "3", 1);
	setenv("NODE_RANK", "3", 1);
	cr_assert_eq(embd_rendezvous_resolve(&c, &r, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(r.master_addr, "10.1.2.3");
	cr_assert_eq(r.master_port, 1234);
	cr_assert_eq(r.world_size, 12);
	cr_assert_eq(r.local_world_size, 3);
	cr_assert_eq(r.node_rank, 3);
	embd_plan_topology_default(&topo, 8);
	embd_rendezvous_apply_topology(&r, &topo);
	cr_assert(topo.world_size == 12 && topo.local_world_size == 3);

	/* one variable alone overrides only its field */
	clear_env();
	setenv("NODE_RANK", "0", 1);
	cr_assert_eq(embd_rendezvous_resolve(&c, &r, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(r.node_rank, 0);
	cr_assert_eq(r.world_size, 8);
}

static void expect_refused(const char *name, const char *value, const char *needle)
{
	struct embd_rendezvous c = config_values(), r;
	char err[256] = "";
	clear_env();
	setenv(name, value, 1);
	int rc = embd_rendezvous_resolve(&c, &r, err, sizeof(err));
	cr_assert_eq(rc, EMBD_EINVAL, "%s=%s: got %d", name, value, rc);
	cr_assert(strstr(err, needle), "%s=\"%s\": expected \"%s\" in \"%s\"", name, value,
		  needle, err);
}

Test(rendezvous_env, bad_values_are_named)
{
	expect_refused("MASTER_PORT", "abc", "MASTER_PORT=\"abc\"");
	expect_refused("MASTER_PORT", "70000", "MASTER_PORT");
	expect_refused("MASTER_PORT", "0", "MASTER_PORT");
	expect_refused("MASTER_PORT", "", "MASTER_PORT");
	expect_refused("WORLD_SIZE", "0", "WORLD_SIZE");
	expect_refused("WORLD_SIZE", "4x", "WORLD_SIZE=\"4x\"");
	expect_refused("LOCAL_WORLD_SIZE", "-2", "LOCAL_WORLD_SIZE");
	expect_refused("NODE_RANK", "one", "NODE_RANK");
	expect_refused("NODE_RANK", "99999999999", "NODE_RANK");
	expect_refused("MASTER_ADDR", "", "MASTER_ADDR");
	/* consistent on their own, not together: the message says where each came from */
	expect_refused("WORLD_SIZE", "6", "WORLD_SIZE 6 (environment) is not a multiple of "
			"local_world_size 4 (config)");
	expect_refused("NODE_RANK", "2", "NODE_RANK 2 (environment) is not below the 2 nodes");
}

/* ---- the address of this node's Gloo device -------------------------------------------- */

/* The resolved config of a node whose master is at master, with gloo_ifname / comm_addr. */
static struct embd_rendezvous comm_config(const char *master, const char *ifname,
					  const char *addr)
{
	struct embd_rendezvous c, r;
	char err[256];

	embd_rendezvous_defaults(&c);
	strcpy(c.master_addr, master);
	strcpy(c.gloo_ifname, ifname);
	strcpy(c.comm_addr, addr);
	cr_assert_eq(embd_rendezvous_resolve(&c, &r, err, sizeof(err)), 0, "%s", err);
	return r;
}

static int comm_addr(const struct embd_rendezvous *r, char *out, char *err, size_t err_len)
{
	const char *how = NULL;
	int rc = embd_rendezvous_comm_addr(r, out, EMBD_RENDEZVOUS_COMM_ADDR_MAX, &how, err,
					   err_len);
	cr_assert_not_null(how, "how the address was chosen is always said");
	return rc;
}

Test(comm_addr, default_is_the_route_to_master_addr, .init = clear_env)
{
	char addr[EMBD_RENDEZVOUS_COMM_ADDR_MAX], err[256];
	struct embd_rendezvous r = comm_config("127.0.0.1", "", "");

	cr_assert_eq(comm_addr(&r, addr, err, sizeof(err)), 0, "%s", err);
	cr_expect_str_eq(addr, "127.0.0.1", "a loopback master: a loopback cluster, got %s", addr);
	r = comm_config("::1", "", "");
	if (comm_addr(&r, addr, err, sizeof(err)) == 0)   /* hosts without IPv6 refuse it */
		cr_expect_str_eq(addr, "::1");
}

Test(comm_addr, interface_from_config_or_environment, .init = clear_env)
{
	char addr[EMBD_RENDEZVOUS_COMM_ADDR_MAX], err[256];
	struct embd_rendezvous r = comm_config("192.0.2.1", "lo", "");

	cr_assert_eq(comm_addr(&r, addr, err, sizeof(err)), 0, "%s", err);
	cr_expect_str_eq(addr, "127.0.0.1", "gloo_ifname lo: expected 127.0.0.1, got %s", addr);
	setenv("GLOO_SOCKET_IFNAME", "lo", 1);
	r = comm_config("192.0.2.1", "no-such-if0", "10.9.9.9");
	cr_expect(r.ifname_from_env);
	cr_expect_str_eq(r.comm_addr, "", "GLOO_SOCKET_IFNAME wins over comm_addr");
	cr_assert_eq(comm_addr(&r, addr, err, sizeof(err)), 0, "%s", err);
	cr_expect_str_eq(addr, "127.0.0.1");
}

Test(comm_addr, missing_interface_is_named, .init = clear_env)
{
	char addr[EMBD_RENDEZVOUS_COMM_ADDR_MAX], err[256];
	struct embd_rendezvous r = comm_config("127.0.0.1", "no-such-if0", "");

	cr_expect_eq(comm_addr(&r, addr, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "gloo_ifname \"no-such-if0\" (config): no such") != NULL, "got '%s'",
		  err);
	setenv("GLOO_SOCKET_IFNAME", "no-such-if1", 1);
	r = comm_config("127.0.0.1", "", "");
	cr_expect_eq(comm_addr(&r, addr, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "GLOO_SOCKET_IFNAME=no-such-if1 (environment)") != NULL, "got '%s'",
		  err);
}

Test(comm_addr, interface_lists_are_refused, .init = clear_env)
{
	expect_refused("GLOO_SOCKET_IFNAME", "eth0,eth1", "GLOO_SOCKET_IFNAME=\"eth0,eth1\"");
	expect_refused("GLOO_SOCKET_IFNAME", "a-name-of-16-byte", "GLOO_SOCKET_IFNAME");
}

Test(comm_addr, comm_addr_must_be_this_hosts, .init = clear_env)
{
	char addr[EMBD_RENDEZVOUS_COMM_ADDR_MAX], err[256];
	struct embd_rendezvous r = comm_config("192.0.2.1", "", "127.0.0.1");

	cr_assert_eq(comm_addr(&r, addr, err, sizeof(err)), 0, "%s", err);
	cr_expect_str_eq(addr, "127.0.0.1");
	/* TEST-NET-1: documentation only, never an address of this host */
	r = comm_config("127.0.0.1", "", "192.0.2.77");
	cr_expect_eq(comm_addr(&r, addr, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "comm_addr \"192.0.2.77\" (config): not an address of this host") !=
		  NULL, "got '%s'", err);
	r = comm_config("127.0.0.1", "", "not-an-address");
	cr_expect_eq(comm_addr(&r, addr, err, sizeof(err)), EMBD_EINVAL);
	cr_expect(strstr(err, "comm_addr") != NULL, "got '%s'", err);
}

/* ---- collective_plan ------------------------------------------------------------------- */

static const char *tables_text =
	"[{\"name\": \"user\", \"num_embeddings\": 1000, \"embedding_dim\": 16,"
	"  \"feature_names\": [\"user_id\"]},"
	" {\"name\": \"item\", \"num_embeddings\": 5000, \"embedding_dim\": 8, \"pooling\": \"mean\","
	"  \"optimizer\": {\"type\": \"adagrad\", \"lr\": 0.1}}]";

enum twist {
	TWIST_NONE,
	TWIST_TABLE_ROWS,       /* the altered node's 'user' has 2000 rows */
	TWIST_WORLD_SIZE,       /* the altered node has two ranks more (one node more) */
	TWIST_EXTRA_TABLE,      /* the altered node has a third table */
	TWIST_PLAN_TOPOLOGY,    /* node 0's plan was built for batch_size 1024 */
	TWIST_SETTINGS,         /* the altered node's settings differ (checkpoint_every_steps) */
};

struct cluster {
	int nodes, local;
	enum twist twist;
	int altered;            /* the node with the twist */
	int timeout_ms;
	int absent;             /* a node that never starts, or -1 */
	tu_child_fn stand_in;   /* runs in the absent node's place (NULL: nothing does) */
	/* what each node must return, and a fragment its message must hold */
	int want_rc[4];
	const char *want_msg[4];
};

/* One node: its own tables and topology, the collective_plan, checks of its result. */
static int child_node(int node, void *arg)
{
	const struct cluster *c = arg;
	struct embd_tables tables = { 0 };
	struct embd_rendezvous r;
	struct embd_topology topo;
	struct embd_store *store = NULL;
	struct embd_plan *plan = NULL;
	char err[1024] = "";
	bool altered = node == c->altered;

	char *text = strdup(tables_text);
	if (altered && c->twist == TWIST_TABLE_ROWS)
		memcpy(strstr(text, "1000"), "2000", 4);
	TU_CHECK(embd_plan_tables_parse_text(text, strlen(text), &tables, err, sizeof(err)) == 0,
		 "%s", err);
	free(text);
	if (altered && c->twist == TWIST_EXTRA_TABLE) {
		const char *more = "[{\"name\": \"user\", \"num_embeddings\": 1000, \"embedding_dim\":"
				   " 16, \"feature_names\": [\"user_id\"]}, {\"name\": \"item\", "
				   "\"num_embeddings\": 5000, \"embedding_dim\": 8, \"pooling\": "
				   "\"mean\", \"optimizer\": {\"type\": \"adagrad\", \"lr\": 0.1}},"
				   " {\"name\": \"ads\", \"num_embeddings\": 10, \"embedding_dim\": 4}]";
		embd_plan_tables_free(&tables);
		TU_CHECK(embd_plan_tables_parse_text(more, strlen(more), &tables, err,
						     sizeof(err)) == 0, "%s", err);
	}
	embd_rendezvous_defaults(&r);
	r.master_port = tu_port;
	r.local_world_size = c->local;
	r.world_size = c->nodes * c->local + (altered && c->twist == TWIST_WORLD_SIZE ? c->local : 0);
	r.node_rank = node;
	embd_plan_topology_default(&topo, r.world_size);
	embd_rendezvous_apply_topology(&r, &topo);

	if (node == 0) {
		struct embd_topology build = topo;
		if (c->twist == TWIST_PLAN_TOPOLOGY)
			build.batch_size = 1024;
		struct embd_plan_options o = { .greedy_only = true };
		TU_CHECK(embd_plan_build(tables.specs, tables.constraints, tables.count, &build, &o,
					 &plan, err, sizeof(err)) == 0, "plan: %s", err);
	}
	TU_CHECK(embd_store_connect("127.0.0.1", tu_port, 5000, &store, err, sizeof(err)) == 0, "%s",
		 err);
	const char *settings = altered && c->twist == TWIST_SETTINGS
		? "{\"checkpoint_dir\": \"set\", \"checkpoint_every_steps\": 10}"
		: "{\"checkpoint_dir\": \"set\", \"checkpoint_every_steps\": 0}";
	int rc = embd_collective_plan(store, &r, &tables, &topo, settings, "t/", c->timeout_ms,
				      &plan, err, sizeof(err));
	fprintf(stderr, "[node %d] collective_plan: %d %s\n", node, rc, err);
	TU_CHECK(rc == c->want_rc[node], "node %d: expected %d (%s), got %d: %s", node,
		 c->want_rc[node], embd_strerror(c->want_rc[node]), rc, err);
	if (c->want_msg[node])
		TU_CHECK(strstr(err, c->want_msg[node]), "node %d: expected \"%s\" in \"%s\"", node,
			 c->want_msg[node], err);
	if (rc == 0) {
		/* the parent compares every node's plan hash and JSON */
		char k[64], *json = NULL;
		size_t len = 0;
		TU_CHECK(plan, "no plan");
		TU_CHECK(embd_plan_write_json(plan, &json, &len) == 0, "write");
		snprintf(k, sizeof(k), "check/plan/%d", node);
		TU_CHECK(embd_store_set(store, k, json, len) == 0, "%s", embd_store_error(store));
		free(json);
	} else {
		TU_CHECK(node == 0 || !plan, "a refused joiner holds no plan");
	}
	embd_plan_destroy(plan);
	embd_plan_tables_free(&tables);
	embd_store_close(store);
	return 0;
}

static int child_or_absent(int node, void *arg)
{
	const struct cluster *c = arg;
	if (node != c->absent)
		return child_node(node, arg);
	return c->stand_in ? c->stand_in(node, arg) : 0;
}

static void run_cluster(struct cluster *c)
{
	pid_t pids[4];
	int codes[4];
	tu_spawn_n(child_or_absent, c->nodes, c, pids);
	int failed = tu_join(pids, c->nodes, 20000, codes);
	for (int n = 0; n < c->nodes; n++)
		cr_expect_eq(codes[n], 0, "node %d exited %d", n, codes[n]);
	cr_assert_eq(failed, 0);
}

TestSuite(collective_plan, .init = tu_server_process_start,
	  .fini = tu_server_process_stop, .timeout = 40);

Test(collective_plan, agreeing_nodes_share_plan_and_hash)
{
	struct cluster c = { .nodes = 3, .local = 2, .timeout_ms = 10000, .absent = -1,
			     .altered = -1 };
	run_cluster(&c);
	struct embd_store *s = NULL;
	char err[256];
	void *plans[3];
	size_t lens[3];
	cr_assert_eq(embd_store_connect("127.0.0.1", tu_port, 2000, &s, err, sizeof(err)), 0);
	for (int n = 0; n < 3; n++) {
		char k[64];
		snprintf(k, sizeof(k), "check/plan/%d", n);
		cr_assert_eq(embd_store_get(s, k, &plans[n], &lens[n]), 0, "%s", embd_store_error(s));
	}
	for (int n = 1; n < 3; n++)
		cr_assert(lens[n] == lens[0] && memcmp(plans[n], plans[0], lens[0]) == 0,
			  "node %d's plan JSON differs from node 0's", n);
	for (int n = 0; n < 3; n++)
		free(plans[n]);
	embd_store_close(s);
}

Test(collective_plan, a_single_node_needs_nobody)
{
	struct cluster c = { .nodes = 1, .local = 4, .timeout_ms = 1000, .absent = -1,
			     .altered = -1 };
	run_cluster(&c);
}

Test(collective_plan, different_table_is_named_on_both_sides)
{
	struct cluster c = {
		.nodes = 3, .local = 1, .twist = TWIST_TABLE_ROWS, .altered = 1, .timeout_ms = 10000,
		.absent = -1, .want_rc = { EMBD_EMISMATCH, EMBD_EMISMATCH, EMBD_EMISMATCH },
		.want_msg = { "node 1: table 'user' num_embeddings 1000 here, 2000 on node 1",
			      "table 'user' num_embeddings 2000 here, 1000 on node 0",
			      "node 0 aborted: " },
	};
	run_cluster(&c);
}

Test(collective_plan, different_world_size_is_named_on_both_sides)
{
	struct cluster c = {
		.nodes = 2, .local = 2, .twist = TWIST_WORLD_SIZE, .altered = 1, .timeout_ms = 10000,
		.absent = -1, .want_rc = { EMBD_EMISMATCH, EMBD_EMISMATCH },
		.want_msg = { "node 1: world_size 4 here, 6 on node 1",
			      "world_size 6 here, 4 on node 0" },
	};
	run_cluster(&c);
}

Test(collective_plan, different_settings_are_named_by_key_on_both_sides)
{
	struct cluster c = {
		.nodes = 2, .local = 2, .twist = TWIST_SETTINGS, .altered = 1, .timeout_ms = 10000,
		.absent = -1, .want_rc = { EMBD_EMISMATCH, EMBD_EMISMATCH },
		.want_msg = { "node 1: checkpoint_every_steps 0 here, 10 on node 1",
			      "checkpoint_every_steps 10 here, 0 on node 0" },
	};
	run_cluster(&c);
}

Test(collective_plan, extra_table_is_named)
{
	struct cluster c = {
		.nodes = 2, .local = 1, .twist = TWIST_EXTRA_TABLE, .altered = 1, .timeout_ms = 10000,
		.absent = -1, .want_rc = { EMBD_EMISMATCH, EMBD_EMISMATCH },
		.want_msg = { "node 1: table 'ads' exists on node 1, not here",
			      "table 'ads' exists here, not on node 0" },
	};
	run_cluster(&c);
}

Test(collective_plan, plan_for_another_topology_is_refused)
{
	struct cluster c = {
		.nodes = 2, .local = 2, .twist = TWIST_PLAN_TOPOLOGY, .altered = -1,
		.timeout_ms = 10000, .absent = -1, .want_rc = { EMBD_EMISMATCH, EMBD_EMISMATCH },
		.want_msg = { "node 1 refused: plan topology batch_size 512 here, 1024 in node 0's plan",
			      "plan topology batch_size 512 here, 1024 in node 0's plan" },
	};
	run_cluster(&c);
}

Test(collective_plan, missing_node_is_a_timeout_naming_it)
{
	struct cluster c = {
		.nodes = 3, .local = 1, .altered = -1, .timeout_ms = 800, .absent = 2,
		.want_rc = { EMBD_ETIMEDOUT, EMBD_ETIMEDOUT },
		.want_msg = { "node(s) 2 did not join within 800 ms", "node 0's verdict" },
	};
	int64_t t0 = embd_now_ms();
	run_cluster(&c);
	cr_assert(embd_now_ms() - t0 < 800 * 2 + 4000, "took %lld ms",
		  (long long)(embd_now_ms() - t0));
}

/* A joiner that speaks another protocol version: hand-made records in the store. */
static int child_old_protocol(int node, void *arg)
{
	(void)node;
	(void)arg;
	struct embd_store *s = NULL;
	char err[256];
	void *v = NULL;
	size_t len;
	const char *record = "{\"protocol\": 1, \"node_rank\": 1, \"world_size\": 2}";
	TU_CHECK(embd_store_connect("127.0.0.1", tu_port, 5000, &s, err, sizeof(err)) == 0, "%s", err);
	TU_CHECK(embd_store_add(s, "t/joined/1", 1, NULL) == 0, "%s", embd_store_error(s));
	TU_CHECK(embd_store_set(s, "t/join/1", record, strlen(record)) == 0, "%s",
		 embd_store_error(s));
	TU_CHECK(embd_store_get(s, "t/verdict/1", &v, &len) == 0, "%s", embd_store_error(s));
	TU_CHECK(len > 20 && memmem(v, len, "protocol version 2 here, 1 on node 1", 36),
		 "verdict: %.*s", (int)len, (char *)v);
	free(v);
	TU_CHECK(embd_store_set(s, "t/result/1", "refused", 7) == 0, "%s", embd_store_error(s));
	embd_store_close(s);
	return 0;
}

Test(collective_plan, other_protocol_version_is_refused)
{
	struct cluster c = {
		.nodes = 2, .local = 1, .altered = -1, .timeout_ms = 10000, .absent = 1,
		.want_rc = { EMBD_EMISMATCH },
		.want_msg = { "node 1: protocol version 2 here, 1 on node 1" },
		.stand_in = child_old_protocol,
	};
	run_cluster(&c);
}

static int child_duplicate(int node, void *arg)
{
	(void)arg;
	struct cluster c = { .nodes = 2, .local = 1, .altered = -1, .timeout_ms = 3000,
			     .absent = -1, .want_rc = { 0, 0 } };
	if (node == 2) {        /* a second node_rank 1, after the first has finished */
		usleep(1500 * 1000);
		c.want_rc[1] = EMBD_EMISMATCH;
		c.want_msg[1] = "node_rank 1 joined 2 times";
		return child_node(1, &c);
	}
	return child_node(node, &c);
}

Test(collective_plan, node_rank_joining_twice_is_refused)
{
	pid_t pids[3];
	int codes[3];
	tu_spawn_n(child_duplicate, 3, NULL, pids);
	cr_assert_eq(tu_join(pids, 3, 20000, codes), 0, "exits %d %d %d", codes[0], codes[1],
		     codes[2]);
}

/* ---- the store helper ------------------------------------------------------------------ */

enum { STORE_NO_PORT = 2 }; /* child_rendezvous_store's exit code when node 0 could not listen */

static int child_rendezvous_store(int node, void *arg)
{
	struct embd_rendezvous r;
	struct embd_store_server *srv = NULL;
	struct embd_store *store = NULL;
	char err[256] = "";
	int64_t n = 0;
	embd_rendezvous_defaults(&r);
	r.master_port = *(uint16_t *)arg;
	r.world_size = 2;
	r.node_rank = node;
	if (node == 0)
		usleep(300 * 1000);     /* the other node is up first and must retry */
	int rc = embd_rendezvous_store(&r, 5000, &srv, &store, err, sizeof(err));
	if (rc == EMBD_EBUSY && node == 0) {
		/* another test took the port while this one waited (ports.h): the parent retries */
		fprintf(stderr, "[child %d] node 0: %s\n", (int)getpid(), err);
		return STORE_NO_PORT;
	}
	TU_CHECK(rc == 0, "%s", err);
	TU_CHECK((srv != NULL) == (node == 0), "only node 0 serves");
	TU_CHECK(embd_store_add(store, "both", 1, &n) == 0, "%s", embd_store_error(store));
	const char *k = "both_done";
	if (n == 2)
		TU_CHECK(embd_store_set(store, k, "1", 1) == 0, "%s", embd_store_error(store));
	TU_CHECK(embd_store_wait(store, &k, 1) == 0, "%s", embd_store_error(store));
	/* node 0 serves until node 1 has seen both_done */
	if (node == 0) {
		const char *bye = "bye";
		TU_CHECK(embd_store_wait(store, &bye, 1) == 0, "%s", embd_store_error(store));
	} else {
		TU_CHECK(embd_store_set(store, "bye", "", 0) == 0, "%s", embd_store_error(store));
	}
	embd_store_close(store);
	embd_store_server_stop(srv);
	return 0;
}

Test(rendezvous_env, store_served_by_node_0, .init = clear_env)
{
	for (int attempt = 1;; attempt++) {
		uint16_t p = tu_free_port();
		pid_t pids[2];
		int codes[2];
		tu_spawn_n(child_rendezvous_store, 2, &p, pids);
		/* node 0 serves until node 1 is done, so it exits last; node 1 is not left
		 * talking to whoever took the port */
		int rc = tu_join(pids, 1, 15000, codes);
		if (codes[0] == STORE_NO_PORT)
			kill(pids[1], SIGKILL);
		rc += tu_join(pids + 1, 1, 15000, codes + 1);
		if (codes[0] == STORE_NO_PORT && attempt < 3)
			continue;
		cr_assert_eq(rc, 0, "exits %d %d", codes[0], codes[1]);
		return;
	}
}
