#!/usr/bin/env bash
# The prefetches the kernels and their limits are tuned on are in the machine code: every
# definition of each named function in the object, archive member or program holds at least one
# x86 prefetch instruction. A compiler may drop __builtin_prefetch (GCC 12 deletes calls to a
# function that only prefetches unless it is always_inline, cpu_kernels.h) and a change to a
# shared helper may lose it; either leaves the results right and only the speed wrong, which no
# other test sees. A function passes while any one of its paths prefetches. The functions are
# kept out of line (noinline) so that they have names here; a compiler's clone of one
# (lean_bags.constprop.0) is not looked for: the test then fails saying the function is gone.
# --insn asks for one kind of prefetch: the prefetches into L1 (prefetcht0) are a few rules'
# alone (embd_forward_prefetch_l1_near,
# embd_backward_prefetch_l1_near, the forward's LEAN_WEIGHTS_AHEAD), beside the many into L2
# in the same functions, so only their own kind shows that they are still there.
# Usage: check_prefetch.sh [--member NAME] [--insn PREFETCH] FILE FUNCTION...
#   (NAME: an archive member; PREFETCH: prefetcht0, prefetcht1, prefetcht2, prefetchnta,
#   prefetchw or prefetchwt1)
set -euo pipefail
usage="usage: check_prefetch.sh [--member NAME] [--insn PREFETCH] FILE FUNCTION..."
member=
insn='prefetch(t0|t1|t2|nta|w|wt1)'
what=prefetch
while [ $# -gt 0 ]; do
	case $1 in
	--member) member=${2:?$usage}; shift 2 ;;
	--insn)
		case ${2:-} in
		prefetcht0 | prefetcht1 | prefetcht2 | prefetchnta | prefetchw | prefetchwt1) ;;
		*) echo "check_prefetch: --insn ${2:-}: not an x86 prefetch instruction" >&2
		   exit 2 ;;
		esac
		insn=$2
		what=$2
		shift 2 ;;
	*) break ;;
	esac
done
file=${1:?$usage}
shift
[ $# -gt 0 ] || { echo "check_prefetch: no function named" >&2; exit 2; }
target=$file${member:+ ($member)}
command -v objdump >/dev/null ||
	{ echo "check_prefetch: objdump (binutils) is missing" >&2; exit 1; }
[ -f "$file" ] || { echo "check_prefetch: no file $file" >&2; exit 1; }

# One line per definition of a named function: its name and its prefetch instructions.
# objdump starts each archive member with "MEMBER:     file format ...".
counts=$(objdump -d --no-show-raw-insn "$file" | awk -v member="$member" -v names="$*" \
	-v insn="$insn" '
	BEGIN { n = split(names, list, " "); for (i = 1; i <= n; i++) wanted[list[i]] = 1 }
	/file format/ { in_member = member == "" || $1 == member ":"; fn = ""; next }
	!in_member { next }
	/^[0-9a-f]+ <[^>]+>:$/ {
		fn = substr($2, 2, length($2) - 3)
		if (fn in wanted) { defs++; name[defs] = fn; hits[defs] = 0 } else fn = ""
		next
	}
	fn != "" && $0 ~ ("[\t ]" insn "[\t ]") { hits[defs]++ }
	END { for (i = 1; i <= defs; i++) print name[i], hits[i] }')

status=0
for fn in "$@"; do
	defs=$(awk -v fn="$fn" '$1 == fn' <<<"$counts")
	if [ -z "$defs" ]; then
		echo "check_prefetch: $target defines no function $fn (inlined or renamed?)" >&2
		status=1
		continue
	fi
	while read -r name hits; do
		if [ "$hits" -eq 0 ]; then
			echo "check_prefetch: a definition of $name in $target has no $what" \
			     "instruction" >&2
			status=1
		else
			echo "check_prefetch: $name in $target: $hits $what instructions"
		fi
	done <<<"$defs"
done
exit $status
