"""TorchRec's DLRM on synthetic Criteo-like click data, trained by the processes of
``torchrun --nproc_per_node N``: the embedding tables either in one embd service
(``--backend embd``: embd.torch.EmbeddingBagCollection, the dense part under DDP over gloo)
or in TorchRec's own sharded EmbeddingBagCollection (``--backend torchrec``:
DistributedModelParallel over gloo), the same model, data and optimizers otherwise. Rank 0
prints the loss (mean over the trainers) and steps/s. examples/run_dlrm.sh runs it.

The data: 13 dense features (log of heavy-tailed counts) and 26 categorical ones with
Criteo Terabyte's cardinalities scaled down (--scale), one id per feature and sample,
drawn with a power law (a few ids are frequent, as in the real logs). Clicks follow a planted
logistic model over a hidden score of the ids of 8 of the features and 3 dense features: about
17% are clicks, so predicting that rate scores a loss of 0.46, and the printed noise floor (the
loss of the true click probabilities) is the best any model can do.

``--pipeline`` (embd only) trains through embd.torch.TrainPipeline, TorchRec's
TrainPipelineSparseDist for embd: each step's next batch is posted to the service as soon as
the step's lookup returned, so the service routes it during the dense work; the same results.

``--write-config FILE`` writes the embd config of these tables (for N trainers) and exits.
Both backends divide the trainers' embedding gradients by their number (TorchRec's default,
and embd's gradient_scaling "mean_over_trainers"), so both apply the same update.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

# Criteo Terabyte (1TB click logs, days 0-23): rows of the 26 categorical features, as in
# TorchRec's DLRM example.
CRITEO_TB_ROWS = [45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176,
                  345138, 10, 2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537,
                  452104, 12606, 104, 35]
DENSE = 13
SIGNAL_FEATURES = 8        # the categorical features that drive the planted clicks


def table_rows(scale: float) -> List[int]:
    """Criteo TB's cardinalities times scale, at least 1000 rows (or all of a smaller one)."""
    return [min(n, max(math.ceil(n * scale), 1000)) for n in CRITEO_TB_ROWS]


def embd_config(args: argparse.Namespace, trainers: int) -> Dict[str, Any]:
    opt = {"type": "rowwise_adagrad", "lr": args.emb_lr, "eps": 1e-8}
    return {
        "tables": [{"name": f"t_cat_{i}", "num_embeddings": rows,
                    "embedding_dim": args.dim, "pooling": "sum", "data_type": "fp32",
                    "feature_names": [f"cat_{i}"], "optimizer": opt}
                   for i, rows in enumerate(table_rows(args.scale))],
        "topology": {"world_size": args.ranks, "local_world_size": args.ranks,
                     "compute_device": "cpu", "hbm_cap": "4G", "ddr_cap": "4G",
                     "batch_size": args.batch_size},
        "trainers_per_node": trainers, "seed": 2026, "threads_per_rank": 1,
    }


def mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit hash (splitmix64's finaliser) of every element."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Data:
    """Synthetic batches of one trainer; the same (seed, rank, step) gives the same batch."""

    def __init__(self, rows: List[int], batch_size: int, rank: int, seed: int) -> None:
        self.rows = np.array(rows)
        self.B = batch_size
        self.rank = rank
        self.seed = seed
        self.keys = [f"cat_{i}" for i in range(len(rows))]

    def batch(self, step: int) -> Tuple[torch.Tensor, Any, torch.Tensor, float]:
        """Dense features, the KJT, labels and the loss of the true click probabilities."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        rng = np.random.default_rng([self.seed, self.rank, step])
        counts = rng.lognormal(1.0, 1.5, (self.B, DENSE))
        dense = np.log1p(counts).astype(np.float32)
        # power law: id = rows * u^3 puts half the draws in the lowest eighth of the ids
        u = rng.random((len(self.rows), self.B))
        ids = np.minimum((self.rows[:, None] * u ** 3).astype(np.int64), self.rows[:, None] - 1)
        feature = np.arange(len(self.rows), dtype=np.uint64)[:, None]
        hashed = mix(ids.astype(np.uint64) * np.uint64(1315423911) + feature)
        score = np.where(hashed & np.uint64(1), 1.0, -1.0)
        logit = (score[:SIGNAL_FEATURES].sum(0) * 0.6 + (dense[:, 0] - dense[:, 1]) * 0.5 +
                 dense[:, 2] * 0.3 - 2.2)
        p = 1 / (1 + np.exp(-logit))
        labels = (rng.random(self.B) < p).astype(np.float32)
        floor = -np.mean(np.where(labels > 0, np.log(p), np.log(1 - p)))
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.from_numpy(ids.reshape(-1)),
                                lengths=torch.ones(ids.size, dtype=torch.int32))
        return torch.from_numpy(dense), kjt, torch.from_numpy(labels), float(floor)


def build_embd(args: argparse.Namespace) -> Tuple[torch.nn.Module, List[torch.nn.Parameter]]:
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.models.dlrm import DLRM

    import embd.torch
    ebc = embd.torch.EmbeddingBagCollection(args.socket)   # index: LOCAL_RANK
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE,
                 dense_arch_layer_sizes=args.bottom + [args.dim],
                 over_arch_layer_sizes=args.top + [1])
    # the rows and their optimizer are the service's: DDP sees only the dense parameters
    return DistributedDataParallel(model), list(model.parameters())


def build_torchrec(args: argparse.Namespace) -> Tuple[torch.nn.Module, List[torch.nn.Parameter]]:
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=args.dim,
                                  num_embeddings=rows, feature_names=[f"cat_{i}"])
               for i, rows in enumerate(table_rows(args.scale))]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE,
                 dense_arch_layer_sizes=args.bottom + [args.dim],
                 over_arch_layer_sizes=args.top + [1])
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(),
                                {"lr": args.emb_lr, "eps": 1e-8})
    world = dist.get_world_size()
    topology = Topology(world_size=world, local_world_size=world, compute_device="cpu")
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size) \
        .collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=sharders)
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    return dmp, dense


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["embd", "torchrec"], default="embd")
    p.add_argument("--socket", default=None, help="embd's socket (default $EMBD_SOCKET)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--print-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=512, help="samples per trainer and step")
    p.add_argument("--dim", type=int, default=64, help="embedding_dim of every table")
    p.add_argument("--scale", type=float, default=0.001,
                   help="table rows = Criteo TB's x scale (at least 1000)")
    p.add_argument("--bottom", type=int, nargs="*", default=[256, 128],
                   help="dense arch layers before the embedding_dim one")
    p.add_argument("--top", type=int, nargs="*", default=[256, 128],
                   help="over arch layers before the output one")
    p.add_argument("--emb-lr", type=float, default=0.05, help="rowwise_adagrad's lr")
    p.add_argument("--dense-lr", type=float, default=0.01, help="Adagrad's lr (dense part)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2, help="embd's CPU ranks (--write-config)")
    p.add_argument("--write-config", metavar="FILE",
                   help="write embd's config for these tables and --trainers, and exit")
    p.add_argument("--trainers", type=int, default=2, help="trainers (--write-config)")
    p.add_argument("--pipeline", action="store_true",
                   help="embd only: train through embd.torch.TrainPipeline")
    args = p.parse_args()
    if args.pipeline and args.backend != "embd":
        p.error("--pipeline is embd's (TorchRec's own pipeline needs CUDA streams)")
    if args.write_config:
        with open(args.write_config, "w") as f:
            json.dump(embd_config(args, args.trainers), f, indent=1)
        return 0

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)          # the same dense initial weights on every trainer
    model, dense = (build_embd if args.backend == "embd" else build_torchrec)(args)
    opt = torch.optim.Adagrad(dense, lr=args.dense_lr)
    data = Data(table_rows(args.scale), args.batch_size, rank, args.seed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    window = torch.zeros(3)               # sums of losses and floors, steps since the print
    t_start = t_print = time.perf_counter()
    first = None


    class Train(torch.nn.Module):
        """One batch's loss as TorchRec's pipelines call a model: (losses, output)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch: Tuple[torch.Tensor, Any, torch.Tensor, float]) -> Any:
            dense_x, kjt, labels, floor = batch
            loss = loss_fn(self.model(dense_x, kjt).squeeze(1), labels)
            return loss, (loss.detach(), floor)

    train = Train()
    if args.pipeline:
        import embd.torch
        pipeline = embd.torch.TrainPipeline(train, opt, sparse_features=lambda b: b[1])
        batches = (data.batch(step) for step in range(args.steps))
    for step in range(args.steps):
        if args.pipeline:
            loss, floor = pipeline.progress(batches)
        else:
            loss, (_, floor) = train(data.batch(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
        window += torch.tensor([loss.item(), floor, 1.0])
        if step == 0:
            t_start = t_print = time.perf_counter()   # the first step pays for warm-up
            window.zero_()
        elif (step % args.print_every == 0) or step == args.steps - 1:
            dist.all_reduce(window)
            now = time.perf_counter()
            mean, floor_mean = (window[0] / window[2]).item(), (window[1] / window[2]).item()
            first = mean if first is None else first
            if rank == 0:
                print(f"{args.backend}: step {step} loss {mean:.4f} (noise floor "
                      f"{floor_mean:.4f}) steps/s "
                      f"{window[2].item() / dist.get_world_size() / (now - t_print):.2f}",
                      flush=True)
            window.zero_()
            t_print = now
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        print(f"{args.backend}: {args.steps - 1} steps in {elapsed:.1f} s, "
              f"{(args.steps - 1) / elapsed:.2f} steps/s, "
              f"{(args.steps - 1) * args.batch_size * dist.get_world_size() / elapsed:.0f} "
              f"samples/s; loss {first:.4f} -> {mean:.4f} (noise floor {floor_mean:.4f})",
              flush=True)
    # DDP's reducer holds the process group: released first, so that gloo's threads stop in
    # destroy_process_group and not in the interpreter's teardown (a SIGABRT, "terminate
    # called without an active exception", seen in 2 of 32 runs on two busy cores)
    del train, model, opt
    if args.pipeline:
        del pipeline
    gc.collect()
    # both trainers past their last collective before either tears its process group down
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
