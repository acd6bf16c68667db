"""Layout fingerprints on a real Mooncake master: pipeline stages and MLA ranks on one cluster."""

from __future__ import annotations

import uuid

import torch

from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, PutStatus
from kvstage.storage.mooncake.store import MooncakeStore

STAGE_LAYOUT = KVLayout(2, 2, 2, 64, "bfloat16")  # 2 layers a stage: 16 KiB a page of 16 tokens
MLA_LAYOUT = KVLayout(4, 1, 1, 64, "bfloat16")


def filled(fingerprint: LayoutFingerprint, value: int) -> torch.Tensor:
    return torch.full((fingerprint.page_bytes,), value, dtype=torch.uint8)


def test_stage_1_never_deduplicates_against_or_reads_stage_0s_page(mooncake_master):
    stage0 = LayoutFingerprint("org/model", STAGE_LAYOUT, 16, first_layer=0)
    stage1 = LayoutFingerprint("org/model", STAGE_LAYOUT, 16, first_layer=2)
    key = uuid.uuid4().hex
    with MooncakeStore(stage0, mooncake_master.url()) as store0, MooncakeStore(stage1, mooncake_master.url()) as store1:
        assert store0.put([key], [filled(stage0, 10)]) == [PutStatus.STORED]
        assert store1.exists([key]) == [False]
        assert store1.put([key], [filled(stage1, 12)]) == [PutStatus.STORED]
        into = torch.zeros(stage1.page_bytes, dtype=torch.uint8)
        assert store1.get([key], [into]) == [True] and torch.equal(into, filled(stage1, 12))
        assert store0.get([key], [into]) == [True] and torch.equal(into, filled(stage0, 10))


def test_mla_page_written_at_tp4_rank0_is_read_at_tp8_rank3(mooncake_master):
    writer = LayoutFingerprint("org/deepseek", MLA_LAYOUT, 16, tp_rank=0, tp_size=4)
    reader = LayoutFingerprint("org/deepseek", MLA_LAYOUT, 16, tp_rank=3, tp_size=8)
    key = uuid.uuid4().hex
    page = torch.arange(writer.page_bytes, dtype=torch.int32).to(torch.uint8)
    with (
        MooncakeStore(writer, mooncake_master.url()) as store_w,
        MooncakeStore(reader, mooncake_master.url()) as store_r,
    ):
        assert writer.writes_pages and not reader.writes_pages
        assert store_w.put([key], [page]) == [PutStatus.STORED]
        into = torch.zeros_like(page)
        assert store_r.exists([key]) == [True]
        assert store_r.get([key], [into]) == [True] and torch.equal(into, page)
