"""One trainer process of test_torchrec_equal.py: rank RANK of WORLD_SIZE (torch.distributed's
env:// variables) trains embd.torch's EmbeddingBagCollection (trainer index RANK of the
service) and, beside it on the same batches and gradients, TorchRec's own sharded
EmbeddingBagCollection (DistributedModelParallel over gloo, fused optimizers applied in
backward) from the same initial weights: the test's (job["weights"], in embd through `embctl
import`), or with job["init"] == "state_dict" TorchRec's own initial weights (a seeded
torchrec.EmbeddingBagCollection), which trainer 0 writes into embd with load_state_dict. It
saves both outputs of every step, the initial weights and its local shards of TorchRec's final
weights to an .npz for the test to compare. With job["pipelined"] embd's steps run first, all
of them through embd.torch.TrainPipeline (each step's next batch prefetched), then TorchRec's.

Usage: torchrec_trainer.py JOB.json  (written by the test: see run_trainers there)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.comm_ops import set_gradient_division
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import embd.torch
from support import TableSpec, exit_skipping_finalization, kjt, make_batch, make_grad

OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
              "rowwise_adagrad": RowWiseAdagrad}


def sharded_ebc(configs: List[torchrec.EmbeddingBagConfig], optimizers: Dict[str, Dict[str, Any]],
                sharding: str, pg: dist.ProcessGroup, device: str = "cpu",
                min_partition: int = 4) -> DistributedModelParallel:
    """TorchRec's EBC of ``configs`` sharded as ``sharding`` over ``pg`` on CPU: the fused
    compute kernel with each table's optimizer (``optimizers[name]``, the service's optimizer
    object) applied in backward, as embd fuses it. ``device`` "meta" leaves the unsharded
    tables unallocated (DMP then initialises only the local shards: large tables)."""
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device(device))
    for c in configs:
        opt = {k: v for k, v in optimizers[c.name].items() if k != "type"}
        apply_optimizer_in_backward(OPTIMIZERS[optimizers[c.name]["type"]],
                                    [ebc.embedding_bags[c.name].weight], opt)
    constraints = {c.name: ParameterConstraints(sharding_types=[sharding],
                                                compute_kernels=["fused"],
                                                min_partition=min_partition)
                   for c in configs}
    topology = Topology(world_size=dist.get_world_size(), compute_device="cpu",
                        local_world_size=dist.get_world_size())
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        ebc, sharders, pg)
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan,
                                    sharders=sharders)


def initial_weights(job: Dict[str, Any], ours: embd.torch.EmbeddingBagCollection,
                    rank: int) -> Dict[str, np.ndarray]:
    """The weights both sides start from (see the module's doc)."""
    if job.get("init") != "state_dict":
        return dict(np.load(job["weights"]))
    torch.manual_seed(job["salt"])         # the same weights in every trainer
    theirs = torchrec.EmbeddingBagCollection(tables=ours.embedding_bag_configs(),
                                             device=torch.device("cpu"))
    state = theirs.state_dict()
    if rank == 0:
        ours.load_state_dict(state)
    dist.barrier()                          # written before any trainer's first step
    return {k.split(".")[-2]: v.numpy() for k, v in state.items()}


def torchrec_side(job: Dict[str, Any], ours: embd.torch.EmbeddingBagCollection,
                  tables: List[TableSpec], pg: dist.ProcessGroup,
                  init: Dict[str, np.ndarray]) -> DistributedModelParallel:
    """TorchRec's EBC of the tables it can train on CPU, sharded as job["torchrec_sharding"]."""
    names = {t.name for t in tables}
    configs = [c for c in ours.embedding_bag_configs() if c.name in names]
    dmp = sharded_ebc(configs, {t.name: t.optimizer for t in tables}, job["torchrec_sharding"],
                      pg)
    for key, st in dmp.state_dict().items():
        table = key.split(".")[-2]
        for shard in st.local_shards():
            r, c = shard.metadata.shard_offsets
            h, w = shard.metadata.shard_sizes
            shard.tensor.copy_(torch.from_numpy(init[table][r:r + h, c:c + w]))
    return dmp


class GradLoss(torch.nn.Module):
    """The loss sum(pooled * grad) of a batch (kjt, grad), as TorchRec's pipelines call a
    model: (losses, output)."""

    def __init__(self, ebc: embd.torch.EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: Any) -> Any:
        features, grad = batch
        out = self.ebc(features).values()
        return (out * grad).sum(), out.detach()


def pipelined_outputs(job: Dict[str, Any], ours: embd.torch.EmbeddingBagCollection,
                      tables: List[TableSpec], rank: int) -> List[np.ndarray]:
    """embd's outputs of every step, trained through TrainPipeline."""
    keys = [f for t in tables for f in t.features]
    B, D = job["batch_size"], ours._layout.total_dim
    batches = ((kjt(keys, make_batch(tables, B, step, rank, salt=job["salt"])),
                torch.from_numpy(make_grad(B, D, step, rank, salt=job["salt"])))
               for step in range(job["steps"]))
    pipeline = embd.torch.TrainPipeline(GradLoss(ours), sparse_features=lambda b: b[0])
    outs = []
    while True:
        try:
            outs.append(pipeline.progress(batches).numpy().copy())
        except StopIteration:
            break
    return outs


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    set_gradient_division(job["gradient_division"])
    pg = dist.group.WORLD
    tables = [TableSpec(**{**t, "features": tuple(t["features"])}) for t in job["tables"]]
    ours = embd.torch.EmbeddingBagCollection(job["socket"], index=rank, timeout=60)
    layout_keys = [f for t in tables for f in t.features]
    theirs_tables = [t for t in tables if t.optimizer["type"] in OPTIMIZERS]
    theirs_keys = [f for t in theirs_tables for f in t.features]
    init = initial_weights(job, ours, rank)
    dmp = torchrec_side(job, ours, theirs_tables, pg, init)
    B, D = job["batch_size"], ours._layout.total_dim
    cols = np.concatenate([np.arange(f.offset, f.offset + f.dim) for f in ours._layout.features
                           if f.name in theirs_keys])
    pipelined = bool(job.get("pipelined"))
    out_ours = pipelined_outputs(job, ours, tables, rank) if pipelined else []
    out_theirs = []
    for step in range(job["steps"]):
        b = make_batch(tables, B, step, rank, salt=job["salt"])
        grad = torch.from_numpy(make_grad(B, D, step, rank, salt=job["salt"]))
        if not pipelined:
            kt = ours(kjt(layout_keys, b))
            (kt.values() * grad).sum().backward()
            out_ours.append(kt.values().detach().numpy().copy())
        # a sharded collection's output keys come grouped by sharding: take them by name
        tkt = dmp(kjt(layout_keys, b, only=theirs_keys)).to_dict()
        theirs = torch.cat([tkt[k] for k in theirs_keys], dim=1)
        (theirs * grad[:, cols]).sum().backward()
        out_theirs.append(theirs.detach().numpy().copy())
    shards: Dict[str, np.ndarray] = {}
    for key, st in dmp.state_dict().items():
        for i, shard in enumerate(st.local_shards()):
            tag = f"{key.split('.')[-2]}:{i}"
            shards[f"shard:{tag}"] = shard.tensor.detach().numpy().copy()
            shards[f"offsets:{tag}"] = np.array(shard.metadata.shard_offsets)
    np.savez(job["out"] % rank, ours=np.stack(out_ours), theirs=np.stack(out_theirs),
             theirs_cols=cols, next_step=ours.step, **shards,
             **{f"init:{name}": w for name, w in init.items()})
    ours.close()
    # every trainer past its last collective before any tears its process group down: gloo
    # aborts a process ("terminate called without an active exception") whose peer left first
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_skipping_finalization(main())
