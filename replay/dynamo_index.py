"""Dynamo's standalone KV indexer as the fleet router's index (``--router dynamo``).

``python -m dynamo.indexer`` (the ``ai-dynamo-runtime`` package) runs as a process of its own:
each engine is registered with it (``POST /register``: its instance id, its KV event PUB and
replay endpoints, the page size as ``block_size``), it subscribes to the engine's events (the
same ``kvstage.events`` stream the ``kv`` policy reads: vLLM's wire format, token ids in each
``BlockStored``) and hashes the token ids itself, and ``POST /query`` with a request's tokens
answers, per engine, how many of its leading tokens that engine holds at each tier
(``gpu``; ``cpu``: on the device or in host memory; ``disk``). The router counts ``cpu``: the
engine's own memory, as the ``kv`` policy counts media ``GPU`` and ``CPU``; pages in the shared
store (medium ``STORAGE``, Dynamo's ``disk``) count for no engine. An engine is registered once
its publisher is bound (the indexer's listener connects once: registered earlier, it never
received a message); a killed engine is unregistered (``POST /unregister``: Dynamo drops what it
held) and its successor registered when it is ready.

The indexer binds 0.0.0.0 (it has no host option); the engines' publishers bind 127.0.0.1.
Requests are matched as plain token ids: a request with an ``extra_key`` or ``cache_salt``
(announced as ``lora_name`` / ``extra_keys``) is hashed apart by Dynamo and never matches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvstage.errors import BackendUnavailableError

MODEL_NAME = "default"
START_TIMEOUT_S = 60.0
INSTALL_HINT = "ai-dynamo-runtime: bash tools/install-dynamo.sh, or pip install ai-dynamo-runtime==1.6.1"


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (the caller binds them soon after), all
    bound at once while picked: one after another, the kernel may hand out a port twice."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the caller binds it soon after)."""
    return free_ports(1)[0]


def _has_indexer(python: str) -> bool:
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('dynamo.indexer') is None)"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def dynamo_python() -> str | None:
    """The Python whose ``dynamo.indexer`` runs: ``$KVSTAGE_DYNAMO_PYTHON``, the checkout's
    ``.venv-dynamo`` (``tools/install-dynamo.sh``), or this one; None where none has it."""
    root = Path(__file__).resolve().parent.parent
    for python in filter(None, (os.environ.get("KVSTAGE_DYNAMO_PYTHON"), str(root / ".venv-dynamo/bin/python"))):
        if Path(python).is_file() and _has_indexer(python):
            return python
    if importlib.util.find_spec("dynamo") is not None and importlib.util.find_spec("dynamo.indexer") is not None:
        return sys.executable
    return None


class DynamoIndex:
    """A ``dynamo.indexer`` process on a free port, for one fleet run.

    Args:
        block_size: the page size in tokens (Dynamo's block size).
        python: the interpreter that has ``dynamo.indexer`` (default :func:`dynamo_python`).

    Raises:
        BackendUnavailableError: no ``ai-dynamo-runtime`` found (names ``--router dynamo`` and
            how to install it), or the indexer exited or was not healthy within
            :data:`START_TIMEOUT_S` (its output in the message).
    """

    def __init__(self, block_size: int, python: str | None = None) -> None:
        python = python or dynamo_python()
        if python is None:
            raise BackendUnavailableError(
                f"--router dynamo: needs Dynamo's KV indexer ({INSTALL_HINT}); none in $KVSTAGE_DYNAMO_PYTHON, "
                "the checkout's .venv-dynamo or this Python"
            )
        self.block_size = block_size
        self.port = free_port()
        self.queries = 0
        self.prefix_answers = 0  # queries where some engine held a prefix
        self.query_s = 0.0
        self.process = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise BackendUnavailableError(
                    f"--router dynamo: dynamo.indexer exited ({self.process.returncode}): {self.process.stdout.read()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise BackendUnavailableError(f"--router dynamo: dynamo.indexer not healthy in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read() or b"{}")

    def register(self, engine: int, endpoint: str, replay_endpoint: str) -> None:
        """Register engine ``engine`` (its instance id) with its PUB and replay endpoints (``tcp://``)."""
        self._post(
            "/register",
            {
                "instance_id": engine,
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "model_name": MODEL_NAME,
                "block_size": self.block_size,
            },
        )

    def unregister(self, engine: int) -> None:
        """Forget engine ``engine`` and every block Dynamo holds for it (it died)."""
        self._post("/unregister", {"instance_id": engine, "model_name": MODEL_NAME})

    def local_blocks(self, token_ids: list[int]) -> dict[int, int]:
        """``{engine: leading whole blocks of token_ids it holds on its device or in host memory}``
        (Dynamo's ``cpu`` tier, which includes ``gpu``), for the engines that hold any."""
        started = time.perf_counter()
        answer = self._post("/query", {"model_name": MODEL_NAME, "token_ids": token_ids, "block_size": self.block_size})
        self.queries += 1
        self.query_s += time.perf_counter() - started
        instances = answer.get("instances", {})
        blocks = {int(e): int(held.get("cpu", 0)) // self.block_size for e, held in instances.items()}
        self.prefix_answers += any(blocks.values())
        return blocks

    def close(self) -> str:
        """Stop the indexer; its output (for a failure's report)."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out or ""
