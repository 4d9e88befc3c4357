/*
 * tests/gpu/test_device_outputs.c - device outputs through CUDA memory (ipc/README.md "Device
 * outputs") with the real embd on every GPU of the machine: trainers that ask for their pooled
 * outputs and gradients on their GPU (trainer t on visible GPU t % count, so the service's
 * numbering and the trainer's need not agree on the GPU they name) train K steps, reading
 * pooled rows and writing gradients with cudaMemcpy, and every output equals bit for bit that
 * of the same training through the slabs (the host path), and the unsharded reference; a GPU
 * the service does not see is refused naming those it sees; crashed trainers leave no fd in
 * embd. Without a GPU every test is skipped. Built where CUDA is, run by tests/gpu/run.sh from
 * the bundle (EMBD_TEST_BINARY); the CPU side of the same path: test_integration_device.
 *
 * CUDA is never initialised in this process: its trainers are forked, and a forked child of a
 * process that initialised CUDA cannot use it. Each trainer child initialises its own.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "embd/client.h"
#include "libclient/client_internal.h"
#include "tests/integration/service_fixture.h"
#include "tests/integration/training_common.h"

static char config_path[128];

/* GPUs a forked child sees (this process keeps CUDA uninitialised); 0 without a usable one. */
static int gpu_count(void)
{
	pid_t kid = tu_fork_child();

	if (kid == 0) {
		int n = 0;
		_exit(cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? (n > 100 ? 100 : n) : 0);
	}
	int st;
	waitpid(kid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 0;
}

static int gpus;

static void start(const char *sharding, uint32_t trainers)
{
	gpus = gpu_count();
	if (!gpus)
		cr_skip_test("no GPU: device outputs through CUDA memory need one");
	snprintf(config_path, sizeof(config_path), "/tmp/embd-gpu-device-%d.json", (int)getpid());
	FILE *f = fopen(config_path, "w");
	cr_assert_not_null(f, "cannot write %s: %s", config_path, strerror(errno));
	fprintf(f, "{ ");
	write_tables(f, sharding);
	fprintf(f, ", \"topology\": {\"compute_device\": \"cuda\", \"hbm_cap\": \"1G\", "
		"\"ddr_cap\": \"1G\", \"batch_size\": %d},\n \"trainers_per_node\": %u, "
		"\"seed\": %u, \"threads_per_rank\": 1, \"busy_poll_us\": 20 }\n", BATCH, trainers,
		SEED);
	fclose(f);
	service_spawn(config_path, "info");
}

static void stop(void)
{
	tu_kill_children();
	service_stop_within(10000, NULL);
	unlink(config_path);
	unlink(service.log);
}

TestSuite(gpu_device_outputs, .fini = stop, .timeout = 120);

/* trainer_copy: cudaMemcpy either way, then the device idle, so a gradient is in device memory
 * before its BACKWARD is posted (client.h's rule). */
static int cuda_copy(void *dst, const void *src, size_t bytes, char *err)
{
	cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);

	if (e == cudaSuccess)
		e = cudaDeviceSynchronize();
	if (e != cudaSuccess)
		return snprintf(err, 256, "cudaMemcpy: %s", cudaGetErrorString(e)), EMBD_EIO;
	return 0;
}

/* trainer_connected: device outputs on visible GPU tr % gpus of this trainer, in CUDA memory. */
static int ask_cuda(struct shared *sh, struct embd_client *c, uint32_t tr)
{
	struct embd_device_outputs out;
	const int device = (int)(tr % (uint32_t)gpus);
	int rc = embd_device_outputs(c, device, &out);

	if (rc)
		return snprintf(sh->err[tr], 256, "device outputs on GPU %d: %s", device,
				embd_last_error(c)), rc;
	if (!out.on_device || out.cuda_device != device)
		return snprintf(sh->err[tr], 256, "granted: on_device %d, device %d", out.on_device,
				out.cuda_device), EMBD_EPROTO;
	return 0;
}

static void cuda_equals_slab(const char *sharding, uint32_t trainers, int pipe)
{
	static struct shared slab;
	struct shared *sh = shared_map();
	const char *sockets[1];

	start(sharding, trainers);
	sockets[0] = service.socket;
	pipelined_trainers = pipe;
	run_trainers(sh, trainers, sockets, trainers);
	memcpy(&slab, sh, sizeof(slab));
	stop();
	start(sharding, trainers);
	trainer_connected = ask_cuda;
	trainer_copy = cuda_copy;
	run_trainers(sh, trainers, sockets, trainers);
	trainer_connected = NULL;
	trainer_copy = NULL;
	pipelined_trainers = PIPE_OFF;
	check_against_reference(sh, trainers, sharding);
	cr_expect(!memcmp(slab.pooled, sh->pooled, sizeof(slab.pooled)),
		  "%s: outputs through CUDA device outputs differ from the slab's", sharding);
	cr_expect(tu_embd_log_has(&service, "(CUDA memory"), "the service logs the CUDA grant");
	munmap(sh, sizeof(*sh));
}

Test(gpu_device_outputs, row_wise_through_cuda_memory_equals_the_slab)
{
	cuda_equals_slab("row_wise", 2, PIPE_OFF);
}
Test(gpu_device_outputs, table_wise_through_cuda_memory_equals_the_slab)
{
	cuda_equals_slab("table_wise", 3, PIPE_OFF);
}
Test(gpu_device_outputs, pipelined_through_cuda_memory_equals_the_slab)
{
	cuda_equals_slab("column_wise", 2, PIPE_BEFORE);
}

/* A GPU the service does not see: EMBD_ENOENT naming those it does; the trainer goes on. */
Test(gpu_device_outputs, an_unknown_gpu_is_refused_naming_the_ones_the_service_sees)
{
	const uint8_t nowhere[16] = { 0xde, 0xad, 0xbe, 0xef };
	struct embd_device_outputs out;
	struct embd_client *c;
	char err[256];

	start(NULL, 1);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &c, err, sizeof(err)), 0, "%s", err);
	cr_expect_eq(embd_client_device_outputs_uuid(c, nowhere, 0, &out), EMBD_ENOENT, "%s",
		     embd_last_error(c));
	cr_expect(strstr(embd_last_error(c), "no GPU GPU-deadbeef-0000-"), "got \"%s\"",
		  embd_last_error(c));
	cr_expect(strstr(embd_last_error(c), "this service sees (its CUDA_VISIBLE_DEVICES): 0 GPU-"),
		  "got \"%s\"", embd_last_error(c));
	struct embd_request nop = { .op = EMBD_REQUEST_NOP };
	cr_expect_eq(embd_run(c, &nop), 0, "the trainer goes on: %s", embd_last_error(c));
	embd_close(c);
}

/* Free memory of visible GPU 0 in MiB, as a forked child sees it; -1 when it cannot tell. */
static long gpu0_free_mib(void)
{
	long *got = mmap(NULL, sizeof(long), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
			 -1, 0);
	cr_assert(got != MAP_FAILED);
	*got = -1;
	pid_t kid = tu_fork_child();
	if (kid == 0) {
		size_t free_bytes, total;
		if (cudaSetDevice(0) == cudaSuccess &&
		    cudaMemGetInfo(&free_bytes, &total) == cudaSuccess)
			*got = (long)(free_bytes >> 20);
		_exit(0);
	}
	waitpid(kid, NULL, 0);
	long mib = *got;
	munmap(got, sizeof(long));
	return mib;
}

#define CRASHES 8

/* Trainers that map their device outputs and die by SIGKILL leave nothing in embd: no fd (the
 * export's is closed once sent) and no GPU memory (each holds at least 2 MiB, the allocation
 * granularity, released when the trainer is dropped). */
Test(gpu_device_outputs, crashed_trainers_leave_no_fd_and_no_gpu_memory)
{
	struct embd_client *t0;
	char err[256];

	start(NULL, 2);
	cr_assert_eq(embd_connect(service.socket, 0, 5000, &t0, err, sizeof(err)), 0, "%s", err);
	const int fds0 = tu_embd_count_fds(&service);
	const long free0 = gpu0_free_mib();
	for (int round = 0; round < CRASHES; round++) {
		pid_t kid = tu_fork_child();
		if (kid == 0) {
			struct embd_device_outputs out;
			struct embd_client *c;
			if (embd_connect(service.socket, 1, 5000, &c, err, sizeof(err)) ||
			    embd_device_outputs(c, 0, &out) || !out.on_device)
				_exit(2);
			raise(SIGKILL);
			_exit(3);
		}
		int st;
		waitpid(kid, &st, 0);
		cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
			  "the trainer: expected death by SIGKILL after mapping, got status 0x%x", st);
	}
	int fds = tu_embd_wait_fds(&service, fds0, FDS_SETTLE_MS);
	cr_expect_eq(fds, fds0, "embd's fds after %d crashed trainers: expected %d, got %d",
		     CRASHES, fds0, fds);
	/* the allocations of CRASHES trainers would be 2 x CRASHES MiB at least */
	const long free1 = gpu0_free_mib();
	cr_expect(free0 >= 0 && free1 >= free0 - 4, "GPU 0's free memory after %d crashed trainers: "
		  "expected at least %ld MiB (%ld before, 4 MiB slack), got %ld", CRASHES, free0 - 4,
		  free0, free1);
	embd_close(t0);
}
