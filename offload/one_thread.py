"""The manager's one-thread rule: the thread of the first call owns it; a call from another raises.

Decorate each checked method with :func:`owner_thread_only`; the instance keeps an
:class:`OwnerThread` as ``_owner``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

from kvstage.errors import ThreadingError

__all__ = ["OwnerThread", "owner_thread_only"]

_Method = TypeVar("_Method", bound=Callable[..., Any])
_get_ident = threading.get_ident  # bound once: the check runs on every call


class OwnerThread:
    """The owning thread: None until the first checked call claims it."""

    __slots__ = ("ident", "name")

    def __init__(self) -> None:
        self.ident: int | None = None
        self.name = ""

    def check(self, call: str) -> None:
        """Claim the calling thread on the first call; afterwards raise on any other thread.

        Raises:
            ThreadingError: naming ``call`` and both threads.
        """
        ident = threading.get_ident()
        if self.ident is None:
            self.ident, self.name = ident, threading.current_thread().name
            return
        if ident == self.ident:
            return
        raise ThreadingError(
            f"{call}: called from thread {threading.current_thread().name!r} ({ident}), but thread {self.name!r} "
            f"({self.ident}) made this manager's first call; call every method but close() from that one thread "
            "(the engine's scheduler)"
        )


def owner_thread_only(method: _Method) -> _Method:
    """Check the thread before ``method`` runs (its name, docstring and signature kept).

    The owner's ident is compared first, so the common call costs one comparison; the
    claim and the error are :meth:`OwnerThread.check`'s.
    """
    call = method.__name__

    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _get_ident() != self._owner.ident:
            self._owner.check(call)
        return method(self, *args, **kwargs)

    return checked  # type: ignore[return-value]
