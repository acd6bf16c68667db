"""Token ids of a replayed request, a pure function of the trace.

The traces hold no text, only block ids, so tokens are made up, under two rules that keep the
trace's sharing: the 512 tokens of a block are a function of its block id alone (so requests
that share leading block ids share those tokens, hence their prefill page keys), and a
request's output tokens are a function of its index in the trace.
"""

from __future__ import annotations

import numpy as np

from kvstage.replay.trace import BLOCK_TOKENS, TraceRequest

VOCAB_SIZE = 128256  # Llama 3's vocabulary

_BLOCK_STREAM = 0xB10C  # generator stream tags, so block and output tokens never coincide
_OUTPUT_STREAM = 0x0007


class TokenSource:
    """Makes the prompt and output token ids of trace requests.

    Args:
        seed: mixed into every generator; the same seed gives the same tokens.
        vocab_size: token ids are drawn uniformly from ``[0, vocab_size)``.

    Block tokens are cached by block id (a trace reuses its popular blocks many times).
    Token ids are ``numpy.int64`` arrays.
    """

    def __init__(self, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> None:
        self.seed = int(seed)
        self.vocab_size = int(vocab_size)
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, block_id: int) -> np.ndarray:
        """The 512 token ids of block ``block_id`` (int64, read-only, cached)."""
        tokens = self._blocks.get(block_id)
        if tokens is None:
            rng = np.random.default_rng([self.seed, _BLOCK_STREAM, int(block_id)])
            tokens = rng.integers(0, self.vocab_size, BLOCK_TOKENS, dtype=np.int64)
            tokens.flags.writeable = False
            self._blocks[block_id] = tokens
        return tokens

    def prompt(self, request: TraceRequest) -> np.ndarray:
        """The prompt: the request's blocks concatenated, cut at ``input_length`` (int64)."""
        tokens = np.concatenate([self.block(b) for b in request.hash_ids])
        return tokens[: request.input_length]

    def output(self, request: TraceRequest) -> np.ndarray:
        """The ``output_length`` output token ids, a function of ``request.index`` (int64)."""
        rng = np.random.default_rng([self.seed, _OUTPUT_STREAM, request.index])
        return rng.integers(0, self.vocab_size, request.output_length, dtype=np.int64)
