"""ModelLayout: a model's KV as components, its rules, and one key space per component."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.kv_layout import KVLayout
from kvstage.model_layout import (
    FullAttention,
    ModelLayout,
    PageSidecar,
    RequestState,
    SlidingWindow,
    TensorSpec,
)
from kvstage.storage import LayoutFingerprint
from kvstage.storage.fingerprint import prefix_differences, prefix_fields, prefix_of
from kvstage.storage.memory_store import MemoryStore

KV = KVLayout(2, 2, 2, 16, "float32")
CONV = TensorSpec("conv", (128, 4), "float32")
RECURRENT = TensorSpec("recurrent", (4, 16, 16), "float32")


def gpt_oss_like(window: int = 8, dtype: str = "float32") -> ModelLayout:
    kv = KVLayout(2, 2, 2, 16, dtype)
    return ModelLayout(4, (SlidingWindow((0, 2), kv, window), FullAttention((1, 3), kv)))


def qwen3_next_like(conv: TensorSpec = CONV, recurrent: TensorSpec = RECURRENT) -> ModelLayout:
    return ModelLayout(
        4, (RequestState((0, 1, 2), (conv, recurrent)), FullAttention((3,), KVLayout(1, 2, 2, 16, "float32")))
    )


def deepseek_v32_like() -> ModelLayout:
    latent = KVLayout(4, 1, 1, 24, "float32")
    index_k = TensorSpec("index_k", (16,), "float32")
    return ModelLayout(4, (FullAttention((0, 1, 2, 3), latent), PageSidecar((0, 1, 2, 3), (index_k,), name="indexer")))


def test_plain_model_keeps_todays_key_space():
    # Stores written before hybrid models stay readable: the plain prefix is pinned.
    plain = ModelLayout.full_attention(KVLayout(32, 2, 8, 128, "bfloat16"))
    assert plain.is_plain and not plain.has_state
    spaces = plain.fingerprints("llama3-8b", page_size=64, tp_rank=1, tp_size=2)
    assert list(spaces) == ["full"]
    assert spaces["full"].prefix() == "llama3-8b@bfloat16@L0-31xKV2xH8xD128@P64@tp1of2@"
    assert spaces["full"] == LayoutFingerprint("llama3-8b", plain.components[0].layout, 64, tp_rank=1, tp_size=2)
    mla = ModelLayout.full_attention(KVLayout(61, 1, 1, 576, "bfloat16"))
    assert mla.fingerprints("dsv3", page_size=64, first_layer=3)["full"].prefix() == (
        "dsv3@bfloat16@L3-63xKV1xH1xD576@P64@tp-any@"
    )


def test_entry_bytes_per_component():
    model = qwen3_next_like()
    assert model.component("state").entry_bytes(8) == 3 * (128 * 4 + 4 * 16 * 16) * 4  # per request, any page size
    assert model.component("state").entry_bytes(64) == model.component("state").entry_bytes(8)
    assert model.component("full").entry_bytes(8) == 1 * 2 * 8 * 2 * 16 * 4
    sidecar = deepseek_v32_like().component("indexer")
    assert sidecar.row_bytes == 64 and sidecar.entry_bytes(8) == 4 * 8 * 64
    swa = gpt_oss_like().component("swa")
    assert swa.entry_bytes(8) == KV.page_bytes(8)
    spaces = model.fingerprints("q3n", page_size=8)
    assert {name: fp.page_bytes for name, fp in spaces.items()} == {"state": 18432, "full": 2048}


@pytest.mark.parametrize(
    "window, page_size, pages",
    [(1, 8, 0), (2, 8, 1), (8, 8, 1), (9, 8, 1), (10, 8, 2), (128, 16, 8), (129, 16, 8), (130, 16, 9)],
)
def test_window_pages_hold_window_minus_one_tokens(window, page_size, pages):
    swa = SlidingWindow((0,), KVLayout(1, 2, 1, 4, "float16"), window)
    assert swa.window_pages(page_size) == pages
    assert pages * page_size >= window - 1 > (pages - 1) * page_size or pages == 0


def test_components_keep_one_order():
    a = ModelLayout(4, (FullAttention((1, 3), KV), SlidingWindow((0, 2), KV, 8)))
    assert a == gpt_oss_like() and a.description(8) == gpt_oss_like().description(8)
    assert [c.name for c in a.components] == ["full", "swa"]


# -- every hybrid difference is another key space ---------------------------------------------------


def _prefixes(model: ModelLayout, **kwargs) -> set[str]:
    kwargs.setdefault("page_size", 8)
    return {fp.prefix() for fp in model.fingerprints("m", **kwargs).values()}


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: gpt_oss_like(window=16), id="window"),
        pytest.param(lambda: gpt_oss_like(dtype="bfloat16"), id="dtype"),
        pytest.param(
            lambda: ModelLayout(4, (SlidingWindow((1, 3), KV, 8), FullAttention((0, 2), KV))), id="layer-kinds"
        ),
        pytest.param(
            lambda: ModelLayout(4, (FullAttention((0, 1, 2, 3), KVLayout(4, 2, 2, 16, "float32")),)), id="plain"
        ),
        pytest.param(lambda: qwen3_next_like(), id="state-model"),
    ],
)
def test_layouts_that_differ_share_no_key_space(other):
    assert not _prefixes(gpt_oss_like()) & _prefixes(other())


@pytest.mark.parametrize(
    "conv, recurrent",
    [
        (TensorSpec("conv", (128, 3), "float32"), RECURRENT),  # another conv kernel
        (CONV, TensorSpec("recurrent", (4, 16, 16), "bfloat16")),  # another state dtype
        (CONV, TensorSpec("ssm", (4, 16, 16), "float32")),  # another tensor
    ],
)
def test_state_shapes_and_dtypes_are_other_key_spaces(conv, recurrent):
    assert not _prefixes(qwen3_next_like()) & _prefixes(qwen3_next_like(conv, recurrent))


def test_page_size_and_stage_are_other_key_spaces():
    model = gpt_oss_like()
    assert not _prefixes(model) & _prefixes(model, page_size=16)
    assert not _prefixes(model) & _prefixes(model, first_layer=4)


def test_components_of_one_model_have_their_own_key_spaces():
    spaces = gpt_oss_like().fingerprints("gpt-oss", page_size=8)
    assert set(spaces) == {"full", "swa"}
    full, swa = spaces["full"].prefix(), spaces["swa"].prefix()
    assert full != swa and full.startswith("gpt-oss@full-") and swa.startswith("gpt-oss@swa-")
    # the same process elsewhere makes the same key spaces
    assert spaces == gpt_oss_like().fingerprints("gpt-oss", page_size=8)


def test_shards_follow_each_component():
    model = ModelLayout(
        2,
        (
            FullAttention((0, 1), KVLayout(2, 1, 1, 24, "float32")),
            PageSidecar((0, 1), (TensorSpec("index_k", (16,), "float8_e4m3fn"),), name="indexer"),
            RequestState((0, 1), (CONV,)),
        ),
    )
    ranks = [model.fingerprints("m", page_size=8, tp_rank=rank, tp_size=2) for rank in (0, 1)]
    assert ranks[0]["full"].prefix() == ranks[1]["full"].prefix()  # MLA latent: replicated
    assert ranks[0]["indexer"].prefix() == ranks[1]["indexer"].prefix()  # sglang keys the indexer without a rank
    assert ranks[0]["state"].prefix() != ranks[1]["state"].prefix()  # Mamba state: sharded by rank
    assert ranks[0]["state"].prefix().endswith("@tp0of2@")
    assert [ranks[1][name].writes_pages for name in ("full", "indexer", "state")] == [False, False, True]


def test_component_prefixes_parse_and_name_their_differences():
    swa = gpt_oss_like().fingerprints("gpt-oss", page_size=8)["swa"]
    other = gpt_oss_like(window=16).fingerprints("gpt-oss", page_size=8)["swa"]
    prefix = swa.prefix()
    assert prefix_of(prefix + "00ff") == prefix
    fields = prefix_fields(prefix)
    assert fields == {
        "model_id": "gpt-oss",
        "component": "swa",
        "page_format": prefix.split("@")[1].split("-")[1],
        "page_bytes": str(KV.page_bytes(8)),
        "shard": "tp0of1",
    }
    formats = {prefix: swa.page_format, other.prefix(): other.page_format}
    assert prefix_differences(other.prefix(), prefix, formats) == [
        "page_format swa=swa L0,2 K/V 2x16 float32 W16 (this store: swa=swa L0,2 K/V 2x16 float32 W8)"
    ]
    plain = LayoutFingerprint("gpt-oss", KV, 8).prefix()
    assert prefix_differences(plain, prefix)[0] == "page kind: a KV layout (this store: a hybrid model's component)"
    # an opaque format still parses as before
    opaque = LayoutFingerprint.opaque("m", page_bytes=16, page_format="fmt").prefix()
    assert "component" not in prefix_fields(opaque) and prefix_of(opaque + "ab") == opaque


def test_a_store_of_a_component_takes_entries_of_its_size():
    spaces = qwen3_next_like().fingerprints("q3n", page_size=8)
    store = MemoryStore(spaces["state"])
    snapshot = torch.arange(spaces["state"].page_bytes, dtype=torch.uint8)
    assert [s.value for s in store.put(["0a"], [snapshot])] == ["stored"]
    back = torch.zeros_like(snapshot)
    assert store.get(["0a"], [back]) == [True] and torch.equal(back, snapshot)
    with pytest.raises(InvalidArgumentError, match=r"pages\[0\]: 2048 bytes, the layout's page has 18432"):
        store.put(["0b"], [torch.zeros(2048, dtype=torch.uint8)])


# -- bad input: the argument and the rule -----------------------------------------------------------


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: FullAttention((0, 0), KV), InvalidArgumentError, r"full.layers: must be strictly increasing"),
        (lambda: FullAttention((1, 0), KV), InvalidArgumentError, r"full.layers: must be strictly increasing"),
        (lambda: FullAttention((), KV), InvalidArgumentError, r"full.layers: must name at least one layer"),
        (lambda: FullAttention((0, True), KV), InvalidArgumentError, r"full.layers: must hold ints >= 0"),
        (lambda: FullAttention(3, KV), ArgumentTypeError, r"full.layers: must be a tuple of layer indices"),
        (lambda: FullAttention((0,), KV), InvalidArgumentError, r"full.layout: num_layers 2 must equal the 1 layers"),
        (lambda: FullAttention((0, 1), "kv"), ArgumentTypeError, r"full.layout: must be a kvstage.kv_layout.KVLayout"),
        (lambda: SlidingWindow((0, 1), KV, 0), InvalidArgumentError, r"swa.window: must be a positive int"),
        (lambda: SlidingWindow((0, 1), KV, 8.0), InvalidArgumentError, r"swa.window: must be a positive int"),
        (lambda: FullAttention((0, 1), KV, name="Full"), InvalidArgumentError, r"name: must match"),
        (lambda: FullAttention((0, 1), KV, name="opaque"), InvalidArgumentError, r"not be 'opaque'"),
        (lambda: FullAttention((0, 1), KV, name="a-b"), InvalidArgumentError, r"name: must match"),
        (lambda: RequestState((0,), ()), ArgumentTypeError, r"tensors: state: must be a non-empty tuple"),
        (lambda: RequestState((0,), (CONV, CONV)), InvalidArgumentError, r"tensors: state: a tensor name repeats"),
        (lambda: RequestState((0,), ("conv",)), ArgumentTypeError, r"tensors: state: must hold .*TensorSpec"),
        (lambda: TensorSpec("conv", (128, 0), "float32"), InvalidArgumentError, r"conv.shape: must hold positive"),
        (lambda: TensorSpec("conv", 128, "float32"), ArgumentTypeError, r"conv.shape: must be a tuple of sizes"),
        (lambda: TensorSpec("conv", (4,), "floaty"), ArgumentTypeError, r"conv.dtype: 'floaty' names no torch dtype"),
    ],
)
def test_components_refuse_bad_input(build, error, message):
    with pytest.raises(error, match=message):
        build()


STATE = RequestState((0,), (CONV,))


@pytest.mark.parametrize(
    "num_layers, components, error, message",
    [
        (0, (STATE,), InvalidArgumentError, r"num_layers: must be a positive int"),
        (2, (), ArgumentTypeError, r"components: must be a non-empty tuple"),
        (2, (KV,), ArgumentTypeError, r"components\[0\]: must be a FullAttention, SlidingWindow"),
        (1, (FullAttention((0, 1), KV),), InvalidArgumentError, r"full.layers: layer 1 is outside \[0, num_layers=1\)"),
        (
            3,
            (FullAttention((0, 1), KV), SlidingWindow((1, 2), KV, 4)),
            InvalidArgumentError,
            r"swa.layers: layer 1 is already cached by 'full' \(a layer has at most one KV component\)",
        ),
        (
            2,
            (FullAttention((0, 1), KV), FullAttention((0, 1), KV)),
            InvalidArgumentError,
            r"components: names must be distinct",
        ),
        (
            3,
            (FullAttention((0, 1), KV), PageSidecar((2,), (CONV,), name="indexer")),
            InvalidArgumentError,
            r"components: layers \[2\] have neither per-token KV",
        ),
        (
            2,
            (STATE, RequestState((0, 1), (CONV,), name="state2")),
            InvalidArgumentError,
            r"state2.layers: layer 0 is already cached by 'state' \(a layer has at most one state component\)",
        ),
    ],
)
def test_model_layout_refuses_bad_input(num_layers, components, error, message):
    with pytest.raises(error, match=message):
        ModelLayout(num_layers, components)


def test_layers_with_kv_and_state_or_kv_and_sidecar_are_allowed():
    falcon_h1 = ModelLayout(2, (FullAttention((0, 1), KV), RequestState((0, 1), (CONV, RECURRENT))))
    assert falcon_h1.has_state and not falcon_h1.is_plain
    assert [c.kind for c in deepseek_v32_like().components] == ["full", "sidecar"]


def test_unknown_component_and_kind_are_named():
    with pytest.raises(InvalidArgumentError, match=r"component: the layout has no component 'swa'; it has \['full'\]"):
        ModelLayout.full_attention(KV).component("swa")
    with pytest.raises(InvalidArgumentError, match=r"kind: must be one of"):
        gpt_oss_like().of_kind("mamba")
    with pytest.raises(ArgumentTypeError, match=r"layout: must be a kvstage.kv_layout.KVLayout"):
        ModelLayout.full_attention("llama")


def test_component_fingerprint_refuses_bad_input():
    with pytest.raises(InvalidArgumentError, match=r"component: must be a component name"):
        LayoutFingerprint.of_component("m", component="opaque", layout_description="x", entry_bytes=4)
    with pytest.raises(InvalidArgumentError, match=r"entry_bytes: must be a positive int"):
        LayoutFingerprint.of_component("m", component="swa", layout_description="x", entry_bytes=0)
    with pytest.raises(InvalidArgumentError, match=r"layout_description: must be a non-empty str"):
        LayoutFingerprint.of_component("m", component="swa", layout_description="", entry_bytes=4)
    with pytest.raises(ArgumentTypeError, match=r"model_id: required"):
        LayoutFingerprint.of_component(component="swa", layout_description="x", entry_bytes=4)
    with pytest.raises(InvalidArgumentError, match=r"component: needs page_format"):
        LayoutFingerprint("m", KV, 8, component="swa")
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpt_oss_like().num_layers = 3


def test_a_file_store_directory_lists_each_component(tmp_path):
    from kvstage.storage import open_storage
    from kvstage.storage.key_spaces import key_spaces

    spaces = qwen3_next_like().fingerprints("q3n", page_size=8)
    for name, fingerprint in spaces.items():
        with open_storage(f"file:{tmp_path}", fingerprint) as store:
            entry = torch.full((fingerprint.page_bytes,), 7, dtype=torch.uint8)
            assert [s.value for s in store.put(["0a"], [entry])] == ["stored"], name
    listed = {space.prefix: space.pages for space in key_spaces(tmp_path)}
    assert listed == {spaces["state"].prefix(): 1, spaces["full"].prefix(): 1}


def test_readme_hybrid_example_runs(tmp_path):
    import re
    import subprocess
    import sys

    from support import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("\n## Hybrid models\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "['full', 'swa'] True",
        "[False, False, True, True, False, False, True, True]",
        f"{3 * (128 * 4 * 2 + 4 * 16 * 16 * 4)} bytes a snapshot",
        "(128, 192) 192 2",
    ]


def test_snapshot_bytes_are_layer_by_layer_tensor_by_tensor():
    conv, recurrent = TensorSpec("conv", (3, 2), "float16"), TensorSpec("recurrent", (2,), "float32")
    state = RequestState((1, 4), (conv, recurrent))
    entry = torch.zeros(state.entry_bytes(8), dtype=torch.uint8)
    views = state.entry_views(entry)
    values = {
        name: [torch.randn(spec.shape).to(spec.dtype) for _ in range(2)]
        for name, spec in (("conv", conv), ("recurrent", recurrent))
    }
    for name, layers in values.items():
        for view, value in zip(views[name], layers):
            view.copy_(value)
    expected = b"".join(values[name][layer].numpy().tobytes() for layer in range(2) for name in ("conv", "recurrent"))
    assert entry.numpy().tobytes() == expected and len(expected) == 2 * (12 + 8)


def test_sidecar_page_bytes_are_layer_by_layer_tensor_by_tensor():
    index_k, scale = TensorSpec("index_k", (4,), "uint8"), TensorSpec("scale", (), "float32")
    sidecar = PageSidecar((0, 1), (index_k, scale), name="indexer")
    entry = torch.arange(sidecar.entry_bytes(2), dtype=torch.uint8)
    views = sidecar.entry_views(entry, page_size=2)
    assert [tuple(v.shape) for v in views["index_k"]] == [(2, 4), (2, 4)] and tuple(views["scale"][1].shape) == (2,)
    # layer 0: index_k of 2 tokens (8 bytes), scale of 2 tokens (8 bytes); then layer 1
    assert views["index_k"][1].flatten().tolist() == list(range(16, 24))
    assert views["scale"][0].view(torch.uint8).tolist() == list(range(8, 16))
    with pytest.raises(InvalidArgumentError, match=r"entry: 31 bytes, an entry has 32"):
        sidecar.entry_views(entry[:31], page_size=2)
    with pytest.raises(ArgumentTypeError, match=r"entry: must be a contiguous uint8 tensor"):
        sidecar.entry_views(entry.float(), page_size=2)


def test_state_buffers_are_checked_before_any_copy():
    state = RequestState((0, 2), (CONV, RECURRENT))
    good = {"conv": [torch.zeros(5, 128, 4)] * 2, "recurrent": [torch.zeros(5, 4, 16, 16)] * 2}
    assert state.require_buffers(good) == 5
    cases = [
        ({**good, "ssm": good["conv"]}, InvalidArgumentError, r"state_buffers: names tensor 'ssm'; state has"),
        ({"conv": good["conv"]}, InvalidArgumentError, r"state_buffers: has no 'recurrent' buffers"),
        (
            {**good, "conv": good["conv"][:1]},
            InvalidArgumentError,
            r"state_buffers\['conv'\]: must be one buffer per state layer \(2\), got 1",
        ),
        (
            {**good, "conv": [torch.zeros(5, 128, 3)] * 2},
            InvalidArgumentError,
            r"state_buffers\['conv'\]\[0\]: shape \(5, 128, 3\) must be \[num_slots, 128, 4\] \(layer 0\)",
        ),
        (
            {**good, "recurrent": [torch.zeros(5, 4, 16, 16), torch.zeros(5, 4, 16, 16, dtype=torch.bfloat16)]},
            ArgumentTypeError,
            r"state_buffers\['recurrent'\]\[1\]: dtype torch.bfloat16 must be torch.float32",
        ),
        (
            {**good, "recurrent": [torch.zeros(6, 4, 16, 16)] * 2},
            InvalidArgumentError,
            r"state_buffers: buffers hold different slot counts \[5, 6\]",
        ),
        ([good["conv"]], ArgumentTypeError, r"state_buffers: must map tensor names"),
    ]
    for buffers, error, message in cases:
        with pytest.raises(error, match=message):
            state.require_buffers(buffers)


def test_stores_of_another_layout_are_refused_naming_what_differs():
    mine = gpt_oss_like()
    mine.require_matches(mine.fingerprints("m", page_size=8), page_size=8)
    theirs = gpt_oss_like(window=16).fingerprints("m", page_size=8)
    with pytest.raises(
        InvalidArgumentError,
        match=r"storage\['full'\]: its layout differs from the pool's: "
        r"swa=swa L0,2 K/V 2x16 float32 W16 \(the pool's: swa L0,2 K/V 2x16 float32 W8\)",
    ):
        mine.require_matches(theirs, page_size=8)
    with pytest.raises(InvalidArgumentError, match=r"storage\['swa'\]: .*page_size=16 \(the pool's: 8\)"):
        mine.require_matches(
            {**mine.fingerprints("m", page_size=8), "swa": gpt_oss_like().fingerprints("m", page_size=16)["swa"]},
            page_size=8,
        )
    with pytest.raises(InvalidArgumentError, match=r"storage: has no key space for the layout's component 'swa'"):
        mine.require_matches({"full": mine.fingerprints("m", page_size=8)["full"]}, page_size=8)
    with pytest.raises(InvalidArgumentError, match=r"storage: names component 'state'; the layout has only"):
        mine.require_matches({**mine.fingerprints("m", page_size=8), "state": theirs["swa"]}, page_size=8)
    plain = ModelLayout.full_attention(KV)
    with pytest.raises(
        InvalidArgumentError, match=r"storage\['full'\]: its layout's page_size 16 must equal the pool's 8"
    ):
        plain.require_matches(plain.fingerprints("m", page_size=16), page_size=8)
