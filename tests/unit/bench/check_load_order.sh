#!/usr/bin/env bash
# The gather limit's loops held to the kernel's load order read a row's vectors in line order
# in the machine code. The limit adds integers, which associate, and GCC 12 regrouped a row's
# adds into a tree that loaded its lines out of order (0x0, 0x100, 0x200, 0x240, 0x340, 0x40,
# ...), where the kernel's floating-point adds keep the row's order; an empty asm on each
# accumulator (gather_add_in_order512 and gather_add_in_order256 in tools/bench/bench_limits.c)
# holds the kernel's order, and a compiler that saw through it would leave the sums right and
# only the limit slower, which no other test sees. In every definition of each named function,
# within straight-line code, the row loads through the same address registers must read
# cache lines in ascending order (two halves of a line in either order); a definition with
# fewer than 16 row loads fails (renamed, or its loads no longer seen: nothing to check).
# Machine code of optimised builds only: at -O0, or with the sanitizers' checks between the
# loads, the rows' loads are not the kernel's (tools/bench/CMakeLists.txt registers it so).
# Usage: check_load_order.sh FILE FUNCTION...
set -euo pipefail
file=${1:?usage: check_load_order.sh FILE FUNCTION...}
shift
[ $# -gt 0 ] || { echo "check_load_order: no function named" >&2; exit 2; }
command -v objdump >/dev/null ||
	{ echo "check_load_order: objdump (binutils) is missing" >&2; exit 1; }
[ -f "$file" ] || { echo "check_load_order: no file $file" >&2; exit 1; }
min_loads=16

# One line per definition of a named function: its name, its row loads and how many of them read
# a lower cache line than the load before them through the same registers, then the first such
# load. A row load: a vector load or integer vector add whose source is memory addressed
# through registers other than the stack's and the instruction pointer. The registers'
# history is forgotten at every jump, call, return or trap (a new straight-line run) and a
# register's own when an instruction writes it (a new row).
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
	# a general register by its 64-bit name: eax, ax and al are rax; r8d is r8
	function canon(r) {
		sub(/^%/, "", r)
		if (r ~ /^r[0-9]+[dwb]$/)
			return substr(r, 1, length(r) - 1)
		if (r ~ /^e(ax|bx|cx|dx|si|di|bp|sp)$/)
			return "r" substr(r, 2)
		if (r ~ /^(ax|bx|cx|dx|si|di|bp|sp)$/)
			return "r" r
		if (r ~ /^[abcd]l$/)
			return "r" substr(r, 1, 1) "x"
		return r
	}
	# operands split at the commas outside parentheses into op[1..n]; returns n
	function operands(text,   n, depth, i, c, cur) {
		n = 0; depth = 0; cur = ""
		for (i = 1; i <= length(text); i++) {
			c = substr(text, i, 1)
			if (c == "(")
				depth++
			else if (c == ")")
				depth--
			if (c == "," && depth == 0) {
				op[++n] = cur; cur = ""
			} else
				cur = cur c
		}
		if (cur != "")
			op[++n] = cur
		return n
	}
	BEGIN {
		n = split(names, list, " ")
		for (i = 1; i <= n; i++)
			wanted[list[i]] = 1
		prefix = "^(cs|ds|es|ss|fs|gs|notrack|bnd|lock|rep|repz|repnz|repe|repne|" \
			 "data16|addr32)$"
		load = "^(v?padd[bwdq]|vmovdq[au](8|16|32|64)?|vmovup[sd]|vmovap[sd]|" \
		       "vinsert[fi](128|32x4|64x2|32x8|64x4))$"
	}
	/^[0-9a-f]+ <[^>]+>:$/ {
		fn = substr($2, 2, length($2) - 3)
		split("", last)
		if (fn in wanted) { defs++; name[defs] = fn; loads[defs] = 0; bad[defs] = 0 }
		else fn = ""
		next
	}
	fn == "" { next }
	{
		text = $0
		if (!sub(/^ *[0-9a-f]+:\t/, "", text))
			next
		sub(/[\t ]*#.*$/, "", text)
		nw = split(text, word, " ")
		for (w = 1; w <= nw && word[w] ~ prefix; w++)
			;
		if (w > nw)
			next
		mnemonic = word[w]
		args = ""
		for (i = w + 1; i <= nw; i++)
			args = args word[i]
		if (mnemonic ~ /^(j|call|ret|ud2|int3|hlt)/) {
			split("", last)
			next
		}
		nops = operands(args)
		if (mnemonic ~ load && nops >= 2) {
			for (i = 1; i < nops; i++) {
				if (op[i] !~ /\(/ || op[i] ~ /%(rsp|rbp|rip)/)
					continue
				split(op[i], part, "(")
				regs = part[2]
				sub(/\).*/, "", regs)
				line = int((part[1] == "" ? 0 : hex(part[1])) / 64)
				loads[defs]++
				if ((regs in last) && line < last[regs] && bad[defs]++ == 0)
					first[defs] = text
				last[regs] = line
			}
		}
		# the destination, when a general register, starts a new row through it
		if (nops >= 1 && op[nops] ~ /^%[a-z0-9]+$/) {
			written = canon(op[nops])
			for (key in last) {
				k = split(key, r, ",")
				for (i = 1; i <= k; i++)
					if (r[i] ~ /^%/ && canon(r[i]) == written) {
						delete last[key]
						break
					}
			}
		}
	}
	END { for (i = 1; i <= defs; i++) print name[i], loads[i], bad[i], first[i] }')

status=0
for fn in "$@"; do
	defs=$(awk -v fn="$fn" '$1 == fn' <<<"$report")
	if [ -z "$defs" ]; then
		echo "check_load_order: $file defines no function $fn (inlined or renamed?)" >&2
		status=1
		continue
	fi
	while read -r name loads bad first; do
		if [ "$loads" -lt "$min_loads" ]; then
			echo "check_load_order: a definition of $name in $file has $loads row" \
			     "loads, fewer than $min_loads: nothing to check" >&2
			status=1
		elif [ "$bad" -gt 0 ]; then
			echo "check_load_order: $name in $file: $bad of $loads row loads read a" \
			     "lower line than the one before them, first: $first" >&2
			status=1
		else
			echo "check_load_order: $name in $file: $loads row loads in line order"
		fi
	done <<<"$defs"
done
exit $status
