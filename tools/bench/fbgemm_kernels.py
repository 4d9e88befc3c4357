#!/usr/bin/env python3
"""FBGEMM side of `embd-bench kernels`: times the same batches through PyTorch on CPU.

embd-bench writes the ids (raw little-endian int64) to a file and runs this script with
EMBD_BENCH_PYTHON (default python3); each batch is the next batch * pooling_factor ids of the
file, cyclically, exactly as the C side walks it. Prints one JSON line:
{"ns_per_batch": median, "ns_per_batch_forward": median (backward modes), "op": "..."}.
Exit code 3 when torch cannot be imported, so the caller can skip the field cleanly.

forward:            torch.nn.EmbeddingBag(mode="sum") under no_grad: FBGEMM's EmbeddingSpMDM.
backward sgd, adagrad, rowwise_adagrad: fbgemm_gpu's TBE CPU op
  (SplitTableBatchedEmbeddingBagsCodegen, EXACT_* optimizers fused into backward); its
  backward time is (forward + backward) - forward, both medians.
backward adam: nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam (TBE has no CPU adam).
"""
import argparse
import json
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--pooling-factor", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--mode", choices=["forward", "backward"], required=True)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--run-seconds", type=float, default=0.2)
    a = ap.parse_args()
    try:
        import numpy as np
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        print(json.dumps({"error": f"import torch: {e}"}))
        return 3

    torch.set_num_threads(a.threads)
    ids = torch.from_numpy(np.fromfile(a.ids, dtype=np.int64))
    per_batch = a.batch * a.pooling_factor
    nbatches = len(ids) // per_batch
    offsets = torch.arange(0, per_batch, a.pooling_factor, dtype=torch.int64)
    batches = [ids[i * per_batch:(i + 1) * per_batch] for i in range(nbatches)]
    grad = torch.rand(a.batch, a.dim) - 0.5
    lr = 0.01

    def timed(step):
        step(batches[0])
        results = []
        k = 0
        for _ in range(a.runs):
            n = 0
            t0 = time.perf_counter_ns()
            while True:
                step(batches[k % nbatches])
                k += 1
                n += 1
                el = time.perf_counter_ns() - t0
                if el >= a.run_seconds * 1e9:
                    break
            results.append(el / n)
        return statistics.median(results)

    out = {}
    if a.mode == "forward" or a.optimizer == "adam":
        emb = torch.nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=a.mode == "backward")
        if a.mode == "forward":
            def fwd(b):
                with torch.no_grad():
                    emb(b, offsets)
            out["ns_per_batch"] = timed(fwd)
            out["op"] = "torch.nn.EmbeddingBag(mode=sum), no_grad"
        else:
            opt = torch.optim.SparseAdam(emb.parameters(), lr=lr)

            def fwd(b):
                with torch.no_grad():
                    emb(b, offsets)

            def step(b):
                opt.zero_grad(set_to_none=True)
                emb(b, offsets).backward(grad)
                opt.step()
            f = timed(fwd)
            s = timed(step)
            out.update(ns_per_batch=max(s - f, 1.0), ns_per_batch_forward=f,
                       op="torch.nn.EmbeddingBag(sparse=True) + torch.optim.SparseAdam, step minus forward")
    else:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)
        kind = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
                "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[a.optimizer]
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(a.rows, a.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=kind, learning_rate=lr, eps=1e-8)
        tbe_offsets = torch.arange(0, per_batch + 1, a.pooling_factor, dtype=torch.int64)

        def fwd(b):
            with torch.no_grad():
                tbe(b, tbe_offsets)

        def step(b):
            tbe(b, tbe_offsets).backward(grad)
        f = timed(fwd)
        s = timed(step)
        out.update(ns_per_batch=max(s - f, 1.0), ns_per_batch_forward=f,
                   op=f"fbgemm_gpu TBE CPU {kind.value}, step minus forward")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
