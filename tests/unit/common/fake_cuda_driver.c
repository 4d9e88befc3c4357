/*
 * A stand-in for libcuda.so.1 that test_cuda_driver opens by path: every entry point of
 * common/cuda_driver.h, each answering CUDA_ERROR_NO_DEVICE (100) as a driver on a machine
 * without a GPU does. Built with FAKE_DRIVER_WITHOUT_VMM it is a driver older than the virtual
 * memory management API: the cuMem* calls are missing.
 */
#include <stddef.h>

#define NO_DEVICE 100

#define FAKE(name) int name(void); int name(void) { return NO_DEVICE; }

FAKE(cuInit)
FAKE(cuDriverGetVersion)
FAKE(cuDeviceGetCount)
FAKE(cuDeviceGet)
FAKE(cuDeviceGetUuid_v2)
FAKE(cuDeviceGetPCIBusId)
FAKE(cuDeviceGetAttribute)
FAKE(cuDevicePrimaryCtxRetain)
FAKE(cuDevicePrimaryCtxRelease_v2)
FAKE(cuCtxPushCurrent_v2)
FAKE(cuCtxPopCurrent_v2)
#ifndef FAKE_DRIVER_WITHOUT_VMM
FAKE(cuMemGetAllocationGranularity)
FAKE(cuMemCreate)
FAKE(cuMemRelease)
FAKE(cuMemExportToShareableHandle)
FAKE(cuMemImportFromShareableHandle)
FAKE(cuMemAddressReserve)
FAKE(cuMemAddressFree)
FAKE(cuMemMap)
FAKE(cuMemUnmap)
FAKE(cuMemSetAccess)
#endif

int cuGetErrorName(int e, const char **name);
int cuGetErrorName(int e, const char **name)
{
	*name = e == NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : NULL;
	return *name ? 0 : 1;
}

int cuGetErrorString(int e, const char **text);
int cuGetErrorString(int e, const char **text)
{
	*text = e == NO_DEVICE ? "no CUDA-capable device is detected" : NULL;
	return *text ? 0 : 1;
}
