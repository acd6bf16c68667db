"""Nothing the engine's thread calls builds a device tensor from host data.

On CUDA, ``torch.tensor(list, device="cuda")`` (or ``.to("cuda")`` of a pageable tensor) is a
blocking copy that waits for everything queued on the current stream, i.e. the forward pass.
Index data must stay on the device or go through pinned buffers. On CPU the same code paths
run, so a spy on the constructors catches such a call wherever it appears.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import kvstage
from kvstage.offload import StoreWorkers

from offload_rig import make_rig

LIBRARY = Path(kvstage.__file__).resolve().parent
TESTS = LIBRARY / "tests"


def library_caller() -> str | None:
    """``path:line`` of the spied call's caller when it is kvstage's own code (not a test's)."""
    caller = sys._getframe(2)  # 0: this function, 1: the spy's wrapper, 2: who called torch
    path = Path(caller.f_code.co_filename).resolve()
    if path.is_relative_to(LIBRARY) and not path.is_relative_to(TESTS):
        return f"{path.relative_to(LIBRARY)}:{caller.f_lineno}"
    return None


class DeviceConstructionSpy:
    """Records every tensor construction or move that names a device, made by kvstage's code
    (the rig's own bookkeeping, which runs between the engine-facing calls, is not recorded)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        original_tensor, original_as_tensor, original_to = torch.tensor, torch.as_tensor, torch.Tensor.to

        def tensor(*args, **kwargs):
            if kwargs.get("device") is not None and (where := library_caller()):
                self.calls.append(f"{where}: torch.tensor(device={kwargs['device']})")
            return original_tensor(*args, **kwargs)

        def as_tensor(*args, **kwargs):
            if kwargs.get("device") is not None and (where := library_caller()):
                self.calls.append(f"{where}: torch.as_tensor(device={kwargs['device']})")
            return original_as_tensor(*args, **kwargs)

        def to(self_tensor, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and (where := library_caller()):
                self.calls.append(f"{where}: Tensor.to({target})")
            return original_to(self_tensor, *args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)
        monkeypatch.setattr(torch, "as_tensor", as_tensor)
        monkeypatch.setattr(torch.Tensor, "to", to)


def test_the_spy_records_a_library_call_and_not_a_tests_own(monkeypatch):
    from kvstage.kernels.layout import to_device_async

    spy = DeviceConstructionSpy(monkeypatch)
    torch.tensor([0], device="cpu").to("cpu")  # this test's own: not recorded
    to_device_async(torch.zeros(2), torch.device("meta"))  # kvstage's: recorded
    assert (
        len(spy.calls) == 1
        and spy.calls[0].startswith("kernels/layout.py:")
        and spy.calls[0].endswith("Tensor.to(meta)")
    )


def test_engine_facing_calls_build_no_device_tensor_from_host_data(monkeypatch):
    # Two host buffers of 2 pages each: segments span them (the case that once built an index
    # tensor on the device from a Python list).
    rig = make_rig(page_size=2, num_host_pages=6, buffer_pages=2, store_prompt=True, store_workers=StoreWorkers())
    prompt = list(range(7))
    a = rig.new_request("a", prompt, 12)
    b = rig.new_request("b", prompt, 12)
    spy = DeviceConstructionSpy(monkeypatch)
    manager = rig.manager
    for step in range(8):
        for req in (a, b):
            rig.decode(req, 50 + step)
            manager.offload(req)
        rig.copy_stream.complete_all()
        manager.poll()
    a.done = True
    manager.finish(a)
    manager.abort(b)
    rig.copy_stream.complete_all()
    manager.drain()
    store_path_calls = spy.calls
    monkeypatch.undo()  # the rig's own bookkeeping below is not the engine-facing path
    assert store_path_calls == [] and manager.metrics.pages_stored > 0
    follow = rig.new_request("c", prompt, 4)
    rig.stacked[:, :, rig.slots(follow)] = -1
    spy = DeviceConstructionSpy(monkeypatch)
    match = manager.match_prefix(follow)
    handle = manager.prefetch(follow)
    assert handle.wait(5.0)
    manager.poll()
    load = manager.load(handle, rig.slots(follow)[: match.num_tokens], layer_by_layer=True)
    rig.copy_stream.complete_all()
    manager.poll()
    load_path_calls = spy.calls
    monkeypatch.undo()
    assert load_path_calls == []
    assert load.done() and match.num_pages == 3 and load.num_pages == 3
    assert manager.metrics.pages_loaded == 3
