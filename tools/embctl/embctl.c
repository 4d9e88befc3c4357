/*
 * embctl: runs one named subcommand (`embctl plan ...`); `embctl` alone lists them. Later
 * subcommands are one more entry in the table below.
 */
#include "embctl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct embctl_command commands[] = {
	{ "plan", "shard tables onto ranks, or --check an existing plan", embctl_plan },
	{ "stats", "live counters of a running embd (--json, --watch SECONDS)", embctl_stats },
	{ "status", "version, step, plan and config of a running embd (JSON)", embctl_status },
	{ "checkpoint", "take a checkpoint now (--wait: until it is on disk)", embctl_checkpoint },
	{ "export", "a table from a checkpoint directory to a .npy file (offline)", embctl_export },
	{ "import", ".npy files as initial weights: a checkpoint embd restores", embctl_import },
	{ NULL, NULL, NULL },
};

int embctl_number(const char *flag, const char *text, uint64_t min, uint64_t max, uint64_t *out)
{
	char *end = NULL;
	uint64_t v = 0;

	/* strtoull alone takes "-5" (as 2^64 - 5), " 5", "5x" and "" */
	errno = 0;
	if (text[0] >= '0' && text[0] <= '9')
		v = strtoull(text, &end, 10);
	if (!end || *end || errno || v < min || v > max) {
		fprintf(stderr, "embctl: %s: '%s' is not a whole number in [%" PRIu64 ", %" PRIu64
			"]\n", flag, text, min, max);
		return 2;
	}
	*out = v;
	return 0;
}

static void usage(FILE *out)
{
	fprintf(out, "usage: embctl COMMAND [args]   (embctl COMMAND --help for its flags)\n"
		     "       embctl --help | --version\n\n"
		     "commands:\n");
	for (const struct embctl_command *c = commands; c->name; c++)
		fprintf(out, "  %-12s %s\n", c->name, c->summary);
}

int main(int argc, char **argv)
{
	if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
		usage(argc < 2 ? stderr : stdout);
		return argc < 2 ? 2 : 0;
	}
	if (!strcmp(argv[1], "-V") || !strcmp(argv[1], "--version")) {
		printf("embctl %s\n", EMBD_VERSION);
		return 0;
	}
	for (const struct embctl_command *c = commands; c->name; c++)
		if (!strcmp(c->name, argv[1]))
			return c->run(argc - 1, argv + 1);
	fprintf(stderr, "embctl: no command named '%s'\n", argv[1]);
	usage(stderr);
	return 2;
}
