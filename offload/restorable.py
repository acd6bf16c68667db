"""Restorable lengths of a hybrid model's token sequence, which sliding-window pages to store, and
where a state snapshot goes (pure arithmetic over a :class:`~kvstage.model_layout.ModelLayout`).

The key rule (every component): the entry of component ``C`` for page ``i`` (tokens
``[i * page_size, (i + 1) * page_size)``) is stored under the page's key ``h_i`` in ``C``'s key
space (:meth:`ModelLayout.fingerprints`); a state snapshot after exactly ``L = k * page_size``
tokens is stored under ``h_{k-1}``, the key of the page that ends at ``L``. So a lookup hashes a
sequence once and asks each component's store for the same keys.

A length ``L = k * page_size`` is restorable when, with ``w = ceil((W - 1) / page_size)`` for a
sliding window of ``W`` tokens:

- every full-attention and sidecar component holds pages ``0 .. k-1`` (sglang's ``ALL_PAGES``);
- every sliding-window component holds pages ``k-w .. k-1`` (from 0 when ``k < w``): the window
  before ``L``, and no more (sglang's ``TRAILING_PAGES``);
- every state component holds the snapshot at ``L`` (key ``h_{k-1}``);
- ``L <= num_tokens - 1``: the engine computes at least the last token (a hit of the whole
  prompt would leave it no logits; vLLM #44599 served wrong ones at exact block boundaries).

Why ``W - 1``: the token at position ``L`` attends to ``[L - W + 1, L]``, so resuming at ``L``
needs the ``W - 1`` tokens before it, exactly what transformers' ``DynamicSlidingWindowLayer``
keeps; sglang keeps ``ceil(W / page_size)`` pages, one more whenever ``page_size`` divides
``W - 1``; vLLM's offload keeps ``cdiv(W - 1 + extra_retained, block)`` chunks, as here when it
retains no extra tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import and_, not_

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.model_layout import ModelLayout, SlidingWindow

__all__ = [
    "Restorable",
    "lengths_unchecked",
    "pages_to_load",
    "reader_window_pages",
    "restorable_lengths",
    "snapshot_key_index",
    "swa_store_mask",
]


@dataclass(frozen=True)
class Restorable:
    """What :func:`restorable_lengths` found.

    Attributes:
        lengths: the restorable lengths in tokens, ascending (each a positive multiple of
            ``page_size``, at most ``num_tokens - 1``); sglang's ``restorable_prefix_pages``
            counts the same points in pages.
        page_size: tokens per page.
        pages_asked: whole pages considered, ``(num_tokens - 1) // page_size``.
    """

    lengths: tuple[int, ...]
    page_size: int
    pages_asked: int

    @property
    def max_length(self) -> int:
        """The restorable length: the largest of :attr:`lengths`, or 0 (nothing to load)."""
        return self.lengths[-1] if self.lengths else 0

    @property
    def num_pages(self) -> int:
        """Pages before :attr:`max_length`."""
        return self.max_length // self.page_size

    def at_most(self, length: int) -> int:
        """The largest restorable length ``<= length`` (e.g. the pages a prefetch could read),
        or 0."""
        best = 0
        for candidate in self.lengths:
            if candidate > length:
                break
            best = candidate
        return best


def _page_size(page_size: object) -> int:
    require(is_int(page_size) and page_size >= 1, "page_size", lambda: f"must be a positive int, got {page_size!r}")
    return page_size


def _layout(layout: object) -> ModelLayout:
    require(
        isinstance(layout, ModelLayout),
        "layout",
        lambda: f"must be a kvstage.model_layout.ModelLayout, got {type(layout).__name__}",
        ArgumentTypeError,
    )
    return layout


def restorable_lengths(
    layout: ModelLayout,
    page_size: int,
    num_tokens: int,
    present: Mapping[str, Sequence[bool]],
    window_pages: Mapping[str, int] | None = None,
) -> Restorable:
    """The lengths of a ``num_tokens`` sequence that the stored entries can restore (module doc).

    Args:
        layout: the model's layout.
        page_size: tokens per page.
        num_tokens: the sequence's tokens (>= 0), e.g. a prompt's.
        present: per component name, ``present[name][i]``: whether that component's key space
            holds key ``h_i`` (a page; for a state component, the snapshot after
            ``(i + 1) * page_size`` tokens). A sequence shorter than the pages asked counts as
            absent past its end. One entry per component of ``layout``.
        window_pages: per sliding-window component name, the window pages its reader needs
            before a length (:func:`reader_window_pages`); one not named: kvstage's rule.

    Returns:
        :class:`Restorable`.

    Raises:
        ArgumentTypeError: ``layout`` is not a ModelLayout, ``present`` not a mapping.
        InvalidArgumentError: ``page_size`` or ``num_tokens`` out of range; ``present`` misses a
            component of ``layout`` or names one it does not have.
    """
    layout = _layout(layout)
    page_size = _page_size(page_size)
    require(is_int(num_tokens) and num_tokens >= 0, "num_tokens", lambda: f"must be an int >= 0, got {num_tokens!r}")
    require(
        isinstance(present, Mapping),
        "present",
        lambda: f"must map component names to presence sequences, got {type(present).__name__}",
        ArgumentTypeError,
    )
    components = layout.components
    if len(present) != len(components) or any(component.name not in present for component in components):
        _check_present_names(layout, present)
    lengths = lengths_unchecked(layout, page_size, num_tokens, present, window_pages)
    return Restorable(lengths, page_size, max(num_tokens - 1, 0) // page_size)


def lengths_unchecked(
    layout: ModelLayout,
    page_size: int,
    num_tokens: int,
    present: Mapping[str, Sequence[bool]],
    window_pages: Mapping[str, int] | None = None,
) -> tuple[int, ...]:
    """:func:`restorable_lengths`'s ``lengths`` without its argument checks, for a caller whose
    arguments are known good (the hybrid lookup: its layout, page size and one presence answer
    per component). Presence marks are taken by truth value; no Python step per page but where
    a sliding window misses pages."""
    limit = max(num_tokens - 1, 0) // page_size  # then: pages every full and sidecar component holds
    components = layout.components
    for component in components:
        if limit and component.kind in ("full", "sidecar"):
            marks = present[component.name][:limit]
            limit = next(compress(count(), map(not_, marks)), len(marks))  # the first absent page
    if not limit:
        return ()
    restorable = [True] * limit  # restorable[k - 1]: whether k pages can be resumed from
    for component in components:
        kind = component.kind
        if kind == "state":
            restorable = list(map(and_, restorable, map(bool, present[component.name][:limit])))  # absent past the end
        elif kind == "swa":
            marks = list(map(bool, present[component.name][:limit]))
            if len(marks) == limit and all(marks):
                continue  # every window is held
            marks += [False] * (limit - len(marks))
            run = 0  # held pages ending at page k - 1
            needed = (window_pages or {}).get(component.name)
            needed = component.window_pages(page_size) if needed is None else needed
            for index, mark in enumerate(marks):
                run = run + 1 if mark else 0
                if run < needed and run <= index and index < len(restorable):  # fewer than min(w, k) held
                    restorable[index] = False
    return tuple(compress(range(page_size, (len(restorable) + 1) * page_size, page_size), restorable))


def _check_present_names(layout: ModelLayout, present: Mapping[str, Sequence[bool]]) -> None:
    """Raise for the first name ``present`` has that the layout lacks, or lacks that it has."""
    names = {component.name for component in layout.components}
    for name in present:
        require(
            name in names,
            "present",
            lambda name=name: f"names component {name!r}, which the layout does not have (it has {sorted(names)})",
        )
    for name in sorted(names):
        require(name in present, "present", lambda name=name: f"has no entry for the layout's component {name!r}")


def pages_to_load(layout: ModelLayout, page_size: int, length: int) -> dict[str, range]:
    """The page indices (keys ``h_i``) each component reads to restore ``length`` tokens: all
    pages before it (full, sidecar), the window's (sliding window), the snapshot's key
    (state). ``length`` 0: nothing.

    Raises:
        InvalidArgumentError: ``length`` is not a multiple of ``page_size`` >= 0.
    """
    layout = _layout(layout)
    page_size = _page_size(page_size)
    require(
        is_int(length) and length >= 0 and length % page_size == 0,
        "length",
        lambda: f"must be a multiple of page_size {page_size} >= 0, got {length!r}",
    )
    k = length // page_size
    plan = {}
    for component in layout.components:
        if k == 0:
            plan[component.name] = range(0)
        elif component.kind == "swa":
            plan[component.name] = range(max(0, k - component.window_pages(page_size)), k)
        elif component.kind == "state":
            plan[component.name] = range(k - 1, k)
        else:
            plan[component.name] = range(k)
    return plan


READERS = ("kvstage", "sglang")


def reader_window_pages(component: SlidingWindow, page_size: int, reader: str = "kvstage") -> int:
    """The pages before a page-aligned length that ``reader`` reads of ``component``'s window of
    ``W`` tokens, at ``P = page_size``; give it to :func:`swa_store_mask` and
    :func:`restorable_lengths` as ``window_pages``.

    - ``"kvstage"`` (kvstage's loads, transformers, vLLM): ``ceil((W - 1) / P)``
      (:meth:`SlidingWindow.window_pages`): position ``L`` attends to ``[L - W + 1, L]``;
      transformers' ``DynamicSlidingWindowLayer`` keeps ``W - 1`` tokens, vLLM's offload
      ``cdiv(W - 1 + extra_retained, block)`` chunks (as here with no extra retained);
    - ``"sglang"`` (0.5.23 HiCache): ``ceil(W / P)``, ``W`` its ``swa_retain_window``
      (``mem_cache/unified_cache/components/swa.py``, ``build_external_linker_transfer``:
      ``window_pages = (sliding_window_size + page - 1) // page``): one page more whenever
      ``P`` divides ``W - 1``.

    Raises:
        InvalidArgumentError: ``reader`` not one of :data:`READERS`; ``page_size`` not positive.
    """
    require(reader in READERS, "reader", lambda: f"must be one of {READERS}, got {reader!r}")
    if reader == "sglang":
        component.entry_bytes(page_size)  # validates page_size
        return -(-component.window // page_size)
    return component.window_pages(page_size)


def swa_store_mask(
    component: SlidingWindow,
    page_size: int,
    resume_lengths: Iterable[int],
    end_page: int,
    first_page: int = 0,
    window_pages: int | None = None,
) -> list[bool]:
    """Which sliding-window pages ``first_page .. end_page - 1`` can serve a hit: those within the
    window before a length the engine may resume at (vLLM's reachable-store mask). The others
    are never stored.

    Args:
        component: the sliding-window component.
        page_size: tokens per page.
        resume_lengths: lengths (tokens) a later request may resume at, each a positive multiple
            of ``page_size``: where the model's state snapshots are, or for a model without state
            the lengths kvstage stores to (a segment's end); any order, repeats allowed.
        end_page, first_page: the pages asked, ``0 <= first_page <= end_page``.
        window_pages: the window pages the reader needs before a length
            (:func:`reader_window_pages`); None: kvstage's rule.

    Returns:
        ``mask[i - first_page]``: whether page ``i`` is stored.

    Raises:
        ArgumentTypeError: ``component`` is not a :class:`SlidingWindow`.
        InvalidArgumentError: a length not a positive multiple of ``page_size`` (named by its
            index), pages out of range, or ``window_pages`` not an int >= 0.
    """
    require(
        isinstance(component, SlidingWindow),
        "component",
        lambda: f"must be a kvstage.model_layout.SlidingWindow, got {type(component).__name__}",
        ArgumentTypeError,
    )
    page_size = _page_size(page_size)
    require(
        is_int(first_page) and is_int(end_page) and 0 <= first_page <= end_page,
        "first_page",
        lambda: f"must be ints with 0 <= first_page <= end_page, got first_page={first_page!r}, end_page={end_page!r}",
    )
    if window_pages is None:
        window_pages = component.window_pages(page_size)
    require(
        is_int(window_pages) and window_pages >= 0,
        "window_pages",
        lambda: f"must be an int >= 0, got {window_pages!r}",
    )
    marks = [0] * (end_page - first_page + 1)  # +1 at a window's first page, -1 after its last
    for index, length in enumerate(resume_lengths):
        require(
            is_int(length) and length >= page_size and length % page_size == 0,
            f"resume_lengths[{index}]",
            lambda length=length: f"must be a positive multiple of page_size {page_size}, got {length!r}",
        )
        k = length // page_size
        begin, end = max(k - window_pages, first_page), min(k, end_page)
        if begin < end:
            marks[begin - first_page] += 1
            marks[end - first_page] -= 1
    mask, covering = [], 0
    for mark in marks[:-1]:
        covering += mark
        mask.append(covering > 0)
    return mask


def snapshot_key_index(length: int, page_size: int, num_tokens: int, argument: str = "length") -> int:
    """The page index ``k - 1`` whose key ``h_{k-1}`` keys a state snapshot taken after
    ``length = k * page_size`` tokens, checked before anything is copied.

    Args:
        length: tokens the state has consumed (``[0, length)``).
        page_size: tokens per page.
        num_tokens: tokens the request has with KV (``kv_length``): a snapshot cannot be of a
            state after more tokens than were computed.
        argument: the caller's name for ``length`` in the error.

    Raises:
        InvalidArgumentError: ``length`` is not a positive multiple of ``page_size``, or exceeds
            ``num_tokens`` (named ``argument``).
    """
    page_size = _page_size(page_size)
    require(is_int(num_tokens) and num_tokens >= 0, "num_tokens", lambda: f"must be an int >= 0, got {num_tokens!r}")
    require(
        is_int(length) and length >= page_size and length % page_size == 0,
        argument,
        lambda: (
            f"must be a positive multiple of page_size {page_size} (a snapshot is taken at a page boundary), "
            f"got {length!r}"
        ),
    )
    if length > num_tokens:
        raise InvalidArgumentError(
            f"{argument}: {length} is past the request's {num_tokens} tokens with KV; a snapshot holds the state "
            "after exactly that many tokens"
        )
    return length // page_size - 1
