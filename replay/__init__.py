"""``kvstage replay``: run a Mooncake-format request trace through the whole toolkit.

Modules, one job each:
    trace: read and validate JSONL trace lines; the built-in seeded synthetic trace.
    tokens: token ids of a request (a function of its block ids and index).
    models: KV layout presets (the small CPU default, ``llama3-8b``, ``deepseek-v3``).
    kv_content: the deterministic KV bytes of a page, a function of (page key, position).
    engine: the replay loop (prefill, decode, offload, release).
    verify: read stored pages back and compare their bytes; load some back into the device pool.
    report: progress bar, summary table and JSON.
    command: the ``kvstage replay`` options and their checks.
    fleet: ``--engines N``: engine processes on one store, the router, the kill, the verify;
    fleet_engine: one engine process; local_tier: an engine's own memory tier in front of the
    shared store; prefix_index, router: the kv router's index (fed by :mod:`kvstage.events`)
    and the policies; fleet_report: the table and the plot.
"""

from kvstage.replay.trace import TraceError, TraceRequest, load_trace, synthetic_trace

__all__ = ["TraceError", "TraceRequest", "load_trace", "synthetic_trace"]
