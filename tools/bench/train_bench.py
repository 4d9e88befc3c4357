"""The Python half of `embd-bench train` (tools/bench/bench_train.c starts it): training steps
per second of two Python trainers through embd (``embd.torch.EmbeddingBagCollection``, the
drop-in for TorchRec's) against TorchRec's own sharded EmbeddingBagCollection
(DistributedModelParallel over gloo, the fused kernel with SGD applied in backward, FBGEMM's CPU
kernels) in the same two processes, on the same batches and gradients. For each sharding type
embd is started with that type forced on every table and TorchRec's planner gets the same
constraint; rounds of the two alternate and each figure is the median round. embd runs twice
per round: plain steps (``embd_steps_per_s``, ``vs_torchrec``) and pipelined ones through
``embd.torch.TrainPipeline``, each step's next batch posted before its backward
(``embd_pipelined_steps_per_s``, ``vs_torchrec_pipelined``: against the same TorchRec rounds).

Each line also carries the service's step phases after the rounds (``embd_step_phases_ms``:
forward, trainers, backward, from ``embctl stats``).

A step is the same on both sides: the KJT's pooled embeddings, a fixed dL/d(pooled), its
backward (the sparse update). Both sides divide the trainers' gradients by their number
(TorchRec's gradient division, embd's default gradient_scaling), so both train alike.

With ``EMBD_BENCH_PROFILE=DIR`` every trainer writes a cProfile of its embd rounds and of its
TorchRec rounds (DIR/<sharding>-<side>-trainer<rank>.prof) and trainer 0 the service's
``embctl stats --json`` after the last round (DIR/<sharding>-embd-stats.json).

Usage (bench_train.c writes JOB.json; the ids file holds BATCHES x TRAINERS batches of int64
ids, feature-major, every bag the same number of ids):
    train_bench.py JOB.json                 # prints one JSON object per sharding type
    train_bench.py JOB.json --worker        # one trainer (RANK, WORLD_SIZE: env://)
"""
from __future__ import annotations

import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "python"))

import support  # noqa: E402  (the service launcher of the Python tests)


def tables_of(job: Dict[str, Any]) -> List[support.TableSpec]:
    opt = {"type": "sgd", "lr": job["lr"]}
    return [support.TableSpec(f"t{i}", job["rows"], job["dim"], "sum", (f"f{i}",), opt)
            for i in range(job["tables"])]


# ---- one trainer ---------------------------------------------------------------------------

def worker(job: Dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.comm_ops import set_gradient_division
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import embd.torch
    from torchrec_trainer import sharded_ebc

    torch.set_num_threads(job["torch_threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    set_gradient_division(True)
    tables = tables_of(job)
    B, P, F, D = job["batch_size"], job["ids_per_bag"], job["tables"], job["dim"]
    ours = embd.torch.EmbeddingBagCollection(job["socket"], index=rank, timeout=600)
    keys = ours._layout.feature_names
    dmp = sharded_ebc(ours.embedding_bag_configs(), {t.name: t.optimizer for t in tables},
                      job["torchrec_sharding"], dist.group.WORLD, device="meta",
                      min_partition=job["min_partition"])
    per = F * B * P
    ids = np.fromfile(job["ids_file"], dtype=np.int64).reshape(job["batches"], world, per)
    lengths = torch.full((F * B,), P, dtype=torch.int32)
    kjts = [KeyedJaggedTensor(keys=keys, values=torch.from_numpy(ids[k, rank].copy()),
                              lengths=lengths) for k in range(job["batches"])]
    grad = torch.from_numpy(np.random.default_rng([7, rank]).uniform(
        -1, 1, (B, F * D)).astype(np.float32))

    def run_embd(n: int) -> None:
        for k in range(n):
            kt = ours(kjts[k % len(kjts)])
            (kt.values() * grad).sum().backward()

    class GradLoss(torch.nn.Module):
        def forward(self, features: KeyedJaggedTensor) -> Any:
            return (ours(features).values() * grad).sum(), None

    pipeline = embd.torch.TrainPipeline(GradLoss(), ebc=ours)

    def run_embd_pipelined(n: int) -> None:
        batches = (kjts[k % len(kjts)] for k in range(n))
        try:
            while True:
                pipeline.progress(batches)
        except StopIteration:
            pass

    def run_torchrec(n: int) -> None:
        for k in range(n):
            kt = dmp(kjts[k % len(kjts)])
            (kt.values() * grad).sum().backward()

    def round_s(run: Any, n: int) -> float:
        """Seconds for n steps, the slowest trainer's (the steps are synchronous)."""
        dist.barrier()
        t0 = time.perf_counter()
        run(n)
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        return float(el.item())

    sides = (("embd", run_embd), ("embd_pipelined", run_embd_pipelined),
             ("torchrec", run_torchrec))
    for _, side in sides:   # warm-up: first touches, FBGEMM's set-up
        round_s(side, job["warmup"])
    rates: Dict[str, List[float]] = {name: [] for name, _ in sides}
    profile = os.environ.get("EMBD_BENCH_PROFILE")
    profilers = {side: cProfile.Profile() for side in rates} if profile else {}
    for _ in range(job["rounds"]):
        for name, side in sides:
            if profilers:
                profilers[name].enable()
            rates[name].append(job["steps"] / round_s(side, job["steps"]))
            if profilers:
                profilers[name].disable()
    if profile:
        for name, prof in profilers.items():
            prof.dump_stats(f"{profile}/{job['sharding']}-{name}-trainer{rank}.prof")
        if rank == 0:       # the service's counters after every embd round
            Path(f"{profile}/{job['sharding']}-embd-stats.json").write_text(support.run(
                [str(support.EMBCTL), "stats", "--socket", job["socket"], "--json"]))
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(rates))
    ours.close()
    # every trainer past its last collective before any tears its process group down: gloo
    # aborts a process ("terminate called without an active exception") whose peer left first
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---- the driver ----------------------------------------------------------------------------

def run_sharding(job: Dict[str, Any], sharding: str, tmp: Path) -> Dict[str, Any]:
    torchrec_sharding = job["torchrec_sharding"].get(sharding, sharding)
    topo = {"world_size": job["ranks"], "local_world_size": job["ranks"],
            "compute_device": "cpu", "hbm_cap": "64G", "ddr_cap": "64G",
            "batch_size": job["batch_size"]}
    extra = {"topology": topo, "threads_per_rank": job["threads_per_rank"],
             "checkpoint_dir": "", "log_level": "warning"}
    tables = tables_of(job)
    specs = [t.config(sharding) for t in tables]
    for s in specs:
        s["constraints"]["min_partition"] = job["min_partition"]
        s["constraints"]["compute_kernels"] = ["fused"]
        s["constraints"]["pooling_factors"] = [job["ids_per_bag"]]
    extra["tables"] = specs
    svc = support.Service(tmp, tables, job["batch_size"], trainers=job["trainers"],
                          sharding=sharding, ranks=job["ranks"], extra=extra).start(timeout=600)
    out = tmp / f"rates-{sharding}.json"
    wjob = dict(job, socket=svc.socket, sharding=sharding, torchrec_sharding=torchrec_sharding,
                out=str(out))
    (tmp / f"job-{sharding}.json").write_text(json.dumps(wjob))
    port = support.free_port()
    procs = []
    try:
        for rank in range(job["trainers"]):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(job["trainers"]), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            log = open(tmp / f"trainer-{sharding}-{rank}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, __file__,
                                           str(tmp / f"job-{sharding}.json"), "--worker"],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        for p in procs:
            p.wait(timeout=job["timeout_s"])
        phases = step_phases_ms(svc.socket)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        svc.stop()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        text = (tmp / f"trainer-{sharding}-{failed[0]}.log").read_text(errors="replace")
        raise RuntimeError(f"{sharding}: trainer {failed[0]} exited "
                           f"{procs[failed[0]].returncode}:\n{text[-3000:]}")
    rates = json.loads(out.read_text())
    e, t = statistics.median(rates["embd"]), statistics.median(rates["torchrec"])
    ep = statistics.median(rates["embd_pipelined"])
    return {"sharding": sharding, "torchrec_sharding": torchrec_sharding,
            "embd_steps_per_s": round(e, 3), "torchrec_steps_per_s": round(t, 3),
            "vs_torchrec": round(e / t, 3) if t > 0 else 0,
            "embd_pipelined_steps_per_s": round(ep, 3),
            "vs_torchrec_pipelined": round(ep / t, 3) if t > 0 else 0,
            "cpus": len(os.sched_getaffinity(0)),      # what the trainers and embd may use
            "embd_rounds": [round(x, 3) for x in rates["embd"]],
            "embd_pipelined_rounds": [round(x, 3) for x in rates["embd_pipelined"]],
            "torchrec_rounds": [round(x, 3) for x in rates["torchrec"]],
            "embd_step_phases_ms": phases}


def step_phases_ms(socket: str) -> Dict[str, float]:
    """The service's step phases (median over its last steps, plain and pipelined, warm-up
    included: `embctl stats`' step_phases_p50_us) in ms: forward, trainers (the lookup's
    completion to the last trainer's BACKWARD), backward. Empty when stats cannot be read."""
    try:
        stats = json.loads(support.run([str(support.EMBCTL), "stats", "--socket", socket,
                                        "--json"]))
        return {k: round(v / 1e3, 3) for k, v in stats["step_phases_p50_us"].items()}
    except (AssertionError, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        print(f"train_bench: no step phases: {e}", file=sys.stderr)
        return {}


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    if sys.argv[2:] == ["--worker"]:
        support.exit_skipping_finalization(worker(job))
    rc = 0
    for sharding in job["shardings"]:
        with tempfile.TemporaryDirectory(prefix="embd-bench-train-") as tmp:
            try:
                line = run_sharding(job, sharding, Path(tmp))
            except Exception as e:  # one type failing leaves the others' lines
                print(f"train_bench: {e}", file=sys.stderr)
                rc = 1
                continue
        print(json.dumps(line), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
