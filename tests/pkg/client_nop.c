/*
 * A trainer built against the installed libembdclient-dev (tests/pkg/test_install.sh compiles
 * it with the package's pkg-config file and runs it inside the installed root): connects to
 * embd, prints the layout, and makes one NOP round trip through the rings.
 * Exit 0 on success, 3 when the service refused or could not be reached, 1 otherwise.
 */
#include <stdio.h>

#include <embd/client.h>

int main(int argc, char **argv)
{
	const char *socket_path = argc > 1 ? argv[1] : "/run/embd/embd.sock";
	struct embd_client *client = NULL;
	struct embd_completion done;
	char err[512] = "";

	int rc = embd_connect(socket_path, EMBD_CLIENT_ANY_INDEX, 5000, &client, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "client_nop: connect %s: %s: %s\n", socket_path, embd_strerror(rc), err);
		return 3;
	}
	const struct embd_client_layout *l = embd_layout(client);
	printf("client_nop: trainer %d of %u, batch %u, %u tables, %u features\n", l->index,
	       l->trainers_per_node, l->batch_size, l->num_tables, l->num_features);
	struct embd_request nop = { .op = EMBD_REQUEST_NOP, .user_data = 42 };
	rc = embd_submit(client, &nop);
	if (!rc)
		rc = embd_wait(client, &done, 5000);
	if (!rc && (done.user_data != 42 || done.result))
		rc = EMBD_EPROTO;
	if (rc)
		fprintf(stderr, "client_nop: NOP: %s: %s\n", embd_strerror(rc), embd_last_error(client));
	else
		printf("client_nop: NOP round trip done\n");
	embd_close(client);
	return rc ? 1 : 0;
}
