#!/usr/bin/env bash
# Builds the Debian packages embd, libembdclient0 and libembdclient-dev (pkg/CMakeLists.txt)
# into build-pkg/packages/: a CPU build (EMBD_CUDA=OFF: the CUDA runtime and NCCL do not come
# from Debian packages, so no Depends could name them), installed under /usr, and only the
# targets the packages hold are built. EMBD_PKG_BUILD_DIR overrides build-pkg.
# tests/pkg/test_install.sh installs the result into a clean Debian root and checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${EMBD_PKG_BUILD_DIR:-build-pkg}

for tool in cpack dpkg-shlibdeps dpkg-deb file; do
  command -v "$tool" >/dev/null || { echo "build-packages: $tool not found (tools/install-deps.sh)" >&2; exit 1; }
done
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
  -DEMBD_CUDA=OFF -DEMBD_WERROR=ON -DCMAKE_SKIP_INSTALL_ALL_DEPENDENCY=ON >/dev/null
cmake --build "$dir" -j "${EMBD_JOBS:-$(nproc)}" --target embd embctl embdclient embdclient_static \
  embd_package_files
rm -f "$dir"/packages/*.deb
(cd "$dir" && cpack -G DEB)
for deb in "$dir"/packages/*.deb; do
  echo "== $deb ($(stat -c %s "$deb") bytes)"
  dpkg-deb --field "$deb" Package Version Depends
done
