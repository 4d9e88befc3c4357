/*
 * Checkpoints of the running service (ckpt/ckpt_service.h). The shards' copy is
 * ckpt/ckpt_snapshot.c's, the cluster's store protocol ckpt/ckpt_cluster.c's; here: when
 * to take one (on a cluster, as agreed through the steps), the writer thread (which runs the
 * copier thread beside it and owns the snapshot until it signals the eventfd), restore,
 * retention, and the stall accounting.
 */
#include "ckpt/ckpt_service.h"
#include "common/clock.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/checkpoint.h"
#include "ckpt/ckpt_cluster.h"
#include "ckpt/ckpt_snapshot.h"
#include "common/log.h"
#include "dist/store.h"

struct result {
	int rc;                         /* 0, or why the write failed */
	uint64_t seq, step, bytes;
	double write_ms, stall_ms;
	char dir[EMBD_CKPT_PATH_MAX + 64];
	char err[768];
};

struct embd_ckpt_service {
	const struct embd_ckpt_settings *settings;
	struct embd_ckpt_lock *lock;            /* checkpoint_dir's, held until destroy */
	struct embd_step *step;
	struct embd_ckpt_manifest base;         /* tables, plan, node: every write's manifest */
	struct embd_store *store;               /* a cluster's: restore, then the writer's only */
	struct embd_ckpt_cluster cl;            /* store, config, node: ckpt_cluster.h */
	struct embd_ckpt_snapshot *snap;
	const struct embd_ckpt_array *arrays;   /* the snapshot's */
	uint32_t num_arrays;
	int efd;
	/* the write in flight (owned by the thread while running) */
	pthread_t thread;
	bool running;
	atomic_bool finished;
	struct result w;
	/* triggers */
	uint64_t seq_started;
	bool requested;
	bool agreed;                            /* a cluster's nodes agreed on this boundary */
	bool stopping;                          /* SIGTERM on a cluster: ask for a final one */
	bool reattach;                          /* re-formed: reconnect store once no write runs */
	uint64_t generation;                    /* the cluster's comm generation: the next write's
						 * keys (cl.generation, set when one starts) */
	uint64_t common_step;                   /* the newest step every node holds (per_node
						 * retention spares it); UINT64_MAX: none known */
	uint64_t last_step, last_ns;            /* of the last started (or restored) checkpoint */
	uint64_t skipped;                       /* every_steps boundaries passed while a write ran
						 * (one node; ckpt_service.h) */
	uint64_t resumed_step;
	/* the steps' share of the running checkpoint (service thread): the boundary's own time
	 * (waiting for the previous write, the begin), then per step the hooks' copies */
	bool accounting;
	double boundary_ms, cur_stall_ms;
	uint64_t hook_seen_ns;
	/* results */
	struct result last;                     /* the last finished one (seq 0: none) */
	double max_stall_ms;
	uint64_t written, failed;
	double write_ms_sum;                    /* of the written ones */
};

int embd_ckpt_service_create(const struct embd_ckpt_settings *settings, struct embd_step *step,
			     struct embd_plan *plan, struct embd_ckpt_service **out, char *err,
			     size_t err_len)
{
	struct embd_ckpt_service *ck = calloc(1, sizeof(*ck));
	const struct embd_tables *t = &settings->tables;
	size_t len;
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!ck)
		return rc;
	ck->settings = settings;
	ck->step = step;
	ck->efd = -1;
	ck->base.node = settings->node_rank;
	ck->base.num_nodes = settings->num_nodes;
	const bool cluster = settings->num_nodes > 1;
	ck->base.node_part = cluster && settings->checkpoint_layout == EMBD_CKPT_PER_NODE;
	char who[96];
	snprintf(who, sizeof(who), "embd node %u of %u%s%s", settings->node_rank,
		 settings->num_nodes, cluster ? ", checkpoint_layout " : "",
		 cluster ? embd_ckpt_layout_name(settings->checkpoint_layout) : "");
	/* first: a second service must not even read the directory the first one writes */
	if ((rc = embd_ckpt_lock_take(settings->checkpoint_dir,
				      cluster && settings->checkpoint_layout == EMBD_CKPT_SHARED,
				      settings->node_rank, who, &ck->lock, err, err_len)))
		goto out;
	rc = EMBD_ENOMEM;
	ck->base.num_tables = t->count;
	ck->base.tables = calloc(t->count + 1, sizeof(*ck->base.tables));
	if (!ck->base.tables)
		goto out;
	for (uint32_t i = 0; i < t->count; i++)
		ck->base.tables[i] = (struct embd_ckpt_table){
			.num_embeddings = t->specs[i].num_embeddings,
			.embedding_dim = t->specs[i].embedding_dim, .data_type = t->specs[i].data_type,
			.optimizer = t->specs[i].optimizer.type,
		};
	for (uint32_t i = 0; i < t->count; i++)
		memcpy(ck->base.tables[i].name, t->specs[i].name, EMBD_NAME_MAX);
	if ((rc = embd_plan_write_json(plan, &ck->base.plan_json, &len)))
		goto out;
	ck->base.plan_hash = plan->plan_hash;
	if ((rc = embd_ckpt_snapshot_create(t, step, ck->base.node, &ck->snap, err, err_len)))
		goto out;
	ck->arrays = embd_ckpt_snapshot_arrays(ck->snap, &ck->num_arrays);
	embd_step_set_update_hook(step, embd_ckpt_snapshot_before_update, ck->snap);
	/* a handle of its own: the service thread's one is busy in the steps' collectives */
	if (ck->base.num_nodes > 1 &&
	    (rc = embd_store_connect(settings->master_addr, settings->master_port,
				     settings->store_timeout_ms, &ck->store, err, err_len)))
		goto out;
	ck->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (ck->efd < 0) {
		rc = EMBD_EIO;
		snprintf(err, err_len, "checkpoints: eventfd: %s", strerror(errno));
		goto out;
	}
	ck->cl = (struct embd_ckpt_cluster){ .store = ck->store, .settings = settings,
					     .node = ck->base.node, .num_nodes = ck->base.num_nodes,
					     .plan_hash = ck->base.plan_hash };
	const char *delay = getenv(EMBD_CKPT_WRITE_DELAY_ENV);
	ck->cl.write_delay_ms = delay ? atoi(delay) : 0;
	ck->common_step = UINT64_MAX;
	ck->last_ns = embd_now_ns();
	*out = ck;
	return 0;
out:
	if (rc == EMBD_ENOMEM && !err[0])
		snprintf(err, err_len, "checkpoints: out of memory");
	embd_ckpt_service_destroy(ck);
	return rc;
}

void embd_ckpt_service_destroy(struct embd_ckpt_service *ck)
{
	if (!ck)
		return;
	if (ck->running)
		pthread_join(ck->thread, NULL);
	if (ck->snap)
		embd_step_set_update_hook(ck->step, NULL, NULL);
	if (ck->efd >= 0)
		close(ck->efd);
	embd_store_close(ck->store);
	embd_ckpt_manifest_free(&ck->base);
	embd_ckpt_snapshot_destroy(ck->snap);
	embd_ckpt_lock_release(ck->lock);
	free(ck);
}

int embd_ckpt_service_fd(const struct embd_ckpt_service *ck)
{
	return ck->efd;
}

/* ---- writing ----------------------------------------------------------------------------- */

static void log_moved(void *arg, const char *dir, const char *why)
{
	(void)arg;
	embd_log_warning("checkpoint retention: a damaged checkpoint was moved to %s (%s); it no "
			 "longer counts toward checkpoint_keep", dir, why);
}

/* The write itself: the thread's body, or the final checkpoint's on the service thread. */
static void write_snapshot(struct embd_ckpt_service *ck)
{
	struct embd_ckpt_manifest m = ck->base;        /* shares tables and plan */
	struct result *w = &ck->w;
	const char *root = ck->settings->checkpoint_dir;
	const bool cluster = ck->base.num_nodes > 1;
	uint64_t t0 = embd_now_ns();

	m.files = NULL;
	m.num_files = 0;
	if (w->rc)
		return;         /* the boundary's copy from the GPUs failed (snapshot) */
	m.step = w->step;
	m.created_unix_ms = 0;
	embd_ckpt_dir_name(root, w->step, w->dir, sizeof(w->dir));
	if (!cluster)
		embd_ckpt_write_delay(&ck->cl);        /* a cluster's node sleeps in its protocol */
	w->rc = cluster ? embd_ckpt_cluster_write(&ck->cl, &m, ck->arrays, ck->num_arrays,
						  &w->bytes, w->err, sizeof(w->err))
			: embd_ckpt_write_dir(root, &m, ck->arrays, ck->num_arrays, true, &w->bytes,
					      w->err, sizeof(w->err));
	free(m.files);
	if (!w->rc || w->rc == EMBD_EBUSY)
		ck->common_step = w->step;
	/* shared: node 0 alone, sparing the .tmp of later steps the nodes may be writing;
	 * per_node: every node in its own directory, sparing the newest step all hold */
	const bool per_node = cluster && ck->settings->checkpoint_layout == EMBD_CKPT_PER_NODE;
	if (per_node || (!w->rc && !m.node)) {
		char inner[512];
		/* per_node spares the newest step every node holds, else the one just written */
		int removed = embd_ckpt_retain(root, ck->settings->checkpoint_keep,
					       cluster && !per_node ? w->step : UINT64_MAX,
					       per_node ? ck->common_step : w->rc ? UINT64_MAX : w->step,
					       log_moved, NULL, inner, sizeof(inner));
		if (removed < 0 && !w->rc)
			snprintf(w->err, sizeof(w->err), "retention: %s", inner);
	}
	w->write_ms = (double)(embd_now_ns() - t0) / 1e6;
}

static void *copier_main(void *arg)
{
	embd_ckpt_snapshot_copy(arg);
	return NULL;
}

static void *writer_main(void *arg)
{
	struct embd_ckpt_service *ck = arg;
	uint64_t one = 1;
	pthread_t copier;
	bool started = !pthread_create(&copier, NULL, copier_main, ck->snap);

	if (!started)
		embd_ckpt_snapshot_copy(ck->snap);      /* the steps wait on this one's rows */
	write_snapshot(ck);
	if (started)
		pthread_join(copier, NULL);
	atomic_store_explicit(&ck->finished, true, memory_order_release);
	if (write(ck->efd, &one, sizeof(one)) != sizeof(one))
		embd_log_warning("checkpoint: cannot signal the service (eventfd)");
	return NULL;
}

/* The steps' share of the checkpoint since the last boundary: that boundary's own time and
 * the hooks' copies in the step after it (rank workers summed: an upper bound). */
static void account_step(struct embd_ckpt_service *ck)
{
	if (!ck->accounting)
		return;
	uint64_t hook = embd_ckpt_snapshot_hook_ns(ck->snap);
	double ms = ck->boundary_ms + (double)(hook - ck->hook_seen_ns) / 1e6;
	ck->hook_seen_ns = hook;
	ck->boundary_ms = 0;
	if (ms > ck->cur_stall_ms)
		ck->cur_stall_ms = ms;
	if (ms > ck->max_stall_ms)
		ck->max_stall_ms = ms;
}

/* Starts the snapshot of `step` at this boundary: only marks the shards "not copied"
 * (ckpt_snapshot.h); waited_ms is what this boundary already spent waiting for the previous
 * write. */
static void snapshot(struct embd_ckpt_service *ck, uint64_t step, double waited_ms)
{
	uint64_t t0 = embd_now_ns();
	char err[512] = "";
	/* GPU shards: their host views (what the snapshot copies) as at this boundary */
	int rc = embd_step_shards_pull(ck->step, err, sizeof(err));

	embd_ckpt_snapshot_begin(ck->snap);
	ck->w = (struct result){ .seq = ++ck->seq_started, .step = step, .rc = rc };
	if (rc)
		snprintf(ck->w.err, sizeof(ck->w.err), "copying the shards from the GPUs: %.500s", err);
	ck->accounting = true;
	ck->boundary_ms = waited_ms + (double)(embd_now_ns() - t0) / 1e6;
	ck->cur_stall_ms = 0;
	ck->hook_seen_ns = 0;
	ck->requested = false;
	ck->last_step = step;
	ck->last_ns = embd_now_ns();
}

static void finish(struct embd_ckpt_service *ck)
{
	struct result *w = &ck->w;

	account_step(ck);
	ck->accounting = false;
	w->stall_ms = ck->cur_stall_ms;

	if (w->rc == EMBD_EBUSY) {      /* this step is on disk already: nothing to add */
		w->rc = 0;
		w->bytes = 0;
		embd_log_info("checkpoint of step %" PRIu64 ": %s holds it already", w->step, w->dir);
	} else if (w->rc) {
		ck->failed++;
		embd_log_error("checkpoint of step %" PRIu64 " failed: %s", w->step, w->err);
	} else {
		ck->written++;
		ck->write_ms_sum += w->write_ms;
		/* a note beside success: a damaged step replaced, retention that failed */
		embd_log(w->err[0] ? EMBD_LOG_WARNING : EMBD_LOG_INFO,
			 "checkpoint of step %" PRIu64 ": %s, %" PRIu64 " bytes in %.1f ms (steps "
			 "stalled %.2f ms)%s%s", w->step, w->dir, w->bytes, w->write_ms, w->stall_ms,
			 w->err[0] ? "; " : "", w->err);
		w->err[0] = 0;
	}
	ck->last = *w;
}

/* The regrouped cluster's store again for the writer's handle, on the service thread while no
 * writer runs (the handle is the writer's while it does). A failure is retried at the next
 * start; meanwhile a write fails at once, naming the closed connection. */
static void reattach_store(struct embd_ckpt_service *ck)
{
	if (!ck->reattach || ck->running)
		return;
	if (embd_store_reconnect(ck->store, ck->settings->store_timeout_ms)) {
		embd_log_warning("checkpoints: cannot reconnect to node 0's store: %s",
				 embd_store_error(ck->store));
		return;
	}
	ck->reattach = false;
}

void embd_ckpt_service_regrouped(struct embd_ckpt_service *ck, uint64_t generation)
{
	if (!ck->store)
		return;
	ck->generation = generation;
	ck->reattach = true;
	reattach_store(ck);
}

static void join_writer(struct embd_ckpt_service *ck)
{
	pthread_join(ck->thread, NULL);
	ck->running = false;
	finish(ck);
	reattach_store(ck);
}

/* Starts the write of the snapshot of `step` taken at this boundary. */
static void start(struct embd_ckpt_service *ck, uint64_t step, double waited_ms)
{
	reattach_store(ck);
	ck->cl.generation = ck->generation;     /* no writer reads it now */
	snapshot(ck, step, waited_ms);
	atomic_store(&ck->finished, false);
	if (pthread_create(&ck->thread, NULL, writer_main, ck)) {
		ck->w.rc = EMBD_EIO;
		snprintf(ck->w.err, sizeof(ck->w.err), "cannot start the writer thread");
		finish(ck);
		return;
	}
	ck->running = true;
}

/* Node 0's checkpoint_every_seconds timer (on a cluster only node 0's counts). */
static bool timer_due(const struct embd_ckpt_service *ck, uint64_t step)
{
	const struct embd_ckpt_settings *c = ck->settings;
	return c->checkpoint_every_seconds && step != ck->last_step &&
	       embd_now_ns() - ck->last_ns >= (uint64_t)c->checkpoint_every_seconds * 1000000000u;
}

/* One node takes a due every_steps checkpoint at the first boundary after the write that ran
 * meanwhile (ckpt_service.h); the boundaries it passed are counted and said, not silent. */
static void count_skipped(struct embd_ckpt_service *ck, uint64_t step)
{
	uint32_t every = ck->settings->checkpoint_every_steps;
	uint64_t passed = (step - ck->last_step) / every;

	if (passed < 2)
		return;
	ck->skipped += passed - 1;
	embd_log_notice("checkpoint_every_steps %u: checkpoint of step %" PRIu64 " only: %" PRIu64
			" due since step %" PRIu64 " passed while the previous write ran (%" PRIu64
			" skipped so far, checkpoint.skipped in embctl status)", every, step,
			passed - 1, ck->last_step, ck->skipped);
}

/* checkpoint_every_steps falls at the boundary of step. A cluster takes only the steps every
 * node knows: multiples of every_steps (not this node's own history: a node that missed a
 * boundary while the cluster re-formed would be due at another step than the others). */
static bool every_steps_due(const struct embd_ckpt_service *ck, uint64_t step)
{
	const uint32_t every = ck->settings->checkpoint_every_steps;

	return every && (ck->base.num_nodes > 1 ? step % every == 0
						 : step >= ck->last_step + every);
}

bool embd_ckpt_service_due(const struct embd_ckpt_service *ck, uint64_t step)
{
	const bool cluster = ck->base.num_nodes > 1;

	if (every_steps_due(ck, step) || (cluster && ck->agreed))
		return true;    /* after the running write, if one runs */
	return !cluster && !ck->running && (ck->requested || timer_due(ck, step));
}

bool embd_ckpt_service_poll(struct embd_ckpt_service *ck, uint64_t step)
{
	const bool cluster = ck->base.num_nodes > 1;
	/* every_steps, and on a cluster the agreed ones (a cluster takes no other) */
	bool every = every_steps_due(ck, step);
	bool must = every || (cluster && ck->agreed);
	double waited_ms = 0;

	ck->agreed = false;
	account_step(ck);
	if (ck->running) {
		/* A cluster's nodes must all take the same steps: a due one waits for the write
		 * before it (a stall) rather than moving to whichever step this node is at when its
		 * write ends. One node alone takes it when the write ends. */
		if (!must || !cluster)
			return false;
		uint64_t t0 = embd_now_ns();
		join_writer(ck);
		waited_ms = (double)(embd_now_ns() - t0) / 1e6;
	}
	if (!must && (cluster || !(ck->requested || timer_due(ck, step))))
		return false;
	if (every && !cluster)
		count_skipped(ck, step);
	start(ck, step, waited_ms);
	return true;
}

bool embd_ckpt_service_wanted(const struct embd_ckpt_service *ck, uint64_t step)
{
	return ck->requested || ck->stopping || (ck->base.node == 0 && timer_due(ck, step));
}

void embd_ckpt_service_agreed(struct embd_ckpt_service *ck)
{
	ck->agreed = true;
}

void embd_ckpt_service_stopping(struct embd_ckpt_service *ck)
{
	ck->stopping = true;
}

uint64_t embd_ckpt_service_request(struct embd_ckpt_service *ck)
{
	ck->requested = true;
	return ck->seq_started + 1;
}

uint64_t embd_ckpt_service_reap(struct embd_ckpt_service *ck)
{
	uint64_t v;

	if (read(ck->efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
		embd_log_warning("checkpoint: eventfd read: %s", strerror(errno));
	if (ck->running && atomic_load_explicit(&ck->finished, memory_order_acquire))
		join_writer(ck);
	return ck->last.seq;
}

int embd_ckpt_service_final(struct embd_ckpt_service *ck, uint64_t step)
{
	char err[512];

	if (ck->running)
		join_writer(ck);
	if (ck->last.seq && !ck->last.rc && ck->last.step == step)
		return 0;
	if (ck->last_step == step && step == ck->resumed_step && !ck->seq_started)
		return 0;       /* nothing trained since the restore */
	/* a cluster's idle nodes write only when every node stops at this step (ckpt_cluster.h) */
	ck->cl.generation = ck->generation;
	if (ck->base.num_nodes > 1 && embd_ckpt_cluster_stop_barrier(&ck->cl, step, err,
								     sizeof(err))) {
		embd_log_warning("no final checkpoint of step %" PRIu64 ": %s", step, err);
		return 0;
	}
	snapshot(ck, step, 0);
	embd_ckpt_snapshot_copy(ck->snap);     /* no steps run any more: all on this thread */
	write_snapshot(ck);
	finish(ck);
	return ck->last.rc;
}

/* ---- restore ----------------------------------------------------------------------------- */

/* The checkpoint's tables must be the config's: same names, rows and columns. */
static int check_tables(const struct embd_ckpt_service *ck, const struct embd_ckpt_manifest *m,
			const char *dir, int *index, char *err, size_t err_len)
{
	const struct embd_tables *t = &ck->settings->tables;

	for (uint32_t i = 0; i < t->count; i++) {
		const struct embd_table_spec *s = &t->specs[i];
		int k = index[i] = embd_ckpt_table_index(m, s->name);
		if (k < 0)
			return snprintf(err, err_len, "%s: table '%s' of the config is not in the "
					"checkpoint", dir, s->name), EMBD_EMISMATCH;
		const struct embd_ckpt_table *c = &m->tables[k];
		if (c->num_embeddings != s->num_embeddings || c->embedding_dim != s->embedding_dim)
			return snprintf(err, err_len, "%s: table '%s' is %lld x %d in the checkpoint, "
					"%lld x %d in the config", dir, s->name,
					(long long)c->num_embeddings, c->embedding_dim,
					(long long)s->num_embeddings, s->embedding_dim), EMBD_EMISMATCH;
		bool has_state = false;
		for (uint32_t f = 0; f < m->num_files; f++)
			has_state |= m->files[f].table == (uint32_t)k && m->files[f].state != EMBD_CKPT_WEIGHT;
		if (has_state && c->optimizer != s->optimizer.type)
			return snprintf(err, err_len, "%s: table '%s' was trained with another optimizer "
					"(its state cannot be used)", dir, s->name), EMBD_EMISMATCH;
	}
	for (uint32_t k = 0; k < m->num_tables; k++) {
		bool found = false;
		for (uint32_t i = 0; i < t->count && !found; i++)
			found = index[i] == (int)k;
		if (!found)
			return snprintf(err, err_len, "%s: table '%s' of the checkpoint is not in the "
					"config", dir, m->tables[k].name), EMBD_EMISMATCH;
	}
	return 0;
}

/* The damaged checkpoints a restore that goes ahead skipped: out of the way (checkpoint.h). */
static void move_skipped(struct embd_ckpt_service *ck, const struct embd_ckpt_skipped *sk)
{
	char moved[EMBD_CKPT_PATH_MAX + 128], err[512];

	for (uint32_t i = 0; i < sk->n; i++) {
		if (embd_ckpt_move_damaged(ck->settings->checkpoint_dir, sk->dirs[i], moved,
					   sizeof(moved), err, sizeof(err)))
			embd_log_warning("damaged checkpoint %s stays where it is: %s", sk->dirs[i], err);
		else
			embd_log_warning("damaged checkpoint %s moved to %s", sk->dirs[i], moved);
	}
}

static void log_abandoned(void *arg, const char *moved_to, const char *dir)
{
	embd_log_warning("checkpoint %s is newer than the step resumed from (%" PRIu64 "): moved "
			 "to %s, so that the steps trained from here never meet it", dir,
			 *(const uint64_t *)arg, moved_to);
}

/* Resuming from `step`: this node's newer steps out of the way (embd_ckpt_set_aside_after).
 * A shared directory is node 0's to tidy. A failure is only logged: the directories stay,
 * and a write of such a step later keeps the old one (the case this prevents). */
static void set_aside_after(struct embd_ckpt_service *ck, uint64_t step)
{
	char err[512];

	if (ck->base.num_nodes > 1 && !ck->base.node_part && ck->base.node)
		return;
	if (embd_ckpt_set_aside_after(ck->settings->checkpoint_dir, step, log_abandoned, &step,
				      err, sizeof(err)) < 0)
		embd_log_error("checkpoints newer than step %" PRIu64 " stay in place: %s", step, err);
}

/* A checkpoint this service may restore (checkpoint.h, identity): one node's part only on
 * that node of a per_node cluster (which checks node, count and plan in ckpt_cluster.c). */
static int check_identity(const struct embd_ckpt_service *ck, const struct embd_ckpt_manifest *m,
			  const char *dir, char *err, size_t err_len)
{
	if (!m->node_part || ck->base.node_part)
		return 0;
	return snprintf(err, err_len, "%s is node %u of %u's part of a checkpoint_layout per_node "
			"checkpoint (only that node's shards): this service (node %u of %u, %s) "
			"restores whole checkpoints; gather every node's directory (embctl export "
			"--dir ... --dir ...) or restore it under per_node", dir, m->node, m->num_nodes,
			ck->base.node, ck->base.num_nodes,
			ck->base.num_nodes > 1 ? "checkpoint_layout shared" : "one node"), EMBD_EMISMATCH;
}

/* The newest valid checkpoint into the shards; on a cluster the one chosen through the store
 * at restore_key (ckpt_cluster.h). EMBD_ENOENT (not logged) when there is none; the damaged
 * ones skipped are moved aside when it goes ahead (restored, or none and a fresh start). */
static int restore(struct embd_ckpt_service *ck, const char *restore_key, uint64_t *step_out,
		   char *err, size_t err_len)
{
	char dir[EMBD_CKPT_PATH_MAX + 64];
	struct embd_ckpt_manifest m;
	struct embd_ckpt_skipped skipped = { 0 };
	uint32_t n = embd_step_num_shards(ck->step);
	struct embd_ckpt_target *targets = calloc(n + 1, sizeof(*targets));
	int *index = calloc(ck->settings->tables.count + 1, sizeof(int));
	int rc = EMBD_ENOMEM;

	*step_out = 0;
	memset(&m, 0, sizeof(m));
	if (!targets || !index)
		goto out;
	rc = ck->base.num_nodes > 1 ? embd_ckpt_cluster_find(&ck->cl, restore_key, &skipped, dir,
							     sizeof(dir), &m, err, err_len)
				    : embd_ckpt_find_local(&ck->cl, UINT64_MAX, &skipped, dir,
							   sizeof(dir), &m, err, err_len);
	if (rc == EMBD_ENOENT)  /* a fresh start was allowed over them (ckpt_cluster.h) */
		move_skipped(ck, &skipped);
	if (rc || (rc = check_identity(ck, &m, dir, err, err_len)) ||
	    (rc = check_tables(ck, &m, dir, index, err, err_len)))
		goto out;
	move_skipped(ck, &skipped);
	uint32_t num_targets = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(ck->step, i, &v);
		if (!v.shard)
			continue;       /* another node's */
		const struct embd_shard_desc *d = &v.shard->desc;
		targets[num_targets++] = (struct embd_ckpt_target){
			.table = (uint32_t)index[v.table], .row_offset = d->row_offset, .rows = d->rows,
			.col_offset = d->col_offset, .cols = d->cols, .dtype = d->dtype,
			.weights = v.shard->weights, .momentum1 = v.shard->momentum1,
			.momentum2 = v.shard->momentum2,
		};
	}
	if ((rc = embd_ckpt_load(dir, &m, targets, num_targets, err, err_len)))
		goto out;
	for (uint32_t i = 0, k = 0; i < n; i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(ck->step, i, &v);
		if (v.shard)
			v.shard->step = targets[k++].optimizer_step;
	}
	embd_step_shards_changed(ck->step);     /* GPU shards get the rows before the first step */
	ck->resumed_step = ck->last_step = ck->common_step = *step_out = m.step;
	set_aside_after(ck, m.step);
	embd_log_notice("restored %s: step %" PRIu64 ", %u files, written under plan %016" PRIx64
			"%s", dir, m.step, m.num_files, m.plan_hash,
			m.plan_hash == ck->base.plan_hash ? "" : " (resharded to this plan)");
out:
	embd_ckpt_skipped_free(&skipped);
	embd_ckpt_manifest_free(&m);
	free(targets);
	free(index);
	return rc;
}

int embd_ckpt_service_restore(struct embd_ckpt_service *ck, uint64_t *step_out, char *err,
			      size_t err_len)
{
	int rc = restore(ck, EMBD_CKPT_RESTORE_KEY, step_out, err, err_len);

	if (rc != EMBD_ENOENT)
		return rc;
	uint32_t aside = embd_ckpt_count_damaged(ck->settings->checkpoint_dir);
	if (aside)      /* allowed, else the restore refused (ckpt_cluster.h) */
		embd_log_warning("checkpoint_allow_fresh_start: starting from the initial weights "
				 "while %s/%s holds %u damaged checkpoint(s)",
				 ck->settings->checkpoint_dir, EMBD_CKPT_DAMAGED_DIR, aside);
	else
		embd_log_info("no checkpoint to restore in %s: starting from the initial weights",
			      ck->settings->checkpoint_dir);
	/* a per_node node may hold steps the others lack: this run trains them anew */
	set_aside_after(ck, 0);
	return 0;
}

int embd_ckpt_service_restore_running(struct embd_ckpt_service *ck, const char *restore_key,
				      uint64_t *step_out, char *err, size_t err_len)
{
	/* the writer reads the snapshot buffer, never the shards: it may go on, but its step
	 * would be reported again after the restore, so the restore waits for it */
	if (ck->running)
		join_writer(ck);
	ck->requested = false;
	/* node 0 may first wait that long for a write in flight of its own */
	embd_store_set_timeout(ck->store, 2 * ck->settings->store_timeout_ms);
	int rc = restore(ck, restore_key, step_out, err, err_len);
	embd_store_set_timeout(ck->store, ck->settings->store_timeout_ms);
	return rc;
}

/* ---- reporting --------------------------------------------------------------------------- */

static void add_result(cJSON *o, const struct result *r)
{
	cJSON_AddBoolToObject(o, "ok", r->rc == 0);
	cJSON_AddNumberToObject(o, "step", (double)r->step);
	cJSON_AddStringToObject(o, "dir", r->dir);
	cJSON_AddNumberToObject(o, "bytes", (double)r->bytes);
	cJSON_AddNumberToObject(o, "write_ms", r->write_ms);
	cJSON_AddNumberToObject(o, "stall_ms", r->stall_ms);
	if (r->rc)
		cJSON_AddStringToObject(o, "error", r->err);
}

static int print(cJSON *root, char **out)
{
	*out = root ? cJSON_PrintUnformatted(root) : NULL;
	cJSON_Delete(root);
	return *out ? 0 : EMBD_ENOMEM;
}

int embd_ckpt_service_result_json(const struct embd_ckpt_service *ck, char **out)
{
	cJSON *root = cJSON_CreateObject();

	if (root)
		add_result(root, &ck->last);
	return print(root, out);
}

int embd_ckpt_service_status_add(const struct embd_ckpt_service *ck, char **status)
{
	cJSON *root = cJSON_Parse(*status), *o, *last;

	if (!root || !(o = cJSON_AddObjectToObject(root, "checkpoint"))) {
		cJSON_Delete(root);
		return EMBD_ENOMEM;
	}
	cJSON_AddNumberToObject(root, "resumed_step", (double)ck->resumed_step);
	cJSON_AddStringToObject(o, "dir", ck->settings->checkpoint_dir);
	if (ck->base.num_nodes > 1)
		cJSON_AddStringToObject(o, "layout",
					embd_ckpt_layout_name(ck->settings->checkpoint_layout));
	cJSON_AddNumberToObject(o, "every_steps", ck->settings->checkpoint_every_steps);
	cJSON_AddNumberToObject(o, "every_seconds", ck->settings->checkpoint_every_seconds);
	cJSON_AddNumberToObject(o, "keep", ck->settings->checkpoint_keep);
	cJSON_AddBoolToObject(o, "in_progress", ck->running);
	cJSON_AddNumberToObject(o, "written", (double)ck->written);
	cJSON_AddNumberToObject(o, "skipped", (double)ck->skipped);
	cJSON_AddNumberToObject(o, "max_stall_ms", ck->max_stall_ms);
	if (ck->last.seq && (last = cJSON_AddObjectToObject(o, "last")))
		add_result(last, &ck->last);
	char *text;
	int rc = print(root, &text);
	if (!rc) {
		free(*status);
		*status = text;
	}
	return rc;
}

void embd_ckpt_service_figures(const struct embd_ckpt_service *ck, struct embd_ckpt_figures *out)
{
	*out = (struct embd_ckpt_figures){
		.max_stall_ms = ck->max_stall_ms, .last_stall_ms = ck->last.stall_ms,
		.last_write_ms = ck->last.write_ms, .last_bytes = ck->last.bytes,
		.written = ck->written, .failed = ck->failed, .write_ms_sum = ck->write_ms_sum,
		.last_step = ck->last.step, .in_progress = ck->running,
	};
}
