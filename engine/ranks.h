/*
 * engine/ranks.h - the node's ranks: for each rank one driver thread that owns a pinned
 * worker pool (kernels/workers.h) and the memory of the rank's shards. A rank computes on a
 * device: the CPU (its shards in host memory on the rank's NUMA node, libnuma, or
 * embd_rows_alloc's where NUMA does not work; advised to huge pages either way) or one GPU
 * (its shards in HBM or, fused_uvm, in pinned host memory the GPU reads in place; its threads
 * and host buffers on the GPU's NUMA node). The device work goes through a backend table
 * (engine/backend.h); everything here is shared.
 *
 * The step engine hands every rank the same function at once (embd_ranks_run) and waits for
 * all: ranks work in parallel, each on its own shards, so no two threads ever touch one shard.
 * Shard memory is first touched (initialised) by its rank's driver thread, which keeps the
 * pages on the rank's node even where the kernel places memory on first touch.
 */
#ifndef EMBD_ENGINE_RANKS_H
#define EMBD_ENGINE_RANKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "embd/plan.h"
#include "kernels/embedding.h"

struct embd_ranks;

/*
 * Devices of kind `device` this process can use (CUDA: the GPUs CUDA_VISIBLE_DEVICES leaves
 * visible; CPU: the NUMA nodes). When there is none, an error and err in one line saying why:
 * "no CUDA device: cudaGetDeviceCount: <the driver's reason>", or that this build has no CUDA.
 */
int embd_ranks_device_count(enum embd_compute_device device, uint32_t *count, char *err,
			    size_t err_len);

/*
 * Starts num_ranks driver threads, each with threads_per_rank workers pinned to CPUs of its
 * NUMA node (rank r on node r * nodes / num_ranks; CPUs taken in order from the process's
 * allowed set of that node, wrapping when there are fewer CPUs than threads).
 */
int embd_ranks_create(uint32_t num_ranks, uint32_t threads_per_rank, struct embd_ranks **out,
		      char *err, size_t err_len);
/*
 * The same on `device`. CUDA: rank r is visible GPU r (EMBD_ENOTSUP when there are fewer
 * GPUs than ranks, naming both numbers), each with its own stream, scratch and
 * error word, its threads on CPUs of the GPU's NUMA node (the PCI device's numa_node).
 */
int embd_ranks_create_on(enum embd_compute_device device, uint32_t num_ranks,
			 uint32_t threads_per_rank, struct embd_ranks **out, char *err,
			 size_t err_len);
/* Joins the threads and frees every shard still allocated. NULL is a no-op. */
void embd_ranks_destroy(struct embd_ranks *ranks);

uint32_t embd_ranks_count(const struct embd_ranks *ranks);
enum embd_compute_device embd_ranks_device(const struct embd_ranks *ranks);
/* The NUMA node of rank (0 where NUMA is absent). */
int embd_ranks_node(const struct embd_ranks *ranks, uint32_t rank);
/* Bytes of shard memory (weights and optimizer state) allocated on rank: host memory on the
 * CPU, HBM plus fused_uvm host rows on a GPU (not counting the host copies of HBM shards). */
uint64_t embd_ranks_memory_bytes(const struct embd_ranks *ranks, uint32_t rank);

/* fn(arg, rank, exec) on every rank's driver thread at once; returns when all returned.
 * exec runs kernels on that rank's workers. Call from one thread at a time. */
typedef void (*embd_ranks_fn)(void *arg, uint32_t rank, const struct embd_exec *exec);
void embd_ranks_run(struct embd_ranks *ranks, embd_ranks_fn fn, void *arg);

/*
 * A shard of desc in rank's memory for compute kernel `kernel` (uninitialised: initialise its
 * host view from embd_ranks_run so the rank's thread touches it first, then mark it changed).
 * CUDA: fused and dense in HBM, fused_uvm in pinned mapped host memory, fused_uvm_caching in
 * pinned mapped host memory with an HBM cache of about rows * cache_ratio of its rows (the
 * plan's uvm_caching_ratio; engine/ranks_cache.c); the CPU runs every kernel on host memory.
 * Tests make the CPU ranks run the GPU's ways with EMBD_TEST_CPU_KERNEL in the environment at
 * embd_ranks_create_on: fused_uvm_caching (fused shards run fused_uvm_caching's cache in host
 * memory), device_copy (fused and dense rows in host memory apart from the host view, copied
 * by pull and push as an HBM shard's, and unreadable outside kernel calls and copies:
 * engine/backend_cpu_device.c). Freed by embd_ranks_free_shard or embd_ranks_destroy.
 */
int embd_ranks_alloc_shard(struct embd_ranks *ranks, uint32_t rank,
			   const struct embd_shard_desc *desc, enum embd_compute_kernel kernel,
			   double cache_ratio, struct embd_shard **out, char *err, size_t err_len);
/*
 * A fused_uvm_caching shard's lookups since it was allocated, added to *hits and *misses:
 * distinct rows of each forward call found in its cache or fetched (a backward maps its rows
 * again and is not counted). false (nothing added) for a shard of another kernel.
 */
bool embd_ranks_cache_counts(const struct embd_ranks *ranks, const struct embd_shard *shard,
			     uint64_t *hits, uint64_t *misses);
void embd_ranks_free_shard(struct embd_ranks *ranks, struct embd_shard *shard);

/*
 * The shard's rows in host memory (engine/backend.h: the shard itself on the CPU, a copy of
 * an HBM shard, the rows of a fused_uvm shard). Between steps it reads as the shard after
 * embd_ranks_shard_pull; whoever writes it calls embd_ranks_shard_changed, and the device gets
 * the rows before its next kernel call.
 */
struct embd_shard *embd_ranks_shard_host(const struct embd_ranks *ranks,
					 const struct embd_shard *shard);
int embd_ranks_shard_pull(struct embd_ranks *ranks, struct embd_shard *shard, char *err,
			  size_t err_len);
void embd_ranks_shard_changed(struct embd_ranks *ranks, struct embd_shard *shard);
/* Hands a changed host view to the device now (errors at once rather than at the next step). */
int embd_ranks_shard_push(struct embd_ranks *ranks, struct embd_shard *shard, char *err,
			  size_t err_len);
/*
 * The optimizer steps the shard has applied (adam's t) without a copy: the host view's after
 * it was written and not yet handed over (a restore), the device's otherwise (steps not yet
 * pulled). Between steps; 0 for a shard the ranks do not hold.
 */
int64_t embd_ranks_shard_step(const struct embd_ranks *ranks, const struct embd_shard *shard);

/*
 * The kernels of a rank, from inside embd_ranks_run on that rank (exec: the one it was given):
 * embd_kernels_forward and _backward with the batches' arrays in host memory, on the rank's
 * device. Returns once the results are in host memory.
 */
int embd_ranks_forward(struct embd_ranks *ranks, uint32_t rank, const struct embd_exec *exec,
		       const struct embd_bag_batch *batches, uint32_t n, struct embd_kernel_err *err);
int embd_ranks_backward(struct embd_ranks *ranks, uint32_t rank, const struct embd_exec *exec,
			struct embd_shard *shard, const struct embd_bag_batch *batches, uint32_t n,
			struct embd_kernel_err *err);

/*
 * Whether embd_ranks_backward_apply can step shard: its backend takes prepared occurrences
 * (engine/backend.h) and the shard is not fused_uvm_caching (whose backward maps its ids to
 * cache slots first, per shard). Any thread.
 */
bool embd_ranks_backward_shares(const struct embd_ranks *ranks, const struct embd_shard *shard);
/*
 * embd_ranks_backward with the shard's bags' occurrences prepared (embd_kernels_backward_prepare,
 * on any rank) instead of its own: the same result, bit for bit. From inside embd_ranks_run on
 * rank, for a shard embd_ranks_backward_shares; EMBD_ENOTSUP otherwise.
 */
int embd_ranks_backward_apply(struct embd_ranks *ranks, uint32_t rank, const struct embd_exec *exec,
			      struct embd_shard *shard, const struct embd_backward_prep *prep,
			      const struct embd_bag_batch *batches, uint32_t n,
			      struct embd_kernel_err *err);

/*
 * Host memory the ranks' devices read and write by DMA (a trainer's slab: ids in, pooled rows
 * out); a no-op on the CPU. Unregister before unmapping it.
 */
int embd_ranks_host_register(struct embd_ranks *ranks, void *p, size_t bytes, char *err,
			     size_t err_len);
void embd_ranks_host_unregister(struct embd_ranks *ranks, void *p);

/*
 * Registration as a matter of speed only: a device copies unregistered memory too, staged by
 * its driver. Returns whether p is registered; a failure is logged (the first per ranks, with
 * what and the driver's reason) and the caller keeps p unregistered.
 */
bool embd_ranks_dma_register(struct embd_ranks *ranks, void *p, size_t bytes, const char *what);

/*
 * Page-aligned host memory of at least bytes (rounded up to whole pages, so no two arrays
 * share a page a device maps) registered as embd_ranks_dma_register does; *registered says
 * whether it is. NULL when out of memory. embd_ranks_dma_free releases it.
 */
void *embd_ranks_dma_alloc(struct embd_ranks *ranks, size_t bytes, bool *registered,
			   const char *what);
void embd_ranks_dma_free(struct embd_ranks *ranks, void *p, bool registered);

/*
 * Device outputs (ipc/README.md "Device outputs"): memory a trainer maps, for its pooled
 * outputs and gradients, on the GPU with UUID uuid. The step engine keeps computing into host
 * memory; the server copies a trainer's rows in (export_copy to_device) after each forward
 * and its gradients out before each backward, so all of the orchestration is the same code
 * for every device. CUDA: a cuMemCreate allocation on that GPU (any GPU this process sees, a
 * rank's or not), exported as a POSIX fd. CPU ranks refuse (EMBD_ENOTSUP: no GPU memory),
 * unless EMBD_TEST_CPU_DEVICE_OUTPUTS=1 is in the environment (tests: a sealed memfd of host
 * memory stands for the GPU's, so the CPU tests run every step of the path but the device
 * calls). Refusals: EMBD_ENOTSUP (CPU ranks; a driver without the VMM API or POSIX fd
 * handles), EMBD_ENOENT (no such GPU here), EMBD_ENOMEM, EMBD_EIO, with err in one line.
 * Caller's thread while the ranks are idle (the server's loop).
 */
enum embd_export_memory {
	EMBD_EXPORT_CUDA = 1,           /* fd: a CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR handle */
	EMBD_EXPORT_HOST = 2,           /* fd: a sealed memfd (the CPU's test double) */
};

struct embd_export {
	enum embd_export_memory memory;
	uint64_t bytes;                 /* of the allocation, >= the bytes asked for: what the
					 * trainer maps */
	int fd;                         /* the shareable handle: the caller sends it and closes it
					 * (-1 then); embd_ranks_export_free closes it otherwise */
	void *state;                    /* the backend's */
};

int embd_ranks_export_alloc(struct embd_ranks *ranks, const uint8_t uuid[16], uint64_t bytes,
			    struct embd_export *out, char *err, size_t err_len);
/* Copies bytes between host memory and [offset, offset + bytes) of the export, either
 * direction; complete on return (the trainer may read what was copied in). */
int embd_ranks_export_copy(struct embd_ranks *ranks, const struct embd_export *x,
			   uint64_t offset, void *host, uint64_t bytes, bool to_device, char *err,
			   size_t err_len);
/* Frees the service's side (the trainer's mapping keeps its own reference) and leaves *x as
 * a failed alloc does (fd -1, state NULL): freeing that again is a no-op. */
void embd_ranks_export_free(struct embd_ranks *ranks, struct embd_export *x);

/*
 * Staging for a cluster comm that moves device memory (dist/comm.h: nccl, whose lane r is
 * rank r's GPU). embd_ranks_comm_buffers: whether this device can back such a comm (false on
 * the CPU, whose comm reads host memory). From inside embd_ranks_run on rank: a buffer of at
 * least `bytes` on the rank's device (valid until the next call), and a copy between it and
 * host memory, complete on return.
 */
bool embd_ranks_comm_buffers(const struct embd_ranks *ranks);
int embd_ranks_comm_buffer(struct embd_ranks *ranks, uint32_t rank, uint64_t bytes, void **out,
			   char *err, size_t err_len);
int embd_ranks_comm_copy(struct embd_ranks *ranks, uint32_t rank, void *dst, const void *src,
			 uint64_t bytes, char *err, size_t err_len);

/*
 * Row-split tables' partial sums, kept on the ranks' devices and summed there, never through
 * host memory (engine/step.c). From inside embd_ranks_run on rank: embd_ranks_partial_buffer,
 * a buffer of at least `bytes` on the rank's device (valid until the next call; a forward's
 * batch may pool into it); then, in a later embd_ranks_run, embd_ranks_partial_copy brings
 * bytes of rank `from`'s buffer into the rank's own (GPUs: peer access, enabled for every
 * pair when the ranks start; staged through host memory only where the pair has none, logged
 * then), embd_ranks_partial_add adds, embd_ranks_partial_out copies rows x cols floats to host
 * rows `stride` floats apart.
 * Each complete on return. The bytes each copy moved are added to the ranks' counts.
 */
int embd_ranks_partial_buffer(struct embd_ranks *ranks, uint32_t rank, uint64_t bytes,
			      void **out, char *err, size_t err_len);
int embd_ranks_partial_copy(struct embd_ranks *ranks, uint32_t rank, void *dst, uint32_t from,
			    const void *src, uint64_t bytes, char *err, size_t err_len);
int embd_ranks_partial_add(struct embd_ranks *ranks, uint32_t rank, float *dst,
			   const float *src, uint64_t n, char *err, size_t err_len);
int embd_ranks_partial_out(struct embd_ranks *ranks, uint32_t rank, float *host,
			   uint64_t stride, const float *src, uint64_t rows, uint64_t cols,
			   char *err, size_t err_len);
/* Bytes embd_ranks_partial_copy moved since the ranks started: device to device (peer access;
 * the CPU's memcpy), and staged through host memory. */
void embd_ranks_partial_counts(const struct embd_ranks *ranks, uint64_t *device_bytes,
			       uint64_t *host_bytes);

#endif /* EMBD_ENGINE_RANKS_H */
