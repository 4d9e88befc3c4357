/*
 * ipc/region.h - the per-client shared-memory region: one sealed memfd holding a header, the
 * submission ring, the completion ring and the data slab (ipc/README.md draws it).
 *
 * The one idea: the service creates the region and keeps its own private copy of the layout;
 * it never reads the header back, so a client scribbling on it only breaks itself. The memfd
 * is sealed against shrinking and growing, so a mapping can never turn into SIGBUS under the
 * service. The client side checks the header and the seals when it attaches.
 */
#ifndef EMBD_IPC_REGION_H
#define EMBD_IPC_REGION_H

#include <stddef.h>
#include <stdint.h>

#include "embd/types.h"
#include "ipc/ring.h"

#define EMBD_REGION_MAGIC 0x52444d45u   /* "EMDR" little-endian */
#define EMBD_REGION_VERSION 1u
#define EMBD_REGION_HEADER_BYTES 4096u  /* the header owns the first page */
#define EMBD_REGION_ALIGN 4096u         /* rings and slab start on page boundaries */
#define EMBD_REGION_BYTES_MAX (UINT64_C(1) << 40)

/* Region header at offset 0, written once by the service before the client maps it. */
struct embd_region_header {
	uint32_t magic;
	uint32_t version;
	uint64_t region_bytes;          /* size of the memfd */
	uint32_t sq_entries;            /* power of two */
	uint32_t cq_entries;            /* power of two */
	uint32_t sqe_bytes;             /* sizeof(struct embd_sqe) */
	uint32_t cqe_bytes;             /* sizeof(struct embd_cqe) */
	uint64_t sq_offset;             /* struct embd_ring_shared, then the SQEs */
	uint64_t cq_offset;             /* struct embd_ring_shared, then the CQEs */
	uint64_t slab_offset;
	uint64_t slab_bytes;
};

struct embd_region_params {
	uint32_t sq_entries;            /* power of two, <= EMBD_RING_SIZE_MAX */
	uint32_t cq_entries;            /* power of two, <= EMBD_RING_SIZE_MAX */
	uint64_t slab_bytes;            /* rounded up to EMBD_REGION_ALIGN */
};

enum embd_region_side {
	EMBD_REGION_SERVICE = 0,        /* consumes the SQ, produces the CQ */
	EMBD_REGION_CLIENT = 1,         /* produces the SQ, consumes the CQ */
};

struct embd_region;

/*
 * Service: creates a sealed memfd sized for `params` (named `name` for /proc, may be NULL),
 * maps it, writes the header and formats both rings. The region owns the fd.
 * Returns 0, EMBD_EINVAL (params, message in err), EMBD_ENOMEM or EMBD_EIO (syscall failed).
 */
int embd_region_create(struct embd_region **out, const struct embd_region_params *params,
		       const char *name, char *err, size_t err_len);

/*
 * Client: maps the memfd `fd` (received over the control socket; the region takes ownership
 * of it on success only), checks that it carries F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL and
 * that the header is consistent with the file size. Returns 0, EMBD_EPROTO (bad header or
 * seals, field named in err), EMBD_EIO.
 */
int embd_region_attach(struct embd_region **out, int fd, char *err, size_t err_len);

/* Unmaps and closes. NULL is a no-op. */
void embd_region_destroy(struct embd_region *region);

int embd_region_fd(const struct embd_region *region);
uint64_t embd_region_bytes(const struct embd_region *region);
enum embd_region_side embd_region_side(const struct embd_region *region);

/* This side's handle on the SQ and CQ (producer or consumer as the side dictates). */
struct embd_ring *embd_region_sq(struct embd_region *region);
struct embd_ring *embd_region_cq(struct embd_region *region);

/* The data slab: base and size (from the service's private layout on the service side). */
void *embd_region_slab(const struct embd_region *region);
uint64_t embd_region_slab_bytes(const struct embd_region *region);

#endif /* EMBD_IPC_REGION_H */
