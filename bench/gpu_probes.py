"""The Python parts of ``bench/gpu_check.sh``: native GPU probes of kvstage, each a function of a device.

Commands (``python bench/gpu_probes.py [--dry-run] [--out DIR] [--only NAMES] COMMAND``):

* ``warm``: compile every Triton variant the probes and the benchmark launch (the kernels'
  ``warm_up``), in parallel processes that share Triton's on-disk cache, so later steps load
  kernels instead of compiling them one after another.
* ``probes``: the checks below, in order; ``probes.json`` in ``--out``:

  - ``host_stall``: the GPU sleeps ~200 ms on the compute stream (``torch.cuda._sleep``) while
    the engine's thread calls ``offload()``, ``poll()``, ``prefetch()`` and ``load()``, under
    ``torch.cuda.set_sync_debug_mode("error")``; after a warm-up round each call must return
    within ``STALL_LIMIT_MS`` (a call that waited for the GPU takes the sleep's length).
  - ``allocator_race``: the side stream sleeps before the copy; the caller drops the index
    tensors (and the handle), allocates and fills tensors of the same sizes on the compute
    stream; staging (or the pool) must equal the reference (PyTorch CUDA semantics: memory
    used on another stream needs ``record_stream`` or a reference until that stream is done).
  - ``ordering``: the KV is written after a long sleep on a stream that is not current; the
    manager's copy waits for that producer's event (``offload(req, after=event)``, and a
    manager built with ``producer=``); the stored bytes must equal the KV. A control without
    ``after`` shows the race the event prevents (reported, not enforced).
  - ``load_layers``: a layer-by-layer load while the copy stream sleeps; a forward stream
    waits on each layer's event (``LoadHandle.wait_layer``) and then reads that layer: it must
    see the stored KV, never the poison (CUDA: ``cudaStreamWaitEvent`` orders the read after
    the layer's copy, without blocking the host).
  - ``pinned_matrix``: layouts x int32/int64 x kernel/staged, staging at +0/+2/+4/+8 bytes into
    a pinned buffer, rows of 9, 92 (bf16 head_dim 46), 576 (fp8 MLA) and 2048 bytes: gather,
    scatter and a per-layer scatter against the torch reference, bytes outside untouched.
  - ``staging_2gib``: layer-first pinned staging of more than 2 GiB with 1-byte words (9-byte
    rows), host pages at its end, int32 and int64 indices: the kernel's offsets must be 64-bit.
  - ``real_model``: ``tests/offload/test_real_model.py``'s engine on the GPU: a tiny Llama and
    DeepseekV3 run A, store its pages; a second engine loads the prefix layer by layer and
    continues; loaded bytes equal A's, tokens equal, logits bitwise (a difference there is
    a WARN: cuBLAS may pick other kernels).
* ``bench``: ``bench_kernels.run(quick=True)`` (gather and scatter against a same-size pinned
  ``cudaMemcpyAsync``, target >= 90%; against a per-page loop, target >= 3x at page 16; timed
  with ``triton.testing.do_bench``) and a ``max_programs`` sweep; ``bench.json``, ``bench.png``.
  The targets are reported (PASS/MISS), not enforced.
* ``sanitize``: a small native run of 92-byte rows (bf16 head_dim 46) in every mode, for
  ``compute-sanitizer`` (memcheck, synccheck) to watch.

``--dry-run`` runs the same code on CPU with tiny sizes (``tests/test_gpu_check.py`` does, so
this file cannot rot): CUDA-only calls (sleeps, streams, events, the sync debug mode,
pinning) are skipped, and timing checks are reported, not enforced. Under
``TRITON_INTERPRET=1`` the Triton paths run in the interpreter.

Each probe prints ``PASS``/``FAIL``/``WARN``/``SKIP`` lines and returns a dict; the exit status
is 1 when a check failed, 3 when there is no CUDA device (and no ``--dry-run``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO / "tests"))  # the tests' pool and byte helpers (tests/kernel_helpers.py)

from kvstage.hashing import PageHasher  # noqa: E402
from kvstage.kernels import (  # noqa: E402
    KVPool,
    gather,
    gather_async,
    gather_reference,
    scatter,
    scatter_async,
    scatter_reference,
    staging_shape,
)
from kvstage.kernels import warm_up as kernels_warm_up  # noqa: E402
from kvstage.kernels.backend import triton_installed, triton_interpreter_enabled  # noqa: E402
from kvstage.offload import HostPool, OffloadManager  # noqa: E402
from kvstage.offload.testing import SimpleRequest, SlotTable  # noqa: E402
from kvstage.storage import LayoutFingerprint, open_storage  # noqa: E402

from kernel_helpers import POISON, as_bytes, make_pool, poison_, random_bytes_  # noqa: E402

STALL_LIMIT_MS = 5.0  # a host call that returns later than this while the GPU sleeps waited for it
SLEEP_MS = 200  # the GPU sleeps this long (at least) in the stall, race, ordering and load probes
SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep counts SM clocks; 2 GHz is above the H200's 1.98 GHz boost
PROBE_TIMEOUT_S = 90  # faulthandler dumps every thread's stack when one probe runs longer (a hang)

# The shapes, shared by the probes and the warm-up (so warm-up compiles exactly what they launch).
RIG = dict(parts=2, layers=4, heads=8, dim=128, dtype=torch.bfloat16, page=16)
MATRIX_ROWS = {
    "9B-int8": dict(parts=2, heads=1, dim=9, dtype=torch.int8),
    "92B-bf16-hd46": dict(parts=2, heads=1, dim=46, dtype=torch.bfloat16),
    "576B-fp8-mla": dict(parts=1, heads=1, dim=576, dtype=torch.float8_e4m3fn),
    "2048B-bf16-llama": dict(parts=2, heads=8, dim=128, dtype=torch.bfloat16),
}
MATRIX = dict(layers=3, page=16, pages=5, num_host_pages=8, slots=256)
STAGING_OFFSETS = (0, 2, 4, 8)  # bytes into a pinned buffer (torch's pinned blocks are 16-byte aligned or more)
BIG_STAGING = dict(
    parts=2, layers=4, heads=1, dim=9, dtype=torch.int8, page=16, bytes=(9 << 28)
)  # 2.25 GiB, layer-first
REAL_MODEL_POOLS = (  # tests/offload/test_real_model.py's pools (PAGE_SIZE 8): Llama 4 layers x 2 KV heads x 32, MLA 2 layers x 80
    dict(parts=2, layers=4, heads=2, dim=32, page=8),
    dict(parts=1, layers=2, heads=1, dim=80, page=8),
)
SWEEP_PROGRAMS = (4, 8, 16, 32, 64, 132, 264)


# -- context and checks ------------------------------------------------------------------------


@dataclass
class Ctx:
    """Where the probes run: the device, dry mode (CPU, tiny sizes), the copy backend to ask for."""

    device: torch.device
    dry: bool
    out: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        """``triton`` natively and under the interpreter; the torch reference elsewhere."""
        return "triton" if triton_installed() and (self.cuda or triton_interpreter_enabled()) else "torch"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class Probe:
    """One probe's checks and data; prints a line per check."""

    name: str
    checks: list[dict] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def check(self, what: str, ok: bool, detail: str = "", *, soft: bool = False, enforced: bool = True) -> bool:
        """Record a check. ``soft``: a miss is a WARN. ``enforced=False``: reported only (a timing in dry mode)."""
        ok = bool(ok)
        status = "PASS" if ok else ("WARN" if soft or not enforced else "FAIL")
        self.checks.append(dict(what=what, status=status, detail=detail))
        print(f"{status} {self.name}: {what}" + (f" ({detail})" if detail else ""), flush=True)
        return ok

    def skip(self, what: str, reason: str) -> None:
        self.checks.append(dict(what=what, status="SKIP", detail=reason))
        print(f"SKIP {self.name}: {what} ({reason})", flush=True)

    def info(self, line: str) -> None:
        print(f"     {self.name}: {line}", flush=True)

    @property
    def ok(self) -> bool:
        return all(c["status"] != "FAIL" for c in self.checks)

    def result(self) -> dict:
        return dict(ok=self.ok, checks=self.checks, **self.data)


@contextlib.contextmanager
def sync_debug(ctx: Ctx):
    """``torch.cuda.set_sync_debug_mode("error")`` inside: a synchronizing CUDA call raises."""
    if not ctx.cuda:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def gpu_sleep(ctx: Ctx, ms: float, stream: Any = None) -> tuple | None:
    """Queue a ``torch.cuda._sleep`` of at least ``ms`` on ``stream`` (default: current); its timing events."""
    if not ctx.cuda:
        return None
    stream = stream if stream is not None else torch.cuda.current_stream(ctx.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        torch.cuda._sleep(int(ms * SLEEP_CYCLES_PER_MS))
        end.record(stream)
    return start, end


def still_sleeping(sleep: tuple | None) -> bool:
    """True while the sleep has not ended (the GPU is still busy); True on CPU (no sleep to wait for)."""
    return sleep is None or not sleep[1].query()


def timed_ms(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - start) * 1e3


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def zero_pool(device: torch.device, **shape: Any) -> KVPool:
    """``tests/kernel_helpers.make_pool``'s pool (``parts, layers, num_slots, heads, dim, dtype``), zeroed."""
    pool = make_pool(device=device, **shape)
    for t in pool.tensors():
        t.zero_()
    return pool


def pinned_empty(ctx: Ctx, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=ctx.cuda)


def rows_of(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The bytes of ``slots``' rows of every (part, layer), on CPU."""
    index = slots.to(pool.device).long()
    return [as_bytes(t.view(t.shape[0], -1).view(torch.uint8)[index]) for t in pool.tensors()]


def device_rows(pool: KVPool, count: int, seed: int) -> list[torch.Tensor]:
    """Random rows for ``count`` slots of every (part, layer), on the pool's device. Made before a
    GPU sleep: a host-to-device copy from pageable memory waits for the device (CUDA runtime API,
    "API synchronization behavior"), which would end the sleep's point."""
    return [
        random_bytes_(torch.empty((count, pool.row_bytes), dtype=torch.uint8), seeded(seed + i)).to(pool.device)
        for i in range(len(pool.tensors()))
    ]


def put_rows_(pool: KVPool, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """``rows`` into ``slots``' rows of every (part, layer), queued on the current stream (no host sync)."""
    for t, r in zip(pool.tensors(), rows):
        t.view(t.shape[0], -1).view(torch.uint8)[slots] = r


# -- the offload rig ---------------------------------------------------------------------------


@dataclass
class Rig:
    pool: KVPool
    host_pool: HostPool
    storage: Any
    hasher: PageHasher
    slots: SlotTable
    manager: OffloadManager
    released: list
    page: int


def make_rig(ctx: Ctx, *, num_slots: int = 2048, num_host_pages: int = 128, producer: Any = None, seed: int = 0) -> Rig:
    """A KV pool (``RIG``), a pinned host pool, a memory store and the manager, on ``ctx.device``.

    Not ``tests/offload_rig.make_rig``: that rig is the tests' CPU engine (an int32 pool whose
    rows name their tokens, a manual copy stream, inline store workers, slots freed on release);
    the probes need the manager's real side stream and store threads, and slots that stay put
    after a request finishes (a later round reads them back)."""
    page = RIG["page"]
    pool = zero_pool(
        ctx.device,
        parts=RIG["parts"],
        layers=RIG["layers"],
        heads=RIG["heads"],
        dim=RIG["dim"],
        dtype=RIG["dtype"],
        num_slots=num_slots,
    )
    host_pool = HostPool.like(pool, num_pages=num_host_pages, page_size=page)  # pinned where CUDA is
    storage = open_storage("memory", LayoutFingerprint.of(pool, page_size=page, model_id="gpu-check"))
    hasher = PageHasher(page_size=page)
    slots = SlotTable(num_slots, device=ctx.device, generator=torch.Generator().manual_seed(seed))
    released: list = []
    manager = OffloadManager(
        pool, host_pool, storage, hasher, slots, release=released.append, backend=ctx.backend, producer=producer
    )
    if ctx.cuda:
        kernels_warm_up(pool, page)
    return Rig(pool, host_pool, storage, hasher, slots, manager, released, page)


def prompt(seed: int, pages: int, page: int, extra: int = 1) -> list[int]:
    return torch.randint(0, 30000, (pages * page + extra,), generator=torch.Generator().manual_seed(seed)).tolist()


def stored_pages_equal(rig: Rig, req: SimpleRequest, slots: torch.Tensor, pages: int) -> tuple[bool, str]:
    """Whether the store holds ``req``'s first ``pages`` pages with exactly the pool's bytes of ``slots``."""
    keys = rig.hasher.prefill_keys(
        req.origin_input_ids[: pages * rig.page], extra_key=req.extra_key, cache_salt=req.cache_salt
    )
    shape = staging_shape(rig.pool, pages, rig.page, "page_first")
    want = torch.zeros(shape, dtype=rig.pool.dtype, device=rig.pool.device)
    gather_reference(
        rig.pool, want, slots[: pages * rig.page], torch.arange(pages, device=rig.pool.device), page_size=rig.page
    )
    got = torch.zeros(shape, dtype=rig.pool.dtype)
    hits = rig.storage.get(keys, list(got.unbind(0)))
    if not all(hits):
        return False, f"{sum(hits)} of {pages} pages in the store"
    same = [torch.equal(as_bytes(got[i]), as_bytes(want[i])) for i in range(pages)]
    return all(same), f"{sum(same)} of {pages} pages equal"


def poll_until_idle(rig: Rig, timeout_s: float = 20.0) -> bool:
    """``poll()`` until no copy and no store write is in flight (never ``drain``: the probe must
    not hide a missed poll); False when that takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s

    def busy() -> bool:
        return bool(rig.manager.copies_in_flight or rig.manager.metrics.writes_pending)

    while busy() and time.monotonic() < deadline:
        rig.manager.poll()
        time.sleep(0.002)
    return not busy()


# -- probes ------------------------------------------------------------------------------------


def probe_host_stall(ctx: Ctx) -> Probe:
    """offload/poll/prefetch/load return while the GPU sleeps: none of them waits for the device.

    Three rounds, each while the compute stream sleeps: (1) offload A0; (2) offload A1, then
    prefetch and load A0's prompt for B1; (3) the same with A2 and A1's prompt, timed. Slots are
    assigned before each sleep (the slot table's ``torch.tensor(..., device=)`` is the engine's
    own H2D copy, which waits for the device)."""
    probe = Probe("host_stall")
    rig = make_rig(ctx)
    pages = 8
    timings: dict[str, Any] = {}
    previous = None  # (the prompt stored last round, its slots)
    try:
        for round_name in ("warm-up store", "warm-up load", "timed"):
            a = SimpleRequest(f"a {round_name}", prompt(len(timings) + 1, pages, rig.page))
            slots_a = rig.slots.assign(a, len(a.origin_input_ids))
            rows = device_rows(rig.pool, slots_a.numel(), seed=7 + len(timings))
            b = slots_b = None
            if previous is not None:
                b = SimpleRequest(f"b {round_name}", previous[0])
                slots_b = rig.slots.assign(b, pages * rig.page)
            ctx.synchronize()
            sleep = gpu_sleep(ctx, SLEEP_MS)  # the forward pass: a long kernel, then the KV write
            put_rows_(rig.pool, slots_a, rows)
            busy_before = still_sleeping(sleep)
            calls: dict[str, float] = {}
            with sync_debug(ctx):
                _, calls["offload"] = timed_ms(lambda: rig.manager.offload(a))
                _, calls["poll"] = timed_ms(rig.manager.poll)
                if b is not None:
                    handle, calls["prefetch"] = timed_ms(lambda: rig.manager.prefetch(b, policy="best_effort"))
                    handle.wait(10.0)  # the store read runs on a worker thread; no GPU work in it
                    _, calls["poll (read done)"] = timed_ms(rig.manager.poll)
                    load, calls["load"] = timed_ms(
                        lambda: rig.manager.load(handle, slots_b[: handle.tokens_ready], layer_by_layer=True)
                    )
                    _, calls["wait_layer (every layer)"] = timed_ms(
                        lambda: [load.wait_layer(i) for i in range(rig.pool.num_layers)]
                    )
                    _, calls["poll (load queued)"] = timed_ms(rig.manager.poll)
            busy_after = still_sleeping(sleep)
            timings[round_name] = calls
            probe.info(
                f"{round_name}: "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in calls.items())
                + f"; GPU sleeping before {busy_before}, after {busy_after}"
            )
            ctx.synchronize()
            if sleep is not None:
                timings[round_name + ": sleep ms"] = sleep[0].elapsed_time(sleep[1])
            if round_name == "timed":
                if ctx.cuda:
                    probe.check(
                        "the GPU still slept after the last call (the calls ran during the sleep)",
                        busy_before and busy_after,
                        f"sleep {timings[round_name + ': sleep ms']:.0f} ms",
                    )
                slow = {k: v for k, v in calls.items() if v > STALL_LIMIT_MS}
                probe.check(
                    f"every call returned within {STALL_LIMIT_MS} ms while the GPU slept",
                    not slow,
                    ", ".join(f"{k} {v:.1f} ms" for k, v in slow.items()) or f"max {max(calls.values()):.2f} ms",
                    enforced=ctx.cuda,
                )
            if b is not None:
                probe.check(
                    f"{round_name}: the prefix hit and was loaded",
                    load.num_pages == pages,
                    f"{load.num_pages} of {pages} pages",
                )
                probe.check(
                    f"{round_name}: the loaded slots equal the stored KV",
                    all(torch.equal(x, y) for x, y in zip(rows_of(rig.pool, slots_b), rows_of(rig.pool, previous[1]))),
                )
                b.done = True
                rig.manager.finish(b)
            a.done = True
            rig.manager.finish(a)
            if not poll_until_idle(rig):
                probe.check(f"{round_name}: the copies finished", False, "still in flight after 20 s")
            ok, detail = stored_pages_equal(rig, a, slots_a, pages)
            probe.check(f"{round_name}: the stored pages equal the KV", ok, detail)
            previous = (a.origin_input_ids, slots_a[: pages * rig.page])
    except RuntimeError as error:  # the sync debug mode raises on a synchronizing call
        probe.check("no synchronizing CUDA call (sync debug mode 'error')", False, f"{error}"[:300])
    finally:
        rig.manager.close()
    probe.data["timings_ms"] = timings
    probe.data["limit_ms"] = STALL_LIMIT_MS
    return probe


def probe_allocator_race(ctx: Ctx) -> Probe:
    """Copies still queued on the side stream read index tensors the caller has dropped and whose
    memory the caller reuses on the compute stream: the results must not change."""
    probe = Probe("allocator_race")
    page, pages, num_slots = RIG["page"], 6, 1024
    pool = make_pool(
        device=ctx.device,
        parts=RIG["parts"],
        layers=RIG["layers"],
        heads=RIG["heads"],
        dim=RIG["dim"],
        dtype=RIG["dtype"],
        num_slots=num_slots,
    )
    if ctx.cuda:
        kernels_warm_up(pool, page)
    gen = torch.Generator().manual_seed(3)
    slot_values = (
        (torch.randperm(num_slots // page - 1, generator=gen)[:pages] * page + page)[:, None]
        .add(torch.arange(page))
        .reshape(-1)
    )  # never slot 0..page-1
    host_values = torch.randperm(pages + 2, generator=gen)[:pages]
    garbage_slot = 0  # what a reused index block would read: row 0, outside the batch
    results = {}
    for variant in (
        "gather device int64",
        "gather device int32",
        "gather cpu int64",
        "scatter device int64",
        "manager offload",
    ):
        op, where, dtype_name = (variant.split() + ["int64"])[:3]
        dtype = getattr(torch, dtype_name)
        side = torch.cuda.Stream(ctx.device) if ctx.cuda else None
        keep = []
        if op == "manager":
            rig = make_rig(ctx, num_slots=num_slots, seed=5)
            req = SimpleRequest("race", prompt(9, pages, page))
            row = rig.slots.assign(req, len(req.origin_input_ids))
            put_rows_(rig.pool, row, device_rows(rig.pool, row.numel(), seed=11))
            copy_stream = getattr(rig.manager.copier.copy_stream, "_side", None)
            sleep = gpu_sleep(ctx, SLEEP_MS, copy_stream)
            rig.manager.offload(req)
            rig.slots.assign(
                req, len(req.origin_input_ids) + page
            )  # the engine's row grows: the old row tensor is dropped
            del row
            keep += [
                torch.full((len(req.origin_input_ids) + k,), garbage_slot, dtype=torch.int64, device=ctx.device)
                for k in range(0, 2 * page, 1)
            ]
            busy = still_sleeping(sleep)
            ok = poll_until_idle(rig)
            ok, detail = stored_pages_equal(rig, req, rig.slots(req), pages) if ok else (False, "copy still in flight")
            req.done = True
            rig.manager.finish(req)
            rig.manager.close()
        else:
            staging = pinned_empty(
                ctx, int(torch.Size(staging_shape(pool, pages + 2, page, "page_first")).numel()), pool.dtype
            ).view(staging_shape(pool, pages + 2, page, "page_first"))
            random_bytes_(staging, seeded(4))
            index_device = ctx.device if where == "device" else torch.device("cpu")
            slot_indices = slot_values.to(dtype).to(index_device)
            host_page_ids = host_values.to(dtype).to(index_device)
            if op == "gather":
                want = staging.clone().to(ctx.device)
                gather_reference(pool, want, slot_values.to(ctx.device), host_values.to(ctx.device), page_size=page)
            else:
                want_pool = KVPool([[t.clone() for t in part] for part in pool.buffers])
                scatter_reference(
                    staging.to(ctx.device),
                    want_pool,
                    slot_values.to(ctx.device),
                    host_values.to(ctx.device),
                    page_size=page,
                )
            ctx.synchronize()
            sleep = gpu_sleep(ctx, SLEEP_MS, side)  # the side stream is busy: the copy is queued behind the sleep
            if op == "gather":
                handle = gather_async(
                    pool, staging, slot_indices, host_page_ids, stream=side, page_size=page, backend=ctx.backend
                )
            else:
                handle = scatter_async(
                    staging, pool, slot_indices, host_page_ids, stream=side, page_size=page, backend=ctx.backend
                )
            sizes = [(slot_indices.numel(), slot_indices.dtype), (host_page_ids.numel(), host_page_ids.dtype)]
            del slot_indices, host_page_ids, handle  # the caller keeps nothing of the copy
            for _ in range(4):  # the same sizes again and again on the compute stream, filled with a wrong slot
                keep += [torch.full((n,), garbage_slot, dtype=d, device=ctx.device) for n, d in sizes]
                # and in pinned memory, where a CPU index went on its way to the device (torch's
                # pinned allocator must not hand its block out before the queued H2D copy ran)
                keep += [pinned_empty(ctx, n, d).fill_(garbage_slot) for n, d in sizes]
            busy = still_sleeping(sleep)
            if side is not None:
                side.synchronize()
            ctx.synchronize()
            if op == "gather":
                ok = torch.equal(as_bytes(staging), as_bytes(want))
            else:
                ok = all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(pool.tensors(), want_pool.tensors()))
            detail = "bytes equal the reference" if ok else "bytes differ from the reference"
        results[variant] = dict(ok=ok, copy_queued_behind_sleep=busy)
        if ctx.cuda:
            probe.check(f"{variant}: the copy was still queued when the caller reused the memory", busy)
        probe.check(f"{variant}: result equals the reference", ok, detail)
        del keep
    probe.data["variants"] = results
    return probe


def probe_ordering(ctx: Ctx) -> Probe:
    """The manager's copies wait for the producer's event (or stream): stored bytes equal the KV."""
    probe = Probe("ordering")
    pages = 8
    producer = torch.cuda.Stream(ctx.device) if ctx.cuda else None
    outcomes = {}
    for variant in ("after=event", "producer=stream", "control: no producer"):
        rig = make_rig(ctx, producer=producer if variant == "producer=stream" else None, seed=len(outcomes))
        req = SimpleRequest(f"order-{len(outcomes)}", prompt(20 + len(outcomes), pages, rig.page))
        slots = rig.slots.assign(req, len(req.origin_input_ids))
        rows = device_rows(rig.pool, slots.numel(), seed=100 + len(outcomes))
        event = None
        ctx.synchronize()
        with torch.cuda.stream(producer) if producer is not None else contextlib.nullcontext():
            sleep = gpu_sleep(ctx, SLEEP_MS, producer)
            put_rows_(rig.pool, slots, rows)
            if producer is not None:
                event = torch.cuda.Event()
                event.record(producer)
        if variant == "after=event":
            launched = rig.manager.offload(req, after=event)
        else:
            launched = rig.manager.offload(req)
        busy = still_sleeping(sleep)
        idle = poll_until_idle(rig)
        ctx.synchronize()
        ok, detail = stored_pages_equal(rig, req, slots, pages) if idle else (False, "copy still in flight")
        outcomes[variant] = dict(stored_equal=ok, launched=launched, producer_busy_at_offload=busy, detail=detail)
        if variant.startswith("control"):
            if ctx.cuda:
                probe.info(
                    f"control (the copy waits for the current stream only, not the producer): stored pages {'equal (the race did not show)' if ok else 'stale, as expected'}; {detail}"
                )
        else:
            probe.check(f"{variant}: the offload launched while the producer was still writing", launched and busy)
            probe.check(f"{variant}: the stored bytes equal the KV the producer wrote", ok, detail)
        req.done = True
        rig.manager.finish(req)
        rig.manager.close()
    probe.data["variants"] = outcomes
    return probe


def probe_load_layers(ctx: Ctx) -> Probe:
    """A layer-by-layer load while the copy stream sleeps: the forward stream waits on each layer."""
    probe = Probe("load_layers")
    rig = make_rig(ctx, seed=8)
    pages = 6
    a = SimpleRequest("a", prompt(31, pages, rig.page))
    slots_a = rig.slots.assign(a, len(a.origin_input_ids))
    put_rows_(rig.pool, slots_a, device_rows(rig.pool, slots_a.numel(), seed=55))
    a.done = True
    rig.manager.finish(a)
    rig.manager.drain()
    b = SimpleRequest("b", list(a.origin_input_ids))
    handle = rig.manager.prefetch(b, policy="wait_complete")
    handle.wait(10.0)
    rig.manager.poll()
    probe.check(
        "the prefix is ready to load",
        handle.ready_to_load() and handle.pages_ready == pages,
        f"{handle.pages_ready} pages ready",
    )
    slots_b = rig.slots.assign(b, handle.tokens_ready)
    for t in rig.pool.tensors():  # poison: a read before the layer's copy shows
        t.view(t.shape[0], -1).view(torch.uint8)[slots_b.long()] = POISON
    ctx.synchronize()
    copy_stream = getattr(rig.manager.copier.copy_stream, "_side", None)
    sleep = gpu_sleep(ctx, SLEEP_MS, copy_stream)
    load = rig.manager.load(handle, slots_b, layer_by_layer=True)
    forward = torch.cuda.Stream(ctx.device) if ctx.cuda else None
    seen, waited_ms = [], 0.0
    with torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
        for layer in range(rig.pool.num_layers):
            _, ms = timed_ms(lambda: load.wait_layer(layer))  # the current stream (forward) waits for the layer's event
            waited_ms += ms
            seen.append(
                [
                    t.view(t.shape[0], -1).view(torch.uint8)[slots_b.long()].clone()
                    for t in (rig.pool.layer(p, layer) for p in range(rig.pool.kv_parts))
                ]
            )
    busy = still_sleeping(sleep)
    if forward is not None:
        forward.synchronize()
    ctx.synchronize()
    want = rows_of(rig.pool, slots_a[: pages * rig.page])  # every (part, layer), parts outer
    per_layer = []
    for layer in range(rig.pool.num_layers):
        got = [as_bytes(x) for x in seen[layer]]
        expected = [want[p * rig.pool.num_layers + layer] for p in range(rig.pool.kv_parts)]
        per_layer.append(all(torch.equal(g, e) for g, e in zip(got, expected)))
    handles = [load.layer_handle(i) for i in range(rig.pool.num_layers)]
    probe.check("one completion per layer", len({id(h) for h in handles}) == rig.pool.num_layers)
    if ctx.cuda:
        probe.check(
            "the wait_layer calls did not block the host",
            busy and waited_ms < STALL_LIMIT_MS,
            f"{waited_ms:.2f} ms for {rig.pool.num_layers} layers",
        )
        ends = [h._end for h in handles]
        order = all(ends[i].elapsed_time(ends[i + 1]) >= 0 for i in range(len(ends) - 1))
        probe.check("the layers' copies ended in layer order", order)
        probe.data["layer_copy_ms"] = [h.seconds * 1e3 for h in handles]
    probe.check(
        "each layer the forward stream read after wait_layer holds the stored KV (not the poison)",
        all(per_layer),
        f"per layer {per_layer}",
    )
    rig.manager.poll()
    poll_until_idle(rig)
    probe.check(
        "the load was counted",
        rig.manager.metrics.pages_loaded == pages,
        f"pages_loaded {rig.manager.metrics.pages_loaded}",
    )
    b.done = True
    rig.manager.finish(b)
    rig.manager.close()
    return probe


def matrix_combos(
    dry: bool, rows: tuple[str, ...] = tuple(MATRIX_ROWS), offsets: tuple[int, ...] = STAGING_OFFSETS
) -> list[tuple]:
    """Every (row, offset, layout, index dtype, mode); in dry mode a subset that has every value of every axis."""
    axes = [rows, offsets, ("page_first", "layer_first"), (torch.int32, torch.int64), ("kernel", "staged")]
    if not dry:
        import itertools

        return list(itertools.product(*axes))
    return [tuple(a[i % len(a)] for a in axes) for i in range(max(len(a) for a in axes))]


def run_matrix(ctx: Ctx, probe: Probe, combos: list[tuple]) -> list[dict]:
    """Gather, scatter and a scatter of layer 1 for each combination; bytes against the reference."""
    records = []
    pools: dict[str, KVPool] = {}
    m = MATRIX
    for row_name, offset, layout, index_dtype, mode in combos:
        spec = MATRIX_ROWS[row_name]
        if row_name not in pools:
            pools[row_name] = make_pool(
                device=ctx.device, layers=m["layers"], num_slots=m["slots"], seed=len(pools), **spec
            )
        pool = pools[row_name]
        shape = staging_shape(pool, m["num_host_pages"], m["page"], layout)
        nbytes = int(torch.Size(shape).numel()) * pool.itemsize
        arena = pinned_empty(ctx, nbytes + 16)
        arena.fill_(POISON)
        staging = arena[offset : offset + nbytes].view(pool.dtype).view(shape)
        gen = torch.Generator().manual_seed(len(records))
        slot_values = torch.randperm(m["slots"], generator=gen)[: m["pages"] * m["page"]]
        host_values = torch.randperm(m["num_host_pages"], generator=gen)[: m["pages"]]
        slot_indices = slot_values.to(index_dtype).to(ctx.device)
        host_page_ids = host_values.to(index_dtype)  # CPU: a staged copy reads its runs on the host
        options = dict(page_size=m["page"], layout=layout, backend=ctx.backend, mode=mode)
        # gather
        want = torch.empty(shape, dtype=pool.dtype, device=ctx.device)
        poison_(want)
        gather_reference(
            pool, want, slot_values.to(ctx.device), host_values.to(ctx.device), page_size=m["page"], layout=layout
        )
        gather(pool, staging, slot_indices, host_page_ids, **options)
        ctx.synchronize()
        outside = torch.cat([arena[:offset], arena[offset + nbytes :]])
        gather_ok = torch.equal(as_bytes(staging), as_bytes(want)) and bool((outside == POISON).all())
        # scatter of every layer, then of layer 1, into poisoned target slots
        random_bytes_(staging, seeded(1000 + len(records)))
        results = {}
        for layer in (None, 1):
            saved = [t.clone() for t in pool.tensors()]
            for t in pool.tensors():
                t.view(t.shape[0], -1).view(torch.uint8)[slot_values.to(ctx.device)] = POISON
            want_pool = KVPool([[t.clone() for t in part] for part in pool.buffers])
            scatter_reference(
                staging.to(ctx.device),
                want_pool,
                slot_values.to(ctx.device),
                host_values.to(ctx.device),
                page_size=m["page"],
                layout=layout,
                layer=layer,
            )
            scatter(staging, pool, slot_indices, host_page_ids, layer=layer, **options)
            ctx.synchronize()
            results[layer] = all(
                torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(pool.tensors(), want_pool.tensors())
            )
            for t, s in zip(pool.tensors(), saved):
                t.copy_(s)
        record = dict(
            row=row_name,
            offset=offset,
            layout=layout,
            index=str(index_dtype).removeprefix("torch."),
            mode=mode,
            gather=gather_ok,
            scatter=results[None],
            scatter_layer_1=results[1],
        )
        records.append(record)
        ok = gather_ok and results[None] and results[1]
        if not ok:
            probe.check(
                f"{row_name} +{offset}B {layout} {record['index']} {mode}",
                False,
                f"gather {gather_ok}, scatter {results[None]}, layer-1 scatter {results[1]}",
            )
    return records


def probe_pinned_matrix(ctx: Ctx) -> Probe:
    probe = Probe("pinned_matrix")
    combos = matrix_combos(ctx.dry)
    records = run_matrix(ctx, probe, combos)
    bad = [r for r in records if not (r["gather"] and r["scatter"] and r["scatter_layer_1"])]
    probe.check(
        f"{len(records)} combinations (rows x staging offsets x layouts x index dtypes x modes) equal the reference, gather and scatter",
        not bad,
        f"{len(bad)} wrong",
    )
    probe.data["combinations"] = records
    return probe


def probe_staging_2gib(ctx: Ctx) -> Probe:
    """Layer-first pinned staging past 2 GiB, 1-byte words, host pages at its end."""
    probe = Probe("staging_2gib")
    s = BIG_STAGING
    pool = make_pool(
        device=ctx.device,
        parts=s["parts"],
        layers=s["layers"],
        heads=s["heads"],
        dim=s["dim"],
        dtype=s["dtype"],
        num_slots=512,
        seed=9,
    )
    page, row = s["page"], pool.row_bytes
    per_host_page = pool.kv_parts * pool.num_layers * page * row
    num_host_pages = (s["bytes"] if ctx.cuda else 1 << 20) // per_host_page
    shape = staging_shape(pool, num_host_pages, page, "layer_first")
    nbytes = int(torch.Size(shape).numel()) * pool.itemsize
    probe.data["staging_bytes"] = nbytes
    if ctx.cuda:
        probe.check("the staging buffer is larger than 2 GiB", nbytes > 2**31, f"{nbytes / 2**30:.2f} GiB")
    started = time.perf_counter()
    staging = pinned_empty(ctx, nbytes).view(pool.dtype).view(shape)
    probe.data["pin_seconds"] = time.perf_counter() - started
    host_values = torch.tensor(
        [num_host_pages - 1, num_host_pages - 5, num_host_pages - 3, num_host_pages // 2]
    )  # none adjacent: each keeps a poisoned row after it
    pages = host_values.numel()
    slot_values = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(2))[: pages * page]
    flat = staging.view(pool.kv_parts, pool.num_layers, num_host_pages * page, row).view(torch.uint8)
    for index_dtype in (torch.int32, torch.int64):
        for p in range(pool.kv_parts):
            for layer in range(pool.num_layers):
                for h in host_values.tolist():
                    flat[p, layer, max(h * page - 1, 0) : (h + 1) * page + 1].fill_(POISON)
        slot_indices, host_page_ids = slot_values.to(index_dtype).to(ctx.device), host_values.to(index_dtype)
        gather(pool, staging, slot_indices, host_page_ids, page_size=page, layout="layer_first", backend=ctx.backend)
        ctx.synchronize()
        small = torch.zeros(staging_shape(pool, pages, page, "layer_first"), dtype=pool.dtype, device=ctx.device)
        gather_reference(
            pool,
            small,
            slot_values.to(ctx.device),
            torch.arange(pages, device=ctx.device),
            page_size=page,
            layout="layer_first",
        )
        small = small.cpu().view(pool.kv_parts, pool.num_layers, pages * page, row).view(torch.uint8)
        ok = True
        for p in range(pool.kv_parts):
            for layer in range(pool.num_layers):
                for i, h in enumerate(host_values.tolist()):
                    ok &= torch.equal(
                        flat[p, layer, h * page : (h + 1) * page], small[p, layer, i * page : (i + 1) * page]
                    )
                    ok &= bool((flat[p, layer, h * page + page] == POISON).all()) if h < num_host_pages - 1 else True
        dtype_name = str(index_dtype).removeprefix("torch.")
        probe.check(f"gather into the last host pages, {dtype_name} indices", ok)
        saved = [t.clone() for t in pool.tensors()]
        for t in pool.tensors():
            t.view(t.shape[0], -1).view(torch.uint8)[slot_values.to(ctx.device)] = 0
        scatter(staging, pool, slot_indices, host_page_ids, page_size=page, layout="layer_first", backend=ctx.backend)
        ctx.synchronize()
        probe.check(
            f"scatter from the last host pages, {dtype_name} indices",
            all(torch.equal(a, b) for a, b in zip(pool.tensors(), saved)),
        )
    del staging, flat
    return probe


def load_real_model_module():
    """``tests/offload/test_real_model.py`` as a module (its model, pool and cache helpers)."""
    path = REPO / "tests" / "offload" / "test_real_model.py"
    spec = importlib.util.spec_from_file_location("kvstage_gpu_check_real_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_real_model(ctx: Ctx) -> Probe:
    """The real-model test's flow on ``ctx.device``: store A, load B's prefix layer by layer, continue."""
    probe = Probe("real_model")
    try:
        rm = load_real_model_module()
    except ImportError as error:
        probe.skip("the real-model flow", f"cannot import tests/offload/test_real_model.py: {error}")
        return probe
    device = ctx.device
    new_tokens = 40 if not ctx.dry else 6

    def device_pool(model):
        cpu_pool = rm.pool_buffers(model)
        moved = [[t.to(device) for t in part] for part in cpu_pool.buffers]
        return KVPool.mla(moved[0]) if cpu_pool.kv_parts == 1 else KVPool.mha(moved[0], moved[1])

    combos = [("llama", torch.bfloat16), ("deepseek_v3", torch.bfloat16)] if not ctx.dry else [("llama", torch.float32)]
    runs = {}
    for arch, dtype in combos:
        name = f"{arch} {str(dtype).removeprefix('torch.')}"
        model = rm.build_model(arch, dtype).to(device)
        kv_pool = device_pool(model)
        if ctx.cuda:
            kernels_warm_up(kv_pool, rm.PAGE_SIZE)
        storage = open_storage("memory", LayoutFingerprint.of(kv_pool, page_size=rm.PAGE_SIZE, model_id=f"tiny-{arch}"))
        first = rm.Engine(
            model, storage, backend=ctx.backend, seed=0, kv_pool=kv_pool, device=device, new_tokens=new_tokens
        )
        tokens = rm.prompt_tokens()
        prefix_tokens = (rm.PROMPT_TOKENS - 1) // rm.PAGE_SIZE * rm.PAGE_SIZE
        a = SimpleRequest("a", tokens, **rm.NAMESPACE)
        first.prefill(a, 0, prefix_tokens)
        logits_a = first.run(a, prefix_tokens)
        first.manager.drain()
        stored = a.kv_length // rm.PAGE_SIZE
        probe.check(
            f"{name}: A's pages stored",
            first.manager.metrics.pages_stored == stored and first.released == [a],
            f"{first.manager.metrics.pages_stored} of {stored}",
        )
        second = rm.Engine(
            model,
            storage,
            backend=ctx.backend,
            seed=1,
            kv_pool=device_pool(model),
            device=device,
            new_tokens=new_tokens,
        )
        b = SimpleRequest("b", tokens, **rm.NAMESPACE)
        load = second.load_prefix(b)
        logits_b = second.run(b, prefix_tokens, load=load)
        ctx.synchronize()
        same_bytes = all(
            torch.equal(x, y)
            for x, y in zip(
                rows_of(second.kv_pool, second.slots(b)[:prefix_tokens]),
                rows_of(first.kv_pool, first.slots(a)[:prefix_tokens]),
            )
        )
        probe.check(
            f"{name}: B's loaded prefix equals A's KV byte for byte",
            same_bytes and load.num_tokens == prefix_tokens,
            f"{load.num_tokens} tokens",
        )
        diffs = [float((x - y).abs().max()) for x, y in zip(logits_a, logits_b)]
        bitwise = all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))
        # Bitwise logits need the GPU to repeat A's kernels exactly (CUBLAS_WORKSPACE_CONFIG is set);
        # where it did not, a near tie may flip a token, and B's decode pages differ: then WARN.
        probe.check(f"{name}: B's logits equal A's bitwise", bitwise, f"max |diff| {max(diffs):.3g}", soft=True)
        probe.check(f"{name}: B's tokens equal A's", b.output_ids == a.output_ids, soft=not bitwise)
        second.manager.drain()
        metrics = second.manager.metrics
        prefix_pages = prefix_tokens // rm.PAGE_SIZE
        probe.check(
            f"{name}: B's prefix loaded",
            metrics.pages_loaded == prefix_pages,
            f"{metrics.pages_loaded} of {prefix_pages} pages",
        )
        probe.check(
            f"{name}: B's decode pages continue the loaded chain (deduplicated against A's)",
            (metrics.pages_stored, metrics.pages_deduplicated) == (0, stored - prefix_pages),
            f"stored {metrics.pages_stored}, deduplicated {metrics.pages_deduplicated}",
            soft=b.output_ids != a.output_ids,
        )
        runs[name] = dict(
            bitwise=bitwise,
            max_abs_diff=max(diffs),
            tokens_equal=b.output_ids == a.output_ids,
            loaded_bytes_equal=same_bytes,
        )
        first.close()
        second.close()
    probe.data["runs"] = runs
    return probe


PROBES: dict[str, Callable[[Ctx], Probe]] = {
    "host_stall": probe_host_stall,
    "allocator_race": probe_allocator_race,
    "ordering": probe_ordering,
    "load_layers": probe_load_layers,
    "pinned_matrix": probe_pinned_matrix,
    "staging_2gib": probe_staging_2gib,
    "real_model": probe_real_model,
}


# -- commands ----------------------------------------------------------------------------------


def header(ctx: Ctx) -> dict:
    info = dict(
        device=torch.cuda.get_device_name(ctx.device) if ctx.cuda else f"cpu ({platform.machine()})",
        torch=torch.__version__,
        dry_run=ctx.dry,
        backend=ctx.backend,
        interpreter=triton_interpreter_enabled(),
    )
    if triton_installed():
        import triton

        info["triton"] = triton.__version__
    return info


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def run_probes(ctx: Ctx, only: list[str] | None) -> int:
    report = dict(header(ctx), probes={})
    path = ctx.out / "probes.json"
    failed = []
    for name, fn in PROBES.items():
        if only and name not in only:
            continue
        print(f"== probe {name}", flush=True)
        started = time.perf_counter()
        faulthandler.dump_traceback_later(PROBE_TIMEOUT_S, exit=False)
        try:
            probe = fn(ctx)
            result = probe.result()
        except Exception as error:  # one probe's crash is its FAIL; the others still run
            traceback.print_exc()
            print(f"FAIL {name}: raised {type(error).__name__}: {error}", flush=True)
            result = dict(ok=False, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-3000:])
        finally:
            faulthandler.cancel_dump_traceback_later()
        result["seconds"] = round(time.perf_counter() - started, 2)
        report["probes"][name] = result
        if not result["ok"]:
            failed.append(name)
        report["ok"] = not failed
        write_json(path, report)  # after every probe: a step killed at its cap still leaves what ran
        print(f"== probe {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", flush=True)
    print(f"probes: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}; {path}", flush=True)
    return 1 if failed else 0


def warm_specs(ctx: Ctx) -> list[dict]:
    """Every (pool shape, page size, staging alignment) the probes and the benchmark launch."""
    import bench_kernels

    specs = []
    for case in bench_kernels.CASES.values():
        for page in bench_kernels.PAGE_SIZES:
            specs.append(
                dict(
                    parts=case["parts"],
                    layers=case["layers"],
                    heads=case["heads"],
                    dim=case["dim"],
                    dtype=str(bench_kernels.DTYPE),
                    page=page,
                    align=16,
                )
            )
    specs.append(dict(RIG, dtype=str(RIG["dtype"]), align=16))
    for spec in MATRIX_ROWS.values():
        for offset in STAGING_OFFSETS:
            specs.append(
                dict(spec, dtype=str(spec["dtype"]), layers=MATRIX["layers"], page=MATRIX["page"], align=offset or 16)
            )
    specs.append(
        dict(
            parts=BIG_STAGING["parts"],
            layers=BIG_STAGING["layers"],
            heads=BIG_STAGING["heads"],
            dim=BIG_STAGING["dim"],
            dtype=str(BIG_STAGING["dtype"]),
            page=BIG_STAGING["page"],
            align=16,
        )
    )
    for spec in REAL_MODEL_POOLS:
        for dtype in ("torch.bfloat16", "torch.float32"):
            specs.append(dict(spec, dtype=dtype, align=16))
    unique = {json.dumps(s, sort_keys=True): s for s in specs}
    return list(unique.values())


def warm_one(spec: dict, device_type: str) -> tuple[str, int, float]:
    """Compile the variants of one spec (in a worker process; Triton's disk cache is shared)."""
    from kvstage.kernels import triton_copy

    started = time.perf_counter()
    device = torch.device(device_type)
    dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
    pool = make_pool(
        device=device,
        parts=spec["parts"],
        layers=spec["layers"],
        heads=spec["heads"],
        dim=spec["dim"],
        dtype=dtype,
        num_slots=4,
    )
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        compiled = triton_copy.warm_up(pool, spec["page"], staging_alignment=spec["align"])
    return json.dumps(spec, sort_keys=True), compiled, time.perf_counter() - started


def run_warm(ctx: Ctx, jobs: int) -> int:
    if not triton_installed():
        print("SKIP warm: triton is not installed")
        return 0
    import multiprocessing

    specs = warm_specs(ctx)
    started = time.perf_counter()
    jobs = max(1, min(jobs, len(specs)))
    print(f"warm: {len(specs)} pool shapes x page sizes x staging alignments on {jobs} processes", flush=True)
    with multiprocessing.get_context("spawn").Pool(jobs) as workers:
        results = workers.starmap(warm_one, [(spec, ctx.device.type) for spec in specs], chunksize=1)
    total = sum(compiled for _, compiled, _ in results)
    slowest = max(results, key=lambda r: r[2])
    print(
        f"PASS warm: {total} kernel variants compiled or loaded for {len(specs)} specs in {time.perf_counter() - started:.1f} s "
        f"(slowest spec {slowest[2]:.1f} s: {slowest[0]})",
        flush=True,
    )
    return 0


def run_bench(ctx: Ctx) -> int:
    import bench_kernels

    probe = Probe("bench")
    started = time.perf_counter()
    if ctx.cuda:
        report = bench_kernels.run(True, device=ctx.device)
        num_tokens = bench_kernels.batch_tokens(ctx.device, True)
        programs = SWEEP_PROGRAMS
    else:  # dry: the same code, CPU methods only, a tiny batch
        report = bench_kernels.run(True, device="cpu", cases=("llama3-8b",), page_sizes=(16,), num_tokens=32)
        num_tokens, programs = 32, SWEEP_PROGRAMS[:2]
    pool, staging, slot_indices, host_page_ids = bench_kernels.make_case("llama3-8b", 16, num_tokens, ctx.device)
    if ctx.cuda:
        kernels_warm_up(pool, 16)
    nbytes = staging.numel() * staging.element_size()
    sweep = []
    for cap in programs:
        fns = {
            "gather": lambda cap=cap: gather(
                pool, staging, slot_indices, host_page_ids, page_size=16, backend=ctx.backend, max_programs=cap
            ),
            "scatter": lambda cap=cap: scatter(
                staging, pool, slot_indices, host_page_ids, page_size=16, backend=ctx.backend, max_programs=cap
            ),
        }
        seconds = bench_kernels.time_medians(fns, ctx.device, quick=True)
        row = dict(max_programs=cap, **{f"{op}_gbps": nbytes / s / 1e9 for op, s in seconds.items()})
        sweep.append(row)
        print(
            f"     sweep: max_programs {cap:4d}: gather {row['gather_gbps']:7.2f} GB/s  scatter {row['scatter_gbps']:7.2f} GB/s",
            flush=True,
        )
    for name, item in report["summary"].items():
        status = "PASS" if item["ok"] else "MISS"
        print(f"{status} bench: {name}: {item['value']:.2f} (target {item['target']})", flush=True)
    met = sum(item["ok"] for item in report["summary"].values())
    probe.info(f"targets met: {met} of {len(report['summary'])} (reported, not enforced)")
    out = dict(
        header(ctx),
        report=report,
        sweep=sweep,
        targets_met=met,
        targets=len(report["summary"]),
        seconds=time.perf_counter() - started,
    )
    write_json(ctx.out / "bench.json", out)
    try:
        bench_kernels.plot(report, ctx.out / "bench.png")
    except ImportError as error:
        print(f"SKIP bench: plot ({error})")
    return 0


def run_sanitize(ctx: Ctx) -> int:
    """A small run for compute-sanitizer: 92-byte rows (bf16 head_dim 46), staging at +0 and +2
    bytes, every layout, index dtype and mode, gather, scatter and a per-layer scatter."""
    probe = Probe("sanitize")
    combos = matrix_combos(ctx.dry, rows=("92B-bf16-hd46",), offsets=(0, 2))
    records = run_matrix(ctx, probe, combos)
    bad = [r for r in records if not (r["gather"] and r["scatter"] and r["scatter_layer_1"])]
    probe.check(f"{len(records)} combinations of 92-byte rows equal the reference", not bad, f"{len(bad)} wrong")
    return 0 if probe.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["warm", "probes", "bench", "sanitize"])
    parser.add_argument("--dry-run", action="store_true", help="on CPU with tiny sizes: the code paths, no GPU claims")
    parser.add_argument("--out", default=str(BENCH_DIR / "results" / "gpu"))
    parser.add_argument("--only", default="", help="probes: comma-separated names (default all)")
    parser.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)), help="warm: processes")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to run the code paths on CPU)")
        return 3
    ctx = Ctx(torch.device("cuda" if not args.dry_run else "cpu"), args.dry_run, Path(args.out))
    ctx.out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_probes {args.command}: {header(ctx)}", flush=True)
    if args.command == "warm":
        return run_warm(ctx, args.jobs if not args.dry_run else 1)
    if args.command == "probes":
        unknown = [n for n in args.only.split(",") if n and n not in PROBES]
        if unknown:
            parser.error(f"unknown probes {unknown}; known: {list(PROBES)}")
        return run_probes(ctx, [n for n in args.only.split(",") if n] or None)
    if args.command == "bench":
        return run_bench(ctx)
    return run_sanitize(ctx)


if __name__ == "__main__":
    sys.exit(main())
