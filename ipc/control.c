/*
 * ipc/control.c - control-socket messages: framing, fd passing, peer credentials, and the
 * peer check (see control.h and ipc/README.md); control_msg.c encodes and decodes payloads.
 *
 * SOCK_SEQPACKET keeps message boundaries, so one recvmsg is one message; MSG_TRUNC and
 * MSG_CTRUNC tell us when a peer sent more than we accept, and such a message is refused
 * whole. Decoders never cast the payload: they memcpy each fixed part into private structs.
 */
#include "ipc/control.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/err.h"

/* ---- sockets ---------------------------------------------------------------------------- */

static int make_addr(const char *path, struct sockaddr_un *addr, char *err, size_t err_len)
{
	size_t len = strlen(path);

	memset(addr, 0, sizeof(*addr));
	addr->sun_family = AF_UNIX;
	if (len == 0 || len >= sizeof(addr->sun_path))
		return embd_fail(err, err_len, EMBD_EINVAL, "socket path: length %zu is not in [1, %zu]",
				len, sizeof(addr->sun_path) - 1);
	memcpy(addr->sun_path, path, len);
	return 0;
}

int embd_ctl_connect(const char *path, int *fd_out, char *err, size_t err_len)
{
	struct sockaddr_un addr;
	int fd, rc;

	*fd_out = -1;
	rc = make_addr(path, &addr, err, err_len);
	if (rc)
		return rc;
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return embd_fail(err, err_len, EMBD_EIO, "socket: %s", strerror(errno));
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		int e = errno;
		close(fd);
		if (e == ENOENT)
			return embd_fail(err, err_len, EMBD_ENOENT, "connect %s: no such socket", path);
		if (e == ECONNREFUSED)
			return embd_fail(err, err_len, EMBD_ECONNRESET, "connect %s: nobody listens", path);
		if (e == EACCES || e == EPERM)
			return embd_fail(err, err_len, EMBD_EACCES, "connect %s: the socket's mode or its "
					 "directory's does not let uid %u in", path, (unsigned)geteuid());
		return embd_fail(err, err_len, EMBD_EIO, "connect %s: %s", path, strerror(e));
	}
	*fd_out = fd;
	return 0;
}

int embd_ctl_listen(const char *path, int backlog, mode_t mode, int *fd_out, char *err,
		    size_t err_len)
{
	struct sockaddr_un addr;
	struct stat st;
	int fd = -1, probe, rc;

	*fd_out = -1;
	rc = make_addr(path, &addr, err, err_len);
	if (rc)
		return rc;
	if (lstat(path, &st) == 0) {
		if (!S_ISSOCK(st.st_mode))
			return embd_fail(err, err_len, EMBD_EBUSY, "listen %s: exists and is not a socket", path);
		rc = embd_ctl_connect(path, &probe, NULL, 0);
		if (rc == 0) {
			close(probe);
			return embd_fail(err, err_len, EMBD_EBUSY, "listen %s: another service listens", path);
		}
		unlink(path);   /* stale socket of a dead service */
	}
	/* Bound and listening under a temporary name first, then linked into place: a client
	 * (or a script waiting for the path to appear) never finds a socket nobody listens on,
	 * and link(), unlike rename(), fails when another service took the path meanwhile. */
	struct sockaddr_un tmp = addr;
	int n = snprintf(tmp.sun_path, sizeof(tmp.sun_path), "%s.%d", path, (int)getpid());
	if (n < 0 || (size_t)n >= sizeof(tmp.sun_path))
		return embd_fail(err, err_len, EMBD_EINVAL, "listen %s: path too long", path);
	unlink(tmp.sun_path);
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return embd_fail(err, err_len, EMBD_EIO, "socket: %s", strerror(errno));
	if (bind(fd, (struct sockaddr *)&tmp, sizeof(tmp)) != 0) {
		rc = embd_fail(err, err_len, EMBD_EIO, "bind %s: %s", tmp.sun_path, strerror(errno));
		goto out;
	}
	/* set before the socket has its name: nobody connects under another mode meanwhile */
	if (chmod(tmp.sun_path, mode) != 0 || listen(fd, backlog) != 0) {
		rc = embd_fail(err, err_len, EMBD_EIO, "listen %s: %s", path, strerror(errno));
		unlink(tmp.sun_path);
		goto out;
	}
	if (link(tmp.sun_path, path) != 0) {
		int e = errno;
		unlink(tmp.sun_path);
		rc = e == EEXIST ? embd_fail(err, err_len, EMBD_EBUSY, "listen %s: another service "
					    "took the path while this one started", path)
				 : embd_fail(err, err_len, EMBD_EIO, "listen %s: %s", path, strerror(e));
		goto out;
	}
	unlink(tmp.sun_path);
	*fd_out = fd;
	return 0;
out:
	close(fd);
	return rc;
}

int embd_ctl_peer_get(int sock, struct embd_ctl_peer *peer, char *err, size_t err_len)
{
	struct ucred cred;
	socklen_t len = sizeof(cred);
	gid_t groups[EMBD_CTL_GROUPS_MAX];
	socklen_t glen = sizeof(groups);

	memset(peer, 0, sizeof(*peer));
	if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred))
		return embd_fail(err, err_len, EMBD_EIO, "SO_PEERCRED: %s", strerror(errno));
	peer->pid = cred.pid;
	peer->uid = cred.uid;
	peer->gid = cred.gid;
	/* ERANGE: more groups than we keep; checking the first EMBD_CTL_GROUPS_MAX is still safe */
	if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &glen) == 0)
		peer->num_groups = glen / sizeof(gid_t);
	for (unsigned i = 0; i < peer->num_groups; i++)
		peer->groups[i] = groups[i];
	return 0;
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77                 /* Linux 6.5; Debian 12's headers predate it */
#endif

int embd_ctl_peer_pidfd(int sock, pid_t peer_pid, int *pidfd_out, char *err, size_t err_len)
{
	int fd = -1;
	socklen_t len = sizeof(fd);

	*pidfd_out = -1;
	/* the socket's own record of its peer cannot name a recycled pid, pidfd_open can */
	if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &fd, &len) == 0 && len == sizeof(fd) &&
	    fd >= 0) {
		*pidfd_out = fd;
		return 0;
	}
	if (errno == ESRCH)
		return embd_fail(err, err_len, EMBD_ECONNRESET, "peer pid %d: already exited",
				(int)peer_pid);
	if (peer_pid <= 0)
		return embd_fail(err, err_len, EMBD_ENOTSUP, "peer pid %d: not in this pid namespace",
				(int)peer_pid);
	fd = pidfd_open(peer_pid, 0);
	if (fd < 0)
		return embd_fail(err, err_len, errno == ESRCH ? EMBD_ECONNRESET : EMBD_ENOTSUP,
				"pidfd_open(%d): %s", (int)peer_pid, strerror(errno));
	/* pidfd_open is close-on-exec already */
	*pidfd_out = fd;
	return 0;
}

int embd_ctl_peer_check(const struct embd_ctl_peer *peer, const uid_t *uids, size_t num_uids,
			const gid_t *gids, size_t num_gids, char *err, size_t err_len)
{
	for (size_t i = 0; i < num_uids; i++)
		if (uids[i] == peer->uid)
			return 0;
	for (size_t i = 0; i < num_gids; i++) {
		if (gids[i] == peer->gid)
			return 0;
		for (unsigned g = 0; g < peer->num_groups; g++)
			if (gids[i] == peer->groups[g])
				return 0;
	}
	return embd_fail(err, err_len, EMBD_EACCES,
			"peer pid %d uid %u gid %u: neither its uid nor its groups are allowed",
			(int)peer->pid, (unsigned)peer->uid, (unsigned)peer->gid);
}

/* ---- framing ---------------------------------------------------------------------------- */

int embd_ctl_send(int sock, enum embd_ctl_type type, const void *payload, uint32_t length,
		  const int *fds, unsigned nfds, char *err, size_t err_len)
{
	struct embd_ctl_header hdr = {
		.magic = EMBD_CTL_MAGIC, .version = EMBD_CTL_VERSION, .type = (uint16_t)type,
		.length = length,
	};
	struct iovec iov[2] = {
		{ .iov_base = &hdr, .iov_len = sizeof(hdr) },
		{ .iov_base = (void *)payload, .iov_len = length },
	};
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * EMBD_CTL_FDS_MAX)];
	} ctl;
	struct msghdr mh = { .msg_iov = iov, .msg_iovlen = length ? 2 : 1 };
	ssize_t n;

	if (length > EMBD_CTL_MSG_MAX - sizeof(hdr))
		return embd_fail(err, err_len, EMBD_EINVAL, "send: payload of %" PRIu32 " bytes is too long",
				length);
	if (nfds > EMBD_CTL_FDS_MAX)
		return embd_fail(err, err_len, EMBD_EINVAL, "send: %u fds, at most %d", nfds,
				EMBD_CTL_FDS_MAX);
	if (nfds) {
		struct cmsghdr *cm;

		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
	}
	do
		n = sendmsg(sock, &mh, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n < 0) {
		if (errno == EPIPE || errno == ECONNRESET)
			return embd_fail(err, err_len, EMBD_ECONNRESET, "send: peer went away");
		return embd_fail(err, err_len, EMBD_EIO, "send: %s", strerror(errno));
	}
	return 0;
}

/* Bytes a payload of `type` must have: exactly `want`, or at least `want` when !exact. */
static int payload_rule(uint16_t type, uint32_t *want, bool *exact)
{
	*exact = true;
	switch (type) {
	case EMBD_CTL_HELLO:
		*want = sizeof(struct embd_ctl_hello);
		return 0;
	case EMBD_CTL_WELCOME:
		*want = sizeof(struct embd_layout_fixed);
		*exact = false;
		return 0;
	case EMBD_CTL_ERROR:
		*want = sizeof(int32_t);
		*exact = false;
		return 0;
	case EMBD_CTL_STATS_REQUEST:
	case EMBD_CTL_STATUS_REQUEST:
		*want = 0;
		return 0;
	case EMBD_CTL_CHECKPOINT_REQUEST:
		*want = sizeof(struct embd_ctl_checkpoint);
		return 0;
	case EMBD_CTL_TABLE_READ:
	case EMBD_CTL_TABLE_WRITE:
		*want = sizeof(struct embd_ctl_table_request);
		*exact = false;
		return 0;
	case EMBD_CTL_TABLE_DATA:
		*want = sizeof(struct embd_ctl_table_reply);
		*exact = false;
		return 0;
	case EMBD_CTL_TABLE_DONE:
		*want = sizeof(struct embd_ctl_table_reply);
		return 0;
	case EMBD_CTL_DEVICE_REQUEST:
		*want = sizeof(struct embd_ctl_device_request);
		return 0;
	case EMBD_CTL_DEVICE_OUTPUTS:
		*want = sizeof(struct embd_ctl_device_outputs);
		return 0;
	case EMBD_CTL_STATS_REPLY:
	case EMBD_CTL_STATUS_REPLY:
	case EMBD_CTL_CHECKPOINT_REPLY:
		*want = 0;
		*exact = false;
		return 0;
	default:
		return EMBD_EPROTO;
	}
}

int embd_ctl_parse(const void *bytes, size_t len, struct embd_ctl_msg *msg, char *err, size_t err_len)
{
	struct embd_ctl_header hdr;
	uint32_t want;
	bool exact;

	memset(msg, 0, sizeof(*msg));
	for (int i = 0; i < EMBD_CTL_FDS_MAX; i++)
		msg->fds[i] = -1;
	if (len < sizeof(hdr))
		return embd_fail(err, err_len, EMBD_EPROTO, "header: %zu bytes, need %zu", len, sizeof(hdr));
	if (len > EMBD_CTL_MSG_MAX)
		return embd_fail(err, err_len, EMBD_EPROTO, "message: %zu bytes exceed %u", len,
				EMBD_CTL_MSG_MAX);
	memcpy(&hdr, bytes, sizeof(hdr));
	if (hdr.magic != EMBD_CTL_MAGIC)
		return embd_fail(err, err_len, EMBD_EPROTO, "header.magic: expected 0x%08x, got 0x%08x",
				EMBD_CTL_MAGIC, hdr.magic);
	/* HELLO and ERROR of another version are read (their layout never changes): HELLO's
	 * decoder then names both versions, and a refusal of ours reaches a newer client */
	if (hdr.version != EMBD_CTL_VERSION && hdr.type != EMBD_CTL_HELLO &&
	    hdr.type != EMBD_CTL_ERROR)
		return embd_fail(err, err_len, EMBD_EPROTO, "header.version: expected %u, got %u",
				EMBD_CTL_VERSION, (unsigned)hdr.version);
	if (hdr.reserved != 0)
		return embd_fail(err, err_len, EMBD_EPROTO, "header.reserved: must be zero");
	if (hdr.length != len - sizeof(hdr))
		return embd_fail(err, err_len, EMBD_EPROTO,
				"header.length: says %" PRIu32 ", the packet carries %zu", hdr.length,
				len - sizeof(hdr));
	if (payload_rule(hdr.type, &want, &exact) != 0)
		return embd_fail(err, err_len, EMBD_EPROTO, "header.type: unknown type %u",
				(unsigned)hdr.type);
	if (exact ? hdr.length != want : hdr.length < want)
		return embd_fail(err, err_len, EMBD_EPROTO,
				"header.length: type %u needs %s%" PRIu32 " payload bytes, got %" PRIu32,
				(unsigned)hdr.type, exact ? "" : "at least ", want, hdr.length);
	msg->type = hdr.type;
	msg->version = hdr.version;
	msg->length = hdr.length;
	msg->payload = (const uint8_t *)bytes + sizeof(hdr);
	return 0;
}

void embd_ctl_msg_close_fds(struct embd_ctl_msg *msg)
{
	for (unsigned i = 0; i < msg->nfds; i++) {
		if (msg->fds[i] >= 0)
			close(msg->fds[i]);
		msg->fds[i] = -1;
	}
	msg->nfds = 0;
}

/* Collects SCM_RIGHTS fds into msg (closing any beyond the cap); false when some were dropped. */
static bool take_fds(struct msghdr *mh, struct embd_ctl_msg *msg)
{
	bool ok = true;

	for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm)) {
		size_t n;

		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < n; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
			if (msg->nfds < EMBD_CTL_FDS_MAX) {
				msg->fds[msg->nfds++] = fd;
			} else {
				close(fd);
				ok = false;
			}
		}
	}
	return ok;
}

int embd_ctl_recv(int sock, void *buf, size_t buf_bytes, int timeout_ms, struct embd_ctl_msg *msg,
		  char *err, size_t err_len)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * EMBD_CTL_FDS_MAX)];
	} ctl;
	struct iovec iov = { .iov_base = buf, .iov_len = buf_bytes };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	struct pollfd pfd = { .fd = sock, .events = POLLIN };
	struct embd_ctl_msg got;
	ssize_t n;
	int rc;

	memset(msg, 0, sizeof(*msg));
	memset(&got, 0, sizeof(got));
	for (int i = 0; i < EMBD_CTL_FDS_MAX; i++)
		msg->fds[i] = got.fds[i] = -1;
	do
		rc = poll(&pfd, 1, timeout_ms);
	while (rc < 0 && errno == EINTR);
	if (rc < 0)
		return embd_fail(err, err_len, EMBD_EIO, "recv: poll: %s", strerror(errno));
	if (rc == 0)
		return embd_fail(err, err_len, EMBD_ETIMEDOUT, "recv: no message within %d ms", timeout_ms);
	mh.msg_control = ctl.buf;
	mh.msg_controllen = sizeof(ctl.buf);
	do
		n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0) {
		if (errno == ECONNRESET)
			return embd_fail(err, err_len, EMBD_ECONNRESET, "recv: peer went away");
		return embd_fail(err, err_len, EMBD_EIO, "recv: %s", strerror(errno));
	}
	if (!take_fds(&mh, &got)) {
		rc = embd_fail(err, err_len, EMBD_EPROTO, "recv: more than %d fds attached",
			      EMBD_CTL_FDS_MAX);
		goto out;
	}
	if (n == 0) {
		rc = embd_fail(err, err_len, EMBD_ECONNRESET, "recv: peer closed the connection");
		goto out;
	}
	if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
		rc = embd_fail(err, err_len, EMBD_EPROTO, "recv: message or its fds truncated (%s)",
			      mh.msg_flags & MSG_TRUNC ? "data" : "fds");
		goto out;
	}
	rc = embd_ctl_parse(buf, (size_t)n, msg, err, err_len);
	if (rc)
		goto out;
	if (got.nfds && msg->type != EMBD_CTL_WELCOME && msg->type != EMBD_CTL_DEVICE_OUTPUTS) {
		rc = embd_fail(err, err_len, EMBD_EPROTO, "recv: type %u may not carry fds",
			      (unsigned)msg->type);
		goto out;
	}
	memcpy(msg->fds, got.fds, sizeof(got.fds));
	msg->nfds = got.nfds;
	return 0;
out:
	embd_ctl_msg_close_fds(&got);
	return rc;
}

void embd_ctl_refuse(int sock, int code, const char *text)
{
	unsigned char buf[512];
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * EMBD_CTL_FDS_MAX)];
	} ctl;

	embd_ctl_send_error(sock, code, text, NULL, 0);
	shutdown(sock, SHUT_RD);        /* from here on the peer's sends fail with EPIPE */
	for (;;) {
		struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
				     .msg_controllen = sizeof(ctl.buf) };
		struct embd_ctl_msg got = { .nfds = 0 };
		if (recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0)
			break;
		take_fds(&mh, &got);
		embd_ctl_msg_close_fds(&got);
	}
	close(sock);
}
