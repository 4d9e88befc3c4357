#!/usr/bin/env bash
# The installed embdclient.pc points at the headers and library of wherever the tree was
# installed (cmake --install --prefix), not at the prefix cmake was configured with: a trainer
# compiles and links with `pkg-config --cflags --libs embdclient` and runs against that library.
# usage: test_pc_prefix.sh BUILD_DIR [CC [sanitize|plain]]  (the build's compiler and flavour)
set -euo pipefail
build=$1 compiler=${2:-cc} flavour=${3:-plain}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/some/prefix
for component in client client_dev; do
  cmake --install "$build" --prefix "$prefix" --component "$component" >/dev/null
done
pc=$(find "$prefix" -name embdclient.pc)
[ -n "$pc" ] || { echo "no embdclient.pc under $prefix"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")
libdir=$(pkg-config --variable=libdir embdclient)
[ -e "$libdir/libembdclient.so" ] || { echo "pkg-config libdir $libdir has no libembdclient.so"; exit 1; }
# a sanitizer build's library needs its runtime in the program (clang links it into
# executables only, gcc loads libasan.so first): the trainer is built the same way
sanitize=()
if [ "$flavour" = sanitize ]; then
  sanitize=(-fsanitize=address,undefined)
fi
# shellcheck disable=SC2046
"$compiler" "${sanitize[@]}" -std=c11 -Wall -Werror -o "$tmp/client_nop" "$here/client_nop.c" $(pkg-config --cflags --libs embdclient)
# no service at that path: the installed library runs and reports it (exit 3)
set +e
LD_LIBRARY_PATH=$libdir "$tmp/client_nop" "$tmp/no-such.sock" 2>"$tmp/stderr"
rc=$?
set -e
[ "$rc" = 3 ] || { echo "client_nop exited $rc, want 3 (refused)"; cat "$tmp/stderr"; exit 1; }
libdir=$(realpath "$libdir")
LD_LIBRARY_PATH=$libdir ldd "$tmp/client_nop" | grep "$libdir/libembdclient.so" >/dev/null ||
  { echo "not linked to $libdir"; LD_LIBRARY_PATH=$libdir ldd "$tmp/client_nop"; exit 1; }
echo "embdclient.pc at $pc: compiled, linked and ran against $libdir"
