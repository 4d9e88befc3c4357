/*
 * Integration: device outputs (ipc/README.md "Device outputs") against the real embd on CPU
 * ranks. Without the tests' knob every request is refused with EMBD_ENOTSUP naming the CPU
 * ranks, and the trainers train on their slabs as ever. With EMBD_TEST_CPU_DEVICE_OUTPUTS=1 in
 * embd's environment the CPU ranks export host memory (a sealed memfd) where a GPU's would be,
 * so everything but the device calls runs here: the request and its fd, the SQEs with
 * EMBD_SQE_DEVICE, the service's copies in and out, pipelined steps and evaluations through
 * them (every output equal to the reference and bit for bit to the slab's), the refusals that
 * keep a connection, and the lifetime (no fd or mapping left by trainers that crashed).
 * The same through CUDA memory on GPU ranks: tests/gpu/test_device_outputs.c.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embd/client.h"
#include "ipc/control.h"
#include "libclient/client_internal.h"
#include "tests/integration/service_fixture.h"
#include "tests/integration/training_common.h"

/* Any GPU: CPU ranks never look it up (the knob's double has one "GPU", whichever is named). */
static const uint8_t some_gpu[16] = { 0x8e, 0x6f, 0x10, 0x2a, 0, 0xff, 0x12, 0x34,
				      0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2 };
static char config_path[128];

/* embd with the test tables (training_common.h) on 2 CPU ranks; host_double: the knob. */
static void start(const char *sharding, uint32_t trainers, bool host_double)
{
	snprintf(config_path, sizeof(config_path), "/tmp/embd-device-%d.json", (int)getpid());
	FILE *f = fopen(config_path, "w");
	cr_assert_not_null(f, "cannot write %s: %s", config_path, strerror(errno));
	fprintf(f, "{ ");
	write_tables(f, sharding);
	fprintf(f, ", \"topology\": {\"world_size\": 2, \"local_world_size\": 2, "
		"\"compute_device\": \"cpu\", \"batch_size\": %d},\n \"trainers_per_node\": %u, "
		"\"seed\": %u, \"threads_per_rank\": 1, \"busy_poll_us\": 20 }\n", BATCH, trainers,
		SEED);
	fclose(f);
	if (host_double)
		setenv("EMBD_TEST_CPU_DEVICE_OUTPUTS", "1", 1);
	else
		unsetenv("EMBD_TEST_CPU_DEVICE_OUTPUTS");
	service_spawn(config_path, "info");
	unsetenv("EMBD_TEST_CPU_DEVICE_OUTPUTS");
}

static void stop(void)
{
	tu_kill_children();
	service_stop_within(3000, NULL);
	unlink(config_path);
	unlink(service.log);
}

TestSuite(device, .fini = stop, .timeout = 60);

/* Mappings of the double's memfds in embd (/proc/PID/maps): one per trainer that has device
 * outputs; -1 when the file cannot be read. */
static int device_mappings(void)
{
	char path[64], line[512];
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)service.pid);
	FILE *f = fopen(path, "re");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		n += strstr(line, "memfd:embd-device-outputs") != NULL;
	fclose(f);
	return n;
}

/* ---- refused: CPU ranks ------------------------------------------------------------------- */

/* trainer_connected: the request is refused naming the CPU ranks, the handle is unchanged. */
static int expect_refused(struct shared *sh, struct embd_client *c, uint32_t tr)
{
	struct embd_device_outputs out = { .cuda_device = -1 };
	struct embd_batch before, after;
	int rc;

	embd_batch_get(c, 0, &before);
	/* twice: a refusal grants nothing, so the second is refused alike (not EMBD_EBUSY) */
	for (int i = 0; i < 2; i++) {
		rc = embd_client_device_outputs_uuid(c, some_gpu, 0, &out);
		if (rc != EMBD_ENOTSUP ||
		    !strstr(embd_last_error(c), "the service refused: device outputs: the ranks "
			    "compute on the CPU (compute_device cpu)"))
			return snprintf(sh->err[tr], 256, "ask %d: expected EMBD_ENOTSUP naming the CPU "
					"ranks, got %d (%s)", i, rc, embd_last_error(c)), EMBD_EPROTO;
	}
	/* the public call, whichever refuses first here: this process's driver (none on a
	 * CPU machine) or the service */
	rc = embd_device_outputs(c, 0, &out);
	if (rc != EMBD_ENOTSUP)
		return snprintf(sh->err[tr], 256, "embd_device_outputs: expected EMBD_ENOTSUP, got "
				"%d (%s)", rc, embd_last_error(c)), EMBD_EPROTO;
	embd_batch_get(c, 0, &after);
	if (out.cuda_device != -1 || before.pooled != after.pooled || before.grad != after.grad)
		return snprintf(sh->err[tr], 256, "a refusal changed the handle"), EMBD_EPROTO;
	return 0;
}

Test(device, cpu_ranks_refuse_and_the_trainers_train_on_their_slabs)
{
	struct shared *sh = shared_map();
	const char *sockets[1];

	start("row_wise", 2, false);
	sockets[0] = service.socket;
	const int fds = tu_embd_count_fds(&service);
	trainer_connected = expect_refused;
	run_trainers(sh, 2, sockets, 2);
	trainer_connected = NULL;
	check_against_reference(sh, 2, "refused device outputs");
	cr_expect(tu_embd_log_has(&service, "device outputs: the ranks compute on the CPU"),
		  "the service logs the refusal");
	int settled = tu_embd_wait_fds(&service, fds, FDS_SETTLE_MS);
	cr_expect_eq(settled, fds, "embd's fds after the refused trainers left: expected %d, got %d",
		     fds, settled);
	munmap(sh, sizeof(*sh));
}

/* ---- the host double: the whole path but the device calls --------------------------------- */

/* trainer_connected: device outputs granted (host memory: the double), and from here on the
 * slots' pooled and grad are theirs. With `only_even`, odd trainers keep their slabs. */
static bool only_even;

static int expect_granted(struct shared *sh, struct embd_client *c, uint32_t tr)
{
	const struct embd_client_layout *l = embd_layout(c);
	struct embd_device_outputs out;
	struct embd_batch b;

	if (only_even && tr % 2)
		return 0;
	int rc = embd_client_device_outputs_uuid(c, some_gpu, 3, &out);
	if (rc)
		return snprintf(sh->err[tr], 256, "device outputs: %s", embd_last_error(c)), rc;
	embd_batch_get(c, 1, &b);
	if (out.on_device || out.cuda_device != 3 ||
	    out.buffer_bytes != (uint64_t)l->batch_size * l->total_dim * sizeof(float) ||
	    b.pooled != out.pooled[1] || b.grad != out.grad[1])
		return snprintf(sh->err[tr], 256, "granted: on_device %d, device %d, %llu bytes, "
				"slot 1's pointers %s", out.on_device, out.cuda_device,
				(unsigned long long)out.buffer_bytes,
				b.pooled == out.pooled[1] ? "theirs" : "the slab's"), EMBD_EPROTO;
	rc = embd_client_device_outputs_uuid(c, some_gpu, 3, &out);
	if (rc != EMBD_EBUSY)
		return snprintf(sh->err[tr], 256, "a second ask: expected EMBD_EBUSY, got %d (%s)",
				rc, embd_last_error(c)), EMBD_EPROTO;
	return 0;
}

/* Trains `trainers` trainers (pipelined as `pipe`) through the double and on their slabs, on
 * two services of the same config: the reference, and bit for bit the slab's outputs. */
static void double_equals_slab(const char *sharding, uint32_t trainers, int pipe)
{
	static struct shared slab;
	struct shared *sh = shared_map();
	const char *sockets[1];

	start(sharding, trainers, true);
	sockets[0] = service.socket;
	pipelined_trainers = pipe;
	run_trainers(sh, trainers, sockets, trainers);
	memcpy(&slab, sh, sizeof(slab));
	stop();
	start(sharding, trainers, true);
	trainer_connected = expect_granted;
	run_trainers(sh, trainers, sockets, trainers);
	trainer_connected = NULL;
	pipelined_trainers = PIPE_OFF;
	check_against_reference(sh, trainers, sharding);
	cr_expect(!memcmp(slab.pooled, sh->pooled, sizeof(slab.pooled)),
		  "%s: outputs through device outputs differ from the slab's", sharding);
	cr_expect(tu_embd_log_has(&service, "host memory: the CPU ranks' test double"),
		  "the service logs what it granted");
	munmap(sh, sizeof(*sh));
}

Test(device, host_double_row_wise_equals_the_slab) { double_equals_slab("row_wise", 2, PIPE_OFF); }
Test(device, host_double_table_wise_equals_the_slab) { double_equals_slab("table_wise", 2, PIPE_OFF); }
Test(device, host_double_pipelined_equals_the_slab)
{
	double_equals_slab("column_wise", 2, PIPE_BEFORE);
}
Test(device, some_trainers_on_device_outputs_others_on_slabs)
{
	only_even = true;
	double_equals_slab("table_row_wise", 3, PIPE_OFF);
	only_even = false;
}

/* An EVAL through the device buffers pools the rows as they are: what the FORWARD of the same
 * batch that follows it pools; refused batches complete with their error as ever. */
Test(device, evaluations_go_through_device_outputs)
{
	struct embd_client *c;
	struct embd_device_outputs out;
	struct embd_batch b;
	static float evaluated[BATCH * MAX_COLS];
	char err[256];

	start("row_wise", 1, true);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &c, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_client_device_outputs_uuid(c, some_gpu, 0, &out), 0, "%s",
		     embd_last_error(c));
	const uint32_t D = embd_layout(c)->total_dim;
	embd_batch_get(c, 0, &b);
	uint64_t n = gen_batch(0, 0, b.lengths, b.values);
	memset(out.pooled[0], 0xff, out.buffer_bytes);
	cr_assert_eq(embd_eval(c, 0, 0, n, 0), 0, "%s", embd_last_error(c));
	memcpy(evaluated, out.pooled[0], (size_t)BATCH * D * sizeof(float));
	memset(out.pooled[0], 0xff, out.buffer_bytes);
	cr_assert_eq(embd_forward(c, 0, embd_layout(c)->resumed_step, n, 0), 0, "%s",
		     embd_last_error(c));
	cr_expect(!memcmp(evaluated, out.pooled[0], (size_t)BATCH * D * sizeof(float)),
		  "the EVAL's output differs from the FORWARD's of the same batch");
	/* the 0xff fill is NaN: every element of the output was written */
	uint32_t written = 0;
	for (uint32_t i = 0; i < BATCH * D; i++)
		written += isfinite(evaluated[i]);
	cr_expect_eq(written, BATCH * D, "the EVAL wrote %u of the %u floats of its output",
		     written, BATCH * D);
	/* an id out of range: refused, naming it, through the device path too */
	b.values[0] = 1 << 20;
	cr_expect_eq(embd_eval(c, 0, 0, n, 0), EMBD_ERANGE, "%s", embd_last_error(c));
	embd_close(c);
}

/* ---- refusals that keep the connection ----------------------------------------------------- */

/* A HELLO'd raw connection (ipc/control.h): the WELCOME's fds are closed, the socket kept. */
static int raw_trainer(void)
{
	static _Alignas(8) uint8_t buf[EMBD_CTL_MSG_MAX];
	struct embd_ctl_hello hello = { EMBD_CTL_VERSION, -1, (int32_t)getpid(), 0 };
	struct embd_ctl_msg msg;
	char err[256] = "";
	int sock;

	cr_assert_eq(embd_ctl_connect(service.socket, &sock, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_send(sock, EMBD_CTL_HELLO, &hello, sizeof(hello), NULL, 0, err,
				   sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(sock, buf, sizeof(buf), 5000, &msg, err, sizeof(err)), 0, "%s",
		     err);
	cr_assert_eq(msg.type, EMBD_CTL_WELCOME);
	embd_ctl_msg_close_fds(&msg);
	return sock;
}

/* Sends a DEVICE_REQUEST for some_gpu (flags as given) on sock; the answer's type, with the
 * ERROR's code and text, or the DEVICE_OUTPUTS' fd count. */
static uint16_t ask_raw(int sock, uint32_t flags, int *code, char *text, size_t text_len,
			unsigned *nfds)
{
	static _Alignas(8) uint8_t buf[EMBD_CTL_MSG_MAX];
	struct embd_ctl_device_request req = { .flags = flags };
	struct embd_ctl_msg msg;
	char err[256] = "";

	memcpy(req.uuid, some_gpu, sizeof(req.uuid));
	*code = 0;
	*nfds = 0;
	text[0] = 0;
	cr_assert_eq(embd_ctl_send(sock, EMBD_CTL_DEVICE_REQUEST, &req, sizeof(req), NULL, 0, err,
				   sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_ctl_recv(sock, buf, sizeof(buf), 5000, &msg, err, sizeof(err)), 0,
		     "no answer: %s", err);
	if (msg.type == EMBD_CTL_ERROR)
		cr_assert_eq(embd_ctl_error_decode(&msg, code, text, text_len, err, sizeof(err)), 0,
			     "%s", err);
	*nfds = msg.nfds;
	embd_ctl_msg_close_fds(&msg);
	return msg.type;
}

Test(device, refusals_are_answered_and_the_connection_stays)
{
	char text[EMBD_CTL_TEXT_MAX + 1];
	unsigned nfds;
	int code;

	start(NULL, 2, true);
	/* a control connection (no HELLO): not a trainer */
	int ctl;
	cr_assert_eq(embd_ctl_connect(service.socket, &ctl, NULL, 0), 0);
	cr_expect_eq(ask_raw(ctl, 0, &code, text, sizeof(text), &nfds), EMBD_CTL_ERROR);
	cr_expect_eq(code, EMBD_EINVAL, "got %d (%s)", code, text);
	cr_expect(strstr(text, "device outputs: only a trainer asks for them"), "got \"%s\"", text);
	close(ctl);

	int sock = raw_trainer();
	/* a malformed request: refused naming the field, the trainer stays */
	cr_expect_eq(ask_raw(sock, 4, &code, text, sizeof(text), &nfds), EMBD_CTL_ERROR);
	cr_expect_eq(code, EMBD_EPROTO, "got %d (%s)", code, text);
	cr_expect(strstr(text, "device_request.flags: unknown bits 0x4"), "got \"%s\"", text);
	cr_expect_eq(ask_raw(sock, 0, &code, text, sizeof(text), &nfds), EMBD_CTL_DEVICE_OUTPUTS,
		     "after a refusal the trainer may ask again (got code %d: %s)", code, text);
	cr_expect_eq(nfds, 1u, "DEVICE_OUTPUTS carries the memory's fd, got %u fds", nfds);
	/* one set per connection */
	cr_expect_eq(ask_raw(sock, 0, &code, text, sizeof(text), &nfds), EMBD_CTL_ERROR);
	cr_expect_eq(code, EMBD_EBUSY, "got %d (%s)", code, text);
	cr_expect(strstr(text, "has them already (one set per connection)"), "got \"%s\"", text);
	cr_expect_eq(device_mappings(), 1, "one trainer with device outputs: one mapping in embd");
	close(sock);
	int left = 1;
	for (int waited = 0; waited < FDS_SETTLE_MS && (left = device_mappings()) != 0; waited += 10)
		usleep(10000);
	cr_expect_eq(left, 0, "the trainer left: its device outputs are freed (%d mappings left)",
		     left);
}

/* A request with EMBD_SQE_DEVICE from a trainer without device outputs: refused naming the
 * flag (the trainer sits the step out); with them, the same request runs. */
Test(device, device_requests_without_device_outputs_are_refused)
{
	struct embd_client *c;
	struct embd_completion done;
	struct embd_sqe sqe;
	struct embd_batch b;
	char err[256];

	start(NULL, 1, true);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &c, err, sizeof(err)), 0, "%s", err);
	embd_batch_get(c, 0, &b);
	struct embd_request req = { .op = EMBD_REQUEST_EVAL, .slot = 0, .user_data = 1,
				    .num_values = gen_batch(0, 0, b.lengths, b.values) };
	cr_assert_eq(embd_client_sqe_build(c, &req, &sqe), 0);
	sqe.flags |= EMBD_SQE_DEVICE;
	sqe.output.offset = 0;
	cr_assert_eq(embd_client_push_sqe(c, &sqe), 0);
	cr_assert_eq(embd_wait(c, &done, 5000), 0, "%s", embd_last_error(c));
	cr_expect_eq(done.result, EMBD_EINVAL);
	cr_expect(strstr(embd_last_error(c), "sqe.flags: DEVICE, but this trainer has no device "
			 "outputs"), "got \"%s\"", embd_last_error(c));
	struct embd_device_outputs out;
	cr_assert_eq(embd_client_device_outputs_uuid(c, some_gpu, 0, &out), 0, "%s",
		     embd_last_error(c));
	cr_assert_eq(embd_client_push_sqe(c, &sqe), 0);
	cr_assert_eq(embd_wait(c, &done, 5000), 0, "%s", embd_last_error(c));
	cr_expect_eq(done.result, 0, "with device outputs the same EVAL runs: %s",
		     embd_last_error(c));
	embd_close(c);
}

/* ---- lifetime ------------------------------------------------------------------------------- */

#define CRASH_ROUNDS 6

/* A trainer that asks for device outputs (granted with the double, else refused), maps them,
 * posts a FORWARD and dies by SIGKILL without closing anything. */
static void crash_round(bool granted)
{
	pid_t kid = tu_fork_child();

	if (kid == 0) {
		struct embd_client *c;
		struct embd_device_outputs out;
		struct embd_batch b;
		char err[256];
		if (embd_connect(service.socket, 1, 5000, &c, err, sizeof(err)))
			_exit(2);
		if ((embd_client_device_outputs_uuid(c, some_gpu, 0, &out) == 0) != granted)
			_exit(3);
		embd_batch_get(c, 0, &b);
		struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = 0,
					    .step = embd_layout(c)->resumed_step,
					    .num_values = gen_batch(0, 1, b.lengths, b.values) };
		if (embd_submit(c, &req))
			_exit(4);
		raise(SIGKILL);
		_exit(5);
	}
	int st;
	waitpid(kid, &st, 0);
	cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
		  "the crashing trainer: expected death by SIGKILL, got status 0x%x", st);
}

/* Crashed trainers leave nothing in embd: fds (the exported fd, the socket, the region) and,
 * with the double, the memory's mapping; so do refused ones. */
static void crashes_leak_nothing(bool host_double)
{
	struct embd_client *t0;
	char err[256];

	start(NULL, 2, host_double);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	const int fds0 = tu_embd_count_fds(&service);
	cr_assert_gt(fds0, 0, "cannot read /proc/%d/fd", (int)service.pid);
	for (int round = 0; round < CRASH_ROUNDS; round++)
		crash_round(host_double);
	int fds = tu_embd_wait_fds(&service, fds0, FDS_SETTLE_MS);
	cr_expect_eq(fds, fds0, "embd's fds after %d crashed trainers: expected %d, got %d",
		     CRASH_ROUNDS, fds0, fds);
	cr_expect_eq(device_mappings(), 0, "no device output of a crashed trainer stays mapped");
	cr_expect_eq(kill(service.pid, 0), 0, "embd survives its crashed trainers");
	embd_close(t0);
}

Test(device, crashed_trainers_with_device_outputs_leak_nothing) { crashes_leak_nothing(true); }
Test(device, crashed_refused_trainers_leak_nothing) { crashes_leak_nothing(false); }
