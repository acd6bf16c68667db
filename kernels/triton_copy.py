"""The Triton kernel that moves token rows between the device pool and a staging buffer, and its launcher.

One kernel serves both directions (``GATHER``: pool -> staging; else staging -> pool) and
both staging layouts (they differ only in strides). It moves *words*, not elements: every
tensor is viewed as the widest integer word (8, 4, 2 or 1 bytes) that divides the row
(``num_heads * head_dim * itemsize``) and every base address, so fp16, bf16, fp32, fp8 and
int8 are one code path, and 16-byte vector accesses happen where the row allows.

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
from kvstage.kernels.words import as_words, widest_word

__all__ = ["LaunchConfig", "choose_config", "launch", "set_config_hook", "DEFAULT_MAX_PROGRAMS"]

# Default grid cap on CUDA. Each program keeps one tile (8-16 KiB) per (part, layer) in flight;
# 32 programs keep about 0.5 MiB in flight, enough to cover PCIe latency, on a quarter of an
# H200's 132 SMs. Override per call (max_programs=) or with KVSTAGE_MAX_PROGRAMS.
DEFAULT_MAX_PROGRAMS = 32
# Under the interpreter every program runs one after the other in Python; few big ones are cheapest.
INTERPRETER_MAX_PROGRAMS = 4


@triton.jit
def _kv_rows_copy_kernel(
    pool_base,  # *word: the first pool buffer; buffer (p, l) starts at pool_base + layer_offsets[p * num_layers + l]
    layer_offsets,  # *int64 [kv_parts * num_layers]: word offsets of each buffer from pool_base
    staging,  # *word: the staging buffer
    slot_indices,  # *int32|int64 [num_tokens]: device slot of each token, slot_stride elements apart
    host_page_ids,  # *int32|int64 [num_tokens // page_size]: host page of each page, page_id_stride elements apart
    slot_stride,  # elements between consecutive slot_indices (0 for an expanded view)
    page_id_stride,  # elements between consecutive host_page_ids
    num_tokens,
    row_words,  # words per slot row (num_heads * head_dim * itemsize / word)
    page_size,
    num_layers,
    layer_start,
    layer_stop,
    kv_parts,
    staging_page_stride,  # words between host pages
    staging_part_stride,  # words between parts
    staging_layer_stride,  # words between layers
    GATHER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN words (vectorization hint)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
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
        device_row = tl.multiple_of(slot * row_words, ALIGN)
        host_row = tl.multiple_of(page * staging_page_stride + (token % page_size).to(tl.int64) * row_words, ALIGN)
        for part in range(0, kv_parts):
            part64 = tl.cast(part, tl.int64)
            for layer in range(layer_start, layer_stop):
                layer64 = tl.cast(layer, tl.int64)
                buffer = tl.multiple_of(tl.load(layer_offsets + part64 * num_layers + layer64), ALIGN)
                device_ptr = pool_base + buffer + device_row[:, None] + col[None, :]
                host_ptr = (
                    staging + part64 * staging_part_stride + layer64 * staging_layer_stride + host_row[:, None] + col[None, :]
                )
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


def choose_config(row_words: int, word_bytes: int, num_tokens: int, *, on_cuda: bool, max_programs: int | None) -> LaunchConfig:
    """The heuristic launch configuration (no autotuning: it needs a GPU and several configs).

    A tile is about 16 KiB on CUDA (whole rows where a row fits, so a token's row is read
    once per layer with full 16-byte vectors); under the interpreter tiles are as big as the
    batch allows (each program step is a numpy call, so fewer bigger steps are faster).

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
    block_t = min(triton.next_power_of_2(max(num_tokens, 1)), max(1, tile_bytes // (block_w * word_bytes)))
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
    align: int  # power of two (words) dividing the row and every offset, up to 16 bytes


KERNEL_MAX_WORD = 8  # bytes: the kernel moves 8-, 4-, 2- or 1-byte words (wider runs vectorise)


# Per-call work is Python, and a scatter per layer runs once per layer of every forward pass:
# the views and the offset table (an H2D copy) are built once per pool and word size, and
# kept here (never in the pool object) for as long as the pool lives.
_POOL_WORDS: "weakref.WeakKeyDictionary[KVPool, dict[int, _PoolWords]]" = weakref.WeakKeyDictionary()


def _pool_words(pool: KVPool, word: int) -> _PoolWords:
    entry = _POOL_WORDS.setdefault(pool, {}).get(word)
    if entry is None:
        tensors = pool.tensors()
        base_ptr = tensors[0].data_ptr()
        byte_offsets = [t.data_ptr() - base_ptr for t in tensors]  # may be negative
        entry = _POOL_WORDS[pool][word] = _PoolWords(
            as_words(tensors[0], pool.row_bytes, word),
            to_device_async(torch.tensor([o // word for o in byte_offsets], dtype=torch.int64), pool.device),
            widest_word(pool.row_bytes, byte_offsets) // word,
        )
    return entry


# Triton's interpreter patches triton.language for the duration of a launch and restores it
# after, so two launches from two threads break each other at random ("Did you forget to add
# @triton.jit?"). Interpreter launches take this lock; native launches never do.
_INTERPRETER_LOCK = threading.Lock()


def _launch_guard(on_cuda: bool) -> contextlib.AbstractContextManager:
    """The interpreter lock for a launch on CPU tensors under the interpreter; nothing on CUDA."""
    return _INTERPRETER_LOCK if not on_cuda and triton_interpreter_enabled() else contextlib.nullcontext()


def launch(plan: Transfer, *, gather: bool, max_programs: int | None = None) -> LaunchConfig | None:
    """Run the copy kernel for a validated :class:`Transfer` on the current stream.

    Returns the :class:`LaunchConfig` used (``None`` for an empty batch, which launches nothing).
    """
    if plan.num_pages == 0:
        return None
    pool = plan.pool
    word = widest_word(pool.row_bytes, [plan.staging.data_ptr()], min(KERNEL_MAX_WORD, pool.word_alignment))
    row_words = pool.row_bytes // word
    words = _pool_words(pool, word)
    staging_words = as_words(plan.staging, pool.row_bytes, word)
    on_cuda = pool.device.type == "cuda"
    config = (_config_hook or choose_config)(row_words, word, plan.num_tokens, on_cuda=on_cuda, max_programs=max_programs)
    ps, layers, parts = plan.page_size, pool.num_layers, pool.kv_parts
    if plan.layout == "page_first":  # [P, L, parts, ps, row]
        page_stride, part_stride, layer_stride = layers * parts * ps * row_words, ps * row_words, parts * ps * row_words
    else:  # [parts, L, P * ps, row]
        tokens = plan.num_host_pages * ps
        page_stride, part_stride, layer_stride = ps * row_words, layers * tokens * row_words, tokens * row_words
    with _launch_guard(on_cuda):
        _kv_rows_copy_kernel[(config.num_programs,)](
            words.base,
            words.table,
            staging_words,
            plan.slot_indices,
            plan.host_page_ids,
            plan.slot_indices.stride(0),
            plan.host_page_ids.stride(0),
            plan.num_tokens,
            row_words,
            ps,
            layers,
            plan.layers.start,
            plan.layers.stop,
            parts,
            page_stride,
            part_stride,
            layer_stride,
            GATHER=gather,
            BLOCK_T=config.block_t,
            BLOCK_W=config.block_w,
            ALIGN=words.align,
            num_warps=config.num_warps,
        )
    return config


def compile_ptx(*, gather: bool = True, block_t: int = 8, block_w: int = 256, align: int = 2, num_warps: int = 8, arch: int = 90) -> str:
    """Compile the kernel for ``sm_<arch>`` without a GPU (Triton ships ptxas) and return its PTX.

    Arguments are specialized as a native launch would specialize them for a 16-byte aligned
    pool and staging buffer with int64 words (pointers and sizes divisible by 16), so the
    PTX shows whether the copies use 16-byte vector accesses (``.v2.b64``). Needs
    ``TRITON_INTERPRET`` unset when this module was imported.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        "pool_base": "*i64", "layer_offsets": "*i64", "staging": "*i64", "slot_indices": "*i64", "host_page_ids": "*i64",
        "slot_stride": "i32", "page_id_stride": "i32", "num_tokens": "i32", "row_words": "i32", "page_size": "i32", "num_layers": "i32", "layer_start": "i32",
        "layer_stop": "i32", "kv_parts": "i32", "staging_page_stride": "i64", "staging_part_stride": "i64",
        "staging_layer_stride": "i64", "GATHER": "constexpr", "BLOCK_T": "constexpr", "BLOCK_W": "constexpr", "ALIGN": "constexpr",
    }
    divisible = [i for i, name in enumerate(signature) if name in {"pool_base", "layer_offsets", "staging", "slot_indices", "host_page_ids", "row_words", "staging_page_stride", "staging_part_stride", "staging_layer_stride"}]
    source = ASTSource(
        fn=_kv_rows_copy_kernel, signature=signature,
        constexprs={"GATHER": gather, "BLOCK_T": block_t, "BLOCK_W": block_w, "ALIGN": align},
        attrs={(i,): [["tt.divisibility", 16]] for i in divisible},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"]
