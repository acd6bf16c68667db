"""KVStageOffloadingSpec with a hybrid model's KV cache groups, in vLLM 0.33.0's own Scheduler and
connector on CPU (:class:`vllm_hybrid_rig.HybridRig`): each group keeps its own key space; vLLM's
connector scheduler decides which chunks of each group to store (those that can serve a hit) and
to load (a sliding-window group: the window before the hit), and kvstage's worker moves them.

What must hold: the tokens a second request hits are the restorable length kvstage's own rule
(:func:`kvstage.offload.restorable.restorable_lengths`) computes from what each group's store
holds; a sliding-window group reads only its window (:meth:`SlidingWindow.window_pages`); every
loaded block holds exactly the first request's bytes; a second scheduler over the same store hits
as well; a group kind kvstage does not store is refused at start, naming it; a page that cannot be
read is reported as its request (vLLM refuses block ids for several groups), which vLLM looks up
again to the restorable length without that page, and later requests still hit it.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

import torch  # noqa: E402

from kvstage.errors import InvalidArgumentError  # noqa: E402
from kvstage.offload.restorable import pages_to_load, restorable_lengths, swa_store_mask  # noqa: E402

from vllm_hybrid_rig import HybridRig, PartialTailRig  # noqa: E402
from vllm_rig import run_to_prompt_end  # noqa: E402

BLOCK = HybridRig.BLOCK_SIZE
PROMPT = list(range(1, 6 * BLOCK + 6))  # 6 full blocks and 5 tokens


def storage_url(kind: str, tmp_path) -> str:
    return "memory" if kind == "memory" else f"file:{tmp_path / 'kv'}"


def present(rig: HybridRig, request) -> dict[str, list[bool]]:
    """Per component of the rig's layout, whether its group's store holds each of the request's
    block keys (``OffloadKey``: block hash and group index)."""
    from vllm.v1.kv_offload.base import make_offload_key

    spec = rig.spec
    marks = {}
    for group_id, name in spec.group_components.items():
        keys = [make_offload_key(block_hash, group_id).hex() for block_hash in request.block_hashes]
        marks[name] = list(rig.manager.storage.stores[group_id].exists(keys))
    return marks


def assert_loaded_blocks_hold(rig: HybridRig, request_id: str, prompt: list[int], plan: dict[str, range]) -> None:
    """The blocks of each group ``plan`` names (its component's page indices) hold the stand-in
    model's KV bytes for ``prompt``."""
    spec = rig.spec
    for group_id, name in spec.group_components.items():
        blocks = rig.group_block_ids(request_id, group_id)
        for index in plan.get(name, ()):
            for layer in rig.groups[group_id]:
                assert torch.equal(rig.bits[layer][blocks[index]], rig.expected_block(prompt, layer, index)), (
                    group_id,
                    index,
                    layer,
                )


@pytest.mark.parametrize(("kind", "batched"), [("memory", 512), ("file", 512), ("file", 2 * BLOCK)])
def test_a_gpt_oss_like_model_stores_its_groups_apart_and_loads_the_window_only(kind, batched, tmp_path):
    # batched 2 * BLOCK: a chunked prefill, a store job a step
    rig = HybridRig(tmp_path / "model", storage_url(kind, tmp_path), kind="swa", max_num_batched_tokens=batched)
    try:
        layout = rig.spec.layout
        full, window = (layout.component(rig.spec.group_components[g]) for g in (0, 1))
        assert (full.kind, window.kind, window.window) == ("full", "swa", rig.WINDOW)
        first = rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        stores = rig.manager.storage.stores
        assert stores[0].prefix != stores[1].prefix  # a key space per group
        assert stores[0].stats.pages_stored == len(PROMPT) // BLOCK  # every full prompt block
        # vLLM stores only the sliding-window chunks that can serve a hit; at least the window
        assert window.window_pages(BLOCK) <= stores[1].stats.pages_stored <= len(PROMPT) // BLOCK
        marks = present(rig, first)
        expected = restorable_lengths(layout, BLOCK, len(PROMPT), marks).max_length
        assert expected == (len(PROMPT) - 1) // BLOCK * BLOCK  # the whole prompt but its last token's block
        # vLLM's reachable-store rule is kvstage's: the window before the stored segment's end
        pages = len(PROMPT) // BLOCK
        assert marks[window.name][:pages] == swa_store_mask(window, BLOCK, [pages * BLOCK], pages)

        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        scheduled = run_to_prompt_end(rig, "b", PROMPT)
        assert len(PROMPT) - scheduled == expected  # tokens hit: the restorable length
        plan = pages_to_load(layout, BLOCK, expected)
        assert stores[0].stats.pages_read == len(plan[full.name]) == expected // BLOCK
        assert stores[1].stats.pages_read == len(plan[window.name]) == window.window_pages(BLOCK) == 2
        assert_loaded_blocks_hold(rig, "b", PROMPT, plan)
        swa_blocks = rig.group_block_ids("b", 1)
        assert all(block == 0 for block in swa_blocks[: plan[window.name].start])  # not loaded, not held
    finally:
        rig.close()


def test_a_second_scheduler_over_the_same_store_hits_the_restorable_prefix(tmp_path):
    url = storage_url("file", tmp_path)
    first = HybridRig(tmp_path / "model-a", url, kind="swa")
    try:
        first.add_request("a", PROMPT, max_tokens=1)
        first.run_until_idle()
    finally:
        first.close()
    rig = HybridRig(tmp_path / "model-a", url, kind="swa")  # the same model path: the same key spaces
    try:
        layout = rig.spec.layout
        scheduled = run_to_prompt_end(rig, "b", PROMPT)
        request = rig.scheduler.requests["b"]
        expected = restorable_lengths(layout, BLOCK, len(PROMPT), present(rig, request)).max_length
        assert expected == 6 * BLOCK and len(PROMPT) - scheduled == expected
        stores = rig.manager.storage.stores
        assert (stores[0].stats.pages_read, stores[1].stats.pages_read) == (6, 2)
        assert_loaded_blocks_hold(rig, "b", PROMPT, pages_to_load(layout, BLOCK, expected))
    finally:
        rig.close()


def test_a_group_kind_kvstage_does_not_store_is_refused_naming_the_group_and_kind(tmp_path):
    with pytest.raises(
        InvalidArgumentError, match=r"^kv_cache_groups\[1\]: .* group 1 \(layers .*\) is ChunkedLocalAttentionSpec"
    ):
        HybridRig(tmp_path / "model", "memory", kind="chunked")


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_qwen3_next_like_model_stores_one_state_chunk_and_hits_at_its_boundary(kind, tmp_path):
    rig = HybridRig(tmp_path / "model", storage_url(kind, tmp_path), kind="mamba")
    try:
        layout = rig.spec.layout
        names = rig.spec.group_components
        assert [layout.component(names[g]).kind for g in range(4)] == ["full", "state", "state", "state"]
        first = rig.add_request("a", PROMPT, max_tokens=1)
        rig.run_until_idle()
        stores = rig.manager.storage.stores
        assert len({store.prefix for store in stores.values()}) == 4  # a key space per group
        assert stores[0].stats.pages_stored == len(PROMPT) // BLOCK
        # vLLM's align mode splits the prefill at the last block boundary before the prompt's end
        # and keeps (and offloads) the state there: one chunk a state group
        assert [stores[g].stats.pages_stored for g in (1, 2, 3)] == [1, 1, 1]
        marks = present(rig, first)
        restorable = restorable_lengths(layout, BLOCK, len(PROMPT), marks)
        assert restorable.lengths == (6 * BLOCK,)  # only where a snapshot is

        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        scheduled = run_to_prompt_end(rig, "b", PROMPT)
        assert len(PROMPT) - scheduled == restorable.max_length  # rounded down to the state chunk
        plan = pages_to_load(layout, BLOCK, restorable.max_length)
        assert stores[0].stats.pages_read == len(plan["g0"]) == 6
        assert [stores[g].stats.pages_read for g in (1, 2, 3)] == [len(plan[names[g]]) for g in (1, 2, 3)] == [1, 1, 1]
        assert_loaded_blocks_hold(rig, "b", PROMPT, {"g0": plan["g0"]})
        for group in (1, 2, 3):
            (name,) = rig.groups[group]
            (index,) = plan[names[group]]  # the snapshot after 96 tokens, under h_5
            block = rig.group_block_ids("b", group)[index]
            assert block != 0
            assert torch.equal(rig.rows[block, : rig.state_bytes], rig.state_after(PROMPT[: (index + 1) * BLOCK], name))
    finally:
        rig.close()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_qwen3_next_like_model_hashed_finer_than_its_blocks_stores_and_hits_a_partial_tail(kind, tmp_path):
    # Blocks of 32 tokens hashed every 16 (prefix_match_unit): vLLM's scheduler also looks up and
    # stores a partial tail (the block and each state at the last hash boundary inside a block),
    # recording a position for every boundary key it looks up. Before kvstage linked each chunk
    # to the chunk before it only, a chunk's predecessor was a partial-tail key never stored:
    # every full-attention page was refused (MissingPriorError) and the second request missed.
    rig = PartialTailRig(tmp_path / "model", storage_url(kind, tmp_path))
    try:
        block = PartialTailRig.BLOCK_SIZE
        assert rig.scheduler.connector.connector_scheduler.config.supports_partial_tail
        prompt = list(range(1, 3 * block + 21))  # 116 tokens: 3 blocks, the last boundary inside a block at 112
        rig.add_request("a", prompt, max_tokens=1)
        rig.run_until_idle()
        stores = rig.manager.storage.stores
        # full attention: 3 blocks and the partial tail; each state group: the state at 96 and at 112
        assert [stores[g].stats.pages_stored for g in range(4)] == [4, 2, 2, 2]
        assert rig.worker.connector_worker.worker.pages_failed == 0

        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        assert run_to_prompt_end(rig, "b", prompt) == len(prompt) - 112
        assert [stores[g].stats.pages_read for g in range(4)] == [4, 1, 1, 1]
        blocks = rig.group_block_ids("b", 0)
        for layer in rig.groups[0]:
            for index in range(3):
                assert torch.equal(rig.bits[layer][blocks[index]], rig.expected_block(prompt, layer, index)), index
            tail = torch.stack([rig.token_bits(prompt[p], p, layer) for p in range(3 * block, 112)], dim=1)
            assert torch.equal(rig.bits[layer][blocks[3]][:, : 112 - 3 * block], tail)
        for group in (1, 2, 3):
            (name,) = rig.groups[group]
            assert torch.equal(rig.resumed_states["b", 112, name], rig.state_after(prompt[:112], name)), group
    finally:
        rig.close()


def test_a_mamba_group_outside_align_mode_is_refused_naming_the_mode():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvstage.integrations.vllm.groups import group_layout

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    state = MambaSpec(block_size=16, shapes=((4, 3),), dtypes=(torch.float16,), mamba_cache_mode="all")
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.1.attn"], full), KVCacheGroupSpec(["layers.0.mixer"], state)],
    )
    with pytest.raises(InvalidArgumentError, match=r"^kv_cache_groups\[1\]: .*is MambaSpec \(mamba_cache_mode 'all'\)"):
        group_layout(config, (0, 1))
    layout, names = group_layout(config, (0,))  # the full-attention group alone is a plain component
    assert names == {0: "g0"} and layout.component("g0").layers == (0,)


@pytest.mark.parametrize("by_request", [False, True])
def test_a_failed_load_names_each_groups_blocks_from_its_first_page_not_read(by_request):
    # One load job over two groups' key spaces: group 0's pages all read, group 1's second is
    # missing; its blocks from that one on are named (by_request: the job, whose request the
    # connector names), and the page it stopped at, and nothing of group 0.
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        make_offload_key,
    )

    from kvstage.integrations.vllm import KVStageWorker
    from kvstage.integrations.vllm.groups import GroupStores
    from kvstage.integrations.vllm.manager import KVStageLoadStoreSpec
    from kvstage.storage import LayoutFingerprint, MemoryStore

    tensor = torch.zeros(8, 64, dtype=torch.int8)  # one layer slot, shared by both groups' layer
    kv_caches = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 64)], [[CanonicalKVCacheRef(0, 64)]] * 2)
    stores = {g: MemoryStore(LayoutFingerprint.opaque("m", page_bytes=64, page_format=f"g{g}")) for g in (0, 3)}
    keys = {g: [make_offload_key(bytes([i]) * 32, g).hex() for i in range(3)] for g in (0, 3)}
    pages = {key: torch.randint(0, 256, (64,), dtype=torch.uint8) for g in (0, 3) for key in keys[g]}
    for g in (0, 3):
        held = [key for key in keys[g] if key != keys[3][1]]
        stores[g].put(held, [pages[key] for key in held])
    worker = KVStageWorker(
        kv_caches,
        GroupStores(stores),
        num_host_pages=2,
        report_load_errors=True,
        load_errors_by_request=by_request,
        group_ids=(0, 3),
    )
    try:
        spec = GPULoadStoreSpec([1, 2, 3, 5, 6, 7], group_sizes=[3, 3], block_indices=[0, 0])
        assert worker.submit_load(9, KVStageLoadStoreSpec(keys[0] + keys[3]), spec)
        worker.wait({9})
        [result] = worker.get_finished()
        assert result.job_id == 9 and result.success  # done: its failed blocks go to vLLM's scheduler
        assert worker.take_block_ids_with_load_errors() == (set() if by_request else {6, 7})
        assert worker.take_failed_load_jobs() == ([9] if by_request else []) and worker.loads_failed == 1
        assert worker.take_unreadable_keys() == [keys[3][1]]  # the page the load stopped at, once
        assert (worker.take_unreadable_keys(), worker.take_failed_load_jobs()) == ([], [])
        for block, key in zip([1, 2, 3, 5], keys[0] + keys[3][:1]):
            assert torch.equal(tensor[block].view(torch.uint8), pages[key])
        assert not tensor[6].any() and not tensor[7].any()
    finally:
        worker.close()


@pytest.mark.parametrize("store", ["file", "mooncake"])
@pytest.mark.parametrize(("kind", "reads"), [("swa", {"0": 6, "1": 2}), ("mamba", {"0": 6, "1": 1, "2": 1, "3": 1})])
def test_another_engine_process_hits_the_restorable_prefix_of_the_shared_store(kind, reads, store, tmp_path):
    # The first engine stores through its Scheduler and worker; a second process (its own vLLM)
    # looks the request up in the same store, loads every group, and checks each block's bytes.
    import contextlib
    import json
    import os
    import pathlib
    import subprocess
    import sys

    with contextlib.ExitStack() as stack:
        if store == "mooncake":
            from kvstage.storage.mooncake.store import master_binary, mooncake_available

            from mooncake_master import LocalMooncakeMaster

            if not (mooncake_available() and master_binary()):
                pytest.skip("the Mooncake store is not installed (make .venv/.mooncake)")
            url = stack.enter_context(LocalMooncakeMaster(tmp_path / "master.log")).url()
        else:
            url = storage_url("file", tmp_path)
        first = HybridRig(tmp_path / "model", url, kind=kind)
        stack.callback(first.close)  # a Mooncake client's segment holds its pages: open until the second is done
        first.add_request("a", PROMPT, max_tokens=1)
        first.run_until_idle()
        stored = {str(g): s.stats.pages_stored for g, s in first.manager.storage.stores.items()}
        assert all(stored.values()), stored
        tests = pathlib.Path(__file__).parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
        script = pathlib.Path(__file__).with_name("hybrid_second_engine.py")
        done = subprocess.run(
            [sys.executable, str(script), kind, str(tmp_path / "model"), url],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["hit"] == report["restorable"] == 6 * BLOCK  # the other process's stores, restorable there
    assert report["pages_read"] == reads and report["exact"]
    assert report["loads_failed"] == 0 and report["load_errors"] == {g: [] for g in reads}  # per group


@pytest.mark.parametrize(
    ("kind", "group", "block", "restorable"),
    [
        ("swa", 1, 4, 4 * BLOCK),  # in the windows ending at blocks 6 and 5: a0's window, ending at 4
        ("swa", 0, 5, 5 * BLOCK),  # the last full-attention chunk: the window ending at block 5
        ("mamba", 2, 5, 4 * BLOCK),  # one group's state snapshot at 6 blocks: the snapshot at 4
    ],
)
def test_a_hybrid_load_of_a_page_that_cannot_be_read_is_looked_up_again_to_what_is_restorable(
    kind, group, block, restorable, tmp_path
):
    # vLLM 0.33's Scheduler refuses block ids of failed loads for several KV cache groups (a block
    # id is unique within its group only): KVStageConnector names the request (failed_recving),
    # vLLM drops its loaded tokens and looks it up again, and by then the page the load stopped at
    # is a miss, so the request hits the restorable length of what every group still holds.
    from vllm.v1.kv_offload.base import make_offload_key

    # miss_ttl_s 60: the bad page stays a miss for the whole test, however slow the machine
    rig = HybridRig(tmp_path / "model", storage_url("file", tmp_path), kind=kind, extra_config={"miss_ttl_s": 60})
    try:
        layout = rig.spec.layout
        rig.add_request("a0", PROMPT[: 4 * BLOCK + 5], max_tokens=1)  # its window / state at 4 blocks
        rig.run_until_idle()
        first = rig.add_request("a", PROMPT, max_tokens=1)  # and at 6
        rig.run_until_idle()
        marks = present(rig, first)
        assert restorable_lengths(layout, BLOCK, len(PROMPT), marks).max_length == 6 * BLOCK
        key = make_offload_key(first.block_hashes[block], group).hex()
        store = rig.worker.connector_worker.worker.storage.stores[group]
        get = store.get  # the page exists (exists says yes) and cannot be read
        store.get = lambda keys, into: [hit and k != key for k, hit in zip(keys, get(keys, into))]
        name = rig.spec.group_components[group]
        assert marks[name][block]
        marks[name][block] = False
        assert restorable_lengths(layout, BLOCK, len(PROMPT), marks).max_length == restorable  # kvstage's rule

        hits = []  # what vLLM's scheduler was offered for b, lookup by lookup
        matched = rig.scheduler.connector.get_num_new_matched_tokens

        def recorded_matched(request, *args, **kwargs):
            found = matched(request, *args, **kwargs)
            if request.request_id in ("b", "c") and found[0] is not None:
                hits.append((request.request_id, found[0]))
            return found

        rig.scheduler.connector.get_num_new_matched_tokens = recorded_matched
        failed_requests, failed_blocks = [], []  # what the worker side told the scheduler, step by step
        results, errors = rig.worker.get_transfer_results, rig.worker.get_block_ids_with_load_errors

        def recorded_results(finished):
            out = results(finished)
            failed_requests.append(out.failed_recving)
            assert out.failed_recving <= out.finished_recving  # vLLM's output aggregator passes only those
            return out

        rig.worker.get_transfer_results = recorded_results
        rig.worker.get_block_ids_with_load_errors = lambda: failed_blocks.append(errors()) or failed_blocks[-1]
        worker = rig.worker.connector_worker.worker
        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        scheduled = run_to_prompt_end(rig, "b", PROMPT)
        assert worker.loads_failed == 1
        assert [failed for failed in failed_requests if failed] == [{"b"}]  # the request, once
        assert failed_blocks and not any(failed_blocks)  # never block ids: vLLM's scheduler raises on them here
        # offered the whole prefix, then (its load failed) the restorable length without the bad page
        assert hits == [("b", 6 * BLOCK), ("b", restorable)]
        assert len(PROMPT) - scheduled == restorable  # the rest computed
        plan = pages_to_load(layout, BLOCK, 6 * BLOCK)
        checked = {"g0": plan["g0"]} if kind == "mamba" else plan  # the state rows: the Mamba test's check
        assert_loaded_blocks_hold(rig, "b", PROMPT, checked)  # loaded or computed, never wrong KV
        rig.run_until_idle()  # the scheduler keeps running: b finishes
        assert "b" not in rig.scheduler.requests

        # another request hits what is still good, and no load fails again
        rig.scheduler.reset_prefix_cache()
        rig.backing.zero_()
        assert len(PROMPT) - run_to_prompt_end(rig, "c", PROMPT) == restorable
        assert hits[2:] == [("c", restorable)] and worker.loads_failed == 1
        assert_loaded_blocks_hold(rig, "c", PROMPT, checked)
        rig.run_until_idle()
    finally:
        rig.close()


def test_sync_loads_of_a_hybrid_model_are_refused_naming_the_budget(tmp_path):
    # a sync load's request runs in the step of its load: vLLM 0.33 has no path to recompute it
    # when a group's page fails (block ids raise for several groups, failed_recving names waiting requests)
    with pytest.raises(
        InvalidArgumentError, match=r"^sync_load_budget_bytes: must be 0 for a model of 2 KV cache groups"
    ):
        HybridRig(tmp_path / "model", "memory", kind="swa", extra_config={"sync_load_budget_bytes": 1 << 20})
