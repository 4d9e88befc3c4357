/*
 * The `embd` binary's lifecycle, driven the way tests and systemd drive it: started with
 * --socket on a private path, it logs "ready" on stderr once the socket listens, answers
 * STATUS and STATS requests, welcomes a trainer with the layout of its config, and exits 0 on
 * SIGTERM, removing its socket. Training through the service is libclient's integration tests.
 */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/ranks.h"
#include "ipc/control.h"
#include "tests/support/embd_process.h"

struct daemon {
	struct tu_embd embd;            /* the embedded default config, no --log-level */
	FILE *log;                      /* its stderr */
};

/* Starts embd and reads its stderr until it logs "ready". */
static void start_daemon(struct daemon *d)
{
	const struct tu_embd_opts o = { .stderr_pipe = true };
	char line[2048];

	snprintf(d->embd.socket, sizeof(d->embd.socket), "/tmp/embd-test-%d/embd.sock",
		 (int)getpid());
	tu_embd_start(&d->embd, &o);
	d->log = fdopen(d->embd.stderr_fd, "r");
	cr_assert_not_null(d->log);
	while (fgets(line, sizeof(line), d->log))
		if (strstr(line, "ready"))
			return;
	int status;
	tu_embd_wait(&d->embd, -1, &status);
	cr_assert_fail("embd exited (status %d) before logging ready", status);
}

/* SIGTERM, and its wait status once it exited (however long that takes). */
static int stop_daemon(struct daemon *d)
{
	int status = -1;
	tu_embd_stop(&d->embd, SIGTERM, -1, &status);
	fclose(d->log);
	/* the service created the socket's directory; the test removes it */
	char dir[sizeof(d->embd.socket)];
	snprintf(dir, sizeof(dir), "%s", d->embd.socket);
	*strrchr(dir, '/') = 0;
	rmdir(dir);
	return status;
}

/* Sends an empty request of type and returns the reply's JSON. */
static cJSON *request(const char *path, enum embd_ctl_type type, enum embd_ctl_type reply)
{
	static uint8_t buf[EMBD_CTL_MSG_MAX];
	static char text[EMBD_CTL_MSG_MAX];
	struct embd_ctl_msg msg;
	char err[256] = "";
	int fd;

	cr_assert_eq(embd_ctl_connect(path, &fd, err, sizeof(err)), 0, "connect: %s", err);
	cr_assert_eq(embd_ctl_send(fd, type, NULL, 0, NULL, 0, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(fd, buf, sizeof(buf), 5000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(msg.type, reply, "expected reply type %d, got %u", reply, msg.type);
	cr_assert_eq(embd_ctl_text_decode(&msg, text, sizeof(text), err, sizeof(err)), 0, "%s", err);
	close(fd);
	cJSON *root = cJSON_Parse(text);
	cr_assert_not_null(root, "reply is not JSON: %s", text);
	return root;
}

Test(daemon, ready_status_stats_sigterm)
{
	struct daemon d;

	start_daemon(&d);
	cJSON *status = request(d.embd.socket, EMBD_CTL_STATUS_REQUEST, EMBD_CTL_STATUS_REPLY);
	cr_assert_str_eq(cJSON_GetObjectItem(status, "version")->valuestring, EMBD_VERSION);
	cr_assert_eq(cJSON_GetObjectItem(status, "step")->valuedouble, 0);
	cJSON *config = cJSON_GetObjectItem(status, "config");
	cr_assert_str_eq(cJSON_GetObjectItem(config, "socket_path")->valuestring, d.embd.socket);
	cr_assert_eq(cJSON_GetObjectItem(config, "num_tables")->valuedouble, 4);
	cJSON_Delete(status);
	cJSON *stats = request(d.embd.socket, EMBD_CTL_STATS_REQUEST, EMBD_CTL_STATS_REPLY);
	cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(stats, "ranks")), 2);
	cJSON *rank0 = cJSON_GetArrayItem(cJSON_GetObjectItem(stats, "ranks"), 0);
	cr_assert_gt(cJSON_GetObjectItem(rank0, "memory_bytes")->valuedouble, 0,
		     "rank 0 should hold shard memory");
	cJSON_Delete(stats);
	int st = stop_daemon(&d);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "expected exit 0 on SIGTERM, got %d", st);
	cr_assert_neq(access(d.embd.socket, F_OK), 0, "the socket file should be gone");
}

/* A client of protocol version 1 (before the device messages): the service reads its HELLO
 * and refuses it with ERROR EMBD_EMISMATCH naming both versions (ipc/README.md "Versions"). */
Test(daemon, hello_of_another_version_is_refused_naming_both)
{
	static uint8_t buf[EMBD_CTL_MSG_MAX];
	uint8_t packet[sizeof(struct embd_ctl_header) + sizeof(struct embd_ctl_hello)];
	struct embd_ctl_header h = { EMBD_CTL_MAGIC, 1, EMBD_CTL_HELLO,
				     sizeof(struct embd_ctl_hello), 0 };
	struct embd_ctl_hello hello = { .protocol_version = 1, .wanted_rank = -1, .pid = getpid() };
	struct embd_ctl_msg msg;
	struct daemon d;
	char err[256] = "", text[512] = "";
	int fd, code = 0;

	start_daemon(&d);
	cr_assert_eq(embd_ctl_connect(d.embd.socket, &fd, err, sizeof(err)), 0, "%s", err);
	memcpy(packet, &h, sizeof(h));
	embd_ctl_hello_encode(&hello, packet + sizeof(h));
	cr_assert_eq(send(fd, packet, sizeof(packet), 0), (ssize_t)sizeof(packet));
	cr_assert_eq(embd_ctl_recv(fd, buf, sizeof(buf), 5000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(msg.type, EMBD_CTL_ERROR, "expected ERROR, got type %u", msg.type);
	cr_assert_eq(embd_ctl_error_decode(&msg, &code, text, sizeof(text), err, sizeof(err)), 0,
		     "%s", err);
	cr_assert_eq(code, EMBD_EMISMATCH, "code %d: %s", code, text);
	cr_assert(strstr(text, "service speaks 2, client 1"), "got \"%s\"", text);
	close(fd);
	int st = stop_daemon(&d);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "expected exit 0 on SIGTERM, got %d", st);
}

Test(daemon, hello_gets_the_layout)
{
	static uint8_t buf[EMBD_CTL_MSG_MAX];
	static struct embd_layout layout;
	struct daemon d;
	struct embd_ctl_msg msg;
	struct embd_ctl_hello hello = { .protocol_version = EMBD_CTL_VERSION, .wanted_rank = 1,
					.pid = getpid() };
	uint8_t payload[sizeof(hello)];
	char err[256] = "";
	int fd;

	start_daemon(&d);
	cr_assert_eq(embd_ctl_connect(d.embd.socket, &fd, err, sizeof(err)), 0, "%s", err);
	embd_ctl_hello_encode(&hello, payload);
	cr_assert_eq(embd_ctl_send(fd, EMBD_CTL_HELLO, payload, sizeof(payload), NULL, 0, err,
				   sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(fd, buf, sizeof(buf), 5000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(msg.type, EMBD_CTL_WELCOME, "expected WELCOME, got type %u", msg.type);
	cr_assert_eq(embd_ctl_welcome_decode(&msg, &layout, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(layout.fixed.rank, 1, "asked for index 1, got %d", layout.fixed.rank);
	cr_assert_eq(layout.fixed.num_features, 5);
	cr_assert_eq(layout.fixed.total_dim, 256);
	cr_assert_str_eq(layout.features[2].name, "clicked_item_id");
	cr_assert_geq(msg.nfds, 1, "the region memfd should come with WELCOME");
	embd_ctl_msg_close_fds(&msg);
	/* the same index again is refused while the first holds it */
	int fd2;
	cr_assert_eq(embd_ctl_connect(d.embd.socket, &fd2, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_send(fd2, EMBD_CTL_HELLO, payload, sizeof(payload), NULL, 0, err,
				   sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(fd2, buf, sizeof(buf), 5000, &msg, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(msg.type, EMBD_CTL_ERROR, "expected ERROR for a taken index, got %u", msg.type);
	close(fd2);
	close(fd);
	int st = stop_daemon(&d);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "expected exit 0 on SIGTERM, got %d", st);
}

/*
 * compute_device cuda on a machine without a usable GPU (CI's): embd exits non-zero before
 * listening, with one line that says there is no CUDA device and why, in the driver's words
 * (or that this build has no CUDA at all). keys: more of the config, "" or ", ...".
 */
static void cuda_without_a_gpu(const char *topology, const char *keys)
{
	char path[64], line[1024], why[1024] = "";
	struct daemon d;
	int status = -1, lines_about_cuda = 0;

	snprintf(path, sizeof(path), "/tmp/embd-test-cuda-%d.json", (int)getpid());
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	fprintf(f, "{ \"topology\": { \"compute_device\": \"cuda\", \"batch_size\": 8%s },\n"
		   "  \"tables\": [ { \"name\": \"t\", \"num_embeddings\": 100, \"embedding_dim\": 8,"
		   " \"feature_names\": [\"f\"] } ]%s }\n", topology, keys);
	fclose(f);
	snprintf(d.embd.socket, sizeof(d.embd.socket), "/tmp/embd-test-%d/embd.sock",
		 (int)getpid());
	const struct tu_embd_opts o = { .config = path, .stderr_pipe = true };
	tu_embd_start(&d.embd, &o);
	d.log = fdopen(d.embd.stderr_fd, "r");
	cr_assert_not_null(d.log);
	while (fgets(line, sizeof(line), d.log)) {
		cr_assert(!strstr(line, "ready"), "embd started on CUDA without a GPU: %s", line);
		/* the GPU count is not known yet when embd says it starts: no rank count then */
		if (strstr(line, "starting") && !strstr(topology, "local_world_size"))
			cr_expect(strstr(line, "one rank per visible cuda"),
				  "embd's start line should not count GPU ranks before it has "
				  "counted the GPUs: %s", line);
		if (strstr(line, "CUDA") || strstr(line, "cuda:") || strstr(line, "nccl")) {
			lines_about_cuda++;
			snprintf(why, sizeof(why), "%s", line);
		}
	}
	fclose(d.log);
	cr_assert(tu_embd_wait(&d.embd, 30000, &status), "embd did not exit");
	unlink(path);
	uint32_t gpus;
	char count_err[256];
	if (embd_ranks_device_count(EMBD_DEVICE_CUDA, &gpus, count_err, sizeof(count_err)) == 0)
		cr_skip_test("this machine has %u CUDA devices", gpus);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "expected a non-zero exit, got %d",
		  status);
	cr_assert_eq(lines_about_cuda, 1, "expected one line about CUDA, got %d (last: %s)",
		     lines_about_cuda, why);
	cr_assert(strstr(why, "compute_device cuda: no CUDA device: "), "got: %s", why);
#ifdef EMBD_HAVE_CUDA
	cr_assert(strstr(why, "cudaGetDeviceCount: ") && strstr(why, "(cuda"),
		  "expected the driver's reason from cudaGetDeviceCount, got: %s", why);
#else
	cr_assert(strstr(why, "built without CUDA"), "got: %s", why);
#endif
}

Test(daemon, cuda_without_a_gpu_exits_with_one_line) { cuda_without_a_gpu("", ""); }

/* A GPU node of a cluster over NCCL: the same one line, before any store or comm is tried
 * (with a GPU, the short store_timeout_ms ends the lonely node 0 quickly). */
Test(daemon, cuda_nccl_node_without_a_gpu_exits_with_one_line)
{
	cuda_without_a_gpu(", \"world_size\": 2, \"local_world_size\": 1",
			   ", \"backend\": \"nccl\", \"node_rank\": 0, \"master_port\": 1, "
			   "\"store_timeout_ms\": 1000");
}
