"""embd's exceptions.

Every failure of the service or of libembdclient raises an :class:`Error` that carries the
``EMBD_E*`` code of ``include/embd/types.h`` (:attr:`Error.code`, :attr:`Error.code_name`) and
the message that names the field, peer or cause (the service's own text for a refused
request, e.g. ``step 3: feature 'f_a' bag 2: id 70 out of range [0, 64)``). Each code has
its own subclass, so a trainer catches exactly what it can handle::

    try:
        loss.backward()
    except embd.StepAbortedError:
        pass  # another trainer went away: no row changed, go on with the next batch
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from embd import _client

#: The codes of include/embd/types.h by name (``codes["EMBD_EINVAL"]`` is ``-22``).
codes: Dict[str, int] = dict(_client.codes)
_names: Dict[int, str] = {v: k for k, v in codes.items()}


class Error(Exception):
    """A failure with an ``EMBD_E*`` code and a message naming its cause."""

    #: the code this class stands for (the base class takes any)
    default_code: int = codes["EMBD_EIO"]

    def __init__(self, message: str, code: Optional[int] = None,
                 step: Optional[int] = None) -> None:
        super().__init__(message)
        self.message: str = message
        self.code: int = self.default_code if code is None else code
        #: the step of the service's answer that carried the code; None when the failure is
        #: this process's own (then the request may not have reached the service)
        self.step: Optional[int] = step

    @property
    def code_name(self) -> str:
        """``EMBD_EINVAL`` and so on (``EMBD_E<number>`` for a code this build lacks)."""
        return _names.get(self.code, f"EMBD_E{-self.code}")

    def __str__(self) -> str:
        return f"{self.message} ({self.code_name}: {_client.strerror(self.code)})"


class InvalidArgumentError(Error, ValueError):
    """An argument or a field of a request is invalid (also a KJT that does not fit the
    layout)."""

    default_code = codes["EMBD_EINVAL"]


class OutOfMemoryError(Error):
    """An allocation failed."""

    default_code = codes["EMBD_ENOMEM"]


class OutOfRangeError(Error):
    """An id, offset or length is out of its bounds."""

    default_code = codes["EMBD_ERANGE"]


class NotFoundError(Error):
    """A socket, table, feature, file or key does not exist."""

    default_code = codes["EMBD_ENOENT"]


class ServiceIOError(Error):
    """Reading or writing failed, or the service refuses steps (a cluster whose state was
    lost)."""

    default_code = codes["EMBD_EIO"]


class PermissionDeniedError(Error):
    """The service does not allow this uid/gid."""

    default_code = codes["EMBD_EACCES"]


class TimedOutError(Error):
    """A wait timed out."""

    default_code = codes["EMBD_ETIMEDOUT"]


class ProtocolError(Error):
    """A peer broke the wire protocol."""

    default_code = codes["EMBD_EPROTO"]


class ServiceGoneError(Error):
    """The service went away (it closed the connection)."""

    default_code = codes["EMBD_ECONNRESET"]


class NoSpaceError(Error):
    """Does not fit: a ring is full or a slab too small."""

    default_code = codes["EMBD_ENOSPC"]


class BusyError(Error):
    """In use: a trainer index taken, a client used by another thread, slot views alive at
    close."""

    default_code = codes["EMBD_EBUSY"]


class TryAgainError(Error):
    """The cluster re-forms: post the same step again a little later."""

    default_code = codes["EMBD_EAGAIN"]


class StepAbortedError(Error):
    """The step was aborted (a trainer or node went away): no row changed; go on with the
    next step."""

    default_code = codes["EMBD_ECANCELED"]


class NotSupportedError(Error):
    """Valid, but not supported by this service or build."""

    default_code = codes["EMBD_ENOTSUP"]


class MalformedError(Error):
    """A file or message is malformed."""

    default_code = codes["EMBD_EPARSE"]


class MismatchError(Error):
    """Peers or files disagree (version, tables, plan)."""

    default_code = codes["EMBD_EMISMATCH"]


class InfeasibleError(Error):
    """The planner found no placement within the caps."""

    default_code = codes["EMBD_EINFEASIBLE"]


class ChecksumError(Error):
    """A stored file does not match its checksum."""

    default_code = codes["EMBD_ECHECKSUM"]


class ResumedError(Error):
    """The cluster re-formed and resumed at another step: :attr:`step` is the one to post next
    (the batch of that step is the next one to feed)."""

    default_code = codes["EMBD_ERESUMED"]


_by_code: Dict[int, Type[Error]] = {
    cls.default_code: cls for cls in (
        InvalidArgumentError, OutOfMemoryError, OutOfRangeError, NotFoundError, ServiceIOError,
        PermissionDeniedError, TimedOutError, ProtocolError, ServiceGoneError, NoSpaceError,
        BusyError, TryAgainError, StepAbortedError, NotSupportedError, MalformedError,
        MismatchError, InfeasibleError, ChecksumError, ResumedError)
}


def error_for(code: int, message: str, step: Optional[int] = None) -> Error:
    """The exception for an ``EMBD_E*`` code (the base :class:`Error` for an unknown one);
    ``step``: the step of the service's answer, None for a failure of this process."""
    return _by_code.get(code, Error)(message or _client.strerror(code), code, step)
