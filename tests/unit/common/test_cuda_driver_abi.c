/*
 * common/cuda_driver.h writes out the few types, constants and symbol names of the CUDA driver
 * it uses instead of including cuda.h (so libembdclient builds and runs without the toolkit);
 * here, where the toolkit is installed, they are checked against cuda.h's. A mismatch fails
 * the build.
 */
#include <criterion/criterion.h>
#include <stddef.h>

#include <cuda.h>

#include "common/cuda_driver.h"

#define SAME_SIZE(ours, theirs) \
	_Static_assert(sizeof(ours) == sizeof(theirs), #ours " is not " #theirs)
#define SAME_OFFSET(ours, f, theirs, g) \
	_Static_assert(offsetof(ours, f) == offsetof(theirs, g), #ours "." #f " is not " #g)

SAME_SIZE(embd_cu_result, CUresult);
SAME_SIZE(embd_cu_device, CUdevice);
SAME_SIZE(embd_cu_context, CUcontext);
SAME_SIZE(embd_cu_ptr, CUdeviceptr);
SAME_SIZE(embd_cu_mem_handle, CUmemGenericAllocationHandle);
SAME_SIZE(struct embd_cu_location, CUmemLocation);
SAME_OFFSET(struct embd_cu_location, id, CUmemLocation, id);
SAME_SIZE(struct embd_cu_alloc_prop, CUmemAllocationProp);
SAME_OFFSET(struct embd_cu_alloc_prop, requested_handle_types, CUmemAllocationProp,
	    requestedHandleTypes);
SAME_OFFSET(struct embd_cu_alloc_prop, location, CUmemAllocationProp, location);
SAME_OFFSET(struct embd_cu_alloc_prop, win32_metadata, CUmemAllocationProp, win32HandleMetaData);
SAME_OFFSET(struct embd_cu_alloc_prop, compression_type, CUmemAllocationProp,
	    allocFlags.compressionType);
SAME_OFFSET(struct embd_cu_alloc_prop, usage, CUmemAllocationProp, allocFlags.usage);
SAME_SIZE(struct embd_cu_access_desc, CUmemAccessDesc);
SAME_OFFSET(struct embd_cu_access_desc, flags, CUmemAccessDesc, flags);

_Static_assert(EMBD_CU_ERROR_INVALID_DEVICE == CUDA_ERROR_INVALID_DEVICE, "error code");
_Static_assert(EMBD_CU_ERROR_OUT_OF_MEMORY == CUDA_ERROR_OUT_OF_MEMORY, "error code");
_Static_assert(EMBD_CU_ERROR_NO_DEVICE == CUDA_ERROR_NO_DEVICE, "error code");
_Static_assert(EMBD_CU_MEM_HANDLE_POSIX_FD == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "handle");
_Static_assert(EMBD_CU_MEM_ALLOCATION_PINNED == CU_MEM_ALLOCATION_TYPE_PINNED, "allocation");
_Static_assert(EMBD_CU_MEM_LOCATION_DEVICE == CU_MEM_LOCATION_TYPE_DEVICE, "location");
_Static_assert(EMBD_CU_MEM_ACCESS_READWRITE == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access");
_Static_assert(EMBD_CU_GRANULARITY_RECOMMENDED == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, "option");
_Static_assert(EMBD_CU_ATTR_VMM_SUPPORTED ==
	       CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "attribute");
_Static_assert(EMBD_CU_ATTR_POSIX_FD_SUPPORTED ==
	       CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "attribute");

/* Each entry point's symbol is what cuda.h calls the function the code means (cuda.h maps
 * some names to versioned symbols with #define: those must be the versioned ones). */
#define STR(x) #x
#define SYMBOL(name) STR(name)

Test(cuda_driver_abi, the_symbols_are_the_ones_cuda_h_calls)
{
	cr_expect_str_eq(SYMBOL(cuDeviceGetUuid), "cuDeviceGetUuid_v2");
	cr_expect_str_eq(SYMBOL(cuDevicePrimaryCtxRelease), "cuDevicePrimaryCtxRelease_v2");
	cr_expect_str_eq(SYMBOL(cuCtxPushCurrent), "cuCtxPushCurrent_v2");
	cr_expect_str_eq(SYMBOL(cuCtxPopCurrent), "cuCtxPopCurrent_v2");
	cr_expect_str_eq(SYMBOL(cuMemCreate), "cuMemCreate");
	cr_expect_str_eq(SYMBOL(cuMemMap), "cuMemMap");
	cr_expect_str_eq(SYMBOL(cuMemSetAccess), "cuMemSetAccess");
	cr_expect_str_eq(SYMBOL(cuMemImportFromShareableHandle), "cuMemImportFromShareableHandle");
	cr_expect_str_eq(SYMBOL(cuMemExportToShareableHandle), "cuMemExportToShareableHandle");
	cr_expect_str_eq(SYMBOL(cuMemAddressReserve), "cuMemAddressReserve");
	cr_expect_str_eq(SYMBOL(cuDeviceGetAttribute), "cuDeviceGetAttribute");
	cr_expect_str_eq(SYMBOL(cuMemGetAllocationGranularity), "cuMemGetAllocationGranularity");
}
