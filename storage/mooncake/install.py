"""Finding the installed Mooncake: its store binding, its ``mooncake_master`` executable, and
whether an address answers (checked before Mooncake's own setup, which waits long on a dead one).

The ``mooncake`` package is imported lazily, when a store is built, so kvstage imports without it.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import Any

from kvstage.errors import BackendUnavailableError, StorageError

INSTALL_HINT = (
    "install it with `bash tools/install-mooncake.sh .venv` (Debian packages libibverbs1 librdmacm1 "
    "libnuma1, then `pip install mooncake-transfer-engine-non-cuda`, or `pip install '.[mooncake]'` in the kvstage checkout)"
)


def import_store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``.

    Raises:
        BackendUnavailableError: the wheel is not installed, or its Debian libraries are missing.
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        text = str(error)
        if ".so" in text:  # the wheel is there but a Debian library is not
            raise BackendUnavailableError(
                f"mooncake: the Mooncake wheel is installed but cannot load ({text}); {INSTALL_HINT}"
            ) from error
        raise BackendUnavailableError(
            f"mooncake: the optional Mooncake store is not installed; {INSTALL_HINT}"
        ) from error
    return MooncakeDistributedStore


def mooncake_available() -> bool:
    """Whether ``mooncake.store`` imports here (the wheel and its Debian libraries are present)."""
    try:
        import_store_class()
    except BackendUnavailableError:
        return False
    return True


def master_binary() -> Path | None:
    """Path of the executable ``mooncake_master`` inside the installed ``mooncake`` package, or None.

    Found without importing ``mooncake`` (so without loading its native libraries).
    """
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def probe(host: str, port: int, timeout: float, what: str) -> str:
    """Connect to host:port and return the local address of the connection.

    Raises:
        StorageError: nothing answers within ``timeout`` seconds.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            return connection.getsockname()[0]
    except OSError as error:
        raise StorageError(
            f"mooncake: {what} at {host}:{port} is unreachable ({error.__class__.__name__}: {error}); "
            f"start mooncake_master (e.g. `mooncake_master -port={port} -enable_http_metadata_server=true`) "
            "or fix the address"
        ) from None
