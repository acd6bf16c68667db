"""Run a ``mooncake_master`` on loopback for the tests and the storage bench (not package API).

The master binary ships in the Mooncake wheel (``mooncake/mooncake_master``). It is started with
its HTTP metadata server (``-enable_http_metadata_server=true``) so clients need no etcd, and
binds every service to 127.0.0.1 on ports the kernel reports free. Flags used (from
``mooncake_master --help``): ``-port`` (the RPC port; newer releases also call it
``-rpc_port``), ``-rpc_address``, ``-enable_http_metadata_server``,
``-http_metadata_server_host``, ``-http_metadata_server_port``, ``-metrics_host``,
``-metrics_port``, ``-enable_metric_reporting``, ``-rpc_thread_num``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from kvstage.errors import BackendUnavailableError
from kvstage.replay.dynamo_index import free_ports  # distinct ports, bound at once while picked
from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0 on 127.0.0.1)."""
    return free_ports(1)[0]


class LocalMooncakeMaster:
    """A ``mooncake_master`` process on 127.0.0.1 with its HTTP metadata server, every port
    picked free: for tests, benchmarks and single-machine use. A context manager (start/stop).

    Args:
        log_path: where the master's stdout and stderr go (appended).
        binary: the ``mooncake_master`` executable (default: :func:`master_binary`).
        flags: more ``-name=value`` flags (e.g. ``-allow_evict_soft_pinned_objects=false``).

    Attributes:
        rpc_port, http_port, metrics_port: the master's RPC port, its metadata server's port
            and its admin/metrics port.
        address: ``127.0.0.1:<rpc_port>``; metadata: ``http://127.0.0.1:<http_port>/metadata``;
            admin_address: ``127.0.0.1:<metrics_port>`` (the store's ``admin=``).

    Raises:
        BackendUnavailableError: no ``mooncake_master`` is installed (names the install command).
    """

    def __init__(self, log_path: Path | str, binary: Path | str | None = None, flags: tuple[str, ...] = ()) -> None:
        found = master_binary() if binary is None else Path(binary)
        if found is None:
            raise BackendUnavailableError(
                f"mooncake: no mooncake_master in the installed mooncake package; {INSTALL_HINT}"
            )
        self.binary = found
        self.flags = tuple(flags)
        self.log_path = Path(log_path)
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.address = f"127.0.0.1:{self.rpc_port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.admin_address = f"127.0.0.1:{self.metrics_port}"  # its admin HTTP server (/get_all_keys)
        self.process: subprocess.Popen | None = None

    def url(self, **query: object) -> str:
        """A ``mooncake://`` URL for this master: HTTP metadata, its admin server (``admin``), tcp,
        a 64 MiB segment and a 16 MiB local buffer unless ``query`` overrides them (any
        :func:`parse_mooncake_url` name; None leaves a name out)."""
        values: dict[str, object] = {
            "metadata": self.metadata,
            "admin": self.admin_address,
            "protocol": "tcp",
            "segment": "64MiB",
            "buffer": "16MiB",
        }
        values.update(query)
        return f"mooncake://{self.address}?" + "&".join(
            f"{key}={value}" for key, value in values.items() if value is not None
        )

    def start(self, timeout: float = 15.0) -> "LocalMooncakeMaster":
        """Start the master and wait until its RPC, HTTP metadata and admin ports accept connections.

        Raises:
            RuntimeError: it exited or did not listen within ``timeout`` seconds (with its log).
        """
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
            *self.flags,
        ]
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        for port in (self.rpc_port, self.http_port, self.metrics_port):
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.process.returncode}; log: {self.log_tail()}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError as error:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"mooncake_master did not listen on {port} within {timeout} s; log: {self.log_tail()}"
                        ) from error
                    time.sleep(0.05)
        return self

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

    def __enter__(self) -> "LocalMooncakeMaster":
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the master's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
