"""KVStageOffloadingSpec with a hybrid model under tensor parallelism (TP=2), in vLLM 0.33.0's own
Scheduler and connector on CPU (:class:`vllm_hybrid_rig.HybridTPRig`: the scheduler here, each
rank's worker-side ``KVStageConnector`` in a process of its own, holding half the KV heads and
Mamba states of its own, written by the stand-in model as ``HybridRig``'s).

What must hold, for a gpt-oss-like (sliding window + full) and a Qwen3-Next-like (Mamba align +
full) model over a ``file:`` store: each rank stores every group's pages as at TP=1, in key
spaces of its own (a rank never holds or reads the other's pages); after the prefix cache is
reset and every rank's KV zeroed, the same prompt hits kvstage's restorable length (as at TP=1)
and every block each rank loads holds exactly that rank's bytes (checked in the rank's
process); a second scheduler with two fresh rank processes over the same store hits the same.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    reason="vLLM 0.33.0 is not installed (make .venv-vllm/.installed, then run with .venv-vllm/bin/python)",
)

from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402

from kvstage.integrations.vllm.groups import group_layout  # noqa: E402
from kvstage.offload.restorable import pages_to_load, restorable_lengths, swa_store_mask  # noqa: E402
from kvstage.storage.key_spaces import key_spaces  # noqa: E402

from vllm_hybrid_rig import HybridTPRig  # noqa: E402
from vllm_rig import run_to_prompt_end  # noqa: E402

BLOCK = HybridTPRig.BLOCK_SIZE
PROMPT = list(range(1, 6 * BLOCK + 6))  # 6 full blocks and 5 tokens
PAGES = len(PROMPT) // BLOCK
KINDS = ["swa", "mamba"]


def layout_of(rig: HybridTPRig):
    """kvstage's layout of the rig's groups, and each group id's component name."""
    groups = tuple(range(len(rig.kv_cache_config.kv_cache_groups)))
    return group_layout(rig.kv_cache_config, groups)


def present(rig: HybridTPRig, request) -> list[dict[str, list[bool]]]:
    """Per rank, per component, whether that rank's group store holds each block key of ``request``."""
    _, names = layout_of(rig)
    keys = {g: [make_offload_key(h, g).hex() for h in request.block_hashes] for g in names}
    flat = [key for g in names for key in keys[g]]
    marks = []
    for held in rig.ask("holds", flat):
        it = iter(held)
        marks.append({names[g]: [bool(next(it)) for _ in keys[g]] for g in names})
    return marks


def expected_stored(rig: HybridTPRig) -> dict[int, int]:
    """Pages of PROMPT each group stores at TP=1 (``test_hybrid_spec.py``): every full block; the
    sliding window's chunks vLLM can serve a hit from (kvstage's mask); one state a Mamba group."""
    layout, names = layout_of(rig)
    if rig.kind == "mamba":
        return {0: PAGES, 1: 1, 2: 1, 3: 1}
    window = layout.component(names[1])
    return {0: PAGES, 1: sum(swa_store_mask(window, BLOCK, [PAGES * BLOCK], PAGES))}


def store_first_request(rig: HybridTPRig):
    request = rig.add_request("a", PROMPT, max_tokens=1)
    rig.run_until_idle()
    return request


def hit_and_check(rig: HybridTPRig, request_id: str, restorable: int) -> None:
    """Serve PROMPT as ``request_id``: it hits ``restorable`` tokens, each rank reads the plan's
    pages of every group, and every block loaded on each rank holds that rank's bytes (checked
    in the rank's process), which differ between the ranks."""
    layout, names = layout_of(rig)
    scheduled = run_to_prompt_end(rig, request_id, PROMPT)
    assert len(PROMPT) - scheduled == restorable
    plan = pages_to_load(layout, BLOCK, restorable)
    by_group = {g: list(plan.get(names[g], ())) for g in names}
    reads = {g: len(indices) for g, indices in by_group.items()}
    assert reads == ({0: 6, 1: 1, 2: 1, 3: 1} if rig.kind == "mamba" else {0: 6, 1: 2})
    for rank_groups in rig.ask("groups"):
        assert {g: read for g, (_, _, read) in rank_groups.items()} == reads
    blocks = rig.group_block_ids(request_id)
    assert all(blocks[g][i] != 0 for g, indices in by_group.items() for i in indices)
    assert rig.ask("model", "wrong_blocks", (PROMPT, blocks, by_group)) == [[], []]
    for g, indices in by_group.items():  # the ranks' loaded bytes are their own, not one copy
        for index in indices:
            rank0, rank1 = rig.ask("model", "block_bytes", (blocks[g][index],))
            assert rank0 != rank1, (g, index)
    if rig.kind == "swa":  # the window only: the blocks before it are neither loaded nor held
        assert all(block == 0 for block in blocks[1][: by_group[1][0]])


@pytest.fixture(scope="module", params=KINDS)
def engine(request, tmp_path_factory):
    """A HybridTPRig of ``kind`` over a file store, after serving PROMPT once (request "a"); one
    per kind for this module (its rank processes take most of a test's time to start)."""
    directory = tmp_path_factory.mktemp(f"tp-{request.param}")
    rig = HybridTPRig(directory / "model", f"file:{directory / 'kv'}", kind=request.param)
    try:
        yield rig, store_first_request(rig), directory
    finally:
        rig.close()


def test_tp2_each_rank_stores_every_groups_pages_in_a_key_space_of_its_own(engine):
    rig, first, directory = engine
    want = expected_stored(rig)
    ranks = rig.ask("groups")
    for rank_groups in ranks:
        assert {g: pages for g, (_, pages, _) in rank_groups.items()} == want
    prefixes = [{g: prefix for g, (prefix, _, _) in rank_groups.items()} for rank_groups in ranks]
    assert set(prefixes[0].values()).isdisjoint(prefixes[1].values())  # rank 0's key spaces are not rank 1's
    assert len(set(prefixes[0].values())) == len(want)  # and a key space per group
    on_disk = {space.prefix: space.pages for space in key_spaces(directory / "kv")}
    assert on_disk == {prefixes[rank][g]: want[g] for rank in (0, 1) for g in want}
    marks = present(rig, first)
    assert marks[0] == marks[1]  # both ranks hold the same blocks, each in its own key space
    layout, _ = layout_of(rig)
    assert restorable_lengths(layout, BLOCK, len(PROMPT), marks[1]).max_length == PAGES * BLOCK
    # the scheduler's manager asks rank 0's key spaces (the workers report what they could not write)
    assert {g: store.prefix for g, store in rig.manager.storage.stores.items()} == prefixes[0]


def test_tp2_after_a_reset_the_prompt_hits_the_restorable_length_and_each_rank_loads_its_own_bytes(engine):
    rig, first, _ = engine
    layout, _ = layout_of(rig)
    marks = present(rig, first)
    restorable = restorable_lengths(layout, BLOCK, len(PROMPT), marks[0]).max_length
    # as at TP=1: full blocks and the window before them (swa), rounded down to the state chunk (mamba)
    assert restorable == 6 * BLOCK
    assert rig.scheduler.reset_prefix_cache()
    rig.ask("model", "zero_kv", ())
    hit_and_check(rig, "b", restorable)


def test_tp2_a_second_scheduler_with_fresh_ranks_over_the_same_store_hits_the_same(engine):
    first, _, directory = engine  # still serving: two engines of two ranks each share the store
    rig = HybridTPRig(directory / "model", f"file:{directory / 'kv'}", kind=first.kind)  # the same key spaces
    try:
        hit_and_check(rig, "b", 6 * BLOCK)
    finally:
        rig.close()
