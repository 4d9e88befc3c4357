/*
 * tests/support/children.h - the processes a test forks (trainers, embctl runs) remembered so
 * that its Criterion fini can SIGKILL whatever still runs after a failed assertion: no child
 * outlives its test. A process that is not this one's child (a trainer's grandchild holding
 * its socket) can be remembered too; it is killed but not reaped.
 */
#ifndef EMBD_TEST_CHILDREN_H
#define EMBD_TEST_CHILDREN_H

#include <sys/types.h>

/* fork(), the child remembered in the parent; fails the test when fork does. */
pid_t tu_fork_child(void);
/* Remembers pid, not a child of this process, to be SIGKILLed by tu_kill_children. */
void tu_track_process(pid_t pid);
/* SIGKILLs a child now, reaps it and forgets it. */
void tu_kill_child(pid_t pid);
/* SIGKILLs and reaps every remembered child still running (a child the test reaped itself is
 * left alone), SIGKILLs every remembered non-child, and forgets them all. */
void tu_kill_children(void);

#endif /* EMBD_TEST_CHILDREN_H */
