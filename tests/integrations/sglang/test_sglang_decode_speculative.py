"""KVStageDecodeOffloadManager with speculative decoding, in sglang 0.5.23's classes on CPU: an MTP
draft layer packed into the prefill side's host pages (the drop-in stores target + draft layers,
in the prefill side's key space), and an EAGLE tree's bigram keys (the drop-in continues the
prefill side's bigram chain); the next turn's prefetch finds every whole page, byte for byte."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from kvstage.integrations.sglang.draft_layers import packed_drafts_of, record_packed_drafts

from decode_rig import DecodeSide, controller_over, put_kv_in_host, released, run_until_released, settings_installed
from sglang_rig import PAGE_SIZE, canonical_of, prefetch, token_slots, write_through


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'gloo'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class SpecWorker:
    """The parts of sglang's speculative worker its draft plan reads: the target runner (its
    algorithm and KV pool) and the draft runners (their KV pools and NextN layer counts);
    ``_draft_model_runners`` is sglang's own."""

    _draft_model_runners = BaseSpecWorker._draft_model_runners

    def __init__(self, algorithm: str, target_pool, draft_pools, nextn_layers: int) -> None:
        spec = SpeculativeAlgorithm.from_string(algorithm)
        self.target_worker = SimpleNamespace(
            model_runner=SimpleNamespace(spec_algorithm=spec, token_to_kv_pool=target_pool)
        )
        runners = [
            SimpleNamespace(token_to_kv_pool=pool, model_config=SimpleNamespace(num_nextn_predict_layers=nextn_layers))
            for pool in draft_pools
        ]
        self.draft_worker = SimpleNamespace(draft_runners=runners)


def draft_plan_hook(algorithm: str, nextn_layers: int):
    """What sglang runs before it builds the offload manager: the speculative worker's draft plan
    (with kvstage's plugin hook after it)."""
    return lambda side: record_packed_drafts(None, SpecWorker(algorithm, side.device, side.drafts, nextn_layers))


def run_a_turn(side: DecodeSide, url: str, layout: str, prompt: list[int], outputs: int, *, bigram: bool = False):
    """The prefill side stores the prompt's whole pages (sglang's controller, bigram keys for an
    EAGLE tree), the decode side runs ``outputs`` steps and finishes; returns the KV the decode
    side held (every buffer, the positions with KV) and the conversation's tokens."""
    req = side.admit("turn-1", prompt, max_tokens=outputs, extra_key="lora-7")
    first_token = 1000
    prefill, prefill_host = controller_over(side, url, layout)
    whole = len(prompt) // PAGE_SIZE * PAGE_SIZE
    slots = prefill_host.alloc(whole)
    put_kv_in_host(prefill_host, side.kv_of(req, whole), slots)
    # an EAGLE tree keys the prompt's bigrams with the first output token as the last one's pair
    prefill_tokens = prompt[:whole] + ([first_token] if bigram and whole == len(prompt) else prompt[whole : whole + 1])
    key = RadixKey(array("q", prefill_tokens if bigram else prompt[:whole]), extra_key="lora-7", is_bigram=bigram)
    write_through(prefill, prefill_host, key, slots)
    prefill.detach_storage_backend()
    for step in range(outputs):
        side.decode_step(req, first_token + step)
        if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
            side.manager.check_offload_progress()
    kv_length = len(prompt) + outputs - 1
    expected = side.kv_of(req, kv_length)
    run_until_released(side, [req])
    assert released(req)
    side.manager.release_host_resources()
    return expected, prompt + [first_token + i for i in range(outputs)], kv_length


def assert_next_turn_finds_every_page(side, url, layout, expected, tokens, kv_length, *, bigram=False):
    reader, reader_host = controller_over(side, url, layout)
    conversation = RadixKey(array("q", tokens + [7, 7, 7]), extra_key="lora-7", is_bigram=bigram)
    hit, host_indices = prefetch(reader, conversation)
    whole = kv_length // PAGE_SIZE * PAGE_SIZE
    assert hit == whole, f"the next turn found {hit // PAGE_SIZE} of {whole // PAGE_SIZE} pages"
    got = token_slots(reader_host, canonical_of(reader_host), host_indices)
    layers = reader_host.layer_num
    mla = hasattr(reader_host, "kv_cache_dim")
    assert len(expected) == (layers if mla else 2 * layers)
    for i, rows in enumerate(expected):
        want = rows[:whole].reshape(whole, -1) if mla else rows[:whole]
        assert torch.equal(
            (got[i] if mla else got[i // layers, i % layers]).view(torch.uint8), want.view(torch.uint8)
        ), i
    reader.detach_storage_backend()


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "page_first_direct")])
def test_an_mtp_draft_layer_packed_into_the_prefill_pages_is_stored_with_the_target_layers(
    tmp_path, one_rank, kind, layout
):
    url = f"file:{tmp_path / 'store'}"
    with settings_installed(url):
        side = DecodeSide(kind, one_rank, draft_layers=1, before_manager=draft_plan_hook("EAGLE", 1))
        assert packed_drafts_of(side.device) == tuple(side.drafts)
        expected, tokens, kv_length = run_a_turn(side, url, layout, list(range(300, 310)), outputs=11)
        assert side.manager.manager.metrics.pages_stored == kv_length // PAGE_SIZE - 2
        assert_next_turn_finds_every_page(side, url, layout, expected, tokens, kv_length)


def test_an_eagle3_draft_model_is_not_packed_so_the_drop_in_stores_the_target_layers_only(one_rank):
    with settings_installed("memory"):
        side = DecodeSide("mha", one_rank, draft_layers=1, before_manager=draft_plan_hook("EAGLE3", 0))
        assert packed_drafts_of(side.device) == ()
        assert side.manager.manager.kv_pool.num_layers == 3
        side.manager.release_host_resources()


def test_an_mtp_draft_of_another_pool_kind_is_refused_naming_it(one_rank):
    from kvstage.errors import InvalidArgumentError
    from kvstage.integrations.sglang.draft_layers import remember_packed_drafts

    from sglang_rig import mla_device_pool

    def pack_an_mla_draft(side):
        side.drafts = [mla_device_pool(size=256, layer_num=1)]
        remember_packed_drafts(side.device, tuple(side.drafts))

    with (
        settings_installed("memory"),
        pytest.raises(InvalidArgumentError, match="packed draft pools: must be of the target pool's kind"),
    ):
        DecodeSide("mha", one_rank, before_manager=pack_an_mla_draft)


@pytest.mark.parametrize("prompt_length", [10, 8])  # a partial last prompt page, and a whole one
def test_eagle_bigram_decode_pages_continue_the_prefill_sides_bigram_chain(tmp_path, one_rank, prompt_length):
    url = f"file:{tmp_path / 'store'}"
    with settings_installed(url, speculative_algorithm="EAGLE"):
        side = DecodeSide("mha", one_rank)
        assert side.manager.bigram_keys
        prompt = list(range(300, 300 + prompt_length))
        expected, tokens, kv_length = run_a_turn(side, url, "page_first", prompt, outputs=11, bigram=True)
        assert side.manager.manager.metrics.pages_stored == kv_length // PAGE_SIZE - prompt_length // PAGE_SIZE
        assert_next_turn_finds_every_page(side, url, "page_first", expected, tokens, kv_length, bigram=True)


def test_eagle_with_a_packed_mtp_draft_layer_stores_bigram_pages_of_every_layer(tmp_path, one_rank):
    url = f"file:{tmp_path / 'store'}"
    with settings_installed(url, speculative_algorithm="NEXTN"):  # sglang runs NEXTN as EAGLE
        side = DecodeSide("mha", one_rank, draft_layers=1, before_manager=draft_plan_hook("EAGLE", 1))
        assert side.manager.bigram_keys and side.manager.manager.kv_pool.num_layers == 4
        expected, tokens, kv_length = run_a_turn(
            side, url, "page_first", list(range(300, 310)), outputs=11, bigram=True
        )
        assert_next_turn_finds_every_page(side, url, "page_first", expected, tokens, kv_length, bigram=True)


def test_eagle_with_kv_events_is_refused_before_a_store_opens(one_rank, monkeypatch):
    from kvstage.errors import InvalidArgumentError

    from sglang_rig import watch_opened_stores

    opened, _ = watch_opened_stores(monkeypatch)
    extra = {"kv_events_endpoint": "tcp://127.0.0.1:5999"}
    with settings_installed("memory", speculative_algorithm="EAGLE", extra=extra):
        with pytest.raises(InvalidArgumentError, match="kv_events_endpoint: KV events of EAGLE bigram pages"):
            DecodeSide("mha", one_rank)
    assert opened == []


PLUGIN_CHECK = """
from sglang_cpu import import_sglang
assert import_sglang() is None
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
load_plugins()  # what run_scheduler_process does first
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from kvstage.integrations.sglang.draft_layers import packed_drafts_of
from sglang_rig import mha_device_pool
target, draft = mha_device_pool(), mha_device_pool(layer_num=1)
class Worker(BaseSpecWorker):  # sglang's worker, its two workers set here instead of built
    target_worker = draft_worker = None
worker = Worker.__new__(Worker)
worker.target_worker = SimpleNamespace(model_runner=SimpleNamespace(
    spec_algorithm=SpeculativeAlgorithm.EAGLE, token_to_kv_pool=target))
worker.draft_worker = SimpleNamespace(draft_runners=[
    SimpleNamespace(token_to_kv_pool=draft, model_config=SimpleNamespace(num_nextn_predict_layers=1))])
worker.init_hicache_draft_plan()  # sglang's own, then kvstage's hook after it
print(len(packed_drafts_of(target)), packed_drafts_of(target)[:1] == (draft,))
"""


@pytest.mark.parametrize("enabled,expected", [("1", "1 True"), ("", "0 False")])
def test_the_plugin_hooks_sglangs_draft_plan_so_the_drop_in_learns_the_packed_drafts(enabled, expected):
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
        "KVSTAGE_SGLANG_DECODE_OFFLOAD": enabled,
    }
    result = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == expected
