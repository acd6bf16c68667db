"""Verify a hybrid replay: every stored entry of every component loaded back through the
manager's prefetch and load path and compared byte for byte.

A hybrid load brings one restorable length ``L`` whole (:mod:`kvstage.offload.restorable`):
the full pages before ``L``, the sliding window's pages before ``L``, the snapshot at ``L``. So
each chain (:func:`~kvstage.replay.verify.chains_to_verify`) is loaded at several lengths, from
its largest restorable length down: a state model at every restorable length (each has its own
snapshot), a sliding-window model at each length whose window holds a stored page no load
before covered. The restorable lengths are worked out here from each store's ``exists`` with
:func:`~kvstage.offload.restorable.restorable_lengths`; a load that brings less than the length
asked (an entry the store holds but cannot read) is counted in ``rounded_loads``.

Full pages end as in :mod:`kvstage.replay.verify`, with one more way to be *unreachable*: held,
but past every restorable length of its chain (no snapshot or window to resume from). Entries
of the other components end as matched, mismatched, unreachable (held, no load reaches it) and,
for snapshots, missing (a snapshot some request took that the store does not hold: a hit there
rounds down).
"""

from __future__ import annotations

import time
from array import array

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload.restorable import restorable_lengths
from kvstage.offload.testing import SimpleRequest
from kvstage.replay.verify import (
    MATCHED,
    MISMATCHED,
    MISSING,
    UNREACHABLE,
    VerifyResult,
    chains_of_sample,
    tally_pages,
    verify_tokens,
)


def _lengths_to_load(engine, lengths: tuple[int, ...], held_window: set[int]) -> list[int]:
    chosen: list[int] = []
    covered: set[int] = set()
    for length in reversed(lengths):
        window = set(engine.window_range(length // engine.page_size)) if engine.swa is not None else set()
        if not chosen or engine.state is not None or (window & held_window) - covered:
            chosen.append(length)
            covered |= window
    return chosen


def _mark(outcome: dict[str, str], key: str, ok: bool) -> None:
    if not ok:
        outcome[key] = MISMATCHED
    else:
        outcome.setdefault(key, MATCHED)


def verify_hybrid(engine, *, sample: int | None = None, seed: int = 0) -> VerifyResult:
    """:func:`~kvstage.replay.verify.verify_pages` for a
    :class:`~kvstage.replay.hybrid_engine.HybridReplayEngine` (module doc); ``components`` of the
    result counts the other components' entries.

    Raises:
        InvalidArgumentError: the host pool could not take a chain's pages.
    """
    started = time.perf_counter()
    manager, ps, layout = engine.manager, engine.page_size, engine.layout
    chains, sampled = chains_of_sample(engine, sample, seed)
    before = manager.metrics
    outcome: dict[str, str] = {}
    others = [c.name for c in layout.components if c.kind != "full"]
    entries: dict[str, dict[str, str]] = {name: {} for name in others}
    held_entries: dict[str, set[str]] = {name: set() for name in others}
    chain_keys: set[str] = set()
    scratch = torch.arange(max(chains.values(), default=0) * ps, dtype=torch.int64, device=engine.device)
    loads = rounded = 0
    for order, pages in chains.items():
        chain = engine.request_keys[order][:pages]
        chain_keys.update(chain)
        trace, tokens, extra_key, cache_salt = verify_tokens(engine, order)
        present = {name: list(store.exists(chain)) for name, store in engine.stores.items()}
        full_held = present["full"]
        leading = next((i for i, hit in enumerate(full_held) if not hit), len(full_held))
        for name in others:
            held_entries[name].update(key for key, hit in zip(chain[:leading], present[name]) if hit)
        lengths = restorable_lengths(layout, ps, pages * ps + 1, present).lengths
        held_window = {i for i, hit in enumerate(present.get("swa", [])) if hit and i < leading}
        for length in _lengths_to_load(engine, lengths, held_window):
            want = length // ps
            req = SimpleRequest(
                f"verify-r{trace.index}-{length}",
                tokens[:length] + array("q", [0]),
                extra_key=extra_key,
                cache_salt=cache_salt,
            )
            handle = manager.prefetch(req, policy="wait_complete")
            if handle.num_host_pages < want:
                manager.abort(req)
                raise InvalidArgumentError(
                    f"--num-host-pages: {manager.host_pool.free_pages} free host pages cannot take a chain of {want} pages"
                )
            handle.wait()
            got = handle.pages_ready
            rounded += got < want
            # The full pages of a shorter length were checked at a longer one: poison and check
            # only the other components' entries then (the window's slots, the state slot).
            full = any(key not in outcome for key in chain[:got])
            if got:
                window = engine.window_range(got) if engine.swa is not None and not full else range(0)
                engine.poison(scratch[: got * ps] if full else scratch[window.start * ps : window.stop * ps])
            load = manager.load(handle, scratch[: got * ps], **engine.load_targets(scratch, got))
            if got:
                load.wait()
                loads += 1
                for name, checked in engine.check_load(scratch, chain, got, full=full).items():
                    for key, ok in checked:
                        _mark(outcome if name == "full" else entries[name], key, ok)
            manager.abort(req)
            manager.poll()  # frees the load's host pages for the next one
        for index, key in enumerate(chain):
            if key in outcome:
                continue
            if index < leading:
                outcome[key] = UNREACHABLE  # held, past every restorable length
            elif index == leading:
                outcome[key] = MISSING
            else:
                outcome[key] = UNREACHABLE if full_held[index] else MISSING
    result = tally_pages(engine, outcome, before, sampled=sampled, verify_requests=loads)
    for name in others:
        states = entries[name]
        counts = {
            "checked": len(states),
            "matched": sum(s == MATCHED for s in states.values()),
            "mismatched": sum(s == MISMATCHED for s in states.values()),
            "unreachable": len(held_entries[name] - set(states)),
        }
        if layout.component(name).kind == "state":
            expected = engine.hybrid.expected_snapshots & chain_keys
            counts["missing"] = len(expected - held_entries[name])
        result.mismatches += counts["mismatched"]
        result.components[name] = counts
    result.rounded_loads = rounded
    result.seconds = time.perf_counter() - started
    return result
