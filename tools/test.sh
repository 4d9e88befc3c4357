#!/usr/bin/env bash
# Sets up a fresh machine and passes every CPU test: installs packages, builds with warnings
# as errors (gcc), runs ctest, then builds with clang and runs the same suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer (so both compilers build with warnings as
# errors), then the Python package's tests (pytest in .venv/, made by
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

if [ "$plain" = 1 ] && [ "$sanitize" = 1 ] &&
   [ "$(realpath -m "${EMBD_BUILD_DIR:-build}")" = "$(realpath -m build-asan)" ]; then
  echo "test.sh: EMBD_BUILD_DIR is the sanitizer build's folder (build-asan)" >&2
  exit 2
fi

bash tools/install-deps.sh
jobs=$(nproc)

# The full path of compiler $1 (as CMake finds a name given without one), or exit.
compiler_path() {
  command -v "$1" || { echo "test.sh: no compiler $1 on PATH" >&2; exit 1; }
}

# The full path of the compiler a build folder's cache holds ("" when it has none).
cached_compiler() {
  local v
  v=$(sed -n "s/^$2:[A-Z]*=//p" "$1/CMakeCache.txt" 2>/dev/null) || true
  [ -n "$v" ] && command -v "$v" || true
}

run_suite() {
  local dir=$1 cc cxx
  cc=$(compiler_path "$2") || exit 1
  cxx=$(compiler_path "$3") || exit 1
  shift 3
  # A folder configured with other compilers is started afresh: on a change CMake deletes the
  # cache itself and keeps only the compilers, not the options given with them.
  if [ -f "$dir/CMakeCache.txt" ] &&
     { [ "$(cached_compiler "$dir" CMAKE_C_COMPILER)" != "$cc" ] ||
       [ "$(cached_compiler "$dir" CMAKE_CXX_COMPILER)" != "$cxx" ]; }; then
    echo "test.sh: $dir was configured with other compilers: configuring it afresh with $cc" >&2
    rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
  fi
  cmake -S . -B "$dir" -DEMBD_WERROR=ON -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" "$@"
  cmake --build "$dir" -j "$jobs"
  ctest --test-dir "$dir" --output-on-failure -j "$jobs"
}

if [ "$plain" = 1 ]; then
  run_suite "${EMBD_BUILD_DIR:-build}" gcc g++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
if [ "$sanitize" = 1 ]; then
  # CUDA objects are not instrumented; the sanitizer build covers the CPU code. clang here,
  # gcc in the plain build: each warns about things the other does not.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_suite build-asan clang clang++ -DCMAKE_BUILD_TYPE=Debug -DEMBD_SANITIZE=ON -DEMBD_CUDA=OFF
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
