/*
 * Service counters and their JSON (daemon/stats.h). Latencies go into fixed windows of the
 * most recent samples, so a percentile costs one sort of at most EMBD_STATS_WINDOW values and
 * only when someone asks; recording a sample is a store.
 */
#include "daemon/stats.h"
#include "common/clock.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* 50 us .. 10 s: a CPU step of a small model takes ~100 us, a cluster's step with a slow
 * peer seconds. */
const uint64_t embd_stats_bucket_ns[EMBD_STATS_BUCKETS] = {
	50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 25000000,
	50000000, 100000000, 250000000, 500000000, 1000000000, 2500000000, 10000000000,
};

static const struct {
	int code;
	const char *name;
} causes[EMBD_STATS_CAUSES - 1] = {
	{ EMBD_EINVAL, "EINVAL" }, { EMBD_ENOMEM, "ENOMEM" }, { EMBD_ERANGE, "ERANGE" },
	{ EMBD_ENOENT, "ENOENT" }, { EMBD_EIO, "EIO" }, { EMBD_EACCES, "EACCES" },
	{ EMBD_ETIMEDOUT, "ETIMEDOUT" }, { EMBD_EPROTO, "EPROTO" },
	{ EMBD_ECONNRESET, "ECONNRESET" }, { EMBD_ENOSPC, "ENOSPC" }, { EMBD_EBUSY, "EBUSY" },
	{ EMBD_EAGAIN, "EAGAIN" }, { EMBD_ECANCELED, "ECANCELED" }, { EMBD_ENOTSUP, "ENOTSUP" },
	{ EMBD_EPARSE, "EPARSE" }, { EMBD_EMISMATCH, "EMISMATCH" },
	{ EMBD_EINFEASIBLE, "EINFEASIBLE" }, { EMBD_ECHECKSUM, "ECHECKSUM" },
	{ EMBD_ERESUMED, "ERESUMED" },
};

uint32_t embd_stats_cause(int code)
{
	for (uint32_t i = 0; i < EMBD_STATS_CAUSES - 1; i++)
		if (causes[i].code == code)
			return i;
	return EMBD_STATS_CAUSES - 1;
}

const char *embd_stats_cause_name(uint32_t cause)
{
	return cause < EMBD_STATS_CAUSES - 1 ? causes[cause].name : "other";
}

static void hist_add(struct embd_stats_hist *h, uint64_t ns)
{
	uint32_t b = 0;

	while (b < EMBD_STATS_BUCKETS && ns > embd_stats_bucket_ns[b])
		b++;
	h->count[b]++;
	h->sum_ns += ns;
	h->total++;
}

const char *const embd_stats_phase_names[EMBD_STATS_PHASES] = { "forward", "trainers",
								  "backward" };

void embd_stats_init(struct embd_stats *s)
{
	memset(s, 0, sizeof(*s));
	s->start_ns = embd_now_ns();
}

void embd_stats_step(struct embd_stats *s, const struct embd_step_counts *c, uint64_t latency_ns,
		     const struct embd_stats_phases *phases)
{
	const uint64_t at = s->num_step % EMBD_STATS_WINDOW;

	s->phase_ns[0][at] = phases->forward_ns;
	s->phase_ns[1][at] = phases->trainers_ns;
	s->phase_ns[2][at] = phases->backward_ns;
	for (int k = 0; k < EMBD_STATS_PHASES; k++)
		s->phase_total_ns[k] += s->phase_ns[k][at];
	s->steps++;
	s->nonfinite_grads += c->nonfinite_grads;
	s->nonfinite_rows += c->nonfinite_rows;
	s->lookups += c->lookups;
	s->ids += c->ids;
	s->bytes_in += c->input_bytes;
	s->bytes_out += c->output_bytes;
	s->sent_bytes += c->sent_bytes;
	s->partial_device_bytes += c->partial_device_bytes;
	s->partial_host_bytes += c->partial_host_bytes;
	s->backward_prepares += c->backward_prepares;
	s->backward_shared_shards += c->backward_shared_shards;
	s->step_ns[s->num_step++ % EMBD_STATS_WINDOW] = latency_ns;
	hist_add(&s->step_hist, latency_ns);
}

void embd_stats_request(struct embd_stats *s, uint64_t latency_ns, int result)
{
	s->ipc_ns[s->num_ipc++ % EMBD_STATS_WINDOW] = latency_ns;
	hist_add(&s->ipc_hist, latency_ns);
	if (result < 0)
		s->refusals[embd_stats_cause(result)]++;
}

static int compare_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Percentile p (0..100) of the window, nearest rank, in microseconds. */
static double percentile_us(const uint64_t *window, uint64_t count, double p)
{
	uint64_t n = count < EMBD_STATS_WINDOW ? count : EMBD_STATS_WINDOW;
	uint64_t sorted[EMBD_STATS_WINDOW];

	if (!n)
		return 0;
	memcpy(sorted, window, n * sizeof(uint64_t));
	qsort(sorted, n, sizeof(uint64_t), compare_u64);
	uint64_t rank = (uint64_t)(p / 100.0 * (double)n + 0.999999);
	rank = rank < 1 ? 1 : rank > n ? n : rank;
	return (double)sorted[rank - 1] / 1000.0;
}

static double uptime_s(const struct embd_stats *s)
{
	return (double)(embd_now_ns() - s->start_ns) / 1e9;
}

static int print(cJSON *root, char **out)
{
	*out = root ? cJSON_PrintUnformatted(root) : NULL;
	cJSON_Delete(root);
	return *out ? 0 : EMBD_ENOMEM;
}

int embd_stats_json(const struct embd_stats *s, const struct embd_stats_rank *ranks,
		    uint32_t num_ranks, const struct embd_stats_table *tables,
		    uint32_t num_tables, const struct embd_stats_client *clients,
		    uint32_t num_clients, char **out)
{
	cJSON *root = cJSON_CreateObject(), *arr, *obj;
	double up = uptime_s(s);
	double per_s = up > 0 ? 1.0 / up : 0;

	*out = NULL;
	if (!root)
		return EMBD_ENOMEM;
	cJSON_AddNumberToObject(root, "uptime_s", up);
	cJSON_AddNumberToObject(root, "steps", (double)s->steps);
	cJSON_AddNumberToObject(root, "aborted_steps", (double)s->aborted_steps);
	cJSON_AddNumberToObject(root, "nonfinite_grads", (double)s->nonfinite_grads);
	cJSON_AddNumberToObject(root, "nonfinite_rows", (double)s->nonfinite_rows);
	cJSON_AddNumberToObject(root, "step_timeouts", (double)s->step_timeouts);
	cJSON_AddNumberToObject(root, "pipelined_steps", (double)s->pipelined_steps);
	cJSON_AddNumberToObject(root, "overlapped_steps", (double)s->overlapped_steps);
	cJSON_AddNumberToObject(root, "lookups", (double)s->lookups);
	cJSON_AddNumberToObject(root, "lookups_per_s", (double)s->lookups * per_s);
	cJSON_AddNumberToObject(root, "ids", (double)s->ids);
	cJSON_AddNumberToObject(root, "ids_per_s", (double)s->ids * per_s);
	cJSON_AddNumberToObject(root, "bytes_in", (double)s->bytes_in);
	cJSON_AddNumberToObject(root, "bytes_out", (double)s->bytes_out);
	cJSON_AddNumberToObject(root, "sent_bytes", (double)s->sent_bytes);
	cJSON_AddNumberToObject(root, "partial_device_bytes", (double)s->partial_device_bytes);
	cJSON_AddNumberToObject(root, "partial_host_bytes", (double)s->partial_host_bytes);
	cJSON_AddNumberToObject(root, "backward_prepares", (double)s->backward_prepares);
	cJSON_AddNumberToObject(root, "backward_shared_shards", (double)s->backward_shared_shards);
	cJSON_AddNumberToObject(root, "requests", (double)s->ipc_hist.total);
	cJSON_AddNumberToObject(root, "step_p50_us", percentile_us(s->step_ns, s->num_step, 50));
	cJSON_AddNumberToObject(root, "step_p99_us", percentile_us(s->step_ns, s->num_step, 99));
	cJSON *phases = cJSON_AddObjectToObject(root, "step_phases_p50_us");
	for (int k = 0; phases && k < EMBD_STATS_PHASES; k++)
		cJSON_AddNumberToObject(phases, embd_stats_phase_names[k],
					percentile_us(s->phase_ns[k], s->num_step, 50));
	cJSON_AddNumberToObject(root, "ipc_p50_us", percentile_us(s->ipc_ns, s->num_ipc, 50));
	cJSON_AddNumberToObject(root, "ipc_p99_us", percentile_us(s->ipc_ns, s->num_ipc, 99));
	arr = cJSON_AddArrayToObject(root, "ranks");
	for (uint32_t i = 0; arr && i < num_ranks; i++) {
		cJSON *o = cJSON_CreateObject();
		cJSON_AddItemToArray(arr, o);
		cJSON_AddNumberToObject(o, "rank", ranks[i].rank);
		cJSON_AddNumberToObject(o, "numa_node", ranks[i].numa_node);
		cJSON_AddNumberToObject(o, "memory_bytes", (double)ranks[i].memory_bytes);
	}
	arr = cJSON_AddArrayToObject(root, "tables");
	for (uint32_t i = 0; arr && i < num_tables; i++) {
		cJSON *o = cJSON_CreateObject();
		cJSON_AddItemToArray(arr, o);
		cJSON_AddStringToObject(o, "name", tables[i].name);
		cJSON_AddNumberToObject(o, "lookups", (double)tables[i].lookups);
		if (!tables[i].cached)
			continue;
		uint64_t h = tables[i].cache_hits, m = tables[i].cache_misses;
		cJSON_AddNumberToObject(o, "cache_hits", (double)h);
		cJSON_AddNumberToObject(o, "cache_misses", (double)m);
		cJSON_AddNumberToObject(o, "cache_hit_rate", h + m ? (double)h / (double)(h + m) : 0);
	}
	obj = cJSON_AddObjectToObject(root, "refusals");
	for (uint32_t i = 0; obj && i < EMBD_STATS_CAUSES; i++)
		if (s->refusals[i])
			cJSON_AddNumberToObject(obj, embd_stats_cause_name(i), (double)s->refusals[i]);
	arr = cJSON_AddArrayToObject(root, "clients");
	for (uint32_t i = 0; arr && i < num_clients; i++) {
		const struct embd_stats_client *c = &clients[i];
		cJSON *o = cJSON_CreateObject();
		cJSON_AddItemToArray(arr, o);
		cJSON_AddNumberToObject(o, "index", c->index);
		cJSON_AddNumberToObject(o, "pid", c->pid);
		cJSON_AddNumberToObject(o, "uid", c->uid);
		cJSON_AddNumberToObject(o, "sq_used", c->sq_used);
		cJSON_AddNumberToObject(o, "sq_entries", c->sq_entries);
		cJSON_AddNumberToObject(o, "cq_used", c->cq_used);
		cJSON_AddNumberToObject(o, "cq_entries", c->cq_entries);
		cJSON_AddNumberToObject(o, "requests", (double)c->requests);
		cJSON_AddNumberToObject(o, "errors", (double)c->errors);
		cJSON_AddNumberToObject(o, "stalling_ms", (double)c->stalling_ms);
	}
	return print(root, out);
}

int embd_stats_status_json(const struct embd_stats *s, const struct embd_config *config,
			   uint64_t step, uint64_t plan_hash, uint32_t num_clients, char **out)
{
	cJSON *root = cJSON_CreateObject(), *c;
	char hash[17];

	*out = NULL;
	if (!root)
		return EMBD_ENOMEM;
	snprintf(hash, sizeof(hash), "%016" PRIx64, plan_hash);
	cJSON_AddStringToObject(root, "version", EMBD_VERSION);
	cJSON_AddNumberToObject(root, "uptime_s", uptime_s(s));
	cJSON_AddNumberToObject(root, "step", (double)step);
	cJSON_AddStringToObject(root, "plan_hash", hash);
	cJSON_AddNumberToObject(root, "clients", num_clients);
	c = cJSON_AddObjectToObject(root, "config");
	if (c) {
		cJSON_AddStringToObject(c, "socket_path", config->socket_path);
		cJSON_AddNumberToObject(c, "num_tables", config->tables.count);
		cJSON_AddNumberToObject(c, "world_size", config->topology.world_size);
		cJSON_AddNumberToObject(c, "local_world_size", config->topology.local_world_size);
		cJSON_AddNumberToObject(c, "trainers_per_node", config->trainers_per_node);
		cJSON_AddNumberToObject(c, "threads_per_rank", config->threads_per_rank);
		cJSON_AddNumberToObject(c, "batch_size", config->topology.batch_size);
		cJSON_AddNumberToObject(c, "busy_poll_us", config->busy_poll_us);
		cJSON_AddStringToObject(c, "checkpoint_dir", config->checkpoint_dir);
		cJSON_AddStringToObject(c, "log_level", embd_log_level_name(config->log_level));
	}
	return print(root, out);
}
