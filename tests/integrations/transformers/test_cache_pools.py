"""``CachePools`` on six tiny hybrid transformers models, and the direct store/load path through it:
prefill, store every component (kvstage gather, one key space per component), drop every cache,
load the restorable prefix into fresh pools (get, scatter), rebuild a ``DynamicCache`` at ``L`` and
continue: logits ``torch.equal`` to transformers continuing its own cache after the same chunked
prefill of ``L`` tokens. Over the memory and file stores and a real Mooncake master. The cases of
the manager's path (round-down, exact length, namespaces, eviction) are test_hybrid_oracle's."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.integrations.transformers import model_layout
from kvstage.integrations.transformers.cache_pools import CachePools, record_window
from kvstage.kernels import KVPool

import hybrid_models as hm
import hybrid_rig as rig
from hybrid_rig import PAGE, one_thread  # noqa: F401 (an autouse fixture of these files)

MAX_TOKENS = 32
PROMPT = 27  # 6 whole pages and 3 tokens: 24 tokens restorable at most
SWA_ARCHS = ("gpt_oss", "gemma3")


model_of = rig.model_of


def prompt(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return rig.prompt(length, seed)


following = rig.following


def engine_run(arch: str, tokens: torch.Tensor, length: int, snapshots=()):
    """The in-process run whose KV is stored: a page-by-page prefill of ``length`` tokens into pools."""
    model, layout = model_of(arch)
    pools = CachePools(layout, max_tokens=MAX_TOKENS, state_slots=max(len(snapshots), 1))
    rig.prefill(model, tokens, length, pools, snapshots if layout.has_state else ())
    return pools


def stored_and_loaded(arch, url, tokens, length, *, snapshots, resume_lengths=None):
    """Store ``length`` tokens' pages and the snapshots, drop the pools and caches, open the stores
    again (other clients) and load the restorable prefix: ``(pools, loaded length, stored)``."""
    model, layout = model_of(arch)
    pools = engine_run(arch, tokens, length, snapshots)
    keys = rig.page_keys(tokens)
    writers = rig.open_stores(layout, url)
    readers = writers
    try:
        stored = rig.store_direct(pools, writers, keys, length // PAGE, snapshots, resume_lengths)
        del pools
        if url != "memory":  # a memory store is its client's own; Mooncake's pages live in the writer's segment
            readers = rig.open_stores(layout, url)
        loaded, at = rig.load_direct(layout, readers, keys, tokens.shape[1], MAX_TOKENS)
    finally:
        rig.close_stores(writers, readers)
    return loaded, at, stored


def resumed(arch: str, pools: CachePools, tokens: torch.Tensor, length: int) -> list[torch.Tensor]:
    model, layout = model_of(arch)
    cache = pools.to_cache(model.config, length, state_slot=0 if layout.has_state else None)
    return rig.continuation(model, cache, tokens, length)


# -- the pools alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_a_cache_rebuilt_from_the_pools_continues_bitwise(arch):
    model, layout = model_of(arch)
    tokens = prompt()
    snapshots = (8, 16, 24)
    pools = engine_run(arch, tokens, 24, snapshots)
    for slot, length in enumerate(snapshots):
        cache = pools.to_cache(model.config, length, state_slot=slot if layout.has_state else None)
        assert cache.get_seq_length() == length
        assert rig.same(
            rig.continuation(model, cache, following(tokens), length), rig.oracle(model, following(tokens), length)
        )
    if layout.has_state:  # the test can fail: the state after 8 tokens does not continue from 16
        wrong = pools.to_cache(model.config, 16, state_slot=0)
        assert not rig.same(
            rig.continuation(model, wrong, following(tokens), 16), rig.oracle(model, following(tokens), 16)
        )


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_generate_on_a_rebuilt_cache_is_generate_on_the_engines_own(arch):
    """``model.generate(prompt, cache=rebuilt)`` computes the prompt's last 3 tokens and 6 more:
    the same tokens and logits as on the cache the prefill of 24 tokens left."""
    model, layout = model_of(arch)
    tokens = prompt()
    pools = CachePools(layout, max_tokens=MAX_TOKENS, state_slots=1)
    own = rig.prefill(model, tokens, 24, pools, (24,) if layout.has_state else ())
    rebuilt = pools.to_cache(model.config, 24, state_slot=0 if layout.has_state else None)
    options = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    ours, theirs = (model.generate(tokens, cache=cache, **options) for cache in (rebuilt, own))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert rig.same(list(ours.logits), list(theirs.logits))


def test_a_window_layer_refuses_positions_it_no_longer_holds_and_record_window_keeps_them():
    model, layout = model_of("gpt_oss")
    tokens = prompt()
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    rig.forward(model, cache, tokens[:, :12])  # 12 > W - 1 = 7: positions 0..4 are gone
    pools = CachePools(layout, max_tokens=MAX_TOKENS)
    with pytest.raises(InvalidArgumentError, match=r"start: sliding-window layer 0 holds positions from 5 on"):
        pools.copy_in(cache, 0, 12)
    recorded = DynamicCache(config=model.config)
    record_window(recorded)
    logits = rig.forward(model, recorded, tokens[:, :12])
    assert torch.equal(logits, rig.forward(model, DynamicCache(config=model.config), tokens[:, :12]))
    pools.copy_in(recorded, 0, 12)
    assert recorded.layers[0].keys.shape[-2] == 7  # trimmed back to W - 1
    rebuilt = pools.to_cache(model.config, 12)
    assert rig.same(rig.continuation(model, rebuilt, tokens, 12), rig.continuation(model, cache, tokens, 12))


@pytest.mark.parametrize("arch", ["gpt_oss", "jamba", "deepseek_v32"])
def test_bfloat16_caches_round_trip_through_the_pools(arch):
    model = hm.build_model(arch, torch.bfloat16)
    layout = model_layout(model)
    tokens = following(prompt())
    pools = CachePools(layout, max_tokens=MAX_TOKENS, state_slots=1)
    rig.prefill(model, tokens, 16, pools, (16,) if layout.has_state else ())
    assert all(pool.dtype == torch.bfloat16 for pool in pools.pools.values() if isinstance(pool, KVPool))
    cache = pools.to_cache(model.config, 16, state_slot=0 if layout.has_state else None)
    assert rig.same(rig.continuation(model, cache, tokens, 16), rig.oracle(model, tokens, 16))


def test_a_state_of_another_shape_is_refused_before_anything_is_copied():
    jamba, layout = model_of("jamba")
    falcon, _ = model_of("falcon_h1")
    from transformers import DynamicCache

    cache = DynamicCache(config=falcon.config)
    rig.forward(falcon, cache, prompt()[:, :4])
    pools = CachePools(layout, max_tokens=8)
    with pytest.raises(InvalidArgumentError, match=r"cache.layers\[0\]: conv state is \(\(1, 80, 4\)"):
        pools.save_state(cache, 0)
    assert all(t.isnan().all() for t in pools.pools["state"].tensors)  # nothing written


def test_bad_arguments_are_named():
    model, layout = model_of("jamba")
    pools = CachePools(layout, max_tokens=8, state_slots=2)
    with pytest.raises(InvalidArgumentError, match="state_slot: must be a state slot in"):
        pools.to_cache(model.config, 4)
    with pytest.raises(InvalidArgumentError, match="num_tokens: must be in"):
        pools.to_cache(model.config, 9, state_slot=0)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    rig.forward(model, cache, prompt()[:, :4])
    with pytest.raises(InvalidArgumentError, match="slot: must be in"):
        pools.save_state(cache, 2)
    with pytest.raises(InvalidArgumentError, match="start/end"):
        pools.copy_in(cache, 0, 5)
    other = CachePools(model_of("gemma3")[1], max_tokens=8)
    with pytest.raises(InvalidArgumentError, match="no state component"):
        other.save_state(cache, 0)
    with pytest.raises(InvalidArgumentError, match="holds 4 layers|cache layer"):
        other.to_cache(model.config, 4)


# -- the direct store and load path ------------------------------------------------------------------


@pytest.mark.parametrize("arch", hm.ARCHS)
def test_stored_and_loaded_prefix_continues_bitwise(arch, store_url):
    model, layout = model_of(arch)
    tokens = prompt()
    loaded, at, stored = stored_and_loaded(arch, store_url, tokens, 24, snapshots=(8, 16, 24))
    assert at == 24  # every component restorable at the last page (26 tokens could not go further)
    if arch in SWA_ARCHS:
        assert stored.pages["swa"] == [4, 5]  # only the window before 24: ceil(7 / 4) = 2 pages
    assert rig.same(resumed(arch, loaded, following(tokens), at), rig.oracle(model, following(tokens), at))


@pytest.mark.parametrize("arch", SWA_ARCHS)
def test_a_corrupt_window_page_is_a_miss_never_wrong_kv(arch, tmp_path):
    """The window's last page before 24 corrupted on disk: the file store's checksum refuses it,
    so the load resumes at 20, whose window (pages 3 and 4) is intact, and continues bitwise."""
    model, layout = model_of(arch)
    tokens = prompt()
    url = f"file:{tmp_path}"
    pools = engine_run(arch, tokens, 24)
    keys = rig.page_keys(tokens)
    stores = rig.open_stores(layout, url)
    rig.store_direct(pools, stores, keys, 6, resume_lengths=[16, 24])
    path = stores["swa"].path_of(keys[5])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    loaded, at = rig.load_direct(layout, stores, keys, PROMPT, MAX_TOKENS)
    rig.close_stores(stores)
    assert at == 20
    assert rig.same(resumed(arch, loaded, following(tokens), at), rig.oracle(model, following(tokens), at))


def test_components_pass_the_engines_window_kept_to_the_manager():
    # An engine that frees window slots behind a request says what it keeps (README "Hybrid
    # models"); before, components() took no window_kept and the engine built ComponentPools itself.
    pools = CachePools(model_of("gpt_oss")[1], max_tokens=MAX_TOKENS)
    (window,) = pools.layout.of_kind("swa")
    kept = window.window - 1
    components = pools.components(window_kept={window.name: kept})
    assert components.window_kept == {window.name: kept}
    assert components.first_kept_page(window.name, PAGE, 20) == (20 - kept) // PAGE
    assert pools.components().window_kept == {}
    too_few = pools.components(window_kept={window.name: window.window - 2})
    with pytest.raises(InvalidArgumentError, match=rf"^components\.window_kept\['{window.name}'\]: must be an int"):
        too_few.check(pools.kv_pool, PAGE)  # what the manager runs at construction
