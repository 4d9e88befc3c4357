/*
 * tests/integration/dist_fixture.h - several real embd processes as the nodes of one cluster
 * on 127.0.0.1 (each with its own socket, config and log, one MASTER_PORT per start), RANKS
 * ranks per node: plans that spread the tables over the nodes, configs, start and stop. A
 * test may set dist_trainers_per_node, dist_store_timeout_ms, dist_extra_json (more config
 * keys, e.g. checkpoints), dist_master_addr, and each node's netns (a network namespace under
 * /run/netns that the node runs in), gloo_ifname (its GLOO_SOCKET_IFNAME) and env (one
 * "NAME=value" in its environment, e.g. a test hook) before start_cluster; stop_cluster
 * resets them. tests/gpu/run.sh runs the same tests on GPUs: EMBD_TEST_COMPUTE_DEVICE=cuda
 * gives each node the GPUs RANKS * n .. RANKS * n + RANKS - 1 (CUDA_VISIBLE_DEVICES) and
 * EMBD_TEST_BACKEND=nccl the NCCL comm (defaults: cpu, gloo).
 */
#ifndef EMBD_TESTS_DIST_FIXTURE_H
#define EMBD_TESTS_DIST_FIXTURE_H

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "tests/integration/training_common.h"
#include "tests/support/embd_process.h"
#include "tests/support/ports.h"

#define MAX_NODES 3
#define RANKS 2                         /* per node, and trainers per node */
#define TIMEOUT_MS 2000                 /* collective_timeout_ms of every test */

static uint32_t dist_trainers_per_node = RANKS;
static int dist_store_timeout_ms = 8000;
static char dist_extra_json[1024];      /* ", \"key\": value, ..." or "" */
static char dist_node_json[MAX_NODES][256];     /* the same, for one node */
static char dist_master_addr[64] = "127.0.0.1";

struct node {
	struct tu_embd embd;            /* its process, socket and log */
	bool rank_from_env;             /* config says node_rank 0, NODE_RANK says which */
	char netns[32];                 /* "" or the network namespace the node runs in */
	char gloo_ifname[16];           /* "" or GLOO_SOCKET_IFNAME for the node */
	char env[96];                   /* "" or "NAME=value" for the node's environment */
	char config[128], plan[128];
};

static struct node nodes[MAX_NODES];
static uint32_t num_nodes;
static uint16_t port;

/* ---- plans that spread the tables over the nodes ----------------------------------------- */

static void write_shard(FILE *f, bool first, int rank, int64_t row, int64_t rows, int col,
			int cols)
{
	fprintf(f, "%s{\"rank\": %d, \"row_offset\": %lld, \"rows\": %lld, \"col_offset\": %d, "
		"\"cols\": %d}", first ? "" : ", ", rank, (long long)row, (long long)rows, col, cols);
}

/* Table t's shards for sharding on N nodes: table 0 toward the last node, table 1 node 0. */
static void write_table_shards(FILE *f, const char *sharding, uint32_t t, uint32_t N)
{
	const int W = (int)(N * RANKS), dim = (int)tables[t].dim;
	const int64_t rows = tables[t].rows;
	const int home = t == 0 ? (int)(N - 1) * RANKS : 0;     /* first rank of the table's node */

	if (!strcmp(sharding, "table_wise")) {
		write_shard(f, true, t == 0 ? W - 1 : 1, 0, rows, 0, dim);
	} else if (!strcmp(sharding, "column_wise")) {
		/* two column shards on two different nodes */
		write_shard(f, true, t == 0 ? 1 : W - 1, 0, rows, 0, dim / 2);
		write_shard(f, false, t == 0 ? W - 2 : 0, 0, rows, dim / 2, dim / 2);
	} else if (!strcmp(sharding, "table_column_wise")) {
		write_shard(f, true, home, 0, rows, 0, dim / 2);
		write_shard(f, false, home + 1, 0, rows, dim / 2, dim / 2);
	} else if (!strcmp(sharding, "row_wise") || !strcmp(sharding, "table_row_wise")) {
		int n = !strcmp(sharding, "row_wise") ? W : RANKS;
		int first = !strcmp(sharding, "row_wise") ? 0 : home;
		int64_t block = (rows + n - 1) / n;
		for (int r = 0; r < n; r++)
			write_shard(f, r == 0, first + r, block * r,
				    rows - block * r < block ? rows - block * r : block, 0, dim);
	} else { /* data_parallel */
		for (int r = 0; r < W; r++)
			write_shard(f, r == 0, r, 0, rows, 0, dim);
	}
}

/* The comm of every node: EMBD_TEST_BACKEND (gloo or nccl), gloo by default. */
static const char *dist_backend(void)
{
	const char *backend = getenv("EMBD_TEST_BACKEND");

	if (!backend || !*backend)
		return "gloo";
	cr_assert(!strcmp(backend, "gloo") || !strcmp(backend, "nccl"),
		  "EMBD_TEST_BACKEND=%s: expected gloo or nccl", backend);
	return backend;
}

static void topology_json(FILE *f, uint32_t N)
{
	fprintf(f, "{\"world_size\": %u, \"local_world_size\": %u, \"compute_device\": \"%s\", "
		"\"hbm_cap\": \"1G\", \"ddr_cap\": \"1G\", \"batch_size\": %d}", N * RANKS, RANKS,
		test_on_gpus() ? "cuda" : "cpu", BATCH);
}

static void write_plan(const char *path, const char *sharding, uint32_t N)
{
	FILE *f = fopen(path, "w");

	cr_assert_not_null(f, "cannot write %s: %s", path, strerror(errno));
	fprintf(f, "{\"version\": 1, \"topology\": ");
	topology_json(f, N);
	fprintf(f, ", \"tables\": [");
	for (uint32_t t = 0; t < NUM_TABLES; t++) {
		/* data_parallel trains with the dense kernel, as TorchRec's (its only CPU kernel) */
		fprintf(f, "%s{\"name\": \"%s\", \"sharding_type\": \"%s\", \"compute_kernel\": "
			"\"%s\", \"shards\": [", t ? ", " : "", tables[t].name, sharding,
			strcmp(sharding, "data_parallel") ? "fused" : "dense");
		write_table_shards(f, sharding, t, N);
		fprintf(f, "]}");
	}
	fprintf(f, "]}\n");
	fclose(f);
}

/* ---- the nodes --------------------------------------------------------------------------- */

/* Node n's config; world_nodes: the world size it is told (N, or another one to mismatch);
 * tables_json: other tables than every other node's, or NULL. */
static void write_config(uint32_t n, const char *sharding, uint32_t world_nodes,
			 const char *tables_json)
{
	struct node *nd = &nodes[n];
	FILE *f = fopen(nd->config, "w");

	cr_assert_not_null(f, "cannot write %s: %s", nd->config, strerror(errno));
	fprintf(f, "{ ");
	if (tables_json)
		fprintf(f, "%s", tables_json);
	else
		write_tables(f, sharding);
	fprintf(f, ", \"topology\": ");
	topology_json(f, world_nodes);
	if (sharding)
		fprintf(f, ", \"plan_file\": \"%s\"", nd->plan);
	fprintf(f, ",\n \"trainers_per_node\": %u, \"seed\": %u, \"threads_per_rank\": 1, "
		"\"busy_poll_us\": 20, \"master_addr\": \"%s\", \"master_port\": %u, "
		"\"node_rank\": %u, \"backend\": \"%s\", \"collective_timeout_ms\": %d, "
		"\"store_timeout_ms\": %d%s%s }\n", dist_trainers_per_node, SEED, dist_master_addr,
		port, nd->rank_from_env ? 0 : n, dist_backend(), TIMEOUT_MS, dist_store_timeout_ms,
		dist_extra_json, dist_node_json[n]);
	fclose(f);
}

/* This test process's part of every name under /tmp: its pid and a tag drawn once per
 * process, since test runs in other PID namespaces may share /tmp (and reuse the pid). */
static const char *dist_run_id(void)
{
	static char id[40];
	static pid_t owner;

	if (owner != getpid()) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		owner = getpid();
		snprintf(id, sizeof(id), "%d-%06lx", (int)owner,
			 ((unsigned long)ts.tv_nsec ^ ((unsigned long)ts.tv_sec << 20)) & 0xfffffful);
	}
	return id;
}

static void node_paths(uint32_t n)
{
	struct node *nd = &nodes[n];
	const char *id = dist_run_id();

	snprintf(nd->embd.socket, sizeof(nd->embd.socket), "/tmp/embd-dist-%s-%u.sock", id, n);
	snprintf(nd->config, sizeof(nd->config), "/tmp/embd-dist-%s-%u.json", id, n);
	snprintf(nd->embd.log, sizeof(nd->embd.log), "/tmp/embd-dist-%s-%u.log", id, n);
	snprintf(nd->plan, sizeof(nd->plan), "/tmp/embd-dist-%s-plan.json", id);
}

/* Moves the calling process into node n's network namespace, if it has one; a child that
 * cannot exits 126 with why on stderr. */
static void enter_node_netns(uint32_t n)
{
	char path[64];
	int fd;

	if (!nodes[n].netns[0])
		return;
	snprintf(path, sizeof(path), "/run/netns/%s", nodes[n].netns);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || setns(fd, CLONE_NEWNET)) {
		fprintf(stderr, "node %u: cannot enter %s: %s\n", n, path, strerror(errno));
		_exit(126);
	}
	close(fd);
}

/* In node n's process before it execs embd: its environment and network namespace. */
static void node_child_setup(void *arg)
{
	const uint32_t n = (uint32_t)(uintptr_t)arg;
	const struct node *nd = &nodes[n];

	/* the config's env:// keys must win here: clear what a CI shell may have set */
	unsetenv("MASTER_ADDR");
	unsetenv("MASTER_PORT");
	unsetenv("NODE_RANK");
	unsetenv("WORLD_SIZE");
	unsetenv("LOCAL_WORLD_SIZE");
	unsetenv("GLOO_SOCKET_IFNAME");
	if (nd->gloo_ifname[0])
		setenv("GLOO_SOCKET_IFNAME", nd->gloo_ifname, 1);
	if (nd->env[0])
		putenv(nodes[n].env);
	if (test_on_gpus()) {
		/* the machine's GPUs split between the nodes, RANKS each */
		char gpus[64];
		size_t at = 0;
		for (uint32_t r = 0; r < RANKS; r++)
			at += (size_t)snprintf(gpus + at, sizeof(gpus) - at, "%s%u", r ? "," : "",
					       n * RANKS + r);
		setenv("CUDA_VISIBLE_DEVICES", gpus, 1);
	}
	enter_node_netns(n);
	if (nd->rank_from_env) {
		char rank[16];
		snprintf(rank, sizeof(rank), "%u", n);
		setenv("NODE_RANK", rank, 1);
	}
}

/* Starts node n's embd (its config written, its paths set); does not wait for it. */
static void spawn(uint32_t n)
{
	const struct tu_embd_opts o = { .config = nodes[n].config, .log_level = "warning",
					.child_setup = node_child_setup,
					.child_arg = (void *)(uintptr_t)n };

	tu_embd_start(&nodes[n].embd, &o);
}

static void read_log(uint32_t n, char *out, size_t len)
{
	tu_embd_read_log(&nodes[n].embd, out, len);
}

/* sig to node n, then SIGKILL if it still runs 3 s later. */
static void stop_node(uint32_t n, int sig)
{
	tu_embd_stop(&nodes[n].embd, sig, 3000, NULL);
}

/* Whether node 0 could not listen on port (its log says so): someone took the port between
 * tu_free_port and node 0's listen, and the caller starts again on another one. */
static bool node0_lost_port(void)
{
	return tu_embd_log_has(&nodes[0].embd, "Address already in use");
}

/* Starts N nodes (every sharding's plan from write_plan) and waits for every socket. A
 * port taken between tu_free_port and node 0's listen is retried with another one. */
static void start_cluster(uint32_t N, const char *sharding)
{
	char log[4096], name[64];

	num_nodes = N;
	for (int attempt = 0;; attempt++) {
		port = tu_free_port();
		for (uint32_t n = 0; n < N; n++)
			node_paths(n);
		if (sharding)
			write_plan(nodes[0].plan, sharding, N);
		for (uint32_t n = 0; n < N; n++) {
			write_config(n, sharding, N, NULL);
			spawn(n);
		}
		int st;
		usleep(100000);
		if (attempt == 3 || !tu_embd_wait(&nodes[0].embd, 0, &st))
			break;
		read_log(0, log, sizeof(log));
		if (!node0_lost_port())
			cr_assert_fail("node 0 exited (status 0x%x) before listening: %s", st, log);
		for (uint32_t n = 1; n < N; n++)
			stop_node(n, SIGKILL);
	}
	for (uint32_t n = 0; n < N; n++) {
		snprintf(name, sizeof(name), "node %u (%s)", n, sharding ? sharding : "any");
		tu_embd_await_socket(&nodes[n].embd, 15000, name);
	}
}

/* Starts N nodes under sharding's plan, runs one trainer process per rank through the
 * training steps and checks every output against the unsharded reference ("<what>, <N> nodes,
 * <sharding>" in failures). Not every test of the fixture trains, hence unused. */
__attribute__((unused)) static void train_cluster(uint32_t N, const char *sharding,
						  const char *what)
{
	const char *sockets[MAX_NODES];
	char name[96];

	start_cluster(N, sharding);
	struct shared *sh = shared_map();
	for (uint32_t n = 0; n < N; n++)
		sockets[n] = nodes[n].embd.socket;
	run_trainers(sh, N * RANKS, sockets, RANKS);
	snprintf(name, sizeof(name), "%s%s%u nodes, %s", what, what[0] ? ", " : "", N, sharding);
	check_against_reference(sh, N * RANKS, name);
	munmap(sh, sizeof(*sh));
}

/* Criterion fini: after a failed assertion too, no embd or trainer outlives its test. */
static void stop_cluster(void)
{
	tu_kill_children();
	/* EMBD_TEST_KEEP=1 keeps each node's config, plan and log (stderr) for a post-mortem */
	bool keep = getenv("EMBD_TEST_KEEP") != NULL;
	for (uint32_t n = 0; n < num_nodes; n++) {
		stop_node(n, SIGTERM);
		unlink(nodes[n].embd.socket);
		if (keep)
			continue;
		unlink(nodes[n].config);
		unlink(nodes[n].embd.log);
		unlink(nodes[n].plan);
	}
	num_nodes = 0;
	for (uint32_t n = 0; n < MAX_NODES; n++)
		nodes[n].netns[0] = nodes[n].gloo_ifname[0] = nodes[n].env[0] = 0;
	strcpy(dist_master_addr, "127.0.0.1");
	dist_trainers_per_node = RANKS;
	dist_store_timeout_ms = 8000;
	dist_extra_json[0] = 0;
	memset(dist_node_json, 0, sizeof(dist_node_json));
}

#endif /* EMBD_TESTS_DIST_FIXTURE_H */
