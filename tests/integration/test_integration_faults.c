/*
 * Integration: a malformed batch is refused with an error naming the field while the other
 * trainer's step runs, and a peer whose uid is not allowed is refused. Each test starts the
 * real embd (EMBD_BINARY) on a private socket: the embedded default config, or one that
 * allows another uid than this process's.
 */
#include <criterion/criterion.h>
#include <string.h>
#include <unistd.h>

#include "embd/client.h"
#include "tests/integration/service_fixture.h"
#include "libclient/client_internal.h"

TestSuite(integration, .init = start_service, .fini = stop_service, .timeout = 60);

/* One id per feature and sample, all id 1; returns the id count. */
static uint64_t fill_valid(struct embd_client *c, uint32_t slot)
{
	const struct embd_client_layout *l = embd_layout(c);
	struct embd_batch b;
	uint64_t n = (uint64_t)l->num_features * l->batch_size;

	embd_batch_get(c, slot, &b);
	for (uint64_t i = 0; i < n; i++) {
		b.lengths[i] = 1;
		b.values[i] = 1;
	}
	return n;
}

Test(integration, malformed_batch_is_named_and_others_run)
{
	struct embd_client *good, *bad;
	char err[256];

	cr_assert_eq(embd_connect(service.socket, 0, 5000, &good, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(embd_connect(service.socket, 1, 5000, &bad, err, sizeof(err)), 0, "%s", err);
	uint64_t n = fill_valid(bad, 0);
	struct embd_request req = { .op = EMBD_REQUEST_FORWARD, .slot = 0, .step = 0,
				    .num_values = n - 1 };  /* lengths sum to n */
	cr_assert_eq(embd_submit(bad, &req), 0, "%s", embd_last_error(bad));
	struct embd_completion done;
	cr_assert_eq(embd_wait(bad, &done, 5000), 0, "%s", embd_last_error(bad));
	cr_expect_lt(done.result, 0, "a batch whose lengths do not sum to num_values: expected an "
		     "error, got %d", done.result);
	cr_expect(strstr(embd_last_error(bad), "num_values") || strstr(embd_last_error(bad), "length"),
		  "error should name lengths/num_values, got '%s'", embd_last_error(bad));
	/* a descriptor with an output span outside the slab */
	struct embd_sqe sqe;
	req.num_values = n;
	cr_assert_eq(embd_client_sqe_build(bad, &req, &sqe), 0);
	sqe.output.offset = embd_client_slab_bytes(bad);
	cr_assert_eq(embd_client_push_sqe(bad, &sqe), 0);
	cr_assert_eq(embd_wait(bad, &done, 5000), 0, "%s", embd_last_error(bad));
	cr_expect_lt(done.result, 0, "output outside the slab: expected an error, got %d", done.result);
	cr_expect(strstr(embd_last_error(bad), "output") != NULL,
		  "error should name the output span, got '%s'", embd_last_error(bad));
	/* the good trainer's step 0 runs without the bad one */
	n = fill_valid(good, 0);
	int rc = embd_forward(good, 0, 0, n, 0);
	cr_expect_eq(rc, 0, "good trainer's forward: expected 0, got %d (%s)", rc,
		     embd_last_error(good));
	struct embd_batch b;
	embd_batch_get(good, 0, &b);
	memset(b.grad, 0, (size_t)embd_layout(good)->batch_size * embd_layout(good)->total_dim * 4);
	rc = embd_backward(good, 0, 0, n, 0);
	cr_expect_eq(rc, 0, "good trainer's backward: expected 0, got %d (%s)", rc,
		     embd_last_error(good));
	embd_close(good);
	embd_close(bad);
}

/*
 * A uid the config does not allow is refused by the service itself: the socket's mode lets
 * this process connect (it owns the socket, or it is root), so the refusal can only be the
 * SO_PEERCRED check, answered with EMBD_EACCES and logged with the peer's uid.
 */
TestSuite(refusal, .fini = stop_service, .timeout = 60);

Test(refusal, unauthorised_uid_is_refused)
{
	char path[128], err[256], logged[96];
	struct embd_client *c = NULL;
	uid_t me = getuid(), other = me == 0 ? 65534 : 0;

	snprintf(path, sizeof(path), "/tmp/embd-uid-%d.json", (int)getpid());
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f, "cannot write %s", path);
	fprintf(f, "{ \"allowed_uids\": [%u] }\n", (unsigned)other);
	fclose(f);
	service_spawn(path, "warning");
	unlink(path);
	int rc = embd_connect(service.socket, EMBD_CLIENT_ANY_INDEX, 5000, &c, err, sizeof(err));
	cr_assert_eq(rc, EMBD_EACCES, "connect as uid %u with allowed_uids [%u]: expected "
		     "EMBD_EACCES (%d), got %d (%s)", (unsigned)me, (unsigned)other, EMBD_EACCES, rc,
		     err);
	cr_assert_null(c);
	snprintf(logged, sizeof(logged), "uid %u", (unsigned)me);
	cr_expect(strstr(err, logged) != NULL, "the refusal should name %s, got '%s'", logged, err);
	/* the service logs its refusal before it answers, so the line is there already */
	snprintf(logged, sizeof(logged), "refused peer uid %u", (unsigned)me);
	cr_expect(tu_embd_log_has(&service, logged), "the service's log (%s) should say '%s'",
		  service.log, logged);
}
