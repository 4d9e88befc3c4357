/*
 * libclient/device.c - device outputs on the trainer's side (device.h).
 *
 * The CUDA driver is opened with dlopen (common/cuda_driver.h) only when a trainer asks for
 * device outputs: libembdclient serves CPU trainers on machines without the NVIDIA driver and
 * is packaged without a CUDA dependency, and a trainer that has CUDA (PyTorch's, say) already
 * has the driver loaded, which the dlopen then shares. The import runs with the device's
 * primary context current (the one the CUDA runtime and PyTorch use) and keeps it retained
 * until the mapping goes, so the mapping outlives nobody's context.
 */
#include "libclient/device.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cuda_driver.h"
#include "common/err.h"

struct client_device {
	const struct embd_cuda_driver *drv;     /* NULL: the host double */
	uint64_t bytes;
	embd_cu_device dev;
	embd_cu_mem_handle handle;
	embd_cu_ptr va;                         /* 0: no address range reserved */
	bool ctx_retained, imported, mapped;
	void *host;                             /* the host double's mapping */
};


int client_device_uuid(int ordinal, uint8_t uuid[16], char *err, size_t err_len)
{
	const struct embd_cuda_driver *d;
	embd_cu_device dev;
	embd_cu_result e;
	char text[160];
	int rc = embd_cuda_driver(&d, err, err_len), n = 0;

	if (rc)
		return rc;
	if ((e = d->cuInit(0)))
		return embd_fail(err, err_len, EMBD_ENOTSUP, "cuInit: %s (no usable GPU here)",
				 embd_cuda_driver_strerror(d, e, text, sizeof(text)));
	if ((e = d->cuDeviceGet(&dev, ordinal))) {
		d->cuDeviceGetCount(&n);
		return embd_fail(err, err_len, e == EMBD_CU_ERROR_INVALID_DEVICE ? EMBD_ENOENT : EMBD_EIO,
				 "cuda_device %d: %s (this process sees %d GPUs)", ordinal,
				 embd_cuda_driver_strerror(d, e, text, sizeof(text)), n);
	}
	if ((e = d->cuDeviceGetUuid_v2(uuid, dev)))
		return embd_cuda_driver_fail(d, e, "cuDeviceGetUuid_v2", err, err_len);
	return 0;
}

/* The host double: a sealed memfd (the seal keeps the service from shrinking it under us). */
static int map_host(struct client_device *d, int fd, char *err, size_t err_len)
{
	struct stat st;
	int seals = fcntl(fd, F_GET_SEALS);

	if (seals < 0 || !(seals & F_SEAL_SHRINK) || fstat(fd, &st) != 0 ||
	    (uint64_t)st.st_size < d->bytes)
		return embd_fail(err, err_len, EMBD_EPROTO, "device outputs: the host memory's fd is "
				 "not a memfd of %llu bytes sealed against shrinking",
				 (unsigned long long)d->bytes);
	void *p = mmap(NULL, d->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return embd_fail(err, err_len, EMBD_EIO, "device outputs: mmap: %s", strerror(errno));
	d->host = p;
	return 0;
}

/* Imports fd and maps it at an address range of its own, readable and writable by d->dev;
 * *what names the call that failed. Under the device's context. */
static embd_cu_result import_and_map(struct client_device *d, int fd, const char **what)
{
	const struct embd_cuda_driver *drv = d->drv;
	const struct embd_cu_access_desc access = { { EMBD_CU_MEM_LOCATION_DEVICE, d->dev },
						    EMBD_CU_MEM_ACCESS_READWRITE };
	embd_cu_ptr va = 0;
	embd_cu_result e;

	*what = "cuMemImportFromShareableHandle";
	if ((e = drv->cuMemImportFromShareableHandle(&d->handle, (void *)(uintptr_t)fd,
						     EMBD_CU_MEM_HANDLE_POSIX_FD)))
		return e;
	d->imported = true;
	*what = "cuMemAddressReserve";
	if ((e = drv->cuMemAddressReserve(&va, d->bytes, 0, 0, 0)))
		return e;
	d->va = va;
	*what = "cuMemMap";
	if ((e = drv->cuMemMap(d->va, d->bytes, 0, d->handle, 0)))
		return e;
	d->mapped = true;
	*what = "cuMemSetAccess";
	return drv->cuMemSetAccess(d->va, d->bytes, &access, 1);
}

/* CUDA memory, with the device's primary context current meanwhile (and retained after). */
static int map_cuda(struct client_device *d, int fd, int ordinal, char *err, size_t err_len)
{
	const struct embd_cuda_driver *drv = d->drv;
	embd_cu_context ctx = NULL, popped;
	const char *what = "cuInit";
	embd_cu_result e;

	if ((e = drv->cuInit(0)))
		goto fail;
	what = "cuDeviceGet";
	if ((e = drv->cuDeviceGet(&d->dev, ordinal)))
		goto fail;
	what = "cuDevicePrimaryCtxRetain";
	if ((e = drv->cuDevicePrimaryCtxRetain(&ctx, d->dev)))
		goto fail;
	d->ctx_retained = true;
	what = "cuCtxPushCurrent";
	if ((e = drv->cuCtxPushCurrent_v2(ctx)))
		goto fail;
	e = import_and_map(d, fd, &what);
	drv->cuCtxPopCurrent_v2(&popped);
	if (!e)
		return 0;
fail:
	return embd_cuda_driver_fail(drv, e, what, err, err_len);
}

int client_device_map(const struct embd_ctl_device_outputs *rep, int fd, int ordinal,
		      struct client_device **out, uint8_t **base, char *err, size_t err_len)
{
	struct client_device *d = calloc(1, sizeof(*d));
	int rc = EMBD_ENOMEM;

	*out = NULL;
	*base = NULL;
	if (!d) {
		embd_fail(err, err_len, rc, "device outputs: out of memory");
		goto out;
	}
	d->bytes = rep->bytes;
	if (rep->memory == EMBD_CTL_MEMORY_HOST) {
		rc = map_host(d, fd, err, err_len);
	} else {
		rc = embd_cuda_driver(&d->drv, err, err_len);
		if (!rc)
			rc = map_cuda(d, fd, ordinal, err, err_len);
	}
	if (rc)
		goto out;
	*base = d->drv ? (uint8_t *)(uintptr_t)d->va : d->host;
	*out = d;
	d = NULL;
out:
	client_device_unmap(d);
	close(fd);      /* imported or mapped: the mapping holds the memory now */
	return rc;
}

void client_device_unmap(struct client_device *d)
{
	if (!d)
		return;
	if (d->drv) {
		if (d->mapped)
			d->drv->cuMemUnmap(d->va, d->bytes);
		if (d->va)
			d->drv->cuMemAddressFree(d->va, d->bytes);
		if (d->imported)
			d->drv->cuMemRelease(d->handle);
		if (d->ctx_retained)
			d->drv->cuDevicePrimaryCtxRelease_v2(d->dev);
	} else if (d->host) {
		munmap(d->host, d->bytes);
	}
	free(d);
}
