#!/usr/bin/env bash
# The module arrows of docs/architecture.md, checked on the sources: every `#include "dir/..."`
# of a product folder names a folder that folder may use, no private header (`*_internal.h`,
# `*.cuh`) is included from another folder, and no file points outside the repository.
# Prints the share of product lines per folder. Exit 1 on the first kind of violation found.
set -euo pipefail
cd "$(dirname "$0")/../.."

# folder -> the folders its sources may include (include/embd is everyone's)
declare -A allowed=(
  [common]="common"
  [kernels]="kernels common"
  [planner]="planner common"
  [ipc]="ipc common"
  [dist]="dist planner common"
  [engine]="engine kernels planner dist common"
  [ckpt]="ckpt engine dist kernels planner common"
  [daemon]="daemon ckpt engine dist ipc kernels planner common"
  [libclient]="libclient ipc common"
)
# engine may use dist's comm interface and store, not its engines or rendezvous internals
declare -A allowed_files=(
  [engine:dist]="dist/comm.h dist/store.h"
)

status=0
fail() { echo "check_layout: $*" >&2; status=1; }

for dir in "${!allowed[@]}"; do
  while IFS= read -r file; do
    while IFS= read -r inc; do
      target=${inc%%/*}
      [ "$target" = "embd" ] && continue          # include/embd: public
      [ "$inc" = "$target" ] && continue           # a same-folder include without a path
      if ! [[ " ${allowed[$dir]} " == *" $target "* ]]; then
        fail "$file includes $inc: $dir may not use $target"
        continue
      fi
      if [ "$target" != "$dir" ]; then
        case "$inc" in
          *_internal.h|*.cuh) fail "$file includes $inc, private to $target" ;;
        esac
        only=${allowed_files[$dir:$target]:-}
        if [ -n "$only" ] && ! [[ " $only " == *" $inc "* ]]; then
          fail "$file includes $inc: $dir may use only $only of $target"
        fi
      fi
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$file")
  done < <(find "$dir" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \))
done

# Tests may include their own module's private headers, nobody else's.
while IFS= read -r file; do
  module=$(echo "$file" | cut -d/ -f3)
  while IFS= read -r inc; do
    target=${inc%%/*}
    case "$inc" in
      *_internal.h|*.cuh) [ "$target" = "$module" ] || fail "$file includes $inc, private to $target" ;;
    esac
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$file")
done < <(find tests/unit -type f \( -name '*.c' -o -name '*.h' \))

# Nothing in the repository refers to files outside it.
if outside=$(git grep -n -I -E '\.\./shared|DEVELOPERS\.md|STYLE\.md' -- . ':!tests/layout/check_layout.sh'); then
  fail "references outside the repository:"; echo "$outside" >&2
fi

total=0
declare -A lines=()
for dir in common kernels planner ipc engine dist ckpt daemon libclient include; do
  n=$(find "$dir" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
      xargs -0 cat | wc -l)
  lines[$dir]=$n
  total=$((total + n))
done
for dir in "${!lines[@]}"; do
  awk -v d="$dir" -v n="${lines[$dir]}" -v t="$total" 'BEGIN { printf "%-10s %6d lines  %4.1f%%\n", d, n, 100 * n / t }'
done | sort -k2 -n -r
exit $status
