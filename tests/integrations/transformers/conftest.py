"""Fixtures of the hybrid-model tests: the store each round trip uses (memory, file, a real
Mooncake master)."""

from hybrid_rig import master, store_url  # noqa: F401 (fixtures, defined beside the rig)
