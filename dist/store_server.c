/*
 * dist/store_server.c - the rendezvous store's server (dist/store.h): one thread, one
 * poll(2) loop over the listening socket, a wake-up eventfd and every client connection, all
 * non-blocking. The protocol is in dist/store_wire.h.
 *
 * The idea: a GET or WAIT whose keys are missing is parked on its connection (at most one
 * request per connection is in flight, the protocol says so) with a deadline; every SET and
 * ADD re-checks the parked requests, and poll's timeout is the nearest deadline, so a waiter
 * is answered the moment its keys appear or its time is up. Nothing a peer sends can stop the
 * loop: a bad frame closes that one connection.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dist/store_wire.h"
#include "common/clock.h"

#define STORE_BUCKETS 1024u
#define READ_CHUNK_BYTES 4096u

struct entry {
	struct entry *next;
	uint8_t *value;
	size_t value_len;
	size_t key_len;
	char key[];
};

struct conn {
	int fd;
	uint8_t *in;                    /* received bytes not yet handled */
	size_t in_len, in_cap;
	struct embd_wbuf out;           /* responses not yet sent, from out_off */
	size_t out_off;
	bool closing;                   /* close once out is flushed (after a protocol error) */
	bool dead;
	uint8_t *parked;                /* body of the parked GET/WAIT, or NULL */
	size_t parked_len;
	uint64_t deadline_ms;
};

struct embd_store_server {
	int listen_fd;
	int wake_fd;
	uint16_t port;
	pthread_t thread;
	struct conn **conns;
	size_t num_conns, cap_conns;
	struct pollfd *pfds;
	size_t cap_pfds;
	struct entry *buckets[STORE_BUCKETS];
};

/* ---- the table ------------------------------------------------------------------------- */

static uint32_t key_bucket(const char *key, size_t len)
{
	uint64_t h = 14695981039346656037ull;
	for (size_t i = 0; i < len; i++)
		h = (h ^ (uint8_t)key[i]) * 1099511628211ull;
	return (uint32_t)(h % STORE_BUCKETS);
}

static struct entry **entry_slot(struct embd_store_server *s, const char *key, size_t len)
{
	struct entry **e = &s->buckets[key_bucket(key, len)];
	while (*e && ((*e)->key_len != len || memcmp((*e)->key, key, len) != 0))
		e = &(*e)->next;
	return e;
}

static struct entry *entry_find(struct embd_store_server *s, const char *key, size_t len)
{
	return *entry_slot(s, key, len);
}

/* Replaces key's value with a copy of value (creating the entry). */
static int entry_set(struct embd_store_server *s, const char *key, size_t len,
		     const void *value, size_t value_len)
{
	struct entry **slot = entry_slot(s, key, len);
	uint8_t *copy = malloc(value_len ? value_len : 1);
	if (!copy)
		return EMBD_ENOMEM;
	if (value_len)
		memcpy(copy, value, value_len);
	struct entry *e = *slot;
	if (!e) {
		e = calloc(1, sizeof(*e) + len);
		if (!e) {
			free(copy);
			return EMBD_ENOMEM;
		}
		memcpy(e->key, key, len);
		e->key_len = len;
		*slot = e;
	}
	free(e->value);
	e->value = copy;
	e->value_len = value_len;
	return 0;
}

static void table_free(struct embd_store_server *s)
{
	for (size_t b = 0; b < STORE_BUCKETS; b++) {
		for (struct entry *e = s->buckets[b], *next; e; e = next) {
			next = e->next;
			free(e->value);
			free(e);
		}
		s->buckets[b] = NULL;
	}
}

/* ---- responses ------------------------------------------------------------------------- */

static void respond(struct conn *c, int32_t status, const void *result, size_t len)
{
	size_t at = embd_wbuf_frame_begin(&c->out);
	embd_wbuf_u32(&c->out, (uint32_t)status);
	embd_wbuf_put(&c->out, result, len);
	embd_wbuf_frame_end(&c->out, at);
	if (c->out.failed)
		c->dead = true;         /* cannot even queue the answer: drop the client */
}

__attribute__((format(printf, 3, 4)))
static void respond_error(struct conn *c, int32_t status, const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0)
		n = 0;
	respond(c, status, msg, (size_t)n < sizeof(msg) ? (size_t)n : sizeof(msg) - 1);
}

static void protocol_error(struct conn *c, const char *what)
{
	respond_error(c, EMBD_EPROTO, "bad request: %s", what);
	c->closing = true;
}

/* ---- parked GET / WAIT ----------------------------------------------------------------- */

/*
 * Answers c's parked request if its keys exist, or with EMBD_ETIMEDOUT (naming the missing
 * keys) when expired is set. The body was validated when it was parked.
 */
static void parked_try(struct embd_store_server *s, struct conn *c, bool expired)
{
	struct embd_rbuf r = { c->parked, c->parked_len, false };
	uint8_t op = embd_rbuf_u8(&r);
	uint32_t timeout_ms = embd_rbuf_u32(&r);
	uint32_t n = op == EMBD_STORE_OP_WAIT ? embd_rbuf_u16(&r) : 1;
	char missing[384];
	size_t missing_len = 0;
	uint32_t num_missing = 0;
	struct entry *last = NULL;

	missing[0] = '\0';
	for (uint32_t i = 0; i < n; i++) {
		size_t len = 0;
		const char *key = embd_rbuf_key(&r, &len);
		last = entry_find(s, key, len);
		if (last)
			continue;
		if (!expired)
			return;
		num_missing++;
		if (missing_len + 8 < sizeof(missing)) {
			int w = snprintf(missing + missing_len, sizeof(missing) - missing_len,
					 "%s'%.*s'", num_missing > 1 ? ", " : "", (int)len, key);
			missing_len += w > 0 ? (size_t)w : 0;
			if (missing_len >= sizeof(missing))
				missing_len = sizeof(missing) - 1;
		}
	}
	if (num_missing)
		respond_error(c, EMBD_ETIMEDOUT, "timed out after %" PRIu32 " ms waiting for %s",
			      timeout_ms, missing);
	else if (op == EMBD_STORE_OP_GET)
		respond(c, 0, last->value, last->value_len);
	else
		respond(c, 0, NULL, 0);
	free(c->parked);
	c->parked = NULL;
}

static void parked_wake_all(struct embd_store_server *s)
{
	for (size_t i = 0; i < s->num_conns; i++)
		if (s->conns[i]->parked && !s->conns[i]->dead)
			parked_try(s, s->conns[i], false);
}

/* ---- requests -------------------------------------------------------------------------- */

static int park(struct embd_store_server *s, struct conn *c, const uint8_t *body, size_t len,
		uint32_t timeout_ms)
{
	c->parked = malloc(len);
	if (!c->parked)
		return EMBD_ENOMEM;
	memcpy(c->parked, body, len);
	c->parked_len = len;
	c->deadline_ms = (uint64_t)embd_now_ms() + timeout_ms;
	parked_try(s, c, timeout_ms == 0);
	return 0;
}

static void handle_add(struct embd_store_server *s, struct conn *c, const char *key,
		       size_t len, int64_t delta)
{
	int64_t value = 0;
	struct entry *e = entry_find(s, key, len);
	if (e) {
		char text[32];
		char *end = NULL;
		if (e->value_len == 0 || e->value_len >= sizeof(text)) {
			respond_error(c, EMBD_EINVAL, "the value is not an integer");
			return;
		}
		memcpy(text, e->value, e->value_len);
		text[e->value_len] = '\0';
		errno = 0;
		long long v = strtoll(text, &end, 10);
		if (errno || end != text + e->value_len || end == text) {
			respond_error(c, EMBD_EINVAL, "the value is not an integer");
			return;
		}
		value = v;
	}
	if (__builtin_add_overflow(value, delta, &value)) {
		respond_error(c, EMBD_ERANGE, "the counter overflows");
		return;
	}
	char text[32];
	int n = snprintf(text, sizeof(text), "%" PRId64, value);
	if (entry_set(s, key, len, text, (size_t)n) < 0) {
		respond_error(c, EMBD_ENOMEM, "server out of memory");
		return;
	}
	uint8_t be[8];
	embd_wire_put_u64(be, (uint64_t)value);
	respond(c, 0, be, sizeof(be));
	parked_wake_all(s);
}

/* Handles one request body: answers it or parks it; returns what is malformed, or NULL. */
static const char *handle_request(struct embd_store_server *s, struct conn *c,
				  const uint8_t *body, size_t body_len)
{
	struct embd_rbuf r = { body, body_len, false };
	uint8_t op = embd_rbuf_u8(&r);
	size_t len = 0;
	const char *key;

	switch (op) {
	case EMBD_STORE_OP_SET: {
		key = embd_rbuf_key(&r, &len);
		uint32_t value_len = embd_rbuf_u32(&r);
		const uint8_t *value = embd_rbuf_take(&r, value_len);
		if (r.bad || r.left)
			return "malformed SET";
		if (entry_set(s, key, len, value, value_len) < 0) {
			respond_error(c, EMBD_ENOMEM, "server out of memory");
			return NULL;
		}
		respond(c, 0, NULL, 0);
		parked_wake_all(s);
		return NULL;
	}
	case EMBD_STORE_OP_GET:
	case EMBD_STORE_OP_WAIT: {
		uint32_t timeout_ms = embd_rbuf_u32(&r);
		uint32_t n = op == EMBD_STORE_OP_WAIT ? embd_rbuf_u16(&r) : 1;
		if (n > EMBD_STORE_WAIT_KEYS_MAX)
			return "too many keys in WAIT";
		for (uint32_t i = 0; i < n && !r.bad; i++)
			embd_rbuf_key(&r, &len);
		if (r.bad || r.left)
			return op == EMBD_STORE_OP_GET ? "malformed GET" : "malformed WAIT";
		if (park(s, c, body, body_len, timeout_ms) < 0)
			respond_error(c, EMBD_ENOMEM, "server out of memory");
		return NULL;
	}
	case EMBD_STORE_OP_ADD: {
		key = embd_rbuf_key(&r, &len);
		int64_t delta = (int64_t)embd_rbuf_u64(&r);
		if (r.bad || r.left)
			return "malformed ADD";
		handle_add(s, c, key, len, delta);
		return NULL;
	}
	case EMBD_STORE_OP_CHECK:
	case EMBD_STORE_OP_DELETE: {
		key = embd_rbuf_key(&r, &len);
		if (r.bad || r.left)
			return op == EMBD_STORE_OP_CHECK ? "malformed CHECK" : "malformed DELETE";
		struct entry **slot = entry_slot(s, key, len);
		if (op == EMBD_STORE_OP_CHECK) {
			uint8_t exists = *slot != NULL;
			respond(c, 0, &exists, 1);
		} else if (!*slot) {
			respond_error(c, EMBD_ENOENT, "no such key");
		} else {
			struct entry *e = *slot;
			*slot = e->next;
			free(e->value);
			free(e);
			respond(c, 0, NULL, 0);
		}
		return NULL;
	}
	default:
		return "unknown op";
	}
}

/* ---- connections ----------------------------------------------------------------------- */

/* Handles every complete frame in c->in while no request is parked. */
static void conn_handle_frames(struct embd_store_server *s, struct conn *c)
{
	size_t off = 0;
	while (!c->parked && !c->closing && !c->dead &&
	       c->in_len - off >= EMBD_STORE_HEADER_BYTES) {
		uint32_t body_len = embd_wire_get_u32(c->in + off);
		if (body_len == 0 || body_len > EMBD_STORE_BODY_MAX) {
			protocol_error(c, "frame length out of range");
			break;
		}
		if (c->in_len - off - EMBD_STORE_HEADER_BYTES < body_len)
			break;
		const char *bad = handle_request(s, c, c->in + off + EMBD_STORE_HEADER_BYTES,
						 body_len);
		if (bad)
			protocol_error(c, bad);
		off += EMBD_STORE_HEADER_BYTES + body_len;
	}
	if (off) {
		memmove(c->in, c->in + off, c->in_len - off);
		c->in_len -= off;
	}
}

/* Bytes c->in must hold for the frame at its start (header first). */
static size_t conn_need(const struct conn *c)
{
	if (c->in_len < EMBD_STORE_HEADER_BYTES)
		return EMBD_STORE_HEADER_BYTES;
	uint32_t body_len = embd_wire_get_u32(c->in);
	if (body_len > EMBD_STORE_BODY_MAX)
		body_len = 0;   /* conn_handle_frames rejects it */
	return EMBD_STORE_HEADER_BYTES + body_len;
}

static void conn_read(struct embd_store_server *s, struct conn *c)
{
	while (!c->parked && !c->closing && !c->dead) {
		size_t want = conn_need(c);
		if (want < c->in_len + READ_CHUNK_BYTES)
			want = c->in_len + READ_CHUNK_BYTES;
		if (want > c->in_cap) {
			uint8_t *in = realloc(c->in, want);
			if (!in) {
				c->dead = true;
				return;
			}
			c->in = in;
			c->in_cap = want;
		}
		ssize_t n = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (n <= 0) {   /* EOF, possibly mid-frame, or a reset: forget this client */
			c->dead = true;
			return;
		}
		c->in_len += (size_t)n;
		conn_handle_frames(s, c);
	}
}

static void conn_flush(struct conn *c)
{
	while (c->out_off < c->out.len) {
		ssize_t n = send(c->fd, c->out.data + c->out_off, c->out.len - c->out_off,
				 MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (n < 0) {
			c->dead = true;
			return;
		}
		c->out_off += (size_t)n;
	}
	c->out.len = c->out_off = 0;
	if (c->closing)
		c->dead = true;
}

static void conn_free(struct conn *c)
{
	close(c->fd);
	free(c->in);
	free(c->out.data);
	free(c->parked);
	free(c);
}

static void accept_all(struct embd_store_server *s)
{
	for (;;) {
		int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE)
				usleep(10000);  /* out of descriptors: let others close first */
			return;
		}
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		if (s->num_conns == s->cap_conns) {
			size_t cap = s->cap_conns ? 2 * s->cap_conns : 16;
			struct conn **conns = realloc(s->conns, cap * sizeof(*conns));
			if (!conns) {
				close(fd);
				return;
			}
			s->conns = conns;
			s->cap_conns = cap;
		}
		struct conn *c = calloc(1, sizeof(*c));
		if (!c) {
			close(fd);
			return;
		}
		c->fd = fd;
		s->conns[s->num_conns++] = c;
	}
}

/* ---- the loop -------------------------------------------------------------------------- */

static int poll_timeout_ms(const struct embd_store_server *s, uint64_t now)
{
	int64_t best = -1;
	for (size_t i = 0; i < s->num_conns; i++) {
		const struct conn *c = s->conns[i];
		if (!c->parked)
			continue;
		int64_t left = c->deadline_ms > now ? (int64_t)(c->deadline_ms - now) : 0;
		if (best < 0 || left < best)
			best = left;
	}
	return best > INT32_MAX ? INT32_MAX : (int)best;
}

static void *server_main(void *arg)
{
	struct embd_store_server *s = arg;
	for (;;) {
		size_t n = s->num_conns;
		if (n + 2 > s->cap_pfds) {
			struct pollfd *p = realloc(s->pfds, (n + 2) * 2 * sizeof(*p));
			if (!p) {
				usleep(10000);
				continue;
			}
			s->pfds = p;
			s->cap_pfds = (n + 2) * 2;
		}
		s->pfds[0] = (struct pollfd){ .fd = s->wake_fd, .events = POLLIN };
		s->pfds[1] = (struct pollfd){ .fd = s->listen_fd, .events = POLLIN };
		for (size_t i = 0; i < n; i++) {
			struct conn *c = s->conns[i];
			short ev = POLLRDHUP;
			if (!c->parked && !c->closing)
				ev |= POLLIN;
			if (c->out_off < c->out.len)
				ev |= POLLOUT;
			s->pfds[i + 2] = (struct pollfd){ .fd = c->fd, .events = ev };
		}
		int rc = poll(s->pfds, n + 2, poll_timeout_ms(s, (uint64_t)embd_now_ms()));
		if (rc < 0 && errno != EINTR)
			usleep(1000);
		if (rc > 0 && (s->pfds[0].revents & POLLIN))
			break;
		for (size_t i = 0; rc > 0 && i < n; i++) {
			struct conn *c = s->conns[i];
			short re = s->pfds[i + 2].revents;
			if (re & (POLLERR | POLLNVAL))
				c->dead = true;
			if (re & (POLLIN | POLLHUP))
				conn_read(s, c);        /* reads EOF too */
			if ((re & (POLLRDHUP | POLLHUP)) && (c->parked || c->closing))
				c->dead = true;         /* hung up while not being read */
		}
		uint64_t now = (uint64_t)embd_now_ms();
		for (size_t i = 0; i < s->num_conns; i++) {
			struct conn *c = s->conns[i];
			if (c->parked && !c->dead && c->deadline_ms <= now)
				parked_try(s, c, true);
			/* an answered park lets the next buffered request run */
			if (!c->parked && !c->dead)
				conn_handle_frames(s, c);
			if (!c->dead && c->out_off < c->out.len)
				conn_flush(c);
		}
		size_t kept = 0;
		for (size_t i = 0; i < s->num_conns; i++) {
			if (s->conns[i]->dead)
				conn_free(s->conns[i]);
			else
				s->conns[kept++] = s->conns[i];
		}
		s->num_conns = kept;
		if (rc > 0 && (s->pfds[1].revents & POLLIN))
			accept_all(s);
	}
	return NULL;
}

/* ---- start / stop ---------------------------------------------------------------------- */

static int listen_on(const char *addr, uint16_t port, int *fd_out, uint16_t *port_out,
		     char *err, size_t err_len)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
	struct addrinfo *res = NULL;
	char service[8];
	const char *host = (!addr || !*addr || strcmp(addr, "0.0.0.0") == 0) ? NULL : addr;
	int last_errno = 0;

	if (!host)
		hints.ai_family = AF_INET;
	snprintf(service, sizeof(service), "%u", port);
	int gai = getaddrinfo(host, service, &hints, &res);
	if (gai) {
		snprintf(err, err_len, "store server %s:%u: cannot resolve: %s",
			 host ? host : "0.0.0.0", port, gai_strerror(gai));
		return EMBD_EINVAL;
	}
	for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
		int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
				ai->ai_protocol);
		if (fd < 0) {
			last_errno = errno;
			continue;
		}
		int one = 1;
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		struct sockaddr_storage bound;
		socklen_t bound_len = sizeof(bound);
		if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0 ||
		    getsockname(fd, (struct sockaddr *)&bound, &bound_len) < 0) {
			last_errno = errno;
			close(fd);
			continue;
		}
		*port_out = ntohs(bound.ss_family == AF_INET6
					  ? ((struct sockaddr_in6 *)&bound)->sin6_port
					  : ((struct sockaddr_in *)&bound)->sin_port);
		*fd_out = fd;
		freeaddrinfo(res);
		return 0;
	}
	freeaddrinfo(res);
	snprintf(err, err_len, "store server %s:%u: cannot listen: %s", host ? host : "0.0.0.0",
		 port, strerror(last_errno));
	return last_errno == EADDRINUSE ? EMBD_EBUSY : EMBD_EIO;
}

int embd_store_server_start(const char *addr, uint16_t port, struct embd_store_server **out,
			    char *err, size_t err_len)
{
	int rc;

	if (err_len)
		err[0] = '\0';
	*out = NULL;
	struct embd_store_server *s = calloc(1, sizeof(*s));
	if (!s) {
		snprintf(err, err_len, "store server: out of memory");
		return EMBD_ENOMEM;
	}
	s->listen_fd = s->wake_fd = -1;
	rc = listen_on(addr, port, &s->listen_fd, &s->port, err, err_len);
	if (rc < 0)
		goto out;
	s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (s->wake_fd < 0) {
		snprintf(err, err_len, "store server: eventfd: %s", strerror(errno));
		rc = EMBD_EIO;
		goto out;
	}
	int perr = pthread_create(&s->thread, NULL, server_main, s);
	if (perr) {
		snprintf(err, err_len, "store server: cannot start its thread: %s", strerror(perr));
		rc = EMBD_ENOMEM;
		goto out;
	}
	*out = s;
	return 0;
out:
	if (s->wake_fd >= 0)
		close(s->wake_fd);
	if (s->listen_fd >= 0)
		close(s->listen_fd);
	free(s);
	return rc;
}

uint16_t embd_store_server_port(const struct embd_store_server *server)
{
	return server->port;
}

void embd_store_server_stop(struct embd_store_server *s)
{
	if (!s)
		return;
	uint64_t one = 1;
	while (write(s->wake_fd, &one, sizeof(one)) < 0 && errno == EINTR)
		;
	pthread_join(s->thread, NULL);
	for (size_t i = 0; i < s->num_conns; i++)
		conn_free(s->conns[i]);
	free(s->conns);
	free(s->pfds);
	table_free(s);
	close(s->wake_fd);
	close(s->listen_fd);
	free(s);
}
