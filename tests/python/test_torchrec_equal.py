"""embd.torch's EmbeddingBagCollection trained by 2 trainer processes through one embd equals
TorchRec's own sharded EmbeddingBagCollection (DistributedModelParallel over gloo, fused
optimizers applied in backward, FBGEMM's CPU kernels) trained in the same processes on the
same batches and gradients from the same initial weights: every pooled output of 20 steps and
every weight after them within 1e-5, for embd's table_wise, column_wise and row_wise plans.

sgd, adagrad and rowwise_adagrad are compared with TorchRec; adam, which TorchRec's CPU
backend lacks, with the exact numpy reference of support.Adam. Both run with their defaults for
the trainers' gradients: TorchRec divides them by the world size, embd by the trainers of the
cluster (gradient_scaling "mean_over_trainers"), so the same learning rate means the same
update. TorchRec has
no row_wise on CPU, so for embd's row_wise plan TorchRec's tables are table_wise (the result
of a step does not depend on the plan). Initial weights reach embd through `embctl import`,
or, as a TorchRec user would bring them, as TorchRec's own initial weights through
load_state_dict; embd's final weights come back through `embctl checkpoint --wait` and
`embctl export`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

from support import (Adam, Service, TableSpec, features_of, free_port, initial_weights,
                     make_batch, make_grad, pool, row_grads)

STEPS = 20
B = 6
TRAINERS = 2
TOL = 1e-5
SALT = 14
TABLES = [
    TableSpec("t_sgd", 50, 8, "sum", ("f_sgd_a", "f_sgd_b"), {"type": "sgd", "lr": 0.1}),
    TableSpec("t_adagrad", 40, 16, "mean", ("f_adagrad",),
              {"type": "adagrad", "lr": 0.05, "eps": 1e-8}),
    TableSpec("t_rowwise", 64, 8, "sum", ("f_rowwise",),
              {"type": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8}),
    TableSpec("t_adam", 30, 8, "sum", ("f_adam",),
              {"type": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}),
]
HERE = Path(__file__).resolve().parent


def run_trainers(tmp: Path, svc: Service, torchrec_sharding: str,
                 weights: Optional[Dict[str, np.ndarray]],
                 pipelined: bool = False) -> List[Dict[str, np.ndarray]]:
    """Runs TRAINERS torchrec_trainer.py processes; returns what each saved. Without weights
    the trainers start from TorchRec's initial weights, loaded into embd by load_state_dict."""
    if weights is not None:
        np.savez(tmp / "init.npz", **weights)
    job = {"socket": svc.socket, "tables": [asdict(t) for t in TABLES], "batch_size": B,
           "steps": STEPS, "salt": SALT, "weights": str(tmp / "init.npz"),
           "init": "import" if weights is not None else "state_dict",
           "torchrec_sharding": torchrec_sharding, "gradient_division": True,
           "pipelined": pipelined,
           "out": str(tmp / "trainer-%d.npz")}
    (tmp / "job.json").write_text(json.dumps(job))
    port = free_port()
    procs = []
    for rank in range(TRAINERS):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(TRAINERS),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(tmp / f"trainer-{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "torchrec_trainer.py"),
                                       str(tmp / "job.json")], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
        log.close()
    try:
        for p in procs:
            p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass
    failed = []
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.returncode != 0:
            text = (tmp / f"trainer-{rank}.log").read_text(errors="replace")
            failed.append(f"trainer {rank}: exit {p.returncode}\n{text[-4000:]}")
    if failed:
        pytest.fail("\n".join(failed) + f"\nembd's log:\n{svc.log()[-3000:]}")
    return [dict(np.load(tmp / f"trainer-{rank}.npz")) for rank in range(TRAINERS)]


def assemble(saved: List[Dict[str, np.ndarray]], table: TableSpec) -> np.ndarray:
    """TorchRec's final weights of a table from every rank's local shards."""
    out = np.full((table.rows, table.dim), np.nan, np.float32)
    for d in saved:
        for key in d:
            if key.startswith(f"shard:{table.name}:"):
                r, c = d["offsets:" + key[len("shard:"):]]
                h, w = d[key].shape
                out[r:r + h, c:c + w] = d[key]
    assert not np.isnan(out).any(), f"{table.name}: TorchRec's shards do not cover the table"
    return out


def adam_reference(weights: Dict[str, np.ndarray], total_dim: int):
    """The adam table's outputs (step, trainer, B, dim) and final weights, on the global batch
    (every trainer's bags, gradients divided by the trainers and summed)."""
    feats = features_of(TABLES)
    offsets = np.cumsum([0] + [t.dim for _, t in feats])
    t = TABLES[3]
    o = t.optimizer
    ref = Adam(weights[t.name], o["lr"], o["beta1"], o["beta2"], o["eps"])
    outs = np.zeros((STEPS, TRAINERS, B, t.dim))
    for step in range(STEPS):
        bags = []
        for tr in range(TRAINERS):
            b = make_batch(TABLES, B, step, tr, salt=SALT)
            g = make_grad(B, total_dim, step, tr, salt=SALT) / TRAINERS
            for i, (name, table) in enumerate(feats):
                if table is t:
                    outs[step, tr] = pool(ref.w, b.lengths[i], b.ids[i], t.pooling)
                    bags.append((b.lengths[i], b.ids[i], g[:, offsets[i]:offsets[i + 1]]))
        ref.step(*row_grads(t.rows, t.dim, bags, t.pooling))
    return outs, ref.w, offsets


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise"])
def test_embd_equals_torchrec_dmp(tmp_path: Path, sharding: str) -> None:
    train_and_compare(tmp_path, sharding, initial_weights(TABLES, seed=3))


def test_torchrecs_initial_weights_through_load_state_dict(tmp_path: Path) -> None:
    """embd starts from its own seeded weights; trainer 0 overwrites them with a plain
    TorchRec collection's through load_state_dict, written into embd's row_wise shards."""
    train_and_compare(tmp_path, "row_wise", None)


def test_pipelined_steps_equal_unpipelined_ones_and_torchrec(tmp_path: Path) -> None:
    """Both trainers through embd.torch.TrainPipeline (every step's next batch prefetched
    before its backward): outputs and tables bit-equal to unpipelined training, and TorchRec's
    within TOL (train_and_compare)."""
    weights = initial_weights(TABLES, seed=3)
    (tmp_path / "plain").mkdir()
    (tmp_path / "piped").mkdir()
    plain, plain_final = train_and_compare(tmp_path / "plain", "table_wise", weights)
    piped, piped_final = train_and_compare(tmp_path / "piped", "table_wise", weights,
                                           pipelined=True)
    for rank in range(TRAINERS):
        np.testing.assert_array_equal(piped[rank]["ours"], plain[rank]["ours"],
                                      err_msg=f"trainer {rank}'s outputs")
    for t in TABLES:
        np.testing.assert_array_equal(piped_final[t.name], plain_final[t.name],
                                      err_msg=f"{t.name} after {STEPS} steps")


def train_and_compare(tmp_path: Path, sharding: str, weights: Optional[Dict[str, np.ndarray]],
                      pipelined: bool = False
                      ) -> Tuple[List[Dict[str, np.ndarray]], Dict[str, np.ndarray]]:
    """Trains, compares with TorchRec; returns what the trainers saved and embd's tables."""
    svc = Service(tmp_path, TABLES, B, trainers=TRAINERS, sharding=sharding,
                  weights=weights).start()
    try:
        saved = run_trainers(tmp_path, svc,
                             "table_wise" if sharding == "row_wise" else sharding, weights,
                             pipelined)
        ours_final = {t.name: svc.weights(t.name, STEPS) for t in TABLES}
    finally:
        svc.stop()
    if weights is None:
        weights = {t.name: saved[0][f"init:{t.name}"] for t in TABLES}
        for d in saved[1:]:
            for t in TABLES:
                np.testing.assert_array_equal(d[f"init:{t.name}"], weights[t.name])
    total_dim = saved[0]["ours"].shape[-1]
    adam_out, adam_w, offsets = adam_reference(weights, total_dim)
    for rank, d in enumerate(saved):
        assert int(d["next_step"]) == STEPS
        diff = np.abs(d["ours"][:, :, d["theirs_cols"]] - d["theirs"])
        step, row, col = np.unravel_index(diff.argmax(), diff.shape)
        assert diff.max() <= TOL, (
            f"{sharding}: trainer {rank} step {step} sample {row}: embd's output column "
            f"{d['theirs_cols'][col]} {d['ours'][step, row, d['theirs_cols'][col]]:.8f}, "
            f"TorchRec's {d['theirs'][step, row, col]:.8f}")
        adam_cols = slice(offsets[-2], offsets[-1])
        diff = np.abs(d["ours"][:, :, adam_cols] - adam_out[:, rank])
        assert diff.max() <= TOL, (
            f"{sharding}: trainer {rank}: adam feature's output differs from the reference by "
            f"{diff.max():.3g} (first at step {np.unravel_index(diff.argmax(), diff.shape)[0]})")
    for t in TABLES:
        want = adam_w if t.optimizer["type"] == "adam" else assemble(saved, t)
        diff = np.abs(ours_final[t.name] - want)
        r, c = np.unravel_index(diff.argmax(), diff.shape)
        who = "the reference" if t.optimizer["type"] == "adam" else "TorchRec"
        assert diff.max() <= TOL, (
            f"{sharding}: {t.name} ({t.optimizer['type']}) after {STEPS} steps: row {r} col {c} "
            f"is {ours_final[t.name][r, c]:.8f} in embd, {want[r, c]:.8f} in {who}")
        moved = np.abs(ours_final[t.name] - weights[t.name]).max()
        assert moved > 100 * TOL, f"{t.name}: the weights did not move ({moved:.3g})"
    return saved, ours_final
