"""``kvstage.integrations.transformers``: transformers 5's ``generate()`` storing and loading prompt KV.

Random-weight Llama (MHA/GQA) and DeepseekV3 (MLA, the cache holds the latent) models from
``tests/transformers_models.py``, on CPU:

- a first process's ``session.generate`` stores the prompt's and decode's whole pages in a
  ``file:`` store; a second process (``python transformers_models.py``) loads the prompt's
  prefix (4 pages, 32 of 37 tokens: the last token is always computed) and generates; its
  greedy tokens equal a plain ``model.generate`` and its logits equal, bitwise, transformers
  continuing from its own KV of the same 32 tokens (a 37-token prefill and a 32 + 5 split are
  other matrix shapes, which round differently: DeepseekV3's first logits differ in float32);
- a follow-up turn in the second process hits the first turn's decode page too;
- the same within one process and one session; another namespace hits nothing;
- bad input: models kvstage cannot store, batches, kwargs, caches that do not fit, each a
  clear error naming the argument or config field, before anything is written; generate
  options that change the cache (beams, ``use_cache=False``, assisted decoding), from kwargs,
  a ``GenerationConfig`` or ``model.generation_config``, refused before any forward;
- caches filled with autograd on are stored; a failing store leaves no request open; Falcon's
  ``multi_query`` cache (1 KV head, read by the construction's one-token probe) round-trips.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.integrations.transformers import KVStageSession

import transformers_models as tm

PREFIX = (tm.PROMPT_TOKENS - 1) // tm.PAGE_SIZE * tm.PAGE_SIZE  # 32: what a lookup of the prompt loads
STORED_PAGES = (tm.PROMPT_TOKENS + tm.NEW_TOKENS - 1) // tm.PAGE_SIZE  # 44 tokens with KV: 5 pages


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny matrices, a busy machine (results are bitwise equal either way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def model_of(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if (arch, dtype) not in MODELS:
        MODELS[arch, dtype] = tm.build_model(arch, dtype)
    return MODELS[arch, dtype]


def continued(model, ids: torch.Tensor, cache: DynamicCache, num_tokens: int):
    """transformers without kvstage: ``generate`` from the first ``num_tokens`` of its own cache."""
    cache.crop(num_tokens - cache.get_seq_length())
    return model.generate(ids, cache=cache, **tm.GENERATE)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Process 1 (this one) stores each model's first generate(); process 2 loads and continues.
    Returns (directory, process 1's outputs by arch, process 2's results by arch)."""
    directory = tmp_path_factory.mktemp("store")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    first = {}
    for arch in tm.ARCHS:
        with tm.session_of(model_of(arch), str(directory), arch) as session:
            first[arch] = (session.generate(tm.prompt_ids(), **tm.GENERATE), session.metrics.pages_stored)
    torch.set_num_threads(threads)
    out = directory / "second.pt"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(tm.__file__).parent), os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(
        [sys.executable, tm.__file__, str(directory), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return directory, first, torch.load(out)


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_another_process_loads_the_prompt_kv_bitwise(two_processes, arch):
    _, first, second = two_processes
    model, ids, run = model_of(arch), tm.prompt_ids(), second[arch]
    plain_cache = DynamicCache(config=model.config)
    plain = model.generate(ids, cache=plain_cache, **tm.GENERATE)  # no kvstage at all
    # process 1: an empty store changes nothing; its KV's whole pages are stored
    stored_by_first, pages_stored = first[arch]
    assert pages_stored == STORED_PAGES
    assert torch.equal(stored_by_first.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(stored_by_first.logits, plain.logits))
    # process 2: the prompt's 4 stored pages loaded; it continues as transformers does from its own KV
    assert run["loaded"] == PREFIX
    assert torch.equal(run["sequences"], plain.sequences)
    reference = continued(model, ids, plain_cache, PREFIX)
    for step, (got, want) in enumerate(zip(run["logits"], reference.logits)):
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max()}"
    assert torch.isfinite(run["logits"]).all()
    # its store continued the loaded chain: only page 5 was copied, and it was stored already
    assert (run["stored"], run["pages_deduplicated"]) == (1, 1)
    # the follow-up turn (turn 1's sequence as its prompt) also hits turn 1's decode page
    turn = plain.sequences
    turn_cache = DynamicCache(config=model.config)
    model.generate(ids, cache=turn_cache, **tm.GENERATE)
    follow_up = continued(model, turn, turn_cache, STORED_PAGES * tm.PAGE_SIZE)
    assert run["pages_loaded"] == PREFIX // tm.PAGE_SIZE + STORED_PAGES
    assert torch.equal(run["follow_up_sequences"], follow_up.sequences)
    assert torch.equal(run["follow_up_logits"], torch.stack(follow_up.logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", tm.ARCHS)
def test_one_session_reuses_the_prompt_it_stored(tmp_path, arch, dtype):
    model, ids = model_of(arch, dtype), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), arch) as session:
        first = session.generate(ids, **tm.GENERATE)
        second = session.generate(ids, **tm.GENERATE)
        assert (session.metrics.pages_stored, session.metrics.pages_loaded) == (STORED_PAGES, PREFIX // tm.PAGE_SIZE)
        cache = DynamicCache(config=model.config)
        model.generate(ids, cache=cache, **tm.GENERATE)
        reference = continued(model, ids, cache, PREFIX)
        assert torch.equal(second.sequences, first.sequences)
        assert all(torch.equal(a, b) for a, b in zip(second.logits, reference.logits))
        # what load() hands transformers: [1, heads, tokens, dim] in the model's dtype
        loaded = session.load(ids)
        assert loaded.get_seq_length() == PREFIX and loaded.layers[0].keys.dtype == dtype
        assert all(
            torch.equal(a.keys, b.keys[..., :PREFIX, :]) and torch.equal(a.values, b.values[..., :PREFIX, :])
            for a, b in zip(loaded.layers, cache.layers)
        )


def test_another_namespace_or_model_id_hits_nothing(tmp_path):
    model, ids = model_of("llama"), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), "llama") as session:
        session.generate(ids, max_new_tokens=1)
    for kwargs in ({"cache_salt": "tenant-b"}, {"extra_key": None}, {"model_id": "other-weights"}):
        options = {
            "model_id": "tiny-llama",
            "page_size": tm.PAGE_SIZE,
            "extra_key": "lora-7",
            "cache_salt": "tenant-a",
            **kwargs,
        }
        with KVStageSession(model, tm.store_url(str(tmp_path), "llama"), **options) as other:
            assert other.load(ids).get_seq_length() == 0, kwargs
    with tm.session_of(model, str(tmp_path), "llama") as same:
        assert same.load(ids).get_seq_length() == PREFIX


def test_pages_past_max_tokens_are_not_stored(tmp_path, caplog):
    model, ids = model_of("llama"), tm.prompt_ids()
    with KVStageSession(model, "memory", model_id="tiny-llama", page_size=tm.PAGE_SIZE, max_tokens=20) as session:
        assert session.max_tokens == 24  # rounded up to whole pages
        with caplog.at_level(logging.WARNING, logger="kvstage.integrations.transformers.session"):
            session.generate(ids, max_new_tokens=2)
        assert session.metrics.pages_stored == 3
        assert "24 of 38 tokens' KV stored: max_tokens=24" in caplog.text
        assert session.load(ids).get_seq_length() == 24


# -- bad input -----------------------------------------------------------------------------------


def tiny(config_class, model_class, **fields):
    config = config_class(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        **fields,
    )
    return model_class(config).eval()


def refused_models():
    from transformers import (
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        MambaConfig,
        MambaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    yield (
        "sliding window",
        lambda: tiny(MistralConfig, MistralForCausalLM, sliding_window=16),
        "model.config.sliding_window: layer 0 is a 'sliding_attention' layer",
    )
    yield (
        "layer types",
        lambda: tiny(
            Qwen2Config,
            Qwen2ForCausalLM,
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=16,
            use_sliding_window=True,
        ),
        "model.config.layer_types: layer 1 is a 'sliding_attention' layer",
    )
    yield (
        "mamba",
        lambda: MambaForCausalLM(MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4)),
        "model.config.layer_types: layer 0 is a 'linear_attention' layer",
    )
    yield (
        "deepseek v3.2 indexer",
        lambda: DeepseekV32ForCausalLM(
            DeepseekV32Config(
                hidden_size=32,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_routed_experts=2,
                num_experts_per_tok=1,
                n_group=1,
                topk_group=1,
                vocab_size=64,
            )
        ),
        "model.config.layer_types: layer 0 is a 'indexed_attention' layer",
    )
    yield (
        "encoder-decoder",
        lambda: T5ForConditionalGeneration(
            T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
        ),
        "model.config.is_encoder_decoder: is True",
    )


@pytest.mark.parametrize(
    "build, message", [case[1:] for case in refused_models()], ids=[case[0] for case in refused_models()]
)
def test_models_it_cannot_store_are_refused_at_construction(tmp_path, build, message):
    store = tmp_path / "store"
    with pytest.raises(InvalidArgumentError) as raised:
        KVStageSession(build(), f"file:{store}", model_id="m")
    assert message in str(raised.value)
    assert not store.exists()  # refused before the store was opened


def test_bad_constructor_arguments_name_the_argument(tmp_path):
    model, store = model_of("llama"), tmp_path / "store"
    for kwargs, error, message in [
        ({}, InvalidArgumentError, "model_id: must name the model's weights"),
        ({"model_id": ""}, InvalidArgumentError, "model_id: must name the model's weights"),
        ({"model_id": "m", "page_size": 0}, InvalidArgumentError, "page_size: must be a positive int, got 0"),
        (
            {"model_id": "m", "max_tokens": 4},
            InvalidArgumentError,
            "max_tokens: must be an int >= page_size (16), got 4",
        ),
        ({"model_id": "m", "cache_salt": 7}, ArgumentTypeError, "cache_salt: must be a str or None, got int"),
    ]:
        with pytest.raises(error) as raised:
            KVStageSession(model, f"file:{store}", **kwargs)
        assert message in str(raised.value), kwargs
    with pytest.raises(ArgumentTypeError, match="storage: must be a store URL string"):
        KVStageSession(model, store, model_id="m")
    with pytest.raises(ArgumentTypeError, match="model: must be a transformers model"):
        KVStageSession(torch.nn.Linear(2, 2), f"file:{store}", model_id="m")
    assert not store.exists()


def test_bad_calls_name_the_argument_and_write_nothing(tmp_path):
    model, ids = model_of("llama"), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), "llama") as session:
        with pytest.raises(
            InvalidArgumentError, match=r"input_ids: must be one sequence \(batch size 1\), got a batch of 2"
        ):
            session.load(ids.repeat(2, 1))
        with pytest.raises(ArgumentTypeError, match="input_ids: must hold integer token ids, got dtype torch.float32"):
            session.load(ids.float())
        for kwargs, message in [
            ({"num_beams": 2}, "num_beams: must be 1 (one sequence at a time), got 2"),
            (
                {"num_return_sequences": 2, "do_sample": True},
                "num_return_sequences: must be 1 (one sequence at a time), got 2",
            ),
            ({"past_key_values": DynamicCache()}, "past_key_values: is the session's"),
            (
                {"attention_mask": torch.tensor([[0] + [1] * (tm.PROMPT_TOKENS - 1)])},
                "attention_mask: must be all ones",
            ),
        ]:
            with pytest.raises(InvalidArgumentError) as raised:
                session.generate(ids, max_new_tokens=2, **kwargs)
            assert message in str(raised.value), kwargs
        # caches that do not fit the tokens or the model
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        with pytest.raises(InvalidArgumentError, match="cache: holds the KV of 37 tokens, more than the 36 token_ids"):
            session.store(ids[:, :-1], cache)
        with pytest.raises(ArgumentTypeError, match="cache: must be a transformers DynamicCache, got tuple"):
            session.store(ids, ((None, None),))
        other = tm.build_model("deepseek_v3")
        other_cache = DynamicCache(config=other.config)
        other(ids, cache=other_cache, use_cache=True)
        with pytest.raises(
            InvalidArgumentError,
            match=r"cache.layers\[0\].keys: must be \[batch 1, heads, tokens, dim\] = \(1, 2, 37, 16\), got \(1, 1, 37, 32\)",
        ):
            session.store(ids, other_cache)
        loaded = session.load(ids)
        with pytest.raises(
            InvalidArgumentError, match="token_ids: must start with the token ids the cache was loaded for"
        ):
            session.store(ids.flip(-1), loaded)
        assert session.metrics.pages_launched == 0
    assert not any((tmp_path / "llama").rglob("*.kvpage"))
    session.close()  # idempotent
    with pytest.raises(InvalidArgumentError, match="session: is closed"):
        session.load(ids)


# -- a store or a copy that fails --------------------------------------------------------------


def test_a_corrupt_page_ends_the_loaded_prefix_before_it(tmp_path):
    from kvstage.hashing import PageHasher

    model, ids = model_of("deepseek_v3"), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), "deepseek_v3") as session:
        session.generate(ids, **tm.GENERATE)
    keys = PageHasher(page_size=tm.PAGE_SIZE).prefill_keys(ids[0].tolist(), "lora-7", "tenant-a")
    (page_2,) = [path for path in (tmp_path / "deepseek_v3").rglob("*.kvpage") if keys[2] in path.name]
    data = bytearray(page_2.read_bytes())
    data[-1] ^= 0xFF  # one payload byte: the checksum no longer matches
    page_2.write_bytes(bytes(data))
    with tm.session_of(model, str(tmp_path), "deepseek_v3") as session:
        cache = session.load(ids)
        assert cache.get_seq_length() == 2 * tm.PAGE_SIZE  # pages 0 and 1; page 2 reads as a miss
        out = model.generate(ids, cache=cache, **tm.GENERATE)
    reference_cache = DynamicCache(config=model.config)
    model.generate(ids, cache=reference_cache, **tm.GENERATE)
    reference = continued(model, ids, reference_cache, 2 * tm.PAGE_SIZE)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, reference.logits))


def test_a_failed_load_returns_an_empty_cache(tmp_path, monkeypatch, caplog):
    from kvstage.offload import copier

    model, ids = model_of("llama"), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), "llama") as session:
        plain = session.generate(ids, **tm.GENERATE)

        def failing_scatter(*args, **kwargs):
            raise RuntimeError("scatter failed")

        monkeypatch.setattr(copier, "scatter", failing_scatter)
        with caplog.at_level(logging.WARNING, logger="kvstage.integrations.transformers.session"):
            cache = session.load(ids)
        assert cache.get_seq_length() == 0
        assert "loading 32 stored tokens failed (RuntimeError('scatter failed'))" in caplog.text
        monkeypatch.undo()
        again = session.generate(ids, **tm.GENERATE)  # the session goes on: the next load loads
        assert session.metrics.pages_loaded == PREFIX // tm.PAGE_SIZE
        assert torch.equal(again.sequences, plain.sequences)


# -- caches filled with autograd on, a failing store, options that change the cache ------------


def test_store_copies_a_cache_filled_with_autograd_on(tmp_path):
    model, ids = model_of("llama"), tm.prompt_ids()
    assert torch.is_grad_enabled()
    with tm.session_of(model, str(tmp_path), "llama") as session:
        cache = session.load(ids)  # nothing stored yet: empty
        model(ids, cache=cache, use_cache=True)  # a plain forward, outside torch.no_grad()
        assert cache.layers[0].keys.requires_grad
        assert session.store(ids, cache) == tm.PROMPT_TOKENS // tm.PAGE_SIZE
        fresh = DynamicCache(config=model.config)
        model(ids, cache=fresh, use_cache=True)
        assert session.store(ids, fresh) == tm.PROMPT_TOKENS // tm.PAGE_SIZE  # found stored already
        loaded = session.load(ids)
        assert loaded.get_seq_length() == PREFIX
        assert all(
            torch.equal(a.keys, b.keys[..., :PREFIX, :].detach())
            and torch.equal(a.values, b.values[..., :PREFIX, :].detach())
            for a, b in zip(loaded.layers, fresh.layers)
        )
        assert session.metrics.requests_live == 1  # the load's request, until its store


@pytest.mark.parametrize("fails", ["_copy_in", "finish"])
@pytest.mark.parametrize("loaded", [True, False], ids=["loaded cache", "own cache"])
def test_a_failed_store_leaves_no_request_open(tmp_path, monkeypatch, fails, loaded):
    model, ids = model_of("llama"), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), "llama") as session:

        def failing(*args, **kwargs):
            raise RuntimeError(f"{fails} failed")

        monkeypatch.setattr(session if fails == "_copy_in" else session.manager, fails, failing)
        for _ in range(3):
            cache = session.load(ids) if loaded else DynamicCache(config=model.config)
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
            with pytest.raises(RuntimeError, match=f"{fails} failed"):
                session.store(ids, cache)
            assert session.metrics.requests_live == 0
        monkeypatch.undo()
        session.generate(ids, max_new_tokens=2)  # the session goes on
        assert session.metrics.requests_live == 0
        assert session.load(ids).get_seq_length() == PREFIX


def forward_calls(model):
    """A list that grows by one per forward of ``model`` (the hook stays for the model's life:
    the caller removes it through the returned handle)."""
    calls = []
    return calls, model.register_forward_hook(lambda *args: calls.append(1))


def test_options_that_change_the_cache_are_refused_before_computing(tmp_path):
    from transformers import GenerationConfig

    model, ids = model_of("llama"), tm.prompt_ids()
    helper = tm.build_model("llama")
    with tm.session_of(model, str(tmp_path), "llama") as session:
        calls, hook = forward_calls(model)  # after the construction's one-token probe
        try:
            for kwargs, message in [
                (
                    {"generation_config": GenerationConfig(num_beams=2)},
                    "num_beams: must be 1 (one sequence at a time), got 2",
                ),
                (
                    {"generation_config": GenerationConfig(do_sample=True, num_return_sequences=2)},
                    "num_return_sequences: must be 1 (one sequence at a time), got 2",
                ),
                ({"use_cache": False}, "use_cache: must not be False"),
                ({"generation_config": GenerationConfig(use_cache=False)}, "use_cache: must not be False"),
                ({"assistant_model": helper}, "assistant_model: "),
                ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens: "),
            ]:
                with pytest.raises(InvalidArgumentError) as raised:
                    session.generate(ids, max_new_tokens=2, **kwargs)
                assert message in str(raised.value), kwargs
            model.generation_config.use_cache = False
            try:
                with pytest.raises(InvalidArgumentError, match="use_cache: must not be False"):
                    session.generate(ids, max_new_tokens=2)
                session.generate(ids, max_new_tokens=2, use_cache=True)  # the call's kwarg wins, as in transformers
            finally:
                model.generation_config.use_cache = True
            assert session.metrics.requests_live == 0
            assert len(calls) == 2  # only the accepted call computed: its prefill and one decode step
            # a kwarg over the generation_config object, as transformers reads them
            session.generate(ids, generation_config=GenerationConfig(num_beams=2, max_new_tokens=2), num_beams=1)
        finally:
            hook.remove()


def test_falcon_multi_query_stores_its_one_kv_head(tmp_path):
    import transformers
    from packaging.version import Version
    from transformers import FalconConfig, FalconForCausalLM

    ids = tm.prompt_ids() % 256
    # multi_query (FalconConfig's default): 1 KV head; new_decoder_architecture caches its num_kv_heads
    # groups, expanded to every query head before transformers 5.25 (FalconAttention), so 4 there
    expanded = Version(transformers.__version__) < Version("5.25")
    for case, (fields, heads) in enumerate(
        [
            ({}, 1),
            ({"new_decoder_architecture": True, "num_kv_heads": 2}, 4 if expanded else 2),
            ({"multi_query": False}, 4),
        ]
    ):
        torch.manual_seed(0)
        model = FalconForCausalLM(
            FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256, **fields)
        ).eval()
        with KVStageSession(
            model, f"file:{tmp_path}/falcon-{case}", model_id="falcon", page_size=tm.PAGE_SIZE
        ) as session:
            assert (session.layout.cache_heads, session.layout.key_dim) == (heads, 16), fields
            first = session.generate(ids, **tm.GENERATE)
            second = session.generate(ids, **tm.GENERATE)
            assert session.metrics.pages_loaded == PREFIX // tm.PAGE_SIZE
        cache = DynamicCache(config=model.config)
        model.generate(ids, cache=cache, **tm.GENERATE)
        reference = continued(model, ids, cache, PREFIX)
        assert torch.equal(first.sequences, second.sequences)
        assert all(torch.equal(a, b) for a, b in zip(second.logits, reference.logits)), fields


def test_a_2d_list_of_token_ids_is_one_sequence(tmp_path):
    model, ids = model_of("llama"), tm.prompt_ids()
    with tm.session_of(model, str(tmp_path), "llama") as session:
        session.generate(ids, max_new_tokens=2)
        assert session.load(ids.tolist()).get_seq_length() == PREFIX  # tokenizer(text)["input_ids"]
        out = session.generate(ids.tolist(), max_new_tokens=2, do_sample=False)
        assert torch.equal(out, model.generate(ids, max_new_tokens=2, do_sample=False))
        with pytest.raises(
            InvalidArgumentError, match=r"input_ids: must be one sequence \(batch size 1\), got a batch of 2"
        ):
            session.load(ids.repeat(2, 1).tolist())


def test_a_model_whose_cache_cannot_be_probed_is_refused_at_construction(tmp_path, monkeypatch):
    model, store = tm.build_model("llama"), tmp_path / "store"

    def failing_forward(*args, **kwargs):
        raise RuntimeError("no forward here")

    monkeypatch.setattr(model, "forward", failing_forward)
    with pytest.raises(
        InvalidArgumentError,
        match=r"model: a one-token forward with a DynamicCache \(to read its KV heads and head size\) failed: RuntimeError\('no forward here'\)",
    ):
        KVStageSession(model, f"file:{store}", model_id="m")
    assert not store.exists()


def test_an_empty_namespace_is_not_none_and_a_memory_store_is_the_sessions_own(tmp_path):
    model, ids = model_of("llama"), tm.prompt_ids()
    url = f"file:{tmp_path}/store"
    with KVStageSession(model, url, model_id="m", page_size=tm.PAGE_SIZE) as session:
        session.generate(ids, max_new_tokens=1)
    for kwargs, loaded in [
        ({"cache_salt": ""}, 0),
        ({"extra_key": ""}, 0),
        ({"cache_salt": None, "extra_key": None}, PREFIX),
    ]:
        with KVStageSession(model, url, model_id="m", page_size=tm.PAGE_SIZE, **kwargs) as other:
            assert other.load(ids).get_seq_length() == loaded, kwargs
    with KVStageSession(model, "memory", model_id="m", page_size=tm.PAGE_SIZE) as first:
        first.generate(ids, max_new_tokens=1)
        with KVStageSession(model, "memory", model_id="m", page_size=tm.PAGE_SIZE) as second:
            assert (first.load(ids).get_seq_length(), second.load(ids).get_seq_length()) == (PREFIX, 0)


def test_the_construction_probe_leaves_the_random_state_as_it_was(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            attention_dropout=0.5,
            attn_implementation="eager",
        )
    )
    model.train()  # the probe's forward draws dropout masks
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with KVStageSession(model, "memory", model_id="m", page_size=tm.PAGE_SIZE) as session:
        assert session.layout.cache_heads == 1
        assert torch.equal(torch.rand(4), expected)
