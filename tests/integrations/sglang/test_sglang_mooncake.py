"""sglang 0.5.23's HiCacheController with KVStageStorage over kvstage's Mooncake store and a real
mooncake_master (tests/mooncake_master.py: loopback only): write-through, then the next turn
prefetches the pages back through another host layout, bytes equal."""

from __future__ import annotations

from array import array

import pytest
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary, mooncake_available

from mooncake_master import LocalMooncakeMaster
from sglang_rig import (
    PAGE_SIZE,
    canonical_of,
    hicache_controller,
    host_pool,
    mha_device_pool,
    mla_device_pool,
    one_rank_gloo_world,
    random_canonical,
    same_bytes,
    set_host,
    token_slots,
    write_through,
)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    if not mooncake_available() or master_binary() is None:
        pytest.skip(f"the Mooncake store is not usable here; {INSTALL_HINT}")
    with LocalMooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    with one_rank_gloo_world(tmp_path_factory.mktemp("gloo")) as world:
        yield world


def controller(device, layout: str, url: str):
    host = host_pool(device, layout)
    cc = hicache_controller(device, host, url)
    return cc, host


@pytest.mark.parametrize(
    "kind,written,read", [("mha", "page_first", "page_first_direct"), ("mla", "page_first_direct", "layer_first")]
)
def test_write_through_then_the_next_turn_prefetches_from_mooncake(master, kind, written, read):
    device = mha_device_pool() if kind == "mha" else mla_device_pool()
    url = master.url()
    # The writer stays up: Mooncake keeps pages in the segments its clients mount.
    writer, writer_host = controller(device, written, url)
    reader = None
    try:
        set_host(writer_host, random_canonical(writer_host, seed=4))
        key = RadixKey(array("q", range(40, 40 + 3 * PAGE_SIZE)), extra_key="lora-7")
        slots = write_through(writer, writer_host, key, timeout=60)
        source = token_slots(writer_host, canonical_of(writer_host), slots)
        reader, reader_host = controller(device, read, url)
        reader.prefetch("turn-2", RadixKey(array("q", list(key.token_ids) + [9, 9]), extra_key="lora-7"))
        operation = reader.prefetch_hit_queue.get(timeout=60)
        assert operation.storage_hit_count == len(key.token_ids)
        operation.host_indices = reader.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
        reader.prefetch_buffer.put(operation)
        while not reader.ack_prefetch_queue.get(timeout=60).completed_req:
            pass
        assert same_bytes(token_slots(reader_host, canonical_of(reader_host), operation.host_indices), source)
    finally:
        if reader is not None:
            reader.detach_storage_backend()
        writer.detach_storage_backend()
