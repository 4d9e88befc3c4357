/*
 * Replay driver for fuzz targets built without libFuzzer: runs LLVMFuzzerTestOneInput over
 * every file named on the command line (directories are walked one level deep). This keeps
 * each target's corpus, including inputs that once crashed, as an ordinary regression test.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "replay: cannot open %s\n", path);
		return -1;
	}
	uint8_t *buf = NULL;
	size_t len = 0, cap = 0;
	for (;;) {
		if (len == cap) {
			cap = cap ? cap * 2 : 4096;
			uint8_t *grown = realloc(buf, cap);
			if (!grown) {
				free(buf);
				fclose(f);
				return -1;
			}
			buf = grown;
		}
		size_t n = fread(buf + len, 1, cap - len, f);
		len += n;
		if (n == 0)
			break;
	}
	fclose(f);
	LLVMFuzzerTestOneInput(buf, len);
	free(buf);
	return 0;
}

static int replay_path(const char *path, unsigned *count)
{
	struct stat st;
	if (stat(path, &st) != 0) {
		fprintf(stderr, "replay: no such path %s\n", path);
		return -1;
	}
	if (!S_ISDIR(st.st_mode)) {
		(*count)++;
		return replay_file(path);
	}
	DIR *dir = opendir(path);
	if (!dir)
		return -1;
	int rc = 0;
	struct dirent *entry;
	while ((entry = readdir(dir)) != NULL) {
		if (entry->d_name[0] == '.')
			continue;
		char child[4096];
		snprintf(child, sizeof(child), "%s/%s", path, entry->d_name);
		if (stat(child, &st) == 0 && S_ISREG(st.st_mode)) {
			(*count)++;
			if (replay_file(child) != 0)
				rc = -1;
		}
	}
	closedir(dir);
	return rc;
}

int main(int argc, char **argv)
{
	unsigned count = 0;
	int rc = 0;
	for (int i = 1; i < argc; i++)
		if (replay_path(argv[i], &count) != 0)
			rc = 1;
	printf("replay: %u inputs, no crash\n", count);
	return rc;
}
