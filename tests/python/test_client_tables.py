"""embd.Client's evaluation lookups, short batches and live table access against the real
embd: an eval equals the next training forward and changes no row, a batch of fewer samples
than batch_size trains like numpy's reference, rows read and written by range, by ids and in
chunks (a table larger than one message), the optimizer's state, an fp16 table's data type,
and refusals carrying the code and naming the table or row."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator

import numpy as np
import pytest

import embd
from support import Service, TableSpec, initial_weights, make_batch, make_grad, pool, row_grads

B = 4
TABLES = [
    TableSpec("t_sum", 20, 8, "sum", ("f_a", "f_b"), {"type": "sgd", "lr": 0.5}),
    TableSpec("t_mean", 12, 4, "mean", ("f_c",), {"type": "adagrad", "lr": 0.25, "eps": 1e-8}),
    # more rows than one table message carries (128 KiB / (8 + 4 * 4) bytes = 5461 rows)
    TableSpec("t_big", 12000, 4, "sum", ("f_d",), {"type": "sgd", "lr": 0.1}),
]
D = 8 + 8 + 4 + 4
SALT = 8


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, TABLES, B, trainers=1, weights=initial_weights(TABLES, 5)).start()
    yield svc
    svc.stop()


def all_rows(c: embd.Client) -> Dict[str, np.ndarray]:
    return {t.name: c.read_rows(t.name) for t in TABLES}


def train(c: embd.Client, step: int, b: int = B) -> None:
    batch = c.batch(step % embd.SLOTS)
    nb = make_batch(TABLES, b, step, 0, salt=SALT)
    n = batch.write(nb.lengths, nb.values)
    c.forward(batch.slot, step, n)
    batch.grad[:b] = make_grad(b, D, step, 0, salt=SALT)
    c.backward(batch.slot, step, n)


def test_a_short_batch_trains_like_numpy(one: Service) -> None:
    w = initial_weights(TABLES, 5)
    with embd.Client(one.socket) as c:
        b = c.batch(0)
        nb = make_batch(TABLES, 2, 0, 0, salt=SALT)      # 2 of B = 4 samples
        n = b.write(nb.lengths, nb.values)
        assert b.batch_size == 2 and n == nb.values.size
        np.testing.assert_array_equal(b.lengths_of(2), nb.lengths)
        b.pooled[:] = np.nan                               # rows 2, 3 must stay untouched
        c.forward(0, 0, n)                                 # batch_size taken from the slot
        for i, f in enumerate(c.layout.features):
            t = next(t for t in TABLES if t.name == f.table)
            np.testing.assert_allclose(b.pooled[:2, f.offset:f.offset + f.dim],
                                       pool(w[t.name], nb.lengths[i], nb.ids[i], t.pooling),
                                       atol=1e-6, err_msg=f.name)
        assert np.isnan(b.pooled[2:]).all()
        g = make_grad(2, D, 0, 0, salt=SALT)
        b.grad[:2] = g
        c.backward(0, 0, n)
        t = TABLES[0]
        rg, _ = row_grads(t.rows, t.dim, [(nb.lengths[i], nb.ids[i], g[:, 8 * i:8 * i + 8])
                                          for i in (0, 1)], t.pooling)
        np.testing.assert_allclose(c.read_rows("t_sum"), w["t_sum"] - t.optimizer["lr"] * rg,
                                   atol=1e-6)
        with pytest.raises(embd.InvalidArgumentError, match="lengths: shape"):
            b.write(np.ones((3, B + 1)), np.zeros(3 * (B + 1)))
        with pytest.raises(embd.InvalidArgumentError, match="batch_size: 5 samples, at most 4"):
            c.forward(1, 1, 0, batch_size=B + 1)
        del b
        train(c, 1)                                        # a full batch again


def test_eval_is_the_next_forward_and_changes_nothing(one: Service) -> None:
    with embd.Client(one.socket) as c:
        train(c, 0)
        train(c, 1)
        before = all_rows(c)
        m1 = c.read_rows("t_mean", array=embd.TableArray.MOMENTUM1)
        nb = make_batch(TABLES, B, 2, 0, salt=SALT)
        e = c.batch(0)
        n = e.write(nb.lengths, nb.values)
        c.eval(0, n)
        evaluated = e.pooled.copy()
        c.eval(0, n)                                        # again: the same rows
        np.testing.assert_array_equal(e.pooled, evaluated)
        for name, rows in all_rows(c).items():
            np.testing.assert_array_equal(rows, before[name], err_msg=name)
        np.testing.assert_array_equal(c.read_rows("t_mean", array=embd.TableArray.MOMENTUM1),
                                      m1)
        assert c.table_info("t_sum").applied_step == 2
        c.forward(0, 2, n)                                  # step 2, same batch
        np.testing.assert_array_equal(e.pooled, evaluated)
        # between step 2's forward and backward: the rows step 2's forward read
        o = c.batch(1)
        c.eval(1, o.write(nb.lengths, nb.values))
        np.testing.assert_array_equal(o.pooled, evaluated)
        e.grad[:] = make_grad(B, D, 2, 0, salt=SALT)
        c.backward(0, 2, n)
        # a short evaluation after the update: its rows moved
        short = make_batch(TABLES, 3, 2, 0, salt=SALT)
        c.eval(1, o.write(short.lengths, short.values))
        assert o.batch_size == 3
        assert not np.array_equal(o.pooled[:3], evaluated[:3])
        del e, o
        assert c.resumed_step == 0 and c.table_info("t_sum").applied_step == 3


def test_rows_by_range_ids_and_chunks(one: Service) -> None:
    w = initial_weights(TABLES, 5)
    with embd.Client(one.socket) as c:
        info = c.table_info("t_big")
        assert (info.num_embeddings, info.cols, info.applied_step) == (12000, 4, 0)
        assert info.max_rows < 12000                         # the read below takes chunks
        np.testing.assert_array_equal(c.read_rows("t_big"), w["t_big"])
        np.testing.assert_array_equal(c.read_rows(2, 100, 200), w["t_big"][100:200])
        ids = np.array([11999, 0, 5000, 5000, 7])
        np.testing.assert_array_equal(c.read_rows("t_big", ids=ids), w["t_big"][ids])
        chunks = list(c.iter_rows("t_big", chunk_rows=5000))
        assert [(s, r.shape) for s, r in chunks] == [(0, (5000, 4)), (5000, (5000, 4)),
                                                      (10000, (2000, 4))]
        np.testing.assert_array_equal(np.concatenate([r for _, r in chunks]), w["t_big"])
        new = np.arange(12000 * 4, dtype=np.float32).reshape(12000, 4) / 1000
        c.write_rows("t_big", new)                           # chunked too
        np.testing.assert_array_equal(c.read_rows("t_big"), new)
        c.write_rows("t_sum", np.full((2, 8), 3.5), ids=[19, 4])
        c.write_rows("t_sum", np.full((1, 8), -1.0), start=7)
        got = c.read_rows("t_sum")
        assert (got[[4, 19]] == 3.5).all() and (got[7] == -1).all()
        np.testing.assert_array_equal(np.delete(got, [4, 7, 19], 0),
                                      np.delete(w["t_sum"], [4, 7, 19], 0))
        # the rows written are what the next step reads
        b = c.batch(0)
        lengths = np.zeros((4, B), np.int32)
        lengths[0, 0] = 1
        c.forward(0, 0, b.write(lengths, [19]))
        assert (b.pooled[0, :8] == 3.5).all()
        b.grad[:] = 0
        c.backward(0, 0, 1)
        del b


def test_optimizer_state_is_read_and_written(one: Service) -> None:
    with embd.Client(one.socket) as c:
        m = embd.TableArray.MOMENTUM1
        assert c.table_info("t_mean", m).cols == 4
        assert not c.read_rows("t_mean", array=m).any()
        train(c, 0)
        m1 = c.read_rows("t_mean", array=m)
        assert (m1 > 0).any()
        c.write_rows("t_mean", np.ones((12, 4)), array=m)
        np.testing.assert_array_equal(c.read_rows("t_mean", array=m), 1)
        with pytest.raises(embd.InvalidArgumentError, match="t_sum"):
            c.table_info("t_sum", m)                         # sgd keeps no state


def test_refusals_name_the_table_and_row(one: Service) -> None:
    with embd.Client(one.socket) as c:
        with pytest.raises(embd.NotFoundError, match="table 't_x'"):
            c.read_rows("t_x")
        with pytest.raises(embd.OutOfRangeError) as e:
            c.read_rows("t_sum", 15, 25)
        assert e.value.code == embd.codes["EMBD_ERANGE"] and "20" in e.value.message
        with pytest.raises(embd.OutOfRangeError, match="20"):
            c.read_rows("t_sum", ids=[3, 20])
        bad = np.zeros((1, 8), np.float32)
        bad[0, 5] = np.nan
        with pytest.raises(embd.InvalidArgumentError, match="finite"):
            c.write_rows("t_sum", bad, start=2)
        with pytest.raises(embd.InvalidArgumentError, match="floats for rows of 8"):
            c.write_rows("t_sum", np.zeros((2, 7)))
        np.testing.assert_array_equal(c.read_rows("t_sum", 2, 3),
                                      initial_weights(TABLES, 5)["t_sum"][2:3])


def test_the_layout_says_an_fp16_tables_data_type(tmp_path: Path) -> None:
    tables = [TableSpec("t32", 10, 8, "sum", ("f_a",), {"type": "sgd", "lr": 0.1}),
              TableSpec("t16", 10, 8, "sum", ("f_b",), {"type": "sgd", "lr": 0.1}, "fp16")]
    svc = Service(tmp_path, tables, B, trainers=1).start()
    try:
        with embd.Client(svc.socket) as c:
            assert [t.data_type for t in c.layout.tables] == [embd.DataType.FP32,
                                                              embd.DataType.FP16]
            # rows of an fp16 table travel as float32 and are stored rounded to fp16
            c.write_rows("t16", np.full((1, 8), 1 / 3), start=0)
            assert (c.read_rows("t16", 0, 1) == np.float32(np.float16(1 / 3))).all()
    finally:
        svc.stop()
