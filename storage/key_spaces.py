"""Key spaces in a file store's directory: list them, remove one, say how they differ.

A directory may hold pages of several key spaces (an old ``model_id`` after a weight update,
other ranks or stages): each :class:`kvstage.storage.file_store.FileStore` counts, evicts,
clears and sweeps only its own (names starting with its prefix, or with its owner tag for
hashed names: :mod:`kvstage.storage.page_file`). This module is the administration of the
others: :func:`key_spaces` lists every key space's pages and bytes, :func:`remove_key_space`
removes one (``FileStore.evict_key_space`` counts it and records events), and
:func:`describe_other_key_spaces` says which settings they differ in from a store's
(:func:`kvstage.storage.fingerprint.prefix_differences`, e.g. ``page_size 16 (this store: 64)``),
as a store logs at open. ``kvstage store file:DIR`` (:mod:`kvstage.cli`) lists and removes
from the command line.

An opaque key space, whose prefix holds only a digest of its page format, leaves the format's
text beside its pages (``.kvstage-format-TAG.json``, :func:`describe_format`, written once by
the first store of it that opens the directory; no page, never counted), so that a description
can name the part of the format that differs.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvstage.errors import InvalidArgumentError, StorageError
from kvstage.storage.fingerprint import prefix_differences, prefix_fields, prefix_of
from kvstage.storage.page_file import HASHED, SUFFIX, full_key_of, owner_tag, remove_page_files, tmp_name, unlink

FORMAT_FILE_PREFIX = ".kvstage-format-"  # an opaque key space's format description (see describe_format)


@dataclass(frozen=True)
class KeySpace:
    """The pages of one key space in a file store's directory.

    Attributes:
        prefix: the key space's fingerprint prefix (:meth:`LayoutFingerprint.prefix`).
        pages: its page files.
        bytes: their sizes summed, in bytes (headers included).
    """

    prefix: str
    pages: int
    bytes: int


def key_spaces(directory: str | os.PathLike) -> list[KeySpace]:
    """Every key space with page files (``*.kvpage``) in a file store's directory, largest
    first. A key space's hashed names (long or unusual keys) are attributed by reading one of
    their headers; files that are not kvstage pages are skipped.

    Raises:
        StorageError: the directory cannot be listed.
    """
    directory = Path(directory)
    try:
        entries = [(entry.name, entry.stat().st_size) for entry in os.scandir(directory) if entry.name.endswith(SUFFIX)]
    except OSError as error:
        raise StorageError(f"directory: cannot list {str(directory)!r}: {error}") from error
    prefix_of_name = prefix_finder(directory)
    totals: dict[str, list[int]] = {}
    for name, size in entries:
        prefix = prefix_of_name(name)
        if prefix is None:
            continue
        total = totals.setdefault(prefix, [0, 0])
        total[0] += 1
        total[1] += size
    return sorted(
        (KeySpace(prefix, pages, size) for prefix, (pages, size) in totals.items()), key=lambda k: (-k.bytes, k.prefix)
    )


def prefix_finder(directory: Path):
    """A function from a page file's name in ``directory`` to its key space's prefix (None: not
    a kvstage page). A plain name holds its prefix; a hashed name's owner tag is resolved by
    reading one header of that tag's files, once."""
    tags: dict[str, str | None] = {}  # owner tag of hashed names -> their prefix

    def prefix_of_name(name: str) -> str | None:
        if HASHED not in name:
            return prefix_of(name[: -len(SUFFIX)])
        tag = name.partition(HASHED)[0]
        if tag not in tags:
            full_key = full_key_of(directory / name)
            tags[tag] = None if full_key is None else prefix_of(full_key)
        return tags[tag]

    return prefix_of_name


def remove_key_space(directory: str | os.PathLike, prefix: str) -> list[str]:
    """Remove every page file of the key space ``prefix`` from a file store's directory.

    Another process's write of that key space that lands after the directory is listed stays;
    temporary files are left to their key space's next open (they may be writes in progress).

    Returns:
        The page keys (without the prefix) of the files removed; a hashed name whose header
        cannot be read is removed but not listed.

    Raises:
        InvalidArgumentError: ``prefix`` is not a fingerprint prefix (:func:`kvstage.storage.fingerprint.prefix_of`).
        StorageError: the directory cannot be listed.
    """
    if not isinstance(prefix, str) or prefix_of(prefix) != prefix:
        raise InvalidArgumentError(
            f"prefix: must be a fingerprint prefix such as 'model@dtype@L0-1xKV2xH1xD4@P16@tp0of1@' "
            f"or 'model@opaque-0123456789abcdef@B4096@tp0of1@', got {prefix!r}"
        )
    directory = Path(directory)
    tag = owner_tag(prefix) + HASHED
    try:
        names = [
            entry.name
            for entry in os.scandir(directory)
            if entry.name.endswith(SUFFIX)
            and (entry.name.startswith(tag) or (entry.name.startswith(prefix) and HASHED not in entry.name))
        ]
    except OSError as error:
        raise StorageError(f"directory: cannot list {str(directory)!r}: {error}") from error
    return [full_key[len(prefix) :] for full_key in remove_page_files(directory, names)]


def format_path(directory: Path, prefix: str) -> Path:
    """Where an opaque key space's format description lies in a file store's directory (its
    prefix holds only a digest of it). Not a page: no page suffix, never counted or swept."""
    return directory / f"{FORMAT_FILE_PREFIX}{owner_tag(prefix)}.json"


def describe_format(directory: Path, prefix: str, page_format: str) -> None:
    """Leave the description of an opaque key space's page format beside its pages, once
    (written to a temporary name, then renamed), so that a process of another format opening
    the directory can say which part of the format differs. A failed write is ignored (a
    description only: the store works without it)."""
    path = format_path(directory, prefix)
    if path.exists():
        return
    tmp = directory / tmp_name(owner_tag(prefix))
    try:
        tmp.write_text(json.dumps({"prefix": prefix, "page_format": page_format}))
        os.replace(tmp, path)
    except OSError:
        unlink(tmp)


def format_descriptions(directory: Path, prefixes) -> dict[str, str]:
    """The page format descriptions found in ``directory`` of those of ``prefixes`` that are
    opaque key spaces (see :func:`describe_format`), by prefix."""
    found = {}
    for prefix in prefixes:
        fields = prefix_fields(prefix)
        if fields is None or "page_format" not in fields:
            continue
        try:
            described = json.loads(format_path(directory, prefix).read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(described, dict)
            and described.get("prefix") == prefix
            and isinstance(described.get("page_format"), str)
        ):
            found[prefix] = described["page_format"]
    return found


def describe_other_key_spaces(
    directory: Path, names: list[str], prefix: str, page_format: str | None, shown: int = 4
) -> str:
    """Which settings the key spaces of page files ``names`` in ``directory`` (not of
    ``prefix``) differ in from the key space ``prefix`` (whose opaque format is
    ``page_format``, or None), for the largest ``shown`` of them by page files, e.g.
    ``"P@... (2 page files): page_size 4 (this store: 16)"``; more are counted, not named."""
    prefix_of_name = prefix_finder(directory)
    counts = Counter(prefix_of_name(name) for name in names)
    counts.pop(None, None)
    formats = {prefix: page_format} if page_format else {}
    formats.update(format_descriptions(directory, counts))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    parts = [
        f"{theirs} ({count} page files): {', '.join(prefix_differences(theirs, prefix, formats))}"
        for theirs, count in ranked[:shown]
    ]
    if len(ranked) > shown:
        parts.append(f"and {len(ranked) - shown} more key spaces")
    return "; ".join(parts) or "(page files whose key space is unreadable)"
