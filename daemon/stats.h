/*
 * daemon/stats.h - the service's counters and the JSON texts of STATS_REPLY and STATUS_REPLY
 * (what `embctl stats` and `embctl status` print). The event loop thread owns the counters;
 * nothing here locks.
 *
 * STATS JSON (one object; times in microseconds, rates per second over the uptime):
 *   { "uptime_s": 12.5,
 *     "steps": 100,                 steps whose backward completed
 *     "aborted_steps": 1,           steps aborted (a participant hung up or stalled
 *                                   mid-step, or a gradient was not finite: below)
 *     "nonfinite_grads": 0,         this node's trainers' backwards refused because their
 *                                   gradient held a NaN or infinity (the step aborted for
 *                                   every trainer and node, engine/step.h)
 *     "nonfinite_rows": 0,          row updates that left a row NaN or infinite (weights or
 *                                   optimizer state; a huge but finite gradient is applied
 *                                   and can do that: clipping is the trainer's job)
 *     "step_timeouts": 0,           phases given up at step_wait_abort_ms (daemon/config.h)
 *     "pipelined_steps": 99,        steps routed while the step before waited for its
 *                                   backward (its trainers posted FORWARD early, pipelined)
 *     "overlapped_steps": 99,       ... of them, on a cluster, whose input exchange ran while
 *                                   the step before was applied (engine/step.h,
 *                                   embd_step_backward_overlapped)
 *     "lookups": 123, "lookups_per_s": 9.8,   row reads by all ranks
 *     "ids": 120, "ids_per_s": 9.6,           ids in the accepted batches
 *     "bytes_in": 4096, "bytes_out": 8192,    KJT bytes read / pooled bytes written
 *     "sent_bytes": 0,              bytes sent to other nodes (forward and backward)
 *     "partial_device_bytes": 0, "partial_host_bytes": 0,   row-split partial sums moved
 *                                   between this node's ranks device to device (GPU peer
 *                                   access) or through host memory (a GPU pair without peer
 *                                   access; a table with shards on other nodes): engine/step.h
 *     "backward_prepares": 16, "backward_shared_shards": 32,   column-split tables whose
 *                                   shards on this node stepped from one check and sort of
 *                                   their ids (engine/step.h), and those shards, every step
 *     "requests": 200,              requests completed, every trainer since start
 *     "step_p50_us": 80.1, "step_p99_us": 200.3,   FORWARD s started -> BACKWARD s applied
 *     "step_phases_p50_us": { "forward": 31.0, "trainers": 19.5, "backward": 28.7 },
 *                                   the step's latency in three parts (struct
 *                                   embd_stats_phases), each its own median (medians of
 *                                   the parts need not add up to step_p50_us)
 *     "ipc_p50_us": 3.2, "ipc_p99_us": 9.9,        SQE popped -> CQE pushed, every request
 *     "ranks": [ { "rank": 0, "numa_node": 0, "memory_bytes": 1048576 } ],
 *     "tables": [ { "name": "user_id", "lookups": 60 } ],  row reads per table by this
 *                                   node's ranks (engine/step.h: embd_step_table_lookups);
 *                                   a fused_uvm_caching table also has "cache_hits",
 *                                   "cache_misses" (distinct rows of each forward found in
 *                                   its HBM cache or fetched from host memory, this node's
 *                                   shards) and "cache_hit_rate" (0 before any lookup)
 *     "refusals": { "EAGAIN": 2 },  requests completed with an error, by code (causes
 *                                   never seen are left out)
 *     "clients": [ { "index": 0, "pid": 42, "uid": 1000, "sq_used": 0, "sq_entries": 64,
 *                    "cq_used": 1, "cq_entries": 64, "requests": 200, "errors": 0,
 *                    "stalling_ms": 0 } ] }    how long the step has waited for this trainer,
 *                                   once that is step_wait_warn_ms or more (else 0)
 * The percentiles cover the last EMBD_STATS_WINDOW samples (0 before the first).
 *
 * STATUS JSON: { "version": "0.1.0", "uptime_s", "step": next step to run, "plan_hash": "16
 * hex digits", "clients": connected count, "config": { "socket_path", "num_tables",
 * "world_size", "local_world_size", "trainers_per_node", "threads_per_rank", "batch_size",
 * "busy_poll_us", "checkpoint_dir", "log_level" } }; with checkpoint_dir also "resumed_step"
 * and "checkpoint" (ckpt/ckpt_service.h); on a cluster also "cluster": { "generation": the
 * comm's (dist/regroup.h), "state": "running" | "forming" | "lost" | "detached",
 * "applied_step": the step the parameters are at, "message": why steps are refused ("" when
 * running) }; while the step has waited step_wait_warn_ms or more for trainers, also
 * "stalled": { "step", "waiting_for": "FORWARD" | "BACKWARD", "waited_ms",
 * "trainers": [ { "index", "pid" } ] }.
 */
#ifndef EMBD_DAEMON_STATS_H
#define EMBD_DAEMON_STATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "engine/step.h"

#define EMBD_STATS_WINDOW 1024

/* The phases of a step's latency (struct embd_stats_phases below), in that order, by the
 * names STATS and the metrics give them: "forward", "trainers", "backward". */
#define EMBD_STATS_PHASES 3
extern const char *const embd_stats_phase_names[EMBD_STATS_PHASES];

/* Latencies since start in fixed buckets (the Prometheus histograms of daemon/metrics.h):
 * count[b] holds samples in (bound[b - 1], bound[b]], count[EMBD_STATS_BUCKETS] the rest. */
#define EMBD_STATS_BUCKETS 16
extern const uint64_t embd_stats_bucket_ns[EMBD_STATS_BUCKETS];

struct embd_stats_hist {
	uint64_t count[EMBD_STATS_BUCKETS + 1];
	uint64_t sum_ns, total;
};

/* The error codes of include/embd/types.h a request may complete with, as refusal causes. */
#define EMBD_STATS_CAUSES 20
/* The cause's index for code (< 0), or EMBD_STATS_CAUSES - 1 ("other") for an unknown one. */
uint32_t embd_stats_cause(int code);
/* The cause's name: the code's name without "EMBD_" ("EAGAIN"), or "other". */
const char *embd_stats_cause_name(uint32_t cause);

struct embd_stats {
	uint64_t start_ns;              /* CLOCK_MONOTONIC at creation */
	uint64_t steps, aborted_steps, step_timeouts, pipelined_steps, overlapped_steps;
	uint64_t nonfinite_grads, nonfinite_rows;
	uint64_t lookups, ids, bytes_in, bytes_out, sent_bytes;
	uint64_t partial_device_bytes, partial_host_bytes;
	uint64_t backward_prepares, backward_shared_shards;
	uint64_t step_ns[EMBD_STATS_WINDOW], num_step;
	uint64_t phase_ns[EMBD_STATS_PHASES][EMBD_STATS_WINDOW];  /* embd_stats_phases, by step */
	uint64_t phase_total_ns[EMBD_STATS_PHASES];               /* ... summed over every step */
	uint64_t ipc_ns[EMBD_STATS_WINDOW], num_ipc;
	struct embd_stats_hist step_hist, ipc_hist;
	uint64_t refusals[EMBD_STATS_CAUSES];
};

struct embd_stats_table {
	const char *name;
	uint64_t lookups;
	bool cached;                    /* fused_uvm_caching: the cache's counts below */
	uint64_t cache_hits, cache_misses;
};

struct embd_stats_rank {
	uint32_t rank;
	int numa_node;
	uint64_t memory_bytes;
};

struct embd_stats_client {
	uint32_t index;
	int32_t pid;
	uint32_t uid;
	uint32_t sq_used, sq_entries, cq_used, cq_entries;
	uint64_t requests, errors;
	uint64_t stalling_ms;
};


/*
 * Where a completed step's latency went, on the server's clock: forward, from FORWARD s
 * started to its completions posted (the routing and the lookups; on a cluster the exchanges
 * too); trainers, from there to the last participant's BACKWARD s taken (their own work
 * between lookup and gradient, and how far apart they post); backward, from there to the
 * update applied (the gradients' copy and check, on a cluster their exchange, the fused
 * optimizer). A pipelined step was routed when its FORWARDs came early, in the phases of the
 * step before: in its trainers phase while that step waited for a BACKWARD, else in its
 * backward. An overlapped step's forward (clusters) starts where the backward before it
 * starts, so that backward's exchange and update are in both steps, as in their latencies.
 */
struct embd_stats_phases {
	uint64_t forward_ns, trainers_ns, backward_ns;
};

void embd_stats_init(struct embd_stats *s);
/* A completed step: its work counters, its latency and that latency's phases. */
void embd_stats_step(struct embd_stats *s, const struct embd_step_counts *counts,
		     uint64_t latency_ns, const struct embd_stats_phases *phases);
/* One request's time inside the service and its result (0 or a negative EMBD_E* code). */
void embd_stats_request(struct embd_stats *s, uint64_t latency_ns, int result);

/* The STATS JSON above, malloc'ed and NUL-terminated. */
int embd_stats_json(const struct embd_stats *s, const struct embd_stats_rank *ranks,
		    uint32_t num_ranks, const struct embd_stats_table *tables,
		    uint32_t num_tables, const struct embd_stats_client *clients,
		    uint32_t num_clients, char **out);

/* The STATUS JSON above, malloc'ed and NUL-terminated. */
int embd_stats_status_json(const struct embd_stats *s, const struct embd_config *config,
			   uint64_t step, uint64_t plan_hash, uint32_t num_clients, char **out);

#endif /* EMBD_DAEMON_STATS_H */
