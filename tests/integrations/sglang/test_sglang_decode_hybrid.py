"""KVStageDecodeOffloadManager over a hybrid device pool (DeepSeek V3.2's ``DSATokenToKVPool``,
the sliding-window ``SWAKVPool`` of gpt-oss / Gemma 3): the prefill side (sglang's
HybridCacheController with KVStageStorage) stores a prompt, the decode drop-in continues it with
every component (the MLA latent and the indexer's keys; the full and the window layers, while
sglang frees the window slots behind the sequence) in the same key spaces, and a fresh
HybridCacheController prefetches the whole conversation, each component byte for byte. Pool
kinds not stored yet are refused naming their class."""

from __future__ import annotations

from array import array

import pytest
import torch
import torch.distributed as dist
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.errors import InvalidArgumentError

from decode_rig import DecodeSide, put_kv_in_host, released, run_until_released, settings_installed
from sglang_hybrid_rig import WINDOW, Rig
from sglang_rig import DSA_PAGE_SIZE, LAYERS, PAGE_SIZE, watch_opened_stores

TIMEOUT = 30


@pytest.fixture
def one_rank(tmp_path):
    init = tmp_path / "gloo"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _split(side: DecodeSide, rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A DSA decode side's per-buffer rows (``DecodeSide.buffers``): (latents, index rows) per layer."""
    layers = side.device.layer_num
    return rows[:layers], rows[layers:]


def _index_pages(index_rows: list[torch.Tensor], page_size: int) -> torch.Tensor:
    """Per-layer index rows ``[tokens, bytes]`` as the indexer host pool's ``[page, layer, bytes]``."""
    return torch.stack([rows.reshape(-1, page_size * rows.shape[1]) for rows in index_rows], dim=1)


def _write_prompt(rig: Rig, side: DecodeSide, rows: list[torch.Tensor], key: RadixKey) -> None:
    """The prefill side's write-through of ``key``'s whole pages: latents and index pages into
    the host pools, then the KV pages and the indexer's (``indices_from_pool=KV``) stored."""
    latents, index_rows = _split(side, rows)
    slots = rig.kv.alloc(len(key.token_ids))
    put_kv_in_host(rig.kv, latents, slots)
    pages = (slots[:: rig.page_size] // rig.page_size).tolist()
    for position, page in enumerate(pages):
        for layer, layer_rows in enumerate(index_rows):
            chunk = layer_rows[position * rig.page_size : (position + 1) * rig.page_size]
            rig.indexer.index_k_with_scale_buffer[page, layer, 0] = chunk.reshape(-1)
    extra = [PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV)]
    rig.cc.write_storage(slots, key.token_ids, hash_value=rig.hashes(key), prefix_keys=[], extra_pools=extra)
    assert rig.cc.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens == len(key.token_ids)


def test_dsa_decode_pages_continue_the_prefill_side_and_the_next_turn_prefetches_every_component(tmp_path, one_rank):
    url = f"file:{tmp_path / 'store'}"
    page = DSA_PAGE_SIZE
    with settings_installed(url, page_size=page):
        side = DecodeSide("dsa", one_rank)
        prompt = list(range(300, 300 + page + 6))  # one whole page from the prefill side, 6 tokens more
        outputs = [1000 + i for i in range(page - 3)]
        req = side.admit("turn-1", prompt, max_tokens=len(outputs))

        writer = Rig("dsa", url)
        prefill = writer.cc.storage_backend
        prefill.on_host_pools_registered()  # sglang's controller does it once its pools are registered
        # the drop-in's key spaces are the prefill side's, component by component
        assert {n: s.fingerprint for n, s in side.manager.stores.items()} == {
            n: s.fingerprint for n, s in prefill.hybrid.stores.items()
        }
        assert set(side.manager.stores) == {"kv", "indexer"}
        _write_prompt(writer, side, side.kv_of(req, page), RadixKey(array("q", prompt[:page])))
        writer.stop()

        kv_length = len(prompt) + len(outputs) - 1  # the last sampled token has no KV
        whole = kv_length // page * page
        assert whole == 2 * page
        for token in outputs:
            side.decode_step(req, token)
            if len(req.output_ids) == len(outputs):  # read before the progress check may release it
                expected = side.kv_of(req, whole)
            side.manager.check_offload_progress()
        run_until_released(side, [req])
        assert released(req)
        side.manager.release_host_resources()  # waits for the store writes still pending
        metrics = side.manager.manager.metrics
        assert metrics.pages_stored == 1  # the decode page; the prompt page was the prefill side's

        reader = Rig("dsa", url)
        conversation = RadixKey(array("q", prompt + outputs[:-1] + [7, 7]))
        hashes = reader.hashes(conversation)
        reader_stores = reader.cc.storage_backend._stores_v2().stores
        assert len(hashes) == 3  # sglang keys the partial last page too; it was never stored
        assert reader_stores["kv"].exists(hashes) == [True, True, False]
        assert reader_stores["indexer"].exists(hashes) == [True, True, False]
        restorable, completed, got = reader.prefetch(conversation)
        reader.stop()
        assert restorable == [1, 2] and completed == whole
        latents, index_rows = _split(side, expected)
        for layer, rows in enumerate(latents):
            assert torch.equal(got["kv"][layer].view(torch.uint8), rows.reshape(whole, -1).view(torch.uint8)), layer
        assert torch.equal(got["indexer"], _index_pages(index_rows, page))


def _canonical(rows: list[torch.Tensor]) -> torch.Tensor:
    """MHA rows per buffer (K layers then V layers, ``[tokens, heads, dim]``) in a host pool's
    canonical order ``[2, layers, tokens, heads, dim]``."""
    return torch.stack(rows).unflatten(0, (2, len(rows) // 2))


def _write_swa_prompt(rig: Rig, rows: list[torch.Tensor], key: RadixKey) -> None:
    """The prefill side's write-through of ``key``'s whole pages: full and window layers into
    their host pools, the KV pages and every window page (``TRAILING_PAGES``) stored."""
    full, window = rows[: 2 * LAYERS], rows[2 * LAYERS :]
    tokens = len(key.token_ids)
    slots, swa_slots = rig.kv.alloc(tokens), rig.swa.alloc(tokens)
    put_kv_in_host(rig.kv, full, slots)
    put_kv_in_host(rig.swa, window, swa_slots)
    hashes = rig.hashes(key)
    extra = [PoolTransfer(PoolName.SWA, swa_slots, keys=hashes, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    rig.cc.write_storage(slots, key.token_ids, hash_value=hashes, prefix_keys=[], extra_pools=extra)
    assert rig.cc.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens == tokens


@pytest.mark.parametrize(
    ("stride_pages", "window_held", "restorable_pages"),
    [
        (1, [True] * 7, [1, 2, 3, 4, 5, 6, 7]),  # each page's window stored as it ends
        # a 3-page stride stores kvstage's ceil((W-1)/P) = 2 window pages before its end (4, 5),
        # then the finish page 6. sglang's reader asks ceil(W/P) = 3 trailing pages, so the run
        # end at 6 pages (window 3..5) is lost to it, one page short; 7 (4..6) is not
        (3, [True, True, True, False, True, True, True], [1, 2, 3, 7]),
    ],
)
def test_swa_decode_pages_continue_the_prefill_side_while_sglang_frees_the_window(
    tmp_path, one_rank, stride_pages, window_held, restorable_pages
):
    """gpt-oss / Gemma 3's SWAKVPool: sglang frees (and here refills) window slots behind the
    sequence each step; each stride's window entries are stored before that, so the next turn
    restores where those windows are held and prefetches both components byte for byte."""
    url = f"file:{tmp_path / 'store'}"
    page = PAGE_SIZE
    with settings_installed(url, stride=stride_pages * page, extra={"sliding_window": WINDOW}):
        side = DecodeSide("swa", one_rank, window=WINDOW)
        prompt = list(range(300, 300 + 3 * page + 2))  # three whole pages from the prefill side, 2 tokens more
        outputs = [1000 + i for i in range(4 * page)]
        req = side.admit("turn-1", prompt, max_tokens=len(outputs))

        writer = Rig("swa", url)
        prefill = writer.cc.storage_backend
        prefill.on_host_pools_registered()
        assert {n: s.fingerprint for n, s in side.manager.stores.items()} == {
            n: s.fingerprint for n, s in prefill.hybrid.stores.items()
        }
        assert set(side.manager.stores) == {"kv", "swa"}
        _write_swa_prompt(writer, side.kv_of(req, 3 * page), RadixKey(array("q", prompt[: 3 * page])))
        writer.stop()

        for token in outputs:
            side.decode_step(req, token)
            side.manager.check_offload_progress()
        kv_length = len(prompt) + len(outputs) - 1  # the last sampled token has no KV
        whole = kv_length // page * page
        assert whole == 7 * page
        assert side.freed_window_slots >= 3 * page  # sglang freed (and we refilled) the window's tail
        expected = side.written_kv(req, whole)
        run_until_released(side, [req])
        assert released(req)
        side.manager.release_host_resources()  # waits for the store writes still pending
        metrics = side.manager.manager.metrics
        assert metrics.pages_stored == 4  # the decode pages; the prompt's were the prefill side's

        reader = Rig("swa", url)
        conversation = RadixKey(array("q", prompt + outputs[:-1] + [7, 7]))
        hashes = reader.hashes(conversation)
        reader_stores = reader.cc.storage_backend._stores_v2().stores
        assert len(hashes) == 8  # the partial last page keyed too; never stored
        assert reader_stores["kv"].exists(hashes) == [True] * 7 + [False]
        assert reader_stores["swa"].exists(hashes) == window_held + [False]
        restorable, completed, got = reader.prefetch(conversation)
        reader.stop()
        assert restorable == restorable_pages and completed == whole
        full, window = expected[: 2 * LAYERS], expected[2 * LAYERS :]
        assert torch.equal(got["kv"].view(torch.uint8), _canonical(full).view(torch.uint8))
        read = got["swa"].shape[2]  # sglang reads the window's trailing pages
        assert read == 3 * page
        assert torch.equal(got["swa"].view(torch.uint8), _canonical(window)[:, :, whole - read :].view(torch.uint8))


def test_an_swa_pool_without_the_window_is_refused_before_any_store_opens(one_rank, monkeypatch):
    opened, _ = watch_opened_stores(monkeypatch)
    with settings_installed("memory"):
        with pytest.raises(InvalidArgumentError, match=r"extra_config.sliding_window: required with an SWA device"):
            DecodeSide("swa", one_rank)
    assert opened == []


def test_a_pool_kind_not_stored_yet_is_refused_at_start_naming_its_class(one_rank, monkeypatch):
    """A hybrid linear-attention model's device pool (HybridLinearKVPool: full-attention layers
    beside a Mamba state pool) is refused before any store opens."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    import decode_rig

    def mamba_hybrid_pool(size: int = 256):
        return HybridLinearKVPool(
            size=size,
            dtype=torch.bfloat16,
            page_size=PAGE_SIZE,
            head_num=2,
            head_dim=8,
            full_attention_layer_ids=[0, 2],
            device="cpu",
            mamba_pool=None,  # never read before the refusal
        )

    opened, _ = watch_opened_stores(monkeypatch)
    monkeypatch.setattr(decode_rig, "mha_device_pool", mamba_hybrid_pool)
    with settings_installed("memory"):
        with pytest.raises(
            InvalidArgumentError,
            match=r"token_to_kv_pool_allocator: a Mamba \(hybrid linear attention\) device pool \(HybridLinearKVPool\)",
        ):
            DecodeSide("mha", one_rank)
    assert opened == []


def test_a_dsa_pool_with_eagle_bigram_keys_is_refused_before_any_store_opens(one_rank, monkeypatch):
    """DeepSeek V3.2 with MTP (EAGLE bigram keys) is not stored by the decode drop-in yet."""
    opened, _ = watch_opened_stores(monkeypatch)
    with settings_installed("memory", page_size=DSA_PAGE_SIZE, speculative_algorithm="EAGLE"):
        with pytest.raises(InvalidArgumentError, match=r"token_to_kv_pool_allocator: a DSA pool with EAGLE bigram"):
            DecodeSide("dsa", one_rank)
    assert opened == []


def test_swa_pages_launched_after_sglang_freed_their_window_slots_are_never_restorable_with_foreign_bytes(
    tmp_path, one_rank
):
    """One host page, and no progress check for 8 decode pages: the pages after the first wait,
    and by the finish sglang has freed (and here another request refilled) the window slots of
    pages 0 .. 7. The drop-in gathers no window page older than the W - 1 tokens before the
    length (window_kept), so every length the next turn finds restorable reads the request's
    own window bytes (before: pages 4 .. 7 were gathered from the refilled slots)."""
    url = f"file:{tmp_path / 'store'}"
    page = PAGE_SIZE
    settings = dict(extra={"sliding_window": WINDOW}, hicache_ratio=0.02)  # 256 slots * 0.02 // 4: one host page
    with settings_installed(url, **settings):
        side = DecodeSide("swa", one_rank, window=WINDOW)
        assert side.manager.manager.host_pool.capacity == 1
        prompt = list(range(300, 300 + 3 * page + 2))
        outputs = [1000 + i for i in range(8 * page)]
        req = side.admit("turn-1", prompt, max_tokens=len(outputs))
        writer = Rig("swa", url)
        writer.cc.storage_backend.on_host_pools_registered()
        _write_swa_prompt(writer, side.kv_of(req, 3 * page), RadixKey(array("q", prompt[: 3 * page])))
        writer.stop()

        copies = side.manager.manager.copier.copy_stream
        for token in outputs:  # the store is slow: no check_offload_progress while it decodes
            side.decode_step(req, token)
            # window_kept's other half: a copy launched at a call has run before sglang frees its
            # slots (a gather of microseconds, the eviction steps later; here a thread on 2 cores)
            copies.synchronize()
        kv_length = len(prompt) + len(outputs) - 1
        whole = kv_length // page * page
        assert whole == 11 * page
        assert side.freed_window_slots >= 8 * page
        expected = _canonical(side.written_kv(req, whole)[2 * LAYERS :])
        run_until_released(side, [req])
        side.manager.release_host_resources()

        tokens = prompt + outputs[:-1]
        reader = Rig("swa", url)
        restorable, _, _ = reader.prefetch(RadixKey(array("q", tokens + [7, 7])))
        # 4: the first decode page launched in time. The late pages' window: pages 9, 10 (the
        # W - 1 = 8 tokens before 45); sglang's reader asks ceil(W/P) = 3 trailing pages, so 11
        # is not restorable for it. Before: 5 .. 11 were, 5 .. 8 with the refilled slots' bytes.
        assert restorable == [1, 2, 3, 4]
        for pages in restorable:  # each length sglang would resume at: its trailing window read
            _, completed, got = reader.prefetch(RadixKey(array("q", tokens[: pages * page] + [7, 7])))
            assert completed == pages * page
            read = got["swa"].shape[2]
            assert torch.equal(
                got["swa"].view(torch.uint8), expected[:, :, pages * page - read : pages * page].view(torch.uint8)
            ), pages
        reader.stop()


def test_kv_events_of_an_swa_pool_are_refused_before_any_store_opens(one_rank, monkeypatch):
    opened, _ = watch_opened_stores(monkeypatch)
    extra = {"sliding_window": WINDOW, "kv_events_endpoint": "tcp://127.0.0.1:0"}
    with settings_installed("memory", extra=extra):
        with pytest.raises(
            InvalidArgumentError,
            match=r"^kv_events_endpoint: KV events of a model with swa components are not supported",
        ):
            DecodeSide("swa", one_rank, window=WINDOW)
    assert opened == []
