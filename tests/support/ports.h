/*
 * tests/support/ports.h - a TCP port for a test's server (a store, a cluster's MASTER_PORT):
 * one the kernel handed out a moment ago, since fixed ranges collide with the ephemeral ports
 * Gloo's pairs and parallel tests hold. Someone may take it before the test binds it: each
 * test that uses one for a server retries with another (dist_fixture.h's node0_lost_port, the
 * store's and the rendezvous' tests).
 */
#ifndef EMBD_TEST_PORTS_H
#define EMBD_TEST_PORTS_H

#include <stdint.h>

/* A TCP port that was free on 127.0.0.1 (bound to port 0, read back, closed); fails the test
 * when no socket can be bound. */
uint16_t tu_free_port(void);

#endif /* EMBD_TEST_PORTS_H */
