"""embd.torch.EmbeddingBagCollection against the real embd: TorchRec's interface (configs
from the layout, taken by TorchRec's DLRM as they are, no parameters), KJTs that do not fit
the layout refused naming the key, training steps numbered from the service's resumed step,
a weighted collection equal to TorchRec's, an aborted step, a service that goes away.
Evaluation, short batches and state_dict: test_torch_eval_state.py."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import numpy as np
import pytest
import torch
import torchrec
import torchrec.models.dlrm
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embd
import embd.torch
from support import (Service, TableSpec, ThreadTrainer, initial_weights, kjt, make_batch,
                     make_grad)

B = 4
SUM_TABLES = [
    TableSpec("t_a", 30, 8, "sum", ("f_a", "f_b"), {"type": "sgd", "lr": 0.1}),
    TableSpec("t_c", 20, 8, "sum", ("f_c",), {"type": "sgd", "lr": 0.2}),
]
TABLES = [
    TableSpec("t_a", 30, 8, "sum", ("f_a", "f_b"), {"type": "sgd", "lr": 0.1}),
    TableSpec("t_c", 20, 8, "mean", ("f_c",), {"type": "sgd", "lr": 0.2}),
]
KEYS = ["f_a", "f_b", "f_c"]


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, TABLES, B, trainers=1, weights=initial_weights(TABLES, 9)).start()
    yield svc
    svc.stop()


def batch_kjt(step: int, keys: List[str] = KEYS, weighted: bool = False) -> KeyedJaggedTensor:
    return kjt(keys, make_batch(TABLES, B, step, 0, salt=3, weighted=weighted))


def train_step(ebc: embd.torch.EmbeddingBagCollection, step: int) -> torch.Tensor:
    out = ebc(batch_kjt(step)).values()
    (out * torch.from_numpy(make_grad(B, 24, step, 0, salt=3))).sum().backward()
    return out.detach()


def test_torchrec_interface_and_dlrm_takes_it(one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    assert isinstance(ebc, EmbeddingBagCollectionInterface)
    assert list(ebc.parameters()) == [] and not ebc.is_weighted()
    assert [(c.name, c.num_embeddings, c.embedding_dim, c.feature_names, c.pooling)
            for c in ebc.embedding_bag_configs()] == [
        ("t_a", 30, 8, ["f_a", "f_b"], PoolingType.SUM),
        ("t_c", 20, 8, ["f_c"], PoolingType.MEAN)]
    model = torchrec.models.dlrm.DLRM(embedding_bag_collection=ebc, dense_in_features=5,
                                      dense_arch_layer_sizes=[8], over_arch_layer_sizes=[4, 1])
    logits = model(torch.rand(B, 5), batch_kjt(0))
    assert logits.shape == (B, 1)
    logits.sum().backward()
    assert ebc.step == 1
    kt = ebc(batch_kjt(1))
    assert kt.keys() == KEYS and kt.length_per_key() == [8, 8, 8]
    assert kt.values().requires_grad and kt.values().shape == (B, 24)
    kt.values().sum().backward()
    ebc.close()


@pytest.mark.parametrize("keys,message", [
    (["f_a", "f_x", "f_c"], "KJT key 'f_x' (position 1) is not a feature of the service"),
    (["f_a", "f_b"], "KJT has no key 'f_c'"),
    (["f_b", "f_a", "f_c"], "KJT key 'f_b' at position 0, the service's feature at position 0 "
                            "is 'f_a'"),
    (["f_a", "f_a", "f_c"], "KJT key 'f_a' appears 2 times"),
])
def test_kjt_keys_that_do_not_fit_are_refused_naming_the_key(one: Service, keys: List[str],
                                                             message: str) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    bad = KeyedJaggedTensor(keys=keys, values=torch.zeros(len(keys) * B, dtype=torch.long),
                            lengths=torch.ones(len(keys) * B, dtype=torch.int32))
    with pytest.raises(embd.InvalidArgumentError) as e:
        ebc(bad)
    assert message in e.value.message
    assert "expects the keys ['f_a', 'f_b', 'f_c'] in this order" in e.value.message
    assert ebc.step == 0
    train_step(ebc, 0)                      # nothing was posted: step 0 runs as usual
    assert ebc.step == 1


def test_kjt_batch_size_values_and_weights_that_do_not_fit_are_refused(one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    long = KeyedJaggedTensor(keys=KEYS, values=torch.zeros(15, dtype=torch.long),
                             lengths=torch.ones(15, dtype=torch.int32))
    with pytest.raises(embd.InvalidArgumentError,
                       match=r"KJT stride \(batch size\) 5 for keys \['f_a', 'f_b', 'f_c'\]: "
                             r"the service takes 1 to its batch_size 4"):
        ebc(long)
    empty = KeyedJaggedTensor(keys=KEYS, values=torch.zeros(0, dtype=torch.long),
                              lengths=torch.zeros(0, dtype=torch.int32))
    with pytest.raises(embd.InvalidArgumentError, match=r"KJT stride \(batch size\) 0"):
        ebc(empty)
    vbe = KeyedJaggedTensor(keys=KEYS, values=torch.zeros(10, dtype=torch.long),
                            lengths=torch.ones(10, dtype=torch.int32),
                            stride_per_key_per_rank=torch.tensor([[4], [4], [2]]))
    with pytest.raises(embd.InvalidArgumentError, match="batch size per key"):
        ebc(vbe)
    n = ebc._layout.max_values + 1
    lengths = torch.zeros(3 * B, dtype=torch.int32)
    lengths[0] = n
    too_many = KeyedJaggedTensor(keys=KEYS, values=torch.zeros(n, dtype=torch.long),
                                 lengths=lengths)
    with pytest.raises(embd.InvalidArgumentError, match=f"KJT has {n} ids: .* max_values"):
        ebc(too_many)
    ebc.close()
    wbc = embd.torch.EmbeddingBagCollection(one.socket, is_weighted=True)
    with pytest.raises(embd.InvalidArgumentError, match="KJT has no weights"):
        wbc(batch_kjt(0))
    wbc.close()


def out_of_range_kjt() -> KeyedJaggedTensor:
    """A batch the service refuses: id 25 of every feature, beyond t_c's 20 rows."""
    return KeyedJaggedTensor(keys=KEYS, values=torch.full((3 * B,), 25, dtype=torch.long),
                             lengths=torch.ones(3 * B, dtype=torch.int32))


def test_a_refused_batch_raises_the_services_message_and_the_next_step_runs(
        one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    bad = out_of_range_kjt()
    with pytest.raises(embd.OutOfRangeError, match="id 25 of feature 'f_c' outside table 't_c'"):
        ebc(bad)
    assert ebc.step == 1      # the trainer sat step 0 out
    train_step(ebc, 1)
    assert ebc.step == 2


def test_each_forward_needs_its_backward_once(one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    out = ebc(batch_kjt(0)).values()
    with pytest.raises(embd.InvalidArgumentError,
                       match="forward of step 1 before the backward of step 0"):
        ebc(batch_kjt(1))
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(embd.InvalidArgumentError, match="backward of step 0 ran already"):
        loss.backward()
    assert ebc.step == 1
    train_step(ebc, 1)


def test_steps_start_at_the_services_resumed_step(tmp_path: Path) -> None:
    svc = Service(tmp_path, TABLES, B, trainers=1, weights=initial_weights(TABLES, 9),
                  import_step=5).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket)
        assert ebc.step == 5
        train_step(ebc, 0)
        train_step(ebc, 1)
        assert ebc.step == 7
        ebc.close()
        assert svc.weights("t_a", 7).shape == (30, 8)     # the service is at step 7
    finally:
        svc.stop()


def test_weighted_collection_equals_torchrecs(tmp_path: Path) -> None:
    """3 steps of a weighted collection (per-id weights) with sgd, beside TorchRec's unsharded
    EmbeddingBagCollection(is_weighted=True) with SGD applied in backward."""
    w0 = initial_weights(SUM_TABLES, 9)     # TorchRec weighs only sum-pooled bags
    svc = Service(tmp_path, SUM_TABLES, B, trainers=1, weights=w0).start()
    try:
        ours = embd.torch.EmbeddingBagCollection(svc.socket, is_weighted=True)
        theirs = torchrec.EmbeddingBagCollection(tables=ours.embedding_bag_configs(),
                                                 is_weighted=True)
        for t in SUM_TABLES:
            with torch.no_grad():
                theirs.embedding_bags[t.name].weight.copy_(torch.from_numpy(w0[t.name]))
            apply_optimizer_in_backward(torch.optim.SGD, [theirs.embedding_bags[t.name].weight],
                                        {"lr": t.optimizer["lr"]})
        for step in range(3):
            f = batch_kjt(step, weighted=True)
            g = torch.from_numpy(make_grad(B, 24, step, 0, salt=3))
            a, b = ours(f).values(), theirs(f).values()
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-6,
                                       err_msg=f"step {step}")
            (a * g).sum().backward()
            (b * g).sum().backward()
        ours.close()
        for t in SUM_TABLES:
            np.testing.assert_allclose(svc.weights(t.name, 3),
                                       theirs.embedding_bags[t.name].weight.detach().numpy(),
                                       atol=1e-6, err_msg=t.name)
            assert np.abs(svc.weights(t.name, 3) - w0[t.name]).max() > 1e-3
    finally:
        svc.stop()


def client_step(c: embd.Client, step: int) -> None:
    """A step of a plain client (every bag one id 0) in slot step % 2; closes it after."""
    b = c.batch(step % embd.SLOTS)
    n = b.write(np.ones((3, B)), np.zeros(3 * B))
    c.forward(step % embd.SLOTS, step, n)
    c.backward(step % embd.SLOTS, step, n)
    del b
    c.close()


def trainer_1_rejoins_for_step(svc: Service, ebc: embd.torch.EmbeddingBagCollection,
                               step: int) -> None:
    """Trainer 1 connects again, told to resume at ``step``, and runs it with ``ebc``."""
    c = embd.Client(svc.socket, index=1)
    assert c.resumed_step == step
    t = ThreadTrainer(lambda: client_step(c, step))
    train_step(ebc, step)
    t.join()
    assert ebc.step == step + 1


def test_a_step_aborted_by_another_trainer_raises_and_the_next_one_runs(tmp_path: Path) -> None:
    svc = Service(tmp_path, TABLES, B, trainers=2).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket, index=0, timeout=30)
        # connected here, before trainer 0 posts: the service runs a step with the trainers
        # connected when it starts (after the first step, which waits for all of them)
        c = embd.Client(svc.socket, index=1)

        def trainer_1_dies_after_its_forward() -> None:
            b = c.batch(0)
            c.forward(0, 0, b.write(np.ones((3, B)), np.zeros(3 * B)))
            del b
            c.close()                             # gone between forward and backward

        t = ThreadTrainer(trainer_1_dies_after_its_forward)
        out = ebc(batch_kjt(0)).values()
        t.join()
        with pytest.raises(embd.StepAbortedError) as e:
            out.sum().backward()
        assert e.value.code == embd.codes["EMBD_ECANCELED"] and e.value.step == 0
        assert ebc.step == 1
        trainer_1_rejoins_for_step(svc, ebc, 1)
    finally:
        svc.stop()


def test_a_service_that_goes_away_mid_step_raises_and_does_not_hang(tmp_path: Path) -> None:
    svc = Service(tmp_path, TABLES, B, trainers=2).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket, index=0)   # no timeout
        threading.Timer(0.5, svc.signal, (signal.SIGKILL,)).start()
        t0 = time.monotonic()
        with pytest.raises(embd.ServiceGoneError, match="closed the connection"):
            ebc(batch_kjt(0))                      # trainer 1 never comes
        assert time.monotonic() - t0 < 5
        with pytest.raises(embd.InvalidArgumentError, match="step 0: its forward was given up "
                                                            "on .ServiceGoneError"):
            ebc(batch_kjt(1))
    finally:
        svc.stop()


def test_an_evaluation_given_up_on_leaves_the_backward_saying_why(tmp_path: Path) -> None:
    svc = Service(tmp_path, TABLES, B, trainers=1).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket, index=0, timeout=1)
        out = ebc(batch_kjt(0))                    # step 0's backward is now due
        svc.signal(signal.SIGSTOP)                 # the evaluation's wait times out
        try:
            ebc.eval()
            with pytest.raises(embd.TimedOutError):
                ebc(batch_kjt(1))
        finally:
            svc.signal(signal.SIGCONT)
        ebc.train()
        with pytest.raises(embd.InvalidArgumentError, match="step 0: its evaluation was given "
                                                            "up on .TimedOutError"):
            out.values().sum().backward()
    finally:
        svc.stop()


class GradLoss(torch.nn.Module):
    """The loss sum(pooled * grad) of a batch (kjt, grad), returned as TorchRec's pipelines
    expect: (losses, output)."""

    def __init__(self, ebc: embd.torch.EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: Tuple[KeyedJaggedTensor, torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.ebc(batch[0]).values()
        return (out * batch[1]).sum(), out.detach()


def grad_batches(steps: int) -> Iterator[Tuple[KeyedJaggedTensor, torch.Tensor]]:
    return ((batch_kjt(s), torch.from_numpy(make_grad(B, 24, s, 0, salt=3)))
            for s in range(steps))


def test_train_pipeline_equals_unpipelined_steps_and_stops_after_the_last_batch(
        tmp_path: Path) -> None:
    """3 batches through TrainPipeline, then StopIteration; outputs and tables bit-equal to
    unpipelined steps on a second service from the same weights."""
    w0 = initial_weights(TABLES, 9)
    (tmp_path / "plain").mkdir()
    (tmp_path / "piped").mkdir()
    plain = Service(tmp_path / "plain", TABLES, B, trainers=1, weights=w0).start()
    piped = Service(tmp_path / "piped", TABLES, B, trainers=1, weights=w0).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(plain.socket)
        want = [train_step(ebc, s) for s in range(3)]
        ebc.close()
        ebc = embd.torch.EmbeddingBagCollection(piped.socket)
        pipeline = embd.torch.TrainPipeline(GradLoss(ebc), sparse_features=lambda b: b[0])
        batches = grad_batches(3)
        got = [pipeline.progress(batches)]
        assert ebc.prefetched is not None and ebc.step == 1   # batch 1 posted as step 1
        got += [pipeline.progress(batches), pipeline.progress(batches)]
        assert ebc.prefetched is None and ebc.step == 3       # the last step prefetched nothing
        with pytest.raises(StopIteration):
            pipeline.progress(batches)
        for s in range(3):
            np.testing.assert_array_equal(got[s].numpy(), want[s].numpy(), err_msg=f"step {s}")
        ebc.close()
        for t in TABLES:
            np.testing.assert_array_equal(piped.weights(t.name, 3), plain.weights(t.name, 3),
                                          err_msg=t.name)
            assert np.abs(piped.weights(t.name, 3) - w0[t.name]).max() > 1e-3
    finally:
        plain.stop()
        piped.stop()


def test_a_refused_prefetched_batch_raises_at_its_forward_and_the_next_step_runs(
        one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    bad = out_of_range_kjt()
    out = ebc(batch_kjt(0)).values()
    ebc.prefetch(bad)                              # posted as step 1, refused by the service
    (out * torch.from_numpy(make_grad(B, 24, 0, 0, salt=3))).sum().backward()
    assert ebc.step == 1
    with pytest.raises(embd.OutOfRangeError, match="id 25 of feature 'f_c' outside table 't_c'"):
        ebc(bad)
    assert ebc.step == 2 and ebc.prefetched is None   # the trainer sat step 1 out
    # a KJT the layout refuses raises at its forward too, naming the key, and posts nothing
    wrong = batch_kjt(2, keys=["f_a", "f_x", "f_c"])
    ebc.prefetch(wrong)
    with pytest.raises(embd.InvalidArgumentError, match="KJT key 'f_x' .position 1."):
        ebc(wrong)
    assert ebc.step == 2
    train_step(ebc, 2)
    assert ebc.step == 3


def test_a_prefetched_batch_takes_the_next_forward_and_nothing_else(one: Service) -> None:
    ebc = embd.torch.EmbeddingBagCollection(one.socket)
    out = ebc(batch_kjt(0)).values()
    ebc.prefetch(batch_kjt(1))
    with pytest.raises(embd.InvalidArgumentError, match="prefetch while the batch of step 1"):
        ebc.prefetch(batch_kjt(2))
    with pytest.raises(embd.InvalidArgumentError,
                       match="forward of step 1 before the backward of step 0"):
        ebc(batch_kjt(1))
    out.sum().backward()
    with pytest.raises(embd.InvalidArgumentError,
                       match="another batch than the one prefetched for step 1"):
        ebc(batch_kjt(2))
    with torch.no_grad(), pytest.raises(embd.InvalidArgumentError,
                                        match="evaluation while the batch of step 1"):
        ebc(batch_kjt(1))
    train_step(ebc, 1)             # an equal KJT (a new object) takes the prefetched lookup
    assert ebc.step == 2 and ebc.prefetched is None
    ebc.eval()
    with pytest.raises(embd.InvalidArgumentError, match="prefetch in eval"):
        ebc.prefetch(batch_kjt(2))
    ebc(batch_kjt(2))              # evaluations run again
    ebc.train()
    ebc.prefetch(batch_kjt(2))     # between steps: posted as the next step
    train_step(ebc, 2)
    assert ebc.step == 3


def test_a_step_aborted_while_the_next_is_prefetched_keeps_the_prefetched_batch(
        tmp_path: Path) -> None:
    svc = Service(tmp_path, TABLES, B, trainers=2).start()
    try:
        ebc = embd.torch.EmbeddingBagCollection(svc.socket, index=0, timeout=30)
        c = embd.Client(svc.socket, index=1)
        ebc.eval()
        want = ebc(batch_kjt(1)).values()         # the rows as they are: step 0 will abort
        ebc.train()

        def trainer_1_dies_after_its_forward() -> None:
            b = c.batch(0)
            c.forward(0, 0, b.write(np.ones((3, B)), np.zeros(3 * B)))
            del b
            c.close()

        t = ThreadTrainer(trainer_1_dies_after_its_forward)
        out = ebc(batch_kjt(0)).values()
        ebc.prefetch(batch_kjt(1))                # FORWARD 1 posted before the abort
        t.join()
        with pytest.raises(embd.StepAbortedError) as e:
            out.sum().backward()
        assert e.value.step == 0 and ebc.step == 1 and ebc.prefetched is not None
        # the prefetched batch is step 1's, run with the trainers still connected
        got = train_step(ebc, 1)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        assert ebc.step == 2 and ebc.prefetched is None
        trainer_1_rejoins_for_step(svc, ebc, 2)
    finally:
        svc.stop()
