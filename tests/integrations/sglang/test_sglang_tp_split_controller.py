"""Head groups through sglang 0.5.23's own HiCacheController (one TP rank, ``tp_lcm_size`` in
the extra config, which sglang takes out and passes as ``storage_config.tp_lcm_size``): what
its write-through stores, TP 2 and TP 4 ranks read; what TP 2 ranks store, its prefetch reads.
File store, and Mooncake with a real master (loopback: run under tools/in-netns.sh)."""

from __future__ import annotations

from array import array

import pytest
import torch.distributed as dist
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvstage.errors import InvalidArgumentError
from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary, mooncake_available

from decode_rig import DecodeSide, settings_installed
from mooncake_master import LocalMooncakeMaster
from sglang_rig import (
    PAGE_SIZE,
    canonical_of,
    hicache_controller,
    mha_device_pool,
    one_rank_gloo_world,
    page_tokens,
    prefetch,
    same_bytes,
    set_host,
    write_through,
)
from tp_split_rig import HEADS, model_kv, rank_backend, rank_heads, rank_host

TIMEOUT = 60


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    if not mooncake_available() or master_binary() is None:
        pytest.skip(f"the Mooncake store is not usable here; {INSTALL_HINT}")
    with LocalMooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as running:
        yield running


def url_of(store: str, tmp_path, request) -> str:
    if store == "file":
        return f"file:{tmp_path / 'pages'}"
    return request.getfixturevalue("master").url()


def tp1_controller(url: str, layout: str, tp_lcm_size: int):
    device = mha_device_pool(head_num=HEADS)
    host = rank_host(1, layout)
    cc = hicache_controller(device, host, url, extra={"tp_lcm_size": tp_lcm_size})
    backend = cc.storage_backend
    assert (
        backend.storage_config.tp_lcm_size == tp_lcm_size and "tp_lcm_size" not in backend.storage_config.extra_config
    )
    assert backend.storage_config.should_split_heads == (layout == "page_head")  # sglang's own rule
    assert backend.store.prefix.endswith(f"@hg{tp_lcm_size}@")
    return cc, host


KEY = RadixKey(array("q", range(100, 100 + 5 * PAGE_SIZE)), extra_key="lora-2")


@pytest.mark.parametrize("store", ["file", "mooncake"])
@pytest.mark.parametrize("readers", [2, 4])
def test_what_a_tp1_server_writes_through_every_rank_of_a_tp_m_server_reads(tmp_path, request, store, readers):
    url = url_of(store, tmp_path, request)
    cc, host = tp1_controller(url, "page_head", 4)
    opened = []
    try:
        kv = model_kv(host, seed=20 + readers)
        set_host(host, kv)
        slots = write_through(cc, host, KEY, timeout=TIMEOUT)
        keys = get_storage_hash_str(KEY, page_size=PAGE_SIZE)
        assert len(keys) == 5
        for rank in range(readers):
            reader_host = rank_host(readers, "page_first")
            reader_host.kv_buffer.zero_()
            reader = rank_backend(url, reader_host, rank, readers, 4)
            opened.append(reader)
            assert reader.batch_exists(keys) == 5
            targets = [0, 12, 36, 8, 20]
            assert reader.batch_get_v1(keys, page_tokens(reader_host, targets)) == [True] * 5
            got = canonical_of(reader_host)
            for page, target in enumerate(targets):
                source = slots[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
                expected = kv[:, :, source][:, :, :, rank_heads(rank, readers)]
                assert same_bytes(got[:, :, target : target + PAGE_SIZE], expected), (rank, page)
    finally:
        for reader in opened:
            reader.close()
        cc.detach_storage_backend()


@pytest.mark.parametrize("store", ["file", "mooncake"])
def test_what_tp2_ranks_store_a_tp1_servers_prefetch_reads(tmp_path, request, store):
    url = url_of(store, tmp_path, request)
    keys = get_storage_hash_str(KEY, page_size=PAGE_SIZE)
    writers = []  # Mooncake keeps pages in the segments its clients mount: the writers stay up
    cc = None
    try:
        kv = None
        for rank in range(2):
            writer_host = rank_host(2, "page_head")
            kv = model_kv(writer_host, seed=30) if kv is None else kv
            set_host(writer_host, kv[:, :, :, rank_heads(rank, 2)].contiguous())
            writer = rank_backend(url, writer_host, rank, 2, 2)
            writers.append(writer)
            assert writer.batch_set_v1(keys, page_tokens(writer_host, [4, 8, 12, 16, 20])) == [True] * 5
        cc, host = tp1_controller(url, "layer_first", 2)
        host.kv_buffer.zero_()
        tokens, slots = prefetch(
            cc, RadixKey(array("q", list(KEY.token_ids) + [7]), extra_key="lora-2"), timeout=TIMEOUT
        )
        assert tokens == 5 * PAGE_SIZE
        got = canonical_of(host)
        assert same_bytes(got[:, :, slots], kv[:, :, 4 : 4 + 5 * PAGE_SIZE])
    finally:
        if cc is not None:
            cc.detach_storage_backend()
        for writer in writers:
            writer.close()


def test_the_decode_side_offload_refuses_tp_lcm_size_rather_than_write_pages_of_another_key_space():
    """The decode side keeps per-rank keys: its pages would not continue the prefill side's chain."""
    with settings_installed("memory", extra={"tp_lcm_size": 2}):
        with pytest.raises(InvalidArgumentError, match=r"^extra_config.tp_lcm_size: the device pool's pages"):
            DecodeSide("mha", dist.group.WORLD)
