/*
 * The planner: enumerate shard options per table, propose one option per table, partition
 * the shards onto ranks, keep the plan whose slowest rank is fastest (TorchRec's pipeline).
 *
 * It stays fast at 10,000 tables x 1,024 ranks because nothing is quadratic: an option is
 * estimated once per shard *class* (a row split has full, short and empty shards, all alike
 * within a class) and the partitioners (partition.c) use difference arrays and heaps. Every
 * sort and heap breaks ties by index, so the result never depends on memory layout.
 */
#include "planner/planner_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COL_SPLITS 3     /* column-block candidates per table (smallest blocks first) */
/* local-search budgets in shard pairs: small while comparing proposals, larger for the winner */
#define SEARCH_REFINE_STEPS (2ull << 20)
#define FINAL_REFINE_STEPS (64ull << 20)
/* ---- enumerator ------------------------------------------------------------------------- */

static int estimate_class(struct planner *p, uint32_t t, struct option *o, int64_t rows,
			  int32_t cols, struct shard_class *out)
{
	struct embd_shard_perf perf;
	struct embd_shard_storage st;
	int rc = embd_plan_estimate_shard(&p->tables[t], p->constraints ? &p->constraints[t] : NULL,
					  p->topo, (enum embd_sharding_type)o->type,
					  (enum embd_compute_kernel)o->kernel, rows, cols, &perf, &st);
	if (rc)
		return rc;
	out->ms = embd_shard_perf_total_ms(&perf);
	out->hbm = st.hbm_bytes;
	out->ddr = st.ddr_bytes;
	return 0;
}

static int fill_option(struct planner *p, uint32_t t, struct option *o)
{
	const struct shard_layout *l = &o->layout;
	int64_t r0, rows, last_rows;
	int32_t c0, cols, last_cols;
	uint32_t n = l->num_shards;

	planner_layout_shard(l, 0, &r0, &rows, &c0, &cols);
	planner_layout_shard(l, n - 1, &r0, &last_rows, &c0, &last_cols);
	o->n_full = n;
	o->n_tail = o->n_empty = 0;
	if (l->type == EMBD_SHARD_ROW_WISE || l->type == EMBD_SHARD_TABLE_ROW_WISE) {
		o->n_full = (uint32_t)(l->rows / l->row_block);
		o->n_tail = l->rows % l->row_block ? 1 : 0;
		o->n_empty = n - o->n_full - o->n_tail;
		last_rows = l->rows % l->row_block;
	} else if (last_cols != cols) {
		o->n_full = n - 1;
		o->n_tail = 1;
	}
	int rc = estimate_class(p, t, o, rows, cols, &o->full);
	if (!rc && o->n_tail)
		rc = estimate_class(p, t, o, last_rows, last_cols, &o->tail);
	if (!rc && o->n_empty)
		rc = estimate_class(p, t, o, 0, cols, &o->empty);
	if (rc)
		return rc;
	o->total_ms = o->full.ms * o->n_full + o->tail.ms * o->n_tail + o->empty.ms * o->n_empty;
	o->max_ms = o->full.ms;
	o->max_hbm = o->full.hbm;
	o->max_ddr = o->full.ddr;
	if (o->n_tail) {
		o->max_ms = fmax(o->max_ms, o->tail.ms);
		o->max_hbm = o->max_hbm > o->tail.hbm ? o->max_hbm : o->tail.hbm;
		o->max_ddr = o->max_ddr > o->tail.ddr ? o->max_ddr : o->tail.ddr;
	}
	if (o->n_empty)
		o->max_ms = fmax(o->max_ms, o->empty.ms);
	return 0;
}

/* Column blocks: multiples of 4 that divide the dim, at least min_partition, >= 2 shards. */
static uint32_t column_blocks(const struct embd_table_spec *t,
			      const struct embd_table_constraints *c, int32_t *blocks)
{
	int32_t min_block = c && c->min_partition ? c->min_partition : MIN_CW_DIM;
	uint32_t n = 0;
	for (int32_t b = min_block; b <= t->embedding_dim / 2 && n < MAX_COL_SPLITS; b++)
		if (b % 4 == 0 && t->embedding_dim % b == 0)
			blocks[n++] = b;
	return n;
}

/* Contradictory constraints: name the table, what it allows and what would be needed. */
static int no_option(const struct planner *p, uint32_t t, uint32_t types, uint32_t kernels,
		     char *err, size_t err_len)
{
	char allowed[256] = "";
	size_t len = 0;
	for (int i = 0; i < EMBD_SHARD_COUNT; i++)
		if (types & (1u << i))
			len += (size_t)snprintf(allowed + len, sizeof(allowed) - len, "%s%s",
						len ? "," : "", embd_plan_sharding_name(i));
	len += (size_t)snprintf(allowed + len, sizeof(allowed) - len, "] x compute_kernels [");
	size_t mark = len;
	for (int k = 0; k < EMBD_KERNEL_COUNT; k++)
		if (kernels & (1u << k))
			len += (size_t)snprintf(allowed + len, sizeof(allowed) - len, "%s%s",
						len > mark ? "," : "", embd_plan_kernel_name(k));
	bool cuda = p->topo->compute_device == EMBD_DEVICE_CUDA;
	return embd_fail(err, err_len, EMBD_EINFEASIBLE,
			   "table '%s': contradictory constraints leave no option on %s: "
			   "sharding_types [%s] (data_parallel runs only dense, the others fused%s; "
			   "column splits need embedding_dim %d >= 2 x min_partition)",
			   p->tables[t].name, embd_plan_device_name(p->topo->compute_device), allowed,
			   cuda ? ", fused_uvm or fused_uvm_caching" : "", p->tables[t].embedding_dim);
}

static int enumerate(struct planner *p, char *err, size_t err_len)
{
	size_t cap = (size_t)p->n * 8 + 16, count = 0;
	bool cuda = p->topo->compute_device == EMBD_DEVICE_CUDA;
	p->opts = malloc(cap * sizeof(*p->opts));
	p->opt_start = malloc(((size_t)p->n + 1) * sizeof(*p->opt_start));
	if (!p->opts || !p->opt_start)
		return EMBD_ENOMEM;
	for (uint32_t t = 0; t < p->n; t++) {
		const struct embd_table_constraints *c = p->constraints ? &p->constraints[t] : NULL;
		uint32_t types = c && c->sharding_types ? c->sharding_types : ~0u;
		uint32_t kernels = c && c->compute_kernels ? c->compute_kernels : ~0u;
		int32_t blocks[MAX_COL_SPLITS];
		uint32_t nblocks = column_blocks(&p->tables[t], c, blocks);
		p->opt_start[t] = (uint32_t)count;
		for (int type = 0; type < EMBD_SHARD_COUNT; type++) {
			if (!(types & (1u << type)))
				continue;
			bool cw = type == EMBD_SHARD_COLUMN_WISE || type == EMBD_SHARD_TABLE_COLUMN_WISE;
			for (int k = 0; k < EMBD_KERNEL_COUNT; k++) {
				/* TorchRec's sharder: data_parallel is dense, the rest fused(+uvm) */
				if (!(kernels & (1u << k)) ||
				    (type == EMBD_SHARD_DATA_PARALLEL) != (k == EMBD_KERNEL_DENSE) ||
				    (!cuda && k >= EMBD_KERNEL_FUSED_UVM))
					continue;
				for (uint32_t b = 0; b < (cw ? nblocks : 1); b++) {
					if (count + 1 > cap) {
						cap *= 2;
						struct option *grown = realloc(p->opts, cap * sizeof(*grown));
						if (!grown)
							return EMBD_ENOMEM;
						p->opts = grown;
					}
					struct option *o = &p->opts[count];
					o->type = (uint8_t)type;
					o->kernel = (uint8_t)k;
					planner_layout(&o->layout, &p->tables[t], p->topo,
						       (enum embd_sharding_type)type, cw ? blocks[b] : 0);
					int rc = fill_option(p, t, o);
					if (rc)
						return embd_fail(err, err_len, rc,
								   "table '%s': cannot estimate %s/%s",
								   p->tables[t].name, embd_plan_sharding_name(type),
								   embd_plan_kernel_name(k));
					count++;
				}
			}
		}
		if (count == p->opt_start[t])
			return no_option(p, t, types, kernels, err, err_len);
	}
	p->opt_start[p->n] = (uint32_t)count;
	return 0;
}

/* ---- proposers -------------------------------------------------------------------------- */

/* An option whose every shard fits an empty rank; options that do not are never proposed. */
static bool option_fits_alone(const struct planner *p, const struct option *o)
{
	return o->max_hbm <= p->hbm_budget && o->max_ddr <= p->ddr_cap;
}

/*
 * Each table's option with the least total perf among those whose slowest shard takes at
 * most max_shard_ms (TorchRec's GreedyProposer when max_shard_ms is infinite); tables with
 * no such option take their option with the fastest slowest shard. memory_first instead
 * takes the option with the smallest largest shard (ties: least perf): the proposal most
 * likely to fit.
 */
static void propose(const struct planner *p, double max_shard_ms, bool memory_first,
		    uint32_t *choice)
{
	for (uint32_t t = 0; t < p->n; t++) {
		uint32_t best = UINT32_MAX, fastest = UINT32_MAX;
		for (uint32_t i = p->opt_start[t]; i < p->opt_start[t + 1]; i++) {
			const struct option *o = &p->opts[i];
			if (!option_fits_alone(p, o))
				continue;
			if (fastest == UINT32_MAX || o->max_ms < p->opts[fastest].max_ms)
				fastest = i;
			if (memory_first) {
				if (best == UINT32_MAX || o->max_hbm < p->opts[best].max_hbm ||
				    (o->max_hbm == p->opts[best].max_hbm &&
				     o->total_ms < p->opts[best].total_ms))
					best = i;
			} else if (o->max_ms <= max_shard_ms &&
				   (best == UINT32_MAX || o->total_ms < p->opts[best].total_ms)) {
				best = i;
			}
		}
		choice[t] = best != UINT32_MAX ? best : fastest;
	}
}

/* Lower bound of the slowest rank: all work spread evenly, or the slowest unavoidable shard. */
static double perf_lower_bound(const struct planner *p)
{
	double sum = 0, worst = 0;
	for (uint32_t t = 0; t < p->n; t++) {
		double least = INFINITY, fastest = INFINITY;
		for (uint32_t i = p->opt_start[t]; i < p->opt_start[t + 1]; i++) {
			if (!option_fits_alone(p, &p->opts[i]))
				continue;
			least = fmin(least, p->opts[i].total_ms);
			fastest = fmin(fastest, p->opts[i].max_ms);
		}
		sum += least;
		worst = fmax(worst, fastest);
	}
	return fmax(sum / p->W, worst);
}

/* Names every table that fits on no rank even alone, with its shortfall; 0 if none. */
static int check_tables_fit(const struct planner *p, char *err, size_t err_len)
{
	struct sbuf b = { 0 };
	uint32_t bad = 0;
	for (uint32_t t = 0; t < p->n; t++) {
		uint64_t least_hbm = UINT64_MAX, least_ddr = UINT64_MAX;
		bool ok = false;
		for (uint32_t i = p->opt_start[t]; i < p->opt_start[t + 1]; i++) {
			const struct option *o = &p->opts[i];
			ok |= option_fits_alone(p, o);
			if (o->max_hbm < least_hbm || (o->max_hbm == least_hbm && o->max_ddr < least_ddr)) {
				least_hbm = o->max_hbm;
				least_ddr = o->max_ddr;
			}
		}
		if (ok)
			continue;
		if (bad++ < 8) {
			bool ddr = least_hbm <= p->hbm_budget;
			uint64_t need = ddr ? least_ddr : least_hbm, room = ddr ? p->ddr_cap : p->hbm_budget;
			sbuf_printf(&b, "%s'%s' needs %llu bytes of %s per shard at least, a rank has %llu: "
				    "short by %llu bytes", bad > 1 ? "; " : "", p->tables[t].name,
				    (unsigned long long)need, ddr ? "DDR" : "HBM",
				    (unsigned long long)room, (unsigned long long)(need - room));
		}
	}
	int rc = 0;
	if (bad)
		rc = embd_fail(err, err_len, EMBD_EINFEASIBLE, "%u table(s) fit on no rank: %s%s",
				 bad, b.data ? b.data : "", bad > 8 ? "; ..." : "");
	free(b.data);
	return rc;
}

/* ---- build ------------------------------------------------------------------------------ */

static int planner_alloc(struct planner *p)
{
	size_t heap = 2 * (size_t)(p->W > p->nodes ? p->W : p->nodes) + 2;
	p->load_ms = calloc(p->W, sizeof(*p->load_ms));
	p->hbm = calloc(p->W, sizeof(*p->hbm));
	p->ddr = calloc(p->W, sizeof(*p->ddr));
	p->diff_ms = calloc(p->W + 1, sizeof(*p->diff_ms));
	p->diff_hbm = calloc(p->W + 1, sizeof(*p->diff_hbm));
	p->diff_ddr = calloc(p->W + 1, sizeof(*p->diff_ddr));
	p->heap = calloc(heap, sizeof(*p->heap));
	p->node_ms = calloc(p->L, sizeof(*p->node_ms));
	p->node_hbm = calloc(p->L, sizeof(*p->node_hbm));
	p->node_ddr = calloc(p->L, sizeof(*p->node_ddr));
	p->free_cap = p->n;
	p->max_node_shards = 1;
	for (uint32_t t = 0; t < p->n; t++) {
		uint32_t most = 1;
		for (uint32_t i = p->opt_start[t]; i < p->opt_start[t + 1]; i++) {
			const struct option *o = &p->opts[i];
			if (o->type == EMBD_SHARD_TABLE_WISE || o->type == EMBD_SHARD_COLUMN_WISE)
				most = o->layout.num_shards > most ? o->layout.num_shards : most;
			if (o->type == EMBD_SHARD_TABLE_COLUMN_WISE &&
			    o->layout.num_shards > p->max_node_shards)
				p->max_node_shards = o->layout.num_shards;
		}
		p->free_cap += most;
	}
	p->free_list = calloc(p->free_cap, sizeof(*p->free_list));
	p->node_pick = calloc(p->max_node_shards, sizeof(*p->node_pick));
	if (!p->load_ms || !p->hbm || !p->ddr || !p->diff_ms || !p->diff_hbm || !p->diff_ddr ||
	    !p->heap || !p->node_ms || !p->node_hbm || !p->node_ddr || !p->free_list ||
	    !p->node_pick)
		return EMBD_ENOMEM;
	return 0;
}

static void planner_free(struct planner *p)
{
	free(p->opts);
	free(p->opt_start);
	free(p->load_ms);
	free(p->hbm);
	free(p->ddr);
	free(p->diff_ms);
	free(p->diff_hbm);
	free(p->diff_ddr);
	free(p->heap);
	free(p->node_ms);
	free(p->node_hbm);
	free(p->node_ddr);
	free(p->free_list);
	free(p->node_pick);
}

/* Result a beats b: feasible first, then the faster slowest rank, then less peak HBM. */
static bool better(const struct result *a, const struct result *b)
{
	if (a->feasible != b->feasible)
		return a->feasible;
	if (!a->feasible)
		return false;
	if (a->max_ms != b->max_ms)
		return a->max_ms < b->max_ms;
	return a->max_hbm < b->max_hbm;
}

/* Turns the winning proposal into an embd_plan (shards with their ranks). */
static int materialize(struct planner *p, const uint32_t *choice, enum partitioner kind,
		       struct embd_plan *plan)
{
	size_t *base = malloc(((size_t)p->n + 1) * sizeof(*base));
	uint32_t *places = NULL;
	struct result res;
	int rc = EMBD_ENOMEM;

	if (!base)
		goto out;
	base[0] = 0;
	for (uint32_t t = 0; t < p->n; t++)
		base[t + 1] = base[t] + chosen(p, choice, t)->layout.num_shards;
	places = malloc((base[p->n] ? base[p->n] : 1) * sizeof(*places));
	plan->tables = calloc(p->n, sizeof(*plan->tables));
	if (!places || !plan->tables)
		goto out;
	plan->num_tables = p->n;
	planner_partition(p, choice, kind, FINAL_REFINE_STEPS, places, base, &res);
	for (uint32_t t = 0; t < p->n; t++) {
		const struct option *o = chosen(p, choice, t);
		struct embd_plan_table *pt = &plan->tables[t];
		memcpy(pt->name, p->tables[t].name, sizeof(pt->name));
		pt->sharding_type = (enum embd_sharding_type)o->type;
		pt->compute_kernel = (enum embd_compute_kernel)o->kernel;
		pt->num_shards = o->layout.num_shards;
		pt->shards = calloc(pt->num_shards, sizeof(*pt->shards));
		if (!pt->shards) {
			rc = EMBD_ENOMEM;
			goto out;
		}
		for (uint32_t i = 0; i < pt->num_shards; i++) {
			struct embd_plan_shard *s = &pt->shards[i];
			planner_layout_shard(&o->layout, i, &s->row_offset, &s->rows, &s->col_offset,
					     &s->cols);
			s->rank = (int32_t)places[base[t] + i];
		}
	}
	rc = 0;
out:
	free(base);
	free(places);
	return rc;
}

int embd_plan_build(const struct embd_table_spec *tables,
		    const struct embd_table_constraints *constraints, uint32_t num_tables,
		    const struct embd_topology *topo, const struct embd_plan_options *options,
		    struct embd_plan **out, char *err, size_t err_len)
{
	struct planner p = { .tables = tables, .constraints = constraints, .n = num_tables,
			     .topo = topo };
	uint32_t *choice = NULL, *best_choice = NULL;
	struct embd_plan *plan = NULL;
	int rc;

	*out = NULL;
	rc = embd_plan_topology_validate(topo, err, err_len);
	if (rc)
		return rc;
	if (!num_tables)
		return embd_fail(err, err_len, EMBD_EINVAL, "no tables to plan");
	p.W = (uint32_t)topo->world_size;
	p.L = (uint32_t)topo->local_world_size;
	p.nodes = p.W / p.L;
	p.hbm_budget = planner_hbm_budget(topo, tables, constraints, num_tables);
	p.ddr_cap = topo->ddr_cap_bytes;
	rc = enumerate(&p, err, err_len);
	if (!rc)
		rc = check_tables_fit(&p, err, err_len);
	if (!rc)
		rc = planner_alloc(&p);
	if (rc)
		goto out;
	choice = malloc(num_tables * sizeof(*choice));
	best_choice = malloc(num_tables * sizeof(*best_choice));
	plan = calloc(1, sizeof(*plan));
	if (!choice || !best_choice || !plan) {
		rc = EMBD_ENOMEM;
		goto out;
	}

	/*
	 * Proposals: greedy (least total perf per table), the search proposer (caps on the
	 * slowest shard at multiples of the lower bound, so big tables split until the ranks
	 * can balance), and memory-first. Each goes through every partitioner.
	 */
	static const double search_factors[] = { 1.0, 1.25, 1.5, 2, 3, 4, 6, 8, 16, 64 };
	size_t nsearch = options && options->greedy_only ? 0 :
			 sizeof(search_factors) / sizeof(search_factors[0]);
	double lb = perf_lower_bound(&p);
	struct result best = { 0 }, memory_res = { 0 };
	enum partitioner best_kind = PART_GREEDY_PERF;
	const char *best_name = NULL;
	for (size_t k = 0; k < nsearch + 2; k++) {
		bool memory_first = k == nsearch + 1;
		double cap = k == 0 ? INFINITY : memory_first ? 0 : lb * search_factors[k - 1];
		const char *name = k == 0 ? "greedy" : memory_first ? "memory_first" : "search";
		propose(&p, cap, memory_first, choice);
		for (int kind = 0; kind < PART_COUNT; kind++) {
			struct result res;
			planner_partition(&p, choice, (enum partitioner)kind, SEARCH_REFINE_STEPS, NULL,
					  NULL, &res);
			if (memory_first && kind == PART_MEMORY_BALANCED)
				memory_res = res;
			if (!best_name || better(&res, &best)) {
				best = res;
				best_kind = (enum partitioner)kind;
				best_name = name;
				memcpy(best_choice, choice, num_tables * sizeof(*choice));
			}
		}
	}
	if (!best.feasible) {
		const struct result *r = &memory_res;
		rc = embd_fail(err, err_len, EMBD_EINFEASIBLE,
				 "no feasible placement: with every table at its smallest shards, "
				 "table '%s' needs %llu bytes of %s on a rank that has %llu left: short "
				 "by %llu bytes (the tables together need more than the %u ranks hold)",
				 tables[r->fail_table].name, (unsigned long long)r->fail_need_bytes,
				 r->fail_ddr ? "DDR" : "HBM", (unsigned long long)r->fail_room_bytes,
				 (unsigned long long)(r->fail_need_bytes > r->fail_room_bytes ?
				 r->fail_need_bytes - r->fail_room_bytes : 0), p.W);
		goto out;
	}
	plan->version = PLAN_SCHEMA_VERSION;
	plan->topology = *topo;
	plan->tables_hash = embd_plan_tables_hash(tables, num_tables);
	plan->proposer = best_name;
	plan->partitioner = planner_partitioner_names[best_kind];
	rc = materialize(&p, best_choice, best_kind, plan);
	if (!rc)
		rc = embd_plan_check(plan, tables, constraints, num_tables, err, err_len);
out:
	planner_free(&p);
	free(choice);
	free(best_choice);
	if (rc)
		embd_plan_destroy(plan);
	else
		*out = plan;
	return rc;
}
