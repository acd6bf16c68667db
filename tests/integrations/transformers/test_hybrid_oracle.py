"""The real-model proof of issue 27 through kvstage's store and load paths: six tiny transformers
models (``hybrid_models``) run page by page into ``CachePools``; the ``OffloadManager`` stores
every component (offload at resume points, state snapshots, finish), every pool and cache is
dropped, a fresh manager over fresh pools prefetches and loads the restorable prefix, the cache is
rebuilt at ``L`` and continued: logits ``torch.equal`` to transformers continuing its own cache
after the same chunked prefill of ``L`` tokens. Over the memory and file stores and a real
Mooncake master."""

from __future__ import annotations

import pytest
import torch

from kvstage.integrations.transformers import CachePools
from kvstage.storage import open_storage

import hybrid_models as hm
import hybrid_rig as rig
from hybrid_rig import PAGE, one_thread  # noqa: F401 (an autouse fixture of these files)

MAX_TOKENS = 32
PROMPT = 27  # 6 whole pages and 3 tokens: 24 tokens restorable at most
STATE_ARCHS = ("qwen3_next", "jamba", "falcon_h1")
SWA_ARCHS = ("gpt_oss", "gemma3")


model_of = rig.model_of


def prompt(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return rig.prompt(length, seed)


following = rig.following


def round_trip(
    arch, url, tokens, length, load_tokens=None, *, stores=None, namespace=None, load_namespace=None, **store_options
):
    """Store through one manager, load ``load_tokens`` (default ``tokens``) through another over
    other store clients (a memory store is its client's own: the same objects stand for it; given
    ``stores``, those, left open): ``(cache, loaded length, the lookup's PrefixMatch)``."""
    model, layout = model_of(arch)
    writers = stores if stores is not None else rig.open_stores(layout, url)
    readers = writers
    try:
        rig.store_with_manager(
            model, layout, tokens, length, writers, max_tokens=MAX_TOKENS, **(namespace or {}), **store_options
        )
        if url != "memory":  # Mooncake's pages live in the writer's segment: keep it mounted
            readers = rig.open_stores(layout, url)
        return rig.load_with_manager(
            model,
            layout,
            tokens if load_tokens is None else load_tokens,
            readers,
            max_tokens=MAX_TOKENS,
            **(load_namespace or {}),
        )
    finally:
        rig.close_stores(*([writers] if stores is None else []), *([readers] if readers is not writers else []))


def continues_bitwise(arch, cache, tokens, length) -> bool:
    model, _ = model_of(arch)
    return rig.same(
        rig.continuation(model, cache, following(tokens), length), rig.oracle(model, following(tokens), length)
    )


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_every_component_stored_and_loaded_continues_bitwise(arch, store_url):
    tokens = prompt()
    cache, at, found = round_trip(arch, store_url, tokens, 24, snapshots=(8, 16, 24), offload_at=(8, 16))
    # a window model resumes at every page (each window before it was stored); a state model at its snapshots
    assert found.lengths == ((8, 16, 24) if arch in STATE_ARCHS else (4, 8, 12, 16, 20, 24))
    assert at == 24
    assert continues_bitwise(arch, cache, tokens, at)


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_a_hit_rounds_down_to_the_last_snapshot_or_window(arch):
    """Pages to 24 stored, offloaded at 8 (the window before 8 and 24 stored), snapshots at 8 and
    16. The same prompt: a state model resumes at 16 (24 has no snapshot). A prompt that leaves
    it after 20 tokens: 16 for a state model, 8 for a window model (the window before 20 needs
    page 3, never stored), 20 for DeepSeek V3.2 (every page of every component is stored)."""
    tokens = prompt()
    options = {"snapshots": (8, 16), "offload_at": (8,)}
    if arch in STATE_ARCHS:
        cache, at, _ = round_trip(arch, "memory", tokens, 24, **options)
        assert at == 16
        assert continues_bitwise(arch, cache, tokens, at)
    other = torch.cat([tokens[:, :20], prompt(7, seed=3)], dim=1)
    cache, at, _ = round_trip(arch, "memory", tokens, 24, other, **options)
    assert at == {"deepseek_v32": 20, **dict.fromkeys(SWA_ARCHS, 8)}.get(arch, 16)
    assert continues_bitwise(arch, cache, other, at)


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_a_prompt_of_exactly_the_stored_length_recomputes_its_last_page(arch):
    tokens = prompt(16)
    cache, at, found = round_trip(arch, "memory", tokens, 16, snapshots=(8, 12, 16), offload_at=(8, 12))
    assert at == 12 and max(found.lengths) == 12  # 16 would leave no token to compute (vLLM #44599)
    assert continues_bitwise(arch, cache, tokens, at)


def tenant_round_trip(arch, layout, tokens, namespace, load_namespace):
    """Fresh memory stores, and :func:`round_trip` of 24 tokens stored under ``namespace`` (snapshots
    at 8, 16, 24; offloaded at 8, 16) and loaded under ``load_namespace``: ``(stores, its result)``."""
    stores = rig.open_stores(layout, "memory")
    found = round_trip(
        arch,
        "memory",
        tokens,
        24,
        stores=dict(stores),
        namespace=namespace,
        load_namespace=load_namespace,
        snapshots=(8, 16, 24),
        offload_at=(8, 16),
    )
    return stores, found


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_tenants_and_adapters_share_no_entry_of_any_component(arch):
    model, layout = model_of(arch)
    tokens = prompt()
    mine = {"extra_key": "lora-a", "cache_salt": "tenant-1"}
    for other in (
        {"extra_key": "lora-a", "cache_salt": "tenant-2"},
        {"extra_key": "lora-b", "cache_salt": "tenant-1"},
        {},
    ):
        stores, (_, at, _) = tenant_round_trip(arch, layout, tokens, mine, other)
        keys = rig.page_keys(tokens, **other)
        assert at == 0
        assert not any(any(store.exists(keys)) for store in stores.values())  # no component holds their keys
    stores, (cache, at, _) = tenant_round_trip(arch, layout, tokens, mine, mine)
    assert at == 24
    assert all(any(store.exists(rig.page_keys(tokens, **mine))) for store in stores.values())  # every component
    assert continues_bitwise(arch, cache, tokens, at)


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_an_evicted_snapshot_rounds_the_hit_down(arch):
    """A state store with room for two snapshots, handed them at 24, 16, 8 (after the prefill):
    the one at 24 is evicted (least recently used); the hit resumes at 16."""
    model, layout = model_of(arch)
    stores = rig.open_stores(layout, "memory")
    snapshot = layout.component("state").entry_bytes(PAGE)
    stores["state"] = open_storage(f"memory:{2 * snapshot}", layout.fingerprints("tiny", page_size=PAGE)["state"])
    tokens = prompt()
    cache, at, found = round_trip(
        arch, "memory", tokens, 24, stores=stores, snapshots=(24, 16, 8), offload_at=(8, 16), late_snapshots=True
    )
    assert stores["state"].stats.pages_evicted == 1
    assert found.lengths == (8, 16) and at == 16
    assert continues_bitwise(arch, cache, tokens, at)


@pytest.mark.parametrize("arch", SWA_ARCHS)
def test_a_corrupt_window_page_is_a_miss_never_wrong_kv(arch, tmp_path):
    """Offloaded at 16 and finished at 24 (window pages 2 .. 5 stored); page 5's window entry
    corrupted on disk: the lookup still sees 24, its read fails the checksum, and the load
    resumes at 20, whose window (pages 3 and 4) is intact."""
    model, layout = model_of(arch)
    tokens = prompt()
    url = f"file:{tmp_path}"
    stores = rig.open_stores(layout, url)
    rig.store_with_manager(model, layout, tokens, 24, stores, max_tokens=MAX_TOKENS, offload_at=(16,))
    keys = rig.page_keys(tokens)
    assert stores["swa"].exists(keys) == [False, False, True, True, True, True]
    path = stores["swa"].path_of(keys[5])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    rig.close_stores(stores)
    readers = rig.open_stores(layout, url)
    try:
        cache, at, found = rig.load_with_manager(model, layout, tokens, readers, max_tokens=MAX_TOKENS)
    finally:
        rig.close_stores(readers)
    assert max(found.lengths) == 24 and at == 20
    assert continues_bitwise(arch, cache, tokens, at)


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_a_loaded_request_computes_and_stores_the_rest_then_loads_whole(arch):
    """A stores 16 tokens (snapshots at 8 and 16); B loads 16 layer by layer, computes pages
    16 .. 23 on the rebuilt cache and stores them (the chain goes on from the loaded prefix, its
    snapshot at 24); C loads 24 and continues bitwise."""
    model, layout = model_of(arch)
    tokens = prompt()
    stores = rig.open_stores(layout, "memory")
    rig.store_with_manager(model, layout, tokens, 16, stores, max_tokens=MAX_TOKENS, snapshots=(8, 16), offload_at=(8,))
    pools = CachePools(layout, max_tokens=MAX_TOKENS, state_slots=2)
    manager = rig.manager_of(pools, stores)
    req = rig.request(tokens, MAX_TOKENS)
    try:
        cache, at = rig.load_into(manager, pools, model, req, layer_by_layer=True)
        assert at == 16
        for start in range(16, 24, PAGE):
            rig.forward(model, cache, tokens[:, start : start + PAGE])
            pools.copy_in(cache, start, start + PAGE)
        manager.offload(req, kv_length=24)
        if layout.has_state:
            pools.save_state(cache, 1)
            manager.snapshot(req, 24, 1, kv_length=24)
        req.done = True
        manager.finish(req, kv_length=24)
        manager.drain()
    finally:
        manager.close()
    cache, at, _ = rig.load_with_manager(model, layout, tokens, stores, max_tokens=MAX_TOKENS)
    assert at == 24
    assert continues_bitwise(arch, cache, tokens, at)
