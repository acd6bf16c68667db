"""The ``generate()`` options a :class:`KVStageSession` cannot run with, read as transformers reads them.

``session.generate`` hands transformers one sequence and the session's ``DynamicCache`` and
stores what the cache holds afterwards. Options that make transformers run several sequences
(beams, ``num_return_sequences``), compute without the cache (``use_cache=False``: every step
is a full forward, appended to the cache) or grow and crop it by guesses (assisted decoding:
``assistant_model``, ``prompt_lookup_num_tokens``, ``assistant_early_exit``, ``use_mtp``)
would leave a cache that is not the sequence's KV; they are refused before anything runs.

An option may come from the call's kwargs, the ``generation_config=`` it passes, or
``model.generation_config``, in that priority; transformers' own ``_prepare_generation_config``
merges them (the fallback, for a transformers without it, applies the same priority).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from kvstage.errors import require

__all__ = ["check_generate_options", "effective_generation_config"]

# GenerationConfig fields that start assisted decoding (transformers' get_generation_mode)
_ASSISTED = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")
_WHERE = "(from the call, its generation_config or model.generation_config)"


def effective_generation_config(model: Any, generate_kwargs: dict[str, Any]) -> Any:
    """The ``GenerationConfig`` ``model.generate(**generate_kwargs)`` runs with (a copy).

    Raises: what transformers raises for a bad generation config (before computing anything).
    """
    named = {
        name
        for name, parameter in inspect.signature(model.generate).parameters.items()
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
    }
    passed = generate_kwargs.get("generation_config")
    kwargs = {name: value for name, value in generate_kwargs.items() if name not in named}
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        config, _ = prepare(passed, **kwargs)
        return config
    config = copy.deepcopy(passed if passed is not None else model.generation_config)
    for name, value in kwargs.items():
        if hasattr(config, name):
            setattr(config, name, value)
    return config


def check_generate_options(model: Any, generate_kwargs: dict[str, Any]) -> None:
    """Refuse ``generate_kwargs`` that would leave the session's cache other than one sequence's KV.

    Raises:
        InvalidArgumentError: naming the option: ``num_beams`` or ``num_return_sequences``
            above 1, ``use_cache`` False, ``assistant_model``, ``prompt_lookup_num_tokens``,
            ``assistant_early_exit``, ``use_mtp``, or another generation mode than greedy or
            sampled decoding (``generation_mode``).
    """
    config = effective_generation_config(model, generate_kwargs)
    for name in ("num_beams", "num_return_sequences"):
        value = getattr(config, name, None)
        require(value in (None, 1), name, lambda: f"must be 1 (one sequence at a time), got {value!r} {_WHERE}")
    require(
        getattr(config, "use_cache", None) is not False,
        "use_cache",
        f"must not be False {_WHERE}: the session's cache must hold the sequence's KV",
    )
    assistant = generate_kwargs.get("assistant_model")
    require(
        assistant is None,
        "assistant_model",
        "is not supported: assisted decoding crops the cache to the accepted guesses; pass no assistant_model",
    )
    for name in _ASSISTED:
        value = getattr(config, name, None)
        require(
            value in (None, False),
            name,
            lambda: (
                f"is not supported (assisted decoding crops the cache to the accepted guesses), got {value!r} {_WHERE}"
            ),
        )
    mode = getattr(config, "get_generation_mode", None)
    if mode is not None:
        kind = str(getattr(mode(), "value", mode()))
        require(
            kind in ("greedy_search", "sample"),
            "generation_mode",
            lambda: f"must be greedy or sampled decoding, got {kind!r} {_WHERE}",
        )
