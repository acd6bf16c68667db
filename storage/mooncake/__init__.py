"""The Mooncake distributed store as a kvstage storage backend (optional ``mooncake`` extra).

Modules: ``config`` (:class:`MooncakeConfig`, ``mooncake://`` URLs), ``status`` (Mooncake's
return codes), ``store`` (:class:`MooncakeStore`). The ``mooncake`` package itself is imported
only when a store is built.
"""

from kvstage.storage.mooncake.config import MooncakeConfig, parse_mooncake_url
from kvstage.storage.mooncake.store import MooncakeStore, mooncake_available

__all__ = ["MooncakeConfig", "MooncakeStore", "mooncake_available", "parse_mooncake_url"]
