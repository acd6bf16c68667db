"""One TP rank of the lockstep test, in a spawned process: it imports sglang the CPU way
(sglang_cpu) before anything else of sglang, so this module imports none at its top."""

from __future__ import annotations

import time

import torch.distributed as dist


def run_rank(rank: int, port: int, kind: str, url: str, out: dict) -> None:
    """One TP rank's process: the same requests, the same steps; the step each is released in."""
    from sglang_cpu import import_sglang

    assert import_sglang() is None
    from decode_rig import DecodeSide, install_settings, released

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    install_settings(url, tp_rank=rank, tp_size=2)
    side = DecodeSide(kind, dist.group.WORLD)
    # Prompts shorter than a page: no prefill-side pages, so every chain starts at its seed here.
    reqs = [side.admit(f"r{i}", list(range(50 * i, 50 * i + 1 + i % 3)), max_tokens=6 + 3 * i) for i in range(4)]
    released_at: dict[str, int] = {}
    step = 0
    while len(released_at) < len(reqs) and step < 5000:  # copies run on a thread: steps until all are back
        time.sleep(0.001)
        step += 1
        for req in reqs:
            if not req.finished():
                side.decode_step(req, 2000 + step)
        side.manager.check_offload_progress()
        for req in reqs:
            if released(req) and req.rid not in released_at:
                released_at[req.rid] = step
    side.manager.release_host_resources()  # waits for the store writes (a release comes before they land)
    out[rank] = (released_at, side.manager.manager.metrics.pages_stored)
    dist.destroy_process_group()
