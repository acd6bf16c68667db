"""A fresh sglang user's run of the README's "Use with sglang": KVStageStorage loaded by sglang
0.5.23's own storage factory from the README's extra-config JSON under sglang's own
HiCacheController (write-through on its backup thread, prefetch of the next turn on its
prefetch threads), with the scheduler's part played by the test; and KVStageDecodeOffloadManager
over sglang's Req, ReqToTokenPool, allocator and pools (decode_rig.DecodeSide), its pages read
back by the next turn's prefetch. Defects found are ``xfail(strict=True)`` tests naming them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from kvstage.errors import InvalidArgumentError, KvstageError
from kvstage.integrations.sglang import KVStageStorage

from decode_rig import DecodeSide, install_settings, released, settings_installed
from sglang_rig import (
    PAGE_SIZE,
    canonical_of,
    host_pool,
    mha_device_pool,
    mla_device_pool,
    prefetch,
    random_canonical,
    same_bytes,
    set_host,
    storage_config,
    token_slots,
    write_through,
)

TIMEOUT = 30
README = Path(__file__).resolve().parents[3] / "README.md"


def readme_extra_config(url: str) -> dict:
    """The extra-config JSON of the README's launch command, as written there, with ``url``."""
    text = README.read_text()
    section = text[text.index("## Use with sglang") :]
    start = section.index('\'{"backend_name"')
    raw = section[start + 1 : section.index("}'", start) + 1]
    config = json.loads(raw)
    config["url"] = url
    return config


def readme_rank_statement() -> str:
    """The README's line stating this process's ranks for sglang built by hand on CPU."""
    section = README.read_text()
    section = section[section.index("## Use with sglang") :]
    (call,) = re.findall(r"`(get_parallel\(\)\.override_permanently\([^`]*\))`", section)
    return call


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(tmp_path_factory):
    """A one-process gloo world (file rendezvous) for the controller's TP group; this
    process's ranks stated as the README says."""
    exec(readme_rank_statement(), {"get_parallel": get_parallel})
    if dist.is_initialized():  # another module of this process made one
        yield
        return
    init = tmp_path_factory.mktemp("gloo") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def controller(url: str, layout: str = "page_first", kind: str = "mha", extra: dict | None = None, **device_kwargs):
    """sglang's HiCacheController with the README's dynamic backend config (plus ``extra``)."""
    device = mha_device_pool(**device_kwargs) if kind == "mha" else mla_device_pool()
    host = host_pool(device, layout)
    allocator = PagedTokenToKVPoolAllocator(device.size, PAGE_SIZE, device.dtype, "cpu", device, need_sort=False)
    cc = HiCacheController(
        allocator,
        host,
        PAGE_SIZE,
        dist.group.WORLD,
        threading.Event(),
        io_backend="direct",
        storage_backend="dynamic",
        model_name="org/tiny-model",
        storage_backend_extra_config={**readme_extra_config(url), **(extra or {})},
    )
    return cc, host


def snapshot(host, slots: torch.Tensor) -> torch.Tensor:
    return token_slots(host, canonical_of(host), slots)


# -- flows that work --------------------------------------------------------------------------


def test_the_readme_config_loads_kvstage_and_the_next_turn_prefetches_the_first(tmp_path):
    cc, host = controller(f"file:{tmp_path}")
    try:
        assert isinstance(cc.storage_backend, KVStageStorage)
        set_host(host, random_canonical(host, seed=11))
        turn1 = RadixKey(array("q", range(50, 50 + 4 * PAGE_SIZE)), extra_key="lora-1", cache_salt="tenant-a")
        source = snapshot(host, write_through(cc, host, turn1))
        host.kv_buffer.zero_()
        turn2 = RadixKey(
            array("q", list(turn1.token_ids) + [9] * (2 * PAGE_SIZE)), extra_key="lora-1", cache_salt="tenant-a"
        )
        tokens, got = prefetch(cc, turn2)
        assert tokens == 4 * PAGE_SIZE
        assert same_bytes(snapshot(host, got), source)
        other_tenant = RadixKey(turn1.token_ids, extra_key="lora-1", cache_salt="tenant-b")
        assert prefetch(cc, other_tenant, rid="other")[0] == 0
    finally:
        cc.detach_storage_backend()


def test_several_requests_written_at_once_each_prefetch_their_own_bytes():
    cc, host = controller("memory", layout="layer_first")
    try:
        set_host(host, random_canonical(host, seed=12))
        keys = [RadixKey(array("q", range(r * 1000, r * 1000 + (r + 1) * PAGE_SIZE))) for r in range(3)]
        slots = [host.alloc(len(key.token_ids)) for key in keys]
        for key, indices in zip(keys, slots):  # all queued before the backup thread acks one
            cc.write_storage(indices, key.token_ids, hash_value=get_storage_hash_str(key, page_size=PAGE_SIZE))
        done = sorted(cc.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens for _ in keys)
        assert done == [PAGE_SIZE, 2 * PAGE_SIZE, 3 * PAGE_SIZE]
        sources = [snapshot(host, indices) for indices in slots]
        host.kv_buffer.zero_()
        for r, key in enumerate(keys):
            tokens, got = prefetch(cc, key, rid=f"r{r}")
            assert tokens == len(key.token_ids)
            assert same_bytes(snapshot(host, got), sources[r])
    finally:
        cc.detach_storage_backend()


@pytest.mark.parametrize(
    "kind,written,read", [("mha", "page_head", "layer_first"), ("mla", "layer_first", "page_first_direct")]
)
def test_a_page_written_in_one_host_layout_reads_back_in_another(tmp_path, kind, written, read):
    writer, whost = controller(f"file:{tmp_path}", layout=written, kind=kind)
    try:
        set_host(whost, random_canonical(whost, seed=13))
        key = RadixKey(array("q", range(3 * PAGE_SIZE)))
        source = snapshot(whost, write_through(writer, whost, key))
    finally:
        writer.detach_storage_backend()
    reader, rhost = controller(f"file:{tmp_path}", layout=read, kind=kind)
    try:
        tokens, got = prefetch(reader, key)
        assert tokens == 3 * PAGE_SIZE
        assert same_bytes(snapshot(rhost, got), source)
    finally:
        reader.detach_storage_backend()


def test_a_corrupted_page_is_a_miss_and_the_pages_before_it_still_load(tmp_path):
    cc, host = controller(f"file:{tmp_path}")
    try:
        set_host(host, random_canonical(host, seed=14))
        key = RadixKey(array("q", range(3 * PAGE_SIZE)))
        source = snapshot(host, write_through(cc, host, key))
        third = get_storage_hash_str(key, page_size=PAGE_SIZE)[2]  # sglang's key of the third page
        target = [p for p in tmp_path.rglob("*") if p.is_file() and third in p.name]
        assert len(target) == 1, sorted(p.name for p in tmp_path.rglob("*"))
        data = bytearray(target[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        target[0].write_bytes(bytes(data))
        host.kv_buffer.zero_()
        tokens, got = prefetch(cc, key)
        assert tokens == 2 * PAGE_SIZE
        assert same_bytes(snapshot(host, got[: 2 * PAGE_SIZE]), source[..., : 2 * PAGE_SIZE, :, :])
    finally:
        cc.detach_storage_backend()


def test_clear_flushes_and_get_stats_counts_pages_of_each_call(tmp_path):
    cc, host = controller(f"file:{tmp_path}")
    try:
        backend = cc.storage_backend
        backend.get_stats()  # from zero
        set_host(host, random_canonical(host, seed=15))
        key = RadixKey(array("q", range(2 * PAGE_SIZE)))
        write_through(cc, host, key)
        assert prefetch(cc, key)[0] == 2 * PAGE_SIZE
        stats = backend.get_stats()
        assert sum(stats.backup_pgs) == 2 and sum(stats.prefetch_pgs) == 2
        assert all(bw > 0 for bw in stats.backup_bandwidth + stats.prefetch_bandwidth)
        assert backend.get_stats().backup_pgs == []  # since the last call
        backend.clear()
        assert prefetch(cc, key, rid="after-flush")[0] == 0
    finally:
        cc.detach_storage_backend()


# -- bad configs ---------------------------------------------------------------------------------


def make(url, host, **extra):
    config = storage_config(url, **extra)
    if url is None:
        del config.extra_config["url"]
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def test_a_missing_url_is_refused_naming_it():
    host = host_pool(mha_device_pool(), "layer_first")
    with pytest.raises(InvalidArgumentError, match=r"extra_config\.url"):
        make(None, host)


def test_a_bad_url_is_refused_with_a_kvstage_error_naming_the_url():
    host = host_pool(mha_device_pool(), "layer_first")
    with pytest.raises(KvstageError, match="s3"):
        make("s3://bucket/kv", host)


@pytest.mark.parametrize(
    "url,rule",
    [
        ("s3://bucket/kv", "unknown storage scheme 's3'"),
        ("file:/tmp/kv?capacity=1", "unknown option 'capacity'"),
        ("memory:lots", "capacity: must be a size, got 'lots'"),
        ("memory:1", "holds no page"),
    ],
)
def test_a_bad_url_names_the_key_the_user_typed(url, rule):
    """Whatever part of the URL is wrong, the message starts with ``extra_config.url`` and the
    URL, which it names once (never the store factory's own argument names ``url:`` /
    ``storage:``)."""
    host = host_pool(mha_device_pool(), "layer_first")
    with pytest.raises(InvalidArgumentError) as caught:
        make(url, host)
    assert str(caught.value).startswith(f"extra_config.url: {url!r}: "), str(caught.value)
    assert rule in str(caught.value)
    assert str(caught.value).count(url) == 1, str(caught.value)
    assert "storage:" not in str(caught.value) and ": url:" not in str(caught.value)


def test_a_bad_url_on_the_decode_side_names_the_same_key(tmp_path):
    with settings_installed("s3://bucket/kv"):
        with pytest.raises(
            InvalidArgumentError, match=r"^extra_config\.url: 's3://bucket/kv': unknown storage scheme 's3'"
        ):
            DecodeSide("mha", dist.group.WORLD)


def test_an_extra_config_that_is_not_json_on_the_decode_side_names_the_flag_the_user_typed(tmp_path):
    from sglang.srt.runtime_context import get_context

    settings = install_settings("memory")
    inner = get_context().override_server_args(
        device="cpu", page_size=PAGE_SIZE, hicache_storage_backend_extra_config="{url: memory}"
    )
    inner.install()
    try:
        with pytest.raises(
            InvalidArgumentError, match=r"^--hicache-storage-backend-extra-config: not JSON \("
        ) as caught:
            DecodeSide("mha", dist.group.WORLD)
        assert "hicache_storage_backend_extra_config" not in str(caught.value)
    finally:
        inner.restore()
        settings.restore()


def test_fp8_kv_held_as_uint8_needs_kv_cache_dtype():
    host = host_pool(mha_device_pool(dtype=torch.uint8), "layer_first")
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        make("memory", host)
    assert make("memory", host, kv_cache_dtype="fp8_e4m3").kv_layout.dtype == torch.float8_e4m3fn


def test_a_typo_in_the_extra_config_is_named():
    host = host_pool(mha_device_pool(), "layer_first")
    with pytest.raises(InvalidArgumentError, match="urll"):
        make("memory", host, urll="file:/x")


def test_v_head_size_other_than_k_is_refused():
    host = host_pool(mha_device_pool(v_head_dim=4), "layer_first")
    with pytest.raises(InvalidArgumentError, match="head"):
        make("memory", host)


# -- decode side: KVStageDecodeOffloadManager over sglang's Req, ReqToTokenPool, allocator ----


@pytest.fixture
def decode_settings(tmp_path):
    """sglang's published config of a decode server whose extra config names a file store."""
    url = f"file:{tmp_path / 'store'}"
    settings = install_settings(url)
    yield url
    settings.restore()


def prefill_side_stores_prompt(side: DecodeSide, url: str, req, key: RadixKey, **server) -> None:
    """The prefill server: sglang's controller writes the prompt's whole pages (the KV the
    decode side received) through KVStageStorage."""
    cc, host = controller(url, **server)
    try:
        whole = len(key.token_ids) // PAGE_SIZE * PAGE_SIZE
        slots = host.alloc(whole)
        canonical = canonical_of(host)
        for i, rows in enumerate(side.kv_of(req, whole)):
            canonical[i // host.layer_num, i % host.layer_num, slots] = rows
        set_host(host, canonical)
        page_key = RadixKey(array("q", key.token_ids[:whole]), extra_key=key.extra_key, cache_salt=key.cache_salt)
        write_through(cc, host, page_key, slots)
    finally:
        cc.detach_storage_backend()


def next_turn_reads(url: str, key: RadixKey, **server) -> tuple[int, torch.Tensor]:
    """The next turn on a fresh server: sglang's prefetch of ``key``; (tokens, KV as
    ``[2, layers, tokens, heads, head_dim]``)."""
    cc, host = controller(url, **server)
    try:
        tokens, slots = prefetch(cc, key)
        return tokens, snapshot(host, slots[:tokens])
    finally:
        cc.detach_storage_backend()


def as_canonical(kv: list[torch.Tensor]) -> torch.Tensor:
    """The decode side's per-buffer rows (K layers, then V layers) as ``[2, L, S, H, D]``."""
    return torch.stack(kv).view(2, len(kv) // 2, *kv[0].shape)


def finish_and_hand_back(side: DecodeSide, reqs) -> list[int]:
    """check_offload_progress each step until sglang has every request back; the
    ``len(ongoing_offload)`` sglang saw at each step."""
    seen = []
    deadline = time.monotonic() + TIMEOUT
    while not all(released(req) for req in reqs):
        assert time.monotonic() < deadline, "requests never handed back to sglang"
        seen.append(len(side.manager.ongoing_offload))
        side.manager.check_offload_progress()
        time.sleep(0.002)
    return seen


def test_a_tenants_decode_pages_continue_its_prefill_chain_and_only_it_reads_them(decode_settings):
    url = decode_settings
    side = DecodeSide("mha", dist.group.WORLD)
    try:
        prompt = list(range(700, 709))  # 2 whole pages from prefill, 1 token more
        req = side.admit("t1", prompt, max_tokens=9, extra_key="lora-2")
        req.cache_salt = "tenant-a"  # what sglang's Req(cache_salt=...) holds
        prefill_side_stores_prompt(
            side, url, req, RadixKey(array("q", prompt), extra_key="lora-2", cache_salt="tenant-a")
        )
        for step in range(9):
            side.decode_step(req, 2000 + step)
            if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
                side.manager.check_offload_progress()
        kv_length = len(prompt) + 8
        expected = as_canonical(side.kv_of(req, kv_length))
        seen = finish_and_hand_back(side, [req])
        assert seen[0] == 1 and len(side.manager.ongoing_offload) == 0
        side.manager.release_host_resources()
        conversation = prompt + [2000 + i for i in range(8)] + [5]
        whole = kv_length // PAGE_SIZE * PAGE_SIZE
        tokens, got = next_turn_reads(
            url, RadixKey(array("q", conversation), extra_key="lora-2", cache_salt="tenant-a")
        )
        assert tokens == whole
        assert same_bytes(got, expected[:, :, :whole])
        other, _ = next_turn_reads(url, RadixKey(array("q", conversation), extra_key="lora-2", cache_salt="tenant-b"))
        assert other == 0
    finally:
        side.manager.manager.close()


def retract(side: DecodeSide, req) -> None:
    """sglang's retraction of a decode request: drain, free its slots and row, reset it."""
    deadline = time.monotonic() + TIMEOUT
    while side.manager.has_inflight_device_transfer():
        assert time.monotonic() < deadline
        side.manager.check_offload_progress()
        time.sleep(0.002)
    side.manager.drain_before_retraction()
    side.allocator.free(side.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].long())
    side.req_to_token_pool.free(req)
    req.reset_for_retract()


@pytest.mark.parametrize("steps_held", [0, 2], ids=["resumed-at-once", "held-two-steps"])
def test_a_retracted_request_that_resumes_stores_its_whole_conversation(decode_settings, steps_held):
    """Held for scheduler steps, the retraction is seen and the manager's lifecycle ends
    (keeping what it stored); the resumed request's pages continue after those."""
    url = decode_settings
    side = DecodeSide("mha", dist.group.WORLD)
    try:
        prompt = list(range(40, 48))  # 2 whole pages
        req = side.admit("r1", prompt, max_tokens=14)
        prefill_side_stores_prompt(side, url, req, RadixKey(array("q", prompt)))
        for step in range(6):
            side.decode_step(req, 3000 + step)
            if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
                side.manager.check_offload_progress()
        kv_before = side.kv_of(req, len(prompt) + 5)
        retract(side, req)
        for _ in range(steps_held):
            side.manager.check_offload_progress()
        assert side.manager.manager.requests_live == (1 if steps_held == 0 else 0)
        # it runs again: new slots, its KV recomputed (the same values), decode goes on
        side.req_to_token_pool.alloc([req])
        total = -(-(len(prompt) + 14) // PAGE_SIZE) * PAGE_SIZE
        slots = side.allocator.alloc(total)
        side.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, total)), slots.to(torch.int32))
        req.kv.kv_allocated_len = total
        rows = side.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(prompt) + 5].long()
        for buffer, before in zip(side.buffers(), kv_before):
            buffer[rows] = before
        for step in range(6, 14):
            side.decode_step(req, 3000 + step)
            if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
                side.manager.check_offload_progress()
        kv_length = len(prompt) + 13
        expected = as_canonical(side.kv_of(req, kv_length))
        finish_and_hand_back(side, [req])
        side.manager.release_host_resources()
        whole = kv_length // PAGE_SIZE * PAGE_SIZE
        tokens, got = next_turn_reads(url, RadixKey(array("q", prompt + [3000 + i for i in range(13)] + [1])))
        assert tokens == whole
        assert same_bytes(got, expected[:, :, :whole])
    finally:
        side.manager.manager.close()


def test_an_aborted_request_is_handed_back_and_shutdown_keeps_what_was_launched(decode_settings):
    url = decode_settings
    side = DecodeSide("mha", dist.group.WORLD)
    try:
        prompt = list(range(90, 98))
        req = side.admit("a1", prompt, max_tokens=30)
        done = side.admit("d1", list(range(120, 128)), max_tokens=5)
        prefill_side_stores_prompt(side, url, req, RadixKey(array("q", prompt)))
        for step in range(9):
            side.decode_step(req, 4000 + step)
        req.finished_reason = FINISH_ABORT()  # the client went away: sglang finishes it as aborted
        assert side.manager.offload_kv_cache(req) is True
        kv_length = len(prompt) + 8
        expected = as_canonical(side.kv_of(req, kv_length))
        for step in range(5):
            side.decode_step(done, 4100 + step)
        finish_and_hand_back(side, [req, done])
        side.manager.release_host_resources()  # shutdown right away: writes land first
        whole = kv_length // PAGE_SIZE * PAGE_SIZE
        tokens, got = next_turn_reads(url, RadixKey(array("q", prompt + [4000 + i for i in range(8)] + [1])))
        assert tokens == whole
        assert same_bytes(got, expected[:, :, :whole])
    finally:
        side.manager.manager.close()


@pytest.mark.parametrize("url,rule", [("s3://bucket/kv", "s3"), ("file:", "file"), ("memory:lots", "lots")])
def test_a_server_started_with_a_bad_url_refuses_to_start_naming_it(url, rule):
    # sglang's controller wraps the backend's error in its own ValueError, kvstage's as the cause
    with pytest.raises(ValueError, match=f"Failed to create storage backend: .*{rule}") as raised:
        cc, _ = controller(url)
        cc.detach_storage_backend()
    assert isinstance(raised.value.__cause__, KvstageError)


def test_a_page_unified_host_pool_is_refused_naming_the_layout():
    host = host_pool(mha_device_pool(), "page_unified")
    with pytest.raises(InvalidArgumentError, match="page_unified"):
        make("memory", host)


def test_three_prefetches_in_flight_at_once_each_get_their_own_pages():
    cc, host = controller("memory", layout="page_first_direct")
    try:
        set_host(host, random_canonical(host, seed=16))
        keys = [
            RadixKey(array("q", range(r * 500, r * 500 + (2 + r) * PAGE_SIZE)), cache_salt=f"t{r}") for r in range(3)
        ]
        sources = [snapshot(host, write_through(cc, host, key)) for key in keys]
        host.kv_buffer.zero_()
        for r, key in enumerate(keys):
            cc.prefetch(f"r{r}", key)
        operations = {}
        for _ in keys:
            operation = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
            operation.host_indices = cc.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
            operations[operation.request_id] = operation
        for operation in operations.values():
            cc.prefetch_buffer.put(operation)
        finished, completed = set(), {}
        while len(finished) < 3:
            ack = cc.ack_prefetch_queue.get(timeout=TIMEOUT)
            if ack.completed_req:
                finished.add(ack.rid)
            elif ack.completed_tokens is not None:
                completed[ack.rid] = ack.completed_tokens
        for r, key in enumerate(keys):
            operation = operations[f"r{r}"]
            assert completed[f"r{r}"] == len(key.token_ids)
            assert same_bytes(snapshot(host, operation.host_indices), sources[r])
    finally:
        cc.detach_storage_backend()


def test_a_corrupted_middle_page_stops_the_prefix_there_and_a_rewrite_mends_it(tmp_path):
    cc, host = controller(f"file:{tmp_path}", layout="layer_first")
    try:
        set_host(host, random_canonical(host, seed=17))
        key = RadixKey(array("q", range(3 * PAGE_SIZE)))
        slots = write_through(cc, host, key)
        source = snapshot(host, slots)
        second = get_storage_hash_str(key, page_size=PAGE_SIZE)[1]
        [path] = [p for p in tmp_path.rglob("*") if p.is_file() and second in p.name]
        path.write_bytes(path.read_bytes()[:-3])  # a torn write
        tokens, _ = prefetch(cc, key)
        assert tokens == PAGE_SIZE
        # the next write-through of the same prompt stores the page again
        write_through(cc, host, key, slots)
        host.kv_buffer.zero_()
        tokens, got = prefetch(cc, key, rid="again")
        assert tokens == 3 * PAGE_SIZE
        assert same_bytes(snapshot(host, got), source)
    finally:
        cc.detach_storage_backend()


WRITER = """
import sys, threading
sys.path.insert(0, {here!r})
from sglang_cpu import import_sglang
assert import_sglang() is None
from array import array
import torch
import torch.distributed as dist
from sglang.srt.runtime_context import get_parallel
get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, attn_dcp_rank=0)
dist.init_process_group("gloo", init_method="file://{rendezvous}", rank=0, world_size=1)
import test_sglang_user as user
from sglang.srt.mem_cache.radix_cache import RadixKey
cc, host = user.controller("file:{store}", layout="page_head")
user.set_host(host, user.random_canonical(host, seed=21))
key = RadixKey(array("q", range(5 * user.PAGE_SIZE)), extra_key="lora-9")
slots = user.write_through(cc, host, key)
torch.save(user.snapshot(host, slots), "{out}")
cc.detach_storage_backend()
"""


def test_two_sglang_processes_share_one_file_directory(tmp_path):
    """Another sglang server process writes the pages; this one (another host layout) reads them,
    and writes the same pages again (deduplicated, still readable)."""
    store, out = tmp_path / "store", tmp_path / "source.pt"
    script = WRITER.format(
        here=str(Path(__file__).resolve().parent), rendezvous=tmp_path / "gloo", store=store, out=out
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    source = torch.load(out)
    cc, host = controller(f"file:{store}", layout="layer_first")
    try:
        key = RadixKey(array("q", range(5 * PAGE_SIZE)), extra_key="lora-9")
        tokens, got = prefetch(cc, key)
        assert tokens == 5 * PAGE_SIZE
        assert same_bytes(snapshot(host, got), source)
        write_through(cc, host, key)  # the same pages from this process too
        host.kv_buffer.zero_()
        tokens, got = prefetch(cc, key, rid="again")
        assert tokens == 5 * PAGE_SIZE and same_bytes(snapshot(host, got), source)
    finally:
        cc.detach_storage_backend()


FP8 = {"extra": {"kv_cache_dtype": "fp8_e4m3"}, "dtype": torch.float8_e4m3fn}


@pytest.fixture
def fp8_decode_side(tmp_path, monkeypatch):
    """make(extra): a decode server with fp8 KV (sglang holds it as uint8) and ``extra`` in its
    extra config; (its store URL, its DecodeSide)."""
    import decode_rig

    url = f"file:{tmp_path / 'store'}"
    installed = []

    def make(extra: dict):
        monkeypatch.setattr(decode_rig, "extra_config", lambda url: {**readme_extra_config(url), **extra})
        monkeypatch.setattr(
            decode_rig, "mha_device_pool", lambda size: mha_device_pool(size=size, dtype=torch.float8_e4m3fn)
        )
        installed.append(install_settings(url))
        return url, DecodeSide("mha", dist.group.WORLD)

    yield make
    for settings in installed:
        settings.restore()


def test_fp8_decode_pages_continue_the_prefill_chain(fp8_decode_side):
    url, side = fp8_decode_side({"kv_cache_dtype": "fp8_e4m3"})
    try:
        prompt = list(range(800, 808))
        req = side.admit("f1", prompt, max_tokens=9)
        prefill_side_stores_prompt(side, url, req, RadixKey(array("q", prompt)), **FP8)
        for step in range(9):
            side.decode_step(req, 5000 + step)
            if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
                side.manager.check_offload_progress()
        kv_length = len(prompt) + 8
        expected = as_canonical(side.kv_of(req, kv_length))
        finish_and_hand_back(side, [req])
        side.manager.release_host_resources()
        tokens, got = next_turn_reads(url, RadixKey(array("q", prompt + [5000 + i for i in range(8)] + [1])), **FP8)
        assert tokens == kv_length
        assert same_bytes(got, expected)
    finally:
        side.manager.manager.close()


def test_an_fp8_decode_side_without_kv_cache_dtype_is_refused(fp8_decode_side):
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        _, side = fp8_decode_side({})
        side.manager.release_host_resources()


def test_kv_cache_dtype_on_a_pool_that_is_not_fp8_is_refused():
    host = host_pool(mha_device_pool(), "layer_first")
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        make("memory", host, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(InvalidArgumentError, match=r"'fp8_e5m2' contradicts the host pool's dtype torch\.bfloat16"):
        make("memory", host, kv_cache_dtype="fp8_e5m2")


def test_kv_cache_dtype_on_a_decode_pool_that_is_not_fp8_is_refused(tmp_path, monkeypatch):
    import decode_rig

    url = f"file:{tmp_path / 'store'}"
    monkeypatch.setattr(
        decode_rig, "extra_config", lambda url: {**readme_extra_config(url), "kv_cache_dtype": "fp8_e4m3"}
    )
    with settings_installed(url):  # the rig's device pool: bf16
        with pytest.raises(
            InvalidArgumentError,
            match=r"kv_cache_dtype: 'fp8_e4m3' contradicts the device pool's dtype torch\.bfloat16",
        ):
            DecodeSide("mha", dist.group.WORLD)


def test_with_prefix_keys_passed_the_next_turns_extension_is_stored_after_its_prefix(tmp_path):
    cc, host = controller(f"file:{tmp_path}", extra={"hicache_storage_pass_prefix_keys": True})
    try:
        set_host(host, random_canonical(host, seed=18))
        turn1 = RadixKey(array("q", range(2 * PAGE_SIZE)))
        first = get_storage_hash_str(turn1, page_size=PAGE_SIZE)
        slots1 = host.alloc(2 * PAGE_SIZE)
        cc.write_storage(slots1, turn1.token_ids, hash_value=first)
        assert cc.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens == 2 * PAGE_SIZE
        # the radix tree's child node: the new pages, their hashes continuing the parent's, its keys as prefix
        extension = array("q", range(100, 100 + 2 * PAGE_SIZE))
        second = get_storage_hash_str(RadixKey(extension), prior_hash=first[-1], page_size=PAGE_SIZE)
        slots2 = host.alloc(2 * PAGE_SIZE)
        cc.write_storage(slots2, extension, hash_value=second, prefix_keys=first)
        assert cc.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens == 2 * PAGE_SIZE
        source = snapshot(host, torch.cat([slots1, slots2]))
        host.kv_buffer.zero_()
        tokens, got = prefetch(cc, RadixKey(array("q", list(turn1.token_ids) + list(extension))))
        assert tokens == 4 * PAGE_SIZE
        assert same_bytes(snapshot(host, got), source)
    finally:
        cc.detach_storage_backend()


def test_a_prompt_shorter_than_a_page_is_stored_whole_by_the_decode_side(decode_settings):
    """No whole prompt page for the prefill side to store: the decode side's first page starts
    the chain from the namespace seed, and the next turn reads every whole page."""
    url = decode_settings
    side = DecodeSide("mha", dist.group.WORLD)
    try:
        prompt = [5, 6, 7]
        req = side.admit("s1", prompt, max_tokens=11, extra_key="lora-3")
        for step in range(11):
            side.decode_step(req, 6000 + step)
            if not req.finished():  # once finished, sglang may get it back at the next check: its KV is read first
                side.manager.check_offload_progress()
        kv_length = len(prompt) + 10
        expected = as_canonical(side.kv_of(req, kv_length))
        finish_and_hand_back(side, [req])
        side.manager.release_host_resources()
        whole = kv_length // PAGE_SIZE * PAGE_SIZE
        tokens, got = next_turn_reads(
            url, RadixKey(array("q", prompt + [6000 + i for i in range(10)] + [1]), extra_key="lora-3")
        )
        assert tokens == whole
        assert same_bytes(got, expected[:, :, :whole])
    finally:
        side.manager.manager.close()
