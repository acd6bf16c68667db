"""kvstage: move the paged KV cache of an LLM inference engine off the GPU and back.

Sub-packages:
    kvstage.kernels: Triton gather/scatter of KV pages between a device KV pool and host staging.
    kvstage.offload: the per-request offload manager, host page pool, copy streams, storage.
    kvstage.hashing: namespace-seeded page hash chains (storage keys).
"""

from kvstage import errors
from kvstage.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    DeviceMismatchError,
    InvalidArgumentError,
    KvstageError,
    StorageError,
)
from kvstage.nvtx_ranges import nvtx_range

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "BackendUnavailableError",
    "DeviceMismatchError",
    "InvalidArgumentError",
    "KvstageError",
    "StorageError",
    "__version__",
    "errors",
    "nvtx_range",
]
