"""What embd's Python tests share: the real ``embd`` and ``embctl`` of a build, a service
started on a private socket with a config the test writes (and initial weights through
``embctl import``), deterministic batches and gradients, and exact numpy references.

The build comes from ``$EMBD_BUILD_DIR`` (tools/test.sh sets it; default ``build/`` of the
repository). Imported by the pytest modules and by the trainer processes they start.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("EMBD_BUILD_DIR") or REPO / "build").resolve()
EMBD = BUILD / "daemon" / "embd"
EMBCTL = BUILD / "tools" / "embctl" / "embctl"


# ---- tables ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    pooling: str                      # "sum" | "mean"
    features: Tuple[str, ...]
    optimizer: Dict[str, Any]         # the service's optimizer object: {"type": ..., "lr": ...}
    data_type: str = "fp32"           # "fp32" | "fp16"

    def config(self, sharding: Optional[str]) -> Dict[str, Any]:
        t: Dict[str, Any] = {"name": self.name, "num_embeddings": self.rows,
                             "embedding_dim": self.dim, "pooling": self.pooling,
                             "data_type": self.data_type, "feature_names": list(self.features),
                             "optimizer": self.optimizer}
        if sharding:
            t["constraints"] = {"sharding_types": [sharding], "min_partition": 4}
        return t


def features_of(tables: Sequence[TableSpec]) -> List[Tuple[str, TableSpec]]:
    """(feature, its table) in the layout's order: tables in order, their features in order."""
    return [(f, t) for t in tables for f in t.features]


def initial_weights(tables: Sequence[TableSpec], seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.uniform(-0.5, 0.5, (t.rows, t.dim)).astype(np.float32) for t in tables}


# ---- deterministic batches -----------------------------------------------------------------

@dataclass
class NpBatch:
    """One trainer's batch: lengths (F, B), ids per feature, weights per feature or None."""

    lengths: np.ndarray
    ids: List[np.ndarray]
    weights: Optional[List[np.ndarray]] = None
    values: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.values = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)


def make_batch(tables: Sequence[TableSpec], batch_size: int, step: int, trainer: int,
               salt: int = 0, max_len: int = 3, weighted: bool = False) -> NpBatch:
    """Trainer ``trainer``'s batch of step ``step``: 0..max_len ids per bag, ids drawn from a
    small range so duplicates are common (the fused optimizers combine them)."""
    rng = np.random.default_rng([salt, step, trainer])
    feats = features_of(tables)
    lengths = rng.integers(0, max_len + 1, (len(feats), batch_size)).astype(np.int32)
    ids = [rng.integers(0, t.rows, int(lengths[i].sum())).astype(np.int64)
           for i, (_, t) in enumerate(feats)]
    weights = ([rng.uniform(0.5, 1.5, x.size).astype(np.float32) for x in ids]
               if weighted else None)
    return NpBatch(lengths, ids, weights)


def make_grad(batch_size: int, total_dim: int, step: int, trainer: int,
              salt: int = 0) -> np.ndarray:
    """dL/d(pooled) of trainer ``trainer`` at step ``step``, in [-1, 1]."""
    rng = np.random.default_rng([salt, step, trainer, 7])
    return rng.uniform(-1, 1, (batch_size, total_dim)).astype(np.float32)


def kjt(keys: Sequence[str], b: NpBatch, only: Optional[Sequence[str]] = None) -> Any:
    """The batch as a TorchRec KeyedJaggedTensor (the features in ``only``, when given)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    pick = [i for i, k in enumerate(keys) if only is None or k in only]
    vals = [b.ids[i] for i in pick]
    w = None if b.weights is None else torch.from_numpy(np.concatenate([b.weights[i]
                                                                         for i in pick]))
    return KeyedJaggedTensor(keys=[keys[i] for i in pick],
                             values=torch.from_numpy(np.concatenate(vals)),
                             lengths=torch.from_numpy(b.lengths[pick].reshape(-1)), weights=w)


# ---- numpy references ------------------------------------------------------------------------

def pool(weight: np.ndarray, lengths: np.ndarray, ids: np.ndarray, pooling: str,
         weights: Optional[np.ndarray] = None) -> np.ndarray:
    """Pooled rows of one feature's bags (float64 accumulation)."""
    out = np.zeros((lengths.size, weight.shape[1]))
    pos = 0
    for b, n in enumerate(lengths):
        if n:
            rows = weight[ids[pos:pos + n]].astype(np.float64)
            if weights is not None:
                rows = rows * weights[pos:pos + n, None]
            out[b] = rows.sum(0) / (n if pooling == "mean" else 1)
        pos += n
    return out


def row_grads(rows: int, dim: int, bags: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]],
              pooling: str) -> Tuple[np.ndarray, np.ndarray]:
    """The gradient of every row from (lengths, ids, grad[B, dim]) of each bag set, every
    occurrence of a row combined, and the mask of rows that occur (EXACT_* semantics)."""
    g = np.zeros((rows, dim))
    seen = np.zeros(rows, bool)
    for lengths, ids, grad in bags:
        pos = 0
        for b, n in enumerate(lengths):
            for j in range(n):
                g[ids[pos + j]] += grad[b] / (n if pooling == "mean" else 1)
                seen[ids[pos + j]] = True
            pos += n
    return g, seen


class Adam:
    """embd's (and FBGEMM's) adam on the rows that occur in a step: bias-corrected, t = the
    table's step count from 1, rows that do not occur keep their weights and moments."""

    def __init__(self, weight: np.ndarray, lr: float, beta1: float, beta2: float, eps: float):
        self.w = weight.astype(np.float64)
        self.m = np.zeros_like(self.w)
        self.v = np.zeros_like(self.w)
        self.lr, self.b1, self.b2, self.eps, self.t = lr, beta1, beta2, eps, 0

    def step(self, g: np.ndarray, seen: np.ndarray) -> None:
        self.t += 1
        m = self.b1 * self.m[seen] + (1 - self.b1) * g[seen]
        v = self.b2 * self.v[seen] + (1 - self.b2) * g[seen] ** 2
        self.m[seen], self.v[seen] = m, v
        m_hat = m / (1 - self.b1 ** self.t)
        v_hat = v / (1 - self.b2 ** self.t)
        self.w[seen] -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


class ThreadTrainer(threading.Thread):
    """A trainer in a thread of the test, started at once; join() re-raises what it raised."""

    def __init__(self, body: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.body = body
        self.error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self.body()
        except BaseException as e:  # handed to the test's thread by join()
            self.error = e

    def join(self, timeout: Optional[float] = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


# ---- the service -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """The real ``embd`` on a private socket in ``tmp``, with the config the test gives
    (tables, per-trainer batch size, trainers) and optional initial weights."""

    def __init__(self, tmp: Path, tables: Sequence[TableSpec], batch_size: int,
                 trainers: int = 2, sharding: Optional[str] = None,
                 weights: Optional[Dict[str, np.ndarray]] = None, ranks: int = 2,
                 extra: Optional[Dict[str, Any]] = None, import_step: int = 0) -> None:
        for tool in (EMBD, EMBCTL):
            if not tool.exists():
                raise FileNotFoundError(f"{tool} is missing: build embd first (EMBD_BUILD_DIR="
                                        f"{BUILD})")
        self.tmp = tmp
        # a socket path has at most 107 bytes: pytest's tmp_path can be longer
        self._sock_dir = tempfile.mkdtemp(prefix="embd-py-")
        self.socket = os.path.join(self._sock_dir, "embd.sock")
        self.ckpt_dir = tmp / "ckpt"
        self.config_path = tmp / "embd.json"
        self.log_path = tmp / "embd.log"
        self.tables = list(tables)
        config: Dict[str, Any] = {
            "tables": [t.config(sharding) for t in tables],
            "topology": {"world_size": ranks, "local_world_size": ranks, "compute_device": "cpu",
                         "hbm_cap": "1G", "ddr_cap": "1G", "batch_size": batch_size},
            "trainers_per_node": trainers, "seed": 2026, "threads_per_rank": 1,
            "busy_poll_us": 20, "checkpoint_dir": str(self.ckpt_dir), "checkpoint_keep": 0,
        }
        config.update(extra or {})
        self.config_path.write_text(json.dumps(config, indent=1))
        self.proc: Optional[subprocess.Popen[bytes]] = None
        if weights:
            self._import(weights, import_step)

    def _import(self, weights: Dict[str, np.ndarray], step: int) -> None:
        """A checkpoint of ``step`` holding ``weights`` (optimizer state zero), which the
        service restores at start."""
        args = [str(EMBCTL), "import", "--config", str(self.config_path), "--step", str(step)]
        for name, w in weights.items():
            path = self.tmp / f"init-{name}.npy"
            np.save(path, np.ascontiguousarray(w, dtype=np.float32))
            args += ["--table", name, "-i", str(path)]
        run(args)

    def start(self, timeout: float = 20) -> "Service":
        """Starts embd and waits up to ``timeout`` seconds for its socket (large tables take
        a while to initialise)."""
        self.proc = start_embd(self.config_path, self.socket, self.log_path, timeout)
        return self

    def log(self) -> str:
        return read_log(self.log_path)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 15) -> Optional[int]:
        """SIGTERM and wait; SIGKILL after ``timeout`` s. Returns the exit status."""
        if self.proc is None:
            return None
        rc = stop_embd(self.proc, timeout=timeout)
        self.proc = None
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        return rc

    def weights(self, table: str, step: int) -> np.ndarray:
        """The table's rows at ``step`` (no step may be running): a checkpoint taken now
        (``embctl checkpoint --wait``, which must be of ``step``), exported by ``embctl``."""
        reply = json.loads(run([str(EMBCTL), "checkpoint", "--socket", self.socket, "--wait",
                                "--timeout", "30"]))
        if not reply.get("ok") or reply.get("step") != step:
            raise AssertionError(f"embctl checkpoint --wait: expected a checkpoint of step "
                                 f"{step}, got {reply}")
        out = self.tmp / f"export-{table}-{step}.npy"
        run([str(EMBCTL), "export", "--table", table, "--step", str(step), "--dir",
             str(self.ckpt_dir), "-o", str(out)])
        return np.load(out)


class Cluster:
    """``nodes`` real ``embd`` processes on 127.0.0.1 forming one cluster over Gloo, ``ranks``
    CPU ranks and ``trainers`` trainers each, under a plan the test gives: ``placement`` maps
    a table to the node whose first rank holds all of it (table_wise) or to "row_wise" (its
    rows in equal blocks over every rank of the cluster, in rank order). ``extra``: more
    config keys for every node (checkpoints, timeouts)."""

    def __init__(self, tmp: Path, tables: Sequence[TableSpec], batch_size: int,
                 placement: Dict[str, Any], nodes: int = 2, ranks: int = 1, trainers: int = 1,
                 extra: Optional[Dict[str, Any]] = None) -> None:
        self.tmp, self.tables, self.nodes, self.ranks = tmp, list(tables), nodes, ranks
        self._sock_dir = tempfile.mkdtemp(prefix="embd-pyc-")
        self.sockets = [os.path.join(self._sock_dir, f"node{n}.sock") for n in range(nodes)]
        self.procs: List[Optional["subprocess.Popen[bytes]"]] = [None] * nodes
        world = nodes * ranks
        topo = {"world_size": world, "local_world_size": ranks, "compute_device": "cpu",
                "hbm_cap": "1G", "ddr_cap": "1G", "batch_size": batch_size}
        plan = {"version": 1, "topology": topo,
                "tables": [self._plan_table(t, placement[t.name]) for t in tables]}
        (tmp / "plan.json").write_text(json.dumps(plan, indent=1))
        port = free_port()
        for n in range(nodes):
            config: Dict[str, Any] = {
                "tables": [t.config(None) for t in tables], "topology": topo,
                "plan_file": str(tmp / "plan.json"), "trainers_per_node": trainers,
                "seed": 2026, "threads_per_rank": 1, "busy_poll_us": 20,
                "master_addr": "127.0.0.1", "master_port": port, "node_rank": n,
                "backend": "gloo", "collective_timeout_ms": 2000, "checkpoint_dir": "",
            }
            config.update(extra or {})
            self.config(n).write_text(json.dumps(config, indent=1))

    def _plan_table(self, t: TableSpec, where: Any) -> Dict[str, Any]:
        if where == "row_wise":
            world = self.nodes * self.ranks
            block = -(-t.rows // world)
            shards = [{"rank": r, "row_offset": block * r, "rows": min(block, t.rows - block * r),
                       "col_offset": 0, "cols": t.dim} for r in range(world)]
        else:
            shards = [{"rank": int(where) * self.ranks, "row_offset": 0, "rows": t.rows,
                       "col_offset": 0, "cols": t.dim}]
        return {"name": t.name, "sharding_type": "row_wise" if where == "row_wise" else
                "table_wise", "compute_kernel": "fused", "shards": shards}

    def rows_of(self, table: str, node: int) -> Tuple[int, int]:
        """The rows [begin, end) of a row_wise table that node ``node`` holds."""
        t = next(t for t in self.tables if t.name == table)
        block = -(-t.rows // (self.nodes * self.ranks))
        begin = min(t.rows, block * self.ranks * node)
        return begin, min(t.rows, begin + block * self.ranks)

    def config(self, n: int) -> Path:
        return self.tmp / f"node{n}.json"

    def log_path(self, n: int) -> Path:
        return self.tmp / f"node{n}.log"

    def start_node(self, n: int, wait: bool = True, timeout: float = 30) -> None:
        """Starts node ``n``; with ``wait``, returns once its socket exists (node 0's socket
        appears only once the cluster formed, so start the others first without it)."""
        env = {k: v for k, v in os.environ.items() if k not in (
            "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        if os.path.exists(self.sockets[n]):
            os.unlink(self.sockets[n])
        if wait:
            self.procs[n] = start_embd(self.config(n), self.sockets[n], self.log_path(n),
                                       timeout, env)
            return
        with open(self.log_path(n), "wb") as log:
            self.procs[n] = subprocess.Popen(
                [str(EMBD), "--config", str(self.config(n)), "--socket", self.sockets[n],
                 "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self, timeout: float = 30) -> "Cluster":
        for n in range(1, self.nodes):
            self.start_node(n, wait=False)
        self.start_node(0, timeout=timeout)
        deadline = time.monotonic() + timeout
        for n in range(1, self.nodes):
            while not os.path.exists(self.sockets[n]):
                proc = self.procs[n]
                if (proc is not None and proc.poll() is not None) or \
                        time.monotonic() > deadline:
                    raise RuntimeError(f"node {n} made no socket:\n{self.log(n)}")
                time.sleep(0.01)
        return self

    def log(self, n: int) -> str:
        return read_log(self.log_path(n))

    def kill(self, n: int) -> None:
        proc = self.procs[n]
        if proc is not None:
            stop_embd(proc, signal.SIGKILL)
        self.procs[n] = None

    def stop(self) -> None:
        for n in range(self.nodes):
            proc = self.procs[n]
            if proc is not None:
                stop_embd(proc)
            self.procs[n] = None
        shutil.rmtree(self._sock_dir, ignore_errors=True)


def start_embd(config: Path, sock: str, log_path: Path, timeout: float,
               env: Optional[Dict[str, str]] = None) -> "subprocess.Popen[bytes]":
    """The real ``embd`` on ``config`` and ``sock`` (its log in ``log_path``), once its socket
    exists (``timeout`` s at most)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(EMBD), "--config", str(config), "--socket", sock,
                                 "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT,
                                env=env)
    deadline = time.monotonic() + timeout
    while not os.path.exists(sock):
        if proc.poll() is not None:
            raise RuntimeError(f"embd exited with {proc.returncode} before its socket "
                               f"appeared:\n{read_log(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"embd made no socket within {timeout} s:\n{read_log(log_path)}")
        time.sleep(0.01)
    return proc


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def stop_embd(proc: "subprocess.Popen[bytes]", sig: int = signal.SIGTERM,
              timeout: float = 15) -> int:
    """``sig`` to the process and wait; SIGKILL after ``timeout`` s. Returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def exit_skipping_finalization(code: int) -> NoReturn:
    """Ends a trainer process whose results are all written and closed, without the
    interpreter's finalization: torch's gloo threads may still hold work referencing Python
    objects, and destroying it while the interpreter is torn down aborts the process now and
    then ("terminate called without an active exception", SIGABRT), even after
    destroy_process_group. Call it only on success: a failure raises with its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(args: Sequence[str], timeout: float = 60) -> str:
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(args)}: exit {p.returncode}\n{p.stdout}{p.stderr}")
    return p.stdout
