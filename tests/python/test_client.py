"""embd.Client against the real embd: the layout of the config, numpy views that are the
region itself, forward/backward numbers against numpy, submit/poll/wait, the trainer index
(LOCAL_RANK, any free one, a taken one), and errors carrying the code and the message."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import embd
from support import (Service, TableSpec, ThreadTrainer, initial_weights, make_batch, make_grad,
                     pool, row_grads)

B = 4
TABLES = [
    TableSpec("t_sum", 20, 8, "sum", ("f_a", "f_b"), {"type": "sgd", "lr": 0.5}),
    TableSpec("t_mean", 12, 4, "mean", ("f_c",), {"type": "sgd", "lr": 0.25}),
]


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Service]:
    """A service for one trainer, with known initial weights."""
    svc = Service(tmp_path, TABLES, B, trainers=1, weights=initial_weights(TABLES, 5)).start()
    yield svc
    svc.stop()


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, TABLES, B, trainers=2).start()
    yield svc
    svc.stop()


def test_layout_is_the_configs(one: Service) -> None:
    with embd.Client(one.socket) as c:
        l = c.layout
        assert (l.index, l.trainers_per_node, l.batch_size, l.resumed_step) == (0, 1, B, 0)
        assert l.feature_names == ["f_a", "f_b", "f_c"]
        assert [(f.table, f.dim, f.offset) for f in l.features] == [
            ("t_sum", 8, 0), ("t_sum", 8, 8), ("t_mean", 4, 16)]
        assert l.total_dim == 20
        assert [(t.name, t.num_embeddings, t.embedding_dim, t.pooling, t.features)
                for t in l.tables] == [("t_sum", 20, 8, embd.Pooling.SUM, ("f_a", "f_b")),
                                       ("t_mean", 12, 4, embd.Pooling.MEAN, ("f_c",))]
        assert l.max_values >= 3 * B
        b = c.batch(1)
        assert (b.lengths.shape, b.lengths.dtype) == ((3, B), np.int32)
        assert (b.values.shape, b.values.dtype) == ((l.max_values,), np.int64)
        assert (b.weights.shape, b.weights.dtype) == ((l.max_values,), np.float32)
        assert (b.pooled.shape, b.grad.shape) == ((B, 20), (B, 20))
        del b


def test_forward_backward_equal_numpy_through_views_of_the_region(one: Service) -> None:
    w = initial_weights(TABLES, 5)
    with embd.Client(one.socket) as c:
        for step in range(4):
            slot = step % embd.SLOTS
            b = c.batch(slot)
            pooled_before = b.pooled          # the same array object must see the result
            nb = make_batch(TABLES, B, step, 0, salt=1)
            n = b.write(nb.lengths, nb.values)
            assert n == nb.values.size
            c.forward(slot, step, n)
            for i, f in enumerate(c.layout.features):
                t = TABLES[0] if f.table == "t_sum" else TABLES[1]
                want = pool(w[t.name], nb.lengths[i], nb.ids[i], t.pooling)
                np.testing.assert_allclose(pooled_before[:, f.offset:f.offset + f.dim], want,
                                           atol=1e-6, err_msg=f"step {step} feature {f.name}")
            g = make_grad(B, 20, step, 0, salt=1)
            b.grad[:] = g
            c.backward(slot, step, n)
            # sgd on the rows that occur, every occurrence combined
            for t, feats, cols in [(TABLES[0], (0, 1), ((0, 8), (8, 16))),
                                   (TABLES[1], (2,), ((16, 20),))]:
                rg, _ = row_grads(t.rows, t.dim, [(nb.lengths[i], nb.ids[i], g[:, a:e])
                                                  for i, (a, e) in zip(feats, cols)], t.pooling)
                w[t.name] = (w[t.name] - t.optimizer["lr"] * rg).astype(np.float32)
            del b, pooled_before
        assert c.resumed_step == 0


def test_views_are_zero_copy_and_close_waits_for_them(one: Service) -> None:
    c = embd.Client(one.socket)
    b0, again = c.batch(0), c.batch(0)
    assert b0.values.__array_interface__["data"][0] == again.values.__array_interface__["data"][0]
    fresh = np.asarray(c._c.span(0, "values"))
    fresh[:3] = [7, 8, 9]
    assert list(b0.values[:3]) == [7, 8, 9]   # one memory, three arrays
    kept = b0.pooled
    del b0, again, fresh
    with pytest.raises(embd.BusyError) as e:
        c.close()
    assert e.value.code == embd.codes["EMBD_EBUSY"] and "1 numpy view" in e.value.message
    del kept
    c.close()
    assert c.closed
    with pytest.raises(embd.InvalidArgumentError, match="closed"):
        c.forward(0, 0, 0)


def test_device_outputs_refused_leave_the_slab(one: Service) -> None:
    """Device outputs from CPU ranks, or in a process without the CUDA driver, are refused
    (NotSupportedError saying why); the client goes on with numpy views of its slab."""
    w = initial_weights(TABLES, 5)
    with embd.Client(one.socket) as c:
        before = c.batch(0)
        with pytest.raises(embd.NotSupportedError) as e:
            c.device_outputs(0)
        assert e.value.code == embd.codes["EMBD_ENOTSUP"]
        assert "device outputs" in e.value.message
        assert ("no CUDA driver" in e.value.message
                or "the ranks compute on the CPU" in e.value.message), e.value.message
        assert c.device is None
        b = c.batch(0)
        assert b is before and isinstance(b.pooled, np.ndarray)
        nb = make_batch(TABLES, B, 0, 0, salt=3)
        c.forward(0, 0, b.write(nb.lengths, nb.values))
        f = c.layout.features[2]
        want = pool(w["t_mean"], nb.lengths[2], nb.ids[2], "mean")
        np.testing.assert_allclose(b.pooled[:, f.offset:f.offset + f.dim], want, atol=1e-6)
        del b, before


def test_submit_poll_wait(one: Service) -> None:
    with embd.Client(one.socket) as c:
        assert c.poll() is None
        c.submit(embd.Op.NOP, user_data=41)
        done = c.wait(timeout=5)
        assert (done.user_data, done.result, done.ok, done.error) == (41, 0, True, None)
        b = c.batch(0)
        nb = make_batch(TABLES, B, 0, 0, salt=2)
        n = b.write(nb.lengths, nb.values)
        c.submit(embd.Op.FORWARD, slot=0, step=0, num_values=n, user_data=42)
        done = c.wait(timeout=5).check()
        assert (done.user_data, done.step) == (42, 0)
        c.submit(embd.Op.BACKWARD, slot=0, step=0, num_values=n, user_data=43)
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            got = c.poll()
        assert got is not None and (got.user_data, got.ok) == (43, True)
        b.values[0] = 99                       # t_sum has 20 rows
        b.lengths[0, 0] = max(b.lengths[0, 0], 1)
        n = int(b.lengths.sum())
        c.submit(embd.Op.FORWARD, slot=0, step=1, num_values=n, user_data=44)
        bad = c.wait(timeout=5)
        assert not bad.ok and bad.user_data == 44
        assert isinstance(bad.error, embd.Error)
        assert bad.error.code == bad.result and "99" in bad.message
        with pytest.raises(type(bad.error)):
            bad.check()
        del b


def test_a_refused_batch_raises_with_the_services_message(one: Service) -> None:
    with embd.Client(one.socket) as c:
        b = c.batch(0)
        b.lengths[:] = 1
        b.values[:3 * B] = 0
        b.values[2 * B + 1] = 12              # f_c's table t_mean has 12 rows
        with pytest.raises(embd.OutOfRangeError) as e:
            c.forward(0, 0, 3 * B)
        assert e.value.code == embd.codes["EMBD_ERANGE"]
        assert "id 12 of feature 'f_c' outside table 't_mean' rows [0, 12)" in e.value.message
        with pytest.raises(embd.InvalidArgumentError, match="num_values"):
            c.forward(0, 0, c.layout.max_values + 1)
        with pytest.raises(embd.InvalidArgumentError, match=r"lengths: shape \(2,\)"):
            b.write([1, 1], [0, 0])
        del b


def test_no_service_and_bad_index(one: Service, tmp_path: Path) -> None:
    with pytest.raises(embd.NotFoundError) as e:
        embd.Client(str(tmp_path / "nothing.sock"))
    assert e.value.code == embd.codes["EMBD_ENOENT"] and "nothing.sock" in e.value.message
    with pytest.raises(embd.InvalidArgumentError, match="wanted_rank: 3, trainers are 0..0"):
        embd.Client(one.socket, index=3)


def test_index_from_local_rank_then_any_free_one(two: Service,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with embd.Client(two.socket) as c1:
        assert c1.layout.index == 1
        with pytest.raises(embd.BusyError, match="trainer 1 is connected"):
            embd.Client(two.socket)
        monkeypatch.delenv("LOCAL_RANK")
        with embd.Client(two.socket) as c0:
            assert c0.layout.index == 0
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(embd.InvalidArgumentError, match="LOCAL_RANK"):
        embd.Client(two.socket)


def test_waits_end_at_their_timeout_and_at_ctrl_c(two: Service) -> None:
    with embd.Client(two.socket, index=0) as c:
        b = c.batch(0)
        n = b.write(np.ones((3, B)), np.zeros(3 * B))
        t0 = time.monotonic()
        with pytest.raises(embd.TimedOutError):
            c.forward(0, 0, n, timeout=0.3)   # trainer 1 never posts
        assert time.monotonic() - t0 < 2
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            c.wait()
        assert time.monotonic() - t0 < 2
        del b


def test_a_service_that_goes_away_mid_step_raises(two: Service) -> None:
    with embd.Client(two.socket, index=0) as c:
        b = c.batch(0)
        n = b.write(np.ones((3, B)), np.zeros(3 * B))
        threading.Timer(0.3, two.signal, (signal.SIGKILL,)).start()
        t0 = time.monotonic()
        with pytest.raises(embd.ServiceGoneError) as e:
            c.forward(0, 0, n)                # waits for trainer 1 until the service dies
        assert e.value.code == embd.codes["EMBD_ECONNRESET"]
        assert time.monotonic() - t0 < 5
        del b


def test_one_client_is_not_used_by_two_threads_at_once(two: Service) -> None:
    with embd.Client(two.socket, index=0) as c:
        b = c.batch(0)
        n = b.write(np.ones((3, B)), np.zeros(3 * B))
        started = threading.Event()

        def waiting() -> None:
            started.set()
            c.forward(0, 0, n, timeout=3)

        t = ThreadTrainer(waiting)
        started.wait()
        time.sleep(0.5)                        # well inside its forward by now
        with pytest.raises(embd.BusyError, match="another thread"):
            c.submit(embd.Op.NOP)
        with pytest.raises(embd.TimedOutError):
            t.join()
        del b
