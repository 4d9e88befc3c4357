/*
 * embctl stats [--json] [--watch SECONDS] and embctl status: one STATS_REQUEST or
 * STATUS_REQUEST on the service's control socket, the JSON reply printed as it came
 * (--json, and always for status) or as a short human summary of the fields documented in
 * daemon/stats.h. --watch repeats every SECONDS until interrupted.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ipc/control.h"
#include "embctl.h"

#define REPLY_TIMEOUT_MS 5000

int embctl_send(const char *socket_path, enum embd_ctl_type request, const void *payload,
		uint32_t len, int *sock)
{
	char err[EMBD_CTL_TEXT_MAX + 64] = "";

	*sock = -1;
	if (embd_ctl_connect(socket_path, sock, err, sizeof(err)) ||
	    embd_ctl_send(*sock, request, payload, len, NULL, 0, err, sizeof(err))) {
		fprintf(stderr, "embctl: %s: %s\n", socket_path, err);
		if (*sock >= 0)
			close(*sock);
		*sock = -1;
		return 1;
	}
	return 0;
}

int embctl_reply(const char *socket_path, int sock, enum embd_ctl_type request, int timeout_ms,
		 char **text)
{
	char err[EMBD_CTL_TEXT_MAX + 64] = "", etext[EMBD_CTL_TEXT_MAX + 1];
	uint8_t *buf = malloc(EMBD_CTL_MSG_MAX);
	struct embd_ctl_msg msg = { .nfds = 0 };
	int rc = 1, code;

	*text = malloc(EMBD_CTL_MSG_MAX);
	if (!buf || !*text)
		goto out;
	if (embd_ctl_recv(sock, buf, EMBD_CTL_MSG_MAX, timeout_ms, &msg, err, sizeof(err)))
		goto out;
	if (msg.type == EMBD_CTL_ERROR) {
		if (!embd_ctl_error_decode(&msg, &code, etext, sizeof(etext), err, sizeof(err)))
			snprintf(err, sizeof(err), "service: %s (%s)", etext, embd_strerror(code));
		goto out;
	}
	if (msg.type != request + 1) {
		snprintf(err, sizeof(err), "unexpected reply type %u", msg.type);
		goto out;
	}
	rc = embd_ctl_text_decode(&msg, *text, EMBD_CTL_MSG_MAX, err, sizeof(err)) ? 1 : 0;
out:
	embd_ctl_msg_close_fds(&msg);
	if (rc)
		fprintf(stderr, "embctl: %s: %s\n", socket_path, err[0] ? err : "out of memory");
	close(sock);
	free(buf);
	return rc;
}

int embctl_ask(const char *socket_path, enum embd_ctl_type request, const void *payload,
	       uint32_t len, int timeout_ms, char **text)
{
	int sock;

	*text = NULL;
	if (embctl_send(socket_path, request, payload, len, &sock))
		return 1;
	return embctl_reply(socket_path, sock, request, timeout_ms, text);
}

static double num(const cJSON *o, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);

	return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

static void print_human(const cJSON *s)
{
	const cJSON *it;

	printf("uptime %.1f s  steps %.0f (aborted %.0f, timed out %.0f)\n", num(s, "uptime_s"),
	       num(s, "steps"), num(s, "aborted_steps"), num(s, "step_timeouts"));
	printf("lookups %.0f (%.1f/s)  ids %.0f (%.1f/s)  bytes in %.0f out %.0f sent %.0f\n",
	       num(s, "lookups"), num(s, "lookups_per_s"), num(s, "ids"), num(s, "ids_per_s"),
	       num(s, "bytes_in"), num(s, "bytes_out"), num(s, "sent_bytes"));
	printf("step p50 %.1f us p99 %.1f us  ipc p50 %.1f us p99 %.1f us\n", num(s, "step_p50_us"),
	       num(s, "step_p99_us"), num(s, "ipc_p50_us"), num(s, "ipc_p99_us"));
	const cJSON *ph = cJSON_GetObjectItemCaseSensitive(s, "step_phases_p50_us");
	if (cJSON_IsObject(ph))
		printf("step phases p50: forward %.1f us  trainers %.1f us  backward %.1f us\n",
		       num(ph, "forward"), num(ph, "trainers"), num(ph, "backward"));
	cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(s, "ranks"))
		printf("rank %.0f  numa node %.0f  memory %.0f bytes\n", num(it, "rank"),
		       num(it, "numa_node"), num(it, "memory_bytes"));
	cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(s, "tables")) {
		const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
		printf("table %s  lookups %.0f\n", cJSON_IsString(name) ? name->valuestring : "?",
		       num(it, "lookups"));
	}
	cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(s, "refusals"))
		if (cJSON_IsNumber(it))
			printf("refused %s %.0f\n", it->string, it->valuedouble);
	cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(s, "clients")) {
		printf("trainer %.0f  pid %.0f uid %.0f  sq %.0f/%.0f cq %.0f/%.0f  requests %.0f "
		       "errors %.0f", num(it, "index"), num(it, "pid"), num(it, "uid"),
		       num(it, "sq_used"), num(it, "sq_entries"), num(it, "cq_used"),
		       num(it, "cq_entries"), num(it, "requests"), num(it, "errors"));
		if (num(it, "stalling_ms") > 0)
			printf("  STALLS the step: waited for %.0f ms", num(it, "stalling_ms"));
		printf("\n");
	}
}

static int run(int argc, char **argv, enum embd_ctl_type request)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' }, { "json", no_argument, NULL, 'j' },
		{ "watch", required_argument, NULL, 'w' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *socket_path = EMBCTL_DEFAULT_SOCKET;
	int json = request == EMBD_CTL_STATUS_REQUEST, opt;
	uint64_t watch_s = 0;

	while ((opt = getopt_long(argc, argv, "s:jw:h", opts, NULL)) != -1) {
		switch (opt) {
		case 's': socket_path = optarg; break;
		case 'j': json = 1; break;
		case 'w': if (embctl_number("--watch", optarg, 1, 86400, &watch_s)) goto usage; break;
		default: goto usage;
		}
	}
	if (optind != argc || (request == EMBD_CTL_STATUS_REQUEST && watch_s))
		goto usage;
	for (;;) {
		char *text = NULL;
		int rc = embctl_ask(socket_path, request, NULL, 0, REPLY_TIMEOUT_MS, &text);
		if (!rc && json) {
			printf("%s\n", text);
		} else if (!rc) {
			cJSON *s = cJSON_Parse(text);
			rc = !s;
			if (s)
				print_human(s);
			else
				fprintf(stderr, "embctl: the service's stats are not JSON\n");
			cJSON_Delete(s);
		}
		free(text);
		fflush(stdout);
		if (rc || !watch_s)
			return rc;
		sleep((unsigned)watch_s);
	}
usage:
	fprintf(stderr, request == EMBD_CTL_STATS_REQUEST ?
		"usage: embctl stats [--socket PATH] [--json] [--watch SECONDS]\n" :
		"usage: embctl status [--socket PATH]\n");
	return 2;
}

int embctl_stats(int argc, char **argv)
{
	return run(argc, argv, EMBD_CTL_STATS_REQUEST);
}

int embctl_status(int argc, char **argv)
{
	return run(argc, argv, EMBD_CTL_STATUS_REQUEST);
}
