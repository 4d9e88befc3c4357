#!/usr/bin/env bash
# daemon/embd.service's socket directory against allowed_uids: embd runs as its own user (here
# uid 65534, its own group, no other groups) in a socket directory made as systemd makes
# RuntimeDirectory= (owned by that user, mode RuntimeDirectoryMode= read from the unit), with
# a config that allows a uid outside that group. That uid must reach the socket and connect
# (`embctl status`), and a uid the config does not name must be refused by embd itself.
# The directory must therefore let others traverse it: the socket's mode, which embd sets
# from allowed_uids and allowed_gids (daemon/config.h, embd_config_socket_mode), and
# SO_PEERCRED decide who connects, not the directory (a mode 0750 directory kept every
# allowed uid outside group embd out with EACCES before embd saw it).
# Needs root (setpriv to other uids); exits 77 (skipped) without it.
# Usage: check_runtime_dir.sh EMBD_BINARY EMBCTL_BINARY UNIT_FILE
set -euo pipefail
embd=${1:?usage: check_runtime_dir.sh EMBD_BINARY EMBCTL_BINARY UNIT_FILE}
embctl=${2:?usage: check_runtime_dir.sh EMBD_BINARY EMBCTL_BINARY UNIT_FILE}
unit=${3:?usage: check_runtime_dir.sh EMBD_BINARY EMBCTL_BINARY UNIT_FILE}

if [ "$(id -u)" != 0 ] || ! command -v setpriv >/dev/null; then
  echo "check_runtime_dir: needs root and setpriv: skipped" >&2
  exit 77
fi
service_uid=65534 allowed_uid=4242 stranger_uid=4243
# systemd's default when the unit says nothing
mode=$(sed -n 's/^RuntimeDirectoryMode=//p' "$unit" | tail -n 1)
mode=${mode:-0755}

work=$(mktemp -d /tmp/embd-rundir.XXXXXX)
embd_pid=
cleanup() {
  [ -n "$embd_pid" ] && kill -KILL "$embd_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
chmod 0755 "$work"
as() { local u=$1; shift; setpriv --reuid="$u" --regid="$u" --clear-groups "$@"; }

# /run/embd as systemd creates it for User=, Group= and RuntimeDirectoryMode=
rundir=$work/run/embd
mkdir -p "$rundir"
chmod 0755 "$work/run"
chown "$service_uid:$service_uid" "$rundir"
chmod "$mode" "$rundir"
"$embd" --print-default-config |
  sed "0,/{/s//{ \"allowed_uids\": [$service_uid, $allowed_uid], \"allowed_gids\": [],/" \
  >"$work/embd.json"
chmod 0644 "$work/embd.json"
setpriv --reuid="$service_uid" --regid="$service_uid" --clear-groups \
  "$embd" --config "$work/embd.json" --socket "$rundir/embd.sock" >/dev/null 2>"$work/embd.log" &
embd_pid=$!
for _ in $(seq 100); do
  [ -S "$rundir/embd.sock" ] && break
  kill -0 "$embd_pid" 2>/dev/null || break
  sleep 0.1
done
if ! [ -S "$rundir/embd.sock" ]; then
  echo "check_runtime_dir: embd did not come up as uid $service_uid:" >&2
  cat "$work/embd.log" >&2
  exit 1
fi
sleep 0.2      # the socket exists at bind(), listen() follows

status=0
if ! as "$allowed_uid" "$embctl" status --socket "$rundir/embd.sock" >"$work/out" 2>&1; then
  echo "check_runtime_dir: uid $allowed_uid is in allowed_uids but not in the service's" \
    "group, and cannot connect through a RuntimeDirectoryMode=$mode directory:" >&2
  cat "$work/out" >&2
  status=1
fi
if as "$stranger_uid" "$embctl" status --socket "$rundir/embd.sock" >"$work/out" 2>&1; then
  echo "check_runtime_dir: uid $stranger_uid is in no allowed list and was served" >&2
  status=1
fi
[ "$status" = 0 ] && echo "check_runtime_dir: RuntimeDirectoryMode=$mode: an allowed uid" \
  "outside the service's group connects, another uid is refused"
exit $status
