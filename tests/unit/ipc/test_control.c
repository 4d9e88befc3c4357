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

/* ---- live table access ------------------------------------------------------------------- */

static _Alignas(8) uint8_t tbuf[EMBD_CTL_MSG_MAX];

/* Sends payload of len bytes as type through a socketpair and receives it into buf. */
static void through_socket(enum embd_ctl_type type, const void *payload, uint32_t len,
			   struct embd_ctl_msg *msg)
{
	char err[256] = "";
	int sv[2];

	pair(sv);
	cr_assert_eq(embd_ctl_send(sv[0], type, payload, len, NULL, 0, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, msg, err, sizeof(err)), 0, "%s",
		     err);
	close(sv[0]);
	close(sv[1]);
}

/* A write of the most rows of 16 floats one message carries, named by ids, and the read
 * reply of as many: both travel through the socket intact. */
Test(control, table_messages_round_trip)
{
	const uint32_t cols = 16, n = embd_ctl_table_max_rows(cols);
	static int64_t ids[EMBD_CTL_TABLE_BYTES_MAX / 8];
	static float rows[EMBD_CTL_TABLE_BYTES_MAX / 4];
	struct embd_ctl_table_request req = { .table = 1, .array = 2, .flags = EMBD_CTL_TABLE_IDS,
					      .num_rows = n, .cols = cols }, got;
	struct embd_ctl_msg msg;
	const int64_t *gids;
	const float *grows;
	char err[256] = "";
	uint32_t len;

	for (uint32_t i = 0; i < n; i++)
		ids[i] = 3 * (int64_t)i;
	for (uint32_t i = 0; i < n * cols; i++)
		rows[i] = (float)i / 7.0f;
	cr_assert_eq(embd_ctl_table_request_encode(&req, ids, rows, tbuf, sizeof(tbuf), &len), 0);
	through_socket(EMBD_CTL_TABLE_WRITE, tbuf, len, &msg);
	cr_assert_eq(embd_ctl_table_request_decode(&msg, &got, &gids, &grows, err, sizeof(err)), 0,
		     "%s", err);
	cr_expect(got.table == 1 && got.array == 2 && got.num_rows == n && got.cols == cols);
	cr_expect(!memcmp(gids, ids, n * 8ull) && !memcmp(grows, rows, (size_t)n * cols * 4));
	/* one row more does not fit a table message */
	req.num_rows = n + 1;
	cr_expect_eq(embd_ctl_table_request_encode(&req, ids, rows, tbuf, sizeof(tbuf), &len),
		     EMBD_EINVAL);
	/* a read of a range: no ids, no rows */
	req = (struct embd_ctl_table_request){ .table = 0, .array = 0, .num_rows = 7, .row_begin = 5 };
	cr_assert_eq(embd_ctl_table_request_encode(&req, NULL, NULL, tbuf, sizeof(tbuf), &len), 0);
	through_socket(EMBD_CTL_TABLE_READ, tbuf, len, &msg);
	cr_assert_eq(embd_ctl_table_request_decode(&msg, &got, &gids, &grows, err, sizeof(err)), 0,
		     "%s", err);
	cr_expect(got.row_begin == 5 && got.num_rows == 7 && !gids && !grows);

	struct embd_ctl_table_reply rep = { .table = 1, .array = 0, .cols = cols,
					    .num_rows = embd_ctl_table_max_rows(cols),
					    .num_embeddings = 1 << 20, .applied_step = 9,
					    .optimizer_step = 9, .max_rows = n }, rgot;
	cr_assert_eq(embd_ctl_table_reply_encode(EMBD_CTL_TABLE_DATA, &rep, rows, tbuf, sizeof(tbuf),
						 &len), 0);
	through_socket(EMBD_CTL_TABLE_DATA, tbuf, len, &msg);
	cr_assert_eq(embd_ctl_table_reply_decode(&msg, &rgot, &grows, err, sizeof(err)), 0, "%s", err);
	cr_expect(rgot.applied_step == 9 && rgot.num_rows == rep.num_rows && rgot.max_rows == n);
	cr_expect(!memcmp(grows, rows, (size_t)rep.num_rows * cols * 4));
	cr_assert_eq(embd_ctl_table_reply_encode(EMBD_CTL_TABLE_DONE, &rep, NULL, tbuf, sizeof(tbuf),
						 &len), 0);
	through_socket(EMBD_CTL_TABLE_DONE, tbuf, len, &msg);
	cr_assert_eq(embd_ctl_table_reply_decode(&msg, &rgot, &grows, err, sizeof(err)), 0, "%s", err);
	cr_expect(rgot.num_rows == rep.num_rows && !grows);
}

/* A table request with one field changed by edit, decoded from a packet built by hand. */
static int bad_request(enum embd_ctl_type type, void (*edit)(struct embd_ctl_table_request *),
		       uint32_t extra, char *err, size_t err_len)
{
	struct embd_ctl_table_request req = { .table = 0, .array = 0, .flags = EMBD_CTL_TABLE_IDS,
					      .num_rows = 2, .cols = type == EMBD_CTL_TABLE_WRITE };
	struct embd_ctl_header h = { EMBD_CTL_MAGIC, EMBD_CTL_VERSION, (uint16_t)type, 0, 0 };
	struct embd_ctl_msg msg;
	const int64_t *ids;
	const float *rows;

	edit(&req);
	uint32_t body = 16 + (type == EMBD_CTL_TABLE_WRITE ? 8 : 0) + extra;
	h.length = (uint32_t)sizeof(req) + body;
	memcpy(tbuf, &h, sizeof(h));
	memcpy(tbuf + sizeof(h), &req, sizeof(req));
	memset(tbuf + sizeof(h) + sizeof(req), 0, body);
	cr_assert_eq(embd_ctl_parse(tbuf, sizeof(h) + h.length, &msg, err, err_len), 0, "%s", err);
	return embd_ctl_table_request_decode(&msg, &req, &ids, &rows, err, err_len);
}

static void no_edit(struct embd_ctl_table_request *r) { (void)r; }
static void unknown_flag(struct embd_ctl_table_request *r) { r->flags |= 2; }
static void reserved_set(struct embd_ctl_table_request *r) { r->reserved = 1; }
static void begin_with_ids(struct embd_ctl_table_request *r) { r->row_begin = 4; }
static void cols_in_read(struct embd_ctl_table_request *r) { r->cols = 3; }
static void too_many_rows(struct embd_ctl_table_request *r) { r->num_rows = 1u << 30; }

Test(control, table_requests_refused_naming_the_field)
{
	struct { enum embd_ctl_type type; void (*edit)(struct embd_ctl_table_request *);
		 uint32_t extra; const char *word; } cases[] = {
		{ EMBD_CTL_TABLE_READ, unknown_flag, 0, "table.flags" },
		{ EMBD_CTL_TABLE_READ, reserved_set, 0, "reserved" },
		{ EMBD_CTL_TABLE_READ, begin_with_ids, 0, "table.row_begin" },
		{ EMBD_CTL_TABLE_READ, cols_in_read, 0, "table.cols" },
		{ EMBD_CTL_TABLE_WRITE, too_many_rows, 0, "table.num_rows" },
		{ EMBD_CTL_TABLE_READ, no_edit, 8, "its head announces" },
		{ EMBD_CTL_TABLE_WRITE, no_edit, 4, "its head announces" },
	};
	char err[256];

	cr_assert_eq(bad_request(EMBD_CTL_TABLE_WRITE, no_edit, 0, err, sizeof(err)), 0, "%s", err);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		err[0] = 0;
		int rc = bad_request(cases[i].type, cases[i].edit, cases[i].extra, err, sizeof(err));
		cr_expect_eq(rc, EMBD_EPROTO, "case %zu: expected EMBD_EPROTO, got %d (%s)", i, rc, err);
		cr_expect(strstr(err, cases[i].word), "case %zu: expected '%s' in '%s'", i,
			  cases[i].word, err);
	}
}

/* ---- device outputs ------------------------------------------------------------------------ */

static const struct embd_ctl_device_outputs good_outputs = {
	.uuid = { 0x8e, 0x6f, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14 },
	.memory = EMBD_CTL_MEMORY_CUDA, .num_slots = EMBD_CTL_DEVICE_SLOTS, .bytes = 2u << 20,
	.buffer_bytes = 1000, .pooled = { 0, 2048 }, .grad = { 1024, 3072 },
};

/* The request and the reply over a socketpair, the reply with its fd: what came is what went,
 * and the fd is the one sent (a memfd standing for the CUDA handle). */
Test(control, device_request_and_outputs_round_trip_with_the_fd)
{
	struct embd_ctl_device_request req = { .uuid = { 1, 2, 3 } }, got_req;
	struct embd_ctl_device_outputs got;
	struct embd_ctl_msg msg;
	char err[256] = "";
	struct stat st;
	int sv[2], memfd = memfd_create("device-outputs", MFD_CLOEXEC);

	pair(sv);
	cr_assert_eq(ftruncate(memfd, 8192), 0);
	cr_assert_eq(embd_ctl_send(sv[0], EMBD_CTL_DEVICE_REQUEST, &req, sizeof(req), NULL, 0, err,
				   sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(embd_ctl_device_request_decode(&msg, &got_req, err, sizeof(err)), 0, "%s", err);
	cr_expect(!memcmp(&got_req, &req, sizeof(req)), "the request changed on the way");

	cr_assert_eq(embd_ctl_send(sv[1], EMBD_CTL_DEVICE_OUTPUTS, &good_outputs,
				   sizeof(good_outputs), &memfd, 1, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(sv[0], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(msg.nfds, 1u, "expected the memory's fd, got %u fds", msg.nfds);
	cr_assert_eq(embd_ctl_device_outputs_decode(&msg, &got, err, sizeof(err)), 0, "%s", err);
	cr_expect(!memcmp(&got, &good_outputs, sizeof(got)), "the reply changed on the way");
	cr_assert_eq(fstat(msg.fds[0], &st), 0);
	cr_expect_eq(st.st_size, 8192, "expected the memfd sent, got an fd of %lld bytes",
		     (long long)st.st_size);
	embd_ctl_msg_close_fds(&msg);

	/* the request carries no fd: one sent with it is refused and closed */
	cr_assert_eq(embd_ctl_send(sv[0], EMBD_CTL_DEVICE_REQUEST, &req, sizeof(req), &memfd, 1, err,
				   sizeof(err)), 0);
	cr_assert_eq(embd_ctl_recv(sv[1], buf, sizeof(buf), 1000, &msg, err, sizeof(err)),
		     EMBD_EPROTO);
	cr_expect(strstr(err, "type 14 may not carry fds"), "got \"%s\"", err);
	/* a reply with two fds is refused by its decoder */
	int two[2] = { memfd, memfd };
	cr_assert_eq(embd_ctl_send(sv[1], EMBD_CTL_DEVICE_OUTPUTS, &good_outputs,
				   sizeof(good_outputs), two, 2, err, sizeof(err)), 0);
	cr_assert_eq(embd_ctl_recv(sv[0], buf, sizeof(buf), 1000, &msg, err, sizeof(err)), 0, "%s",
		     err);
	cr_expect_eq(embd_ctl_device_outputs_decode(&msg, &got, err, sizeof(err)), EMBD_EPROTO);
	cr_expect(strstr(err, "2 fds attached"), "got \"%s\"", err);
	embd_ctl_msg_close_fds(&msg);
	close(memfd);
	close(sv[0]);
	close(sv[1]);
}

/* A payload of type `type` parsed from bytes: what a decoder sees of a peer's packet. */
static void parse_payload(enum embd_ctl_type type, const void *payload, uint32_t len,
			  struct embd_ctl_msg *msg)
{
	static _Alignas(8) uint8_t packet[256];
	struct embd_ctl_header h = { EMBD_CTL_MAGIC, EMBD_CTL_VERSION, (uint16_t)type, len, 0 };
	char err[256] = "";

	memcpy(packet, &h, sizeof(h));
	memcpy(packet + sizeof(h), payload, len);
	cr_assert_eq(embd_ctl_parse(packet, sizeof(h) + len, msg, err, sizeof(err)), 0, "%s", err);
}

Test(control, device_messages_refused_naming_the_field)
{
	struct embd_ctl_device_request req = { .flags = 1 };
	struct embd_ctl_device_outputs o;
	struct embd_ctl_msg msg;
	char err[256] = "";

	parse_payload(EMBD_CTL_DEVICE_REQUEST, &req, sizeof(req), &msg);
	cr_expect_eq(embd_ctl_device_request_decode(&msg, &req, err, sizeof(err)), EMBD_EPROTO);
	cr_expect(strstr(err, "device_request.flags"), "got \"%s\"", err);
	req = (struct embd_ctl_device_request){ .reserved = 9 };
	parse_payload(EMBD_CTL_DEVICE_REQUEST, &req, sizeof(req), &msg);
	cr_expect_eq(embd_ctl_device_request_decode(&msg, &req, err, sizeof(err)), EMBD_EPROTO);
	cr_expect(strstr(err, "device_request.reserved"), "got \"%s\"", err);

	/* each broken field of the reply, named */
	const struct { uint64_t *field; uint64_t value; const char *word; } offsets[] = {
		{ &o.pooled[1], 2050, "device_outputs.pooled[1]: offset 2050 is not 256-byte aligned" },
		{ &o.grad[0], (2u << 20) - 768, "device_outputs.grad[0]: [2096384, +1000) lies outside" },
		{ &o.grad[1], UINT64_MAX - 255, "device_outputs.grad[1]: [18446744073709551360" },
		{ &o.grad[1], 1024, "device_outputs.grad[1]: overlaps device_outputs.grad[0]" },
		{ &o.pooled[1], 256, "device_outputs.pooled[1]: overlaps device_outputs.pooled[0]" },
		{ &o.bytes, 0, "device_outputs.bytes: 0" },
		{ &o.bytes, (1ull << 40) + 1, "device_outputs.bytes" },
		{ &o.buffer_bytes, 0, "device_outputs.buffer_bytes: 0" },
		{ &o.buffer_bytes, (2u << 20) + 1, "device_outputs.buffer_bytes" },
	};
	for (size_t i = 0; i < sizeof(offsets) / sizeof(offsets[0]); i++) {
		o = good_outputs;
		*offsets[i].field = offsets[i].value;
		parse_payload(EMBD_CTL_DEVICE_OUTPUTS, &o, sizeof(o), &msg);
		err[0] = 0;
		cr_expect_eq(embd_ctl_device_outputs_decode(&msg, &o, err, sizeof(err)), EMBD_EPROTO,
			     "case %zu: accepted", i);
		cr_expect(strstr(err, offsets[i].word), "case %zu: expected '%s' in '%s'", i,
			  offsets[i].word, err);
	}
	o = good_outputs;
	o.memory = 3;
	parse_payload(EMBD_CTL_DEVICE_OUTPUTS, &o, sizeof(o), &msg);
	cr_expect_eq(embd_ctl_device_outputs_decode(&msg, &o, err, sizeof(err)), EMBD_EPROTO);
	cr_expect(strstr(err, "device_outputs.memory: unknown kind 3"), "got \"%s\"", err);
	o = good_outputs;
	o.num_slots = 3;
	parse_payload(EMBD_CTL_DEVICE_OUTPUTS, &o, sizeof(o), &msg);
	cr_expect_eq(embd_ctl_device_outputs_decode(&msg, &o, err, sizeof(err)), EMBD_EPROTO);
	cr_expect(strstr(err, "device_outputs.num_slots: 3"), "got \"%s\"", err);
	/* a payload of the wrong size never reaches the decoder */
	struct embd_ctl_header h = { EMBD_CTL_MAGIC, EMBD_CTL_VERSION, EMBD_CTL_DEVICE_OUTPUTS, 8, 0 };
	uint8_t short_packet[sizeof(h) + 8] = { 0 };
	memcpy(short_packet, &h, sizeof(h));
	cr_expect_eq(embd_ctl_parse(short_packet, sizeof(short_packet), &msg, err, sizeof(err)),
		     EMBD_EPROTO);
	cr_expect(strstr(err, "type 15 needs 72 payload bytes, got 8"), "got \"%s\"", err);
}

/*
 * Versions (ipc/README.md): version 2 added the device messages. A HELLO or an ERROR of
 * another version is read, so that the HELLO's decoder names both versions and a refusal
 * reaches a client of another version; every other message of another version is refused.
 */
Test(control, other_versions_meet_at_hello_and_error_only)
{
	static uint8_t packet[64];
	struct embd_ctl_header h = { EMBD_CTL_MAGIC, 1, EMBD_CTL_HELLO, 16, 0 };
	struct embd_ctl_hello hello = { 1, -1, 42, 0 }, got;
	struct embd_ctl_msg msg;
	char err[256] = "", text[64];
	int code;

	cr_assert_eq(EMBD_CTL_VERSION, 2u, "the device messages came with version 2");
	memcpy(packet, &h, sizeof(h));
	embd_ctl_hello_encode(&hello, packet + sizeof(h));
	cr_assert_eq(embd_ctl_parse(packet, sizeof(h) + 16, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_hello_decode(&msg, &got, err, sizeof(err)), EMBD_EMISMATCH);
	cr_assert(strstr(err, "service speaks 2, client 1"), "got \"%s\"", err);

	/* a HELLO whose payload names another version than its header is malformed */
	h.version = EMBD_CTL_VERSION;
	memcpy(packet, &h, sizeof(h));
	cr_assert_eq(embd_ctl_parse(packet, sizeof(h) + 16, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_hello_decode(&msg, &got, err, sizeof(err)), EMBD_EPROTO);
	cr_assert(strstr(err, "hello.protocol_version: 1 but the header says version 2"),
		  "got \"%s\"", err);

	h = (struct embd_ctl_header){ EMBD_CTL_MAGIC, 3, EMBD_CTL_ERROR, 4 + 5, 0 };
	const int32_t refused = EMBD_EMISMATCH;
	memcpy(packet, &h, sizeof(h));
	memcpy(packet + sizeof(h), &refused, 4);
	memcpy(packet + sizeof(h) + 4, "older", 5);
	cr_assert_eq(embd_ctl_parse(packet, sizeof(h) + 9, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_error_decode(&msg, &code, text, sizeof(text), err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(code, EMBD_EMISMATCH);
	cr_assert_str_eq(text, "older");

	const enum embd_ctl_type others[] = { EMBD_CTL_STATS_REQUEST, EMBD_CTL_DEVICE_REQUEST };
	for (size_t i = 0; i < sizeof(others) / sizeof(others[0]); i++) {
		const uint32_t len = others[i] == EMBD_CTL_DEVICE_REQUEST ? 24 : 0;
		h = (struct embd_ctl_header){ EMBD_CTL_MAGIC, 1, (uint16_t)others[i], len, 0 };
		memset(packet, 0, sizeof(packet));
		memcpy(packet, &h, sizeof(h));
		cr_assert_eq(embd_ctl_parse(packet, sizeof(h) + len, &msg, err, sizeof(err)),
			     EMBD_EPROTO, "type %d of version 1 was read", others[i]);
		cr_assert(strstr(err, "header.version: expected 2, got 1"), "got \"%s\"", err);
	}
}
