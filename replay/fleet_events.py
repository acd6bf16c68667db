"""A fleet engine's KV events on the wire, in vLLM's format, for the fleet's router.

Frames (vLLM ``vllm/distributed/kv_events.py``): a ZMQ PUB socket sends ``[topic, seq as 8
bytes big-endian, payload]``; the payload is a msgpack ``KVEventBatch`` array ``[ts, events,
data_parallel_rank]`` with ``ts`` the publish time (``time.time()``, seconds) and each event a
tagged map: ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", "lora_name", "medium", "extra_keys"}``, ``{"type": "BlockRemoved",
"block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``.

Block hashes: a page key's first 16 hex digits as an int (sglang's events do the same with the
page SHA-256), so the router's index keys pages by the same chain the engines hash.

This module is the replay fleet's own transport until ``kvstage.events`` (its publisher and
subscriber) is on main; :class:`FleetPublisher` and :class:`FleetSubscriber` have the
publisher's and subscriber's call shapes (``publish(events)``, ``poll(timeout_s)`` ->
``[(seq, batch)]``) so that swapping them is a change of import.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import msgpack
import zmq

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"


def block_hash(key: str) -> int:
    """A page key's event hash: its first 16 hex digits as an unsigned 64-bit int."""
    return int(key[:16], 16)


def block_stored(
    keys: list[str], parent: str | None, token_ids: list[int], block_size: int, medium: str, lora_name: str | None
) -> dict[str, Any]:
    """A ``BlockStored`` event of one run of a chain (``keys`` in order, ``parent`` the page before)."""
    return {
        "type": "BlockStored",
        "block_hashes": [block_hash(k) for k in keys],
        "parent_block_hash": None if parent is None else block_hash(parent),
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_name": lora_name,
        "medium": medium,
    }


def block_removed(keys: list[str], medium: str) -> dict[str, Any]:
    """A ``BlockRemoved`` event."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash(k) for k in keys], "medium": medium}


class FleetPublisher:
    """Binds a PUB socket at ``endpoint`` and publishes event batches with a sequence from 0."""

    def __init__(self, endpoint: str, *, topic: str = "", data_parallel_rank: int = 0) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.bind(endpoint)
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Send one batch (nothing when ``events`` is empty)."""
        if not events:
            return
        payload = msgpack.packb([time.time(), events, self._rank], use_bin_type=True)
        self._socket.send_multipart([self._topic, struct.pack(">Q", self._seq), payload])
        self._seq += 1

    def close(self) -> None:
        """Close the socket (pending batches get up to 1 s to leave)."""
        self._socket.close()
        self._context.term()


class FleetSubscriber:
    """Connects a SUB socket to ``endpoint``; :meth:`poll` returns ``[(seq, (ts, events, rank))]``."""

    def __init__(self, endpoint: str, *, topic: str = "") -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)

    def poll(self, timeout_s: float = 0.0) -> list[tuple[int, tuple[float, list, int]]]:
        """Every batch that has arrived (waits up to ``timeout_s`` for the first)."""
        out = []
        if not self._socket.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                _, seq, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            ts, events, rank = msgpack.unpackb(payload, raw=False)
            out.append((struct.unpack(">Q", seq)[0], (ts, events, rank)))

    def close(self) -> None:
        """Close the socket."""
        self._socket.close(linger=0)
        self._context.term()
