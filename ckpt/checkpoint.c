/*
 * Checkpoint directories (ckpt/checkpoint.h). The invariant every function keeps: a
 * directory named step-<N> is only ever created by one rename of a directory whose files and
 * manifest are already on disk, only ever removed by retention once newer valid ones exist,
 * and moved aside (never deleted) when it is damaged.
 */
#include "ckpt/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kernels/device.h"
#include "ckpt/crc32c.h"

#define READ_CHUNK (4u << 20)

void embd_ckpt_dir_name(const char *root, uint64_t step, char *out, size_t cap)
{
	snprintf(out, cap, "%s/step-%" PRIu64, root, step);
}

static int fsync_path(const char *path, char *err, size_t err_len)
{
	int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	int rc = 0;

	if (fd < 0 || fsync(fd)) {
		snprintf(err, err_len, "%s: fsync: %s", path, strerror(errno));
		rc = EMBD_EIO;
	}
	if (fd >= 0)
		close(fd);
	return rc;
}

/* rm -r of a checkpoint directory (flat: only files inside). */
static int remove_dir(const char *dir, char *err, size_t err_len)
{
	char path[EMBD_CKPT_PATH_MAX + 256];
	DIR *d = opendir(dir);

	if (!d)
		return errno == ENOENT ? 0 : (snprintf(err, err_len, "%s: %s", dir, strerror(errno)),
					      EMBD_EIO);
	for (struct dirent *e; (e = readdir(d));) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		unlink(path);
	}
	closedir(d);
	if (rmdir(dir))
		return snprintf(err, err_len, "%s: rmdir: %s", dir, strerror(errno)), EMBD_EIO;
	return 0;
}

int embd_ckpt_mkdir(const char *path, char *err, size_t err_len)
{
	char dir[EMBD_CKPT_PATH_MAX];

	if (snprintf(dir, sizeof(dir), "%s", path) >= (int)sizeof(dir))
		return snprintf(err, err_len, "checkpoint_dir: path too long"), EMBD_EINVAL;
	for (char *p = dir + 1;; p++) {
		if (*p && *p != '/')
			continue;
		char saved = *p;
		*p = 0;
		if (mkdir(dir, 0755) && errno != EEXIST)
			return snprintf(err, err_len, "%s: mkdir: %s", dir, strerror(errno)), EMBD_EIO;
		*p = saved;
		if (!saved)
			return 0;
	}
}

static int write_manifest(const char *dir, const struct embd_ckpt_manifest *m, bool sync,
			  uint64_t *bytes, char *err, size_t err_len)
{
	char tmp[EMBD_CKPT_PATH_MAX + 128], final[EMBD_CKPT_PATH_MAX + 128];
	char *text = NULL;
	int rc = embd_ckpt_manifest_write(m, &text), fd = -1;

	if (rc)
		return snprintf(err, err_len, "%s: cannot format the manifest", dir), rc;
	snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, EMBD_MANIFEST_NAME);
	snprintf(final, sizeof(final), "%s/%s", dir, EMBD_MANIFEST_NAME);
	size_t len = strlen(text), done = 0;
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	rc = EMBD_EIO;
	if (fd < 0) {
		snprintf(err, err_len, "%s: open: %s", tmp, strerror(errno));
		goto out;
	}
	while (done < len) {
		ssize_t w = write(fd, text + done, len - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			snprintf(err, err_len, "%s: write: %s", tmp, strerror(errno));
			goto out;
		}
		done += (size_t)w;
	}
	if (sync && fsync(fd)) {
		snprintf(err, err_len, "%s: fsync: %s", tmp, strerror(errno));
		goto out;
	}
	close(fd);
	fd = -1;
	if (rename(tmp, final)) {
		snprintf(err, err_len, "%s: rename: %s", final, strerror(errno));
		goto out;
	}
	*bytes += len;
	rc = sync ? fsync_path(dir, err, err_len) : 0;
out:
	if (fd >= 0)
		close(fd);
	free(text);
	return rc;
}

/* dir (under root) to <root>/<where>/<its name>-<UTC time>, the new path into moved_to. */
static int move_aside(const char *root, const char *where, const char *dir, char *moved_to,
		      size_t cap, char *err, size_t err_len)
{
	char aside[EMBD_CKPT_PATH_MAX + 16], stamp[32];
	const char *name = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
	time_t now = time(NULL);
	struct tm tm;

	snprintf(aside, sizeof(aside), "%s/%s", root, where);
	if (mkdir(aside, 0755) && errno != EEXIST)
		return snprintf(err, err_len, "%s: mkdir: %s", aside, strerror(errno)), EMBD_EIO;
	strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", gmtime_r(&now, &tm));
	/* the same step may be damaged again within a second (a rewrite that failed the same way) */
	for (uint32_t k = 0; k < 1000; k++) {
		snprintf(moved_to, cap, k ? "%s/%s-%s.%u" : "%s/%s-%s", aside, name, stamp, k);
		if (!access(moved_to, F_OK))
			continue;
		if (rename(dir, moved_to))
			return snprintf(err, err_len, "%s: rename to %s: %s", dir, moved_to,
					strerror(errno)), EMBD_EIO;
		return 0;
	}
	return snprintf(err, err_len, "%s: no free name under %s", dir, aside), EMBD_EIO;
}

int embd_ckpt_move_damaged(const char *root, const char *dir, char *moved_to, size_t cap,
			   char *err, size_t err_len)
{
	return move_aside(root, EMBD_CKPT_DAMAGED_DIR, dir, moved_to, cap, err, err_len);
}

/* step-<N> already there: EMBD_EBUSY when it is valid (nothing to write), moved aside when it
 * is damaged (err then says where; "" otherwise). */
static int check_final(const char *root, const char *final, char *err, size_t err_len)
{
	struct embd_ckpt_manifest old;
	char inner[512], moved[EMBD_CKPT_PATH_MAX + 128];
	int rc;

	err[0] = 0;
	if (access(final, F_OK))
		return 0;
	rc = embd_ckpt_open_dir(final, &old, inner, sizeof(inner));
	embd_ckpt_manifest_free(&old);
	if (!rc)
		return snprintf(err, err_len, "%s: already written", final), EMBD_EBUSY;
	if ((rc = embd_ckpt_move_damaged(root, final, moved, sizeof(moved), err, err_len)))
		return rc;
	snprintf(err, err_len, "the damaged %s it replaces was moved to %s (%s)", final, moved,
		 inner);
	return 0;
}

/* Every array -> <tmp>/<name>.npy; m's files become one entry per array (bytes, crc32c). */
static int write_arrays(const char *tmp, struct embd_ckpt_manifest *m,
			const struct embd_ckpt_array *arrays, uint32_t num_arrays, bool sync,
			uint64_t *bytes, char *err, size_t err_len)
{
	char path[EMBD_CKPT_PATH_MAX + 256];
	struct embd_ckpt_file *files = calloc(num_arrays + 1, sizeof(*files));

	if (!files)
		return EMBD_ENOMEM;
	for (uint32_t i = 0; i < num_arrays; i++) {
		const struct embd_ckpt_array *a = &arrays[i];
		uint64_t shape[2] = { (uint64_t)a->file.rows, a->file.cols };
		files[i] = a->file;
		snprintf(path, sizeof(path), "%s/%s", tmp, a->file.name);
		if (a->await_data)
			a->await_data(a->await_arg, i);
		int rc = embd_npy_write_file(path, a->file.dtype, a->ndim, shape, a->data, sync,
					     &files[i].crc32c, &files[i].bytes, err, err_len);
		if (rc) {
			free(files);
			return rc;
		}
		*bytes += files[i].bytes;
	}
	free(m->files);
	m->files = files;
	m->num_files = num_arrays;
	return 0;
}

/* Steps 3 and 4 of checkpoint.h: the manifest into tmp, tmp renamed to final, root fsynced. */
static int commit_tmp(const char *root, const char *tmp, const char *final,
		      struct embd_ckpt_manifest *m, bool sync, uint64_t *bytes, char *err,
		      size_t err_len)
{
	int rc;

	if (!m->created_unix_ms) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		m->created_unix_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
	}
	if ((rc = write_manifest(tmp, m, sync, bytes, err, err_len)))
		return rc;
	if (rename(tmp, final))
		return snprintf(err, err_len, "%s: rename: %s", final, strerror(errno)), EMBD_EIO;
	return sync ? fsync_path(root, err, err_len) : 0;
}

static void tmp_name(const char *root, uint64_t step, char *out, size_t cap)
{
	snprintf(out, cap, "%s/.tmp-step-%" PRIu64, root, step);
}

int embd_ckpt_write_dir(const char *root, struct embd_ckpt_manifest *m,
			const struct embd_ckpt_array *arrays, uint32_t num_arrays, bool sync,
			uint64_t *bytes_out, char *err, size_t err_len)
{
	char tmp[EMBD_CKPT_PATH_MAX + 64], final[EMBD_CKPT_PATH_MAX + 64];
	uint64_t bytes = 0;
	int rc;

	*bytes_out = 0;
	if ((rc = embd_ckpt_mkdir(root, err, err_len)))
		return rc;
	char note[EMBD_CKPT_PATH_MAX + 700], inner[256];

	embd_ckpt_dir_name(root, m->step, final, sizeof(final));
	if ((rc = check_final(root, final, note, sizeof(note))))
		return snprintf(err, err_len, "%s", note), rc;
	tmp_name(root, m->step, tmp, sizeof(tmp));
	if ((rc = remove_dir(tmp, err, err_len)))
		return rc;
	if (mkdir(tmp, 0755))
		return snprintf(err, err_len, "%s: mkdir: %s", tmp, strerror(errno)), EMBD_EIO;
	if ((rc = write_arrays(tmp, m, arrays, num_arrays, sync, &bytes, err, err_len)) ||
	    (rc = commit_tmp(root, tmp, final, m, sync, &bytes, err, err_len))) {
		/* now, not at the next checkpoint: a full disk gets its space back at once */
		if (remove_dir(tmp, inner, sizeof(inner)))
			snprintf(err + strlen(err), err_len - strlen(err), "; %s", inner);
		return rc;
	}
	snprintf(err, err_len, "%s", note);
	*bytes_out = bytes;
	return 0;
}

int embd_ckpt_write_part(const char *root, struct embd_ckpt_manifest *m,
			 const struct embd_ckpt_array *arrays, uint32_t num_arrays, bool sync,
			 uint64_t *bytes_out, char *err, size_t err_len)
{
	char tmp[EMBD_CKPT_PATH_MAX + 64];
	int rc;

	*bytes_out = 0;
	if ((rc = embd_ckpt_mkdir(root, err, err_len)))
		return rc;
	tmp_name(root, m->step, tmp, sizeof(tmp));
	if (mkdir(tmp, 0755) && errno != EEXIST)   /* every node makes it; the first one wins */
		return snprintf(err, err_len, "%s: mkdir: %s", tmp, strerror(errno)), EMBD_EIO;
	return write_arrays(tmp, m, arrays, num_arrays, sync, bytes_out, err, err_len);
}

int embd_ckpt_commit(const char *root, struct embd_ckpt_manifest *m, bool sync, char *err,
		     size_t err_len)
{
	char tmp[EMBD_CKPT_PATH_MAX + 64], final[EMBD_CKPT_PATH_MAX + 64];
	uint64_t bytes = 0;
	int rc;

	char note[EMBD_CKPT_PATH_MAX + 700];

	embd_ckpt_dir_name(root, m->step, final, sizeof(final));
	tmp_name(root, m->step, tmp, sizeof(tmp));
	if ((rc = check_final(root, final, note, sizeof(note))))
		return snprintf(err, err_len, "%s", note), rc;
	if ((rc = commit_tmp(root, tmp, final, m, sync, &bytes, err, err_len)))
		return rc;
	snprintf(err, err_len, "%s", note);
	return 0;
}

int embd_ckpt_discard(const char *root, uint64_t step, char *err, size_t err_len)
{
	char tmp[EMBD_CKPT_PATH_MAX + 64];

	tmp_name(root, step, tmp, sizeof(tmp));
	return remove_dir(tmp, err, err_len);
}

/* ---- reading ----------------------------------------------------------------------------- */

/* A file that is not there is damage; one that cannot be opened now (permissions, too many
 * open files, a stale NFS handle) says nothing about the checkpoint. */
static int open_error(int e)
{
	return e == ENOENT ? EMBD_ENOENT : EMBD_EIO;
}

/* Whether a check's code means the checkpoint itself is damaged (moved aside, skipped), not
 * that it could not be read at the moment (left in place, the caller fails or keeps it). */
static bool is_damage(int rc)
{
	return rc == EMBD_ENOENT || rc == EMBD_EPARSE || rc == EMBD_ECHECKSUM;
}

static int check_file(const char *dir, const struct embd_ckpt_file *f, uint8_t *buf, char *err,
		      size_t err_len)
{
	char path[EMBD_CKPT_PATH_MAX + 256];
	struct stat st;
	uint32_t crc = 0;
	int rc = 0;

	snprintf(path, sizeof(path), "%s/%s", dir, f->name);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return snprintf(err, err_len, "%s: %s", path, strerror(errno)), open_error(errno);
	if (fstat(fd, &st) || (uint64_t)st.st_size != f->bytes) {
		rc = EMBD_ECHECKSUM;
		snprintf(err, err_len, "%s: %lld bytes, the manifest says %" PRIu64, path,
			 (long long)st.st_size, f->bytes);
		goto out;
	}
	for (;;) {
		ssize_t r = read(fd, buf, READ_CHUNK);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			rc = EMBD_EIO;
			snprintf(err, err_len, "%s: read: %s", path, strerror(errno));
			goto out;
		}
		if (!r)
			break;
		crc = embd_crc32c(crc, buf, (size_t)r);
	}
	if (crc != f->crc32c) {
		rc = EMBD_ECHECKSUM;
		snprintf(err, err_len, "%s: crc32c %08x, the manifest says %08x", path, crc, f->crc32c);
	}
out:
	close(fd);
	return rc;
}

/* dir's manifest into *m (freed on error). */
static int read_manifest(const char *dir, struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	char path[EMBD_CKPT_PATH_MAX + 64], inner[384];
	char *text = NULL;
	size_t len = 0;
	struct stat st;
	int rc, fd;

	memset(m, 0, sizeof(*m));
	snprintf(path, sizeof(path), "%s/%s", dir, EMBD_MANIFEST_NAME);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return snprintf(err, err_len, "%s: %s", path, strerror(errno)), open_error(errno);
	rc = EMBD_EIO;
	if (fstat(fd, &st) || st.st_size > (64 << 20) || !(text = malloc((size_t)st.st_size + 1))) {
		snprintf(err, err_len, "%s: unreadable or over 64 MiB", path);
		goto out;
	}
	while (len < (size_t)st.st_size) {
		ssize_t r = read(fd, text + len, (size_t)st.st_size - len);
		if (r <= 0) {
			snprintf(err, err_len, "%s: read: %s", path, r ? strerror(errno) : "short");
			goto out;
		}
		len += (size_t)r;
	}
	rc = embd_ckpt_manifest_parse(text, len, m, inner, sizeof(inner));
	if (rc)
		snprintf(err, err_len, "%s: %s", path, inner);
out:
	if (rc)
		embd_ckpt_manifest_free(m);
	close(fd);
	free(text);
	return rc;
}

int embd_ckpt_open_dir(const char *dir, struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	uint8_t *buf = NULL;
	int rc = read_manifest(dir, m, err, err_len);

	if (rc)
		return rc;
	rc = EMBD_ENOMEM;
	if (!(buf = malloc(READ_CHUNK)))
		goto out;
	for (uint32_t i = 0; i < m->num_files; i++)
		if ((rc = check_file(dir, &m->files[i], buf, err, err_len)))
			goto out;
	rc = 0;
out:
	if (rc)
		embd_ckpt_manifest_free(m);
	free(buf);
	return rc;
}

/* Retention's check of step-<step> (checkpoint.h): its manifest, its step, every file's size. */
static int check_quick(const char *dir, uint64_t step, char *err, size_t err_len)
{
	char path[EMBD_CKPT_PATH_MAX + 256];
	struct embd_ckpt_manifest m;
	struct stat st;
	int rc = read_manifest(dir, &m, err, err_len);

	if (rc)
		return rc;
	if (m.step != step) {
		rc = EMBD_EPARSE;
		snprintf(err, err_len, "manifest step %" PRIu64 " in a directory named for step %"
			 PRIu64, m.step, step);
	}
	for (uint32_t i = 0; i < m.num_files && !rc; i++) {
		snprintf(path, sizeof(path), "%s/%s", dir, m.files[i].name);
		if (stat(path, &st)) {
			rc = open_error(errno);
			snprintf(err, err_len, "%s: %s", m.files[i].name, strerror(errno));
		} else if ((uint64_t)st.st_size != m.files[i].bytes) {
			rc = EMBD_ECHECKSUM;
			snprintf(err, err_len, "%s: %lld bytes, the manifest says %" PRIu64,
				 m.files[i].name, (long long)st.st_size, m.files[i].bytes);
		}
	}
	embd_ckpt_manifest_free(&m);
	return rc;
}

/* The steps of every step-<N> under root, newest first (malloc'ed in *out). */
static int list_steps(const char *root, const char *prefix, uint64_t **out, uint32_t *n,
		      char *err, size_t err_len)
{
	uint32_t cap = 16;
	uint64_t *steps = malloc(cap * sizeof(*steps));
	DIR *d = opendir(root);
	size_t plen = strlen(prefix);

	*out = NULL;
	*n = 0;
	if (!steps || !d) {
		free(steps);
		if (d)
			closedir(d);
		return !steps ? EMBD_ENOMEM : (snprintf(err, err_len, "%s: %s", root, strerror(errno)),
					       errno == ENOENT ? EMBD_ENOENT : EMBD_EIO);
	}
	for (struct dirent *e; (e = readdir(d));) {
		char *end;
		if (strncmp(e->d_name, prefix, plen) || e->d_name[plen] < '0' || e->d_name[plen] > '9')
			continue;
		uint64_t s = strtoull(e->d_name + plen, &end, 10);
		if (*end)
			continue;
		if (*n == cap) {
			uint64_t *p = realloc(steps, 2 * cap * sizeof(*steps));
			if (!p)
				break;
			steps = p;
			cap *= 2;
		}
		steps[(*n)++] = s;
	}
	closedir(d);
	/* newest first: insertion sort, the lists are short */
	for (uint32_t i = 1; i < *n; i++)
		for (uint32_t j = i; j > 0 && steps[j] > steps[j - 1]; j--) {
			uint64_t t = steps[j];
			steps[j] = steps[j - 1];
			steps[j - 1] = t;
		}
	*out = steps;
	return 0;
}

int embd_ckpt_find(const char *root, uint64_t max_step, embd_ckpt_skip_fn skip, void *skip_arg,
		   char *dir_out, size_t dir_cap, struct embd_ckpt_manifest *m, char *err,
		   size_t err_len)
{
	char inner[768];
	uint64_t *steps;
	uint32_t n;
	int rc = list_steps(root, "step-", &steps, &n, err, err_len);

	memset(m, 0, sizeof(*m));
	if (rc)
		return rc;
	rc = EMBD_ENOENT;
	snprintf(err, err_len, "%s: no valid checkpoint%s", root,
		 max_step == UINT64_MAX ? "" : " at or before the step asked");
	for (uint32_t i = 0; i < n && rc; i++) {
		if (steps[i] > max_step)
			continue;
		embd_ckpt_dir_name(root, steps[i], dir_out, dir_cap);
		int r = embd_ckpt_open_dir(dir_out, m, inner, sizeof(inner));
		if (!r && m->step != steps[i]) {
			snprintf(inner, sizeof(inner), "manifest step %" PRIu64 " in a directory named "
				 "for step %" PRIu64, m->step, steps[i]);
			embd_ckpt_manifest_free(m);
			r = EMBD_EPARSE;
		}
		if (!r) {
			rc = 0;
		} else if (!is_damage(r)) {
			/* unreadable now, not damaged: restoring an older one would lose steps */
			rc = r;
			snprintf(err, err_len, "%s", inner);
			break;
		} else if (skip) {
			skip(skip_arg, dir_out, inner);
		}
	}
	free(steps);
	return rc;
}

int embd_ckpt_retain(const char *root, uint32_t keep, uint64_t tmp_before, uint64_t spare,
		     embd_ckpt_skip_fn moved, void *moved_arg, char *err, size_t err_len)
{
	char dir[EMBD_CKPT_PATH_MAX + 64], aside[EMBD_CKPT_PATH_MAX + 128], why[512];
	uint64_t *steps;
	uint32_t n, valid = 0;
	int removed = 0, rc;

	if ((rc = list_steps(root, ".tmp-step-", &steps, &n, err, err_len)))
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		if (steps[i] >= tmp_before)
			continue;       /* a cluster's nodes may be writing it now */
		tmp_name(root, steps[i], dir, sizeof(dir));
		removed += !remove_dir(dir, err, err_len);
	}
	free(steps);
	if (!keep)
		return removed;
	if ((rc = list_steps(root, "step-", &steps, &n, err, err_len)))
		return rc;
	/* newest first: a damaged one is moved aside and holds no slot of the keep */
	for (uint32_t i = 0; i < n; i++) {
		embd_ckpt_dir_name(root, steps[i], dir, sizeof(dir));
		if (steps[i] == spare) {        /* the one just written stays, checked or not */
			valid++;
			continue;
		}
		int q = check_quick(dir, steps[i], why, sizeof(why));
		if (q && !is_damage(q))
			continue;       /* unreadable now: neither counted, nor moved, nor removed */
		if (q) {
			if (!embd_ckpt_move_damaged(root, dir, aside, sizeof(aside), err, err_len) &&
			    moved)
				moved(moved_arg, aside, why);
			continue;
		}
		if (++valid <= keep || steps[i] == spare)
			continue;
		if (!(rc = remove_dir(dir, err, err_len)))
			removed++;
	}
	free(steps);
	return removed;
}

int embd_ckpt_find_nodes(const char *const *roots, uint32_t num_roots, uint64_t max_step,
			 embd_ckpt_skip_fn skip, void *skip_arg, char (*dirs)[EMBD_CKPT_PATH_MAX + 64],
			 struct embd_ckpt_manifest *m, char *err, size_t err_len)
{
	struct embd_ckpt_manifest *parts = calloc(num_roots + 1, sizeof(*parts));
	char inner[768];
	uint64_t *steps = NULL;
	uint32_t n = 0;
	int rc = parts ? list_steps(roots[0], "step-", &steps, &n, err, err_len) : EMBD_ENOMEM;

	memset(m, 0, sizeof(*m));
	if (rc)
		goto out;
	rc = EMBD_ENOENT;
	snprintf(err, err_len, "%s and %u more: no step that every node holds valid", roots[0],
		 num_roots - 1);
	for (uint32_t i = 0; i < n && rc; i++) {
		uint32_t k = 0;
		int r = 0;
		if (steps[i] > max_step)
			continue;
		for (; k < num_roots && !r; k++) {
			embd_ckpt_dir_name(roots[k], steps[i], dirs[k], sizeof(dirs[k]));
			r = embd_ckpt_open_dir(dirs[k], &parts[k], inner, sizeof(inner));
		}
		if (!r)
			r = embd_ckpt_manifest_merge(parts, num_roots, m, inner, sizeof(inner));
		for (uint32_t j = 0; j < k; j++)
			embd_ckpt_manifest_free(&parts[j]);
		if (!r)
			rc = 0;
		else if (skip)
			skip(skip_arg, dirs[k - 1], inner);
	}
out:
	free(steps);
	free(parts);
	return rc;
}

int embd_ckpt_set_aside_after(const char *root, uint64_t step, embd_ckpt_skip_fn moved,
			      void *moved_arg, char *err, size_t err_len)
{
	char dir[EMBD_CKPT_PATH_MAX + 64], aside[EMBD_CKPT_PATH_MAX + 128];
	uint64_t *steps;
	uint32_t n;
	int count = 0, rc = list_steps(root, "step-", &steps, &n, err, err_len);

	if (rc)
		return rc == EMBD_ENOENT ? 0 : rc;
	/* newest first: a failure leaves the older ones, never a gap below a newer one */
	for (uint32_t i = 0; i < n && steps[i] > step; i++) {
		embd_ckpt_dir_name(root, steps[i], dir, sizeof(dir));
		if ((rc = move_aside(root, EMBD_CKPT_ABANDONED_DIR, dir, aside, sizeof(aside), err,
				     err_len)))
			break;
		count++;
		if (moved)
			moved(moved_arg, aside, dir);
	}
	free(steps);
	return rc ? rc : count;
}

uint32_t embd_ckpt_count_damaged(const char *root)
{
	char aside[EMBD_CKPT_PATH_MAX + 16];
	uint32_t n = 0;

	snprintf(aside, sizeof(aside), "%s/%s", root, EMBD_CKPT_DAMAGED_DIR);
	DIR *d = opendir(aside);
	/* step-<N>-<UTC time>[.k], as move_aside names them */
	for (struct dirent *e; d && (e = readdir(d));)
		n += !strncmp(e->d_name, "step-", 5) && e->d_name[5] >= '0' && e->d_name[5] <= '9';
	if (d)
		closedir(d);
	return n;
}
