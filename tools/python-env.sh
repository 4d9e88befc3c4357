#!/usr/bin/env bash
# Makes, or reuses, the Python environment embd's Python tests and examples run in: a
# virtualenv (.venv/, or $EMBD_VENV) holding torch, TorchRec and the CPU build of FBGEMM from
# PyPI, plus the embd package built against this tree's libembdclient ($EMBD_BUILD_DIR, default
# build/). TorchRec declares a dependency on the CUDA build `fbgemm-gpu`; it is installed without
# its dependencies so only `fbgemm-gpu-cpu` (same Python module, CPU kernels) is present.
# A fresh environment takes ~150 s and ~5.5 GB (torch from PyPI brings the CUDA libraries).
# Prints the environment's python on the last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${EMBD_VENV:-.venv}
build=${EMBD_BUILD_DIR:-build}
deps=(torch==2.14.1 fbgemm-gpu-cpu==1.9.0 tensordict torchmetrics==1.0.3 tqdm pyre-extensions
      numpy pytest setuptools wheel)
torchrec=torchrec==1.9.2
want="${deps[*]} $torchrec"
# Small test-only packages, installed into an existing environment without remaking it:
# prometheus_client's text parser reads embd's /metrics (tests/python/test_metrics.py).
extra=(prometheus_client==0.26.0)

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.embd-deps" 2>/dev/null)" != "$want" ]; then
  start=$(date +%s)
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "${deps[@]}" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$torchrec" >&2
  echo "$want" > "$venv/.embd-deps"
  echo "python-env: made $venv in $(( $(date +%s) - start )) s" >&2
fi
if [ "$(cat "$venv/.embd-extra" 2>/dev/null)" != "${extra[*]}" ]; then
  "$venv/bin/pip" install -q --disable-pip-version-check "${extra[@]}" >&2
  echo "${extra[*]}" > "$venv/.embd-extra"
fi

# The extension links libembdclient from the build folder; rebuilt every time so it matches
# the library the C suites just built.
EMBD_BUILD_DIR=$(cd "$build" && pwd) "$venv/bin/pip" install -q --disable-pip-version-check \
  --no-deps --no-build-isolation --force-reinstall ./python >&2
echo "$venv/bin/python"
