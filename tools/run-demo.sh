#!/usr/bin/env bash
# The README's main command: installs dependencies, builds into build/, starts embd with its
# embedded default config on a private socket, trains the demo click-through model with two
# trainer processes through it, prints their loss, a summary line, and stops embd with SIGTERM.
# Exits non-zero when the build fails or either trainer's loss did not fall.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
steps="${EMBD_DEMO_STEPS:-2000}"

"$root/tools/install-deps.sh"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target embd embd-demo-trainer

sock="$(mktemp -d /tmp/embd-demo.XXXXXX)/embd.sock"
build/daemon/embd --socket "$sock" &
embd_pid=$!
stop() { kill -TERM "$embd_pid" 2>/dev/null || true; wait "$embd_pid" 2>/dev/null || true; rm -rf "$(dirname "$sock")"; }
trap stop EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "run-demo: embd did not start" >&2; exit 1; }

pids=()
out="$(dirname "$sock")"
start=$SECONDS
for i in 0 1; do
	build/tools/demo/embd-demo-trainer --socket "$sock" --index "$i" --steps "$steps" \
		--print-every 200 | tee "$out/trainer$i.log" &
	pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
# each trainer's last line: "trainer I: loss A at its first step, ..., C over its last N (noise floor F): fell"
summary=$(for i in 0 1; do tail -n 1 "$out/trainer$i.log" |
	sed -E 's/^trainer ([0-9]+): loss ([0-9.]+) at .* ([0-9.]+) over its last [0-9]+ \(noise floor ([0-9.]+)\).*/trainer \1 \2 -> \3 (floor \4)/'; done | paste -sd "," - | sed "s/,/; /")
if [ "$status" = 0 ]; then
	echo "run-demo: $steps steps in $((SECONDS - start)) s, the loss fell for both trainers: $summary"
else
	echo "run-demo: FAILED: $summary" >&2
fi
exit "$status"
