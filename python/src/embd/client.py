"""embd.Client: a trainer's connection to the node's embd service (libembdclient).

The service sends the layout at connect (:class:`Layout`: tables, features in KJT key order,
their columns in the pooled output, the batch size). Batches are never copied on their way in
or out: :meth:`Client.batch` hands numpy views of one of the two batch slots in the shared
region; the trainer writes a KJT into a slot's ``lengths`` / ``values`` (``weights``), posts
FORWARD of step ``s``, reads ``pooled``, writes dL/d(pooled) into ``grad`` and posts BACKWARD of
step ``s``. Steps run once every trainer of the node posted them, and a step's rows are updated
once with every trainer's gradient (divided by the trainers of the cluster unless the
service's ``gradient_scaling`` says otherwise). Use slot ``s % 2`` for step ``s`` so that step
``s + 1`` can be filled while ``s`` runs; a slot's ``pooled`` is overwritten two steps later.
A batch may hold fewer samples than the layout's ``batch_size`` (the last batch of an epoch):
:meth:`Batch.write` takes them and the requests post that many. :meth:`Client.eval` looks a
batch up without training (no step, no backward, no row changed), and :meth:`Client.read_rows`
/ :meth:`Client.write_rows` read and write a table's rows between steps.

A trainer on a GPU may ask for its slots' ``pooled`` and ``grad`` in memory of its GPU
(:meth:`Client.device_outputs`): they are then torch tensors on that device, and the service
copies the outputs there and the gradients from there.

Every failure raises an :class:`embd.Error` subclass with the ``EMBD_E*`` code and the message
(see :mod:`embd.errors`). One client must not be used by two threads at once
(:class:`embd.BusyError`).
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

from embd import _client
from embd.errors import (Error, InvalidArgumentError, NotFoundError, TryAgainError, codes,
                         error_for)

#: Batch slots of a client's region (``EMBD_CLIENT_SLOTS``).
SLOTS: int = _client.SLOTS
#: Where ``embd`` listens unless its config says otherwise.
DEFAULT_SOCKET = "/run/embd/embd.sock"


class Pooling(enum.IntEnum):
    """How a table pools the rows of a bag (``enum embd_pooling``)."""

    SUM = _client.POOLING_SUM
    MEAN = _client.POOLING_MEAN  # the mean of an empty bag is 0, as in TorchRec


class Op(enum.IntEnum):
    """What a request asks for (``enum embd_request_op``)."""

    NOP = _client.OP_NOP  # completes at once: a round trip
    FORWARD = _client.OP_FORWARD
    BACKWARD = _client.OP_BACKWARD
    EVAL = _client.OP_EVAL  # an evaluation lookup: no step, nothing changes


class DataType(enum.IntEnum):
    """How the service stores a table's rows (``enum embd_data_type``); rows are read and
    written as float32 whatever it is."""

    FP32 = _client.DTYPE_FP32
    FP16 = _client.DTYPE_FP16


class TableArray(enum.IntEnum):
    """An array of a table (``enum embd_table_array``): its weights, or its fused optimizer's
    state."""

    WEIGHTS = _client.TABLE_WEIGHTS      # num_embeddings x embedding_dim
    #: adagrad's sum of squares, adam's m (embedding_dim wide); rowwise_adagrad's one value per
    #: column shard of a row (1 wide unless the table is column-wise sharded)
    MOMENTUM1 = _client.TABLE_MOMENTUM1
    MOMENTUM2 = _client.TABLE_MOMENTUM2  # adam's v (embedding_dim wide)


@dataclass(frozen=True)
class TableInfo:
    """The shape of one array of a table (``struct embd_table_info``)."""

    num_embeddings: int         #: rows
    cols: int                   #: floats per row
    max_rows: int               #: rows one message carries (reads and writes are split)
    applied_step: int           #: the rows hold the update of every step before it
    optimizer_step: int         #: the table's optimizer steps so far (adam's t)


@dataclass(frozen=True)
class Table:
    """One table of the service: ``features`` are the names of the features it serves, in the
    layout's order."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Pooling
    features: Tuple[str, ...]
    data_type: DataType = DataType.FP32


@dataclass(frozen=True)
class Feature:
    """One feature (KJT key): its table and its columns ``[offset, offset + dim)`` of the
    pooled output."""

    name: str
    table: str
    dim: int
    offset: int


@dataclass(frozen=True)
class Layout:
    """What the service told this trainer at connect (``struct embd_client_layout``)."""

    index: int                  #: this trainer's index on its node, 0..trainers_per_node-1
    trainers_per_node: int
    batch_size: int             #: samples of every batch (TorchRec's KJT stride)
    total_dim: int              #: columns of the pooled output
    max_values: int             #: most ids one batch may hold
    resumed_step: int           #: the first step to post (see Client.resumed_step after that)
    tables: Tuple[Table, ...]
    features: Tuple[Feature, ...]   #: in KJT key order

    @property
    def feature_names(self) -> List[str]:
        """The KJT keys a batch must have, in this order."""
        return [f.name for f in self.features]


@dataclass
class Batch:
    """Numpy views (no copy) of one batch slot in the shared region, for a full batch of the
    layout's ``B`` samples.

    ``lengths[f, b]`` ids of feature f in sample b (int32; feature-major like a KJT's lengths),
    ``values`` / ``weights`` the ids (int64) and their weights, of which the first
    ``lengths.sum()`` are posted; ``pooled[b]`` the output row of sample b (written by forward),
    ``grad`` its gradient (read by backward). A batch of ``n < B`` samples (:attr:`batch_size`,
    set by :meth:`write`) uses the first ``F * n`` entries of the flat ``lengths`` (stride
    ``n``: see :meth:`lengths_of`) and the first ``n`` rows of ``pooled`` and ``grad``. With
    device outputs in CUDA memory (:meth:`Client.device_outputs`) ``pooled`` and ``grad`` are
    float32 torch tensors on that GPU, over the same memory the service writes and reads.
    """

    slot: int
    lengths: npt.NDArray[np.int32]
    values: npt.NDArray[np.int64]
    weights: npt.NDArray[np.float32]
    pooled: Any                 #: numpy float32 (B, total_dim), or a torch.Tensor on the GPU
    grad: Any
    #: samples of the batch in the slot: the layout's until :meth:`write` says otherwise;
    #: requests on this slot post this many unless given a batch_size
    batch_size: int = 0

    def __post_init__(self) -> None:
        if not self.batch_size:
            self.batch_size = self.lengths.shape[1]

    def lengths_of(self, batch_size: int) -> npt.NDArray[np.int32]:
        """The ``(num_features, batch_size)`` view of ``lengths`` a batch of ``batch_size``
        samples uses."""
        F, B = self.lengths.shape
        if not 1 <= batch_size <= B:
            raise InvalidArgumentError(f"batch_size: {batch_size} samples, 1..{B} per batch")
        return self.lengths.reshape(-1)[:F * batch_size].reshape(F, batch_size)

    def write(self, lengths: npt.ArrayLike, values: npt.ArrayLike,
              weights: Optional[npt.ArrayLike] = None) -> int:
        """Copies one batch into the slot and returns its number of ids, the ``num_values``
        to post. ``lengths`` is ``(num_features, n)`` for a batch of ``n`` samples, 1 <= n <=
        the layout's batch size, or flat in that order; ``n`` becomes :attr:`batch_size`."""
        lens = np.asarray(lengths)
        vals = np.asarray(values).reshape(-1)
        F, B = self.lengths.shape
        n = lens.shape[1] if lens.ndim == 2 else lens.size // F
        if lens.ndim > 2 or (lens.ndim == 2 and lens.shape[0] != F) or lens.size != F * n \
                or not 1 <= n <= B:
            raise InvalidArgumentError(f"lengths: shape {lens.shape}, the layout has {F} "
                                       f"features x 1..{B} samples")
        if vals.size > self.values.size:
            raise InvalidArgumentError(f"values: {vals.size} ids, at most max_values "
                                       f"{self.values.size} per batch")
        self.lengths.reshape(-1)[:lens.size] = lens.reshape(-1)
        self.batch_size = n
        self.values[:vals.size] = vals
        if weights is not None:
            w = np.asarray(weights).reshape(-1)
            if w.size != vals.size:
                raise InvalidArgumentError(f"weights: {w.size} entries for {vals.size} ids")
            self.weights[:w.size] = w
        return int(vals.size)


@dataclass(frozen=True)
class Completion:
    """The answer to a request posted with :meth:`Client.submit`."""

    user_data: int
    step: int
    result: int                 #: 0 or a negative EMBD_E* code
    message: str                #: what failed, when result is not 0

    @property
    def ok(self) -> bool:
        return self.result == 0

    @property
    def error(self) -> Optional[Error]:
        """The exception this completion stands for, or None when it succeeded."""
        if self.result == 0:
            return None
        return error_for(self.result, self.message, self.step)

    def check(self) -> "Completion":
        """Raises :attr:`error` when the request failed; returns self otherwise."""
        e = self.error
        if e is not None:
            raise e
        return self


def _timeout_ms(timeout: Optional[float]) -> int:
    return -1 if timeout is None else max(0, int(timeout * 1000))


def default_index() -> Optional[int]:
    """The trainer index a client asks for when given none: ``LOCAL_RANK`` (set by torchrun),
    or None for any free index."""
    local = os.environ.get("LOCAL_RANK")
    if local is None or local == "":
        return None
    try:
        return int(local)
    except ValueError:
        raise InvalidArgumentError(f"LOCAL_RANK={local!r} is not a trainer index") from None


class Client:
    """A connection to the embd service at ``socket_path`` as trainer ``index``.

    ``socket_path`` defaults to ``$EMBD_SOCKET``, then ``/run/embd/embd.sock``; ``index`` to
    ``$LOCAL_RANK`` (torchrun's), then any free index (the one taken is ``layout.index``). A
    taken index raises :class:`embd.BusyError`; a refused uid :class:`embd.PermissionDeniedError`;
    no service :class:`embd.NotFoundError`. ``timeout`` (seconds) bounds the wait for the
    service's welcome.
    """

    def __init__(self, socket_path: Optional[str] = None, index: Optional[int] = None,
                 timeout: Optional[float] = 10.0) -> None:
        self.socket_path: str = socket_path or os.environ.get("EMBD_SOCKET") or DEFAULT_SOCKET
        if index is None:
            index = default_index()
        want = _client.ANY_INDEX if index is None else int(index)
        if want < 0 and want != _client.ANY_INDEX:
            raise InvalidArgumentError(f"index: {want}, a trainer index is >= 0")
        self._c = _client.Client(self.socket_path, want, _timeout_ms(timeout))
        self.layout: Layout = _layout(self._c.layout())
        self._batches: Dict[int, Batch] = {}
        #: the CUDA device whose memory holds pooled and grad (device_outputs), or None
        self.device: Optional[int] = None

    # ---- the layout ------------------------------------------------------------------------

    @property
    def resumed_step(self) -> int:
        """The step to post next after a resume: the layout's at connect, and after an
        :class:`embd.ResumedError` the step the cluster resumed at."""
        return int(self._c.resumed_step)

    # ---- batch slots ---------------------------------------------------------------------

    def batch(self, slot: int) -> Batch:
        """Numpy views of batch slot ``slot`` (0 or 1). They stay valid until :meth:`close`,
        which refuses while any view of them is alive."""
        b = self._batches.get(slot)
        if b is None:
            spans = {n: np.asarray(self._c.span(slot, n))
                     for n in ("lengths", "values", "weights")}
            for n in ("pooled", "grad"):
                span = self._c.span(slot, n)
                spans[n] = np.asarray(span) if self.device is None else \
                    _device_tensor(span, self.device)
            b = Batch(slot=slot, **spans)
            self._batches[slot] = b
        return b

    def device_outputs(self, device: int = 0) -> None:
        """Puts both slots' ``pooled`` and ``grad`` in memory of this process's CUDA device
        ``device`` (``embd_device_outputs``, include/embd/client.h): the service allocates
        them on that GPU (found by its UUID, so the service's ``CUDA_VISIBLE_DEVICES`` may
        number it otherwise), copies every forward's rows there before the forward returns
        and every gradient from there when the step's backward runs. From then on
        :meth:`batch` hands them out as torch tensors on that device (no copy; Batch objects
        taken before keep their numpy views of the slab, which no request uses any more), and
        :meth:`backward` first waits for the device's work, so a gradient written by a kernel
        is complete before the service reads it. Once per client. Raises
        :class:`embd.NotSupportedError` (no CUDA driver here; the service's ranks are CPU
        ranks; its driver cannot export the GPU's memory), :class:`embd.NotFoundError` (no
        such device here, or one the service does not see: the message names those it
        sees), :class:`embd.BusyError` (asked before); after a failure the client goes on
        with the slab's buffers."""
        on_device, _ = self._c.device_outputs(int(device))
        self._batches.clear()
        # the CPU ranks' test double hands out host memory: numpy views as before
        self.device = int(device) if on_device else None

    # ---- requests --------------------------------------------------------------------------

    def forward(self, slot: int, step: int, num_values: int, weighted: bool = False,
                timeout: Optional[float] = None, batch_size: Optional[int] = None) -> None:
        """Looks up the batch in ``slot`` as step ``step``; ``pooled`` holds the result on
        return. ``batch_size``: its samples (default: the slot's :attr:`Batch.batch_size`). Waits until every trainer of the node posted the step (``timeout`` seconds at
        most; None: no limit, Ctrl-C still works).

        An error the service answered has ``step`` set: a refused batch (the message names the
        field) or :class:`embd.StepAbortedError` end the step for this trainer, whose next
        step is ``step + 1``; :class:`embd.TryAgainError` asks for the same step again later;
        :class:`embd.ResumedError` names the step to post next. An error with ``step`` None is
        this process's own (:class:`embd.TimedOutError`, :class:`embd.ServiceGoneError`...):
        a request that timed out may still run, so reconnect before going on."""
        self._c.forward(slot, step, num_values, weighted, _timeout_ms(timeout),
                        self._batch_size(slot, batch_size))

    def backward(self, slot: int, step: int, num_values: int, weighted: bool = False,
                 timeout: Optional[float] = None, batch_size: Optional[int] = None) -> None:
        """Posts ``grad`` of the batch in ``slot`` for step ``step`` (the same batch as its
        forward, ``batch_size`` as there) and waits until the service applied every
        trainer's gradient."""
        self._device_idle()
        self._c.backward(slot, step, num_values, weighted, _timeout_ms(timeout),
                         self._batch_size(slot, batch_size))

    def _device_idle(self) -> None:
        """With device outputs: the device's work done, so a gradient written there is in
        its memory before the service copies it (client.h's rule)."""
        if self.device is not None:
            import torch
            torch.cuda.synchronize(self.device)

    def eval(self, slot: int, num_values: int, weighted: bool = False,
             timeout: Optional[float] = None, batch_size: Optional[int] = None) -> None:
        """Looks up the batch in ``slot`` without training (TorchRec's eval mode): ``pooled``
        holds the rows as they are on return; no step is posted or waited for, no row changes.
        Between steps these are exactly the rows the next training forward reads. On one
        node it runs at once; on a cluster every trainer posts its evaluations at the same
        point of its steps, and an eval while this trainer's backward is due is refused
        (:class:`embd.InvalidArgumentError`). Use a slot no step in flight uses."""
        self._c.eval(slot, 0, num_values, weighted, _timeout_ms(timeout),
                     self._batch_size(slot, batch_size))

    def _batch_size(self, slot: int, batch_size: Optional[int]) -> int:
        if batch_size is not None:
            return int(batch_size)
        b = self._batches.get(slot)
        return 0 if b is None else b.batch_size

    def submit(self, op: Op, slot: int = 0, step: int = 0, num_values: int = 0,
               weighted: bool = False, user_data: int = 0,
               batch_size: Optional[int] = None) -> None:
        """Posts a request without waiting; its :class:`Completion` comes from :meth:`poll` or
        :meth:`wait` with the same ``user_data`` (below 2**63). Do not mix with
        :meth:`forward` / :meth:`backward` while requests are in flight."""
        if op == Op.BACKWARD:
            self._device_idle()
        self._c.submit(int(op), slot, step, num_values, weighted, user_data,
                       self._batch_size(slot, batch_size) if op != Op.NOP else 0)

    def poll(self) -> Optional[Completion]:
        """The oldest completion, or None when there is none yet."""
        t = self._c.poll()
        return None if t is None else Completion(*t)

    def wait(self, timeout: Optional[float] = None) -> Completion:
        """Waits for the oldest completion (``timeout`` seconds at most; None: no limit)."""
        return Completion(*self._c.wait(_timeout_ms(timeout)))

    # ---- live table access -----------------------------------------------------------------
    #
    # Through the control socket, answered while no step phase runs: between steps the rows
    # are exactly those the next training forward reads and writes are what it reads. A
    # trainer that reads or writes between its own steps holds the node's other trainers at
    # the next step meanwhile. Large requests travel in chunks of TableInfo.max_rows rows;
    # iter_rows reads a table chunk by chunk without holding all of it. A cluster refuses
    # writes (:class:`embd.NotSupportedError`); rows kept on another node are refused naming
    # it (:class:`embd.NotFoundError`).

    def table_index(self, table: Union[int, str]) -> int:
        """The index in ``layout.tables`` of a table given by index or name."""
        if isinstance(table, str):
            for i, t in enumerate(self.layout.tables):
                if t.name == table:
                    return i
            raise NotFoundError(f"table '{table}': the service has "
                                f"{[t.name for t in self.layout.tables]}")
        i = int(table)
        if not 0 <= i < len(self.layout.tables):
            raise NotFoundError(f"table {i}: the service has {len(self.layout.tables)}")
        return i

    def table_info(self, table: Union[int, str],
                   array: TableArray = TableArray.WEIGHTS) -> TableInfo:
        """The shape of ``array`` of ``table``; :class:`embd.InvalidArgumentError` when its
        optimizer keeps no such array."""
        return TableInfo(*self._c.table_info(self.table_index(table), int(array)))

    def read_rows(self, table: Union[int, str], start: int = 0, stop: Optional[int] = None, *,
                  ids: Optional[npt.ArrayLike] = None, array: TableArray = TableArray.WEIGHTS,
                  out: Optional[npt.NDArray[np.float32]] = None) -> npt.NDArray[np.float32]:
        """Rows ``start .. stop - 1`` (default: to the end) of ``array`` of ``table``, or the
        rows ``ids``, as float32 ``(n, cols)`` (into ``out`` when given: C-contiguous
        float32 of that shape). :class:`embd.TryAgainError` when a step ran between two
        chunks: read again between steps."""
        t = self.table_index(table)
        info = self.table_info(t, array)
        id_arr = None if ids is None else np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if id_arr is None:
            stop = info.num_embeddings if stop is None else stop
            n = max(0, stop - start)
        else:
            n = id_arr.size
        if out is None:
            out = np.empty((n, info.cols), np.float32)
        elif out.shape != (n, info.cols) or out.dtype != np.float32 \
                or not out.flags.c_contiguous:
            raise InvalidArgumentError(f"out: {out.dtype} {out.shape}, expected C-contiguous "
                                       f"float32 {(n, info.cols)}")
        self._c.table_read(t, int(array), out, start, id_arr)
        return out

    def iter_rows(self, table: Union[int, str], chunk_rows: Optional[int] = None,
                  array: TableArray = TableArray.WEIGHTS
                  ) -> Iterator[Tuple[int, npt.NDArray[np.float32]]]:
        """``(first_row, rows)`` of ``array`` of ``table`` in chunks of ``chunk_rows`` rows
        (default: one message's), so a table larger than memory can be streamed. Every chunk
        holds the same step (:class:`embd.TryAgainError` otherwise): post no step of this
        trainer until the iteration ends."""
        t = self.table_index(table)
        info = self.table_info(t, array)
        chunk = chunk_rows or info.max_rows
        if chunk < 1:
            raise InvalidArgumentError(f"chunk_rows: {chunk}, at least 1")
        for start in range(0, info.num_embeddings, chunk):
            rows = np.empty((min(chunk, info.num_embeddings - start), info.cols), np.float32)
            step = self._c.table_read(t, int(array), rows, start, None)
            if step != info.applied_step:
                raise TryAgainError(f"table '{self.layout.tables[t].name}': a step ran while it "
                                    f"was read (rows of step {info.applied_step}, then from row "
                                    f"{start} of step {step}): read it between steps")
            yield start, rows

    def write_rows(self, table: Union[int, str], rows: npt.ArrayLike, start: int = 0, *,
                   ids: Optional[npt.ArrayLike] = None,
                   array: TableArray = TableArray.WEIGHTS) -> None:
        """Writes ``rows`` (``(n, cols)``, every value finite) into rows ``start ..`` of
        ``array`` of ``table``, or into the rows ``ids``. Each chunk is checked whole before
        any of its rows changes."""
        t = self.table_index(table)
        data = np.ascontiguousarray(rows, dtype=np.float32)
        id_arr = None if ids is None else np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        self._c.table_write(t, int(array), data, start, id_arr)

    # ---- lifetime --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return bool(self._c.closed)

    def close(self) -> None:
        """Disconnects (the service drops requests in flight). Raises
        :class:`embd.BusyError` while numpy views of a slot are still alive elsewhere."""
        self._batches.clear()
        self._c.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"index {self.layout.index}"
        return f"embd.Client({self.socket_path!r}, {state})"


def _device_tensor(span: Any, device: int) -> Any:
    """A torch tensor over a span of CUDA memory (its __cuda_array_interface__): no copy, and
    the tensor keeps the span, so the client's close() refuses while it lives."""
    import torch
    return torch.as_tensor(span, device=f"cuda:{device}")


def _layout(d: Dict[str, Any]) -> Layout:
    raw_tables: Sequence[Tuple[str, int, int, int, int]] = d["tables"]
    raw_features: Sequence[Tuple[str, int, int, int]] = d["features"]
    tables = tuple(
        Table(name=name, num_embeddings=rows, embedding_dim=dim, pooling=Pooling(pooling),
              features=tuple(f[0] for f in raw_features if f[1] == t),
              data_type=DataType(dtype))
        for t, (name, rows, dim, pooling, dtype) in enumerate(raw_tables))
    features = tuple(Feature(name=name, table=raw_tables[t][0], dim=dim, offset=offset)
                     for name, t, dim, offset in raw_features)
    return Layout(index=d["index"], trainers_per_node=d["trainers_per_node"],
                  batch_size=d["batch_size"], total_dim=d["total_dim"],
                  max_values=d["max_values"], resumed_step=d["resumed_step"], tables=tables,
                  features=features)


__all__ = ["SLOTS", "DEFAULT_SOCKET", "Pooling", "Op", "DataType", "TableArray", "TableInfo",
           "Table", "Feature", "Layout", "Batch", "Completion", "Client", "default_index",
           "codes"]
