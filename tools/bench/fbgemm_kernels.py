#!/usr/bin/env python3
"""FBGEMM side of `embd-bench kernels`: times the same batches through PyTorch on CPU.

embd-bench writes the ids (raw little-endian int64) to a file and runs this script with
EMBD_BENCH_PYTHON (default python3) for one table and a list of configs (--configs 1,20,100w:
pooling factor P, "w" for weighted); each batch is the next batch * P ids of the file,
cyclically, exactly as the C side walks it. Prints one JSON line per config, in order:
{"ns_per_batch": median, "op": "...", "isa": "..."} and, by mode,
forward:  "tbe_ns_per_batch", "tbe_op" (fbgemm_gpu's TBE on the same batches), when it runs;
backward: "ns_per_batch_forward" (the forward part subtracted from the step).
Exit code 3 when torch cannot be imported, so the caller can skip the field cleanly.

forward:  torch.nn.EmbeddingBag(mode="sum") under no_grad (FBGEMM's EmbeddingSpMDM), and
  fbgemm_gpu's TBE CPU op (SplitTableBatchedEmbeddingBagsCodegen) forward under no_grad;
  --dtype fp16 makes both tables fp16 (EmbeddingBag then also outputs fp16; TBE outputs fp32
  as embd does); --weighted passes the per-id weights embd-bench uses (see weights()).
backward sgd, adagrad, rowwise_adagrad: fbgemm_gpu's TBE CPU op (EXACT_* optimizers fused
  into backward); its backward time is (forward + backward) - forward, both medians.
backward adam: nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam (TBE has no CPU adam).
The instruction set is FBGEMM's and ATen's own choice unless the caller sets
FBGEMM_ENABLE_INSTRUCTIONS / ATEN_CPU_CAPABILITY (embd-bench does when it forces AVX2).
"""
import argparse
import json
import os
import statistics
import sys
import time


def weights(n):
    """The per-id weights of embd-bench's weighted configs: 0.5 + (i % 7) / 8 for id i."""
    import torch
    return 0.5 + (torch.arange(n, dtype=torch.int64) % 7).to(torch.float32) / 8


def timer(batches, runs, run_seconds, clock):
    """Median ns per step over runs, after a warm-up run; clock as embd-bench's --clock."""
    def timed(step):
        results = []
        k = 0
        for r in range(runs + 1):
            n = 0
            t0 = clock()
            while True:
                step(batches[k % len(batches)])
                k += 1
                n += 1
                el = clock() - t0
                if el >= run_seconds * 1e9:
                    break
            if r:
                results.append(el / n)
        return statistics.median(results)
    return timed


def tbe_module(a, kind, fp16):
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(a.rows, a.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=kind, learning_rate=0.01, eps=1e-8,
        weights_precision=SparseType.FP16 if fp16 else SparseType.FP32,
        output_dtype=SparseType.FP32)


def batches_of(ids, per_batch):
    return [ids[i * per_batch:(i + 1) * per_batch] for i in range(len(ids) // per_batch)]


def forward(a, ids, configs, outs):
    """Each table is built once: EmbeddingBag for every config, then TBE for every config."""
    import torch
    fp16 = a.dtype == "fp16"
    emb = torch.nn.EmbeddingBag(a.rows, a.dim, mode="sum",
                                dtype=torch.float16 if fp16 else torch.float32)
    for (P, weighted), out in zip(configs, outs):
        per_batch = a.batch * P
        offsets = torch.arange(0, per_batch, P, dtype=torch.int64)
        psw = weights(per_batch).to(emb.weight.dtype) if weighted else None

        def fwd(b):
            with torch.no_grad():
                emb(b, offsets, per_sample_weights=psw)
        out["ns_per_batch"] = timer(batches_of(ids, per_batch), a.runs, a.run_seconds, a.clock)(fwd)
        out["op"] = "torch.nn.EmbeddingBag(mode=sum, %s%s), no_grad" % (
            a.dtype, ", per_sample_weights" if weighted else "")
    del emb
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        tbe = tbe_module(a, EmbOptimType.EXACT_SGD, fp16)
    except Exception as e:  # noqa: BLE001 - TBE missing: EmbeddingBag alone is still a figure
        for out in outs:
            out["tbe_error"] = str(e)
        return
    for (P, weighted), out in zip(configs, outs):
        per_batch = a.batch * P
        tbe_offsets = torch.arange(0, per_batch + 1, P, dtype=torch.int64)
        psw = weights(per_batch) if weighted else None

        def tbe_fwd(b):
            with torch.no_grad():
                tbe(b, tbe_offsets, per_sample_weights=psw)
        out["tbe_ns_per_batch"] = timer(batches_of(ids, per_batch), a.runs, a.run_seconds, a.clock)(tbe_fwd)
        out["tbe_op"] = "fbgemm_gpu TBE CPU forward (%s rows%s), no_grad" % (
            a.dtype, ", per_sample_weights" if weighted else "")


def backward(a, ids, P, out):
    import torch
    per_batch = a.batch * P
    timed = timer(batches_of(ids, per_batch), a.runs, a.run_seconds, a.clock)
    offsets = torch.arange(0, per_batch, P, dtype=torch.int64)
    grad = torch.rand(a.batch, a.dim) - 0.5
    if a.optimizer == "adam":
        emb = torch.nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=True)
        opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)

        def fwd(b):
            with torch.no_grad():
                emb(b, offsets)

        def step(b):
            opt.zero_grad(set_to_none=True)
            emb(b, offsets).backward(grad)
            opt.step()
        op = "torch.nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam, step minus forward"
    else:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        kind = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
                "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[a.optimizer]
        tbe = tbe_module(a, kind, False)
        tbe_offsets = torch.arange(0, per_batch + 1, P, dtype=torch.int64)

        def fwd(b):
            with torch.no_grad():
                tbe(b, tbe_offsets)

        def step(b):
            tbe(b, tbe_offsets).backward(grad)
        op = f"fbgemm_gpu TBE CPU {kind.value}, step minus forward"
    f = timed(fwd)
    s = timed(step)
    out.update(ns_per_batch=max(s - f, 1.0), ns_per_batch_forward=f, op=op)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--configs", required=True, help="P or Pw (weighted), comma-separated")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--mode", choices=["forward", "backward"], required=True)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--run-seconds", type=float, default=0.2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a = ap.parse_args()
    if a.clock == "cpu":
        a.clock = lambda: time.process_time_ns() / a.threads
    else:
        a.clock = time.perf_counter_ns
    try:
        import numpy as np
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        print(json.dumps({"error": f"import torch: {e}"}))
        return 3

    torch.set_num_threads(a.threads)
    ids = torch.from_numpy(np.fromfile(a.ids, dtype=np.int64))
    configs = [(int(c.rstrip("w")), c.endswith("w")) for c in a.configs.split(",")]
    forced = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")
    isa = "fbgemm %s, aten %s" % (forced.lower() if forced else "auto",
                                  torch.backends.cpu.get_cpu_capability().lower())
    # the CPUs FBGEMM's threads may run on, on every line (embd-bench prints it as fbgemm_cpus)
    cpus = len(os.sched_getaffinity(0))
    outs = [{"isa": isa, "cpus": cpus} for _ in configs]
    if a.mode == "forward":
        forward(a, ids, configs, outs)
    else:
        backward(a, ids, configs[0][0], outs[0])
    for out in outs:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
