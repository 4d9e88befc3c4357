/*
 * The .npy format (ckpt/npy.h). The header is parsed by a small recursive-descent reader
 * of exactly the Python literal subset numpy writes (strings, True/False, tuples of
 * non-negative integers) - never by anything that evaluates it. File writes go in chunks so
 * the CRC-32C of a chunk is computed while it is still in cache, and a synced write starts
 * each chunk's writeback right away.
 */
#include "ckpt/npy.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "embd/types.h"
#include "ckpt/crc32c.h"

#define WRITE_CHUNK (4u << 20)

static const struct {
	enum embd_npy_dtype dtype;
	const char *name;
	uint32_t bytes;
} dtypes[] = {
	{ EMBD_NPY_F2, "<f2", 2 }, { EMBD_NPY_F4, "<f4", 4 }, { EMBD_NPY_F8, "<f8", 8 },
	{ EMBD_NPY_I4, "<i4", 4 }, { EMBD_NPY_I8, "<i8", 8 }, { EMBD_NPY_U1, "|u1", 1 },
};
#define NUM_DTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

uint32_t embd_npy_dtype_bytes(enum embd_npy_dtype dtype)
{
	for (size_t i = 0; i < NUM_DTYPES; i++)
		if (dtypes[i].dtype == dtype)
			return dtypes[i].bytes;
	return 0;
}

const char *embd_npy_dtype_name(enum embd_npy_dtype dtype)
{
	for (size_t i = 0; i < NUM_DTYPES; i++)
		if (dtypes[i].dtype == dtype)
			return dtypes[i].name;
	return NULL;
}

/* Product of the shape times the element size; false on overflow. */
static bool data_bytes(enum embd_npy_dtype dtype, uint32_t ndim, const uint64_t *shape,
		       uint64_t *out)
{
	uint64_t n = embd_npy_dtype_bytes(dtype);
	for (uint32_t i = 0; i < ndim; i++)
		if (__builtin_mul_overflow(n, shape[i], &n))
			return false;
	*out = n;
	return n <= INT64_MAX;
}

int embd_npy_header_format(enum embd_npy_dtype dtype, uint32_t ndim, const uint64_t *shape,
			   void *buf, size_t cap, size_t *len_out)
{
	char dict[EMBD_NPY_HEADER_MAX];
	uint64_t bytes;
	int n;

	if (!embd_npy_dtype_name(dtype) || ndim > EMBD_NPY_NDIM_MAX ||
	    !data_bytes(dtype, ndim, shape, &bytes))
		return EMBD_EINVAL;
	n = snprintf(dict, sizeof(dict), "{'descr': '%s', 'fortran_order': False, 'shape': (",
		     embd_npy_dtype_name(dtype));
	for (uint32_t i = 0; i < ndim; i++)
		n += snprintf(dict + n, sizeof(dict) - (size_t)n, "%s%" PRIu64 "%s", i ? ", " : "",
			      shape[i], ndim == 1 ? "," : "");
	n += snprintf(dict + n, sizeof(dict) - (size_t)n, "), }");
	/* magic(6) + version(2) + length(2) + dict + padding + '\n' */
	size_t total = (10 + (size_t)n + 1 + EMBD_NPY_ALIGN - 1) / EMBD_NPY_ALIGN * EMBD_NPY_ALIGN;
	if (total > cap)
		return EMBD_ENOSPC;
	uint8_t *p = buf;
	memcpy(p, "\x93NUMPY\x01\x00", 8);
	uint16_t hlen = (uint16_t)(total - 10);
	p[8] = (uint8_t)hlen;
	p[9] = (uint8_t)(hlen >> 8);
	memcpy(p + 10, dict, (size_t)n);
	memset(p + 10 + n, ' ', total - 10 - (size_t)n - 1);
	p[total - 1] = '\n';
	*len_out = total;
	return 0;
}

/* ---- the header dict --------------------------------------------------------------------- */

struct cursor {
	const char *p, *end;
	char *err;
	size_t err_len;
};

static void skip_space(struct cursor *c)
{
	while (c->p < c->end && (*c->p == ' ' || *c->p == '\t'))
		c->p++;
}

static int fail(struct cursor *c, const char *what)
{
	snprintf(c->err, c->err_len, "npy header: %s", what);
	return EMBD_EPARSE;
}

static bool eat(struct cursor *c, char ch)
{
	skip_space(c);
	if (c->p < c->end && *c->p == ch) {
		c->p++;
		return true;
	}
	return false;
}

/* A quoted string (either quote, no escapes) into out (cap bytes). */
static int read_string(struct cursor *c, char *out, size_t cap, const char *what)
{
	skip_space(c);
	if (c->p >= c->end || (*c->p != '\'' && *c->p != '"'))
		return snprintf(c->err, c->err_len, "npy header: %s: expected a quoted string", what),
		       EMBD_EPARSE;
	char q = *c->p++;
	size_t n = 0;
	while (c->p < c->end && *c->p != q) {
		if (*c->p == '\\' || n + 1 >= cap)
			return snprintf(c->err, c->err_len, "npy header: %s: string too long or "
					"escaped", what), EMBD_EPARSE;
		out[n++] = *c->p++;
	}
	if (c->p >= c->end)
		return snprintf(c->err, c->err_len, "npy header: %s: unterminated string", what),
		       EMBD_EPARSE;
	c->p++;
	out[n] = 0;
	return 0;
}

static int read_shape(struct cursor *c, struct embd_npy_header *h)
{
	if (!eat(c, '('))
		return fail(c, "shape: expected a tuple");
	h->ndim = 0;
	for (;;) {
		if (eat(c, ')'))
			return 0;
		skip_space(c);
		if (c->p >= c->end || *c->p < '0' || *c->p > '9')
			return fail(c, "shape: expected a non-negative integer");
		if (h->ndim == EMBD_NPY_NDIM_MAX)
			return snprintf(c->err, c->err_len, "npy header: shape: more than %d dimensions",
					EMBD_NPY_NDIM_MAX), EMBD_ENOTSUP;
		uint64_t v = 0;
		while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
			if (__builtin_mul_overflow(v, 10, &v) ||
			    __builtin_add_overflow(v, (uint64_t)(*c->p - '0'), &v))
				return fail(c, "shape: dimension overflows 64 bits");
			c->p++;
		}
		if (eat(c, 'L')) { /* Python 2 longs, as old numpy wrote them */ }
		h->shape[h->ndim++] = v;
		if (eat(c, ')'))
			return 0;
		if (!eat(c, ','))
			return fail(c, "shape: expected ',' or ')'");
	}
}

static int parse_dict(struct cursor *c, struct embd_npy_header *h)
{
	bool have_descr = false, have_order = false, have_shape = false;
	char key[32], val[32];
	int rc;

	if (!eat(c, '{'))
		return fail(c, "expected '{'");
	while (!eat(c, '}')) {
		if ((rc = read_string(c, key, sizeof(key), "key")))
			return rc;
		if (!eat(c, ':'))
			return fail(c, "expected ':' after a key");
		if (!strcmp(key, "descr") && !have_descr) {
			if ((rc = read_string(c, val, sizeof(val), "descr")))
				return rc;
			h->dtype = 0;
			for (size_t i = 0; i < NUM_DTYPES; i++)
				if (!strcmp(val, dtypes[i].name) ||
				    (dtypes[i].bytes == 1 && val[0] == '<' && !strcmp(val + 1, dtypes[i].name + 1)))
					h->dtype = dtypes[i].dtype;
			if (!h->dtype)
				return snprintf(c->err, c->err_len, "npy header: descr: '%s' is not one of "
						"<f2 <f4 <f8 <i4 <i8 |u1 (little-endian)", val), EMBD_ENOTSUP;
			have_descr = true;
		} else if (!strcmp(key, "fortran_order") && !have_order) {
			skip_space(c);
			if (c->end - c->p >= 5 && !memcmp(c->p, "False", 5))
				c->p += 5;
			else if (c->end - c->p >= 4 && !memcmp(c->p, "True", 4))
				return snprintf(c->err, c->err_len, "npy header: fortran_order: True is not "
						"supported (save a C-order array)"), EMBD_ENOTSUP;
			else
				return fail(c, "fortran_order: expected False");
			have_order = true;
		} else if (!strcmp(key, "shape") && !have_shape) {
			if ((rc = read_shape(c, h)))
				return rc;
			have_shape = true;
		} else {
			return snprintf(c->err, c->err_len, "npy header: key '%s' unknown or repeated", key),
			       EMBD_EPARSE;
		}
		if (!eat(c, ',')) {
			if (!eat(c, '}'))
				return fail(c, "expected ',' or '}'");
			break;
		}
	}
	if (!have_descr || !have_order || !have_shape)
		return snprintf(c->err, c->err_len, "npy header: missing '%s'",
				!have_descr ? "descr" : !have_order ? "fortran_order" : "shape"),
		       EMBD_EPARSE;
	while (c->p < c->end && (*c->p == ' ' || *c->p == '\n' || *c->p == '\t' || *c->p == '\0'))
		c->p++;
	if (c->p != c->end)
		return fail(c, "bytes after the dict");
	return 0;
}

int embd_npy_header_parse(const void *bytes, size_t len, struct embd_npy_header *out, char *err,
			  size_t err_len)
{
	const uint8_t *b = bytes;
	uint64_t hlen, prefix;

	memset(out, 0, sizeof(*out));
	if (len < 10 || memcmp(b, "\x93NUMPY", 6))
		return snprintf(err, err_len, "npy: not a .npy file (magic)"), EMBD_EPARSE;
	if (b[6] == 1) {
		hlen = (uint64_t)b[8] | (uint64_t)b[9] << 8;
		prefix = 10;
	} else if (b[6] == 2 || b[6] == 3) {
		if (len < 12)
			return snprintf(err, err_len, "npy: header length truncated"), EMBD_EPARSE;
		hlen = (uint64_t)b[8] | (uint64_t)b[9] << 8 | (uint64_t)b[10] << 16 |
		       (uint64_t)b[11] << 24;
		prefix = 12;
	} else {
		return snprintf(err, err_len, "npy: format version %u.%u is not 1.0, 2.0 or 3.0", b[6],
				b[7]), EMBD_ENOTSUP;
	}
	if (hlen > EMBD_NPY_HEADER_MAX || prefix + hlen > len)
		return snprintf(err, err_len, "npy: header of %" PRIu64 " bytes runs past the %zu "
				"given (at most %u)", hlen, len, EMBD_NPY_HEADER_MAX), EMBD_EPARSE;
	struct cursor c = { (const char *)b + prefix, (const char *)b + prefix + hlen, err, err_len };
	int rc = parse_dict(&c, out);
	if (rc)
		return rc;
	if (!data_bytes(out->dtype, out->ndim, out->shape, &out->data_bytes))
		return snprintf(err, err_len, "npy header: shape: array size overflows"), EMBD_EPARSE;
	out->data_offset = prefix + hlen;
	return 0;
}

/* ---- files ------------------------------------------------------------------------------- */

/* Writes len bytes at the file's offset *at. With sync, each chunk's writeback is started
 * at once (sync_file_range), so the disk works while the next chunk is copied and the final
 * fsync has little left to wait for. */
static int write_all(int fd, const void *data, uint64_t len, uint32_t *crc, bool sync,
		     uint64_t *at, const char *path, char *err, size_t err_len)
{
	const uint8_t *p = data;

	while (len) {
		size_t n = len < WRITE_CHUNK ? (size_t)len : WRITE_CHUNK;
		if (crc)
			*crc = embd_crc32c(*crc, p, n);
		size_t done = 0;
		while (done < n) {
			ssize_t w = write(fd, p + done, n - done);
			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0)
				return snprintf(err, err_len, "%s: write: %s", path,
						w < 0 ? strerror(errno) : "no progress"), EMBD_EIO;
			done += (size_t)w;
		}
		if (sync)
			sync_file_range(fd, (off_t)*at, (off_t)n, SYNC_FILE_RANGE_WRITE);
		*at += n;
		p += n;
		len -= n;
	}
	return 0;
}

int embd_npy_write_file(const char *path, enum embd_npy_dtype dtype, uint32_t ndim,
			const uint64_t *shape, const void *data, bool sync, uint32_t *crc_out,
			uint64_t *size_out, char *err, size_t err_len)
{
	uint8_t header[EMBD_NPY_HEADER_MAX];
	size_t hlen;
	uint64_t bytes = 0;
	uint32_t crc = 0;
	int rc = embd_npy_header_format(dtype, ndim, shape, header, sizeof(header), &hlen);

	if (rc)
		return snprintf(err, err_len, "%s: cannot format a .npy header", path), rc;
	data_bytes(dtype, ndim, shape, &bytes);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return snprintf(err, err_len, "%s: open: %s", path, strerror(errno)), EMBD_EIO;
	uint64_t at = 0;
	rc = write_all(fd, header, hlen, &crc, false, &at, path, err, err_len);
	if (!rc)
		rc = write_all(fd, data, bytes, &crc, sync, &at, path, err, err_len);
	if (!rc && sync && fsync(fd)) {
		snprintf(err, err_len, "%s: fsync: %s", path, strerror(errno));
		rc = EMBD_EIO;
	}
	if (close(fd) && !rc) {
		snprintf(err, err_len, "%s: close: %s", path, strerror(errno));
		rc = EMBD_EIO;
	}
	if (!rc && crc_out)
		*crc_out = crc;
	if (!rc && size_out)
		*size_out = hlen + bytes;
	return rc;
}

/* pread of exactly len bytes at off; EMBD_EIO names the path. */
static int read_exact(int fd, void *buf, uint64_t len, uint64_t off, const char *path, char *err,
		      size_t err_len)
{
	uint8_t *p = buf;

	while (len) {
		ssize_t r = pread(fd, p, len > (1u << 30) ? (1u << 30) : (size_t)len, (off_t)off);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return snprintf(err, err_len, "%s: read: %s", path,
					r < 0 ? strerror(errno) : "file shorter than its header says"),
			       EMBD_EIO;
		p += r;
		off += (uint64_t)r;
		len -= (uint64_t)r;
	}
	return 0;
}

int embd_npy_read_file(const char *path, struct embd_npy_header *hdr, void **data, char *err,
		       size_t err_len)
{
	uint8_t head[EMBD_NPY_HEADER_MAX + 12];
	char inner[256];
	struct stat st;
	void *buf = NULL;
	int rc, fd = open(path, O_RDONLY | O_CLOEXEC);

	*data = NULL;
	if (fd < 0)
		return snprintf(err, err_len, "%s: open: %s", path, strerror(errno)),
		       errno == ENOENT ? EMBD_ENOENT : EMBD_EIO;
	if (fstat(fd, &st)) {
		rc = EMBD_EIO;
		snprintf(err, err_len, "%s: stat: %s", path, strerror(errno));
		goto out;
	}
	uint64_t head_len = (uint64_t)st.st_size < sizeof(head) ? (uint64_t)st.st_size : sizeof(head);
	rc = read_exact(fd, head, head_len, 0, path, err, err_len);
	if (rc)
		goto out;
	rc = embd_npy_header_parse(head, head_len, hdr, inner, sizeof(inner));
	if (rc) {
		snprintf(err, err_len, "%s: %s", path, inner);
		goto out;
	}
	if (hdr->data_offset + hdr->data_bytes != (uint64_t)st.st_size) {
		rc = EMBD_EPARSE;
		snprintf(err, err_len, "%s: %" PRIu64 " bytes, its header says %" PRIu64, path,
			 (uint64_t)st.st_size, hdr->data_offset + hdr->data_bytes);
		goto out;
	}
	buf = malloc(hdr->data_bytes ? hdr->data_bytes : 1);
	if (!buf) {
		rc = EMBD_ENOMEM;
		snprintf(err, err_len, "%s: out of memory for %" PRIu64 " bytes", path, hdr->data_bytes);
		goto out;
	}
	rc = read_exact(fd, buf, hdr->data_bytes, hdr->data_offset, path, err, err_len);
	if (!rc) {
		*data = buf;
		buf = NULL;
	}
out:
	free(buf);
	close(fd);
	return rc;
}
