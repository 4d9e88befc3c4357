#!/usr/bin/env bash
# The man pages and the bash completion against the code, so neither drifts from it:
#   embd.conf(5)     every key daemon/config.c reads (its key table, or the strcmp chain it
#                    replaced) and every topology field of the planner (from `embctl plan
#                    --help`, the planner's own list)
#   embd(8)          every long and short option of daemon/main.c
#   embctl(8)        every long and short option of tools/embctl/*.c and every topology flag
#   libembdclient(3) every function include/embd/client.h exports
#   the unit         every man: page of its Documentation= exists
#   completion       every embctl command and long option
# and every page renders without a groff warning.
# Usage: check_man.sh EMBCTL_BINARY (run from anywhere; paths are the repository's).
set -euo pipefail
cd "$(dirname "$0")/../.."
embctl=${1:?usage: check_man.sh EMBCTL_BINARY}

status=0
fail() { echo "check_man: $*" >&2; status=1; }

# A page's text as written: font escapes dropped, \- as -.
page_text() { sed -e 's/\\f[BIRP]//g' -e 's/\\f(..//g' -e 's/\\-/-/g' "$1"; }

# need PAGE WHAT WORD...: each WORD must appear in PAGE, not as part of a longer name.
need() {
  local page=$1 what=$2; shift 2
  local text
  text=$(page_text "$page")
  for word in "$@"; do
    grep -qE -- "(^|[^A-Za-z0-9_-])${word}([^A-Za-z0-9_-]|\$)" <<<"$text" ||
      fail "$page does not mention $what $word"
  done
}

# at_least N WHAT LIST: a guard that the extraction still matches the code.
at_least() {
  local n
  n=$(wc -w <<<"$3")
  [ "$n" -ge "$1" ] || fail "found only $n $2 (expected at least $1): the extraction no longer matches the code"
}

# Long options of getopt tables: { "name", required_argument|no_argument|optional_argument
long_opts() { { grep -ohE '\{ *"[a-z][a-z-]*", *(required|no|optional)_argument' "$@" || true; } | sed -E 's/\{ *"([a-z-]+)".*/--\1/' | sort -u; }
# Short options of getopt_long's optstring.
short_opts() { { grep -ohE 'getopt_long\([^,]+, *[^,]+, *"[^"]*"' "$@" || true; } | sed -E 's/.*"([^"]*)"/\1/' | tr -d ':\n' | fold -w1 | sort -u | sed 's/^/-/'; }

# daemon/config.c: the keys table ({ "name", parse_fn | NULL, ...) or strcmp(k, "name").
config_keys=$( { grep -ohE '^\s*\{ *"[a-z_]+", *(NULL|parse_[a-z_]+)' daemon/config.c || true
                 grep -ohE 'strcmp\(k, *"[a-z_]+"\)' daemon/config.c || true; } |
               sed -E 's/[^"]*"([a-z_]+)".*/\1/' | sort -u)
at_least 20 "config keys in daemon/config.c" "$config_keys"
need man/embd.conf.5 "config key" $config_keys

topology_flags=$("$embctl" plan --help | sed -n 's/^  \(--[a-z-]*\)$/\1/p')
at_least 10 "topology flags in embctl plan --help" "$topology_flags"
need man/embctl.8 "topology flag" $topology_flags
need man/embd.conf.5 "topology field" $(sed -e 's/^--//' -e 's/-/_/g' <<<"$topology_flags")

embctl_long=$(long_opts tools/embctl/*.c)
at_least 10 "long options in tools/embctl" "$embctl_long"
need man/embctl.8 "option" $embctl_long --version --help
need man/embctl.8 "short option" $(short_opts tools/embctl/*.c) -V

embd_long=$(long_opts daemon/main.c)
at_least 5 "long options in daemon/main.c" "$embd_long"
need man/embd.8 "option" $embd_long
need man/embd.8 "short option" $(short_opts daemon/main.c)

client_api=$( { grep -ohE 'EMBD_CLIENT_API [^(]*\bembd_[a-z_]+\(' include/embd/client.h || true; } | sed -E 's/.*\b(embd_[a-z_]+)\(/\1/' | sort -u)
at_least 8 "functions in include/embd/client.h" "$client_api"
need man/libembdclient.3 "function" $client_api

for doc in $(sed -n 's/^Documentation=//p' daemon/embd.service); do
  case "$doc" in
    man:*) page=${doc#man:}; name=${page%(*}; section=${page#*(}; section=${section%)}
           [ -f "man/$name.$section" ] || fail "embd.service: Documentation=$doc has no man/$name.$section" ;;
  esac
done

completion=tools/embctl/embctl.bash
commands=$(sed -n 's/^\t{ "\([a-z]*\)", "[^"]*", embctl_[a-z]* },$/\1/p' tools/embctl/embctl.c)
at_least 5 "commands in tools/embctl/embctl.c" "$commands"
need "$completion" "command" $commands
need "$completion" "option" $embctl_long --version

for page in man/*.[1-8]; do
  warnings=$(groff -man -ww -z -Tutf8 "$page" 2>&1 || true)
  [ -z "$warnings" ] || fail "$page: groff: $warnings"
done

[ "$status" = 0 ] && echo "check_man: $(wc -w <<<"$config_keys") config keys, $(wc -w <<<"$topology_flags") topology fields, $(wc -w <<<"$embctl_long") embctl and $(wc -w <<<"$embd_long") embd options, $(wc -w <<<"$client_api") client functions documented"
exit $status
