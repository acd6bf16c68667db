"""The replay's load path: a request loads the whole pages an earlier request stored, the loaded
bytes are checked, and verification through prefetch and load catches wrong, missing and
unreadable pages."""

from __future__ import annotations

import json

import pytest

import kvstage.storage
from kvstage.cli import main
from kvstage.replay.kv_content import KVContent
from kvstage.replay.models import resolve_model
from kvstage.replay.trace import TraceRequest
from kvstage.replay.verify import chains_to_verify, verify_pages
from kvstage.storage.memory_store import MemoryStore

from replay_helpers import (
    PAGE_BYTES,
    TINY,
    distinct_pages,
    expected_page_count,
    run_in_process,
    serial_hits,
    tiny_trace,
)

# Request 1 repeats request 0's blocks: request 0's 700 prompt tokens are 43 whole pages of 16
# (its page 43 holds output tokens), so request 1 (900 tokens, 56 pages looked up) shares 43.
SHARING = [TraceRequest(0, 0.0, 700, 20, (0, 1)), TraceRequest(1, 1.0, 900, 9, (0, 1))]


def test_a_request_sharing_a_prefix_loads_the_shared_whole_pages(device):
    # One at a time: request 0's pages are stored before request 1 looks its prompt up.
    report, engine = run_in_process(SHARING, max_running=1, device=device.type)
    engine.close()
    assert report["pages_looked_up"] == 43 + 56 and report["tokens_looked_up"] == 99 * 16
    assert report["pages_hit"] == report["pages_loaded"] == 43
    assert report["page_hit_rate"] == pytest.approx(43 / 99)
    assert report["tokens_hit"] == report["prefill_tokens_saved"] == 43 * 16
    assert report["prompt_token_hit_rate"] == pytest.approx(43 * 16 / 1600)
    assert report["bytes_loaded"] == 43 * PAGE_BYTES
    assert report["h2d_gbps"] > 0 and report["load_seconds"] > 0
    assert report["load_mismatches"] == report["prefetch_failures"] == report["load_failures"] == 0
    # The manager stores only what follows the loaded pages: 44 of request 0, 56 - 43 of request 1.
    assert report["pages_launched"] == report["pages_stored"] == 44 + 13
    assert report["pages_deduplicated"] == 0
    # Request 0's chain is not a prefix of request 1's (its page 43 differs): two verify loads.
    assert report["verify_requests"] == 2 and report["verify_pages_checked"] == 57
    assert report["verify_bytes_loaded"] == (44 + 56) * PAGE_BYTES
    assert report["verify_mismatches"] == report["lost_pages"] == report["verify_pages_unreachable"] == 0


@pytest.mark.parametrize(
    "model, stride",
    [(TINY, None), (resolve_model("deepseek-v3", layers=2, head_dim=32), 64)],
    ids=["mha", "mla-stride-64"],
)
def test_one_at_a_time_every_page_stored_before_is_hit(model, stride):
    requests = tiny_trace()
    report, engine = run_in_process(requests, model=model, stride=stride, max_running=1)
    engine.close()
    hits, looked_up = serial_hits(requests, 16)
    assert (report["pages_hit"], report["pages_looked_up"]) == (hits, looked_up) == (43 + 18 + 32 + 32, 226)
    assert report["pages_loaded"] == hits and report["bytes_loaded"] == hits * model.page_bytes(16)
    assert report["pages_loaded"] + report["pages_launched"] == expected_page_count(requests, 16)
    assert report["pages_stored"] == report["pages_launched"] == distinct_pages(requests, 16)
    assert report["load_mismatches"] == report["verify_mismatches"] == report["lost_pages"] == 0


class CorruptFirstPageStore(MemoryStore):
    """A memory store that flips one byte of the first page it stores (bytes corrupted at rest)."""

    corrupted_key: str | None = None

    def _put(self, full_keys, pages, full_prior_key=None):
        statuses = super()._put(full_keys, pages, full_prior_key)
        if self.corrupted_key is None and full_keys:
            self.corrupted_key = full_keys[0]
            self._pages.value(full_keys[0])[7] ^= 0x01
        return statuses


def test_a_page_corrupted_in_the_store_is_a_load_mismatch(monkeypatch, tmp_path, capsys):
    opened = []

    def open_corrupting(url, fingerprint):
        opened.append(CorruptFirstPageStore(fingerprint, capacity_pages=1000))
        return opened[-1]

    monkeypatch.setattr(kvstage.storage, "open_storage", open_corrupting)
    trace = tmp_path / "sharing.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in SHARING
        )
    )
    argv = [
        "replay",
        str(trace),
        "--page-size",
        "16",
        "--layers",
        "1",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--dtype",
        "float16",
        "--max-running",
        "1",
        "--backend",
        "torch",
        "--no-progress",
        "--json",
        str(tmp_path / "out.json"),
    ]
    assert main(argv) == 1
    report = json.loads((tmp_path / "out.json").read_text())
    # Request 0's first page, corrupted at rest, is one of the 43 request 1 loads; verify loads it again.
    assert report["pages_loaded"] == 43 and report["load_mismatches"] == 1
    assert report["verify_mismatches"] == 1 and report["lost_pages"] == 0
    assert "1 pages loaded during the run mismatched; verify found 1 mismatched" in capsys.readouterr().err


def test_a_load_that_writes_nothing_is_caught(monkeypatch):
    # One at a time, request 1 gets request 0's device pages back, which still hold the shared
    # prefix's KV: only the poison written before the load shows that the load wrote nothing.
    from kvstage.offload import OffloadManager

    load = OffloadManager.load

    def load_without_copying(self, handle, slot_indices, **kwargs):
        return load(self, handle, slot_indices[:0], **kwargs)

    monkeypatch.setattr(OffloadManager, "load", load_without_copying)
    report, engine = run_in_process(SHARING, max_running=1)
    engine.close()
    assert report["pages_hit"] == 43 and report["pages_loaded"] == 0
    assert report["load_mismatches"] == 43


def test_verify_catches_wrong_bytes_and_pages_missing_from_the_store():
    report, engine = run_in_process(SHARING, max_running=1)
    try:
        assert report["verify_pages_checked"] == 57 and report["lost_pages"] == 0
        storage, keys = engine.storage, engine.request_keys
        # Verify loads through the same manager; the run's figures are a snapshot before it.
        assert engine.manager.metrics.pages_loaded == 43 + 44 + 56 and report["pages_loaded"] == 43
        # Every page wrong: verify with another KV content.
        right = engine.content
        engine.content = KVContent(TINY, 16, seed=99, device=engine.device)
        wrong = verify_pages(engine)
        engine.content = right
        assert (wrong.pages_checked, wrong.mismatches, wrong.pages_matched) == (57, 57, 0)
        # One byte of one page at rest: one mismatch, though two chains load it.
        # A page damaged at rest: no public call changes a stored page's bytes.
        storage._pages.value(keys[0][3])[0] ^= 0x10
        flipped = verify_pages(engine)
        assert (flipped.mismatches, flipped.pages_matched, flipped.lost) == (1, 56, 0)
        storage._pages.value(keys[0][3])[0] ^= 0x10
        # Page 40 of the shared prefix gone: it is lost; what both chains hold after it is unreachable:
        # pages 41-42 (shared), request 0's page 43, request 1's pages 43-55.
        # Removed behind the store's back (no eviction event): no public call does that.
        storage._pages.remove(keys[0][40])
        holed = verify_pages(engine)
        assert (holed.pages_matched, holed.missing, holed.lost, holed.unreachable) == (40, 1, 1, 2 + 1 + 13)
        assert holed.pages_checked == 57 and holed.verify_requests == 2
        assert holed.pages_loaded == 2 * 40 and holed.bytes_loaded == 80 * PAGE_BYTES
    finally:
        engine.close()


def test_an_unreadable_page_is_missing_not_unreachable(tmp_path):
    # A file store reads a corrupted file as a miss (checksum): the page exists but no load gets it.
    report, engine = run_in_process(SHARING, max_running=1, storage=f"file:{tmp_path}")
    try:
        assert report["lost_pages"] == 0
        path = engine.storage.path_of(engine.request_keys[0][5])
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        result = verify_pages(engine)
        # Pages 0-4 load; page 5 is missing (lost); 6-42 shared, request 0's 43 and request 1's 43-55 unreachable.
        assert (result.pages_matched, result.missing, result.lost, result.unreachable) == (5, 1, 1, 37 + 1 + 13)
    finally:
        engine.close()


def test_a_verify_sample_loads_the_chains_of_the_sampled_pages_only():
    report, engine = run_in_process(tiny_trace(), max_running=1)
    try:
        full = verify_pages(engine)
        sample = verify_pages(engine, sample=3, seed=1)
        assert full.pages_checked == report["verify_pages_checked"] == distinct_pages(tiny_trace(), 16) == 110
        assert sample.sampled and 1 <= sample.verify_requests <= 3
        # Each sampled page is checked with the pages before it in its chain, no more.
        assert 3 <= sample.pages_checked <= sample.pages_loaded and sample.pages_checked < full.pages_checked
        assert sample.mismatches == sample.lost == 0
    finally:
        engine.close()


def test_chains_to_verify_covers_the_targets_with_the_fewest_prefixes():
    keys = [["a", "b", "c"], ["a", "b", "c", "d"], ["a", "x"], ["a", "b"]]
    everything = sorted({key for chain in keys for key in chain})
    # Request 0's chain is a prefix of request 1's, request 3's of request 0's: left out.
    assert chains_to_verify(keys, everything) == {1: 4, 2: 2}
    assert chains_to_verify(keys, ["b"]) == {0: 2}
    assert chains_to_verify(keys, ["x", "c"]) == {0: 3, 2: 2}
    assert chains_to_verify(keys, []) == {}
