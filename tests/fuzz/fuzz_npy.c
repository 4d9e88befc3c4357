/*
 * Fuzz target for .npy headers (ckpt/npy.h): any bytes; a header that parses must describe
 * a data offset inside the bytes given and a size without overflow, and formatting the same
 * dtype and shape must parse back to the same description.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct embd_npy_header h, again;
	uint8_t buf[EMBD_NPY_HEADER_MAX];
	char err[256];
	size_t len;

	if (embd_npy_header_parse(data, size, &h, err, sizeof(err)))
		return 0;
	if (h.data_offset > size || h.ndim > EMBD_NPY_NDIM_MAX)
		abort();
	if (embd_npy_header_format(h.dtype, h.ndim, h.shape, buf, sizeof(buf), &len))
		return 0;       /* a shape too long to format is fine to refuse */
	if (embd_npy_header_parse(buf, len, &again, err, sizeof(err)) || again.dtype != h.dtype ||
	    again.ndim != h.ndim || again.data_bytes != h.data_bytes ||
	    memcmp(again.shape, h.shape, sizeof(h.shape)))
		abort();
	return 0;
}
