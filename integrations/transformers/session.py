"""``KVStageSession``: a transformers model's prompt KV stored after one ``generate()`` and loaded in the next.

The session is the engine kvstage's :class:`~kvstage.offload.OffloadManager` expects, for one
sequence at a time (batch size 1): a KV pool of ``max_tokens`` slots on the model's device
staging one sequence's KV, a host pool of as many pages, a store opened from a URL under the
model's layout fingerprint, and a page hasher. ``load`` prefetches and loads a stored prefix
into the pool and hands it to transformers as a ``DynamicCache``; ``store`` copies a
``DynamicCache``'s KV into the pool and lets the manager store its whole pages. Offload,
storage and key logic are the manager's, the stores' and the hasher's; this module only moves
tensors between transformers' cache layers and the pool.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import weakref
from typing import Any

import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError, is_int, require
from kvstage.hashing import PageHasher
from kvstage.integrations.transformers.generation import check_generate_options
from kvstage.integrations.transformers.layout import CacheLayout, cache_layout
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager, OffloadMetrics
from kvstage.storage import LayoutFingerprint, open_storage

__all__ = ["KVStageSession"]

logger = logging.getLogger(__name__)


class _Request:
    """One sequence as the manager sees it (:class:`~kvstage.offload.OffloadRequest`)."""

    def __init__(self, rid: int, prompt: list[int], extra_key: str | None, cache_salt: str | None) -> None:
        self.rid = rid
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.done = False

    def finished(self) -> bool:
        return self.done


class _Loaded:
    """The request of the last :meth:`KVStageSession.load`, until its cache is stored (or another load)."""

    def __init__(self, req: _Request, cache: Any, num_tokens: int) -> None:
        self.req = req
        self.cache = weakref.ref(cache)
        self.num_tokens = num_tokens


def _token_list(value: Any, argument: str) -> list[int]:
    """Token ids of one sequence: a 1-D or ``[1, n]`` integer tensor, a list of ints, or a list of one list of ints."""
    if isinstance(value, torch.Tensor):
        require(
            not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool,
            argument,
            lambda: f"must hold integer token ids, got dtype {value.dtype}",
            ArgumentTypeError,
        )
        if value.dim() == 2:
            require(
                value.shape[0] == 1,
                argument,
                lambda: (
                    f"must be one sequence (batch size 1), got a batch of {value.shape[0]}: "
                    "KVStageSession runs one sequence at a time; call it once per sequence"
                ),
            )
            value = value[0]
        require(value.dim() == 1, argument, lambda: f"must be [n] or [1, n] token ids, got shape {tuple(value.shape)}")
        tokens = value.tolist()
    else:
        if isinstance(value, (list, tuple)) and value and all(isinstance(row, (list, tuple)) for row in value):
            # [[ids]]: what tokenizer(text)["input_ids"] gives without return_tensors
            require(
                len(value) == 1,
                argument,
                lambda: (
                    f"must be one sequence (batch size 1), got a batch of {len(value)}: "
                    "KVStageSession runs one sequence at a time; call it once per sequence"
                ),
            )
            value = value[0]
        require(
            isinstance(value, (list, tuple)) and all(is_int(t) for t in value),
            argument,
            lambda: f"must be a tensor, a list of int token ids or a list of one such list, got {type(value).__name__}",
            ArgumentTypeError,
        )
        tokens = [int(t) for t in value]
    require(len(tokens) >= 1, argument, "must hold at least one token id")
    require(min(tokens) >= 0, argument, lambda: f"token ids must be >= 0, got {min(tokens)}")
    return tokens


def _namespace_part(value: Any, argument: str) -> str | None:
    require(
        value is None or isinstance(value, str),
        argument,
        lambda: f"must be a str or None, got {type(value).__name__}",
        ArgumentTypeError,
    )
    return value


class KVStageSession:
    """Stores the KV of a transformers model's sequences in a kvstage store and loads stored prefixes back.

    One sequence at a time (batch size 1), from one thread (the thread of the first call owns
    the session, as :class:`~kvstage.offload.OffloadManager`). Another process opening the same
    ``file:`` store with the same model, ``model_id``, dtype and ``page_size`` finds the pages.

    Args:
        model: a transformers decoder-only model whose ``DynamicCache`` layers are full attention
            (MHA/GQA: Llama, Qwen, ...; MLA: DeepseekV3, whose cache holds the latent); see
            :func:`~kvstage.integrations.transformers.layout.cache_layout` for what is refused.
            Its KV pool lives on ``model.device``.
        storage: a store URL (:func:`kvstage.storage.open_storage`): ``"file:DIR"`` (shared
            between processes), ``"memory"`` (this session's own: another session, even in
            this process, loads nothing from it), ``"mooncake://..."``.
        model_id: the name of the model's weights, e.g. ``"meta-llama/Llama-3.1-8B"``: part of
            the key space, so pages of other weights never match (required).
        page_size: tokens per stored page (a prefix loads in whole pages).
        max_tokens: the longest sequence stored or loaded: the session's KV pool (on the
            model's device) and host pool each hold this many tokens, rounded up to whole pages
            (``max_tokens * layout.token_bytes`` bytes each). Pages past it are not stored (a
            WARNING) and loads stop there.
        extra_key, cache_salt: the namespace (a LoRA adapter's name, a tenant's secret); pages
            are shared only with the same namespace. ``""`` is a namespace of its own, not None
            (as everywhere in kvstage).
        backend: the copy kernels' backend (``"auto"``, ``"triton"``, ``"torch"``).

    Raises:
        ArgumentTypeError: ``model`` is no transformers model, ``storage`` no str,
            ``extra_key`` / ``cache_salt`` neither str nor None.
        InvalidArgumentError: a model kind kvstage cannot store (the message names the config
            field: ``sliding_window``, ``layer_types``, ...), ``model_id`` missing or empty,
            ``page_size`` or ``max_tokens`` not a positive int (``max_tokens >= page_size``),
            a bad store URL.
        StorageError: the store cannot be opened.
        All before anything is allocated or written.

    Example::

        session = KVStageSession(model, "file:/tmp/kv", model_id="my-model")
        out = session.generate(input_ids, max_new_tokens=32)   # loads a stored prefix, stores the KV
        session.close()
    """

    def __init__(
        self,
        model: Any,
        storage: str,
        *,
        model_id: str | None = None,
        page_size: int = 16,
        max_tokens: int = 4096,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        backend: str = "auto",
    ) -> None:
        self._cache_layout: CacheLayout = cache_layout(model)
        require(
            isinstance(storage, str),
            "storage",
            lambda: f"must be a store URL string (e.g. 'file:/tmp/kv'), got {type(storage).__name__}",
            ArgumentTypeError,
        )
        require(
            isinstance(model_id, str) and model_id != "",
            "model_id",
            lambda: (
                f"must name the model's weights, e.g. model.name_or_path (pages of other weights never match), got {model_id!r}"
            ),
        )
        require(is_int(page_size) and page_size >= 1, "page_size", lambda: f"must be a positive int, got {page_size!r}")
        require(
            is_int(max_tokens) and max_tokens >= page_size,
            "max_tokens",
            lambda: f"must be an int >= page_size ({page_size}), got {max_tokens!r}",
        )
        self.extra_key = _namespace_part(extra_key, "extra_key")
        self.cache_salt = _namespace_part(cache_salt, "cache_salt")
        self.model = model
        self.page_size = page_size
        num_pages = -(-max_tokens // page_size)
        layout = self._cache_layout.layout
        fingerprint = LayoutFingerprint.of(layout, page_size=page_size, model_id=model_id)
        self.storage = open_storage(storage, fingerprint)
        try:
            self.kv_pool = KVPool.allocate(layout, num_pages * page_size, device=model.device)
            host_pool = HostPool.like(self.kv_pool, num_pages=num_pages, page_size=page_size)
            self._slots = torch.arange(self.kv_pool.num_slots, device=self.kv_pool.device)
            self._held: dict[int, int] = {}  # id(req) -> slots [0, n) it holds; one request at a time
            self._storing: _Request | None = None  # the request store() waits for
            self._pages_stored = 0  # its on_stored's pages_stored
            self.manager = OffloadManager(
                self.kv_pool,
                host_pool,
                self.storage,
                PageHasher(page_size=page_size),
                self._slot_indices_of,
                release=self._release,
                on_stored=self._on_stored,
                backend=backend,
            )
        except BaseException:
            self.storage.close()
            raise
        self._rids = itertools.count()
        self._loaded: _Loaded | None = None
        # transformers 5 names the cache argument `cache` (`past_key_values` deprecated); 5.x before, the old name
        self._cache_argument = (
            "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        )
        self._closed = False

    # -- the manager's callbacks ---------------------------------------------------------------

    def _slot_indices_of(self, req: _Request) -> torch.Tensor:
        return self._slots[: self._held[id(req)]]

    def _release(self, req: _Request) -> None:
        self._held.pop(id(req), None)

    def _on_stored(self, req: _Request, pages_stored: int, pages_failed: int) -> None:
        if req is self._storing:
            self._pages_stored = pages_stored

    # -- public API -------------------------------------------------------------------------------

    @property
    def layout(self) -> CacheLayout:
        """The model's cache layout (:class:`~kvstage.integrations.transformers.layout.CacheLayout`)."""
        return self._cache_layout

    @property
    def metrics(self) -> OffloadMetrics:
        """The manager's counters (pages stored, loaded, failed, ...)."""
        return self.manager.metrics

    @property
    def max_tokens(self) -> int:
        """Tokens the session's pools hold (``max_tokens`` rounded up to whole pages)."""
        return self.kv_pool.num_slots

    def load(self, input_ids: Any) -> Any:
        """A ``DynamicCache`` holding the stored KV of ``input_ids``' longest stored prefix.

        The prefix is whole pages and at most ``len(input_ids) - 1`` tokens (the last token is
        always computed: its logits pick the next token); 0 tokens when nothing is stored.
        Pass the cache to ``model.generate(input_ids, cache=cache, ...)`` (transformers 5;
        ``past_key_values=`` before), which computes only the tokens after it, then give it to
        :meth:`store`. The request stays open until that ``store`` (or the next ``load``).

        Args:
            input_ids: the sequence's token ids, ``[n]`` or ``[1, n]`` int tensor, list of ints or list of one list.

        Returns:
            ``transformers.DynamicCache(config=model.config)``; ``get_seq_length()`` is the
            number of tokens loaded. Layers' ``keys`` / ``values`` are ``[1, heads, n, dim]``
            on the model's device, in its dtype. A page the store cannot read (missing,
            corrupt) ends the prefix before it; a copy into the pool that fails is logged at
            WARNING and returns an empty cache: the model computes every token.

        Raises:
            ArgumentTypeError / InvalidArgumentError: ``input_ids`` is not one sequence of
                token ids (a batch larger than 1 is refused).
        """
        from transformers import DynamicCache

        tokens = _token_list(input_ids, "input_ids")
        self._require_open()
        self._end_loaded()
        req = _Request(next(self._rids), tokens, self.extra_key, self.cache_salt)
        try:
            manager = self.manager
            handle = manager.prefetch(req, policy="wait_complete")
            while not handle.ready_to_load():
                handle.wait()
                manager.poll()
            num_tokens = handle.tokens_ready
            self._held[id(req)] = num_tokens
            load = manager.load(handle, self._slots[:num_tokens])
            load.wait()
            while not load.done():  # CUDA: the copy's event (wait() only ordered the current stream)
                manager.poll()
            manager.poll()  # frees the host pages
            cache = DynamicCache(config=self.model.config)
            if load.error is not None:
                logger.warning(
                    "kvstage: loading %d stored tokens failed (%r); the model computes them", num_tokens, load.error
                )
                self._end(req)
                return cache
            if num_tokens:
                self._fill(cache, num_tokens)
        except BaseException:
            self._end(req)  # a failed prefetch, load or fill leaves no request open
            raise
        self._loaded = _Loaded(req, cache, num_tokens)
        return cache

    def store(self, token_ids: Any, cache: Any) -> int:
        """Store the whole pages of ``cache``'s KV, the KV of ``token_ids[:cache.get_seq_length()]``; waits until written.

        After ``generate``, ``token_ids`` is its output sequence (prompt and new tokens) and the
        cache holds the KV of all but its last token. A cache from :meth:`load` continues that
        request: only the pages after the loaded prefix are copied (they continue its page
        chain). Pages past :attr:`max_tokens` are not stored (a WARNING).

        Args:
            token_ids: the sequence, ``[n]`` or ``[1, n]`` int tensor, list of ints or list of one list.
            cache: a ``DynamicCache`` of this model holding the KV of the sequence's first
                ``cache.get_seq_length() <= n`` tokens, batch size 1.

        Returns:
            Pages written or found in the store already (``on_stored``'s ``pages_stored``),
            not counting a loaded prefix's pages. A page that failed to write is logged at
            WARNING (see :attr:`metrics`).

        Raises:
            ArgumentTypeError: ``cache`` is no ``DynamicCache`` of plain layers, or its dtype differs.
            InvalidArgumentError: ``token_ids`` is not one sequence; ``cache`` holds another
                layer count, batch size, head count or head size, more tokens than
                ``token_ids``, or (a cache from :meth:`load`) ``token_ids`` do not start with
                the loaded tokens. Nothing is written then.
        """
        tokens = _token_list(token_ids, "token_ids")
        self._require_open()
        num_tokens = self._check_cache(cache)
        require(
            num_tokens <= len(tokens),
            "cache",
            lambda: f"holds the KV of {num_tokens} tokens, more than the {len(tokens)} token_ids",
        )
        loaded = self._loaded if self._loaded is not None and self._loaded.cache() is cache else None
        if loaded is not None:
            prompt = loaded.req.origin_input_ids
            require(
                tokens[: len(prompt)] == prompt,
                "token_ids",
                "must start with the token ids the cache was loaded for (its first positions hold their KV)",
            )
        kv_length = min(num_tokens, self.kv_pool.num_slots)
        if kv_length < num_tokens:
            logger.warning(
                "kvstage: %d of %d tokens' KV stored: max_tokens=%d", kv_length, num_tokens, self.kv_pool.num_slots
            )
        if loaded is not None:
            self._loaded = None
            req, start = loaded.req, loaded.num_tokens
            req.output_ids = tokens[len(req.origin_input_ids) :]
        else:
            self._end_loaded()
            req, start = _Request(next(self._rids), tokens, self.extra_key, self.cache_salt), 0
        self._held[id(req)] = max(kv_length, self._held.get(id(req), 0))
        end = kv_length // self.page_size * self.page_size  # whole pages only are stored
        self._storing, self._pages_stored = req, 0
        try:
            try:
                if end > start:
                    self._copy_in(cache, start, end)
                req.done = True
                self.manager.finish(req, kv_length=kv_length)
            except BaseException:
                self._end(req)  # nothing of it launched: abort it and free its slots
                raise
            self.manager.drain()  # on_stored(req, ...) comes from its polls
        finally:
            self._storing = None
        return self._pages_stored

    def generate(self, input_ids: Any, **generate_kwargs: Any) -> Any:
        """``model.generate`` on a stored prefix of ``input_ids``, then :meth:`store` of its KV.

        :meth:`load`, ``model.generate(input_ids, cache=<the loaded cache>, **generate_kwargs)``,
        :meth:`store` of the output sequence; greedy or sampled decoding, one sequence.

        Args:
            input_ids: ``[1, n]`` (or ``[n]``) token ids.
            generate_kwargs: passed to ``model.generate`` (``max_new_tokens``, ``do_sample``,
                ``output_logits``, ``return_dict_in_generate``, ...).

        Returns:
            What ``model.generate`` returns (a tensor of sequences, or its output object).

        Raises:
            InvalidArgumentError: ``generate_kwargs`` holds a cache (``cache``,
                ``past_key_values``: the session passes its own) or an ``attention_mask``
                with padding; the call's kwargs, its ``generation_config=`` or
                ``model.generation_config`` (in that priority, as transformers reads them)
                set ``num_beams`` or ``num_return_sequences`` above 1, ``use_cache=False``,
                or assisted decoding (``assistant_model``, ``prompt_lookup_num_tokens``, ...;
                see :func:`~kvstage.integrations.transformers.generation.check_generate_options`);
                ``input_ids`` as for :meth:`load`. Raised before anything is computed.
        """
        for name in ("cache", "past_key_values"):
            require(
                name not in generate_kwargs,
                name,
                "is the session's: it passes the loaded cache itself (use load() and store() to pass your own)",
            )
        check_generate_options(self.model, generate_kwargs)
        mask = generate_kwargs.get("attention_mask")
        if mask is not None:
            require(
                isinstance(mask, torch.Tensor) and bool(mask.all()),
                "attention_mask",
                "must be all ones (one sequence, no padding)",
            )
        tokens = _token_list(input_ids, "input_ids")
        ids = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else torch.tensor([tokens])
        cache = self.load(tokens)
        try:
            output = self.model.generate(ids.to(self.model.device), **{self._cache_argument: cache}, **generate_kwargs)
        except BaseException:
            self._end_loaded()
            raise
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        self.store(sequences, cache)
        return output

    def close(self) -> None:
        """End an open request, wait for writes in flight, stop the manager's threads and close
        the store. Idempotent."""
        if self._closed:
            return
        self._end_loaded()
        self.manager.close()
        self.storage.close()
        self._closed = True

    def __enter__(self) -> "KVStageSession":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- copies between transformers' cache layers and the pool ----------------------------------

    def _fill(self, cache: Any, num_tokens: int) -> None:
        """Put the pool's slots ``[0, num_tokens)`` into ``cache``'s layers as ``[1, heads, n, dim]``."""
        split = self._cache_layout.key_dim
        for layer in range(self.kv_pool.num_layers):
            if self._cache_layout.is_mla:
                rows = self.kv_pool.layer(0, layer)[:num_tokens].transpose(0, 1)[None]  # [1, 1, n, kv_dim]
                keys, values = rows[..., :split], rows[..., split:]
            else:
                keys = self.kv_pool.layer(0, layer)[:num_tokens].transpose(0, 1)[None]
                values = self.kv_pool.layer(1, layer)[:num_tokens].transpose(0, 1)[None]
            cache.layers[layer].update(keys.contiguous(), values.contiguous())

    @torch.no_grad()  # a cache filled with autograd on holds tensors that require grad: copy their values only
    def _copy_in(self, cache: Any, start: int, end: int) -> None:
        """Write ``cache``'s KV of positions ``[start, end)`` into the pool's slots of the same positions."""
        for layer, cache_layer in enumerate(cache.layers):
            keys, values = cache_layer.keys[0, :, start:end], cache_layer.values[0, :, start:end]  # [heads, n, dim]
            if self._cache_layout.is_mla:
                self.kv_pool.layer(0, layer)[start:end] = torch.cat([keys, values], dim=-1).transpose(0, 1)
            else:
                self.kv_pool.layer(0, layer)[start:end] = keys.transpose(0, 1)
                self.kv_pool.layer(1, layer)[start:end] = values.transpose(0, 1)

    def _check_cache(self, cache: Any) -> int:
        """``cache``'s token count, after checking it holds this model's layout (batch size 1)."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        require(
            isinstance(layers, list) and hasattr(cache, "get_seq_length"),
            "cache",
            lambda: f"must be a transformers DynamicCache, got {type(cache).__name__}",
            ArgumentTypeError,
        )
        layout = self._cache_layout
        require(
            len(layers) == layout.layout.num_layers,
            "cache",
            lambda: f"must hold {layout.layout.num_layers} layers (the model's), got {len(layers)}",
        )
        num_tokens = None
        for index, layer in enumerate(layers):
            require(
                type(layer) is DynamicLayer,
                f"cache.layers[{index}]",
                lambda: f"must be a plain DynamicLayer (every token's KV), got {type(layer).__name__}",
                ArgumentTypeError,
            )
            if not layer.is_initialized or layer.keys.numel() == 0:
                length = 0
            else:
                expected = [
                    (1, layout.cache_heads, layer.keys.shape[2], layout.key_dim),
                    (1, layout.cache_heads, layer.keys.shape[2], layout.value_dim),
                ]
                for name, tensor, shape in zip(("keys", "values"), (layer.keys, layer.values), expected):
                    require(
                        tensor.dtype == layout.layout.dtype,
                        f"cache.layers[{index}].{name}",
                        lambda: f"dtype must be the model's {layout.layout.dtype}, got {tensor.dtype}",
                        ArgumentTypeError,
                    )
                    require(
                        tuple(tensor.shape) == shape,
                        f"cache.layers[{index}].{name}",
                        lambda: f"must be [batch 1, heads, tokens, dim] = {shape}, got {tuple(tensor.shape)}",
                    )
                length = int(layer.keys.shape[2])
            require(
                num_tokens is None or length == num_tokens,
                f"cache.layers[{index}]",
                lambda: f"holds {length} tokens, layer 0 {num_tokens}",
            )
            num_tokens = length
        return num_tokens

    def _end_loaded(self) -> None:
        """Abort the request of a load whose cache was not stored (its slots are released)."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            self._end(loaded.req)

    def _end(self, req: _Request) -> None:
        """Abort ``req`` and wait for its release (nothing of it is in flight: its load has landed)."""
        self.manager.abort(req)
        while id(req) in self._held:
            self.manager.poll()

    def _require_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("session: is closed")
