"""The CUDA launch path, checked on CPU: no index tensor that lives on the device is read on
the host (each read would sync the device), and every copy runs under the pool's device.

Index tensors play device-resident ones: :class:`DeviceIndex` is a CPU tensor that records
every host read of its values (``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``.cpu()``,
``torch.unique``, ...), and :func:`kvstage.kernels.layout.on_host`, the one predicate deciding
whether a copy may read a tensor on the host, answers False for it. On CUDA the gpu-marked
test runs the real thing under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kernels import gather, scatter, transfer, triton_copy
from kvstage.kernels import layout as layout_module

from kernel_helpers import (
    as_bytes,
    changed_buffers,
    expected_pool_after_scatter,
    expected_staging,
    make_indices,
    make_pool,
    make_staging,
    pool_bytes,
    pool_equals,
    random_bytes_,
)

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__float__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.to,
    torch.unique,
    torch.Tensor.unique,
    torch.nonzero,
    torch.Tensor.nonzero,
}


class DeviceIndex(torch.Tensor):
    """A CPU index tensor standing in for one on the device: host reads of it (or of tensors made from it) are recorded."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            cls.reads.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def device_indices(monkeypatch):
    """Make :class:`DeviceIndex` tensors count as device-resident; return a function wrapping a tensor as one."""
    monkeypatch.setattr(layout_module, "on_host", lambda t: not isinstance(t, DeviceIndex) and t.device.type == "cpu")
    DeviceIndex.reads.clear()
    yield lambda t: t.as_subclass(DeviceIndex)
    DeviceIndex.reads.clear()


class SpyKernel:
    """Stands in for the jitted kernel: notes the host reads made before the launch, then launches the real one."""

    def __init__(self, real):
        self.real, self.reads_at_launch = real, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.reads_at_launch.append(list(DeviceIndex.reads))
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, torch.Tensor) else a for a in args]
            return self.real[grid](*plain, **kwargs)

        return launch


def case():
    pool = make_pool(parts=2, layers=3, num_slots=24, heads=1, dim=12, dtype=torch.float16, device=torch.device("cpu"))
    slot_indices, host_page_ids = make_indices(pool, 3, 2, 5, aligned=True)  # whole pages: the route that reads slots
    return pool, slot_indices, torch.tensor([1, 2, 0])  # host pages one run: the route that reads host ids


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", ["gather", "scatter", "scatter-layer-2"])
def test_no_device_index_is_read_on_the_host(device_indices, monkeypatch, backend, op):
    pool, slot_indices, host_page_ids = case()
    # The kernel is private: spied on to see its launch arguments.
    spy = SpyKernel(triton_copy._kv_rows_copy_kernel)
    monkeypatch.setattr(triton_copy, "_kv_rows_copy_kernel", spy)
    staging = make_staging(pool, 5, 2, "page_first")
    layer = 2 if op.endswith("layer-2") else None
    if op == "gather":
        want = expected_staging(pool, staging, slot_indices, host_page_ids, 2)
        gather(
            pool,
            staging,
            device_indices(slot_indices),
            device_indices(host_page_ids),
            page_size=2,
            backend=backend,
            check_bounds=False,
        )
        assert torch.equal(as_bytes(staging), want.view(-1))
    else:
        random_bytes_(staging, torch.Generator().manual_seed(1))
        want = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, 2, layer=layer)
        scatter(
            staging,
            pool,
            device_indices(slot_indices),
            device_indices(host_page_ids),
            page_size=2,
            layer=layer,
            backend=backend,
            check_bounds=False,
        )
        assert pool_equals(pool, want)
    assert DeviceIndex.reads == []
    assert spy.reads_at_launch == ([[]] if backend == "triton" else [])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_spy_sees_a_host_read(device_indices, backend):
    """The check above can fail: check_bounds reads the indices on the host, and the spy records it."""
    pool, slot_indices, host_page_ids = case()
    staging = make_staging(pool, 5, 2, "page_first")
    gather(
        pool,
        staging,
        device_indices(slot_indices),
        device_indices(host_page_ids),
        page_size=2,
        backend=backend,
        check_bounds=True,
    )
    assert DeviceIndex.reads


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_staged_copy_rejects_device_host_page_ids(device_indices, backend):
    pool, slot_indices, host_page_ids = case()
    staging = make_staging(pool, 5, 2, "page_first")
    before = as_bytes(staging).clone()
    with pytest.raises(InvalidArgumentError, match="^host_page_ids: a staged copy .* needs them on CPU"):
        gather(
            pool,
            staging,
            slot_indices,
            device_indices(host_page_ids),
            page_size=2,
            backend=backend,
            mode="staged",
            check_bounds=False,
        )
    assert torch.equal(before, as_bytes(staging))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_every_copy_runs_under_the_pools_device(device, monkeypatch, backend, op):
    events = []

    @contextlib.contextmanager
    def guard(dev):
        events.append(("enter", dev))
        yield
        events.append(("exit", dev))

    def spying(name, real):
        def run(*args, **kwargs):
            events.append(("launch", name))
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(transfer, "_device_guard", guard)
    monkeypatch.setattr(triton_copy, "launch", spying("triton", triton_copy.launch))
    monkeypatch.setattr(transfer, "run_gather_torch", spying("torch", transfer.run_gather_torch))
    monkeypatch.setattr(transfer, "run_scatter_torch", spying("torch", transfer.run_scatter_torch))
    pool = make_pool(parts=2, layers=2, num_slots=8, heads=1, dim=8, dtype=torch.float16, device=device)
    staging = make_staging(pool, 2, 2, "page_first")
    slot_indices, host_page_ids = make_indices(pool, 2, 2, 2)
    if op == "gather":
        gather(pool, staging, slot_indices, host_page_ids, page_size=2, backend=backend)
    else:
        scatter(staging, pool, slot_indices, host_page_ids, page_size=2, backend=backend)
    assert events == [("enter", pool.device), ("launch", backend), ("exit", pool.device)]


def test_device_guard_selects_the_pools_cuda_device_and_nothing_on_cpu():
    # The guard is private: checked alone since no CPU copy can show which device it selects.
    guard = transfer._device_guard(torch.device("cuda", 1))  # built without touching CUDA
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(transfer._device_guard(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_sync_on_the_cuda_launch_path(backend):
    """After warm-up, gather and scatter with device slots and CPU host page ids never sync."""
    device = torch.device("cuda")
    pool = make_pool(parts=2, layers=2, num_slots=64, heads=8, dim=128, dtype=torch.bfloat16, device=device)
    staging = make_staging(pool, 4, 16, "page_first")
    slot_indices, host_page_ids = make_indices(pool, 4, 16, 4)
    host_page_ids = host_page_ids.cpu()
    for _ in range(2):  # compile, offset table, allocator and pinned-memory caches
        gather(pool, staging, slot_indices, host_page_ids, page_size=16, backend=backend)
        scatter(staging, pool, slot_indices, host_page_ids, page_size=16, layer=1, backend=backend)
    torch.cuda.synchronize()
    before = pool_bytes(pool)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather(pool, staging, slot_indices, host_page_ids, page_size=16, backend=backend)
        scatter(staging, pool, slot_indices, host_page_ids, page_size=16, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert changed_buffers(before, pool) == []
