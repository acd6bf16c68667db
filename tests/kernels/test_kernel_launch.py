"""The Triton launcher: word size, grid cap and grid-stride loop, staged mode, NVTX, the streams helper."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from kvstage import nvtx_ranges
from kvstage.kernels import gather, gather_async, launch_after, scatter, scatter_async, triton_copy
from kvstage.kernels.layout import page_runs
from kvstage.kernels.words import widest_word

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
    same_bytes,
)


def test_word_is_the_widest_dividing_row_and_addresses():
    base = torch.empty(64, dtype=torch.uint8).data_ptr()  # torch's allocator aligns to at least 64 bytes
    assert widest_word(144, [base]) == 16
    assert widest_word(144, [base], max_word=8) == 8
    assert widest_word(36, [base]) == 4
    assert widest_word(18, [base]) == 2
    assert widest_word(9, [base]) == 1
    assert widest_word(144, [base, base + 4]) == 4  # a buffer starting 4 bytes in
    assert widest_word(144, [base + 1]) == 1
    assert widest_word(576, [0, -576 * 7]) == 16  # negative byte offsets (buffers below the first)


def test_one_word_rule_for_both_backends_and_none_stored_in_the_pool(device):
    import ast
    import inspect

    from kvstage.kernels import reference

    imported = {
        node.module for node in ast.walk(ast.parse(inspect.getsource(triton_copy))) if isinstance(node, ast.ImportFrom)
    }
    assert "kvstage.kernels.reference" not in imported
    pool = make_pool(parts=2, layers=2, num_slots=8, heads=1, dim=16, dtype=torch.float16, device=device)
    before = set(vars(pool))
    staging = make_staging(pool, 2, 2, "page_first")
    slot_indices, host_page_ids = make_indices(pool, 2, 2, 2)
    gather(pool, staging, slot_indices, host_page_ids, page_size=2, backend="triton")
    gather(pool, staging, slot_indices, host_page_ids, page_size=2, backend="torch")
    assert set(vars(pool)) - before == {"word_alignment"}  # KVPool's own cached_property, nothing else
    assert reference.widest_word is triton_copy.widest_word


@pytest.mark.parametrize(
    "on_cuda, expected_cap",
    [(True, triton_copy.DEFAULT_MAX_PROGRAMS), (False, triton_copy.INTERPRETER_MAX_PROGRAMS)],
    ids=["cuda", "interpreter"],
)
def test_grid_is_capped_by_default(on_cuda, expected_cap, monkeypatch):
    monkeypatch.delenv("KVSTAGE_MAX_PROGRAMS", raising=False)
    config = triton_copy.choose_config(256, 8, 1 << 20, on_cuda=on_cuda, max_programs=None)
    assert config.num_programs == expected_cap
    assert config.block_w == 256  # a Llama-3-8B row (8 heads x 128 x bf16 = 2 KiB) in one tile row
    monkeypatch.setenv("KVSTAGE_MAX_PROGRAMS", "3")
    assert triton_copy.choose_config(256, 8, 1 << 20, on_cuda=on_cuda, max_programs=None).num_programs == 3
    assert triton_copy.choose_config(256, 8, 1 << 20, on_cuda=on_cuda, max_programs=7).num_programs == 7
    assert (
        triton_copy.choose_config(256, 8, 1, on_cuda=on_cuda, max_programs=7).num_programs == 1
    )  # never more than tiles


@pytest.fixture
def tiny_tiles():
    """Force 2-token x 8-word tiles: many tiles, several column tiles per row, a short grid."""

    def hook(row_words, word_bytes, num_tokens, *, on_cuda, max_programs):
        return triton_copy.LaunchConfig(block_t=2, block_w=8, num_warps=1, num_programs=max_programs or 3)

    triton_copy.set_config_hook(hook)
    yield
    triton_copy.set_config_hook(None)


@pytest.mark.parametrize("programs", [1, 3], ids=["1-program", "3-programs"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_grid_stride_loop_covers_every_tile(device, tiny_tiles, programs, layout):
    pool = make_pool(
        parts=2, layers=2, num_slots=24, heads=1, dim=36, dtype=torch.float16, device=device, storage="scattered"
    )
    staging = make_staging(pool, 6, 3, layout)
    slot_indices, host_page_ids = make_indices(
        pool, 5, 3, 6
    )  # 15 tokens = 8 token tiles; 74-byte gaps -> 2-byte words, 36 a row = 5 column tiles
    want = expected_staging(pool, staging, slot_indices, host_page_ids, 3, layout)
    gather(
        pool, staging, slot_indices, host_page_ids, page_size=3, layout=layout, backend="triton", max_programs=programs
    )
    assert torch.equal(as_bytes(staging), want.view(-1))
    random_bytes_(staging, torch.Generator().manual_seed(5))
    want_pool = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, 3, layout)
    scatter(
        staging, pool, slot_indices, host_page_ids, page_size=3, layout=layout, backend="triton", max_programs=programs
    )
    assert pool_equals(pool, want_pool)


def test_page_runs_group_consecutive_host_pages():
    assert page_runs([5, 6, 7, 1, 2, 9]) == [(0, 5, 3), (3, 1, 2), (5, 9, 1)]
    assert page_runs([3]) == [(0, 3, 1)]
    assert page_runs([4, 3]) == [(0, 4, 1), (1, 3, 1)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_staged_mode_equals_python_loops_and_kernel_mode(device, layout, backend):
    pool = make_pool(parts=2, layers=3, num_slots=40, heads=5, dim=72, dtype=torch.bfloat16, device=device)
    pinned = device.type == "cuda"
    staging = make_staging(pool, 10, 3, layout, pinned=pinned)
    slot_indices, _ = make_indices(pool, 6, 3, 10)
    host_page_ids = torch.tensor(
        [5, 6, 7, 1, 2, 9]
    )  # three runs; on CPU, as an engine's host pool would hand them over
    want = expected_staging(pool, staging, slot_indices, host_page_ids, 3, layout)
    kernel_staging = make_staging(pool, 10, 3, layout, pinned=pinned)  # (a clone would not be pinned)
    gather(pool, kernel_staging, slot_indices, host_page_ids, page_size=3, layout=layout, backend=backend)
    gather(pool, staging, slot_indices, host_page_ids, page_size=3, layout=layout, backend=backend, mode="staged")
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(as_bytes(staging), want.view(-1)) and same_bytes(staging, kernel_staging)
    original = pool_bytes(pool)
    for t in pool.tensors():
        t.view(torch.uint8)[slot_indices.long()] = 0xA5
    scatter(
        staging,
        pool,
        slot_indices,
        host_page_ids,
        page_size=3,
        layout=layout,
        backend=backend,
        mode="staged",
        layer=None,
    )
    assert changed_buffers(original, pool) == []


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_staged_scatter_of_one_layer_moves_only_that_layer(device, layout):
    pool = make_pool(parts=2, layers=3, num_slots=24, heads=1, dim=16, dtype=torch.float16, device=device)
    staging = make_staging(pool, 5, 2, layout, pinned=device.type == "cuda")
    random_bytes_(staging, torch.Generator().manual_seed(4))
    slot_indices, _ = make_indices(pool, 3, 2, 5)
    host_page_ids = torch.tensor([4, 0, 1])
    want = expected_pool_after_scatter(pool, staging, slot_indices, host_page_ids, 2, layout, layer=1)
    before = pool_bytes(pool)
    scatter(
        staging, pool, slot_indices, host_page_ids, page_size=2, layout=layout, layer=1, mode="staged", backend="triton"
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert pool_equals(pool, want)
    assert changed_buffers(before, pool) == [1, 3 + 1]  # K and V of layer 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_every_launch_runs_inside_its_nvtx_range(device, backend, monkeypatch):
    seen = []
    real_launch = triton_copy.launch

    def spy(plan, *, gather, max_programs=None):
        seen.append(nvtx_ranges.open_ranges())
        return real_launch(plan, gather=gather, max_programs=max_programs)

    monkeypatch.setattr(triton_copy, "launch", spy)
    from kvstage.kernels import reference

    real_torch = reference.run_gather_torch
    monkeypatch.setattr(
        "kvstage.kernels.transfer.run_gather_torch",
        lambda plan: (seen.append(nvtx_ranges.open_ranges()), real_torch(plan)),
    )
    pool = make_pool(parts=1, layers=2, num_slots=8, heads=1, dim=16, dtype=torch.float16, device=device)
    staging = make_staging(pool, 2, 2, "page_first")
    slot_indices, host_page_ids = make_indices(pool, 2, 2, 2)
    gather(pool, staging, slot_indices, host_page_ids, page_size=2, backend=backend)
    scatter(staging, pool, slot_indices, host_page_ids, page_size=2, backend=backend)
    if backend == "triton":
        assert seen == [("gather",), ("scatter",)]
    else:
        assert seen == [("gather",)]  # the reference opens its own inner range
    assert nvtx_ranges.open_ranges() == ()


def test_streams_helper_copies_and_completes(device):
    pool = make_pool(parts=2, layers=2, num_slots=16, heads=1, dim=16, dtype=torch.float16, device=device)
    staging = make_staging(pool, 3, 2, "page_first", pinned=True)
    slot_indices, host_page_ids = make_indices(pool, 2, 2, 3)
    want = expected_staging(pool, staging, slot_indices, host_page_ids, 2)
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    handle = gather_async(pool, staging, slot_indices, host_page_ids, stream=stream, page_size=2)
    handle.synchronize()
    assert handle.query()
    assert torch.equal(as_bytes(staging), want.view(-1))
    original = pool_bytes(pool)
    for t in pool.tensors():
        t.view(torch.uint8)[slot_indices.long()] = 0
    handle = scatter_async(staging, pool, slot_indices, host_page_ids, stream=stream, page_size=2)
    handle.wait()  # the consumer's stream waits; on CPU it already ran
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    assert changed_buffers(original, pool) == []


def test_launch_after_runs_inline_without_a_stream():
    calls = []
    handle = launch_after(functools.partial(calls.append, 1), stream=None, keep_alive=[torch.zeros(1)])
    assert calls == [1] and handle.query() and handle.device is None and handle.error is None


def test_launch_after_raises_what_an_inline_copy_raises():
    def failing():
        raise RuntimeError("bad copy")

    with pytest.raises(RuntimeError, match="bad copy"):
        launch_after(failing, stream=None)


def test_launch_after_names_a_bad_stream():
    from kvstage.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="^stream: must be a torch.cuda.Stream or None"):
        launch_after(lambda: None, stream="side")


@pytest.mark.gpu
def test_side_stream_copy_waits_for_the_producer():
    """The producer writes the pool after a long kernel; the gather on the side stream must see the write."""
    device = torch.device("cuda")
    pool = make_pool(parts=2, layers=2, num_slots=64, heads=8, dim=128, dtype=torch.bfloat16, device=device)
    staging = make_staging(pool, 4, 16, "page_first", pinned=True)
    slot_indices, host_page_ids = make_indices(pool, 4, 16, 4)
    side = torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # keep the producer busy for tens of ms
    for t in pool.tensors():
        t.fill_(1.5)
    handle = gather_async(pool, staging, slot_indices, host_page_ids, stream=side, page_size=16)
    handle.synchronize()
    assert (staging.float() == 1.5).all()


# The kernel and its varying arguments are private: the specialization of their launch is what is checked.
KERNEL_PARAMS = list(inspect.signature(triton_copy._kv_rows_copy_kernel.fn).parameters)


def _specialization(args, kwargs):
    """What selects a compiled variant: Triton's key of every specialized argument, and the constexprs."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import MockTensor, native_specialize_impl

    keys = {}
    for name, value in zip(KERNEL_PARAMS, args):
        value = MockTensor.wrap_dtype(value)
        specialize = name not in triton_copy._VARYING
        keys[name] = native_specialize_impl(BaseBackend, value, False, specialize, True)
    return keys, {k: kwargs[k] for k in ("GATHER", "BLOCK_T", "BLOCK_W", "VEC", "num_warps")}


@pytest.mark.parametrize(
    "rows", [(8, 128, torch.bfloat16), (1, 576, torch.float8_e4m3fn)], ids=["llama-rows", "mla-fp8-rows"]
)
def test_warm_up_compiles_the_variant_of_every_later_copy(rows, monkeypatch):
    """Batches of 1, 16 and 5 pages, both layouts, a per-layer scatter at layers 0, 1 and 2, int32
    and int64 indices: each launch's specialization (as Triton computes it on CUDA) is one
    that warm_up compiled, so none compiles on the hot path."""
    heads, dim, dtype = rows
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(_specialization(args, kwargs))

    monkeypatch.setattr(triton_copy, "_kv_rows_copy_kernel", Recorder())
    real = triton_copy.choose_config
    monkeypatch.setattr(
        triton_copy, "choose_config", lambda *a, **k: real(*a, **{**k, "on_cuda": True})
    )  # CUDA's tile shapes
    pool = make_pool(
        parts=2 if heads > 1 else 1,
        layers=3,
        num_slots=96,
        heads=heads,
        dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    warmed = [_specialization(args, kwargs) for args, kwargs in triton_copy.warm_up_calls(pool, 4)]
    for num_pages, layout, index_dtype in [
        (1, "page_first", torch.int64),
        (16, "layer_first", torch.int32),
        (5, "page_first", torch.int32),
    ]:
        staging = make_staging(pool, 20, 4, layout)
        slot_indices, host_page_ids = make_indices(pool, num_pages, 4, 20, index_dtype=index_dtype)
        gather(pool, staging, slot_indices, host_page_ids, page_size=4, layout=layout, backend="triton")
        for layer in (None, 0, 1, 2):
            scatter(
                staging, pool, slot_indices, host_page_ids, page_size=4, layout=layout, layer=layer, backend="triton"
            )
    assert len(launches) == 15
    assert all(launch in warmed for launch in launches)
    assert len({repr(w) for w in warmed}) == len(warmed) == 8  # 2 directions x 2 x 2 index dtypes, all distinct
