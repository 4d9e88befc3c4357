/*
 * dist/store.c - the rendezvous store's client (dist/store.h): one TCP connection to the
 * server, one request and its response at a time (protocol: dist/store_wire.h).
 *
 * Timeouts: a GET or WAIT carries its timeout to the server, which parks it and answers
 * EMBD_ETIMEDOUT when it expires, so the connection stays in step. The client itself waits
 * that long plus REPLY_SLACK_MS for any answer; a server that says nothing by then (or closes,
 * or sends garbage) leaves the stream in an unknown state, so the handle closes its socket and
 * every later call fails with EMBD_ECONNRESET.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dist/store_wire.h"
#include "common/clock.h"

#define REPLY_SLACK_MS 2000
#define RETRY_MIN_MS 10
#define RETRY_MAX_MS 200

struct embd_store {
	int fd;
	int timeout_ms;
	char where[300];                /* "addr:port" for messages */
	char host[256];                 /* to connect again (embd_store_reconnect) */
	uint16_t port;
	char err[512];
	uint8_t *reply;                 /* body of the last response */
	size_t reply_len, reply_cap;
};

static int ms_left(int64_t deadline)
{
	int64_t left = deadline - embd_now_ms();
	return left <= 0 ? 0 : left > INT32_MAX ? INT32_MAX : (int)left;
}

static int vfail(struct embd_store *s, int rc, const char *fmt, va_list ap)
{
	int n = snprintf(s->err, sizeof(s->err), "store %s: ", s->where);
	if (n >= 0 && (size_t)n < sizeof(s->err))
		vsnprintf(s->err + n, sizeof(s->err) - (size_t)n, fmt, ap);
	return rc;
}

__attribute__((format(printf, 3, 4)))
static int fail(struct embd_store *s, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfail(s, rc, fmt, ap);
	va_end(ap);
	return rc;
}

/* A transport failure: the stream can no longer be trusted, so the handle stops using it. */
__attribute__((format(printf, 3, 4)))
static int broken(struct embd_store *s, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfail(s, rc, fmt, ap);
	va_end(ap);
	if (s->fd >= 0)
		close(s->fd);
	s->fd = -1;
	return rc;
}

/* ---- connect --------------------------------------------------------------------------- */

/* One attempt at every address of res; 0 and s->fd set, or the last errno. */
static int try_connect(struct embd_store *s, struct addrinfo *res, int64_t deadline)
{
	int last = ECONNREFUSED;
	for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
		int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
				ai->ai_protocol);
		if (fd < 0) {
			last = errno;
			continue;
		}
		int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
		if (rc < 0 && errno == EINPROGRESS) {
			struct pollfd p = { .fd = fd, .events = POLLOUT };
			int wait = ms_left(deadline);
			if (wait < RETRY_MAX_MS)
				wait = RETRY_MAX_MS;    /* a last attempt still gets its handshake */
			rc = poll(&p, 1, wait);
			int soerr = 0;
			socklen_t len = sizeof(soerr);
			if (rc == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 &&
			    soerr == 0)
				rc = 0;
			else {
				errno = rc == 0 ? ETIMEDOUT : soerr ? soerr : errno;
				rc = -1;
			}
		}
		if (rc == 0) {
			int one = 1;
			setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
			s->fd = fd;
			return 0;
		}
		last = errno;
		close(fd);
	}
	return last;
}

/* Connects s to s->host:s->port, retrying until timeout_ms; 0 or EMBD_ETIMEDOUT (s->err). */
static int connect_retrying(struct embd_store *s, int timeout_ms)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_NUMERICSERV };
	char service[8];
	snprintf(service, sizeof(service), "%u", s->port);
	int64_t deadline = embd_now_ms() + timeout_ms;
	int delay_ms = RETRY_MIN_MS;
	for (;;) {
		/* A name that does not resolve yet (DNS of a starting cluster) is retried too. */
		struct addrinfo *res = NULL;
		int gai = getaddrinfo(s->host, service, &hints, &res);
		int last = gai ? 0 : try_connect(s, res, deadline);
		if (res)
			freeaddrinfo(res);
		if (!gai && last == 0)
			return 0;
		if (ms_left(deadline) == 0)
			return fail(s, EMBD_ETIMEDOUT, "cannot connect within %d ms: %s", timeout_ms,
				    gai ? gai_strerror(gai) : strerror(last));
		int left = ms_left(deadline);
		usleep((useconds_t)(delay_ms < left ? delay_ms : left) * 1000u);
		delay_ms = delay_ms * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : delay_ms * 2;
	}
}

int embd_store_connect(const char *addr, uint16_t port, int timeout_ms,
		       struct embd_store **out, char *err, size_t err_len)
{
	if (err_len)
		err[0] = '\0';
	*out = NULL;
	struct embd_store *s = calloc(1, sizeof(*s));
	if (!s) {
		snprintf(err, err_len, "store: out of memory");
		return EMBD_ENOMEM;
	}
	s->fd = -1;
	s->timeout_ms = timeout_ms < 0 ? 0 : timeout_ms;
	snprintf(s->host, sizeof(s->host), "%s", addr && *addr ? addr : "127.0.0.1");
	s->port = port;
	snprintf(s->where, sizeof(s->where), "%s:%u", s->host, port);
	int rc = connect_retrying(s, s->timeout_ms);
	if (rc) {
		snprintf(err, err_len, "%s", s->err);
		free(s);
		return rc;
	}
	*out = s;
	return 0;
}

int embd_store_reconnect(struct embd_store *s, int timeout_ms)
{
	if (s->fd >= 0)
		return 0;
	return connect_retrying(s, timeout_ms < 0 ? 0 : timeout_ms);
}

void embd_store_close(struct embd_store *s)
{
	if (!s)
		return;
	if (s->fd >= 0)
		close(s->fd);
	free(s->reply);
	free(s);
}

void embd_store_set_timeout(struct embd_store *s, int timeout_ms)
{
	s->timeout_ms = timeout_ms < 0 ? 0 : timeout_ms;
}

int embd_store_server_addr(const struct embd_store *s, struct sockaddr_storage *out)
{
	socklen_t len = sizeof(*out);

	return s->fd >= 0 && !getpeername(s->fd, (struct sockaddr *)out, &len) ? 0 : EMBD_EIO;
}

const char *embd_store_error(const struct embd_store *s)
{
	return s->err;
}

/* ---- one request ----------------------------------------------------------------------- */

static int send_all(struct embd_store *s, const uint8_t *p, size_t len, int64_t deadline)
{
	while (len) {
		ssize_t n = send(s->fd, p, len, MSG_NOSIGNAL);
		if (n > 0) {
			p += n;
			len -= (size_t)n;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
			return broken(s, EMBD_ECONNRESET, "connection lost: %s", strerror(errno));
		struct pollfd pfd = { .fd = s->fd, .events = POLLOUT };
		if (poll(&pfd, 1, ms_left(deadline)) == 0)
			return broken(s, EMBD_ETIMEDOUT, "server did not take the request in time");
	}
	return 0;
}

static int recv_all(struct embd_store *s, uint8_t *p, size_t len, int64_t deadline)
{
	while (len) {
		ssize_t n = recv(s->fd, p, len, 0);
		if (n > 0) {
			p += n;
			len -= (size_t)n;
			continue;
		}
		if (n == 0)
			return broken(s, EMBD_ECONNRESET, "server closed the connection");
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			return broken(s, EMBD_ECONNRESET, "connection lost: %s", strerror(errno));
		struct pollfd pfd = { .fd = s->fd, .events = POLLIN };
		if (poll(&pfd, 1, ms_left(deadline)) == 0)
			return broken(s, EMBD_ETIMEDOUT, "no answer from the server in time");
	}
	return 0;
}

/*
 * Sends the request in req and reads the response into s->reply (the result after the
 * status). Returns the server's status (its message copied into s->err, prefixed with what)
 * or a transport error. wait_ms is how long the server may park the request.
 */
static int rpc(struct embd_store *s, struct embd_wbuf *req, int wait_ms, const char *what)
{
	if (req->failed)
		return fail(s, EMBD_ENOMEM, "%s: out of memory", what);
	if (s->fd < 0)
		return fail(s, EMBD_ECONNRESET, "%s: connection closed after an earlier error",
			    what);
	int64_t deadline = embd_now_ms() + (int64_t)wait_ms + REPLY_SLACK_MS;
	int rc = send_all(s, req->data, req->len, deadline);
	uint8_t header[EMBD_STORE_HEADER_BYTES + 4];
	if (rc == 0)
		rc = recv_all(s, header, sizeof(header), deadline);
	if (rc < 0)
		return rc;
	uint32_t body_len = embd_wire_get_u32(header);
	int32_t status = (int32_t)embd_wire_get_u32(header + EMBD_STORE_HEADER_BYTES);
	if (body_len < 4 || body_len > EMBD_STORE_BODY_MAX)
		return broken(s, EMBD_EPROTO, "%s: bad response length %u", what, body_len);
	s->reply_len = body_len - 4;
	if (s->reply_len > s->reply_cap) {
		uint8_t *p = realloc(s->reply, s->reply_len);
		if (!p)
			return broken(s, EMBD_ENOMEM, "%s: out of memory for a %zu-byte answer", what,
				      s->reply_len);
		s->reply = p;
		s->reply_cap = s->reply_len;
	}
	rc = recv_all(s, s->reply, s->reply_len, deadline);
	if (rc < 0)
		return rc;
	if (status > 0 || status < -0x7fff)
		return broken(s, EMBD_EPROTO, "%s: bad status %d", what, status);
	if (status < 0)
		return fail(s, status, "%s: %.*s", what, (int)(s->reply_len < 400 ? s->reply_len : 400),
			    (const char *)s->reply);
	s->err[0] = '\0';
	return 0;
}

/* Names the operation in what ("get 'key'") and checks the key's length. */
static int check_key(struct embd_store *s, const char *verb, const char *key, char *what,
		     size_t what_len)
{
	size_t len = key ? strlen(key) : 0;
	if (verb)
		snprintf(what, what_len, "%s '%s'", verb, key ? key : "");
	if (len == 0 || len > EMBD_STORE_KEY_MAX)
		return fail(s, EMBD_EINVAL, "%s: key of %zu bytes (1..%u allowed)", what, len,
			    EMBD_STORE_KEY_MAX);
	return 0;
}

/* Starts a request for op on key: frame header, op, optional u32 timeout, key. */
static size_t begin(struct embd_wbuf *b, enum embd_store_op op, const uint32_t *timeout_ms,
		    const char *key)
{
	size_t at = embd_wbuf_frame_begin(b);
	embd_wbuf_u8(b, (uint8_t)op);
	if (timeout_ms)
		embd_wbuf_u32(b, *timeout_ms);
	if (key)
		embd_wbuf_key(b, key, strlen(key));
	return at;
}

/* Runs the one-key request for op; what names it in messages ("get 'key'"). */
static int request(struct embd_store *s, struct embd_wbuf *b, size_t at, int wait_ms,
		   const char *what)
{
	embd_wbuf_frame_end(b, at);
	int rc = rpc(s, b, wait_ms, what);
	free(b->data);
	return rc;
}

/* ---- the operations -------------------------------------------------------------------- */

int embd_store_set(struct embd_store *s, const char *key, const void *value, size_t len)
{
	char what[EMBD_STORE_KEY_MAX + 16];
	int rc = check_key(s, "set", key, what, sizeof(what));
	if (rc < 0)
		return rc;
	if (len > EMBD_STORE_VALUE_MAX)
		return fail(s, EMBD_EINVAL, "%s: value of %zu bytes (at most %u)", what, len,
			    EMBD_STORE_VALUE_MAX);
	struct embd_wbuf b = { 0 };
	size_t at = begin(&b, EMBD_STORE_OP_SET, NULL, key);
	embd_wbuf_u32(&b, (uint32_t)len);
	embd_wbuf_put(&b, value, len);
	return request(s, &b, at, s->timeout_ms, what);
}

int embd_store_get(struct embd_store *s, const char *key, void **value, size_t *len)
{
	char what[EMBD_STORE_KEY_MAX + 16];
	*value = NULL;
	*len = 0;
	int rc = check_key(s, "get", key, what, sizeof(what));
	if (rc < 0)
		return rc;
	struct embd_wbuf b = { 0 };
	uint32_t timeout_ms = (uint32_t)s->timeout_ms;
	size_t at = begin(&b, EMBD_STORE_OP_GET, &timeout_ms, key);
	rc = request(s, &b, at, s->timeout_ms, what);
	if (rc < 0)
		return rc;
	void *copy = malloc(s->reply_len ? s->reply_len : 1);
	if (!copy)
		return fail(s, EMBD_ENOMEM, "%s: out of memory", what);
	if (s->reply_len)
		memcpy(copy, s->reply, s->reply_len);
	*value = copy;
	*len = s->reply_len;
	return 0;
}

int embd_store_add(struct embd_store *s, const char *key, int64_t delta, int64_t *out)
{
	char what[EMBD_STORE_KEY_MAX + 16];
	int rc = check_key(s, "add", key, what, sizeof(what));
	if (rc < 0)
		return rc;
	struct embd_wbuf b = { 0 };
	size_t at = begin(&b, EMBD_STORE_OP_ADD, NULL, key);
	embd_wbuf_u64(&b, (uint64_t)delta);
	rc = request(s, &b, at, s->timeout_ms, what);
	if (rc < 0)
		return rc;
	struct embd_rbuf r = { s->reply, s->reply_len, false };
	int64_t v = (int64_t)embd_rbuf_u64(&r);
	if (r.bad || r.left)
		return broken(s, EMBD_EPROTO, "%s: answer of %zu bytes", what, s->reply_len);
	if (out)
		*out = v;
	return 0;
}

int embd_store_wait(struct embd_store *s, const char *const *keys, size_t n)
{
	char what[EMBD_STORE_KEY_MAX + 32];
	if (n == 0)
		return 0;
	snprintf(what, sizeof(what), "wait (%zu keys)", n);
	if (n > EMBD_STORE_WAIT_KEYS_MAX)
		return fail(s, EMBD_EINVAL, "%s: %zu keys (at most %u)", what, n,
			    EMBD_STORE_WAIT_KEYS_MAX);
	for (size_t i = 0; i < n; i++) {
		int rc = check_key(s, NULL, keys[i], what, sizeof(what));
		if (rc < 0)
			return rc;
	}
	struct embd_wbuf b = { 0 };
	uint32_t timeout_ms = (uint32_t)s->timeout_ms;
	size_t at = begin(&b, EMBD_STORE_OP_WAIT, &timeout_ms, NULL);
	embd_wbuf_u16(&b, (uint16_t)n);
	for (size_t i = 0; i < n; i++)
		embd_wbuf_key(&b, keys[i], strlen(keys[i]));
	return request(s, &b, at, s->timeout_ms, what);
}

int embd_store_check(struct embd_store *s, const char *key)
{
	char what[EMBD_STORE_KEY_MAX + 16];
	int rc = check_key(s, "check", key, what, sizeof(what));
	if (rc < 0)
		return rc;
	struct embd_wbuf b = { 0 };
	size_t at = begin(&b, EMBD_STORE_OP_CHECK, NULL, key);
	rc = request(s, &b, at, s->timeout_ms, what);
	if (rc < 0)
		return rc;
	if (s->reply_len != 1 || s->reply[0] > 1)
		return broken(s, EMBD_EPROTO, "%s: bad answer", what);
	return s->reply[0];
}

int embd_store_delete(struct embd_store *s, const char *key)
{
	char what[EMBD_STORE_KEY_MAX + 16];
	int rc = check_key(s, "delete", key, what, sizeof(what));
	if (rc < 0)
		return rc;
	struct embd_wbuf b = { 0 };
	size_t at = begin(&b, EMBD_STORE_OP_DELETE, NULL, key);
	return request(s, &b, at, s->timeout_ms, what);
}
