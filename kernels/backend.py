"""Which copy backend runs: native Triton, the Triton interpreter, or the torch reference.

``backend="auto"`` picks native Triton on CUDA tensors, the Triton interpreter on CPU tensors
when ``TRITON_INTERPRET=1`` was set before Triton was imported (how the tests run the same
kernels without a GPU), and the torch reference (``index_select``/``index_copy_``) otherwise.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from kvstage.errors import BackendUnavailableError, InvalidArgumentError

BACKEND_CHOICES = ("auto", "triton", "torch")


@functools.cache
def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (looked up once: a ``sys.path`` scan
    would otherwise cost ~0.1 ms on every copy)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, on_cuda: bool) -> str:
    """Resolve a backend request to ``"triton"`` or ``"torch"``.

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        on_cuda: whether the tensors to copy live on a CUDA device.

    Returns:
        ``"triton"`` or ``"torch"``.

    Raises:
        InvalidArgumentError: ``backend`` is not one of :data:`BACKEND_CHOICES`.
        BackendUnavailableError: ``"triton"`` was asked for but Triton is missing, or the
            tensors are on CPU and ``TRITON_INTERPRET=1`` is not set.
    """
    if backend not in BACKEND_CHOICES:
        raise InvalidArgumentError(f"backend: must be one of {BACKEND_CHOICES}, got {backend!r}")
    if backend == "torch":
        return "torch"
    triton_runs = triton_installed() and (on_cuda or triton_interpreter_enabled())
    if backend == "auto":
        return "triton" if triton_runs else "torch"
    if not triton_installed():
        raise BackendUnavailableError("backend: 'triton' needs the triton package (pip install triton)")
    if not triton_runs:
        raise BackendUnavailableError(
            "backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return "triton"


def describe_backend(on_cuda: bool) -> str:
    """A one-line description of what ``backend="auto"`` runs, for ``kvstage info``."""
    if resolve_backend("auto", on_cuda) == "torch":
        return "torch reference (index_select / index_copy_)"
    return "native Triton" if on_cuda else "Triton interpreter (TRITON_INTERPRET=1, CPU)"
