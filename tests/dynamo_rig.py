"""Dynamo's standalone KV indexer (``ai-dynamo-runtime``, ``python -m dynamo.indexer``) as a
test's subprocess, queried over HTTP (importable as ``dynamo_rig``).

It binds 0.0.0.0 (no host option): its tests run inside the network namespace
(``bash tools/in-netns.sh``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support import REPO_ROOT, skip_missing

WORKER = "1"


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Indexer:
    """``python -m dynamo.indexer`` on a free port; with ``endpoint``, one worker:
    ``WORKER=endpoint`` (without replay: Dynamo replays only for registered workers)."""

    def __init__(self, endpoint: str | None, block_size: int) -> None:
        self.port = free_port()
        workers = [] if endpoint is None else ["--block-size", str(block_size), "--workers", f"{WORKER}={endpoint}"]
        self.process = subprocess.Popen(
            [require_dynamo(), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1", *workers],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"dynamo.indexer exited {self.process.returncode}: {self.process.stdout.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("dynamo.indexer not healthy within 30 s")

    def post(self, path: str, body: dict) -> int:
        """POST ``body`` as JSON; the HTTP status."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status

    def overlaps(self, token_ids: list[int]) -> dict[str, int]:
        """Tokens of ``token_ids`` the indexer matches for the worker, by tier (``"gpu"``,
        ``"cpu"``, ``"disk"``; missing: 0). Dynamo 1.6.1 counts a tier's match over that tier
        and the faster ones: a block still at ``gpu`` counts at ``disk`` too."""
        body = json.dumps({"model_name": "default", "token_ids": token_ids}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/query", body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            instances = json.load(answer).get("instances", {})
        found = instances.get(WORKER, {})
        return {tier: int(found.get(tier, 0)) for tier in ("gpu", "cpu", "disk")}

    def disk_overlap(self, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` the indexer finds for the worker at its disk tier (0: none)."""
        return self.overlaps(token_ids)["disk"]

    def wait_for(self, token_ids: list[int], expected: int, timeout_s: float = 10.0) -> int:
        """Query until the overlap is ``expected`` (or ``timeout_s`` passed); the last answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            overlap = self.disk_overlap(token_ids)
            if overlap == expected or time.monotonic() > deadline:
                return overlap
            time.sleep(0.02)

    def stop(self) -> str:
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out


def dynamo_python() -> str | None:
    """The Python whose ``dynamo.indexer`` runs: ``$KVSTAGE_DYNAMO_PYTHON``, the repository's
    ``.venv-dynamo`` (``tools/install-dynamo.sh``), or this one; None where none has it."""
    candidates = [os.environ.get("KVSTAGE_DYNAMO_PYTHON"), str(REPO_ROOT / ".venv-dynamo" / "bin" / "python")]
    for python in filter(None, candidates):
        if Path(python).is_file() and _has_indexer(python):
            return python
    return sys.executable if importlib.util.find_spec("dynamo") and importlib.util.find_spec("dynamo.indexer") else None


def _has_indexer(python: str) -> bool:
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('dynamo.indexer') is None)"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def require_dynamo() -> str:
    """The indexer's Python; skip (fail under CI) where ai-dynamo-runtime is not installed."""
    python = dynamo_python()
    if python is None:
        skip_missing(
            "the ai-dynamo-runtime package (bash tools/install-dynamo.sh, or pip install ai-dynamo-runtime==1.6.1)"
        )
    return python
