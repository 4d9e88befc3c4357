/*
 * tests/gpu/bench_cuda_kernels.c - the CUDA kernels' benchmark: one JSON object per line, each
 * figure beside the card's device-to-device copy bandwidth measured in the same run
 * ("copy_limit"). Exits 77 where there is no GPU.
 *
 * Bytes are those a kernel cannot avoid moving: forward reads every looked-up row, each id
 * (and weight) and the offsets, and writes the pooled output; backward reads the ids, offsets
 * and dL/d(pooled) once, and reads and writes each touched row's weights and optimizer state
 * once. gbps = bytes / median time of REPS runs; tables are far larger than the 50 MB L2.
 * fused_uvm_caching's forward goes beside fused's on the same ids ("ratio_to_fused").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/gpu/gpu_util.h"

#define REPS 9
#define IDS_PER_CALL (4u << 20)
#define TABLE_BYTES (2ull << 30)

static struct embd_cuda_ctx *ctx;

static int cmp_float(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return x < y ? -1 : x > y;
}

typedef void (*bench_fn)(void *arg);

/* Median milliseconds of REPS runs of fn (after one warm-up), timed with events on the stream. */
static float time_ms(bench_fn fn, void *arg)
{
	cudaStream_t st = embd_cuda_ctx_stream(ctx);
	cudaEvent_t a, b;
	float ms[REPS];

	cudaEventCreate(&a);
	cudaEventCreate(&b);
	fn(arg);
	for (int i = 0; i < REPS; i++) {
		cudaEventRecord(a, st);
		fn(arg);
		cudaEventRecord(b, st);
		if (cudaEventSynchronize(b) != cudaSuccess)
			gpu_die("timing failed: %s", cudaGetErrorString(cudaGetLastError()));
		cudaEventElapsedTime(&ms[i], a, b);
	}
	struct embd_kernel_err e;
	int rc = embd_cuda_sync(ctx, &e);
	if (rc)
		gpu_die("a benchmarked call failed: %d (%s): %s", rc, embd_strerror(rc), e.msg);
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	qsort(ms, REPS, sizeof(float), cmp_float);
	return ms[REPS / 2];
}

struct copy_job {
	void *dst, *src;
	size_t bytes;
};

static void copy_run(void *arg)
{
	struct copy_job *j = arg;
	cudaMemcpyAsync(j->dst, j->src, j->bytes, cudaMemcpyDeviceToDevice, embd_cuda_ctx_stream(ctx));
}

/* Read + write bandwidth of a 1 GiB device-to-device copy, GB/s. */
static double copy_limit(void)
{
	struct copy_job j = { .bytes = 1ull << 30 };

	j.src = dev_alloc(j.bytes);
	j.dst = dev_alloc(j.bytes);
	dev_zero(j.src, j.bytes);
	float ms = time_ms(copy_run, &j);
	double gbps = 2.0 * j.bytes / (ms * 1e-3) / 1e9;
	printf("{\"name\":\"copy_limit\",\"bytes\":%zu,\"ms\":%.4f,\"gbps\":%.1f}\n", j.bytes, ms, gbps);
	dev_free(j.src);
	dev_free(j.dst);
	return gbps;
}

struct call_job {
	struct embd_bag_batch bt;
	struct embd_shard *shard;       /* backward */
};

static void forward_run(void *arg)
{
	struct call_job *j = arg;
	struct embd_kernel_err e;
	int rc = embd_cuda_forward(ctx, &j->bt, 1, &e);
	if (rc)
		gpu_die("forward: %s", e.msg);
}

static void backward_run(void *arg)
{
	struct call_job *j = arg;
	struct embd_kernel_err e;
	int rc = embd_cuda_backward(ctx, j->shard, &j->bt, 1, &e);
	if (rc)
		gpu_die("backward: %s", e.msg);
}

static const char *opt_names[] = { "sgd", "adagrad", "rowwise_adagrad", "adam" };

/* Forward (and, for the backward configs, every optimizer) over one table of dim columns. */
static void bench_table(struct grng *r, uint32_t dim, enum embd_data_type dt, const uint32_t *pfs,
			int npf, bool backward, double copy_gbps)
{
	uint32_t eb = embd_dtype_bytes(dt);
	int64_t rows = (int64_t)(TABLE_BYTES / ((uint64_t)dim * eb));
	const char *dts = dt == EMBD_DTYPE_FP16 ? "fp16" : "fp32";
	char msg[256];

	for (int opt = backward ? 0 : -1; opt < (backward ? 4 : 0); opt++) {
		struct embd_shard_desc d = {
			.table_id = 1, .num_embeddings = rows, .embedding_dim = dim, .dtype = dt,
			.row_offset = 0, .rows = rows, .col_offset = 0, .cols = dim,
			.optimizer = { .type = opt < 0 ? EMBD_OPT_SGD : (enum embd_optimizer_type)opt,
				       .lr = 0.01f, .eps = 1e-8f, .beta1 = 0.9f, .beta2 = 0.999f },
		};
		struct embd_shard *sh;
		uint64_t wb, m1b, m2b;
		if (embd_cuda_shard_create(ctx, &d, &sh, msg, sizeof(msg)) ||
		    embd_shard_sizes(&d, &wb, &m1b, &m2b, msg, sizeof(msg)))
			gpu_die("shard: %s", msg);
		dev_zero(sh->weights, wb);
		uint64_t state_row_bytes = (m1b + m2b) / (uint64_t)rows;

		for (int i = 0; i < npf; i++) {
			uint32_t P = pfs[i], B = IDS_PER_CALL / P;
			uint64_t n = (uint64_t)B * P;
			int64_t *offsets = malloc((B + 1) * sizeof(int64_t)), *ids = malloc(n * sizeof(int64_t));
			uint8_t *seen = calloc((size_t)rows / 8 + 1, 1);
			uint64_t unique = 0;
			if (!offsets || !ids || !seen)
				gpu_die("out of memory for %llu ids", (unsigned long long)n);
			for (uint32_t b = 0; b <= B; b++)
				offsets[b] = (int64_t)b * P;
			for (uint64_t k = 0; k < n; k++) {
				ids[k] = (int64_t)grng_below(r, (uint64_t)rows);
				if (!(seen[ids[k] / 8] & (1u << (ids[k] % 8)))) {
					seen[ids[k] / 8] |= (uint8_t)(1u << (ids[k] % 8));
					unique++;
				}
			}
			float *pooled = dev_alloc((uint64_t)B * dim * sizeof(float));
			dev_zero(pooled, (uint64_t)B * dim * sizeof(float));
			struct call_job j = { .shard = sh };
			j.bt = (struct embd_bag_batch){
				.shard = sh, .batch_size = B, .offsets = dev_upload(offsets, (B + 1) * sizeof(int64_t)),
				.ids = dev_upload(ids, n * sizeof(int64_t)), .num_ids = n,
				.pooling = EMBD_POOLING_SUM, .pooled = pooled, .pooled_grad = pooled,
				.pooled_stride = dim,
			};
			uint64_t io_bytes = n * 8 + (B + 1) * 8ull + (uint64_t)B * dim * 4;
			const char *name = opt < 0 ? "forward" : "backward";
			uint64_t bytes = opt < 0 ? io_bytes + n * dim * eb
						 : io_bytes + unique * (2ull * dim * eb + 2 * state_row_bytes);
			float ms = time_ms(opt < 0 ? forward_run : backward_run, &j);
			double gbps = bytes / (ms * 1e-3) / 1e9;
			printf("{\"name\":\"%s%s%s\",\"dim\":%u,\"dtype\":\"%s\",\"pooling_factor\":%u,"
			       "\"batch_size\":%u,\"ids\":%llu,\"unique_rows\":%llu,\"table_bytes\":%llu,"
			       "\"bytes\":%llu,\"ms\":%.4f,\"gbps\":%.1f,\"copy_gbps\":%.1f,\"ratio_to_copy\":%.3f}\n",
			       name, opt < 0 ? "" : "_", opt < 0 ? "" : opt_names[opt], dim, dts, P, B,
			       (unsigned long long)n, (unsigned long long)unique, (unsigned long long)wb,
			       (unsigned long long)bytes, ms, gbps, copy_gbps, gbps / copy_gbps);
			fflush(stdout);
			dev_free((void *)j.bt.offsets);
			dev_free((void *)j.bt.ids);
			dev_free(pooled);
			free(offsets);
			free(ids);
			free(seen);
		}
		embd_cuda_shard_destroy(sh);
	}
}

/*
 * fused_uvm_caching's forward against fused's over one D128 fp32 table (kernels/cache.h):
 * host rows pinned and mapped, a cache of 0.2 of them in HBM, and calls of B 2048 x P 20 ids,
 * 95% drawn from 32768 hot rows, 5% from the whole table: about 90% of a call's distinct rows
 * are cached (the line reports the rate the cache counted). One call: the host
 * maps the ids (engine/ranks_cache.c's prefetch), the GPU copies the misses in
 * (embd_cuda_cache_copy), the slot ids go over, the forward runs on the cache rows. The same
 * ids through a fused (HBM) shard are the reference; the hit rate is the cache's own count.
 */
struct cache_job {
	struct embd_cache *cache;
	struct embd_bag_batch bt;       /* on the slots, ids: the device slot ids */
	const int64_t *rows;            /* host: the call's local rows */
	uint64_t *slot_of;
	int64_t *slot_ids;
	void *host_rows[3], *slot_rows[3];
	uint64_t row_bytes[3];
};

static void cache_run(void *arg)
{
	struct cache_job *j = arg;
	struct embd_cache_moves mv;
	struct embd_kernel_err e;

	if (embd_cache_map(j->cache, j->rows, j->bt.num_ids, true, j->slot_of, &mv) ||
	    j->cache->overflow)
		gpu_die("cache map: no memory, or %llu rows overflowed their set",
			(unsigned long long)j->cache->overflow);
	if (embd_cuda_cache_copy(ctx, &mv, j->host_rows, j->slot_rows, j->row_bytes, &e))
		gpu_die("cache copy: %s", e.msg);
	for (uint64_t k = 0; k < j->bt.num_ids; k++)
		j->slot_ids[k] = (int64_t)j->slot_of[k];
	cudaMemcpyAsync((void *)j->bt.ids, j->slot_ids, j->bt.num_ids * 8, cudaMemcpyHostToDevice,
			embd_cuda_ctx_stream(ctx));
	if (embd_cuda_forward(ctx, &j->bt, 1, &e))
		gpu_die("forward on the cache: %s", e.msg);
	embd_cache_end(j->cache, false, &mv);
}

static void bench_caching(struct grng *r, double copy_gbps)
{
	const uint32_t dim = 128, B = 2048, P = 20;
	const uint64_t n = (uint64_t)B * P, row_bytes = dim * 4;
	const int64_t rows = (int64_t)(TABLE_BYTES / row_bytes);
	struct embd_shard_desc d = {
		.table_id = 1, .num_embeddings = rows, .embedding_dim = dim, .dtype = EMBD_DTYPE_FP32,
		.rows = rows, .cols = dim, .optimizer = { .type = EMBD_OPT_SGD, .lr = 0.01f },
	};
	struct cache_job j = { .row_bytes = { row_bytes, 0, 0 } };
	struct embd_shard *fused, *slots;
	char msg[256];

	if (embd_cache_create(rows, 0.2, &j.cache, msg, sizeof(msg)))
		gpu_die("cache: %s", msg);
	struct embd_shard_desc sd = d;
	sd.num_embeddings = sd.rows = (int64_t)embd_cache_slots(j.cache);
	if (embd_cuda_shard_create(ctx, &d, &fused, msg, sizeof(msg)) ||
	    embd_cuda_shard_create(ctx, &sd, &slots, msg, sizeof(msg)))
		gpu_die("shard: %s", msg);
	dev_zero(fused->weights, (uint64_t)rows * row_bytes);
	void *host = NULL;
	if (cudaHostAlloc(&host, (uint64_t)rows * row_bytes, cudaHostAllocMapped) != cudaSuccess ||
	    cudaHostGetDevicePointer(&j.host_rows[0], host, 0) != cudaSuccess)
		gpu_die("pinned mapped host rows: %s", cudaGetErrorString(cudaGetLastError()));
	memset(host, 0, (uint64_t)rows * row_bytes);
	j.slot_rows[0] = slots->weights;
	int64_t *offsets = malloc((B + 1) * 8), *ids = malloc(n * 8);
	j.slot_of = malloc(n * 8);
	j.slot_ids = malloc(n * 8);
	if (!offsets || !ids || !j.slot_of || !j.slot_ids)
		gpu_die("out of memory");
	for (uint32_t b = 0; b <= B; b++)
		offsets[b] = (int64_t)b * P;
	const uint64_t hot = 32768;
	for (uint64_t k = 0; k < n; k++)
		ids[k] = (int64_t)(grng_below(r, 20) ? grng_below(r, hot) * 7 % (uint64_t)rows
						     : grng_below(r, (uint64_t)rows));
	j.rows = ids;
	float *pooled = dev_alloc((uint64_t)B * dim * 4);
	struct call_job f = { .shard = fused };
	f.bt = (struct embd_bag_batch){
		.shard = fused, .batch_size = B, .offsets = dev_upload(offsets, (B + 1) * 8),
		.ids = dev_upload(ids, n * 8), .num_ids = n, .pooling = EMBD_POOLING_SUM,
		.pooled = pooled, .pooled_stride = dim,
	};
	j.bt = f.bt;
	j.bt.shard = slots;
	j.bt.ids = dev_alloc(n * 8);
	float fused_ms = time_ms(forward_run, &f);
	/* warm the hot set in, then count what the timed calls find */
	cache_run(&j);
	j.cache->hits = j.cache->misses = 0;
	float cache_ms = time_ms(cache_run, &j);
	double hit_rate = (double)j.cache->hits / (double)(j.cache->hits + j.cache->misses);
	uint64_t bytes = n * 8 + (B + 1) * 8ull + (uint64_t)B * dim * 4 + n * row_bytes;
	printf("{\"name\":\"forward_fused_uvm_caching\",\"dim\":%u,\"dtype\":\"fp32\","
	       "\"pooling_factor\":%u,\"batch_size\":%u,\"ids\":%llu,\"cache_rows\":%llu,"
	       "\"table_bytes\":%llu,\"hit_rate\":%.3f,\"ms\":%.4f,\"gbps\":%.1f,"
	       "\"fused_ms\":%.4f,\"fused_gbps\":%.1f,\"ratio_to_fused\":%.3f,\"copy_gbps\":%.1f}\n",
	       dim, P, B, (unsigned long long)n, (unsigned long long)embd_cache_slots(j.cache),
	       (unsigned long long)((uint64_t)rows * row_bytes), hit_rate, cache_ms,
	       bytes / (cache_ms * 1e-3) / 1e9, fused_ms, bytes / (fused_ms * 1e-3) / 1e9,
	       fused_ms / cache_ms, copy_gbps);
	fflush(stdout);
	dev_free((void *)f.bt.offsets);
	dev_free((void *)f.bt.ids);
	dev_free((void *)j.bt.ids);
	dev_free(pooled);
	cudaFreeHost(host);
	embd_cuda_shard_destroy(fused);
	embd_cuda_shard_destroy(slots);
	embd_cache_destroy(j.cache);
	free(offsets);
	free(ids);
	free(j.slot_of);
	free(j.slot_ids);
}

int main(void)
{
	static const uint32_t fwd_pf[] = { 1, 20, 100 }, bwd_pf[] = { 20 };
	struct grng r = { 0xbe9c4a11ull };
	char msg[256];

	gpu_require("bench_cuda_kernels");
	if (embd_cuda_ctx_create(0, NULL, &ctx, msg, sizeof(msg)))
		gpu_die("context: %s", msg);
	double copy_gbps = copy_limit();
	bench_table(&r, 64, EMBD_DTYPE_FP32, fwd_pf, 3, false, copy_gbps);
	bench_table(&r, 128, EMBD_DTYPE_FP32, fwd_pf, 3, false, copy_gbps);
	bench_table(&r, 128, EMBD_DTYPE_FP16, fwd_pf, 3, false, copy_gbps);
	bench_table(&r, 128, EMBD_DTYPE_FP32, bwd_pf, 1, true, copy_gbps);
	bench_caching(&r, copy_gbps);
	embd_cuda_ctx_destroy(ctx);
	return 0;
}
