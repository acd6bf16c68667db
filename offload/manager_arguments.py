"""Argument checks of :class:`~kvstage.offload.OffloadManager`'s constructor and calls.

Each raises the typed error naming the argument and the rule before the manager changes
anything; the manager calls them in the order its docstrings promise.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require, require_seconds
from kvstage.offload.collaborators import PageHasherLike
from kvstage.offload.load_path import PREFETCH_POLICIES, PrefetchHandle
from kvstage.offload.request import int_scalar
from kvstage.offload.request import kv_length as kv_length_of

__all__ = [
    "check_after",
    "check_prefetch_handle",
    "check_callbacks",
    "check_prefetch_arguments",
    "check_prefetch_request",
    "checked_kv_length",
    "checked_load_pages",
    "checked_stride",
    "pending_prefetch_error",
]


def checked_stride(hasher: Any, host_pool: Any, offload_stride: Any, prior_wait_s: Any) -> int:
    """The offload stride in tokens (default: one page), with the hasher and ``prior_wait_s``.

    Raises:
        ArgumentTypeError: ``hasher`` is not a page hasher instance.
        InvalidArgumentError: the hasher's page size is not the host pool's; the stride is not
            a positive multiple of it or needs more pages than the host pool holds;
            ``prior_wait_s`` is not a number >= 0.
    """
    page_size = host_pool.page_size
    require(
        isinstance(hasher, PageHasherLike) and not isinstance(hasher, type),
        "hasher",
        lambda: (
            f"must be a kvstage.hashing.PageHasher (page_size, seed, prefill_keys, continue_keys), got {type(hasher).__name__}"
        ),
        ArgumentTypeError,
    )
    require(
        hasher.page_size == page_size,
        "hasher",
        lambda: f"page_size {hasher.page_size} must equal the host pool's page_size {page_size}",
    )
    stride = page_size if offload_stride is None else offload_stride
    require(
        is_int(stride) and stride > 0 and stride % page_size == 0,
        "offload_stride",
        lambda: f"must be a positive multiple of page_size {page_size}, got {offload_stride!r}",
    )
    require(
        stride // page_size <= host_pool.capacity,
        "offload_stride",
        lambda: (
            f"{stride} tokens ({stride // page_size} pages of {page_size}) exceeds the host pool's capacity of {host_pool.capacity} pages: no stride could ever be launched"
        ),
    )
    require_seconds(prior_wait_s, "prior_wait_s")
    return stride


def check_callbacks(
    storage: Any,
    host_pool: Any,
    slot_indices_of: Any,
    release: Any,
    on_storage_failure: Any,
    on_stored: Any,
    producer: Any,
    finish_backlog_pages: Any,
) -> Any:
    """The store's layout fingerprint, checked against the host pool; the callbacks, the
    producer and ``finish_backlog_pages`` checked.

    Raises:
        ArgumentTypeError: ``storage`` has no fingerprint; ``producer`` is no event or stream.
        InvalidArgumentError: the fingerprint does not match the host pool's layout or page
            size; a callback is not callable; ``finish_backlog_pages`` is neither None nor an
            int >= 0.
    """
    fingerprint = getattr(storage, "fingerprint", None)
    require(
        fingerprint is not None,
        "storage",
        lambda: f"must be a kvstage.storage.StorageBackend, got {type(storage).__name__}",
        ArgumentTypeError,
    )
    if not getattr(fingerprint, "component", None):  # a hybrid component's: ModelLayout.require_matches checked it
        fingerprint.require_matches(host_pool.layout, host_pool.page_size, "storage")
    require(callable(slot_indices_of), "slot_indices_of", "must be callable")
    require(release is None or callable(release), "release", "must be callable or None")
    require(
        on_storage_failure is None or callable(on_storage_failure), "on_storage_failure", "must be callable or None"
    )
    require(on_stored is None or callable(on_stored), "on_stored", "must be callable or None")
    check_after(producer, "producer")
    require(
        finish_backlog_pages is None or (is_int(finish_backlog_pages) and finish_backlog_pages >= 0),
        "finish_backlog_pages",
        lambda: f"must be None (no limit) or an int >= 0, got {finish_backlog_pages!r}",
    )
    return fingerprint


def check_prefetch_arguments(policy: Any, timeout_s: Any, min_pages: Any, max_pages: Any = None) -> None:
    """``prefetch``'s policy, ``timeout_s`` (for ``policy="timeout"``), ``min_pages`` and ``max_pages``.

    Raises:
        InvalidArgumentError: an unknown policy, a missing or non-positive timeout (or one
            given with another policy), a
            ``min_pages`` that is neither None nor an int >= 1, a ``max_pages`` that is
            neither None nor an int >= 0.
    """
    require(policy in PREFETCH_POLICIES, "policy", lambda: f"must be one of {PREFETCH_POLICIES}, got {policy!r}")
    if policy == "timeout":
        require(
            isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0,
            "timeout_s",
            lambda: f"must be a positive number of seconds for policy 'timeout', got {timeout_s!r}",
        )
    else:  # a timeout no policy reads would be silently ignored
        require(
            timeout_s is None,
            "timeout_s",
            lambda: f"is read by policy 'timeout' only: must be None with policy {policy!r}, got {timeout_s!r}",
        )
    require(
        min_pages is None or (is_int(min_pages) and min_pages >= 1),
        "min_pages",
        lambda: f"must be None or an int >= 1, got {min_pages!r}",
    )
    require(
        max_pages is None or (is_int(max_pages) and max_pages >= 0),
        "max_pages",
        lambda: f"must be None or an int >= 0 (pages to look up at most), got {max_pages!r}",
    )


def checked_kv_length(req: Any, kv_length: Any, launched_length: int) -> int:
    """The positions with KV: ``kv_length`` checked, or the request's default.

    Raises:
        InvalidArgumentError: not an integer scalar >= 0, past the request's tokens, or
            below ``launched_length`` (what this lifecycle launched).
    """
    if kv_length is None:
        return kv_length_of(req)
    given, kv_length = kv_length, int_scalar(kv_length)
    if kv_length is None or kv_length < 0:
        raise InvalidArgumentError(
            f"kv_length: must be an int >= 0 (token positions with KV; a numpy integer or 0-d integer tensor too), got {given!r}"
        )
    total = len(req.origin_input_ids) + len(req.output_ids)
    if kv_length > total:
        raise InvalidArgumentError(
            f"kv_length: {kv_length} exceeds the {total} tokens of rid={req.rid!r} (prompt and output)"
        )
    if kv_length < launched_length:
        raise InvalidArgumentError(
            f"kv_length: {kv_length} is below the {launched_length} tokens of rid={req.rid!r} launched already; positions with KV never shrink"
        )
    return kv_length


def check_after(after: Any, argument: str) -> None:
    """``after``/``producer`` must be None, a CUDA event or stream, or (CPU copy streams)
    anything with ``synchronize()``.

    Raises:
        ArgumentTypeError: naming ``argument``.
    """
    if after is None or callable(getattr(after, "synchronize", None)):
        return
    raise ArgumentTypeError(
        f"{argument}: must be None, a torch.cuda.Event or torch.cuda.Stream (CPU: anything with synchronize()), got {type(after).__name__}"
    )


def check_prefetch_request(req: Any, state: Any, ended: bool, num_keys: int, min_pages: Any, capacity: int) -> None:
    """A request may prefetch: ``min_pages`` fits the host pool; it has not ended, has no
    prefetch and offloaded nothing (``state``: its tracked state or None; ``ended``: it was
    released after a finish or abort).

    Raises:
        InvalidArgumentError: naming ``min_pages`` or ``req`` and the rule broken.
    """
    require(
        min_pages is None or min(min_pages, num_keys) <= capacity,
        "min_pages",
        lambda: (
            f"{min_pages} of the {num_keys} pages looked up can never be free: the host pool holds {capacity} pages"
        ),
    )
    require(not ended, "req", lambda: f"rid={req.rid!r} has ended (finish, abort or release); it cannot prefetch")
    if state is None:
        return
    require(
        not state.ending, "req", lambda: f"rid={req.rid!r} has ended (finish, abort or release); it cannot prefetch"
    )
    require(state.prefetch is None, "req", lambda: f"rid={req.rid!r} has a prefetch already")
    require(
        state.chain is None and state.copies_in_flight == 0,
        "req",
        lambda: f"rid={req.rid!r} has offloaded pages already; prefetch before it runs",
    )


def checked_load_pages(handle: Any, state: Any, slot_indices: Any, page_size: int) -> int:
    """The pages a load scatters: ``len(slot_indices) // page_size``, checked against the
    handle (``state``: its request's tracked state or None).

    Raises:
        InvalidArgumentError: the handle was loaded or cancelled, its request has ended or it
            is another manager's; ``slot_indices`` is not a 1-D tensor of whole pages, at most
            the handle's ready pages.
    """
    require(not handle.loaded, "handle", "was loaded already (a prefetch is loaded once)")
    require(not handle.cancelled, "handle", "was cancelled (or its request aborted)")
    require(
        state is not None and not state.ending and state.prefetch is handle,
        "handle",
        lambda: f"rid={handle.req.rid!r} has ended, or the handle is not this manager's",
    )
    ready = handle.pages_ready  # read once: a read in flight grows it
    count = slot_indices.shape[0] if isinstance(slot_indices, torch.Tensor) and slot_indices.dim() == 1 else None
    require(
        count is not None and count % page_size == 0 and count // page_size <= ready,
        "slot_indices",
        lambda: (
            f"must be a 1-D tensor of at most {ready} ready pages x {page_size} slots, got {tuple(slot_indices.shape) if isinstance(slot_indices, torch.Tensor) else type(slot_indices).__name__}"
        ),
    )
    return count // page_size


def check_prefetch_handle(handle: Any, whence: str = "") -> None:
    """``handle`` is a :class:`~kvstage.offload.load_path.PrefetchHandle` (``whence``: where
    one comes from, for the message).

    Raises:
        ArgumentTypeError: it is not.
    """
    require(
        isinstance(handle, PrefetchHandle),
        "handle",
        lambda: f"must be a PrefetchHandle{whence}, got {type(handle).__name__}",
        ArgumentTypeError,
    )


def pending_prefetch_error(req: Any, kv_length: int, error: InvalidArgumentError) -> InvalidArgumentError:
    """The error for a request with a prefetch pending whose KV up to ``kv_length`` cannot be
    offloaded (``error``: why): most likely it never ran, so the message says so and how to
    end it, not only what was wrong with its slots."""
    return InvalidArgumentError(
        f"req: rid={req.rid!r} has a prefetch pending (never loaded), and its KV up to kv_length={kv_length} "
        f"cannot be offloaded ({error}); a request that ends before it runs: abort(req) or "
        "finish(req, kv_length=0), which cancel the prefetch"
    )


def check_events_of_model(kv_events: Any, components: Any, argument: str = "kv_events") -> None:
    """KV events only for a model whose every stored full page a router may claim: a plain
    model, or full pages with page sidecars. A sliding window or a request state restores only
    some lengths (a router would send requests for prefixes no engine can resume).

    Args:
        kv_events: the events setting (None: off).
        components: the model's checked :class:`~kvstage.offload.ComponentPools` (None: plain).
        argument: the caller's name for ``kv_events`` in the error.

    Raises:
        InvalidArgumentError: ``kv_events`` with such ``components``, naming the kinds.
    """
    if kv_events is None or components is None:
        return
    kinds = sorted({c.kind for c in components.layout.components} & {"swa", "state"})
    require(
        not kinds,
        argument,
        lambda: (
            f"KV events of a model with {' and '.join(kinds)} components are not supported yet: they would claim "
            "every stored full page, and only some lengths can be restored"
        ),
    )
