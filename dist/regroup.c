/*
 * dist/regroup.c - generations of the comm and the decision after a failure
 * (dist/regroup.h). The one rule that keeps the nodes together: a node never forms a
 * generation below the newest one that is open in the store, so whoever failed last decides
 * where everyone meets, and a generation whose forming failed anywhere is abandoned by all
 * (the next one is opened and everyone sees it open).
 *
 * Only the service's thread calls in; each call looks at the store a few times with short
 * waits, and blocks for longer only once every node has joined (comm rendezvous, states).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embd/types.h"
#include "common/log.h"
#include "dist/regroup.h"
#include "dist/store.h"

#define LOOK_MS 200                     /* a store look while waiting for others */

struct embd_regroup {
	struct embd_regroup_options o;
	struct embd_store *store;
	struct embd_comm *comm;                 /* the current generation's, NULL while forming */
	uint64_t gen;
	bool forming;
	bool fresh;                             /* restarted: opens a generation of its own */
	char prefix[48];
	char instance[64];                      /* node 0's store (EMBD_REGROUP_INSTANCE_KEY) */
};

/* ---- the decision ------------------------------------------------------------------------ */

void embd_regroup_decide(const struct embd_regroup_state *st, uint32_t nodes,
			 bool have_checkpoints, struct embd_regroup_decision *out)
{
	size_t at = 0;

	memset(out, 0, sizeof(*out));
	for (uint32_t n = 0; n < nodes; n++)
		if (st[n].lost && at < sizeof(out->why))
			at += (size_t)snprintf(out->why + at, sizeof(out->why) - at, "%snode %u",
					       at ? ", " : "", n);
	if (at && at < sizeof(out->why)) {
		snprintf(out->why + at, sizeof(out->why) - at, " restarted");
	} else if (!at) {
		bool same = true;
		for (uint32_t n = 1; n < nodes; n++)
			same &= st[n].applied == st[0].applied;
		if (same) {
			out->verdict = EMBD_REGROUP_RESUME;
			out->step = st[0].applied;
			return;
		}
		/* a failure during the gradient exchange: some nodes applied that step */
		at = (size_t)snprintf(out->why, sizeof(out->why), "nodes disagree on the step:");
		for (uint32_t n = 0; n < nodes && at < sizeof(out->why); n++)
			at += (size_t)snprintf(out->why + at, sizeof(out->why) - at, " %u at %" PRIu64,
					       n, st[n].applied);
	}
	out->verdict = have_checkpoints ? EMBD_REGROUP_RESTORE : EMBD_REGROUP_LOST;
}

int embd_regroup_state_format(const struct embd_regroup_state *st, char *out, size_t len)
{
	int n = snprintf(out, len, "applied %" PRIu64 " lost %d", st->applied, st->lost ? 1 : 0);
	return n < 0 || (size_t)n >= len ? EMBD_ENOSPC : 0;
}

int embd_regroup_state_parse(const char *text, size_t len, struct embd_regroup_state *out)
{
	char buf[64];
	unsigned long long applied;
	int lost, used = 0;

	if (len >= sizeof(buf))
		return EMBD_EPARSE;
	memcpy(buf, text, len);
	buf[len] = 0;
	if (sscanf(buf, "applied %llu lost %d%n", &applied, &lost, &used) != 2 ||
	    (size_t)used != len || (lost != 0 && lost != 1) || strchr(buf, '-'))
		return EMBD_EPARSE;
	out->applied = applied;
	out->lost = lost;
	return 0;
}

/* ---- generations ------------------------------------------------------------------------- */

int embd_regroup_create(const struct embd_regroup_options *o, struct embd_store *store,
			struct embd_comm *comm, struct embd_regroup **out)
{
	struct embd_regroup *rg = calloc(1, sizeof(*rg));

	*out = NULL;
	if (!rg)
		return EMBD_ENOMEM;
	rg->o = *o;
	rg->store = store;
	rg->comm = comm;
	rg->fresh = comm == NULL;
	rg->forming = comm == NULL;
	snprintf(rg->prefix, sizeof(rg->prefix), "embd/gen/0/");
	/* which store this is: a store that answers again after a failure is the same only if
	 * it still holds this value (node 0 stalled, not restarted) */
	void *v = NULL;
	size_t len = 0;
	embd_store_set_timeout(store, o->store_timeout_ms);
	if (embd_store_check(store, EMBD_REGROUP_INSTANCE_KEY) == 1 &&
	    !embd_store_get(store, EMBD_REGROUP_INSTANCE_KEY, &v, &len))
		snprintf(rg->instance, sizeof(rg->instance), "%.*s", (int)len, (char *)v);
	free(v);
	*out = rg;
	return 0;
}

void embd_regroup_destroy(struct embd_regroup *rg)
{
	if (!rg)
		return;
	embd_comm_destroy(rg->comm);
	free(rg);
}

uint64_t embd_regroup_generation(const struct embd_regroup *rg)
{
	return rg->gen;
}

struct embd_comm *embd_regroup_comm(const struct embd_regroup *rg)
{
	return rg->forming ? NULL : rg->comm;
}

bool embd_regroup_forming(const struct embd_regroup *rg)
{
	return rg->forming;
}

const char *embd_regroup_prefix(const struct embd_regroup *rg)
{
	return rg->prefix;
}

static const char *gen_key(char *buf, size_t len, uint64_t gen, const char *what)
{
	snprintf(buf, len, "embd/gen/%" PRIu64 "/%s", gen, what);
	return buf;
}

/* rc, a failure of the store, with err saying so. */
static int store_gone(const struct embd_regroup *rg, int rc, char *err, size_t err_len)
{
	snprintf(err, err_len, "node 0 (the store) is gone: %.150s", embd_store_error(rg->store));
	return rc;
}

/* 1 when generation gen is open, 0 when not, < 0 when the store failed (err set). */
static int is_open(struct embd_regroup *rg, uint64_t gen, char *err, size_t err_len)
{
	char k[64];
	int rc = embd_store_check(rg->store, gen_key(k, sizeof(k), gen, "open"));

	return rc < 0 ? store_gone(rg, rc, err, err_len) : rc;
}

int embd_regroup_newer(struct embd_regroup *rg, uint32_t *by, char *err, size_t err_len)
{
	char k[64], text[16] = "";
	void *value = NULL;
	size_t len = 0;

	*by = UINT32_MAX;
	embd_store_set_timeout(rg->store, LOOK_MS);
	int rc = is_open(rg, rg->gen + 1, err, err_len);
	if (rc != 1)
		return rc;
	/* names who re-forms in the step's error: the node that joined first, or (no "opener":
	 * see join) the last one, which "open" holds */
	int opener = embd_store_check(rg->store, gen_key(k, sizeof(k), rg->gen + 1, "opener"));
	if (opener < 0)
		return store_gone(rg, opener, err, err_len);
	const char *who = opener == 1 ? "opener" : "open";
	if (!embd_store_get(rg->store, gen_key(k, sizeof(k), rg->gen + 1, who), &value, &len) &&
	    len < sizeof(text)) {
		memcpy(text, value, len);
		char *end;
		unsigned long node = strtoul(text, &end, 10);
		if (len && *end == '\0' && node < UINT32_MAX)
			*by = (uint32_t)node;
	}
	free(value);
	return 1;
}

/* Joins generation gen: open it (idempotent) and say this node is in. The node is in gen only
 * once every write went through: a failed join leaves it where it was, so that the next start
 * tries gen again rather than the one after it (which nobody else would look for). */
static int join(struct embd_regroup *rg, uint64_t gen, char *err, size_t err_len)
{
	char k[64];

	rg->forming = true;
	char node[16];
	int node_len = snprintf(node, sizeof(node), "%u", rg->o.node);

	int64_t joined = 0;

	/* "joined" counts the nodes in: the first (a restarted node, or one that saw a
	 * collective fail) is the one that re-forms, and "opener" names it to the others. Both
	 * are written before "open", which is what the others look for: a generation open
	 * without "opener" is one two nodes joined at once, or whose first failed between. */
	if (embd_store_add(rg->store, gen_key(k, sizeof(k), gen, "joined"), 1, &joined) ||
	    (joined == 1 && embd_store_set(rg->store, gen_key(k, sizeof(k), gen, "opener"), node,
					   (size_t)node_len)) ||
	    embd_store_set(rg->store, gen_key(k, sizeof(k), gen, "open"), node, (size_t)node_len) ||
	    (snprintf(k, sizeof(k), "embd/gen/%" PRIu64 "/join/%u", gen, rg->o.node),
	     embd_store_set(rg->store, k, "1", 1)))
		return store_gone(rg, EMBD_ECONNRESET, err, err_len);
	rg->gen = gen;
	snprintf(rg->prefix, sizeof(rg->prefix), "embd/gen/%" PRIu64 "/", gen);
	embd_log_notice("node %u: joining generation %" PRIu64 " of the cluster", rg->o.node, gen);
	return 0;
}

int embd_regroup_start(struct embd_regroup *rg, char *err, size_t err_len)
{
	uint64_t target = rg->gen + 1;
	int rc;

	embd_comm_destroy(rg->comm);
	rg->comm = NULL;
	rg->forming = true;
	embd_store_set_timeout(rg->store, LOOK_MS);
	/* the newest open generation; a restarted node opens the one after it */
	while ((rc = is_open(rg, target + 1, err, err_len)) == 1)
		target++;
	if (rc < 0)
		return rc;
	if (rg->fresh) {
		while ((rc = is_open(rg, target, err, err_len)) == 1)
			target++;
		if (rc < 0)
			return rc;
	}
	rc = join(rg, target, err, err_len);
	if (!rc)
		rg->fresh = false;
	return rc;
}

/* Names the nodes not yet in the generation; 0 when none is missing. */
static int missing(struct embd_regroup *rg, char *err, size_t err_len)
{
	size_t at = 0;
	char k[64];

	for (uint32_t n = 0; n < rg->o.nodes; n++) {
		if (n == rg->o.node)
			continue;
		snprintf(k, sizeof(k), "embd/gen/%" PRIu64 "/join/%u", rg->gen, n);
		int rc = embd_store_check(rg->store, k);
		if (rc < 0)
			return store_gone(rg, rc, err, err_len);
		if (rc == 0 && at < err_len)
			at += (size_t)snprintf(err + at, err_len - at, "%s%u", at ? ", " : "waiting "
					       "for node ", n);
	}
	if (at && at < err_len)
		snprintf(err + at, err_len - at, " to join generation %" PRIu64, rg->gen);
	return at ? 1 : 0;
}

/* The states of every node (after this node's own was set). */
static int gather(struct embd_regroup *rg, struct embd_regroup_state *st, char *err,
		  size_t err_len)
{
	char k[64];

	embd_store_set_timeout(rg->store, rg->o.store_timeout_ms);
	for (uint32_t n = 0; n < rg->o.nodes; n++) {
		void *v = NULL;
		size_t len = 0;
		snprintf(k, sizeof(k), "embd/gen/%" PRIu64 "/state/%u", rg->gen, n);
		int rc = embd_store_get(rg->store, k, &v, &len);
		if (!rc && (rc = embd_regroup_state_parse(v, len, &st[n])))
			snprintf(err, err_len, "node %u's state record is malformed", n);
		else if (rc)
			snprintf(err, err_len, "node %u's state: %.150s", n,
				 embd_store_error(rg->store));
		free(v);
		if (rc)
			return rc;
	}
	return 0;
}

/* This generation failed on this node: every node moves on to the next one. */
static int next_generation(struct embd_regroup *rg, const char *what, char *err,
			   size_t err_len)
{
	char why[300];

	snprintf(why, sizeof(why), "%s", err);
	embd_log_warning("node %u: generation %" PRIu64 " failed (%s): %s", rg->o.node, rg->gen,
			 what, why);
	int rc = embd_regroup_start(rg, err, err_len);
	return rc ? rc : EMBD_EAGAIN;
}

int embd_regroup_poll(struct embd_regroup *rg, const struct embd_regroup_state *mine,
		      bool have_checkpoints, struct embd_regroup_decision *out, char *err,
		      size_t err_len)
{
	struct embd_regroup_state *st = NULL;
	char k[64], text[64], inner[512];
	int rc;

	err[0] = 0;
	if (!rg->forming)
		return 1;
	if (rg->fresh)
		return embd_regroup_start(rg, err, err_len);
	embd_store_set_timeout(rg->store, LOOK_MS);
	/* someone gave this generation up, or a restarted node opened a newer one */
	if ((rc = is_open(rg, rg->gen + 1, err, err_len)) != 0) {
		if (rc < 0)
			return rc;
		rc = embd_regroup_start(rg, err, err_len);
		return rc ? rc : EMBD_EAGAIN;
	}
	if ((rc = missing(rg, err, err_len)) != 0)
		return rc < 0 ? rc : 0;
	struct embd_comm_options co = {
		.backend = rg->o.backend, .rank = rg->o.node, .size = rg->o.nodes,
		.lanes = rg->o.lanes, .timeout_ms = rg->o.collective_timeout_ms, .hostname = rg->o.hostname, .prefix = NULL,
	};
	char gloo[64];
	snprintf(gloo, sizeof(gloo), "%sgloo/", rg->prefix);
	co.prefix = gloo;
	if ((rc = embd_comm_create(&co, rg->store, &rg->comm, inner, sizeof(inner)))) {
		snprintf(err, err_len, "%.400s", inner);
		return next_generation(rg, "comm", err, err_len);
	}
	st = calloc(rg->o.nodes, sizeof(*st));
	if (!st)
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	embd_regroup_state_format(mine, text, sizeof(text));
	snprintf(k, sizeof(k), "embd/gen/%" PRIu64 "/state/%u", rg->gen, rg->o.node);
	if (embd_store_set(rg->store, k, text, strlen(text)) ||
	    (rc = gather(rg, st, err, err_len))) {
		if (!err[0])
			snprintf(err, err_len, "%.300s", embd_store_error(rg->store));
		free(st);
		return next_generation(rg, "states", err, err_len);
	}
	embd_regroup_decide(st, rg->o.nodes, have_checkpoints, out);
	free(st);
	rg->forming = false;
	return 1;
}

int embd_regroup_finish(struct embd_regroup *rg, char *err, size_t err_len)
{
	int rc = embd_comm_barrier(rg->comm);

	if (!rc)
		return 0;
	snprintf(err, err_len, "%.300s", embd_comm_error(rg->comm));
	return next_generation(rg, "barrier", err, err_len);
}

bool embd_regroup_restore_transient(int restore_rc)
{
	return restore_rc == EMBD_ETIMEDOUT || restore_rc == EMBD_ECONNRESET ||
	       restore_rc == EMBD_EAGAIN || restore_rc == EMBD_EBUSY;
}

/* Node n's outcome record, written once per generation: whoever claims "<key>/claim" first
 * (node n after its restore, or a node that gave up waiting for it) writes it, so every node
 * reads the same record. 0 with *v read, or the store's failure. */
static int outcome_record(struct embd_regroup *rg, uint32_t n, const char *mine, int wait_ms,
			  void **v, size_t *len)
{
	char k[96], claim[112], late[160];
	int64_t first = 0;
	int rc;

	snprintf(k, sizeof(k), "%srestored/%u", rg->prefix, n);
	snprintf(claim, sizeof(claim), "%s/claim", k);
	if (n == rg->o.node) {
		if ((rc = embd_store_add(rg->store, claim, 1, &first)))
			return rc;
		if (first == 1 && (rc = embd_store_set(rg->store, k, mine, strlen(mine))))
			return rc;
	}
	embd_store_set_timeout(rg->store, wait_ms);
	rc = embd_store_get(rg->store, k, v, len);
	embd_store_set_timeout(rg->store, rg->o.store_timeout_ms);
	if (rc != EMBD_ETIMEDOUT)
		return rc;
	/* node n said nothing in time: the first to give up writes its record for it */
	if ((rc = embd_store_add(rg->store, claim, 1, &first)))
		return rc;
	if (first == 1) {
		snprintf(late, sizeof(late), "retry: node %u did not report its restore within %d ms",
			 n, wait_ms);
		if ((rc = embd_store_set(rg->store, k, late, strlen(late))))
			return rc;
	}
	/* someone else claimed it: its record follows the claim at once */
	return embd_store_get(rg->store, k, v, len);
}

int embd_regroup_restored(struct embd_regroup *rg, int restore_rc, const char *why,
			  int restore_ms, char *err, size_t err_len)
{
	const int wait_ms = rg->o.store_timeout_ms + (restore_ms > 0 ? restore_ms : 0);
	char mine[160], retry[256] = "";
	int rc = 0;

	if (!restore_rc)
		snprintf(mine, sizeof(mine), "ok");
	else
		snprintf(mine, sizeof(mine), "%s: %.140s",
			 embd_regroup_restore_transient(restore_rc) ? "retry" : "error", why);
	embd_store_set_timeout(rg->store, rg->o.store_timeout_ms);
	/* every record is read, so every node weighs the same ones. A transient failure anywhere
	 * moves every node on to the next generation (another node's error may only follow from
	 * it: node 0's choice of checkpoint timed out); else a data failure is the verdict */
	for (uint32_t n = 0; n < rg->o.nodes; n++) {
		void *v = NULL;
		size_t len = 0;
		int frc = outcome_record(rg, n, mine, wait_ms, &v, &len);
		if (frc) {
			snprintf(err, err_len, "node %u's restore outcome: %.200s", n,
				 embd_store_error(rg->store));
			return frc;     /* the store failed: this node is detached */
		}
		const char *text = v;
		const bool ok = len == 2 && !memcmp(text, "ok", 2);
		if (len > 7 && !memcmp(text, "retry: ", 7)) {
			if (!retry[0])
				snprintf(retry, sizeof(retry), "node %u's restore did not complete: "
					 "%.*s", n, (int)(len - 7), text + 7);
		} else if (!ok && !rc) {        /* the first error is named */
			rc = EMBD_EIO;
			if (len > 7 && !memcmp(text, "error: ", 7))
				snprintf(err, err_len, "node %u's restore failed: %.*s", n,
					 (int)(len - 7), text + 7);
			else
				snprintf(err, err_len, "node %u's restore outcome is malformed", n);
		}
		free(v);
	}
	if (!retry[0])
		return rc;
	snprintf(err, err_len, "%s", retry);
	return next_generation(rg, "restore", err, err_len);
}

int embd_regroup_reattach(struct embd_regroup *rg, char *err, size_t err_len)
{
	void *v = NULL;
	size_t len = 0;
	char k[64];

	if (embd_store_reconnect(rg->store, LOOK_MS))
		return snprintf(err, err_len, "node 0 (the store) does not answer"), 0;
	embd_store_set_timeout(rg->store, LOOK_MS);
	int rc = embd_store_check(rg->store, EMBD_REGROUP_INSTANCE_KEY);
	/* only a value that was read and differs (or no key at all) means a new store: a read
	 * that fails is node 0 stalling again, to be tried once more later */
	if (rc == 1)
		rc = embd_store_get(rg->store, EMBD_REGROUP_INSTANCE_KEY, &v, &len) ? -1 : 1;
	if (rc < 0)
		return snprintf(err, err_len, "node 0 (the store) does not answer"), 0;
	if (rc == 1) {
		bool same = rg->instance[0] && len == strlen(rg->instance) &&
			    !memcmp(v, rg->instance, len);
		free(v);
		if (same)
			return 1;
	}
	/* a new store: node 0 restarted. Tell it, so that it names this node when it gives up */
	snprintf(k, sizeof(k), "embd/stale/%u", rg->o.node);
	embd_store_set(rg->store, k, "1", 1);
	snprintf(err, err_len, "node 0 restarted (a new store)");
	return 0;
}
