"""embd.torch.EmbeddingBagCollection's evaluation, short batches and state against the real
embd and TorchRec: eval() / no_grad forwards equal the next training forward and change no
row or step; a short last batch (KJT stride below the batch size) trains like TorchRec's
unsharded EmbeddingBagCollection loaded with the same weights through load_state_dict;
state_dict() has TorchRec's keys and loads into a plain TorchRec collection (and a DLRM);
load_state_dict refuses what does not fit before writing anything; fp16 tables; the fused
optimizer's state."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
import torchrec
import torchrec.models.dlrm
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embd
import embd.torch
from support import NpBatch, Service, TableSpec, initial_weights, kjt, make_batch, make_grad

B = 4
D = 24
TABLES = [
    TableSpec("t_a", 30, 8, "sum", ("f_a", "f_b"), {"type": "sgd", "lr": 0.1}),
    TableSpec("t_c", 20, 8, "mean", ("f_c",), {"type": "sgd", "lr": 0.2}),
]
KEYS = ["f_a", "f_b", "f_c"]
SALT = 5


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, TABLES, B, trainers=1, weights=initial_weights(TABLES, 4)).start()
    yield svc
    svc.stop()


def batch(step: int, b: int = B) -> KeyedJaggedTensor:
    return kjt(KEYS, make_batch(TABLES, b, step, 0, salt=SALT))


def head(step: int, k: int) -> KeyedJaggedTensor:
    """The first k samples of step ``step``'s batch."""
    nb = make_batch(TABLES, B, step, 0, salt=SALT)
    lengths = nb.lengths[:, :k]
    return kjt(KEYS, NpBatch(lengths, [x[:int(n)] for x, n in zip(nb.ids, lengths.sum(1))]))


def grad(step: int, b: int = B) -> torch.Tensor:
    return torch.from_numpy(make_grad(b, D, step, 0, salt=SALT))


def train_step(ebc: torch.nn.Module, step: int, b: int = B) -> torch.Tensor:
    out = ebc(batch(step, b)).values()
    (out * grad(step, b)).sum().backward()
    return out.detach()


def plain_torchrec(ebc: embd.torch.EmbeddingBagCollection) -> torchrec.EmbeddingBagCollection:
    """TorchRec's unsharded collection of the same tables, SGD applied in backward."""
    theirs = torchrec.EmbeddingBagCollection(tables=ebc.embedding_bag_configs())
    for t in TABLES:
        apply_optimizer_in_backward(torch.optim.SGD, [theirs.embedding_bags[t.name].weight],
                                    {"lr": t.optimizer["lr"]})
    return theirs


def assert_state_equal(a: dict, b: dict, tol: float = 0.0) -> None:
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_allclose(a[k].detach().float().numpy(),
                                   b[k].detach().float().numpy(), atol=tol, rtol=0, err_msg=k)


def test_eval_is_the_next_training_forward_and_changes_nothing(one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    train_step(ebc, 0)
    train_step(ebc, 1)
    before = ebc.state_dict()
    ebc.eval()
    kt = ebc(batch(2))
    evaluated = kt.values()
    assert kt.keys() == KEYS and evaluated.shape == (B, D) and not evaluated.requires_grad
    np.testing.assert_array_equal(ebc(batch(2)).values(), evaluated)
    short = ebc(head(2, 3)).values()                         # a short evaluation batch
    np.testing.assert_array_equal(short, evaluated[:3])
    ebc.train()
    with torch.no_grad():                                    # no_grad is an evaluation too
        np.testing.assert_array_equal(ebc(batch(2)).values(), evaluated)
    assert ebc.step == 2
    assert_state_equal(ebc.state_dict(), before)
    out = ebc(batch(2)).values()                             # step 2
    np.testing.assert_array_equal(out.detach(), evaluated)
    with torch.no_grad():                                    # before step 2's update
        np.testing.assert_array_equal(ebc(batch(2)).values(), evaluated)
    (out * grad(2)).sum().backward()
    assert ebc.step == 3
    ebc.eval()
    assert not np.array_equal(ebc(batch(2)).values(), evaluated)    # the update landed
    ebc.train()
    train_step(ebc, 3)
    assert ebc.step == 4
    ebc.close()


def test_torchrecs_weights_load_and_a_short_last_batch_trains_like_torchrec(
        one: Service) -> None:
    ours = embd.torch.EmbeddingBagCollection(one.socket)
    torch.manual_seed(11)
    theirs = plain_torchrec(ours)
    ours.load_state_dict(theirs.state_dict())               # TorchRec's initial weights
    assert_state_equal(ours.state_dict(), theirs.state_dict())
    for step, b in enumerate([B, B, 2, 1, B]):              # short batches, then a full one
        a = train_step(ours, step, b)
        t = train_step(theirs, step, b)
        assert a.shape == (b, D)
        np.testing.assert_allclose(a.numpy(), t.numpy(), atol=1e-6, err_msg=f"step {step}")
    assert_state_equal(ours.state_dict(), theirs.state_dict(), tol=1e-6)
    ours.eval()
    theirs.eval()
    np.testing.assert_allclose(ours(batch(9, 3)).values().numpy(),
                               theirs(batch(9, 3)).values().detach().numpy(), atol=1e-6)
    ours.close()


def test_state_dict_loads_into_plain_torchrec_and_round_trips(one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    for step in range(3):
        train_step(ebc, step)
    trained = ebc.state_dict()
    plain = torchrec.EmbeddingBagCollection(tables=ebc.embedding_bag_configs())
    assert list(trained) == list(plain.state_dict()) == ["embedding_bags.t_a.weight",
                                                         "embedding_bags.t_c.weight"]
    plain.load_state_dict(trained)                          # strict
    ebc.eval()
    np.testing.assert_allclose(ebc(batch(5)).values().numpy(),
                               plain(batch(5)).values().detach().numpy(), atol=1e-6)
    # in a model: the prefix is the model's
    dense = dict(dense_in_features=5, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 1])
    ours_model = torchrec.models.dlrm.DLRM(embedding_bag_collection=ebc, **dense)
    their_model = torchrec.models.dlrm.DLRM(embedding_bag_collection=plain, **dense)
    their_model.load_state_dict(ours_model.state_dict())
    x = torch.rand(B, 5)
    np.testing.assert_allclose(ours_model(x, batch(6)).detach().numpy(),
                               their_model(x, batch(6)).detach().numpy(), atol=1e-6)
    other = {k: torch.full_like(v, 0.25) for k, v in trained.items()}
    ebc.load_state_dict(other)
    assert_state_equal(ebc.state_dict(), other)
    ebc.load_state_dict(trained)
    assert_state_equal(ebc.state_dict(), trained)
    # what does not fit is refused before any row is written
    wrong = dict(other, **{"embedding_bags.t_c.weight": torch.zeros(19, 8)})
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.t_c.weight.*"
                                           r"'t_c' is \(20, 8\)"):
        ebc.load_state_dict(wrong)
    assert_state_equal(ebc.state_dict(), trained)
    with pytest.raises(RuntimeError, match=r"Unexpected key.*embedding_bags.t_x.weight"):
        ebc.load_state_dict(dict(trained, **{"embedding_bags.t_x.weight": torch.zeros(1)}))
    # as for any PyTorch module, the tables present are loaded: strict=False loads a part
    with pytest.raises(RuntimeError, match=r"Missing key.*embedding_bags.t_c.weight"):
        ebc.load_state_dict({"embedding_bags.t_a.weight": other["embedding_bags.t_a.weight"]})
    result = ebc.load_state_dict({"embedding_bags.t_a.weight": trained[
        "embedding_bags.t_a.weight"]}, strict=False)
    assert result.missing_keys == ["embedding_bags.t_c.weight"]
    assert_state_equal(ebc.state_dict(), trained)
    nan = dict(other, **{"embedding_bags.t_a.weight": torch.full((30, 8), float("nan"))})
    with pytest.raises(embd.InvalidArgumentError, match="finite"):
        ebc.load_state_dict(nan)
    ebc.train()
    train_step(ebc, 3)
    ebc.close()


def test_fp16_tables_say_so_and_their_state_loads_into_torchrec(tmp_path: Path) -> None:
    tables = [TABLES[0], TableSpec("t_c", 20, 8, "mean", ("f_c",), {"type": "sgd", "lr": 0.2},
                                   "fp16")]
    svc = Service(tmp_path, tables, B, trainers=1).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket)
        assert [c.data_type for c in ebc.embedding_bag_configs()] == [DataType.FP32,
                                                                     DataType.FP16]
        train_step(ebc, 0)
        sd = ebc.state_dict()
        assert [v.dtype for v in sd.values()] == [torch.float32, torch.float16]
        plain = torchrec.EmbeddingBagCollection(tables=ebc.embedding_bag_configs())
        assert plain.embedding_bags["t_c"].weight.dtype == torch.float16
        plain.load_state_dict(sd)
        assert_state_equal(plain.state_dict(), sd)
        ebc.load_state_dict(plain.state_dict())
        assert_state_equal(ebc.state_dict(), sd)
        ebc.close()
    finally:
        svc.stop()


def test_optimizer_state_under_torchrecs_names(tmp_path: Path) -> None:
    tables = [TableSpec("t_ada", 10, 4, "sum", ("f_a",), {"type": "adagrad", "lr": 0.1}),
              TableSpec("t_row", 10, 4, "sum", ("f_b",), {"type": "rowwise_adagrad", "lr": 0.1}),
              TableSpec("t_adam", 10, 4, "sum", ("f_c",),
                        {"type": "adam", "lr": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}),
              TableSpec("t_sgd", 10, 4, "sum", ("f_d",), {"type": "sgd", "lr": 0.1})]
    svc = Service(tmp_path, tables, B, trainers=1).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket)
        b = kjt(["f_a", "f_b", "f_c", "f_d"], make_batch(tables, B, 0, 0, salt=SALT))
        ebc(b).values().sum().backward()
        st = ebc.optimizer_state_dict()
        assert {k: tuple(v.shape) for k, v in st.items()} == {
            "t_ada.momentum1": (10, 4), "t_row.momentum1": (10,),
            "t_adam.momentum1": (10, 4), "t_adam.exp_avg_sq": (10, 4)}
        assert all(v.abs().sum() > 0 for v in st.values())
        ebc.load_optimizer_state_dict({k: torch.zeros_like(v) for k, v in st.items()})
        assert all(v.abs().sum() == 0 for v in ebc.optimizer_state_dict().values())
        ebc.load_optimizer_state_dict(st)
        assert_state_equal(ebc.optimizer_state_dict(), st)
        with pytest.raises(embd.InvalidArgumentError, match="t_sgd"):
            ebc.load_optimizer_state_dict({"t_sgd.momentum1": torch.zeros(10)})
        ebc.close()
    finally:
        svc.stop()
