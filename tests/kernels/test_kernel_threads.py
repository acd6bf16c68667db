"""Copies from two threads at once: a gather on a worker thread while the caller scatters.

Under ``TRITON_INTERPRET=1`` the interpreter patches ``triton.language`` for the duration of
a launch, so two unserialized launches fail at random ("Did you forget to add @triton.jit?");
the launcher serializes interpreter launches. On CUDA the same test checks that concurrent
launches from two threads (on their own streams) stay correct.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from kvstage.kernels import gather, scatter

from kernel_helpers import (
    expected_pool_after_scatter,
    expected_staging,
    make_indices,
    make_pool,
    make_staging,
    pool_equals,
    random_bytes_,
    same_bytes,
)

ROUNDS = 30


def test_gather_on_a_worker_thread_while_the_caller_scatters(device):
    source = make_pool(parts=2, layers=2, num_slots=16, heads=1, dim=8, dtype=torch.float16, device=device, seed=1)
    target = make_pool(parts=2, layers=2, num_slots=16, heads=1, dim=8, dtype=torch.float16, device=device, seed=2)
    slot_indices, host_page_ids = make_indices(source, 3, 2, 4)
    want_staging = expected_staging(source, make_staging(source, 4, 2, "page_first"), slot_indices, host_page_ids, 2)
    scatter_staging = random_bytes_(make_staging(target, 4, 2, "page_first"), torch.Generator().manual_seed(3))
    want_target = expected_pool_after_scatter(target, scatter_staging, slot_indices, host_page_ids, 2)
    failures: list[BaseException] = []
    gathered = []

    def worker() -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for _ in range(ROUNDS):
                    staging = make_staging(source, 4, 2, "page_first")
                    gather(source, staging, slot_indices, host_page_ids, page_size=2, backend="triton")
                    gathered.append(staging)
            if stream is not None:
                stream.synchronize()
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    for _ in range(ROUNDS):
        scatter(scatter_staging, target, slot_indices, host_page_ids, page_size=2, backend="triton")
    thread.join()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert not failures, failures[0]
    assert len(gathered) == ROUNDS and all(same_bytes(s, want_staging) for s in gathered)
    assert pool_equals(target, want_target)
