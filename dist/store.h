/*
 * dist/store.h - the rendezvous key-value store of a cluster of embd nodes, in the manner of
 * torch.distributed's TCPStore: node 0 serves it on MASTER_ADDR:MASTER_PORT, every node (node 0
 * too) connects as a client. Keys are strings, values byte strings. `wait` blocks until keys
 * exist; `add` is an atomic counter (barriers and "everyone reported" are built from it).
 *
 * Every call that can block takes a timeout and returns EMBD_ETIMEDOUT when it expires; a
 * client connecting while the server is not up yet retries until its timeout. A server that
 * goes away makes calls return EMBD_ECONNRESET; after any error other than a server-answered
 * one (timeout, missing key, bad key) the handle is closed and every later call fails: connect
 * a new one. One handle is used by one thread at a time. The server runs on its own thread
 * inside the node-0 process; timeouts are in ms, 0 meaning "do not wait" (negative = 0).
 * Functions with an err[err_len] argument write their message there (err may be NULL when
 * err_len is 0); the others keep it on the handle (embd_store_error).
 */
#ifndef EMBD_DIST_STORE_H
#define EMBD_DIST_STORE_H

#include <stddef.h>
#include <stdint.h>

struct embd_store_server;
struct embd_store;

#define EMBD_STORE_KEY_MAX 256                  /* bytes of a key, NUL excluded */
#define EMBD_STORE_VALUE_MAX (64u << 20)        /* bytes of one value (a plan fits) */

/* Listens on addr:port (addr "" or "0.0.0.0" = every interface, port 0 = any free port) and
 * serves on a thread. The wire protocol is described in dist/store_wire.h. */
int embd_store_server_start(const char *addr, uint16_t port, struct embd_store_server **out,
			    char *err, size_t err_len);
/* The port the server listens on (the chosen one when started with port 0). */
uint16_t embd_store_server_port(const struct embd_store_server *server);
/* Stops the thread and closes every connection. NULL is a no-op. */
void embd_store_server_stop(struct embd_store_server *server);

/* Connects to addr:port, retrying until timeout_ms; errors name addr:port. */
int embd_store_connect(const char *addr, uint16_t port, int timeout_ms,
		       struct embd_store **out, char *err, size_t err_len);
void embd_store_close(struct embd_store *store);
/* A handle closed by an error connects again to the same addr:port (retrying until
 * timeout_ms): 0, at once when it is still open, or EMBD_ETIMEDOUT. Whether the server is the
 * same one is the caller's to check (a key it set before, e.g. embd/instance). */
int embd_store_reconnect(struct embd_store *store, int timeout_ms);

/* The timeout (ms) used by get/wait/add on this handle (initially connect's timeout_ms). */
void embd_store_set_timeout(struct embd_store *store, int timeout_ms);

int embd_store_set(struct embd_store *store, const char *key, const void *value, size_t len);
/* Waits for key, then returns a malloc'ed copy in *value (caller frees) of *len bytes. */
int embd_store_get(struct embd_store *store, const char *key, void **value, size_t *len);
/* Adds delta to the integer at key (missing = 0) and returns the new value in *out (out may be
 * NULL). The counter is stored as decimal text, so get() of it reads e.g. "3". */
int embd_store_add(struct embd_store *store, const char *key, int64_t delta, int64_t *out);
/* Waits until every key exists. */
int embd_store_wait(struct embd_store *store, const char *const *keys, size_t n);
/* 1 when key exists, 0 when not, or a negative code. */
int embd_store_check(struct embd_store *store, const char *key);
/* 0 when key was deleted, EMBD_ENOENT when it did not exist. */
int embd_store_delete(struct embd_store *store, const char *key);

/* The last error's message on this handle ("" when none). */
const char *embd_store_error(const struct embd_store *store);

/* The server's address as this connection reaches it (getpeername). EMBD_EIO when not
 * connected. */
struct sockaddr_storage;
int embd_store_server_addr(const struct embd_store *store, struct sockaddr_storage *out);

#endif /* EMBD_DIST_STORE_H */
