"""Two sglang 0.5.23 servers in different OS processes share one store: this process's
``HybridCacheController`` writes a request through for the pool sets of sglang's Mamba
(kv+mamba), Swa (kv+swa), MambaSwa (kv+mamba+swa) and Dsa (kv+indexer) stack strategies; a
second process (``hybrid_prefetch_worker.py``) builds its own controller over fresh host pools
and prefetches every pool, and every byte arrives as written. Over a ``file:`` store (the
writers closed before the second process starts) and a real ``mooncake_master`` (loopback: run
under tools/in-netns.sh; the writers stay up, as Mooncake keeps pages in the segments its
clients mount). One second process per store serves all four strategies."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary, mooncake_available

from mooncake_master import LocalMooncakeMaster
from sglang_hybrid_rig import STRATEGIES, Rig, assert_same_pools
from sglang_rig import DSA_PAGE_SIZE, PAGE_SIZE, one_rank_gloo_world
from support import skip_missing

HERE = Path(__file__).resolve().parent
EXPECTED_HITS = {"mamba": {"mamba": 1}, "swa": {"swa": 3}, "mamba_swa": {"mamba": 1, "swa": 3}, "dsa": {}}


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


def pages_of(strategy: str) -> int:
    return 2 if strategy == "dsa" else 5


def page_size_of(strategy: str) -> int:
    return DSA_PAGE_SIZE if strategy == "dsa" else PAGE_SIZE


@pytest.fixture(scope="module", params=["file", "mooncake"])
def second_process(request, tmp_path_factory):
    """Write every strategy's request here, prefetch them all in one other process; yields
    (what each writer held, the second process's report, where it saved what it read)."""
    store = request.param
    tmp = tmp_path_factory.mktemp(f"second-{store}")
    with contextlib.ExitStack() as stack:
        if store == "mooncake":
            if not mooncake_available() or master_binary() is None:
                skip_missing(f"the Mooncake store; {INSTALL_HINT}")
            master = stack.enter_context(LocalMooncakeMaster(tmp / "master.log"))
            url = master.url(segment="16MiB", buffer="8MiB")
        else:
            url = f"file:{tmp / 'pages'}"
        held, jobs = {}, []
        for index, strategy in enumerate(STRATEGIES):
            start, extra_key = 11 + index, f"second-{strategy}"
            writer = Rig(strategy, url, seed=40 + index, timeout=60)
            try:
                tokens = array("q", range(start, start + pages_of(strategy) * writer.page_size))
                held[strategy] = writer.write_through(RadixKey(tokens, extra_key=extra_key))
            finally:
                if store == "file":  # nothing of the writer stays up: the files alone are read
                    writer.stop()
                else:
                    stack.callback(writer.stop)
            jobs.append(dict(strategy=strategy, url=url, start=start, pages=pages_of(strategy), extra_key=extra_key))
        paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        done = subprocess.run(
            [sys.executable, str(HERE / "hybrid_prefetch_worker.py"), json.dumps(jobs), str(tmp)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    yield held, json.loads(done.stdout.strip().splitlines()[-1]), tmp


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_second_process_controller_prefetches_every_pool_another_process_wrote(second_process, strategy):
    held, report, saved = second_process
    assert report[strategy]["tokens"] == pages_of(strategy) * page_size_of(strategy)
    assert report[strategy]["restorable"] == ([1, 2] if strategy == "dsa" else [pages_of(strategy)])
    assert report[strategy]["pool_hits"] == EXPECTED_HITS[strategy]
    got = torch.load(saved / f"{strategy}.pt")
    assert set(got) == {"kv", *EXPECTED_HITS[strategy], *(["indexer"] if strategy == "dsa" else [])}
    assert_same_pools(got, held[strategy])
