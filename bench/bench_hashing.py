"""Benchmark: tokens/s of the page key chains beside a per-token reference and the one-call ceiling.

For each scheme (``sglang-v1`` = SHA-256, ``xxh3-128``) and page size (1, 16, 64, 256), over
the same 1M random token ids (2**20; ``--quick``: 2**16), each method producing the same keys:

* ``kvstage``: :func:`kvstage.hashing.page_keys` on a numpy int64 array: the chain that runs
  by default here, the compiled one (one C call from int64 ids to the list of keys, range
  checks and u32 conversion fused into the page loop) where it was built, else the pure-Python
  loop (the last lines say which).
* ``kvstage-list``: the same from a Python list of ints (what many engines hold).
* ``kvstage-array``: the same from an ``array('q')`` (what sglang 0.5.23's ``Req`` holds): the
  compiled chain reads its buffer in place, as it reads the numpy array.
* ``kvstage-py``: as ``kvstage`` but always the pure-Python chain (validation and one
  ``astype('<u4')``, then one hash call per page), what runs without the extensions or with
  ``KVSTAGE_PURE_PYTHON_HASH=1``.
* ``per-token``: the plain reference, a hash object per page fed the prior digest, then one
  ``int.to_bytes(4, "little")`` per token, from a Python list.
* ``ceiling``: the same hash over the same token bytes in ONE call (no chain, no per-page
  work): what a perfect implementation could approach. A chain also hashes the 32 (16) prior
  bytes and pads every page, so even zero overhead stays below 1.0 of it at small pages.
* ``call-floor``: only the per-page hash calls a Python chain cannot avoid, on empty input
  (``sglang-v1``: one hashlib object made and finalised per page; ``xxh3-128``: one
  ``xxh3_128_digest(b"")`` per page). It bounds any pure-Python chain from above: ``kvstage-py``
  at 1.0 of it would spend nothing beyond those calls (no slicing, hashing, hex); the compiled
  chains make no such calls.

Timing: CPU time of this process (``time.process_time``; all methods are single-threaded, and
it keeps other jobs on a shared machine out of the figures); every method once per round, rounds interleaved (so load on a shared machine hits all
methods alike; both schemes run in every round), the median over rounds; each ratio is the
median of the per-round ratios.

Targets (issue 3), at page 64: sglang-v1 >= 10x per-token and >= 0.5 of the ceiling;
xxh3-128 >= 3x sglang-v1 (all on the ``kvstage`` rows, so on the compiled chains where they
are built; the list and pure-Python figures are printed beside them).

Run: ``python bench/bench_hashing.py [--quick] [--rounds N] [--json PATH]``;
``run(quick) -> dict`` is the entry point for other scripts.
"""

from __future__ import annotations

import argparse
import array
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
from kvstage.hashing.schemes import describe_chains

PAGE_SIZES = (1, 16, 64, 256)
NEW_HASH = {"sglang-v1": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}
ONE_CALL = {"sglang-v1": lambda data: hashlib.sha256(data).digest(), "xxh3-128": xxhash.xxh3_128_digest}
METHODS = ("kvstage", "kvstage-list", "kvstage-array", "kvstage-py", "per-token", "ceiling", "call-floor")
# The pure-Python chain of each scheme, whatever runs by default (see ``kvstage-py`` above).
PURE_PYTHON = {name: get_scheme(name).pure_python() for name in SCHEMES}
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


def call_floor(scheme: str, num_pages: int) -> list[bytes]:
    """The per-page hash calls alone, on no data (see the module doc)."""
    if scheme == "sglang-v1":
        fresh = hashlib.sha256().copy  # as kvstage's chain makes its per-page objects
        return [fresh().digest() for _ in range(num_pages)]
    return [xxhash.xxh3_128_digest(b"") for _ in range(num_pages)]


def _timed(fn: Callable[[], object]) -> float:
    # CPU seconds of this process: every method is single-threaded, and on a shared machine
    # wall time also counts the time other jobs held the core.
    start = time.process_time()
    fn()
    return time.process_time() - start


def run(
    quick: bool = False,
    *,
    rounds: int | None = None,
    n_tokens: int | None = None,
    page_sizes: tuple[int, ...] = PAGE_SIZES,
    schemes: tuple[str, ...] = SCHEMES,
    log: Callable[[str], None] = print,
) -> dict:
    """Time every scheme x page size x method; return the results as a JSON-able dict.

    Args:
        quick: 2**16 tokens and 3 rounds instead of 2**20 and 5 (seconds instead of a minute).
        rounds: override the number of rounds (the median is taken over them).
        n_tokens: override the number of tokens.
        log: where progress lines go.

    Returns:
        ``{"machine", "python", "chains", "n_tokens", "rounds", "quick", "results":
        [{scheme, page_size, method, seconds, tokens_per_s}], "ratios": [{scheme, page_size,
        vs_per_token, of_ceiling, list_vs_per_token, list_of_ceiling, array_of_numpy, of_call_floor,
        py_vs_per_token, py_of_ceiling}], "xxh3_vs_sglang": {page_size: x},
        "summary": {name: {value, target, ok}}}``.
    """
    n_tokens = n_tokens or (1 << 16 if quick else 1 << 20)
    rounds = rounds or (3 if quick else 5)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152064, n_tokens, dtype=np.int64)  # a 152K vocabulary (Qwen2-sized)
    tokens = ids.tolist()
    int64_array = array.array("q", ids.tobytes())
    data = ids.astype("<u4").tobytes()
    results: list[dict] = []
    ratios: list[dict] = []
    xxh3_vs_sglang: dict[int, float] = {}
    for page_size in page_sizes:
        fns: dict[str, dict[str, Callable[[], object]]] = {}
        for scheme in schemes:
            # Same keys from every chain method (checked once, outside the timing).
            expected = page_keys(ids, page_size, scheme=scheme)
            assert page_keys(tokens, page_size, scheme=scheme) == expected
            assert page_keys(int64_array, page_size, scheme=scheme) == expected
            assert page_keys(ids, page_size, scheme=PURE_PYTHON[scheme]) == expected
            assert per_token_reference(tokens[: 8 * page_size], page_size, NEW_HASH[scheme]) == expected[:8]
            fns[scheme] = {
                "kvstage": lambda scheme=scheme: page_keys(ids, page_size, scheme=scheme),
                "kvstage-list": lambda scheme=scheme: page_keys(tokens, page_size, scheme=scheme),
                "kvstage-array": lambda scheme=scheme: page_keys(int64_array, page_size, scheme=scheme),
                "kvstage-py": lambda scheme=scheme: page_keys(ids, page_size, scheme=PURE_PYTHON[scheme]),
                "per-token": lambda scheme=scheme: per_token_reference(tokens, page_size, NEW_HASH[scheme]),
                "ceiling": lambda scheme=scheme: ONE_CALL[scheme](data),
                "call-floor": lambda scheme=scheme: call_floor(scheme, n_tokens // page_size),
            }
        times = {scheme: {m: [] for m in METHODS} for scheme in schemes}
        for _ in range(rounds):
            for scheme in schemes:  # both schemes in every round: their ratio is per round too
                for method, fn in fns[scheme].items():
                    times[scheme][method].append(_timed(fn))
        for scheme in schemes:
            row = {}
            for method in METHODS:
                seconds = statistics.median(times[scheme][method])
                row[method] = n_tokens / seconds
                results.append(
                    dict(scheme=scheme, page_size=page_size, method=method, seconds=seconds, tokens_per_s=row[method])
                )

            def per_round(a: str, b: str, scheme: str = scheme) -> float:
                return statistics.median(tb / ta for ta, tb in zip(times[scheme][a], times[scheme][b]))

            ratio = dict(
                scheme=scheme,
                page_size=page_size,
                vs_per_token=per_round("kvstage", "per-token"),
                of_ceiling=per_round("kvstage", "ceiling"),
                list_vs_per_token=per_round("kvstage-list", "per-token"),
                list_of_ceiling=per_round("kvstage-list", "ceiling"),
                array_of_numpy=per_round("kvstage-array", "kvstage"),
                of_call_floor=per_round("kvstage-py", "call-floor"),
                py_vs_per_token=per_round("kvstage-py", "per-token"),
                py_of_ceiling=per_round("kvstage-py", "ceiling"),
            )
            ratios.append(ratio)
            log(
                f"{scheme:9s} page {page_size:3d}  "
                + "  ".join(f"{m} {row[m] / 1e6:7.2f}" for m in METHODS)
                + f"  Mtok/s | kvstage {ratio['vs_per_token']:5.1f}x per-token, {ratio['of_ceiling']:.2f} of ceiling"
                + f" | from list {ratio['list_vs_per_token']:5.1f}x, {ratio['list_of_ceiling']:.2f}"
                + f" | from array('q') {ratio['array_of_numpy']:.2f} of numpy"
                + f" | pure Python {ratio['py_vs_per_token']:5.1f}x, {ratio['py_of_ceiling']:.2f}, {ratio['of_call_floor']:.2f} of call floor"
            )
        if set(SCHEMES) <= set(schemes):
            pairs = zip(times["sglang-v1"]["kvstage"], times["xxh3-128"]["kvstage"])
            xxh3_vs_sglang[page_size] = statistics.median(sglang / xxh3 for sglang, xxh3 in pairs)
    if xxh3_vs_sglang:
        log("xxh3-128 / sglang-v1 (kvstage): " + "  ".join(f"page {p}: {x:.1f}x" for p, x in xxh3_vs_sglang.items()))
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "python": platform.python_version(),
        "chains": describe_chains(),
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
            summary[f"sglang-v1 page {TARGET_PAGE}: kvstage / per-token"] = dict(
                value=r["vs_per_token"], target=10.0, ok=r["vs_per_token"] >= 10.0
            )
            summary[f"sglang-v1 page {TARGET_PAGE}: kvstage / one-call ceiling"] = dict(
                value=r["of_ceiling"], target=0.5, ok=r["of_ceiling"] >= 0.5
            )
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
    print(
        f"{report['n_tokens']} tokens, median of {report['rounds']} rounds; Python {report['python']}, {report['openssl']}"
    )
    print(f"kvstage rows: {report['chains']}")
    if report["n_tokens"] < 1 << 20:
        print("(fewer than 1M tokens: per-call costs weigh more; the targets are judged on a full run)")
    for name, item in report["summary"].items():
        verdict = ("PASS" if item["ok"] else "MISS") if report["n_tokens"] >= 1 << 20 else "----"
        print(f"{verdict} {name}: {item['value']:.2f} (target {item['target']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
