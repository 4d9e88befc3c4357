"""embd.Client: a trainer's connection to the node's embd service (libembdclient).

The service sends the layout at connect (:class:`Layout`: tables, features in KJT key order,
their columns in the pooled output, the batch size). Batches are never copied on their way in
or out: :meth:`Client.batch` hands numpy views of one of the two batch slots in the shared
region; the trainer writes a KJT into a slot's ``lengths`` / ``values`` (``weights``), posts
FORWARD of step ``s``, reads ``pooled``, writes dL/d(pooled) into ``grad`` and posts BACKWARD of
step ``s``. Steps run once every trainer of the node posted them, and a step's rows are updated
once with every trainer's gradient summed. Use slot ``s % 2`` for step ``s`` so that step
``s + 1`` can be filled while ``s`` runs; a slot's ``pooled`` is overwritten two steps later.

Every failure raises an :class:`embd.Error` subclass with the ``EMBD_E*`` code and the message
(see :mod:`embd.errors`). One client must not be used by two threads at once
(:class:`embd.BusyError`).
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from embd import _client
from embd.errors import Error, InvalidArgumentError, codes, error_for

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


@dataclass(frozen=True)
class Table:
    """One table of the service: ``features`` are the names of the features it serves, in the
    layout's order."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Pooling
    features: Tuple[str, ...]


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


@dataclass(frozen=True)
class Batch:
    """Numpy views (no copy) of one batch slot in the shared region.

    ``lengths[f, b]`` ids of feature f in sample b (int32; feature-major like a KJT's lengths),
    ``values`` / ``weights`` the ids (int64) and their weights, of which the first
    ``lengths.sum()`` are posted; ``pooled[b]`` the output row of sample b (written by forward),
    ``grad`` its gradient (read by backward).
    """

    slot: int
    lengths: npt.NDArray[np.int32]
    values: npt.NDArray[np.int64]
    weights: npt.NDArray[np.float32]
    pooled: npt.NDArray[np.float32]
    grad: npt.NDArray[np.float32]

    def write(self, lengths: npt.ArrayLike, values: npt.ArrayLike,
              weights: Optional[npt.ArrayLike] = None) -> int:
        """Copies one batch into the slot and returns its number of ids, the ``num_values``
        to post. ``lengths`` is ``(num_features, batch_size)`` or flat in that order."""
        lens = np.asarray(lengths).reshape(-1)
        vals = np.asarray(values).reshape(-1)
        if lens.size != self.lengths.size:
            raise InvalidArgumentError(f"lengths: {lens.size} entries, the layout has "
                                       f"{self.lengths.shape[0]} features x "
                                       f"{self.lengths.shape[1]} samples = {self.lengths.size}")
        if vals.size > self.values.size:
            raise InvalidArgumentError(f"values: {vals.size} ids, at most max_values "
                                       f"{self.values.size} per batch")
        self.lengths.reshape(-1)[:] = lens
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
                     for n in ("lengths", "values", "weights", "pooled", "grad")}
            b = Batch(slot=slot, **spans)
            self._batches[slot] = b
        return b

    # ---- requests --------------------------------------------------------------------------

    def forward(self, slot: int, step: int, num_values: int, weighted: bool = False,
                timeout: Optional[float] = None) -> None:
        """Looks up the batch in ``slot`` as step ``step``; ``pooled`` holds the result on
        return. Waits until every trainer of the node posted the step (``timeout`` seconds at
        most; None: no limit, Ctrl-C still works).

        An error the service answered has ``step`` set: a refused batch (the message names the
        field) or :class:`embd.StepAbortedError` end the step for this trainer, whose next
        step is ``step + 1``; :class:`embd.TryAgainError` asks for the same step again later;
        :class:`embd.ResumedError` names the step to post next. An error with ``step`` None is
        this process's own (:class:`embd.TimedOutError`, :class:`embd.ServiceGoneError`...):
        a request that timed out may still run, so reconnect before going on."""
        self._blocking(self._c.forward, slot, step, num_values, weighted, timeout)

    def backward(self, slot: int, step: int, num_values: int, weighted: bool = False,
                 timeout: Optional[float] = None) -> None:
        """Posts ``grad`` of the batch in ``slot`` for step ``step`` (the same batch as its
        forward) and waits until the service applied every trainer's gradient."""
        self._blocking(self._c.backward, slot, step, num_values, weighted, timeout)

    def _blocking(self, call: Any, slot: int, step: int, num_values: int, weighted: bool,
                  timeout: Optional[float]) -> None:
        call(slot, step, num_values, weighted, _timeout_ms(timeout))

    def submit(self, op: Op, slot: int = 0, step: int = 0, num_values: int = 0,
               weighted: bool = False, user_data: int = 0) -> None:
        """Posts a request without waiting; its :class:`Completion` comes from :meth:`poll` or
        :meth:`wait` with the same ``user_data`` (below 2**63). Do not mix with
        :meth:`forward` / :meth:`backward` while requests are in flight."""
        self._c.submit(int(op), slot, step, num_values, weighted, user_data)

    def poll(self) -> Optional[Completion]:
        """The oldest completion, or None when there is none yet."""
        t = self._c.poll()
        return None if t is None else Completion(*t)

    def wait(self, timeout: Optional[float] = None) -> Completion:
        """Waits for the oldest completion (``timeout`` seconds at most; None: no limit)."""
        return Completion(*self._c.wait(_timeout_ms(timeout)))

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


def _layout(d: Dict[str, Any]) -> Layout:
    raw_tables: Sequence[Tuple[str, int, int, int]] = d["tables"]
    raw_features: Sequence[Tuple[str, int, int, int]] = d["features"]
    tables = tuple(
        Table(name=name, num_embeddings=rows, embedding_dim=dim, pooling=Pooling(pooling),
              features=tuple(f[0] for f in raw_features if f[1] == t))
        for t, (name, rows, dim, pooling) in enumerate(raw_tables))
    features = tuple(Feature(name=name, table=raw_tables[t][0], dim=dim, offset=offset)
                     for name, t, dim, offset in raw_features)
    return Layout(index=d["index"], trainers_per_node=d["trainers_per_node"],
                  batch_size=d["batch_size"], total_dim=d["total_dim"],
                  max_values=d["max_values"], resumed_step=d["resumed_step"], tables=tables,
                  features=features)


__all__ = ["SLOTS", "DEFAULT_SOCKET", "Pooling", "Op", "Table", "Feature", "Layout", "Batch",
           "Completion", "Client", "default_index", "codes"]
