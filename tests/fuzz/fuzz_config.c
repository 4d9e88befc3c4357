/*
 * Fuzz target for the service config parser (daemon/config.h): any bytes must either parse
 * into a config that frees cleanly or fail with a message; never crash, leak or read past
 * the input.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct embd_config c;
	char err[512];

	/* a private copy without a terminator: the parser must respect size */
	char *text = malloc(size ? size : 1);
	if (!text)
		return 0;
	memcpy(text, data, size);
	if (embd_config_parse(text, size, &c, err, sizeof(err)) == 0)
		embd_config_free(&c);
	else if (!memchr(err, 0, sizeof(err)))
		abort(); /* an error message must be a string */
	free(text);
	return 0;
}
