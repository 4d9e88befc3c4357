#!/usr/bin/env bash
# A fuzz campaign over every libFuzzer target of the tree, opt-in (CI runs only the replay of
# the corpus, tools/test.sh). Builds the `fuzz` preset (clang; ASan + UBSan + coverage) into
# build-fuzz/, then runs each target for a fixed time on a scratch copy of its corpus
# tests/fuzz/corpus/<target>/ and merges back (-set_cover_merge=1, libFuzzer's -merge=1 with
# a greedy set cover) only a smallest set of the inputs that add coverage, so the corpus in
# the repo grows by what is worth keeping and stays small. A finding stops
# nothing: its input is kept under build-fuzz/findings/ and the script exits 1 at the end.
#
#   tools/fuzz-campaign.sh [SECONDS_PER_TARGET (60)] [TARGET ...]   (default: every target)
#
# Prints one JSON line per target: executions, executions per second, the corpus before and
# after the merge, and the result. Environment: EMBD_FUZZ_JOBS (build jobs, default nproc),
# EMBD_FUZZ_MAX_LEN (longest input tried, default 4096 bytes).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
case "$seconds" in
  ''|*[!0-9]*|0) echo "fuzz-campaign.sh: SECONDS_PER_TARGET must be a whole number > 0, got '$seconds'" >&2; exit 2 ;;
esac
jobs=${EMBD_FUZZ_JOBS:-$(nproc)}
max_len=${EMBD_FUZZ_MAX_LEN:-4096}
build=build-fuzz
findings=$build/findings

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$jobs" >/dev/null

# every target with a source in tests/fuzz/, or the ones named
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for src in tests/fuzz/fuzz_*.c; do
    targets+=("$(basename "$src" .c)")
  done
fi

mkdir -p "$findings"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=0
for t in "${targets[@]}"; do
  bin=$(find "$build" -type f -perm -u+x -name "$t" | head -n 1)
  if [ -z "$bin" ]; then
    echo "fuzz-campaign.sh: no binary $t under $build" >&2
    failed=1
    continue
  fi
  corpus=tests/fuzz/corpus/$t
  mkdir -p "$corpus" "$scratch/$t"
  cp -rp "$corpus/." "$scratch/$t/"
  before=$(find "$corpus" -type f | wc -l)
  log=$scratch/$t.log
  result=ok
  if ! "$bin" -max_total_time="$seconds" -max_len="$max_len" -print_final_stats=1 \
       -artifact_prefix="$findings/$t-" "$scratch/$t" >"$log" 2>&1; then
    result="finding (see $findings/$t-*; log kept as $findings/$t.log)"
    cp "$log" "$findings/$t.log"
    failed=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  # into the repo: a greedy smallest set of the new inputs that covers what they add to its
  # corpus (-set_cover_merge; plain -merge=1 keeps every input with a new feature: 5-35x more)
  "$bin" -set_cover_merge=1 -max_len="$max_len" "$corpus" "$scratch/$t" >"$scratch/$t.merge" 2>&1 || true
  after=$(find "$corpus" -type f | wc -l)
  printf '{"target":"%s","seconds":%s,"execs":%s,"execs_per_s":%s,"corpus_before":%s,"corpus_after":%s,"result":"%s"}\n' \
    "$t" "$seconds" "${execs:-0}" "${rate:-0}" "$before" "$after" "$result"
done
exit $failed
