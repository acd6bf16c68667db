"""Builders shared by tests/kernels: random pools, poisoned staging, byte-exact comparison, and
the expected bytes of a gather or scatter by plain Python loops (which share no code with
kvstage's planning, ``check_transfer``, that the Triton path and the torch reference both use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvstage.kernels import KVPool, staging_shape

POISON = 0xA5  # as a byte of fp16/bf16/fp32 it reads as a NaN-free odd value; as fp8 e4m3 0xA5 is -0.0703125


def random_bytes_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``t`` with random bytes (any dtype; floats may hold NaN/inf patterns: compare bytes)."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=generator)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))
    return t


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill every byte of ``t`` with :data:`POISON`."""
    t.view(-1).view(torch.uint8).fill_(POISON) if t.numel() else None
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat uint8 tensor on CPU."""
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (any dtypes, shapes and devices; NaNs compare equal)."""
    return torch.equal(as_bytes(a), as_bytes(b))


def make_pool(
    *,
    parts: int,
    layers: int,
    num_slots: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    storage: str = "lists",
    seed: int = 0,
) -> KVPool:
    """A pool of random bytes.

    storage: ``"lists"`` = one allocation per buffer; ``"stacked"`` = one 5-D tensor;
    ``"scattered"`` = buffers carved out of one allocation in reverse order with gaps of odd
    sizes between them (not adjacent, descending addresses, so table offsets go negative).
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots, heads, dim)
    if storage == "stacked":
        t = random_bytes_(torch.empty((parts, layers, *shape), dtype=dtype, device=device), gen)
        return KVPool.from_stacked(t)
    if storage == "lists":
        buffers = [
            [random_bytes_(torch.empty(shape, dtype=dtype, device=device), gen) for _ in range(layers)]
            for _ in range(parts)
        ]
    elif storage == "scattered":
        numel = num_slots * heads * dim
        gap = 37  # elements: keeps every buffer's start aligned to its element but not to 16 bytes
        arena = torch.empty(parts * layers * (numel + gap) + gap, dtype=dtype, device=device)
        random_bytes_(arena, gen)
        buffers = [[None] * layers for _ in range(parts)]
        k = 0
        for p in range(parts):
            for layer in range(layers):
                start = gap + (parts * layers - 1 - k) * (numel + gap)
                buffers[p][layer] = arena[start : start + numel].view(shape)
                k += 1
    else:
        raise ValueError(storage)
    if parts == 1:
        return KVPool.mla(buffers[0])
    return KVPool.mha(buffers[0], buffers[1])


def pool_bytes(pool: KVPool) -> list[torch.Tensor]:
    """A copy of every buffer's bytes, flat uint8 on CPU, in ``pool.tensors()`` order."""
    return [as_bytes(t).clone() for t in pool.tensors()]


def make_staging(
    pool: KVPool, num_host_pages: int, page_size: int, layout: str, *, pinned: bool = False
) -> torch.Tensor:
    """A poisoned staging buffer of ``staging_shape(pool, num_host_pages, page_size, layout)`` and
    the pool's dtype, on the pool's device (``pinned`` with a CUDA pool: pinned host memory)."""
    shape = staging_shape(pool, num_host_pages, page_size, layout)
    if pool.device.type == "cuda" and pinned:
        t = torch.empty(shape, dtype=pool.dtype, pin_memory=True)
    else:
        t = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    return poison_(t)


def make_indices(
    pool: KVPool,
    num_pages: int,
    page_size: int,
    num_host_pages: int,
    *,
    seed: int = 0,
    index_dtype=torch.int64,
    aligned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random slots (token order within a page) and distinct random host page ids."""
    gen = torch.Generator().manual_seed(seed + 1)
    if aligned:
        pool_pages = pool.num_slots // page_size
        starts = torch.randperm(pool_pages, generator=gen)[:num_pages] * page_size
        slot_indices = (starts[:, None] + torch.arange(page_size)).reshape(-1)
    else:
        slot_indices = torch.randperm(pool.num_slots, generator=gen)[: num_pages * page_size]
    host_page_ids = torch.randperm(num_host_pages, generator=gen)[:num_pages]
    return slot_indices.to(index_dtype).to(pool.device), host_page_ids.to(index_dtype).to(pool.device)


def expected_staging(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    page_size: int,
    layout: str = "page_first",
) -> torch.Tensor:
    """What ``staging`` holds after a gather, by plain Python loops over pages, tokens, parts and
    layers (no kvstage code: the oracle of the kernels and of the torch reference), as uint8
    bytes of ``staging``'s shape (its last dim times the element size)."""
    out = staging.detach().cpu().clone().view(torch.uint8)  # bytes: fp8 indexing needs no kernels
    s, h = slot_indices.cpu().tolist(), host_page_ids.cpu().tolist()
    for i, host_page in enumerate(h):
        for j in range(page_size):
            for p in range(pool.kv_parts):
                for layer in range(pool.num_layers):
                    row = pool.buffers[p][layer][s[i * page_size + j]].cpu().view(torch.uint8)
                    if layout == "page_first":
                        out[host_page, layer, p, j] = row
                    else:
                        out[p, layer, host_page * page_size + j] = row
    return out


def expected_pool_after_scatter(
    pool: KVPool,
    staging: torch.Tensor,
    slot_indices: torch.Tensor,
    host_page_ids: torch.Tensor,
    page_size: int,
    layout: str = "page_first",
    layer: int | None = None,
) -> list[torch.Tensor]:
    """Every buffer's bytes after a scatter of ``staging`` into ``pool`` (``layer``: that layer
    only, both parts), by plain Python loops; flat uint8 tensors in ``pool.tensors()`` order
    (part-major: ``p * num_layers + layer``). Read before the scatter: the pool's current bytes
    are the rows the scatter leaves alone."""
    out = [as_bytes(t).clone().view(pool.num_slots, -1) for t in pool.tensors()]
    host = staging.detach().cpu().contiguous().view(torch.uint8)
    s, h = slot_indices.cpu().tolist(), host_page_ids.cpu().tolist()
    for i, host_page in enumerate(h):
        for j in range(page_size):
            for p in range(pool.kv_parts):
                for each in range(pool.num_layers):
                    if layer is not None and each != layer:
                        continue
                    row = (
                        host[host_page, each, p, j]
                        if layout == "page_first"
                        else host[p, each, host_page * page_size + j]
                    )
                    out[p * pool.num_layers + each][s[i * page_size + j]] = row.reshape(-1)
    return [t.view(-1) for t in out]


def pool_equals(pool: KVPool, want: list[torch.Tensor]) -> bool:
    """Whether every buffer of ``pool`` holds the bytes of ``want`` (as :func:`expected_pool_after_scatter`)."""
    return len(want) == len(pool.tensors()) and all(
        torch.equal(as_bytes(t), w.view(-1)) for t, w in zip(pool.tensors(), want)
    )


def changed_buffers(before: list[torch.Tensor], pool: KVPool) -> list[int]:
    """Indices (``pool.tensors()`` order) of the buffers whose bytes differ from ``before`` (:func:`pool_bytes`)."""
    return [i for i, (old, t) in enumerate(zip(before, pool.tensors())) if not torch.equal(old, as_bytes(t))]


NO_PTXAS = 3  # a PTX script's exit status when Triton finds no ptxas binary for the target


def run_ptx_script(script: str, cases: dict) -> dict:
    """Run ``script`` (argv: the JSON ``cases``, :data:`NO_PTXAS`) in a subprocess; return its last JSON line.

    The native compiler needs ``TRITON_INTERPRET`` unset when triton is imported, hence the
    subprocess. A missing ptxas binary skips (under ``CI`` it fails: :func:`support.skip_missing`);
    any other error fails the test.
    """
    import pytest

    from support import skip_missing

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases), str(NO_PTXAS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode == NO_PTXAS:
        skip_missing(f"the ptxas binary for sm_90 ({result.stderr.strip()[-300:]}); Triton's wheel ships it")
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])
