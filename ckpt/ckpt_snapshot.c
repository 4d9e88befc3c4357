/*
 * Copy-before-write snapshots of the shards (ckpt/ckpt_snapshot.h). The array layout (one
 * array per shard and state at a fixed 64-byte aligned offset of one buffer) is computed once
 * at create; a shard's arrays are consecutive, and one chunk state and one bitmap per shard
 * cover all of its arrays, so the hook claims a row once for its weights and its state.
 */
#include "ckpt/ckpt_snapshot.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/clock.h"

#define HUGE_PAGE (2u << 20)
#define CHUNK_BYTES (32u << 10)
#define MAX_STATES 3

enum { CHUNK_PENDING, CHUNK_BUSY, CHUNK_DONE };

struct snap_shard {
	const struct embd_shard *shard;
	uint32_t first_array, num_arrays;
	uint64_t rows, rows_per_chunk, num_chunks;
	const uint8_t *src[MAX_STATES];
	uint8_t *dst[MAX_STATES];
	uint64_t row_bytes[MAX_STATES];
	_Atomic uint32_t *chunks;               /* num_chunks states */
	_Atomic uint64_t *copied;               /* one bit per row: the hook copied it */
};

struct embd_ckpt_snapshot {
	struct embd_ckpt_array *arrays;
	uint32_t num_arrays;
	uint32_t *array_shard;                  /* arrays[i] belongs to shards[array_shard[i]] */
	struct snap_shard *shards;
	uint32_t num_shards;
	uint8_t *buffer;
	uint64_t buffer_bytes;
	atomic_bool copying;                    /* begin .. the copy's end: hooks must look */
	_Atomic uint64_t hook_ns;
	pthread_mutex_t lock;                   /* shards_done and its condition */
	pthread_cond_t cond;
	uint32_t shards_done;
};

/* A file name from the table name: unsafe characters become '_'; the index keeps it unique. */
static void array_name(char *out, size_t cap, uint32_t table, const char *name, int64_t row,
		       uint32_t col, uint32_t node, enum embd_ckpt_state state)
{
	char safe[EMBD_NAME_MAX];
	size_t i = 0;

	for (; name[i] && i + 1 < sizeof(safe); i++) {
		char c = name[i];
		bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
			  c == '_' || c == '-';
		safe[i] = ok ? c : '_';
	}
	safe[i] = 0;
	snprintf(out, cap, "t%u-%s.r%lld.c%u.n%u.%s.npy", table, safe, (long long)row, col, node,
		 embd_ckpt_state_name(state));
}

/* The arrays of step shard i (0 to 3 of them) at arrays + k; returns how many. */
static int add_shard_arrays(struct embd_ckpt_snapshot *snap, const struct embd_tables *tables,
			    const struct embd_step_shard_view *v, uint32_t node, uint64_t *total,
			    char *err, size_t err_len)
{
	const struct embd_shard_desc *d = &v->shard->desc;
	struct snap_shard *sh = &snap->shards[snap->num_shards];
	uint64_t bytes[MAX_STATES], row_total = 0;
	int rc = embd_shard_sizes(d, &bytes[0], &bytes[1], &bytes[2], err, err_len);

	if (rc)
		return rc;
	const void *src[MAX_STATES] = { v->shard->weights, v->shard->momentum1, v->shard->momentum2 };
	*sh = (struct snap_shard){ .shard = v->shard, .first_array = snap->num_arrays,
				   .rows = (uint64_t)d->rows };
	for (int s = 0; s < MAX_STATES; s++) {
		if (!bytes[s])
			continue;
		struct embd_ckpt_array *a = &snap->arrays[snap->num_arrays];
		bool per_row = s && d->optimizer.type == EMBD_OPT_ROWWISE_ADAGRAD;
		a->file = (struct embd_ckpt_file){
			.table = v->table, .state = (enum embd_ckpt_state)s,
			.row_offset = d->row_offset, .rows = d->rows, .col_offset = d->col_offset,
			.cols = d->cols, .dtype = !s && d->dtype == EMBD_DTYPE_FP16 ? EMBD_NPY_F2 :
			EMBD_NPY_F4, .node = node,
		};
		a->ndim = per_row ? 1 : 2;
		array_name(a->file.name, sizeof(a->file.name), v->table, tables->specs[v->table].name,
			   d->row_offset, d->col_offset, node, a->file.state);
		a->data = (const void *)(uintptr_t)*total;      /* an offset until the buffer exists */
		sh->src[sh->num_arrays] = src[s];
		sh->row_bytes[sh->num_arrays] = bytes[s] / (uint64_t)d->rows;
		row_total += bytes[s] / (uint64_t)d->rows;
		snap->array_shard[snap->num_arrays] = snap->num_shards;
		snap->num_arrays++;
		sh->num_arrays++;
		*total += (bytes[s] + 63) / 64 * 64;
	}
	uint64_t rpc = (CHUNK_BYTES / row_total + 63) / 64 * 64;
	sh->rows_per_chunk = rpc ? rpc : 64;
	sh->num_chunks = (sh->rows + sh->rows_per_chunk - 1) / sh->rows_per_chunk;
	sh->chunks = calloc(sh->num_chunks, sizeof(*sh->chunks));
	sh->copied = calloc((sh->rows + 63) / 64, sizeof(*sh->copied));
	if (!sh->chunks || !sh->copied)
		return EMBD_ENOMEM;
	/* nothing to copy until the first begin */
	for (uint64_t c = 0; c < sh->num_chunks; c++)
		atomic_init(&sh->chunks[c], CHUNK_DONE);
	snap->num_shards++;
	return 0;
}

static void await_array(void *snap, uint32_t i)
{
	embd_ckpt_snapshot_wait_array(snap, i);
}

int embd_ckpt_snapshot_create(const struct embd_tables *tables, struct embd_step *step,
			      uint32_t node, struct embd_ckpt_snapshot **out, char *err,
			      size_t err_len)
{
	struct embd_ckpt_snapshot *snap = calloc(1, sizeof(*snap));
	uint32_t n = embd_step_num_shards(step);
	uint64_t total = 0;
	int rc = EMBD_ENOMEM;

	*out = NULL;
	if (!snap)
		goto fail;
	pthread_mutex_init(&snap->lock, NULL);
	pthread_cond_init(&snap->cond, NULL);
	snap->arrays = calloc(MAX_STATES * (size_t)n + 1, sizeof(*snap->arrays));
	snap->array_shard = calloc(MAX_STATES * (size_t)n + 1, sizeof(*snap->array_shard));
	snap->shards = calloc((size_t)n + 1, sizeof(*snap->shards));
	if (!snap->arrays || !snap->array_shard || !snap->shards)
		goto fail;
	for (uint32_t i = 0; i < n; i++) {
		struct embd_step_shard_view v;
		embd_step_shard_view(step, i, &v);
		if (v.replica || !v.shard)
			continue;       /* one copy of data_parallel; another node's shard */
		if ((rc = add_shard_arrays(snap, tables, &v, node, &total, err, err_len)))
			goto fail;
	}
	/* 2 MiB aligned and advised to huge pages, as shard memory is: fewer TLB misses */
	snap->buffer_bytes = (total + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
	snap->buffer = aligned_alloc(HUGE_PAGE, snap->buffer_bytes ? snap->buffer_bytes : HUGE_PAGE);
	if (!snap->buffer) {
		snprintf(err, err_len, "checkpoint snapshot buffer: out of memory for %" PRIu64
			 " bytes", total);
		rc = EMBD_ENOMEM;
		goto fail;
	}
	madvise(snap->buffer, snap->buffer_bytes, MADV_HUGEPAGE);
	memset(snap->buffer, 0, total);         /* touched now: no copy pays the page faults */
	for (uint32_t i = 0; i < snap->num_arrays; i++) {
		snap->arrays[i].data = snap->buffer + (uintptr_t)snap->arrays[i].data;
		snap->arrays[i].await_data = await_array;
		snap->arrays[i].await_arg = snap;
	}
	for (uint32_t k = 0; k < snap->num_shards; k++) {
		struct snap_shard *sh = &snap->shards[k];
		for (uint32_t a = 0; a < sh->num_arrays; a++)
			sh->dst[a] = (uint8_t *)snap->arrays[sh->first_array + a].data;
	}
	snap->shards_done = snap->num_shards;
	*out = snap;
	return 0;
fail:
	if (rc == EMBD_ENOMEM && err_len && !err[0])
		snprintf(err, err_len, "checkpoint snapshot: out of memory");
	embd_ckpt_snapshot_destroy(snap);
	return rc;
}

void embd_ckpt_snapshot_destroy(struct embd_ckpt_snapshot *snap)
{
	if (!snap)
		return;
	for (uint32_t k = 0; snap->shards && k < snap->num_shards; k++) {
		free(snap->shards[k].chunks);
		free(snap->shards[k].copied);
	}
	/* a shard that failed half-way through add_shard_arrays */
	if (snap->shards) {
		free(snap->shards[snap->num_shards].chunks);
		free(snap->shards[snap->num_shards].copied);
	}
	pthread_mutex_destroy(&snap->lock);
	pthread_cond_destroy(&snap->cond);
	free(snap->arrays);
	free(snap->array_shard);
	free(snap->shards);
	free(snap->buffer);
	free(snap);
}

const struct embd_ckpt_array *embd_ckpt_snapshot_arrays(const struct embd_ckpt_snapshot *snap,
							uint32_t *num_arrays)
{
	*num_arrays = snap->num_arrays;
	return snap->arrays;
}

void embd_ckpt_snapshot_begin(struct embd_ckpt_snapshot *snap)
{
	for (uint32_t k = 0; k < snap->num_shards; k++) {
		struct snap_shard *sh = &snap->shards[k];
		for (uint64_t c = 0; c < sh->num_chunks; c++)
			atomic_store_explicit(&sh->chunks[c], CHUNK_PENDING, memory_order_relaxed);
		for (uint64_t w = 0; w < (sh->rows + 63) / 64; w++)
			atomic_store_explicit(&sh->copied[w], 0, memory_order_relaxed);
		for (uint32_t a = 0; a < sh->num_arrays; a++)
			snap->arrays[sh->first_array + a].file.optimizer_step = sh->shard->step;
	}
	pthread_mutex_lock(&snap->lock);
	snap->shards_done = 0;
	pthread_mutex_unlock(&snap->lock);
	atomic_store_explicit(&snap->hook_ns, 0, memory_order_relaxed);
	/* release: the rank workers that see copying see the states above */
	atomic_store_explicit(&snap->copying, snap->num_shards > 0, memory_order_release);
	if (!snap->num_shards)
		pthread_cond_broadcast(&snap->cond);
}

static void copy_rows(const struct snap_shard *sh, uint64_t row, uint64_t count)
{
	for (uint32_t a = 0; a < sh->num_arrays; a++)
		memcpy(sh->dst[a] + row * sh->row_bytes[a], sh->src[a] + row * sh->row_bytes[a],
		       count * sh->row_bytes[a]);
}

/* Claims chunk c for the copier: a hook holds it only for one row, so spinning is short. */
static void claim_chunk(struct snap_shard *sh, uint64_t c)
{
	for (;;) {
		uint32_t expect = CHUNK_PENDING;
		if (atomic_compare_exchange_weak_explicit(&sh->chunks[c], &expect, CHUNK_BUSY,
							  memory_order_acquire, memory_order_relaxed))
			return;
		sched_yield();
	}
}

/* The rows of chunk c the hooks did not copy, in runs between marked rows. */
static void copy_chunk(struct snap_shard *sh, uint64_t c)
{
	uint64_t lo = c * sh->rows_per_chunk;
	uint64_t hi = lo + sh->rows_per_chunk < sh->rows ? lo + sh->rows_per_chunk : sh->rows;
	uint64_t run = lo;

	for (uint64_t w = lo / 64; w * 64 < hi; w++) {
		uint64_t bits = atomic_load_explicit(&sh->copied[w], memory_order_relaxed);
		if (!bits)
			continue;
		for (uint64_t r = w * 64; r < w * 64 + 64 && r < hi; r++) {
			if (!(bits >> (r & 63) & 1))
				continue;
			if (run < r)
				copy_rows(sh, run, r - run);
			run = r + 1;
		}
	}
	if (run < hi)
		copy_rows(sh, run, hi - run);
}

void embd_ckpt_snapshot_copy(struct embd_ckpt_snapshot *snap)
{
	for (uint32_t k = 0; k < snap->num_shards; k++) {
		struct snap_shard *sh = &snap->shards[k];
		for (uint64_t c = 0; c < sh->num_chunks; c++) {
			claim_chunk(sh, c);
			copy_chunk(sh, c);
			atomic_store_explicit(&sh->chunks[c], CHUNK_DONE, memory_order_release);
		}
		pthread_mutex_lock(&snap->lock);
		snap->shards_done = k + 1;
		pthread_cond_broadcast(&snap->cond);
		pthread_mutex_unlock(&snap->lock);
	}
	atomic_store_explicit(&snap->copying, false, memory_order_release);
}

void embd_ckpt_snapshot_wait_array(struct embd_ckpt_snapshot *snap, uint32_t i)
{
	pthread_mutex_lock(&snap->lock);
	while (snap->shards_done <= snap->array_shard[i])
		pthread_cond_wait(&snap->cond, &snap->lock);
	pthread_mutex_unlock(&snap->lock);
}

/* Row r of a chunk the copier has not reached: copied (and marked) while the hook holds the
 * chunk, unless the copier got there first. */
static void save_row(struct snap_shard *sh, uint64_t r)
{
	uint64_t c = r / sh->rows_per_chunk;

	for (;;) {
		uint32_t expect = CHUNK_PENDING;
		if (atomic_compare_exchange_weak_explicit(&sh->chunks[c], &expect, CHUNK_BUSY,
							  memory_order_acquire, memory_order_relaxed)) {
			copy_rows(sh, r, 1);
			atomic_fetch_or_explicit(&sh->copied[r / 64], 1ull << (r & 63),
						 memory_order_relaxed);
			atomic_store_explicit(&sh->chunks[c], CHUNK_PENDING, memory_order_release);
			return;
		}
		if (expect == CHUNK_DONE)
			return;
		sched_yield();          /* the copier holds the chunk: it is copying this row */
	}
}

void embd_ckpt_snapshot_before_update(void *arg, const struct embd_shard *shard,
				      const struct embd_bag_batch *batches, uint32_t n)
{
	struct embd_ckpt_snapshot *snap = arg;
	struct snap_shard *sh = NULL;

	if (!atomic_load_explicit(&snap->copying, memory_order_acquire))
		return;
	for (uint32_t k = 0; k < snap->num_shards && !sh; k++)
		if (snap->shards[k].shard == shard)
			sh = &snap->shards[k];
	if (!sh)
		return;         /* a data_parallel replica the checkpoint does not save */
	uint64_t t0 = embd_now_ns();
	const int64_t row_offset = shard->desc.row_offset;
	for (uint32_t b = 0; b < n; b++) {
		for (uint64_t i = 0; i < batches[b].num_ids; i++) {
			int64_t id = batches[b].ids[i];
			/* the kernel refuses ids outside the shard before it updates anything */
			if (id < row_offset || (uint64_t)(id - row_offset) >= sh->rows)
				continue;
			uint64_t r = (uint64_t)(id - row_offset);
			uint64_t c = r / sh->rows_per_chunk;
			if (atomic_load_explicit(&sh->chunks[c], memory_order_acquire) == CHUNK_DONE ||
			    atomic_load_explicit(&sh->copied[r / 64], memory_order_relaxed) >> (r & 63) & 1)
				continue;
			save_row(sh, r);
		}
	}
	atomic_fetch_add_explicit(&snap->hook_ns, embd_now_ns() - t0, memory_order_relaxed);
}

uint64_t embd_ckpt_snapshot_hook_ns(struct embd_ckpt_snapshot *snap)
{
	return atomic_load_explicit(&snap->hook_ns, memory_order_relaxed);
}
