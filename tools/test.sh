#!/usr/bin/env bash
# Sets up a fresh machine and passes every CPU test: installs packages, builds with warnings
# as errors, runs ctest, then builds and runs the same suite again under AddressSanitizer +
# UndefinedBehaviorSanitizer, then the Python package's tests (pytest in .venv/, made by
# tools/python-env.sh: torch, torchrec, fbgemm-gpu-cpu from PyPI; ~150 s and ~5.5 GB the first
# time, reused after) against the plain build. `.ci/run` calls exactly this. Flags:
#   --no-sanitize  no sanitizer build
#   --asan-only    only the sanitizer build (no Python tests)
#   --no-python    no Python tests
# Build folders: build/ and build-asan/ (EMBD_BUILD_DIR overrides the first).
set -euo pipefail
cd "$(dirname "$0")/.."

plain=1 sanitize=1 python=1
for arg in "$@"; do
  case "$arg" in
    --no-sanitize) sanitize=0 ;;
    --asan-only) sanitize=1 plain=0 python=0 ;;
    --no-python) python=0 ;;
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

# The Python suite uses the plain build's embd, embctl and libembdclient (an ASan library
# would need the sanitizer runtime preloaded into python).
if [ "$python" = 1 ]; then
  build=$(cd "${EMBD_BUILD_DIR:-build}" && pwd)
  py=$(EMBD_BUILD_DIR="$build" EMBD_WERROR=1 bash tools/python-env.sh | tail -n 1)
  rc=0
  EMBD_BUILD_DIR="$build" "$py" -m pytest -ra tests/python || rc=$?
  if [ "$rc" = 5 ]; then
    echo "test.sh: pytest collected no tests in tests/python (exit 5): the Python suite" \
      "did not run" >&2
    exit 1
  fi
  exit "$rc"
fi
