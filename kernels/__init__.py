"""Gather/scatter of paged KV between a device KV pool and host staging buffers.

Public API:
    KVPool: a view of the device pool (``mha``, ``mla``, ``from_stacked``).
    staging_shape: the shape of a ``page_first`` or ``layer_first`` staging buffer.
    gather / scatter: D2H / H2D of every layer (scatter: or one layer) in one launch.
    gather_reference / scatter_reference: the torch reference (``index_select``/``index_copy_``).
    resolve_backend, describe_backend, BACKEND_CHOICES: which backend ``"auto"`` runs.
"""

from kvstage.kernels.backend import BACKEND_CHOICES, describe_backend, resolve_backend
from kvstage.kernels.layout import LAYOUTS, staging_shape
from kvstage.kernels.pool import KVPool
from kvstage.kernels.reference import gather_reference, scatter_reference
from kvstage.kernels.transfer import MODES, gather, scatter

__all__ = [
    "BACKEND_CHOICES",
    "KVPool",
    "LAYOUTS",
    "MODES",
    "describe_backend",
    "gather",
    "gather_reference",
    "resolve_backend",
    "scatter",
    "scatter_reference",
    "staging_shape",
]
