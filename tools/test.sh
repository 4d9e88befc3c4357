#!/usr/bin/env bash
# Sets up a fresh machine and passes every CPU test: installs packages, builds with warnings
# as errors, runs ctest, then builds and runs the same suite again under AddressSanitizer +
# UndefinedBehaviorSanitizer. `.ci/run` calls exactly this. Flags:
#   --no-sanitize  only the plain build
#   --asan-only    only the sanitizer build
# Build folders: build/ and build-asan/ (EMBD_BUILD_DIR overrides the first).
set -euo pipefail
cd "$(dirname "$0")/.."

plain=1 sanitize=1
for arg in "$@"; do
  case "$arg" in
    --no-sanitize) sanitize=0 ;;
    --asan-only) sanitize=1 plain=0 ;;
    *) echo "test.sh: unknown flag $arg" >&2; exit 2 ;;
  esac
done

bash tools/install-deps.sh
jobs=$(nproc)

run_suite() {
  local dir=$1; shift
  cmake -S . -B "$dir" -DEMBD_WERROR=ON "$@"
  cmake --build "$dir" -j "$jobs"
  ctest --test-dir "$dir" --output-on-failure -j "$jobs"
}

if [ "$plain" = 1 ]; then
  run_suite "${EMBD_BUILD_DIR:-build}" -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
if [ "$sanitize" = 1 ]; then
  # CUDA objects are not instrumented; the sanitizer build covers the CPU code.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_suite build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBD_SANITIZE=ON -DEMBD_CUDA=OFF
fi
