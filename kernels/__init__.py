"""Triton gather/scatter of paged KV between a device KV pool and host staging buffers."""

from kvstage.kernels.backend import BACKEND_CHOICES, describe_backend, resolve_backend

__all__ = ["BACKEND_CHOICES", "describe_backend", "resolve_backend"]
