/* Whole-file reads (common/file.h): grow a buffer until fread says end of file. */
#include "common/file.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/err.h"
#include "embd/types.h"

int embd_read_file(const char *path, char **out, size_t *out_len, char *err, size_t err_len)
{
	FILE *f = fopen(path, "rb");
	char *buf = NULL;
	size_t len = 0, cap = 0;
	int rc = 0;

	*out = NULL;
	*out_len = 0;
	if (!f)
		return embd_fail(err, err_len, EMBD_ENOENT, "%s: cannot open", path);
	for (;;) {
		if (cap - len < 4096) {
			cap = cap ? cap * 2 : 65536;
			char *grown = realloc(buf, cap + 1);
			if (!grown) {
				rc = embd_fail(err, err_len, EMBD_ENOMEM, "%s: out of memory", path);
				goto out;
			}
			buf = grown;
		}
		size_t n = fread(buf + len, 1, cap - len, f);
		len += n;
		if (n == 0)
			break;
	}
	if (ferror(f)) {
		rc = embd_fail(err, err_len, EMBD_EIO, "%s: read error", path);
		goto out;
	}
	buf[len] = '\0';
	*out = buf;
	*out_len = len;
	buf = NULL;
out:
	free(buf);
	fclose(f);
	return rc;
}
