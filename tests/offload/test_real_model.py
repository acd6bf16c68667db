"""A real model through kvstage: a transformers model whose KV lives in a paged ``KVPool``.

The test is the engine. Its KV pool holds every layer's KV at scattered slots (a
:class:`SlotTable` with a generator); the model's own decoder layers (real weights, eager
attention) run with :class:`PoolCache`, transformers' cache interface backed by the pool:
``update()`` writes the new tokens' KV into the request's slots and returns the request's KV
gathered back from them, so every attention reads its keys and values from the pool.

- MHA: a Llama config (4 layers, 8 query / 2 KV heads, head_dim 32); the pool has a K and a V
  buffer per layer (``KVPool.mha``).
- MLA: a DeepseekV3 config (2 layers, one dense and one MoE); transformers caches its
  compressed latent (``kv_a_layernorm``'d ``kv_lora_rank`` part and the rotated
  ``qk_rope_head_dim`` part), which the pool holds as one row per token
  (``KVPool.mla``, ``kv_dim = kv_lora_rank + qk_rope_head_dim``), as sglang does.

The flow, for each layout, dtype (float32, bfloat16) and copy backend (torch, Triton; on CPU
the Triton interpreter, see ``tests/conftest.py``):

1. Engine 1 runs request A: prefill of its 37-token prompt (in two chunks, split where B's
   loaded prefix will end), then greedy decode to 40 output tokens; kvstage's
   ``OffloadManager`` stores the prompt's and the decode's whole pages (``offload`` and
   ``poll`` every step, ``finish`` at the end).
2. Engine 2, a second instance with a fresh NaN-filled pool sharing the store, runs B (same
   prompt and namespace): ``match_prefix``, ``prefetch``, ``load`` layer by layer into B's
   slots, each layer's attention waiting for its layer (``wait_layer``); then the prompt's
   rest and the decode. B's logits equal A's bitwise at every step, and so do its tokens:
   both runs go through the same code with the same shapes, so any byte the store, host pool
   or copies changed would show.
3. Another ``cache_salt``, another ``extra_key`` or no namespace: no page hits.
4. A follow-up turn (A's prompt and output as the prompt) hits A's decode pages too; loaded
   into engine 2, its logits equal those of the same turn continuing from A's own KV in
   engine 1.

Why A prefills in two chunks: a 37-token prefill and a 32-token prefix plus a 5-token chunk
are different matrix shapes, which round differently; bitwise equality needs B to repeat A's
shapes, and A to be the reference (its own KV continuing at position 32).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import LayoutFingerprint, open_storage

PAGE_SIZE = 8
PROMPT_TOKENS = 37  # 4 whole pages and 5 tokens
NEW_TOKENS = 40  # A's KV then covers 37 + 39 = 76 positions: 9 whole pages
NUM_SLOTS = 256
HOST_PAGES = 32
VOCAB = 1000
NAMESPACE = {"extra_key": "lora-7", "cache_salt": "tenant-a"}


# -- the model -------------------------------------------------------------------------------


def build_model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """A small model with seeded random weights (no download), eager attention, in eval mode."""
    if arch == "llama":
        config = LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=VOCAB,
            max_position_embeddings=256,
            attn_implementation="eager",
        )
        cls = LlamaForCausalLM
    else:
        config = DeepseekV3Config(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            vocab_size=VOCAB,
            max_position_embeddings=256,
            attn_implementation="eager",
        )
        cls = DeepseekV3ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = cls(config)
    return model.to(dtype).eval()


def pool_buffers(model: torch.nn.Module) -> KVPool:
    """A NaN-filled KV pool for the model: a slot read before it was written poisons the logits."""
    config, dtype = model.config, model.dtype

    def buffer(heads: int, dim: int) -> torch.Tensor:
        return torch.full((NUM_SLOTS, heads, dim), float("nan"), dtype=dtype)

    layers = range(config.num_hidden_layers)
    if isinstance(config, DeepseekV3Config):
        return KVPool.mla([buffer(1, config.kv_lora_rank + config.qk_rope_head_dim) for _ in layers])
    return KVPool.mha(
        [buffer(config.num_key_value_heads, config.head_dim) for _ in layers],
        [buffer(config.num_key_value_heads, config.head_dim) for _ in layers],
    )


class PoolCache:
    """transformers' cache interface over a kvstage ``KVPool``, for one forward of one request.

    ``update(a, b, layer)`` gets the new tokens' KV of one layer (MHA: K and V
    ``[1, num_kv_heads, n, head_dim]``; MLA: the latent ``[1, 1, n, kv_lora_rank]`` and the
    rotated key part ``[1, 1, n, qk_rope_head_dim]``), writes it into the slots of positions
    ``[start, start + n)`` of ``slot_indices`` and returns the KV of every position
    ``[0, start + n)`` gathered from the pool. With a ``load`` (kvstage's ``LoadHandle``), it
    first waits for that layer's copy.
    """

    def __init__(self, kv_pool: KVPool, slot_indices: torch.Tensor, start: int, load=None) -> None:
        self.kv_pool, self.slot_indices, self.start, self.load = kv_pool, slot_indices, start, load

    def update(self, a: torch.Tensor, b: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.load is not None:
            self.load.wait_layer(layer_idx)  # the prefix's KV of this layer has landed
        end = self.start + a.shape[-2]
        new, rows = self.slot_indices[self.start : end], self.slot_indices[:end]
        if self.kv_pool.kv_parts == 2:
            k_buffer, v_buffer = self.kv_pool.layer(0, layer_idx), self.kv_pool.layer(1, layer_idx)
            k_buffer[new] = a[0].transpose(0, 1)
            v_buffer[new] = b[0].transpose(0, 1)
            return k_buffer[rows].transpose(0, 1)[None], v_buffer[rows].transpose(0, 1)[None]
        latent_buffer = self.kv_pool.layer(0, layer_idx)
        if a.shape[1] != 1 or a.shape[-1] + b.shape[-1] != latent_buffer.shape[-1]:
            raise AssertionError(
                f"expected the MLA latent [1, 1, n, kv_lora_rank] and rope part, got {tuple(a.shape)} and {tuple(b.shape)}: "
                "this transformers caches expanded K/V (the latent cache came in transformers 5)"
            )
        latent_buffer[new] = torch.cat([a, b], dim=-1)[0].transpose(0, 1)
        latent = latent_buffer[rows].transpose(0, 1)[None]
        return latent.split([a.shape[-1], b.shape[-1]], dim=-1)


def _cache_argument(layer: torch.nn.Module) -> str:
    """The decoder layer's cache keyword (``cache`` in transformers 5; ``past_key_values`` before)."""
    parameters = inspect.signature(layer.forward).parameters
    return next(name for name in ("cache", "past_key_values", "past_key_value") if name in parameters)


# -- the engine ------------------------------------------------------------------------------


class Engine:
    """One engine instance: a model, its KV pool, a slot table and kvstage's manager, on
    ``device`` (the model's); ``new_tokens``: how many tokens :meth:`run` decodes to."""

    def __init__(
        self,
        model: torch.nn.Module,
        storage,
        *,
        backend: str,
        seed: int,
        kv_pool: KVPool | None = None,
        device: torch.device | str = "cpu",
        new_tokens: int = NEW_TOKENS,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.new_tokens = new_tokens
        self.kv_pool = kv_pool if kv_pool is not None else pool_buffers(model)
        self.slots = SlotTable(NUM_SLOTS, device=self.device, generator=torch.Generator().manual_seed(seed))
        self.released: list = []
        host_pool = HostPool.like(self.kv_pool, num_pages=HOST_PAGES, page_size=PAGE_SIZE)
        self.manager = OffloadManager(
            self.kv_pool,
            host_pool,
            storage,
            PageHasher(page_size=PAGE_SIZE),
            self.slots,
            release=self.released.append,
            backend=backend,
        )
        self.cache_argument = _cache_argument(model.model.layers[0])

    @torch.no_grad()
    def forward(self, slot_indices: torch.Tensor, token_ids: list[int], start: int, load=None) -> torch.Tensor:
        """Logits (float32) of ``token_ids`` at positions ``[start, start + n)``; their KV is written
        into ``slot_indices[start:start + n]``, and ``slot_indices[:start]`` hold the KV before."""
        inner = self.model.model
        end = start + len(token_ids)
        positions = torch.arange(start, end, device=self.device)[None]
        hidden = inner.embed_tokens(torch.tensor([token_ids], device=self.device))
        position_embeddings = inner.rotary_emb(hidden, positions)
        mask = torch.full(
            (len(token_ids), end), torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=self.device
        ).triu(start + 1)[None, None]
        cache = PoolCache(self.kv_pool, slot_indices[:end], start, load)
        for layer in inner.layers:
            out = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                position_embeddings=position_embeddings,
                **{self.cache_argument: cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(inner.norm(hidden))[0].float()

    def prefill(self, req: SimpleRequest, start: int, end: int, load=None) -> torch.Tensor:
        """Prefill the prompt's positions ``[start, end)`` (slots grown to ``end``)."""
        slot_indices = self.slots.assign(req, end)
        return self.forward(slot_indices, req.origin_input_ids[start:end], start, load)

    def run(self, req: SimpleRequest, start: int, load=None) -> list[torch.Tensor]:
        """Prefill the prompt from ``start`` (``[0, start)`` has KV), greedy-decode to
        ``new_tokens``, calling kvstage as an engine does: ``offload`` and ``poll`` after every
        step's KV is written, ``finish`` at the end. Returns every step's logits."""
        steps = [self.prefill(req, start, len(req.origin_input_ids), load)]
        while True:
            req.output_ids.append(int(steps[-1][-1].argmax()))
            self.manager.offload(req)
            self.manager.poll()
            if len(req.output_ids) == self.new_tokens:
                break
            position = req.kv_length  # the last sampled token's position: it has no KV yet
            slot_indices = self.slots.assign(req, position + 1)
            steps.append(self.forward(slot_indices, [req.output_ids[-1]], position))
        req.done = True
        self.manager.finish(req)
        return steps

    def load_prefix(self, req: SimpleRequest):
        """Lookup, prefetch (waiting for it: a test), and a layer-by-layer load of ``req``'s stored
        prefix into fresh slots; returns the load handle."""
        assert self.manager.match_prefix(req).num_pages > 0
        handle = self.manager.prefetch(req, policy="wait_complete")
        while not handle.ready_to_load():
            handle.wait()  # an engine would schedule other requests and look again next step
            self.manager.poll()
        slot_indices = self.slots.assign(req, handle.tokens_ready)
        return self.manager.load(handle, slot_indices, layer_by_layer=True)

    def close(self) -> None:
        self.manager.drain()
        self.manager.close()


def prompt_tokens() -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()


MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def model_of(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    if (arch, dtype) not in MODELS:
        MODELS[arch, dtype] = build_model(arch, dtype)
    return MODELS[arch, dtype]


# -- the test --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these matrices are tiny, and on a busy 2-core machine OpenMP's
    threads spin against each other (10x slower). Results are bitwise equal either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"], ids=["mha-llama", "mla-deepseek_v3"])
def test_stored_prefix_continues_bitwise(arch, dtype, backend, monkeypatch):
    from kvstage.kernels import triton_copy

    triton_launches = []
    launch = triton_copy.launch
    monkeypatch.setattr(
        triton_copy,
        "launch",
        lambda *args, **kwargs: (triton_launches.append(kwargs["gather"]), launch(*args, **kwargs)),
    )
    model = model_of(arch, dtype)
    kv_pool = pool_buffers(model)
    storage = open_storage("memory", LayoutFingerprint.of(kv_pool, page_size=PAGE_SIZE, model_id=f"tiny-{arch}"))
    first = Engine(model, storage, backend=backend, seed=0, kv_pool=kv_pool)
    prompt = prompt_tokens()
    prompt_pages = PROMPT_TOKENS // PAGE_SIZE  # 4
    prefix_tokens = (PROMPT_TOKENS - 1) // PAGE_SIZE * PAGE_SIZE  # what a lookup can load: 32

    # 1. A on engine 1; its KV is stored page by page as it runs.
    a = SimpleRequest("a", prompt, **NAMESPACE)
    first.prefill(a, 0, prefix_tokens)
    logits_a = first.run(a, prefix_tokens)
    first.manager.drain()
    stored_pages = a.kv_length // PAGE_SIZE  # 76 positions with KV: 9 pages
    assert first.released == [a]
    assert first.manager.metrics.pages_stored == stored_pages
    assert all(torch.isfinite(step).all() for step in logits_a)

    # 2. B on engine 2 (fresh NaN pool, other slots, same store): load the prefix, continue.
    second = Engine(model, storage, backend=backend, seed=1)
    b = SimpleRequest("b", prompt, **NAMESPACE)
    match = second.manager.match_prefix(b)
    assert (match.num_pages, match.num_tokens) == (prompt_pages, prefix_tokens)
    load = second.load_prefix(b)
    assert load.num_tokens == prefix_tokens
    assert not set(second.slots(b).tolist()) <= set(first.slots(a).tolist())  # scattered differently
    logits_b = second.run(b, prefix_tokens, load=load)
    assert b.output_ids == a.output_ids
    assert len(logits_b) == len(logits_a)
    for step, (from_a, from_b) in enumerate(zip(logits_a, logits_b)):
        assert torch.equal(from_a, from_b), f"step {step}: max |diff| {(from_a - from_b).abs().max()}"
    second.manager.drain()
    metrics = second.manager.metrics
    assert second.released == [b]
    assert metrics.pages_loaded == prompt_pages
    # B's decode pages continue the loaded chain: the same keys as A's, already stored.
    assert (metrics.pages_stored, metrics.pages_deduplicated) == (0, stored_pages - prompt_pages)

    # 3. Other namespaces never see A's pages.
    for namespace in (
        {"extra_key": "lora-7", "cache_salt": "tenant-b"},
        {"extra_key": "lora-8", "cache_salt": "tenant-a"},
        {},
    ):
        assert second.manager.match_prefix(SimpleRequest("x", prompt, **namespace)).num_pages == 0, namespace

    # 4. A follow-up turn hits A's decode pages; loaded, it continues as from A's own KV.
    turn = prompt + a.output_ids  # the next turn's prompt: 77 tokens
    follow_up = SimpleRequest("turn-2", turn, **NAMESPACE)
    assert second.manager.match_prefix(follow_up).num_pages == stored_pages > prompt_pages
    load = second.load_prefix(follow_up)
    assert load.num_tokens == stored_pages * PAGE_SIZE
    loaded = second.prefill(follow_up, load.num_tokens, len(turn), load)
    # the reference: engine 1 continues the turn from A's slots (a radix-cache hit)
    reference = SimpleRequest("turn-2-ref", turn, **NAMESPACE)
    tail = first.slots.assign(reference, len(turn) - load.num_tokens)
    slot_indices = torch.cat([first.slots(a)[: load.num_tokens], tail])
    expected = first.forward(slot_indices, turn[load.num_tokens :], load.num_tokens)
    assert torch.isfinite(loaded).all()
    assert torch.equal(loaded, expected)

    second.manager.abort(follow_up)
    first.close()
    second.close()
    # the copies ran on the backend asked for: Triton gathers and scatters, or none
    assert set(triton_launches) == ({True, False} if backend == "triton" else set())
