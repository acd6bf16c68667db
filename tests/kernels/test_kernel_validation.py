"""Every gather/scatter validation error names its argument and fires before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import ArgumentTypeError, BackendUnavailableError, DeviceMismatchError, InvalidArgumentError
from kvstage.kernels import gather, scatter

from kernel_helpers import as_bytes, changed_buffers, make_indices, make_pool, make_staging, pool_bytes, same_bytes

PAGE = 3
# A device that is neither the pool's nor the host: "meta" tensors (no storage) raise the same
# device errors on a CPU-only machine; CUDA too where present.
OTHER_DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def case(device):
    pool = make_pool(parts=2, layers=2, num_slots=16, heads=1, dim=8, dtype=torch.float16, device=device)
    staging = make_staging(pool, 4, PAGE, "page_first")
    slot_indices, host_page_ids = make_indices(pool, 2, PAGE, 4)
    return pool, staging, slot_indices, host_page_ids


def _bad(case, what):
    """Return kwargs for gather/scatter with one thing broken, as named by ``what``."""
    pool, staging, slot_indices, host_page_ids = case
    dev = pool.device
    kw = dict(pool=pool, staging=staging, slot_indices=slot_indices, host_page_ids=host_page_ids, page_size=PAGE)
    if what == "staging-dtype":
        kw["staging"] = staging.view(torch.bfloat16)
    elif what == "staging-layers":
        kw["staging"] = staging[:, :1].contiguous()
    elif what == "staging-parts":
        kw["staging"] = staging[:, :, :1].contiguous()
    elif what == "staging-heads":
        kw["staging"] = torch.zeros(4, 2, 2, PAGE, 2, 8, dtype=torch.float16, device=dev)
    elif what == "staging-head-dim":
        kw["staging"] = torch.zeros(4, 2, 2, PAGE, 1, 16, dtype=torch.float16, device=dev)
    elif what == "staging-page-size":
        kw["page_size"] = PAGE + 1
        kw["slot_indices"] = torch.arange(2 * (PAGE + 1), device=dev)
    elif what == "staging-rank":
        kw["staging"] = staging.view(4, 2, 2, PAGE, 8)
    elif what == "staging-not-contiguous":
        kw["staging"] = torch.zeros(2, 2, 2, PAGE, 1, 8, dtype=torch.float16, device=dev)[:, :, :, :, :, :].transpose(
            0, 1
        )
    elif what == "layer-first-tokens":
        kw["staging"] = torch.zeros(2, 2, 10, 1, 8, dtype=torch.float16, device=dev)
        kw["layout"] = "layer_first"
    elif what == "slot-dtype":
        kw["slot_indices"] = slot_indices.float()
    elif what == "slot-not-tensor":
        kw["slot_indices"] = slot_indices.tolist()
    elif what == "slot-rank":
        kw["slot_indices"] = slot_indices.view(2, PAGE)
    elif what == "slot-count":
        kw["slot_indices"] = slot_indices[:-1]
    elif what == "page-dtype":
        kw["host_page_ids"] = host_page_ids.to(torch.int16)
    elif what == "page-out-of-range":  # host page ids on CPU are always checked (no sync needed)
        kw["host_page_ids"] = torch.tensor([0, 4])
    elif what == "page-negative":
        kw["host_page_ids"] = torch.tensor([-1, 2])
    elif what == "page-repeated":
        kw["host_page_ids"] = torch.tensor([1, 1])
    elif what == "device-page-repeated":  # on the pool's device: checked with check_bounds
        kw["host_page_ids"] = torch.tensor([3, 3], device=dev)
        kw["check_bounds"] = True
    elif what == "slot-out-of-range":
        kw["slot_indices"] = torch.tensor([0, 1, 2, 3, 4, 16], device=dev)
        kw["check_bounds"] = True
    elif what == "slot-negative":
        kw["slot_indices"] = torch.tensor([0, 1, 2, 3, -4, 5], device=dev)
        kw["check_bounds"] = True
    elif what == "staging-on-meta":  # neither the pool's device nor host memory
        kw["staging"] = torch.empty(staging.shape, dtype=staging.dtype, device="meta")
    elif what == "slot-on-meta":  # an index tensor on a third device
        kw["slot_indices"] = slot_indices.to("meta")
    elif what == "page-on-meta":
        kw["host_page_ids"] = host_page_ids.to("meta")
    elif what == "page-size":
        kw["page_size"] = 0
    elif what == "layout":
        kw["layout"] = "token_first"
    elif what == "pool":
        kw["pool"] = pool.buffers
    elif what == "mode":
        kw["mode"] = "zero_copy"
    elif what == "backend":
        kw["backend"] = "cuda"
    elif what == "max-programs":
        kw["max_programs"] = 0
    else:
        raise AssertionError(what)
    return kw


CASES = [
    ("staging-dtype", ArgumentTypeError, "staging"),
    ("staging-layers", InvalidArgumentError, "staging"),
    ("staging-parts", InvalidArgumentError, "staging"),
    ("staging-heads", InvalidArgumentError, "staging"),
    ("staging-head-dim", InvalidArgumentError, "staging"),
    ("staging-page-size", InvalidArgumentError, "staging"),
    ("staging-rank", InvalidArgumentError, "staging"),
    ("staging-not-contiguous", InvalidArgumentError, "staging"),
    ("layer-first-tokens", InvalidArgumentError, "staging"),
    ("slot-dtype", ArgumentTypeError, "slot_indices"),
    ("slot-not-tensor", ArgumentTypeError, "slot_indices"),
    ("slot-rank", InvalidArgumentError, "slot_indices"),
    ("slot-count", InvalidArgumentError, "slot_indices"),
    ("page-dtype", ArgumentTypeError, "host_page_ids"),
    ("page-out-of-range", InvalidArgumentError, "host_page_ids"),
    ("page-negative", InvalidArgumentError, "host_page_ids"),
    ("page-repeated", InvalidArgumentError, "host_page_ids"),
    ("device-page-repeated", InvalidArgumentError, "host_page_ids"),
    ("slot-out-of-range", InvalidArgumentError, "slot_indices"),
    ("slot-negative", InvalidArgumentError, "slot_indices"),
    ("staging-on-meta", DeviceMismatchError, "staging"),
    ("slot-on-meta", DeviceMismatchError, "slot_indices"),
    ("page-on-meta", DeviceMismatchError, "host_page_ids"),
    ("page-size", InvalidArgumentError, "page_size"),
    ("layout", InvalidArgumentError, "layout"),
    ("pool", ArgumentTypeError, "pool"),
    ("mode", InvalidArgumentError, "mode"),
    ("backend", InvalidArgumentError, "backend"),
    ("max-programs", InvalidArgumentError, "max_programs"),
]


@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("what, error, argument", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_is_named_and_nothing_is_written(case, op, what, error, argument):
    pool, staging, _, _ = case
    kw = _bad(case, what)
    before_pool, before_staging = pool_bytes(pool), as_bytes(staging).clone()
    with pytest.raises(error) as info:
        if op == "gather":
            gather(kw.pop("pool"), kw.pop("staging"), kw.pop("slot_indices"), kw.pop("host_page_ids"), **kw)
        else:
            scatter(kw.pop("staging"), kw.pop("pool"), kw.pop("slot_indices"), kw.pop("host_page_ids"), **kw)
    assert str(info.value).startswith(f"{argument}:"), str(info.value)
    assert changed_buffers(before_pool, pool) == []
    assert torch.equal(before_staging, as_bytes(staging))


@pytest.mark.parametrize("layer", [2, -1, "0"], ids=["too-high", "negative", "string"])
def test_scatter_rejects_a_bad_layer(case, layer):
    pool, staging, slot_indices, host_page_ids = case
    with pytest.raises((InvalidArgumentError, ArgumentTypeError), match="^layer:"):
        scatter(staging, pool, slot_indices, host_page_ids, page_size=PAGE, layer=layer)


def test_slot_check_is_skipped_when_asked(case):
    """check_bounds=False trusts the slots (as on CUDA by default): a valid batch still copies."""
    pool, staging, slot_indices, host_page_ids = case
    gather(pool, staging, slot_indices, host_page_ids, page_size=PAGE, check_bounds=False)
    want = make_staging(pool, 4, PAGE, "page_first")
    gather(pool, want, slot_indices, host_page_ids, page_size=PAGE, backend="torch")
    assert same_bytes(staging, want)


def test_cpu_staging_for_a_cuda_pool_must_be_pinned():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pool = make_pool(parts=2, layers=1, num_slots=8, heads=1, dim=8, dtype=torch.float16, device=torch.device("cuda"))
    staging = torch.zeros(2, 1, 2, 1, 1, 8, dtype=torch.float16)
    slot_indices, host_page_ids = make_indices(pool, 1, 1, 2)
    with pytest.raises(DeviceMismatchError, match="^staging: .*pinned"):
        gather(pool, staging, slot_indices, host_page_ids, page_size=1)


@pytest.mark.parametrize("other", OTHER_DEVICES)
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_staging_on_another_device_for_a_cpu_pool_is_a_device_mismatch(other, op):
    pool = make_pool(parts=2, layers=1, num_slots=8, heads=1, dim=8, dtype=torch.float16, device=torch.device("cpu"))
    staging = torch.zeros(2, 1, 2, 1, 1, 8, dtype=torch.float16, device=other)
    slot_indices, host_page_ids = make_indices(pool, 1, 1, 2)
    before = pool_bytes(pool)
    with pytest.raises(
        DeviceMismatchError, match=rf"^staging: must be pinned host memory or on the pool's device \(cpu\), got {other}"
    ):
        if op == "gather":
            gather(pool, staging, slot_indices, host_page_ids, page_size=1)
        else:
            scatter(staging, pool, slot_indices, host_page_ids, page_size=1)
    assert changed_buffers(before, pool) == []


def test_triton_backend_on_cpu_needs_the_interpreter(case, monkeypatch):
    pool, staging, slot_indices, host_page_ids = case
    if pool.device.type != "cpu":
        pytest.skip("about CPU tensors")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="^backend:"):
        gather(pool, staging, slot_indices, host_page_ids, page_size=PAGE, backend="triton")
