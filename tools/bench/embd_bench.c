/*
 * embd-bench: runs one named benchmark. `embd-bench NAME [args]`; `embd-bench` alone lists
 * them. Benchmarks are tools, not tests: they print JSON lines and never fail on a figure.
 */
#include "bench.h"

#include <stdio.h>
#include <string.h>

static const struct bench_command commands[] = {
	{ "planner", "plan time and plan quality at 100 to 10,000 tables", bench_planner_run },
	{ "kernels", "CPU embedding kernels vs the memory limits and FBGEMM", bench_kernels_run },
	{ "ipc", "NOP round trip through embd vs thread ping-pongs", bench_ipc_run },
	{ "e2e", "forward+backward steps/s through embd vs in-process kernels", bench_e2e_run },
	{ "checkpoint", "checkpoint write speed and step stall vs the disk's dd speed",
	  bench_checkpoint_run },
	{ "dist", "steps/s of every sharding type on 1-3 nodes vs raw gloo alltoallv", bench_dist_run },
	{ "train", "Python trainers' steps/s through embd vs TorchRec's sharded EBC", bench_train_run },
	{ NULL, NULL, NULL },
};

static void usage(FILE *out)
{
	fprintf(out, "usage: embd-bench NAME [args]\n\nbenchmarks:\n");
	for (const struct bench_command *c = commands; c->name; c++)
		fprintf(out, "  %-12s %s\n", c->name, c->summary);
}

int main(int argc, char **argv)
{
	if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
		usage(argc < 2 ? stderr : stdout);
		return argc < 2 ? 2 : 0;
	}
	for (const struct bench_command *c = commands; c->name; c++)
		if (!strcmp(c->name, argv[1]))
			return c->run(argc - 1, argv + 1);
	fprintf(stderr, "embd-bench: no benchmark named '%s'\n", argv[1]);
	usage(stderr);
	return 2;
}
