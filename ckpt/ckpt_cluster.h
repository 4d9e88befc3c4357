/*
 * ckpt/ckpt_cluster.h - the store protocol of a cluster's checkpoints (both layouts of
 * ckpt/checkpoint.h): every node's report, node 0's verdict that every node hears, the
 * choice of the step to restore, and the barrier of a final checkpoint at SIGTERM while idle.
 * The idea: node 0 decides everything and publishes the decision under one key the others
 * wait for, so every node returns the same outcome (a `--wait` on any node answers with the
 * cluster's result). Private to ckpt_service.c; every call blocks on the store (the writer
 * thread's handle, or the service thread's before steps run / after they stopped).
 *
 * Every key of a write and of the stop barrier lives under "embd/gen/<g>/ckpt/" (g: the comm
 * generation every node of the running cluster is in, dist/regroup.h). A node that died or
 * was late leaves keys behind, and after a re-form (a restore) the cluster may checkpoint the
 * same step again: in a new generation, so a stale report, verdict, ack count or mark of an
 * earlier one is never read (a stale report let node 0 commit a step before node k wrote it).
 */
#ifndef EMBD_CKPT_CKPT_CLUSTER_H
#define EMBD_CKPT_CKPT_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_service.h"

struct embd_store;

/* The test hook of a slow write: this many ms of sleep before a node writes its part (read
 * from the environment at start, so that a test can slow one node; 0 when unset), also before
 * one node's write. embd_ckpt_write_delay sleeps it. */
#define EMBD_CKPT_WRITE_DELAY_ENV "EMBD_TEST_CKPT_WRITE_DELAY_MS"

struct embd_ckpt_cluster {
	struct embd_store *store;
	const struct embd_ckpt_settings *settings; /* checkpoint_dir, layout, store_timeout_ms */
	uint32_t node, num_nodes;
	uint64_t plan_hash;                     /* per_node restores only this plan */
	int write_delay_ms;                     /* EMBD_CKPT_WRITE_DELAY_ENV */
	uint64_t generation;                    /* scopes the keys: the cluster's comm generation
						 * (0 until a re-form); set only while no write runs */
};

void embd_ckpt_write_delay(const struct embd_ckpt_cluster *cl);

/*
 * This node's part of step m->step: shared layout, its files into .tmp-step-N
 * (embd_ckpt_write_part); per_node, a whole step-N of its own in its checkpoint_dir
 * (embd_ckpt_write_dir). Then its report "<gen>N/node/<k>" (its manifest, "ok" or "error:
 * why"; <gen>: "embd/gen/<g>/ckpt/"). Node 0 waits store_timeout_ms for every report, commits
 * (shared: merged manifest, rename) or checks (per_node), and publishes the verdict
 * "<gen>N/done"; every other node
 * waits for it. Returns the cluster's outcome on every node: 0 (EMBD_EBUSY on node 0 when
 * the step was on disk already), or the failure with err naming the node.
 *
 * How long the others wait: node 0's verdict comes after node 0's own write, which may take
 * far longer than any timeout (a bigger part, a slower disk). So node 0 marks "<gen>N/writing"
 * before it writes and deletes the mark only after it published the verdict. Another node
 * waits twice store_timeout_ms, then store_timeout_ms more at a time for as long as the mark
 * is there (node 0 works on step N and has not given up: it always ends with a verdict),
 * and gives up when the mark is gone without a verdict (node 0 never started step N) or the
 * store does not answer (node 0 died or stalls: a store call fails within its timeout plus
 * the client's reply slack).
 */
int embd_ckpt_cluster_write(const struct embd_ckpt_cluster *cl, struct embd_ckpt_manifest *m,
			    const struct embd_ckpt_array *arrays, uint32_t num_arrays,
			    uint64_t *bytes, char *err, size_t err_len);

/*
 * The damaged checkpoints one node's restore skipped (each logged as it is found): the service
 * moves them aside (embd_ckpt_move_damaged) once the restore goes ahead, and leaves them in
 * place when it refuses, so that the next start refuses too.
 */
struct embd_ckpt_skipped {
	uint32_t n, cap;
	char (*dirs)[EMBD_CKPT_PATH_MAX + 64];
	char why[512];                  /* the newest one's reason */
};
void embd_ckpt_skipped_free(struct embd_ckpt_skipped *s);

/*
 * This node's newest valid checkpoint with step <= bound in its checkpoint_dir
 * (embd_ckpt_find), noting the damaged ones it skips in skipped. EMBD_ENOENT when there is
 * none; but when checkpoint_allow_fresh_start is not set, EMBD_ECHECKSUM naming them when it
 * skipped damaged ones, or (bound UINT64_MAX) when there is no valid step at all and
 * damaged/ holds checkpoints moved there before: starting from the initial weights would
 * silently drop the training they hold.
 */
int embd_ckpt_find_local(const struct embd_ckpt_cluster *cl, uint64_t bound,
			 struct embd_ckpt_skipped *skipped, char *dir, size_t dir_cap,
			 struct embd_ckpt_manifest *m, char *err, size_t err_len);

/*
 * The checkpoint a cluster restores, the same on every node; dir and *m are this node's.
 * key: the store key of this restore (EMBD_CKPT_RESTORE_KEY at start; one per generation when
 * a re-formed cluster restores, dist/regroup.h).
 * Shared: node 0 finds the newest valid step and publishes it at key; the others
 * open that very directory. Per_node: rounds r = 0, 1, ...: every node publishes the newest
 * step <= bound it holds valid ("<key>/<r>/node/<k>"), node 0 answers with the step
 * when all agree, or with the smallest as the next bound ("<key>/<r>"), so the newest
 * step that every node holds valid wins; a node that skipped damaged steps says so, and
 * when no step remains node 0 refuses to start afresh as embd_ckpt_find_local does. Per_node
 * restores only a checkpoint of this plan and node count (EMBD_EMISMATCH otherwise, saying
 * how to reshard). Every node notes what it skipped in skipped. EMBD_ENOENT: none. A
 * failure of this node's store handle returns the store's code (EMBD_ETIMEDOUT,
 * EMBD_ECONNRESET): a re-formed cluster tries again after those (dist/regroup.h).
 */
#define EMBD_CKPT_RESTORE_KEY "ckpt/restore"
int embd_ckpt_cluster_find(const struct embd_ckpt_cluster *cl, const char *key,
			   struct embd_ckpt_skipped *skipped, char *dir, size_t dir_cap,
			   struct embd_ckpt_manifest *m, char *err, size_t err_len);

/*
 * SIGTERM on an idle cluster: every node stopping at `step` says so ("<gen>stop/<step>/
 * node/<k>"); node 0 waits store_timeout_ms for all and publishes "go" or why not; 0 when
 * every node stops at step (then each writes its part), EMBD_ETIMEDOUT naming the nodes that
 * did not (then no node writes anything).
 */
int embd_ckpt_cluster_stop_barrier(const struct embd_ckpt_cluster *cl, uint64_t step,
				   char *err, size_t err_len);

#endif /* EMBD_CKPT_CKPT_CLUSTER_H */
