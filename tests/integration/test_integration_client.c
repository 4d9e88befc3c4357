/*
 * libembdclient against the real embd binary (EMBD_BINARY): connect and layout, a NOP round
 * trip, argument checks that never reach the service, and connecting where nobody listens.
 * Each test starts its own embd on a private socket and kills it at the end.
 */
#include <criterion/criterion.h>
#include <unistd.h>

#include "embd/client.h"
#include "tests/integration/service_fixture.h"

TestSuite(client, .init = start_service, .fini = stop_service, .timeout = 30);

Test(client, connect_gives_layout_and_nop_round_trip)
{
	struct embd_client *c;
	char err[256];
	int rc = embd_connect(service.socket, 1, 5000, &c, err, sizeof(err));

	cr_assert_eq(rc, 0, "connect: expected 0, got %d (%s)", rc, err);
	const struct embd_client_layout *l = embd_layout(c);
	cr_expect_eq(l->index, 1, "index: expected 1, got %d", l->index);
	cr_expect_gt(l->num_features, 0);
	cr_expect_gt(l->batch_size, 0);
	uint32_t col = 0;
	for (uint32_t f = 0; f < l->num_features; f++) {
		cr_expect_eq(l->features[f].offset, col, "feature %u offset: expected %u, got %u", f,
			     col, l->features[f].offset);
		col += l->features[f].dim;
	}
	cr_expect_eq(col, l->total_dim, "total_dim: expected %u, got %u", col, l->total_dim);
	struct embd_request nop = { .op = EMBD_REQUEST_NOP, .user_data = 77 };
	struct embd_completion done;
	cr_assert_eq(embd_submit(c, &nop), 0, "%s", embd_last_error(c));
	rc = embd_wait(c, &done, 5000);
	cr_assert_eq(rc, 0, "wait: expected 0, got %d (%s)", rc, embd_last_error(c));
	cr_expect_eq(done.user_data, 77u, "user_data: expected 77, got %llu",
		     (unsigned long long)done.user_data);
	cr_expect_eq(done.result, 0, "result: expected 0, got %d", done.result);
	cr_expect_eq(embd_poll(c, &done), EMBD_EAGAIN, "poll of an empty ring must say EAGAIN");
	embd_close(c);
}

Test(client, bad_arguments_are_named)
{
	struct embd_client *c;
	struct embd_batch b;
	char err[256];

	cr_assert_eq(embd_connect(service.socket, EMBD_CLIENT_ANY_INDEX, 5000, &c, err,
				  sizeof(err)), 0, "%s", err);
	cr_expect_eq(embd_batch_get(c, EMBD_CLIENT_SLOTS, &b), EMBD_EINVAL);
	cr_expect(strstr(embd_last_error(c), "slot") != NULL, "got '%s'", embd_last_error(c));
	struct embd_request big = { .op = EMBD_REQUEST_FORWARD,
				    .num_values = embd_layout(c)->max_values + 1 };
	cr_expect_eq(embd_submit(c, &big), EMBD_EINVAL);
	cr_expect(strstr(embd_last_error(c), "num_values") != NULL, "got '%s'", embd_last_error(c));
	struct embd_request wide = { .op = EMBD_REQUEST_FORWARD,
				     .batch_size = embd_layout(c)->batch_size + 1 };
	cr_expect_eq(embd_submit(c, &wide), EMBD_EINVAL);
	cr_expect(strstr(embd_last_error(c), "batch_size") != NULL, "got '%s'", embd_last_error(c));
	/* the same index twice is refused by the service, with its reason */
	struct embd_client *twin;
	int rc = embd_connect(service.socket, embd_layout(c)->index, 5000, &twin, err, sizeof(err));
	cr_expect_eq(rc, EMBD_EBUSY, "second connect as the same index: expected EBUSY, got %d", rc);
	cr_expect(strstr(err, "wanted_rank") != NULL, "got '%s'", err);
	cr_expect_null(twin);
	embd_close(c);
	embd_close(NULL);
}

Test(client, no_service_is_enoent)
{
	struct embd_client *c;
	char err[256];
	int rc = embd_connect("/tmp/embd-test-client-nobody.sock", 0, 1000, &c, err, sizeof(err));

	cr_expect_eq(rc, EMBD_ENOENT, "expected ENOENT, got %d (%s)", rc, err);
	cr_expect_null(c);
}
