# bash completion for embctl(8): commands, each command's flags, and files or directories
# after the flags that take them. The topology flags of `embctl plan` come from `embctl plan
# --help`, the planner's own list; tests/man/check_man.sh checks every other flag is here.
# Plain bash (compgen), so it works with or without the bash-completion package.

_embctl_plan_topology_flags()
{
	"${COMP_WORDS[0]}" plan --help 2>/dev/null | sed -n 's/^  \(--[a-z-]*\)$/\1/p'
}

_embctl()
{
	local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD - 1]}
	local command=${COMP_WORDS[1]} flags

	COMPREPLY=()
	if [ "$COMP_CWORD" -eq 1 ]; then
		COMPREPLY=($(compgen -W "plan stats status checkpoint export import --help --version" \
			-- "$cur"))
		return
	fi
	case "$command:$prev" in
	plan:--tables | plan:--topology | plan:--check | plan:--config | plan:-o | \
	export:--config | export:-c | import:--config | import:-c)
		COMPREPLY=($(compgen -f -- "$cur"))
		return ;;
	export:--output | export:-o | import:--input | import:-i)
		COMPREPLY=($(compgen -f -X '!*.npy' -- "$cur") $(compgen -d -- "$cur"))
		return ;;
	export:--dir | export:-d | import:--dir | import:-d)
		COMPREPLY=($(compgen -d -- "$cur"))
		return ;;
	stats:--socket | stats:-s | status:--socket | status:-s | checkpoint:--socket | \
	checkpoint:-s)
		COMPREPLY=($(compgen -f -- "$cur"))
		return ;;
	stats:--watch | stats:-w | checkpoint:--timeout | checkpoint:-t | *:--table | *:-t | *:--step | \
	export:-s | import:-s)
		return ;;             # a number or a table name
	esac
	case "$command" in
	plan) flags="--tables --config --topology --json -o --check --greedy-only --help
		     $(_embctl_plan_topology_flags)" ;;
	stats) flags="--socket --json --watch --help" ;;
	status) flags="--socket --help" ;;
	checkpoint) flags="--socket --wait --timeout --help" ;;
	export) flags="--table --step --dir --config --output --help" ;;
	import) flags="--config --dir --step --table --input --help" ;;
	*) return ;;
	esac
	[[ "$cur" == -* || -z "$cur" ]] && COMPREPLY=($(compgen -W "$flags" -- "$cur"))
}

complete -F _embctl embctl
