/*
 * The Prometheus endpoint (daemon/metrics.h). Two copies of the snapshot: the draft, which the
 * event loop fills, and the published one, which scrapes read. Publishing copies draft ->
 * published under a mutex the loop only try-locks, and a scrape holds it only to copy the
 * published one out, so the loop never waits on a scrape and formatting (the slow part) runs on
 * libmicrohttpd's thread with no lock held.
 */
#include "daemon/metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/err.h"

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct embd_metrics {
	struct MHD_Daemon *mhd;
	int fd;                                 /* until MHD owns it */
	uint32_t num_tables, num_ranks;
	pthread_mutex_t lock;
	struct embd_metrics_snapshot draft, published;
};

/* ---- the exposition text ------------------------------------------------------------------ */

static void head(FILE *f, const char *name, const char *type, const char *help)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value: backslash, double quote and newline escaped, as the format asks. */
static void label_value(FILE *f, const char *v)
{
	fputc('"', f);
	for (; *v; v++) {
		if (*v == '\\' || *v == '"')
			fputc('\\', f);
		if (*v == '\n')
			fputs("\\n", f);
		else
			fputc(*v, f);
	}
	fputc('"', f);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v)
{
	head(f, name, "counter", help);
	fprintf(f, "%s %" PRIu64 "\n", name, v);
}

static void gauge(FILE *f, const char *name, const char *help, double v)
{
	head(f, name, "gauge", help);
	fprintf(f, "%s %.17g\n", name, v);
}

static void histogram(FILE *f, const char *name, const char *help,
		      const struct embd_stats_hist *h)
{
	uint64_t cum = 0;

	head(f, name, "histogram", help);
	for (uint32_t b = 0; b < EMBD_STATS_BUCKETS; b++) {
		cum += h->count[b];
		fprintf(f, "%s_bucket{le=\"%.9g\"} %" PRIu64 "\n", name,
			(double)embd_stats_bucket_ns[b] / 1e9, cum);
	}
	cum += h->count[EMBD_STATS_BUCKETS];
	fprintf(f, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, cum);
	fprintf(f, "%s_sum %.17g\n%s_count %" PRIu64 "\n", name, (double)h->sum_ns / 1e9, name,
		cum);
}

static void work(FILE *f, const struct embd_metrics_snapshot *s)
{
	counter(f, "embd_steps_total", "Steps whose backward completed.", s->steps);
	counter(f, "embd_aborted_steps_total", "Steps aborted (a participant hung up).",
		s->aborted_steps);
	histogram(f, "embd_step_duration_seconds", "FORWARD started to BACKWARD applied.",
		  &s->step_hist);
	head(f, "embd_step_phase_seconds_total", "counter", "The steps' time by phase: forward "
	     "(routing and lookups), trainers (their work between lookup and gradient), backward "
	     "(the update).");
	for (int k = 0; k < EMBD_STATS_PHASES; k++)
		fprintf(f, "embd_step_phase_seconds_total{phase=\"%s\"} %.17g\n",
			embd_stats_phase_names[k], (double)s->phase_total_ns[k] / 1e9);
	counter(f, "embd_requests_total", "Trainer requests completed.", s->request_hist.total);
	histogram(f, "embd_request_duration_seconds", "Request popped to completion pushed.",
		  &s->request_hist);
	head(f, "embd_refusals_total", "counter", "Requests completed with an error, by code.");
	for (uint32_t i = 0; i < EMBD_STATS_CAUSES; i++)
		fprintf(f, "embd_refusals_total{cause=\"%s\"} %" PRIu64 "\n",
			embd_stats_cause_name(i), s->refusals[i]);
	counter(f, "embd_ids_total", "Ids in the accepted batches.", s->ids);
	head(f, "embd_lookups_total", "counter", "Row reads by this node's ranks, per table.");
	for (uint32_t t = 0; t < s->num_tables; t++) {
		fputs("embd_lookups_total{table=", f);
		label_value(f, s->tables[t].name);
		fprintf(f, "} %" PRIu64 "\n", s->tables[t].lookups);
	}
	head(f, "embd_cache_lookups_total", "counter", "fused_uvm_caching tables: distinct rows "
	     "of each forward found in the HBM cache (hit) or fetched from host memory (miss).");
	for (uint32_t t = 0; t < s->num_tables; t++) {
		if (!s->tables[t].cached)
			continue;
		for (int miss = 0; miss < 2; miss++) {
			fputs("embd_cache_lookups_total{table=", f);
			label_value(f, s->tables[t].name);
			fprintf(f, ",result=\"%s\"} %" PRIu64 "\n", miss ? "miss" : "hit",
				miss ? s->tables[t].cache_misses : s->tables[t].cache_hits);
		}
	}
	head(f, "embd_bytes_total", "counter", "Bytes moved: trainer_in (KJTs read), trainer_out "
	     "(pooled written), peer_out (sent to other nodes), rank_device and rank_host "
	     "(row-split partial sums between this node's ranks, device to device or through "
	     "host memory).");
	fprintf(f, "embd_bytes_total{link=\"trainer_in\"} %" PRIu64 "\n", s->bytes_in);
	fprintf(f, "embd_bytes_total{link=\"trainer_out\"} %" PRIu64 "\n", s->bytes_out);
	fprintf(f, "embd_bytes_total{link=\"peer_out\"} %" PRIu64 "\n", s->sent_bytes);
	fprintf(f, "embd_bytes_total{link=\"rank_device\"} %" PRIu64 "\n",
		s->partial_device_bytes);
	fprintf(f, "embd_bytes_total{link=\"rank_host\"} %" PRIu64 "\n", s->partial_host_bytes);
	head(f, "embd_rank_memory_bytes", "gauge", "Memory of each local rank's shards.");
	for (uint32_t r = 0; r < s->num_ranks; r++)
		fprintf(f, "embd_rank_memory_bytes{rank=\"%u\",numa_node=\"%d\"} %" PRIu64 "\n",
			s->ranks[r].rank, s->ranks[r].numa_node, s->ranks[r].memory_bytes);
	gauge(f, "embd_clients_connected", "Trainers connected.", s->clients);
}

static void checkpoints(FILE *f, const struct embd_metrics_snapshot *s)
{
	head(f, "embd_checkpoints_total", "counter", "Checkpoint writes by result.");
	fprintf(f, "embd_checkpoints_total{result=\"ok\"} %" PRIu64 "\n", s->ckpt_ok);
	fprintf(f, "embd_checkpoints_total{result=\"failed\"} %" PRIu64 "\n", s->ckpt_failed);
	head(f, "embd_checkpoint_write_duration_seconds", "summary",
	     "Time of the checkpoint writes that succeeded.");
	fprintf(f, "embd_checkpoint_write_duration_seconds_sum %.17g\n"
		"embd_checkpoint_write_duration_seconds_count %" PRIu64 "\n",
		s->ckpt_write_ms_sum / 1e3, s->ckpt_ok);
	gauge(f, "embd_checkpoint_last_write_seconds", "The last checkpoint's write time.",
	      s->ckpt_last_write_ms / 1e3);
	gauge(f, "embd_checkpoint_last_stall_seconds", "Steps stalled by the last checkpoint.",
	      s->ckpt_last_stall_ms / 1e3);
	gauge(f, "embd_checkpoint_max_stall_seconds", "Worst snapshot copy so far.",
	      s->ckpt_max_stall_ms / 1e3);
	gauge(f, "embd_checkpoint_last_step", "Step of the last checkpoint.",
	      (double)s->ckpt_last_step);
	gauge(f, "embd_checkpoint_last_bytes", "Bytes of the last checkpoint.",
	      (double)s->ckpt_last_bytes);
	gauge(f, "embd_checkpoint_in_progress", "1 while a checkpoint is written.",
	      s->ckpt_in_progress);
}

static void cluster(FILE *f, const struct embd_metrics_snapshot *s)
{
	static const char *const states[EMBD_METRICS_CLUSTER_STATES] = {
		"running", "forming", "lost", "detached" };

	gauge(f, "embd_cluster_generation", "The cluster comm's generation.",
	      (double)s->generation);
	gauge(f, "embd_cluster_applied_step", "The step the parameters are at.",
	      (double)s->applied_step);
	gauge(f, "embd_cluster_node", "This node's rank in the cluster.", s->node);
	head(f, "embd_cluster_state", "gauge", "1 for this node's cluster state.");
	for (uint32_t i = 0; i < EMBD_METRICS_CLUSTER_STATES; i++)
		fprintf(f, "embd_cluster_state{state=\"%s\"} %d\n", states[i], s->state == i);
}

int embd_metrics_text(const struct embd_metrics_snapshot *s, char **out, size_t *len)
{
	FILE *f = open_memstream(out, len);

	if (!f)
		return EMBD_ENOMEM;
	head(f, "embd_info", "gauge", "The service's version.");
	fputs("embd_info{version=", f);
	label_value(f, EMBD_VERSION);
	fputs("} 1\n", f);
	gauge(f, "embd_uptime_seconds", "Seconds since the service started.", s->uptime_s);
	gauge(f, "embd_step", "The step being collected or run.", (double)s->step);
	work(f, s);
	if (s->checkpoints)
		checkpoints(f, s);
	if (s->cluster)
		cluster(f, s);
	if (ferror(f)) {
		fclose(f);
		free(*out);
		*out = NULL;
		return EMBD_ENOMEM;
	}
	return fclose(f) ? EMBD_ENOMEM : 0;
}

/* ---- serving ------------------------------------------------------------------------------ */

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, char *body,
			     size_t len, enum MHD_ResponseMemoryMode mode)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
	enum MHD_Result rc;

	if (!r) {
		if (mode == MHD_RESPMEM_MUST_FREE)
			free(body);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
				status == MHD_HTTP_OK ? CONTENT_TYPE : "text/plain");
	if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
		MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET");
	rc = MHD_queue_response(conn, status, r);
	MHD_destroy_response(r);
	return rc;
}

/* The published snapshot copied out (its arrays into tables and ranks, sized alike). */
static void copy_snapshot(struct embd_metrics_snapshot *to, const struct embd_metrics_snapshot *from)
{
	struct embd_stats_table *tables = to->tables;
	struct embd_stats_rank *ranks = to->ranks;

	*to = *from;
	to->tables = tables;
	to->ranks = ranks;
	memcpy(tables, from->tables, sizeof(*tables) * from->num_tables);
	memcpy(ranks, from->ranks, sizeof(*ranks) * from->num_ranks);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
			      const char *method, const char *version, const char *upload_data,
			      size_t *upload_data_size, void **con_cls)
{
	struct embd_metrics *m = cls;
	static char not_found[] = "not found: embd serves /metrics\n";
	static char only_get[] = "only GET\n";
	struct embd_metrics_snapshot s = { .num_tables = m->num_tables,
					   .num_ranks = m->num_ranks };
	char *text = NULL;
	size_t len = 0;

	(void)version;
	(void)upload_data;
	(void)con_cls;
	if (strcmp(method, MHD_HTTP_METHOD_GET)) {
		*upload_data_size = 0;  /* a body is not read: the answer is the same */
		return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, only_get, sizeof(only_get) - 1,
			     MHD_RESPMEM_PERSISTENT);
	}
	if (strcmp(url, "/metrics"))
		return reply(conn, MHD_HTTP_NOT_FOUND, not_found, sizeof(not_found) - 1,
			     MHD_RESPMEM_PERSISTENT);
	s.tables = calloc(s.num_tables ? s.num_tables : 1, sizeof(*s.tables));
	s.ranks = calloc(s.num_ranks ? s.num_ranks : 1, sizeof(*s.ranks));
	if (s.tables && s.ranks) {
		pthread_mutex_lock(&m->lock);
		copy_snapshot(&s, &m->published);
		pthread_mutex_unlock(&m->lock);
		embd_metrics_text(&s, &text, &len);
	}
	free(s.tables);
	free(s.ranks);
	if (!text)
		return MHD_NO;
	return reply(conn, MHD_HTTP_OK, text, len, MHD_RESPMEM_MUST_FREE);
}

static int alloc_snapshot(struct embd_metrics_snapshot *s, uint32_t num_tables,
			  const char *const *names, uint32_t num_ranks)
{
	s->num_tables = num_tables;
	s->num_ranks = num_ranks;
	s->tables = calloc(num_tables ? num_tables : 1, sizeof(*s->tables));
	s->ranks = calloc(num_ranks ? num_ranks : 1, sizeof(*s->ranks));
	if (!s->tables || !s->ranks)
		return EMBD_ENOMEM;
	for (uint32_t t = 0; t < num_tables; t++)
		s->tables[t].name = names[t];
	return 0;
}

/* The socket is ours, bound here, so that a port in use fails with the kernel's reason. */
static int bind_listen(const struct sockaddr_storage *addr, int *fd, char *err, size_t err_len)
{
	socklen_t len = addr->ss_family == AF_INET ? sizeof(struct sockaddr_in)
						   : sizeof(struct sockaddr_in6);
	int one = 1;

	*fd = socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (*fd < 0 || setsockopt(*fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
	    bind(*fd, (const struct sockaddr *)addr, len) || listen(*fd, 64))
		return embd_fail(err, err_len, EMBD_EIO, "config key 'metrics_listen': cannot "
				 "listen there: %s", strerror(errno));
	return 0;
}

int embd_metrics_create(const char *listen, uint32_t num_tables, const char *const *table_names,
			uint32_t num_ranks, struct embd_metrics **out, char *err, size_t err_len)
{
	struct sockaddr_storage addr;
	struct embd_metrics *m;
	int rc;

	*out = NULL;
	if (!embd_config_listen_addr(listen, &addr))
		return embd_fail(err, err_len, EMBD_EINVAL, "config key 'metrics_listen': %s",
				 embd_config_listen_why);
	m = calloc(1, sizeof(*m));
	if (!m)
		return EMBD_ENOMEM;
	m->fd = -1;
	m->num_tables = num_tables;
	m->num_ranks = num_ranks;
	pthread_mutex_init(&m->lock, NULL);
	rc = alloc_snapshot(&m->draft, num_tables, table_names, num_ranks);
	if (!rc)
		rc = alloc_snapshot(&m->published, num_tables, table_names, num_ranks);
	if (!rc)
		rc = bind_listen(&addr, &m->fd, err, err_len);
	if (rc)
		goto out;
	m->mhd = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO |
				  (addr.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0),
				  0, NULL, NULL, handle, m,
				  MHD_OPTION_LISTEN_SOCKET, m->fd,
				  MHD_OPTION_CONNECTION_LIMIT, (unsigned)64,
				  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10,
				  MHD_OPTION_END);
	if (!m->mhd) {
		rc = embd_fail(err, err_len, EMBD_EIO, "config key 'metrics_listen': cannot start "
			       "the HTTP server on %s", listen);
		goto out;
	}
	m->fd = -1;     /* MHD_stop_daemon closes it */
	*out = m;
	return 0;
out:
	embd_metrics_destroy(m);
	return rc;
}

struct embd_metrics_snapshot *embd_metrics_draft(struct embd_metrics *m)
{
	return &m->draft;
}

bool embd_metrics_publish(struct embd_metrics *m)
{
	if (pthread_mutex_trylock(&m->lock))
		return false;
	copy_snapshot(&m->published, &m->draft);
	pthread_mutex_unlock(&m->lock);
	return true;
}

void embd_metrics_destroy(struct embd_metrics *m)
{
	if (!m)
		return;
	if (m->mhd)
		MHD_stop_daemon(m->mhd);
	if (m->fd >= 0)
		close(m->fd);
	pthread_mutex_destroy(&m->lock);
	free(m->draft.tables);
	free(m->draft.ranks);
	free(m->published.tables);
	free(m->published.ranks);
	free(m);
}
