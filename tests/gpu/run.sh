#!/bin/bash
# tests/gpu/run.sh - builds the CUDA kernels, their GPU test and the GPU benchmark in their own
# build directory and runs both on this machine's GPU (about 2 minutes of build and 1 of runs
# on one H200), then the NCCL comm engine's test (test_comm_nccl). With $OUT set, the test log and the benchmark's JSON lines are written there.
# Exit status: the test's (0 passed, 1 failed, 77 no GPU), or the benchmark's if it failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${EMBD_GPU_BUILD:-build-gpu}
out=${OUT:-$build}

cmake -S . -B "$build" -DEMBD_CUDA=ON -DEMBD_WERROR=ON -DCMAKE_BUILD_TYPE=Release -DEMBD_KERNELS_ONLY=ON || exit 1
cmake --build "$build" -j"$(nproc)" --target test_cuda_kernels bench_cuda_kernels || exit 1
mkdir -p "$out"

"$build"/kernels/test_cuda_kernels 2>&1 | tee "$out/test_cuda_kernels.log"
rc=$?
"$build"/kernels/bench_cuda_kernels | tee "$out/bench_cuda_kernels.jsonl"
brc=$?
if [ "$rc" -eq 0 ] && [ "$brc" -ne 0 ]; then
	rc=$brc
fi
# The NCCL comm engine, where the toolkit has NCCL (the target exists only then).
nrc=0
if cmake --build "$build" -j"$(nproc)" --target test_comm_nccl >"$out/build_comm_nccl.log" 2>&1; then
	"$build"/kernels/test_comm_nccl 2>&1 | tee "$out/test_comm_nccl.log"
	nrc=${PIPESTATUS[0]}
else
	echo "test_comm_nccl: not built (no NCCL?), see $out/build_comm_nccl.log"
fi
if [ "$rc" -eq 0 ] && [ "$nrc" -ne 0 ]; then
	rc=$nrc
fi
echo "test_cuda_kernels: exit $rc, bench_cuda_kernels: exit $brc, test_comm_nccl: exit $nrc"
exit "$rc"
