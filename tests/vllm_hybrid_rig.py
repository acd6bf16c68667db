"""A hybrid model's KV cache groups in vLLM's real ``Scheduler`` with ``KVStageConnector``
(:class:`HybridRig`; with tensor-parallel ranks in processes of their own: :class:`HybridTPRig`;
importable as ``vllm_hybrid_rig``; it imports vLLM lazily)."""

from __future__ import annotations

from vllm_rig import ConnectorRig, TPRig


class HybridRig(ConnectorRig):
    """:class:`ConnectorRig` over a hybrid model of four layers, its KV cache laid out as vLLM's
    hybrid allocator lays it out (groups of equal layer counts overlaying one allocation, one
    layer slot per group layer; a block id belongs to one group at a time):

    - ``"swa"``, gpt-oss-like: layers 0 and 2 sliding window (``WINDOW`` tokens), 1 and 3 full
      attention; group 0 full ``[1, 3]``, group 1 sliding window ``[0, 2]``;
    - ``"chunked"``: the same with chunked local attention (chunks of ``WINDOW`` tokens, a kind
      kvstage does not store) instead of the sliding window;
    - ``"mamba"``, Qwen3-Next-like: layers 0-2 linear attention (``MambaSpec`` in align mode:
      a conv and a recurrent state, padded to the attention page), layer 3 full attention; a group
      per layer (group 0 full ``[3]``, groups 1-3 the state layers), as vLLM groups 3:1 models.
      The stand-in writes the state after exactly ``L`` tokens (``L`` a multiple of the block,
      a function of ``tokens[:L]`` and the layer) into the group's block ``L / BLOCK_SIZE - 1``,
      where vLLM's align mode keeps it, and performs the scheduler's copy-on-write block copies.
      With :attr:`HASH_BLOCK_SIZE` below the block (:class:`PartialTailRig`), it also writes the
      state after each forward's last token into the block of that token, as a running state.
      :attr:`resumed_states` keeps the state each forward continued from (its block's bytes
      before the forward wrote).

    :attr:`spec` is the worker side's ``KVStageOffloadingSpec`` (its groups are the scheduler side's).

    The stand-in model writes random bytes: token ``t`` at position ``p`` of layer ``l`` is
    ``RANDOM[p, l] ^ t`` (int16 bits, a seeded table), so a block's bytes are a function of its
    tokens and positions and a loaded block must hold exactly them.
    """

    WINDOW = 24
    LAYERS = tuple(f"model.layers.{index}.self_attn.attn" for index in range(4))

    def __init__(self, model_dir, storage: str, *, kind: str = "swa", **kwargs) -> None:
        self._init_model(kind)
        super().__init__(model_dir, storage, **kwargs)

    def _init_model(self, kind: str, rank: int = 0) -> None:
        """The stand-in model's tables; ``rank`` (a tensor-parallel rank) gives other bytes."""
        import torch

        assert kind in ("swa", "chunked", "mamba"), kind
        self.kind, self.rank = kind, rank
        if kind == "mamba":
            self.CACHE_CONFIG = {"mamba_cache_mode": "align"}  # what --enable-prefix-caching picks for it
        generator = torch.Generator().manual_seed(29 + 1000 * rank)
        shape = (512, len(self.LAYERS), 2, self.NUM_KV_HEADS, self.HEAD_SIZE)
        self.random = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
        self.resumed_states: dict = {}  # (request id, start, state layer) -> the state a forward from start read

    @classmethod
    def rank_model(cls, kind: str, rank: int, num_kv_heads: int) -> "HybridRig":
        """One tensor-parallel rank's KV cache and stand-in model, with no scheduler or connector
        (for a rank's own process): :attr:`kv_cache_config` and the tensors it places, and
        :meth:`write`, whose bytes are a function of ``rank`` too."""
        model = cls.__new__(cls)
        model.NUM_KV_HEADS = num_kv_heads  # this rank's share of the heads
        model._init_model(kind, rank)
        model.kv_cache_config = model._kv_cache_config()
        return model

    def _kv_cache_config(self):
        import torch
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            SlidingWindowSpec,
        )

        if self.kind == "mamba":
            return self._mamba_kv_cache_config()
        block_size, num_blocks = self.BLOCK_SIZE, self.NUM_BLOCKS
        sizes = dict(
            block_size=block_size, num_kv_heads=self.NUM_KV_HEADS, head_size=self.HEAD_SIZE, dtype=torch.float16
        )
        full = FullAttentionSpec(**sizes)
        if self.kind == "swa":
            window = SlidingWindowSpec(**sizes, sliding_window=self.WINDOW)
        else:
            window = ChunkedLocalAttentionSpec(**sizes, attention_chunk_size=self.WINDOW)
        L = self.LAYERS
        self.groups = [[L[1], L[3]], [L[0], L[2]]]
        specs = [full, window]
        page = full.page_size_bytes
        slots = len(self.groups[0])
        self.backing = torch.zeros(slots, num_blocks, page, dtype=torch.int8)
        self.kv, self.bits = {}, {}
        for group in self.groups:
            for slot, name in enumerate(group):
                self.kv[name] = (
                    self.backing[slot]
                    .view(torch.float16)
                    .view(num_blocks, 2, block_size, self.NUM_KV_HEADS, self.HEAD_SIZE)
                )
                self.bits[name] = self.kv[name].view(torch.int16)
        size = slots * num_blocks * page
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(size=size, layers=list(group), layer_stride=num_blocks * page, block_stride=page)
                for group in self.groups
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(group), spec) for group, spec in zip(self.groups, specs)],
        )

    STATE_SHAPES = ((64, 3), (2, 8, 16))  # conv (float16), recurrent (float32): 1408 bytes, padded to 2048

    def _mamba_kv_cache_config(self):
        import torch
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MambaSpec,
        )

        block_size, num_blocks = self.BLOCK_SIZE, self.NUM_BLOCKS
        full = FullAttentionSpec(
            block_size=block_size, num_kv_heads=self.NUM_KV_HEADS, head_size=self.HEAD_SIZE, dtype=torch.float16
        )
        page = full.page_size_bytes
        state = MambaSpec(
            block_size=block_size,
            shapes=self.STATE_SHAPES,
            dtypes=(torch.float16, torch.float32),
            page_size_padded=page,
            mamba_cache_mode="align",
        )
        self.state_bytes = state.state_content_size_bytes
        L = self.LAYERS
        self.groups = [[L[3]], [L[0]], [L[1]], [L[2]]]
        self.backing = torch.zeros(1, num_blocks, page, dtype=torch.int8)
        self.rows = self.backing[0]  # (num_blocks, page): every layer's block row (one layer slot)
        attention = self.rows.view(torch.float16).view(num_blocks, 2, block_size, self.NUM_KV_HEADS, self.HEAD_SIZE)
        conv = self.rows.view(torch.float16)[:, : 64 * 3].view(num_blocks, 64, 3)  # a state layer's first tensor
        self.kv = {L[3]: attention, L[0]: conv, L[1]: conv, L[2]: conv}
        self.bits = {L[3]: attention.view(torch.int16)}
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=num_blocks * page, layers=list(group), layer_stride=num_blocks * page, block_stride=page
                )
                for group in self.groups
            ],
            kv_cache_groups=[
                KVCacheGroupSpec(list(group), spec) for group, spec in zip(self.groups, [full, state, state, state])
            ],
        )

    def state_after(self, tokens: list[int], name: str):
        """A state layer's state after exactly ``tokens`` (its ``state_bytes`` bytes, int8)."""
        import torch

        seed = hash((tuple(tokens), self.LAYERS.index(name), self.rank)) % 2**31  # ints hash alike in every process
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(-128, 128, (self.state_bytes,), dtype=torch.int8, generator=generator)

    @property
    def spec(self):
        return self.worker.connector_worker.spec

    def group_block_ids(self, request_id: str, group: int) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[group])

    def token_bits(self, token: int, position: int, name: str):
        """A token's row of one layer's block, as the stand-in model writes it (int16 bits)."""
        return self.random[position, self.LAYERS.index(name)] ^ token

    def forward(self, request_id: str, start: int, end: int) -> None:
        tokens = self.scheduler.requests[request_id].all_token_ids
        blocks = [self.group_block_ids(request_id, group) for group in range(len(self.groups))]
        self.write(request_id, tokens, blocks, start, end)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The model runner's copy-on-write of (source, destination) block ids (Mamba align)."""
        for src, dst in copies:
            self.backing[:, dst] = self.backing[:, src]

    def write(self, request_id: str, tokens: list[int], group_blocks: list[list[int]], start: int, end: int) -> None:
        """The stand-in model's work on positions ``[start, end)`` of ``tokens``, a request's
        blocks ``group_blocks`` (each group's block ids)."""
        if self.kind == "mamba":
            for group_index, (name,) in enumerate(self.groups[1:], 1):
                blocks = group_blocks[group_index]
                if start > 0:  # the state this forward continues from: its block before the forward writes
                    self.resumed_states[request_id, start, name] = self.rows[
                        blocks[(start - 1) // self.BLOCK_SIZE], : self.state_bytes
                    ].clone()
                for length in range((start // self.BLOCK_SIZE + 1) * self.BLOCK_SIZE, end + 1, self.BLOCK_SIZE):
                    block = blocks[length // self.BLOCK_SIZE - 1]
                    if block != 0:
                        self.rows[block, : self.state_bytes] = self.state_after(tokens[:length], name)
                if self.HASH_BLOCK_SIZE and end % self.BLOCK_SIZE and blocks[(end - 1) // self.BLOCK_SIZE] != 0:
                    self.rows[blocks[(end - 1) // self.BLOCK_SIZE], : self.state_bytes] = self.state_after(
                        tokens[:end], name
                    )
        for group_index, group in enumerate(self.groups):
            if self.kind == "mamba" and group_index > 0:
                continue
            blocks = group_blocks[group_index]
            for position in range(start, end):
                block = blocks[position // self.BLOCK_SIZE]
                assert block != 0, (request_id, group_index, position)  # a position computed has a block
                for name in group:
                    self.bits[name][block, :, position % self.BLOCK_SIZE] = self.token_bits(
                        tokens[position], position, name
                    )

    def wrong_blocks(self, prompt: list[int], group_blocks: list[list[int]], plan: dict[int, list[int]]) -> list:
        """Of the blocks ``plan`` names (per group, block indices of a request whose blocks are
        ``group_blocks``), those not holding this model's bytes for ``prompt``: (group, index,
        layer) each; a state group's block must hold the state after its last token."""
        import torch

        wrong = []
        for group, indices in plan.items():
            for index in indices:
                block = group_blocks[group][index]
                for name in self.groups[group]:
                    if self.kind == "mamba" and group > 0:
                        held = self.rows[block, : self.state_bytes]
                        want = self.state_after(prompt[: (index + 1) * self.BLOCK_SIZE], name)
                    else:
                        held, want = self.bits[name][block], self.expected_block(prompt, name, index)
                    if block == 0 or not torch.equal(held, want):
                        wrong.append((group, index, name))
        return wrong

    def zero_kv(self) -> None:
        """Forget every block's bytes (as a GPU's KV cache after the prefix cache is reset)."""
        self.backing.zero_()

    def block_bytes(self, block: int) -> bytes:
        """Block ``block``'s bytes in every layer slot (whichever group holds it)."""
        return self.backing[:, block].contiguous().numpy().tobytes()

    def expected_block(self, prompt: list[int], name: str, block_index: int):
        """Layer ``name``'s block ``block_index`` for ``prompt`` (int16 bits)."""
        import torch

        return torch.stack(
            [
                self.token_bits(prompt[position], position, name)
                for position in range(block_index * self.BLOCK_SIZE, (block_index + 1) * self.BLOCK_SIZE)
            ],
            dim=1,
        )


class PartialTailRig(HybridRig):
    """The Qwen3-Next-like :class:`HybridRig` (``kind="mamba"``) with blocks of 32 tokens hashed
    every 16 (vLLM's ``prefix_match_unit``): vLLM 0.33.0's offloading scheduler then stores and
    hits partial tails (``supports_partial_tail``), a block and state snapshot keyed at a hash
    boundary inside a block."""

    BLOCK_SIZE, HASH_BLOCK_SIZE = 32, 16

    def __init__(self, model_dir, storage: str, **kwargs) -> None:
        super().__init__(model_dir, storage, kind="mamba", **kwargs)


class HybridTPRig(TPRig):
    """:class:`vllm_rig.TPRig` over :class:`HybridRig`'s hybrid model (``kind`` ``"swa"`` or
    ``"mamba"``), each rank holding half the model's KV heads (HybridRig's) and states of its
    own: rank ``r``'s process builds ``HybridRig.rank_model(kind, r, heads)``, whose bytes are a
    function of the rank too, and applies each step's copy-on-write."""

    LAYERS = HybridRig.LAYERS

    def __init__(self, model_dir, storage: str, *, kind: str, tp: int = 2, **kwargs) -> None:
        self.kind = kind
        self.NUM_KV_HEADS = HybridRig.NUM_KV_HEADS * tp
        self.CACHE_CONFIG = {"mamba_cache_mode": "align"} if kind == "mamba" else {}
        super().__init__(model_dir, storage, tp=tp, **kwargs)

    def _kv_cache_config(self):
        local = HybridRig.rank_model(self.kind, 0, self.NUM_KV_HEADS // self.tp)  # the same on every rank
        self.groups = local.groups
        return local.kv_cache_config

    def rank_model(self, rank: int) -> tuple:
        return HybridRig.rank_model, (self.kind, rank, self.NUM_KV_HEADS // self.tp)
