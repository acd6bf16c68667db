"""``kvstage replay``: its options, their checks, and the run from options to report.

Exit codes: 0 when the replay verified clean (0 load mismatches during the run, 0 mismatched
and 0 lost pages at verification); 1 when it ran but found mismatched or lost pages, or storage
failed at run time; 2 for a bad option or a malformed trace line (the message names the option,
or the trace line number and field).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Sequence

from kvstage.errors import BackendUnavailableError, InvalidArgumentError, KvstageError
from kvstage.replay.models import DEFAULT_MODEL, DTYPES, HYBRID_PRESETS, PRESETS, resolve_model
from kvstage.replay.trace import TraceRequest, load_trace, multi_tenant_trace, synthetic_trace

DEFAULT_SYNTHETIC_REQUESTS = 48
DEFAULT_LOCAL_PAGES = 4096  # as kvstage.replay.fleet.DEFAULT_LOCAL_PAGES (a test keeps them equal)
# As kvstage.hashing.SCHEMES and kvstage.kernels.backend.BACKEND_CHOICES (a test keeps them
# equal); listed here so that --help imports neither (kvstage.kernels imports torch).
HASH_SCHEMES = ("sglang-v1", "xxh3-128")
BACKENDS = ("auto", "triton", "torch")


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``replay`` on the ``kvstage`` sub-command parsers."""
    p = commands.add_parser(
        "replay",
        help="replay a Mooncake-format request trace through kvstage (default: a built-in synthetic trace)",
        description=(
            "Replay a Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids of "
            "512-token blocks) as a prefill-and-decode engine would: each request first loads its stored "
            "prefix (lookup, prefetch, load, checked byte for byte), prefill writes the rest of its prompt, "
            "and the offload manager stores its prompt pages and every decode stride; at the end every "
            "stored page is loaded back and checked. Without TRACE, a built-in seeded synthetic trace."
        ),
    )
    p.add_argument("trace", nargs="?", metavar="TRACE", help="JSONL trace file (default: built-in synthetic trace)")
    p.add_argument(
        "--requests", type=int, metavar="N", help="replay the first N requests (synthetic: make N; default 48)"
    )
    p.add_argument(
        "--multi-tenant",
        type=int,
        metavar="TENANTS",
        help="without TRACE: the built-in multi-tenant trace (TENANTS system prompts that recur) instead",
    )
    p.add_argument("--page-size", type=int, default=64, metavar="TOKENS", help="tokens per page (default 64)")
    p.add_argument(
        "--stride",
        type=int,
        metavar="TOKENS",
        help="decode offload stride, a multiple of the page size (default: one page)",
    )
    p.add_argument("--max-running", type=int, default=32, metavar="N", help="requests decoding at once (default 32)")
    p.add_argument(
        "--model",
        choices=tuple(PRESETS),
        help=f"KV layout preset (default {DEFAULT_MODEL}); hybrid: {', '.join(HYBRID_PRESETS)}",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=1,
        metavar="PAGES",
        help="hybrid models: a resume point (state snapshot, sliding-window run end) every PAGES pages (default 1)",
    )
    p.add_argument("--layers", type=int, help="layers (overrides the preset)")
    p.add_argument("--heads", type=int, help="KV heads (overrides the preset)")
    p.add_argument("--head-dim", type=int, help="head_dim, or kv_dim for MLA (overrides the preset)")
    p.add_argument("--dtype", choices=DTYPES, help="KV dtype (overrides the preset)")
    p.add_argument(
        "--storage",
        default="memory",
        metavar="URL",
        help="memory | memory:BYTES | file:DIR | mooncake://... (default memory, sized so nothing is evicted)",
    )
    p.add_argument("--hash", choices=HASH_SCHEMES, default="sglang-v1", help="page key scheme (default sglang-v1)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="copy backend of the gathers (default auto)")
    p.add_argument("--seed", type=int, default=0, help="seeds tokens, KV content, tenants, synthetic trace (default 0)")
    p.add_argument(
        "--tenants", type=int, default=0, metavar="N", help="give requests one of N cache_salt values (default 0: none)"
    )
    p.add_argument(
        "--lora-share",
        type=float,
        default=0.0,
        metavar="F",
        help="fraction of requests with a LoRA extra_key (default 0)",
    )
    p.add_argument(
        "--verify-sample",
        type=int,
        metavar="N",
        help="verify N random stored pages, each loaded with the pages before it in its chain (default: all)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device of the KV pool (default: cuda when available)")
    p.add_argument(
        "--pool-tokens",
        type=int,
        metavar="N",
        help="device KV pool slots (default: sized for the largest running requests)",
    )
    p.add_argument(
        "--num-host-pages",
        type=int,
        metavar="N",
        help="host pool pages, at least the longest request's (default: twice that + 4 strides per running request)",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op CPU threads (default 1 with a CPU KV pool, else torch's default)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve kvstage's Prometheus metrics on PORT while the replay runs (0: any free port, printed)",
    )
    p.add_argument(
        "--metrics-addr", default="127.0.0.1", metavar="ADDR", help="address --metrics-port binds (default 127.0.0.1)"
    )
    p.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="write kvstage's Prometheus metrics at the end of the run to PATH (text format, as the report's figures)",
    )
    fleet = p.add_argument_group("fleet (several engine processes on one store)")
    fleet.add_argument(
        "--engines",
        type=int,
        metavar="N",
        help="run N engine processes on one shared store (file:DIR or mooncake://...) behind a router",
    )
    fleet.add_argument(
        "--router",
        default="round-robin",
        metavar="POLICY[,POLICY...]",
        help="with --engines: kv, round-robin, random or dynamo (Dynamo's standalone KV indexer as the index: "
        "ai-dynamo-runtime, $KVSTAGE_DYNAMO_PYTHON); several (comma-separated) run one after another, "
        "each on a fresh store (default round-robin)",
    )
    fleet.add_argument(
        "--kill-engine-at",
        type=int,
        metavar="K",
        help="with --engines: SIGKILL the busiest engine right after the K-th request is routed, and restart it",
    )
    fleet.add_argument(
        "--local-pages",
        type=int,
        default=DEFAULT_LOCAL_PAGES,
        metavar="N",
        help=f"with --engines: pages each engine keeps in its own memory tier (default {DEFAULT_LOCAL_PAGES})",
    )
    fleet.add_argument("--plot", metavar="PNG", help="with --engines: plot hit rate over time per policy to PNG")
    p.set_defaults(handler=run)
    return p


def _positive(option: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise InvalidArgumentError(f"{option}: must be >= {minimum}, got {value}")


def config_from_args(args: argparse.Namespace):
    """Check the options and build the :class:`ReplayConfig`, the requests and the trace's name.

    Raises:
        InvalidArgumentError: an option breaks a rule (the message starts with the option).
        TraceError: a malformed trace line (the message names the line number and field).
    """
    from kvstage.replay.engine import ReplayConfig

    _positive("--requests", args.requests)
    _positive("--page-size", args.page_size)
    _positive("--max-running", args.max_running)
    _positive("--seed", args.seed, 0)
    _positive("--tenants", args.tenants, 0)
    _positive("--verify-sample", args.verify_sample, 0)
    _positive("--pool-tokens", args.pool_tokens)
    _positive("--num-host-pages", args.num_host_pages)
    _positive("--threads", args.threads)
    _positive("--snapshot-every", getattr(args, "snapshot_every", 1))
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise InvalidArgumentError(f"--metrics-port: must be a TCP port in [0, 65535], got {args.metrics_port}")
    if args.stride is not None and (args.stride < 1 or args.stride % args.page_size):
        raise InvalidArgumentError(
            f"--stride: must be a positive multiple of --page-size {args.page_size}, got {args.stride}"
        )
    if not 0.0 <= args.lora_share <= 1.0:
        raise InvalidArgumentError(f"--lora-share: must be in [0, 1], got {args.lora_share}")
    storage = args.storage
    if not (storage == "memory" or storage.startswith(("memory:", "file:", "mooncake://"))):
        raise InvalidArgumentError(
            f"--storage: must be memory, memory:BYTES, file:DIR or mooncake://..., got {storage!r}"
        )
    if storage.startswith("file:") and not storage[len("file:") :]:
        raise InvalidArgumentError("--storage: file: needs a folder, e.g. file:/tmp/kvstage-pages")
    model = resolve_model(args.model, layers=args.layers, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    _positive("--multi-tenant", args.multi_tenant)
    if args.multi_tenant is not None and args.trace is not None:
        raise InvalidArgumentError("--multi-tenant: makes a built-in trace; give it without TRACE")
    if args.multi_tenant is not None:
        requests = multi_tenant_trace(args.requests or DEFAULT_SYNTHETIC_REQUESTS, args.multi_tenant, seed=args.seed)
        trace_name = f"built-in multi-tenant ({args.multi_tenant} tenants)"
    elif args.trace is None:
        requests = synthetic_trace(args.requests or DEFAULT_SYNTHETIC_REQUESTS, seed=args.seed)
        trace_name = "built-in synthetic"
    else:
        requests = load_trace(args.trace, args.requests)
        trace_name = args.trace
    config = ReplayConfig(
        model=model,
        page_size=args.page_size,
        stride=args.stride,
        max_running=args.max_running,
        storage=storage,
        hash_scheme=args.hash,
        backend=args.backend,
        seed=args.seed,
        tenants=args.tenants,
        lora_share=args.lora_share,
        device=args.device,
        pool_tokens=args.pool_tokens,
        num_host_pages=args.num_host_pages,
        snapshot_every=getattr(args, "snapshot_every", 1),
    )
    if args.engines is not None and args.model in HYBRID_PRESETS:
        raise InvalidArgumentError(f"--engines: a fleet replays plain models only, not the hybrid {args.model}")
    return config, requests, trace_name


def replay(
    config,
    requests: Sequence[TraceRequest],
    *,
    trace_name: str = "built-in synthetic",
    verify_sample: int | None = None,
    on_progress: Callable[[Any], None] | None = None,
    started: float | None = None,
    keep_engine: bool = False,
    metrics_registry: Any = None,
    metrics_file: str | None = None,
):
    """Run a replay and verify it; returns ``(report, engine)`` (engine closed unless ``keep_engine``).

    Args:
        config: the :class:`kvstage.replay.engine.ReplayConfig`.
        requests: the trace.
        trace_name: the report's ``trace``.
        verify_sample: verify this many stored pages (see :func:`kvstage.replay.verify.verify_pages`);
            None: all.
        on_progress: the engine's progress callback.
        started: ``time.perf_counter()`` when the command started (default: now).
        keep_engine: leave the engine open (for tests that look into it; close it after).
        metrics_registry: a ``prometheus_client.CollectorRegistry`` that gets the manager's
            metrics (:class:`kvstage.offload.prometheus.PrometheusExporter`) for the whole
            replay, verification's loads included (closed when it returns: the last figures
            stay on the registry); None: no metrics.
        metrics_file: with ``metrics_registry``: write the registry in Prometheus' text format
            to this path when the run ends, before verification (the figures of the report).

    Returns:
        ``(report, engine)``: the report is :func:`kvstage.replay.report.build_report`'s dict.

    Raises:
        InvalidArgumentError: an option the engine checks (pool sizes); BackendUnavailableError.
    """
    from kvstage.replay.engine import ReplayEngine
    from kvstage.replay.report import build_report
    from kvstage.replay.verify import verify_pages

    if metrics_file is not None and metrics_registry is None:
        raise InvalidArgumentError("metrics_file: needs metrics_registry (the registry whose metrics it writes)")
    started = time.perf_counter() if started is None else started
    from kvstage.replay.models import HybridShape

    if isinstance(config.model, HybridShape):
        from kvstage.replay.hybrid_engine import HybridReplayEngine

        engine = HybridReplayEngine(config, requests, on_progress=on_progress)
    else:
        engine = ReplayEngine(config, requests, on_progress=on_progress)
    exporter = None
    try:
        if metrics_registry is not None:
            from kvstage.offload.prometheus import PrometheusExporter

            exporter = PrometheusExporter(engine.manager, registry=metrics_registry)
        engine.run()
        if metrics_file is not None and metrics_registry is not None:
            from pathlib import Path

            from prometheus_client import write_to_textfile

            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(metrics_file, metrics_registry)
        result = verify_pages(engine, sample=verify_sample, seed=config.seed)
        report = build_report(engine, result, trace_name=trace_name, elapsed_s=time.perf_counter() - started)
    finally:
        if exporter is not None:
            exporter.close()  # the last figures (verification's included) stay on the registry
        if not keep_engine:
            engine.close()
    return report, engine


def set_cpu_threads(threads: int | None, device: str | None) -> None:
    """Set torch's intra-op threads: ``threads``, else 1 when the KV pool is on CPU.

    Why 1: the replay's copies are many small ones (a page is tens of KiB) made by two threads
    already (the engine and the copy stream's worker); intra-op threads on top oversubscribe
    the cores, and on small VMs a 64 KiB ``copy_`` was measured 100x slower with 2 threads
    than with 1 (2 ms against 17 us).
    """
    import torch

    from kvstage.replay.device_pages import pick_device

    if threads is not None:
        torch.set_num_threads(threads)
    elif pick_device(device).type == "cpu":
        torch.set_num_threads(1)


def run(args: argparse.Namespace) -> int:
    """``kvstage replay``: returns the exit code (see the module docstring)."""
    from kvstage.replay.report import ProgressDisplay, print_summary, write_json

    started = time.perf_counter()
    try:
        config, requests, trace_name = config_from_args(args)
    except (InvalidArgumentError, BackendUnavailableError) as exc:
        print(f"kvstage replay: error: {exc}", file=sys.stderr)
        return 2
    if args.engines is not None:
        return run_fleet(args, config, requests, trace_name)
    registry = None
    if args.metrics_port is not None or args.metrics_file is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        if args.metrics_port is not None:
            try:
                server, _ = start_http_server(args.metrics_port, addr=args.metrics_addr, registry=registry)
            except OSError as exc:
                print(
                    f"kvstage replay: error: --metrics-port: cannot serve on {args.metrics_addr}:{args.metrics_port}: {exc}",
                    file=sys.stderr,
                )
                return 2
            print(
                f"kvstage replay: metrics on http://{args.metrics_addr}:{server.server_port}/metrics", file=sys.stderr
            )
    try:
        set_cpu_threads(args.threads, config.device)
        with ProgressDisplay(len(requests), enabled=not args.no_progress) as progress:
            report, _ = replay(
                config,
                requests,
                trace_name=trace_name,
                verify_sample=args.verify_sample,
                on_progress=progress.update,
                started=started,
                metrics_registry=registry,
                metrics_file=args.metrics_file,
            )
    except (InvalidArgumentError, BackendUnavailableError) as exc:
        print(f"kvstage replay: error: {exc}", file=sys.stderr)
        return 2
    except KvstageError as exc:
        print(f"kvstage replay: failed: {exc}", file=sys.stderr)
        return 1
    for note in report.get("notes", []):
        print(f"kvstage replay: note: {note}", file=sys.stderr)
    print_summary(report)
    if args.json:
        write_json(report, args.json)
    verified = report["load_mismatches"] == 0 and report["verify_mismatches"] == 0 and report["lost_pages"] == 0
    if not verified:
        print(
            f"kvstage replay: {report['load_mismatches']} pages loaded during the run mismatched; verify found "
            f"{report['verify_mismatches']} mismatched and {report['lost_pages']} lost pages",
            file=sys.stderr,
        )
    if report["pages_failed"]:
        print(
            f"kvstage replay: {report['pages_failed']:,} pages failed their copy or storage write "
            "(is the store smaller than one batch of pages?)",
            file=sys.stderr,
        )
    return 0 if verified and not report["pages_failed"] else 1


def fleet_plan(args: argparse.Namespace, config) -> list[tuple[Any, Any]]:
    """The ``(ReplayConfig, FleetConfig)`` of each policy of ``--router``, checked.

    With several policies each gets a fresh store: ``file:DIR`` becomes ``file:DIR/POLICY``; a
    Mooncake store is cleared before each (see :func:`run_fleet`).

    Raises:
        InvalidArgumentError: a fleet option breaks a rule (the message names it).
    """
    import dataclasses

    from kvstage.replay.fleet import FleetConfig
    from kvstage.replay.router import POLICIES

    _positive("--engines", args.engines)
    _positive("--local-pages", args.local_pages, 0)
    policies = [p.strip() for p in args.router.split(",")]
    for policy in policies:
        if policy not in POLICIES:
            raise InvalidArgumentError(f"--router: unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if len(set(policies)) != len(policies):
        raise InvalidArgumentError(f"--router: a policy appears twice in {args.router!r}")
    if not config.storage.startswith(("file:", "mooncake://")):
        raise InvalidArgumentError(
            f"--storage: --engines needs a store processes share, file:DIR or mooncake://..., got {config.storage!r}"
        )
    for option in ("metrics_port", "metrics_file"):
        if getattr(args, option) is not None:
            raise InvalidArgumentError(f"--{option.replace('_', '-')}: not available with --engines")
    plan = []
    for policy in policies:
        storage = config.storage
        if len(policies) > 1 and storage.startswith("file:"):
            directory, sep, query = storage[len("file:") :].partition("?")
            storage = f"file:{directory.rstrip('/')}/{policy}{sep}{query}"
        fleet = FleetConfig(
            engines=args.engines,
            policy=policy,
            kill_at=args.kill_engine_at,
            local_pages=args.local_pages,
        )
        plan.append((dataclasses.replace(config, storage=storage), fleet))
    return plan


def run_fleet(args: argparse.Namespace, config, requests: Sequence[TraceRequest], trace_name: str) -> int:
    """``kvstage replay --engines N``: each policy's fleet run, the table, the plot, the JSON.

    Exit codes as :func:`run`: 1 when a policy's run lost or mismatched pages, left a request
    incomplete, or an engine failed.
    """
    from kvstage.replay.fleet import Fleet, FleetError
    from kvstage.replay.fleet_report import plot_hit_rates, print_fleet_summary
    from kvstage.replay.report import write_json

    try:
        plan = fleet_plan(args, config)
        set_cpu_threads(args.threads, config.device)
        reports = []
        for policy_config, fleet in plan:
            if len(plan) > 1 and policy_config.storage.startswith("mooncake://"):
                _clear_store(policy_config)
            runner = Fleet(policy_config, requests, fleet)
            if not args.no_progress:
                print(f"kvstage replay: {fleet.engines} engines, router {fleet.policy} ...", file=sys.stderr)
            report = runner.run()
            report["trace"] = trace_name
            reports.append(report)
        if args.plot:
            store = config.storage.split(":")[0]
            plot_hit_rates(
                reports, args.plot, title=f"{args.engines} engines on a {store} store: {trace_name.rsplit('/', 1)[-1]}"
            )
    except (InvalidArgumentError, BackendUnavailableError) as exc:
        print(f"kvstage replay: error: {exc}", file=sys.stderr)
        return 2
    except (KvstageError, FleetError) as exc:
        print(f"kvstage replay: failed: {exc}", file=sys.stderr)
        return 1
    print_fleet_summary(reports)
    if args.json:
        write_json({"trace": trace_name, "policies": reports}, args.json)
    bad = [
        r["policy"]
        for r in reports
        if r["lost"] or r["mismatched"] or r["requests_completed"] != r["requests"] or r["pages_failed"]
    ]
    if bad:
        print(f"kvstage replay: lost, mismatched or failed pages, or requests not completed: {bad}", file=sys.stderr)
    return 1 if bad else 0


def _clear_store(config) -> None:
    """Empty the replay's key space in the store (a fresh store for the next policy)."""
    from kvstage.replay.engine import ReplayEngine

    engine = ReplayEngine(config, [TraceRequest(0, 0.0, 1, 1, (0,))])
    try:
        engine.storage.clear()
    finally:
        engine.close()
