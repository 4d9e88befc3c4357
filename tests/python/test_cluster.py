"""embd.torch.EmbeddingBagCollection on a 2-node cluster of real embd processes (support.Cluster:
one rank and one trainer per node, Gloo on 127.0.0.1): a table row_wise over both nodes and
one table on each node. Every output is compared with a numpy reference of the cluster's SGD
(mean_over_trainers: each trainer's gradient divided by the 2 trainers) from the initial rows,
read through each node's own rows.
 - eval: both trainers evaluate together between training steps and get what the next training
   forward returns; nothing changes; state_dict() on either node is refused naming the node
   that holds the rest of the rows; load_state_dict() and write_rows() are refused with the
   service's ENOTSUP message, and no row changes.
 - a re-formed cluster: node 1 is killed after the cluster checkpoint of step 2 (and step 2
   ran) and restarted; node 0's module raises ResumedError naming step 2 (after a step that
   failed naming node 1) and leaves .step at 2, node 1's new trainer starts at 2 or is told so
   the same way, both redo step 2 and go on, and every output and row equals the reference;
   the same with every step pipelined (the next step's batch prefetched before the backward):
   node 1 dies while step 3 is prefetched on both nodes, node 0's prefetched step 3 fails
   naming node 1, and training resumes at step 2 as without pipelining.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

import embd
import embd.torch
from support import Cluster, TableSpec, ThreadTrainer, kjt, make_batch, make_grad, pool, row_grads

B = 4
LR = 0.1
TABLES = [TableSpec("t_rw", 40, 8, "sum", ("f_rw",), {"type": "sgd", "lr": LR}),
          TableSpec("t_n0", 20, 8, "sum", ("f_n0",), {"type": "sgd", "lr": LR}),
          TableSpec("t_n1", 30, 8, "sum", ("f_n1",), {"type": "sgd", "lr": LR})]
PLACEMENT = {"t_rw": "row_wise", "t_n0": 0, "t_n1": 1}
KEYS = ["f_rw", "f_n0", "f_n1"]
TOTAL_DIM = 24
TRAINERS = 2


def batch_kjt(step: int, trainer: int):
    return kjt(KEYS, make_batch(TABLES, B, step, trainer, salt=5))


def grad(step: int, trainer: int) -> np.ndarray:
    return make_grad(B, TOTAL_DIM, step, trainer, salt=5)


class Reference:
    """The cluster's rows after each step, from the initial ones: SGD on every row's
    gradient summed over both trainers' bags, each trainer's divided by the trainers."""

    def __init__(self, w0: Dict[str, np.ndarray]) -> None:
        self.w = [{k: v.astype(np.float64) for k, v in w0.items()}]   # w[s]: before step s

    def weights(self, step: int) -> Dict[str, np.ndarray]:
        while len(self.w) <= step:
            s = len(self.w) - 1
            nxt = {}
            for i, t in enumerate(TABLES):
                bags = []
                for g in range(TRAINERS):
                    b = make_batch(TABLES, B, s, g, salt=5)
                    bags.append((b.lengths[i], b.ids[i],
                                 grad(s, g)[:, 8 * i:8 * i + 8] / TRAINERS))
                rg, _ = row_grads(t.rows, t.dim, bags, t.pooling)
                nxt[t.name] = self.w[s][t.name] - LR * rg
            self.w.append(nxt)
        return self.w[step]

    def output(self, step: int, trainer: int) -> np.ndarray:
        """What trainer ``trainer``'s forward of ``step`` returns."""
        w = self.weights(step)
        b = make_batch(TABLES, B, step, trainer, salt=5)
        return np.concatenate([pool(w[t.name], b.lengths[i], b.ids[i], t.pooling)
                               for i, t in enumerate(TABLES)], axis=1)


def read_all(cl: Cluster, clients: List[embd.Client]) -> Dict[str, np.ndarray]:
    """Every table's rows, each node's part read on that node."""
    out = {"t_n0": clients[0].read_rows("t_n0"), "t_n1": clients[1].read_rows("t_n1")}
    parts = []
    for n in range(2):
        begin, end = cl.rows_of("t_rw", n)
        parts.append(clients[n].read_rows("t_rw", begin, end))
    out["t_rw"] = np.concatenate(parts)
    return out


def train_step(ebc: embd.torch.EmbeddingBagCollection, trainer: int) -> np.ndarray:
    """The module's next step (ebc.step) with this trainer's batch of that step."""
    step = ebc.step
    out = ebc(batch_kjt(step, trainer)).values()
    (out * torch.from_numpy(grad(step, trainer))).sum().backward()
    return out.detach().numpy().copy()


def pipelined_step(ebc: embd.torch.EmbeddingBagCollection, trainer: int, last: int) -> np.ndarray:
    """train_step with the batch of the step after it prefetched before the backward (none
    after step ``last``)."""
    step = ebc.step
    out = ebc(batch_kjt(step, trainer)).values()
    if step < last:
        ebc.prefetch(batch_kjt(step + 1, trainer))
    (out * torch.from_numpy(grad(step, trainer))).sum().backward()
    return out.detach().numpy().copy()


def both(bodies) -> None:
    threads = [ThreadTrainer(b) for b in bodies]
    for t in threads:
        t.join(60)


@pytest.fixture
def checkpoints(tmp_path: Path) -> Dict[str, object]:
    return {"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every_steps": 2,
            "checkpoint_keep": 0}


def test_cluster_eval_state_dict_and_refused_writes(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, TABLES, B, PLACEMENT).start()
    try:
        ebcs = [embd.torch.EmbeddingBagCollection(cl.sockets[n], index=0, timeout=30)
                for n in range(2)]
        ref = Reference(read_all(cl, [e._client for e in ebcs]))
        outs: Dict[tuple, np.ndarray] = {}

        def trainer(g: int, steps: int) -> None:
            for _ in range(steps):
                s = ebcs[g].step
                outs[(s, g)] = train_step(ebcs[g], g)

        both([lambda g=g: trainer(g, 2) for g in range(2)])
        evals: Dict[int, np.ndarray] = {}

        def evaluate(g: int) -> None:
            ebcs[g].eval()
            with torch.no_grad():
                evals[g] = ebcs[g](batch_kjt(2, g)).values().numpy().copy()
            ebcs[g].train()

        both([lambda g=g: evaluate(g) for g in range(2)])
        assert [e.step for e in ebcs] == [2, 2]      # eval is no step
        both([lambda g=g: trainer(g, 2) for g in range(2)])
        for g in range(2):
            np.testing.assert_allclose(evals[g], outs[(2, g)], atol=1e-6,
                                       err_msg=f"trainer {g}: eval before step 2")
            for s in range(4):
                np.testing.assert_allclose(outs[(s, g)], ref.output(s, g), atol=1e-5,
                                           err_msg=f"trainer {g} step {s}")

        # state_dict: t_rw's other half is on the other node, named with it
        with pytest.raises(embd.NotFoundError, match=r"table 't_rw' row 20: columns \[0, \+8\) "
                                                     r"are on node 1, this is node 0"):
            ebcs[0].state_dict()
        with pytest.raises(embd.NotFoundError, match=r"table 't_rw' row 0: columns \[0, \+8\) "
                                                     r"are on node 0, this is node 1"):
            ebcs[1].state_dict()
        before = read_all(cl, [e._client for e in ebcs])
        for n, w in before.items():
            np.testing.assert_allclose(w, ref.weights(4)[n], atol=1e-5, err_msg=n)
        full = {f"embedding_bags.{n}.weight": torch.from_numpy(w * 0)
                for n, w in before.items()}
        refusal = "table writes on a cluster are not supported"
        for e in ebcs:
            with pytest.raises(embd.NotSupportedError, match=refusal) as err:
                e.load_state_dict(full)
            assert err.value.code_name == "EMBD_ENOTSUP"
            with pytest.raises(embd.NotSupportedError, match=refusal):
                e._client.write_rows("t_n0", before["t_n0"][:2] * 0, ids=[0, 1])
        after = read_all(cl, [e._client for e in ebcs])
        for n in before:
            np.testing.assert_array_equal(after[n], before[n], err_msg=n)
        both([lambda g=g: trainer(g, 1) for g in range(2)])   # the cluster trains on
        for g in range(2):
            np.testing.assert_allclose(outs[(4, g)], ref.output(4, g), atol=1e-5)
        for e in ebcs:
            e.close()
    finally:
        cl.stop()


@pytest.mark.parametrize("pipelined", [False, True])
def test_restarted_node_makes_the_module_raise_resumed_and_training_goes_on(
        tmp_path: Path, checkpoints: Dict[str, object], pipelined: bool) -> None:
    cl = Cluster(tmp_path, TABLES, B, PLACEMENT, extra=checkpoints).start()
    try:
        ebcs = [embd.torch.EmbeddingBagCollection(cl.sockets[n], index=0, timeout=30)
                for n in range(2)]
        ref = Reference(read_all(cl, [e._client for e in ebcs]))
        first: Dict[tuple, np.ndarray] = {}

        def steps_0_to_2(g: int) -> None:
            for s in range(3):    # pipelined: step 3's batch is posted when node 1 dies
                first[(s, g)] = pipelined_step(ebcs[g], g, 3) if pipelined else \
                    train_step(ebcs[g], g)

        both([lambda g=g: steps_0_to_2(g) for g in range(2)])
        manifest = tmp_path / "ckpt" / "step-2" / "manifest.json"
        deadline = time.monotonic() + 15
        while not manifest.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert manifest.exists(), f"no checkpoint of step 2:\n{cl.log(0)}"
        ebcs[1].close()
        cl.kill(1)
        cl.start_node(1)                                # restores the checkpoint of step 2
        # connected before node 1 rejoined and restored: it may not know step 2 yet
        late = embd.torch.EmbeddingBagCollection(cl.sockets[1], index=0, timeout=30)
        late_first_step = late.step
        again: Dict[tuple, np.ndarray] = {}
        resumed: Dict[int, List[embd.ResumedError]] = {0: [], 1: []}
        other: List[str] = []

        def loop(ebc: embd.torch.EmbeddingBagCollection, g: int, must_resume: bool) -> None:
            """A training loop that survives the cluster re-forming: post the module's next
            step until it completed step 4 (node 0's: only after the cluster said where it
            resumed)."""
            end = time.monotonic() + 40
            while time.monotonic() < end and not (ebc.step == 5 and
                                                  (resumed[g] or not must_resume)):
                s = ebc.step
                try:
                    out = pipelined_step(ebc, g, 4) if pipelined else train_step(ebc, g)
                except embd.ResumedError as e:
                    resumed[g].append(e)
                    assert ebc.step == e.step, (ebc.step, e.step)
                    continue
                except embd.TryAgainError:
                    time.sleep(0.02)                    # the same step, a little later
                    continue
                except embd.Error as e:
                    other.append(f"trainer {g} step {s}: {type(e).__name__}: {e}")
                    continue
                if resumed[g] or not must_resume:
                    again[(s, g)] = out

        both([lambda: loop(ebcs[0], 0, True), lambda: loop(late, 1, False)])
        assert resumed[0], f"node 0's module raised no ResumedError; other errors: {other}"
        for g in range(2):
            for e in resumed[g]:
                assert e.step == 2 and e.code_name == "EMBD_ERESUMED", (g, e)
                assert "resumed at step 2" in str(e) and "feed the batch of step 2" in str(e)
        assert late_first_step == 2 or resumed[1], (
            f"node 1's new trainer started at step {late_first_step} and was never told to "
            f"resume at 2; errors: {other}")
        # before the cluster re-formed, node 0's step failed naming node 1 (gone); never
        # anything else, and nothing on the restarted node
        assert all(o.startswith("trainer 0 ") and "node 1" in o for o in other), other
        assert ebcs[0].step == 5 and late.step == 5
        for g in range(2):
            np.testing.assert_allclose(again[(2, g)], first[(2, g)], atol=1e-6,
                                       err_msg=f"trainer {g}: the redone step 2")
            for s in (2, 3, 4):
                np.testing.assert_allclose(again[(s, g)], ref.output(s, g), atol=1e-5,
                                           err_msg=f"trainer {g} step {s} after resuming")
        w = read_all(cl, [ebcs[0]._client, late._client])
        for n in w:
            np.testing.assert_allclose(w[n], ref.weights(5)[n], atol=1e-5, err_msg=n)
        ebcs[0].close()
        late.close()
    finally:
        cl.stop()
