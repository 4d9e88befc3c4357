/*
 * dist/regroup.h - re-forming a cluster after a node failed or stalled: a new generation of
 * the comm, joined by every node through the store, and one decision about the parameters that
 * every node takes from the same records.
 *
 * Generations: the comm made at start is generation 0. A node whose collective failed (or that
 * sees that another node opened a newer generation, or that restarted into a running cluster)
 * joins generation g under the store keys embd/gen/<g>/: "joined" (a count) and "opener" (the
 * node that counted first: the one re-forming), "open" (g started; it holds the last node that
 * joined), "join/<n>" (node n is in), the comm's rendezvous under "gloo/", then "state/<n>"
 * (what node n holds).
 * A node always goes to the newest open generation, so nodes that failed at different moments
 * meet in one; a restarted node opens the one after the newest. Waiting for the others is a
 * look at the store per call (the event loop keeps serving); only once every node joined does
 * a call block, for the comm's rendezvous (collective_timeout_ms) and the states
 * (store_timeout_ms); either failing moves every node on to the next generation.
 *
 * The decision (embd_regroup_decide): every node still holds the same applied step and none
 * restarted -> RESUME at that step; otherwise RESTORE the newest cluster checkpoint when
 * checkpoints are configured, else LOST (steps refused, naming the node).
 *
 * Node 0 serves the store. When the store fails, a node is detached and tries to connect
 * again (embd_regroup_reattach): the same store (node 0 was stalled: it still holds node 0's
 * EMBD_REGROUP_INSTANCE_KEY) lets it re-form as above; a new one (node 0 restarted, its
 * store empty) is not resumed: the node marks itself in it as "embd/stale/<n>" (so the new
 * node 0, whose start waits for joiners that never come, names it when it gives up) and keeps
 * refusing steps until every node is restarted.
 */
#ifndef EMBD_DIST_REGROUP_H
#define EMBD_DIST_REGROUP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dist/comm.h"
#include "dist/rendezvous.h"

struct embd_store;
struct embd_regroup;

/* Set by node 0 in its store at start (a value unique to that process), read by every node. */
#define EMBD_REGROUP_INSTANCE_KEY "embd/instance"

/* What a node holds when a generation forms (its state record). */
struct embd_regroup_state {
	uint64_t applied;               /* the step after the last one whose update this node
					   applied (its parameters are "at" this step) */
	bool lost;                      /* restarted into the cluster: its shards are gone */
};

enum embd_regroup_verdict {
	EMBD_REGROUP_RESUME = 0,        /* parameters agree: go on at step */
	EMBD_REGROUP_RESTORE = 1,       /* every node restores the newest cluster checkpoint */
	EMBD_REGROUP_LOST = 2,          /* no checkpoint: refuse steps (why names the node) */
};

struct embd_regroup_decision {
	enum embd_regroup_verdict verdict;
	uint64_t step;                  /* RESUME: the step to collect next */
	char why[160];                  /* RESTORE / LOST: who lost or disagreed */
};

/* The decision from every node's state (states[nodes], in node order). Pure. */
void embd_regroup_decide(const struct embd_regroup_state *states, uint32_t nodes,
			 bool have_checkpoints, struct embd_regroup_decision *out);

/* A state record as store text and back (EMBD_EPARSE names what is wrong). */
int embd_regroup_state_format(const struct embd_regroup_state *st, char *out, size_t len);
int embd_regroup_state_parse(const char *text, size_t len, struct embd_regroup_state *out);

struct embd_regroup_options {
	uint32_t node, nodes;
	enum embd_comm_backend backend;
	uint32_t lanes;                 /* the comm's (dist/comm.h): the node's ranks */
	int collective_timeout_ms;
	int store_timeout_ms;
	char hostname[EMBD_RENDEZVOUS_COMM_ADDR_MAX];   /* this node's gloo address, "" = 127.0.0.1 */
};

/*
 * Takes over comm (generation 0; NULL for a node that restarted into a running cluster: it
 * starts forming the generation after the newest open one at its first embd_regroup_poll).
 * store: the service thread's handle (not owned). Returns EMBD_ENOMEM or 0.
 */
int embd_regroup_create(const struct embd_regroup_options *o, struct embd_store *store,
			struct embd_comm *comm, struct embd_regroup **out);
/* Destroys the current comm too. NULL is a no-op. */
void embd_regroup_destroy(struct embd_regroup *rg);

/* The current generation and its comm (NULL while forming). */
uint64_t embd_regroup_generation(const struct embd_regroup *rg);
struct embd_comm *embd_regroup_comm(const struct embd_regroup *rg);
bool embd_regroup_forming(const struct embd_regroup *rg);

/* Running: 1 when another node opened a newer generation (call _start), 0 when not, or the
 * store's failure (err set: node 0 is gone). *by: the node that joined it first (the one
 * re-forming; when two joined at once or the first failed between its writes, maybe the
 * last one that joined), UINT32_MAX when the store does not say. */
int embd_regroup_newer(struct embd_regroup *rg, uint32_t *by, char *err, size_t err_len);

/* Leaves the current comm (destroyed) and joins the newest open generation after it (a
 * restarted node opens the one after the newest). On failure (the store's) the node keeps the
 * generation it had, and a restarted node stays one, so the next call aims where this one did. */
int embd_regroup_start(struct embd_regroup *rg, char *err, size_t err_len);

/*
 * Forming: one look. 0 while nodes are missing (err names them: "waiting for node 1 to join
 * generation 2"); 1 when the generation's comm is up and every state is in (*out decided from
 * mine and the others'); EMBD_EAGAIN when this generation failed and the next one was started;
 * other negative codes: the store failed (err set).
 */
int embd_regroup_poll(struct embd_regroup *rg, const struct embd_regroup_state *mine,
		      bool have_checkpoints, struct embd_regroup_decision *out, char *err,
		      size_t err_len);

/* After the decision was carried out (a restore included): a barrier on the new comm, so no
 * node runs a step while another still restores. A failure starts the next generation. */
int embd_regroup_finish(struct embd_regroup *rg, char *err, size_t err_len);

/*
 * After a RESTORE decision, every node's outcome, so that a restore failing on one node does
 * not leave the others waiting, and every node takes the same decision from the same records.
 * This node publishes its own ("<prefix>restored/<n>": "ok"; "retry: why" when restore_rc is
 * transient (embd_regroup_restore_transient: a store timeout or a lost connection, no verdict
 * about the data); else "error: why"), then reads every node's, waiting store_timeout_ms +
 * restore_ms (this node's own restore time: a bound that covers another node's) for each.
 * Each record is written once: a node that gives up waiting writes the late node's as "retry:
 * node 1 did not report its restore within 8000 ms" (a store counter says who writes it), so
 * the late one and every other read that one. Returns 0 when every record says ok;
 * EMBD_EAGAIN when one says retry (err names the first; the next generation was started, as
 * after embd_regroup_poll's EMBD_EAGAIN: another node's error may only follow from it);
 * else EMBD_EIO when one says error (err names the first: "node 1's restore failed: ...":
 * the cluster's state is lost); other negative codes: the store failed (err set).
 */
bool embd_regroup_restore_transient(int restore_rc);
int embd_regroup_restored(struct embd_regroup *rg, int restore_rc, const char *why,
			  int restore_ms, char *err, size_t err_len);

/* Detached (the store failed): connects the store handle again (for a moment). 1 when it is
 * node 0's same store (call _start); 0 when it does not answer yet or is a new one (err says
 * which; a new one gets this node's stale mark). */
int embd_regroup_reattach(struct embd_regroup *rg, char *err, size_t err_len);

/* The store key prefix of the current generation ("embd/gen/<g>/"), for keys of its own. */
const char *embd_regroup_prefix(const struct embd_regroup *rg);

#endif /* EMBD_DIST_REGROUP_H */
