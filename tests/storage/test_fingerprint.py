"""LayoutFingerprint in real deployments: pipeline stages, MLA across TP sizes, K/V ranks, model ids.

Pipeline parallel: two stages on one TP rank hold layers 0-1 and 2-3 of one model with the same
per-stage layout, so their pages have equal sizes and equal page keys; only the layer range in
the prefix keeps stage 1 from deduplicating against (and reading) stage 0's page.
MLA: the latent is the same on every TP rank, so TP 4 rank 0 writes and TP 8 rank 3 reads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, MemoryStore, PutStatus

STAGE_LAYOUT = KVLayout(2, 2, 2, 4, "float32")  # 2 layers a stage, K/V, 2 heads of 4: 256 B a page of 2 tokens
MLA_LAYOUT = KVLayout(4, 1, 1, 8, "bfloat16")  # 4 layers of one 8-wide latent


def stage(first_layer: int) -> LayoutFingerprint:
    return LayoutFingerprint("org/model", STAGE_LAYOUT, 2, first_layer=first_layer)


def mla(tp_rank: int, tp_size: int) -> LayoutFingerprint:
    return LayoutFingerprint("org/deepseek", MLA_LAYOUT, 2, tp_rank=tp_rank, tp_size=tp_size)


def kv(tp_rank: int, tp_size: int) -> LayoutFingerprint:
    return LayoutFingerprint("org/model", STAGE_LAYOUT, 2, tp_rank=tp_rank, tp_size=tp_size)


def filled(fingerprint: LayoutFingerprint, value: int) -> torch.Tensor:
    return torch.full((fingerprint.page_bytes,), value, dtype=torch.uint8)


KEY = prefill_page_keys([1, 2], 2)[0]


def test_pipeline_stages_have_their_own_layer_ranges_and_prefixes():
    first, second = stage(0), stage(2)
    assert first.layers == range(0, 2) and second.layers == range(2, 4)
    assert first.page_bytes == second.page_bytes == 256
    # "org/model" is not file-name safe: sanitized, plus 8 hex digits of SHA-256("org/model").
    assert first.prefix() == "org_model-c87c0c64@float32@L0-1xKV2xH2xD4@P2@tp0of1@"
    assert second.prefix() == "org_model-c87c0c64@float32@L2-3xKV2xH2xD4@P2@tp0of1@"
    assert first.prefix() != second.prefix()


def stage_stores(kind: str, tmp_path):
    """Stage 0's and stage 1's stores: MemoryStores, or FileStores on one directory."""
    if kind == "memory":
        return MemoryStore(stage(0), capacity_pages=4), MemoryStore(stage(2), capacity_pages=4)
    return FileStore(stage(0), tmp_path), FileStore(stage(2), tmp_path)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_stage_1_never_deduplicates_against_or_reads_stage_0s_page(kind, tmp_path):
    store0, store1 = stage_stores(kind, tmp_path)
    assert store0.put([KEY], [filled(stage(0), 10)]) == [PutStatus.STORED]
    assert store1.exists([KEY]) == [False]
    assert store1.put([KEY], [filled(stage(2), 12)]) == [PutStatus.STORED]
    into = torch.zeros(256, dtype=torch.uint8)
    assert store1.get([KEY], [into]) == [True] and torch.equal(into, filled(stage(2), 12))
    assert store0.get([KEY], [into]) == [True] and torch.equal(into, filled(stage(0), 10))
    if kind == "file":
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([store0.file_name(KEY), store1.file_name(KEY)])
        # Reopened, each stage still finds only its own page.
        reopened1 = FileStore(stage(2), tmp_path)
        assert reopened1.get([KEY], [into]) == [True] and torch.equal(into, filled(stage(2), 12))


def test_mla_pages_written_at_tp4_rank0_are_read_at_tp8_rank3(tmp_path):
    writer, reader = mla(0, 4), mla(3, 8)
    assert writer.rank_neutral and reader.rank_neutral
    assert writer.prefix() == reader.prefix()
    assert writer.prefix().endswith("@bfloat16@L0-3xKV1xH1xD8@P2@tp-any@")
    page = torch.arange(writer.page_bytes, dtype=torch.int32).to(torch.uint8)
    assert FileStore(writer, tmp_path).put([KEY], [page]) == [PutStatus.STORED]
    store = FileStore(reader, tmp_path)
    into = torch.zeros_like(page)
    assert store.exists([KEY]) == [True]
    assert store.get([KEY], [into]) == [True] and torch.equal(into, page)


def test_only_mla_rank_0_writes_while_every_kv_rank_does():
    assert [mla(rank, 4).writes_pages for rank in range(4)] == [True, False, False, False]
    assert [mla(rank, 8).writes_pages for rank in range(8)] == [True] + [False] * 7
    assert [kv(rank, 4).writes_pages for rank in range(4)] == [True] * 4
    assert kv(0, 1).writes_pages and mla(0, 1).writes_pages


def test_kv_ranks_never_share_a_key_space():
    prefixes = [kv(rank, size).prefix() for size in (1, 2, 4, 8) for rank in range(size)]
    assert len(set(prefixes)) == len(prefixes) == 15
    assert not kv(0, 4).rank_neutral
    assert kv(1, 4).prefix().endswith("@P2@tp1of4@")


def test_kv_ranks_on_one_directory_do_not_see_each_others_pages(tmp_path):
    rank0, rank1 = FileStore(kv(0, 2), tmp_path), FileStore(kv(1, 2), tmp_path)
    assert rank0.put([KEY], [filled(kv(0, 2), 1)]) == [PutStatus.STORED]
    assert rank1.exists([KEY]) == [False]
    assert rank1.put([KEY], [filled(kv(1, 2), 2)]) == [PutStatus.STORED]


def test_model_ids_that_sanitize_alike_keep_distinct_prefixes():
    slash = LayoutFingerprint("org/model", STAGE_LAYOUT, 2).prefix()
    underscore = LayoutFingerprint("org_model", STAGE_LAYOUT, 2).prefix()
    accented = LayoutFingerprint("org/modèle", STAGE_LAYOUT, 2).prefix()
    assert underscore == "org_model@float32@L0-1xKV2xH2xD4@P2@tp0of1@"  # already safe: as given
    assert len({slash, underscore, accented}) == 3
    for prefix in (slash, accented):
        assert all(c.isascii() and (c.isalnum() or c in "._-@") for c in prefix), prefix


def test_stages_on_one_directory_count_and_evict_only_their_own_pages(tmp_path):
    store1 = FileStore(stage(2), tmp_path)
    assert store1.put([KEY], [filled(stage(2), 12)]) == [PutStatus.STORED]
    page_file_bytes = store1.used_bytes
    # Stage 0 opens the shared directory with room for one page and writes two chains' heads.
    store0 = FileStore(stage(0), tmp_path, capacity_bytes=page_file_bytes)
    assert store0.used_bytes == 0
    other = prefill_page_keys([3, 4], 2)[0]
    assert store0.put([KEY], [filled(stage(0), 10)]) == [PutStatus.STORED]
    assert store0.put([other], [filled(stage(0), 11)]) == [PutStatus.STORED]  # evicts stage 0's KEY
    assert store0.exists([KEY, other]) == [False, True]
    assert store1.exists([KEY]) == [True] and store1.used_bytes == page_file_bytes


# Which setting two key spaces differ in (the file store's log on opening a shared directory).
BASE = LayoutFingerprint("org/model", KVLayout(4, 2, 8, 128, "bfloat16"), 16, tp_rank=0, tp_size=2)


@pytest.mark.parametrize(
    "other,said",
    [
        (dataclasses.replace(BASE, page_size=64), ["page_size 64 (this store: 16)"]),
        (
            dataclasses.replace(BASE, model_id="org/model-v2"),
            ["model_id org_model-v2-76eadac9 (this store: org_model-c87c0c64)"],
        ),
        (dataclasses.replace(BASE, layout=KVLayout(4, 2, 8, 128, "float16")), ["dtype float16 (this store: bfloat16)"]),
        (dataclasses.replace(BASE, layout=KVLayout(4, 2, 4, 128, "bfloat16")), ["num_heads 4 (this store: 8)"]),
        (dataclasses.replace(BASE, first_layer=4), ["layers 4-7 (this store: 0-3)"]),
        (dataclasses.replace(BASE, tp_rank=1), ["shard tp1of2 (this store: tp0of2)"]),
        (
            dataclasses.replace(BASE, page_size=64, tp_rank=1, tp_size=4),
            ["page_size 64 (this store: 16)", "shard tp1of4 (this store: tp0of2)"],
        ),
        (
            LayoutFingerprint.opaque("org/model", page_bytes=4096, page_format="f"),
            ["page kind: an engine's own page format (this store: a KV layout)"],
        ),
    ],
)
def test_prefix_differences_name_each_setting_that_differs(other, said):
    from kvstage.storage.fingerprint import prefix_differences

    assert prefix_differences(other.prefix(), BASE.prefix()) == said
    assert prefix_differences(BASE.prefix(), BASE.prefix()) == []


def test_opaque_formats_differ_by_the_parts_of_their_descriptions():
    from kvstage.storage.fingerprint import prefix_differences

    mine = LayoutFingerprint.opaque(
        "m", page_bytes=4096, page_format="vllm-block-v1|dtype=bfloat16|g0:16tok:l0,l1|tph=16"
    )
    theirs = LayoutFingerprint.opaque(
        "m", page_bytes=4096, page_format="vllm-block-v1|dtype=float16|g0:16tok:l0,l1|tph=16"
    )
    formats = {mine.prefix(): mine.page_format, theirs.prefix(): theirs.page_format}
    assert prefix_differences(theirs.prefix(), mine.prefix(), formats) == [
        "page_format dtype=float16 (this store: dtype=bfloat16)"
    ]
    blocks = LayoutFingerprint.opaque(
        "m", page_bytes=8192, page_format="vllm-block-v1|dtype=bfloat16|g0:32tok:l0,l1|tph=16"
    )
    formats[blocks.prefix()] = blocks.page_format
    assert prefix_differences(blocks.prefix(), mine.prefix(), formats) == [
        "page_format g0:32tok:l0,l1 (this store: g0:16tok:l0,l1)",
        "page_bytes 8192 (this store: 4096)",
    ]
    # a format the directory does not describe: its digest, and this store's format
    digest = theirs.prefix().split("@")[1][len("opaque-") :]
    assert prefix_differences(theirs.prefix(), mine.prefix(), {mine.prefix(): mine.page_format}) == [
        f"page_format with digest {digest}, not described (this store: vllm-block-v1|dtype=bfloat16|g0:16tok:l0,l1|tph=16)"
    ]


def test_a_missing_model_id_names_the_argument_and_what_it_is_for():
    """``LayoutFingerprint.of(pool, page_size=...)`` without ``model_id`` was Python's bare
    ``TypeError: of() missing 1 required keyword-only argument``, saying nothing of what the id
    is for. It is now a kvstage ``ArgumentTypeError`` (still a ``TypeError``) naming the argument,
    an example, and why it is required; ``opaque`` says the same."""
    from kvstage.errors import ArgumentTypeError, InvalidArgumentError

    rule = r"^model_id: required: the model's name or path \(e\.g\. 'meta-llama/Llama-3\.1-8B'\); it is part of every page key's prefix, so that pages of different models are never shared$"
    with pytest.raises(ArgumentTypeError, match=rule):
        LayoutFingerprint.of(STAGE_LAYOUT, page_size=2)
    with pytest.raises(ArgumentTypeError, match=rule):
        LayoutFingerprint.opaque(page_bytes=64, page_format="vllm-blocks")
    with pytest.raises(
        InvalidArgumentError, match=r"^model_id: must be a non-empty str, the model.s name .*never shared, got ''$"
    ):
        LayoutFingerprint.of(STAGE_LAYOUT, page_size=2, model_id="")
    with pytest.raises(
        InvalidArgumentError, match=r"^model_id: must be a non-empty str, the model.s name .*never shared, got None$"
    ):
        LayoutFingerprint(None, STAGE_LAYOUT, 2)
    assert LayoutFingerprint.of(STAGE_LAYOUT, page_size=2, model_id="org/model") == stage(0)
