"""A second sglang server process for ``test_sglang_hybrid_second_process.py`` (run as a script:
``python hybrid_prefetch_worker.py JOBS_JSON OUT_DIR``; not a test module). For each job
(``strategy``, ``url``, ``start``, ``pages``, ``extra_key``) it builds its own sglang 0.5.23
``HybridCacheController`` over fresh host pools of that stack strategy with KVStageStorage on
``url``, prefetches the request, and saves what every pool holds in the slots read
(``OUT_DIR/<strategy>.pt``); it prints one JSON line: per strategy, the hit query's restorable
pages, the tokens prefetched and sglang's per-pool hit counts."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main(jobs_json: str, out_dir: str) -> None:
    from sglang_cpu import import_sglang

    missing = import_sglang()  # before anything of sglang: its CPU import (see conftest.py)
    assert missing is None, missing
    from array import array

    import torch
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_hybrid_rig import Rig
    from sglang_rig import one_rank_gloo_world

    report = {}
    with tempfile.TemporaryDirectory() as gloo, one_rank_gloo_world(Path(gloo)):
        for job in json.loads(jobs_json):
            rig = Rig(job["strategy"], job["url"], timeout=60)
            try:
                tokens = array("q", range(job["start"], job["start"] + job["pages"] * rig.page_size))
                restorable, completed, got = rig.prefetch(RadixKey(tokens, extra_key=job["extra_key"]))
                torch.save(got, Path(out_dir) / f"{job['strategy']}.pt")
                hits = {name: count for name, count in rig.pool_hits.items() if count}
                report[job["strategy"]] = {"restorable": restorable, "tokens": completed, "pool_hits": hits}
            finally:
                rig.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
