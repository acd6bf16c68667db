"""The exception types kvstage raises.

Every error kvstage raises derives from :class:`KvstageError`, so an engine can catch all
of them in one place; each also derives from the built-in exception whose meaning fits
(``ValueError`` for a bad value, ``TypeError`` for a wrong type, ``RuntimeError`` for a
failure at run time), so code that already catches those keeps working.

Messages name the argument and the rule it broke, for example
``slot_indices: dtype must be int32 or int64, got torch.float32``.
"""

from __future__ import annotations

from collections.abc import Callable


class KvstageError(Exception):
    """Base class of every exception kvstage raises."""


class InvalidArgumentError(KvstageError, ValueError):
    """An argument has the right type but a value that breaks a rule (shape, range, count)."""


class ArgumentTypeError(KvstageError, TypeError):
    """An argument has the wrong type or dtype (e.g. float token ids, a float index tensor)."""


class DeviceMismatchError(InvalidArgumentError):
    """Tensors that must share a device (or must be pinned host memory) do not."""


class BackendUnavailableError(KvstageError, RuntimeError):
    """The requested copy backend or optional dependency cannot run on this machine."""


class StorageError(KvstageError, RuntimeError):
    """A storage backend could not be set up or failed as a whole (not a per-key miss)."""


class ThreadingError(KvstageError, RuntimeError):
    """An object that one thread must drive (the offload manager: the engine's scheduler thread)
    was called from another thread, or a call was made on a thread where it cannot complete (a
    KV event publisher's ``flush`` on its own sending thread)."""


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool`` (Python counts ``True`` as the int 1; no size,
    count or index here takes it)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require(
    condition: bool, argument: str, rule: str | Callable[[], str], error: type[KvstageError] = InvalidArgumentError
) -> None:
    """Raise ``error("<argument>: <rule>")`` when ``condition`` is false.

    Args:
        condition: the rule holds when true.
        argument: the name of the argument that is checked, as the caller spells it.
        rule: what must hold, with the offending value where it helps; or a function making
            that text, called only when the rule fails (on hot paths, where formatting the
            message every call would cost more than the check).
        error: the exception class to raise (a :class:`KvstageError` subclass).

    Raises:
        error: when ``condition`` is false.
    """
    if not condition:
        raise error(f"{argument}: {rule() if callable(rule) else rule}")


def require_seconds(value: object, argument: str) -> None:
    """Raise unless ``value`` is a duration: an int or float of seconds >= 0 (not a bool, which
    Python counts as an int; not NaN; infinity passes).

    Args:
        value: the duration given.
        argument: the argument's name, as the caller spells it.

    Raises:
        InvalidArgumentError: ``"<argument>: must be a number of seconds >= 0, got <value>"``.
    """
    require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
        argument,
        lambda: f"must be a number of seconds >= 0, got {value!r}",
    )
