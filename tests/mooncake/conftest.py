"""Fixtures for the Mooncake store tests: a real ``mooncake_master`` on loopback.

The master comes from the ``mooncake-transfer-engine-non-cuda`` wheel (``mooncake/mooncake_master``)
and runs with its HTTP metadata server, every port picked free. Where the wheel (or the Debian
libraries it links against) is missing, the tests that need it skip and say what to install.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import sys

import pytest

from kvstage.offload.mooncake_store import INSTALL_HINT, mooncake_available
from kvstage.offload.storage import LayoutFingerprint
from support import REPO_ROOT

# A small layout: 2 layers x K,V x 16 tokens x 2 heads x 64 x bf16 = 16 KiB a page.
FINGERPRINT = LayoutFingerprint("tiny-model", "bfloat16", num_layers=2, kv_parts=2, head_num=2, head_dim=64, page_size=16)


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def master_binary() -> Path | None:
    """Path of ``mooncake_master`` inside the installed wheel, or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def drop_shadowing_module() -> None:
    """Forget a ``mooncake`` module that is this repository's root, not the Mooncake wheel.

    pytest's importlib mode imports the repository root's ``__init__.py`` under the checkout
    folder's name while it collects; in a checkout folder named ``mooncake`` that module hides
    the installed ``mooncake`` package. Elsewhere this does nothing.
    """
    shadow = sys.modules.get("mooncake")
    if shadow is not None and getattr(shadow, "__file__", None) == str(REPO_ROOT / "__init__.py"):
        del sys.modules["mooncake"]


def require_mooncake() -> Path:
    """The master binary, or skip naming what to install."""
    drop_shadowing_module()
    if not mooncake_available():
        pytest.skip(f"the Mooncake store is not usable here; {INSTALL_HINT}")
    binary = master_binary()
    if binary is None:
        pytest.skip(f"mooncake_master is not in the installed mooncake package; {INSTALL_HINT}")
    return binary


class MooncakeMaster:
    """A ``mooncake_master`` process on 127.0.0.1 with its HTTP metadata server.

    Attributes:
        rpc_port, http_port: the master's RPC port and its metadata server's port.
        address: ``127.0.0.1:<rpc_port>``; metadata: ``http://127.0.0.1:<http_port>/metadata``.
    """

    def __init__(self, binary: Path, log_path: Path) -> None:
        self.binary = binary
        self.log_path = log_path
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.process: subprocess.Popen | None = None

    def url(self, **query: object) -> str:
        """A ``mooncake://`` URL for this master, with small sizes unless overridden."""
        values = {"metadata": self.metadata, "protocol": "tcp", "segment": "64MB", "buffer": "16MB"}
        values.update({key: str(value) for key, value in query.items()})
        return f"mooncake://{self.address}?" + "&".join(f"{key}={value}" for key, value in values.items())

    def start(self, timeout: float = 15.0) -> None:
        """Start the master and wait until its RPC and HTTP ports accept connections."""
        args = [
            str(self.binary),
            f"-port={self.rpc_port}",  # -port: the name every release knows (newer ones also take -rpc_port)
            "-rpc_address=127.0.0.1",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.http_port}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
            "-rpc_thread_num=2",
        ]
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        for port in (self.rpc_port, self.http_port):
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.process.returncode}; log: {self.log_tail()}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"mooncake_master did not listen on {port} within {timeout} s; log: {self.log_tail()}")
                    time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the master (a crash: no goodbye to clients) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the master keeps its sockets open but answers nothing (a hung master)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; idempotent."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)  # a paused master cannot act on SIGTERM
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def fingerprint() -> LayoutFingerprint:
    """The small layout the Mooncake tests store pages of (16 KiB a page)."""
    return FINGERPRINT


@pytest.fixture(scope="session")
def mooncake_installed() -> Path:
    """The ``mooncake_master`` binary; skips (naming what to install) where Mooncake is missing."""
    return require_mooncake()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory):
    """A master shared by the tests of one module; stopped afterwards."""
    binary = require_mooncake()
    master = MooncakeMaster(binary, tmp_path_factory.mktemp("mooncake") / "master.log")
    master.start()
    yield master
    master.stop()


@pytest.fixture
def private_master(tmp_path: Path):
    """A master for one test (which may kill or pause it); stopped afterwards."""
    binary = require_mooncake()
    master = MooncakeMaster(binary, tmp_path / "master.log")
    master.start()
    yield master
    master.stop()
