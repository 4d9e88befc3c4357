/*
 * engine/backend.h - what one kind of rank device does for the step engine, behind one function
 * table per device (NCCL's one-transport-one-table): where a shard's rows live, how a rank's
 * lookups and fused backwards run, and how its rows reach host memory for checkpoints and live
 * table access. engine/ranks.c owns the threads, the NUMA placement and the bookkeeping and
 * calls a backend for the device work, so the CPU and the GPU ranks share every line of
 * orchestration and the CPU tests exercise it.
 *
 * Every shard has a HOST VIEW: a struct embd_shard over host memory with the same rows. On the
 * CPU it is the shard itself; a GPU shard in HBM keeps a host copy that pull and push refresh;
 * a fused_uvm shard's rows are host memory the GPU reads in place, so its view is those rows.
 *
 * fused_uvm_caching: the rows are host memory as for fused_uvm (shard: the rows as the device
 * sees them), plus SLOTS, a shard of cache rows in device memory (HBM; host memory on the CPU
 * backend, which runs the same cache to test it) that the kernels compute on. The backend
 * only holds and copies those rows: engine/ranks_cache.c keeps the cache (kernels/cache.h),
 * maps each call's ids to slots and has the backend copy rows in and out.
 * Private to engine/ (the daemon and the checkpoints go through engine/ranks.h and step.h).
 */
#ifndef EMBD_ENGINE_BACKEND_H
#define EMBD_ENGINE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "engine/ranks.h"
#include "kernels/cache.h"
#include "kernels/embedding.h"

/* A backend's state of one rank (a CPU group; a GPU with its stream, scratch, error word). */
struct embd_backend_rank;

/* One shard as the backend allocated it. */
struct embd_backend_shard {
	/* what the kernels compute on (device pointers on a GPU); the struct itself is host
	 * memory, so its step and non-finite counts are the device's, readable at any time */
	struct embd_shard *shard;
	struct embd_shard *host;        /* the host view (the top of this file); may be == shard */
	enum embd_compute_kernel kernel;
	void *mem[3];                   /* the host view's weights, momentum1, momentum2 */
	uint64_t bytes[3];
	uint64_t device_bytes;          /* memory on the device beyond the host view's (HBM) */
	bool registered;                /* mem registered with the GPU (pinned, mapped) */
	/* fused_uvm_caching: the cache's rows (desc: slot_rows rows from 0, the shard's columns,
	 * dtype and optimizer); NULL otherwise. Their bytes are in device_bytes. */
	struct embd_shard *slots;
	uint64_t slot_rows;
};

struct embd_backend {
	const char *name;               /* "cpu", "cuda": the topology's compute_device */
	/* Devices this process can use (caller's thread); an error says why none, in one line. */
	int (*count)(uint32_t *count, char *err, size_t err_len);
	/* The NUMA node the device of rank is attached to; -1 when unknown (caller's thread). */
	int (*numa_node)(uint32_t rank);
	/* On the rank's own driver thread, once, before anything else of the rank. */
	int (*rank_open)(uint32_t rank, struct embd_backend_rank **out, char *err, size_t err_len);
	void (*rank_close)(struct embd_backend_rank *r);
	/* A shard of desc for kernel (uninitialised), its host view on NUMA node `node`
	 * (numa: libnuma works). Any thread while the rank is idle. */
	int (*shard_alloc)(struct embd_backend_rank *r, bool numa, int node,
			   const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			   struct embd_backend_shard *out, char *err, size_t err_len);
	void (*shard_free)(struct embd_backend_rank *r, bool numa, struct embd_backend_shard *s);
	/* Rows, state and step: device -> host view, host view -> device. NULL where the host
	 * view is the shard. */
	int (*pull)(struct embd_backend_rank *r, struct embd_backend_shard *s, char *err,
		    size_t err_len);
	int (*push)(struct embd_backend_rank *r, struct embd_backend_shard *s, char *err,
		    size_t err_len);
	/* embd_kernels_forward / _backward with host arrays (ids, offsets, weights, lengths,
	 * pooled, pooled_grad: the engine's buffers and the trainers' slabs) on the rank's
	 * shards; return when the results are in host memory. */
	int (*forward)(struct embd_backend_rank *r, const struct embd_exec *exec,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err);
	int (*backward)(struct embd_backend_rank *r, const struct embd_exec *exec,
			struct embd_shard *shard, const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err);
	/* embd_kernels_backward_apply: the backward with occurrences prepared once on the host
	 * for every shard of the same bags (a table's column shards, on any of the node's ranks).
	 * NULL where the device cannot take them: the engine calls backward for each shard. */
	int (*backward_apply)(struct embd_backend_rank *r, const struct embd_exec *exec,
			      struct embd_shard *shard, const struct embd_backward_prep *prep,
			      const struct embd_bag_batch *batches, uint32_t n,
			      struct embd_kernel_err *err);
	/* fused_uvm_caching (engine/ranks_cache.c), on the rank's thread or while it is idle:
	 * s->slots replaced by one of `rows` slot rows whose first `keep` rows (and step) are the
	 * old ones'; s->slot_rows and device_bytes updated. */
	int (*slots_resize)(struct embd_backend_rank *r, struct embd_backend_shard *s,
			    uint64_t rows, uint64_t keep, char *err, size_t err_len);
	/* Copies rows between the host rows and the slots, every write-back (slot -> host row)
	 * before every fetch (host row -> slot): weights and optimizer state. Returns when done
	 * (the host rows may be read). */
	int (*slots_copy)(struct embd_backend_rank *r, struct embd_backend_shard *s,
			  const struct embd_cache_moves *m, char *err, size_t err_len);
	/* Host memory the device may DMA from and to: a trainer's slab, the engine's ids and
	 * partials, the server's gradients (engine/ranks.h). The CPU's record it (a registry
	 * the device_copy double checks every kernel call's arrays against). */
	int (*host_register)(struct embd_backend_rank *r, void *p, size_t bytes, char *err,
			     size_t err_len);
	void (*host_unregister)(struct embd_backend_rank *r, void *p);
	/* A cluster whose comm moves device memory (dist/comm.h: nccl, lane r = rank r): a
	 * staging buffer of at least `bytes` on the rank's device, kept and grown by the backend
	 * until rank_close; and a copy between it and host memory (either direction), complete on
	 * return. NULL where the comm reads host memory itself (the CPU). Rank's thread. */
	int (*comm_buffer)(struct embd_backend_rank *r, uint64_t bytes, void **out, char *err,
			   size_t err_len);
	int (*comm_copy)(struct embd_backend_rank *r, void *dst, const void *src, uint64_t bytes,
			 char *err, size_t err_len);
	/*
	 * Row-split tables' partial sums, summed on the ranks' devices (engine/ranks.h,
	 * embd_ranks_partial_*), on the rank's thread. partial_buffer: at least `bytes` of the
	 * rank's device memory, kept and grown until rank_close (its contents are not kept when
	 * it grows); forward may write pooled rows into it. copy_peer: bytes of `from`'s device
	 * memory (written before the embd_ranks_run this call is in) to dst on r's; *direct says
	 * whether they went device to device (peer access, NVLink; the CPU's memcpy) or were
	 * staged through host memory (a pair of GPUs without peer access). add: dst[i] += src[i]
	 * for n floats of r's memory. rows_out: rows x cols floats at src (dense) to host rows
	 * `stride` floats apart. Each complete on return.
	 */
	int (*partial_buffer)(struct embd_backend_rank *r, uint64_t bytes, void **out, char *err,
			      size_t err_len);
	/* Once per ordered pair of ranks, at embd_ranks_create on r's thread: r's device made able
	 * to read `from`'s memory for copy_peer where the pair allows it (GPUs: peer access; a
	 * pair without it is logged once, and its copies staged). NULL: nothing to open. */
	void (*peer_open)(struct embd_backend_rank *r, struct embd_backend_rank *from);
	int (*copy_peer)(struct embd_backend_rank *r, void *dst, struct embd_backend_rank *from,
			 const void *src, uint64_t bytes, bool *direct, char *err, size_t err_len);
	int (*add)(struct embd_backend_rank *r, float *dst, const float *src, uint64_t n,
		   char *err, size_t err_len);
	int (*rows_out)(struct embd_backend_rank *r, float *host, uint64_t stride, const float *src,
			uint64_t rows, uint64_t cols, char *err, size_t err_len);
	/* Device outputs (engine/ranks.h, embd_ranks_export_*): any thread while the ranks are
	 * idle. export_alloc refuses where the device has no memory to export. */
	int (*export_alloc)(const uint8_t uuid[16], uint64_t bytes, struct embd_export *out,
			    char *err, size_t err_len);
	int (*export_copy)(const struct embd_export *x, uint64_t offset, void *host,
			   uint64_t bytes, bool to_device, char *err, size_t err_len);
	void (*export_free)(struct embd_export *x);
};

extern const struct embd_backend embd_backend_cpu;
/* The CPU with fused and dense rows kept apart from their host views, as in a GPU's HBM:
 * tests (engine/backend_cpu_device.c, EMBD_TEST_CPU_KERNEL=device_copy). */
extern const struct embd_backend embd_backend_cpu_device;
#ifdef EMBD_HAVE_CUDA
extern const struct embd_backend embd_backend_cuda;    /* engine/backend_cuda.c */
#endif

/* The CPU backends' record of host_register: whether [p, p + bytes) lies in one registered
 * range; and the bytes of kernel arrays the device_copy double found outside every one (a GPU
 * would have had them staged by the driver, not DMA'd: tests check it stays 0). */
bool embd_backend_host_registered(const void *p, uint64_t bytes);
uint64_t embd_backend_unregistered_bytes(void);

/* Host memory on NUMA node `node` (page aligned), or embd_rows_alloc's where NUMA does not work;
 * from 2 MiB advised to transparent huge pages either way. NULL for 0 bytes or when out of
 * memory. */
void *embd_backend_host_alloc(bool numa, int node, uint64_t bytes);
void embd_backend_host_free(bool numa, void *p, uint64_t bytes);

/* The host view of desc in host memory on node (out->mem, bytes, host); the CPU backend's
 * whole shard, a GPU shard's host side. */
int embd_backend_host_shard(bool numa, int node, const struct embd_shard_desc *desc,
			    struct embd_backend_shard *out, char *err, size_t err_len);
void embd_backend_host_shard_free(bool numa, struct embd_backend_shard *s);

/* fused_uvm_caching: the desc of `rows` slot rows of desc's shard (rows from 0, its columns,
 * dtype and optimizer); the bytes of one row of the host view's array i (0 weights, 1 and 2
 * the optimizer state; 0 where unused). */
void embd_backend_slots_desc(const struct embd_shard_desc *desc, uint64_t rows,
			     struct embd_shard_desc *out);
uint64_t embd_backend_row_bytes(const struct embd_backend_shard *s, int i);

#endif /* EMBD_ENGINE_BACKEND_H */
