"""KVStageDecodeOffloadManager in sglang 0.5.23's decode loop: decode pages stored from sglang's
Req, ReqToTokenPool, allocator and MHA/MLA pools continue the prefill side's chain, and sglang's
own HiCacheController prefetches the whole conversation back byte for byte (the next turn);
two TP ranks (two processes, gloo on loopback) release the same requests in the same steps."""

from __future__ import annotations

import gc
import socket
import time
import weakref
from array import array

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sglang.srt.managers.schedule_batch import release_req
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvstage.errors import InvalidArgumentError

import tp_rank_worker
from decode_rig import DecodeSide, controller_over, put_kv_in_host, released, run_until_released, settings_installed
from sglang_rig import (
    PAGE_SIZE,
    canonical_of,
    token_slots,
    watch_opened_stores,
    write_through,
)


@pytest.fixture
def one_rank(tmp_path):
    init = tmp_path / "gloo"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "page_first_direct")])
def test_decode_pages_continue_the_prefill_chain_and_the_next_turn_prefetches_them_byte_equal(
    tmp_path, one_rank, kind, layout
):
    url = f"file:{tmp_path / 'store'}"
    with settings_installed(url):
        side = DecodeSide(kind, one_rank)
        prompt = list(range(300, 310))  # 2 whole pages from the prefill side, 2 tokens more
        req = side.admit("turn-1", prompt, max_tokens=11, extra_key="lora-7")

        # The prefill side stored the prompt's whole pages (sglang's controller, kvstage's store).
        prefill, prefill_host = controller_over(side, url, layout)
        prompt_slots = prefill_host.alloc(8)
        put_kv_in_host(prefill_host, side.kv_of(req, 8), prompt_slots)
        key = RadixKey(array("q", prompt[:8]), extra_key="lora-7")
        write_through(prefill, prefill_host, key, prompt_slots)
        prefill.detach_storage_backend()

        for step in range(11):
            side.decode_step(req, 1000 + step)
            if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
                side.manager.check_offload_progress()
        kv_length = len(prompt) + 10  # the last sampled token has no KV
        expected = side.kv_of(req, kv_length)
        run_until_released(side, [req])
        assert released(req)
        side.manager.release_host_resources()
        assert side.manager.manager.metrics.pages_stored == (kv_length // PAGE_SIZE) - 2

        # The next turn: sglang's prefetch finds every whole page and reads it back.
        reader, reader_host = controller_over(side, url, layout)
        conversation = RadixKey(array("q", prompt + [1000 + i for i in range(10)] + [7, 7, 7]), extra_key="lora-7")
        reader.prefetch("turn-2", conversation)
        operation = reader.prefetch_hit_queue.get(timeout=30)
        assert operation.storage_hit_count == kv_length // PAGE_SIZE * PAGE_SIZE
        operation.host_indices = reader.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
        reader.prefetch_buffer.put(operation)
        while not reader.ack_prefetch_queue.get(timeout=30).completed_req:
            pass
        got = token_slots(reader_host, canonical_of(reader_host), operation.host_indices)
        whole = operation.storage_hit_count
        for i, rows in enumerate(expected):
            if kind == "mla":
                want = rows[:whole].reshape(whole, -1)
                assert torch.equal(got[i].view(torch.uint8), want.view(torch.uint8)), i
            else:
                layers = reader_host.layer_num
                assert torch.equal(got[i // layers, i % layers].view(torch.uint8), rows[:whole].view(torch.uint8)), i
        reader.detach_storage_backend()


def test_no_url_in_the_extra_config_is_refused(tmp_path, one_rank):
    with settings_installed("memory"):
        from sglang.srt.runtime_context import get_context

        inner = get_context().override_server_args(
            device="cpu", page_size=PAGE_SIZE, hicache_storage_backend_extra_config="{}"
        )
        inner.install()
        try:
            with pytest.raises(InvalidArgumentError, match="extra_config.url"):
                DecodeSide("mha", one_rank)
        finally:
            inner.restore()


def test_a_stride_larger_than_the_host_pool_is_refused_and_the_opened_store_is_closed(one_rank, monkeypatch):
    """The store is opened before the host pool and the manager; when they refuse, it is closed."""
    opened, closed = watch_opened_stores(monkeypatch)
    # hicache_ratio 2.0 over 256 device slots: 128 host pages; a stride of 256 pages cannot fit
    with settings_installed("memory", stride=256 * PAGE_SIZE):
        with pytest.raises(InvalidArgumentError, match="offload_stride"):
            DecodeSide("mha", one_rank)
    assert len(opened) == 1 and closed == opened


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_two_tp_ranks_release_the_same_requests_in_the_same_steps(tmp_path, kind):
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        procs = [
            context.Process(target=tp_rank_worker.run_rank, args=(rank, port, kind, f"file:{tmp_path / 'store'}", out))
            for rank in (0, 1)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
        assert [proc.exitcode for proc in procs] == [0, 0]
        (released0, stored0), (released1, stored1) = out[0], out[1]
    assert sorted(released0) == ["r0", "r1", "r2", "r3"]
    assert released0 == released1
    if kind == "mla":
        assert stored0 > 0 and stored1 == 0  # only rank 0 writes the replicated latent
    else:
        assert stored0 == stored1 > 0


def test_an_abort_through_finalize_release_is_released_and_retraction_drains_first(tmp_path, one_rank):
    with settings_installed(f"file:{tmp_path / 'store'}"):
        side = DecodeSide("mha", one_rank)
        aborted = side.admit("aborted", list(range(3)), max_tokens=20)
        running = side.admit("running", list(range(50, 53)), max_tokens=20)
        for step in range(6):
            for req in (aborted, running):
                side.decode_step(req, 500 + step)
        # sglang's sampling-mask abort: finalize_release_on_finish without offload_kv_cache
        side.manager.finalize_release_on_finish(aborted)
        assert len(side.manager.ongoing_offload) == 1
        run_until_released(side, [aborted])
        assert not released(running)
        deadline = time.monotonic() + 30
        while side.manager.has_inflight_device_transfer():  # the running request's copies end
            assert time.monotonic() < deadline
            side.manager.check_offload_progress()
            time.sleep(0.002)
        side.manager.drain_before_retraction()  # nothing copies device slots now: no error
        side.manager.finalize_release_on_finish(aborted)  # already back with sglang: nothing
        assert len(side.manager.ongoing_offload) == 0
        side.manager.release_host_resources()


def wait_for_copies(side: DecodeSide) -> None:
    deadline = time.monotonic() + 30
    while side.manager.has_inflight_device_transfer():
        assert time.monotonic() < deadline, "device-to-host copies never ended"
        side.manager.check_offload_progress()
        time.sleep(0.002)


def sglang_retracts(side: DecodeSide, req) -> None:
    """sglang's decode-side retraction of ``req`` (``Scheduler`` under memory pressure): drain,
    then its own ``release_req`` (as ``retract_all(..., offload_kv=False)``): the slots and row
    freed, the request reset and held for re-bootstrap."""
    wait_for_copies(side)
    side.manager.drain_before_retraction()
    # The rig allocates a request's slots at admission (sglang as it decodes): counted as
    # committed, as sglang's free path expects of what it allocated.
    req.kv.kv_committed_len = req.kv.kv_allocated_len
    release_req(
        req=req,
        remaing_req_count=0,
        req_to_token_pool=side.req_to_token_pool,
        token_to_kv_pool_allocator=side.allocator,
        tree_cache=side.tree_cache,
        hisparse_coordinator=None,
        offload_kv=False,
    )
    assert released(req) and req.is_retracted


def test_a_request_sglang_drops_while_held_after_retraction_is_not_kept_alive(tmp_path, one_rank):
    with settings_installed(f"file:{tmp_path / 'store'}"):
        side = DecodeSide("mha", one_rank)
        # shorter than a page: its decode pages start the chain (no prefill page to wait for)
        req = side.admit("held", list(range(3)), max_tokens=20)
        for step in range(6):
            side.decode_step(req, 600 + step)
            side.manager.check_offload_progress()
        assert side.manager.manager.requests_live == 1
        sglang_retracts(side, req)
        side.manager.check_offload_progress()  # the scheduler's next step, the request held
        # an abort while held: sglang drops its last reference and never calls the adapter again
        held = weakref.ref(req)
        del req
        deadline = time.monotonic() + 5
        while True:  # the scheduler's steps go on; its store writes end
            side.manager.check_offload_progress()
            gc.collect()
            if held() is None or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        assert side.manager.manager.requests_live == 0
        assert held() is None
        assert len(side.manager.ongoing_offload) == 0
        assert side.manager.manager.metrics.pages_stored == 2  # what it stored before retraction stays stored
        side.manager.release_host_resources()
