/*
 * Fuzz target for the rendezvous store's wire protocol (dist/store_wire.h): bytes = what one
 * peer sends on one connection to a real store server (started once, on a thread of this
 * process, on a loopback port). The server must answer or close that connection and keep
 * serving: after every input a fresh client does a SET/GET round trip through the public API.
 * Reads of the fuzzed connection are bounded (a parked GET/WAIT may hold it for its timeout).
 */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dist/store.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct embd_store_server *server;
static uint16_t port;

static void start_server(void)
{
	char err[256] = "";
	if (embd_store_server_start("127.0.0.1", 0, &server, err, sizeof(err)) < 0) {
		fprintf(stderr, "fuzz_store: store server: %s\n", err);
		abort();
	}
	port = embd_store_server_port(server);
}

/* Sends data on a raw connection, then drains answers for at most ~20 ms. */
static void send_raw(const uint8_t *data, size_t size)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0)
		abort();        /* the server stopped accepting: that is the bug to find */
	for (size_t at = 0; at < size;) {
		ssize_t n = send(fd, data + at, size - at, MSG_NOSIGNAL);
		if (n <= 0)
			break;  /* the server closed it after a protocol error */
		at += (size_t)n;
	}
	char buf[4096];
	for (int rounds = 0; rounds < 4; rounds++) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (poll(&p, 1, 5) <= 0 || recv(fd, buf, sizeof(buf), 0) <= 0)
			break;
	}
	close(fd);
}

/* The server still serves a well-behaved client. */
static void check_alive(void)
{
	char err[256] = "";
	struct embd_store *s = NULL;
	void *value = NULL;
	size_t len = 0;

	if (embd_store_connect("127.0.0.1", port, 2000, &s, err, sizeof(err)) < 0 ||
	    embd_store_set(s, "fuzz/alive", "1", 1) < 0 ||
	    embd_store_get(s, "fuzz/alive", &value, &len) < 0 || len != 1 ||
	    memcmp(value, "1", 1) != 0) {
		fprintf(stderr, "fuzz_store: the server stopped serving: %s %s\n", err,
			s ? embd_store_error(s) : "");
		abort();
	}
	free(value);
	embd_store_close(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (!server)
		start_server();
	send_raw(data, size);
	check_alive();
	return 0;
}
