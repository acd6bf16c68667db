"""The engine side and the direct store/load path for the hybrid-model oracle (six tiny transformers
models of ``hybrid_models``): a page-by-page prefill that copies each page into
:class:`~kvstage.integrations.transformers.cache_pools.CachePools` and snapshots the state at the
lengths asked, the oracle (the same chunked prefill to ``L`` in process, then the continuation),
and pools -> gather into host pages -> one store per component key space -> get -> scatter into
fresh pools, with the key rule and restorable lengths of :mod:`kvstage.offload.restorable`.

The continuation is ``N`` tokens in one forward, then one decode step (a cache that resumes
wrong shows in either); logits are compared with ``torch.equal``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from kvstage.hashing import PageHasher
from kvstage.integrations.transformers.cache_pools import CachePools
from kvstage.kernels import gather, gather_state, scatter, scatter_state, staging_shape
from kvstage.model_layout import ModelLayout
from kvstage.offload.restorable import pages_to_load, restorable_lengths, snapshot_key_index, swa_store_mask
from kvstage.storage import open_storage

from mooncake_master import LocalMooncakeMaster
from support import skip_missing

PAGE = 4  # tokens per page: the window (8) spans ceil(7 / 4) = 2 pages
CONTINUE = 3  # tokens of the continuation's first forward (then one decode step)


_MODELS: dict[str, tuple] = {}


def model_of(arch: str):
    """``(model, layout)`` of ``hybrid_models``' ``arch``, built once per process (the tests share them)."""
    if arch not in _MODELS:
        from kvstage.integrations.transformers import model_layout

        import hybrid_models

        model = hybrid_models.build_model(arch)
        _MODELS[arch] = (model, model_layout(model))
    return _MODELS[arch]


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    """``[1, length]`` random token ids (vocabulary 128), seeded."""
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def following(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` and 8 more: the continuation may run past the prompt (the same tokens on both sides)."""
    return torch.cat([tokens, prompt(8, seed=2)], dim=1)


def forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


def prefill(model, tokens: torch.Tensor, length: int, pools: CachePools | None = None, snapshots=()) -> object:
    """A fresh cache after ``tokens[:, :length]`` fed one page at a time (the last chunk partial);
    with ``pools``, each chunk is copied in and the state after ``snapshots[i]`` tokens goes to
    state slot ``i``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    slot_of = {length_: slot for slot, length_ in enumerate(snapshots)}
    for start in range(0, length, PAGE):
        end = min(start + PAGE, length)
        forward(model, cache, tokens[:, start:end])
        if pools is not None:
            pools.copy_in(cache, start, end)
            if end in slot_of:
                pools.save_state(cache, slot_of[end])
    return cache


def continuation(model, cache, tokens: torch.Tensor, start: int) -> list[torch.Tensor]:
    """Logits of ``tokens[start : start + CONTINUE]`` in one forward, then of the next token."""
    first = forward(model, cache, tokens[:, start : start + CONTINUE])
    return [first, forward(model, cache, tokens[:, start + CONTINUE : start + CONTINUE + 1])]


def oracle(model, tokens: torch.Tensor, length: int) -> list[torch.Tensor]:
    """What transformers computes after the same chunked prefill of ``length`` tokens, in process."""
    return continuation(model, prefill(model, tokens, length), tokens, length)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def open_stores(layout: ModelLayout, url: str, *, model_id: str = "tiny") -> dict:
    """One store per component key space (``layout.fingerprints``), all at ``url``."""
    return {name: open_storage(url, fp) for name, fp in layout.fingerprints(model_id, page_size=PAGE).items()}


def close_stores(*groups: dict) -> None:
    """Close every store of ``groups`` (dicts of stores) at once (a Mooncake client takes about 2 s to close)."""
    stores = {id(store): store for group in groups for store in group.values()}
    with ThreadPoolExecutor(max_workers=max(len(stores), 1)) as pool:
        list(pool.map(lambda store: store.close(), stores.values()))


def page_keys(tokens: torch.Tensor, *, extra_key=None, cache_salt=None) -> list[str]:
    return PageHasher(page_size=PAGE).prefill_keys(tokens[0].tolist(), extra_key=extra_key, cache_salt=cache_salt)


def _runs(mask: list[bool]) -> list[range]:
    runs, start = [], None
    for index, on in enumerate([*mask, False]):
        if on and start is None:
            start = index
        elif not on and start is not None:
            runs.append(range(start, index))
            start = None
    return runs


@dataclass
class Stored:
    """What :func:`store_direct` put, per component name: the page indices (state: snapshot key indices)."""

    pages: dict[str, list[int]]


def store_direct(
    pools: CachePools, stores: dict, keys: list[str], num_pages: int, snapshots=(), resume_lengths=None
) -> Stored:
    """Store ``num_pages`` pages of the pools' token components and the snapshots in state slots
    ``0..`` (taken after ``snapshots[i]`` tokens): full and sidecar pages all, sliding-window
    pages only in the window before a resume length (default: the snapshots', or for a model
    without state, ``num_pages``' end), each snapshot under the key of the page that ends at it."""
    layout, put = pools.layout, {}
    if resume_lengths is None:
        resume_lengths = list(snapshots) if layout.has_state else [num_pages * PAGE]
    for component in layout.components:
        store = stores[component.name]
        pool = pools.pools[component.name]
        if component.kind == "state":
            indices = [snapshot_key_index(length, PAGE, num_pages * PAGE) for length in snapshots]
            staging = torch.empty(pool.staging_shape(len(indices)), dtype=torch.uint8)
            gather_state(pool, list(range(len(indices))), staging)
            for row, index in enumerate(indices):  # each snapshot alone: it starts no chain
                assert store.put([keys[index]], [staging[row]]).error is None
            put[component.name] = indices
            continue
        mask = (
            swa_store_mask(component, PAGE, resume_lengths, num_pages)
            if component.kind == "swa"
            else [True] * num_pages
        )
        staging = torch.empty(staging_shape(pool, num_pages, PAGE), dtype=pool.dtype)
        gather(pool, staging, torch.arange(num_pages * PAGE), torch.arange(num_pages), page_size=PAGE)
        for run in _runs(mask):
            prior = keys[run.start - 1] if run.start > 0 and mask[run.start - 1] else None
            answer = store.put([keys[i] for i in run], [staging[i] for i in run], prior_key=prior)
            assert answer.error is None, answer.error
        put[component.name] = [i for i, on in enumerate(mask) if on]
    return Stored(put)


def restorable(layout: ModelLayout, stores: dict, keys: list[str], num_tokens: int, absent=None):
    """The restorable lengths of a ``num_tokens`` prompt with these keys (``absent``: entries read
    as missing, per component)."""
    present = {name: store.exists(keys) for name, store in stores.items()}
    for name, indices in (absent or {}).items():
        for index in indices:
            present[name][index] = False
    return restorable_lengths(layout, PAGE, num_tokens, present)


def load_direct(layout: ModelLayout, stores: dict, keys: list[str], num_tokens: int, max_tokens: int):
    """Fresh pools holding the longest restorable prefix of a ``num_tokens`` prompt: pages into the
    slots of their positions, the snapshot into state slot 0. A get that fails (a corrupt or
    vanished entry) is a miss: the length is looked up again without it. Returns
    ``(pools, length)``; length 0: nothing restorable."""
    absent: dict[str, set[int]] = {}
    while True:
        length = restorable(layout, stores, keys, num_tokens, absent).max_length
        pools = CachePools(layout, max_tokens=max_tokens)
        if length == 0:
            return pools, 0
        failed = False
        for name, pages in pages_to_load(layout, PAGE, length).items():
            store, pool = stores[name], pools.pools[name]
            if layout.component(name).kind == "state":
                staging = torch.empty(pool.staging_shape(1), dtype=torch.uint8)
                if not store.get([keys[pages.start]], [staging[0]])[0]:
                    absent.setdefault(name, set()).add(pages.start)
                    failed = True
                    continue
                scatter_state(staging, pool, [0])
                continue
            staging = torch.empty(staging_shape(pool, len(pages), PAGE), dtype=pool.dtype)
            hits = store.get([keys[i] for i in pages], [staging[j] for j in range(len(pages))])
            if not all(hits):
                absent.setdefault(name, set()).update(i for i, hit in zip(pages, hits) if not hit)
                failed = True
                continue
            slots = torch.arange(pages.start * PAGE, pages.stop * PAGE)
            scatter(staging, pool, slots, torch.arange(len(pages)), page_size=PAGE)
        if not failed:
            return pools, length


# -- the manager's store and load paths -------------------------------------------------------------


def _slots(req) -> torch.Tensor:
    return torch.arange(req.max_tokens)


def manager_of(pools: CachePools, stores: dict):
    """An :class:`OffloadManager` over ``pools`` (:attr:`CachePools.kv_pool` and
    :meth:`CachePools.components`, every pool indexed by position) and one store per component."""
    from kvstage.offload import HostPool, OffloadManager

    return OffloadManager(
        pools.kv_pool,
        HostPool.like(pools.kv_pool, num_pages=pools.max_tokens // PAGE, page_size=PAGE),
        stores,
        PageHasher(page_size=PAGE),
        _slots,
        components=pools.components(),
        backend="torch",
    )


def request(tokens: torch.Tensor, max_tokens: int, rid: int = 0, **namespace):
    from kvstage.offload.testing import SimpleRequest

    req = SimpleRequest(rid, tokens[0].tolist(), **namespace)
    req.max_tokens = max_tokens
    return req


def store_with_manager(
    model,
    layout: ModelLayout,
    tokens: torch.Tensor,
    length: int,
    stores: dict,
    *,
    max_tokens: int,
    snapshots=(),
    offload_at=(),
    late_snapshots: bool = False,
    **namespace,
) -> None:
    """The engine's run through the manager: a page-by-page prefill of ``length`` tokens into
    fresh pools, ``manager.offload`` at each length of ``offload_at`` (a resume point: the window
    before it is stored), ``manager.snapshot`` of the state after each length of ``snapshots``
    (one state slot each: when the prefill reaches it, or with ``late_snapshots`` after the
    prefill, in the order given), then ``finish`` (every whole page to ``length``) and ``drain``."""
    snapshots = tuple(snapshots) if layout.has_state else ()
    pools = CachePools(layout, max_tokens=max_tokens, state_slots=max(len(snapshots), 1))
    manager = manager_of(pools, stores)
    req = request(tokens, max_tokens, **namespace)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    try:
        for start in range(0, length, PAGE):
            end = min(start + PAGE, length)
            forward(model, cache, tokens[:, start:end])
            pools.copy_in(cache, start, end)
            if end in offload_at:
                manager.offload(req, kv_length=end)
            if end in snapshots:
                slot = snapshots.index(end)
                pools.save_state(cache, slot)
                if not late_snapshots:
                    manager.snapshot(req, end, slot, kv_length=end)
        if late_snapshots:
            for slot, end in enumerate(snapshots):
                manager.snapshot(req, end, slot, kv_length=length)
        req.done = True
        manager.finish(req, kv_length=length)
        manager.drain()
    finally:
        manager.close()


def load_into(manager, pools: CachePools, model, req, *, layer_by_layer: bool = False):
    """Prefetch ``req``'s restorable prefix with ``manager`` and load it into ``pools`` (the window
    pages at their positions, the snapshot in state slot 0; with ``layer_by_layer``, waiting for
    each layer in turn); ``(cache rebuilt at the loaded length or None, loaded length)``."""
    layout = pools.layout
    handle = manager.prefetch(req, policy="wait_complete")
    while not handle.ready_to_load():
        handle.wait()
        manager.poll()
    length = handle.pages_ready * PAGE
    windows = {
        c.name: _slots(req)[max(length - c.window_pages(PAGE) * PAGE, 0) : length] for c in layout.of_kind("swa")
    }
    loaded = manager.load(
        handle,
        _slots(req)[:length],
        layer_by_layer=layer_by_layer,
        state_slot=0 if layout.has_state else None,
        component_slots=windows or None,
    )
    if layer_by_layer:
        for layer in range(layout.num_layers):
            loaded.wait_layer(layer)
    loaded.wait()
    while not loaded.done():
        manager.poll()
    assert loaded.error is None, loaded.error
    state_slot = 0 if layout.has_state else None
    return (pools.to_cache(model.config, length, state_slot=state_slot) if length else None), length


def load_with_manager(model, layout: ModelLayout, tokens: torch.Tensor, stores: dict, *, max_tokens: int, **namespace):
    """A fresh engine's load through the manager (:func:`load_into` with fresh pools and manager):
    ``(cache or None, loaded length, the lookup's PrefixMatch)``."""
    pools = CachePools(layout, max_tokens=max_tokens)
    manager = manager_of(pools, stores)
    req = request(tokens, max_tokens, rid=1, **namespace)
    try:
        found = manager.match_prefix(req)
        cache, length = load_into(manager, pools, model, req)
        req.done = True
        manager.abort(req)
        manager.drain()
    finally:
        manager.close()
    return cache, length, found


# Fixtures of the hybrid-model tests (test_cache_pools.py, test_hybrid_oracle.py import them).
@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary, mooncake_available

    if not mooncake_available() or master_binary() is None:
        skip_missing(f"the Mooncake store is not usable here; {INSTALL_HINT}")
    with LocalMooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as running:
        yield running


@pytest.fixture(params=["memory", "file", "mooncake"])
def store_url(request, tmp_path):
    if request.param == "memory":
        return "memory"
    if request.param == "file":
        return f"file:{tmp_path}"
    return request.getfixturevalue("master").url()
