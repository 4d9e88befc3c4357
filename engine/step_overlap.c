/*
 * The comm thread of a cluster node's step engine (engine/step.h,
 * embd_step_backward_overlapped): while the ranks apply step s's update, it runs the input
 * exchange (HELLO, INPUT) of step s + 1, which embd_step_prepare routed into the other
 * training pass. The caller's thread drives the apply and hands the trainers their backward
 * completions meanwhile, so they never wait for another node's next step (a trainer may have
 * to meet another node's trainers before that one posts its next FORWARD). The collectives
 * keep their order: the gradient exchange of step s is done before the thread starts, and
 * step s + 1's output exchange waits for it. The comm is used by one thread at a time: this
 * one between step_overlap_start and step_overlap_wait, the caller's otherwise.
 *
 * The thread is started at the first overlap and sleeps between them.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "engine/step_internal.h"

struct step_overlap {
	pthread_t thread;
	pthread_mutex_t mu;
	pthread_cond_t cv;              /* CLOCK_MONOTONIC */
	bool go, busy, stop;
};

/* The prepared step's input exchange, in train[cur ^ 1]. */
static void exchange_prepared(struct embd_step *s)
{
	s->pass = &s->train[s->cur ^ 1];
	s->cluster_ckpt = false;        /* its HELLO sets it */
	s->exchange_rc = step_dist_input(s, ROUND_TRAIN);
	s->exchanged = true;
	s->pass = train_pass(s);
}

static void *comm_main(void *arg)
{
	struct embd_step *s = arg;
	struct step_overlap *ov = s->overlap;

	pthread_mutex_lock(&ov->mu);
	for (;;) {
		while (!ov->go && !ov->stop)
			pthread_cond_wait(&ov->cv, &ov->mu);
		if (ov->stop)
			break;
		ov->go = false;
		pthread_mutex_unlock(&ov->mu);
		exchange_prepared(s);
		pthread_mutex_lock(&ov->mu);
		ov->busy = false;
		pthread_cond_broadcast(&ov->cv);
	}
	pthread_mutex_unlock(&ov->mu);
	return NULL;
}

/* The thread, at its first use; false (logged) when it cannot be had. */
static bool overlap_open(struct embd_step *s)
{
	struct step_overlap *ov;
	pthread_condattr_t ca;

	if (s->overlap)
		return true;
	ov = calloc(1, sizeof(*ov));
	if (!ov)
		return false;
	pthread_mutex_init(&ov->mu, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&ov->cv, &ca);
	pthread_condattr_destroy(&ca);
	s->overlap = ov;
	/* the caller's signal mask is inherited: the event loop's blocks every signal */
	int rc = pthread_create(&ov->thread, NULL, comm_main, s);
	if (rc) {
		embd_log_warning("step engine: no comm thread (%s): the next steps' exchanges follow "
				 "their step's backward", strerror(rc));
		s->overlap = NULL;
		pthread_cond_destroy(&ov->cv);
		pthread_mutex_destroy(&ov->mu);
		free(ov);
		return false;
	}
	return true;
}

bool step_overlap_start(struct embd_step *s)
{
	if (!overlap_open(s))
		return false;
	struct step_overlap *ov = s->overlap;
	pthread_mutex_lock(&ov->mu);
	ov->go = ov->busy = true;
	pthread_cond_broadcast(&ov->cv);
	pthread_mutex_unlock(&ov->mu);
	return true;
}

void step_overlap_wait(struct embd_step *s)
{
	struct step_overlap *ov = s->overlap;
	/* the exchange gives up after the comm's timeout (twice: HELLO, INPUT) and up to 1 s
	 * naming the node that did not answer; past that something is wrong: say so, and go on
	 * waiting, since the thread owns the comm and the other pass until it returns */
	const uint64_t t0 = embd_now_ns(), grace_ms = 2ull * step_dist_timeout_ms(s) + 2000;
	uint64_t next_ms = grace_ms;
	struct timespec at;

	pthread_mutex_lock(&ov->mu);
	while (ov->busy) {
		uint64_t due = t0 + next_ms * 1000000;
		at = (struct timespec){ (time_t)(due / 1000000000), (long)(due % 1000000000) };
		if (pthread_cond_timedwait(&ov->cv, &ov->mu, &at) != ETIMEDOUT)
			continue;
		embd_log_warning("step engine: waited %llu ms for the next step's input exchange "
				 "(size and id exchanges with the other nodes, on the comm thread; "
				 "collective_timeout_ms %d)", (unsigned long long)next_ms,
				 step_dist_timeout_ms(s));
		next_ms += 10000;
	}
	pthread_mutex_unlock(&ov->mu);
}

void step_overlap_destroy(struct embd_step *s)
{
	struct step_overlap *ov = s->overlap;

	if (!ov)
		return;
	pthread_mutex_lock(&ov->mu);
	ov->stop = true;
	pthread_cond_broadcast(&ov->cv);
	pthread_mutex_unlock(&ov->mu);
	pthread_join(ov->thread, NULL);
	pthread_cond_destroy(&ov->cv);
	pthread_mutex_destroy(&ov->mu);
	free(ov);
	s->overlap = NULL;
}
