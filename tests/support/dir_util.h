/*
 * tests/support/dir_util.h - what tests look for in a directory (checkpoint directories:
 * step-<N>, .tmp-step-<N>, damaged/).
 */
#ifndef EMBD_TESTS_DIR_UTIL_H
#define EMBD_TESTS_DIR_UTIL_H

#include <dirent.h>
#include <string.h>

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

#endif /* EMBD_TESTS_DIR_UTIL_H */
