/*
 * The store protocol of a cluster's checkpoints (ckpt/ckpt_cluster.h). Node 0 is the only
 * one that decides: it waits for every node's key, then publishes one verdict key that the
 * others wait for. A node that dies or is late never makes node 0 commit without it (node 0
 * names it and drops the step), and a verdict key nobody publishes only costs the waiters
 * their timeout, so every path ends in bounded time: a write's verdict is waited for as long
 * as node 0 itself writes (its "writing" mark, ckpt_cluster.h), no longer.
 */
#include "ckpt/ckpt_cluster.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "dist/store.h"

/* Store keys of this file: a generation's "embd/gen/<g>/ckpt/..." (CKPT_KEY), the start's
 * "ckpt/restore/...", or a re-formed generation's "embd/gen/<g>/restore/<r>/node/<k>". */
#define CKPT_KEY_MAX 128
#define CKPT_KEY "embd/gen/%" PRIu64 "/ckpt/"

/* Who did not set prefix<k> (k < n) after a failed wait: "1, 2" into out. */
static void missing_nodes(const struct embd_ckpt_cluster *cl, char (*keys)[CKPT_KEY_MAX], char *out,
			  size_t cap)
{
	size_t len = 0;

	out[0] = 0;
	for (uint32_t k = 0; k < cl->num_nodes && len + 16 < cap; k++)
		if (embd_store_check(cl->store, keys[k]) != 1)
			len += (size_t)snprintf(out + len, cap - len, "%s%u", len ? ", " : "", k);
	if (!len)
		snprintf(out, cap, "?");
}

/* Node 0: waits for every node's key keys[k]; on a timeout err names the missing nodes. */
static int wait_all(const struct embd_ckpt_cluster *cl, char (*keys)[CKPT_KEY_MAX], const char *what,
		    char *err, size_t err_len)
{
	const char **names = calloc(cl->num_nodes, sizeof(*names));
	char missing[256];
	int rc;

	if (!names)
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	for (uint32_t k = 0; k < cl->num_nodes; k++)
		names[k] = keys[k];
	if ((rc = embd_store_wait(cl->store, names, cl->num_nodes))) {
		missing_nodes(cl, keys, missing, sizeof(missing));
		snprintf(err, err_len, "node %s did not %s within store_timeout_ms %d (%s)", missing,
			 what, cl->settings->store_timeout_ms, embd_store_error(cl->store));
	}
	free(names);
	return rc;
}

/* Any node: node 0's verdict under key ("ok", "go", or "error: why"), waiting up to twice
 * store_timeout_ms, then on while node 0's mark `busy` (NULL: none) is there (ckpt_cluster.h);
 * 0 when it is `good`. The last reader deletes it (acks counted under key/acks), so a long
 * run leaves no keys behind. */
static int read_verdict(const struct embd_ckpt_cluster *cl, const char *key, const char *busy,
			const char *good, char *err, size_t err_len)
{
	char acks[96];
	void *v = NULL;
	size_t len = 0;
	int64_t seen = 0;
	int busy_rc = 0;

	embd_store_set_timeout(cl->store, 2 * cl->settings->store_timeout_ms);
	int rc = embd_store_get(cl->store, key, &v, &len);
	embd_store_set_timeout(cl->store, cl->settings->store_timeout_ms);
	/* a timeout the store answered leaves the handle usable: look at the mark */
	while (rc == EMBD_ETIMEDOUT && busy && (busy_rc = embd_store_check(cl->store, busy)) == 1)
		rc = embd_store_get(cl->store, key, &v, &len);
	if (rc == EMBD_ETIMEDOUT && busy && busy_rc == 0) {
		/* the mark goes only after the verdict is set: it may have come meanwhile */
		embd_store_set_timeout(cl->store, 0);
		rc = embd_store_get(cl->store, key, &v, &len);
		embd_store_set_timeout(cl->store, cl->settings->store_timeout_ms);
	}
	if (rc)
		return snprintf(err, err_len, "no word from node 0 (%s) within twice "
				"store_timeout_ms%s: %s", key, busy ? ", nor while it wrote" : "",
				embd_store_error(cl->store)), rc;
	if (len != strlen(good) || memcmp(v, good, len)) {
		rc = EMBD_EIO;
		snprintf(err, err_len, "node 0: %.*s", (int)(len > 7 && !memcmp(v, "error: ", 7) ?
							     len - 7 : len),
			 (char *)v + (len > 7 && !memcmp(v, "error: ", 7) ? 7 : 0));
	}
	free(v);
	snprintf(acks, sizeof(acks), "%s/acks", key);
	if (!embd_store_add(cl->store, acks, 1, &seen) && seen == (int64_t)cl->num_nodes - 1) {
		embd_store_delete(cl->store, key);
		embd_store_delete(cl->store, acks);
	}
	return rc;
}

/* Node 0: publishes its verdict ("ok"/"go" when rc is 0 or EMBD_EBUSY, else the error). */
static void publish_verdict(const struct embd_ckpt_cluster *cl, const char *key, int rc,
			    const char *good, const char *why)
{
	char value[900];

	snprintf(value, sizeof(value), rc && rc != EMBD_EBUSY ? "error: %s" : "%s",
		 rc && rc != EMBD_EBUSY ? why : good);
	if (embd_store_set(cl->store, key, value, strlen(value)))
		embd_log_warning("checkpoints: cannot publish %s: %s", key,
				 embd_store_error(cl->store));
}

/* ---- writing ----------------------------------------------------------------------------- */

void embd_ckpt_write_delay(const struct embd_ckpt_cluster *cl)
{
	struct timespec d = { .tv_sec = cl->write_delay_ms / 1000,
			      .tv_nsec = (long)(cl->write_delay_ms % 1000) * 1000000 };

	while (cl->write_delay_ms > 0 && nanosleep(&d, &d) && errno == EINTR)
		;
}

/* Node 0: every node's report of step, then the commit (shared) or the check (per_node). */
static int commit(const struct embd_ckpt_cluster *cl, uint64_t step, char (*keys)[CKPT_KEY_MAX],
		  char *err, size_t err_len)
{
	const uint32_t n = cl->num_nodes;
	const bool shared = cl->settings->checkpoint_layout == EMBD_CKPT_SHARED;
	struct embd_ckpt_manifest *parts = calloc(n, sizeof(*parts)), merged = { 0 };
	char inner[512];
	int rc = parts ? wait_all(cl, keys, "report its files", err, err_len) : EMBD_ENOMEM;

	for (uint32_t k = 0; k < n && !rc; k++) {
		void *v = NULL;
		size_t len = 0;
		if ((rc = embd_store_get(cl->store, keys[k], &v, &len))) {
			snprintf(err, err_len, "node %u's report: %s", k, embd_store_error(cl->store));
		} else if (!len || *(char *)v != (shared ? '{' : 'o')) {
			rc = EMBD_EIO;
			snprintf(err, err_len, "node %u: %.*s", k, (int)len, (char *)v);
		} else if (shared &&
			   (rc = embd_ckpt_manifest_parse(v, len, &parts[k], inner, sizeof(inner)))) {
			snprintf(err, err_len, "node %u's report: %s", k, inner);
		}
		free(v);
	}
	if (!rc && !shared)
		embd_log_info("checkpoint of step %" PRIu64 ": complete, every one of the %u nodes "
			      "committed it in its own directory", step, n);
	if (!rc && shared)
		rc = embd_ckpt_manifest_merge(parts, n, &merged, err, err_len);
	if (!rc && shared)
		rc = embd_ckpt_commit(cl->settings->checkpoint_dir, &merged, true, err, err_len);
	if (rc && rc != EMBD_EBUSY && shared &&
	    embd_ckpt_discard(cl->settings->checkpoint_dir, step, inner, sizeof(inner)))
		embd_log_warning("checkpoint of step %" PRIu64 ": %s", step, inner);
	for (uint32_t k = 0; parts && k < n; k++) {
		embd_store_delete(cl->store, keys[k]);
		embd_ckpt_manifest_free(&parts[k]);
	}
	embd_ckpt_manifest_free(&merged);
	free(parts);
	if (rc == EMBD_ENOMEM && !err[0])
		snprintf(err, err_len, "out of memory");
	return rc;
}

int embd_ckpt_cluster_write(const struct embd_ckpt_cluster *cl, struct embd_ckpt_manifest *m,
			    const struct embd_ckpt_array *arrays, uint32_t num_arrays,
			    uint64_t *bytes, char *err, size_t err_len)
{
	const char *root = cl->settings->checkpoint_dir;
	const bool shared = cl->settings->checkpoint_layout == EMBD_CKPT_SHARED;
	char (*keys)[CKPT_KEY_MAX] = calloc(cl->num_nodes, sizeof(*keys)), done[CKPT_KEY_MAX], *text = NULL;
	char *failed = malloc(err_len + 8), busy[CKPT_KEY_MAX];
	int rc;

	if (!keys || !failed) {
		free(keys);
		free(failed);
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	}
	snprintf(busy, sizeof(busy), CKPT_KEY "%" PRIu64 "/writing", cl->generation, m->step);
	/* the others wait for the verdict while this mark is there (ckpt_cluster.h) */
	if (cl->node == 0 && embd_store_set(cl->store, busy, "1", 1))
		embd_log_warning("checkpoints: cannot set %s: %s", busy, embd_store_error(cl->store));
	embd_ckpt_write_delay(cl);
	rc = shared ? embd_ckpt_write_part(root, m, arrays, num_arrays, true, bytes, err, err_len)
		    : embd_ckpt_write_dir(root, m, arrays, num_arrays, true, bytes, err, err_len);
	if (rc == EMBD_EBUSY && !shared)
		rc = 0;         /* this node holds that step already: its part is there */
	if (!rc && shared && (rc = embd_ckpt_manifest_write(m, &text)))
		snprintf(err, err_len, "cannot format this node's manifest");
	snprintf(failed, err_len + 8, "error: %s", err);
	const char *report = rc ? failed : shared ? text : "ok";
	for (uint32_t k = 0; k < cl->num_nodes; k++)
		snprintf(keys[k], sizeof(keys[k]), CKPT_KEY "%" PRIu64 "/node/%u",
			 cl->generation, m->step, k);
	snprintf(done, sizeof(done), CKPT_KEY "%" PRIu64 "/done", cl->generation, m->step);
	int src = embd_store_set(cl->store, keys[cl->node], report, strlen(report));
	if (src && !rc) {
		rc = src;
		snprintf(err, err_len, "reporting to the store: %s", embd_store_error(cl->store));
	}
	if (cl->node == 0) {
		/* node 0's own failure is in its report too: commit() names it like any node's */
		int crc = commit(cl, m->step, keys, err, err_len);
		rc = rc ? rc : crc;
		publish_verdict(cl, done, rc, "ok", err);
		embd_store_delete(cl->store, busy);
	} else if (!rc) {
		rc = read_verdict(cl, done, busy, "ok", err, err_len);
	}
	free(text);
	free(keys);
	free(failed);
	return rc;
}

/* ---- restore ----------------------------------------------------------------------------- */

void embd_ckpt_skipped_free(struct embd_ckpt_skipped *s)
{
	free(s->dirs);
	memset(s, 0, sizeof(*s));
}

static void note_skipped(void *arg, const char *dir, const char *why)
{
	struct embd_ckpt_skipped *s = arg;

	embd_log_warning("checkpoint %s is damaged, skipped: %s", dir, why);
	for (uint32_t i = 0; i < s->n; i++)
		if (!strcmp(s->dirs[i], dir))
			return;
	if (!s->n)
		snprintf(s->why, sizeof(s->why), "%s", why);
	if (s->n == s->cap) {
		uint32_t cap = s->cap ? 2 * s->cap : 8;
		void *p = realloc(s->dirs, cap * sizeof(*s->dirs));
		if (!p)
			return;         /* it stays where it is: moved aside at a later restore */
		s->dirs = p;
		s->cap = cap;
	}
	snprintf(s->dirs[s->n++], sizeof(s->dirs[0]), "%s", dir);
}

/* Why a restore that skipped damaged checkpoints and found no valid one does not start
 * afresh (what), into err. */
static int refuse_fresh_start(const struct embd_ckpt_skipped *s, const char *what, char *err,
			      size_t err_len)
{
	return snprintf(err, err_len, "%s: %u damaged checkpoint%s (%s: %s) and no valid one to "
			"restore; refusing to start from the initial weights. Repair or move them "
			"away, or set checkpoint_allow_fresh_start to start afresh (they are then "
			"moved to damaged/)", what, s->n, s->n == 1 ? "" : "s", s->dirs[0], s->why),
	       EMBD_ECHECKSUM;
}

/* The same when every damaged checkpoint was moved to damaged/ before (by retention, or by a
 * start that skipped them) and no step-<N> remains: their training is lost just the same. */
static int refuse_fresh_start_aside(const char *root, uint32_t aside, char *err, size_t err_len)
{
	return snprintf(err, err_len, "%s: no valid checkpoint to restore, and %s/%s/ holds %u "
			"damaged checkpoint%s; refusing to start from the initial weights. Repair "
			"one and move it back, or set checkpoint_allow_fresh_start to start afresh",
			root, root, EMBD_CKPT_DAMAGED_DIR, aside, aside == 1 ? "" : "s"),
	       EMBD_ECHECKSUM;
}

int embd_ckpt_find_local(const struct embd_ckpt_cluster *cl, uint64_t bound,
			 struct embd_ckpt_skipped *skipped, char *dir, size_t dir_cap,
			 struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	const char *root = cl->settings->checkpoint_dir;
	int rc = embd_ckpt_find(root, bound, note_skipped, skipped, dir, dir_cap, m, err, err_len);
	uint32_t aside;

	if (rc != EMBD_ENOENT || cl->settings->checkpoint_allow_fresh_start)
		return rc;
	if (skipped->n)
		return refuse_fresh_start(skipped, root, err, err_len);
	if (bound == UINT64_MAX && (aside = embd_ckpt_count_damaged(root)))
		return refuse_fresh_start_aside(root, aside, err, err_len);
	return rc;
}

/* Shared: node 0 finds the newest valid step and publishes it ("none", or "error: why");
 * every other node opens that very directory and fails on damage rather than take another
 * step than node 0. */
static int find_shared(const struct embd_ckpt_cluster *cl, const char *key,
		       struct embd_ckpt_skipped *skipped, char *dir, size_t dir_cap,
		       struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	const char *root = cl->settings->checkpoint_dir;
	char value[800], inner[600];
	void *v = NULL;
	size_t len = 0;
	int rc;

	if (!cl->node) {
		rc = embd_ckpt_find_local(cl, UINT64_MAX, skipped, dir, dir_cap, m, err, err_len);
		if (!rc)
			snprintf(value, sizeof(value), "%" PRIu64, m->step);
		else
			snprintf(value, sizeof(value), rc == EMBD_ENOENT ? "none" : "error: %s", err);
		/* the store's own code: a re-formed cluster tries again after a store failure
		 * (embd_regroup_restore_transient), not after a damaged checkpoint */
		int src = embd_store_set(cl->store, key, value, strlen(value));
		if (src) {
			embd_ckpt_manifest_free(m);
			return snprintf(err, err_len, "store: publishing the step to restore: %s",
					embd_store_error(cl->store)), src;
		}
		return rc;
	}
	if ((rc = embd_store_get(cl->store, key, &v, &len)))
		return snprintf(err, err_len, "store: waiting for node 0's choice of checkpoint: %s",
				embd_store_error(cl->store)), rc;
	snprintf(value, sizeof(value), "%.*s", (int)len, (char *)v);
	free(v);
	if (!strcmp(value, "none"))
		return snprintf(err, err_len, "%s: no valid checkpoint (node 0)", root), EMBD_ENOENT;
	if (!strncmp(value, "error: ", 7))
		return snprintf(err, err_len, "node 0 cannot choose a checkpoint: %s", value + 7),
		       EMBD_EIO;
	uint64_t step = strtoull(value, NULL, 10);
	embd_ckpt_dir_name(root, step, dir, dir_cap);
	rc = embd_ckpt_open_dir(dir, m, inner, sizeof(inner));
	if (!rc && m->step != step) {
		snprintf(inner, sizeof(inner), "its manifest is of step %" PRIu64, m->step);
		embd_ckpt_manifest_free(m);
		rc = EMBD_EPARSE;
	}
	/* never EMBD_ENOENT: this node must not start afresh while node 0 restores */
	if (rc)
		return snprintf(err, err_len, "%s: node 0 restores step %" PRIu64 ", this node cannot "
				"(is checkpoint_dir one shared directory?): %s", dir, step, inner),
		       rc == EMBD_ENOENT ? EMBD_EMISMATCH : rc;
	return 0;
}

/* Per_node, node 0's part of round r: every node's newest valid step, then the answer. A
 * value is "<step>" or "none", followed by " damaged" when that node skipped damaged steps. */
static int decide_round(const struct embd_ckpt_cluster *cl, uint32_t r, char (*keys)[CKPT_KEY_MAX],
			char *answer, size_t cap, char *err, size_t err_len)
{
	uint64_t lowest = UINT64_MAX, highest = 0;
	uint32_t damaged = UINT32_MAX, none = UINT32_MAX;
	int rc = wait_all(cl, keys, "say which checkpoints it holds", err, err_len);

	for (uint32_t k = 0; k < cl->num_nodes && !rc; k++) {
		void *v = NULL;
		size_t len = 0;
		if ((rc = embd_store_get(cl->store, keys[k], &v, &len))) {
			snprintf(err, err_len, "node %u's checkpoints: %s", k, embd_store_error(cl->store));
			break;
		}
		char text[600];
		snprintf(text, sizeof(text), "%.*s", (int)len, (char *)v);
		free(v);
		embd_store_delete(cl->store, keys[k]);
		if (!strncmp(text, "error: ", 7)) {
			snprintf(err, err_len, "node %u: %s", k, text + 7);
			return EMBD_EIO;
		}
		if (strstr(text, " damaged") && damaged == UINT32_MAX)
			damaged = k;
		if (!strncmp(text, "none", 4)) {
			none = none == UINT32_MAX ? k : none;
			continue;
		}
		uint64_t s = strtoull(text, NULL, 10);
		lowest = s < lowest ? s : lowest;
		highest = s > highest ? s : highest;
	}
	if (rc)
		return rc;
	if (none == UINT32_MAX) {
		snprintf(answer, cap, "%s %" PRIu64, lowest == highest ? "step" : "below", lowest);
		return 0;
	}
	/* a step damaged on one node only was a cluster checkpoint: do not start afresh over it */
	if (damaged != UINT32_MAX && !cl->settings->checkpoint_allow_fresh_start)
		return snprintf(err, err_len, "node %u holds damaged checkpoints (skipped now, or in "
				"its damaged/; see its log) and no step every node holds valid "
				"remains; refusing to start from the initial weights. Repair or move "
				"them away, or set checkpoint_allow_fresh_start on node 0", damaged),
		       EMBD_ECHECKSUM;
	snprintf(answer, cap, "none");
	embd_log_notice("restore: node %u holds no valid checkpoint (round %u): every node starts "
			"from the initial weights", none, r);
	return 0;
}

/* Per_node: rounds until every node holds the same newest valid step (ckpt_cluster.h). */
static int find_per_node(const struct embd_ckpt_cluster *cl, const char *base,
			 struct embd_ckpt_skipped *skipped, char *dir, size_t dir_cap,
			 struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	const char *root = cl->settings->checkpoint_dir;
	char (*keys)[CKPT_KEY_MAX] = calloc(cl->num_nodes, sizeof(*keys)), key[CKPT_KEY_MAX], value[640], answer[700];
	uint64_t bound = UINT64_MAX;
	int rc = keys ? 0 : EMBD_ENOMEM;
	bool aside = false;     /* no valid step at all, and damaged/ holds checkpoints */

	memset(m, 0, sizeof(*m));
	for (uint32_t r = 0; !rc; r++) {
		embd_ckpt_manifest_free(m);
		/* the cluster decides whether damage forbids a fresh start: this node says "none" */
		int frc = embd_ckpt_find(root, bound, note_skipped, skipped, dir, dir_cap, m, err,
					 err_len);
		aside |= r == 0 && frc == EMBD_ENOENT && embd_ckpt_count_damaged(root);
		const bool damaged = skipped->n || aside;
		if (frc == 0)
			snprintf(value, sizeof(value), "%" PRIu64 "%s", m->step,
				 damaged ? " damaged" : "");
		else if (frc == EMBD_ENOENT)
			snprintf(value, sizeof(value), "none%s", damaged ? " damaged" : "");
		else
			snprintf(value, sizeof(value), "error: %s", err);
		for (uint32_t k = 0; k < cl->num_nodes; k++)
			snprintf(keys[k], sizeof(keys[k]), "%s/%u/node/%u", base, r, k);
		snprintf(key, sizeof(key), "%s/%u", base, r);
		if ((rc = embd_store_set(cl->store, keys[cl->node], value, strlen(value)))) {
			snprintf(err, err_len, "store: %s", embd_store_error(cl->store));
			break;
		}
		if (cl->node == 0) {
			rc = decide_round(cl, r, keys, answer, sizeof(answer), err, err_len);
			publish_verdict(cl, key, rc, answer, err);
			if (rc)
				break;
		} else {
			void *v = NULL;
			size_t len = 0;
			if ((rc = embd_store_get(cl->store, key, &v, &len))) {
				snprintf(err, err_len, "store: waiting for node 0's choice of checkpoint: "
					 "%s", embd_store_error(cl->store));
				break;
			}
			snprintf(answer, sizeof(answer), "%.*s", (int)len, (char *)v);
			free(v);
			if (!strncmp(answer, "error: ", 7)) {
				rc = EMBD_EIO;
				snprintf(err, err_len, "node 0 cannot choose a checkpoint: %s", answer + 7);
				break;
			}
		}
		if (!strcmp(answer, "none")) {
			rc = EMBD_ENOENT;
			snprintf(err, err_len, "no step that every node holds valid");
		} else if (!strncmp(answer, "step ", 5)) {
			/* every node published this very step: so did this one */
			break;
		} else {
			bound = strtoull(answer + 6, NULL, 10);
		}
	}
	free(keys);
	if (rc) {
		embd_ckpt_manifest_free(m);
		return rc;
	}
	if (m->num_nodes != cl->num_nodes || m->node != cl->node || m->plan_hash != cl->plan_hash) {
		snprintf(err, err_len, "%s was written by node %u of %u under plan %016" PRIx64 "; "
			 "this is node %u of %u under plan %016" PRIx64 ": checkpoint_layout "
			 "per_node restores only the same plan and node count (to reshard, gather "
			 "every node's directory into one and use the shared layout, or embctl "
			 "export --dir ...)", dir, m->node, m->num_nodes, m->plan_hash, cl->node,
			 cl->num_nodes, cl->plan_hash);
		embd_ckpt_manifest_free(m);
		return EMBD_EMISMATCH;
	}
	return 0;
}

int embd_ckpt_cluster_find(const struct embd_ckpt_cluster *cl, const char *key,
			   struct embd_ckpt_skipped *skipped, char *dir, size_t dir_cap,
			   struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	return cl->settings->checkpoint_layout == EMBD_CKPT_SHARED
		       ? find_shared(cl, key, skipped, dir, dir_cap, m, err, err_len)
		       : find_per_node(cl, key, skipped, dir, dir_cap, m, err, err_len);
}

/* ---- the final checkpoint of an idle cluster ---------------------------------------------- */

int embd_ckpt_cluster_stop_barrier(const struct embd_ckpt_cluster *cl, uint64_t step,
				   char *err, size_t err_len)
{
	char (*keys)[CKPT_KEY_MAX] = calloc(cl->num_nodes, sizeof(*keys)), go[CKPT_KEY_MAX];
	int rc;

	if (!keys)
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	for (uint32_t k = 0; k < cl->num_nodes; k++)
		snprintf(keys[k], sizeof(keys[k]), CKPT_KEY "stop/%" PRIu64 "/node/%u",
			 cl->generation, step, k);
	snprintf(go, sizeof(go), CKPT_KEY "stop/%" PRIu64, cl->generation, step);
	if ((rc = embd_store_set(cl->store, keys[cl->node], "1", 1))) {
		snprintf(err, err_len, "store: %s", embd_store_error(cl->store));
	} else if (cl->node == 0) {
		rc = wait_all(cl, keys, "stop idle at this step", err, err_len);
		publish_verdict(cl, go, rc, "go", err);
		for (uint32_t k = 0; k < cl->num_nodes; k++)
			embd_store_delete(cl->store, keys[k]);
	} else {
		rc = read_verdict(cl, go, NULL, "go", err, err_len);
	}
	free(keys);
	return rc;
}
