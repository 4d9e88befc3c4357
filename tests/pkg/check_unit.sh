#!/usr/bin/env bash
# daemon/embd.service as systemd reads it: `systemd-analyze verify` over a throw-away root that
# holds the unit, /usr/bin/embd (the built binary) and the host's own units (so its
# dependencies resolve), then the hardening: `systemd-analyze security` must rate its
# exposure 2.0 or lower and the settings embd is known to run under must all be there.
# Usage: check_unit.sh EMBD_BINARY UNIT_FILE
set -euo pipefail
embd=${1:?usage: check_unit.sh EMBD_BINARY UNIT_FILE}
unit=${2:?usage: check_unit.sh EMBD_BINARY UNIT_FILE}

if ! command -v systemd-analyze >/dev/null; then
  echo "check_unit: systemd-analyze not found (tools/install-deps.sh installs systemd)" >&2
  exit 1
fi
host_units=/usr/lib/systemd/system
[ -f "$host_units/multi-user.target" ] || host_units=/lib/systemd/system

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/bin" "$root/etc/systemd/system" "$root/usr/lib/systemd"
cp "$embd" "$root/usr/bin/embd"
cp "$unit" "$root/etc/systemd/system/embd.service"
cp -r "$host_units" "$root/usr/lib/systemd/system"

status=0
# man pages: tests/man/check_man.sh checks the unit's Documentation= pages exist
if ! out=$(systemd-analyze verify --man=no --root="$root" embd.service 2>&1) || [ -n "$out" ]; then
  echo "check_unit: systemd-analyze verify: ${out:-failed}" >&2
  status=1
fi
if ! systemd-analyze security --offline=yes --root="$root" --threshold=20 embd.service >"$root/security" 2>&1; then
  echo "check_unit: exposure above 2.0:" >&2
  grep -E '✗|Overall' "$root/security" >&2 || cat "$root/security" >&2
  status=1
fi
for setting in User=embd Group=embd RuntimeDirectory=embd StateDirectory=embd Type=notify \
    NoNewPrivileges=yes CapabilityBoundingSet= ProtectSystem=strict ProtectHome=yes \
    PrivateTmp=yes "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK" \
    SystemCallFilter=@system-service "ExecStart=/usr/bin/embd --config /etc/embd/embd.conf"; do
  grep -qxF "$setting" "$unit" || { echo "check_unit: $unit lacks $setting" >&2; status=1; }
done
[ "$status" = 0 ] && echo "check_unit: verify clean, $(grep -o 'Overall exposure level[^:]*: [0-9.]*' "$root/security")"
exit $status
