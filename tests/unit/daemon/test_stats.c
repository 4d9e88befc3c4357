/*
 * Stats (daemon/stats.h): the STATS and STATUS JSON parse back, carry every documented
 * field with the values recorded, and the latency percentiles follow the samples.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/stats.h"

static double num(const cJSON *o, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
	cr_assert(cJSON_IsNumber(v), "field '%s' missing or not a number", key);
	return v->valuedouble;
}

Test(stats, json_fields_and_percentiles)
{
	struct embd_stats *s = malloc(sizeof(*s));
	char *text = NULL;

	cr_assert_not_null(s);
	embd_stats_init(s);
	/* steps of 1..100 us: p50 = 50 us, p99 = 99 us (nearest rank) */
	for (uint64_t i = 1; i <= 100; i++) {
		struct embd_step_counts c = { .ids = 10, .lookups = 20, .input_bytes = 100,
					      .output_bytes = 200, .nonfinite_grads = i == 7,
					      .nonfinite_rows = i % 10 == 0 ? 3 : 0,
					      .sent_bytes = 3, .partial_device_bytes = 5,
					      .partial_host_bytes = 1, .backward_prepares = 2,
					      .backward_shared_shards = 4 };
		const struct embd_stats_phases ph = { .forward_ns = i * 300, .trainers_ns = i * 200,
						      .backward_ns = i * 500 };
		embd_stats_step(s, &c, i * 1000, &ph);
		embd_stats_request(s, (101 - i) * 10, i % 10 == 0 ? EMBD_EAGAIN : 0);
	}
	s->aborted_steps = 2;
	s->step_timeouts = 1;
	struct embd_stats_rank ranks[2] = { { 0, 0, 4096 }, { 1, 1, 8192 } };
	struct embd_stats_client clients[1] = { { .index = 1, .pid = 42, .uid = 7, .sq_used = 3,
		.sq_entries = 64, .cq_used = 1, .cq_entries = 64, .requests = 9, .errors = 2,
		.stalling_ms = 12000 } };
	struct embd_stats_table tables[2] = { { .name = "user_id", .lookups = 60 },
		{ .name = "item_id", .lookups = 7, .cached = true, .cache_hits = 9, .cache_misses = 3 } };
	cr_assert_eq(embd_stats_json(s, ranks, 2, tables, 2, clients, 1, &text), 0);
	cJSON *root = cJSON_Parse(text);
	cr_assert_not_null(root, "not JSON: %s", text);
	cr_assert_eq(num(root, "steps"), 100);
	cr_assert_eq(num(root, "aborted_steps"), 2);
	cr_assert_eq(num(root, "nonfinite_grads"), 1);
	cr_assert_eq(num(root, "nonfinite_rows"), 30);
	cr_assert_eq(num(root, "step_timeouts"), 1);
	cr_assert_eq(num(root, "ids"), 1000);
	cr_assert_eq(num(root, "lookups"), 2000);
	cr_assert_eq(num(root, "bytes_in"), 10000);
	cr_assert_eq(num(root, "bytes_out"), 20000);
	cr_assert_eq(num(root, "sent_bytes"), 300);
	cr_assert_eq(num(root, "partial_device_bytes"), 500);
	cr_assert_eq(num(root, "partial_host_bytes"), 100);
	cr_assert_eq(num(root, "backward_prepares"), 200);
	cr_assert_eq(num(root, "backward_shared_shards"), 400);
	cJSON *phases = cJSON_GetObjectItemCaseSensitive(root, "step_phases_p50_us");
	cr_assert_not_null(phases, "no step_phases_p50_us: %s", text);
	cr_assert_eq(num(phases, "forward"), 15.0);     /* 50 x 300 ns */
	cr_assert_eq(num(phases, "trainers"), 10.0);
	cr_assert_eq(num(phases, "backward"), 25.0);
	cr_assert_eq(num(root, "requests"), 100);
	const cJSON *refusals = cJSON_GetObjectItemCaseSensitive(root, "refusals");
	cr_assert_eq(num(refusals, "EAGAIN"), 10);
	cr_assert_eq(cJSON_GetArraySize(refusals), 1, "causes never seen are left out: %s", text);
	const cJSON *t = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "tables"), 1);
	cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(t, "name")->valuestring, "item_id");
	cr_assert_eq(num(t, "lookups"), 7);
	/* a fused_uvm_caching table has its cache's counts; the others none */
	cr_assert_eq(num(t, "cache_hits"), 9);
	cr_assert_eq(num(t, "cache_misses"), 3);
	cr_assert_float_eq(num(t, "cache_hit_rate"), 0.75, 1e-12);
	const cJSON *t0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "tables"), 0);
	cr_assert_null(cJSON_GetObjectItemCaseSensitive(t0, "cache_hits"), "%s", text);
	cr_assert_gt(num(root, "ids_per_s"), 0);
	cr_assert_gt(num(root, "lookups_per_s"), num(root, "ids_per_s"));
	cr_assert_gt(num(root, "uptime_s"), 0);
	cr_assert_eq(num(root, "step_p50_us"), 50, "got %g", num(root, "step_p50_us"));
	cr_assert_eq(num(root, "step_p99_us"), 99, "got %g", num(root, "step_p99_us"));
	cr_assert_float_eq(num(root, "ipc_p50_us"), 0.5, 1e-9, "got %g", num(root, "ipc_p50_us"));
	cr_assert_float_eq(num(root, "ipc_p99_us"), 0.99, 1e-9, "got %g", num(root, "ipc_p99_us"));
	/* histograms: 1..100 us steps; bounds 50 us and 100 us take 50 and 50 */
	cr_assert_eq(s->step_hist.count[0], 50);
	cr_assert_eq(s->step_hist.count[1], 50);
	cr_assert_eq(s->step_hist.total, 100);
	cr_assert_eq(s->step_hist.sum_ns, 5050 * 1000);
	const cJSON *r = cJSON_GetObjectItemCaseSensitive(root, "ranks");
	cr_assert_eq(cJSON_GetArraySize(r), 2);
	cr_assert_eq(num(cJSON_GetArrayItem(r, 1), "memory_bytes"), 8192);
	cr_assert_eq(num(cJSON_GetArrayItem(r, 1), "numa_node"), 1);
	const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "clients"), 0);
	cr_assert_not_null(c);
	const char *keys[] = { "index", "pid", "uid", "sq_used", "sq_entries", "cq_used",
			       "cq_entries", "requests", "errors", "stalling_ms" };
	double want[] = { 1, 42, 7, 3, 64, 1, 64, 9, 2, 12000 };
	for (int i = 0; i < 10; i++)
		cr_assert_eq(num(c, keys[i]), want[i], "client %s: expected %g, got %g", keys[i],
			     want[i], num(c, keys[i]));
	cJSON_Delete(root);
	free(text);
	free(s);
}

Test(stats, refusals_by_cause)
{
	struct embd_stats *s = malloc(sizeof(*s));

	embd_stats_init(s);
	embd_stats_request(s, 10, EMBD_ERESUMED);
	embd_stats_request(s, 10, EMBD_ECHECKSUM);
	embd_stats_request(s, 10, -77777);       /* not a code of types.h */
	embd_stats_request(s, 10, 0);
	cr_assert_eq(s->refusals[embd_stats_cause(EMBD_ERESUMED)], 1);
	cr_assert_str_eq(embd_stats_cause_name(embd_stats_cause(EMBD_ECHECKSUM)), "ECHECKSUM");
	cr_assert_eq(s->refusals[EMBD_STATS_CAUSES - 1], 1);
	cr_assert_str_eq(embd_stats_cause_name(EMBD_STATS_CAUSES - 1), "other");
	uint64_t sum = 0;
	for (uint32_t i = 0; i < EMBD_STATS_CAUSES; i++)
		sum += s->refusals[i];
	cr_assert_eq(sum, 3);
	cr_assert_eq(s->ipc_hist.total, 4);
	free(s);
}

Test(stats, window_keeps_the_latest_samples)
{
	struct embd_stats *s = malloc(sizeof(*s));
	char *text = NULL;
	struct embd_step_counts zero = { 0 };
	const struct embd_stats_phases slow = { 500000, 200000, 300000 }, fast = { 900, 400, 700 };

	embd_stats_init(s);
	/* old slow steps fall out of the window, their phases with them */
	for (int i = 0; i < EMBD_STATS_WINDOW; i++)
		embd_stats_step(s, &zero, 1000000, &slow);
	for (int i = 0; i < EMBD_STATS_WINDOW; i++)
		embd_stats_step(s, &zero, 2000, &fast);
	cr_assert_eq(embd_stats_json(s, NULL, 0, NULL, 0, NULL, 0, &text), 0);
	cJSON *root = cJSON_Parse(text);
	cr_assert_eq(num(root, "step_p99_us"), 2, "got %g", num(root, "step_p99_us"));
	const cJSON *phases = cJSON_GetObjectItemCaseSensitive(root, "step_phases_p50_us");
	cr_assert_eq(num(phases, "forward"), 0.9, "got %g", num(phases, "forward"));
	cr_assert_eq(num(phases, "trainers"), 0.4, "got %g", num(phases, "trainers"));
	cr_assert_eq(num(phases, "backward"), 0.7, "got %g", num(phases, "backward"));
	cr_assert_eq(num(root, "ipc_p50_us"), 0, "no requests: expected 0");
	cJSON_Delete(root);
	free(text);
	free(s);
}

Test(stats, status_json)
{
	struct embd_stats s;
	struct embd_config config;
	char err[256], *text = NULL;

	embd_stats_init(&s);
	cr_assert_eq(embd_config_parse(embd_config_default_text(),
				       strlen(embd_config_default_text()), &config, err,
				       sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_stats_status_json(&s, &config, 17, 0x0123456789abcdefull, 2, &text), 0);
	cJSON *root = cJSON_Parse(text);
	cr_assert_not_null(root);
	cr_assert_str_eq(cJSON_GetObjectItem(root, "version")->valuestring, EMBD_VERSION);
	cr_assert_str_eq(cJSON_GetObjectItem(root, "plan_hash")->valuestring, "0123456789abcdef");
	cr_assert_eq(num(root, "step"), 17);
	cr_assert_eq(num(root, "clients"), 2);
	const cJSON *c = cJSON_GetObjectItem(root, "config");
	cr_assert_eq(num(c, "num_tables"), 4);
	cr_assert_eq(num(c, "local_world_size"), 2);
	cr_assert_str_eq(cJSON_GetObjectItem(c, "socket_path")->valuestring,
			 EMBD_CONFIG_DEFAULT_SOCKET);
	cJSON_Delete(root);
	free(text);
	embd_config_free(&config);
}
