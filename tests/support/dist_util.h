/*
 * tests/support/dist_util.h - helpers of the multi-process tests of the distribution layer
 * (store, comm, rendezvous): run a function in forked children and collect their exit codes
 * with a deadline, so a hang is a failure with a message and never a stuck test binary.
 *
 * A child reports a failure with TU_CHECK: it prints what it expected and what it got on
 * stderr and returns 1 from the child function, which becomes the child's exit status.
 */
#ifndef EMBD_TEST_DIST_UTIL_H
#define EMBD_TEST_DIST_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

struct embd_store_server;

#define TU_CHECK(cond, ...)                                                                \
	do {                                                                               \
		if (!(cond)) {                                                             \
			fprintf(stderr, "[child %d] %s:%d: %s: ", (int)getpid(), __FILE__,  \
				__LINE__, #cond);                                          \
			fprintf(stderr, __VA_ARGS__);                                      \
			fputc('\n', stderr);                                               \
			return 1;                                                          \
		}                                                                          \
	} while (0)

#define TU_HUNG (-1)            /* tu_join's code for a child killed at the deadline */

typedef int (*tu_child_fn)(int index, void *arg);

/* Forks a child that runs fn(index, arg) and _exits with its return value. */
pid_t tu_spawn(tu_child_fn fn, int index, void *arg);
/*
 * Forks n children running fn(0..n-1, arg) into pids[n]; they start together once all are
 * forked. Fork a batch of children this way rather than one by one: forking while earlier
 * children keep the test's store-server thread busy can deadlock a sanitizer build's child
 * (its allocator lock held by that thread at the fork).
 */
void tu_spawn_n(tu_child_fn fn, int n, void *arg, pid_t *pids);
/*
 * Waits for n children until timeout_ms; codes[i] gets the exit status, 128 + signal for a
 * signalled child, or TU_HUNG for one still running at the deadline (it is SIGKILLed).
 * Returns how many children did not exit with 0.
 */
int tu_join(const pid_t *pids, int n, int timeout_ms, int *codes);

/* A store server on 127.0.0.1 at a free port, as a Criterion .init/.fini pair: children
 * forked by the test connect to tu_port. */
extern struct embd_store_server *tu_server;
extern uint16_t tu_port;
void tu_server_start(void);
void tu_server_stop(void);
/*
 * The same server in a process of its own, so the test process has no thread when it forks
 * its children: gcc 12's ASan allocator has no fork handlers, and a child forked while
 * another thread held its lock hangs (seen as rare test_comm_gloo hangs under ctest).
 */
void tu_server_process_start(void);
void tu_server_process_stop(void);

#endif /* EMBD_TEST_DIST_UTIL_H */
