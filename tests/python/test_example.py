"""examples/run_dlrm.sh: TorchRec's DLRM trained by 2 torchrun trainers (trainer index from
LOCAL_RANK, the dense part under DDP over gloo) through one embd started by the script, on a
small version of the example's data; the loss falls and the summary line is printed, and with
--pipeline (embd.torch.TrainPipeline) it falls the same."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from support import BUILD, REPO


def run_example(*flags: str) -> "re.Match[str]":
    """The summary line of a small run of the example through embd."""
    env = dict(os.environ, EMBD_BUILD_DIR=str(BUILD), EMBD_VENV=sys.prefix)
    p = subprocess.run(["bash", str(REPO / "examples" / "run_dlrm.sh"), "--steps", "40",
                        "--print-every", "20", "--batch-size", "128", "--scale", "0.0001",
                        "--dim", "16", "--bottom", "32", "--top", "32", *flags],
                       env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    m = re.search(r"^embd: 39 steps in [\d.]+ s, ([\d.]+) steps/s, \d+ samples/s; loss "
                  r"([\d.]+) -> ([\d.]+) \(noise floor ([\d.]+)\)$", p.stdout, re.M)
    assert m, out[-4000:]
    return m


def test_dlrm_example_trains_through_embd() -> None:
    m = run_example()
    assert float(m.group(1)) > 0 and float(m.group(3)) < float(m.group(2)), m.group(0)


def test_dlrm_example_pipelined_trains_the_same() -> None:
    plain, piped = run_example(), run_example("--pipeline")
    assert piped.group(2, 3, 4) == plain.group(2, 3, 4), (plain.group(0), piped.group(0))
