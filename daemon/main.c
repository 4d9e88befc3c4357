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
 * Several nodes: node 0 serves the store, every node connects, collective_plan makes every
 * node agree on node 0's plan (or all refuse, naming the difference), and the comm joins
 * one participant per node with one lane per rank (gloo: slots of one Gloo context; nccl: one
 * communicator per GPU, docs/cluster.md).
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
		.lanes = (uint32_t)c->topology.local_world_size,
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
		.lanes = ro.lanes, .timeout_ms = c->collective_timeout_ms, .hostname = addr,
		.prefix = "embd/gloo/0/",
	};
	rc = embd_comm_create(&o, cl->store, &cl->comm, inner, sizeof(inner));
	if (rc)
		return snprintf(err, err_len, "comm: %s", inner), rc;
	embd_log_info("comm %s: node %u of %u, %u lanes", embd_comm_backend_name(c->backend),
		      c->node_rank, embd_config_nodes(c), embd_comm_lanes(cl->comm));
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

/* The command line: what overrides the config. */
struct args {
	const char *config_path, *socket_path;
	bool has_level;
	enum embd_log_level level;
};

/* Everything the daemon builds, in the order it builds it (daemon_close undoes it). */
struct daemon {
	struct embd_config config;
	int sigfd;
	struct cluster cluster;
	struct embd_plan *plan;
	struct embd_ranks *ranks;
	struct embd_step *step;
	struct embd_ckpt_settings ckpt_settings;        /* the checkpointer keeps a pointer */
	struct embd_ckpt_service *ckpt;                 /* NULL without checkpoint_dir */
	uint64_t resumed_step;                          /* what a restore resumed at */
	struct embd_server *server;
};

/* -1 to go on, else the exit code (--help, --version, a bad flag). */
static int parse_args(int argc, char **argv, struct args *a)
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
	const char *level_name = NULL;
	int opt;

	*a = (struct args){ 0 };
	while ((opt = getopt_long(argc, argv, "c:s:l:hV", opts, NULL)) != -1) {
		switch (opt) {
		case 'c': a->config_path = optarg; break;
		case 's': a->socket_path = optarg; break;
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
	if (level_name && embd_log_level_from_name(level_name, &a->level)) {
		fprintf(stderr, "embd: --log-level: '%s' is not error, warning, notice, info or debug\n",
			level_name);
		return 2;
	}
	a->has_level = level_name != NULL;
	if (a->socket_path && strlen(a->socket_path) >= EMBD_CONFIG_SOCKET_MAX) {
		fprintf(stderr, "embd: --socket: path longer than %zu bytes\n",
			EMBD_CONFIG_SOCKET_MAX - 1);
		return 2;
	}
	return -1;
}

/* The config file (or the embedded default) with the command line's overrides. */
static int load_config(const struct args *a, struct embd_config *c)
{
	const char *text = embd_config_default_text();
	char err[1024] = "";
	int rc = a->config_path ? embd_config_load(a->config_path, c, err, sizeof(err))
				: embd_config_parse(text, strlen(text), c, err, sizeof(err));

	if (rc) {
		embd_log_error("config: %s", err);
		return rc;
	}
	if (a->socket_path)
		strcpy(c->socket_path, a->socket_path);
	if (a->has_level)
		c->log_level = a->level;
	embd_log_set_level(c->log_level);
	/* GPU ranks not given are counted later (resolve_devices logs the count) */
	char ranks[64];
	if (c->topology.compute_device != EMBD_DEVICE_CPU && !c->local_world_size_given)
		snprintf(ranks, sizeof(ranks), "one rank per visible %s",
			 embd_plan_device_name(c->topology.compute_device));
	else
		snprintf(ranks, sizeof(ranks), "%d ranks, %u trainers",
			 c->topology.local_world_size, c->trainers_per_node);
	embd_log_info("embd %s starting: %s, %u tables, %s", EMBD_VERSION,
		      a->config_path ? a->config_path : "embedded default config", c->tables.count,
		      ranks);
	return 0;
}

/* SIGTERM and SIGINT blocked in every thread (call before any thread exists, so every thread
 * inherits the mask) and read from a signalfd by the event loop. */
static int open_signals(int *sigfd)
{
	sigset_t mask;

	sigemptyset(&mask);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	/* a trainer that hangs up mid-send must cost an EPIPE, not the service */
	signal(SIGPIPE, SIG_IGN);
	*sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
	if (*sigfd < 0) {
		embd_log_error("signalfd failed");
		return EMBD_EIO;
	}
	return 0;
}

/* The plan: this node's own, or (several nodes) the one the cluster agreed on at the join. */
static int plan_node(struct daemon *d)
{
	struct embd_config *c = &d->config;
	struct embd_rendezvous rdv;
	char err[1024] = "";
	int rc = embd_config_resolve_env(c, &rdv, err, sizeof(err));

	if (rc) {
		embd_log_error("env://: %s", err);
		return rc;
	}
	const uint32_t nodes = embd_config_nodes(c);
	if (nodes > 1) {
		embd_log_info("node %u of %u: store at %s:%u, %s, collective timeout %d ms",
			      c->node_rank, nodes, c->master_addr, c->master_port,
			      c->backend == EMBD_COMM_GLOO ? "gloo" : "nccl",
			      c->collective_timeout_ms);
		rc = cluster_join(c, &rdv, &d->cluster, &d->plan, err, sizeof(err));
		if (rc) {
			embd_log_error("join: %s (%s)", err, embd_strerror(rc));
			return rc;
		}
	} else {
		rc = embd_config_plan(c, &d->plan, err, sizeof(err));
		if (rc) {
			embd_log_error("plan: %s (%s)", err, embd_strerror(rc));
			return rc;
		}
	}
	/* what the ready line and the status name the plan by (a checked plan has it already,
	 * but embd_plan_build does not promise it) */
	rc = embd_plan_hash(d->plan, &d->plan->plan_hash);
	if (rc) {
		embd_log_error("plan: %s", embd_strerror(rc));
		return rc;
	}
	log_plan(d->plan);
	return 0;
}

/*
 * GPU ranks: the GPUs this process may use, counted before anything is planned (a
 * local_world_size the config left out becomes their number). Without one, a single line
 * says so with the driver's reason, and embd exits.
 */
static int resolve_devices(struct embd_config *c)
{
	char err[512] = "";
	uint32_t devices = 0;
	int rc;

	if (c->topology.compute_device == EMBD_DEVICE_CPU)
		return 0;
	rc = embd_ranks_device_count(c->topology.compute_device, &devices, err, sizeof(err));
	if (!rc)
		rc = embd_config_resolve_devices(c, devices, err, sizeof(err));
	if (rc)
		embd_log_error("compute_device %s: %s",
			       embd_plan_device_name(c->topology.compute_device), err);
	else
		embd_log_info("compute_device %s: %u visible, %d ranks, %u trainers",
			      embd_plan_device_name(c->topology.compute_device), devices,
			      c->topology.local_world_size, c->trainers_per_node);
	return rc;
}

/* The ranks (CPU groups or GPUs) with their shards, and the step engine over them (and the
 * cluster's comm). */
static int start_engine(struct daemon *d, char *err, size_t err_len)
{
	const struct embd_config *c = &d->config;
	struct embd_regroup *rg = d->cluster.regroup;
	int rc = embd_ranks_create_on(c->topology.compute_device,
				      (uint32_t)c->topology.local_world_size, c->threads_per_rank,
				      &d->ranks, err, err_len);

	if (rc)
		return rc;
	struct embd_step_cluster where = {
		c->node_rank, embd_config_nodes(c), rg ? embd_regroup_comm(rg) : NULL,
		d->cluster.store, c->collective_timeout_ms };
	rc = embd_step_create_cluster(&c->tables, d->plan, d->ranks, c->seed, c->trainers_per_node,
				      &where, &d->step, err, err_len);
	if (!rc)
		embd_step_set_grad_divisor(d->step, embd_config_grad_divisor(c));
	return rc;
}

/* With checkpoint_dir: the checkpointer, and the newest valid checkpoint restored before the
 * socket accepts anyone. */
static int start_checkpoints(struct daemon *d, char *err, size_t err_len)
{
	if (!d->config.checkpoint_dir[0])
		return 0;
	embd_config_ckpt_settings(&d->config, &d->ckpt_settings);
	int rc = embd_ckpt_service_create(&d->ckpt_settings, d->step, d->plan, &d->ckpt, err,
					  err_len);
	/* a rejoining node restores when the cluster decides it (dist/regroup.h) */
	if (!rc && !d->cluster.rejoining)
		rc = embd_ckpt_service_restore(d->ckpt, &d->resumed_step, err, err_len);
	return rc;
}

static int start_server(struct daemon *d, char *err, size_t err_len)
{
	int rc = embd_server_create(&d->config, d->step, d->ranks, d->plan->plan_hash, d->sigfd,
				    &d->server, err, err_len);

	if (!rc && d->ckpt)
		rc = embd_server_set_checkpoints(d->server, d->ckpt, d->resumed_step, err, err_len);
	if (!rc && d->cluster.regroup)
		rc = embd_server_set_regroup(d->server, d->cluster.regroup, d->cluster.rejoining,
					     d->resumed_step, err, err_len);
	if (!rc)
		rc = embd_server_listen(d->server, err, err_len);
	return rc;
}

/* Serves until SIGTERM / SIGINT, then takes the final checkpoint where one may be taken. */
static int serve(struct daemon *d)
{
	char why[256];

	for (uint32_t r = 0; r < embd_ranks_count(d->ranks); r++)
		embd_log_info("rank %u: NUMA node %d, %" PRIu64 " bytes of shards", r,
			      embd_ranks_node(d->ranks, r), embd_ranks_memory_bytes(d->ranks, r));
	embd_log_notice("ready: listening on %s, plan %016" PRIx64 ", step %" PRIu64,
			d->config.socket_path, d->plan->plan_hash, d->resumed_step);
	sd_notify(0, "READY=1");
	int rc = embd_server_run(d->server);
	sd_notify(0, "STOPPING=1");
	if (d->ckpt && !embd_server_cluster_running(d->server, why, sizeof(why))) {
		/* the shards may differ between the nodes and the step ran ahead of them */
		embd_log_warning("no final checkpoint: the cluster is not running (%s); the newest "
				 "cluster checkpoint stays the one to restore", why);
	} else if (d->ckpt) {
		/* the final checkpoint: no step phase runs any more, so the shards are at "step" */
		int crc = embd_ckpt_service_final(d->ckpt, embd_server_step(d->server));
		if (crc)
			rc = crc;
	}
	embd_log_notice("stopped");
	return rc;
}

static void daemon_close(struct daemon *d)
{
	embd_server_destroy(d->server);
	embd_ckpt_service_destroy(d->ckpt);
	embd_step_destroy(d->step);
	cluster_close(&d->cluster);
	embd_ranks_destroy(d->ranks);
	embd_plan_destroy(d->plan);
	embd_config_free(&d->config);
	if (d->sigfd >= 0)
		close(d->sigfd);
}

int main(int argc, char **argv)
{
	struct daemon d = { .sigfd = -1 };
	struct args a;
	char err[1024] = "";
	int rc = parse_args(argc, argv, &a);

	if (rc >= 0)
		return rc;
	embd_log_init();
	if (load_config(&a, &d.config))
		return 1;
	if (resolve_devices(&d.config)) {
		embd_config_free(&d.config);
		return 1;
	}
	rc = open_signals(&d.sigfd);
	if (!rc)
		rc = plan_node(&d);
	if (rc)
		goto out;
	rc = start_engine(&d, err, sizeof(err));
	if (!rc)
		rc = start_checkpoints(&d, err, sizeof(err));
	if (!rc)
		rc = start_server(&d, err, sizeof(err));
	if (rc) {
		embd_log_error("start: %s", err);
		goto out;
	}
	rc = serve(&d);
out:
	daemon_close(&d);
	return rc ? 1 : 0;
}
