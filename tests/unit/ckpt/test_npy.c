/*
 * .npy files (ckpt/npy.h): headers round-trip and keep the data 64-byte aligned; files
 * numpy itself wrote (1.0 and 2.0 headers, several dtypes and shapes, generated at test time
 * with python3 + numpy, skipped cleanly where they are missing) read back to numpy's values;
 * files written here load in numpy with the same values; malformed headers are refused with
 * the field named.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "embd/types.h"
#include "ckpt/npy.h"
#include "tests/support/numpy_python.h"

static char tmpdir[64];

static void setup(void)
{
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/embd-npy-XXXXXX");
	cr_assert_not_null(mkdtemp(tmpdir));
}

static void teardown(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
	cr_expect_eq(system(cmd), 0);
}

TestSuite(npy, .init = setup, .fini = teardown);

static int run_python(const char *py, const char *script)
{
	char path[128], cmd[512];
	snprintf(path, sizeof(path), "%s/script.py", tmpdir);
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(script, f);
	fclose(f);
	snprintf(cmd, sizeof(cmd), "cd %s && %s script.py", tmpdir, py);
	return system(cmd);
}

Test(npy, header_round_trip_is_aligned)
{
	uint8_t buf[4096];
	char err[256];
	size_t len;
	struct embd_npy_header h;
	uint64_t shapes[][3] = { { 3, 4, 0 }, { 5, 0, 0 }, { 0, 0, 0 }, { 100000, 128, 2 } };
	uint32_t ndims[] = { 2, 1, 0, 3 };

	for (int i = 0; i < 4; i++) {
		cr_assert_eq(embd_npy_header_format(EMBD_NPY_F4, ndims[i], shapes[i], buf, sizeof(buf),
						    &len), 0);
		cr_expect_eq(len % 64, 0, "header of %zu bytes: expected a multiple of 64", len);
		cr_expect_eq(buf[len - 1], '\n');
		int rc = embd_npy_header_parse(buf, len, &h, err, sizeof(err));
		cr_assert_eq(rc, 0, "parse: %d %s (header %.*s)", rc, err, (int)len - 10, buf + 10);
		cr_expect_eq(h.ndim, ndims[i]);
		cr_expect_eq(h.data_offset, len);
		uint64_t n = 4;
		for (uint32_t d = 0; d < ndims[i]; d++) {
			cr_expect_eq(h.shape[d], shapes[i][d]);
			n *= shapes[i][d];
		}
		cr_expect_eq(h.data_bytes, n);
	}
	cr_expect_eq(embd_npy_header_format(EMBD_NPY_F4, 2, shapes[0], buf, 32, &len), EMBD_ENOSPC);
}

static void expect_refused(const char *dict, int want_rc, const char *field)
{
	uint8_t buf[512];
	char err[256] = "";
	struct embd_npy_header h;
	size_t n = strlen(dict);

	memcpy(buf, "\x93NUMPY\x01\x00", 8);
	buf[8] = (uint8_t)n;
	buf[9] = 0;
	memcpy(buf + 10, dict, n);
	int rc = embd_npy_header_parse(buf, 10 + n, &h, err, sizeof(err));
	cr_expect_eq(rc, want_rc, "%s: expected %d, got %d (%s)", dict, want_rc, rc, err);
	cr_expect(strstr(err, field), "%s: expected the error to name '%s', got '%s'", dict, field,
		  err);
}

Test(npy, malformed_headers_are_refused_naming_the_field)
{
	expect_refused("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }\n", EMBD_ENOTSUP,
		       "descr");
	expect_refused("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }\n", EMBD_ENOTSUP,
		       "fortran_order");
	expect_refused("{'descr': '<f4', 'shape': (2,), }\n", EMBD_EPARSE, "fortran_order");
	expect_refused("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}\n",
		       EMBD_EPARSE, "'x'");
	expect_refused("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1), }\n",
		       EMBD_EPARSE, "shape");
	expect_refused("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, "
		       "99999999999, 99999999999), }\n", EMBD_EPARSE, "overflow");
	expect_refused("{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1), }\n",
		       EMBD_ENOTSUP, "dimensions");
	expect_refused("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", EMBD_EPARSE,
		       "npy header");
	expect_refused("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
		       EMBD_EPARSE, "repeated");
	uint8_t bad[16] = "\x93NUMPX\x01\x00\x00\x00";
	char err[128];
	struct embd_npy_header h;
	cr_expect_eq(embd_npy_header_parse(bad, sizeof(bad), &h, err, sizeof(err)), EMBD_EPARSE);
	uint8_t longhdr[12] = "\x93NUMPY\x01\x00\xff\x0f";
	cr_expect_eq(embd_npy_header_parse(longhdr, sizeof(longhdr), &h, err, sizeof(err)),
		     EMBD_EPARSE, "a header longer than the bytes given");
}

Test(npy, reads_what_numpy_wrote)
{
	const char *py = numpy_python();
	if (!py)
		cr_skip_test("python3 with numpy not found (set EMBD_PYTHON)");
	int rc = run_python(py,
		"import numpy as np\n"
		"a = np.arange(12, dtype='<f4').reshape(3, 4) * 0.5 - 1\n"
		"np.save('f4.npy', a)\n"
		"np.save('f2.npy', a.astype('<f2'))\n"
		"np.save('f8.npy', np.arange(5, dtype='<f8') / 3)\n"
		"np.save('i8.npy', np.arange(7, dtype='<i8') - 3)\n"
		"np.save('scalar.npy', np.float32(2.5))\n"
		"np.save('fortran.npy', np.asfortranarray(a))\n"
		"with open('v2.npy', 'wb') as f:\n"
		"    np.lib.format.write_array(f, a, version=(2, 0))\n");
	cr_assert_eq(rc, 0, "python3 failed writing the numpy files");
	char path[128], err[256];
	struct embd_npy_header h;
	void *data;
	const char *f4names[] = { "f4.npy", "v2.npy" };
	for (int k = 0; k < 2; k++) {
		snprintf(path, sizeof(path), "%s/%s", tmpdir, f4names[k]);
		rc = embd_npy_read_file(path, &h, &data, err, sizeof(err));
		cr_assert_eq(rc, 0, "%s: %d %s", f4names[k], rc, err);
		cr_expect(h.dtype == EMBD_NPY_F4 && h.ndim == 2 && h.shape[0] == 3 && h.shape[1] == 4);
		for (int i = 0; i < 12; i++)
			cr_expect_eq(((float *)data)[i], i * 0.5f - 1, "%s[%d]", f4names[k], i);
		free(data);
	}
	snprintf(path, sizeof(path), "%s/f2.npy", tmpdir);
	cr_assert_eq(embd_npy_read_file(path, &h, &data, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(h.dtype, EMBD_NPY_F2);
	cr_expect_eq(((uint16_t *)data)[2], 0x0000, "f2[2] = 0.0"); /* 2 * 0.5 - 1 */
	cr_expect_eq(((uint16_t *)data)[0], 0xbc00, "f2[0] = -1.0");
	free(data);
	snprintf(path, sizeof(path), "%s/f8.npy", tmpdir);
	cr_assert_eq(embd_npy_read_file(path, &h, &data, err, sizeof(err)), 0, "%s", err);
	cr_expect(h.dtype == EMBD_NPY_F8 && h.ndim == 1 && h.shape[0] == 5);
	cr_expect_eq(((double *)data)[4], 4.0 / 3);
	free(data);
	snprintf(path, sizeof(path), "%s/i8.npy", tmpdir);
	cr_assert_eq(embd_npy_read_file(path, &h, &data, err, sizeof(err)), 0, "%s", err);
	cr_expect(h.dtype == EMBD_NPY_I8 && ((int64_t *)data)[0] == -3);
	free(data);
	snprintf(path, sizeof(path), "%s/scalar.npy", tmpdir);
	cr_assert_eq(embd_npy_read_file(path, &h, &data, err, sizeof(err)), 0, "%s", err);
	cr_expect(h.ndim == 0 && h.data_bytes == 4 && ((float *)data)[0] == 2.5f);
	free(data);
	snprintf(path, sizeof(path), "%s/fortran.npy", tmpdir);
	rc = embd_npy_read_file(path, &h, &data, err, sizeof(err));
	cr_expect_eq(rc, EMBD_ENOTSUP, "fortran order: expected refused, got %d", rc);
	cr_expect(strstr(err, "fortran.npy") && strstr(err, "fortran_order"), "got '%s'", err);
}

Test(npy, numpy_reads_what_we_wrote)
{
	float a[6 * 5];
	uint64_t shape[2] = { 6, 5 };
	char path[128], err[256];
	uint32_t crc;
	uint64_t size;

	for (int i = 0; i < 30; i++)
		a[i] = (float)i / 7.0f - 2.0f;
	snprintf(path, sizeof(path), "%s/ours.npy", tmpdir);
	int rc = embd_npy_write_file(path, EMBD_NPY_F4, 2, shape, a, true, &crc, &size, err,
				     sizeof(err));
	cr_assert_eq(rc, 0, "%s", err);
	cr_expect_eq(size, 128 + sizeof(a), "size: expected 128 + data, got %llu",
		     (unsigned long long)size);
	struct embd_npy_header h;
	void *back;
	cr_assert_eq(embd_npy_read_file(path, &h, &back, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(memcmp(back, a, sizeof(a)), 0, "read back differs");
	free(back);
	/* a file that ends early or late is refused */
	cr_assert_eq(truncate(path, (off_t)size - 1), 0);
	cr_expect_eq(embd_npy_read_file(path, &h, &back, err, sizeof(err)), EMBD_EPARSE);
	cr_assert_eq(embd_npy_write_file(path, EMBD_NPY_F4, 2, shape, a, false, NULL, NULL, err,
					 sizeof(err)), 0);
	const char *py = numpy_python();
	if (!py)
		cr_skip_test("python3 with numpy not found (set EMBD_PYTHON)");
	rc = run_python(py,
		"import numpy as np, sys\n"
		"a = np.load('ours.npy')\n"
		"want = (np.arange(30, dtype=np.float32) / np.float32(7) - np.float32(2)).reshape(6, 5)\n"
		"sys.exit(0 if a.dtype == np.float32 and a.shape == (6, 5) and (a == want).all() "
		"and a.flags['C_CONTIGUOUS'] else 1)\n");
	cr_expect_eq(rc, 0, "numpy: expected ours.npy to load as float32 (6, 5) with our values");
}
