#!/usr/bin/env bash
# The Debian packages installed into a clean Debian root, the way an operator installs them:
# a debootstrap minbase root (cached as a tarball after the first run), `apt-get install` of
# the three .deb files, which must pull every library embd needs from Debian through the
# packages' Depends alone. Then, inside that root:
#   - the files of each package, the conffile, the system user and group embd
#   - embd --version / --print-default-config, embctl plan --config /etc/embd/embd.conf
#   - embd started as the unit starts it, emulated without systemd: user and group embd, no
#     capabilities, no new privileges, the file system read-only but for /run/embd and
#     /var/lib/embd, a private /tmp, umask 0027; it must become ready, serve root's
#     `embctl status` with the plan `embctl plan --config` printed, serve a trainer built
#     against libembdclient-dev (pkg-config) whose user is in group embd, refuse a user who
#     is not, write a checkpoint into /var/lib/embd where the group can export it, stop at
#     SIGTERM and restore that checkpoint at the next start
#   - systemd-analyze verify on the installed unit (tests/pkg/check_unit.sh)
#   - purge keeps the user and the checkpoints; reinstalling finds them
#   - then, with systemd-nspawn (systemd-container), the root boots with systemd as PID 1 and
#     embd.service runs under every setting of its unit, seccomp filter included
#     (tests/pkg/boot_check.sh): started, sandboxed, serving, checkpointing, stopped cleanly
#
# Needs root (chroot, mounts, users), debootstrap, gcc, pkg-config and the network to a Debian
# mirror (EMBD_DEBIAN_MIRROR, default deb.debian.org), about 2 minutes the first time and
# under one with the cached root: opt-in, not in the default suite (ctest -L package in a build
# configured with -DEMBD_PACKAGE_TEST=ON, or run it directly after tools/build-packages.sh).
# Usage: test_install.sh [--build | PACKAGE_DIR]   (default build-pkg/packages; --build runs
# tools/build-packages.sh first)
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
if [ "${1:-}" = --build ]; then
  bash tools/build-packages.sh
  shift
fi
packages=$(realpath "${1:-build-pkg/packages}")
cache=$(realpath -m "${EMBD_PKG_CACHE:-build-pkg/cache}")
mirror=${EMBD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm

if [ "$(id -u)" != 0 ]; then
  echo "test_install: needs root (chroot, mounts, users)" >&2
  exit 1
fi
for tool in debootstrap chroot unshare gcc pkg-config; do
  command -v "$tool" >/dev/null || { echo "test_install: $tool not found" >&2; exit 1; }
done
debs=("$packages"/embd_*.deb "$packages"/libembdclient0_*.deb "$packages"/libembdclient-dev_*.deb)
for deb in "${debs[@]}"; do
  [ -f "$deb" ] || { echo "test_install: $deb missing (tools/build-packages.sh)" >&2; exit 1; }
done
# Every mount below lives in a mount namespace of this script's own, so none outlives it.
if [ -z "${EMBD_TEST_INSTALL_NS:-}" ]; then
  exec unshare --mount --propagation private env EMBD_TEST_INSTALL_NS=1 bash "$0" "$packages"
fi

work=$(mktemp -d /tmp/embd-install.XXXXXX)
root=$work/root
embd_pid=
cleanup() {
  [ -n "$embd_pid" ] && kill -KILL "$embd_pid" 2>/dev/null
  umount -R "$root/proc" "$root/sys" "$root/dev" "$root/var/cache/apt/archives" 2>/dev/null || true
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

checks=0
failed=0
check() {         # check DESCRIPTION COMMAND...: runs COMMAND, counts and reports the result
  local what=$1; shift
  checks=$((checks + 1))
  if "$@" >"$work/out" 2>&1; then
    echo "ok   $what"
  else
    failed=$((failed + 1))
    echo "FAIL $what"
    sed 's/^/     /' "$work/out" | tail -20
  fi
}
in_root() { chroot "$root" "$@"; }
as_user() { local u=$1; shift; chroot "$root" setpriv --reuid="$u" --regid="$u" --init-groups "$@"; }

# ---- a clean root ---------------------------------------------------------------------------
mkdir -p "$cache/archives/partial"
if [ ! -f "$cache/$suite-minbase.tar" ]; then
  echo "test_install: debootstrap --variant=minbase $suite from $mirror"
  debootstrap --variant=minbase "$suite" "$work/base" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }
  tar -C "$work/base" -cf "$cache/$suite-minbase.tar.tmp" .
  mv "$cache/$suite-minbase.tar.tmp" "$cache/$suite-minbase.tar"
  rm -rf --one-file-system "$work/base"
fi
mkdir "$root"
tar -C "$root" -xf "$cache/$suite-minbase.tar"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
mount -t sysfs -o ro sysfs "$root/sys"
mount --bind /dev "$root/dev"
mount --bind "$cache/archives" "$root/var/cache/apt/archives"

# ---- install --------------------------------------------------------------------------------
in_root dpkg-query -W -f='${Package}\n' | sort >"$work/before"
mkdir "$root/tmp/debs"
cp "${debs[@]}" "$root/tmp/debs/"
in_root apt-get update -qq >"$work/apt.log" 2>&1 || { cat "$work/apt.log"; exit 1; }
check "apt-get install of the three packages resolves their Depends from $suite" \
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  $(cd "$root" && ls tmp/debs/*.deb | sed 's|^|/|')
in_root dpkg-query -W -f='${Package}\n' | sort >"$work/after"
pulled=$(comm -13 "$work/before" "$work/after" | tr '\n' ' ')

for p in embd libembdclient0 libembdclient-dev; do
  check "$p is installed" sh -c "chroot '$root' dpkg-query -W -f='\${Status}' $p | grep -qx 'install ok installed'"
done
files=(/usr/bin/embd /usr/bin/embctl /usr/lib/systemd/system/embd.service /etc/embd/embd.conf
  /usr/share/man/man8/embd.8.gz /usr/share/man/man8/embctl.8.gz /usr/share/man/man5/embd.conf.5.gz
  /usr/share/man/man3/libembdclient.3.gz /usr/share/bash-completion/completions/embctl
  /usr/lib/x86_64-linux-gnu/libembdclient.so.0 /usr/lib/x86_64-linux-gnu/libembdclient.so
  /usr/lib/x86_64-linux-gnu/libembdclient.a /usr/lib/x86_64-linux-gnu/pkgconfig/embdclient.pc
  /usr/include/embd/client.h /usr/include/embd/types.h)
for f in "${files[@]}"; do
  check "$f" test -e "$root$f"
done
check "/etc/embd/embd.conf is a conffile of embd" \
  sh -c "chroot '$root' dpkg-query -W -f='\${Conffiles}' embd | grep -q ' /etc/embd/embd.conf '"
check "ldd: embd and embctl find every library" \
  sh -c "! chroot '$root' ldd /usr/bin/embd /usr/bin/embctl | grep 'not found'"

# ---- the user -------------------------------------------------------------------------------
user_is_system() {
  local entry uid gid
  entry=$(in_root getent passwd embd) || return 1
  IFS=: read -r _ _ uid gid _ home shell <<<"$entry"
  echo "$entry"
  [ "$uid" -lt 1000 ] && [ "$home" = /var/lib/embd ] && [ "$shell" = /usr/sbin/nologin ] &&
    [ "$gid" = "$(in_root getent group embd | cut -d: -f3)" ]
}
check "system user embd (uid < 1000, home /var/lib/embd, nologin, primary group embd)" user_is_system
embd_uid=$(in_root id -u embd)
embd_gid=$(in_root id -g embd)

# ---- the binaries ---------------------------------------------------------------------------
check "embd --version" sh -c "chroot '$root' embd --version | grep -qx 'embd [0-9.]*'"
check "embctl --version" sh -c "chroot '$root' embctl --version | grep -qx 'embctl [0-9.]*'"
check "embd --print-default-config runs as user embd" \
  sh -c "chroot '$root' setpriv --reuid=embd --regid=embd --init-groups embd --print-default-config | grep -q '\"tables\"'"
plan_hash() { grep -o '"plan_hash": *"[0-9a-f]*"' | grep -o '[0-9a-f]\{16\}'; }
check "embctl plan --config /etc/embd/embd.conf" in_root embctl plan --config /etc/embd/embd.conf
preview=$(in_root embctl plan --config /etc/embd/embd.conf --json | plan_hash || true)

# ---- the service, sandboxed as its unit sandboxes it ----------------------------------------
in_root useradd --no-create-home --groups embd trainer
in_root useradd --no-create-home stranger
unit_mode() { sed -n "s/^$1=//p" "$root/usr/lib/systemd/system/embd.service" | tail -n 1; }
for d in "/run/embd RuntimeDirectoryMode" "/var/lib/embd StateDirectoryMode"; do
  set -- $d                                 # the directory as the unit's setting makes it
  mkdir -p "$root$1"
  chown "$embd_uid:$embd_gid" "$root$1"
  chmod "$(unit_mode "$2")" "$root$1"
done
start_embd() {
  : >"$work/embd.log"
  unshare --mount --propagation private sh -c '
    root=$1
    mount --rbind "$root" "$root" &&
    mount --bind "$root/run/embd" "$root/run/embd" &&
    mount --bind "$root/var/lib/embd" "$root/var/lib/embd" &&
    mount -t tmpfs tmpfs "$root/tmp" && mount -t tmpfs -o ro tmpfs "$root/home" &&
    mount -o remount,bind,ro "$root" &&
    exec chroot "$root" setpriv --reuid=embd --regid=embd --init-groups --no-new-privs \
      --bounding-set=-all --inh-caps=-all sh -c "umask 0027; exec /usr/bin/embd --config /etc/embd/embd.conf"
  ' sh "$root" 2>>"$work/embd.log" &
  embd_pid=$!
  for _ in $(seq 100); do
    grep -q "ready" "$work/embd.log" && return 0
    kill -0 "$embd_pid" 2>/dev/null || break
    sleep 0.1
  done
  cat "$work/embd.log"
  return 1
}
stop_embd() {
  local st=0
  kill -TERM "$embd_pid"
  wait "$embd_pid" || st=$?
  embd_pid=
  cat "$work/embd.log"
  return $st
}
check "embd starts as embd:embd, no capabilities, read-only / (ready)" start_embd
check "the socket is /run/embd/embd.sock, mode 0660, owned by embd:embd" \
  test "$(stat -c '%a %u:%g' "$root/run/embd/embd.sock")" = "660 $embd_uid:$embd_gid"
served=$(in_root embctl status | plan_hash || true)
check "root's embctl status: plan $served, the plan embctl plan --config printed ($preview)" \
  test -n "$served" -a "$served" = "$preview"

# a trainer compiled against the installed -dev package through its pkg-config file
flags=$(PKG_CONFIG_SYSROOT_DIR="$root" PKG_CONFIG_LIBDIR="$root/usr/lib/x86_64-linux-gnu/pkgconfig" \
  pkg-config --cflags --libs embdclient)
check "a trainer builds with pkg-config embdclient: $flags" \
  gcc -Wall -Werror -o "$root/usr/local/bin/client_nop" "$repo/tests/pkg/client_nop.c" $flags
check "a member of group embd connects and makes a round trip" as_user trainer /usr/local/bin/client_nop
check "a member of group embd reads embctl stats" as_user trainer embctl stats
check "a user outside group embd is refused" sh -c "chroot '$root' setpriv --reuid=stranger \
  --regid=stranger --init-groups /usr/local/bin/client_nop; [ \$? = 3 ]"

check "a member of group embd takes a checkpoint (embctl checkpoint --wait)" \
  as_user trainer embctl checkpoint --wait
check "SIGTERM: embd exits 0" stop_embd
check "the checkpoint is in /var/lib/embd, owned by embd" \
  sh -c "ls -ld '$root'/var/lib/embd/step-* && [ \"\$(stat -c %u '$root'/var/lib/embd/step-*/manifest.json)\" = $embd_uid ]"
check "group embd exports a table from it (embctl export --config)" \
  as_user trainer embctl export --config /etc/embd/embd.conf --table category -o /tmp/category.npy
check "embd starts again" start_embd
check "... restoring that checkpoint" grep "restored /var/lib/embd/step-" "$work/embd.log"
check "SIGTERM again: embd exits 0" stop_embd

check "systemd-analyze verify and security on the installed unit" \
  bash "$repo/tests/pkg/check_unit.sh" "$root/usr/bin/embd" "$root/usr/lib/systemd/system/embd.service"
for page in "$root"/usr/share/man/man*/*embd*.gz "$root"/usr/share/man/man8/embctl.8.gz; do
  check "man ${page##*/} renders" sh -c "zcat '$page' | groff -man -ww -z -Tutf8 2>&1 | (! grep .)"
done

# ---- purge and reinstall --------------------------------------------------------------------
check "apt-get purge embd" in_root env DEBIAN_FRONTEND=noninteractive apt-get purge -y -q embd
check "purge removed the binaries and /etc/embd" sh -c "[ ! -e '$root/usr/bin/embd' ] && [ ! -e '$root/etc/embd' ]"
check "purge kept the user embd and the checkpoints" \
  sh -c "chroot '$root' getent passwd embd && ls -d '$root'/var/lib/embd/step-*"
check "reinstalling embd finds its user again" sh -c "chroot '$root' env DEBIAN_FRONTEND=noninteractive \
  dpkg -i /tmp/debs/$(basename "${debs[0]}") && [ \"\$(chroot '$root' id -u embd)\" = $embd_uid ]"

# ---- the unit under a booted systemd ---------------------------------------------------------
# The sandbox above is an emulation; systemd-nspawn boots the root with systemd as PID 1 and
# tests/pkg/boot_check.sh runs embd.service there with all of its unit's settings.
if command -v systemd-nspawn >/dev/null; then
  check "apt-get install systemd into the root" in_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends systemd systemd-sysv dbus
  rm -rf "$root"/var/lib/embd/step-*
  install -m 755 "$repo/tests/pkg/boot_check.sh" "$root/usr/local/bin/embd-boot-check"
  printf '[Unit]\nAfter=multi-user.target\n[Service]\nType=oneshot\nExecStart=%s\n' \
    /usr/local/bin/embd-boot-check >"$root/etc/systemd/system/embd-boot-check.service"
  ln -s /etc/systemd/system/embd-boot-check.service \
    "$root/etc/systemd/system/multi-user.target.wants/embd-boot-check.service"
  umount -R "$root/proc" "$root/sys" "$root/dev" "$root/var/cache/apt/archives"
  # --keep-unit --register=no: no systemd runs on this host to hold the container's scope
  check "the root boots with systemd-nspawn and powers itself off" timeout 180 systemd-nspawn -q \
    --boot --directory="$root" --register=no --keep-unit --console=pipe
  log=$root/var/log/embd-boot-check.log
  check "boot_check ran to its end" grep -qx "boot_check: done" "$log"
  grep -E '^(ok|FAIL) ' "$log" | sed 's/^/     /' || true
  checks=$((checks + $(grep -c '^ok ' "$log" || true) + $(grep -c '^FAIL ' "$log" || true)))
  failed=$((failed + $(grep -c '^FAIL ' "$log" || true)))
  grep -q '^FAIL ' "$log" && cat "$log"
else
  echo "skip the unit under a booted systemd: systemd-nspawn not found (systemd-container)"
fi

echo "test_install: $((checks - failed)) of $checks checks passed; apt pulled in: $pulled"
[ "$failed" = 0 ]
