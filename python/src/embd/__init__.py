"""embd: the Python client of embd, the node-local embedding service.

``embd.Client`` is a trainer's connection (libembdclient): the layout, zero-copy numpy views
of the batch slots, forward / backward / eval / submit / poll / wait, and the tables' rows
(read_rows / write_rows). ``embd.torch`` (imported on
its own, it needs torch and torchrec) has ``EmbeddingBagCollection``, a drop-in for TorchRec's
whose rows live in the service. Failures raise :class:`embd.Error` subclasses carrying the
``EMBD_E*`` code and the service's message (:mod:`embd.errors`).
"""
from embd.client import (DEFAULT_SOCKET, SLOTS, Batch, Client, Completion, DataType, Feature,
                         Layout, Op, Pooling, Table, TableArray, TableInfo, default_index)
from embd.errors import (BusyError, ChecksumError, Error, InfeasibleError, InvalidArgumentError,
                         MalformedError, MismatchError, NoSpaceError, NotFoundError,
                         NotSupportedError, OutOfMemoryError, OutOfRangeError,
                         PermissionDeniedError, ProtocolError, ResumedError, ServiceGoneError,
                         ServiceIOError, StepAbortedError, TimedOutError, TryAgainError, codes,
                         error_for)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SOCKET", "SLOTS", "Batch", "Client", "Completion", "DataType", "Feature", "Layout",
    "Op", "Pooling", "Table", "TableArray", "TableInfo", "default_index",
    "BusyError", "ChecksumError", "Error", "InfeasibleError", "InvalidArgumentError",
    "MalformedError", "MismatchError", "NoSpaceError", "NotFoundError", "NotSupportedError",
    "OutOfMemoryError", "OutOfRangeError", "PermissionDeniedError", "ProtocolError",
    "ResumedError", "ServiceGoneError", "ServiceIOError", "StepAbortedError", "TimedOutError",
    "TryAgainError", "codes", "error_for",
]
