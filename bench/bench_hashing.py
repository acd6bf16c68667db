"""Benchmark: tokens/s of the page key chains beside a per-token reference and the one-call ceiling.

For each scheme (``sglang-v1`` = SHA-256, ``xxh3-128``) and page size (1, 16, 64, 256), over
the same 1M random token ids (2**20; ``--quick``: 2**16), each method producing the same keys:

* ``kvstage``: :func:`kvstage.hashing.page_keys` on a numpy int64 array (validation, one
  ``astype('<u4')``, then the chain): the chain that runs by default here, for ``sglang-v1``
  the compiled one (``kvstage.hashing._chain``, one C call for all pages) where it was built,
  else the pure-Python loop (the last lines say which).
* ``kvstage-list``: the same from a Python list of ints (one ``array('I', ...)`` conversion).
* ``kvstage-py``: as ``kvstage`` but always the pure-Python chain (one hash call per page), what
  runs without the extension or with ``KVSTAGE_PURE_PYTHON_HASH=1``; for ``xxh3-128``, whose
  chain is always Python, the same as ``kvstage``.
* ``per-token``: the plain reference, a hash object per page fed the prior digest, then one
  ``int.to_bytes(4, "little")`` per token, from a Python list.
* ``ceiling``: the same hash over the same token bytes in ONE call (no chain, no per-page
  work): what a perfect implementation could approach. A chain also hashes the 32 (16) prior
  bytes and pads every page, so even zero overhead stays below 1.0 of it at small pages.
* ``call-floor``: only the per-page hash calls a Python chain cannot avoid, on empty input
  (``sglang-v1``: one hashlib object made and finalised per page; ``xxh3-128``: one
  ``xxh3_128_digest(b"")`` per page). It bounds any pure-Python chain from above: ``kvstage``
  at 1.0 of it would spend nothing beyond those calls (no slicing, hashing, hex); the compiled
  chain makes no such calls, so it can exceed 1.0.

Timing: CPU time of this process (``time.process_time``; all methods are single-threaded, and
it keeps other jobs on a shared machine out of the figures); every method once per round, rounds interleaved (so load on a shared machine hits all
methods alike), the median over rounds; each ratio is the median of the per-round ratios.

Targets (issue 3), at page 64: sglang-v1 >= 10x per-token and >= 0.5 of the ceiling;
xxh3-128 >= 3x sglang-v1 (all on the ``kvstage`` rows, so on the compiled sglang-v1 chain where
it is built; the pure-Python figures are printed beside them).

Run: ``python bench/bench_hashing.py [--quick] [--rounds N] [--json PATH]``;
``run(quick) -> dict`` is the entry point for other scripts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from kvstage.hashing import SCHEMES, get_scheme, page_keys
from kvstage.hashing.schemes import HashScheme, _chain_hash_objects, _sha256_digest, describe_chains

PAGE_SIZES = (1, 16, 64, 256)
NEW_HASH = {"sglang-v1": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}
ONE_CALL = {"sglang-v1": lambda data: hashlib.sha256(data).digest(), "xxh3-128": xxhash.xxh3_128_digest}
METHODS = ("kvstage", "kvstage-list", "kvstage-py", "per-token", "ceiling", "call-floor")
# The pure-Python chain of each scheme, whatever runs by default (see ``kvstage-py`` above).
PURE_PYTHON = {
    "sglang-v1": HashScheme("sglang-v1", 32, _sha256_digest, _chain_hash_objects(hashlib.sha256), cryptographic=True),
    "xxh3-128": get_scheme("xxh3-128"),
}
TARGET_PAGE = 64


def per_token_reference(tokens: list[int], page_size: int, new_hash: Callable) -> list[str]:
    """The plain way: one hash object per page, one ``to_bytes`` and ``update`` per token."""
    keys = []
    prior = b""
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = new_hash(prior)
        for token in tokens[start : start + page_size]:
            h.update(token.to_bytes(4, "little"))
        prior = h.digest()
        keys.append(prior.hex())
    return keys


def call_floor(scheme: str, n_pages: int) -> list[bytes]:
    """The per-page hash calls alone, on no data (see the module doc)."""
    if scheme == "sglang-v1":
        fresh = hashlib.sha256().copy  # as kvstage's chain makes its per-page objects
        return [fresh().digest() for _ in range(n_pages)]
    return [xxhash.xxh3_128_digest(b"") for _ in range(n_pages)]


def _timed(fn: Callable[[], object]) -> float:
    # CPU seconds of this process: every method is single-threaded, and on a shared machine
    # wall time also counts the time other jobs held the core.
    start = time.process_time()
    fn()
    return time.process_time() - start


def run(quick: bool = False, *, rounds: int | None = None, n_tokens: int | None = None, page_sizes: tuple[int, ...] = PAGE_SIZES, schemes: tuple[str, ...] = SCHEMES, log: Callable[[str], None] = print) -> dict:
    """Time every scheme x page size x method; return the results as a JSON-able dict.

    Args:
        quick: 2**16 tokens and 3 rounds instead of 2**20 and 5 (seconds instead of a minute).
        rounds: override the number of rounds (the median is taken over them).
        n_tokens: override the number of tokens.
        log: where progress lines go.

    Returns:
        ``{"machine", "python", "sglang_chain", "n_tokens", "rounds", "quick", "results":
        [{scheme, page_size, method, seconds, tokens_per_s}], "ratios": [{scheme, page_size,
        vs_per_token, of_ceiling, list_vs_per_token, list_of_ceiling, of_call_floor,
        py_vs_per_token, py_of_ceiling}], "xxh3_vs_sglang": {page_size: x},
        "summary": {name: {value, target, ok}}}``.
    """
    n_tokens = n_tokens or (1 << 16 if quick else 1 << 20)
    rounds = rounds or (3 if quick else 5)
    rng = np.random.default_rng(0)
    array = rng.integers(0, 152064, n_tokens, dtype=np.int64)  # a 152K vocabulary (Qwen2-sized)
    tokens = array.tolist()
    data = array.astype("<u4").tobytes()
    results: list[dict] = []
    ratios: list[dict] = []
    kvstage_seconds: dict[tuple[str, int], list[float]] = {}
    for scheme in schemes:
        for page_size in page_sizes:
            # Same keys from every chain method (checked once, outside the timing).
            expected = page_keys(array, page_size, scheme=scheme)
            assert page_keys(tokens, page_size, scheme=scheme) == expected
            assert page_keys(array, page_size, scheme=PURE_PYTHON[scheme]) == expected
            assert per_token_reference(tokens[: 8 * page_size], page_size, NEW_HASH[scheme]) == expected[:8]
            fns = {
                "kvstage": lambda: page_keys(array, page_size, scheme=scheme),
                "kvstage-list": lambda: page_keys(tokens, page_size, scheme=scheme),
                "kvstage-py": lambda: page_keys(array, page_size, scheme=PURE_PYTHON[scheme]),
                "per-token": lambda: per_token_reference(tokens, page_size, NEW_HASH[scheme]),
                "ceiling": lambda: ONE_CALL[scheme](data),
                "call-floor": lambda: call_floor(scheme, n_tokens // page_size),
            }
            times = {m: [] for m in METHODS}
            for _ in range(rounds):
                for method, fn in fns.items():
                    times[method].append(_timed(fn))
            row = {}
            for method in METHODS:
                seconds = statistics.median(times[method])
                row[method] = n_tokens / seconds
                results.append(dict(scheme=scheme, page_size=page_size, method=method, seconds=seconds, tokens_per_s=row[method]))
            kvstage_seconds[(scheme, page_size)] = times["kvstage"]

            def per_round(a: str, b: str) -> float:
                return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

            ratio = dict(
                scheme=scheme,
                page_size=page_size,
                vs_per_token=per_round("kvstage", "per-token"),
                of_ceiling=per_round("kvstage", "ceiling"),
                list_vs_per_token=per_round("kvstage-list", "per-token"),
                list_of_ceiling=per_round("kvstage-list", "ceiling"),
                of_call_floor=per_round("kvstage", "call-floor"),
                py_vs_per_token=per_round("kvstage-py", "per-token"),
                py_of_ceiling=per_round("kvstage-py", "ceiling"),
            )
            ratios.append(ratio)
            log(
                f"{scheme:9s} page {page_size:3d}  "
                + "  ".join(f"{m} {row[m] / 1e6:7.2f}" for m in METHODS)
                + f"  Mtok/s | kvstage {ratio['vs_per_token']:5.1f}x per-token, {ratio['of_ceiling']:.2f} of ceiling"
                + f", {ratio['of_call_floor']:.2f} of call floor"
                + f" | from list {ratio['list_vs_per_token']:5.1f}x, {ratio['list_of_ceiling']:.2f}"
                + f" | pure Python {ratio['py_vs_per_token']:5.1f}x, {ratio['py_of_ceiling']:.2f}"
            )
    xxh3_vs_sglang = {}
    if set(SCHEMES) <= set(schemes):
        # Rounds of the two schemes are not interleaved; the ratio of medians is the fair summary.
        for page_size in page_sizes:
            xxh3_vs_sglang[page_size] = statistics.median(kvstage_seconds[("sglang-v1", page_size)]) / statistics.median(kvstage_seconds[("xxh3-128", page_size)])
        log("xxh3-128 / sglang-v1 (kvstage): " + "  ".join(f"page {p}: {x:.1f}x" for p, x in xxh3_vs_sglang.items()))
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "python": platform.python_version(),
        "sglang_chain": describe_chains(),
        "openssl": __import__("ssl").OPENSSL_VERSION,
        "xxhash": xxhash.VERSION,
        "n_tokens": n_tokens,
        "rounds": rounds,
        "quick": quick,
        "results": results,
        "ratios": ratios,
        "xxh3_vs_sglang": xxh3_vs_sglang,
        "summary": summarize(ratios, xxh3_vs_sglang),
    }
    return report


def summarize(ratios: list[dict], xxh3_vs_sglang: dict) -> dict:
    """The targets of issue 3, as ``{name: {"value": ..., "target": ..., "ok": bool}}``."""
    summary: dict[str, dict] = {}
    for r in ratios:
        if r["scheme"] == "sglang-v1" and r["page_size"] == TARGET_PAGE:
            summary[f"sglang-v1 page {TARGET_PAGE}: kvstage / per-token"] = dict(value=r["vs_per_token"], target=10.0, ok=r["vs_per_token"] >= 10.0)
            summary[f"sglang-v1 page {TARGET_PAGE}: kvstage / one-call ceiling"] = dict(value=r["of_ceiling"], target=0.5, ok=r["of_ceiling"] >= 0.5)
    if TARGET_PAGE in xxh3_vs_sglang:
        value = xxh3_vs_sglang[TARGET_PAGE]
        summary[f"page {TARGET_PAGE}: xxh3-128 / sglang-v1"] = dict(value=value, target=3.0, ok=value >= 3.0)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2**16 tokens, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds to take the median over (default 5; quick 3)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (default 2**20; quick 2**16)")
    parser.add_argument("--page-size", action="append", type=int, help="repeatable; default 1 16 64 256")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    report = run(args.quick, rounds=args.rounds, n_tokens=args.tokens, page_sizes=tuple(args.page_size or PAGE_SIZES))
    print(f"{report['n_tokens']} tokens, median of {report['rounds']} rounds; Python {report['python']}, {report['openssl']}")
    print(f"kvstage rows: {report['sglang_chain']}")
    for name, item in report["summary"].items():
        print(f"{'PASS' if item['ok'] else 'MISS'} {name}: {item['value']:.2f} (target {item['target']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
