/*
 * The step engine (engine/step.h). Routing turns every (trainer, feature, shard) into one
 * "item": a bag batch in its rank's private input buffer. Items are the unit of everything
 * after routing: a rank's lookup is one kernel call over its forward items, its backward one
 * call per shard over that shard's items, and the input exchange (step_dist.c) ships exactly
 * the items staged for other nodes. Routing (step_route.c) makes the items; this file creates
 * the engine and runs lookup, assembly and backward over them.
 */
#include "engine/step.h"
#include "engine/step_internal.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/device.h"
#include "kernels/finite.h"

/* v's memory moved to a page-aligned allocation of cap elements, registered for DMA. */
static int dma_grow(struct vec *v, uint64_t cap, size_t elem)
{
	bool registered;
	void *p = embd_ranks_dma_alloc(v->dma, cap * elem, &registered,
				       "a step engine array the ranks copy");

	if (!p)
		return EMBD_ENOMEM;
	if (v->p)
		memcpy(p, v->p, v->len * elem);
	embd_ranks_dma_free(v->dma, v->p, v->registered);
	v->p = p;
	v->cap = cap;
	v->registered = registered;
	return 0;
}

int vec_reserve(struct vec *v, uint64_t extra, size_t elem)
{
	/* allocated even for 0 elements, so that every item's pointers are valid */
	if (v->p && v->len + extra <= v->cap)
		return 0;
	uint64_t cap = v->cap ? v->cap : 256;
	while (cap < v->len + extra)
		cap *= 2;
	if (v->dma)
		return dma_grow(v, cap, elem);
	void *p = realloc(v->p, cap * elem);
	if (!p)
		return EMBD_ENOMEM;
	v->p = p;
	v->cap = cap;
	return 0;
}

/* Reserves n elements at the end and returns their index. */
int vec_take(struct vec *v, uint64_t n, size_t elem, uint64_t *at)
{
	int rc = vec_reserve(v, n, elem);
	if (rc)
		return rc;
	*at = v->len;
	v->len += n;
	return 0;
}

void vec_free(struct vec *v)
{
	if (v->dma)
		embd_ranks_dma_free(v->dma, v->p, v->registered);
	else
		free(v->p);
	*v = (struct vec){ .dma = v->dma };
}


/* ---- creation ---------------------------------------------------------------------------- */

static void init_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct rank_shards *rs = &s->rank_shards[rank];

	/* the host view, on this rank's thread (first touch on its node), then the device's */
	for (uint32_t i = 0; i < rs->num_shards; i++) {
		const struct step_shard *ss = &s->shards[rs->shards[i]];
		embd_shard_init_weights(ss->host, s->seed, exec);
		embd_ranks_shard_changed(s->ranks, ss->shard);
	}
	for (uint32_t i = 0; i < rs->num_shards && !rs->init_rc; i++)
		rs->init_rc = embd_ranks_shard_push(s->ranks, s->shards[rs->shards[i]].shard,
						    rs->init_err, sizeof(rs->init_err));
}

/* Initialises every shard on its rank; the first failure in err. */
static int init_shards(struct embd_step *s, char *err, size_t err_len)
{
	embd_ranks_run(s->ranks, init_rank, s);
	for (uint32_t r = 0; r < s->num_ranks; r++)
		if (s->rank_shards[r].init_rc) {
			snprintf(err, err_len, "rank %u: initialising its shards: %s", r,
				 s->rank_shards[r].init_err);
			return s->rank_shards[r].init_rc;
		}
	return 0;
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
	if (!s->names || !s->dims || !s->offsets || !s->feature_tables)
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

static const struct embd_plan_table *plan_table(const struct embd_plan *plan, const char *name)
{
	for (uint32_t p = 0; p < plan->num_tables; p++)
		if (!strcmp(plan->tables[p].name, name))
			return &plan->tables[p];
	return NULL;
}

/*
 * Whether t's shards on this node share one prep of their occurrences (step_internal.h):
 * column shards see the same bags, and the kernels' occurrences depend only on the bags and
 * the rows. If so, t->prep_rank is the rank holding one of them with the fewest preps so far
 * (preps: per rank), so the preps spread over the ranks and are read where they were made.
 */
static void plan_shared_prep(const struct embd_step *s, struct step_table *t, uint32_t *preps)
{
	const struct step_shard *first = NULL;

	t->shares_prep = false;
	if ((t->type != EMBD_SHARD_COLUMN_WISE && t->type != EMBD_SHARD_TABLE_COLUMN_WISE) ||
	    t->num_local < 2)
		return;
	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		if (!ss->shard)
			continue;
		if (!embd_ranks_backward_shares(s->ranks, ss->shard))
			return;
		if (!first) {
			first = ss;
			t->prep_rank = ss->local;
		} else if (ss->desc.row_offset != first->desc.row_offset ||
			   ss->desc.rows != first->desc.rows)
			return;
		if (preps[ss->local] < preps[t->prep_rank])
			t->prep_rank = ss->local;
	}
	preps[t->prep_rank]++;
	t->shares_prep = true;
}

/* After place_shards: which tables share a prep, and on which rank. */
static int plan_shared_preps(struct embd_step *s)
{
	uint32_t *preps = calloc(s->num_ranks, sizeof(*preps));

	if (!preps)
		return EMBD_ENOMEM;
	for (uint32_t t = 0; t < s->num_tables; t++)
		plan_shared_prep(s, &s->tables[t], preps);
	free(preps);
	return 0;
}

static int place_shards(struct embd_step *s, const struct embd_tables *tables,
			const struct embd_plan *plan, char *err, size_t err_len)
{
	const uint32_t L = s->num_ranks, world = L * s->num_nodes;
	uint32_t n = 0;
	int rc;

	for (uint32_t t = 0; t < tables->count; t++) {
		const struct embd_plan_table *pt = plan_table(plan, tables->specs[t].name);
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
		if (pt->num_shards > s->max_table_shards)
			s->max_table_shards = pt->num_shards;
	}
	s->num_shards = n;
	s->shards = calloc(n ? n : 1, sizeof(*s->shards));
	s->wire_tables = calloc(tables->count ? tables->count : 1, sizeof(*s->wire_tables));
	s->wire_shards = calloc(n ? n : 1, sizeof(*s->wire_shards));
	s->preps = calloc(tables->count ? tables->count : 1, sizeof(*s->preps));
	s->spans = calloc(n ? n : 1, sizeof(*s->spans));
	for (uint32_t r = 0; r < s->num_ranks; r++)
		s->rank_shards[r].shards = calloc(n ? n : 1, sizeof(uint32_t));
	if (!s->shards || !s->wire_tables || !s->wire_shards || !s->preps || !s->spans)
		return EMBD_ENOMEM;
	s->wire = (struct step_wire_plan){
		.node = s->node, .batch_size = s->layout.batch_size, .num_tables = tables->count,
		.num_shards = n, .num_features = s->layout.num_features, .tables = s->wire_tables,
		.shards = s->wire_shards, .feature_tables = s->feature_tables,
	};
	for (uint32_t r = 0; r < s->num_ranks; r++)
		if (!s->rank_shards[r].shards)
			return EMBD_ENOMEM;
	for (uint32_t t = 0; t < tables->count; t++) {
		const struct embd_table_spec *spec = &tables->specs[t];
		const struct embd_plan_table *pt = plan_table(plan, spec->name);
		s->wire_tables[t] = (struct step_wire_table){ .type = pt->sharding_type,
							     .pooling = spec->pooling };
		for (uint32_t k = 0; k < pt->num_shards; k++) {
			const struct embd_plan_shard *ps = &pt->shards[k];
			struct step_shard *ss = &s->shards[s->tables[t].first_shard + k];
			if (ps->rank < 0 || (uint32_t)ps->rank >= world || ps->col_offset < 0 ||
			    ps->cols <= 0) {
				snprintf(err, err_len, "table '%s' shard %u: rank %d or columns [%d, +%d) "
					 "outside the cluster's %u ranks and the table", spec->name, k,
					 ps->rank, ps->col_offset, ps->cols, world);
				return EMBD_EINVAL;
			}
			ss->desc = (struct embd_shard_desc){
				.table_id = t, .num_embeddings = spec->num_embeddings,
				.embedding_dim = (uint32_t)spec->embedding_dim, .dtype = spec->data_type,
				.row_offset = ps->row_offset, .rows = ps->rows,
				.col_offset = (uint32_t)ps->col_offset, .cols = (uint32_t)ps->cols,
				.optimizer = spec->optimizer,
			};
			ss->table = t;
			ss->rank = (uint32_t)ps->rank;
			ss->node = ss->rank / L;
			ss->local = ss->rank % L;
			s->wire_shards[s->tables[t].first_shard + k] = (struct step_wire_shard){
				.table = t, .node = ss->node, .row_offset = ps->row_offset,
				.rows = ps->rows, .cols = (uint32_t)ps->cols,
			};
			if (ss->node != s->node)
				continue;       /* another node's memory */
			char inner[192];
			rc = embd_ranks_alloc_shard(s->ranks, ss->local, &ss->desc, pt->compute_kernel,
						    plan->topology.uvm_caching_ratio,
						    &ss->shard, inner, sizeof(inner));
			if (rc) {
				snprintf(err, err_len, "table '%s' shard %u (%s): %s", spec->name, k,
					 embd_plan_kernel_name(pt->compute_kernel), inner);
				return rc;
			}
			ss->host = embd_ranks_shard_host(s->ranks, ss->shard);
			s->tables[t].num_local++;
			struct rank_shards *rs = &s->rank_shards[ss->local];
			rs->shards[rs->num_shards++] = s->tables[t].first_shard + k;
		}
		struct step_table *st = &s->tables[t];
		st->device_sum = row_split(st->type) && st->num_local == st->num_shards;
		for (uint32_t k = 1; k < st->num_shards; k++) {
			const struct embd_shard_desc *a = &s->shards[st->first_shard].desc;
			const struct embd_shard_desc *b = &s->shards[st->first_shard + k].desc;
			if (a->col_offset != b->col_offset || a->cols != b->cols)
				st->device_sum = false;
		}
		if (st->device_sum) {
			uint64_t n = (uint64_t)s->layout.batch_size *
				     s->shards[st->first_shard].desc.cols;
			if (n > s->max_sum_floats)
				s->max_sum_floats = n;
		}
		if (s->tables[t].type == EMBD_SHARD_DATA_PARALLEL && !s->tables[t].num_local) {
			snprintf(err, err_len, "table '%s': data_parallel without a replica on node %u",
				 spec->name, s->node);
			return EMBD_EINVAL;
		}
	}
	return 0;
}

/* The buffers of one pass: every io, and room for max_trainers batches' offsets, sources and
 * item references. After place_shards (it counts max_table_shards). */
static int pass_alloc(struct embd_step *s, struct step_pass *p)
{
	const uint64_t F = s->layout.num_features, B = s->layout.batch_size;
	const uint64_t refs = (uint64_t)s->max_trainers * F *
			      (s->max_table_shards ? s->max_table_shards : 1);

	p->io = calloc(s->num_io, sizeof(*p->io));
	/* what the local ranks' devices read (ids) and write (partials) */
	for (uint32_t r = 0; p->io && r < s->num_ranks; r++) {
		struct rank_io *io = &p->io[r];
		io->offsets.dma = io->ids.dma = io->weights.dma = io->lengths.dma = s->ranks;
		io->partial.dma = s->ranks;
	}
	p->scratch_offsets = calloc((uint64_t)s->max_trainers * (F * B + 1), sizeof(int64_t));
	p->sources = calloc(refs, sizeof(*p->sources));
	p->refs = calloc(refs, sizeof(*p->refs));
	p->source_ranks = calloc(refs, sizeof(*p->source_ranks));
	return p->io && p->scratch_offsets && p->sources && p->refs && p->source_ranks ? 0 :
	       EMBD_ENOMEM;
}

static void pass_free(struct embd_step *s, struct step_pass *p)
{
	for (uint32_t r = 0; p->io && r < s->num_io; r++) {
		struct rank_io *io = &p->io[r];
		struct vec *vs[] = { &io->offsets, &io->ids, &io->weights, &io->lengths,
				     &io->partial, &io->items, &io->batches };
		for (size_t i = 0; i < sizeof(vs) / sizeof(vs[0]); i++)
			vec_free(vs[i]);
	}
	free(p->io);
	free(p->scratch_offsets);
	free(p->sources);
	free(p->refs);
	free(p->source_ranks);
}

int embd_step_create_cluster(const struct embd_tables *tables, const struct embd_plan *plan,
			     struct embd_ranks *ranks, uint64_t seed, uint32_t max_trainers,
			     const struct embd_step_cluster *cluster, struct embd_step **out,
			     char *err, size_t err_len)
{
	uint32_t nodes = cluster && cluster->num_nodes ? cluster->num_nodes : 1;
	uint32_t node = cluster ? cluster->node : 0;
	struct embd_step *s;
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!max_trainers || !plan->topology.batch_size || node >= nodes ||
	    (nodes > 1 && max_trainers > 64)) {
		snprintf(err, err_len, "max_trainers %u (1..%u), batch_size %u, node %u of %u",
			 max_trainers, nodes > 1 ? 64 : UINT32_MAX, plan->topology.batch_size, node,
			 nodes);
		return EMBD_EINVAL;
	}
	if (nodes > 1 && (uint64_t)plan->topology.world_size != (uint64_t)nodes *
							 embd_ranks_count(ranks)) {
		snprintf(err, err_len, "plan world_size %d: expected %u nodes x %u ranks",
			 plan->topology.world_size, nodes, embd_ranks_count(ranks));
		return EMBD_EMISMATCH;
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return EMBD_ENOMEM;
	s->ranks = ranks;
	s->seed = seed;
	s->max_trainers = max_trainers;
	s->node = node;
	s->num_nodes = nodes;
	s->num_ranks = embd_ranks_count(ranks);
	s->num_io = s->num_ranks + (nodes > 1 ? nodes : 0);
	s->num_tables = tables->count;
	s->tables = calloc(tables->count ? tables->count : 1, sizeof(*s->tables));
	s->rank_shards = calloc(s->num_ranks, sizeof(*s->rank_shards));
	s->partials = calloc(s->num_ranks, sizeof(*s->partials));
	s->pass = train_pass(s);
	s->eval.eval = true;
	if (!s->tables || !s->rank_shards || !s->partials)
		goto out;
	rc = build_layout(s, tables, plan->topology.batch_size);
	if (rc)
		goto out;
	rc = place_shards(s, tables, plan, err, err_len);
	if (!rc)
		rc = plan_shared_preps(s);
	for (int i = 0; i < 2 && !rc; i++)
		rc = pass_alloc(s, &s->train[i]);
	if (!rc)
		rc = pass_alloc(s, &s->eval);
	if (!rc && nodes > 1)
		rc = step_dist_create(s, cluster, err, err_len);
	if (!rc)
		rc = init_shards(s, err, err_len);
	if (rc)
		goto out;
	*out = s;
	return 0;
out:
	if (rc == EMBD_ENOMEM && err_len && !err[0])
		snprintf(err, err_len, "out of memory creating the step engine");
	embd_step_destroy(s);
	return rc;
}

int embd_step_create(const struct embd_tables *tables, const struct embd_plan *plan,
		     struct embd_ranks *ranks, uint64_t seed, uint32_t max_trainers,
		     struct embd_step **out, char *err, size_t err_len)
{
	return embd_step_create_cluster(tables, plan, ranks, seed, max_trainers, NULL, out, err,
					err_len);
}

void embd_step_destroy(struct embd_step *s)
{
	if (!s)
		return;
	step_dist_destroy(s);
	for (uint32_t i = 0; s->shards && i < s->num_shards; i++)
		if (s->shards[i].shard)
			embd_ranks_free_shard(s->ranks, s->shards[i].shard);
	pass_free(s, &s->train[0]);
	pass_free(s, &s->train[1]);
	pass_free(s, &s->eval);
	for (uint32_t r = 0; s->rank_shards && r < s->num_ranks; r++)
		free(s->rank_shards[r].shards);
	free(s->rank_shards);
	free(s->partials);
	free(s->preps);
	free(s->spans);
	free(s->shards);
	free(s->tables);
	free(s->names);
	free(s->dims);
	free(s->offsets);
	free(s->feature_tables);
	free(s->wire_tables);
	free(s->wire_shards);
	free(s);
}

const struct embd_step_layout *embd_step_layout(const struct embd_step *s)
{
	return &s->layout;
}

/* Shard, then feature, then the global batch order (so every data_parallel replica of the
 * cluster combines gradients in one order and stays bit-identical). */
static int compare_items(const void *a, const void *b)
{
	const struct step_item *x = a, *y = b;
	if (x->shard != y->shard)
		return x->shard < y->shard ? -1 : 1;
	if (x->feature != y->feature)
		return x->feature < y->feature ? -1 : 1;
	return x->gtrainer < y->gtrainer ? -1 : x->gtrainer > y->gtrainer;
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
		const struct step_table *t = &s->tables[ss->table];
		const bool remote = it->peer != NO_PEER;
		struct embd_bag_batch *bb = VEC_AT(io->batches, struct embd_bag_batch, i);
		/* direct: straight into (or from) the trainer's own output columns; a remote
		 * data_parallel item has no output at all (it only trains) */
		bool direct = !remote && (grad || it->partial_at == NO_INDEX);
		*bb = (struct embd_bag_batch){
			.shard = ss->shard, .feature = it->feature, .batch_size = it->bsize,
			.offsets = remote ? it->r_offsets : VEC_AT(io->offsets, int64_t, it->offsets_at),
			.ids = remote ? it->r_ids : VEC_AT(io->ids, int64_t, it->ids_at),
			.weights = !it->weighted ? NULL : remote ? it->r_weights :
				   VEC_AT(io->weights, float, it->ids_at),
			.num_ids = it->num_ids, .pooling = t->spec->pooling,
			.mean_lengths = remote ? it->r_lengths : it->lengths_at == NO_INDEX ? NULL :
					VEC_AT(io->lengths, int32_t, it->lengths_at),
			.pooled_stride = direct ? s->layout.total_dim : ss->desc.cols,
			.pooled_col = direct ? s->offsets[it->feature] + ss->desc.col_offset : 0,
		};
		if (grad) {
			bb->pooled_grad = remote ? step_dist_grad_of(s, it) :
				s->pass->batches[it->batch].pooled_grad;
			bb->grad_divisor = s->grad_divisor;
		}
		else if (direct)
			bb->pooled = s->pass->batches[it->batch].pooled;
		else if (it->partial_at != NO_INDEX)
			bb->pooled = VEC_AT(io->partial, float, it->partial_at);
	}
	io->batches.len = n;
	return 0;
}

/* ---- lookup, assembly, backward ---------------------------------------------------------- */

/* Whether the item's partial sum is summed on the ranks' devices (reduce_rank). */
static bool device_summed(const struct embd_step *s, const struct step_item *it)
{
	return it->peer == NO_PEER && it->batch != NO_BATCH && it->partial_at != NO_INDEX &&
	       s->tables[s->shards[it->shard].table].device_sum;
}

/* The rank's device_sum items pool into its partial buffer, laid out as io->partial with
 * room for one peer's partial after it (reduce_rank). */
static int partials_on_device(struct embd_step *s, uint32_t rank, struct rank_io *io)
{
	struct embd_bag_batch *all = io->batches.p;
	bool any = false;
	void *buf;
	int rc;

	s->partials[rank] = NULL;
	for (uint64_t i = 0; i < io->items.len && !any; i++)
		any = device_summed(s, VEC_AT(io->items, struct step_item, i));
	if (!any)
		return 0;
	rc = embd_ranks_partial_buffer(s->ranks, rank,
				       (io->partial.len + s->max_sum_floats) * sizeof(float), &buf,
				       io->kerr.msg, sizeof(io->kerr.msg));
	if (rc)
		return rc;
	s->partials[rank] = buf;
	for (uint64_t i = 0; i < io->items.len; i++) {
		const struct step_item *it = VEC_AT(io->items, struct step_item, i);
		if (device_summed(s, it))
			all[i].pooled = (float *)buf + it->partial_at;
	}
	return 0;
}

static void lookup_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct rank_io *io = &s->pass->io[rank];
	struct embd_bag_batch *all = io->batches.p;
	uint64_t n = 0;

	if ((io->rc = partials_on_device(s, rank, io)))
		return;
	/* forward items first: data_parallel's other replicas only train */
	for (uint64_t i = 0; i < io->items.len; i++)
		if (VEC_AT(io->items, struct step_item, i)->forward)
			all[n++] = all[i];
	io->rc = n ? embd_ranks_forward(s->ranks, rank, exec, all, (uint32_t)n, &io->kerr) : 0;
}

/*
 * The outputs of device_sum tables, on the rank holding the first shard with a partial for
 * them: the other shards' partials added in shard order (copied from their ranks' devices
 * first), as assemble adds them, then the sum to the trainer's columns. The sources
 * (lookup_pass) point into the ranks' partial buffers. Every rank reads the others' partials
 * and writes only the sums it owns.
 */
static void reduce_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct step_pass *p = s->pass;
	struct rank_io *io = &p->io[rank];
	const uint32_t F = s->layout.num_features, M = s->max_table_shards;
	char *err = io->kerr.msg;
	const size_t err_len = sizeof(io->kerr.msg);

	(void)exec;
	io->rc = 0;
	for (uint64_t i = 0; i < io->items.len && !io->rc; i++) {
		const struct step_item *it = VEC_AT(io->items, struct step_item, i);
		if (!device_summed(s, it) || p->batches[it->batch].status)
			continue;
		const struct step_table *t = &s->tables[s->shards[it->shard].table];
		const uint64_t at = ((uint64_t)it->batch * F + it->feature) * M;
		const float **src = &p->sources[at];
		const uint32_t *from = &p->source_ranks[at];
		uint32_t first = 0;
		while (first < t->num_shards && !src[first])
			first++;
		if (first != it->shard - t->first_shard)
			continue;       /* another shard's rank sums it */
		const struct embd_shard_desc *d = &s->shards[it->shard].desc;
		const uint64_t n = (uint64_t)it->bsize * d->cols;
		float *sum = (float *)src[first];
		float *recv = (float *)s->partials[rank] + io->partial.len;
		for (uint32_t k = first + 1; k < t->num_shards && !io->rc; k++) {
			const float *add = src[k];
			if (!add)
				continue;
			if (from[k] != rank) {
				io->rc = embd_ranks_partial_copy(s->ranks, rank, recv, from[k], add,
								 n * sizeof(float), err, err_len);
				add = recv;
			}
			if (!io->rc)
				io->rc = embd_ranks_partial_add(s->ranks, rank, sum, add, n, err, err_len);
		}
		if (!io->rc)
			io->rc = embd_ranks_partial_out(s->ranks, rank, p->batches[it->batch].pooled +
							s->offsets[it->feature] + d->col_offset,
							s->layout.total_dim, sum, it->bsize, d->cols,
							err, err_len);
	}
}

/* The backward of train[cur], never s->pass: the loop thread may run the next step's input
 * exchange in the other training pass meanwhile (embd_step_backward_overlapped). */
static void backward_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;
	struct rank_io *io = &train_pass(s)->io[rank];
	struct embd_bag_batch *all = io->batches.p;
	uint64_t i = 0;

	io->rc = 0;
	/* items are sorted by shard; every shard of the rank steps once, even untouched */
	for (uint32_t k = 0; k < s->rank_shards[rank].num_shards && !io->rc; k++) {
		uint32_t shard = s->rank_shards[rank].shards[k];
		uint64_t first = i;
		while (i < io->items.len && VEC_AT(io->items, struct step_item, i)->shard == shard)
			i++;
		/* the hook reads the host view: rows a snapshot saw at its boundary (step.h) */
		if (s->update_hook && i > first)
			s->update_hook(s->update_hook_arg, s->shards[shard].host, all + first,
				       (uint32_t)(i - first));
		const struct step_prep *pr = &s->preps[s->shards[shard].table];
		if (!pr->shared)
			io->rc = embd_ranks_backward(s->ranks, rank, exec, s->shards[shard].shard,
						     all + first, (uint32_t)(i - first), &io->kerr);
		else if (pr->rc) {      /* the bags' error, the same for every column shard */
			io->rc = pr->rc;
			io->kerr = pr->kerr;
		} else
			io->rc = embd_ranks_backward_apply(s->ranks, rank, exec, s->shards[shard].shard,
							   pr->prep, all + first, (uint32_t)(i - first),
							   &io->kerr);
	}
}

/* The shared tables' occurrences whose prepare falls to this rank (step_internal.h). */
static void prepare_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct embd_step *s = arg;

	for (uint32_t t = 0; t < s->num_tables; t++) {
		struct step_prep *pr = &s->preps[t];
		if (!pr->shared || s->tables[t].prep_rank != rank)
			continue;
		const struct step_shard *ss = &s->shards[pr->lead];
		const struct rank_io *io = &train_pass(s)->io[ss->local];
		const struct item_span *sp = &s->spans[pr->lead];
		/* reads the lead's ids and only the description of its shard, wherever it is */
		pr->rc = embd_kernels_backward_prepare(exec, ss->shard,
						       (const struct embd_bag_batch *)io->batches.p +
						       sp->first, (uint32_t)sp->n, &pr->prep, &pr->kerr);
	}
}

/* Whether items a and b (of two column shards of one table) describe the same bags. */
static bool same_bags(const struct step_item *a, const struct step_item *b)
{
	return a->feature == b->feature && a->gtrainer == b->gtrainer && a->bsize == b->bsize &&
	       a->num_ids == b->num_ids && a->weighted == b->weighted;
}

/*
 * Which tables' shards share one prep in this backward (s->preps): those that may, when every
 * local shard's items describe the same bags as the first one's (routing gives every column
 * shard the table's whole bags; anything else is stepped shard by shard). Fills s->spans.
 * Returns how many share.
 */
static uint32_t plan_preps(struct embd_step *s)
{
	struct step_pass *p = train_pass(s);
	uint32_t sharing = 0;

	memset(s->spans, 0, s->num_shards * sizeof(*s->spans));
	for (uint32_t r = 0; r < s->num_ranks; r++)
		for (uint64_t i = 0; i < p->io[r].items.len; i++) {
			struct item_span *sp = &s->spans[VEC_AT(p->io[r].items, struct step_item, i)->shard];
			if (!sp->n++)
				sp->first = i;
		}
	for (uint32_t t = 0; t < s->num_tables; t++) {
		const struct step_table *st = &s->tables[t];
		struct step_prep *pr = &s->preps[t];
		*pr = (struct step_prep){ .shared = st->shares_prep };
		if (!pr->shared)
			continue;
		uint32_t k = 0, lead;
		while (!s->shards[st->first_shard + k].shard)
			k++;    /* shares_prep: at least two are here */
		pr->lead = lead = st->first_shard + k;
		for (k++; pr->shared && k < st->num_shards; k++) {
			uint32_t j = st->first_shard + k;
			if (!s->shards[j].shard)
				continue;
			const struct item_span *a = &s->spans[lead], *b = &s->spans[j];
			const struct vec *ia = &p->io[s->shards[lead].local].items;
			const struct vec *ib = &p->io[s->shards[j].local].items;
			pr->shared = a->n == b->n;
			for (uint64_t i = 0; pr->shared && i < a->n; i++)
				pr->shared = same_bags(VEC_AT(*ia, struct step_item, a->first + i),
						       VEC_AT(*ib, struct step_item, b->first + i));
		}
		sharing += pr->shared;
	}
	return sharing;
}

/*
 * Outputs that did not go straight into a trainer's columns: the partial sums of row-split
 * tables (out = their sum, in shard order, wherever the shard is) and the column blocks of
 * shards on other nodes (copied). s->pass->sources holds one pointer per (batch, feature, shard of
 * the table): the rank's partial buffer here, the output exchange's buffer for other nodes.
 */
static void assemble(struct embd_step *s)
{
	const uint32_t D = s->layout.total_dim, F = s->layout.num_features;
	const uint32_t M = s->max_table_shards;

	for (uint32_t i = 0; i < s->pass->num_batches; i++) {
		if (s->pass->batches[i].status)
			continue;
		const uint32_t B = s->pass->batches[i].kjt.batch_size;
		for (uint32_t f = 0; f < F; f++) {
			const struct step_table *t = &s->tables[s->feature_tables[f]];
			const bool split = row_split(t->type);
			float *out = s->pass->batches[i].pooled + s->offsets[f];
			if (t->device_sum)
				continue;       /* summed on the ranks (reduce_rank) */
			if (split)
				for (uint32_t b = 0; b < B; b++)
					memset(&out[(uint64_t)b * D], 0, sizeof(float) * s->dims[f]);
			for (uint32_t k = 0; k < t->num_shards; k++) {
				const float *src = s->pass->sources[((uint64_t)i * F + f) * M + k];
				if (!src)
					continue;
				const struct embd_shard_desc *d = &s->shards[t->first_shard + k].desc;
				float *dst = out + d->col_offset;
				for (uint32_t b = 0; b < B; b++)
					for (uint32_t c = 0; c < d->cols; c++)
						dst[(uint64_t)b * D + c] = (split ? dst[(uint64_t)b * D + c] : 0.0f) +
									  src[(uint64_t)b * d->cols + c];
			}
		}
	}
}

static void reset_io(struct embd_step *s)
{
	for (uint32_t r = 0; r < s->num_io; r++) {
		struct rank_io *io = &s->pass->io[r];
		io->offsets.len = io->ids.len = io->weights.len = io->lengths.len = 0;
		io->partial.len = io->items.len = io->batches.len = 0;
	}
}

void step_pass_begin(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	struct step_pass *p = s->pass;

	p->batches = batches;
	p->num_batches = n;
	p->cluster_accepted = 0;
	p->counts = (struct embd_step_counts){ 0 };
	reset_io(s);
}

/* step_fail of pass p, which need not be the running one. */
static int fail_pass(struct embd_step *s, struct step_pass *p, int rc, const char *msg)
{
	for (uint32_t i = 0; i < p->num_batches; i++)
		if (!p->batches[i].status) {
			p->batches[i].status = rc;
			snprintf(p->batches[i].err, sizeof(p->batches[i].err), "%s", msg);
		}
	/* only the step forwarded last may be pending (not a preparation of the next) */
	if (p == train_pass(s))
		s->pending = false;
	return rc;
}

int step_fail(struct embd_step *s, int rc, const char *fmt, ...)
{
	char msg[sizeof(s->pass->batches[0].err)];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return fail_pass(s, s->pass, rc, msg);
}

/* Where the local ranks' partials lie for assemble and reduce_rank: s->pass->sources (device
 * memory for device_sum tables, with the rank in source_ranks); counts the partial bytes
 * summed on the host. Returns whether any output is summed on the ranks. */
static bool find_sources(struct embd_step *s)
{
	const uint32_t F = s->layout.num_features, M = s->max_table_shards;
	struct step_pass *p = s->pass;
	bool device = false;

	for (uint32_t r = 0; r < s->num_ranks; r++) {
		struct rank_io *io = &p->io[r];
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (it->partial_at == NO_INDEX || it->batch == NO_BATCH)
				continue;
			const struct step_table *t = &s->tables[s->shards[it->shard].table];
			const uint64_t at = ((uint64_t)it->batch * F + it->feature) * M + it->shard -
					    t->first_shard;
			if (device_summed(s, it)) {
				p->sources[at] = (const float *)s->partials[r] + it->partial_at;
				p->source_ranks[at] = r;
				device = true;
				continue;
			}
			p->sources[at] = VEC_AT(io->partial, float, it->partial_at);
			if (row_split(t->type))
				p->counts.partial_host_bytes += (uint64_t)it->bsize *
								 s->shards[it->shard].desc.cols *
								 sizeof(float);
		}
	}
	return device;
}

/* Lookup and assembly of the running pass once its items are in (the exchanges included). */
static int lookup_pass(struct embd_step *s)
{
	struct step_pass *p = s->pass;
	uint32_t failed_rank = 0;
	int rc = 0;

	memset(p->sources, 0, sizeof(*p->sources) * p->num_batches * s->layout.num_features *
			      s->max_table_shards);
	/* from here on a failure is reported to the other nodes before the step fails */
	for (uint32_t r = 0; r < s->num_ranks && !rc; r++) {
		struct rank_io *io = &p->io[r];
		if (io->items.len) /* a rank may hold no shard */
			qsort(io->items.p, io->items.len, sizeof(struct step_item), compare_items);
		for (uint64_t i = 0; i < io->items.len; i++) {
			const struct step_item *it = VEC_AT(io->items, struct step_item, i);
			if (it->forward) {
				p->counts.lookups += it->num_ids;
				s->tables[s->shards[it->shard].table].lookups += it->num_ids;
			}
		}
		rc = make_batches(s, io, false);
		failed_rank = r;
	}
	if (!rc) {
		embd_ranks_run(s->ranks, lookup_rank, s);
		for (uint32_t r = 0; r < s->num_ranks && !rc; r++)
			if ((rc = p->io[r].rc))
				failed_rank = r;
	}
	if (!rc && find_sources(s)) {
		uint64_t device0, host0, device1, host1;
		embd_ranks_partial_counts(s->ranks, &device0, &host0);
		embd_ranks_run(s->ranks, reduce_rank, s);
		embd_ranks_partial_counts(s->ranks, &device1, &host1);
		p->counts.partial_device_bytes += device1 - device0;
		p->counts.partial_host_bytes += host1 - host0;
		for (uint32_t r = 0; r < s->num_ranks && !rc; r++)
			if ((rc = p->io[r].rc))
				failed_rank = r;
	}
	char why[160] = "";
	if (rc)
		snprintf(why, sizeof(why), "lookup on rank %u of node %u: %.100s", failed_rank,
			 s->node, rc == EMBD_ENOMEM ? "out of memory" : p->io[failed_rank].kerr.msg);
	if (s->dist)
		rc = step_dist_output(s, rc, why);
	else if (rc)
		return step_fail(s, rc, "%s", why);
	if (rc)
		return rc;
	assemble(s);
	return 0;
}

/* The rest of a forward pass once its ids are in (the input exchange done): lookup, the
 * output exchange, assembly. Returns accepted, or an error. */
static int forward_exchanged(struct embd_step *s, uint32_t accepted)
{
	if (!s->pass->cluster_accepted)
		return 0;
	int rc = lookup_pass(s);
	return rc ? rc : (int)accepted;
}

/*
 * The rest of a forward pass once s->pass is routed (accepted: on this node): the input
 * exchange, then forward_exchanged. A ROUND_FOLLOW pass may leave s->pass switched to the
 * evaluation pass (step_dist_input).
 */
static int forward_routed(struct embd_step *s, enum step_round round, uint32_t accepted)
{
	if (s->dist) {
		/* the other nodes' ids for this node's ranks arrive; everyone learns the count */
		int rc = step_dist_input(s, round);
		if (rc)
			return rc;
	}
	return forward_exchanged(s, accepted);
}

/*
 * The prepared step's input exchange ran (embd_step_backward_overlapped), so the other nodes
 * go on to its lookup and output exchange; when anything but its forward comes instead, this
 * node's collectives are out of line with theirs from here on: the comm is broken (every node
 * fails its next exchange and the cluster re-forms).
 */
static void drop_exchanged(struct embd_step *s, const char *instead)
{
	char why[192];

	if (!s->exchanged)
		return;
	s->exchanged = false;
	snprintf(why, sizeof(why), "node %u dropped a step after its input exchange: %s", s->node,
		 instead);
	embd_step_comm_break(s, why);
}

/* One forward pass over n batches in s->pass: routing, then forward_routed. */
static int forward_pass(struct embd_step *s, struct embd_step_batch *batches, uint32_t n,
			enum step_round round)
{
	int rc = step_route_pass(s, batches, n);

	return rc < 0 ? rc : forward_routed(s, round, (uint32_t)rc);
}

int embd_step_forward(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	const struct step_pass *next = &s->train[s->cur ^ 1];
	const bool same = s->prepared && next->batches == batches && next->num_batches == n;
	int rc;

	s->pending = false;
	if (!same) {
		drop_exchanged(s, "a forward of other batches came");
		s->cluster_ckpt = s->prepared = false;
		rc = forward_pass(s, batches, n, ROUND_TRAIN);
	} else if (s->exchanged) {
		/* its ids came while the step before was applied; its HELLO set cluster_ckpt */
		s->cur ^= 1;
		s->pass = train_pass(s);
		s->prepared = s->exchanged = false;
		rc = s->exchange_rc < 0 ? s->exchange_rc : forward_exchanged(s, s->pass->accepted);
	} else {
		/* routed while the step before waited for its backward (embd_step_prepare) */
		s->cur ^= 1;
		s->pass = train_pass(s);
		s->cluster_ckpt = s->prepared = false;
		rc = forward_routed(s, ROUND_TRAIN, s->pass->accepted);
	}
	s->pending = rc >= 0 && train_pass(s)->cluster_accepted;
	return rc;
}

bool embd_step_prepared(const struct embd_step *s)
{
	return s->prepared;
}

bool embd_step_exchanged(const struct embd_step *s)
{
	return s->exchanged;
}

int embd_step_eval(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	drop_exchanged(s, "an evaluation came");
	s->pass = &s->eval;
	int rc = forward_pass(s, batches, n, ROUND_EVAL);
	s->pass = train_pass(s);
	return rc;
}

int embd_step_follow(struct embd_step *s, bool *eval)
{
	*eval = false;
	if (s->pending)
		return EMBD_EINVAL;
	drop_exchanged(s, "a round without batches came");
	s->cluster_ckpt = false;
	s->prepared = false;
	int rc = forward_pass(s, NULL, 0, ROUND_FOLLOW);
	*eval = s->pass == &s->eval;
	s->pass = train_pass(s);
	s->pending = !*eval && rc >= 0 && train_pass(s)->cluster_accepted;
	return rc;
}

uint32_t embd_step_cluster_accepted(const struct embd_step *s)
{
	return s->train[s->cur].cluster_accepted;
}

void embd_step_want_checkpoint(struct embd_step *s, bool want)
{
	s->ckpt_want = want;
}

bool embd_step_cluster_checkpoint(const struct embd_step *s)
{
	return s->cluster_ckpt;
}

/* One run of the gradients' copy and check over the ranks (check_grads_finite). */
struct grad_check {
	struct embd_step *s;
	atomic_uint *nonfinite;         /* per batch: some slice saw a NaN or an infinity */
	uint32_t rank;                  /* the rank whose workers run grad_check_worker */
};

/* Gradient i's elements: b samples (its batch's, fewer than B for a short batch) x total_dim. */
static uint64_t grad_elems(const struct embd_step *s, const struct embd_step_batch *b)
{
	return (uint64_t)b->kjt.batch_size * s->layout.total_dim;
}

/* Part `part` of `parts` of [from, to), cut at multiples of EMBD_FINITE_BLOCK (so every part
 * but the last vectorizes whole). */
static void grad_part(uint64_t *from, uint64_t *to, uint32_t part, uint32_t parts)
{
	const uint64_t blocks = (*to - *from) / EMBD_FINITE_BLOCK, end = *to;

	*to = part + 1 == parts ? end : *from + blocks * (part + 1) / parts * EMBD_FINITE_BLOCK;
	*from += blocks * part / parts * EMBD_FINITE_BLOCK;
}

/* Worker w of the rank's part of every accepted gradient: copied and checked, or checked. */
static void grad_check_worker(void *arg, uint32_t w, uint32_t nw)
{
	const struct grad_check *g = arg;
	const struct step_pass *p = g->s->pass;

	for (uint32_t i = 0; i < p->num_batches; i++) {
		const struct embd_step_batch *b = &p->batches[i];
		uint64_t from = 0, to = grad_elems(g->s, b);
		if (b->status)
			continue;
		grad_part(&from, &to, g->rank, g->s->num_ranks);
		grad_part(&from, &to, w, nw);
		bool bad = b->grad_from ?
			embd_copy_nonfinite(b->grad_copy + from, b->grad_from + from, to - from) :
			embd_first_nonfinite(b->pooled_grad + from, to - from) != to - from;
		if (bad)
			atomic_store_explicit(&g->nonfinite[i], 1, memory_order_relaxed);
	}
}

static void grad_check_rank(void *arg, uint32_t rank, const struct embd_exec *exec)
{
	struct grad_check g = *(const struct grad_check *)arg;

	g.rank = rank;
	embd_workers_run(exec->workers, grad_check_worker, &g);
}

/*
 * The accepted gradients that are not finite (step.h): why names the first one's trainer,
 * sample, column and feature. Returns how many batches hold one. The copy out of grad_from
 * and the check run split over every rank and each rank's workers: on one node they are the
 * only work between the trainers' BACKWARDs and the update, and on the loop thread alone they
 * would leave the other CPUs idle (embd-bench train's 2 trainers: 8 MiB a step). Only a
 * gradient that holds a NaN or an infinity is searched again, for the first.
 */
static uint32_t check_grads_finite(struct embd_step *s, char *why, size_t why_len)
{
	const struct embd_step_layout *l = &s->layout;
	struct step_pass *p = s->pass;
	atomic_uint *nonfinite = calloc(p->num_batches ? p->num_batches : 1, sizeof(*nonfinite));
	uint32_t bad = 0;

	for (uint32_t i = 0; i < p->num_batches; i++) {
		struct embd_step_batch *b = &p->batches[i];
		if (b->status || !b->grad_from)
			continue;
		if (!nonfinite)         /* out of memory: on this thread, the copy then its check */
			memcpy(b->grad_copy, b->grad_from, grad_elems(s, b) * sizeof(float));
		b->pooled_grad = b->grad_copy;
	}
	if (nonfinite) {
		struct grad_check g = { .s = s, .nonfinite = nonfinite };
		for (uint32_t i = 0; i < p->num_batches; i++)
			atomic_init(&nonfinite[i], 0);
		embd_ranks_run(s->ranks, grad_check_rank, &g);
	}
	for (uint32_t i = 0; i < p->num_batches; i++) {
		const struct embd_step_batch *b = &p->batches[i];
		const uint64_t n = grad_elems(s, b);
		uint64_t k = b->status || (nonfinite && !atomic_load(&nonfinite[i])) ? n :
			     embd_first_nonfinite(b->pooled_grad, n);
		if (k == n || bad++)
			continue;
		uint32_t col = (uint32_t)(k % l->total_dim), f = 0;
		while (f + 1 < l->num_features && col >= l->feature_offsets[f] + l->feature_dims[f])
			f++;
		snprintf(why, why_len, "trainer %u of node %u sent a gradient that is %s at sample "
			 "%u, column %u (feature '%s')", b->trainer, s->node,
			 b->pooled_grad[k] != b->pooled_grad[k] ? "NaN" : "infinite",
			 (uint32_t)(k / l->total_dim), col, l->feature_names[f]);
	}
	free(nonfinite);
	return bad;
}

/* Rows the last backward's updates left non-finite, from the shards' counters (step.h). */
static void count_nonfinite_rows(struct embd_step *s)
{
	struct embd_step_counts *c = &train_pass(s)->counts;

	for (uint32_t i = 0; i < s->num_shards; i++) {
		struct step_shard *ss = &s->shards[i];
		if (!ss->shard || ss->shard->nonfinite_rows == ss->nonfinite_seen)
			continue;
		if (!c->nonfinite_rows) {
			c->nonfinite_table = ss->table;
			c->nonfinite_row = ss->shard->nonfinite_row;
		}
		c->nonfinite_rows += ss->shard->nonfinite_rows - ss->nonfinite_seen;
		ss->nonfinite_seen = ss->shard->nonfinite_rows;
	}
}

/*
 * The fused optimizer of the step in backward (train[cur]) on every rank, once its gradients
 * are in. With overlap the comm thread runs the prepared step's input exchange meanwhile
 * (step_overlap.c; *exchanging says whether it started): from then on until it is waited for
 * this thread touches neither s->pass nor the other training pass.
 */
static int apply(struct embd_step *s, bool overlap, bool *exchanging)
{
	struct step_pass *p = train_pass(s);
	uint32_t failed_rank = 0;
	char msg[sizeof(p->batches[0].err)];
	int rc = 0;

	for (uint32_t r = 0; r < s->num_ranks && !rc; r++)
		if ((rc = make_batches(s, &p->io[r], true)))
			failed_rank = r;
	if (!rc) {
		*exchanging = overlap && step_overlap_start(s);
		if (plan_preps(s))
			embd_ranks_run(s->ranks, prepare_rank, s);
		embd_ranks_run(s->ranks, backward_rank, s);
		for (uint32_t r = 0; r < s->num_ranks && !rc; r++)
			if ((rc = p->io[r].rc))
				failed_rank = r;
		for (uint32_t t = 0; t < s->num_tables; t++) {
			struct step_prep *pr = &s->preps[t];
			if (pr->shared && !rc) {        /* counted in applied steps only */
				p->counts.backward_prepares++;
				p->counts.backward_shared_shards += s->tables[t].num_local;
			}
			embd_backward_prep_free(pr->prep);
			pr->prep = NULL;
		}
		count_nonfinite_rows(s);
	}
	if (!rc)
		return 0;
	snprintf(msg, sizeof(msg), "backward on rank %u of node %u: %.150s", failed_rank, s->node,
		 rc == EMBD_ENOMEM ? "out of memory" : p->io[failed_rank].kerr.msg);
	return fail_pass(s, p, rc, msg);
}

/* The backward up to the apply: the gradients checked and, on a cluster, exchanged. 0 when
 * the update is to be applied. */
static int gradients_in(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	char why[192] = "";
	int rc = 0;

	if (!s->pending || batches != s->pass->batches || n != s->pass->num_batches)
		return EMBD_EINVAL;
	s->pending = false;
	for (uint32_t i = 0; i < n; i++)
		if (!batches[i].status && !batches[i].pooled_grad &&
		    !(batches[i].grad_from && batches[i].grad_copy)) {
			snprintf(batches[i].err, sizeof(batches[i].err), "pooled_grad: missing");
			rc = EMBD_EINVAL;
		}
	/* before anything is sent or applied: refused like an abort (step.h) */
	s->pass->counts.nonfinite_grads = rc ? 0 : check_grads_finite(s, why, sizeof(why));
	if (s->pass->counts.nonfinite_grads)
		rc = EMBD_ECANCELED;
	else if (rc)
		snprintf(why, sizeof(why), "a trainer's pooled_grad is missing");
	if (s->dist)    /* a refused gradient here aborts the step everywhere, not half of it */
		return step_dist_grads(s, rc, why);
	if (rc == EMBD_ECANCELED)
		return step_fail(s, rc, "step aborted: %s", why);
	return rc;
}

static int backward(struct embd_step *s, struct embd_step_batch *batches, uint32_t n,
		    bool overlap, embd_step_applied_fn applied, void *arg)
{
	bool exchanging = false;
	int rc = gradients_in(s, batches, n);

	/* the exchange needs the comm to itself: a comm staged through the ranks' devices
	 * (nccl) copies on the rank threads, which the apply holds */
	overlap = overlap && s->prepared && !s->exchanged && s->lanes &&
		  !step_lanes_staged(s->lanes);
	if (!rc)
		rc = apply(s, overlap, &exchanging);
	if (applied)
		applied(arg, rc);
	if (exchanging)
		step_overlap_wait(s);
	return rc;
}

int embd_step_backward(struct embd_step *s, struct embd_step_batch *batches, uint32_t n)
{
	return backward(s, batches, n, false, NULL, NULL);
}

int embd_step_backward_overlapped(struct embd_step *s, struct embd_step_batch *batches,
				  uint32_t n, embd_step_applied_fn applied, void *arg)
{
	return backward(s, batches, n, true, applied, arg);
}

int embd_step_abort(struct embd_step *s, const char *why)
{
	int rc = 0;

	if (s->dist && s->pending)
		rc = step_dist_grads(s, EMBD_ECANCELED, why ? why : "aborted");
	drop_exchanged(s, "an abort came");
	s->pending = false;
	s->prepared = false;
	reset_io(s);
	return rc == EMBD_ECANCELED ? 0 : rc;
}

void embd_step_counts(const struct embd_step *s, struct embd_step_counts *out)
{
	*out = s->train[s->cur].counts;
	if (s->dist)
		step_dist_counts(s, out);
}

uint64_t embd_step_table_lookups(const struct embd_step *s, uint32_t table)
{
	return table < s->num_tables ? s->tables[table].lookups : 0;
}

bool embd_step_table_cache(const struct embd_step *s, uint32_t table, uint64_t *hits,
			   uint64_t *misses)
{
	bool cached = false;

	*hits = *misses = 0;
	if (table >= s->num_tables)
		return false;
	const struct step_table *t = &s->tables[table];
	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		if (ss->shard && embd_ranks_cache_counts(s->ranks, ss->shard, hits, misses))
			cached = true;
	}
	return cached;
}

int embd_step_read_weight(const struct embd_step *s, uint32_t table, int64_t row, uint32_t col,
			  uint32_t replica, float *out)
{
	if (table >= s->num_tables)
		return EMBD_ENOENT;
	const struct step_table *t = &s->tables[table];
	for (uint32_t k = 0; k < t->num_shards; k++) {
		const struct step_shard *ss = &s->shards[t->first_shard + k];
		const struct embd_shard_desc *d = &ss->desc;
		if (!ss->shard || (t->num_replicas > 1 && ss->rank != replica))
			continue;
		if (row < d->row_offset || row >= d->row_offset + d->rows || col < d->col_offset ||
		    col >= d->col_offset + d->cols)
			continue;
		char err[192];
		if (embd_ranks_shard_pull(s->ranks, ss->shard, err, sizeof(err)))
			return EMBD_EIO;
		uint64_t i = (uint64_t)(row - d->row_offset) * d->cols + (col - d->col_offset);
		*out = d->dtype == EMBD_DTYPE_FP16 ? embd_fp16_to_fp32(((uint16_t *)ss->host->weights)[i])
						   : ((float *)ss->host->weights)[i];
		return 0;
	}
	return EMBD_ENOENT;
}

void embd_step_set_grad_divisor(struct embd_step *s, uint32_t divisor)
{
	s->grad_divisor = divisor;
}

void embd_step_set_update_hook(struct embd_step *s, embd_step_update_hook hook, void *arg)
{
	s->update_hook = hook;
	s->update_hook_arg = arg;
}

uint32_t embd_step_num_shards(const struct embd_step *s)
{
	return s->num_shards;
}

void embd_step_shard_view(const struct embd_step *s, uint32_t i, struct embd_step_shard_view *out)
{
	const struct step_shard *ss = &s->shards[i];
	const struct step_table *t = &s->tables[ss->table];

	*out = (struct embd_step_shard_view){
		.table = ss->table, .rank = ss->rank, .shard = ss->host,
		.replica = t->num_replicas > 1 && i != t->first_shard,
	};
}

int embd_step_shards_pull(struct embd_step *s, char *err, size_t err_len)
{
	for (uint32_t i = 0; i < s->num_shards; i++) {
		const struct step_shard *ss = &s->shards[i];
		if (!ss->shard)
			continue;
		int rc = embd_ranks_shard_pull(s->ranks, ss->shard, err, err_len);
		if (rc)
			return rc;
	}
	return 0;
}

void embd_step_shards_changed(struct embd_step *s)
{
	for (uint32_t i = 0; i < s->num_shards; i++)
		if (s->shards[i].shard)
			embd_ranks_shard_changed(s->ranks, s->shards[i].shard);
}
