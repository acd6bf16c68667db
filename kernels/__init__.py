"""Gather/scatter of paged KV between a device KV pool and host staging buffers.

Public API:
    KVPool: a view of the device pool (``mha``, ``mla``, ``from_stacked``).
    staging_shape: the shape of a ``page_first`` or ``layer_first`` staging buffer.
    gather / scatter: D2H / H2D of every layer (scatter: or one layer) in one launch.
    warm_up: compile the kernel variants and build a pool's offset table before the first copy.
    gather_reference / scatter_reference: the torch reference (``index_select``/``index_copy_``).
    resolve_backend, describe_backend, BACKEND_CHOICES: which backend ``"auto"`` runs.
    launch_after, gather_async, scatter_async, CopyHandle, side_stream: run a copy on a side
        stream after the producer's queued work (:mod:`kvstage.kernels.streams`).
    MODES, LAYOUTS: the accepted ``mode`` and ``layout`` values.
    StatePool: per-request state tensors (Mamba / linear attention) indexed by state slot.
    gather_state / scatter_state (and ``_async``): a state snapshot of every state tensor in one launch.
    gather_state_reference / scatter_state_reference: their torch reference; warm_up_state.

Modules: ``pool`` (KVPool), ``layout`` (staging layouts, validation, staged-mode helpers),
``words`` (the copy-word rule), ``reference`` (torch path), ``state_pool`` / ``state_layout`` /
``state_copy`` / ``state_reference`` / ``triton_state`` (the state snapshot copies, likewise), ``triton_copy`` (the kernel, its launch
heuristic ``choose_config``, the autotune hook ``set_config_hook``, ``warm_up``, ``compile_ptx``; imports triton, so
it is imported only when a Triton launch happens), ``transfer`` (gather/scatter), ``streams``,
``host_copy`` (host-to-host row copies with streaming stores, ``copy_rows``; the optional C
extension ``_host_copy``).
"""

from kvstage.kernels.backend import BACKEND_CHOICES, describe_backend, resolve_backend
from kvstage.kernels.layout import LAYOUTS, staging_shape
from kvstage.kernels.pool import KVPool
from kvstage.kernels.reference import gather_reference, scatter_reference
from kvstage.kernels.state_copy import (
    gather_state,
    gather_state_async,
    scatter_state,
    scatter_state_async,
    warm_up_state,
)
from kvstage.kernels.state_pool import StatePool
from kvstage.kernels.state_reference import gather_state_reference, scatter_state_reference
from kvstage.kernels.streams import CopyHandle, gather_async, launch_after, scatter_async, side_stream
from kvstage.kernels.transfer import MODES, gather, scatter, warm_up

__all__ = [
    "BACKEND_CHOICES",
    "CopyHandle",
    "KVPool",
    "LAYOUTS",
    "MODES",
    "StatePool",
    "describe_backend",
    "gather",
    "gather_async",
    "gather_reference",
    "gather_state",
    "gather_state_async",
    "gather_state_reference",
    "launch_after",
    "resolve_backend",
    "scatter",
    "scatter_async",
    "scatter_reference",
    "scatter_state",
    "scatter_state_async",
    "scatter_state_reference",
    "side_stream",
    "staging_shape",
    "warm_up",
    "warm_up_state",
]
