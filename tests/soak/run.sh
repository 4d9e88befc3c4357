#!/usr/bin/env bash
# The soak test (tests/soak/test_soak.c; docs/testing.md): the real embd with good, crashing and
# hostile trainers for N minutes, then its tables against the reference of the steps it
# applied, its fds and its RSS. Opt-in, not in ctest's default run.
# Usage: tests/soak/run.sh [--minutes N (2)] [--seconds S] [--seed N (1)] [--build-dir DIR (build)]
# Prints one JSON line of figures; exits 0 when every check held.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=120 seed=1 build=build
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) seconds=$(( ${2:?--minutes N} * 60 )); shift 2 ;;
    --seconds) seconds=${2:?--seconds S}; shift 2 ;;
    --seed) seed=${2:?--seed N}; shift 2 ;;
    --build-dir) build=${2:?--build-dir DIR}; shift 2 ;;
    *) echo "run.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
case "$seconds$seed" in *[!0-9]*) echo "run.sh: numbers only" >&2; exit 2 ;; esac
cmake --build "$build" -j2 --target test_soak embd >/dev/null
# a sanitizer build (--build-dir build-asan): ASan's quarantine of freed memory (256 MiB) would
# read as RSS growth; embd inherits the setting
export ASAN_OPTIONS=${ASAN_OPTIONS:-quarantine_size_mb=0}
EMBD_SOAK_SECONDS=$seconds EMBD_SOAK_SEED=$seed exec "$build/tests/soak/test_soak" --verbose
