"""The load handle of a hybrid model: its layers are the model's, each waiting for the copies
of every component with that layer (:mod:`kvstage.offload.hybrid`)."""

from __future__ import annotations

from typing import Any

from kvstage.errors import InvalidArgumentError, is_int
from kvstage.kernels.streams import CopyHandle
from kvstage.offload.load_path import LoadHandle

__all__ = ["HybridLoadHandle"]


class HybridLoadHandle(LoadHandle):
    """A :class:`LoadHandle` whose layers are the model's (``0 .. layout.num_layers - 1``): a
    layer's wait covers its full-attention copy and the copy of every other component with that
    layer (its layer's own copy when loaded layer by layer, else the component's one copy)."""

    def __init__(self, base: LoadHandle, layout: Any, launched: dict[str, list[CopyHandle]]) -> None:
        super().__init__(base.req, base.num_pages, 1, base._handles, base._num_layers, base.layer_by_layer)
        self.num_tokens = base.num_tokens
        self._layout, self._launched = layout, launched
        self._all = [*base._handles, *(copy for copies in launched.values() for copy in copies)]

    def layer_handles(self, layer: int) -> list[CopyHandle]:
        """Every copy ``layer`` waits for.

        Raises:
            InvalidArgumentError: ``layer`` is not in ``[0, num_layers)`` of the model.
        """
        if not is_int(layer) or not 0 <= layer < self._layout.num_layers:
            raise InvalidArgumentError(f"layer: must be an int in [0, {self._layout.num_layers}), got {layer!r}")
        handles = []
        for component in self._layout.components:
            if layer not in component.layers:
                continue
            copies = self._handles if component.kind == "full" else self._launched.get(component.name, [])
            if copies:  # one per component layer (layer by layer) or one for them all
                handles.append(copies[component.layers.index(layer)] if len(copies) > 1 else copies[0])
        return handles

    def layer_handle(self, layer: int) -> CopyHandle:
        """The one copy ``layer`` waits for; a layer of several components has several
        (:meth:`layer_handles`, :meth:`wait_layer`).

        Raises:
            InvalidArgumentError: ``layer`` is out of range, or waits for more than one copy.
        """
        handles = self.layer_handles(layer)
        if len(handles) > 1:
            raise InvalidArgumentError(
                f"layer: {layer} waits for {len(handles)} copies (one per component); use layer_handles() or wait_layer()"
            )
        return handles[0] if handles else super().layer_handle(0)

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        for handle in self.layer_handles(layer):
            handle.wait(stream)

    def wait(self, stream: Any = None) -> None:
        for handle in self._all:
            handle.wait(stream)

    def done(self) -> bool:
        return all(handle.query() for handle in self._all)

    @property
    def error(self) -> BaseException | None:
        return next((h.error for h in self._all if h.query() and h.error is not None), None)
