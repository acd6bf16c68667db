"""Concurrency helpers of the Mooncake store: the clear gate and the pool of bounce buffers.

:class:`ClearGate` lets exists/put/get run together and gives ``clear`` and ``close`` the store
alone, so a put racing a clear lands whole after it or not at all. :class:`BufferPool` hands each
call that needs a bounce buffer one of its own, making at most ``limit`` of them.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, TypeVar

from kvstage.errors import InvalidArgumentError

T = TypeVar("T")


class ClearGate:
    """A reader-writer gate: many ``shared()`` holders at once, or one ``exclusive()`` holder.

    A waiting exclusive holder goes first: shared holders that arrive after it wait until it
    is done, so a stream of puts cannot starve a clear. Not reentrant (a shared holder that asks
    again while a clear waits would wait on itself).
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._shared = 0  # holders of shared() now
        self._exclusive = False  # an exclusive() holder now
        self._exclusive_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the gate together with other shared holders (a put, get or exists)."""
        with self._condition:
            while self._exclusive or self._exclusive_waiting:
                self._condition.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                self._shared -= 1
                if not self._shared:
                    self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone (a clear or close): waits for every shared holder to leave."""
        with self._condition:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._condition.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class BufferPool(Generic[T]):
    """At most ``limit`` buffers, each lent to one caller at a time.

    Args:
        make: builds a new buffer (called without the pool's lock held, so a slow registration
            does not block returns); may return None when none can be made (the caller then
            gets None).
        limit: the most buffers ever made (an int >= 1); a caller finding all of them lent
            waits for one to come back.

    Raises:
        InvalidArgumentError: limit is not an int >= 1.
    """

    def __init__(self, make: Callable[[], T | None], limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidArgumentError(f"limit: must be an int >= 1, got {limit!r}")
        self._make = make
        self.limit = limit
        self._condition = threading.Condition()
        self._free: list[T] = []
        self._made: list[T] = []
        self._making = 0  # make() calls under way, counted against the limit

    @property
    def made(self) -> list[T]:
        """Every buffer made so far (lent or free), oldest first."""
        with self._condition:
            return list(self._made)

    @contextmanager
    def lend(self) -> Iterator[T | None]:
        """A buffer for the ``with`` block alone (None when ``make`` could not make one)."""
        buffer = self._take()
        try:
            yield buffer
        finally:
            if buffer is not None:
                with self._condition:
                    self._free.append(buffer)
                    self._condition.notify()

    def drain(self) -> list[T]:
        """Forget every buffer and return them (for the owner to release); call when none is lent."""
        with self._condition:
            made, self._made, self._free = self._made, [], []
            return made

    def _take(self) -> T | None:
        with self._condition:
            while not self._free and len(self._made) + self._making >= self.limit:
                self._condition.wait()
            if self._free:
                return self._free.pop()  # the most recently returned: warm in cache
            self._making += 1
        buffer = None
        try:
            buffer = self._make()
        finally:
            with self._condition:
                self._making -= 1
                if buffer is not None:
                    self._made.append(buffer)
                self._condition.notify()
        return buffer
