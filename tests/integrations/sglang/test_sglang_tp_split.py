"""Prefill and decode at different TP sizes (MHA): pages split by KV head groups
(``tp_lcm_size``), written by the N ranks of one server and read by the M ranks of another,
each rank over sglang's own host pool holding its share of the model's KV heads."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvstage.errors import InvalidArgumentError

from sglang_rig import PAGE_SIZE, canonical_of, host_pool, mla_device_pool, page_tokens, same_bytes, set_host
from tp_split_rig import model_kv, rank_backend, rank_heads, rank_host, split_config

TP_SIZES = [1, 2, 4]
KEYS = [f"{i:064x}" for i in range(1, 6)]  # a 5-page prompt
SOURCE_PAGES = [8, 20, 4, 40, 12]
TARGET_PAGES = [0, 28, 64, 16, 52]


def write_prompt(url: str, size: int, layout: str, tp_lcm_size: int | None, seed: int) -> torch.Tensor:
    """The ``size`` ranks of a prefill server store the 5 pages; returns the model's KV."""
    kv = None
    for rank in range(size):
        host = rank_host(size, layout)
        kv = model_kv(host, seed) if kv is None else kv
        set_host(host, kv[:, :, :, rank_heads(rank, size)].contiguous())
        backend = rank_backend(url, host, rank, size, tp_lcm_size)
        assert backend.batch_set_v1(KEYS, page_tokens(host, SOURCE_PAGES)) == [True] * len(KEYS)
        backend.close()
    return kv


def expected_rank_kv(host, kv: torch.Tensor, heads: slice) -> torch.Tensor:
    expected = torch.zeros((2, host.layer_num, host.size, host.head_num, host.head_dim), dtype=host.dtype)
    for source, target in zip(SOURCE_PAGES, TARGET_PAGES):
        expected[:, :, target : target + PAGE_SIZE] = kv[:, :, source : source + PAGE_SIZE, heads]
    return expected


def test_without_tp_lcm_size_a_tp1_server_finds_none_of_a_tp2_servers_pages(tmp_path):
    """Today's key space, kept for servers that do not opt in: pages are per TP rank and size."""
    url = f"file:{tmp_path / 'pages'}"
    write_prompt(url, 2, "page_first", None, seed=1)
    reader = rank_backend(url, rank_host(1, "page_first"), 0, 1, None)
    assert reader.store.prefix.endswith("@tp0of1@")
    assert reader.batch_exists(KEYS) == 0
    reader.close()


@pytest.mark.parametrize("written,read", [("page_first", "page_first"), ("page_head", "layer_first")])
def test_with_tp_lcm_size_2_a_tp1_server_reads_every_page_a_tp2_server_stored(tmp_path, written, read):
    url = f"file:{tmp_path / 'pages'}"
    kv = write_prompt(url, 2, written, 2, seed=2)
    host = rank_host(1, read)
    host.kv_buffer.zero_()
    reader = rank_backend(url, host, 0, 1, 2)
    assert reader.batch_exists(KEYS) == 5
    assert reader.batch_get_v1(KEYS, page_tokens(host, TARGET_PAGES)) == [True] * 5
    assert same_bytes(canonical_of(host), expected_rank_kv(host, kv, rank_heads(0, 1)))
    reader.close()


@pytest.mark.parametrize("writers,readers", list(itertools.product(TP_SIZES, TP_SIZES)))
def test_pages_written_by_n_ranks_read_back_byte_exact_by_each_of_m_ranks(tmp_path, writers, readers):
    url = f"file:{tmp_path / 'pages'}"
    layouts = ["page_head", "page_first", "layer_first", "page_first_direct"]
    kv = write_prompt(url, writers, layouts[writers % 4], 4, seed=10 * writers + readers)
    for rank in range(readers):
        host = rank_host(readers, layouts[(readers + rank) % 4])
        host.kv_buffer.zero_()
        reader = rank_backend(url, host, rank, readers, 4)
        assert reader.batch_exists(KEYS + ["f" * 64]) == 5, (writers, readers, rank)
        assert reader.batch_get_v1(KEYS, page_tokens(host, TARGET_PAGES)) == [True] * 5
        assert same_bytes(canonical_of(host), expected_rank_kv(host, kv, rank_heads(rank, readers))), rank
        reader.close()


def test_each_page_is_tp_lcm_size_files_and_each_rank_writes_its_share_of_them(tmp_path, monkeypatch):
    from kvstage.storage import FileStore

    written = []
    real_put = FileStore.put
    monkeypatch.setattr(
        FileStore, "put", lambda self, keys, *a, **k: (written.append(len(keys)), real_put(self, keys, *a, **k))[1]
    )
    directory = tmp_path / "pages"
    write_prompt(f"file:{directory}", 2, "page_first", 4, seed=3)
    assert sum(written) == 2 * 5 * 2  # 2 ranks x 5 pages x 4/2 groups each
    names = sorted(path.name for path in directory.glob("*.kvpage"))
    assert len(names) == 5 * 4 and all("@L0-2xKV2xH1xD8@P4@hg4@" in name for name in names)
    assert {name.rsplit(".h", 1)[1] for name in names} == {"0.kvpage", "1.kvpage", "2.kvpage", "3.kvpage"}


def test_a_missing_group_entry_makes_its_page_a_miss_for_the_ranks_holding_that_group_only(tmp_path):
    directory = tmp_path / "pages"
    url = f"file:{directory}"
    kv = write_prompt(url, 1, "page_first", 4, seed=4)
    (victim,) = directory.glob(f"*{KEYS[2]}.h2.kvpage")
    victim.unlink()
    found = []
    for rank in range(4):
        host = rank_host(4, "page_first")
        reader = rank_backend(url, host, rank, 4, 4)
        found.append(reader.batch_exists(KEYS))
        hits = reader.batch_get_v1(KEYS, page_tokens(host, TARGET_PAGES))
        assert hits == [True, True, rank != 2, True, True]
        reader.close()
    assert found == [5, 5, 2, 5]
    host = rank_host(2, "page_first")  # TP 2 rank 1 holds groups 2 and 3
    host.kv_buffer.zero_()
    reader = rank_backend(url, host, 1, 2, 4)
    assert reader.batch_exists(KEYS) == 2
    assert reader.batch_get_v1(KEYS, page_tokens(host, TARGET_PAGES)) == [True, True, False, True, True]
    expected = expected_rank_kv(host, kv, rank_heads(1, 2))
    got = canonical_of(host)
    page = TARGET_PAGES[2]
    for other in (0, 1, 3, 4):
        target = TARGET_PAGES[other]
        assert same_bytes(got[:, :, target : target + PAGE_SIZE], expected[:, :, target : target + PAGE_SIZE])
    # the page read False; the group found (heads 3) holds that page's bytes, never another page's
    assert same_bytes(got[:, :, page : page + PAGE_SIZE, 1], expected[:, :, page : page + PAGE_SIZE, 1])
    reader.close()


def test_the_legacy_flat_page_calls_split_heads_too(tmp_path):
    url = f"file:{tmp_path / 'pages'}"
    kv = write_prompt(url, 4, "layer_first", 4, seed=5)
    host = rank_host(2, "page_head")
    reader = rank_backend(url, host, 1, 2, 4)
    assert reader.exists(KEYS[0]) and not reader.exists("f" * 64)
    targets = [host.get_dummy_flat_data_page() for _ in KEYS]
    assert reader.batch_get(KEYS, targets) == targets
    host.kv_buffer.zero_()
    for target, start in zip(targets, TARGET_PAGES):
        host.set_from_flat_data_page(start, target)
    assert same_bytes(canonical_of(host), expected_rank_kv(host, kv, rank_heads(1, 2)))
    reader.close()


def test_what_cannot_be_split_is_refused_naming_tp_lcm_size_and_the_rule(tmp_path):
    from kvstage.integrations.sglang import KVStageStorage

    url = f"file:{tmp_path / 'pages'}"
    with pytest.raises(InvalidArgumentError, match=r"^storage_config.tp_lcm_size: 3 must be a multiple of tp_size 2"):
        KVStageStorage(split_config(url, 0, 2, "page_head", 3))
    with pytest.raises(
        InvalidArgumentError, match=r"^storage_config.tp_lcm_size: an MLA latent has no KV heads to split"
    ):
        KVStageStorage(dataclasses.replace(split_config(url, 0, 1, "page_first", 2), is_mla_model=True))
    events = dataclasses.replace(split_config(url, 0, 1, "page_first", 2))
    events.extra_config["kv_events_endpoint"] = "tcp://127.0.0.1:5599"
    with pytest.raises(InvalidArgumentError, match=r"^storage_config.tp_lcm_size: KV events"):
        KVStageStorage(events)
    backend = KVStageStorage(split_config(url, 0, 1, "page_first", 8))  # 4 KV heads in 8 groups
    with pytest.raises(InvalidArgumentError, match=r"KV heads \(4 per rank x tp_size 1 = 4\) to be a multiple of 8"):
        backend.register_mem_pool_host(rank_host(1, "page_first"))
    assert backend.store is None and not (tmp_path / "pages").exists()
    mla = KVStageStorage(split_config(url, 0, 1, "page_first", 2))  # a config that does not say MLA
    with pytest.raises(InvalidArgumentError, match=r"^storage_config.tp_lcm_size: an MLA latent"):
        mla.register_mem_pool_host(host_pool(mla_device_pool(), "page_first"))
