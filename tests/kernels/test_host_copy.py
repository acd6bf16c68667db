"""kvstage.kernels.host_copy: batched host-to-host row copies (the C streaming copy and the
memmove fallback): every byte lands, nothing outside a row is written, odd sizes and unaligned
starts, many rows, threads at once, bad input refused before any byte moves."""

from __future__ import annotations

import importlib
import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.errors import ArgumentTypeError, DeviceMismatchError, InvalidArgumentError
from kvstage.kernels import host_copy

from support import CI, skip_missing

POISON = 0xA5
MARGIN = 64  # poisoned bytes each side of a row's target
ODD_SIZES = [0, 1, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, (1 << 20) + 3]


def _compiled_module():
    try:
        return importlib.import_module("kvstage.kernels._host_copy")
    except ImportError as exc:
        skip_missing(f"kvstage.kernels._host_copy ({exc}; `pip install -e .` builds it)")


@pytest.fixture(params=["compiled", "fallback"])
def implementation(request, monkeypatch):
    """Each test runs on the C extension and on the memmove fallback."""
    module = _compiled_module() if request.param == "compiled" else None
    monkeypatch.setattr(host_copy, "_compiled", module)
    return request.param


def _rows(rng: np.random.Generator, sizes, target_offsets, source_offsets):
    """Random sources and poisoned targets (each in its own buffer, MARGIN poisoned bytes each
    side) at the given byte offsets; returns (targets, sources, target buffers)."""
    targets, sources, buffers = [], [], []
    for size, target_offset, source_offset in zip(sizes, target_offsets, source_offsets):
        buffer = np.full(size + 2 * MARGIN + 16, POISON, dtype=np.uint8)
        start = MARGIN + target_offset
        targets.append(buffer[start : start + size])
        source = rng.integers(0, 256, size + 16, dtype=np.uint8)
        sources.append(source[source_offset : source_offset + size])
        buffers.append((buffer, start))
    return targets, sources, buffers


def _check(targets, sources, buffers):
    for index, (target, source, (buffer, start)) in enumerate(zip(targets, sources, buffers)):
        assert np.array_equal(target, source), f"row {index}: bytes differ"
        assert (buffer[:start] == POISON).all(), f"row {index}: written before the row"
        assert (buffer[start + target.size :] == POISON).all(), f"row {index}: written after the row"


@pytest.mark.parametrize("size", ODD_SIZES)
def test_odd_sizes_at_every_alignment_land_exactly(implementation, size):
    rng = np.random.default_rng(size)
    offsets = list(range(16))
    targets, sources, buffers = _rows(rng, [size] * 16, offsets, offsets[::-1])
    host_copy.copy_rows(targets, sources)
    _check(targets, sources, buffers)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 20000), st.integers(0, 15), st.integers(0, 15)), min_size=0, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_rows_land_exactly(rows, seed):
    for module in ("compiled", "fallback"):
        previous = host_copy._compiled
        host_copy._compiled = _compiled_module() if module == "compiled" else None
        try:
            sizes, target_offsets, source_offsets = zip(*rows) if rows else ((), (), ())
            targets, sources, buffers = _rows(np.random.default_rng(seed), sizes, target_offsets, source_offsets)
            host_copy.copy_rows(targets, sources)
            _check(targets, sources, buffers)
        finally:
            host_copy._compiled = previous


@settings(max_examples=80, deadline=None)
@given(
    size=st.integers(0, 600),
    target_offset=st.integers(0, 15),
    source_offset=st.integers(0, 15),
    seed=st.integers(0, 2**32 - 1),
)
def test_streaming_path_handles_any_head_body_tail(size, target_offset, source_offset, seed):
    """stream_min_bytes 0 streams every row, so small rows cover each head/body/tail split."""
    compiled = _compiled_module()
    targets, sources, buffers = _rows(np.random.default_rng(seed), [size], [target_offset], [source_offset])
    plan = host_copy.plan_rows(targets, sources)
    compiled.copy_rows(plan.targets, plan.sources, plan.sizes, 0)
    _check(targets, sources, buffers)


def test_many_rows_in_one_call(implementation):
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 70000, 1500)
    targets, sources, buffers = _rows(rng, sizes, rng.integers(0, 16, 1500), rng.integers(0, 16, 1500))
    host_copy.copy_rows(targets, sources)
    _check(targets, sources, buffers)


def test_rows_of_one_buffer_into_one_buffer(implementation):
    """Adjacent rows of one allocation each way (a store's buffers, a pool's pages)."""
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, 64 * 5000, dtype=np.uint8)
    target = np.full_like(source, POISON)
    order = rng.permutation(64)
    host_copy.copy_rows(
        [target[i * 5000 : (i + 1) * 5000] for i in order], [source[i * 5000 : (i + 1) * 5000] for i in order]
    )
    assert np.array_equal(target, source)


def test_fallback_gives_the_compiled_bytes(monkeypatch):
    rng = np.random.default_rng(11)
    sizes = [0, 1, 17, 4095, 4096, 70001, (1 << 20) + 3]
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    results = []
    for module in (_compiled_module(), None):
        monkeypatch.setattr(host_copy, "_compiled", module)
        targets = [np.full(size, POISON, dtype=np.uint8) for size in sizes]
        host_copy.copy_rows(targets, sources)
        results.append(targets)
    for compiled, fallback, source in zip(*results, sources):
        assert np.array_equal(compiled, fallback) and np.array_equal(compiled, source)


def test_torch_rows_of_any_dtype(implementation):
    generator = torch.Generator().manual_seed(0)
    sources = [
        torch.randn(3, 1000, generator=generator, dtype=torch.bfloat16),
        torch.randint(0, 2**31, (5001,), generator=generator, dtype=torch.int32),
        torch.randn(0, 4, generator=generator),
    ]
    targets = [torch.full_like(source, 7) for source in sources]
    # A numpy array as a torch row's target: a row is its bytes.
    array_target = np.full(sources[1].numel() * 4, POISON, dtype=np.uint8)
    host_copy.copy_rows([*targets, array_target], [*sources, sources[1]])
    for target, source in zip(targets, sources):
        assert torch.equal(target, source)
    assert np.array_equal(array_target, sources[1].numpy().view(np.uint8))


def test_threads_copy_at_once(implementation):
    rng = np.random.default_rng(5)
    batches = [_rows(rng, [(1 << 17) + k, 4097, 300], [k, 1, 2], [3, k, 0]) for k in range(6)]
    errors = []

    def work(batch):
        try:
            for _ in range(20):
                host_copy.copy_rows(batch[0], batch[1])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for batch in batches:
        _check(*batch)


def test_run_plan_shares_cover_every_row_once(implementation):
    rng = np.random.default_rng(9)
    targets, sources, buffers = _rows(rng, rng.integers(0, 9000, 11), [0] * 11, [1] * 11)
    plan = host_copy.plan_rows(targets, sources)
    for first in range(3):
        host_copy.run_plan(plan, first, 3)
    _check(targets, sources, buffers)


def test_a_plan_of_addresses_copies_like_plan_rows_and_refuses_overlapping_targets(implementation):
    rng = np.random.default_rng(11)
    targets, sources, buffers = _rows(rng, [5000, 17, 0, 4096], [0, 3, 0, 1], [1, 0, 2, 0])
    address = lambda row: row.__array_interface__["data"][0]  # noqa: E731
    plan = host_copy.plan_addresses(
        [address(t) for t in targets], [address(s) for s in sources], [t.size for t in targets], (targets, sources)
    )
    reference = host_copy.plan_rows(targets, sources)
    assert all(np.array_equal(a, b) for a, b in zip(plan[:3], reference[:3]))
    host_copy.run_plan(plan)
    _check(targets, sources, buffers)
    shared = np.full(300, POISON, dtype=np.uint8)
    with pytest.raises(InvalidArgumentError, match=r"targets\[1\]: must not share bytes with another row"):
        host_copy.plan_addresses(
            [address(shared), address(shared) + 99], [address(s) for s in sources[:2]], [100, 100], ()
        )
    assert (shared == POISON).all()
    unchecked = host_copy.plan_addresses(
        [address(t) for t in targets],
        [address(s) for s in sources],
        [t.size for t in targets],
        (targets, sources),
        check_overlap=False,
    )
    assert all(np.array_equal(a, b) for a, b in zip(unchecked[:3], reference[:3]))


def _bad_inputs():
    """(name, targets, sources, error, message part): each with a good row first, poisoned."""
    good_target, good_source = np.full(100, POISON, dtype=np.uint8), np.arange(100, dtype=np.uint8)
    shared = np.full(300, POISON, dtype=np.uint8)
    read_only = np.full(100, POISON, dtype=np.uint8)
    read_only.flags.writeable = False
    cases = [
        (
            "device",
            [torch.empty(100, dtype=torch.uint8, device="meta")],
            [good_source],
            DeviceMismatchError,
            "targets[1]: must be a CPU tensor",
        ),
        (
            "device of a source",
            [np.full(100, POISON, np.uint8)],
            [torch.empty(100, dtype=torch.uint8, device="meta")],
            DeviceMismatchError,
            "sources[1]: must be a CPU tensor",
        ),
        (
            "strided target",
            [np.full(200, POISON, np.uint8)[::2]],
            [good_source],
            InvalidArgumentError,
            "targets[1]: must be C-contiguous",
        ),
        (
            "strided tensor",
            [torch.full((200,), POISON, dtype=torch.uint8)[::2]],
            [good_source],
            InvalidArgumentError,
            "targets[1]: must be contiguous",
        ),
        (
            "size",
            [np.full(99, POISON, np.uint8)],
            [good_source],
            InvalidArgumentError,
            "sources[1]: must have as many bytes as targets[1] (99), got 100",
        ),
        ("read-only", [read_only], [good_source], InvalidArgumentError, "targets[1]: must be writable"),
        (
            "objects",  # their bytes are PyObject pointers: a copy would break reference counts
            [np.full(100, POISON, np.uint8)],
            [np.array([None] * 100, dtype=object)[:13]],
            InvalidArgumentError,
            "sources[1]: must hold plain values, not Python objects (dtype object)",
        ),
        (
            "target over target",
            [shared[:100], shared[50:150]],
            [good_source, good_source],
            InvalidArgumentError,
            "overlaps",
        ),
        ("target over source", [shared[:100]], [shared[99:199]], InvalidArgumentError, "overlaps"),
        ("target over own source", [shared[200:300]], [shared[200:300]], InvalidArgumentError, "overlaps"),
        (
            "type",
            [bytearray(100)],
            [good_source],
            ArgumentTypeError,
            "targets[1]: must be a torch.Tensor or numpy.ndarray",
        ),
    ]
    for name, targets, sources, error, message in cases:
        yield pytest.param([good_target, *targets], [good_source, *sources], error, message, id=name)
    yield pytest.param(
        [good_target, shared[:100]],
        [good_source],
        InvalidArgumentError,
        "sources: must hold as many rows as targets (2), got 1",
        id="count",
    )
    yield pytest.param(
        good_target, [good_source], ArgumentTypeError, "targets: must be a sequence", id="not a sequence"
    )


@pytest.mark.parametrize(("targets", "sources", "error", "message"), list(_bad_inputs()))
def test_bad_input_is_refused_before_any_byte_moves(implementation, targets, sources, error, message):
    with pytest.raises(error, match=None) as raised:
        host_copy.copy_rows(targets, sources)
    assert message in str(raised.value)
    for target in targets if isinstance(targets, list) else [targets]:
        if isinstance(target, np.ndarray):
            assert (target == POISON).all(), "a byte was written before the input was refused"


def test_describe_says_which_copy_runs(monkeypatch):
    monkeypatch.setattr(host_copy, "_compiled", None)
    monkeypatch.setattr(host_copy, "_why_fallback", "why")
    assert host_copy.describe_host_copy() == "memmove per row (why)"
    monkeypatch.setattr(host_copy, "_compiled", _compiled_module())
    assert host_copy.describe_host_copy().startswith("compiled (")


@pytest.mark.skipif(not CI, reason="only CI requires the optional extension to be built")
@pytest.mark.skipif(bool(os.environ.get(host_copy.PURE_PYTHON_ENV)), reason="the fallback is forced")
def test_ci_runs_the_compiled_copy():
    assert host_copy._compiled is not None, host_copy._why_fallback
