/*
 * Integration: several embd nodes as on separate hosts. Each node and its trainers run in a
 * network namespace of their own, whose only link is a veth pair into a bridge in a hub
 * namespace (10.77.0.<n + 1>/24 on eth0; nothing reaches the machine's own network), so
 * 127.0.0.1 is a different host for every node and a Gloo device that advertised it could
 * not connect. master_addr is node 0's 10.77.0.1, nodes 0 and 1 find their Gloo address by
 * the route to it (the default) and node 2 by GLOO_SOCKET_IFNAME=eth0; then forward and K
 * training steps equal the unsharded reference, as in test_integration_dist.c. One more case
 * (198.18.0.0/24) gives node 0 MASTER_ADDR=127.0.0.1, so its own route is loopback and it must
 * advertise the address its peer reaches it at.
 *
 * Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 with veth and bridge support:
 * skipped with the reason otherwise. Names carry the test process's pid, so parallel runs
 * do not collide; the namespaces go in the suite's fini (a failed assertion too), and
 * namespaces left by a killed run are removed by the next one.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/integration/dist_fixture.h"

#define NS_PREFIX "embd-t"      /* embd-t<pid>-hub, embd-t<pid>-<node> */

static char hub[32];

/* Runs a shell command quietly; its exit status (or -1). */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
	char cmd[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(cmd, sizeof(cmd), fmt, ap);
	va_end(ap);
	strncat(cmd, " >/dev/null 2>&1", sizeof(cmd) - strlen(cmd) - 1);
	int st = system(cmd);
	return st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
}

/* Namespaces of runs whose process is gone (a run killed before its fini). */
static void remove_stale(void)
{
	DIR *d = opendir("/run/netns");
	struct dirent *e;

	while (d && (e = readdir(d))) {
		long pid;
		if (strncmp(e->d_name, NS_PREFIX, strlen(NS_PREFIX)) ||
		    sscanf(e->d_name + strlen(NS_PREFIX), "%ld", &pid) != 1)
			continue;
		if (kill((pid_t)pid, 0) && errno == ESRCH)
			sh("ip netns del %s", e->d_name);
	}
	if (d)
		closedir(d);
}

static void teardown(void)
{
	stop_cluster();
	for (uint32_t n = 0; n < MAX_NODES; n++) {
		char name[32];
		snprintf(name, sizeof(name), NS_PREFIX "%d-%u", (int)getpid(), n);
		sh("ip netns del %s", name);
	}
	if (hub[0])
		sh("ip netns del %s", hub);
	hub[0] = 0;
	trainer_setup = NULL;
}

/* The hub with its bridge and N node namespaces linked to it; cr_skip when the machine does
 * not allow it (the first command that failed is the reason). */
static void make_network(uint32_t N, const char *subnet)
{
	const int pid = (int)getpid();

	if (geteuid() != 0)
		cr_skip_test("network namespaces need root (euid %d)", (int)geteuid());
	if (sh("ip -V"))
		cr_skip_test("no 'ip' command (iproute2)");
	remove_stale();
	snprintf(hub, sizeof(hub), NS_PREFIX "%d-hub", pid);
	if (sh("ip netns add %s", hub)) {
		hub[0] = 0;
		cr_skip_test("'ip netns add' failed: no CAP_SYS_ADMIN / CAP_NET_ADMIN here");
	}
	if (sh("ip -n %s link add br0 type bridge && ip -n %s link set br0 up", hub, hub))
		cr_skip_test("no bridge device in namespace %s", hub);
	for (uint32_t n = 0; n < N; n++) {
		struct node *nd = &nodes[n];
		snprintf(nd->netns, sizeof(nd->netns), NS_PREFIX "%d-%u", pid, n);
		if (sh("ip netns add %s", nd->netns))
			cr_skip_test("'ip netns add %s' failed", nd->netns);
		if (sh("ip -n %s link add p%u type veth peer name eth0 netns %s", hub, n, nd->netns))
			cr_skip_test("no veth pair between %s and %s", hub, nd->netns);
		cr_assert_eq(sh("ip -n %s link set p%u master br0 up && "
				"ip -n %s addr add %s.%u/24 dev eth0 && "
				"ip -n %s link set eth0 up && ip -n %s link set lo up", hub, n,
				nd->netns, subnet, n + 1, nd->netns, nd->netns), 0,
			     "configuring %s's link failed", nd->netns);
	}
}

TestSuite(netns, .fini = teardown, .timeout = 60);

static void train_in_namespaces(uint32_t N, const char *sharding)
{
	make_network(N, "10.77.0");
	strcpy(dist_master_addr, "10.77.0.1");
	if (N > 2)
		strcpy(nodes[2].gloo_ifname, "eth0");
	trainer_setup = enter_node_netns;
	train_cluster(N, sharding, "network namespaces");
}

Test(netns, two_hosts_row_wise) { train_in_namespaces(2, "row_wise"); }
Test(netns, two_hosts_table_column_wise) { train_in_namespaces(2, "table_column_wise"); }
Test(netns, three_hosts_table_row_wise) { train_in_namespaces(3, "table_row_wise"); }

/* Node 0 reaches its own store through 127.0.0.1 (as when master_addr is node 0's hostname,
 * which resolves to 127.0.1.1 there): its route is loopback, and it must advertise the
 * address its peers reach it at instead. The subnet sorts above 127/8, so Gloo makes node 1
 * the connecting side of the pair (the larger address connects): a node 0 advertising
 * 127.0.0.1 would send node 1 to its own loopback. */
Test(netns, node_0_addressed_by_loopback_advertises_its_peers_view)
{
	make_network(2, "198.18.0");
	strcpy(dist_master_addr, "198.18.0.1");
	strcpy(nodes[0].env, "MASTER_ADDR=127.0.0.1");
	trainer_setup = enter_node_netns;
	train_cluster(2, "table_wise", "node 0 addressed by loopback");
}
