/*
 * The step engine's routing (engine/step.h, step_internal.h): every (trainer, feature, shard)
 * becomes one item in the io of its local rank or in the staging io of its node. Routing runs
 * in two halves: on the event-loop thread each trainer's lengths are checked into its private
 * offsets and its items' room is reserved (a refused trainer is rolled back by truncating the
 * buffers); then every rank's workers copy the ids of its items, and help with those staged
 * for other nodes, out of the (shared, untrusted) batches, checking each value read. Every
 * item has room for all ids of its bag, so a client changing its memory meanwhile only changes
 * its own result; a data_parallel bag is read once for all its replicas, which therefore never
 * diverge. A bad id refuses its trainer: its items are then dropped from every rank and
 * staging buffer, before the size exchange (step_dist_input) learns what this node accepted.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "kernels/finite.h"
#include "kernels/jagged.h"
#include "engine/step_internal.h"

/* Trainer i's private offsets: F * b + 1, feature-major, b its batch's samples (check_batch
 * writes them); each trainer has room for the layout's B. */
static int64_t *trainer_offsets(const struct embd_step *s, uint32_t batch)
{
	const uint64_t FB = (uint64_t)s->layout.num_features * s->layout.batch_size;

	return &s->pass->scratch_offsets[batch * (FB + 1)];
}

/* Checks what can be checked without reading ids, and fills the trainer's offsets. */
static int check_batch(struct embd_step *s, uint32_t batch, struct embd_step_batch *b)
{
	const struct embd_kjt *k = &b->kjt;
	const struct embd_step_layout *l = &s->layout;

	if (k->num_features != l->num_features) {
		snprintf(b->err, sizeof(b->err), "num_features: %u, the layout has %u",
			 k->num_features, l->num_features);
		return EMBD_EINVAL;
	}
	/* fewer samples than the layout's B: the last batch of an epoch (TorchRec's stride) */
	if (k->batch_size == 0 || k->batch_size > l->batch_size) {
		snprintf(b->err, sizeof(b->err), "batch_size: %u, the layout takes 1..%u",
			 k->batch_size, l->batch_size);
		return EMBD_EINVAL;
	}
	if (k->num_values > l->max_values) {
		snprintf(b->err, sizeof(b->err), "num_values: %llu, at most %llu",
			 (unsigned long long)k->num_values, (unsigned long long)l->max_values);
		return EMBD_ERANGE;
	}
	if ((!k->lengths && l->num_features) || (!k->values && k->num_values) ||
	    !b->pooled) {
		snprintf(b->err, sizeof(b->err), "%s: missing", !b->pooled ? "pooled" :
			 !k->lengths ? "lengths" : "values");
		return EMBD_EINVAL;
	}
	for (uint32_t f = 0; k->keys && f < k->num_features; f++)
		if (!k->keys[f] || strncmp(k->keys[f], l->feature_names[f], EMBD_NAME_MAX)) {
			snprintf(b->err, sizeof(b->err), "keys[%u]: '%.64s', expected feature '%s'", f,
				 k->keys[f] ? k->keys[f] : "(null)", l->feature_names[f]);
			return EMBD_ENOENT;
		}
	char inner[160];
	int rc = embd_jagged_offsets(k->lengths, (uint64_t)l->num_features * k->batch_size,
				     k->num_values, trainer_offsets(s, batch), inner, sizeof(inner));
	if (rc)
		snprintf(b->err, sizeof(b->err), "lengths: %s", inner);
	return rc;
}

/*
 * Where the items of shard k of table t go: the io of its local rank, or the staging io of
 * its node. A data_parallel table is staged once per other node (its first replica there; the
 * node hands the ids to every replica it holds); NO_IO: no item for this shard.
 */
static uint32_t item_dest(const struct embd_step *s, const struct step_table *t, uint32_t k)
{
	const struct step_shard *ss = &s->shards[t->first_shard + k];

	if (ss->node == s->node)
		return ss->local;
	if (t->type == EMBD_SHARD_DATA_PARALLEL)
		for (uint32_t j = 0; j < k; j++)
			if (s->shards[t->first_shard + j].node == ss->node)
				return NO_IO;
	return s->num_ranks + ss->node;
}

/* Where route_feature put the item of (batch, feature, shard k of the feature's table). */
static struct item_ref *item_ref(const struct embd_step *s, uint32_t batch, uint32_t f,
				 uint32_t k)
{
	return &s->pass->refs[((uint64_t)batch * s->layout.num_features + f) * s->max_table_shards + k];
}

/* Reserves the items of one (batch, feature) on every shard of its table: offsets, room for
 * all n ids of the feature (a row shard fills only its part), and for row-split tables the
 * partial sums (and, for mean, the full bag lengths). fill_item copies the ids later. */
static int route_feature(struct embd_step *s, uint32_t batch, uint32_t f,
			 struct embd_step_batch *b)
{
	const struct step_table *t = &s->tables[s->feature_tables[f]];
	const uint32_t B = b->kjt.batch_size;
	const int64_t *offs = trainer_offsets(s, batch) + (uint64_t)f * B;
	const uint64_t n = (uint64_t)(offs[B] - offs[0]);
	const bool split = row_split(t->type);
	const bool mean = t->spec->pooling == EMBD_POOLING_MEAN;
	uint32_t replica = 0;
	bool first = true;
	int rc;

	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		struct item_ref *ref = item_ref(s, batch, f, k);
		ref->io = item_dest(s, t, k);
		if (ref->io == NO_IO)
			continue;
		struct rank_io *io = &s->pass->io[ref->io];
		const bool local = ref->io < s->num_ranks;
		/* data_parallel: the trainer's own local replica looks up, the others train */
		const bool forward = t->num_replicas == 1 ||
				     (local && replica++ == batch % t->num_local);
		if (!forward && s->pass->eval) {
			ref->io = NO_IO;        /* an evaluation trains nothing */
			continue;
		}
		struct step_item it = {
			.shard = t->first_shard + k, .feature = f, .batch = batch,
			.gtrainer = (s->node << 16) | batch, .bsize = B, .forward = forward,
			.weighted = b->kjt.weights != NULL,
			/* data_parallel: the first replica's item fills the others' (one read) */
			.copy = t->num_replicas > 1 && !first,
			.lengths_at = NO_INDEX, .partial_at = NO_INDEX, .peer = NO_PEER, .rx = NO_INDEX,
		};
		first = false;
		if ((rc = vec_take(&io->offsets, B + 1, sizeof(int64_t), &it.offsets_at)) ||
		    (rc = vec_take(&io->ids, n, sizeof(int64_t), &it.ids_at)) ||
		    (rc = vec_reserve(&io->weights, n, sizeof(float))) ||
		    (split && mean && (rc = vec_take(&io->lengths, B, sizeof(int32_t), &it.lengths_at))) ||
		    (split && local && (rc = vec_take(&io->partial, (uint64_t)B * ss->desc.cols,
						       sizeof(float), &it.partial_at))) ||
		    (rc = vec_take(&io->items, 1, sizeof(it), &ref->at)))
			return rc;
		io->weights.len = io->ids.len;
		*VEC_AT(io->items, struct step_item, ref->at) = it;
	}
	return 0;
}

/*
 * Copies ids src[0, n) (a trainer's shared memory, which it may write meanwhile) into dst and
 * returns nonzero when some id of the copy is not below max_row: each block is checked as it
 * lies in the copy, so the ids checked are the ids kept (embd_copy_nonfinite's way). Block
 * moves and a branch-free check, where reading each id through a volatile pointer and testing
 * it took three times the CPU (embd-bench train, table_wise: fill_io 2.8% of the service's
 * perf samples against 0.9%, Zen 4, 2026-12-05).
 */
static uint32_t copy_ids_below(int64_t *restrict dst, const int64_t *restrict src, uint64_t n,
			       uint64_t max_row)
{
	uint32_t lane[EMBD_FINITE_BLOCK] = { 0 }, any = 0;
	uint64_t i = 0;

	for (; i + EMBD_FINITE_BLOCK <= n; i += EMBD_FINITE_BLOCK) {
		for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
			dst[i + k] = src[i + k];
		/* the check reads the copy: without this the compiler may read src again */
		__asm__ volatile("" ::: "memory");
		for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
			lane[k] |= (uint64_t)dst[i + k] >= max_row;
	}
	for (; i < n; i++) {
		dst[i] = src[i];
		__asm__ volatile("" ::: "memory");
		any |= (uint64_t)dst[i] >= max_row;
	}
	for (uint32_t k = 0; k < EMBD_FINITE_BLOCK; k++)
		any |= lane[k];
	return any;
}

/*
 * fill_item for an item of one destination that keeps every id (not row-split, so it has no
 * bag lengths to write either): the feature's ids and weights copied whole, then checked in
 * the copy. The first bad value by position is refused, an id before a weight at the same
 * position, as the element loop would. out[0] is already 0.
 */
static void fill_item_whole(struct step_item *it, const struct embd_kjt *kjt, const int64_t *offs,
			    uint64_t max_row, int64_t *ids, float *weights, int64_t *out)
{
	const uint32_t B = it->bsize;
	const uint64_t first = (uint64_t)offs[0], n = (uint64_t)(offs[B] - offs[0]);
	uint64_t bad_id = n, bad_weight = n;

	/* no ids: kjt->values may be NULL, and NULL + 0 is not a pointer C allows */
	if (n && copy_ids_below(ids, kjt->values + first, n, max_row))
		for (bad_id = 0; bad_id < n && (uint64_t)ids[bad_id] < max_row; bad_id++)
			;
	if (n && it->weighted && embd_copy_nonfinite(weights, kjt->weights + first, n))
		bad_weight = embd_first_nonfinite(weights, n);
	if (bad_id < n && bad_id <= bad_weight) {
		it->rc = EMBD_ERANGE;
		it->bad_at = (int64_t)(first + bad_id);
		it->bad_id = ids[bad_id];
		return;
	}
	if (bad_weight < n) {
		it->rc = EMBD_EINVAL;
		it->bad_at = (int64_t)(first + bad_weight);
		it->bad_weight = weights[bad_weight];
		return;
	}
	for (uint32_t i = 0; i < B; i++)
		out[i + 1] = offs[i + 1] - offs[0];
	it->num_ids = n;
}

/*
 * Copies an item's ids (and weights, for weighted batches) out of its trainer's shared batch,
 * reading each once and checking the value read; a row shard keeps the ids of its own rows.
 * A data_parallel item writes what it read into every replica's item of its (batch,
 * feature) too, so that replicas never train on different ids. Buffers no longer grow.
 */
static void fill_item(const struct embd_step *s, struct rank_io *io, struct step_item *it)
{
	const struct step_table *t = &s->tables[s->feature_tables[it->feature]];
	const struct embd_shard_desc *d = &s->shards[it->shard].desc;
	const struct embd_kjt *kjt = &s->pass->batches[it->batch].kjt;
	const uint32_t B = it->bsize;
	const int64_t *offs = trainer_offsets(s, it->batch) + (uint64_t)it->feature * B;
	const uint64_t max_row = (uint64_t)t->spec->num_embeddings;
	const bool split = row_split(t->type);
	const uint32_t max_dst = t->num_replicas > 1 ? t->num_shards : 1;
	struct step_item *dst[max_dst];
	int64_t *ids[max_dst], *out[max_dst];
	float *weights[max_dst];
	uint32_t m = 0;
	uint64_t n = 0;

	for (uint32_t k = 0; k < max_dst; k++) {
		const struct item_ref *ref = item_ref(s, it->batch, it->feature, k);
		struct rank_io *x_io = io;
		struct step_item *x = it;
		if (max_dst > 1) {
			if (ref->io == NO_IO)
				continue;
			x_io = &s->pass->io[ref->io];
			x = VEC_AT(x_io->items, struct step_item, ref->at);
		}
		dst[m] = x;
		ids[m] = VEC_AT(x_io->ids, int64_t, x->ids_at);
		weights[m] = VEC_AT(x_io->weights, float, x->ids_at);
		out[m] = VEC_AT(x_io->offsets, int64_t, x->offsets_at);
		out[m++][0] = 0;
	}
	if (m == 1 && !split) {
		fill_item_whole(it, kjt, offs, max_row, ids[0], weights[0], out[0]);
		return;
	}
	int32_t *lengths = it->lengths_at == NO_INDEX ? NULL :
			   VEC_AT(io->lengths, int32_t, it->lengths_at);
	for (uint32_t i = 0; i < B; i++) {
		for (int64_t j = offs[i]; j < offs[i + 1]; j++) {
			int64_t id = ((const volatile int64_t *)kjt->values)[j];
			if ((uint64_t)id >= max_row) {
				it->rc = EMBD_ERANGE;
				it->bad_at = j;
				it->bad_id = id;
				return;
			}
			if (split && (id < d->row_offset || id >= d->row_offset + d->rows))
				continue;
			float w = it->weighted ? ((const volatile float *)kjt->weights)[j] : 0.0f;
			/* the backward scales the bag's gradient by w into shared rows: a NaN or
			 * infinite weight would poison them for every trainer */
			if (!isfinite(w)) {
				it->rc = EMBD_EINVAL;
				it->bad_at = j;
				it->bad_weight = w;
				return;
			}
			for (uint32_t k = 0; k < m; k++) {
				if (it->weighted)
					weights[k][n] = w;
				ids[k][n] = id;
			}
			n++;
		}
		for (uint32_t k = 0; k < m; k++)
			out[k][i + 1] = (int64_t)n;
		if (lengths)
			lengths[i] = (int32_t)(offs[i + 1] - offs[i]);
	}
	for (uint32_t k = 0; k < m; k++)
		dst[k]->num_ids = n;
}

/* The items of one fill: io[i]'s next item to take is next[i]. */
struct fill_work {
	const struct embd_step *s;
	_Atomic uint64_t *next;                 /* num_io */
};

struct fill_rank_work {
	struct fill_work *w;
	uint32_t rank;
};

/* Takes items of io i off its counter until none is left (data_parallel copies are filled by
 * their first replica's item). */
static void fill_io(struct fill_work *w, uint32_t i)
{
	struct rank_io *io = &w->s->pass->io[i];

	for (uint64_t at; (at = atomic_fetch_add(&w->next[i], 1)) < io->items.len;) {
		struct step_item *it = VEC_AT(io->items, struct step_item, at);
		if (!it->copy)
			fill_item(w->s, io, it);
	}
}

/* A rank's workers fill its own items, then help with the items staged for other nodes. */
static void fill_worker(void *arg, uint32_t worker, uint32_t num_workers)
{
	struct fill_rank_work *rw = arg;

	(void)worker;
	(void)num_workers;
	fill_io(rw->w, rw->rank);
	for (uint32_t i = rw->w->s->num_ranks; i < rw->w->s->num_io; i++)
		fill_io(rw->w, i);
}

static void fill_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct fill_rank_work rw = { .w = arg, .rank = rank };

	embd_workers_run(exec->workers, fill_worker, &rw);
}

/*
 * After fill_rank: refuses each trainer with a bad id or weight, naming the first bad value of its batch
 * (as a serial read would), and drops its items from every io: their buffer room just stays
 * unused this step.
 */
static void refuse_bad_ids(struct embd_step *s)
{
	const struct step_item *first[s->pass->num_batches];

	memset(first, 0, sizeof(first));
	for (uint32_t r = 0; r < s->num_io; r++) {
		const struct rank_io *io = &s->pass->io[r];
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (it->rc && (!first[it->batch] || it->bad_at < first[it->batch]->bad_at))
				first[it->batch] = it;
		}
	}
	bool any = false;
	for (uint32_t i = 0; i < s->pass->num_batches; i++) {
		const struct step_item *it = first[i];
		if (!it)
			continue;
		const struct step_table *t = &s->tables[s->feature_tables[it->feature]];
		struct embd_step_batch *b = &s->pass->batches[i];
		b->status = it->rc;
		if (it->rc == EMBD_EINVAL)
			snprintf(b->err, sizeof(b->err), "weights[%lld]: %s weight of feature '%s' "
				 "(table '%s'); per-sample weights must be finite",
				 (long long)it->bad_at, isnan(it->bad_weight) ? "NaN" : "infinite",
				 s->names[it->feature], t->spec->name);
		else
			snprintf(b->err, sizeof(b->err), "values[%lld]: id %lld of feature '%s' outside "
				 "table '%s' rows [0, %llu)", (long long)it->bad_at,
				 (long long)it->bad_id, s->names[it->feature], t->spec->name,
				 (unsigned long long)t->spec->num_embeddings);
		any = true;
	}
	for (uint32_t r = 0; any && r < s->num_io; r++) {
		struct rank_io *io = &s->pass->io[r];
		uint64_t kept = 0;
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (!s->pass->batches[it->batch].status)
				*VEC_AT(io->items, struct step_item, kept++) = *it;
		}
		io->items.len = kept;
	}
}

/* Checks batch i and reserves its items; on a bad value rolls them back and sets its status. */
void step_route_batch(struct embd_step *s, uint32_t i)
{
	struct embd_step_batch *b = &s->pass->batches[i];
	uint64_t saved[s->num_io][5];
	int rc;

	b->err[0] = 0;
	for (uint32_t r = 0; r < s->num_io; r++) {
		struct rank_io *io = &s->pass->io[r];
		uint64_t v[5] = { io->offsets.len, io->ids.len, io->lengths.len, io->partial.len,
				  io->items.len };
		memcpy(saved[r], v, sizeof(v));
	}
	rc = check_batch(s, i, b);
	for (uint32_t f = 0; !rc && f < s->layout.num_features; f++)
		rc = route_feature(s, i, f, b);
	b->status = rc;
	if (!rc)
		return;
	if (rc == EMBD_ENOMEM)
		snprintf(b->err, sizeof(b->err), "out of memory routing the batch");
	for (uint32_t r = 0; r < s->num_io; r++) {
		struct rank_io *io = &s->pass->io[r];
		io->offsets.len = saved[r][0];
		io->ids.len = io->weights.len = saved[r][1];
		io->lengths.len = saved[r][2];
		io->partial.len = saved[r][3];
		io->items.len = saved[r][4];
	}
}

/* Every rank's workers copy the ids of the reserved items (route_feature), then the trainers
 * with a bad id are refused; returns the batches accepted here. */
uint32_t step_fill_batches(struct embd_step *s)
{
	_Atomic uint64_t next[s->num_io];
	struct fill_work w = { .s = s, .next = next };
	uint64_t items = 0;
	uint32_t accepted = 0;

	for (uint32_t r = 0; r < s->num_io; r++) {
		atomic_init(&next[r], 0);
		items += s->pass->io[r].items.len;
	}
	if (items) {
		embd_ranks_run(s->ranks, fill_rank, &w);
		refuse_bad_ids(s);
	}
	for (uint32_t i = 0; i < s->pass->num_batches; i++) {
		const struct embd_step_batch *b = &s->pass->batches[i];
		if (b->status)
			continue;
		accepted++;
		s->pass->counts.ids += b->kjt.num_values;
		s->pass->counts.input_bytes += (uint64_t)s->layout.num_features * b->kjt.batch_size * 4 +
					 b->kjt.num_values * (8 + (b->kjt.weights ? 4 : 0));
		s->pass->counts.output_bytes += (uint64_t)b->kjt.batch_size * s->layout.total_dim * 4;
	}
	return accepted;
}

int step_route_pass(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	step_pass_begin(s, batches, n);
	if (n > s->max_trainers)
		return EMBD_EINVAL;
	for (uint32_t i = 0; i < n; i++)
		step_route_batch(s, i);
	/* bad ids are known before the other nodes learn which batches this node accepted */
	s->pass->accepted = step_fill_batches(s);
	s->pass->cluster_accepted = s->pass->accepted;
	return (int)s->pass->accepted;
}

int embd_step_prepare(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	if (s->exchanged || s->pass != train_pass(s) || n > s->max_trainers)
		return EMBD_EINVAL;
	s->prepared = false;
	s->pass = &s->train[s->cur ^ 1];
	int rc = step_route_pass(s, batches, n);
	s->pass = train_pass(s);
	s->prepared = rc >= 0;
	return rc;
}
