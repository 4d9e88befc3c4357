#!/usr/bin/env bash
# Installs every Debian package embd builds, tests or benchmarks with.
# Idempotent: packages already present are left alone. Run as root (or with sudo).
set -euo pipefail

packages=(
  build-essential cmake pkg-config clang libclang-rt-14-dev
  liburing-dev libnuma-dev libcriterion-dev libgloo-dev libcjson-dev libsystemd-dev
  libmicrohttpd-dev
  python3 python3-numpy python3-venv python3-dev
  iproute2
  # packages, man pages and the unit: tools/build-packages.sh (dpkg-shlibdeps looks at the
  # binaries with file), tests/man/check_man.sh (groff), tests/pkg/check_unit.sh
  # (systemd-analyze), tests/pkg/test_install.sh (debootstrap, systemd-nspawn)
  dpkg-dev file groff-base systemd debootstrap systemd-container
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep 'install ok installed' >/dev/null || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: installed ${missing[*]}"
