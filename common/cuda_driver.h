/*
 * common/cuda_driver.h - the few calls of the CUDA driver API that device outputs need (the
 * virtual memory management API: cuMemCreate, export and import of a POSIX file descriptor,
 * mapping), loaded at run time with dlopen("libcuda.so.1") instead of linked.
 *
 * The one idea: nothing that links this needs the NVIDIA driver to start. libembdclient serves
 * CPU trainers on machines without a driver, and embd runs CPU ranks there; both only open the
 * driver when a trainer asks for device outputs, and a missing driver, or one older than the
 * VMM API, is then an error that names what is missing rather than a loader failure at start.
 * So no cuda.h either: the types and constants below are the driver's ABI (stable since CUDA
 * 10.2, uuid_v2 since 11.4), written out, and tests/unit/common/test_cuda_driver_abi.c checks
 * them against cuda.h wherever the toolkit is installed.
 */
#ifndef EMBD_COMMON_CUDA_DRIVER_H
#define EMBD_COMMON_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

/* ---- the driver's ABI (cuda.h's names in comments) ---------------------------------------- */

typedef int embd_cu_result;                     /* CUresult: 0 is CUDA_SUCCESS */
typedef int embd_cu_device;                     /* CUdevice: an ordinal */
typedef void *embd_cu_context;                  /* CUcontext */
typedef unsigned long long embd_cu_ptr;         /* CUdeviceptr */
typedef unsigned long long embd_cu_mem_handle;  /* CUmemGenericAllocationHandle */

#define EMBD_CU_ERROR_INVALID_DEVICE 101        /* CUDA_ERROR_INVALID_DEVICE */
#define EMBD_CU_ERROR_OUT_OF_MEMORY 2           /* CUDA_ERROR_OUT_OF_MEMORY */
#define EMBD_CU_ERROR_NO_DEVICE 100             /* CUDA_ERROR_NO_DEVICE */
#define EMBD_CU_MEM_HANDLE_POSIX_FD 1           /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
#define EMBD_CU_MEM_ALLOCATION_PINNED 1         /* CU_MEM_ALLOCATION_TYPE_PINNED */
#define EMBD_CU_MEM_LOCATION_DEVICE 1           /* CU_MEM_LOCATION_TYPE_DEVICE */
#define EMBD_CU_MEM_ACCESS_READWRITE 3          /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
#define EMBD_CU_GRANULARITY_RECOMMENDED 1       /* CU_MEM_ALLOC_GRANULARITY_RECOMMENDED */
#define EMBD_CU_ATTR_VMM_SUPPORTED 102          /* ..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
#define EMBD_CU_ATTR_POSIX_FD_SUPPORTED 103     /* ..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */

struct embd_cu_location {                       /* CUmemLocation */
	int type;
	int id;
};

struct embd_cu_alloc_prop {                     /* CUmemAllocationProp */
	int type;
	int requested_handle_types;
	struct embd_cu_location location;
	void *win32_metadata;
	unsigned char compression_type;
	unsigned char gpu_direct_rdma_capable;
	unsigned short usage;
	unsigned char reserved[4];
};

struct embd_cu_access_desc {                    /* CUmemAccessDesc */
	struct embd_cu_location location;
	int flags;
};

/* ---- the loaded driver -------------------------------------------------------------------- */

/* Entry points, named as cuda.h's functions (the exported symbol where cuda.h maps a name to a
 * versioned one: cuDeviceGetUuid_v2, cuDevicePrimaryCtxRelease_v2, cuCtxPushCurrent_v2,
 * cuCtxPopCurrent_v2). */
struct embd_cuda_driver {
	void *lib;                      /* the dlopen handle (never closed: see the .c) */
	embd_cu_result (*cuInit)(unsigned int flags);
	embd_cu_result (*cuDriverGetVersion)(int *version);
	embd_cu_result (*cuGetErrorName)(embd_cu_result e, const char **name);
	embd_cu_result (*cuGetErrorString)(embd_cu_result e, const char **text);
	embd_cu_result (*cuDeviceGetCount)(int *count);
	embd_cu_result (*cuDeviceGet)(embd_cu_device *dev, int ordinal);
	embd_cu_result (*cuDeviceGetUuid_v2)(uint8_t uuid[16], embd_cu_device dev);
	embd_cu_result (*cuDeviceGetPCIBusId)(char *bus_id, int len, embd_cu_device dev);
	embd_cu_result (*cuDeviceGetAttribute)(int *value, int attribute, embd_cu_device dev);
	embd_cu_result (*cuDevicePrimaryCtxRetain)(embd_cu_context *ctx, embd_cu_device dev);
	embd_cu_result (*cuDevicePrimaryCtxRelease_v2)(embd_cu_device dev);
	embd_cu_result (*cuCtxPushCurrent_v2)(embd_cu_context ctx);
	embd_cu_result (*cuCtxPopCurrent_v2)(embd_cu_context *ctx);
	embd_cu_result (*cuMemGetAllocationGranularity)(size_t *granularity,
							const struct embd_cu_alloc_prop *prop,
							int option);
	embd_cu_result (*cuMemCreate)(embd_cu_mem_handle *handle, size_t size,
				      const struct embd_cu_alloc_prop *prop, unsigned long long flags);
	embd_cu_result (*cuMemRelease)(embd_cu_mem_handle handle);
	embd_cu_result (*cuMemExportToShareableHandle)(void *shareable, embd_cu_mem_handle handle,
						       int handle_type, unsigned long long flags);
	embd_cu_result (*cuMemImportFromShareableHandle)(embd_cu_mem_handle *handle,
							 void *os_handle, int handle_type);
	embd_cu_result (*cuMemAddressReserve)(embd_cu_ptr *ptr, size_t size, size_t alignment,
					      embd_cu_ptr addr, unsigned long long flags);
	embd_cu_result (*cuMemAddressFree)(embd_cu_ptr ptr, size_t size);
	embd_cu_result (*cuMemMap)(embd_cu_ptr ptr, size_t size, size_t offset,
				   embd_cu_mem_handle handle, unsigned long long flags);
	embd_cu_result (*cuMemUnmap)(embd_cu_ptr ptr, size_t size);
	embd_cu_result (*cuMemSetAccess)(embd_cu_ptr ptr, size_t size,
					 const struct embd_cu_access_desc *desc, size_t count);
};

/* The soname a process loads: the driver's, not the toolkit's stub. */
#define EMBD_CUDA_DRIVER_LIBRARY "libcuda.so.1"

/*
 * Loads `library` (EMBD_CUDA_DRIVER_LIBRARY, or another path: tests) and every entry point
 * above into *out. EMBD_ENOTSUP when the library does not load (no NVIDIA driver: dlerror's
 * words) or lacks one of them (a driver older than the VMM API or than cuDeviceGetUuid_v2:
 * the symbol named), with err saying so in one line.
 */
int embd_cuda_driver_load(const char *library, struct embd_cuda_driver *out, char *err,
			  size_t err_len);

/*
 * The process's driver: EMBD_CUDA_DRIVER_LIBRARY loaded once (thread-safe) and kept for the
 * life of the process. Returns 0 with *out, or the first load's error (and its message) every
 * time.
 */
int embd_cuda_driver(const struct embd_cuda_driver **out, char *err, size_t err_len);

/* "CUDA_ERROR_OUT_OF_MEMORY (out of memory)": the driver's name and text of e, into buf. */
const char *embd_cuda_driver_strerror(const struct embd_cuda_driver *d, embd_cu_result e,
				      char *buf, size_t len);
/* "what: <the driver's name and text of e>" into err; returns EMBD_ENOMEM for out of memory,
 * EMBD_ENOTSUP for no device (no GPU to use is a "cannot", not an I/O failure), else
 * EMBD_EIO. */
int embd_cuda_driver_fail(const struct embd_cuda_driver *d, embd_cu_result e, const char *what,
			  char *err, size_t err_len);

/* A GPU's UUID as nvidia-smi and CUDA_VISIBLE_DEVICES write it: "GPU-" and 36 characters
 * (8-4-4-4-12 hex digits). buf holds EMBD_CUDA_UUID_TEXT bytes. */
#define EMBD_CUDA_UUID_TEXT 41
const char *embd_cuda_uuid_text(const uint8_t uuid[16], char buf[EMBD_CUDA_UUID_TEXT]);

#endif /* EMBD_COMMON_CUDA_DRIVER_H */
