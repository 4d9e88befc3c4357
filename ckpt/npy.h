/*
 * ckpt/npy.h - numpy's .npy file format (format versions 1.0, 2.0 and 3.0), the format of
 * every checkpoint shard file and of `embctl export/import`.
 *
 * A file is the magic "\x93NUMPY", two version bytes, the header length (uint16 little-endian
 * in 1.0, uint32 in 2.0/3.0), an ASCII header that is a Python dict literal
 *   {'descr': '<f4', 'fortran_order': False, 'shape': (rows, cols), }
 * padded with spaces and ended by '\n' so that the data starts at a multiple of 64 bytes, and
 * the raw array in C order. The writer emits 1.0 (2.0 when the header does not fit 65535
 * bytes). The reader takes the keys in any order and refuses, naming the field, anything else:
 * big-endian or unknown dtypes, fortran_order True, a shape over EMBD_NPY_NDIM_MAX dimensions,
 * a data size that overflows, a header that runs past the bytes given.
 */
#ifndef EMBD_CKPT_NPY_H
#define EMBD_CKPT_NPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define EMBD_NPY_NDIM_MAX 4
#define EMBD_NPY_ALIGN 64u              /* data offset alignment the writer keeps */
#define EMBD_NPY_HEADER_MAX 4096u       /* bytes of header the reader accepts */

enum embd_npy_dtype {
	EMBD_NPY_F2 = 1,                /* '<f2' IEEE binary16 */
	EMBD_NPY_F4,                    /* '<f4' */
	EMBD_NPY_F8,                    /* '<f8' */
	EMBD_NPY_I4,                    /* '<i4' */
	EMBD_NPY_I8,                    /* '<i8' */
	EMBD_NPY_U1,                    /* '|u1' */
};

struct embd_npy_header {
	enum embd_npy_dtype dtype;
	uint32_t ndim;                  /* 0 = a scalar */
	uint64_t shape[EMBD_NPY_NDIM_MAX];
	uint64_t data_offset;           /* bytes before the array (magic + header) */
	uint64_t data_bytes;            /* product of shape times the element size */
};

/* Bytes of one element; "<f4" and friends; 0 / NULL for a value outside the enum. */
uint32_t embd_npy_dtype_bytes(enum embd_npy_dtype dtype);
const char *embd_npy_dtype_name(enum embd_npy_dtype dtype);

/*
 * Formats the header of an array (magic, version, length, dict, padding) into buf (cap
 * bytes); *len_out = its bytes, a multiple of EMBD_NPY_ALIGN. EMBD_ENOSPC when cap is short,
 * EMBD_EINVAL for a bad dtype, ndim or a size that overflows.
 */
int embd_npy_header_format(enum embd_npy_dtype dtype, uint32_t ndim, const uint64_t *shape,
			   void *buf, size_t cap, size_t *len_out);

/*
 * Parses the header at the start of bytes (len of them; the array may follow or not).
 * Returns 0, or EMBD_EPARSE / EMBD_ENOTSUP with err naming the field.
 */
int embd_npy_header_parse(const void *bytes, size_t len, struct embd_npy_header *out, char *err,
			  size_t err_len);

/*
 * Writes an array to path (O_CREAT|O_TRUNC, mode 0644): header, then data_bytes from data.
 * With sync the file is fsynced before it is closed. *crc_out (when not NULL) gets the
 * CRC-32C of the whole file and *size_out its bytes. Errors name the path.
 */
int embd_npy_write_file(const char *path, enum embd_npy_dtype dtype, uint32_t ndim,
			const uint64_t *shape, const void *data, bool sync, uint32_t *crc_out,
			uint64_t *size_out, char *err, size_t err_len);

/*
 * Reads a whole .npy file: *hdr, and *data (malloc'ed, hdr->data_bytes, caller frees).
 * The file must end exactly where the array does. Errors name the path and the field.
 */
int embd_npy_read_file(const char *path, struct embd_npy_header *hdr, void **data, char *err,
		       size_t err_len);

#endif /* EMBD_CKPT_NPY_H */
