"""Head-group keying (kvstage.storage.head_groups): pages of K/V split into tp_lcm_size groups of
KV heads, one key space for every TP size, each rank writing and reading its own groups."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, PutStatus
from kvstage.storage.fingerprint import prefix_differences
from kvstage.storage.head_groups import HeadGroups, head_group_key

HEADS, LAYERS, PAGE, DIM = 4, 2, 2, 3


def rank_layout(tp_size: int) -> KVLayout:
    return KVLayout(LAYERS, 2, HEADS // tp_size, DIM, "float32")


def groups_of(rank: int, size: int, lcm: int = 4) -> HeadGroups:
    return HeadGroups.for_layout(rank_layout(size), tp_lcm_size=lcm, tp_rank=rank, tp_size=size)


def fingerprint(groups: HeadGroups) -> LayoutFingerprint:
    entry = groups.entry_layout(rank_layout(groups.tp_size))
    return LayoutFingerprint(
        "org/model", entry, PAGE, tp_rank=groups.tp_rank, tp_size=groups.tp_size, head_groups=groups.tp_lcm_size
    )


def test_each_rank_holds_its_consecutive_share_of_the_groups():
    assert [list(groups_of(r, 2).groups) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(groups_of(r, 4).groups) for r in range(4)] == [[0], [1], [2], [3]]
    assert list(groups_of(0, 1).groups) == [0, 1, 2, 3]
    assert groups_of(1, 2).entry_keys(["a", "b"]) == ["a.h2", "a.h3", "b.h2", "b.h3"]
    assert head_group_key("a", 3) == "a.h3"


def test_the_key_space_is_the_same_for_every_tp_size_and_rank_and_names_the_groups():
    prefixes = {fingerprint(groups_of(r, n)).prefix() for n in (1, 2, 4) for r in range(n)}
    assert prefixes == {"org_model-c87c0c64@float32@L0-1xKV2xH1xD3@P2@hg4@"}
    # without head groups: today's key space per rank and size
    assert (
        LayoutFingerprint("org/model", rank_layout(2), PAGE, tp_rank=1, tp_size=2)
        .prefix()
        .endswith("xH2xD3@P2@tp1of2@")
    )
    assert fingerprint(groups_of(0, 2, lcm=2)).prefix().endswith("xH2xD3@P2@hg2@")  # lcm 2: another key space
    per_rank = LayoutFingerprint("org/model", rank_layout(2), PAGE, tp_rank=0, tp_size=2).prefix()
    assert prefix_differences(fingerprint(groups_of(0, 2)).prefix(), per_rank) == [
        "num_heads 1 (this store: 2)",
        "shard hg4 (this store: tp0of2)",
    ]


@pytest.mark.parametrize("writers,readers", list(itertools.product([1, 2, 4], repeat=2)))
def test_entries_written_by_n_ranks_are_the_heads_each_of_m_ranks_reads(tmp_path, writers, readers):
    """The model's page [L, 2, page, HEADS, D]; each rank's page is its heads' slice."""
    model_page = torch.randn(LAYERS, 2, PAGE, HEADS, DIM)
    for rank in range(writers):  # each rank a process of its own, with its own store
        groups = groups_of(rank, writers)
        share = HEADS // writers
        page = model_page[:, :, :, rank * share : (rank + 1) * share].contiguous()
        entries = [entry.contiguous() for entry in groups.entry_views([page], page.shape)]
        with FileStore(fingerprint(groups), tmp_path) as store:
            assert store.put(groups.entry_keys(["p"]), entries) == [PutStatus.STORED] * groups.per_rank
    assert len(list(tmp_path.glob("*.kvpage"))) == 4  # one entry per group, whatever the TP size
    for rank in range(readers):
        groups = groups_of(rank, readers)
        share = HEADS // readers
        page = torch.zeros(LAYERS, 2, PAGE, share, DIM)
        entries = groups.entry_views([page], page.shape)
        with FileStore(fingerprint(groups), tmp_path) as store:
            assert groups.page_hits(store.get(groups.entry_keys(["p"]), entries)) == [True]
        assert torch.equal(page, model_page[:, :, :, rank * share : (rank + 1) * share])


def test_a_page_is_a_hit_only_when_every_entry_of_it_is():
    assert groups_of(0, 1).page_hits([True, True, True, True, True, False, True, True]) == [True, False]


def test_bad_tp_lcm_size_and_mla_are_refused_naming_the_argument_and_rule():
    with pytest.raises(InvalidArgumentError, match=r"^tp_lcm_size: must be a positive multiple of tp_size 2"):
        HeadGroups.for_layout(rank_layout(2), tp_lcm_size=3, tp_rank=0, tp_size=2)
    with pytest.raises(InvalidArgumentError, match=r"KV heads \(4 per rank x tp_size 1 = 4\) to be a multiple of 8"):
        HeadGroups.for_layout(rank_layout(1), tp_lcm_size=8, tp_rank=0, tp_size=1)
    with pytest.raises(InvalidArgumentError, match=r"^cfg.tp_lcm_size: an MLA latent has no KV heads to split"):
        HeadGroups.for_layout(
            KVLayout(2, 1, 1, 8, "bfloat16"), tp_lcm_size=2, tp_rank=0, tp_size=1, argument="cfg.tp_lcm_size"
        )
    with pytest.raises(InvalidArgumentError, match="head_groups: must be 0 or a positive multiple of tp_size 4"):
        LayoutFingerprint("m", rank_layout(4), PAGE, tp_rank=0, tp_size=4, head_groups=2)
    with pytest.raises(InvalidArgumentError, match="head_groups: splits K/V heads: not for MLA"):
        LayoutFingerprint("m", KVLayout(2, 1, 1, 8, "bfloat16"), PAGE, head_groups=2)
