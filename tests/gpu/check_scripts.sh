#!/bin/bash
# tests/gpu/check_scripts.sh BUILD - what of tests/gpu/run.sh needs no GPU, checked on every CI
# run: both scripts parse, run.sh's arguments, the bundle of BUILD's programs (under 64 MiB,
# every library found in it, embd starting from it), and run.sh's service part on that bundle:
# where no GPU is, embd refuses compute_device cuda with one line and run.sh exits 77.
set -euo pipefail
build=$(realpath "$1")
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d /tmp/embd-gpu-check-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "check_scripts: $*" >&2; exit 1; }

bash -n tests/gpu/run.sh && bash -n tests/gpu/bundle.sh
bash tests/gpu/run.sh --help | grep -- "--bundle-only" >/dev/null || fail "run.sh --help names no --bundle-only"
set +e
bash tests/gpu/run.sh --bogus 2>/dev/null
[ $? -eq 2 ] || fail "run.sh --bogus: expected exit 2"
bash tests/gpu/bundle.sh "$build" 2>/dev/null
[ $? -eq 2 ] || fail "bundle.sh with one argument: expected exit 2"
EMBD_BUNDLE_MAX_BYTES=1000 bash tests/gpu/bundle.sh "$build" "$tmp/small" >/dev/null 2>&1
[ $? -eq 1 ] || fail "a bundle over EMBD_BUNDLE_MAX_BYTES should fail"
set -e

bash tests/gpu/bundle.sh "$build" "$tmp/bundle"
for lib in "$tmp"/bundle/lib/*; do
	name=$(basename "$lib")
	LD_LIBRARY_PATH="$tmp/bundle/lib" ldd "$tmp"/bundle/bin/* | grep -F "$name =>" |
		grep -vqF "$tmp/bundle/lib/$name" && fail "$name does not load from the bundle"
done
LD_LIBRARY_PATH="$tmp/bundle/lib" "$tmp/bundle/bin/embd" --version >/dev/null ||
	fail "embd does not start from the bundle"

set +e
OUT="$tmp/out" EMBD_GPU_BUNDLE="$tmp/bundle" bash tests/gpu/run.sh --no-kernels >"$tmp/run.log" 2>&1
rc=$?
set -e
if grep -q "too_many_gpus: refused as expected" "$tmp/run.log"; then
	echo "check_scripts: this machine has a GPU: run.sh ran for real (exit $rc)"
	exit "$rc"
fi
[ "$rc" -eq 77 ] || { cat "$tmp/run.log"; fail "run.sh without a GPU: expected exit 77, got $rc"; }
grep -q "no CUDA device" "$tmp/out/too_many_gpus.log" || fail "no refusal line in the log"
echo "check_scripts: passed"
