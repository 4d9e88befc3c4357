#!/usr/bin/env bash
# The gather limit's loops held to the kernel's load order read a row's vectors in line order
# in the machine code. The limit adds integers, which associate, and GCC 12 regrouped a row's
# adds into a tree that loaded its lines out of order (0x0, 0x100, 0x200, 0x240, 0x340, 0x40,
# ...), where the kernel's floating-point adds keep the row's order; an empty asm on each
# accumulator (gather_add_in_order512 and gather_add_in_order256 in tools/bench/bench_limits.c)
# holds the kernel's order, and a compiler that saw through it would leave the sums right and
# only the limit slower, which no other test sees. In every definition of each named function,
# within straight-line code (from one jump to the next), the integer vector adds that read
# memory through the same address registers must read ascending offsets; a function with no
# such add fails (renamed, or the adds no longer read memory: the check would see nothing).
# Usage: check_load_order.sh FILE FUNCTION...
set -euo pipefail
file=${1:?usage: check_load_order.sh FILE FUNCTION...}
shift
[ $# -gt 0 ] || { echo "check_load_order: no function named" >&2; exit 2; }
command -v objdump >/dev/null ||
	{ echo "check_load_order: objdump (binutils) is missing" >&2; exit 1; }
[ -f "$file" ] || { echo "check_load_order: no file $file" >&2; exit 1; }

# One line per definition of a named function: its name, its adds from memory and how many of
# them read a lower offset than the add before them through the same registers, then the first
# such add.
report=$(objdump -d --no-show-raw-insn "$file" | awk -v names="$*" '
	function hex(s,   v, i, neg) {
		neg = substr(s, 1, 1) == "-"
		if (neg)
			s = substr(s, 2)
		sub(/^0x/, "", s)
		v = 0
		for (i = 1; i <= length(s); i++)
			v = v * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
		return neg ? -v : v
	}
	BEGIN { n = split(names, list, " "); for (i = 1; i <= n; i++) wanted[list[i]] = 1 }
	/^[0-9a-f]+ <[^>]+>:$/ {
		fn = substr($2, 2, length($2) - 3)
		split("", last)
		if (fn in wanted) { defs++; name[defs] = fn; adds[defs] = 0; bad[defs] = 0 }
		else fn = ""
		next
	}
	fn == "" { next }
	/\tj[a-z]+ / || /\tret/ { split("", last); next }
	/\tv?padd[bwdq] .*\(%/ {
		operand = $0
		sub(/^.*\tv?padd[bwdq] +/, "", operand)
		split(operand, part, "(")
		regs = part[2]
		sub(/\).*/, "", regs)
		offset = part[1] == "" ? 0 : hex(part[1])
		adds[defs]++
		if ((regs in last) && offset < last[regs] && bad[defs]++ == 0)
			first[defs] = $0
		last[regs] = offset
	}
	END { for (i = 1; i <= defs; i++) print name[i], adds[i], bad[i], first[i] }')

status=0
for fn in "$@"; do
	defs=$(awk -v fn="$fn" '$1 == fn' <<<"$report")
	if [ -z "$defs" ]; then
		echo "check_load_order: $file defines no function $fn (inlined or renamed?)" >&2
		status=1
		continue
	fi
	while read -r name adds bad first; do
		if [ "$adds" -eq 0 ]; then
			echo "check_load_order: a definition of $name in $file has no add from memory" >&2
			status=1
		elif [ "$bad" -gt 0 ]; then
			echo "check_load_order: $name in $file: $bad of $adds adds from memory read a" \
			     "lower offset than the one before them, first: $first" >&2
			status=1
		else
			echo "check_load_order: $name in $file: $adds adds from memory in line order"
		fi
	done <<<"$defs"
done
exit $status
