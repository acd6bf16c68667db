"""kvstage for a transformers 5 model's ``generate()``: store a sequence's KV, load a stored prefix.

Public API:
    KVStageSession: ``session.generate(input_ids, ...)`` loads the longest stored prefix of
        ``input_ids`` into a ``DynamicCache``, runs ``model.generate`` on it and stores the KV of
        the output sequence; ``load`` / ``store`` do the two halves around your own ``generate``.
    cache_layout, CacheLayout: a model's KV layout from its config (and the refusal of models
        kvstage cannot store: sliding-window, chunked, indexed, Mamba / linear-attention,
        hybrid, shared-KV layers).
    model_layout, model_layout_of_config: a (hybrid) model's :class:`~kvstage.model_layout.ModelLayout`
        read from the cache a short prefill fills (the store and load of hybrid models are next).

Modules: ``layout`` (config -> layout), ``model_layout`` (cache -> ModelLayout), ``session`` (``KVStageSession``). Importing this
package does not import transformers; building a session does.
"""

from kvstage.integrations.transformers.layout import CacheLayout, cache_layout
from kvstage.integrations.transformers.model_layout import model_layout, model_layout_of_config
from kvstage.integrations.transformers.session import KVStageSession

__all__ = ["CacheLayout", "KVStageSession", "cache_layout", "model_layout", "model_layout_of_config"]
