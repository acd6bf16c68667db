"""Strided pages: a store with ``strided_pages`` (MemoryStore, FileStore) takes a non-contiguous
page view (e.g. an sglang host pool page permuted into kvstage's page order) and copies it with
one copy; its bytes are the view's elements in row-major order. Other stores refuse such a view."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint
from kvstage.storage.file_store import FileStore
from kvstage.storage.memory_store import MemoryStore

LAYOUT = KVLayout(3, 2, 2, 8, torch.bfloat16)
PAGE_SIZE = 4


def fingerprint() -> LayoutFingerprint:
    return LayoutFingerprint("m", LAYOUT, PAGE_SIZE)


def host_like(num_pages: int, seed: int) -> torch.Tensor:
    """A layer_first-like host buffer [2, L, tokens, H, D] with random bit patterns."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**15), 2**15, (2, 3, num_pages * PAGE_SIZE, 2, 8), dtype=torch.int16, generator=generator)
    return raw.view(torch.bfloat16)


def page(host: torch.Tensor, index: int) -> torch.Tensor:
    """Page ``index`` as a [L, 2, page, H, D] view (not contiguous)."""
    return host[:, :, index * PAGE_SIZE : (index + 1) * PAGE_SIZE].transpose(0, 1)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_store_puts_and_gets_strided_views_as_their_row_major_bytes(tmp_path, kind):
    store = MemoryStore(fingerprint()) if kind == "memory" else FileStore(fingerprint(), tmp_path)
    assert store.strided_pages
    source, target = host_like(3, seed=1), torch.zeros(2, 3, 3 * PAGE_SIZE, 2, 8, dtype=torch.bfloat16)
    views = [page(source, i) for i in range(3)]
    assert not any(view.is_contiguous() for view in views)
    assert [s.value for s in store.put(["a", "b", "c"], views)] == ["stored"] * 3

    contiguous = torch.empty(LAYOUT.page_shape(PAGE_SIZE), dtype=torch.bfloat16)
    assert store.get(["b"], [contiguous]) == [True]
    assert torch.equal(contiguous.view(torch.int16), views[1].contiguous().view(torch.int16))

    assert store.get(["c", "a"], [page(target, 0), page(target, 2)]) == [True, True]
    assert torch.equal(target[:, :, :PAGE_SIZE].view(torch.int16), source[:, :, 2 * PAGE_SIZE :].view(torch.int16))
    assert torch.equal(target[:, :, 2 * PAGE_SIZE :].view(torch.int16), source[:, :, :PAGE_SIZE].view(torch.int16))
    assert not target[:, :, PAGE_SIZE : 2 * PAGE_SIZE].view(torch.int16).any()  # page 1 untouched


class ContiguousOnly(MemoryStore):
    """A store that declares no strided pages (as the Mooncake store): the base class checks."""

    strided_pages = False


def test_a_store_without_strided_pages_refuses_a_view_before_writing():
    store = ContiguousOnly(fingerprint())
    assert not store.strided_pages
    with pytest.raises(InvalidArgumentError, match=r"pages\[0\]: must be a contiguous CPU tensor"):
        store.put(["a"], [page(host_like(1, seed=2), 0)])
    assert store.exists(["a"]) == [False]


def test_a_strided_page_of_the_wrong_size_is_refused():
    store = MemoryStore(fingerprint())
    with pytest.raises(InvalidArgumentError, match="bytes, the layout's page has"):
        store.put(["a"], [host_like(2, seed=3)[:, :, : 2 * PAGE_SIZE].transpose(0, 1)])


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_get_into_a_target_that_requires_grad_is_refused_before_any_target_is_written(tmp_path, kind):
    store = MemoryStore(fingerprint()) if kind == "memory" else FileStore(fingerprint(), tmp_path, io_threads=2)
    shape = LAYOUT.page_shape(PAGE_SIZE)
    store.put(["a", "b"], [torch.ones(shape, dtype=torch.bfloat16), torch.ones(shape, dtype=torch.bfloat16)])
    first, second = (
        torch.zeros(shape, dtype=torch.bfloat16),
        torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True),
    )
    with pytest.raises(InvalidArgumentError, match=r"into\[1\]: must not require grad"):
        store.get(["a", "b"], [first, second])
    assert not first.any() and not second.detach().any()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_lazy_conjugate_page_is_refused_before_any_page_is_stored(tmp_path, kind):
    complex_layout = LayoutFingerprint("m", KVLayout(3, 2, 2, 8, torch.complex64), PAGE_SIZE)
    store = MemoryStore(complex_layout) if kind == "memory" else FileStore(complex_layout, tmp_path, io_threads=2)
    shape = KVLayout(3, 2, 2, 8, torch.complex64).page_shape(PAGE_SIZE)
    plain, conjugate = torch.ones(shape, dtype=torch.complex64), torch.ones(shape, dtype=torch.complex64).conj()
    assert conjugate.is_conj()
    with pytest.raises(InvalidArgumentError, match=r"pages\[1\]: .*resolve_conj"):
        store.put(["a", "b"], [plain, conjugate])
    assert store.exists(["a", "b"]) == [False, False]
