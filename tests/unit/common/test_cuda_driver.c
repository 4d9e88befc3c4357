/*
 * Tests for common/cuda_driver.h on any machine: the driver's absence and a driver older than
 * the VMM API are refused naming what is missing (stand-ins opened by path,
 * fake_cuda_driver.c), a complete one loads and its errors read in the driver's words, UUIDs
 * print as nvidia-smi prints them, and the process's driver is loaded once.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "common/cuda_driver.h"
#include "embd/types.h"

Test(cuda_driver, a_missing_driver_is_not_supported_saying_so)
{
	struct embd_cuda_driver d;
	char err[256] = "";

	cr_assert_eq(embd_cuda_driver_load("/nonexistent/libcuda.so.1", &d, err, sizeof(err)),
		     EMBD_ENOTSUP);
	cr_expect(strstr(err, "no CUDA driver: /nonexistent/libcuda.so.1"), "got \"%s\"", err);
	cr_expect_null(d.lib);
}

Test(cuda_driver, a_driver_without_the_vmm_api_is_refused_naming_the_call)
{
	struct embd_cuda_driver d;
	char err[512] = "";

	cr_assert_eq(embd_cuda_driver_load(FAKE_DRIVER_OLD, &d, err, sizeof(err)), EMBD_ENOTSUP);
	cr_expect(strstr(err, "has no cuMemGetAllocationGranularity"), "got \"%s\"", err);
	cr_expect(strstr(err, "virtual memory management"), "got \"%s\"", err);
	cr_expect_null(d.cuInit, "a refused driver hands out no entry point");
}

Test(cuda_driver, a_complete_driver_loads_and_its_errors_read_in_its_words)
{
	struct embd_cuda_driver d;
	char err[256] = "", text[160];
	int n = -1;

	cr_assert_eq(embd_cuda_driver_load(FAKE_DRIVER, &d, err, sizeof(err)), 0, "%s", err);
	cr_assert_not_null(d.cuMemSetAccess);
	embd_cu_result e = d.cuDeviceGetCount(&n);
	cr_expect_eq(e, 100);
	cr_expect_str_eq(embd_cuda_driver_strerror(&d, e, text, sizeof(text)),
			 "CUDA_ERROR_NO_DEVICE (100: no CUDA-capable device is detected)");
	cr_expect_str_eq(embd_cuda_driver_strerror(&d, 7, text, sizeof(text)),
			 "CUDA_ERROR_UNKNOWN (7: no description)");
}

Test(cuda_driver, uuids_print_as_nvidia_smi_prints_them)
{
	const uint8_t uuid[16] = { 0x8e, 0x6f, 0x10, 0x2a, 0x00, 0xff, 0x12, 0x34,
				   0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x02 };
	char text[EMBD_CUDA_UUID_TEXT];

	cr_expect_str_eq(embd_cuda_uuid_text(uuid, text),
			 "GPU-8e6f102a-00ff-1234-5678-9abcdef00102");
}

/* Whatever this machine has: a second call answers as the first (loaded once, kept). */
Test(cuda_driver, the_process_driver_is_loaded_once)
{
	const struct embd_cuda_driver *a, *b;
	char err_a[256] = "", err_b[256] = "";
	int rc_a = embd_cuda_driver(&a, err_a, sizeof(err_a));
	int rc_b = embd_cuda_driver(&b, err_b, sizeof(err_b));

	cr_expect_eq(rc_a, rc_b);
	cr_expect_eq(a, b);
	cr_expect_str_eq(err_a, err_b);
	if (rc_a)
		cr_expect(strstr(err_a, "libcuda.so.1"), "a refusal names the library: \"%s\"", err_a);
}
