"""embd.torch: TorchRec's EmbeddingBagCollection, with the tables in the embd service.

:class:`EmbeddingBagCollection` takes the place of ``torchrec.EmbeddingBagCollection`` (or of
a sharded one under DistributedModelParallel) in a TorchRec model::

    ebc = embd.torch.EmbeddingBagCollection()          # $LOCAL_RANK's trainer index
    model = torchrec.models.dlrm.DLRM(embedding_bag_collection=ebc, ...)
    loss = criterion(model(dense, kjt), labels)
    loss.backward()      # posts dL/d(pooled); the service applies its fused optimizer

The tables, their optimizers and the sharding are the service's (its config); the module has
no parameters. Each training forward is one step of the service, numbered by the module from
the service's resumed step; the step's backward must run before the next forward (the
service waits for every trainer's gradient before any row changes). In ``eval()`` mode, or
under ``torch.no_grad()``, a forward is an evaluation lookup instead: the rows as they are, no
step, nothing to backward. A KJT may hold fewer samples than the service's batch size (the
last batch of an epoch): the output has that many rows. The pooled output is copied out of
the batch slot (slots are reused two steps later); the KJT is copied into it.
``state_dict()`` / ``load_state_dict()`` read and write the service's rows under TorchRec's
keys (``embedding_bags.<table>.weight``), so a trained module's state loads into a plain
``torchrec.EmbeddingBagCollection`` with the same configs, and TorchRec's weights into embd.

Pipelined steps (TorchRec's ``TrainPipelineSparseDist`` idea, docs/architecture.md):
:class:`TrainPipeline` trains a model one batch per ``progress(dataloader_iter)`` and posts the
next batch's lookup while the current step's dense work runs, so the service routes it
meanwhile; :meth:`EmbeddingBagCollection.prefetch` is the call underneath. The results are
bit-identical to unpipelined steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, NoReturn, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

import embd
from embd.client import Completion, Layout, Op, Pooling

_POOLING = {Pooling.SUM: PoolingType.SUM, Pooling.MEAN: PoolingType.MEAN}
_DATA_TYPE = {embd.DataType.FP32: DataType.FP32, embd.DataType.FP16: DataType.FP16}
# the dtype of TorchRec's weight tensor of a table of that data type
_TORCH_DTYPE = {embd.DataType.FP32: torch.float32, embd.DataType.FP16: torch.float16}


def embedding_bag_configs(layout: Layout) -> List[EmbeddingBagConfig]:
    """TorchRec's configs of the service's tables, in the layout's order (the output's key
    order is TorchRec's: tables in order, each table's features in order)."""
    return [EmbeddingBagConfig(num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                               name=t.name, data_type=_DATA_TYPE[t.data_type],
                               feature_names=list(t.features), pooling=_POOLING[t.pooling])
            for t in layout.tables]


def check_kjt(layout: Layout, features: KeyedJaggedTensor, weighted: bool) -> int:
    """Returns the KJT's batch size (stride); raises :class:`embd.InvalidArgumentError`
    naming the key (or the stride) when ``features`` does not fit the layout: the same keys in
    the same order, one batch size of 1 to the service's, weights when the collection is
    weighted, at most max_values ids."""
    want = layout.feature_names
    got = list(features.keys())
    if got != want:
        raise embd.InvalidArgumentError(_key_mismatch(got, want))
    if features.variable_stride_per_key():
        raise embd.InvalidArgumentError(
            f"KJT has a batch size per key (variable stride), {features.stride_per_key()} for "
            f"keys {got}: the service takes one batch size per batch, 1 to "
            f"{layout.batch_size}")
    stride = features.stride()
    if not 1 <= stride <= layout.batch_size:
        raise embd.InvalidArgumentError(
            f"KJT stride (batch size) {stride} for keys {got}: the service takes 1 to its "
            f"batch_size {layout.batch_size} samples per batch")
    n = features.values().numel()
    if n > layout.max_values:
        raise embd.InvalidArgumentError(f"KJT has {n} ids: the service takes at most "
                                        f"max_values {layout.max_values} per batch")
    if weighted and features.weights_or_none() is None:
        raise embd.InvalidArgumentError("KJT has no weights: this EmbeddingBagCollection is "
                                        "weighted (is_weighted=True)")
    return stride


def _key_mismatch(got: List[str], want: List[str]) -> str:
    expect = f"the service's layout expects the keys {want} in this order"
    for i, key in enumerate(got):
        if key not in want:
            return f"KJT key '{key}' (position {i}) is not a feature of the service: {expect}"
        if got.count(key) > 1:
            return f"KJT key '{key}' appears {got.count(key)} times: {expect}"
    for key in want:
        if key not in got:
            return f"KJT has no key '{key}': {expect}"
    for i, key in enumerate(got):
        if key != want[i]:
            return (f"KJT key '{key}' at position {i}, the service's feature at position {i} is "
                    f"'{want[i]}': {expect}")
    return expect  # not reached: got != want


def _same_kjt(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    """Whether two KJTs hold the same batch (the same object, or equal keys, lengths, ids and
    weights)."""
    if a is b:
        return True
    wa, wb = a.weights_or_none(), b.weights_or_none()
    return (list(a.keys()) == list(b.keys()) and torch.equal(a.lengths(), b.lengths()) and
            torch.equal(a.values(), b.values()) and (wa is None) == (wb is None) and
            (wa is None or torch.equal(wa, wb)))


@dataclass
class _Prefetched:
    """A batch posted ahead by :meth:`EmbeddingBagCollection.prefetch`."""

    step: int
    slot: int
    num_values: int
    batch_size: int
    features: KeyedJaggedTensor
    #: the request's user_data, or None when the KJT does not fit the layout (nothing posted)
    tag: Optional[int]
    #: why the KJT does not fit: raised by the forward that uses it, as an unpipelined one would
    error: Optional[BaseException] = None
    #: posted for a step the service no longer runs next (the step before it failed with a
    #: step to resume at): its completion, a refusal, is taken and dropped
    stale: bool = False


class _Step(torch.autograd.Function):
    """One training step of the service: forward returns the pooled rows (a copy), backward
    hands dL/d(pooled) to the service. ``anchor`` is a leaf that requires grad, so the output
    is part of the graph although the module has no parameters."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, module: "EmbeddingBagCollection",
                step: int) -> torch.Tensor:
        ctx.module = module
        ctx.step = step
        return module._pooled_copy()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None]:
        ctx.module._post_backward(ctx.step, grad)
        return None, None, None


# torchrec ships no type information: its base class is Any to a type checker
class EmbeddingBagCollection(EmbeddingBagCollectionInterface):  # type: ignore[misc]
    """TorchRec's ``EmbeddingBagCollection`` interface over an embd service.

    Args:
        socket_path: the service's control socket (default ``$EMBD_SOCKET``, then
            ``/run/embd/embd.sock``).
        index: this trainer's index on the node (default ``$LOCAL_RANK``, then any free one).
        is_weighted: use the KJT's weights (per-id weights), as TorchRec's ``is_weighted``.
        timeout: seconds a step may wait for the other trainers (None: no limit).

    ``forward(kjt)`` takes a KJT with exactly the layout's keys in its order and 1 to the
    service's batch size samples, and returns a ``KeyedTensor`` (keys in TorchRec's order, one
    row per sample). In training mode with gradients enabled it is a training step whose
    backward posts the gradient; in ``eval()`` mode or under ``torch.no_grad()`` an
    evaluation lookup that neither advances nor waits for the steps (on a cluster every
    trainer evaluates at the same point of its steps, as with TorchRec's sharded modules).

    ``state_dict()`` holds each table's weights as ``embedding_bags.<table>.weight`` (float32,
    float16 for an fp16 table), read from the service; ``load_state_dict()`` writes them (one
    node only: a cluster refuses writes with :class:`embd.NotSupportedError`). Read between
    steps, they are exactly the rows the next step reads. The fused optimizer's state is
    :meth:`optimizer_state_dict` / :meth:`load_optimizer_state_dict`.

    :meth:`prefetch` posts the lookup of the next training step's batch without waiting
    (pipelined steps, see :class:`TrainPipeline`).
    """

    def __init__(self, socket_path: Optional[str] = None, index: Optional[int] = None, *,
                 is_weighted: bool = False, timeout: Optional[float] = None) -> None:
        super().__init__()
        self._client = embd.Client(socket_path, index)
        self._layout = self._client.layout
        self._is_weighted = is_weighted
        self._timeout = timeout
        self._configs = embedding_bag_configs(self._layout)
        self._embedding_names = self._layout.feature_names
        self._lengths_per_embedding = [f.dim for f in self._layout.features]
        self._next_step = self._client.resumed_step
        # (step, slot, num_values, batch_size) of the forward whose backward has not run yet
        self._pending: Optional[Tuple[int, int, int, int]] = None
        self._broken = ""   # why no step can be posted any more, after a failure of ours
        # Batches travel through numpy: its copies run on this thread, where torch's might
        # wake its intra-op pool, whose spinning threads take the CPUs the service's step
        # runs on (a third of a 64K-id step on a 2-core machine).
        self._slots = [self._client.batch(s) for s in range(embd.SLOTS)]
        self._anchor = torch.empty(0, requires_grad=True)
        self._prefetched: Optional[_Prefetched] = None
        # completions taken while waiting for another request's (prefetch in flight)
        self._completions: Dict[int, Completion] = {}
        self._last_tag = 0

    # ---- TorchRec's interface ----------------------------------------------------------------

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self._broken:
            raise embd.InvalidArgumentError(self._broken)
        self._drop_stale()
        if self._prefetched is not None:
            values = self._train_prefetched(features)
        else:
            b = check_kjt(self._layout, features, self._is_weighted)
            if not self.training or not torch.is_grad_enabled():
                values = self._evaluate(features, b)
            else:
                values = self._train(features, b)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding,
                           values=values)

    # ---- the step ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step the next training forward posts."""
        return self._next_step

    @property
    def prefetched(self) -> Optional[KeyedJaggedTensor]:
        """The batch :meth:`prefetch` posted, whose training forward has not run yet."""
        p = self._prefetched
        return None if p is None or p.stale else p.features

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Posts the lookup of ``features`` as the next training step without waiting for it:
        the step after the one whose backward is due (or, between steps, the next one). The
        service routes it (checks and distributes its ids) while this trainer's dense work
        runs and looks it up right after the current step's backward; the training forward
        of the same batch (this KJT object, or one equal to it) then only waits for the
        result, which is exactly the unpipelined forward's.

        A KJT that does not fit the layout, or ids the service refuses, raise at that forward,
        as the unpipelined forward raises them (the step is then over for this trainer, as
        there). Until that forward: another ``prefetch`` and a forward of another batch raise
        :class:`embd.InvalidArgumentError` and change nothing, and so does an evaluation
        (``eval()`` mode or ``torch.no_grad()``): the prefetched batch is a training step the
        service already has, run its forward first. A step that fails in its backward with a
        step to resume at other than the prefetched one (:class:`embd.ResumedError`) drops the
        prefetched batch: feed the batch of that step, as without pipelining. Raises
        :class:`embd.InvalidArgumentError` at once in ``eval()`` mode."""
        if self._broken:
            raise embd.InvalidArgumentError(self._broken)
        self._drop_stale()
        if self._prefetched is not None:
            raise embd.InvalidArgumentError(
                f"prefetch while the batch of step {self._prefetched.step} is prefetched: run "
                "its training forward first (one batch is prefetched at a time)")
        if not self.training:
            raise embd.InvalidArgumentError(
                "prefetch in eval() mode: a prefetched batch is a training step")
        step = self._next_step + (self._pending is not None)
        slot = step % embd.SLOTS
        try:
            b = check_kjt(self._layout, features, self._is_weighted)
        except embd.InvalidArgumentError as e:
            self._prefetched = _Prefetched(step, slot, 0, 0, features, None, e)
            return
        n = self._fill(slot, features, b)
        self._last_tag += 1
        self._client.submit(Op.FORWARD, slot, step, n, self._is_weighted, self._last_tag, b)
        self._prefetched = _Prefetched(step, slot, n, b, features, self._last_tag)

    def _train_prefetched(self, features: KeyedJaggedTensor) -> torch.Tensor:
        p = self._prefetched
        assert p is not None
        if not self.training or not torch.is_grad_enabled():
            raise embd.InvalidArgumentError(
                f"evaluation while the batch of step {p.step} is prefetched (a training step "
                "the service already has): run its training forward first")
        if not _same_kjt(features, p.features):
            raise embd.InvalidArgumentError(
                f"forward of another batch than the one prefetched for step {p.step}: the "
                "next training forward takes the prefetched KJT (.prefetched)")
        if self._pending is not None:
            raise embd.InvalidArgumentError(
                f"forward of step {p.step} before the backward of step {self._pending[0]}: "
                "every training forward needs its backward (loss.backward()) before the next "
                "one, the service waits for it")
        self._prefetched = None
        if p.error is not None:
            raise p.error
        try:
            self._await(p.tag)
        except BaseException as e:
            self._after_failure(p.step, "forward", e)
        self._pending = (p.step, p.slot, p.num_values, p.batch_size)
        out: torch.Tensor = _Step.apply(self._anchor, self, p.step)
        return out

    def _await(self, tag: Optional[int]) -> None:
        """Waits for the completion of the request posted with user_data ``tag``, keeping the
        others taken meanwhile; raises its error."""
        assert tag is not None
        done = self._completions.pop(tag, None)
        while done is None:
            c = self._client.wait(self._timeout)
            if c.user_data == tag:
                done = c
            else:
                self._completions[c.user_data] = c
        done.check()

    def _drop_stale(self) -> None:
        """Takes the refusal of a prefetched batch that the service no longer runs."""
        p = self._prefetched
        if p is None or not p.stale:
            return
        try:
            self._await(p.tag)
        except embd.Error as e:
            if e.step is None:
                self._after_failure(p.step, "forward", e)
        except BaseException as e:
            self._after_failure(p.step, "forward", e)
        self._prefetched = None

    def _after_step_failure(self) -> None:
        """After the step whose backward was due failed: a prefetched batch posted for another
        step than the one to post next is dropped (its completion, taken later)."""
        p = self._prefetched
        if p is None or p.step == self._next_step or self._broken:
            return
        if p.tag is None:
            self._prefetched = None
        else:
            p.stale = True

    def _fill(self, slot: int, features: KeyedJaggedTensor, b: int) -> int:
        """Copies the KJT of ``b`` samples into batch slot ``slot``; returns its ids."""
        v = self._slots[slot]
        values = features.values()
        n = values.numel()
        np.copyto(v.lengths.reshape(-1)[:len(self._embedding_names) * b],
                  features.lengths().detach().numpy())
        np.copyto(v.values[:n], values.detach().numpy())
        if self._is_weighted:
            np.copyto(v.weights[:n], features.weights().detach().numpy())
        return n

    def _train(self, features: KeyedJaggedTensor, b: int) -> torch.Tensor:
        if self._pending is not None:
            raise embd.InvalidArgumentError(
                f"forward of step {self._next_step + 1} before the backward of step "
                f"{self._pending[0]}: every training forward needs its backward "
                f"(loss.backward()) before the next one, the service waits for it")
        step = self._next_step
        slot = step % embd.SLOTS
        n = self._fill(slot, features, b)
        try:
            self._client.forward(slot, step, n, self._is_weighted, self._timeout, b)
        except BaseException as e:
            self._after_failure(step, "forward", e)
        self._pending = (step, slot, n, b)
        out: torch.Tensor = _Step.apply(self._anchor, self, step)
        return out

    def _evaluate(self, features: KeyedJaggedTensor, b: int) -> torch.Tensor:
        """An evaluation lookup, in the slot the next training forward will fill (the other
        one while a step's backward is due: that step's batch is still needed)."""
        slot = (self._next_step + (self._pending is not None)) % embd.SLOTS
        n = self._fill(slot, features, b)
        try:
            self._client.eval(slot, n, self._is_weighted, self._timeout, b)
        except embd.ResumedError as e:
            self._after_failure(self._next_step, "evaluation", e)
        except BaseException as e:
            if not isinstance(e, embd.Error) or e.step is None:
                # the training step whose backward is due is not the one given up on: keep
                # it, so its backward says why no request can be posted any more
                self._after_failure(self._next_step, "evaluation", e, keep_pending=True)
            raise
        return torch.from_numpy(self._slots[slot].pooled[:b].copy())

    def _pooled_copy(self) -> torch.Tensor:
        assert self._pending is not None
        _, slot, _, b = self._pending
        return torch.from_numpy(self._slots[slot].pooled[:b].copy())

    def _post_backward(self, step: int, grad: torch.Tensor) -> None:
        if self._broken:
            raise embd.InvalidArgumentError(self._broken)
        if self._pending is None or self._pending[0] != step:
            raise embd.InvalidArgumentError(
                f"backward of step {step} ran already (each step's output takes one backward)")
        _, slot, n, b = self._pending
        np.copyto(self._slots[slot].grad[:b], grad.detach().numpy())
        p = self._prefetched
        try:
            if p is not None and p.tag is not None:
                # the prefetched forward is in flight: its completion may come first
                self._last_tag += 1
                self._client.submit(Op.BACKWARD, slot, step, n, self._is_weighted,
                                    self._last_tag, b)
                self._await(self._last_tag)
            else:
                self._client.backward(slot, step, n, self._is_weighted, self._timeout, b)
        except BaseException as e:
            try:
                self._after_failure(step, "backward", e)
            finally:
                self._after_step_failure()
        self._pending = None
        self._next_step = step + 1

    def _after_failure(self, step: int, what: str, e: BaseException,
                       keep_pending: bool = False) -> NoReturn:
        """Where the step sequence goes on after the request of ``step`` failed with ``e``;
        raises ``e`` (a :class:`embd.ResumedError` saying where to resume)."""
        if not keep_pending:
            self._pending = None
        if isinstance(e, embd.ResumedError) and e.step is not None:
            self._next_step = e.step
            raise embd.ResumedError(
                f"{e.message}: the cluster re-formed and resumed at step {e.step}; this "
                f"EmbeddingBagCollection posts step {e.step} next (its .step): feed the batch "
                f"of step {e.step}", e.code, e.step) from e
        if isinstance(e, embd.TryAgainError):
            self._next_step = step       # the cluster re-forms: the same step, a little later
        elif isinstance(e, embd.Error) and e.step is not None:
            self._next_step = step + 1   # refused or aborted: the step is over for us
        else:
            # a wait given up on (timeout, Ctrl-C) leaves the request in flight, and a lost
            # service leaves nothing: either way no later step can be posted on this handle
            self._broken = (f"step {step}: its {what} was given up on ({type(e).__name__}: "
                            f"{e}); the service may still run that step: close this "
                            "EmbeddingBagCollection and make a new one")
        raise e

    # ---- tables' state -------------------------------------------------------------------

    def _weight_key(self, prefix: str, table: str) -> str:
        return f"{prefix}embedding_bags.{table}.weight"

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        for t in self._layout.tables:
            rows = torch.from_numpy(self._client.read_rows(t.name))
            destination[self._weight_key(prefix, t.name)] = rows.to(_TORCH_DTYPE[t.data_type])

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Dict[str, Any], strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        # Every shape is checked before any row is written, so a size mismatch changes
        # nothing. Missing and unexpected keys are PyTorch's business: it is told of them and
        # raises after the load when strict (torch passes strict=True here whatever the
        # caller asked), and the tables that are present are written, as any module's.
        writes = []
        for t in self._layout.tables:
            key = self._weight_key(prefix, t.name)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            w = state_dict[key]
            shape = tuple(w.shape)
            if shape != (t.num_embeddings, t.embedding_dim):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{shape}, the service's table '{t.name}' is "
                                  f"{(t.num_embeddings, t.embedding_dim)}")
                continue
            writes.append((t.name, torch.as_tensor(w).detach().to(torch.float32).contiguous()))
        ours = {self._weight_key(prefix, t.name) for t in self._layout.tables}
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and
                                   k not in ours)
        if error_msgs:
            return
        for name, w in writes:
            self._client.write_rows(name, w.numpy())

    def optimizer_state_dict(self) -> Dict[str, torch.Tensor]:
        """The fused optimizer's state of every table, under the keys of TorchRec's fused
        optimizer state (``<table>.momentum1``: adagrad's sum of squares, rowwise_adagrad's
        one value per row, adam's first moment; ``<table>.exp_avg_sq``: adam's second
        moment). Tables whose optimizer keeps no state (sgd) have no key."""
        out: Dict[str, torch.Tensor] = {}
        for t in self._layout.tables:
            for array, name in ((embd.TableArray.MOMENTUM1, "momentum1"),
                                (embd.TableArray.MOMENTUM2, "exp_avg_sq")):
                try:
                    rows = self._client.read_rows(t.name, array=array)
                except embd.InvalidArgumentError:
                    continue        # the table's optimizer keeps no such array
                out[f"{t.name}.{name}"] = torch.from_numpy(
                    rows.reshape(-1) if rows.shape[1] == 1 else rows)
        return out

    def load_optimizer_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Writes the state :meth:`optimizer_state_dict` returns (any subset of its keys)."""
        arrays = {"momentum1": embd.TableArray.MOMENTUM1,
                  "exp_avg_sq": embd.TableArray.MOMENTUM2}
        for key, value in state.items():
            table, _, name = key.rpartition(".")
            if name not in arrays:
                raise embd.InvalidArgumentError(f"optimizer state '{key}': expected "
                                                f"<table>.momentum1 or <table>.exp_avg_sq")
            rows = torch.as_tensor(value).detach().to(torch.float32).numpy()
            self._client.write_rows(table, rows.reshape(rows.shape[0], -1), array=arrays[name])

    # ---- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Disconnects from the service (also when the module is garbage-collected)."""
        self._slots = []
        self._client.close()

    def extra_repr(self) -> str:
        return (f"socket={self._client.socket_path!r}, index={self._layout.index}, "
                f"tables={[t.name for t in self._layout.tables]}, step={self._next_step}")


def sparse_features(batch: Any) -> KeyedJaggedTensor:
    """The KJT of a batch: the batch itself when it is one, else its ``sparse_features`` field
    (TorchRec's ``torchrec.datasets.utils.Batch``)."""
    if isinstance(batch, KeyedJaggedTensor):
        return batch
    features = getattr(batch, "sparse_features", None)
    if isinstance(features, KeyedJaggedTensor):
        return features
    raise embd.InvalidArgumentError(
        f"a batch of type {type(batch).__name__} with no KeyedJaggedTensor field "
        "'sparse_features': give TrainPipeline(sparse_features=...) a function that returns "
        "the KJT the model hands to its embd EmbeddingBagCollection")


class TrainPipeline:
    """TorchRec's ``TrainPipelineSparseDist`` for a model whose sparse part is an embd
    :class:`EmbeddingBagCollection`: each :meth:`progress` trains one batch and, as soon as the
    collection's forward of that batch returned, posts the next batch's lookup
    (:meth:`EmbeddingBagCollection.prefetch`), so the service routes it while the dense
    forward, backward and optimizer step run and looks it up right after this step's
    backward. The steps' results are bit-identical to unpipelined training.

    Args:
        model: called as ``model(batch)``, returning ``(losses, output)`` as TorchRec's
            pipelines expect (``torchrec.models.dlrm.DLRMTrain`` does); it must hand the
            batch's KJT (the same object, or one equal to it) to the collection, once.
        optimizer: the dense optimizer (``zero_grad()`` before each batch, ``step()`` after its
            backward), or None when the model has no dense parameters.
        sparse_features: returns the KJT of a batch (default :func:`sparse_features`: the
            batch itself, or its ``sparse_features`` field).
        ebc: the collection to prefetch into (default: the only embd
            :class:`EmbeddingBagCollection` among the model's modules).

    ``progress(dataloader_iter)`` returns the model's ``output`` of one batch and raises
    ``StopIteration`` once the iterator is exhausted and its last batch was trained (that last
    step prefetches nothing). It reads one batch ahead of the one it trains. Unlike TorchRec's it
    moves no batch to a device (the collection reads the KJT from host memory). In ``eval()``
    mode it runs the forward only and prefetches nothing; switch modes only after
    ``StopIteration`` (or before a batch is prefetched): an evaluation while a batch is
    prefetched raises :class:`embd.InvalidArgumentError`. A batch whose step raised (a refused
    batch, an aborted step) is not trained again: the next ``progress`` takes the batch after it.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 sparse_features: Callable[[Any], KeyedJaggedTensor] = sparse_features,
                 ebc: Optional[EmbeddingBagCollection] = None) -> None:
        if ebc is None:
            found = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
            if len(found) != 1:
                raise embd.InvalidArgumentError(
                    f"model has {len(found)} embd EmbeddingBagCollection modules: TrainPipeline "
                    "prefetches into one, name it with ebc=")
            ebc = found[0]
        self._model = model
        self._optimizer = optimizer
        self._sparse_features = sparse_features
        self._ebc = ebc
        self._next_batch: Optional[Any] = None
        self._has_next = False
        self._to_prefetch: Optional[KeyedJaggedTensor] = None
        self._hook = ebc.register_forward_hook(self._after_lookup)

    def _after_lookup(self, module: nn.Module, inputs: Any, output: Any) -> None:
        features, self._to_prefetch = self._to_prefetch, None
        if features is not None:
            self._ebc.prefetch(features)

    def _take(self, dataloader_iter: Iterator[Any]) -> None:
        try:
            self._next_batch = next(dataloader_iter)
            self._has_next = True
        except StopIteration:
            self._next_batch, self._has_next = None, False

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if not self._has_next:
            self._take(dataloader_iter)
            if not self._has_next:
                raise StopIteration
        batch = self._next_batch
        self._take(dataloader_iter)
        training = self._model.training
        # taken before the step starts: a batch without a KJT raises before anything is posted
        ahead = self._sparse_features(self._next_batch) if training and self._has_next else None
        if training and self._optimizer is not None:
            self._optimizer.zero_grad()
        self._to_prefetch = ahead
        try:
            losses, output = self._model(batch)
        finally:
            self._to_prefetch = None
        if training:
            torch.sum(losses, dim=0).backward()
            if self._optimizer is not None:
                self._optimizer.step()
        return output

    def detach(self) -> None:
        """Removes the pipeline's hook from the collection (after the last ``progress``)."""
        self._hook.remove()


__all__ = ["EmbeddingBagCollection", "TrainPipeline", "embedding_bag_configs", "check_kjt",
           "sparse_features"]
