"""The Triton kernel that moves token rows between the device pool and a staging buffer, and its launcher.

One kernel serves both directions (``GATHER``: pool -> staging; else staging -> pool) and
both staging layouts (they differ only in strides). It moves *words*, not elements: every
tensor is viewed as integer words of up to 8 bytes, ``VEC`` of them making the widest vector
(up to 16 bytes) that divides the row (``num_heads * head_dim * itemsize``) and every base
address (:func:`kvstage.kernels.words.widest_word`), so fp16, bf16, fp32, fp8 and int8 are
one code path, and every row that allows 16-byte accesses gets them.

Index tensors are read by their strides (any 1-D view). Ints that vary per call are not
specialized, so the variants a pool needs are few and :func:`warm_up` compiles them ahead of
the hot path. Under the interpreter launches are serialized (it is not thread-safe).

Work decomposition: the batch's ``num_tokens = num_pages * page_size`` rows are cut into tiles
of ``BLOCK_T`` tokens x ``BLOCK_W`` words; a program loads a tile's slot and page indices
once, then copies that tile in every (part, layer). Programs walk the tiles grid-stride, so
the grid is capped at ``max_programs`` (a copy kernel must leave the forward pass its SMs)
whatever the batch size.

The per-layer buffers need not be adjacent: the kernel receives the first buffer as
``pool_base`` and an int64 table of every (part, layer) buffer's word offset from it (which
may be negative). All offsets are computed in int64, so pools and staging buffers past
2**31 bytes (or words) work.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from kvstage.kernels.backend import triton_interpreter_enabled
from kvstage.kernels.layout import Transfer, to_device_async
from kvstage.kernels.pool import KVPool
from kvstage.kernels.words import WORD_DTYPES, as_words, widest_word

__all__ = [
    "LaunchConfig",
    "choose_config",
    "compile_ptx",
    "copy_words",
    "launch",
    "set_config_hook",
    "warm_up",
    "warm_up_calls",
    "DEFAULT_MAX_PROGRAMS",
]

# Default grid cap on CUDA. Each program keeps one tile (8-16 KiB) per (part, layer) in flight;
# 32 programs keep about 0.5 MiB in flight, enough to cover PCIe latency, on a quarter of an
# H200's 132 SMs. Override per call (max_programs=) or with KVSTAGE_MAX_PROGRAMS.
DEFAULT_MAX_PROGRAMS = 32
# Under the interpreter every program runs one after the other in Python; few big ones are cheapest.
INTERPRETER_MAX_PROGRAMS = 4


# Ints that vary from call to call are not specialized: Triton would otherwise compile a new
# variant whenever one of them is 1 or turns divisible by 16 (a batch of 16 tokens, layer 1
# of a per-layer scatter). The index pointers are not specialized on alignment either (a
# slice of req_to_token starts anywhere). What stays specialized is fixed per pool and page
# size, so :func:`warm_up` can compile every variant before the first copy.
_VARYING = (
    "slot_indices",
    "host_page_ids",
    "slot_stride",
    "page_id_stride",
    "num_tokens",
    "layer_start",
    "layer_stop",
    "staging_page_stride",
    "staging_part_stride",
    "staging_layer_stride",
)


@triton.jit(do_not_specialize=_VARYING)
def _kv_rows_copy_kernel(
    pool_base,  # *word: the first pool buffer; buffer (p, l) starts at pool_base + layer_offsets[p * num_layers + l]
    layer_offsets,  # *int64 [kv_parts * num_layers]: word offsets of each buffer from pool_base
    staging,  # *word: the staging buffer
    slot_indices,  # *int32|int64 [num_tokens]: device slot of each token, slot_stride elements apart
    host_page_ids,  # *int32|int64 [num_tokens // page_size]: host page of each page, page_id_stride elements apart
    slot_stride,  # elements between consecutive slot_indices (0 for an expanded view)
    page_id_stride,  # elements between consecutive host_page_ids
    num_tokens,
    row_vecs,  # vectors (VEC words) per slot row
    page_size,
    num_layers,
    layer_start,
    layer_stop,
    kv_parts,
    staging_page_stride,  # vectors between host pages
    staging_part_stride,  # vectors between parts
    staging_layer_stride,  # vectors between layers
    GATHER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,  # words per tile row (a multiple of VEC)
    VEC: tl.constexpr,  # words per vector: every row, buffer and staging offset is a multiple of it
):
    # Lengths and strides arrive in vectors and are scaled here, so the compiler knows every
    # row start and the row end are multiples of VEC words (16 bytes when the pool allows):
    # the row copies become 16-byte accesses whatever the row length (e.g. 576-byte MLA rows).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    row_words = row_vecs * VEC
    col_tiles = tl.cdiv(row_words, BLOCK_W)
    num_tiles = tl.cdiv(num_tokens, BLOCK_T) * col_tiles
    for tile in range(pid, num_tiles, num_programs):
        token = (tile // col_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = ((tile % col_tiles) * BLOCK_W + tl.arange(0, BLOCK_W)).to(tl.int64)
        token_ok = token < num_tokens
        mask = token_ok[:, None] & (col < row_words)[None, :]
        token64 = token.to(tl.int64)
        slot = tl.load(slot_indices + token64 * slot_stride, mask=token_ok, other=0).to(tl.int64)
        page = tl.load(host_page_ids + (token64 // page_size) * page_id_stride, mask=token_ok, other=0).to(tl.int64)
        device_row = tl.multiple_of(slot * row_words, VEC)
        host_row = tl.multiple_of(page * (staging_page_stride * VEC) + (token64 % page_size) * row_words, VEC)
        for part in range(0, kv_parts):
            part64 = tl.cast(part, tl.int64)
            for layer in range(layer_start, layer_stop):
                layer64 = tl.cast(layer, tl.int64)
                buffer = tl.multiple_of(tl.load(layer_offsets + part64 * num_layers + layer64), VEC)
                plane = tl.multiple_of((part64 * staging_part_stride + layer64 * staging_layer_stride) * VEC, VEC)
                device_ptr = pool_base + buffer + device_row[:, None] + col[None, :]
                host_ptr = staging + plane + host_row[:, None] + col[None, :]
                if GATHER:
                    rows = tl.load(device_ptr, mask=mask, eviction_policy="evict_first")
                    tl.store(host_ptr, rows, mask=mask)
                else:
                    rows = tl.load(host_ptr, mask=mask, eviction_policy="evict_first")
                    tl.store(device_ptr, rows, mask=mask)


@dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of one copy: tile ``block_t`` tokens x ``block_w`` words, ``num_warps``, grid size."""

    block_t: int
    block_w: int
    num_warps: int
    num_programs: int


def choose_config(
    row_words: int, word_bytes: int, num_tokens: int, *, on_cuda: bool, max_programs: int | None
) -> LaunchConfig:
    """The heuristic launch configuration (no autotuning: it needs a GPU and several configs).

    A tile is about 16 KiB on CUDA (whole rows where a row fits, so a token's row is read
    once per layer with full 16-byte vectors) whatever the batch size, so that the tile
    shape, a compile-time constant, never changes from call to call; under the interpreter
    tiles are as big as the batch allows (each program step is a numpy call, so fewer bigger
    steps are faster, and nothing compiles).

    Args:
        row_words: words per row; word_bytes: bytes per word; num_tokens: rows per (part, layer).
        on_cuda: native launch (else the interpreter).
        max_programs: grid cap; ``None`` = ``KVSTAGE_MAX_PROGRAMS`` or the default.
    """
    if max_programs is None:
        env = os.environ.get("KVSTAGE_MAX_PROGRAMS")
        max_programs = int(env) if env else (DEFAULT_MAX_PROGRAMS if on_cuda else INTERPRETER_MAX_PROGRAMS)
    tile_bytes = 16 * 1024 if on_cuda else 1 << 20
    block_w = min(triton.next_power_of_2(row_words), max(1, tile_bytes // word_bytes))
    block_t = max(1, tile_bytes // (block_w * word_bytes))
    if not on_cuda:
        block_t = min(triton.next_power_of_2(max(num_tokens, 1)), block_t)
    tiles = triton.cdiv(num_tokens, block_t) * triton.cdiv(row_words, block_w)
    num_warps = 8 if block_t * block_w * word_bytes >= 8192 else 4
    return LaunchConfig(block_t, block_w, num_warps, max(1, min(tiles, max_programs)))


_config_hook: Callable[..., LaunchConfig] | None = None


def set_config_hook(hook: Callable[..., LaunchConfig] | None) -> None:
    """Replace :func:`choose_config` (same arguments) with ``hook``, e.g. a GPU autotuner's table; ``None`` restores it."""
    global _config_hook
    _config_hook = hook


@dataclass(frozen=True)
class _PoolWords:
    """What a launch needs from the pool at one word size; built once per (pool, word)."""

    base: torch.Tensor  # the first buffer as [num_slots, row_words] words
    table: torch.Tensor  # int64 [kv_parts * num_layers] word offsets from base, on the pool's device


KERNEL_MAX_WORD = 8  # bytes: the kernel moves 8-, 4-, 2- or 1-byte words, VEC of them per vector


# Per-call work is Python, and a scatter per layer runs once per layer of every forward pass:
# the views and the offset table (an H2D copy) are built once per pool and word size, and
# kept here (never in the pool object) for as long as the pool lives.
_POOL_WORDS: "weakref.WeakKeyDictionary[KVPool, dict[int, _PoolWords]]" = weakref.WeakKeyDictionary()
_POOL_WORDS_LOCK = threading.Lock()


def _pool_words(pool: KVPool, word: int) -> _PoolWords:
    with _POOL_WORDS_LOCK:
        entry = _POOL_WORDS.setdefault(pool, {}).get(word)
        if entry is None:
            tensors = pool.tensors()
            base_ptr = tensors[0].data_ptr()
            offsets = [(t.data_ptr() - base_ptr) // word for t in tensors]  # may be negative
            entry = _POOL_WORDS[pool][word] = _PoolWords(
                as_words(tensors[0], pool.row_bytes, word),
                to_device_async(torch.tensor(offsets, dtype=torch.int64), pool.device),
            )
        return entry


def copy_words(pool: KVPool, staging_address: int) -> tuple[int, int]:
    """``(word, vec)``: the kernel's word in bytes and words per vector for ``pool`` and a staging buffer at ``staging_address``.

    The vector (``word * vec`` bytes, up to 16) is the widest word dividing the row, every
    pool buffer's address and the staging buffer's (:func:`kvstage.kernels.words.widest_word`).
    """
    vector = widest_word(pool.row_bytes, [staging_address], pool.word_alignment)
    word = min(vector, KERNEL_MAX_WORD)
    return word, vector // word


# Triton's interpreter patches triton.language for the duration of a launch and restores it
# after, so two launches from two threads break each other at random ("Did you forget to add
# @triton.jit?"). Interpreter launches take this lock; native launches never do.
_INTERPRETER_LOCK = threading.Lock()


def _launch_guard(on_cuda: bool) -> contextlib.AbstractContextManager:
    """The interpreter lock for a launch on CPU tensors under the interpreter; nothing on CUDA."""
    return _INTERPRETER_LOCK if not on_cuda and triton_interpreter_enabled() else contextlib.nullcontext()


def _kernel_args(
    pool: KVPool,
    staging,
    slot_indices,
    host_page_ids,
    *,
    word: int,
    vec: int,
    page_size: int,
    layout: str,
    num_host_pages: int,
    num_tokens: int,
    layers: range,
    slot_stride: int,
    page_id_stride: int,
    gather: bool,
    config: LaunchConfig,
) -> tuple[tuple, dict]:
    """The kernel's positional and keyword arguments: one builder for launches, warm-up and :func:`compile_ptx`."""
    words = _pool_words(pool, word)
    row_vecs = pool.row_bytes // (word * vec)
    ps, num_layers, parts = page_size, pool.num_layers, pool.kv_parts
    if layout == "page_first":  # [P, L, parts, ps, row]
        strides = (num_layers * parts * ps * row_vecs, ps * row_vecs, parts * ps * row_vecs)
    else:  # [parts, L, P * ps, row]
        tokens = num_host_pages * ps
        strides = (ps * row_vecs, num_layers * tokens * row_vecs, tokens * row_vecs)
    args = (
        words.base,
        words.table,
        staging,
        slot_indices,
        host_page_ids,
        slot_stride,
        page_id_stride,
        num_tokens,
        row_vecs,
        ps,
        num_layers,
        layers.start,
        layers.stop,
        parts,
        *strides,
    )
    return args, dict(
        GATHER=gather, BLOCK_T=config.block_t, BLOCK_W=config.block_w, VEC=vec, num_warps=config.num_warps
    )


def launch(plan: Transfer, *, gather: bool, max_programs: int | None = None) -> LaunchConfig | None:
    """Run the copy kernel for a validated :class:`Transfer` on the current stream.

    Returns the :class:`LaunchConfig` used (``None`` for an empty batch, which launches nothing).
    """
    if plan.num_pages == 0:
        return None
    pool = plan.pool
    word, vec = copy_words(pool, plan.staging.data_ptr())
    on_cuda = pool.device.type == "cuda"
    config = (_config_hook or choose_config)(
        pool.row_bytes // word, word, plan.num_tokens, on_cuda=on_cuda, max_programs=max_programs
    )
    args, kwargs = _kernel_args(
        pool,
        as_words(plan.staging, pool.row_bytes, word),
        plan.slot_indices,
        plan.host_page_ids,
        word=word,
        vec=vec,
        page_size=plan.page_size,
        layout=plan.layout,
        num_host_pages=plan.num_host_pages,
        num_tokens=plan.num_tokens,
        layers=plan.layers,
        slot_stride=plan.slot_indices.stride(0),
        page_id_stride=plan.host_page_ids.stride(0),
        gather=gather,
        config=config,
    )
    with _launch_guard(on_cuda):
        _kv_rows_copy_kernel[(config.num_programs,)](*args, **kwargs)
    return config


def warm_up_calls(
    pool: KVPool,
    page_size: int,
    *,
    index_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64),
    staging_alignment: int = 16,
) -> list[tuple[tuple, dict]]:
    """The kernel arguments of every variant a native copy of ``pool`` at ``page_size`` compiles.

    One per direction and (``slot_indices``, ``host_page_ids``) dtype pair, for staging
    buffers aligned to ``staging_alignment`` bytes (torch's allocations, pinned ones included,
    are aligned to far more). Staging and index tensors are stood in for by their dtypes
    (Triton's ``MockTensor``): only their dtype and alignment select a variant. Layouts, batch
    sizes and layers differ only in arguments that are not specialized.
    """
    word, vec = copy_words(pool, staging_alignment)
    config = (_config_hook or choose_config)(pool.row_bytes // word, word, page_size, on_cuda=True, max_programs=None)
    calls = []
    for gather in (True, False):
        for slot_dtype in index_dtypes:
            for page_id_dtype in index_dtypes:
                calls.append(
                    _kernel_args(
                        pool,
                        WORD_DTYPES[word],
                        slot_dtype,
                        page_id_dtype,
                        word=word,
                        vec=vec,
                        page_size=page_size,
                        layout="page_first",
                        num_host_pages=1,
                        num_tokens=page_size,
                        layers=range(pool.num_layers),
                        slot_stride=1,
                        page_id_stride=1,
                        gather=gather,
                        config=config,
                    )
                )
    return calls


def warm_up(pool: KVPool, page_size: int, **options) -> int:
    """Compile every kernel variant a native copy of ``pool`` at ``page_size`` needs, and build the
    pool's offset table, before the first copy (so none compiles or syncs on the hot path).

    Call it under the pool's device. ``options``: as :func:`warm_up_calls`. Returns the number of
    variants compiled: 0 under the interpreter (nothing compiles; the table is still built).
    """
    calls = warm_up_calls(pool, page_size, **options)
    if pool.device.type != "cuda":
        return 0
    for args, kwargs in calls:
        _kv_rows_copy_kernel.warmup(*args, grid=(1,), **kwargs)
    return len(calls)


def compile_ptx(
    *,
    row_bytes: int = 2048,
    page_size: int = 16,
    num_layers: int = 4,
    kv_parts: int = 2,
    gather: bool = True,
    arch: int = 90,
) -> str:
    """Compile the kernel for ``sm_<arch>`` without a GPU (Triton ships ptxas) and return its PTX.

    The arguments and their specialization are those of :func:`warm_up_calls` (int64 indices)
    for a pool of 16-byte aligned buffers with rows of ``row_bytes``, put through Triton's own
    specialization rules, so the PTX is what a native launch compiles: it shows whether the row
    copies use 16-byte vector accesses (``.v2.b64``). Needs ``TRITON_INTERPRET`` unset when
    this module was imported.
    """
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import MockTensor, native_specialize_impl

    buffers = torch.empty(
        (kv_parts, num_layers, 1, 1, row_bytes), dtype=torch.uint8
    )  # on CPU: only addresses and dtypes matter
    pool = KVPool.from_stacked(buffers)
    args, kwargs = warm_up_calls(pool, page_size, index_dtypes=(torch.int64,))[0 if gather else 1]
    names = list(inspect.signature(_kv_rows_copy_kernel.fn).parameters)
    signature, attrs, constexprs = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        value = MockTensor.wrap_dtype(value)
        if isinstance(value, torch.Tensor):  # the pool's buffers: aligned like a CUDA allocation
            value = MockTensor(value.dtype)
        kind, key = native_specialize_impl(BaseBackend, value, False, name not in _VARYING, True)
        if kind == "constexpr":
            signature[name], constexprs[(i,)] = "constexpr", key
        else:
            signature[name] = kind
            if key:
                attrs[(i,)] = BaseBackend.parse_attr(key)
    for name in ("GATHER", "BLOCK_T", "BLOCK_W", "VEC"):
        signature[name], constexprs[(names.index(name),)] = "constexpr", kwargs[name]
    source = ASTSource(fn=_kv_rows_copy_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": kwargs["num_warps"]}).asm[
        "ptx"
    ]
