"""Lifecycle cases engines hit: retraction, placeholder token ids, MLA ranks that do not write."""

from __future__ import annotations

import pytest
import torch

from kvstage.errors import InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, ManualCopyStream, OffloadManager
from kvstage.offload.testing import SimpleRequest
from kvstage.storage import FileStore, LayoutFingerprint

from offload_rig import InlineStoreWorkers, make_rig


def decode(rig, req, tokens):
    for token in tokens:
        rig.decode(req, token)
        rig.manager.offload(req)


@pytest.mark.parametrize("keep", [True, False])
def test_a_retracted_request_is_released_and_offloads_again_when_it_runs_again(keep):
    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 20)
    decode(rig, req, [3, 4, 5])  # kv 4 tokens: page 1 launched
    rig.manager.retract(req, keep_offloaded=keep)
    assert rig.released == []  # its copy is in flight: slots still held
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.released == [req] and not rig.manager.is_tracked(req)
    assert rig.manager.metrics.retractions == 1
    # Under memory pressure its slots were freed; it runs again later: prefill again, decode on.
    rig.slots.assign(req, 22)
    rig.write_kv(req, 0, req.kv_length)
    decode(rig, req, [6, 7])  # kv 6 tokens: page 2 is new
    assert rig.manager.is_tracked(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    m = rig.manager.metrics
    # keep: page 1's copy completes and is stored, only page 2 is launched after the rerun;
    # drop: page 1's copy is discarded and the offload starts over after the prompt.
    assert (m.pages_launched, m.pages_stored, m.pages_deduplicated, m.pages_discarded) == (
        (2, 2, 0, 0) if keep else (3, 2, 0, 1)
    )
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.released == [req, req] and rig.storage.exists(rig.chain(req))[1:] == [True, True]


def test_retract_of_an_untracked_request_does_nothing():
    rig = make_rig(page_size=2)
    rig.manager.retract(SimpleRequest("x", [1, 2]))
    assert rig.released == [] and rig.manager.metrics.retractions == 0


def test_placeholder_ids_are_an_error_naming_the_request_and_position_before_any_copy():
    rig = make_rig(page_size=2)
    req = rig.new_request("spec", [1, 2], 10)
    rig.decode(req, 3)
    rig.decode(req, -1)  # speculative decoding: not yet known
    rig.decode(req, 5)
    with pytest.raises(
        InvalidArgumentError, match=r"^output_ids\[1\]: rid='spec' holds the placeholder id -1 at token position 3"
    ):
        rig.manager.offload(req)
    assert rig.copy_stream.pending == [] and rig.host_pool.used == 0
    req.output_ids[1] = 4  # the real token arrives
    assert rig.manager.offload(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    assert rig.manager.metrics.pages_stored == 1 and rig.manager.metrics.pages_failed == 0


def _mla_manager(tp_rank: int, tp_size: int, directory):
    """A manager of a 2-layer MLA pool on TP rank ``tp_rank`` of ``tp_size``, its file store in ``directory``."""
    latent = [torch.arange(64 * 8, dtype=torch.float32).view(64, 1, 8) + layer for layer in range(2)]
    kv_pool = KVPool.mla(latent)
    host_pool = HostPool.like(kv_pool, num_pages=8, page_size=2, pin=False)
    fingerprint = LayoutFingerprint.of(kv_pool, page_size=2, model_id="mla", tp_rank=tp_rank, tp_size=tp_size)
    store = FileStore(fingerprint, directory)  # one directory: the ranks share a store
    slots = torch.arange(64)
    manager = OffloadManager(
        kv_pool,
        host_pool,
        store,
        PageHasher(page_size=2),
        lambda req: slots,
        copy_stream=ManualCopyStream(),
        store_workers=InlineStoreWorkers(),
        backend="torch",
    )
    return manager, store


def test_only_rank_0_of_an_mla_model_writes_and_every_rank_reads_it(tmp_path):
    writer, _ = _mla_manager(0, 4, tmp_path)
    reader, _ = _mla_manager(3, 8, tmp_path)  # another TP size: same rank-neutral key space
    assert writer.writes_pages and not reader.writes_pages
    for manager in (writer, reader):
        req = SimpleRequest("r", [1, 2, 3, 4, 5], [6])
        assert manager.offload(req) is (manager is writer)
        manager.copier.copy_stream.complete_all()
        manager.poll()
    assert writer.metrics.pages_stored == 2 and reader.metrics.pages_launched == 0
    assert reader.match_prefix(token_ids=[1, 2, 3, 4]).num_pages == 2


def test_a_retracted_request_the_engine_drops_is_forgotten():
    import gc

    rig = make_rig(page_size=2)
    req = rig.new_request("r", [1, 2], 20)
    decode(rig, req, [3, 4, 5])
    rig.manager.retract(req, keep_offloaded=True)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    # No public view of the retracted requests' kept progress: it must go with the object.
    assert rig.manager.offloaded_length(req) == 4 and len(rig.manager._retracted) == 1
    del req
    rig.released.clear()
    gc.collect()
    assert rig.manager._retracted == {}


def test_lookup_of_a_prompt_with_a_placeholder_names_the_request_and_position():
    rig = make_rig(page_size=2)
    req = SimpleRequest("p", [1, 2, -1, 4, 5])
    with pytest.raises(InvalidArgumentError, match=r"^origin_input_ids\[2\]: rid='p' holds the placeholder id -1"):
        rig.manager.match_prefix(req)
    assert rig.manager.metrics.lookups == 0


@pytest.mark.parametrize(
    "kwargs, name", [({"write_threads": 0}, "write_threads"), ({"read_threads": True}, "read_threads")]
)
def test_store_worker_thread_counts_are_checked_by_name(kwargs, name):
    from kvstage.offload import StoreWorkers

    with pytest.raises(InvalidArgumentError, match=f"^{name}: must be an int >= 1"):
        StoreWorkers(**kwargs)
