"""coordl's exceptions and warnings.

A bad sample raises a :class:`SampleError` that is *also* an instance of the
type the sample's own code raised: ``SampleError[OSError]`` is a subclass of
both ``OSError`` and ``SampleError`` (and so, as before, of ``RuntimeError``).
A user's ``except OSError:`` keeps working, as it does under torch's
DataLoader, which re-raises a failing worker's exception type.

These combined classes are made on demand and cached, one per original type.
They pickle *by reference to the original type* (a ``copyreg`` reducer on
their metaclass), so when torch's worker machinery sends the class of an
error raised in a worker to the main process and rebuilds it as
``exc_type(message)``, the main process gets the same combined class.
"""
from __future__ import annotations

import copyreg
import pickle
import threading
from .base import forks as _forks

__all__ = ["SampleError", "SkippedSampleWarning", "StateError", "sample_error",
           "sample_error_type", "Failure"]


class _SampleErrorMeta(type):
    """Metaclass of :class:`SampleError`: only there so that the combined
    classes can be pickled by reference (see ``_reduce_class``)."""


class SampleError(RuntimeError, metaclass=_SampleErrorMeta):
    """A sample could not be read or prepared.

    The message names the stage, the sample index and its location (path),
    the original error and the remedy. The exception raised is an instance of
    ``SampleError`` *and* of the original exception's type (its class is
    ``SampleError[T]``, see ``sample_error_type``), so ``except
    SampleError``, ``except OSError`` (for an ``OSError`` from the sample) and
    ``except RuntimeError`` all catch it. In the main process (``num_workers=0``)
    the original exception is chained as ``__cause__``; from a worker process
    its traceback is part of the message, as for any error raised in a torch
    DataLoader worker. When the original type cannot be rebuilt from one
    message argument (e.g. ``UnicodeDecodeError``), is not an ``Exception``,
    or (from a worker) cannot be pickled by reference, the error is a plain
    ``SampleError``, message kept.
    Pass ``on_error="skip"`` to the loader to skip such samples instead.
    """

    def __str__(self) -> str:
        # the message as given, also for KeyError-like types whose own __str__
        # is the repr() of their argument
        if len(self.args) == 1:
            return str(self.args[0])
        return super().__str__()


class SkippedSampleWarning(UserWarning):
    """Emitted once per sample skipped under ``on_error="skip"``."""


class StateError(ValueError):
    """A state dict cannot be restored into this loader (mismatched settings)."""


_types: dict[type, type] = {}
_types_lock = _forks.worker_safe(threading.RLock())  # a probed constructor may itself raise a SampleError
_PROBE = "coordl probe message"


def _rebuildable(t: type) -> bool:
    """Whether ``t(message)`` works and keeps the message (what torch does to
    re-raise a worker's error in the main process)."""
    if not (isinstance(t, type) and issubclass(t, Exception)):
        return False
    try:
        e = t(_PROBE)
    except Exception:
        return False
    return isinstance(e, t) and any(_PROBE in str(a) for a in e.args)


def sample_error_type(exc_type: type | None) -> type:
    """The class raised for a bad sample whose own error was of ``exc_type``.

    ``SampleError[exc_type]``, a subclass of both ``exc_type`` and
    :class:`SampleError` (made once per type and cached); ``SampleError``
    itself when ``exc_type`` is None, already a ``SampleError``, exactly
    ``RuntimeError`` or ``Exception``, not an ``Exception`` subclass, or
    cannot be built from a single message argument that it keeps.
    """
    if exc_type is None or not isinstance(exc_type, type) or issubclass(exc_type, SampleError) \
            or exc_type is RuntimeError or exc_type is Exception:
        return SampleError
    with _types_lock:
        cls = _types.get(exc_type)
        if cls is not None:
            return cls
        cls = SampleError
        if _rebuildable(exc_type):
            try:
                # the original type first: its __new__/__init__ run as for
                # exc_type(message), as torch would rebuild it
                cand = _SampleErrorMeta(
                    f"SampleError[{exc_type.__name__}]", (exc_type, SampleError),
                    {"__module__": __name__, "__doc__": SampleError.__doc__,
                     "__str__": SampleError.__str__, "_coordl_original": exc_type})
                if _PROBE in str(cand(_PROBE)):  # the message survives (maybe decorated)
                    cls = cand
            except Exception:  # e.g. an instance layout conflict, a custom metaclass
                pass
        _types[exc_type] = cls
        return cls


def _by_reference(t: type) -> bool:
    """Whether the class ``t`` pickles by reference and loads back as itself."""
    try:
        return pickle.loads(pickle.dumps(t)) is t
    except Exception:
        return False


def _reduce_class(cls):
    original = cls.__dict__.get("_coordl_original")
    if original is None:  # SampleError itself or a statically defined subclass
        return cls.__qualname__
    if not _by_reference(original):  # e.g. a class local to a function
        original = None
    return sample_error_type, (original,)


copyreg.pickle(_SampleErrorMeta, _reduce_class)


def sample_error(stage: str, index: int, where: str, err: BaseException) -> SampleError:
    """The one wording of a bad-sample error: stage, index, location, cause, remedy.

    An instance of ``SampleError[type(err)]``; raise it ``from err``.
    """
    if getattr(err, "coordl_transient", False) or isinstance(err, (TimeoutError, ConnectionError)):
        # the network or the server, not the file: its message says what to change
        remedy = "The file itself may be fine: retry once the storage keeps up."
    else:
        remedy = "Fix or remove the file, or pass on_error='skip' to the DataLoader to skip bad samples."
    return sample_error_type(type(err))(
        f"coordl: error {stage} sample {index} ({where}): {type(err).__name__}: "
        f"{str(err).rstrip('.')}. {remedy}"
    )


class Failure:
    """A failed sample or batch on its way from the engine to the consumer.

    ``message`` is what to raise when the error crossed a process boundary
    (it carries the worker's traceback); ``exc_type`` is the original error's
    type. ``error`` is the exception itself, kept only within the process
    that raised it: it is never pickled (the type goes by reference, with
    the message as text), so nothing but a class reference and a string
    crosses the pipe.
    """

    __slots__ = ("message", "exc_type", "error")

    def __init__(self, message: str, exc_type: type | None = None,
                 error: BaseException | None = None) -> None:
        self.message = message
        self.exc_type = exc_type
        self.error = error

    def __reduce__(self):
        t = self.exc_type
        return Failure, (self.message, t if t is not None and _by_reference(t) else None)

    def exception(self) -> BaseException:
        """The exception to raise in the consumer: the in-process one when
        there is one, else ``SampleError[exc_type](message)``."""
        if self.error is not None:
            return self.error
        return sample_error_type(self.exc_type)(self.message)
