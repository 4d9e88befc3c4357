/*
 * tests/gpu/test_comm_nccl.c - the NCCL engine of dist/comm.h on this machine's GPU: a
 * world of one rank (alltoallv with uneven and zero sizes, allreduce f32/u64, broadcast,
 * barrier, every result checked byte for byte after a copy back to the host), and a world of
 * two where rank 1 never comes: create must fail with EMBD_ETIMEDOUT within its timeout
 * (NCCL's non-blocking init, then ncclCommAbort) instead of hanging.
 * Plain C, no Criterion: it runs where a GPU is (tests/gpu/run.sh) and exits 77 where none is.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "embd/types.h"
#include "common/clock.h"
#include "dist/comm.h"
#include "dist/store.h"

static int failures;

#define CHECK(cond, ...)                                                                   \
	do {                                                                               \
		if (!(cond)) {                                                             \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
			fprintf(stderr, __VA_ARGS__);                                      \
			fputc('\n', stderr);                                               \
			failures++;                                                        \
			goto out;                                                          \
		}                                                                          \
	} while (0)

static struct embd_comm *create(struct embd_store *store, uint32_t size, int timeout_ms,
				const char *prefix, int *rc, char *err, size_t err_len)
{
	struct embd_comm *comm = NULL;
	struct embd_comm_options o = { .backend = EMBD_COMM_NCCL, .rank = 0, .size = size,
				       .timeout_ms = timeout_ms,
				       .prefix = prefix };
	*rc = embd_comm_create(&o, store, &comm, err, err_len);
	return comm;
}

static void world_of_one(struct embd_store *store)
{
	enum { N = 100003, F = 4096 };
	char err[512] = "";
	int rc;
	uint8_t *host = malloc(N), *back = malloc(N), *d_send = NULL, *d_recv = NULL;
	float *hf = malloc(F * sizeof(float)), *d_f = NULL;
	uint64_t *hu = malloc(F * sizeof(uint64_t)), *d_u = NULL;
	struct embd_comm *comm = create(store, 1, 20000, "one/", &rc, err, sizeof(err));
	CHECK(rc == 0, "create: %d %s", rc, err);
	CHECK(cudaMalloc((void **)&d_send, N) == cudaSuccess && cudaMalloc((void **)&d_recv, N) ==
	      cudaSuccess && cudaMalloc((void **)&d_f, F * sizeof(float)) == cudaSuccess &&
	      cudaMalloc((void **)&d_u, F * sizeof(uint64_t)) == cudaSuccess, "cudaMalloc");

	for (size_t i = 0; i < N; i++)
		host[i] = (uint8_t)(i * 7 + 1);
	cudaMemcpy(d_send, host, N, cudaMemcpyHostToDevice);
	cudaMemset(d_recv, 0, N);
	uint64_t bytes = N, zero = 0;
	rc = embd_comm_alltoallv(comm, d_send, &bytes, d_recv, &bytes);
	CHECK(rc == 0, "alltoallv: %d %s", rc, embd_comm_error(comm));
	cudaMemcpy(back, d_recv, N, cudaMemcpyDeviceToHost);
	CHECK(memcmp(back, host, N) == 0, "alltoallv to self changed the bytes");
	rc = embd_comm_alltoallv(comm, NULL, &zero, NULL, &zero);
	CHECK(rc == 0, "empty alltoallv: %d %s", rc, embd_comm_error(comm));

	for (int i = 0; i < F; i++) {
		hf[i] = 0.25f * (float)i;
		hu[i] = ((uint64_t)1 << 40) + (uint64_t)i;
	}
	cudaMemcpy(d_f, hf, F * sizeof(float), cudaMemcpyHostToDevice);
	cudaMemcpy(d_u, hu, F * sizeof(uint64_t), cudaMemcpyHostToDevice);
	rc = embd_comm_allreduce_f32(comm, d_f, F);
	CHECK(rc == 0, "allreduce f32: %d %s", rc, embd_comm_error(comm));
	rc = embd_comm_allreduce_u64(comm, d_u, F);
	CHECK(rc == 0, "allreduce u64: %d %s", rc, embd_comm_error(comm));
	float bf[F];
	uint64_t bu[F];
	cudaMemcpy(bf, d_f, sizeof(bf), cudaMemcpyDeviceToHost);
	cudaMemcpy(bu, d_u, sizeof(bu), cudaMemcpyDeviceToHost);
	CHECK(memcmp(bf, hf, sizeof(bf)) == 0 && memcmp(bu, hu, sizeof(bu)) == 0,
	      "a sum over one rank changed the values");

	rc = embd_comm_broadcast(comm, d_send, N, 0);
	CHECK(rc == 0, "broadcast: %d %s", rc, embd_comm_error(comm));
	cudaMemcpy(back, d_send, N, cudaMemcpyDeviceToHost);
	CHECK(memcmp(back, host, N) == 0, "broadcast from self changed the bytes");
	for (int i = 0; i < 100; i++) {
		rc = embd_comm_barrier(comm);
		CHECK(rc == 0, "barrier %d: %d %s", i, rc, embd_comm_error(comm));
	}
	printf("test_comm_nccl: world of 1: alltoallv, allreduce f32/u64, broadcast, barrier ok\n");
out:
	embd_comm_destroy(comm);
	cudaFree(d_send);
	cudaFree(d_recv);
	cudaFree(d_f);
	cudaFree(d_u);
	free(host);
	free(back);
	free(hf);
	free(hu);
}

static void missing_peer_times_out(struct embd_store *store)
{
	char err[512] = "";
	int rc;
	int64_t t0 = embd_now_ms();
	struct embd_comm *comm = create(store, 2, 3000, "two/", &rc, err, sizeof(err));
	long long took = embd_now_ms() - t0;
	CHECK(rc == EMBD_ETIMEDOUT, "expected EMBD_ETIMEDOUT, got %d: %s", rc, err);
	CHECK(took < 3000 + 5000, "gave up after %lld ms", took);
	printf("test_comm_nccl: missing rank 1: %s (after %lld ms)\n", err, took);
out:
	embd_comm_destroy(comm);
}

int main(void)
{
	struct embd_store_server *server = NULL;
	struct embd_store *store = NULL;
	char err[256] = "";
	int devices = 0;

	if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
		printf("test_comm_nccl: no GPU, skipped\n");
		return 77;
	}
	if (embd_comm_available(EMBD_COMM_NCCL) != 0 ||
	    embd_store_server_start("127.0.0.1", 0, &server, err, sizeof(err)) < 0 ||
	    embd_store_connect("127.0.0.1", embd_store_server_port(server), 5000, &store, err,
			       sizeof(err)) < 0) {
		fprintf(stderr, "test_comm_nccl: setup: %s\n", err);
		return 1;
	}
	world_of_one(store);
	missing_peer_times_out(store);
	embd_store_close(store);
	embd_store_server_stop(server);
	printf("test_comm_nccl: %s\n", failures ? "FAILED" : "passed");
	return failures ? 1 : 0;
}
