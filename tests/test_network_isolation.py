"""The test servers (mooncake_master binds a port on every interface; gloo peers) are reachable
from this machine alone: `make test` runs pytest inside a network namespace of its own
(tools/in-netns.sh) whose only interfaces are loopback and a veth pair inside it, with no route
out."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from support import REPO_ROOT, skip_missing

NAMESPACE_INTERFACES = ["kvstage0", "kvstage1", "lo"]


def interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def routes() -> list[tuple[str, str]]:
    """(interface, destination as hex) of every IPv4 route, from /proc/net/route."""
    lines = Path("/proc/net/route").read_text().splitlines()[1:]
    return [(fields[0], fields[1]) for fields in (line.split() for line in lines) if fields]


def test_the_suite_runs_in_its_own_network_namespace():
    if interfaces() != NAMESPACE_INTERFACES:
        skip_missing("tools/in-netns.sh's network namespace: run pytest through it (make test does)")
    assert routes() == [("kvstage0", "000200C0")]  # 192.0.2.0/24 only: no default route out
    with socket.create_server(("127.0.0.1", 0)) as server:  # loopback works inside it
        socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=2).close()


def test_in_netns_gives_a_command_only_its_own_interfaces():
    done = subprocess.run(
        [
            "bash",
            str(REPO_ROOT / "tools" / "in-netns.sh"),
            "python3",
            "-c",
            "import socket; print(sorted(n for _, n in socket.if_nameindex()))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    if "no network namespace here" in done.stderr:
        skip_missing("unshare --net (root, or unprivileged user namespaces) for tools/in-netns.sh")
    assert done.stdout.strip() == str(NAMESPACE_INTERFACES)
