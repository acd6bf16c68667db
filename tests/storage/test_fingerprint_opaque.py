"""LayoutFingerprint.opaque: pages whose layout an engine owns (vLLM's canonical blocks, one
offload chunk of every worker), keyed by model, a description of the page format and the shard.

What must hold: two formats never share a key space; ranks of a sharded format never share one;
a rank-neutral format (MLA replicated on every rank, or vLLM's parallelism-agnostic canonical
pages) is shared by every rank and written by rank 0 only; bad arguments raise, naming them.
"""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, PutStatus

FORMAT = "vllm-0.33.0:g0=16tok:L0-31:bpc=2"


def opaque(page_format: str = FORMAT, *, page_bytes: int = 4096, **shard) -> LayoutFingerprint:
    return LayoutFingerprint.opaque("org/model", page_bytes=page_bytes, page_format=page_format, **shard)


def test_an_opaque_page_has_the_given_bytes_and_a_prefix_naming_format_bytes_and_shard():
    fingerprint = opaque(tp_rank=1, tp_size=2)
    assert fingerprint.page_bytes == 4096
    prefix = fingerprint.prefix()
    assert prefix.startswith("org_model-") and prefix.endswith("@B4096@tp1of2@")
    assert "@opaque-" in prefix and FORMAT not in prefix  # a digest: a format may hold any character


def test_formats_byte_counts_and_ranks_each_get_their_own_key_space():
    prefixes = {
        opaque().prefix(),
        opaque(FORMAT + ":other").prefix(),
        opaque(page_bytes=8192).prefix(),
        opaque(tp_rank=0, tp_size=2).prefix(),
        opaque(tp_rank=1, tp_size=2).prefix(),
        LayoutFingerprint("org/model", KVLayout(1, 1, 1, 4096, "uint8"), 1).prefix(),
    }
    assert len(prefixes) == 6


def test_a_rank_neutral_format_is_shared_by_every_rank_and_written_by_rank_0(tmp_path):
    writer, reader = opaque(tp_rank=0, tp_size=4, rank_neutral=True), opaque(tp_rank=3, tp_size=8, rank_neutral=True)
    assert writer.prefix() == reader.prefix() and writer.prefix().endswith("@tp-any@")
    assert writer.writes_pages and not reader.writes_pages
    assert not opaque(tp_rank=3, tp_size=4).rank_neutral and opaque(tp_rank=3, tp_size=4).writes_pages
    page = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    assert FileStore(writer, tmp_path).put(["ab12"], [page]) == [PutStatus.STORED]
    into = torch.zeros_like(page)
    assert FileStore(reader, tmp_path).get(["ab12"], [into]) == [True] and torch.equal(into, page)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"page_format": ""}, "page_format"),
        ({"page_format": 7}, "page_format"),
        ({"page_bytes": 0}, "page_bytes"),
        ({"page_bytes": True}, "page_bytes"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(arguments, message):
    values = {"page_format": FORMAT, "page_bytes": 4096} | arguments
    with pytest.raises(InvalidArgumentError, match=message):
        LayoutFingerprint.opaque("org/model", **values)


def test_rank_neutral_is_an_opaque_formats_choice_only():
    with pytest.raises(InvalidArgumentError, match="rank_neutral_pages"):
        LayoutFingerprint("org/model", KVLayout(1, 2, 1, 8, "uint8"), 1, rank_neutral_pages=True)
