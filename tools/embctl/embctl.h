/*
 * embctl: the operator's command line. One subcommand per file, each an entry of the table
 * in embctl.c; each returns a process exit code (0 ok, 1 the operation failed, 2 usage).
 */
#ifndef EMBCTL_H
#define EMBCTL_H

#include <stdint.h>

#include "ipc/control.h"

#define EMBCTL_DEFAULT_SOCKET "/run/embd/embd.sock"

struct embctl_command {
	const char *name;
	const char *summary;
	int (*run)(int argc, char **argv);
};

int embctl_plan(int argc, char **argv);
int embctl_stats(int argc, char **argv);
int embctl_status(int argc, char **argv);
int embctl_checkpoint(int argc, char **argv);
int embctl_export(int argc, char **argv);
int embctl_import(int argc, char **argv);

/* The number of a flag's argument, parsed strictly: only decimal digits, within [min, max]
 * (no sign, no spaces, no trailing text). 0, or 2 (usage) with why printed naming the flag. */
int embctl_number(const char *flag, const char *text, uint64_t min, uint64_t max, uint64_t *out);

/* Sends one request (payload of len bytes) and waits up to timeout_ms for its reply, whose
 * text goes to *text (malloc'ed; the caller frees it even on failure). 0, or 1 with the
 * error printed. */
int embctl_ask(const char *socket_path, enum embd_ctl_type request, const void *payload,
	       uint32_t len, int timeout_ms, char **text);

#endif
