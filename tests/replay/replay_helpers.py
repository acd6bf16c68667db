"""Helpers of the replay tests: a tiny trace and model, an in-process replay, and the pages a
trace must store and hit, counted from its block ids alone (not from the replay's keys)."""

from __future__ import annotations

from kvstage.replay.command import replay
from kvstage.replay.engine import ReplayConfig
from kvstage.replay.models import resolve_model
from kvstage.replay.trace import BLOCK_TOKENS, TraceRequest

TINY = resolve_model(None, layers=1, heads=1, head_dim=8, dtype="float16")
PAGE_BYTES = TINY.page_bytes(16)


def tiny_trace(n=6):
    """Short requests sharing a first block; the second also shares the first's second block."""
    shapes = [
        (700, 20, [0, 1]),
        (900, 9, [0, 1]),
        (300, 1, [0]),
        (1200, 33, [0, 2, 3]),
        (520, 16, [0, 4]),
        (64, 64, [5]),
    ]
    return [TraceRequest(i, float(i), n_in, n_out, tuple(ids)) for i, (n_in, n_out, ids) in enumerate(shapes[:n])]


def run_in_process(requests, *, metrics_registry=None, metrics_file=None, **overrides):
    """``replay()`` of the tiny model at page size 16 (overrides: ReplayConfig fields; the
    metrics arguments are replay()'s); the engine is left open: close it."""
    settings = dict(model=TINY, page_size=16, max_running=3, backend="torch")
    settings.update(overrides)
    return replay(
        ReplayConfig(**settings),
        requests,
        keep_engine=True,
        metrics_registry=metrics_registry,
        metrics_file=metrics_file,
    )


def page_identities(request, page_size):
    """What each whole page with KV of ``request`` holds: a prompt page is named by the blocks its
    tokens come from and its index (tokens are a function of block ids), a page holding output
    tokens by the request and its index."""
    identities = []
    for page in range((request.input_length + request.output_length - 1) // page_size):
        end = (page + 1) * page_size
        if end <= request.input_length:
            identities.append((request.hash_ids[: -(-end // BLOCK_TOKENS)], page))
        else:
            identities.append((request.index, page))
    return identities


def expected_page_count(requests, page_size):
    """Whole pages with KV (prompt + output[:-1]) of every request."""
    return sum((r.input_length + r.output_length - 1) // page_size for r in requests)


def distinct_pages(requests, page_size):
    """Pages a store must hold after the trace (each distinct page once)."""
    return len({identity for r in requests for identity in page_identities(r, page_size)})


def serial_hits(requests, page_size):
    """(pages hit, pages looked up) when each request runs after the previous one's pages are
    stored (``max_running=1``): its lookup (whole pages of the prompt but its last token) hits
    the leading pages an earlier request stored."""
    stored, hits, looked_up = set(), 0, 0
    for request in requests:
        identities = page_identities(request, page_size)
        lookup = (request.input_length - 1) // page_size
        hit = 0
        while hit < lookup and identities[hit] in stored:
            hit += 1
        hits += hit
        looked_up += lookup
        stored.update(identities)
    return hits, looked_up
