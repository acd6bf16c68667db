"""KVStageStorage as sglang 0.5.23's HiCache L3 backend, built by sglang's own storage factory
over sglang's own MHA and MLA host pools (every host layout), with the memory and file stores."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from sglang_rig import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE_SIZE,
    canonical_shape,
    host_buffer_of,
    host_pool,
    kvstage_backend,
    mha_device_pool,
    mla_device_pool,
    random_canonical,
    same_bytes,
    set_host,
)

KINDS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


def make_host(kind: str, layout: str):
    return host_pool(mha_device_pool() if kind == "mha" else mla_device_pool(), layout)


def slots(starts: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + PAGE_SIZE) for start in starts])


def expected_after_copy(host, source: torch.Tensor, src_starts, dst_starts) -> torch.Tensor:
    """The canonical content of a zeroed host pool after the pages at ``src_starts`` of
    ``source`` (canonical) landed at ``dst_starts``."""
    token_axis = 1 if len(canonical_shape(host)) == 3 else 2
    expected = torch.zeros(canonical_shape(host), dtype=host.dtype)
    for src, dst in zip(src_starts, dst_starts):
        expected.narrow(token_axis, dst, PAGE_SIZE).copy_(source.narrow(token_axis, src, PAGE_SIZE))
    return expected


def urls(tmp_path: Path) -> dict[str, str]:
    return {"memory": "memory", "file": f"file:{tmp_path / 'pages'}"}


@pytest.mark.parametrize("store", ["memory", "file"])
@pytest.mark.parametrize("kind,layout", KINDS)
def test_batch_set_v1_then_batch_get_v1_moves_every_byte_of_each_page(tmp_path, store, kind, layout):
    host = make_host(kind, layout)
    source = random_canonical(host, seed=1)
    set_host(host, source)
    backend = kvstage_backend(urls(tmp_path)[store], host)
    keys = [f"{i:064x}" for i in range(1, 4)]
    src_starts, dst_starts = [8, 20, 4], [40, 12, 64]

    assert backend.batch_set_v1(keys, slots(src_starts)) == [True, True, True]
    assert backend.batch_exists(keys + ["f" * 64]) == 3
    host.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, slots(dst_starts)) == [True, True, True]

    expected = host_buffer_of(layout, expected_after_copy(host, source, src_starts, dst_starts), kind == "mla")
    assert same_bytes(host.kv_buffer, expected)
    backend.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_page_written_through_one_host_layout_reads_back_right_through_every_other(tmp_path, kind):
    layouts = MHA_LAYOUTS if kind == "mha" else MLA_LAYOUTS
    url = f"file:{tmp_path / 'pages'}"
    for number, (written, read) in enumerate(itertools.permutations(layouts, 2)):
        writer_host, reader_host = make_host(kind, written), make_host(kind, read)
        source = random_canonical(writer_host, seed=10 + number)
        set_host(writer_host, source)
        keys = [f"{number:02x}{i:062x}" for i in range(2)]
        writer = kvstage_backend(url, writer_host)
        assert writer.batch_set_v1(keys, slots([16, 4])) == [True, True]
        writer.close()
        reader = kvstage_backend(url, reader_host)  # another process would open the same directory
        reader_host.kv_buffer.zero_()
        assert reader.batch_get_v1(keys, slots([0, 28])) == [True, True], (written, read)
        expected = expected_after_copy(reader_host, source, [16, 4], [0, 28])
        assert same_bytes(reader_host.kv_buffer, host_buffer_of(read, expected, kind == "mla")), (written, read)
        reader.close()


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "page_first_direct")])
def test_a_corrupted_page_reads_as_a_miss_and_leaves_the_host_slots_untouched(tmp_path, kind, layout):
    host = make_host(kind, layout)
    set_host(host, random_canonical(host, seed=3))
    directory = tmp_path / "pages"
    backend = kvstage_backend(f"file:{directory}", host)
    keys = ["a" * 64, "b" * 64]
    assert backend.batch_set_v1(keys, slots([0, 4])) == [True, True]
    (victim,) = [path for path in directory.iterdir() if "b" * 64 in path.name]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x01  # one bit of the payload
    victim.write_bytes(bytes(data))

    before = host.kv_buffer.clone()
    hits = backend.batch_get_v1(keys, slots([8, 12]))
    assert hits == [True, False]
    assert same_bytes(host.get_data_page(8, flat=True), host.get_data_page(0, flat=True))
    assert same_bytes(host.get_data_page(12, flat=True), page_of(before, host, 12))
    backend.close()


def page_of(buffer: torch.Tensor, host, index: int) -> torch.Tensor:
    """The flat page at ``index`` of ``buffer`` (a copy of the host pool's kv_buffer)."""
    saved = host.kv_buffer
    try:
        host.kv_buffer = buffer
        return host.get_data_page(index, flat=True).clone()
    finally:
        host.kv_buffer = saved


@pytest.mark.parametrize("kind,layout", KINDS)
def test_with_the_memory_store_each_page_moves_with_one_copy_between_host_pool_and_store(kind, layout):
    """The store gets views of the host pool itself (no staging copy) in both directions."""
    host = make_host(kind, layout)
    set_host(host, random_canonical(host, seed=5))
    backend = kvstage_backend("memory", host)
    host_memory = host.kv_buffer.untyped_storage().data_ptr()
    seen = []
    for name in ("put", "get"):
        original = getattr(backend.store, name)

        def spy(keys, pages, *args, _original=original, **kwargs):
            seen.extend(page.untyped_storage().data_ptr() == host_memory for page in pages)
            return _original(keys, pages, *args, **kwargs)

        setattr(backend.store, name, spy)
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert backend.batch_set_v1(keys, slots([0, 8])) == [True, True]
    assert backend.batch_get_v1(keys, slots([16, 24])) == [True, True]
    assert seen == [True] * 4


@pytest.mark.parametrize("kind,layout", KINDS)
def test_page_views_of_many_pages_are_each_pages_own_view(kind, layout):
    """page_views (one as_strided a page between the first and last, or one for all of evenly
    spaced pages) gives, for pages in any order, the same view as page_view of each: same
    memory, shape and strides."""
    from kvstage.integrations.sglang import host_layouts

    host = make_host(kind, layout)
    pages = host.size // PAGE_SIZE
    evenly = ([0, 1, 2, 3, 4], [1, 3, 5, 7], [pages - 3, pages - 2, pages - 1], [0, 2, 4, 5])
    for starts in ([0, 3, 1, pages - 1, 2], [pages - 1, 0, 5, 4], [2, 2, 2], *evenly):
        starts = [page * PAGE_SIZE for page in starts]
        for got, start in zip(host_layouts.page_views(host, starts), starts, strict=True):
            want = host_layouts.page_view(host, start)
            assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape, want.stride())


@pytest.mark.parametrize("kind,layout", KINDS)
def test_page_view_flattens_a_layer_row_exactly_when_torch_can_view_it_flat(kind, layout):
    from kvstage.integrations.sglang import host_layouts

    host = make_host(kind, layout)
    set_host(host, random_canonical(host, seed=5))
    table = host_layouts.MLA_LAYOUTS if kind == "mla" else host_layouts.MHA_LAYOUTS
    five = table[layout][1](host.get_data_page(PAGE_SIZE, flat=False))
    try:
        flat = five.view(five.shape[0], five.shape[1], -1)
    except RuntimeError:
        flat = None
    view = host_layouts.page_view(host, PAGE_SIZE)
    assert view.data_ptr() == five.data_ptr()  # a view of the pool, never a copy
    if flat is None:
        assert view.shape == five.shape and view.stride() == five.stride()
    else:
        assert view.shape == flat.shape and view.stride() == flat.stride()
    assert same_bytes(view.reshape(five.shape), five)
