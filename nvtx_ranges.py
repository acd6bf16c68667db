"""Named NVTX ranges in one ``kvstage`` domain, for Nsight Systems timelines.

Uses the ``nvtx`` package (not ``torch.cuda.nvtx``, which raises on CPU builds of torch).
With no profiler attached, NVTX's push/pop are no-ops inside libnvToolsExt, so a range costs
about a microsecond of Python; when ``nvtx`` is not installed every range is a plain no-op.

Besides the NVTX calls, each thread keeps the names of its open ranges (see
:func:`open_ranges`), so nesting can be checked without a profiler.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

try:  # optional at run time: a missing nvtx makes every range a no-op
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - exercised by monkeypatching NVTX_AVAILABLE
    _nvtx = None

DOMAIN_NAME = "kvstage"
NVTX_AVAILABLE = _nvtx is not None

_domain = _nvtx.get_domain(DOMAIN_NAME) if _nvtx is not None else None
_attributes: dict[str, object] = {}  # range name -> cached nvtx EventAttributes
_local = threading.local()

F = TypeVar("F", bound=Callable)


def _stack() -> list[str]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def open_ranges() -> tuple[str, ...]:
    """The names of this thread's open kvstage ranges, outermost first."""
    return tuple(_stack())


class nvtx_range:
    """Context manager: the NVTX range ``name`` in the ``kvstage`` domain around the body.

    The range is popped when the body exits, also when it raises. A class rather than a
    generator-based context manager because it sits on per-step hot paths (about 1 us).

    Args:
        name: the range's message as Nsight shows it, e.g. ``"gather"``.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        _stack().append(self.name)
        if _domain is not None and NVTX_AVAILABLE:
            attributes = _attributes.get(self.name)
            if attributes is None:
                attributes = _attributes[self.name] = _domain.get_event_attributes(message=self.name)
            _domain.push_range(attributes)

    def __exit__(self, *exc_info: object) -> None:
        if _domain is not None and NVTX_AVAILABLE:
            _domain.pop_range()
        _stack().pop()


def annotated(name: str) -> Callable[[F], F]:
    """Decorator form of :func:`nvtx_range`: the whole call runs inside the range ``name``."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with nvtx_range(name):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
