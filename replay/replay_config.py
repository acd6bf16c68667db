"""A replay's configuration and raw counters (:class:`ReplayConfig`, :class:`ReplayStats`) and
the defaults the replay engines size their pools and stores by."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstage.replay.models import ModelShape

__all__ = ["ReplayConfig", "ReplayStats"]

DEFAULT_CPU_POOL_BYTES = 4 << 30  # device KV pool bound when it lives on CPU
DEFAULT_GPU_POOL_FRACTION = 0.5  # of free GPU memory
PREFETCH_POLICY = "wait_complete"  # load a prefix once its read has finished: every hit page
POISON_WORD = 0x5A  # written into slots before a load, so a load that writes nothing is caught
MEMORY_STORE_SHARE = 0.6  # of the host memory available: the most a default memory store takes


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class ReplayConfig:
    """What to replay and how (the ``kvstage replay`` options, checked by the command line).

    Attributes:
        model: the KV layout.
        page_size: tokens per page (device pages, host pages and stored pages).
        stride: decode offload stride in tokens (a multiple of page_size); None: one page.
        max_running: requests decoding at once.
        storage: storage URL: ``memory`` (sized so nothing is evicted), ``memory:BYTES``,
            ``file:DIR``, ``mooncake://...``.
        hash_scheme: ``sglang-v1`` or ``xxh3-128``.
        backend: copy backend of the gathers: ``auto``, ``triton``, ``torch``.
        seed: seeds tokens, KV content, tenants and the verify sample.
        tenants: 0: no ``cache_salt``; N >= 1: each request gets one of N salts.
        lora_share: fraction of requests with an ``extra_key`` (a LoRA adapter name).
        device: where the device KV pool lives; None: CUDA when available, else CPU.
        pool_tokens: device KV pool slots; None: enough for the ``max_running`` largest
            requests, bounded (4 GiB on CPU, half the free memory on CUDA) but never below the
            largest request.
        num_host_pages: host pool pages, at least the longest request's whole pages (a prefetch and
            a verify load take a whole prefix at once); None: twice that plus four strides per
            running request.
        snapshot_every: a hybrid model's resume points, every this many pages (state
            snapshots, sliding-window runs; :mod:`kvstage.replay.hybrid_engine`).
    """

    model: ModelShape
    page_size: int = 64
    stride: int | None = None
    max_running: int = 32
    storage: str = "memory"
    hash_scheme: str = "sglang-v1"
    backend: str = "auto"
    seed: int = 0
    tenants: int = 0
    lora_share: float = 0.0
    device: str | None = None
    pool_tokens: int | None = None
    num_host_pages: int | None = None
    snapshot_every: int = 1


@dataclass
class ReplayStats:
    """Raw counters of one replay (the report derives rates from them; the pages' store and load
    counters are the manager's, :class:`kvstage.offload.OffloadMetrics`).

    Attributes:
        prompt_pages: whole pages of the prompts.
        prefill_tokens_saved: prompt tokens whose KV was loaded rather than written by prefill.
        load_mismatches: loaded pages whose device KV differs from what was stored.
    """

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_pages: int = 0
    prefill_tokens_saved: int = 0
    load_mismatches: int = 0
    hashed_tokens: int = 0
    hash_seconds: float = 0.0
    decode_steps: int = 0
    run_seconds: float = 0.0
    storage_failure_keys: list[str] = field(default_factory=list)
