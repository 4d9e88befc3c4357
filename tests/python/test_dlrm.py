"""TorchRec's DLRM trained 50 steps through embd.torch's EmbeddingBagCollection has the same
losses as the same DLRM with TorchRec's unsharded EmbeddingBagCollection: the same initial
embedding rows (embctl import) and dense weights, the same batches, rowwise_adagrad on the
embeddings (TorchRec's RowWiseAdagrad applied in backward) and SGD on the dense part."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torchrec
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import embd.torch
from support import NpBatch, Service, TableSpec, initial_weights, kjt

STEPS = 50
B = 16
DENSE = 4
OPT = {"type": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8}
TABLES = [TableSpec(f"t{i}", rows, 8, "sum", (f"f{i}",), OPT)
          for i, rows in enumerate([40, 100, 7, 300])]
KEYS = [f"f{i}" for i in range(len(TABLES))]


def batch(step: int):
    """Dense features, the KJT (1 or 2 ids a bag) and labels of a planted rule: clicked when
    the first dense feature plus a hidden +-1 score of the bag's first f0 id is positive."""
    rng = np.random.default_rng([50, step])
    lengths = rng.integers(1, 3, (len(TABLES), B)).astype(np.int32)
    ids = [rng.integers(0, t.rows, int(lengths[i].sum())) for i, t in enumerate(TABLES)]
    dense = rng.normal(size=(B, DENSE)).astype(np.float32)
    first = ids[0][np.concatenate([[0], np.cumsum(lengths[0])[:-1]])]
    labels = (dense[:, 0] + np.where(first % 2, 1.0, -1.0) > 0).astype(np.float32)
    return torch.from_numpy(dense), kjt(KEYS, NpBatch(lengths, ids)), torch.from_numpy(labels)


def train(model: DLRM, embedding_params: set) -> list:
    dense_params = [p for p in model.parameters() if id(p) not in embedding_params]
    opt = torch.optim.SGD(dense_params, lr=0.1)
    losses = []
    for step in range(STEPS):
        dense, features, labels = batch(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, features).squeeze(1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_dlrm_losses_equal_torchrecs_unsharded_ebc(tmp_path: Path) -> None:
    w0 = initial_weights(TABLES, 11)
    svc = Service(tmp_path, TABLES, B, trainers=1, weights=w0).start()
    try:
        ours_ebc = embd.torch.EmbeddingBagCollection(svc.socket)
        theirs_ebc = torchrec.EmbeddingBagCollection(tables=ours_ebc.embedding_bag_configs())
        for t in TABLES:
            with torch.no_grad():
                theirs_ebc.embedding_bags[t.name].weight.copy_(torch.from_numpy(w0[t.name]))
        apply_optimizer_in_backward(RowWiseAdagrad, theirs_ebc.parameters(),
                                    {"lr": OPT["lr"], "eps": OPT["eps"]})
        torch.manual_seed(0)
        sizes = dict(dense_in_features=DENSE, dense_arch_layer_sizes=[16, 8],
                     over_arch_layer_sizes=[16, 1])
        theirs = DLRM(embedding_bag_collection=theirs_ebc, **sizes)
        ours = DLRM(embedding_bag_collection=ours_ebc, **sizes)
        ours.load_state_dict({k: v for k, v in theirs.state_dict().items()
                              if "embedding_bag_collection" not in k}, strict=False)
        assert not list(ours_ebc.parameters())
        theirs_losses = train(theirs, {id(p) for p in theirs_ebc.parameters()})
        ours_losses = train(ours, set())
        ours_ebc.close()
        np.testing.assert_allclose(ours_losses, theirs_losses, rtol=0, atol=1e-5)
        assert np.mean(ours_losses[-10:]) < np.mean(ours_losses[:10])   # it learns
        for t in TABLES:
            np.testing.assert_allclose(svc.weights(t.name, STEPS),
                                       theirs_ebc.embedding_bags[t.name].weight.detach(),
                                       atol=1e-5, err_msg=t.name)
    finally:
        svc.stop()
