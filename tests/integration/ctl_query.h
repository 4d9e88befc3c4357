/*
 * tests/integration/ctl_query.h - a STATS or STATUS reply of the embd at a socket, as
 * `embctl stats` / `embctl status` get it (daemon/stats.h says what is in it), for the suites
 * that check a counter.
 */
#ifndef EMBD_TESTS_CTL_QUERY_H
#define EMBD_TESTS_CTL_QUERY_H

#include <cjson/cJSON.h>
#include <stdint.h>
#include <unistd.h>

#include "ipc/control.h"

/* The reply to request (EMBD_CTL_STATS_REQUEST or EMBD_CTL_STATUS_REQUEST), parsed; NULL on
 * failure. The caller deletes it. */
static inline cJSON *ctl_ask_json(const char *socket, enum embd_ctl_type request)
{
	static uint8_t buf[EMBD_CTL_MSG_MAX];
	static char text[EMBD_CTL_TEXT_MAX * 16];
	struct embd_ctl_msg msg;
	int sock;

	if (embd_ctl_connect(socket, &sock, NULL, 0))
		return NULL;
	cJSON *root = NULL;
	if (!embd_ctl_send(sock, request, NULL, 0, NULL, 0, NULL, 0) &&
	    !embd_ctl_recv(sock, buf, sizeof(buf), 5000, &msg, NULL, 0) &&
	    msg.type == request + 1 && !embd_ctl_text_decode(&msg, text, sizeof(text), NULL, 0))
		root = cJSON_Parse(text);
	close(sock);
	return root;
}

/* The number under key of o, or -1 when there is none. */
static inline double ctl_json_num(const cJSON *o, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);

	return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

#endif /* EMBD_TESTS_CTL_QUERY_H */
