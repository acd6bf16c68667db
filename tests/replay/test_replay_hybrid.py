"""`kvstage replay --model` of hybrid shapes on the real trace: every entry of every component
verified byte for byte, the restorable-length counts against a count made from the trace's block
ids alone, and a corrupt or missing snapshot rounding a hit down (never a mismatch)."""

from __future__ import annotations

import argparse

import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.replay.command import add_parser, config_from_args, replay
from kvstage.replay.engine import ReplayConfig
from kvstage.replay.hybrid_engine import HybridReplayEngine
from kvstage.replay.models import resolve_model
from kvstage.replay.tokens import TokenSource
from kvstage.replay.trace import load_trace
from kvstage.replay.verify import verify_pages
from kvstage.storage import MemoryStore

from replay_helpers import page_identities
from support import REPO_ROOT

TRACE = REPO_ROOT.parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"
PAGE = 128  # the small presets' window (128) spans one page before a resume point
EVERY = 3  # pages between resume points: the shared first block (4 pages) rounds down to 3
REQUESTS = 4


def config(name: str, **overrides) -> ReplayConfig:
    settings = dict(model=resolve_model(name), page_size=PAGE, max_running=1, backend="torch", snapshot_every=EVERY)
    settings.update(overrides)
    return ReplayConfig(**settings)


def trace():
    if not TRACE.exists():
        pytest.skip(f"the shared trace {TRACE} is not here")
    return load_trace(TRACE, REQUESTS)


def expected_counts(requests, model: str) -> dict[str, int]:
    """Requests hit, hits rounded down, stored-prefix and restored tokens, one request at a time
    in trace order, from block ids alone: a page is held once an earlier request had it; a state
    snapshot is held at every ``EVERY``-th page an earlier request had; a one-page window is held
    before each of an earlier request's resume points (its ``EVERY``-th pages past what it
    loaded, and its prompt's end)."""
    held, window_held = set(), set()
    counts = dict(requests_hit=0, hits_rounded_down=0, tokens_stored_prefix=0, tokens_restored=0)
    for request in requests:
        pages = page_identities(request, PAGE)
        asked = pages[: (request.input_length - 1) // PAGE]
        stored = next((i for i, page in enumerate(asked) if page not in held), len(asked))
        if model == "small-linear":
            restored = stored // EVERY * EVERY
        else:
            restored = max((k for k in range(1, stored + 1) if pages[k - 1] in window_held), default=0)
        if stored:
            counts["requests_hit"] += 1
            counts["hits_rounded_down"] += restored < stored
            counts["tokens_stored_prefix"] += stored * PAGE
            counts["tokens_restored"] += restored * PAGE
        prompt_pages = request.input_length // PAGE
        ends = [k for k in range(EVERY, prompt_pages + 1, EVERY) if k > restored] + [prompt_pages]
        window_held.update(pages[k - 1] for k in ends if k >= 1)
        held.update(pages)
    return counts


@pytest.mark.parametrize("name", ["small-linear", "small-swa"])
def test_hybrid_replay_verifies_every_component_and_counts_restorable_lengths(name):
    requests = trace()
    report, engine = replay(config(name), requests, keep_engine=True)
    engine.close()
    assert (report["load_mismatches"], report["verify_mismatches"], report["lost_pages"]) == (0, 0, 0)
    assert report["verify_pages_checked"] == len(engine.expected_keys) > 0
    assert report["verify_rounded_loads"] == 0
    (component,) = [c for c in ("state", "swa") if c in report["verify_components"]]
    counts = report["verify_components"][component]
    stored, failed = report["entries_stored_failed"][component]
    assert failed == 0 and counts["checked"] == counts["matched"] == stored > 0
    assert counts["mismatched"] == counts["unreachable"] == counts.get("missing", 0) == 0
    expected = expected_counts(requests, name)
    assert {key: report[key] for key in expected} == expected
    assert expected["hits_rounded_down"] > 0 and expected["tokens_restored"] > 0


class HidingStore(MemoryStore):
    """A memory store whose chosen keys read as missing (``exists`` too) or fail their read only."""

    def __init__(self, fingerprint, hidden: set[str], exists: bool) -> None:
        super().__init__(fingerprint)
        self.hidden, self.show = hidden, exists

    def _hit(self, key: str) -> bool:
        return not any(key.endswith(h) for h in self.hidden)

    def _exists(self, full_keys):
        hits = super()._exists(full_keys)
        return [hit and (self.show or self._hit(k)) for k, hit in zip(full_keys, hits)]

    def _get(self, full_keys, into):
        return [hit and self._hit(k) for k, hit in zip(full_keys, super()._get(full_keys, into))]


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_a_missing_or_corrupt_snapshot_rounds_the_hit_down(kind):
    requests = trace()
    cfg = config("small-linear")
    first = requests[0]
    keys = PageHasher(cfg.hash_scheme, PAGE).prefill_keys(TokenSource(cfg.seed).prompt(first)[: EVERY * PAGE].tolist())
    hidden = {keys[EVERY - 1]}  # the snapshot at 3 pages: the only resume point of the shared first block
    layout = cfg.model.model_layout
    state_fp = layout.fingerprints(cfg.model.name, page_size=PAGE)["state"]

    def open_store(url, fingerprint):
        if fingerprint == state_fp:
            return HidingStore(fingerprint, hidden, exists=kind == "corrupt")
        return MemoryStore(fingerprint)

    engine = HybridReplayEngine(cfg, requests, open_store=open_store)
    try:
        engine.run()
        result = verify_pages(engine)
    finally:
        engine.close()
    assert engine.stats.load_mismatches == 0 and result.mismatches == 0 and result.lost == 0
    assert engine.hybrid.requests_hit == engine.hybrid.hits_rounded_down == REQUESTS - 1
    assert engine.hybrid.tokens_restored == 0  # rounded down to nothing, not loaded wrong
    state = result.components["state"]
    if kind == "missing":
        assert (state["missing"], state["unreachable"], result.rounded_loads) == (1, 0, 0)
    else:  # the lookup sees it, its read fails: each chain's verify load at 3 pages brings nothing
        assert (state["missing"], state["unreachable"], result.rounded_loads) == (0, 1, REQUESTS)
    assert state["mismatched"] == 0 and state["matched"] == state["checked"] > 0


@pytest.mark.parametrize("name,component", [("small-linear", "state"), ("small-swa", "swa")])
def test_verify_catches_wrong_component_bytes(name, component):
    requests = trace()[:2]
    report, engine = replay(config(name), requests, keep_engine=True)
    try:
        assert report["verify_mismatches"] == 0
        content = engine.state_content if component == "state" else engine.swa_content
        content.base[0] ^= 1  # what verify expects changes in one byte of every entry
        result = verify_pages(engine)
    finally:
        engine.close()
    counts = result.components[component]
    assert counts["mismatched"] == counts["checked"] > 0 and result.mismatches == counts["mismatched"]


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["replay", *argv])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "small-swa", "--snapshot-every", "0"], "^--snapshot-every: must be >= 1"),
        (["--model", "gpt-oss-like", "--layers", "2"], "^--layers: a hybrid preset"),
        (["--model", "qwen3-next-like", "--engines", "2"], "^--engines: a fleet replays plain models only"),
    ],
)
def test_bad_hybrid_options_are_refused(argv, message):
    with pytest.raises(InvalidArgumentError, match=message):
        config_from_args(parse(*argv))


def test_hybrid_presets_describe_their_layouts():
    gpt = resolve_model("gpt-oss-like")
    assert gpt.model_layout.component("swa").layers == tuple(range(0, 24, 2)) and gpt.num_layers == 12
    qwen = resolve_model("qwen3-next-like").model_layout
    assert qwen.component("state").layers == tuple(i for i in range(48) if i % 4 != 3)
    assert qwen.component("state").layer_bytes == 8192 * 4 * 2 + 32 * 128 * 128 * 4


def test_the_command_runs_a_hybrid_model_and_prints_its_restorable_lengths(tmp_path, capsys):
    from kvstage.cli import main

    trace()
    argv = ["replay", str(TRACE), "--requests", "3", "--page-size", str(PAGE), "--model", "small-linear"]
    argv += ["--snapshot-every", str(EVERY), "--max-running", "1", "--backend", "torch", "--no-progress"]
    argv += ["--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "restorable: tokens" in out and "verify: state entries" in out
    report = __import__("json").loads((tmp_path / "r.json").read_text())
    assert (report["tokens_restored"], report["tokens_stored_prefix"]) == (2 * EVERY * PAGE, 2 * 4 * PAGE)
    assert report["snapshot_every_pages"] == EVERY and report["verify_components"]["state"]["mismatched"] == 0


def test_a_sliding_window_model_sizes_its_pools_by_both_kv_components():
    assert resolve_model("gpt-oss-like").token_bytes == 24 * 2 * 8 * 64 * 2  # 12 full + 12 sliding layers
    assert resolve_model("qwen3-next-like").token_bytes == 12 * 2 * 2 * 256 * 2  # the full layers only
