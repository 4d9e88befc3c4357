/*
 * ipc/region.c - creating (service) and attaching to (client) a per-client memfd region.
 *
 * Layout: [header page][SQ block + SQEs][CQ block + CQEs][slab], each part page-aligned.
 * The service computes the layout from its own parameters and keeps it privately; the header
 * is written for the client only. Seals (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) are
 * applied before the fd leaves the service, so the size both sides mapped is final.
 */
#include "ipc/region.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "ipc/protocol.h"

#define REGION_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

struct embd_region {
	int fd;
	enum embd_region_side side;
	void *base;
	struct embd_region_header layout;       /* private copy: the service's own, or the checked one */
	struct embd_ring sq;
	struct embd_ring cq;
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

/* Fills layout for the given shape; EMBD_EINVAL names the bad parameter. */
static int compute_layout(struct embd_region_header *h, uint32_t sq_entries, uint32_t cq_entries,
			  uint64_t slab_bytes, char *err, size_t err_len)
{
	uint64_t sq_bytes = embd_ring_bytes(sq_entries, sizeof(struct embd_sqe));
	uint64_t cq_bytes = embd_ring_bytes(cq_entries, sizeof(struct embd_cqe));

	if (sq_bytes == 0)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"sq_entries: %" PRIu32 " is not a power of two in [1, %u]",
				sq_entries, EMBD_RING_SIZE_MAX);
	if (cq_bytes == 0)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"cq_entries: %" PRIu32 " is not a power of two in [1, %u]",
				cq_entries, EMBD_RING_SIZE_MAX);
	if (slab_bytes == 0 || slab_bytes > EMBD_REGION_BYTES_MAX)
		return embd_fail(err, err_len, EMBD_EINVAL,
				"slab_bytes: %" PRIu64 " is not in [1, 2^40]", slab_bytes);
	memset(h, 0, sizeof(*h));
	h->magic = EMBD_REGION_MAGIC;
	h->version = EMBD_REGION_VERSION;
	h->sq_entries = sq_entries;
	h->cq_entries = cq_entries;
	h->sqe_bytes = sizeof(struct embd_sqe);
	h->cqe_bytes = sizeof(struct embd_cqe);
	h->sq_offset = EMBD_REGION_HEADER_BYTES;
	h->cq_offset = align_up(h->sq_offset + sq_bytes, EMBD_REGION_ALIGN);
	h->slab_offset = align_up(h->cq_offset + cq_bytes, EMBD_REGION_ALIGN);
	h->slab_bytes = align_up(slab_bytes, EMBD_REGION_ALIGN);
	h->region_bytes = h->slab_offset + h->slab_bytes;
	return 0;
}

/* Maps the fd and attaches both rings for `side`; region->layout is already trusted. */
static int map_region(struct embd_region *r, char *err, size_t err_len)
{
	enum embd_ring_role sq_role = r->side == EMBD_REGION_SERVICE ? EMBD_RING_CONSUMER : EMBD_RING_PRODUCER;
	enum embd_ring_role cq_role = r->side == EMBD_REGION_SERVICE ? EMBD_RING_PRODUCER : EMBD_RING_CONSUMER;
	unsigned char *base;

	base = mmap(NULL, r->layout.region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
	if (base == MAP_FAILED)
		return embd_fail(err, err_len, errno == ENOMEM ? EMBD_ENOMEM : EMBD_EIO,
				"region: mmap of %" PRIu64 " bytes failed: %s",
				r->layout.region_bytes, strerror(errno));
	r->base = base;
	if (r->side == EMBD_REGION_SERVICE) {
		embd_ring_format(base + r->layout.sq_offset);
		embd_ring_format(base + r->layout.cq_offset);
	}
	/* shapes were checked by compute_layout, so attach cannot fail */
	embd_ring_attach(&r->sq, base + r->layout.sq_offset, r->layout.sq_entries,
			 sizeof(struct embd_sqe), sq_role);
	embd_ring_attach(&r->cq, base + r->layout.cq_offset, r->layout.cq_entries,
			 sizeof(struct embd_cqe), cq_role);
	return 0;
}

int embd_region_create(struct embd_region **out, const struct embd_region_params *params,
		       const char *name, char *err, size_t err_len)
{
	struct embd_region *r;
	int rc;

	*out = NULL;
	r = calloc(1, sizeof(*r));
	if (!r)
		return embd_fail(err, err_len, EMBD_ENOMEM, "region: out of memory");
	r->fd = -1;
	r->side = EMBD_REGION_SERVICE;
	rc = compute_layout(&r->layout, params->sq_entries, params->cq_entries, params->slab_bytes,
			    err, err_len);
	if (rc)
		goto out;
	r->fd = memfd_create(name ? name : "embd-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (r->fd < 0) {
		rc = embd_fail(err, err_len, EMBD_EIO, "region: memfd_create: %s", strerror(errno));
		goto out;
	}
	if (ftruncate(r->fd, (off_t)r->layout.region_bytes) != 0) {
		rc = embd_fail(err, err_len, errno == ENOSPC || errno == EFBIG ? EMBD_ENOSPC : EMBD_EIO,
			      "region: ftruncate to %" PRIu64 " bytes: %s",
			      r->layout.region_bytes, strerror(errno));
		goto out;
	}
	if (fcntl(r->fd, F_ADD_SEALS, REGION_SEALS) != 0) {
		rc = embd_fail(err, err_len, EMBD_EIO, "region: F_ADD_SEALS: %s", strerror(errno));
		goto out;
	}
	rc = map_region(r, err, err_len);
	if (rc)
		goto out;
	memcpy(r->base, &r->layout, sizeof(r->layout));
	*out = r;
	return 0;
out:
	embd_region_destroy(r);
	return rc;
}

/* Client side: checks the header copy `h` read from a mapping of file_bytes. */
static int check_header(const struct embd_region_header *h, uint64_t file_bytes, char *err,
			size_t err_len)
{
	struct embd_region_header want;
	int rc;

	if (h->magic != EMBD_REGION_MAGIC)
		return embd_fail(err, err_len, EMBD_EPROTO, "region.magic: expected 0x%08x, got 0x%08x",
				EMBD_REGION_MAGIC, h->magic);
	if (h->version != EMBD_REGION_VERSION)
		return embd_fail(err, err_len, EMBD_EPROTO, "region.version: expected %u, got %" PRIu32,
				EMBD_REGION_VERSION, h->version);
	if (h->sqe_bytes != sizeof(struct embd_sqe) || h->cqe_bytes != sizeof(struct embd_cqe))
		return embd_fail(err, err_len, EMBD_EPROTO,
				"region.sqe_bytes/cqe_bytes: expected %zu/%zu, got %" PRIu32 "/%" PRIu32,
				sizeof(struct embd_sqe), sizeof(struct embd_cqe), h->sqe_bytes, h->cqe_bytes);
	/* one layout rule for both sides: recompute it and demand the same offsets */
	rc = compute_layout(&want, h->sq_entries, h->cq_entries, h->slab_bytes, err, err_len);
	if (rc)
		return EMBD_EPROTO;
	if (memcmp(&want, h, sizeof(want)) != 0)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"region: offsets or sizes in the header disagree with its ring and slab sizes");
	if (h->region_bytes != file_bytes)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"region.region_bytes: header says %" PRIu64 ", memfd has %" PRIu64,
				h->region_bytes, file_bytes);
	return 0;
}

int embd_region_attach(struct embd_region **out, int fd, char *err, size_t err_len)
{
	struct embd_region *r = NULL;
	void *head = MAP_FAILED;
	struct stat st;
	int seals, rc;

	*out = NULL;
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0) {
		rc = embd_fail(err, err_len, EMBD_EPROTO, "region: fd is not a sealable memfd: %s",
			      strerror(errno));
		goto out;
	}
	if ((seals & REGION_SEALS) != REGION_SEALS) {
		rc = embd_fail(err, err_len, EMBD_EPROTO,
			      "region: seals 0x%x lack SHRINK|GROW|SEAL (0x%x)", seals, REGION_SEALS);
		goto out;
	}
	if (fstat(fd, &st) != 0 || st.st_size < (off_t)EMBD_REGION_HEADER_BYTES) {
		rc = embd_fail(err, err_len, EMBD_EPROTO, "region: memfd smaller than its header");
		goto out;
	}
	r = calloc(1, sizeof(*r));
	if (!r) {
		rc = embd_fail(err, err_len, EMBD_ENOMEM, "region: out of memory");
		goto out;
	}
	r->fd = -1;
	r->side = EMBD_REGION_CLIENT;
	head = mmap(NULL, EMBD_REGION_HEADER_BYTES, PROT_READ, MAP_SHARED, fd, 0);
	if (head == MAP_FAILED) {
		rc = embd_fail(err, err_len, EMBD_EIO, "region: mmap of the header: %s", strerror(errno));
		goto out;
	}
	memcpy(&r->layout, head, sizeof(r->layout));
	rc = check_header(&r->layout, (uint64_t)st.st_size, err, err_len);
	if (rc)
		goto out;
	r->fd = fd;
	rc = map_region(r, err, err_len);
	if (rc) {
		r->fd = -1;     /* the caller still owns fd on failure */
		goto out;
	}
	munmap(head, EMBD_REGION_HEADER_BYTES);
	*out = r;
	return 0;
out:
	if (head != MAP_FAILED)
		munmap(head, EMBD_REGION_HEADER_BYTES);
	embd_region_destroy(r);
	return rc;
}

void embd_region_destroy(struct embd_region *r)
{
	if (!r)
		return;
	if (r->base)
		munmap(r->base, r->layout.region_bytes);
	if (r->fd >= 0)
		close(r->fd);
	free(r);
}

int embd_region_fd(const struct embd_region *r)
{
	return r->fd;
}

uint64_t embd_region_bytes(const struct embd_region *r)
{
	return r->layout.region_bytes;
}

enum embd_region_side embd_region_side(const struct embd_region *r)
{
	return r->side;
}

struct embd_ring *embd_region_sq(struct embd_region *r)
{
	return &r->sq;
}

struct embd_ring *embd_region_cq(struct embd_region *r)
{
	return &r->cq;
}

void *embd_region_slab(const struct embd_region *r)
{
	return (unsigned char *)r->base + r->layout.slab_offset;
}

uint64_t embd_region_slab_bytes(const struct embd_region *r)
{
	return r->layout.slab_bytes;
}
