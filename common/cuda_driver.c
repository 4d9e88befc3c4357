/*
 * common/cuda_driver.c - the CUDA driver's VMM entry points through dlopen (cuda_driver.h).
 *
 * The driver is never dlclose'd: after cuInit it runs threads of its own and hands out
 * pointers into itself, and a process that unloaded it (libcudart, which loads it too, keeps a
 * reference of its own, but a plain C trainer may not) would crash at its next call. Loaded
 * with RTLD_NODELETE, it stays for the life of the process whoever closes it.
 */
#include "common/cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/err.h"
#include "embd/types.h"

/* Each entry point: the struct member it fills, by the symbol's name. */
#define ENTRY(name) { #name, offsetof(struct embd_cuda_driver, name) }
static const struct {
	const char *symbol;
	size_t at;
} entries[] = {
	ENTRY(cuInit), ENTRY(cuDriverGetVersion), ENTRY(cuGetErrorName), ENTRY(cuGetErrorString),
	ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet), ENTRY(cuDeviceGetUuid_v2),
	ENTRY(cuDeviceGetPCIBusId), ENTRY(cuDeviceGetAttribute), ENTRY(cuDevicePrimaryCtxRetain),
	ENTRY(cuDevicePrimaryCtxRelease_v2), ENTRY(cuCtxPushCurrent_v2), ENTRY(cuCtxPopCurrent_v2),
	ENTRY(cuMemGetAllocationGranularity), ENTRY(cuMemCreate), ENTRY(cuMemRelease),
	ENTRY(cuMemExportToShareableHandle), ENTRY(cuMemImportFromShareableHandle),
	ENTRY(cuMemAddressReserve), ENTRY(cuMemAddressFree), ENTRY(cuMemMap), ENTRY(cuMemUnmap),
	ENTRY(cuMemSetAccess),
};
#undef ENTRY

int embd_cuda_driver_load(const char *library, struct embd_cuda_driver *out, char *err,
			  size_t err_len)
{
	memset(out, 0, sizeof(*out));
	out->lib = dlopen(library, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
	if (!out->lib) {
		const char *why = dlerror();
		return embd_fail(err, err_len, EMBD_ENOTSUP, "no CUDA driver: %s",
				 why ? why : library);
	}
	for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
		void *fn = dlsym(out->lib, entries[i].symbol);
		if (!fn) {
			dlclose(out->lib);      /* RTLD_NODELETE: the library itself stays */
			memset(out, 0, sizeof(*out));
			return embd_fail(err, err_len, EMBD_ENOTSUP, "the CUDA driver (%s) has no %s: "
					 "it predates the virtual memory management API that device "
					 "outputs need (a driver of CUDA 11.4 or later has it)",
					 library, entries[i].symbol);
		}
		/* POSIX guarantees a function pointer survives the round trip through void * */
		memcpy((char *)out + entries[i].at, &fn, sizeof(fn));
	}
	return 0;
}

static struct {
	pthread_once_t once;
	struct embd_cuda_driver driver;
	int rc;
	char err[256];
} process_driver = { .once = PTHREAD_ONCE_INIT };

static void load_process_driver(void)
{
	process_driver.rc = embd_cuda_driver_load(EMBD_CUDA_DRIVER_LIBRARY, &process_driver.driver,
						  process_driver.err, sizeof(process_driver.err));
}

int embd_cuda_driver(const struct embd_cuda_driver **out, char *err, size_t err_len)
{
	pthread_once(&process_driver.once, load_process_driver);
	*out = process_driver.rc ? NULL : &process_driver.driver;
	if (process_driver.rc)
		return embd_fail(err, err_len, process_driver.rc, "%s", process_driver.err);
	return 0;
}

const char *embd_cuda_driver_strerror(const struct embd_cuda_driver *d, embd_cu_result e,
				      char *buf, size_t len)
{
	const char *name = NULL, *text = NULL;

	if (d->cuGetErrorName(e, &name) || !name)
		name = "CUDA_ERROR_UNKNOWN";
	if (d->cuGetErrorString(e, &text) || !text)
		text = "no description";
	snprintf(buf, len, "%s (%d: %s)", name, e, text);
	return buf;
}

int embd_cuda_driver_fail(const struct embd_cuda_driver *d, embd_cu_result e, const char *what,
			  char *err, size_t err_len)
{
	char text[160];

	snprintf(err, err_len, "%s: %s", what, embd_cuda_driver_strerror(d, e, text, sizeof(text)));
	return e == EMBD_CU_ERROR_OUT_OF_MEMORY ? EMBD_ENOMEM :
	       e == EMBD_CU_ERROR_NO_DEVICE ? EMBD_ENOTSUP : EMBD_EIO;
}

const char *embd_cuda_uuid_text(const uint8_t uuid[16], char buf[EMBD_CUDA_UUID_TEXT])
{
	char *p = buf + snprintf(buf, EMBD_CUDA_UUID_TEXT, "GPU-");

	for (int i = 0; i < 16; i++) {
		if (i == 4 || i == 6 || i == 8 || i == 10)
			*p++ = '-';
		p += snprintf(p, (size_t)(buf + EMBD_CUDA_UUID_TEXT - p), "%02x", uuid[i]);
	}
	return buf;
}
