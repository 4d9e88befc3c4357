/*
 * Tests for ipc/control.h over a socketpair: HELLO and WELCOME round trips with a memfd passed
 * by SCM_RIGHTS, the peer credential check, ERROR and text replies, and refused messages;
 * and embd_ctl_listen on a real path.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ipc/control.h"

static uint8_t buf[EMBD_CTL_MSG_MAX];

static void pair(int sv[2])
{
	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
}

static struct embd_layout *demo_layout(void)
{
	struct embd_layout *l = calloc(1, sizeof(*l));

	cr_assert_not_null(l);
	l->fixed = (struct embd_layout_fixed){ .rank = 1, .local_world_size = 2, .region_bytes = 1 << 20,
		.resumed_step = 5, .max_values = 100, .batch_size = 8, .total_dim = 24, .num_tables = 2,
		.num_features = 3 };
	l->tables[0] = (struct embd_layout_table){ "t0", 1000, 8, EMBD_POOLING_SUM, EMBD_DTYPE_FP32, 0 };
	l->tables[1] = (struct embd_layout_table){ "t1", 50, 4, EMBD_POOLING_MEAN, EMBD_DTYPE_FP16, 0 };
	l->features[0] = (struct embd_layout_feature){ "f0", 0, 8, 0, 0 };
	l->features[1] = (struct embd_layout_feature){ "f1", 0, 8, 8, 0 };
	l->features[2] = (struct embd_layout_feature){ "f2", 1, 4, 16, 0 };
	l->fixed.total_dim = 20;
	return l;
}

Test(control, hello_and_welcome_with_fd)
{
	struct embd_ctl_hello hello = { EMBD_CTL_VERSION, -1, (int32_t)getpid(), 0 }, got;
	struct embd_layout *l = demo_layout(), *back = calloc(1, sizeof(*back));
	struct embd_ctl_msg msg;
	uint8_t payload[sizeof(hello)];
	char err[256] = "";
	uint32_t len;
	int sv[2], memfd = memfd_create("t", MFD_CLOEXEC);

	pair(sv);
	embd_ctl_hello_encode(&hello, payload);
	cr_assert_eq(embd_ctl_send(sv[0], EMBD_CTL_HELLO, payload, sizeof(payload), NULL, 0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_hello_decode(&msg, &got, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(got.wanted_rank, -1);
	cr_assert_eq(got.pid, (int32_t)getpid());

	cr_assert_eq(ftruncate(memfd, 4096), 0);
	static uint8_t wbuf[EMBD_CTL_MSG_MAX];
	cr_assert_eq(embd_ctl_welcome_encode(l, wbuf, sizeof(wbuf), &len), 0);
	cr_assert_eq(embd_ctl_send(sv[1], EMBD_CTL_WELCOME, wbuf, len, &memfd, 1, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(sv[0], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(msg.nfds, 1u, "expected the memfd, got %u fds", msg.nfds);
	cr_assert_eq(embd_ctl_welcome_decode(&msg, back, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(back->fixed.rank, 1);
	cr_assert_str_eq(back->features[2].name, "f2");
	cr_assert_eq(back->features[2].offset, 16u);
	struct stat st;
	cr_assert_eq(fstat(msg.fds[0], &st), 0);
	cr_assert_eq(st.st_size, 4096, "received fd should be the memfd");
	embd_ctl_msg_close_fds(&msg);

	/* a broken layout: a feature offset leaves a gap */
	l->features[2].offset = 17;
	cr_assert_eq(embd_ctl_welcome_encode(l, wbuf, sizeof(wbuf), &len), 0);
	cr_assert_eq(embd_ctl_send(sv[1], EMBD_CTL_WELCOME, wbuf, len, NULL, 0, err, sizeof(err)), 0);
	cr_assert_eq(embd_ctl_recv(sv[0], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_welcome_decode(&msg, back, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "welcome.features[2].offset"), "got \"%s\"", err);

	/* fds on a message type that may not carry them are refused and closed */
	cr_assert_eq(embd_ctl_send(sv[0], EMBD_CTL_STATS_REQUEST, NULL, 0, &memfd, 1, err, sizeof(err)), 0);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "may not carry fds"), "got \"%s\"", err);
	close(memfd);
	close(sv[0]);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), EMBD_ECONNRESET);
	close(sv[1]);
	free(l);
	free(back);
}

Test(control, peer_credentials)
{
	struct embd_ctl_peer peer;
	char err[256] = "";
	int sv[2];

	pair(sv);
	cr_assert_eq(embd_ctl_peer_get(sv[1], &peer, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(peer.uid, getuid());
	cr_assert_eq(peer.pid, getpid());
	uid_t me = getuid(), other = getuid() + 1;
	gid_t other_gid = getgid() + 12345;
	cr_assert_eq(embd_ctl_peer_check(&peer, &me, 1, NULL, 0, err, sizeof(err)), 0);
	cr_assert_eq(embd_ctl_peer_check(&peer, &other, 1, &other_gid, 1, err, sizeof(err)), EMBD_EACCES,
		     "a list without our uid or gid must refuse us");
	cr_assert(strstr(err, "uid"), "got \"%s\"", err);
	gid_t mine = getgid();
	cr_assert_eq(embd_ctl_peer_check(&peer, &other, 1, &mine, 1, err, sizeof(err)), 0);
	close(sv[0]);
	close(sv[1]);
}

Test(control, error_text_and_bad_headers)
{
	struct embd_ctl_msg msg;
	char err[256] = "", text[64];
	int code, sv[2];

	pair(sv);
	cr_assert_eq(embd_ctl_send_error(sv[0], EMBD_EACCES, "uid 7 is not allowed", err, sizeof(err)), 0);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_error_decode(&msg, &code, text, sizeof(text), err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(code, EMBD_EACCES);
	cr_assert_str_eq(text, "uid 7 is not allowed");
	cr_assert_eq(embd_ctl_send(sv[1], EMBD_CTL_STATS_REPLY, "{\"steps\":3}", 11, NULL, 0, err, sizeof(err)), 0);
	cr_assert_eq(embd_ctl_recv(sv[0], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_text_decode(&msg, text, sizeof(text), err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(text, "{\"steps\":3}");
	cr_assert_eq(embd_ctl_recv(sv[0], buf, sizeof(buf), 10, &msg, err, sizeof(err)), EMBD_ETIMEDOUT);

	struct embd_ctl_header h = { EMBD_CTL_MAGIC, EMBD_CTL_VERSION, EMBD_CTL_HELLO, 3, 0 };
	cr_assert_eq(embd_ctl_parse(&h, sizeof(h), &msg, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "header.length"), "got \"%s\"", err);
	h.magic = 1;
	cr_assert_eq(embd_ctl_parse(&h, sizeof(h), &msg, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "header.magic"), "got \"%s\"", err);
	h = (struct embd_ctl_header){ EMBD_CTL_MAGIC, EMBD_CTL_VERSION, 99, 0, 0 };
	cr_assert_eq(embd_ctl_parse(&h, sizeof(h), &msg, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "header.type"), "got \"%s\"", err);
	close(sv[0]);
	close(sv[1]);
}

/* The path appears only once it is listened on (a temporary name is linked into place and
 * removed again), and a second service on the same path is refused naming it. */
Test(control, listen_publishes_the_path_once_listening_and_refuses_a_second_service)
{
	char path[108], tmp[120];
	int fd = -1, fd2 = -1, client = -1;
	char err[256];
	struct stat st;

	snprintf(path, sizeof(path), "/tmp/embd-test-control-%d.sock", (int)getpid());
	snprintf(tmp, sizeof(tmp), "%s.%d", path, (int)getpid());
	unlink(path);
	cr_assert_eq(embd_ctl_listen(path, 4, 0640, &fd, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(lstat(tmp, &st), -1, "the temporary name %s should be gone", tmp);
	cr_assert_eq(lstat(path, &st), 0);
	cr_expect_eq(st.st_mode & 0777, 0640, "mode: expected 0640, got 0%o", st.st_mode & 0777);
	cr_expect_eq(embd_ctl_connect(path, &client, err, sizeof(err)), 0, "%s", err);
	int rc = embd_ctl_listen(path, 4, 0660, &fd2, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EBUSY, "a second listener: expected EMBD_EBUSY, got %d (%s)", rc, err);
	cr_expect(strstr(err, path) != NULL, "the refusal should name the path: %s", err);
	cr_expect_eq(lstat(tmp, &st), -1, "the refused service's temporary name should be gone");
	if (client >= 0)
		close(client);
	close(fd);
	unlink(path);
}

/* A socket whose mode keeps this uid out is EMBD_EACCES, not an I/O error: as root (which
 * the mode does not stop) the connect runs in a child that became uid 65534. */
Test(control, connect_kept_out_by_the_mode_is_eacces)
{
	char path[108], err[256];
	int fd = -1;

	snprintf(path, sizeof(path), "/tmp/embd-test-control-acc-%d.sock", (int)getpid());
	unlink(path);
	cr_assert_eq(embd_ctl_listen(path, 4, 0600, &fd, err, sizeof(err)), 0, "%s", err);
	if (geteuid() != 0) {
		cr_assert_eq(chmod(path, 0), 0);
	}
	pid_t child = fork();
	cr_assert_geq(child, 0);
	if (child == 0) {
		int c = -1;
		if (geteuid() == 0 && (setgid(65534) || setuid(65534)))
			_exit(3);
		int rc = embd_ctl_connect(path, &c, err, sizeof(err));
		_exit(rc == EMBD_EACCES && strstr(err, path) ? 0 : rc == EMBD_EIO ? 1 : 2);
	}
	int status = 0;
	waitpid(child, &status, 0);
	close(fd);
	unlink(path);
	cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "connect kept out by the mode: expected EMBD_EACCES naming the path, child says %d "
		  "(1: EMBD_EIO, 2: another code, 3: setuid failed)", WEXITSTATUS(status));
}
