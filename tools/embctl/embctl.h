/*
 * embctl: the operator's command line. One subcommand per file, each an entry of the table
 * in embctl.c; each returns a process exit code (0 ok, 1 the operation failed, 2 usage).
 */
#ifndef EMBCTL_H
#define EMBCTL_H

struct embctl_command {
	const char *name;
	const char *summary;
	int (*run)(int argc, char **argv);
};

int embctl_plan(int argc, char **argv);
int embctl_stats(int argc, char **argv);
int embctl_status(int argc, char **argv);

#endif
