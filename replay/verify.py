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
