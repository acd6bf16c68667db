"""A hybrid model's device pools and stores, one per component, checked before the manager uses them.

The manager's own :class:`~kvstage.kernels.KVPool`, host pool and store serve the model's one
:class:`~kvstage.model_layout.FullAttention` component, exactly as for a plain model. The other
components (:mod:`kvstage.model_layout`) bring their own pools, named by component in a
:class:`ComponentPools`, and their own stores (``storage={name: store}``, each opened on
``layout.fingerprints(...)[name]``; :func:`component_stores` builds them).

Pools, per kind:

- ``swa`` (:class:`~kvstage.model_layout.SlidingWindow`): a KVPool of the component's layout with
  its own slots; ``slots_of[name](req)`` gives the request's slots of that pool, position by
  position (as ``slot_indices_of`` does for the full pool). An engine that frees a running
  request's window slots behind it (sglang's ``free_swa_out_of_window_slots``) says how many
  positions it keeps in ``window_kept[name]``: a window page is gathered only while it is kept.
- ``sidecar`` (:class:`~kvstage.model_layout.PageSidecar`): a KVPool on the full pool's slots
  (e.g. :meth:`KVPool.from_rows <kvstage.kernels.KVPool.from_rows>`) whose page-first page is the
  entry's bytes (``entry_bytes(page_size)``).
- ``state`` (:class:`~kvstage.model_layout.RequestState`): a :class:`~kvstage.kernels.StatePool`
  whose tensors are the component's, layer by layer (``StatePool.from_layers`` /
  ``from_stacked``), dim 0 the state slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.kernels import KVPool
from kvstage.kernels.state_pool import StatePool
from kvstage.model_layout import ModelLayout
from kvstage.offload.request import as_int

__all__ = ["ComponentPools", "component_stores"]

_KV_FIELDS = ("num_layers", "kv_parts", "num_heads", "head_dim", "dtype")


@dataclass(frozen=True)
class ComponentPools:
    """The device pools of a hybrid model's components other than its full attention.

    Attributes:
        layout: the model's :class:`~kvstage.model_layout.ModelLayout` (exactly one
            ``FullAttention`` component: the manager's ``kv_pool``).
        pools: per component name (every component but the full one): a ``KVPool`` (sliding
            window, sidecar) or a ``StatePool`` (state), as the module doc says.
        slots_of: per sliding-window component name, ``slots_of(req)`` -> the request's 1-D
            int slots of that component's pool (position ``p`` at index ``p``).
        window_kept: per sliding-window component name whose slots the engine frees while the
            request runs: ``R`` tokens (an integer scalar), at least the component's
            ``window - 1``. The engine keeps, at each ``offload``/``finish``/``snapshot`` call
            with ``kv_length`` ``n`` and until the copies launched there have run, the window slots of every page that
            holds one of the positions ``n - R .. n - 1`` (it frees whole pages, older ones
            only). kvstage gathers no window page older than that, so a run launched late
            (host pool short) or a snapshot taken late stores no page whose slots may hold
            another request's KV: its length is not restorable. sglang keeps at least ``W``
            (``evict_threshold = pre_len - W`` or more). A component not named: the engine
            keeps its slots until the request's release.

    Raises (:meth:`check`, run by the manager before anything is copied):
        InvalidArgumentError / ArgumentTypeError: a missing or unknown pool, a pool of another
            layout, shape or dtype than its component, naming ``pools[name]``; a name in
            ``slots_of`` or ``window_kept`` that is no sliding-window component, or a kept
            count that is no int of at least ``window - 1``.
    """

    layout: ModelLayout
    pools: Mapping[str, Any]
    slots_of: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    window_kept: Mapping[str, int] = field(default_factory=dict)

    def first_kept_page(self, name: str, page_size: int, kv_length: int) -> int:
        """The oldest page of window ``name`` whose slots the engine keeps at a call with
        ``kv_length`` (``window_kept``; 0 when it keeps them all)."""
        kept = self.window_kept.get(name)
        return 0 if kept is None else max(0, (int(kv_length) - int(kept)) // page_size)

    @property
    def full(self):
        """The layout's one full-attention component."""
        (full,) = self.layout.of_kind("full")
        return full

    def check(self, kv_pool: Any, page_size: int) -> None:
        """Check every pool against its component (see the class doc); ``kv_pool`` is the full one."""
        layout = self.layout
        require(
            isinstance(layout, ModelLayout),
            "components.layout",
            lambda: f"must be a kvstage.model_layout.ModelLayout, got {type(layout).__name__}",
            ArgumentTypeError,
        )
        fulls = layout.of_kind("full")
        require(
            len(fulls) == 1,
            "components.layout",
            lambda: f"must have exactly one full-attention component (the manager's kv_pool), got {len(fulls)}",
        )
        for name in _KV_FIELDS:
            mine, theirs = getattr(fulls[0].layout, name), getattr(kv_pool.layout, name)
            require(mine == theirs, "kv_pool", lambda: f"layout's {name} {theirs} must be the full component's {mine}")
        require(isinstance(self.pools, Mapping), "components.pools", "must map component names to pools")
        others = [component for component in layout.components if component.kind != "full"]
        names = [component.name for component in others]
        for name in self.pools:
            require(name in names, "components.pools", lambda name=name: f"names {name!r}; the layout's are {names}")
        windows = {component.name: component for component in layout.of_kind("swa")}
        for argument in ("slots_of", "window_kept"):
            given = getattr(self, argument)
            require(isinstance(given, Mapping), f"components.{argument}", "must map sliding-window component names")
            for name in given:
                require(
                    name in windows,
                    f"components.{argument}",
                    lambda name=name: f"names {name!r}; the layout's sliding-window components are {sorted(windows)}",
                )
        for name, kept in self.window_kept.items():
            least, kept = windows[name].window - 1, as_int(kept)
            require(
                is_int(kept) and kept >= least,
                f"components.window_kept[{name!r}]",
                lambda kept=kept, least=least: (
                    f"must be an int of at least the window's {least} kept tokens (window - 1), got {kept!r}"
                ),
            )
        for component in others:
            where = f"components.pools[{component.name!r}]"
            require(component.name in self.pools, "components.pools", lambda c=component: f"has no pool for {c.name!r}")
            pool = self.pools[component.name]
            if component.kind == "state":
                _check_state_pool(component, pool, where, kv_pool.device)
                continue
            require(isinstance(pool, KVPool), where, "must be a kvstage.kernels.KVPool", ArgumentTypeError)
            require(pool.device == kv_pool.device, where, lambda: f"must be on {kv_pool.device}, got {pool.device}")
            if component.kind == "swa":
                for name in _KV_FIELDS:
                    mine, theirs = getattr(component.layout, name), getattr(pool.layout, name)
                    require(mine == theirs, where, lambda: f"layout's {name} {theirs} must be the component's {mine}")
                require(
                    callable(self.slots_of.get(component.name)),
                    "components.slots_of",
                    lambda c=component: f"needs a slots_of(req) for the sliding-window component {c.name!r}",
                )
            else:  # a sidecar: rows on the full pool's slots
                size, expected = pool.layout.page_bytes(page_size), component.entry_bytes(page_size)
                require(size == expected, where, lambda: f"a page of it is {size} bytes, the sidecar's is {expected}")
                require(
                    pool.num_slots == kv_pool.num_slots,
                    where,
                    lambda: (
                        f"must have the full pool's {kv_pool.num_slots} slots (rows on its slots), got {pool.num_slots}"
                    ),
                )


def _check_state_pool(component: Any, pool: Any, where: str, device: Any) -> None:
    require(isinstance(pool, StatePool), where, "must be a kvstage.kernels.StatePool", ArgumentTypeError)
    require(pool.device == device, where, lambda: f"must be on the KV pool's device {device}, got {pool.device}")
    specs = [spec for _ in component.layers for spec in component.tensors]
    require(
        pool.num_tensors == len(specs),
        where,
        lambda: f"holds {pool.num_tensors} tensors; {component.name} has {len(specs)} (layer by layer)",
    )
    for index, (tensor, spec) in enumerate(zip(pool.tensors, specs)):
        layer = component.layers[index // len(component.tensors)]
        if tuple(tensor.shape[1:]) != spec.shape or tensor.dtype != spec.dtype:
            raise InvalidArgumentError(
                f"{where}: {pool.names[index]} is {tuple(tensor.shape[1:])} {tensor.dtype} per slot; layer {layer}'s "
                f"{spec.name} is {spec.shape} {spec.dtype}"
            )


def component_stores(
    layout: ModelLayout, model_id: str, page_size: int, open_store: Callable[[Any], Any], **shard: int
) -> dict[str, Any]:
    """One store per component: ``{name: open_store(fingerprint)}`` over
    ``layout.fingerprints(model_id, page_size=page_size, **shard)`` (``shard``: ``tp_rank``,
    ``tp_size``, ``first_layer``), e.g. ``open_store=MemoryStore``.

    Raises:
        As :meth:`ModelLayout.fingerprints`, and whatever ``open_store`` raises.
    """
    return {name: open_store(fp) for name, fp in layout.fingerprints(model_id, page_size=page_size, **shard).items()}
