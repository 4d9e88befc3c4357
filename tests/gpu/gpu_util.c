/* Shared helpers of the GPU test and benchmark (gpu_util.h). */
#include "tests/gpu/gpu_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

void gpu_die(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

void gpu_require(const char *prog)
{
	int n = 0;

	embd_cuda_device_count(&n);
	if (n < 1) {
		printf("%s: no GPU present (or no CUDA driver): skipped\n", prog);
		exit(GPU_SKIP_EXIT);
	}
}

static void check(cudaError_t e, const char *what, size_t bytes)
{
	if (e != cudaSuccess)
		gpu_die("%s of %zu bytes: %s", what, bytes, cudaGetErrorString(e));
}

void *dev_alloc(size_t bytes)
{
	void *p = NULL;

	check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc", bytes);
	return p;
}

/*
 * cudaMemcpy runs on the legacy stream, which a context's non-blocking stream does not wait
 * for, and from pageable memory it may return before the data has landed: wait for the whole
 * device on both sides of every copy.
 */
void dev_copy_in(void *dev, const void *host, size_t bytes)
{
	if (!bytes)
		return;
	check(cudaDeviceSynchronize(), "waiting before an upload", bytes);
	check(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice), "upload", bytes);
	check(cudaDeviceSynchronize(), "upload", bytes);
}

void *dev_upload(const void *host, size_t bytes)
{
	if (!host || !bytes)
		return NULL;
	void *p = dev_alloc(bytes);
	dev_copy_in(p, host, bytes);
	return p;
}

void dev_download(void *host, const void *dev, size_t bytes)
{
	if (!bytes)
		return;
	check(cudaDeviceSynchronize(), "waiting before a download", bytes);
	check(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), "download", bytes);
}

void dev_zero(void *dev, size_t bytes)
{
	check(cudaMemset(dev, 0, bytes), "cudaMemset", bytes);
	check(cudaDeviceSynchronize(), "cudaMemset", bytes);
}

void dev_free(void *dev)
{
	cudaFree(dev);
}

uint64_t grng_u64(struct grng *r)
{
	r->s ^= r->s >> 12;
	r->s ^= r->s << 25;
	r->s ^= r->s >> 27;
	return r->s * 0x2545f4914f6cdd1dull;
}

uint64_t grng_below(struct grng *r, uint64_t n)
{
	return n ? grng_u64(r) % n : 0;
}

float grng_float(struct grng *r, float lo, float hi)
{
	return lo + (hi - lo) * (float)((grng_u64(r) >> 40) * 0x1p-24);
}

void gbags_random(struct gbags *g, struct grng *r, uint32_t batch_size, uint32_t max_len,
		  uint32_t zero_pct, int64_t id_lo, uint64_t id_span, int weighted)
{
	g->batch_size = batch_size;
	g->lengths = malloc((batch_size ? batch_size : 1) * sizeof(*g->lengths));
	g->offsets = malloc((batch_size + 1) * sizeof(*g->offsets));
	if (!g->lengths || !g->offsets)
		gpu_die("out of memory for %u bags", batch_size);
	g->offsets[0] = 0;
	for (uint32_t b = 0; b < batch_size; b++) {
		g->lengths[b] = grng_below(r, 100) < zero_pct ? 0 : (int32_t)grng_below(r, max_len + 1);
		g->offsets[b + 1] = g->offsets[b] + g->lengths[b];
	}
	g->num_ids = (uint64_t)g->offsets[batch_size];
	g->ids = malloc((g->num_ids ? g->num_ids : 1) * sizeof(*g->ids));
	g->weights = weighted ? malloc((g->num_ids ? g->num_ids : 1) * sizeof(float)) : NULL;
	if (!g->ids || (weighted && !g->weights))
		gpu_die("out of memory for %llu ids", (unsigned long long)g->num_ids);
	for (uint64_t i = 0; i < g->num_ids; i++) {
		g->ids[i] = id_lo + (int64_t)grng_below(r, id_span);
		if (weighted)
			g->weights[i] = grng_float(r, -1.5f, 1.5f);
	}
}

void gbags_free(struct gbags *g)
{
	free(g->lengths);
	free(g->offsets);
	free(g->ids);
	free(g->weights);
}
