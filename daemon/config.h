/*
 * daemon/config.h - the configuration of `embd`: one JSON object, parsed strictly (an unknown
 * key or a wrong type is an error naming the key; text after the closing brace other than
 * whitespace is an error naming its line), with an embedded default so that `embd` alone runs
 * a small CPU node.
 *
 * This comment is the reference for the file format; the one place keys are read is the keys[]
 * table of daemon/config.c (each key's type, range and default). Every key is optional:
 *
 *   { "tables": [ ... ],            the planner's tables array (include/embd/plan.h)
 *     "topology": { ... },          the planner's topology fields (include/embd/plan.h);
 *                                   world_size a multiple of local_world_size: node n
 *                                   holds global ranks [n * L, (n + 1) * L)
 *     "plan_file": "plan.json",     a plan to load and check instead of planning at start
 *     "socket_path": "/run/embd/embd.sock",  control socket; its directory is created
 *     "allowed_uids": [1000],       peers allowed by uid (default: the service's own uid)
 *     "allowed_gids": [100],        ... or by primary or supplementary gid (default: none);
 *                                   both take names too ("embd"), resolved when parsed.
 *                                   Both empty is refused (nobody could connect). The
 *                                   peer's SO_PEERCRED decides; the socket's mode only lets
 *                                   them reach it (embd_config_socket_mode)
 *     "trainers_per_node": 2,       T trainers per step (default: local_world_size)
 *     "gradient_scaling": "mean_over_trainers",  how the trainers' gradients of a step
 *                                   combine: "mean_over_trainers" divides each dL/d(pooled)
 *                                   by the number of trainers of the cluster
 *                                   (trainers_per_node x nodes) before they are summed, as
 *                                   TorchRec's sharded modules do by default (their gradient
 *                                   division by the world size), so that a TorchRec learning
 *                                   rate means the same here; "sum" sums them as they are (a
 *                                   learning rate then moves rows T times as far with T
 *                                   trainers). Every node of a cluster must have the same
 *     "seed": 2026,                 weight init seed (unsigned 64-bit)
 *     "threads_per_rank": 1,        worker threads of each CPU rank
 *     "log_level": "info",          error | warning | notice | info | debug
 *     "checkpoint_dir": "",         where checkpoints go (ckpt/checkpoint.h); "" = none. At start
 *                                   the newest valid one there is restored, damaged ones are
 *                                   moved to damaged/ there; the service locks it (a second
 *                                   one on the same directory is refused, naming the pid)
 *     "checkpoint_layout": "shared",  a cluster's directories: "shared" (every node's
 *                                   checkpoint_dir is one directory, NFS or one machine) or
 *                                   "per_node" (each node its own disk: step-N/ with its
 *                                   own shards and manifest; restores only under the same
 *                                   plan and node count). Ignored on one node
 *     "checkpoint_every_steps": 0,  a checkpoint every N completed steps (0 = off)
 *     "checkpoint_every_seconds": 0,  ... and/or every T seconds while steps run (0 = off);
 *                                   `embctl checkpoint` and SIGTERM take one too. On a
 *                                   cluster node 0's timer decides, and every trigger is
 *                                   agreed through the step's first exchange (ckpt_service.h)
 *     "checkpoint_keep": 3,         checkpoints kept (older ones removed; 0 = keep all);
 *                                   only valid ones count, damaged ones are moved aside
 *     "checkpoint_allow_fresh_start": false,  true: start from the initial weights when
 *                                   checkpoint_dir holds no valid checkpoint but damaged
 *                                   ones, as step-<N> or in damaged/ (moving the step-<N>
 *                                   ones to damaged/); false refuses to start then, at
 *                                   every start until a valid checkpoint is written
 *   every node of a cluster must have the same checkpoint_layout, every_steps,
 *   every_seconds and keep, checkpoint_dir set on all or none, and the same
 *   gradient_scaling (checked at join)
 *     "busy_poll_us": 50,           how long the event loop spins on rings before sleeping
 *     "step_wait_warn_ms": 10000,   a step that waits this long for a trainer (its FORWARD,
 *                                   once another trainer's came; its BACKWARD, once the
 *                                   forward ran) logs which trainers (index, pid) it waits
 *                                   for and shows them in `embctl status` and `stats`
 *                                   (daemon/stats.h); 0 = off
 *     "step_wait_abort_ms": 0,      ... and after this long (above step_wait_warn_ms; 0 = off)
 *                                   gives up: the requests kept for the step are answered
 *                                   EMBD_ETIMEDOUT naming those trainers (daemon/server.h)
 *     "handshake_timeout_ms": 5000, a connection that sent no message within it is closed
 *                                   (daemon/server.h: at most 32 such wait at a time, the
 *                                   longest-waiting one closed to make room for a new one)
 *     "metrics_listen": "",         where the Prometheus endpoint serves GET /metrics
 *                                   (daemon/metrics.h): "127.0.0.1:9464", "[::1]:9464";
 *                                   "" = off. A port that cannot be bound stops the start
 *   several nodes (world_size > local_world_size; torch.distributed's env:// names, and the
 *   environment variables MASTER_ADDR, MASTER_PORT, NODE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE
 *   override these keys and the topology's sizes; see dist/rendezvous.h):
 *     "master_addr": "127.0.0.1",   where node 0 serves the rendezvous store
 *     "master_port": 29500,         its TCP port
 *     "gloo_ifname": "",            the interface whose address this node's Gloo device
 *                                   listens on and advertises (GLOO_SOCKET_IFNAME in the
 *                                   environment wins, as in torch; one name, not a list)
 *     "comm_addr": "",              ... or that numeric address of this host (not with
 *                                   gloo_ifname). Neither: the local address of the route to
 *                                   master_addr (dist/rendezvous.h,
 *                                   embd_rendezvous_comm_addr): 127.0.0.1 on one host
 *     "node_rank": 0,               this node (0 .. world_size / local_world_size - 1)
 *     "backend": "gloo",            gloo (one Gloo rank per node, host memory); nccl (one
 *                                   NCCL rank per GPU, device memory) needs cuda
 *     "collective_timeout_ms": 30000,  every collective: a node that does not answer within
 *                                   it fails the step on the others (and breaks the comm,
 *                                   which is re-formed: dist/regroup.h); also the comm
 *                                   rendezvous and barrier of a re-formed generation
 *     "store_timeout_ms": 0 }       every store wait and the join, and a re-forming
 *                                   generation's wait for the states (a runtime restore
 *                                   waits twice it for node 0's choice); 0 =
 *                                   collective_timeout_ms. Re-forming waits for a missing
 *                                   node without limit, serving meanwhile (FORWARDs get
 *                                   EMBD_EAGAIN naming it)
 *
 * Trainers: trainers_per_node on every node (at most 64 on several nodes); the global batch
 * is node 0's trainers' batches in trainer order, then node 1's, ...
 * Missing "tables" or "topology" take the embedded default's (embd_config_default_text).
 * Command-line flags (--socket, --log-level) are applied by the caller after parsing.
 */
#ifndef EMBD_DAEMON_CONFIG_H
#define EMBD_DAEMON_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/un.h>

#include "ckpt/ckpt_service.h"
#include "embd/plan.h"
#include "dist/comm.h"
#include "common/log.h"

#define EMBD_CONFIG_IDS_MAX 64          /* entries of allowed_uids / allowed_gids */
#define EMBD_CONFIG_TRAINERS_MAX 1024u  /* trainers_per_node */
#define EMBD_CONFIG_PATH_MAX 4096
#define EMBD_CONFIG_SOCKET_MAX sizeof(((struct sockaddr_un *)0)->sun_path)
#define EMBD_CONFIG_DEFAULT_SOCKET "/run/embd/embd.sock"

/* "gradient_scaling": how the trainers' gradients of one step combine. */
enum embd_gradient_scaling {
	EMBD_GRADIENT_MEAN_OVER_TRAINERS = 0,   /* each divided by the cluster's trainers */
	EMBD_GRADIENT_SUM = 1,                  /* summed as they are */
};

struct embd_config {
	struct embd_tables tables;                      /* owned; embd_config_free releases */
	struct embd_topology topology;
	char plan_file[EMBD_CONFIG_PATH_MAX];           /* "" = plan at start */
	char socket_path[EMBD_CONFIG_SOCKET_MAX];
	uint32_t num_allowed_uids;
	uid_t allowed_uids[EMBD_CONFIG_IDS_MAX];        /* checked by embd_ctl_peer_check */
	uint32_t num_allowed_gids;
	gid_t allowed_gids[EMBD_CONFIG_IDS_MAX];
	uint32_t trainers_per_node;
	enum embd_gradient_scaling gradient_scaling;
	uint64_t seed;
	uint32_t threads_per_rank;
	enum embd_log_level log_level;
	char checkpoint_dir[EMBD_CONFIG_PATH_MAX];      /* "" = none */
	enum embd_ckpt_layout checkpoint_layout;
	uint32_t checkpoint_every_steps;                /* 0 = off */
	uint32_t checkpoint_every_seconds;              /* 0 = off */
	uint32_t checkpoint_keep;                       /* 0 = keep all */
	bool checkpoint_allow_fresh_start;
	uint32_t busy_poll_us;
	uint32_t handshake_timeout_ms;
	uint32_t step_wait_warn_ms;                     /* 0 = off */
	uint32_t step_wait_abort_ms;                    /* 0 = off */
	char master_addr[256];
	uint16_t master_port;
	char gloo_ifname[16];                           /* "" = not given (IFNAMSIZ) */
	char comm_addr[64];                             /* "" = not given */
	uint32_t node_rank;
	enum embd_comm_backend backend;
	int collective_timeout_ms;
	int store_timeout_ms;                           /* resolved: never 0 after parsing */
	char metrics_listen[64];                        /* "" = no metrics endpoint */
	/* whether the config gave them (embd_config_resolve_devices fills the others in) */
	bool world_size_given, local_world_size_given, trainers_per_node_given;
};

/* metrics_listen's form: "address:port" with a numeric IPv4 address or a bracketed IPv6 one
 * ("127.0.0.1:9464", "[::1]:9464"), port 1..65535. True and *addr (port in network order),
 * or false; embd_config_listen_why says what is expected. */
struct sockaddr_storage;
bool embd_config_listen_addr(const char *text, struct sockaddr_storage *addr);
extern const char embd_config_listen_why[];

/*
 * compute_device cuda, once the daemon counted the GPUs it can use (`devices`): a
 * local_world_size the config did not give becomes that count (and world_size, when not given
 * either, the same; trainers_per_node's default follows), and a local_world_size above it is
 * refused naming both numbers. Nothing changes for cpu.
 */
int embd_config_resolve_devices(struct embd_config *c, uint32_t devices, char *err,
				size_t err_len);

/* Nodes of the cluster: world_size / local_world_size. */
static inline uint32_t embd_config_nodes(const struct embd_config *c)
{
	return (uint32_t)(c->topology.world_size / c->topology.local_world_size);
}

/* The embedded default configuration (JSON text, NUL-terminated). */
const char *embd_config_default_text(void);

/*
 * Parses config text of len bytes into *out (zeroed first). Returns 0, EMBD_EPARSE for bad
 * JSON (err gives line and column), EMBD_EINVAL for an unknown key, a wrong type or a value
 * out of range (err names the key), or the planner's error for tables and topology.
 * On error *out holds nothing to free; on success release it with embd_config_free.
 */
int embd_config_parse(const char *text, size_t len, struct embd_config *out, char *err,
		      size_t err_len);

/* Reads and parses a file (errors name the path). */
int embd_config_load(const char *path, struct embd_config *out, char *err, size_t err_len);

/* The settings beside tables and topology that every node of a cluster must share, as a JSON
 * object for the join record (rendezvous.h: embd_collective_plan's settings); *out is
 * malloc'ed. checkpoint_dir is compared as "set" / "unset" only. */
int embd_config_join_settings(const struct embd_config *c, char **out);

/* The control socket's file mode for what allowed_uids and allowed_gids allow, when the
 * socket belongs to owner:group (the service's euid and egid): 0600 for the owner (and root)
 * alone, 0660 when the group is allowed too, 0666 when any other uid or gid is (SO_PEERCRED
 * refuses the rest; a mode narrower than the config would keep allowed peers out before the
 * check, with EACCES from connect). */
mode_t embd_config_socket_mode(const struct embd_config *c, uid_t owner, gid_t group);
/* What the step engine divides every trainer's gradient by (embd_step_set_grad_divisor):
 * the cluster's trainers under mean_over_trainers, 1 under sum. */
static inline uint32_t embd_config_grad_divisor(const struct embd_config *c)
{
	return c->gradient_scaling == EMBD_GRADIENT_SUM ? 1 :
	       c->trainers_per_node * embd_config_nodes(c);
}

/* The checkpoint service's view of the config (ckpt/ckpt_service.h); *out borrows c's tables. */
void embd_config_ckpt_settings(const struct embd_config *c, struct embd_ckpt_settings *out);

/* Releases what a parsed config owns. NULL and zeroed are fine. */
void embd_config_free(struct embd_config *config);

#endif /* EMBD_DAEMON_CONFIG_H */
