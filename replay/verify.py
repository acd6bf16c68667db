"""Load stored pages back through the manager's load path and compare them with what they must hold.

After a replay, every whole page key any request had (prompt and decode pages) should be in the
storage, holding :meth:`KVContent.expected_pages` of that key. Verification reads them the way an
engine would: a *verify request* per chain (the tokens with KV of a trace request, as a prompt)
is prefetched (:meth:`OffloadManager.prefetch`) and loaded (:meth:`OffloadManager.load`) into
idle device slots, whose KV is then compared with the expected content.

Each page checked ends as one of:

- *matched*: loaded with the expected bytes; *mismatched*: loaded with other bytes;
- *missing*: not loadable, and not behind an earlier page of its chain that is missing: the
  store does not hold it, or holds it and cannot read it (a corrupted file). A missing page is
  *lost* unless the replay knows why (a reported storage failure, a page the manager dropped
  for want of host pages, an eviction by a store too small for the run): those are *explained*;
- *unreachable*: held by the store (``exists``) behind a missing page of its chain, so no load
  can use it.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.testing import SimpleRequest
from kvstage.replay.replay_request import ReplayRequest

MATCHED, MISMATCHED, MISSING, UNREACHABLE = "matched", "mismatched", "missing", "unreachable"


@dataclass
class VerifyResult:
    """The outcome of :func:`verify_pages` (counts are pages; each page key counted once).

    Attributes:
        pages_checked: keys verified (every expected key, or the sampled keys and the pages
            before them in their chains).
        pages_matched, mismatches, missing, unreachable: see the module docstring.
        lost: missing pages nothing explains (``missing - explained``, at least 0).
        explained: missing pages accounted for by failures, drops or evictions.
        verify_requests: prefetch-and-load rounds (one per chain verified).
        pages_loaded, bytes_loaded: what those loads moved H2D.
        load_seconds: the loads' copy time, in seconds (GPU time on CUDA).
        seconds: wall-clock time of the whole verification.
        sampled: whether a sample (``--verify-sample``) was checked rather than every key.
        missing_keys: the missing pages' keys (a fleet tells the killed engine's writes apart).
        components: a hybrid model's other components, by name: entries ``checked``,
            ``matched``, ``mismatched`` (also counted in ``mismatches``), ``unreachable``, and
            for state ``missing`` (:mod:`kvstage.replay.hybrid_verify`); empty for a plain model.
        rounded_loads: a hybrid model's verify loads that brought less than the length asked.
    """

    pages_checked: int = 0
    pages_matched: int = 0
    mismatches: int = 0
    missing: int = 0
    unreachable: int = 0
    lost: int = 0
    explained: int = 0
    verify_requests: int = 0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    seconds: float = 0.0
    sampled: bool = False
    missing_keys: list[str] = field(default_factory=list)
    components: dict[str, dict[str, int]] = field(default_factory=dict)
    rounded_loads: int = 0

    @property
    def h2d_gbps(self) -> float:
        """The verify loads' H2D throughput over copy time, in GB/s (1e9 bytes)."""
        return self.bytes_loaded / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0


def chains_to_verify(request_keys: list[list[str]], targets: list[str]) -> dict[int, int]:
    """The fewest request prefixes whose pages cover ``targets``.

    Args:
        request_keys: each request's page keys (one hash chain each), in replay order.
        targets: keys to cover, each a key of some request.

    Returns:
        ``{request order: pages}``: load the first ``pages`` pages of that request's chain. A
        prefix that is a prefix of another chosen one is left out (a key fixes its whole chain
        before it, so two chains through one key agree up to it).
    """
    owner: dict[str, tuple[int, int]] = {}
    for order, keys in enumerate(request_keys):
        for position, key in enumerate(keys):
            owner.setdefault(key, (order, position))
    depth: dict[int, int] = {}
    for key in targets:
        order, position = owner[key]
        depth[order] = max(depth.get(order, 0), position + 1)
    ends = {request_keys[order][pages - 1]: order for order, pages in depth.items()}
    for order, pages in depth.items():
        for key in request_keys[order][: pages - 1]:
            covered = ends.get(key)
            if covered is not None and covered != order:
                del ends[key]
    return {order: depth[order] for order in sorted(ends.values())}


def chains_of_sample(engine, sample: int | None, seed: int) -> tuple[dict[int, int], bool]:
    """(:func:`chains_to_verify` of the keys to verify, whether they are a sample): every
    expected key of ``engine``, or ``sample`` of them chosen with ``seed`` (see :func:`verify_pages`)."""
    keys = list(engine.expected_keys)
    sampled = sample is not None and sample < len(keys)
    if sampled:
        rng = np.random.default_rng([seed, 0x5EED])
        keys = [keys[i] for i in sorted(rng.choice(len(keys), size=sample, replace=False).tolist())]
    return chains_to_verify(engine.request_keys, keys), sampled


def verify_tokens(engine, order: int) -> tuple[Any, array, str | None, str | None]:
    """(trace request, tokens with KV, extra_key, cache_salt) of the request at ``order``."""
    trace = engine.trace[order]
    extra_key, cache_salt = engine.namespaces[order]
    tokens = ReplayRequest(trace, engine.tokens.prompt(trace), engine.tokens.output(trace), extra_key, cache_salt)
    return trace, tokens.kv_tokens, extra_key, cache_salt


def tally_pages(engine, outcome: dict[str, str], before: Any, *, sampled: bool, verify_requests: int) -> VerifyResult:
    """A :class:`VerifyResult` of the full pages' ``outcome`` (key -> state), the loads since the
    manager's metrics ``before`` and the missing pages the replay explains (module doc)."""
    after = engine.manager.metrics
    result = VerifyResult(sampled=sampled, verify_requests=verify_requests)
    result.pages_loaded = after.pages_loaded - before.pages_loaded
    result.bytes_loaded = after.bytes_loaded - before.bytes_loaded
    result.load_seconds = after.load_seconds - before.load_seconds
    failed = set(engine.stats.storage_failure_keys)
    missing_failed = 0
    for key, state in outcome.items():
        result.pages_checked += 1
        if state == MATCHED:
            result.pages_matched += 1
        elif state == MISMATCHED:
            result.mismatches += 1
        elif state == UNREACHABLE:
            result.unreachable += 1
        else:
            result.missing += 1
            result.missing_keys.append(key)
            missing_failed += key in failed
    allowance = engine.run_metrics.pages_dropped + engine.storage.stats.pages_evicted
    result.explained = min(result.missing, missing_failed + allowance)
    result.lost = result.missing - result.explained
    return result


def verify_pages(engine, *, sample: int | None = None, seed: int = 0) -> VerifyResult:
    """Load the replay's stored pages back through the manager's load path and compare them.

    Call it after :meth:`ReplayEngine.run`: it uses the device pool's first slots (no request
    holds them then) and the manager's host pages.

    Args:
        engine: the :class:`kvstage.replay.engine.ReplayEngine` after ``run()`` (a hybrid
            model's: :func:`kvstage.replay.hybrid_verify.verify_hybrid`, every component).
        sample: verify this many keys chosen at random (seeded), each with the pages before it
            in its chain; None or >= the number of keys: all.
        seed: the sample's seed.

    Returns:
        A :class:`VerifyResult`; missing pages are explained by ``engine.stats``'
        ``storage_failure_keys``, the manager's ``pages_dropped`` and the store's evictions.

    Raises:
        InvalidArgumentError: the host pool could not take a chain's pages (it is smaller than
            the longest request, or not idle).
    """
    from kvstage.replay.models import HybridShape

    if isinstance(engine.model, HybridShape):  # every component (kvstage.replay.hybrid_verify)
        from kvstage.replay.hybrid_verify import verify_hybrid

        return verify_hybrid(engine, sample=sample, seed=seed)
    started = time.perf_counter()
    manager, content, ps = engine.manager, engine.content, engine.page_size
    chains, sampled = chains_of_sample(engine, sample, seed)
    before = manager.metrics
    outcome: dict[str, str] = {}
    scratch = torch.arange(max(chains.values(), default=0) * ps, dtype=torch.int64, device=engine.device)
    for order, pages in chains.items():
        chain = engine.request_keys[order][:pages]
        trace, tokens, extra_key, cache_salt = verify_tokens(engine, order)
        # A lookup leaves a prompt's last token out (the engine computes it): one more, any id.
        req = SimpleRequest(
            f"verify-r{trace.index}", tokens[: pages * ps] + array("q", [0]), extra_key=extra_key, cache_salt=cache_salt
        )
        handle = manager.prefetch(req, policy="wait_complete")
        if handle.num_host_pages < pages:
            manager.abort(req)
            raise InvalidArgumentError(
                f"--num-host-pages: {manager.host_pool.free_pages} free host pages cannot take a chain of {pages} pages"
            )
        handle.wait()
        loaded = handle.pages_ready
        slots = scratch[: loaded * ps]
        if loaded:
            engine.poison(slots)
        load = manager.load(handle, slots)
        if loaded:
            load.wait()
            wrong = engine.mismatched_pages(slots, content.masks(chain[:loaded])).tolist()
            for key, bad in zip(chain, wrong):
                outcome.setdefault(key, MISMATCHED if bad else MATCHED)
        manager.abort(req)
        manager.poll()  # frees the load's host pages for the next chain
        if loaded < pages:
            outcome.setdefault(chain[loaded], MISSING)
            behind = chain[loaded + 1 :]
            for key, held in zip(behind, engine.storage.exists(behind) if behind else []):
                outcome.setdefault(key, UNREACHABLE if held else MISSING)
    result = tally_pages(engine, outcome, before, sampled=sampled, verify_requests=len(chains))
    result.seconds = time.perf_counter() - started
    return result
