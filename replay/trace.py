"""Mooncake-format request traces: read and validate JSONL lines; the built-in synthetic trace.

Format (the traces released with the Mooncake paper, FAST'25; see ``../shared/data/README.md``):
one JSON object a line with

    timestamp      arrival time in milliseconds (number >= 0)
    input_length   prompt tokens (int >= 1)
    output_length  tokens to generate (int >= 1)
    hash_ids       ids of the prompt's 512-token blocks (ints >= 0), exactly
                   ceil(input_length / 512) of them; equal ids mean the same prefix block

Blank lines are skipped. Other keys are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from kvstage.errors import InvalidArgumentError, is_int

BLOCK_TOKENS = 512  # tokens per hash_ids block in Mooncake traces


class TraceError(InvalidArgumentError):
    """A trace line is malformed; the message names the file, the line number and the field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: 0-based position in the trace (after ``--requests`` slicing, still the line order).
        timestamp: arrival in milliseconds.
        input_length: prompt tokens.
        output_length: tokens to generate.
        hash_ids: ids of the prompt's 512-token blocks.
        line: 1-based line number in the file (0 for the synthetic trace).
    """

    index: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


def parse_line(text: str, index: int, line: int, source: str = "trace") -> TraceRequest:
    """Parse and validate one JSONL line.

    Raises:
        TraceError: not a JSON object, a field missing, of the wrong type or out of range
            (the message is ``<source> line <n>: <field>: <rule>``).
    """

    def fail(field: str, rule: str) -> TraceError:
        return TraceError(f"{source} line {line}: {field}: {rule}")

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail("json", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise fail("json", f"must be an object, got {type(obj).__name__}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in obj:
            raise fail(field, "missing")
    timestamp = obj["timestamp"]
    if (
        not (isinstance(timestamp, (int, float)) and not isinstance(timestamp, bool))
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise fail("timestamp", f"must be a number >= 0 (milliseconds), got {timestamp!r}")
    for field in ("input_length", "output_length"):
        value = obj[field]
        if not is_int(value) or value < 1:
            raise fail(field, f"must be an int >= 1, got {value!r}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise fail("hash_ids", f"must be a list of ints, got {type(hash_ids).__name__}")
    for position, block in enumerate(hash_ids):
        if not is_int(block) or block < 0:
            raise fail(f"hash_ids[{position}]", f"must be an int >= 0, got {block!r}")
    needed = -(-obj["input_length"] // BLOCK_TOKENS)
    if len(hash_ids) != needed:
        raise fail(
            "hash_ids",
            f"{len(hash_ids)} block ids for input_length {obj['input_length']}; "
            f"must be ceil(input_length / {BLOCK_TOKENS}) = {needed}",
        )
    return TraceRequest(index, float(timestamp), obj["input_length"], obj["output_length"], tuple(hash_ids), line)


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """Yield the requests of a JSONL trace file in line order, at most ``limit`` of them.

    Raises:
        TraceError: a malformed line (named by its number), or the file is unreadable.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(f"TRACE: cannot open {str(path)!r}: {exc.strerror}") from None
    with handle:
        index = 0
        for number, raw in enumerate(handle, start=1):
            if limit is not None and index >= limit:
                return
            try:  # decoded line by line, so that a bad byte is reported with its line number
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{path.name} line {number}: not UTF-8 text (byte {exc.start})") from None
            if not text.strip():
                continue
            yield parse_line(text, index, number, source=path.name)
            index += 1


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of a trace file, validated.

    Raises:
        TraceError: a malformed line, an unreadable file, or no request in it.
    """
    requests = list(iter_trace(path, limit))
    if not requests:
        raise TraceError(f"TRACE: {str(path)!r} holds no request")
    return requests


class _BlockIds:
    """Fresh block ids of a synthetic trace: ``fresh(n)`` gives the next ``n``, from 0."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        return ids


def _turn(rng: np.random.Generator, index: int, timestamp: float, history: list[int]) -> TraceRequest:
    """A synthetic request over the block ids ``history`` (the last block partial: 64 tokens to a
    whole block) with an output of 8-160 tokens."""
    input_length = (len(history) - 1) * BLOCK_TOKENS + int(rng.integers(64, BLOCK_TOKENS + 1))
    output_length = int(rng.integers(8, 161))
    return TraceRequest(index, round(timestamp, 3), input_length, output_length, tuple(history), 0)


def synthetic_trace(num_requests: int = 48, seed: int = 0) -> list[TraceRequest]:
    """A seeded synthetic trace in the Mooncake format, the default of ``kvstage replay``.

    Shaped like a chat service, small enough for a CPU: a few shared system prompts (1-2
    blocks), then conversations whose every turn repeats the previous turn's prompt and
    output as its prefix and adds a fresh user message; Poisson arrivals (mean gap 50 ms);
    prompts of about 0.7k-6k tokens, outputs of 8-160 tokens. Block ids follow the trace
    rule: equal ids mean an equal prefix (each block id is a node of one prefix tree).

    Args:
        num_requests: requests to make, >= 1.
        seed: the numpy generator's seed; the same seed gives the same trace.
    """
    if not is_int(num_requests) or num_requests < 1:
        raise InvalidArgumentError(f"num_requests: must be an int >= 1, got {num_requests!r}")
    rng = np.random.default_rng([seed, 0x7A11])
    fresh = _BlockIds()

    system_prompts = [fresh(int(rng.integers(1, 3))) for _ in range(4)]
    conversations: list[list[int]] = []  # block ids of each conversation's history so far
    requests: list[TraceRequest] = []
    timestamp = 0.0
    for index in range(num_requests):
        timestamp += float(rng.exponential(50.0))
        if not conversations or rng.random() < 0.35 or len(conversations[-1]) > 10:
            conversations.append(list(system_prompts[int(rng.integers(0, len(system_prompts)))]))
            history = conversations[-1]
        else:
            history = conversations[int(rng.integers(max(0, len(conversations) - 4), len(conversations)))]
        # This turn's prompt: the history (whole blocks) plus a new user message, the last block partial.
        history.extend(fresh(int(rng.integers(1, 3))))
        requests.append(_turn(rng, index, timestamp, history))
        # The partial last block is replaced by a fresh one when the conversation continues,
        # as a new prompt holds more tokens there (its prefix block differs).
        history.pop()
    return requests


def multi_tenant_trace(num_requests: int = 200, tenants: int = 8, seed: int = 0) -> list[TraceRequest]:
    """A seeded synthetic trace of tenants whose prefixes recur: ``kvstage replay --multi-tenant N``.

    Each tenant has its own system prompt (4-8 blocks of 512 tokens) and up to 4 open
    sessions; tenants are picked with Zipf weights (tenant t: 1 / (t + 1)), so a few are busy
    and recur everywhere a router spreads them. A request continues one of its tenant's
    sessions (half the time, its history as prefix plus 1-2 new blocks) or opens a new one (the
    system prompt plus one block); the last block is partial. Poisson arrivals (mean gap 20 ms),
    outputs of 8-160 tokens. Block ids follow the trace rule (equal ids, equal prefix).

    Args:
        num_requests: requests to make, >= 1.
        tenants: tenants, >= 1.
        seed: the numpy generator's seed.

    Raises:
        InvalidArgumentError: ``num_requests`` or ``tenants`` is not an int >= 1.
    """
    for name, value in (("num_requests", num_requests), ("tenants", tenants)):
        if not is_int(value) or value < 1:
            raise InvalidArgumentError(f"{name}: must be an int >= 1, got {value!r}")
    rng = np.random.default_rng([seed, 0x7E7A])
    fresh = _BlockIds()

    system = [fresh(int(rng.integers(4, 9))) for _ in range(tenants)]
    sessions: list[list[list[int]]] = [[] for _ in range(tenants)]
    weights = 1.0 / np.arange(1, tenants + 1)
    weights /= weights.sum()
    requests: list[TraceRequest] = []
    timestamp = 0.0
    for index in range(num_requests):
        timestamp += float(rng.exponential(20.0))
        tenant = int(rng.choice(tenants, p=weights))
        open_sessions = sessions[tenant]
        if open_sessions and rng.random() < 0.5:
            history = open_sessions[int(rng.integers(len(open_sessions)))]
            history.extend(fresh(int(rng.integers(1, 3))))
        else:
            history = list(system[tenant]) + fresh(1)
            open_sessions.append(history)
            if len(open_sessions) > 4:
                open_sessions.pop(0)
        requests.append(_turn(rng, index, timestamp, history))
        history.pop()  # the partial last block: a continuing turn replaces it with a whole one
        history.extend(fresh(1))  # ... which holds the previous turn's prompt end and output
    return requests
