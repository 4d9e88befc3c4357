#!/bin/bash
# tests/gpu/check_scripts.sh BUILD - what of tests/gpu/run.sh needs no GPU, checked on every CI
# run: both scripts parse, run.sh's arguments, the bundle of BUILD's programs (under 64 MiB,
# every library found in it, embd starting from it), its embd-bench e2e (through ranks of the
# CPU, and --device cuda refused with one line where no GPU is), and run.sh's service part on
# that bundle: where no GPU is, embd refuses compute_device cuda with one line and run.sh
# exits 77.
set -euo pipefail
build=$(realpath "$1")
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d /tmp/embd-gpu-check-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "check_scripts: $*" >&2; exit 1; }

bash -n tests/gpu/run.sh && bash -n tests/gpu/bundle.sh && bash -n tests/gpu/sanitized.sh
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
# run.sh's end-to-end benchmark: through ranks of the CPU here (a small table), the JSON line
# run.sh reads; and --device cuda without a GPU: exit 77 with one line saying why. A sanitizer
# build's bundle leaves it out (bundle.sh), and only that one.
if [ ! -x "$tmp/bundle/bin/embd-bench" ]; then
	bash tests/gpu/sanitized.sh "$build/tools/bench/embd-bench" ||
		fail "the bundle has no embd-bench, and $build is no sanitizer build"
else
	bench() { LD_LIBRARY_PATH="$tmp/bundle/lib" "$tmp/bundle/bin/embd-bench" e2e --rows 10000 \
		--ids 4096 --seconds 0.3 --threads 1 --embd "$tmp/bundle/bin/embd" "$@"; }
	bench --device cpu >"$tmp/e2e_cpu.jsonl" || fail "embd-bench e2e --device cpu failed"
	grep -q '"device":"cpu","rows":10000,"reference":"ranks"' "$tmp/e2e_cpu.jsonl" &&
		grep -q '"overhead_ratio":[0-9]' "$tmp/e2e_cpu.jsonl" ||
		fail "embd-bench e2e --device cpu: no ratio against the ranks: $(cat "$tmp/e2e_cpu.jsonl")"
	set +e
	bench --device cuda >"$tmp/e2e_cuda.jsonl" 2>"$tmp/e2e_cuda.log"
	brc=$?
	set -e
	if [ "$brc" -ne 0 ]; then
		[ "$brc" -eq 77 ] || fail "embd-bench e2e --device cuda: exit $brc: $(cat "$tmp/e2e_cuda.log")"
		[ "$(wc -l <"$tmp/e2e_cuda.log")" -eq 1 ] && grep -q "no CUDA device" "$tmp/e2e_cuda.log" ||
			fail "embd-bench e2e --device cuda without a GPU: expected one line, got: $(cat "$tmp/e2e_cuda.log")"
	fi
fi

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
