#!/usr/bin/env python3
"""TorchRec's EmbeddingShardingPlanner and embd's planner side by side on the same tables.

For each configuration: the tables come from `embd-bench planner --emit-tables N` (or
--tables-file), TorchRec plans them on a cuda Topology with the same world size, ranks per
node, HBM cap and batch (no GPU needed: the model lives on the meta device), and embd plans
them with `embctl plan`. TorchRec's plan is converted to embd's plan JSON and both plans are
scored by ONE cost model, embd's (`embctl plan --check --json`), so max_rank_time_ms is
comparable. Prints one JSON line per configuration; without torchrec it prints embd's figures
and "torchrec": "unavailable" and exits 0.

usage: torchrec_planner.py [--build build] [--config TABLES:WORLD:LOCAL ...] [--tables-file F]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def topology_flags(world, local, hbm_cap, batch):
    return ["--world-size", str(world), "--local-world-size", str(local),
            "--compute-device", "cuda", "--hbm-cap", str(hbm_cap), "--batch-size", str(batch)]


def torchrec_plan(tables, world, local, hbm_cap, batch):
    """Plans with TorchRec; returns (plan_ms, embd-format table entries)."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs, constraints = [], {}
    for t in tables:
        configs.append(EmbeddingBagConfig(
            name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
            feature_names=t.get("feature_names", [t["name"]]),
            pooling=PoolingType.MEAN if t.get("pooling") == "mean" else PoolingType.SUM))
        c = t.get("constraints", {})
        constraints[t["name"]] = ParameterConstraints(
            sharding_types=c.get("sharding_types"), compute_kernels=c.get("compute_kernels"),
            pooling_factors=c.get("pooling_factors", [1.0] * len(configs[-1].feature_names)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))

    topology = Topology(world_size=world, local_world_size=local, compute_device="cuda",
                        hbm_cap=hbm_cap)
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch,
                                       constraints=constraints)
    model = Model()
    t0 = time.perf_counter()
    plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
    plan_ms = (time.perf_counter() - t0) * 1e3

    by_name = {t["name"]: t for t in tables}
    out = []
    for _, params in plan.plan.items():
        for name, ps in params.items():
            t = by_name[name]
            if ps.sharding_spec is None:   # data_parallel: a full replica per rank
                shards = [{"rank": r, "row_offset": 0, "rows": t["num_embeddings"],
                           "col_offset": 0, "cols": t["embedding_dim"]} for r in ps.ranks]
            else:
                shards = [{"rank": m.placement.rank(), "row_offset": m.shard_offsets[0],
                           "rows": m.shard_sizes[0], "col_offset": m.shard_offsets[1],
                           "cols": m.shard_sizes[1]} for m in ps.sharding_spec.shards]
            out.append({"name": name, "sharding_type": ps.sharding_type,
                        "compute_kernel": ps.compute_kernel, "shards": shards})
    order = {t["name"]: i for i, t in enumerate(tables)}
    out.sort(key=lambda e: order[e["name"]])
    return plan_ms, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--config", action="append",
                    help="TABLES:WORLD:LOCAL (default 100:8:8 and 1000:64:8)")
    ap.add_argument("--tables-file")
    ap.add_argument("--hbm-cap", type=int, default=32 << 30)
    ap.add_argument("--batch-size", type=int, default=512)
    args = ap.parse_args()
    embctl = os.path.join(args.build, "tools/embctl/embctl")
    bench = os.path.join(args.build, "tools/bench/embd-bench")
    try:
        import torchrec  # noqa: F401
        have_torchrec = True
    except Exception:
        have_torchrec = False

    with tempfile.TemporaryDirectory() as tmp:
        for config in args.config or ["100:8:8", "1000:64:8"]:
            n, world, local = (int(x) for x in config.split(":"))
            path = args.tables_file or os.path.join(tmp, f"tables_{n}.json")
            if not args.tables_file:
                with open(path, "w") as f:
                    f.write(run([bench, "planner", "--emit-tables", str(n)]))
            with open(path) as f:
                tables = json.load(f)
            flags = topology_flags(world, local, args.hbm_cap, args.batch_size)
            t0 = time.perf_counter()
            ours = json.loads(run([embctl, "plan", "--tables", path, "--json"] + flags))
            embd_ms = (time.perf_counter() - t0) * 1e3
            line = {"bench": "torchrec_planner", "tables": len(tables), "world_size": world,
                    "local_world_size": local, "embd_plan_ms": round(embd_ms, 3),
                    "embd_max_rank_time_ms": ours["max_rank_time_ms"]}
            if not have_torchrec:
                line["torchrec"] = "unavailable"
                print(json.dumps(line), flush=True)
                continue
            tr_ms, tr_tables = torchrec_plan(tables, world, local, args.hbm_cap,
                                             args.batch_size)
            plan_path = os.path.join(tmp, f"torchrec_plan_{n}.json")
            with open(plan_path, "w") as f:
                json.dump({"version": 1, "topology": ours["topology"], "tables": tr_tables}, f)
            scored = json.loads(run([embctl, "plan", "--check", plan_path, "--tables", path,
                                     "--json"] + flags))
            line.update({
                "torchrec_plan_ms": round(tr_ms, 3),
                "torchrec_max_rank_time_ms": scored["max_rank_time_ms"],
                "plan_time_ratio": round(tr_ms / embd_ms, 1),
                "max_rank_time_ratio": round(ours["max_rank_time_ms"] /
                                             scored["max_rank_time_ms"], 4),
            })
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
