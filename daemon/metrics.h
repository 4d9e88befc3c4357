/*
 * daemon/metrics.h - the Prometheus endpoint (config key metrics_listen): `GET /metrics` in the
 * text exposition format 0.0.4, served by libmicrohttpd on its own thread so a scrape never
 * runs on the event loop's thread. The loop publishes a snapshot of its figures (a copy under
 * a mutex it only try-locks: a scrape copying the snapshot makes the loop skip one publish,
 * never wait); a scrape formats the last published one.
 *
 * The figures (every one of `embctl stats`, daemon/stats.h, and the status JSON's checkpoint
 * and cluster parts; times in seconds, sizes in bytes):
 *   embd_info{version}                     1
 *   embd_uptime_seconds                    gauge
 *   embd_step                              gauge: the step being collected or run
 *   embd_steps_total                       steps whose backward completed
 *   embd_aborted_steps_total               steps aborted
 *   embd_step_duration_seconds             histogram: FORWARD started -> BACKWARD applied
 *   embd_step_phase_seconds_total{phase}   that time in forward, trainers and backward
 *                                          (daemon/stats.h: struct embd_stats_phases)
 *   embd_requests_total                    trainer requests completed
 *   embd_request_duration_seconds          histogram: SQE popped -> CQE pushed
 *   embd_refusals_total{cause}             requests completed with an error, by code
 *                                          (daemon/stats.h: embd_stats_cause_name)
 *   embd_ids_total                         ids in accepted batches
 *   embd_lookups_total{table}              row reads per table by this node's ranks
 *   embd_bytes_total{link}                 trainer_in (KJTs read), trainer_out (pooled
 *                                          written), peer_out (sent to other nodes),
 *                                          rank_device and rank_host (row-split partial
 *                                          sums between this node's ranks, device to
 *                                          device or through host memory)
 *   embd_cache_lookups_total{table,result} fused_uvm_caching tables: distinct rows of each
 *                                          forward found in the cache (hit) or fetched (miss)
 *   embd_rank_memory_bytes{rank,numa_node} gauge
 *   embd_clients_connected                 gauge: trainers connected
 * with checkpoint_dir:
 *   embd_checkpoints_total{result}         ok | failed
 *   embd_checkpoint_write_duration_seconds summary (_sum, _count) of the ok writes
 *   embd_checkpoint_last_write_seconds, embd_checkpoint_last_stall_seconds,
 *   embd_checkpoint_max_stall_seconds, embd_checkpoint_last_step, embd_checkpoint_last_bytes,
 *   embd_checkpoint_in_progress            gauges
 * on a cluster's node:
 *   embd_cluster_generation, embd_cluster_applied_step, embd_cluster_node  gauges
 *   embd_cluster_state{state}              1 for the node's state, 0 for the others
 *                                          (running, forming, lost, detached)
 */
#ifndef EMBD_DAEMON_METRICS_H
#define EMBD_DAEMON_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/stats.h"

#define EMBD_METRICS_CLUSTER_STATES 4

struct embd_metrics_snapshot {
	double uptime_s;
	uint64_t step;
	uint64_t steps, aborted_steps, ids, bytes_in, bytes_out, sent_bytes;
	uint64_t partial_device_bytes, partial_host_bytes;
	struct embd_stats_hist step_hist, request_hist;
	uint64_t phase_total_ns[EMBD_STATS_PHASES];     /* daemon/stats.h's phases */
	uint64_t refusals[EMBD_STATS_CAUSES];
	uint32_t clients;
	uint32_t num_tables, num_ranks;         /* fixed at embd_metrics_create */
	struct embd_stats_table *tables;        /* num_tables; names borrowed */
	struct embd_stats_rank *ranks;          /* num_ranks */
	bool checkpoints;                       /* the checkpoint figures below are set */
	uint64_t ckpt_ok, ckpt_failed, ckpt_last_step, ckpt_last_bytes;
	double ckpt_write_ms_sum, ckpt_last_write_ms, ckpt_last_stall_ms, ckpt_max_stall_ms;
	bool ckpt_in_progress;
	bool cluster;                           /* the cluster figures below are set */
	uint64_t generation, applied_step;
	uint32_t node, state;                   /* state: index into running, forming, ... */
};

/* The exposition text of s, malloc'ed, NUL-terminated, its length in *len. */
int embd_metrics_text(const struct embd_metrics_snapshot *s, char **out, size_t *len);

struct embd_metrics;

/* Binds listen ("host:port"), starts serving, and allocates the snapshot arrays for num_tables
 * tables (names borrowed: they must outlive the handle) and num_ranks ranks. Errors
 * (EMBD_EINVAL: malformed; EMBD_EIO: cannot bind or start) name metrics_listen in err. */
int embd_metrics_create(const char *listen, uint32_t num_tables, const char *const *table_names,
			uint32_t num_ranks, struct embd_metrics **out, char *err, size_t err_len);

/* The snapshot the caller fills and publishes (its arrays are sized for the handle). Only the
 * publishing thread touches it. */
struct embd_metrics_snapshot *embd_metrics_draft(struct embd_metrics *m);

/* Makes the draft what scrapes see: true, or false when a scrape held the published copy at
 * that moment (nothing waited; publish again later). */
bool embd_metrics_publish(struct embd_metrics *m);

/* Stops serving (waits for the thread) and frees. NULL is a no-op. */
void embd_metrics_destroy(struct embd_metrics *m);

#endif /* EMBD_DAEMON_METRICS_H */
