/*
 * ipc/ring.h - single-producer single-consumer rings of fixed-size descriptors in shared memory,
 * the only code that reads or writes ring indices: nothing else touches them.
 *
 * The one idea: each side keeps its own index in private memory and only *reads* the other
 * side's index from the shared block, so a hostile peer can at worst make the ring look empty
 * or report EMBD_EPROTO; it can never make this side read or write outside the entry array.
 */
#ifndef EMBD_IPC_RING_H
#define EMBD_IPC_RING_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "embd/types.h"

/*
 * Shared layout of one ring (struct embd_ring_shared, 256 bytes, then the entries):
 *
 *   offset   word       written by    read by      meaning
 *   0        head       consumer      producer     entries consumed so far (free-running u32)
 *   64       tail       producer      consumer     entries produced so far (free-running u32)
 *   128      flags      consumer      producer     EMBD_RING_NEED_WAKEUP: "I am going to sleep"
 *   192      doorbell   producer      consumer     futex word, incremented on every wakeup
 *   256      entries[size], each entry_bytes, entry i at index (i & (size - 1))
 *
 * Each word has its own 64-byte cache line so producer and consumer never false-share.
 * Indices run freely and wrap at 2^32; size is a power of two so (index & mask) stays right
 * across the wrap and tail - head (unsigned) is the number of entries in flight.
 *
 * Memory ordering (as io_uring's rings): the producer writes the entry, then stores tail with
 * release; the consumer loads tail with acquire, then reads the entry. The consumer copies the
 * entry out, then stores head with release; the producer loads head with acquire before it
 * overwrites that slot. The producer keeps the last head it read (peer_head) and reads the
 * shared head again only when that copy says the ring is full: head lives in the consumer's
 * cache, so reading it on every push would cost a cache-line transfer on every request. A
 * stale copy only ever under-counts the free slots.
 *
 * Notification suppression (io_uring's IORING_SQ_NEED_WAKEUP, in both directions: the service
 * is the SQ consumer, the client is the CQ consumer): a consumer about to sleep sets
 * NEED_WAKEUP, issues a full fence and looks at the ring once more (embd_ring_sleep_prepare);
 * a producer publishes tail, issues a full fence and reads the flag (embd_ring_needs_wakeup).
 * The two fences guarantee that either the consumer sees the new entry or the producer sees
 * the flag, so a wakeup is never lost and never sent to a consumer that is busy polling.
 * The doorbell word itself is driven by ipc/doorbell.h.
 */

#define EMBD_RING_NEED_WAKEUP (1u << 0)
#define EMBD_RING_CACHELINE 64u
#define EMBD_RING_SIZE_MAX (1u << 20)  /* entries; keeps size * entry_bytes far from overflow */

struct embd_ring_shared {
	_Alignas(EMBD_RING_CACHELINE) _Atomic uint32_t head;
	_Alignas(EMBD_RING_CACHELINE) _Atomic uint32_t tail;
	_Alignas(EMBD_RING_CACHELINE) _Atomic uint32_t flags;
	_Alignas(EMBD_RING_CACHELINE) _Atomic uint32_t doorbell;
};
_Static_assert(sizeof(struct embd_ring_shared) == 4 * EMBD_RING_CACHELINE, "ring block layout");

enum embd_ring_role {
	EMBD_RING_PRODUCER = 0,
	EMBD_RING_CONSUMER = 1,
};

/* One side's private handle on a ring. Not thread-safe: one thread per side at a time. */
struct embd_ring {
	struct embd_ring_shared *sh;
	unsigned char *entries;
	uint32_t size;          /* entries, a power of two */
	uint32_t mask;          /* size - 1 */
	uint32_t entry_bytes;
	uint32_t local;         /* the index this side owns: tail for a producer, head for a consumer */
	uint32_t peer_head;     /* producer: the consumer's head as last read and checked */
	enum embd_ring_role role;
};

/* Copies one entry; the protocol's 128-byte descriptors get a copy of constant size, which the
 * compiler inlines as a few vector moves instead of a call into libc's memcpy. */
#define EMBD_RING_COMMON_ENTRY_BYTES 128u
static inline void embd_ring_copy_entry(void *dst, const void *src, uint32_t entry_bytes)
{
	if (entry_bytes == EMBD_RING_COMMON_ENTRY_BYTES)
		memcpy(dst, src, EMBD_RING_COMMON_ENTRY_BYTES);
	else
		memcpy(dst, src, entry_bytes);
}

/* Bytes of the shared block plus `size` entries of `entry_bytes` (0 when the shape is invalid). */
static inline uint64_t embd_ring_bytes(uint32_t size, uint32_t entry_bytes)
{
	if (size == 0 || size > EMBD_RING_SIZE_MAX || (size & (size - 1)) != 0 || entry_bytes == 0)
		return 0;
	return sizeof(struct embd_ring_shared) + (uint64_t)size * entry_bytes;
}

/*
 * Zeroes the shared block of a new ring (the creator calls this once, before the peer maps it).
 * `mem` must be 64-byte aligned and hold embd_ring_bytes(size, entry_bytes).
 */
static inline void embd_ring_format(void *mem)
{
	struct embd_ring_shared *sh = (struct embd_ring_shared *)mem;

	atomic_store_explicit(&sh->head, 0, memory_order_relaxed);
	atomic_store_explicit(&sh->tail, 0, memory_order_relaxed);
	atomic_store_explicit(&sh->flags, 0, memory_order_relaxed);
	atomic_store_explicit(&sh->doorbell, 0, memory_order_relaxed);
	atomic_thread_fence(memory_order_release);
}

/*
 * Attaches one side to a formatted ring at `mem`. The private index starts from the shared
 * one the peer does not write (head for a consumer, tail for a producer), read once here.
 * Returns 0 or EMBD_EINVAL for a bad shape.
 */
static inline int embd_ring_attach(struct embd_ring *r, void *mem, uint32_t size, uint32_t entry_bytes,
				   enum embd_ring_role role)
{
	if (embd_ring_bytes(size, entry_bytes) == 0 || ((uintptr_t)mem % EMBD_RING_CACHELINE) != 0)
		return EMBD_EINVAL;
	r->sh = (struct embd_ring_shared *)mem;
	r->entries = (unsigned char *)mem + sizeof(struct embd_ring_shared);
	r->size = size;
	r->mask = size - 1;
	r->entry_bytes = entry_bytes;
	r->role = role;
	r->local = role == EMBD_RING_PRODUCER ?
		atomic_load_explicit(&r->sh->tail, memory_order_relaxed) :
		atomic_load_explicit(&r->sh->head, memory_order_relaxed);
	r->peer_head = r->local - r->size;      /* "full": the first push reads the real head */
	return 0;
}

/*
 * Entries in flight as seen from this side: tail - head, where this side's index is the
 * private copy and the peer's comes from shared memory. Returns the count (0..size) or
 * EMBD_EPROTO when the peer's index is more than `size` away (a corrupt or hostile peer).
 */
static inline int64_t embd_ring_count(const struct embd_ring *r)
{
	uint32_t in_flight;

	if (r->role == EMBD_RING_PRODUCER)
		in_flight = r->local - atomic_load_explicit(&r->sh->head, memory_order_acquire);
	else
		in_flight = atomic_load_explicit(&r->sh->tail, memory_order_acquire) - r->local;
	if (in_flight > r->size)
		return EMBD_EPROTO;
	return in_flight;
}

/*
 * Consumer, polling an empty ring: loads the lines of the slot the next entry will land in, so
 * that the producer's write moves them here while tail moves too, not only after this side saw
 * tail change (one cache-line transfer instead of two in a row on the waiting side).
 */
static inline void embd_ring_touch_next(const struct embd_ring *r)
{
	const volatile unsigned char *slot =
		r->entries + (uint64_t)(r->local & r->mask) * r->entry_bytes;

	for (uint32_t b = 0; b < r->entry_bytes; b += EMBD_RING_CACHELINE)
		(void)slot[b];
}

/*
 * Producer: copies `entry` (entry_bytes) into the next slot and publishes it.
 * Returns 0, EMBD_ENOSPC when the ring is full, or EMBD_EPROTO for a corrupt head.
 */
static inline int embd_ring_push(struct embd_ring *r, const void *entry)
{
	if (r->local - r->peer_head >= r->size) {
		int64_t in_flight = embd_ring_count(r);
		if (in_flight < 0)
			return (int)in_flight;
		r->peer_head = r->local - (uint32_t)in_flight;
		if ((uint32_t)in_flight == r->size)
			return EMBD_ENOSPC;
	}
	embd_ring_copy_entry(r->entries + (uint64_t)(r->local & r->mask) * r->entry_bytes, entry,
			     r->entry_bytes);
	r->local++;
	atomic_store_explicit(&r->sh->tail, r->local, memory_order_release);
	return 0;
}

/*
 * Producer: whether `want` (at most size) more entries fit now: 1 or 0, or EMBD_EPROTO for a
 * corrupt head. Like embd_ring_push it reads the consumer's head only when the last copy says
 * they do not, so a producer that must never push into a full ring (a completion that cannot
 * be dropped) can ask before it takes on the work whose results it will push.
 */
static inline int embd_ring_room(struct embd_ring *r, uint32_t want)
{
	if (r->local - r->peer_head + want <= r->size)
		return 1;
	int64_t in_flight = embd_ring_count(r);
	if (in_flight < 0)
		return (int)in_flight;
	r->peer_head = r->local - (uint32_t)in_flight;
	return (uint32_t)in_flight + want <= r->size;
}

/*
 * Consumer: copies the oldest entry into private memory at `entry_out` and frees its slot.
 * The copy is the only read of the slot, so the producer changing it later cannot change
 * what the caller validates. Returns 0, EMBD_EAGAIN when empty, or EMBD_EPROTO for a
 * corrupt tail.
 */
static inline int embd_ring_pop(struct embd_ring *r, void *entry_out)
{
	int64_t in_flight = embd_ring_count(r);

	if (in_flight < 0)
		return (int)in_flight;
	if (in_flight == 0) {
		embd_ring_touch_next(r);
		return EMBD_EAGAIN;
	}
	embd_ring_copy_entry(entry_out, r->entries + (uint64_t)(r->local & r->mask) * r->entry_bytes,
			     r->entry_bytes);
	r->local++;
	atomic_store_explicit(&r->sh->head, r->local, memory_order_release);
	return 0;
}

/*
 * Producer, after publishing: true when the consumer advertised that it sleeps, i.e. the
 * caller must ring the doorbell. The fence pairs with the one in embd_ring_sleep_prepare.
 */
static inline bool embd_ring_needs_wakeup(const struct embd_ring *r)
{
	atomic_thread_fence(memory_order_seq_cst);
	return (atomic_load_explicit(&r->sh->flags, memory_order_relaxed) & EMBD_RING_NEED_WAKEUP) != 0;
}

/*
 * Consumer, before sleeping: sets NEED_WAKEUP, then returns the doorbell value to sleep on
 * in *doorbell_seen and whether the ring is still empty (true: sleep until the doorbell moves
 * from *doorbell_seen; false: an entry arrived, call embd_ring_sleep_finish and consume).
 * A corrupt tail counts as "not empty" so that the caller's pop reports EMBD_EPROTO.
 */
static inline bool embd_ring_sleep_prepare(struct embd_ring *r, uint32_t *doorbell_seen)
{
	atomic_fetch_or_explicit(&r->sh->flags, EMBD_RING_NEED_WAKEUP, memory_order_relaxed);
	*doorbell_seen = atomic_load_explicit(&r->sh->doorbell, memory_order_relaxed);
	atomic_thread_fence(memory_order_seq_cst);
	return embd_ring_count(r) == 0;
}

/* Consumer, awake again: clears NEED_WAKEUP so producers stop ringing. */
static inline void embd_ring_sleep_finish(struct embd_ring *r)
{
	atomic_fetch_and_explicit(&r->sh->flags, ~EMBD_RING_NEED_WAKEUP, memory_order_relaxed);
}

/* The ring's doorbell futex word (for ipc/doorbell.h). */
static inline _Atomic uint32_t *embd_ring_doorbell_word(const struct embd_ring *r)
{
	return &r->sh->doorbell;
}

#endif /* EMBD_IPC_RING_H */
