#!/usr/bin/env bash
# Trains TorchRec's DLRM on synthetic Criteo-like data with 2 trainers under torchrun
# (examples/dlrm.py): through one embd started here on a private socket (default), or with
# TorchRec's own sharded EmbeddingBagCollection for comparison. Prints loss and steps/s.
#   bash examples/run_dlrm.sh [--backend embd|torchrec] [more dlrm.py flags]
# Needs the build (EMBD_BUILD_DIR, default build/) and the Python environment with embd
# installed (EMBD_VENV, default .venv/: bash tools/python-env.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."

build=${EMBD_BUILD_DIR:-build}
venv=${EMBD_VENV:-.venv}
trainers=${EMBD_TRAINERS:-2}
backend=embd
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --backend) backend=${args[i + 1]:-} ;;
    --backend=*) backend=${args[i]#--backend=} ;;
  esac
done

run() {
  "$venv/bin/torchrun" --standalone --nproc_per_node "$trainers" examples/dlrm.py "$@"
}

if [ "$backend" != embd ]; then
  run "${args[@]}"
  exit
fi

dir=$(mktemp -d /tmp/embd-dlrm.XXXXXX)
embd_pid=
cleanup() {
  [ -n "$embd_pid" ] && kill "$embd_pid" 2>/dev/null && wait "$embd_pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
"$venv/bin/python" examples/dlrm.py --write-config "$dir/embd.json" --trainers "$trainers" \
  "${args[@]}"
"$build/daemon/embd" --config "$dir/embd.json" --socket "$dir/embd.sock" \
  --log-level warning &
embd_pid=$!
for _ in $(seq 200); do
  [ -S "$dir/embd.sock" ] && break
  kill -0 "$embd_pid" 2>/dev/null || { echo "run_dlrm: embd did not start" >&2; exit 1; }
  sleep 0.05
done
EMBD_SOCKET="$dir/embd.sock" run "${args[@]}"
