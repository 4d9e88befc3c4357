/*
 * tests/support/numpy_python.h - finds a python3 that can import numpy, for tests that check files
 * against numpy itself: $EMBD_PYTHON, then /usr/bin/python3 (Debian's python3-numpy), then
 * python3 on PATH. Tests skip their numpy part cleanly when there is none.
 */
#ifndef EMBD_TESTS_NUMPY_PYTHON_H
#define EMBD_TESTS_NUMPY_PYTHON_H

#include <stdio.h>
#include <stdlib.h>

/* The interpreter's command, or NULL when no python3 has numpy. */
static inline const char *numpy_python(void)
{
	const char *candidates[] = { getenv("EMBD_PYTHON"), "/usr/bin/python3", "python3" };
	char cmd[256];

	for (size_t i = 0; i < 3; i++) {
		if (!candidates[i])
			continue;
		snprintf(cmd, sizeof(cmd), "%s -c 'import numpy' >/dev/null 2>&1", candidates[i]);
		if (system(cmd) == 0)
			return candidates[i];
	}
	return NULL;
}

#endif
