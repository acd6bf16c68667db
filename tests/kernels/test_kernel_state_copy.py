"""gather_state / scatter_state (Triton, the interpreter on CPU) and the torch reference, against
plain Python loops over slots and tensors (no kvstage code). Staging and the pool's target rows are poisoned
first (every byte 0xA5), and every byte outside the call's slots is compared too: a row left
unwritten or a byte written outside the slots shows in the byte-exact comparison."""

from __future__ import annotations

import math

import pytest
import torch

from kvstage.kernels import (
    StatePool,
    gather_state,
    gather_state_async,
    scatter_state,
    scatter_state_async,
    triton_state,
)

from kernel_helpers import as_bytes, random_bytes_

# (name, [(slot row shape, dtype), ...]): state tensors as transformers' tiny hybrid caches
# hold them per linear layer, and rows of odd sizes.
STATE_SHAPES = {
    # Qwen3-Next: conv (128, 4) and recurrent (4, 16, 16) per linear-attention layer, 3 layers
    "qwen3-next-3-layers": [((128, 4), torch.bfloat16), ((4, 16, 16), torch.float32)] * 3,
    # Jamba: conv (128, 4) and ssm (128, 8) per Mamba layer; FalconH1-like fp16 conv of 80 channels
    "jamba-and-falcon": [((128, 4), torch.float32), ((128, 8), torch.float32), ((80, 4), torch.float16)],
    # rows of 3, 20, 132 and 1 bytes, and a 1-element row
    "odd-rows": [
        ((3,), torch.uint8),
        ((20,), torch.uint8),
        ((132,), torch.uint8),
        ((), torch.uint8),
        ((5, 2), torch.float16),
    ],
    "every-dtype": [
        ((5, 4), torch.float8_e4m3fn),
        ((3, 7), torch.float8_e5m2),
        ((6,), torch.bfloat16),
        ((9,), torch.float16),
        ((3, 3), torch.float32),
        ((2,), torch.float64),
        ((11,), torch.int8),
        ((4,), torch.int32),
        ((13,), torch.bool),
    ],
}


def row_bytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def make_state_pool(
    name: str, num_slots: int, device, *, storage: str = "lists", seed: int = 0
) -> tuple[StatePool, torch.Tensor | None]:
    """A state pool of random bytes, and the one allocation its tensors are carved from (or None).

    storage: ``"lists"`` = one allocation per tensor; ``"blocks"`` = every tensor a strided view
    into per-slot blocks of one uint8 allocation, as vLLM carves Mamba state out of its KV
    blocks (each slot's block holds every tensor's row, then 16 spare bytes); ``"odd-blocks"``:
    the same with rows placed at odd offsets (3 spare bytes before each row), so no wide words.
    """
    gen = torch.Generator().manual_seed(seed)
    spec = STATE_SHAPES[name]
    if storage == "lists":
        tensors = [
            random_bytes_(torch.empty((num_slots, *shape), dtype=dtype, device=device), gen) for shape, dtype in spec
        ]
        return StatePool(tensors), None
    gap = 3 if storage == "odd-blocks" else 0
    offsets, at = [], 0
    for shape, dtype in spec:
        size = torch.empty(0, dtype=dtype).element_size()
        at += gap
        at = -(-at // size) * size  # each row at a multiple of its element size
        offsets.append(at)
        at += row_bytes(shape, dtype)
    block = -(-at // 8) * 8 + 16  # a multiple of every element size: the slot strides of the views
    raw = random_bytes_(torch.empty((num_slots, block), dtype=torch.uint8, device=device), gen)
    tensors = []
    for (shape, dtype), offset in zip(spec, offsets):
        rows = raw[:, offset : offset + row_bytes(shape, dtype)]
        tensors.append(rows.view(dtype).view(num_slots, *shape))
    return StatePool(tensors), raw


def slot_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s slot rows as uint8 ``[num_slots, row_bytes]`` on CPU, one Python step per slot."""
    return torch.stack([t[s].reshape(-1).contiguous().view(torch.uint8).cpu() for s in range(t.shape[0])])


def expected_snapshots(pool: StatePool, slot_ids: list[int]) -> torch.Tensor:
    """``[len(slot_ids), snapshot_bytes]``: each slot's rows of every tensor, concatenated in order."""
    rows = [slot_rows(t) for t in pool.tensors]
    if not slot_ids:
        return torch.empty(0, pool.snapshot_bytes, dtype=torch.uint8)
    return torch.stack([torch.cat([r[s] for r in rows]) for s in slot_ids])


def expected_rows_after_scatter(pool: StatePool, staging: torch.Tensor, slot_ids: list[int]) -> list[torch.Tensor]:
    """Each tensor's slot rows (as :func:`slot_rows`) after scattering ``staging`` into ``slot_ids``."""
    host = as_bytes(staging).view(len(slot_ids), -1) if slot_ids else None
    out = []
    for k, t in enumerate(pool.tensors):
        rows = slot_rows(t).clone()
        start = sum(math.prod(u.shape[1:]) * u.element_size() for u in pool.tensors[:k])
        width = rows.shape[1]
        for i, s in enumerate(slot_ids):
            rows[s] = host[i, start : start + width]
        out.append(rows)
    return out


def poisoned_staging(pool: StatePool, num_ids: int, *, pinned: bool = False) -> torch.Tensor:
    shape = pool.staging_shape(num_ids)
    if pool.device.type == "cuda" and pinned:
        return torch.full(shape, 0xA5, dtype=torch.uint8, pin_memory=True)
    return torch.full(shape, 0xA5, dtype=torch.uint8, device=pool.device)


BACKENDS = ["triton", "torch"]
# (pool slots, slot ids): one slot of a one-slot pool, one of many, several non-contiguous, out of order
# and more ids than the reference copies row by row (it index_selects them)
SLOTS = [(1, [0]), (7, [4]), (7, [5, 0, 3]), (9, [8, 1, 2, 6, 7, 0, 3]), (24, [(7 * i + 3) % 24 for i in range(20)])]


def slots_id(case) -> str:
    return f"{case[0]}slots-{'-'.join(map(str, case[1][:8]))}"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slots", SLOTS, ids=slots_id)
@pytest.mark.parametrize("name", list(STATE_SHAPES))
def test_gather_state_equals_python_loops(device, name, slots, backend):
    num_slots, slot_ids = slots
    pool, _ = make_state_pool(name, num_slots, device)
    before = [slot_rows(t) for t in pool.tensors]
    staging = poisoned_staging(pool, len(slot_ids))
    gather_state(pool, torch.tensor(slot_ids, device=device), staging, backend=backend)
    synchronize(device)
    assert torch.equal(as_bytes(staging).view(len(slot_ids), -1), expected_snapshots(pool, slot_ids))
    assert all(torch.equal(b, slot_rows(t)) for b, t in zip(before, pool.tensors))  # the pool is only read


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slots", SLOTS, ids=slots_id)
@pytest.mark.parametrize("name", list(STATE_SHAPES))
def test_scatter_state_equals_python_loops_and_leaves_other_slots_alone(device, name, slots, backend):
    num_slots, slot_ids = slots
    pool, _ = make_state_pool(name, num_slots, device)
    for t in pool.tensors:  # the target slots hold poison: a row left unwritten shows
        t.view(torch.uint8)[slot_ids] = 0xA5
    staging = random_bytes_(poisoned_staging(pool, len(slot_ids)), torch.Generator().manual_seed(3))
    want = expected_rows_after_scatter(pool, staging, slot_ids)
    scatter_state(staging, pool, torch.tensor(slot_ids, device=device), backend=backend)
    synchronize(device)
    assert all(torch.equal(w, slot_rows(t)) for w, t in zip(want, pool.tensors))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", ["blocks", "odd-blocks"])
@pytest.mark.parametrize("name", ["qwen3-next-3-layers", "odd-rows", "every-dtype"])
def test_strided_views_into_per_slot_blocks(device, name, storage, backend):
    """vLLM-style state: every tensor a strided view into per-slot blocks of one allocation.
    The bytes between the views (and the slots outside the call) must never change."""
    pool, raw = make_state_pool(name, 6, device, storage=storage, seed=2)
    assert all(not t.is_contiguous() for t in pool.tensors if t.dim() > 1 and t.shape[1] > 1)
    slot_ids = [4, 1]
    staging = poisoned_staging(pool, 2)
    gather_state(pool, slot_ids, staging, backend=backend)
    synchronize(device)
    assert torch.equal(as_bytes(staging).view(2, -1), expected_snapshots(pool, slot_ids))
    covered = torch.zeros(raw.shape, dtype=torch.bool)
    for t in pool.tensors:  # mark each view's bytes in the raw blocks
        start = t.data_ptr() - raw.data_ptr()
        covered[:, start : start + t[0].numel() * t.element_size()] = True
    raw_before = raw.cpu().clone()
    random_bytes_(staging, torch.Generator().manual_seed(4))
    want = expected_rows_after_scatter(pool, staging, slot_ids)
    scatter_state(staging, pool, torch.tensor([4, 1], device=device), backend=backend)
    synchronize(device)
    assert all(torch.equal(w, slot_rows(t)) for w, t in zip(want, pool.tensors))
    assert torch.equal(raw.cpu()[~covered], raw_before[~covered])  # nothing written between the views
    others = [s for s in range(6) if s not in slot_ids]
    assert torch.equal(raw.cpu()[others], raw_before[others])


@pytest.mark.parametrize("backend", BACKENDS)
def test_staging_and_ids_at_odd_offsets(device, backend):
    """A staging view that starts one byte into its allocation (byte words only on its side),
    slot ids as a strided column with a storage offset."""
    pool, _ = make_state_pool("qwen3-next-3-layers", 5, device)
    arena = torch.full((2 * pool.snapshot_bytes + 3,), 0xA5, dtype=torch.uint8, device=device)
    staging = arena[1 : 1 + 2 * pool.snapshot_bytes].view(2, -1)
    table = torch.full((4, 3), 10**6, dtype=torch.int64, device=device)
    table[1:3, 2] = torch.tensor([3, 1], device=device)
    ids = table[1:3, 2]
    assert ids.stride() == (3,) and ids.storage_offset() == 5
    gather_state(pool, ids, staging, backend=backend)
    synchronize(device)
    assert torch.equal(as_bytes(staging).view(2, -1), expected_snapshots(pool, [3, 1]))
    assert (as_bytes(arena[:1]) == 0xA5).all() and (as_bytes(arena[-2:]) == 0xA5).all()
    random_bytes_(staging, torch.Generator().manual_seed(5))
    want = expected_rows_after_scatter(pool, staging, [3, 1])
    scatter_state(staging, pool, ids, backend=backend)
    synchronize(device)
    assert all(torch.equal(w, slot_rows(t)) for w, t in zip(want, pool.tensors))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_may_repeat_a_slot(device, backend):
    pool, _ = make_state_pool("odd-rows", 4, device)
    staging = poisoned_staging(pool, 3)
    gather_state(pool, torch.tensor([2, 2, 0], device=device).to(torch.int32), staging, backend=backend)
    synchronize(device)
    assert torch.equal(as_bytes(staging).view(3, -1), expected_snapshots(pool, [2, 2, 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_then_scatter_restores_a_request_state(device, backend):
    pool, _ = make_state_pool("every-dtype", 5, device, seed=9)
    original = [slot_rows(t) for t in pool.tensors]
    staging = poisoned_staging(pool, 2)
    gather_state(pool, [3, 0], staging, backend=backend)
    for t in pool.tensors:
        t.view(torch.uint8)[[3, 0]] = 0
    assert any(not torch.equal(o, slot_rows(t)) for o, t in zip(original, pool.tensors))
    scatter_state(staging, pool, [3, 0], backend=backend)
    synchronize(device)
    assert all(torch.equal(o, slot_rows(t)) for o, t in zip(original, pool.tensors))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_call_writes_nothing(device, backend):
    pool, _ = make_state_pool("odd-rows", 3, device)
    before = [slot_rows(t) for t in pool.tensors]
    staging = poisoned_staging(pool, 0)
    gather_state(pool, [], staging, backend=backend)
    scatter_state(staging, pool, torch.empty(0, dtype=torch.int64, device=device), backend=backend)
    assert all(torch.equal(b, slot_rows(t)) for b, t in zip(before, pool.tensors))


def test_every_tensor_moves_in_one_launch(device, monkeypatch):
    """One kernel launch for every state tensor of the pool, whatever their word classes."""
    pool, _ = make_state_pool("jamba-and-falcon", 4, device)
    kernel = triton_state._state_rows_copy_kernel
    grids = []

    class Counting:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_state, "_state_rows_copy_kernel", Counting())
    staging = poisoned_staging(pool, 2)
    gather_state(pool, [1, 3], staging, backend="triton")
    scatter_state(staging, pool, [0, 2], backend="triton")
    assert len(grids) == 2
    synchronize(device)
    assert torch.equal(as_bytes(staging).view(2, -1), expected_snapshots(pool, [1, 3]))


def test_word_classes_follow_rows_and_addresses():
    """Rows that allow it get 16-byte words; 132-byte rows 4; a 3-byte row 1; and a staging
    buffer at an odd address limits every tensor to bytes."""
    tensors = [torch.empty(2, 1024, dtype=torch.uint8), torch.empty(2, 132, dtype=torch.uint8)]
    tensors.append(torch.empty(2, 3, dtype=torch.uint8))
    pool = StatePool(tensors)
    assert triton_state.state_table(pool, 16, False, on_cuda=False).words == (16, 4, 1)
    assert triton_state.state_table(pool, 16, True, on_cuda=False).words == (1, 1, 1)  # snapshot_bytes 1159 is odd
    assert triton_state.state_table(pool, 1, False, on_cuda=False).words == (1, 1, 1)
    qwen = StatePool([torch.empty(3, 128, 4, dtype=torch.bfloat16), torch.empty(3, 4, 16, 16)])
    assert triton_state.state_table(qwen, 16, True, on_cuda=False).words == (16, 16)


def test_async_without_a_stream_runs_inline(device):
    pool, _ = make_state_pool("qwen3-next-3-layers", 3, device)
    staging = poisoned_staging(pool, 1)
    handle = gather_state_async(pool, [2], staging, stream=None)
    assert handle.query() and handle.error is None
    assert torch.equal(as_bytes(staging).view(1, -1), expected_snapshots(pool, [2]))
    for t in pool.tensors:
        t.view(torch.uint8)[1] = 0
    handle = scatter_state_async(staging, pool, [1], stream=None)
    assert handle.query()
    assert all(torch.equal(slot_rows(t)[1], slot_rows(t)[2]) for t in pool.tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_side_stream_waits_for_the_producer_without_a_host_sync(backend):
    """On CUDA the copy runs on a side stream after the producer's event: it sees the state the
    producer wrote just before, and nothing on the way to the launch syncs the host (after
    ``warm_up_state``; ids given on the host)."""
    from kvstage.kernels import side_stream, warm_up_state

    device = torch.device("cuda")
    pool, _ = make_state_pool("qwen3-next-3-layers", 4, device)
    warm_up_state(pool, backend=backend)
    staging = poisoned_staging(pool, 2, pinned=True)
    stream = side_stream(device)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the producer's stream is busy...
    for t in pool.tensors:
        t[2].fill_(1)  # ...then writes the state the snapshot must hold
    event = torch.cuda.Event()
    event.record()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = gather_state_async(pool, [2, 0], staging, stream=stream, after=event, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    handle.synchronize()
    assert torch.equal(as_bytes(staging).view(2, -1), expected_snapshots(pool, [2, 0]))
    want = expected_rows_after_scatter(pool, staging.flip(0).contiguous(), [1, 3])
    back = scatter_state_async(staging.flip(0).contiguous().pin_memory(), pool, [1, 3], stream=stream, backend=backend)
    back.wait()
    torch.cuda.synchronize()
    assert all(torch.equal(w, slot_rows(t)) for w, t in zip(want, pool.tensors))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_layer_moves_alone_at_its_columns(device, backend):
    """Layer-by-layer loading: ``tensors=pool.layers[l]`` reads and writes that layer's rows only,
    at their columns of the full snapshot."""
    gen = torch.Generator().manual_seed(11)
    per_layer = [
        [
            random_bytes_(torch.empty(5, 16, 4, dtype=torch.bfloat16, device=device), gen),
            random_bytes_(torch.empty(5, 3, dtype=torch.uint8, device=device), gen),
        ]
        for _ in range(3)
    ]
    pool = StatePool.from_layers(per_layer)
    assert pool.layers == [range(0, 2), range(2, 4), range(4, 6)]
    staging = poisoned_staging(pool, 2)
    gather_state(pool, [4, 1], staging, backend=backend, tensors=pool.layers[1])
    synchronize(device)
    full = expected_snapshots(pool, [4, 1])
    got = as_bytes(staging).view(2, -1)
    columns = slice(pool.offsets[2], pool.offsets[4])
    assert torch.equal(got[:, columns], full[:, columns])
    outside = torch.ones(pool.snapshot_bytes, dtype=torch.bool)
    outside[columns] = False
    assert (got[:, outside] == 0xA5).all()
    random_bytes_(staging, torch.Generator().manual_seed(12))
    want = expected_rows_after_scatter(pool, staging, [0, 3])
    before = [slot_rows(t) for t in pool.tensors]
    scatter_state(staging, pool, [0, 3], backend=backend, tensors=pool.layers[2])
    synchronize(device)
    for k, t in enumerate(pool.tensors):
        assert torch.equal(slot_rows(t), want[k] if k in pool.layers[2] else before[k]), k
