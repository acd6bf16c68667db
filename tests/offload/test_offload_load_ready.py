"""Loading more pages than are ready, while the prefetch's read is still in flight (ready < hit).

A ``best_effort`` prefetch may be loaded while its read runs: the lookup found ``pages_hit``
pages, the reader has landed ``pages_ready`` of them in host pages, and the host pages of the
rest still hold whatever they held before. An engine that asks for one page more than is ready
must be refused before anything is copied: otherwise that page's slots would get the stale
host page, and the request's chain would continue from a page it never loaded. The checks here
are on what lands in the device slots and in the store, not only on the error.
"""

from __future__ import annotations

import threading

import torch

from kvstage.errors import InvalidArgumentError
from kvstage.offload import StoreWorkers
from kvstage.offload.testing import SimpleRequest

from offload_rig import make_rig

PAGE = 2
PROMPT = list(range(40))  # 39 tokens looked up: 19 whole pages, read in batches of 16
STALE = -7  # what every host page holds before the prefetch


def rows_at(rig, slots):
    """The rig's ``[n, parts, layers, 4]`` rows at device ``slots``."""
    return rig.stacked[:, :, slots, 0, :4].permute(2, 0, 1, 3)


def test_loading_one_page_more_than_ready_while_the_read_runs_writes_nothing_past_the_ready_pages():
    rig = make_rig(page_size=PAGE, store_prompt=True, num_host_pages=40, store_workers=StoreWorkers())
    manager = rig.manager
    a = rig.new_request("a", PROMPT, 2)
    rig.decode(a, 100)
    a.done = True
    manager.finish(a)
    rig.copy_stream.complete_all()
    manager.drain()
    assert rig.storage.exists(rig.chain(a)) == [True] * 20
    for host_page_id in range(rig.host_pool.capacity):
        rig.host_pool.page(host_page_id).fill_(STALE)

    # The store answers the first batch of reads, then holds the second until the test lets it go.
    second_batch_started, let_go = threading.Event(), threading.Event()
    batches = []
    read = rig.storage.get

    def get(keys, into):
        batches.append(len(keys))
        if len(batches) == 2:
            second_batch_started.set()
            let_go.wait(10.0)
        return read(keys, into)

    rig.storage.get = get
    b = SimpleRequest("b", PROMPT)
    slots = rig.slots.assign(b, len(PROMPT) + 4)
    rig.stacked[:, :, slots] = -1  # poisoned: nothing of b is written yet
    try:
        handle = manager.prefetch(b, policy="best_effort")
        assert second_batch_started.wait(10.0)
        assert (handle.pages_hit, handle.pages_ready, handle.ready_to_load()) == (19, 16, True)

        refused = None
        try:  # an engine that loads the page whose read is still in flight
            manager.load(handle, slots[: 17 * PAGE])
        except InvalidArgumentError as error:
            refused = error
        rig.copy_stream.complete_all()
        manager.poll()
        assert bool((rows_at(rig, slots) == -1).all()), "a refused load wrote device slots"
        assert rig.copy_stream.pending == [] and manager.metrics.pages_loaded == 0
        assert str(refused).startswith("slot_indices: must be a 1-D tensor of at most 16 ready pages")

        load = manager.load(handle, slots[: 16 * PAGE])  # the handle is still usable
    finally:
        let_go.set()
    assert handle.wait(10.0)
    rig.copy_stream.complete_all()
    manager.poll()
    assert load.done() and load.num_pages == 16 and manager.metrics.pages_loaded == 16
    assert torch.equal(rows_at(rig, slots[: 16 * PAGE]), rig.expected_rows(a, 0, 16 * PAGE))
    assert bool((rows_at(rig, slots[16 * PAGE :]) == -1).all()), "written past the loaded pages"
    assert manager.offloaded_length(b) == 16 * PAGE  # the chain continues after the loaded pages only

    # The engine prefills the rest of the prompt: b's pages after the loaded ones are b's own
    # KV under the prefill chain (page 16 onward deduplicates against a's equal pages).
    rig.write_kv(b, 16 * PAGE, len(PROMPT))
    rig.decode(b, 100)
    b.done = True
    manager.finish(b)
    rig.copy_stream.complete_all()
    manager.drain()
    assert rig.missing_pages(b) == [] and rig.chain(b) == rig.chain(a)
    metrics = manager.metrics
    assert (metrics.pages_launched, metrics.pages_deduplicated, metrics.pages_failed) == (20 + 4, 4, 0)
    assert rig.host_pool.used == 0 and rig.released == [a, b]
