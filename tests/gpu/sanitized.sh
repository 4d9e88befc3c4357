#!/bin/bash
# tests/gpu/sanitized.sh PROGRAM - exits 0 when PROGRAM is built with a sanitizer (ASan, UBSan
# or TSan), 1 when not: gcc links the sanitizers' runtime as a shared library, which ldd names;
# clang links it into the program, whose symbols then hold its entry points. bundle.sh leaves
# a sanitizer build's embd-bench out of the bundle, and check_scripts.sh checks that it did so
# only for one.
set -euo pipefail
if [ $# -ne 1 ]; then
	echo "usage: $0 PROGRAM" >&2
	exit 2
fi
# grep reads all of ldd's output: with -q it may exit first, and under pipefail ldd's SIGPIPE
# would fail the test
ldd "$1" | grep -E 'lib(a|ub|t)san\.so' >/dev/null ||
	grep -aqE '__(asan_init|tsan_init|ubsan_handle_)' "$1"
