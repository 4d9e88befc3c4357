/*
 * Fuzz target for checkpoint manifests (ckpt/manifest.h): whatever bytes a manifest.json
 * holds, parsing must not crash; a manifest that parses is written back, and that text must
 * parse again to the same files (a checkpoint read from disk is bytes from outside).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/manifest.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct embd_ckpt_manifest m, again;
	char err[512], *text = NULL;

	if (embd_ckpt_manifest_parse((const char *)data, size, &m, err, sizeof(err))) {
		embd_ckpt_manifest_free(&m);
		return 0;
	}
	if (embd_ckpt_manifest_write(&m, &text))
		abort();
	if (embd_ckpt_manifest_parse(text, strlen(text), &again, err, sizeof(err)) ||
	    again.num_files != m.num_files || again.step != m.step ||
	    (m.num_files && memcmp(again.files, m.files, m.num_files * sizeof(*m.files))))
		abort();
	free(text);
	embd_ckpt_manifest_free(&again);
	embd_ckpt_manifest_free(&m);
	return 0;
}
