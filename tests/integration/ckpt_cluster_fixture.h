/*
 * tests/integration/ckpt_cluster_fixture.h - cluster checkpoint tests' common parts on top of
 * dist_fixture.h: a checkpoint root per test process (one shared checkpoint_dir), whether a
 * step directory is there, stopping and restarting the nodes, the resumed step of a run
 * (not every test uses every helper, hence the unused attributes).
 */
#ifndef EMBD_TESTS_CKPT_CLUSTER_FIXTURE_H
#define EMBD_TESTS_CKPT_CLUSTER_FIXTURE_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/integration/dist_fixture.h"

static char ckpt_root[128];

static void remove_root(void)
{
	char cmd[192];

	if (!ckpt_root[0] || getenv("EMBD_TEST_KEEP"))
		return;
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", ckpt_root);
	if (system(cmd))
		fprintf(stderr, "cannot remove %s\n", ckpt_root);
}

/* Kills every node (SIGKILL: no final checkpoint), keeping the checkpoint directory. */
static void kill_nodes(void)
{
	for (uint32_t n = 0; n < num_nodes; n++)
		stop_node(n, SIGKILL);
}

/* Criterion fini: the nodes are killed (a SIGTERMed node of a cluster would wait for the
 * others' final checkpoint), then the cluster's files and the checkpoint root go. */
static void ckpt_cluster_fini(void)
{
	kill_nodes();
	stop_cluster();
	remove_root();
}

/* A fresh checkpoint_dir for this test and the config keys that point at it. */
static void use_checkpoints(uint32_t every_steps)
{
	snprintf(ckpt_root, sizeof(ckpt_root), "/tmp/embd-ckpt-cluster-%s", dist_run_id());
	snprintf(dist_extra_json, sizeof(dist_extra_json), ", \"checkpoint_dir\": \"%s\", "
		 "\"checkpoint_every_steps\": %u, \"checkpoint_keep\": 0", ckpt_root, every_steps);
}

static bool has_step(uint64_t step, bool tmp)
{
	char path[192];

	snprintf(path, sizeof(path), "%s/%sstep-%llu%s", ckpt_root, tmp ? ".tmp-" : "",
		 (unsigned long long)step, tmp ? "" : "/manifest.json");
	return access(path, F_OK) == 0;
}

/* Stops every node (SIGTERM to all first, as a job scheduler does: a cluster's final
 * checkpoint needs every node), keeping the checkpoint directory. */
__attribute__((unused)) static void stop_nodes(void)
{
	for (uint32_t n = 0; n < num_nodes; n++)
		if (nodes[n].embd.pid > 0)
			kill(nodes[n].embd.pid, SIGTERM);
	for (uint32_t n = 0; n < num_nodes; n++) {
		int st;
		tu_embd_wait(&nodes[n].embd, 15000, &st);
		stop_node(n, SIGKILL);
	}
}

/* Kills node n and starts it again; node 1 must listen again (node 0 never does: it waits
 * for joiners that still run the old cluster). */
__attribute__((unused)) static void restart_node(uint32_t n)
{
	char name[32];

	stop_node(n, SIGKILL);
	spawn(n);
	if (n == 0)
		return;
	snprintf(name, sizeof(name), "restarted node %u", n);
	tu_embd_await_socket(&nodes[n].embd, 15000, name);
}

/* The newest step-<N> with a manifest under dir (-1: none) and how many step-<N> and
 * .tmp-step-<N> entries dir holds. */
__attribute__((unused)) static long long newest_step(const char *dir, int *entries)
{
	DIR *d = opendir(dir);
	long long newest = -1;
	char path[512];

	*entries = 0;
	for (struct dirent *e; d && (e = readdir(d));) {
		bool tmp = !strncmp(e->d_name, ".tmp-step-", 10);
		if (!tmp && strncmp(e->d_name, "step-", 5))
			continue;
		(*entries)++;
		snprintf(path, sizeof(path), "%s/%s/manifest.json", dir, e->d_name);
		long long s = atoll(e->d_name + 5);
		if (!tmp && access(path, F_OK) == 0 && s > newest)
			newest = s;
	}
	if (d)
		closedir(d);
	return newest;
}

/* N nodes of sharding, trainers_per_node each, run K_STEPS into a new mapping. */
static struct shared *train(uint32_t N, const char *sharding, uint32_t per_node)
{
	const char *sockets[MAX_NODES];
	struct shared *sh = shared_map();

	dist_trainers_per_node = per_node;
	start_cluster(N, sharding);
	for (uint32_t n = 0; n < N; n++)
		sockets[n] = nodes[n].embd.socket;
	run_trainers(sh, N * per_node, sockets, per_node);
	return sh;
}

static void expect_resumed(const struct shared *sh, uint32_t trainers, uint64_t step,
			   const char *what)
{
	for (uint32_t g = 0; g < trainers; g++)
		cr_expect_eq(sh->resumed_step[g], step, "%s: trainer %u: expected resumed step %llu, "
			     "got %llu", what, g, (unsigned long long)step,
			     (unsigned long long)sh->resumed_step[g]);
}

#endif
