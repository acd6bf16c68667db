"""Read stored pages back and compare their bytes with what they must hold.

After a replay, every full page key any request had (prompt and decode pages) should be in the
storage, holding :meth:`KVContent.expected_pages` of that key. A key the storage does not
return is *lost*, unless the replay knows why (a reported storage failure, a page the manager
dropped for want of host pages, an eviction by a store too small for the run): those are
counted apart as *explained*. A page returned with other bytes is a *mismatch*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvstage.replay.kv_content import KVContent

VERIFY_BATCH_BYTES = 256 << 20  # pages read back and compared per batch (bounds host memory)


@dataclass
class VerifyResult:
    """The outcome of :func:`verify_pages`.

    Attributes:
        pages_checked: keys read back (all expected keys, or the sample).
        pages_matched: read back with the expected bytes.
        mismatches: read back with other bytes.
        missing: not returned by the storage.
        lost: missing pages nothing explains (``missing - explained``, at least 0).
        explained: missing pages accounted for by failures, drops or evictions.
        seconds: wall-clock time of the read-back and comparison.
        sampled: whether a sample (``--verify-sample``) was checked rather than every key.
    """

    pages_checked: int = 0
    pages_matched: int = 0
    mismatches: int = 0
    missing: int = 0
    lost: int = 0
    explained: int = 0
    seconds: float = 0.0
    sampled: bool = False


def verify_pages(
    storage,
    content: KVContent,
    keys: Sequence[str],
    *,
    sample: int | None = None,
    seed: int = 0,
    failed_keys: Sequence[str] = (),
    unexplained_allowance: int = 0,
) -> VerifyResult:
    """Read ``keys`` (or a seeded sample of ``sample`` of them) back and compare bytes.

    Args:
        storage: a :class:`kvstage.offload.StorageBackend` of the replay's layout.
        content: makes the expected bytes of a key.
        keys: the page keys that must be stored.
        sample: check this many keys chosen at random (seeded); None or >= len(keys): all.
        seed: the sample's seed.
        failed_keys: keys reported failed (their absence is explained).
        unexplained_allowance: missing pages explained without a key (drops, evictions).

    Returns:
        A :class:`VerifyResult`.
    """
    started = time.perf_counter()
    keys = list(keys)
    sampled = sample is not None and sample < len(keys)
    if sampled:
        rng = np.random.default_rng([seed, 0x5EED])
        keys = [keys[i] for i in sorted(rng.choice(len(keys), size=sample, replace=False).tolist())]
    failed = set(failed_keys)
    result = VerifyResult(sampled=sampled)
    page_bytes = content.page_bytes
    batch_pages = max(1, min(256, VERIFY_BATCH_BYTES // page_bytes))
    buffer = torch.empty((min(batch_pages, max(len(keys), 1)), page_bytes), dtype=torch.uint8)
    missing_failed = 0
    for start in range(0, len(keys), batch_pages):
        batch = keys[start : start + batch_pages]
        into = [buffer[i] for i in range(len(batch))]
        hits = storage.get(batch, into)
        expected = content.expected_pages(batch).view(content.word)
        # Compare machine words, not bytes: 2-8x fewer elements for the same answer.
        same = (buffer[: len(batch)].view(content.word) == expected).all(dim=1).tolist()
        for key, hit, equal in zip(batch, hits, same):
            result.pages_checked += 1
            if not hit:
                result.missing += 1
                missing_failed += key in failed
            elif equal:
                result.pages_matched += 1
            else:
                result.mismatches += 1
    result.explained = min(result.missing, missing_failed + unexplained_allowance)
    result.lost = result.missing - result.explained
    result.seconds = time.perf_counter() - started
    return result


@dataclass
class RoundTripResult:
    """The outcome of :func:`round_trip_pages`: stored pages loaded back into the device KV pool.

    Attributes:
        pages: pages read from storage and scattered H2D.
        mismatches: pages whose device KV differs from the expected content afterwards.
        bytes_h2d: bytes scattered.
        h2d_seconds: time of the scatters (GPU: synchronized wall-clock).
    """

    pages: int = 0
    mismatches: int = 0
    bytes_h2d: int = 0
    h2d_seconds: float = 0.0

    @property
    def h2d_gbps(self) -> float:
        """H2D GB/s (1e9 bytes) over the scatters' time."""
        return self.bytes_h2d / self.h2d_seconds / 1e9 if self.h2d_seconds > 0 else 0.0


def round_trip_pages(storage, content: KVContent, kv_pool, keys: Sequence[str], *, page_size: int, backend: str = "auto", max_pages: int = 256) -> RoundTripResult:
    """The way back: read up to ``max_pages`` stored pages into host staging, scatter them into
    the device KV pool (:func:`kvstage.kernels.scatter`, H2D, every layer) and compare the
    pool's words with the expected content, layer by layer on the device.

    Uses the pool's first slots: call it when no request holds the pool (after the replay).
    Pages the storage does not return are skipped (:func:`verify_pages` counts them).

    Args:
        storage: the replay's storage backend.
        content: the expected KV (its device is the pool's).
        kv_pool: the :class:`kvstage.kernels.KVPool` the replay ran with.
        keys: page keys to choose from (the first ``max_pages``).
        page_size: tokens per page.
        backend: the scatter's backend.
        max_pages: at most this many pages (bounded also by the pool's and 256 MiB of staging).
    """
    from kvstage.kernels import scatter, staging_shape

    device = kv_pool.device
    on_cuda = torch.device(device).type == "cuda"
    budget = max(1, VERIFY_BATCH_BYTES // content.page_bytes)
    n = min(len(keys), max_pages, kv_pool.num_slots // page_size, budget)
    result = RoundTripResult()
    if n == 0:
        return result
    staging = torch.empty(staging_shape(kv_pool, n, page_size), dtype=kv_pool.dtype, pin_memory=on_cuda)
    hits = storage.get(list(keys[:n]), [staging[i] for i in range(n)])
    chosen = [i for i, hit in enumerate(hits) if hit]
    if not chosen:
        return result
    host_ids = torch.tensor(chosen, dtype=torch.int64, device=device)
    slots = torch.arange(len(chosen) * page_size, dtype=torch.int64, device=device)
    if on_cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    scatter(staging, kv_pool, slots, host_ids, page_size=page_size, layout="page_first", backend=backend)
    if on_cuda:
        torch.cuda.synchronize(device)
    result.h2d_seconds = time.perf_counter() - started
    result.pages = len(chosen)
    result.bytes_h2d = len(chosen) * content.page_bytes
    masks = content.masks([keys[i] for i in chosen])
    wrong = torch.zeros(len(chosen), dtype=torch.bool, device=device)
    rows = len(chosen) * page_size
    for layer in range(kv_pool.num_layers):
        for part in range(kv_pool.kv_parts):
            words = kv_pool.layer(part, layer).view(kv_pool.num_slots, -1).view(content.word)[:rows]
            expected = content.page_words_for_layer(masks, layer, part)
            wrong |= (words != expected).view(len(chosen), -1).any(dim=1)
    result.mismatches = int(wrong.sum())
    return result
