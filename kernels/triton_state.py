"""The Triton kernel that moves state snapshots between a :class:`StatePool` and staging, in one launch.

One kernel serves both directions (``GATHER``: pool -> staging; else staging -> pool) and every
state tensor of the pool: it reads a per-tensor table (int64 ``[num_tensors, 8]``) giving each
tensor's word class (16, 8, 4, 2 or 1 bytes: the widest word dividing its row, slot stride,
address and snapshot offset, and the staging buffer's address), then, in units of that word,
the tensor's offset from the base pointer (the table's own address, a valid pointer on the
pool's device whatever the tensors' sizes; offsets may be negative), its slot stride, row
length, offset within a snapshot, the snapshot stride, and the tensor's first column tile
(the 8th column pads rows to 64 bytes). Each word class present in the pool compiles one branch
(``BLOCK<w>`` is 0 for a class no tensor uses), so a pool whose rows all allow 16 bytes compiles
to 16-byte accesses only (``.v2.b64``), and a tensor of 3-byte rows costs byte accesses for its
own rows alone.

Work: every (snapshot, tensor, column tile) is one tile, numbered tensor by tensor; programs
take tiles ``pid, pid + num_programs, ...``, so the grid (capped like the KV kernel's) covers
every tensor whatever their number. Offsets are int64 throughout.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstage.kernels.state_layout import StateTransfer
from kvstage.kernels.state_pool import StatePool
from kvstage.kernels.triton_copy import DEFAULT_MAX_PROGRAMS, INTERPRETER_MAX_PROGRAMS, _launch_guard
from kvstage.kernels.words import widest_word

__all__ = ["compile_state_ptx", "launch_state", "state_table", "warm_up_state"]

WORD_CLASSES = (16, 8, 4, 2, 1)  # bytes
# The element type each class moves, and how many of them make one word of the class.
_ELEMENT = {16: (torch.int64, 2), 8: (torch.int64, 1), 4: (torch.int32, 1), 2: (torch.int16, 1), 1: (torch.uint8, 1)}
TABLE_COLUMNS = 8
# Ints that vary per call are not specialized (see triton_copy._VARYING); the rest is fixed per pool.
_VARYING = ("slot_ids", "slot_stride", "num_ids", "tensor_start", "tensor_stop")


@triton.jit
def _tensor_rows(
    pool,
    stage,
    slot_ids,
    slot_stride,
    num_ids,
    entry,
    pid,
    num_programs,
    GATHER: tl.constexpr,
    VEC: tl.constexpr,  # elements per word of this class (2 int64 for 16 bytes, else 1)
    BLOCK: tl.constexpr,  # elements per tile (a multiple of VEC)
):
    # Table values are in words and scaled by VEC here, so the compiler knows every row start
    # and row end is a multiple of VEC elements: 16-byte accesses for the 16-byte class.
    tensor_at = tl.load(entry + 1) * VEC
    slot_elems = tl.load(entry + 2) * VEC
    row_elems = tl.load(entry + 3) * VEC
    stage_at = tl.load(entry + 4) * VEC
    snapshot_elems = tl.load(entry + 5) * VEC
    first_tile = tl.load(entry + 6) * num_ids
    col_tiles = tl.cdiv(row_elems, BLOCK)
    num_tiles = num_ids * col_tiles
    start = ((pid - first_tile) % num_programs + num_programs) % num_programs
    for tile in range(start, num_tiles, num_programs):
        i = tile // col_tiles
        col = (tile % col_tiles) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = col < row_elems
        slot = tl.load(slot_ids + i * slot_stride).to(tl.int64)
        pool_row = tl.multiple_of(tensor_at + slot * slot_elems, VEC)
        stage_row = tl.multiple_of(stage_at + i * snapshot_elems, VEC)
        if GATHER:
            rows = tl.load(pool + pool_row + col, mask=mask, eviction_policy="evict_first")
            tl.store(stage + stage_row + col, rows, mask=mask)
        else:
            rows = tl.load(stage + stage_row + col, mask=mask, eviction_policy="evict_first")
            tl.store(pool + pool_row + col, rows, mask=mask)


@triton.jit(do_not_specialize=_VARYING)
def _state_rows_copy_kernel(
    pool8,  # the base (the table's address) as int64 / int32 / int16 / uint8 pointers
    pool4,
    pool2,
    pool1,
    stage8,  # the staging buffer's start, likewise
    stage4,
    stage2,
    stage1,
    table,  # *int64 [num_tensors, 8]: word class, then offsets and lengths in words of that class
    slot_ids,  # *int32|int64 [num_ids]: state slot of each snapshot, slot_stride elements apart
    slot_stride,
    num_ids,
    tensor_start,  # the tensors moved: [tensor_start, tensor_stop) of the table
    tensor_stop,
    GATHER: tl.constexpr,
    BLOCK16: tl.constexpr,  # elements per tile of each word class; 0 = no tensor of that class
    BLOCK8: tl.constexpr,
    BLOCK4: tl.constexpr,
    BLOCK2: tl.constexpr,
    BLOCK1: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)
    num_ids64 = tl.cast(num_ids, tl.int64)
    for k in range(tensor_start, tensor_stop):
        entry = table + tl.cast(k, tl.int64) * 8
        word = tl.load(entry)
        if BLOCK16 > 0:
            if word == 16:
                _tensor_rows(
                    pool8, stage8, slot_ids, slot_stride, num_ids64, entry, pid, num_programs, GATHER, 2, BLOCK16
                )
        if BLOCK8 > 0:
            if word == 8:
                _tensor_rows(
                    pool8, stage8, slot_ids, slot_stride, num_ids64, entry, pid, num_programs, GATHER, 1, BLOCK8
                )
        if BLOCK4 > 0:
            if word == 4:
                _tensor_rows(
                    pool4, stage4, slot_ids, slot_stride, num_ids64, entry, pid, num_programs, GATHER, 1, BLOCK4
                )
        if BLOCK2 > 0:
            if word == 2:
                _tensor_rows(
                    pool2, stage2, slot_ids, slot_stride, num_ids64, entry, pid, num_programs, GATHER, 1, BLOCK2
                )
        if BLOCK1 > 0:
            if word == 1:
                _tensor_rows(
                    pool1, stage1, slot_ids, slot_stride, num_ids64, entry, pid, num_programs, GATHER, 1, BLOCK1
                )


@dataclass(frozen=True)
class StateTable:
    """What a launch needs from the pool for one staging alignment and snapshot count class.

    Attributes:
        words: each tensor's word class in bytes.
        blocks: ``{word class: elements per tile}`` for the classes present.
        tiles_per_snapshot: column tiles of one snapshot, all tensors together.
        table: int64 ``[num_tensors, 8]`` on the pool's device (see the module doc).
        pool_views: the table's address as int64 / int32 / int16 / uint8 one-element tensors.
        ready: CUDA: an event recorded after the table's H2D copy, which every launch's stream
            waits for (the copy was queued on whichever stream built the table); None on CPU.
    """

    words: tuple[int, ...]
    blocks: dict[int, int]
    tiles_per_snapshot: int
    table: torch.Tensor
    pool_views: tuple[torch.Tensor, ...]
    ready: "torch.cuda.Event | None"


def _address_views(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One-element views at ``t``'s first byte as int64, int32, int16 and uint8 (what the kernel
    takes as its typed pointers; a zero-size view would pass address 0). A type that does not fit
    in ``t``'s bytes from there, or whose size does not divide the offset, gets the uint8 view:
    no word of that size is chosen for the address."""
    storage, offset = t.untyped_storage(), t.data_ptr() - t.untyped_storage().data_ptr()
    views = []
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if offset % dtype.itemsize or offset + dtype.itemsize > storage.nbytes():
            dtype = torch.uint8
        views.append(torch.empty(0, dtype=dtype, device=t.device).set_(storage, offset // dtype.itemsize, (1,), (1,)))
    return tuple(views)


_TABLES: "weakref.WeakKeyDictionary[StatePool, dict[tuple, StateTable]]" = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def tile_bytes(on_cuda: bool) -> int:
    """Bytes per tile: 16 KiB on CUDA (a state row of up to 16 KiB is one tile); 1 MiB under the
    interpreter (each program step is a numpy call: fewer, bigger steps are faster)."""
    return 16 * 1024 if on_cuda else 1 << 20


def state_table(pool: StatePool, staging_alignment: int, multi: bool, *, on_cuda: bool) -> StateTable:
    """The launch table of ``pool`` for staging at an address divisible by ``staging_alignment``
    (a power of two <= 16) and more than one snapshot per call (``multi``: the snapshot stride
    then limits the words too). Built once per (pool, alignment, multi) and kept while the pool lives."""
    key = (staging_alignment, multi, on_cuda)
    with _TABLES_LOCK:
        entry = _TABLES.setdefault(pool, {}).get(key)
        if entry is not None:
            return entry
    # The table's own allocation is the base the tensors' offsets count from: a valid address
    # on the pool's device whatever the tensors' sizes.
    table = torch.empty((pool.num_tensors, TABLE_COLUMNS), dtype=torch.int64, device=pool.device)
    base = table.data_ptr()
    words = tuple(
        widest_word(row, [base] + ([pool.snapshot_bytes] if multi else []), min(aligned, staging_alignment))
        for row, aligned in zip(pool.row_bytes, pool.word_alignment)
    )
    blocks: dict[int, int] = {}
    for w in WORD_CLASSES:
        elem_bytes = _ELEMENT[w][0].itemsize
        rows = [row // elem_bytes for row, word in zip(pool.row_bytes, words) if word == w]
        if rows:
            blocks[w] = min(triton.next_power_of_2(max(rows)), max(_ELEMENT[w][1], tile_bytes(on_cuda) // elem_bytes))
    values, first_tile = [], 0
    for t, row, stride, offset, w in zip(pool.tensors, pool.row_bytes, pool.slot_stride_bytes, pool.offsets, words):
        values.append(
            [
                w,
                (t.data_ptr() - base) // w,
                stride // w if pool.num_slots > 1 else 0,
                row // w,
                offset // w,
                pool.snapshot_bytes // w if multi else 0,
                first_tile,
                0,
            ]
        )
        first_tile += triton.cdiv(row // _ELEMENT[w][0].itemsize, blocks[w])
    host = torch.tensor(values, dtype=torch.int64)
    if pool.device.type == "cuda":
        host = host.pin_memory()  # a non_blocking copy from pageable memory may be synchronous
    table.copy_(host, non_blocking=True)
    ready = None
    if pool.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(pool.device))
    entry = StateTable(words, blocks, first_tile, table, _address_views(table), ready)
    with _TABLES_LOCK:
        return _TABLES[pool].setdefault(key, entry)


def _kernel_args(
    table: StateTable, stage_views, slot_ids, slot_stride: int, num_ids: int, tensors: range, gather: bool
) -> tuple[tuple, dict]:
    """The kernel's positional and keyword arguments: one builder for launches, warm-up and :func:`compile_state_ptx`."""
    blocks = {f"BLOCK{w}": table.blocks.get(w, 0) for w in WORD_CLASSES}
    args = (*table.pool_views, *stage_views, table.table, slot_ids, slot_stride, num_ids, tensors.start, tensors.stop)
    return args, dict(GATHER=gather, num_warps=4, **blocks)


def _num_programs(tiles: int, on_cuda: bool, max_programs: int | None) -> int:
    if max_programs is None:
        env = os.environ.get("KVSTAGE_MAX_PROGRAMS")
        max_programs = int(env) if env else (DEFAULT_MAX_PROGRAMS if on_cuda else INTERPRETER_MAX_PROGRAMS)
    return max(1, min(tiles, max_programs))


def launch_state(plan: StateTransfer, *, gather: bool, max_programs: int | None = None) -> int:
    """Run the state kernel for a validated :class:`StateTransfer` on the current stream.

    Returns the grid size (0 for an empty call, which launches nothing).
    """
    n = plan.num_ids
    if n == 0:
        return 0
    pool, staging = plan.pool, plan.staging
    on_cuda = pool.device.type == "cuda"
    start = staging.untyped_storage().data_ptr()
    alignment = widest_word(16, [staging.data_ptr(), start])
    table = state_table(pool, alignment, n > 1, on_cuda=on_cuda)
    stage_views = _address_views(staging)
    grid = _num_programs(n * table.tiles_per_snapshot, on_cuda, max_programs)
    args, kwargs = _kernel_args(table, stage_views, plan.slot_ids, plan.slot_ids.stride(0), n, plan.tensors, gather)
    if table.ready is not None:  # no host sync: the launch's stream waits on the device
        torch.cuda.current_stream(pool.device).wait_event(table.ready)
    with _launch_guard(on_cuda):
        _state_rows_copy_kernel[(grid,)](*args, **kwargs)
    return grid


def warm_up_state_calls(
    pool: StatePool, *, index_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64), on_cuda: bool = True
) -> list[tuple[tuple, dict]]:
    """The kernel arguments of every variant a native state copy of ``pool`` compiles, for
    16-byte aligned staging: per direction, slot id dtype, and one or several snapshots per call.
    Staging and slot ids are stood in for by their dtypes (Triton's ``MockTensor``)."""
    from triton.runtime.jit import MockTensor

    calls = []
    for multi in (False, True):
        table = state_table(pool, 16, multi, on_cuda=on_cuda)
        stage_views = tuple(MockTensor(v.dtype) for v in table.pool_views)
        for gather in (True, False):
            for dtype in index_dtypes:
                calls.append(
                    _kernel_args(
                        table, stage_views, MockTensor(dtype), 1, 2 if multi else 1, range(pool.num_tensors), gather
                    )
                )
    return calls


def warm_up_state(pool: StatePool) -> int:
    """Compile every state-kernel variant of ``pool`` and build its tables before the first copy.
    Call it under the pool's device. Returns the variants compiled (0 under the interpreter)."""
    calls = warm_up_state_calls(pool, on_cuda=pool.device.type == "cuda")
    if pool.device.type != "cuda":
        return 0
    for args, kwargs in calls:
        _state_rows_copy_kernel.warmup(*args, grid=(1,), **kwargs)
    return len(calls)


def compile_state_ptx(row_bytes: list[int], *, gather: bool = True, num_slots: int = 4, arch: int = 90) -> str:
    """Compile the state kernel for ``sm_<arch>`` without a GPU and return its PTX.

    The pool is one uint8 tensor ``[num_slots, row]`` per entry of ``row_bytes`` (16-byte aligned
    separate allocations, as a CUDA allocator gives), one snapshot per call, int64 slot ids;
    arguments are specialized by Triton's own rules, as a launch does. Needs ``TRITON_INTERPRET``
    unset when this module was imported.
    """
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import MockTensor, native_specialize_impl

    pool = StatePool([torch.empty(num_slots, row, dtype=torch.uint8) for row in row_bytes])
    args, kwargs = warm_up_state_calls(pool, index_dtypes=(torch.int64,))[0 if gather else 1]
    names = list(inspect.signature(_state_rows_copy_kernel.fn).parameters)
    signature, attrs, constexprs = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        value = MockTensor.wrap_dtype(value)
        if isinstance(value, torch.Tensor):  # pool views and the table: aligned like a CUDA allocation
            value = MockTensor(value.dtype)
        kind, key = native_specialize_impl(BaseBackend, value, False, name not in _VARYING, True)
        if kind == "constexpr":
            signature[name], constexprs[(i,)] = "constexpr", key
        else:
            signature[name] = kind
            if key:
                attrs[(i,)] = BaseBackend.parse_attr(key)
    for name, value in kwargs.items():
        if name == "num_warps":
            continue
        signature[name], constexprs[(names.index(name),)] = "constexpr", value
    source = ASTSource(fn=_state_rows_copy_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}).asm["ptx"]
