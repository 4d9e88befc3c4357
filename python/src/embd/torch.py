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
service waits for every trainer's gradient before any row changes). The pooled output is
copied out of the batch slot (slots are reused two steps later); the KJT is copied into it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

import embd
from embd.client import Layout, Pooling

_POOLING = {Pooling.SUM: PoolingType.SUM, Pooling.MEAN: PoolingType.MEAN}


def embedding_bag_configs(layout: Layout) -> List[EmbeddingBagConfig]:
    """TorchRec's configs of the service's tables, in the layout's order (the output's key
    order is TorchRec's: tables in order, each table's features in order)."""
    return [EmbeddingBagConfig(num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                               name=t.name, data_type=DataType.FP32,
                               feature_names=list(t.features), pooling=_POOLING[t.pooling])
            for t in layout.tables]


def check_kjt(layout: Layout, features: KeyedJaggedTensor, weighted: bool) -> None:
    """Raises :class:`embd.InvalidArgumentError` naming the key (or the stride) when
    ``features`` does not fit the layout: the same keys in the same order, one batch size
    equal to the service's, weights when the collection is weighted, at most max_values ids."""
    want = layout.feature_names
    got = list(features.keys())
    if got != want:
        raise embd.InvalidArgumentError(_key_mismatch(got, want))
    if features.variable_stride_per_key():
        raise embd.InvalidArgumentError(
            f"KJT has a batch size per key (variable stride), {features.stride_per_key()} for "
            f"keys {got}: the service takes one batch size, {layout.batch_size}")
    if features.stride() != layout.batch_size:
        raise embd.InvalidArgumentError(
            f"KJT stride (batch size) {features.stride()} for keys {got}: the service's "
            f"batch_size is {layout.batch_size}")
    n = features.values().numel()
    if n > layout.max_values:
        raise embd.InvalidArgumentError(f"KJT has {n} ids: the service takes at most "
                                        f"max_values {layout.max_values} per batch")
    if weighted and features.weights_or_none() is None:
        raise embd.InvalidArgumentError("KJT has no weights: this EmbeddingBagCollection is "
                                        "weighted (is_weighted=True)")


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

    ``forward(kjt)`` takes a KJT with exactly the layout's keys in its order and its batch
    size, and returns a ``KeyedTensor`` (keys in TorchRec's order) whose backward posts the
    gradient. Training mode only: evaluation lookups (``eval()``, ``torch.no_grad()``) are not
    served yet and raise :class:`embd.NotSupportedError`, as do ``state_dict()`` and
    ``load_state_dict()`` of the tables (reading rows needs the service's live table access).
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
        # (step, slot, num_values) of the forward whose backward has not run yet
        self._pending: Optional[Tuple[int, int, int]] = None
        self._broken = ""   # why no step can be posted any more, after a failure of ours
        self._slots = [self._torch_views(s) for s in range(embd.SLOTS)]
        self._anchor = torch.empty(0, requires_grad=True)

    def _torch_views(self, slot: int) -> Dict[str, torch.Tensor]:
        b = self._client.batch(slot)
        return {"lengths": torch.from_numpy(b.lengths).view(-1),
                "values": torch.from_numpy(b.values), "weights": torch.from_numpy(b.weights),
                "pooled": torch.from_numpy(b.pooled), "grad": torch.from_numpy(b.grad)}

    # ---- TorchRec's interface ----------------------------------------------------------------

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not self.training or not torch.is_grad_enabled():
            raise embd.NotSupportedError(
                "embd.torch.EmbeddingBagCollection: evaluation lookups (eval() or "
                "torch.no_grad()) are not served by this embd yet; forward runs training steps "
                "only, in training mode with gradients enabled")
        if self._broken:
            raise embd.InvalidArgumentError(self._broken)
        if self._pending is not None:
            raise embd.InvalidArgumentError(
                f"forward of step {self._next_step + 1} before the backward of step "
                f"{self._pending[0]}: every training forward needs its backward "
                f"(loss.backward()) before the next one, the service waits for it")
        check_kjt(self._layout, features, self._is_weighted)
        step = self._next_step
        slot = step % embd.SLOTS
        v = self._slots[slot]
        n = features.values().numel()
        v["lengths"].copy_(features.lengths())
        v["values"][:n].copy_(features.values())
        if self._is_weighted:
            v["weights"][:n].copy_(features.weights())
        try:
            self._client.forward(slot, step, n, self._is_weighted, self._timeout)
        except BaseException as e:
            self._after_failure(step, "forward", e)
            raise
        self._pending = (step, slot, n)
        values = _Step.apply(self._anchor, self, step)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding,
                           values=values)

    # ---- the step ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step the next training forward posts."""
        return self._next_step

    def _pooled_copy(self) -> torch.Tensor:
        assert self._pending is not None
        return self._slots[self._pending[1]]["pooled"].clone()

    def _post_backward(self, step: int, grad: torch.Tensor) -> None:
        if self._pending is None or self._pending[0] != step:
            raise embd.InvalidArgumentError(
                f"backward of step {step} ran already (each step's output takes one backward)")
        _, slot, n = self._pending
        self._slots[slot]["grad"].copy_(grad)
        try:
            self._client.backward(slot, step, n, self._is_weighted, self._timeout)
        except BaseException as e:
            self._after_failure(step, "backward", e)
            raise
        self._pending = None
        self._next_step = step + 1

    def _after_failure(self, step: int, what: str, e: BaseException) -> None:
        """Where the step sequence goes on after the request of ``step`` failed with ``e``."""
        self._pending = None
        if isinstance(e, embd.ResumedError) and e.step is not None:
            self._next_step = e.step
        elif isinstance(e, embd.TryAgainError):
            self._next_step = step       # the cluster re-forms: the same step, a little later
        elif isinstance(e, embd.Error) and e.step is not None:
            self._next_step = step + 1   # refused or aborted: the step is over for us
        else:
            # a wait given up on (timeout, Ctrl-C) leaves the request in flight, and a lost
            # service leaves nothing: either way no later step can be posted on this handle
            self._broken = (f"step {step}: its {what} was given up on ({type(e).__name__}: "
                            f"{e}); the service may still run that step: close this "
                            "EmbeddingBagCollection and make a new one")

    # ---- tables' state -------------------------------------------------------------------

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        raise embd.NotSupportedError(
            "embd.torch.EmbeddingBagCollection.state_dict(): reading the tables' rows needs "
            "live table access in the service, which this embd lacks; use its checkpoints "
            "(embctl checkpoint / embctl export) for the rows")

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Dict[str, Any], strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        ours = [k for k in state_dict if k.startswith(prefix + "embedding_bags.")]
        if ours:
            raise embd.NotSupportedError(
                f"embd.torch.EmbeddingBagCollection.load_state_dict(): writing rows ({ours[0]} "
                "...) needs live table access in the service, which this embd lacks; use "
                "embctl import before the service starts")

    # ---- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Disconnects from the service (also when the module is garbage-collected)."""
        self._slots = []
        self._client.close()

    def extra_repr(self) -> str:
        return (f"socket={self._client.socket_path!r}, index={self._layout.index}, "
                f"tables={[t.name for t in self._layout.tables]}, step={self._next_step}")


__all__ = ["EmbeddingBagCollection", "embedding_bag_configs", "check_kjt"]
