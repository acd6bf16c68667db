"""Benchmark: end-to-end ``kvstage replay`` runs, the speed targets of issue 6.

Cases (each the same code path as the command line, in this process):

* ``default``: the built-in synthetic trace (48 requests) with the small model; target: under
  60 s on CPU.
* ``conversation-200`` (full mode only, when ``../shared/data/mooncake-traces`` is there): the
  first 200 requests of the Mooncake conversation trace, page size 64, small model; target:
  "a few minutes" on CPU, taken as under 300 s.

Each row carries the replay's own figures (prefix hit rate, load and D2H GB/s, hashing
tokens/s, storage put GB/s, pages) so a regression in any part shows here. On CPU torch runs with one intra-op thread, as the
command line does (see ``kvstage.replay.command.set_cpu_threads``).

Run: ``python bench/bench_replay.py [--quick] [--json PATH]``; ``run(quick) -> dict``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from kvstage.replay.command import replay
from kvstage.replay.engine import ReplayConfig, pick_device
from kvstage.replay.models import resolve_model
from kvstage.replay.trace import load_trace, synthetic_trace

CONVERSATION = Path(__file__).resolve().parent.parent.parent / "shared/data/mooncake-traces/conversation_trace.jsonl"
TARGET_SECONDS = {"default": 60.0, "conversation-200": 300.0}
FIGURES = (
    "prompt_pages",
    "page_hit_rate",
    "prefill_tokens_saved",
    "pages_loaded",
    "h2d_gbps",
    "load_mismatches",
    "pages_stored",
    "pages_deduplicated",
    "bytes_offloaded",
    "d2h_gbps",
    "hashing_tokens_per_s",
    "storage_put_gbps",
    "storage_get_gbps",
    "host_pool_high_water_pages",
    "verify_mismatches",
    "lost_pages",
    "copy_backend",
)


def cases(quick: bool) -> list[tuple[str, Callable[[], list]]]:
    """(name, trace maker) of the cases to run."""
    chosen = [("default", lambda: synthetic_trace(48, seed=0))]
    if not quick and CONVERSATION.is_file():
        chosen.append(("conversation-200", lambda: load_trace(CONVERSATION, 200)))
    return chosen


def run(quick: bool = False, *, log: Callable[[str], None] = print) -> dict:
    """Replay each case; returns ``{"device", "results": [{case, requests, seconds,
    requests_per_s, ...replay figures}], "summary": {name: {value, target, ok}}}``."""
    on_cpu = pick_device(None).type == "cpu"
    threads = torch.get_num_threads()
    if on_cpu:
        torch.set_num_threads(1)
    results, summary = [], {}
    try:
        for name, make in cases(quick):
            requests = make()
            config = ReplayConfig(model=resolve_model("small"), page_size=64)
            started = time.perf_counter()
            report, _ = replay(config, requests, trace_name=name, started=started)
            seconds = time.perf_counter() - started
            row = {
                "case": name,
                "requests": report["requests"],
                "seconds": seconds,
                "requests_per_s": report["requests"] / seconds,
            }
            row.update({key: report[key] for key in FIGURES})
            results.append(row)
            target = TARGET_SECONDS[name]
            clean = report["load_mismatches"] == 0 and report["verify_mismatches"] == 0 and report["lost_pages"] == 0
            summary[f"{name}: seconds ({'cpu' if on_cpu else 'cuda'})"] = dict(
                value=seconds, target=target, ok=seconds < target and clean
            )
            log(
                f"{name:17s} {report['requests']} requests in {seconds:6.1f} s, prefix hit {report['page_hit_rate']:.1%}, "
                f"D2H {report['d2h_gbps']:.2f} GB/s, H2D {report['h2d_gbps']:.2f} GB/s, {report['pages_stored']} pages stored, "
                f"{report['lost_pages']} lost, {report['load_mismatches'] + report['verify_mismatches']} mismatched"
            )
    finally:
        torch.set_num_threads(threads)
    return {
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "quick": quick,
        "results": results,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default run only")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    report = run(args.quick)
    for name, item in report["summary"].items():
        print(f"{'PASS' if item['ok'] else 'MISS'} {name}: {item['value']:.1f} (target < {item['target']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
