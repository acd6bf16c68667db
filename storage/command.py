"""``kvstage store file:DIR``: list the key spaces of a file store's directory, evict some.

Lists each key space (fingerprint prefix) with its pages and bytes; ``--evict PREFIX`` removes
the named key spaces, ``--evict-other --keep PREFIX`` every key space but the kept ones (e.g.
an old ``model_id``'s pages after a weight update). Every removal is counted in the output.
"""

from __future__ import annotations

import argparse
import sys

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.storage.file_store import key_spaces, remove_key_space

__all__ = ["add_parser", "run_store"]


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``store`` on the ``kvstage`` sub-command parsers."""
    p = commands.add_parser(
        "store",
        help="list the key spaces of a file: store directory (pages, bytes); evict some",
        description=(
            "List every key space (layout fingerprint prefix) with page files in a file: store's "
            "directory, with its pages and bytes, then remove the key spaces asked for."
        ),
    )
    p.add_argument("url", metavar="file:DIR", help="the file store's URL (or its directory)")
    p.add_argument("--evict", action="append", default=[], metavar="PREFIX", help="remove this key space's pages (repeatable)")
    p.add_argument("--evict-other", action="store_true", help="remove every key space not named by --keep")
    p.add_argument("--keep", action="append", default=[], metavar="PREFIX", help="a key space --evict-other keeps (repeatable)")
    p.set_defaults(handler=run_store)
    return p


def run_store(args: argparse.Namespace) -> int:
    """List, then evict what the arguments ask; prints one line per key space and per eviction.

    Returns:
        0; 2 when the arguments break a rule (``--evict-other`` without ``--keep``, ``--keep``
        without ``--evict-other``, a URL that is not ``file:``) or the directory cannot be
        listed, with the reason on stderr.
    """
    try:
        directory = _directory(args.url)
        if args.evict_other != bool(args.keep):
            raise InvalidArgumentError("--keep: --evict-other needs at least one --keep PREFIX, and --keep needs --evict-other")
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


def _directory(url: str) -> str:
    scheme, colon, rest = url.partition(":")
    if not colon:
        return url
    if scheme != "file" or not rest:
        raise InvalidArgumentError(f"url: must be file:DIR (or a directory), got {url!r}")
    return rest.partition("?")[0]
