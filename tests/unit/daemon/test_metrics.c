/*
 * The Prometheus endpoint (daemon/metrics.h): the exposition text (names, label escaping,
 * cumulative histogram buckets, the optional parts), metrics_listen's form, and the HTTP side
 * over a real socket (GET /metrics, 404, GET only, a port in use refused).
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/metrics.h"

static char *text_of(const struct embd_metrics_snapshot *s)
{
	char *text = NULL;
	size_t len = 0;

	cr_assert_eq(embd_metrics_text(s, &text, &len), 0);
	cr_assert_eq(strlen(text), len);
	return text;
}

static void has(const char *text, const char *line)
{
	cr_assert_not_null(strstr(text, line), "expected the line '%s' in:\n%s", line, text);
}

Test(metrics, names_types_and_values)
{
	struct embd_stats_table tables[2] = { { .name = "user_id", .lookups = 60 },
		{ .name = "item_id", .lookups = 7, .cached = true, .cache_hits = 9, .cache_misses = 3 } };
	struct embd_stats_rank ranks[2] = { { 0, 0, 4096 }, { 1, 1, 8192 } };
	struct embd_metrics_snapshot s = {
		.uptime_s = 2.5, .step = 11, .steps = 10, .aborted_steps = 1, .ids = 500,
		.bytes_in = 100, .bytes_out = 200, .sent_bytes = 300,
		.partial_device_bytes = 400, .partial_host_bytes = 7, .clients = 2,
		.num_tables = 2, .tables = tables, .num_ranks = 2, .ranks = ranks,
		.phase_total_ns = { 1500000000, 250000000, 2000000000 } };
	s.refusals[embd_stats_cause(EMBD_EAGAIN)] = 4;
	char *text = text_of(&s);

	has(text, "# TYPE embd_steps_total counter\nembd_steps_total 10\n");
	has(text, "# HELP embd_steps_total ");
	has(text, "\nembd_aborted_steps_total 1\n");
	has(text, "\nembd_step 11\n");
	has(text, "\nembd_uptime_seconds 2.5\n");
	has(text, "\nembd_ids_total 500\n");
	has(text, "\nembd_lookups_total{table=\"user_id\"} 60\n");
	has(text, "\nembd_lookups_total{table=\"item_id\"} 7\n");
	has(text, "# TYPE embd_cache_lookups_total counter\n");
	has(text, "\nembd_cache_lookups_total{table=\"item_id\",result=\"hit\"} 9\n");
	has(text, "\nembd_cache_lookups_total{table=\"item_id\",result=\"miss\"} 3\n");
	cr_assert_null(strstr(text, "embd_cache_lookups_total{table=\"user_id\""), "%s", text);
	has(text, "# TYPE embd_step_phase_seconds_total counter\n");
	has(text, "\nembd_step_phase_seconds_total{phase=\"forward\"} 1.5\n");
	has(text, "\nembd_step_phase_seconds_total{phase=\"trainers\"} 0.25\n");
	has(text, "\nembd_step_phase_seconds_total{phase=\"backward\"} 2\n");
	has(text, "\nembd_bytes_total{link=\"trainer_in\"} 100\n");
	has(text, "\nembd_bytes_total{link=\"trainer_out\"} 200\n");
	has(text, "\nembd_bytes_total{link=\"peer_out\"} 300\n");
	has(text, "\nembd_bytes_total{link=\"rank_device\"} 400\n");
	has(text, "\nembd_bytes_total{link=\"rank_host\"} 7\n");
	has(text, "\nembd_rank_memory_bytes{rank=\"1\",numa_node=\"1\"} 8192\n");
	has(text, "\nembd_clients_connected 2\n");
	has(text, "\nembd_refusals_total{cause=\"EAGAIN\"} 4\n");
	has(text, "\nembd_refusals_total{cause=\"other\"} 0\n");
	has(text, "\nembd_info{version=\"" EMBD_VERSION "\"} 1\n");
	/* without checkpoints or a cluster their figures are absent, not zero */
	cr_assert_null(strstr(text, "embd_checkpoint"), "%s", text);
	cr_assert_null(strstr(text, "embd_cluster"), "%s", text);
	/* every line: a comment or "name[{labels}] value", no blank lines */
	for (char *line = text; *line; line = strchr(line, '\n') + 1) {
		cr_assert(line[0] == '#' || !strncmp(line, "embd_", 5), "bad line: %.80s", line);
		cr_assert_not_null(strchr(line, '\n'), "the text ends with a newline");
	}
	free(text);
}

Test(metrics, label_values_escaped)
{
	struct embd_stats_table tables[1] = { { .name = "a\"b\\c\nd", .lookups = 3 } };
	struct embd_metrics_snapshot s = { .num_tables = 1, .tables = tables };
	char *text = text_of(&s);

	has(text, "\nembd_lookups_total{table=\"a\\\"b\\\\c\\nd\"} 3\n");
	free(text);
}

Test(metrics, histogram_buckets_cumulative)
{
	struct embd_metrics_snapshot s = { 0 };

	/* 3 samples <= 50 us, 2 in (100 us, 250 us], 1 above the last bound */
	s.step_hist.count[0] = 3;
	s.step_hist.count[2] = 2;
	s.step_hist.count[EMBD_STATS_BUCKETS] = 1;
	s.step_hist.total = 6;
	s.step_hist.sum_ns = 1500000000;
	char *text = text_of(&s);

	has(text, "# TYPE embd_step_duration_seconds histogram\n");
	has(text, "\nembd_step_duration_seconds_bucket{le=\"5e-05\"} 3\n");
	has(text, "\nembd_step_duration_seconds_bucket{le=\"0.0001\"} 3\n");
	has(text, "\nembd_step_duration_seconds_bucket{le=\"0.00025\"} 5\n");
	has(text, "\nembd_step_duration_seconds_bucket{le=\"10\"} 5\n");
	has(text, "\nembd_step_duration_seconds_bucket{le=\"+Inf\"} 6\n");
	has(text, "\nembd_step_duration_seconds_sum 1.5\n");
	has(text, "\nembd_step_duration_seconds_count 6\n");
	has(text, "\nembd_request_duration_seconds_bucket{le=\"+Inf\"} 0\n");
	free(text);
}

Test(metrics, checkpoint_and_cluster_parts)
{
	struct embd_metrics_snapshot s = {
		.checkpoints = true, .ckpt_ok = 3, .ckpt_failed = 1, .ckpt_write_ms_sum = 1500,
		.ckpt_last_write_ms = 250, .ckpt_last_step = 40, .ckpt_in_progress = true,
		.cluster = true, .generation = 2, .applied_step = 41, .node = 1, .state = 1 };
	char *text = text_of(&s);

	has(text, "\nembd_checkpoints_total{result=\"ok\"} 3\n");
	has(text, "\nembd_checkpoints_total{result=\"failed\"} 1\n");
	has(text, "# TYPE embd_checkpoint_write_duration_seconds summary\n");
	has(text, "\nembd_checkpoint_write_duration_seconds_sum 1.5\n");
	has(text, "\nembd_checkpoint_write_duration_seconds_count 3\n");
	has(text, "\nembd_checkpoint_last_write_seconds 0.25\n");
	has(text, "\nembd_checkpoint_last_step 40\n");
	has(text, "\nembd_checkpoint_in_progress 1\n");
	has(text, "\nembd_cluster_generation 2\n");
	has(text, "\nembd_cluster_applied_step 41\n");
	has(text, "\nembd_cluster_state{state=\"running\"} 0\n");
	has(text, "\nembd_cluster_state{state=\"forming\"} 1\n");
	free(text);
}

Test(metrics, listen_form)
{
	struct sockaddr_storage a;
	const char *good[] = { "127.0.0.1:9464", "0.0.0.0:1", "[::1]:65535", "[::]:9464" };
	const char *bad[] = { "127.0.0.1", ":9464", "127.0.0.1:0", "127.0.0.1:65536",
			      "localhost:9464", "::1:9464", "[::1:9464", "127.0.0.1:94x",
			      "127.0.0.1:+94", "127.0.0.1:", "[]:9464" };

	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++)
		cr_assert(embd_config_listen_addr(good[i], &a), "refused %s", good[i]);
	cr_assert_eq(a.ss_family, AF_INET6);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_assert(!embd_config_listen_addr(bad[i], &a), "took %s", bad[i]);
}

/* ---- over HTTP ---- */

/* A bound loopback port nobody listens on: free until we close it. */
static int free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int fd = socket(AF_INET, SOCK_STREAM, 0);

	cr_assert(fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof(a)) &&
		  !getsockname(fd, (struct sockaddr *)&a, &len));
	close(fd);
	return ntohs(a.sin_port);
}

/* One HTTP/1.0 request; the whole answer (status line, headers, body), malloc'ed. */
static char *http(int port, const char *request)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	size_t len = 0, cap = 1 << 16;
	char *buf = malloc(cap);
	ssize_t n;

	cr_assert(fd >= 0 && buf);
	cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	cr_assert_eq(write(fd, request, strlen(request)), (ssize_t)strlen(request));
	while ((n = read(fd, buf + len, cap - len - 1)) > 0) {
		len += (size_t)n;
		if (len + 1 == cap)
			buf = realloc(buf, cap *= 2);
	}
	buf[len] = 0;
	close(fd);
	return buf;
}

Test(metrics, serves_the_published_snapshot)
{
	const char *names[] = { "user_id" };
	char listen[64], err[256] = "";
	struct embd_metrics *m = NULL;
	int port = free_port();

	snprintf(listen, sizeof(listen), "127.0.0.1:%d", port);
	cr_assert_eq(embd_metrics_create(listen, 1, names, 1, &m, err, sizeof(err)), 0, "%s", err);
	char *before = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
	has(before, " 200 OK\r\n");
	has(before, "text/plain; version=0.0.4");
	has(before, "\nembd_steps_total 0\n");

	struct embd_metrics_snapshot *d = embd_metrics_draft(m);
	d->steps = 42;
	d->tables[0].lookups = 9;
	d->ranks[0].memory_bytes = 1024;
	cr_assert(embd_metrics_publish(m));
	d->steps = 43;          /* a draft not published is not seen */
	char *after = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
	has(after, "\nembd_steps_total 42\n");
	has(after, "\nembd_lookups_total{table=\"user_id\"} 9\n");
	has(after, "\nembd_rank_memory_bytes{rank=\"0\",numa_node=\"0\"} 1024\n");

	char *other = http(port, "GET /other HTTP/1.0\r\n\r\n");
	has(other, " 404 ");
	char *post = http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 2\r\n\r\nab");
	has(post, " 405 ");
	has(post, "Allow: GET");
	free(before);
	free(after);
	free(other);
	free(post);

	/* the port is taken now: a second endpoint there is refused, naming the key */
	struct embd_metrics *m2 = NULL;
	cr_assert_eq(embd_metrics_create(listen, 1, names, 1, &m2, err, sizeof(err)), EMBD_EIO);
	cr_assert_null(m2);
	cr_assert_not_null(strstr(err, "metrics_listen"), "%s", err);
	cr_assert_not_null(strstr(err, "in use"), "%s", err);
	embd_metrics_destroy(m);
}

Test(metrics, malformed_listen_refused)
{
	char err[256] = "";
	struct embd_metrics *m = NULL;

	cr_assert_eq(embd_metrics_create("localhost:9464", 0, NULL, 0, &m, err, sizeof(err)),
		     EMBD_EINVAL);
	cr_assert_not_null(strstr(err, "metrics_listen"), "%s", err);
	embd_metrics_destroy(NULL);
}
