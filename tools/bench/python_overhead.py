#!/usr/bin/env python3
"""embd-bench python: what the Python package costs a training step. Steps/s of
embd.torch.EmbeddingBagCollection (KJT in, KeyedTensor out, autograd backward posting the
gradient) against libembdclient's own blocking calls on the same batches through the same
embd, one trainer: per step the reference copies the batch into the slot, calls
embd_forward, copies dL/d(pooled) into the slot and calls embd_backward (through ctypes: five
foreign calls, about a microsecond each, on steps of milliseconds). Rounds of the two
alternate on one service (each reconnects as trainer 0 and goes on at the service's step);
the median round of each is reported, and ratio = the median over rounds of torch / C of a
round and the C round just before it (neighbours share the machine's load of the moment).

One JSON line per ids-per-step figure, with the CPU model and the ISA embd's kernels run:
  python3 tools/bench/python_overhead.py [--ids 65536,16384] [--rounds 5] [--round-s 2]
Needs the embd package (tools/python-env.sh) and an embd build ($EMBD_BUILD_DIR, default
build/; --embd names the binary). --profile FILE writes a cProfile of the torch rounds.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TABLES = 2           # table_wise, one feature each
DIM = 64
ROWS = 1_000_000
BATCH = 2048         # B
BATCHES = 4          # distinct batches, cycled
SEED = 2026


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def kernel_isa() -> str:
    """The ISA embd's kernels pick on this CPU (kernels/isa.c), capped by $EMBD_ISA."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    order = ["scalar", "avx2", "avx512"]
    best = ("avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else
            "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar")
    cap = os.environ.get("EMBD_ISA", "")
    return cap if cap in order and order.index(cap) < order.index(best) else best


class Embd:
    """A private embd for the run (config written here, killed at the end)."""

    def __init__(self, binary: str, threads: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="embd-bench-py-")
        self.socket = os.path.join(self.dir, "embd.sock")
        config = {
            "tables": [{"name": f"t{i}", "num_embeddings": ROWS, "embedding_dim": DIM,
                        "pooling": "sum", "data_type": "fp32", "feature_names": [f"f{i}"],
                        "optimizer": {"type": "adagrad", "lr": 0.05, "eps": 1e-8},
                        "constraints": {"sharding_types": ["table_wise"]}}
                       for i in range(TABLES)],
            "topology": {"world_size": 1, "local_world_size": 1, "compute_device": "cpu",
                         "hbm_cap": "8G", "ddr_cap": "8G", "batch_size": BATCH},
            "trainers_per_node": 1, "seed": SEED, "threads_per_rank": threads,
        }
        path = os.path.join(self.dir, "embd.json")
        Path(path).write_text(json.dumps(config))
        self.log = open(os.path.join(self.dir, "embd.log"), "wb")
        self.proc = subprocess.Popen([binary, "--config", path, "--socket", self.socket],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = Path(self.dir, "embd.log").read_text(errors="replace")
                self.stop()
                sys.exit(f"python_overhead: embd did not start; its log:\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def make_batches(ids: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(lengths (F, B), values) of BATCHES batches of ``ids`` ids, the same pooling factor for
    every bag, ids uniform over the rows."""
    per_bag = ids // (TABLES * BATCH)
    rng = np.random.default_rng(SEED)
    lengths = np.full((TABLES, BATCH), per_bag, np.int32)
    return [(lengths, rng.integers(0, ROWS, TABLES * BATCH * per_bag, dtype=np.int64))
            for _ in range(BATCHES)]


def connect_retry(make: Callable[[], Any]) -> Any:
    """A handle of trainer 0 once the service let the previous one go."""
    import embd
    deadline = time.monotonic() + 10
    while True:
        try:
            return make()
        except embd.BusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class CBatch(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("lengths", "values", "weights", "pooled", "grad")]


def c_round(lib: ctypes.CDLL, socket: str, batches: List[Tuple[np.ndarray, np.ndarray]],
            grad: np.ndarray, round_s: float) -> float:
    """Steps/s of libembdclient's blocking calls for about round_s seconds."""
    import embd
    probe = connect_retry(lambda: embd.Client(socket, index=0))
    step = probe.resumed_step       # the layout's, read the same way as the module does
    probe.close()
    handle = ctypes.c_void_p()
    err = ctypes.create_string_buffer(512)
    deadline = time.monotonic() + 10
    while lib.embd_connect(socket.encode(), 0, 10000, ctypes.byref(handle), err, 512):
        if time.monotonic() > deadline:
            sys.exit(f"python_overhead: embd_connect: {err.value.decode()}")
        time.sleep(0.01)
    slots = [CBatch() for _ in range(2)]
    for s, b in enumerate(slots):
        lib.embd_batch_get(handle, s, ctypes.byref(b))
    grad_bytes = grad.nbytes
    steps, t0 = 0, time.perf_counter()
    while True:
        lengths, values = batches[step % BATCHES]
        b = slots[step % 2]
        ctypes.memmove(b.lengths, lengths.ctypes.data, lengths.nbytes)
        ctypes.memmove(b.values, values.ctypes.data, values.nbytes)
        rc = lib.embd_forward(handle, step % 2, ctypes.c_uint64(step),
                              ctypes.c_uint64(values.size), 0)
        ctypes.memmove(b.grad, grad.ctypes.data, grad_bytes)
        rc = rc or lib.embd_backward(handle, step % 2, ctypes.c_uint64(step),
                                     ctypes.c_uint64(values.size), 0)
        if rc:
            sys.exit(f"python_overhead: C step {step}: {lib.embd_last_error(handle).decode()}")
        step += 1
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= round_s:
            lib.embd_close(handle)
            return steps / elapsed


def torch_round(socket: str, kjts: List[Any], grad: Any, round_s: float) -> float:
    """Steps/s of embd.torch.EmbeddingBagCollection for about round_s seconds."""
    import embd.torch
    ebc = connect_retry(lambda: embd.torch.EmbeddingBagCollection(socket, index=0))
    steps, t0 = 0, time.perf_counter()
    while True:
        out = ebc(kjts[ebc.step % BATCHES]).values()
        out.backward(grad)
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= round_s:
            ebc.close()
            return steps / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    build = Path(os.environ.get("EMBD_BUILD_DIR") or REPO / "build")
    ap.add_argument("--embd", default=os.environ.get("EMBD_BENCH_EMBD",
                                                     str(build / "daemon" / "embd")))
    ap.add_argument("--lib", default=str(build / "libclient" / "libembdclient.so"))
    ap.add_argument("--ids", default="65536", help="ids per step, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-s", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1, help="embd's threads_per_rank")
    ap.add_argument("--profile", help="write a cProfile of the torch rounds here")
    args = ap.parse_args()

    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lib = ctypes.CDLL(args.lib)
    lib.embd_last_error.restype = ctypes.c_char_p
    svc = Embd(args.embd, args.threads)
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
    try:
        for ids in [int(x) for x in args.ids.split(",")]:
            batches = make_batches(ids)
            kjts = [KeyedJaggedTensor(keys=[f"f{i}" for i in range(TABLES)],
                                      values=torch.from_numpy(v),
                                      lengths=torch.from_numpy(l.reshape(-1)))
                    for l, v in batches]
            grad = np.random.default_rng(SEED).uniform(-1, 1, (BATCH, TABLES * DIM)) \
                .astype(np.float32)
            c_rates, torch_rates = [], []
            c_round(lib, svc.socket, batches, grad, args.round_s / 4)       # warm-up
            torch_round(svc.socket, kjts, torch.from_numpy(grad), args.round_s / 4)
            for _ in range(args.rounds):
                c_rates.append(c_round(lib, svc.socket, batches, grad, args.round_s))
                if profiler:
                    profiler.enable()
                torch_rates.append(torch_round(svc.socket, kjts, torch.from_numpy(grad),
                                               args.round_s))
                if profiler:
                    profiler.disable()
            c, t = statistics.median(c_rates), statistics.median(torch_rates)
            print(json.dumps({
                "bench": "python", "ids_per_step": batches[0][1].size, "batch_size": BATCH,
                "tables": TABLES, "dim": DIM, "rows": ROWS, "optimizer": "adagrad",
                "embd_threads": args.threads, "rounds": args.rounds, "round_s": args.round_s,
                "torch_steps_per_s": round(t, 2), "c_steps_per_s": round(c, 2),
                "ratio": round(statistics.median(x / y for x, y in zip(torch_rates, c_rates)),
                               4),
                "load_avg_1m": os.getloadavg()[0],
                "torch_rounds": [round(x, 2) for x in torch_rates],
                "c_rounds": [round(x, 2) for x in c_rates],
                "cpu": cpu_model(), "isa": kernel_isa(), "python": platform.python_version(),
                "torch": torch.__version__,
            }), flush=True)
    finally:
        svc.stop()
    if profiler:
        profiler.dump_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
