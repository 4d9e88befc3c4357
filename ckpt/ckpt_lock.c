/*
 * Who owns a checkpoint directory (embd_ckpt_lock_take in ckpt/checkpoint.h). flock, not a
 * pid file: the kernel drops the lock when its holder dies however it dies, so a crashed
 * service never locks its successor out, and NFS carries flock as a lock of its own. flock
 * cannot say who holds it, so every exclusive holder writes "pid P, who" into the file it
 * holds, and clears it when it lets go; a shared holder (a shared-layout cluster's node)
 * clears .embd.lock of a departed exclusive holder's text, so its text always names the
 * current holder (or is empty while only shared holders remain).
 */
#include "ckpt/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#define LOCK_NAME ".embd.lock"
#define NODE_LOCK_PREFIX ".embd.lock-node-"

struct embd_ckpt_lock {
	int fd;                 /* LOCK_NAME: exclusive, or shared for a shared-layout node */
	int node_fd;            /* NODE_LOCK_PREFIX<k> (shared-layout node) or -1 */
};

/* The text a holder wrote into path ("" when none). */
static void read_holder(const char *path, char *out, size_t cap)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, out, cap - 1) : -1;

	out[n > 0 ? n : 0] = 0;
	out[strcspn(out, "\n")] = 0;
	if (fd >= 0)
		close(fd);
}

/* Who holds root's lock, for the refusal: the exclusive holder's text, or the shared-layout
 * nodes' (each in its own node lock file). */
static void describe_holders(const char *root, char *out, size_t cap)
{
	char path[EMBD_CKPT_PATH_MAX + 64], text[256];
	size_t len = 0;
	DIR *d;

	snprintf(path, sizeof(path), "%s/" LOCK_NAME, root);
	read_holder(path, out, cap);
	if (out[0] || !(d = opendir(root)))
		goto out;
	for (struct dirent *e; (e = readdir(d)) && len + 16 < cap;) {
		if (strncmp(e->d_name, NODE_LOCK_PREFIX, strlen(NODE_LOCK_PREFIX)))
			continue;
		snprintf(path, sizeof(path), "%s/%s", root, e->d_name);
		read_holder(path, text, sizeof(text));
		if (text[0])
			len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? "; " : "", text);
	}
	closedir(d);
out:
	if (!out[0])
		snprintf(out, cap, "a process that did not record its pid");
}

/* Opens path and flocks it (op | LOCK_NB); EMBD_EBUSY when someone else holds it. */
static int lock_file(const char *path, int op, int *fd_out, char *err, size_t err_len)
{
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);

	*fd_out = -1;
	if (fd < 0)
		return snprintf(err, err_len, "%s: open: %s", path, strerror(errno)), EMBD_EIO;
	while (flock(fd, op | LOCK_NB)) {
		if (errno == EINTR)
			continue;
		int e = errno;
		close(fd);
		if (e == EWOULDBLOCK)
			return EMBD_EBUSY;
		return snprintf(err, err_len, "%s: flock: %s", path, strerror(e)), EMBD_EIO;
	}
	*fd_out = fd;
	return 0;
}

/* Replaces fd's text with ours (or nothing: who NULL). */
static void set_holder(int fd, const char *who)
{
	char text[256];
	int len = who ? snprintf(text, sizeof(text), "pid %d, %s\n", (int)getpid(), who) : 0;

	if (ftruncate(fd, 0) || (len > 0 && pwrite(fd, text, (size_t)len, 0) != len))
		return;         /* only the message of a refused second one would lack it */
}

int embd_ckpt_lock_take(const char *root, bool shared_part, uint32_t node, const char *who,
			struct embd_ckpt_lock **out, char *err, size_t err_len)
{
	char path[EMBD_CKPT_PATH_MAX + 64], holder[512];
	struct embd_ckpt_lock *l = calloc(1, sizeof(*l));
	int rc;

	*out = NULL;
	if (!l)
		return snprintf(err, err_len, "out of memory"), EMBD_ENOMEM;
	l->fd = l->node_fd = -1;
	if ((rc = embd_ckpt_mkdir(root, err, err_len)))
		goto out;
	snprintf(path, sizeof(path), "%s/" LOCK_NAME, root);
	rc = lock_file(path, shared_part ? LOCK_SH : LOCK_EX, &l->fd, err, err_len);
	if (!rc) {
		set_holder(l->fd, shared_part ? NULL : who);
		if (shared_part) {
			snprintf(path, sizeof(path), "%s/" NODE_LOCK_PREFIX "%u", root, node);
			if (!(rc = lock_file(path, LOCK_EX, &l->node_fd, err, err_len)))
				set_holder(l->node_fd, who);
		}
	}
	if (rc == EMBD_EBUSY) {
		if (shared_part && l->fd >= 0)
			read_holder(path, holder, sizeof(holder));
		else
			describe_holders(root, holder, sizeof(holder));
		snprintf(err, err_len, "checkpoint_dir %s is in use by %s%s: a checkpoint directory "
			 "belongs to one service (one node rank of a shared-layout cluster); stop "
			 "it or give this one another checkpoint_dir", root,
			 holder[0] ? holder : "a process that did not record its pid",
			 shared_part && l->fd >= 0 ? " (the same node rank)" : "");
	}
out:
	if (rc) {
		embd_ckpt_lock_release(l);
		return rc;
	}
	*out = l;
	return 0;
}

void embd_ckpt_lock_release(struct embd_ckpt_lock *l)
{
	if (!l)
		return;
	if (l->node_fd >= 0) {
		set_holder(l->node_fd, NULL);
		close(l->node_fd);
	}
	if (l->fd >= 0) {
		/* a shared holder's text is "" already; an exclusive one clears its own */
		if (l->node_fd < 0)
			set_holder(l->fd, NULL);
		close(l->fd);
	}
	free(l);
}
