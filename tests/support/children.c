/* tests/support/children.c - a test's forked processes, killed at its end (children.h). */
#include "tests/support/children.h"

#include <criterion/criterion.h>

#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_REMEMBERED 64

static struct {
	pid_t pid;
	bool foreign;                   /* not this process's child: kill, never wait */
} remembered[MAX_REMEMBERED];
static unsigned num_remembered;

static void remember(pid_t pid, bool foreign)
{
	cr_assert_lt(num_remembered, MAX_REMEMBERED, "more than %d processes to kill at the end "
		     "of the test", MAX_REMEMBERED);
	remembered[num_remembered].pid = pid;
	remembered[num_remembered++].foreign = foreign;
}

pid_t tu_fork_child(void)
{
	pid_t pid = fork();

	cr_assert(pid >= 0, "fork: %s", strerror(errno));
	if (pid > 0)
		remember(pid, false);
	return pid;
}

void tu_track_process(pid_t pid)
{
	remember(pid, true);
}

void tu_kill_child(pid_t pid)
{
	int status;

	kill(pid, SIGKILL);
	waitpid(pid, &status, 0);
	for (unsigned i = 0; i < num_remembered; i++)
		if (remembered[i].pid == pid)
			remembered[i] = remembered[--num_remembered];
}

void tu_kill_children(void)
{
	int status;

	for (unsigned i = 0; i < num_remembered; i++) {
		pid_t pid = remembered[i].pid;
		if (remembered[i].foreign) {
			kill(pid, SIGKILL);
		} else if (waitpid(pid, &status, WNOHANG) == 0) {
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
		}
	}
	num_remembered = 0;
}
