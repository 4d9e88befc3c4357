"""Issue 14's DLRM benchmark: steps/s of the DLRM example (examples/dlrm.py: TorchRec's DLRM on
synthetic Criteo-like data, 2 trainers under torchrun, the dense part under DDP over gloo)
with its tables in one embd (``--backend embd``) against the same model with TorchRec's own
sharded EmbeddingBagCollection (``--backend torchrec``: DistributedModelParallel over gloo,
FBGEMM's CPU kernels), on the same machine in the same run. Each round runs
examples/run_dlrm.sh once per backend, the order alternating between rounds; the figure of a
round is the example's own steps/s (its first step, the warm-up, left out); the line holds the
medians, every round, and the machine (CPU model, ISA, load average before and after).

    .venv/bin/python tools/bench/dlrm_bench.py [--rounds 5] [--steps 101] [-- dlrm.py flags]

The example's flags after ``--`` go to both backends (e.g. ``-- --batch-size 1024``). Needs
the build (``$EMBD_BUILD_DIR``, default build/) and the venv of tools/python-env.sh
(``$EMBD_VENV``, default .venv/).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[2]
# the example's last line: "embd: 100 steps in 5.0 s, 19.86 steps/s, ...; loss a -> b (...)"
SUMMARY = re.compile(r"^(embd|torchrec): (\d+) steps in [\d.]+ s, ([\d.]+) steps/s, .*"
                     r"loss [\d.]+ -> ([\d.]+)", re.M)


def cpu_model_and_isa() -> Tuple[str, str]:
    """The CPU model and the widest vector ISA its flags offer (as embd's kernels name it)."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    isa = ("avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if "avx2" in flags
           else "scalar")
    return model, isa


def one_run(backend: str, steps: int, extra: List[str], log: Path) -> Tuple[float, float, int]:
    """Steps/s, the final mean loss and the exit status of one run of the example with
    ``backend``. A run that printed its summary and then failed (a trainer's process group
    teardown has been seen to abort) keeps its figure; its status goes into the line."""
    args = ["bash", str(REPO / "examples" / "run_dlrm.sh"), "--backend", backend,
            "--steps", str(steps), "--print-every", str(steps - 1)] + extra
    with open(log, "w") as out:
        rc = subprocess.run(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            timeout=1800).returncode
    text = log.read_text(errors="replace")
    m = SUMMARY.search(text)
    if not m or m.group(1) != backend:
        raise RuntimeError(f"{backend}: run_dlrm.sh exited {rc} (log {log}):\n{text[-3000:]}")
    return float(m.group(3)), float(m.group(4)), rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=101, help="steps per run (the first is "
                    "warm-up)")
    ap.add_argument("--logs", help="keep every run's output in this folder")
    ap.add_argument("extra", nargs="*", help="dlrm.py flags for both backends (after --)")
    args = ap.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="embd-dlrm-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rates: Dict[str, List[float]] = {"embd": [], "torchrec": []}
    losses: Dict[str, List[float]] = {"embd": [], "torchrec": []}
    failed_exits: List[str] = []
    t0 = time.monotonic()
    for r in range(args.rounds):
        order = ("embd", "torchrec") if r % 2 == 0 else ("torchrec", "embd")
        for backend in order:
            log = logs / f"round{r}-{backend}.log"
            rate, loss, rc = one_run(backend, args.steps, args.extra, log)
            if rc:
                failed_exits.append(f"{log}: exit {rc}")
            rates[backend].append(rate)
            losses[backend].append(loss)
    e, t = statistics.median(rates["embd"]), statistics.median(rates["torchrec"])
    cpu, isa = cpu_model_and_isa()
    print(json.dumps({
        "name": "dlrm", "embd_steps_per_s": round(e, 3), "torchrec_steps_per_s": round(t, 3),
        "vs_torchrec": round(e / t, 3) if t > 0 else 0,
        "embd_rounds": rates["embd"], "torchrec_rounds": rates["torchrec"],
        "embd_final_loss": losses["embd"], "torchrec_final_loss": losses["torchrec"],
        "trainers": int(os.environ.get("EMBD_TRAINERS", "2")), "steps": args.steps - 1,
        "dlrm_flags": " ".join(args.extra), "failed_exits": failed_exits, "seconds": round(time.monotonic() - t0, 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": len(os.sched_getaffinity(0)), "cpu": cpu, "isa": isa,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
