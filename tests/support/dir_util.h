/*
 * tests/support/dir_util.h - what tests look for in a directory (checkpoint directories:
 * step-<N>, .tmp-step-<N>, damaged/).
 */
#ifndef EMBD_TESTS_DIR_UTIL_H
#define EMBD_TESTS_DIR_UTIL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A new empty directory /tmp/<prefix>-XXXXXX into out. */
static inline void tu_tmpdir(char *out, size_t cap, const char *prefix)
{
	snprintf(out, cap, "/tmp/%s-XXXXXX", prefix);
	cr_assert_not_null(mkdtemp(out), "mkdtemp %s", out);
}

/* rm -rf dir. */
static inline void tu_rmtree(const char *dir)
{
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_expect_eq(system(cmd), 0, "%s", cmd);
}

/* Whether dir/name exists. */
static inline bool tu_has_entry(const char *dir, const char *name)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	return access(path, F_OK) == 0;
}

/* Entries of dir whose name starts with prefix (0 when dir cannot be opened). */
static inline int tu_count_entries(const char *dir, const char *prefix)
{
	DIR *d = opendir(dir);
	int n = 0;

	for (struct dirent *e; d && (e = readdir(d));)
		n += !strncmp(e->d_name, prefix, strlen(prefix));
	if (d)
		closedir(d);
	return n;
}

/* Entries of <root>/damaged/ (checkpoints moved aside, ckpt/checkpoint.h) starting with prefix. */
static inline int tu_count_damaged(const char *root, const char *prefix)
{
	char dir[512];
	snprintf(dir, sizeof(dir), "%s/damaged", root);
	return tu_count_entries(dir, prefix);
}

#endif /* EMBD_TESTS_DIR_UTIL_H */
