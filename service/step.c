/*
 * The step engine (service/step.h). Routing turns every (trainer, feature, shard) into one
 * "item": a bag batch in its rank's private input buffer. Items are the unit of everything
 * after routing: a rank's lookup is one kernel call over its forward items, its backward one
 * call per shard over that shard's items, and the future all-to-all would ship exactly the
 * items of remote ranks. Routing runs in two halves: on the event-loop thread each trainer's
 * lengths are checked into private offsets and its items' room is reserved (a refused trainer
 * is rolled back by truncating the per-rank buffers); then every rank, in parallel and on its
 * own workers, copies the ids of its items out of the (shared, untrusted) batches, checking
 * each value it read, so the bulk copy costs no serial time. A bad id refuses its trainer: its
 * items are then dropped from every rank.
 */
#include <stdatomic.h>
#include "service/step.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/device.h"
#include "kernels/jagged.h"

#define NO_INDEX UINT64_MAX

struct step_shard {
	struct embd_shard *shard;
	uint32_t table;
	uint32_t rank;
};

struct step_table {
	const struct embd_table_spec *spec;
	enum embd_sharding_type type;
	uint32_t first_shard, num_shards;       /* into step->shards, in the plan's order */
	uint32_t num_replicas;                  /* data_parallel: = num_shards; else 1 */
};

struct step_item {
	uint32_t shard, feature, trainer;
	bool forward;                           /* data_parallel: only the trainer's replica */
	bool weighted;
	uint64_t offsets_at, ids_at, num_ids;
	uint64_t lengths_at;                    /* full bag lengths (row-split mean) or NO_INDEX */
	uint64_t partial_at;                    /* row-split partial sums or NO_INDEX (direct) */
	int rc;                                 /* fill_item: EMBD_ERANGE for bad_id at bad_at */
	int64_t bad_at, bad_id;
};

/* A growable array of elements of one type; len/cap in elements. */
struct vec {
	void *p;
	uint64_t len, cap;
};

/* One rank's explicit input (ids to look up) and output (partial sums) buffers. */
struct rank_io {
	struct vec offsets, ids, weights, lengths, partial, items, batches;
	uint32_t *shards;                       /* indices into step->shards on this rank */
	uint32_t num_shards;
	int rc;
	struct embd_kernel_err kerr;
};

struct embd_step {
	uint32_t num_tables, num_shards, num_ranks, max_trainers;
	struct step_table *tables;
	struct step_shard *shards;
	struct embd_ranks *ranks;
	struct rank_io *io;
	struct embd_step_layout layout;
	char (*names)[EMBD_NAME_MAX];
	uint32_t *dims, *offsets, *feature_tables;
	int64_t *scratch_offsets;               /* max_trainers x (F * B + 1): private offsets */
	uint64_t seed;
	/* the step in flight */
	struct embd_step_batch *batches;
	uint32_t num_batches;
	bool pending;
	struct embd_step_counts counts;
};

static int vec_reserve(struct vec *v, uint64_t extra, size_t elem)
{
	/* allocated even for 0 elements, so that every item's pointers are valid */
	if (v->p && v->len + extra <= v->cap)
		return 0;
	uint64_t cap = v->cap ? v->cap : 256;
	while (cap < v->len + extra)
		cap *= 2;
	void *p = realloc(v->p, cap * elem);
	if (!p)
		return EMBD_ENOMEM;
	v->p = p;
	v->cap = cap;
	return 0;
}

/* Reserves n elements at the end and returns their index. */
static int vec_take(struct vec *v, uint64_t n, size_t elem, uint64_t *at)
{
	int rc = vec_reserve(v, n, elem);
	if (rc)
		return rc;
	*at = v->len;
	v->len += n;
	return 0;
}

static void vec_free(struct vec *v)
{
	free(v->p);
	*v = (struct vec){ 0 };
}

#define VEC_AT(v, type, i) (&((type *)(v).p)[i])

static bool row_split(enum embd_sharding_type t)
{
	return t == EMBD_SHARD_ROW_WISE || t == EMBD_SHARD_TABLE_ROW_WISE;
}

/* ---- creation ---------------------------------------------------------------------------- */

static void init_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct rank_io *io = &s->io[rank];

	for (uint32_t i = 0; i < io->num_shards; i++)
		embd_shard_init_weights(s->shards[io->shards[i]].shard, s->seed, exec);
}

static int build_layout(struct embd_step *s, const struct embd_tables *tables,
			uint32_t batch_size)
{
	uint32_t f = 0, col = 0;
	uint64_t max_values = 0;

	for (uint32_t t = 0; t < tables->count; t++)
		f += tables->specs[t].num_features;
	s->names = calloc(f ? f : 1, sizeof(*s->names));
	s->dims = calloc(f ? f : 1, sizeof(uint32_t));
	s->offsets = calloc(f ? f : 1, sizeof(uint32_t));
	s->feature_tables = calloc(f ? f : 1, sizeof(uint32_t));
	s->scratch_offsets = calloc((uint64_t)s->max_trainers * ((uint64_t)f * batch_size + 1),
				    sizeof(int64_t));
	if (!s->names || !s->dims || !s->offsets || !s->feature_tables || !s->scratch_offsets)
		return EMBD_ENOMEM;
	f = 0;
	for (uint32_t t = 0; t < tables->count; t++) {
		const struct embd_table_spec *spec = &tables->specs[t];
		const struct embd_table_constraints *c = &tables->constraints[t];
		for (uint32_t k = 0; k < spec->num_features; k++, f++) {
			memcpy(s->names[f], spec->feature_names[k], EMBD_NAME_MAX);
			s->dims[f] = (uint32_t)spec->embedding_dim;
			s->offsets[f] = col;
			s->feature_tables[f] = t;
			col += (uint32_t)spec->embedding_dim;
			/* room for 8x the planned pooling factor, and never under 64 ids a bag */
			double pf = k < c->num_pooling_factors ? c->pooling_factors[k] : 1.0;
			uint64_t per_bag = (uint64_t)(pf * 8.0) + 1;
			max_values += (uint64_t)batch_size * (per_bag > 64 ? per_bag : 64);
		}
	}
	s->layout = (struct embd_step_layout){
		.num_features = f, .batch_size = batch_size, .total_dim = col,
		.max_values = max_values, .feature_names = (const char (*)[EMBD_NAME_MAX])s->names,
		.feature_dims = s->dims, .feature_offsets = s->offsets,
		.feature_tables = s->feature_tables,
	};
	return 0;
}

static int place_shards(struct embd_step *s, const struct embd_tables *tables,
			const struct embd_plan *plan, char *err, size_t err_len)
{
	uint32_t n = 0;
	int rc;

	for (uint32_t t = 0; t < tables->count; t++) {
		const struct embd_plan_table *pt = NULL;
		for (uint32_t p = 0; p < plan->num_tables && !pt; p++)
			if (!strcmp(plan->tables[p].name, tables->specs[t].name))
				pt = &plan->tables[p];
		if (!pt || !pt->num_shards) {
			snprintf(err, err_len, "table %u '%s': not in the plan", t, tables->specs[t].name);
			return EMBD_ENOENT;
		}
		s->tables[t] = (struct step_table){
			.spec = &tables->specs[t], .type = pt->sharding_type, .first_shard = n,
			.num_shards = pt->num_shards,
			.num_replicas = pt->sharding_type == EMBD_SHARD_DATA_PARALLEL ? pt->num_shards : 1,
		};
		n += pt->num_shards;
	}
	s->num_shards = n;
	s->shards = calloc(n ? n : 1, sizeof(*s->shards));
	for (uint32_t r = 0; r < s->num_ranks; r++)
		s->io[r].shards = calloc(n ? n : 1, sizeof(uint32_t));
	if (!s->shards)
		return EMBD_ENOMEM;
	for (uint32_t r = 0; r < s->num_ranks; r++)
		if (!s->io[r].shards)
			return EMBD_ENOMEM;
	for (uint32_t t = 0; t < tables->count; t++) {
		const struct embd_table_spec *spec = &tables->specs[t];
		const struct embd_plan_table *pt = NULL;
		for (uint32_t p = 0; p < plan->num_tables && !pt; p++)
			if (!strcmp(plan->tables[p].name, spec->name))
				pt = &plan->tables[p];
		for (uint32_t k = 0; k < pt->num_shards; k++) {
			const struct embd_plan_shard *ps = &pt->shards[k];
			struct step_shard *ss = &s->shards[s->tables[t].first_shard + k];
			if (ps->rank < 0 || (uint32_t)ps->rank >= s->num_ranks || ps->col_offset < 0 ||
			    ps->cols <= 0) {
				snprintf(err, err_len, "table '%s' shard %u: rank %d or columns [%d, +%d) "
					 "outside this node's %u ranks and the table", spec->name, k,
					 ps->rank, ps->col_offset, ps->cols, s->num_ranks);
				return EMBD_EINVAL;
			}
			struct embd_shard_desc d = {
				.table_id = t, .num_embeddings = spec->num_embeddings,
				.embedding_dim = (uint32_t)spec->embedding_dim, .dtype = spec->data_type,
				.row_offset = ps->row_offset, .rows = ps->rows,
				.col_offset = (uint32_t)ps->col_offset, .cols = (uint32_t)ps->cols,
				.optimizer = spec->optimizer,
			};
			char inner[192];
			rc = embd_ranks_alloc_shard(s->ranks, (uint32_t)ps->rank, &d, &ss->shard, inner,
						    sizeof(inner));
			if (rc) {
				snprintf(err, err_len, "table '%s' shard %u: %s", spec->name, k, inner);
				return rc;
			}
			ss->table = t;
			ss->rank = (uint32_t)ps->rank;
			struct rank_io *io = &s->io[ss->rank];
			io->shards[io->num_shards++] = s->tables[t].first_shard + k;
		}
	}
	return 0;
}

int embd_step_create(const struct embd_tables *tables, const struct embd_plan *plan,
		     struct embd_ranks *ranks, uint64_t seed, uint32_t max_trainers,
		     struct embd_step **out, char *err, size_t err_len)
{
	struct embd_step *s;
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!max_trainers || !plan->topology.batch_size) {
		snprintf(err, err_len, "max_trainers %u and batch_size %u must be at least 1",
			 max_trainers, plan->topology.batch_size);
		return EMBD_EINVAL;
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return EMBD_ENOMEM;
	s->ranks = ranks;
	s->seed = seed;
	s->max_trainers = max_trainers;
	s->num_ranks = embd_ranks_count(ranks);
	s->num_tables = tables->count;
	s->tables = calloc(tables->count ? tables->count : 1, sizeof(*s->tables));
	s->io = calloc(s->num_ranks, sizeof(*s->io));
	if (!s->tables || !s->io)
		goto out;
	rc = build_layout(s, tables, plan->topology.batch_size);
	if (rc)
		goto out;
	rc = place_shards(s, tables, plan, err, err_len);
	if (rc)
		goto out;
	embd_ranks_run(ranks, init_rank, s);
	*out = s;
	return 0;
out:
	if (rc == EMBD_ENOMEM)
		snprintf(err, err_len, "out of memory creating the step engine");
	embd_step_destroy(s);
	return rc;
}

void embd_step_destroy(struct embd_step *s)
{
	if (!s)
		return;
	for (uint32_t i = 0; s->shards && i < s->num_shards; i++)
		if (s->shards[i].shard)
			embd_ranks_free_shard(s->ranks, s->shards[i].shard);
	for (uint32_t r = 0; s->io && r < s->num_ranks; r++) {
		struct rank_io *io = &s->io[r];
		struct vec *vs[] = { &io->offsets, &io->ids, &io->weights, &io->lengths,
				     &io->partial, &io->items, &io->batches };
		for (size_t i = 0; i < sizeof(vs) / sizeof(vs[0]); i++)
			vec_free(vs[i]);
		free(io->shards);
	}
	free(s->io);
	free(s->shards);
	free(s->tables);
	free(s->names);
	free(s->dims);
	free(s->offsets);
	free(s->feature_tables);
	free(s->scratch_offsets);
	free(s);
}

const struct embd_step_layout *embd_step_layout(const struct embd_step *s)
{
	return &s->layout;
}

/* ---- routing ----------------------------------------------------------------------------- */

/* Trainer i's private offsets: F * B + 1, feature-major (check_batch writes them). */
static int64_t *trainer_offsets(const struct embd_step *s, uint32_t trainer)
{
	const uint64_t FB = (uint64_t)s->layout.num_features * s->layout.batch_size;

	return &s->scratch_offsets[trainer * (FB + 1)];
}

/* Checks what can be checked without reading ids, and fills the trainer's offsets. */
static int check_batch(struct embd_step *s, uint32_t trainer, struct embd_step_batch *b)
{
	const struct embd_kjt *k = &b->kjt;
	const struct embd_step_layout *l = &s->layout;

	if (k->num_features != l->num_features) {
		snprintf(b->err, sizeof(b->err), "num_features: %u, the layout has %u",
			 k->num_features, l->num_features);
		return EMBD_EINVAL;
	}
	if (k->batch_size != l->batch_size) {
		snprintf(b->err, sizeof(b->err), "batch_size: %u, the layout's is %u", k->batch_size,
			 l->batch_size);
		return EMBD_EINVAL;
	}
	if (k->num_values > l->max_values) {
		snprintf(b->err, sizeof(b->err), "num_values: %llu, at most %llu",
			 (unsigned long long)k->num_values, (unsigned long long)l->max_values);
		return EMBD_ERANGE;
	}
	if ((!k->lengths && l->num_features && l->batch_size) || (!k->values && k->num_values) ||
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
	int rc = embd_jagged_offsets(k->lengths, (uint64_t)l->num_features * l->batch_size,
				     k->num_values, trainer_offsets(s, trainer), inner, sizeof(inner));
	if (rc)
		snprintf(b->err, sizeof(b->err), "lengths: %s", inner);
	return rc;
}

/* Reserves the items of one (trainer, feature) on every shard of its table: offsets, room for
 * all n ids of the feature (a row shard fills only its part), and for row-split tables the
 * partial sums (and, for mean, the full bag lengths). fill_item copies the ids later. */
static int route_feature(struct embd_step *s, uint32_t trainer, uint32_t f,
			 struct embd_step_batch *b)
{
	const struct step_table *t = &s->tables[s->feature_tables[f]];
	const uint32_t B = s->layout.batch_size;
	const int64_t *offs = trainer_offsets(s, trainer) + (uint64_t)f * B;
	const uint64_t n = (uint64_t)(offs[B] - offs[0]);
	const bool split = row_split(t->type);
	const bool mean = t->spec->pooling == EMBD_POOLING_MEAN;
	int rc;

	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		struct rank_io *io = &s->io[ss->rank];
		uint64_t item_at;
		struct step_item it = {
			.shard = t->first_shard + k, .feature = f, .trainer = trainer,
			.forward = t->num_replicas == 1 || k == trainer % t->num_replicas,
			.weighted = b->kjt.weights != NULL,
			.lengths_at = NO_INDEX, .partial_at = NO_INDEX,
		};
		if ((rc = vec_take(&io->offsets, B + 1, sizeof(int64_t), &it.offsets_at)) ||
		    (rc = vec_take(&io->ids, n, sizeof(int64_t), &it.ids_at)) ||
		    (rc = vec_reserve(&io->weights, n, sizeof(float))) ||
		    (split && mean && (rc = vec_take(&io->lengths, B, sizeof(int32_t), &it.lengths_at))) ||
		    (split && (rc = vec_take(&io->partial, (uint64_t)B * ss->shard->desc.cols,
					      sizeof(float), &it.partial_at))) ||
		    (rc = vec_take(&io->items, 1, sizeof(it), &item_at)))
			return rc;
		io->weights.len = io->ids.len;
		*VEC_AT(io->items, struct step_item, item_at) = it;
		if (split && mean)
			for (uint32_t i = 0; i < B; i++)
				*VEC_AT(io->lengths, int32_t, it.lengths_at + i) =
					(int32_t)(offs[i + 1] - offs[i]);
	}
	return 0;
}

/* Copies an item's ids (and weights) out of its trainer's shared batch, reading each once and
 * checking the value read; a row shard keeps the ids of its rows. Buffers no longer grow. */
static void fill_item(const struct embd_step *s, struct rank_io *io, struct step_item *it)
{
	const struct step_table *t = &s->tables[s->feature_tables[it->feature]];
	const struct embd_shard_desc *d = &s->shards[it->shard].shard->desc;
	const struct embd_kjt *kjt = &s->batches[it->trainer].kjt;
	const uint32_t B = s->layout.batch_size;
	const int64_t *offs = trainer_offsets(s, it->trainer) + (uint64_t)it->feature * B;
	const uint64_t max_row = (uint64_t)t->spec->num_embeddings;
	const bool split = row_split(t->type);
	int64_t *ids = VEC_AT(io->ids, int64_t, it->ids_at);
	float *weights = VEC_AT(io->weights, float, it->ids_at);
	int64_t *out = VEC_AT(io->offsets, int64_t, it->offsets_at);
	uint64_t n = 0;

	out[0] = 0;
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
			if (it->weighted)
				weights[n] = ((const volatile float *)kjt->weights)[j];
			ids[n++] = id;
		}
		out[i + 1] = (int64_t)n;
	}
	it->num_ids = n;
}

struct fill_work {
	const struct embd_step *s;
	struct rank_io *io;
	_Atomic uint64_t next;                  /* the next item to take */
};

static void fill_worker(void *arg, uint32_t worker, uint32_t num_workers)
{
	struct fill_work *w = arg;

	(void)worker;
	(void)num_workers;
	for (uint64_t i; (i = atomic_fetch_add(&w->next, 1)) < w->io->items.len;)
		fill_item(w->s, w->io, VEC_AT(w->io->items, struct step_item, i));
}

/* A rank fills its items on its own workers, one item per worker at a time. */
static void fill_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct fill_work w = { .s = s, .io = &s->io[rank] };

	atomic_init(&w.next, 0);
	if (w.io->items.len)
		embd_workers_run(exec->workers, fill_worker, &w);
}

/* After fill_rank: refuses each trainer with a bad id (naming the first one found) and drops
 * its items from every rank (their buffer room just stays unused this step). */
static void refuse_bad_ids(struct embd_step *s)
{
	for (uint32_t r = 0; r < s->num_ranks; r++) {
		struct rank_io *io = &s->io[r];
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			struct embd_step_batch *b = &s->batches[it->trainer];
			const struct step_table *t = &s->tables[s->feature_tables[it->feature]];
			if (!it->rc || b->status)
				continue;
			b->status = it->rc;
			snprintf(b->err, sizeof(b->err),
				 "values[%lld]: id %lld of feature '%s' outside table '%s' rows "
				 "[0, %llu)", (long long)it->bad_at, (long long)it->bad_id,
				 s->names[it->feature], t->spec->name,
				 (unsigned long long)t->spec->num_embeddings);
		}
	}
	for (uint32_t r = 0; r < s->num_ranks; r++) {
		struct rank_io *io = &s->io[r];
		uint64_t kept = 0;
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (!s->batches[it->trainer].status)
				*VEC_AT(io->items, struct step_item, kept++) = *it;
		}
		io->items.len = kept;
	}
}

static int compare_items(const void *a, const void *b)
{
	const struct step_item *x = a, *y = b;
	if (x->shard != y->shard)
		return x->shard < y->shard ? -1 : 1;
	if (x->feature != y->feature)
		return x->feature < y->feature ? -1 : 1;
	return x->trainer < y->trainer ? -1 : x->trainer > y->trainer;
}

/* Turns a rank's items into kernel bag batches (pointers fixed now that buffers stopped
 * growing); grad selects the backward view of the same items. */
static int make_batches(struct embd_step *s, struct rank_io *io, bool grad)
{
	uint64_t n = io->items.len;
	int rc = vec_reserve(&io->batches, n, sizeof(struct embd_bag_batch));

	if (rc)
		return rc;
	for (uint64_t i = 0; i < n; i++) {
		const struct step_item *it = VEC_AT(io->items, struct step_item, i);
		const struct step_shard *ss = &s->shards[it->shard];
		const struct embd_step_batch *tb = &s->batches[it->trainer];
		const struct step_table *t = &s->tables[ss->table];
		struct embd_bag_batch *bb = VEC_AT(io->batches, struct embd_bag_batch, i);
		bool direct = grad || it->partial_at == NO_INDEX;
		*bb = (struct embd_bag_batch){
			.shard = ss->shard, .feature = it->feature, .batch_size = s->layout.batch_size,
			.offsets = VEC_AT(io->offsets, int64_t, it->offsets_at),
			.ids = VEC_AT(io->ids, int64_t, it->ids_at),
			.weights = it->weighted ? VEC_AT(io->weights, float, it->ids_at) : NULL,
			.num_ids = it->num_ids, .pooling = t->spec->pooling,
			.mean_lengths = it->lengths_at == NO_INDEX ? NULL :
					VEC_AT(io->lengths, int32_t, it->lengths_at),
			.pooled_stride = direct ? s->layout.total_dim : ss->shard->desc.cols,
			.pooled_col = direct ? s->offsets[it->feature] + ss->shard->desc.col_offset : 0,
		};
		if (grad)
			bb->pooled_grad = tb->pooled_grad;
		else
			bb->pooled = direct ? tb->pooled : VEC_AT(io->partial, float, it->partial_at);
	}
	io->batches.len = n;
	return 0;
}

/* ---- lookup, assembly, backward ---------------------------------------------------------- */

static void lookup_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct rank_io *io = &s->io[rank];
	struct embd_bag_batch *all = io->batches.p;
	uint64_t n = 0;

	/* forward items first: data_parallel's other replicas only train */
	for (uint64_t i = 0; i < io->items.len; i++)
		if (VEC_AT(io->items, struct step_item, i)->forward)
			all[n++] = all[i];
	io->rc = n ? embd_kernels_forward(exec, all, (uint32_t)n, &io->kerr) : 0;
}

static void backward_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct rank_io *io = &s->io[rank];
	struct embd_bag_batch *all = io->batches.p;
	uint64_t i = 0;

	io->rc = 0;
	/* items are sorted by shard; every shard of the rank steps once, even untouched */
	for (uint32_t k = 0; k < io->num_shards && !io->rc; k++) {
		uint32_t shard = io->shards[k];
		uint64_t first = i;
		while (i < io->items.len && VEC_AT(io->items, struct step_item, i)->shard == shard)
			i++;
		io->rc = embd_kernels_backward(exec, s->shards[shard].shard, all + first,
					       (uint32_t)(i - first), &io->kerr);
	}
}

/* Row-split tables: out = sum of the partials of their row shards, in shard order. */
static void assemble(struct embd_step *s)
{
	const uint32_t B = s->layout.batch_size, D = s->layout.total_dim;

	for (uint32_t i = 0; i < s->num_batches; i++) {
		if (s->batches[i].status)
			continue;
		for (uint32_t f = 0; f < s->layout.num_features; f++)
			if (row_split(s->tables[s->feature_tables[f]].type))
				for (uint32_t b = 0; b < B; b++)
					memset(&s->batches[i].pooled[(uint64_t)b * D + s->offsets[f]], 0,
					       sizeof(float) * s->dims[f]);
	}
	for (uint32_t r = 0; r < s->num_ranks; r++) {
		struct rank_io *io = &s->io[r];
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (it->partial_at == NO_INDEX)
				continue;
			const struct embd_shard_desc *d = &s->shards[it->shard].shard->desc;
			const float *src = VEC_AT(io->partial, float, it->partial_at);
			float *dst = s->batches[it->trainer].pooled + s->offsets[it->feature] +
				     d->col_offset;
			for (uint32_t b = 0; b < B; b++)
				for (uint32_t c = 0; c < d->cols; c++)
					dst[(uint64_t)b * D + c] += src[(uint64_t)b * d->cols + c];
		}
	}
}

static void reset_io(struct embd_step *s)
{
	for (uint32_t r = 0; r < s->num_ranks; r++) {
		struct rank_io *io = &s->io[r];
		io->offsets.len = io->ids.len = io->weights.len = io->lengths.len = 0;
		io->partial.len = io->items.len = io->batches.len = 0;
	}
}

static int fail_step(struct embd_step *s, int rc, const char *what, uint32_t rank)
{
	for (uint32_t i = 0; i < s->num_batches; i++)
		if (!s->batches[i].status) {
			s->batches[i].status = rc;
			snprintf(s->batches[i].err, sizeof(s->batches[i].err), "%s on rank %u: %.150s",
				 what, rank, s->io[rank].kerr.msg);
		}
	s->pending = false;
	return rc;
}

int embd_step_forward(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	uint64_t saved[s->num_ranks][5];
	uint32_t routed = 0;
	int accepted = 0, rc;

	s->pending = false;
	s->batches = batches;
	s->num_batches = n;
	s->counts = (struct embd_step_counts){ 0 };
	reset_io(s);
	if (n > s->max_trainers)
		return EMBD_EINVAL;
	for (uint32_t i = 0; i < n; i++) {
		struct embd_step_batch *b = &batches[i];
		b->err[0] = 0;
		for (uint32_t r = 0; r < s->num_ranks; r++) {
			struct rank_io *io = &s->io[r];
			uint64_t v[5] = { io->offsets.len, io->ids.len, io->lengths.len,
					  io->partial.len, io->items.len };
			memcpy(saved[r], v, sizeof(v));
		}
		rc = check_batch(s, i, b);
		for (uint32_t f = 0; !rc && f < s->layout.num_features; f++)
			rc = route_feature(s, i, f, b);
		b->status = rc;
		if (!rc) {
			routed++;
			continue;
		}
		if (rc == EMBD_ENOMEM)
			snprintf(b->err, sizeof(b->err), "out of memory routing the batch");
		/* roll the refused trainer's items back */
		for (uint32_t r = 0; r < s->num_ranks; r++) {
			struct rank_io *io = &s->io[r];
			io->offsets.len = saved[r][0];
			io->ids.len = io->weights.len = saved[r][1];
			io->lengths.len = saved[r][2];
			io->partial.len = saved[r][3];
			io->items.len = saved[r][4];
		}
	}
	if (!routed)
		return 0;
	embd_ranks_run(s->ranks, fill_rank, s);
	refuse_bad_ids(s);
	for (uint32_t i = 0; i < n; i++) {
		const struct embd_step_batch *b = &batches[i];
		if (b->status)
			continue;
		accepted++;
		s->counts.ids += b->kjt.num_values;
		s->counts.input_bytes += (uint64_t)s->layout.num_features * s->layout.batch_size * 4 +
					 b->kjt.num_values * (8 + (b->kjt.weights ? 4 : 0));
		s->counts.output_bytes += (uint64_t)s->layout.batch_size * s->layout.total_dim * 4;
	}
	if (!accepted)
		return 0;
	for (uint32_t r = 0; r < s->num_ranks; r++) {
		struct rank_io *io = &s->io[r];
		if (io->items.len) /* a rank may hold no shard */
			qsort(io->items.p, io->items.len, sizeof(struct step_item), compare_items);
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (it->forward)
				s->counts.lookups += it->num_ids;
		}
		if (make_batches(s, io, false))
			return fail_step(s, EMBD_ENOMEM, "lookup", r);
	}
	embd_ranks_run(s->ranks, lookup_rank, s);
	for (uint32_t r = 0; r < s->num_ranks; r++)
		if (s->io[r].rc)
			return fail_step(s, s->io[r].rc, "lookup", r);
	assemble(s);
	s->pending = true;
	return accepted;
}

int embd_step_backward(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	if (!s->pending || batches != s->batches || n != s->num_batches)
		return EMBD_EINVAL;
	s->pending = false;
	for (uint32_t i = 0; i < n; i++)
		if (!batches[i].status && !batches[i].pooled_grad) {
			snprintf(batches[i].err, sizeof(batches[i].err), "pooled_grad: missing");
			return EMBD_EINVAL;
		}
	for (uint32_t r = 0; r < s->num_ranks; r++)
		if (make_batches(s, &s->io[r], true))
			return fail_step(s, EMBD_ENOMEM, "backward", r);
	embd_ranks_run(s->ranks, backward_rank, s);
	for (uint32_t r = 0; r < s->num_ranks; r++)
		if (s->io[r].rc)
			return fail_step(s, s->io[r].rc, "backward", r);
	return 0;
}

void embd_step_abort(struct embd_step *s)
{
	s->pending = false;
	reset_io(s);
}

void embd_step_counts(const struct embd_step *s, struct embd_step_counts *out)
{
	*out = s->counts;
}

int embd_step_read_weight(const struct embd_step *s, uint32_t table, int64_t row, uint32_t col,
			  uint32_t replica, float *out)
{
	if (table >= s->num_tables)
		return EMBD_ENOENT;
	const struct step_table *t = &s->tables[table];
	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		const struct embd_shard_desc *d = &ss->shard->desc;
		if (t->num_replicas > 1 && ss->rank != replica)
			continue;
		if (row < d->row_offset || row >= d->row_offset + d->rows || col < d->col_offset ||
		    col >= d->col_offset + d->cols)
			continue;
		uint64_t i = (uint64_t)(row - d->row_offset) * d->cols + (col - d->col_offset);
		*out = d->dtype == EMBD_DTYPE_FP16 ? embd_fp16_to_fp32(((uint16_t *)ss->shard->weights)[i])
						   : ((float *)ss->shard->weights)[i];
		return 0;
	}
	return EMBD_ENOENT;
}
