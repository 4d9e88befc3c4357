/*
 * embd: the node's embedding service. Reads its config (or the embedded default), plans or
 * loads and checks the plan, starts the CPU ranks and their shards, and serves trainers on the
 * control socket until SIGTERM / SIGINT. Signals are blocked in every thread and read from a
 * signalfd by the event loop, so no handler ever runs in the middle of a step.
 *
 * For tests and systemd alike: "ready" is logged (and READY=1 sent through sd_notify when
 * NOTIFY_SOCKET is set) only once the socket listens, and a stop by signal exits 0.
 */
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt_service.h"
#include "dist/comm.h"
#include "daemon/config.h"
#include "daemon/config_plan.h"
#include "common/log.h"
#include "engine/ranks.h"
#include "dist/regroup.h"
#include "dist/collective_plan.h"
#include "dist/rendezvous.h"
#include "daemon/server.h"
#include "engine/step.h"
#include "dist/store.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: embd [--config FILE] [--socket PATH] [--log-level LEVEL]\n"
		"       embd --print-default-config | --help | --version\n"
		"\n"
		"  --config FILE          service config (JSON, see daemon/config.h); without it\n"
		"                         the embedded default (--print-default-config) is used\n"
		"  --socket PATH          control socket, overrides the config's socket_path\n"
		"  --log-level LEVEL      error, warning, notice, info or debug\n"
		"  --print-default-config print the embedded default config and exit\n");
}

/* What a node of several holds besides its step engine. */
struct cluster {
	struct embd_store_server *server;       /* node 0 only */
	struct embd_store *store;
	struct embd_comm *comm;                 /* generation 0; then owned by regroup */
	struct embd_regroup *regroup;
	bool rejoining;                         /* restarted into a running cluster */
};

static void cluster_close(struct cluster *cl)
{
	embd_regroup_destroy(cl->regroup);
	embd_comm_destroy(cl->comm);
	embd_store_close(cl->store);
	embd_store_server_stop(cl->server);
}

/*
 * env:// over the config (dist/rendezvous.h): MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
 * LOCAL_WORLD_SIZE and NODE_RANK in the environment win over the config's keys.
 */
static int resolve_env(struct embd_config *c, struct embd_rendezvous *r, char *err,
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

/*
 * Several nodes: node 0 serves the store, every node connects, collective_plan makes every
 * node agree on node 0's plan (or all refuse, naming the difference), and the comm joins
 * one Gloo participant per node.
 */
static int cluster_join(const struct embd_config *c, const struct embd_rendezvous *r,
			struct cluster *cl, struct embd_plan **plan, char *err, size_t err_len)
{
	char inner[768];
	int rc;

	if (c->node_rank == 0 && (rc = embd_config_plan(c, plan, inner, sizeof(inner))))
		return snprintf(err, err_len, "plan: %s", inner), rc;
	rc = embd_rendezvous_store(r, c->store_timeout_ms, &cl->server, &cl->store, inner,
				   sizeof(inner));
	if (rc)
		return snprintf(err, err_len, "store: %s", inner), rc;
	char addr[EMBD_RENDEZVOUS_COMM_ADDR_MAX] = "";
	const char *how = NULL;
	if (c->backend == EMBD_COMM_GLOO) {
		if ((rc = embd_rendezvous_comm_addr(r, addr, sizeof(addr), &how, inner,
						    sizeof(inner))))
			return snprintf(err, err_len, "comm: %s", inner), rc;
	}
	if (c->node_rank == 0) {
		/* which store this is, for nodes that reconnect after a failure (regroup.h) */
		struct timespec ts;
		char id[64];
		clock_gettime(CLOCK_REALTIME, &ts);
		snprintf(id, sizeof(id), "%d.%lld.%09ld", (int)getpid(), (long long)ts.tv_sec,
			 ts.tv_nsec);
		if ((rc = embd_store_set(cl->store, EMBD_REGROUP_INSTANCE_KEY, id, strlen(id))))
			return snprintf(err, err_len, "store: %s", embd_store_error(cl->store)), rc;
	}
	struct embd_regroup_options ro = {
		.node = c->node_rank, .nodes = embd_config_nodes(c), .backend = c->backend,
		.collective_timeout_ms = c->collective_timeout_ms,
		.store_timeout_ms = c->store_timeout_ms,
	};
	snprintf(ro.hostname, sizeof(ro.hostname), "%s", addr);
	char *settings = NULL;
	if ((rc = embd_config_join_settings(c, &settings)))
		return snprintf(err, err_len, "out of memory"), rc;
	/* a node that restarts into a running cluster joins its next generation instead */
	rc = embd_collective_plan_rejoin(cl->store, r, &c->tables, &c->topology, settings,
					 c->store_timeout_ms, plan, inner, sizeof(inner));
	if (rc == 0)
		rc = embd_collective_plan(cl->store, r, &c->tables, &c->topology, settings, NULL,
					  c->store_timeout_ms, plan, inner, sizeof(inner));
	else if (rc == 1)
		embd_log_warning("node %u: the cluster runs already: rejoining it (this node's "
				 "shards are lost until a restore)", c->node_rank);
	free(settings);
	if (rc == 1) {
		cl->rejoining = true;
		if (how)
			embd_log_info("gloo: node %u listens on %s (%s)", c->node_rank, addr, how);
		return embd_regroup_create(&ro, cl->store, NULL, &cl->regroup);
	}
	if (rc)
		return snprintf(err, err_len, "collective_plan: %s", inner), rc;
	if (c->backend == EMBD_COMM_GLOO) {
		/* every node is in: node 0 may learn its outward address from the others */
		if ((rc = embd_rendezvous_comm_addr_settle(r, cl->store, addr, sizeof(addr), &how,
							   inner, sizeof(inner))))
			return snprintf(err, err_len, "comm: %s", inner), rc;
		snprintf(ro.hostname, sizeof(ro.hostname), "%s", addr);
		embd_log_info("gloo: node %u listens on %s (%s)", c->node_rank, addr, how);
	}
	struct embd_comm_options o = {
		.backend = c->backend, .rank = c->node_rank, .size = embd_config_nodes(c),
		.timeout_ms = c->collective_timeout_ms, .hostname = addr, .prefix = "embd/gloo/0/",
	};
	rc = embd_comm_create(&o, cl->store, &cl->comm, inner, sizeof(inner));
	if (rc)
		return snprintf(err, err_len, "comm: %s", inner), rc;
	rc = embd_regroup_create(&ro, cl->store, cl->comm, &cl->regroup);
	if (!rc)
		cl->comm = NULL;
	return rc;
}

static void log_plan(struct embd_plan *plan)
{
	char *text = NULL;

	if (embd_plan_stats_text(plan, &text))
		return;
	for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n"))
		embd_log_info("plan: %s", line);
	free(text);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "socket", required_argument, NULL, 's' },
		{ "log-level", required_argument, NULL, 'l' },
		{ "print-default-config", no_argument, NULL, 'p' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	const char *config_path = NULL, *socket_path = NULL, *level_name = NULL;
	struct embd_config config = { 0 };
	struct embd_ckpt_settings ckpt_settings = { 0 };
	struct embd_plan *plan = NULL;
	struct embd_ranks *ranks = NULL;
	struct embd_step *step = NULL;
	struct embd_server *server = NULL;
	struct embd_ckpt_service *ckpt = NULL;
	uint64_t resumed_step = 0;
	struct cluster cluster = { 0 };
	enum embd_log_level level;
	char err[1024] = "";
	int sigfd = -1, rc, opt;

	while ((opt = getopt_long(argc, argv, "c:s:l:hV", opts, NULL)) != -1) {
		switch (opt) {
		case 'c': config_path = optarg; break;
		case 's': socket_path = optarg; break;
		case 'l': level_name = optarg; break;
		case 'p': fputs(embd_config_default_text(), stdout); return 0;
		case 'h': usage(stdout); return 0;
		case 'V': printf("embd %s\n", EMBD_VERSION); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "embd: unexpected argument '%s'\n", argv[optind]);
		usage(stderr);
		return 2;
	}
	if (level_name && embd_log_level_from_name(level_name, &level)) {
		fprintf(stderr, "embd: --log-level: '%s' is not error, warning, notice, info or debug\n",
			level_name);
		return 2;
	}
	if (socket_path && strlen(socket_path) >= EMBD_CONFIG_SOCKET_MAX) {
		fprintf(stderr, "embd: --socket: path longer than %zu bytes\n",
			EMBD_CONFIG_SOCKET_MAX - 1);
		return 2;
	}
	embd_log_init();
	rc = config_path ? embd_config_load(config_path, &config, err, sizeof(err))
			 : embd_config_parse(embd_config_default_text(),
					     strlen(embd_config_default_text()), &config, err,
					     sizeof(err));
	if (rc) {
		embd_log_error("config: %s", err);
		return 1;
	}
	if (socket_path)
		strcpy(config.socket_path, socket_path);
	embd_log_set_level(level_name ? level : config.log_level);
	if (level_name)
		config.log_level = level;
	embd_log_info("embd %s starting: %s, %u tables, %d ranks, %u trainers", EMBD_VERSION,
		      config_path ? config_path : "embedded default config", config.tables.count,
		      config.topology.local_world_size, config.trainers_per_node);

	/* block before any thread exists, so every thread inherits the mask */
	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	/* a trainer that hangs up mid-send must cost an EPIPE, not the service */
	signal(SIGPIPE, SIG_IGN);
	sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
	rc = sigfd < 0 ? EMBD_EIO : 0;
	if (rc) {
		embd_log_error("signalfd failed");
		goto out;
	}
	struct embd_rendezvous rdv;
	rc = resolve_env(&config, &rdv, err, sizeof(err));
	if (rc) {
		embd_log_error("env://: %s", err);
		goto out;
	}
	const uint32_t nodes = embd_config_nodes(&config);
	if (nodes > 1) {
		embd_log_info("node %u of %u: store at %s:%u, %s, collective timeout %d ms",
			      config.node_rank, nodes, config.master_addr, config.master_port,
			      config.backend == EMBD_COMM_GLOO ? "gloo" : "nccl",
			      config.collective_timeout_ms);
		rc = cluster_join(&config, &rdv, &cluster, &plan, err, sizeof(err));
		if (rc) {
			embd_log_error("join: %s (%s)", err, embd_strerror(rc));
			goto out;
		}
	} else {
		rc = embd_config_plan(&config, &plan, err, sizeof(err));
		if (rc) {
			embd_log_error("plan: %s (%s)", err, embd_strerror(rc));
			goto out;
		}
	}
	char *json = NULL;
	size_t json_len;
	rc = embd_plan_write_json(plan, &json, &json_len);   /* also sets plan_hash */
	free(json);
	if (rc)
		goto out;
	log_plan(plan);

	rc = embd_ranks_create((uint32_t)config.topology.local_world_size, config.threads_per_rank,
			       &ranks, err, sizeof(err));
	struct embd_step_cluster where = {
		config.node_rank, nodes, cluster.regroup ? embd_regroup_comm(cluster.regroup) : NULL,
		cluster.store, config.collective_timeout_ms };
	if (!rc)
		rc = embd_step_create_cluster(&config.tables, plan, ranks, config.seed,
					      config.trainers_per_node, &where, &step, err,
					      sizeof(err));
	/* checkpoints: the newest valid one is restored before the socket accepts anyone */
	if (!rc && config.checkpoint_dir[0]) {
		embd_config_ckpt_settings(&config, &ckpt_settings);
		rc = embd_ckpt_service_create(&ckpt_settings, step, plan, &ckpt, err, sizeof(err));
		/* a rejoining node restores when the cluster decides it (dist/regroup.h) */
		if (!rc && !cluster.rejoining)
			rc = embd_ckpt_service_restore(ckpt, &resumed_step, err, sizeof(err));
	}
	if (!rc)
		rc = embd_server_create(&config, step, ranks, plan->plan_hash, sigfd, &server, err,
					sizeof(err));
	if (!rc && ckpt && embd_server_set_checkpoints(server, ckpt, resumed_step)) {
		rc = EMBD_EIO;
		snprintf(err, sizeof(err), "cannot watch the checkpoint writer");
	}
	if (rc) {
		embd_log_error("start: %s", err);
		goto out;
	}
	if (cluster.regroup)
		embd_server_set_regroup(server, cluster.regroup, cluster.rejoining, resumed_step);
	for (uint32_t r = 0; r < embd_ranks_count(ranks); r++)
		embd_log_info("rank %u: NUMA node %d, %" PRIu64 " bytes of shards", r,
			      embd_ranks_node(ranks, r), embd_ranks_memory_bytes(ranks, r));
	embd_log_notice("ready: listening on %s, plan %016" PRIx64 ", step %" PRIu64,
			config.socket_path, plan->plan_hash, resumed_step);
	sd_notify(0, "READY=1");
	rc = embd_server_run(server);
	sd_notify(0, "STOPPING=1");
	char why[256];
	if (ckpt && !embd_server_cluster_running(server, why, sizeof(why))) {
		/* the shards may differ between the nodes and the step ran ahead of them */
		embd_log_warning("no final checkpoint: the cluster is not running (%s); the newest "
				 "cluster checkpoint stays the one to restore", why);
	} else if (ckpt) {
		/* the final checkpoint: no step phase runs any more, so the shards are at "step" */
		int crc = embd_ckpt_service_final(ckpt, embd_server_step(server));
		if (crc)
			rc = crc;
	}
	embd_log_notice("stopped");
out:
	embd_server_destroy(server);
	embd_ckpt_service_destroy(ckpt);
	embd_step_destroy(step);
	cluster_close(&cluster);
	embd_ranks_destroy(ranks);
	embd_plan_destroy(plan);
	embd_config_free(&config);
	if (sigfd >= 0)
		close(sigfd);
	return rc ? 1 : 0;
}
