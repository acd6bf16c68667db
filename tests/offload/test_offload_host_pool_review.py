"""HostPool argument checks found in review: bools and floats as sizes, pinning without an accelerator."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError

from offload_rig import host_pool

ARGS = dict(num_layers=1, kv_parts=2, num_heads=1, head_dim=4, dtype=torch.float32, num_pages=2, page_size=2, pin=False)


@pytest.mark.parametrize(
    "change, rule",
    [
        ({"num_layers": True}, r"^num_layers: must be a positive int"),
        ({"num_pages": True}, r"^num_pages: must be a positive int"),
        ({"kv_parts": 2.0}, r"^kv_parts: must be 1 \(MLA\) or 2"),
        ({"kv_parts": True}, r"^kv_parts: must be 1 \(MLA\) or 2"),
        ({"buffer_pages": True}, r"^buffer_pages: must be a positive int"),
    ],
)
def test_bools_and_floats_are_not_sizes(change, rule):
    with pytest.raises(InvalidArgumentError, match=rule):
        host_pool(**{**ARGS, **change})


def test_alloc_of_a_bool_is_an_error_and_changes_nothing():
    pool = host_pool(**ARGS)
    with pytest.raises(InvalidArgumentError, match=r"^num_pages: must be a non-negative int, got True"):
        pool.alloc(True)
    assert pool.used == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is")
def test_pin_without_an_accelerator_names_the_argument():
    with pytest.raises(InvalidArgumentError, match=r"^pin: "):
        host_pool(**{**ARGS, "pin": True})
