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
    """What ``kvstage info`` prints, as a dict (versions, CUDA, copy backend, host row copies, NVTX, hashing)."""
    import torch

    from kvstage.hashing.schemes import describe_chains
    from kvstage.kernels.backend import describe_backend
    from kvstage.kernels.host_copy import describe_host_copy
    from kvstage.nvtx_ranges import NVTX_AVAILABLE

    cuda = torch.cuda.is_available()
    return {
        "kvstage": kvstage.__version__,
        "torch": torch.__version__,
        "triton": _version_of("triton"),
        "cuda": torch.cuda.get_device_name(0) if cuda else "not available",
        "copy backend": describe_backend(on_cuda=cuda),
        "host row copies": describe_host_copy(),
        "nvtx": "available (domain 'kvstage')" if NVTX_AVAILABLE else "not installed (ranges are no-ops)",
        "hashing": describe_chains(),
        "mooncake": _mooncake_status(),
    }


def _mooncake_status() -> str:
    from kvstage.storage.mooncake.store import INSTALL_HINT, master_binary

    if importlib.util.find_spec("mooncake") is None:
        return f"not installed ({INSTALL_HINT})"
    master = master_binary()
    versions = [
        f"{name} {_version_of(name)}" for name in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
    ]
    found = [v for v in versions if not v.endswith("not installed")]
    return f"installed ({', '.join(found) or 'unknown distribution'}; master: {master or 'not found'})"


def run_info(args: argparse.Namespace) -> int:
    """Print :func:`collect_info` as aligned ``key: value`` lines."""
    info = collect_info()
    width = max(len(key) for key in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _add_store_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "store",
        help="list the key spaces of a file: store directory (pages, bytes); evict some",
        description=(
            "List every key space (layout fingerprint prefix) with page files in a file: store's "
            "directory, with its pages and bytes, then remove the key spaces asked for (e.g. an old "
            "model_id's pages after a weight update); each removal is counted in the output."
        ),
    )
    p.add_argument("url", metavar="file:DIR", help="the file store's URL (or its directory)")
    p.add_argument(
        "--evict", action="append", default=[], metavar="PREFIX", help="remove this key space's pages (repeatable)"
    )
    p.add_argument("--evict-other", action="store_true", help="remove every key space not named by --keep")
    p.add_argument(
        "--keep", action="append", default=[], metavar="PREFIX", help="a key space --evict-other keeps (repeatable)"
    )
    p.set_defaults(handler=run_store)


def run_store(args: argparse.Namespace) -> int:
    """``kvstage store``: list the key spaces of a file store's directory, then evict what the
    arguments ask; one line per key space and per eviction.

    Returns:
        0; 2 when the arguments break a rule (``--evict-other`` without ``--keep``, ``--keep``
        without ``--evict-other``, a URL that is not ``file:``) or the directory cannot be
        listed, with the reason on stderr (nothing removed then).
    """
    from kvstage.errors import InvalidArgumentError, StorageError
    from kvstage.storage.key_spaces import key_spaces, remove_key_space  # imports torch (kvstage.storage): only here

    try:
        scheme, colon, rest = args.url.partition(":")
        if colon and (scheme != "file" or not rest):
            raise InvalidArgumentError(f"url: must be file:DIR (or a directory), got {args.url!r}")
        directory = rest.partition("?")[0] if colon else args.url
        if args.evict_other != bool(args.keep):
            raise InvalidArgumentError(
                "--keep: --evict-other needs at least one --keep PREFIX, and --keep needs --evict-other"
            )
        spaces = key_spaces(directory)
        for space in spaces:
            print(f"{space.prefix}  {space.pages} pages  {space.bytes} bytes")
        if not spaces:
            print(f"no kvstage pages in {directory}")
        doomed = list(args.evict)
        if args.evict_other:
            doomed += [space.prefix for space in spaces if space.prefix not in args.keep and space.prefix not in doomed]
        for prefix in doomed:
            print(f"evicted {prefix}: {len(remove_key_space(directory, prefix))} pages")
    except (InvalidArgumentError, StorageError) as error:
        print(f"kvstage store: {error}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="kvstage", description=kvstage.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvstage {kvstage.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser(
        "info", help="versions, CUDA, the copy backend that will run, NVTX, the hash chain that will run"
    )
    info.set_defaults(handler=run_info)
    from kvstage.replay.command import add_parser as add_replay_parser

    add_replay_parser(commands)
    _add_store_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstage`` script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)
