#!/bin/bash
# tests/gpu/run.sh - the GPU checks, in one script for a lent GPU machine (one H200: about 2
# minutes of build, then the runs). Logs and JSON lines go to $OUT (default: the build folder).
#
#   tests/gpu/run.sh                on the GPU machine:
#     1. builds the CUDA kernels, their test and benchmark (kernels-only: the machine lacks the
#        service's Debian packages) and runs them, then the NCCL comm engine's test;
#     2. with the service bundle (below) at $EMBD_GPU_BUNDLE (default build-gpu-bundle): the
#        real embd on all GPUs of the machine (compute_device cuda, ranks = the GPU count) with
#        trainer processes, every sharding type, compute kernels fused, fused_uvm and
#        fused_uvm_caching (its HBM cache a few rows of the test tables: evictions, write-backs
#        and overflowing sets every step), each equal to the unsharded CPU reference (all of
#        test_integration_training: short batches, pipelined steps, a killed trainer, refused
#        batches, all through the host/device copies of the GPU ranks); a config asking for
#        more GPUs than there are refused naming both numbers; and two embd nodes on this
#        machine with the GPUs split between them (2 each, CUDA_VISIBLE_DEVICES) and backend
#        nccl (test_integration_dist): every two-node training equal to the reference, and a
#        node killed mid-step reported naming it (needs 4 GPUs: NCCL refuses two ranks of
#        one communicator on one GPU; with fewer it says so and is not run); and device
#        outputs (test_device_outputs): trainers with their pooled outputs and gradients in
#        CUDA memory of their GPU (cuMemCreate, exported as a POSIX fd) train as through the
#        slab, bit for bit, an unknown GPU is refused, crashed trainers leave no fd and no
#        GPU memory in embd; and end to end on one GPU (embd-bench e2e --device cuda): embd's
#        training steps/s against the same CUDA kernels called in process through the ranks,
#        overhead_ratio in e2e_cuda.jsonl (the target: >= 0.9), judged in the log (a bundle
#        of a sanitizer build has no embd-bench: not run).
#   tests/gpu/run.sh --bundle-only  on a machine with the packages (CI, a developer's): builds
#        the service in $EMBD_BUILD_DIR (default build) and bundles its programs with their
#        libraries into $EMBD_GPU_BUNDLE (tests/gpu/bundle.sh, under 64 MiB) to carry along.
#   --no-kernels  skip step 1; --help  this text.
# Exit status: 0 passed, 1 failed, 2 usage, 77 no GPU (nothing ran).
set -uo pipefail
cd "$(dirname "$0")/../.."

bundle_only=0 kernels=1
for arg in "$@"; do
	case "$arg" in
	--bundle-only) bundle_only=1 ;;
	--no-kernels) kernels=0 ;;
	--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	*) echo "run.sh: unknown argument $arg (--help)" >&2; exit 2 ;;
	esac
done
build=${EMBD_GPU_BUILD:-build-gpu}
bundle=${EMBD_GPU_BUNDLE:-build-gpu-bundle}
out=${OUT:-$build}

if [ "$bundle_only" = 1 ]; then
	service=${EMBD_BUILD_DIR:-build}
	cmake -S . -B "$service" -DEMBD_CUDA=ON -DEMBD_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo || exit 1
	cmake --build "$service" -j"$(nproc)" --target embd embctl embd-demo-trainer embd-bench \
		test_integration_training test_integration_dist test_device_outputs || exit 1
	exec bash tests/gpu/bundle.sh "$service" "$bundle"
fi

mkdir -p "$out"
rc=0
# a failure keeps the first failing status; 77 (no GPU) only when nothing else ran
note() {
	if [ "$1" -ne 0 ] && { [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ]; }; then
		rc=$1
	fi
}

if [ "$kernels" = 1 ]; then
	cmake -S . -B "$build" -DEMBD_CUDA=ON -DEMBD_WERROR=ON -DCMAKE_BUILD_TYPE=Release -DEMBD_KERNELS_ONLY=ON || exit 1
	cmake --build "$build" -j"$(nproc)" --target test_cuda_kernels bench_cuda_kernels || exit 1
	"$build"/kernels/test_cuda_kernels 2>&1 | tee "$out/test_cuda_kernels.log"
	note "${PIPESTATUS[0]}"
	if [ "$rc" -ne 77 ]; then
		"$build"/kernels/bench_cuda_kernels | tee "$out/bench_cuda_kernels.jsonl"
		note "${PIPESTATUS[0]}"
	fi
	# The NCCL comm engine, where the toolkit has NCCL (the target exists only then).
	if cmake --build "$build" -j"$(nproc)" --target test_comm_nccl >"$out/build_comm_nccl.log" 2>&1; then
		"$build"/kernels/test_comm_nccl 2>&1 | tee "$out/test_comm_nccl.log"
		note "${PIPESTATUS[0]}"
	else
		echo "test_comm_nccl: not built (no NCCL?), see $out/build_comm_nccl.log"
	fi
fi

if [ ! -x "$bundle/bin/embd" ]; then
	echo "service on GPUs: no bundle at $bundle (make it with run.sh --bundle-only where the" \
		"packages are, and carry it): not run"
	[ "$kernels" = 1 ] || rc=1
	echo "run.sh: exit $rc"
	exit "$rc"
fi
cuda_lib=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
	[ -d "$d" ] && cuda_lib="$cuda_lib:$d"
done
bundle=$(realpath "$bundle")
export LD_LIBRARY_PATH="$bundle/lib$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export EMBD_TEST_BINARY="$bundle/bin/embd"

# more GPUs than the machine has: refused, naming both numbers
cfg=$(mktemp /tmp/embd-gpu-XXXXXX.json)
printf '{ "topology": { "compute_device": "cuda", "world_size": 4096, "local_world_size": 4096, "batch_size": 8 },\n  "tables": [ { "name": "t", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f"] } ] }\n' >"$cfg"
"$EMBD_TEST_BINARY" --config "$cfg" --socket "/tmp/embd-gpu-$$.sock" >"$out/too_many_gpus.log" 2>&1
erc=$?
rm -f "$cfg"
if grep -q "no CUDA device" "$out/too_many_gpus.log"; then
	echo "service on GPUs: embd sees no CUDA device: $(tail -n 1 "$out/too_many_gpus.log")"
	note 77
elif [ "$erc" -ne 0 ] && grep -Eq "local_world_size 4096 asks for more GPUs than the [0-9]+" "$out/too_many_gpus.log"; then
	echo "too_many_gpus: refused as expected"
else
	echo "too_many_gpus: expected a refusal naming 4096 and the GPU count, got exit $erc:"
	cat "$out/too_many_gpus.log"
	note 1
fi

if [ "$rc" -ne 77 ]; then
	for kernel in fused fused_uvm fused_uvm_caching; do
		EMBD_TEST_COMPUTE_DEVICE=cuda EMBD_TEST_COMPUTE_KERNEL=$kernel \
			"$bundle/bin/test_integration_training" -j1 \
			2>&1 | tee "$out/training_$kernel.log"
		note "${PIPESTATUS[0]}"
	done
fi
if [ "$rc" -ne 77 ]; then
	if [ -x "$bundle/bin/test_device_outputs" ]; then
		"$bundle/bin/test_device_outputs" -j1 2>&1 | tee "$out/device_outputs.log"
		note "${PIPESTATUS[0]}"
	else
		echo "device_outputs: not in the bundle (built without CUDA): not run"
	fi
fi
if [ "$rc" -ne 77 ]; then
	# one GPU (the config's one rank): the service against the same kernels in process
	if [ ! -x "$bundle/bin/embd-bench" ]; then
		echo "e2e_cuda: no embd-bench in the bundle (a sanitizer build): not run"
	elif ! "$bundle/bin/embd-bench" e2e --device cuda --seconds 3 --embd "$bundle/bin/embd" \
		>"$out/e2e_cuda.jsonl" 2>"$out/e2e_cuda.log"; then
		cat "$out/e2e_cuda.jsonl"
		echo "e2e_cuda: failed: $(tail -n 1 "$out/e2e_cuda.log")"
		note 1
	else
		cat "$out/e2e_cuda.jsonl"
		for ratio in $(grep -o '"overhead_ratio":[0-9.]*' "$out/e2e_cuda.jsonl" | cut -d: -f2); do
			verdict=$(awk -v r="$ratio" 'BEGIN { print (r >= 0.9 ? "met" : "MISSED") }')
			echo "e2e_cuda: overhead_ratio $ratio, target >= 0.9: $verdict"
		done
	fi
fi
if [ "$rc" -ne 77 ]; then
	gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
	if [ "$gpus" -ge 4 ]; then
		for filter in 'dist/two_nodes_*' 'dist/killed_node_*'; do
			log="$out/nccl_$(echo "$filter" | tr -c 'a-z_\n' '_').log"
			EMBD_TEST_COMPUTE_DEVICE=cuda EMBD_TEST_BACKEND=nccl \
				"$bundle/bin/test_integration_dist" -j1 --filter "$filter" 2>&1 | tee "$log"
			note "${PIPESTATUS[0]}"
		done
	else
		echo "nccl_two_nodes: needs 4 GPUs (2 nodes of 2 ranks), this machine has $gpus: not run"
	fi
fi
echo "run.sh: exit $rc"
exit "$rc"
