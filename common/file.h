/*
 * common/file.h - reading a whole (small) file: configs, plans, tables. Checkpoint shards are
 * not read through here; they stream (ckpt/npy.h).
 */
#ifndef EMBD_COMMON_FILE_H
#define EMBD_COMMON_FILE_H

#include <stddef.h>

/*
 * Reads path into a malloc'ed, NUL-terminated *out of *out_len bytes (the NUL not counted).
 * Returns 0, EMBD_ENOENT when it cannot be opened, EMBD_EIO on a read error, EMBD_ENOMEM;
 * err names the path. On error *out is NULL.
 */
int embd_read_file(const char *path, char **out, size_t *out_len, char *err, size_t err_len);

#endif /* EMBD_COMMON_FILE_H */
