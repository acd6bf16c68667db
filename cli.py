"""The ``kvstage`` command line: ``kvstage --version``, ``kvstage info``, ``kvstage replay``,
``kvstage store``.

Sub-commands register themselves in :func:`build_parser`; each has a ``run_<name>`` function
that takes the parsed arguments and returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from typing import Sequence

import kvstage


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect_info() -> dict[str, object]:
    """What ``kvstage info`` prints, as a dict (versions, CUDA, copy backend, NVTX, hashing)."""
    import torch

    from kvstage.hashing.schemes import describe_chains
    from kvstage.kernels.backend import describe_backend
    from kvstage.nvtx_ranges import NVTX_AVAILABLE

    cuda = torch.cuda.is_available()
    return {
        "kvstage": kvstage.__version__,
        "torch": torch.__version__,
        "triton": _version_of("triton"),
        "cuda": torch.cuda.get_device_name(0) if cuda else "not available",
        "copy backend": describe_backend(on_cuda=cuda),
        "nvtx": "available (domain 'kvstage')" if NVTX_AVAILABLE else "not installed (ranges are no-ops)",
        "hashing": describe_chains(),
        "mooncake": _mooncake_status(),
    }


def _mooncake_status() -> str:
    from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary

    if importlib.util.find_spec("mooncake") is None:
        return f"not installed ({INSTALL_HINT})"
    master = master_binary()
    versions = [f"{name} {_version_of(name)}" for name in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")]
    found = [v for v in versions if not v.endswith("not installed")]
    return f"installed ({', '.join(found) or 'unknown distribution'}; master: {master or 'not found'})"


def run_info(args: argparse.Namespace) -> int:
    """Print :func:`collect_info` as aligned ``key: value`` lines."""
    info = collect_info()
    width = max(len(key) for key in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="kvstage", description=kvstage.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvstage {kvstage.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", help="versions, CUDA, the copy backend that will run, NVTX, the hash chain that will run")
    info.set_defaults(handler=run_info)
    from kvstage.replay.command import add_parser as add_replay_parser

    add_replay_parser(commands)
    from kvstage.storage.command import add_parser as add_store_parser

    add_store_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstage`` script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)
