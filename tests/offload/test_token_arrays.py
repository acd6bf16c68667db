"""A request whose token ids are ``array.array('q')``, as sglang 0.5.23's ``Req`` keeps
``origin_input_ids`` and ``output_ids``, goes through the README's flow: ``offload``, ``finish``,
``match_prefix``, ``prefetch``, ``load``; its keys equal the list form's and the loaded bytes equal
the source. Also ``request_tokens`` on array, mixed and placeholder-holding requests."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import PageHasher
from kvstage.kernels import KVPool
from kvstage.offload import HostPool, OffloadManager
from kvstage.offload.request import kv_length, request_tokens
from kvstage.offload.testing import SimpleRequest, SlotTable
from kvstage.storage import LayoutFingerprint, open_storage

from offload_rig import STORED_PROMPT, make_rig

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE = 2, 2, 16, 16
# 40 prompt ids; page 1 holds an id above 2**32-1, so its key hashes u64 ids (array('q') holds it).
PROMPT = [1000 + i for i in range(40)]
PROMPT[20] = 2**40 + 3


class ArrayRequest:
    """A request holding its token ids as ``array('q')``, as sglang 0.5.23's ``Req`` does."""

    def __init__(self, rid, prompt, *, extra_key=None, cache_salt=None):
        self.rid = rid
        self.origin_input_ids = array("q", prompt)
        self.output_ids = array("q")
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.done = False

    def finished(self) -> bool:
        return self.done


class Engine:
    """The README example's engine around one manager: a KV pool, slots, and a forward pass
    writing each token's KV from its id."""

    def __init__(self, scheme: str, storage=None, *, store_prompt: bool = True):
        self.k = [torch.full((1024, HEADS, HEAD_DIM), float("nan"), dtype=torch.float16) for _ in range(LAYERS)]
        self.v = [torch.full((1024, HEADS, HEAD_DIM), float("nan"), dtype=torch.float16) for _ in range(LAYERS)]
        self.kv_pool = KVPool.mha(self.k, self.v)
        host_pool = HostPool.like(self.kv_pool, num_pages=32, page_size=PAGE_SIZE)
        fingerprint = LayoutFingerprint.of(self.kv_pool, page_size=PAGE_SIZE, model_id="array-model")
        self.storage = storage if storage is not None else open_storage("memory", fingerprint)
        self.slots = SlotTable(1024, generator=torch.Generator().manual_seed(0))
        self.hasher = PageHasher(scheme, page_size=PAGE_SIZE)
        self.released = []
        self.manager = OffloadManager(self.kv_pool, host_pool, self.storage, self.hasher, slot_indices_of=self.slots,
                                      release=self.released.append, store_prompt=store_prompt)  # fmt: skip

    def forward(self, req, start, end, load=None):
        row = self.slots.assign(req, end)
        ids = (req.origin_input_ids + req.output_ids)[start:end]  # array('q') + array('q')
        values = torch.tensor(np.frombuffer(ids, dtype=np.int64) % 2048, dtype=torch.float16)
        for layer in range(LAYERS):
            if load is not None:
                load.wait_layer(layer)
            self.k[layer][row[start:end]] = values[:, None, None] + layer
            self.v[layer][row[start:end]] = -values[:, None, None] - layer

    def run(self, req, new_tokens: int, *, offload_prompt: bool = True):
        """Prefill, then decode ``new_tokens`` tokens (offloading every step), finish and drain."""
        self.forward(req, 0, len(req.origin_input_ids))
        req.output_ids.append(5000)
        for token in range(5001, 5000 + new_tokens):
            self.forward(req, kv_length(req), kv_length(req) + 1)
            req.output_ids.append(token)
            self.manager.offload(req)
            self.manager.poll()
        req.done = True
        self.manager.finish(req)
        self.manager.drain()

    def load_prefix(self, req):
        """Prefetch and load ``req``'s stored prefix layer by layer, compute the rest of its prompt."""
        handle = self.manager.prefetch(req, policy="wait_complete")
        handle.wait()
        assert handle.ready_to_load()
        load = self.manager.load(handle, self.slots.assign(req, handle.tokens_ready), layer_by_layer=True)
        self.forward(req, load.num_tokens, len(req.origin_input_ids), load=load)
        assert load.error is None
        return load

    def same_bytes(self, a, b, num_tokens: int) -> bool:
        return all(torch.equal(t[self.slots(a)[:num_tokens]].view(torch.uint8), t[self.slots(b)[:num_tokens]].view(torch.uint8))
                   for t in self.kv_pool.tensors())  # fmt: skip


@pytest.mark.parametrize("scheme", ["sglang-v1", "xxh3-128"])
def test_an_array_request_is_stored_prefetched_and_loaded_with_the_list_forms_keys(scheme):
    engine = Engine(scheme)
    manager, hasher = engine.manager, engine.hasher
    a = ArrayRequest("a", PROMPT, extra_key="lora-7", cache_salt="tenant-a")
    engine.run(a, 40)
    assert engine.released == [a]

    # A's 79 tokens with KV: 4 whole pages, keyed as the list of the same ids would be.
    kv_tokens = a.origin_input_ids + a.output_ids[:-1]
    assert type(kv_tokens) is array and len(kv_tokens) == 79
    expected = hasher.prefill_keys(kv_tokens.tolist(), extra_key="lora-7", cache_salt="tenant-a")
    assert len(expected) == 4
    assert hasher.prefill_keys(kv_tokens, extra_key="lora-7", cache_salt="tenant-a") == expected
    assert manager.metrics.pages_stored == 4 and engine.storage.exists(expected) == [True] * 4

    # Lookup by request and by token ids in array and memoryview form; another namespace misses.
    b = ArrayRequest("b", PROMPT, extra_key="lora-7", cache_salt="tenant-a")
    assert manager.match_prefix(b).num_pages == 2  # a prompt's last token is always computed
    for ids in (b.origin_input_ids, memoryview(b.origin_input_ids), array("Q", PROMPT)):
        assert manager.match_prefix(token_ids=ids, extra_key="lora-7", cache_salt="tenant-a").num_pages == 2
    assert manager.match_prefix(token_ids=b.origin_input_ids, extra_key="lora-7").num_pages == 0

    load = engine.load_prefix(b)
    assert load.num_pages == 2
    assert engine.same_bytes(a, b, 40)  # the loaded 32 tokens and the 8 computed ones

    # The next turn: A's prompt and output (array + array) find the decode pages too.
    c = ArrayRequest("c", a.origin_input_ids + a.output_ids, extra_key="lora-7", cache_salt="tenant-a")
    assert manager.match_prefix(c).num_pages == 4
    load = engine.load_prefix(c)
    assert load.num_pages == 4
    assert engine.same_bytes(a, c, 79)
    for req in (b, c):
        req.done = True
        manager.finish(req)
    manager.drain()
    assert engine.released == [a, b, c] and manager.metrics.pages_loaded == 6
    manager.close()


def test_a_decode_side_continues_an_array_requests_chain_from_the_prefill_sides_keys():
    """``store_prompt=False``: the chain starts at the prompt's last whole page's key, computed
    from ``origin_input_ids[:aligned]`` (an array slice)."""
    prefill = Engine("sglang-v1")
    p = ArrayRequest("p", PROMPT, cache_salt="tenant-a")
    prefill.run(p, 1)  # the prompt's 2 whole pages
    prefill.manager.close()
    assert prefill.manager.metrics.pages_stored == 2
    decode = Engine("sglang-v1", prefill.storage, store_prompt=False)
    d = ArrayRequest("d", PROMPT, cache_salt="tenant-a")
    decode.run(d, 40)
    keys = decode.hasher.prefill_keys((d.origin_input_ids + d.output_ids[:-1]).tolist(), cache_salt="tenant-a")
    assert len(keys) == 4
    assert decode.manager.metrics.pages_stored == 2 and decode.storage.exists(keys) == [True] * 4
    decode.manager.close()


# ---- request_tokens ----------------------------------------------------------------------------


class Request:
    def __init__(self, prompt, output, rid="r"):
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, output


@pytest.mark.parametrize("typecode", ["q", "l", "i", "Q", "H"])
@pytest.mark.parametrize("start, end", [(0, 4), (2, 9), (6, 10), (0, 10), (5, 5)])
def test_request_tokens_of_arrays_are_an_array_copy_of_those_positions(typecode, start, end):
    values = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    req = Request(array(typecode, values[:6]), array(typecode, values[6:]))
    tokens = request_tokens(req, start, end)
    assert type(tokens) is array and tokens.typecode == typecode and tokens.tolist() == values[start:end]
    req.output_ids.append(8)  # the engine keeps appending: nothing holds the array's buffer
    req.output_ids[0] = 7
    assert tokens.tolist() == values[start:end]


@pytest.mark.parametrize(
    "prompt, output",
    [
        (list, lambda v: array("q", v)),
        (lambda v: array("q", v), list),
        (lambda v: array("i", v), lambda v: array("q", v)),
        (lambda v: np.array(v, dtype=np.int64), lambda v: array("q", v)),
        (lambda v: torch.tensor(v), lambda v: array("q", v)),
        (tuple, tuple),
    ],
    ids=["list+array", "array+list", "array-i+array-q", "numpy+array", "torch+array", "tuple+tuple"],
)
def test_request_tokens_of_mixed_forms_give_the_same_ids_and_keys(prompt, output):
    values = [3, 1, 4, 1, 5, 9, 2, 6, 5, 2**40, 5, 8]
    req = Request(prompt(values[:7]), output(values[7:]))
    hasher = PageHasher(page_size=2)
    for start, end in [(0, 12), (2, 10), (8, 12), (0, 6)]:
        tokens = request_tokens(req, start, end)
        assert [int(t) for t in tokens] == values[start:end]
        assert hasher.continue_keys(tokens, None) == hasher.continue_keys(values[start:end], None)


@pytest.mark.parametrize("typecode", ["q", "b"])
def test_a_placeholder_in_an_array_is_named(typecode):
    req = Request(array(typecode, [1, 2, 3, 4]), array(typecode, [5, -1]), rid="spec")
    with pytest.raises(
        InvalidArgumentError, match=r"^output_ids\[1\]: rid='spec' holds the placeholder id -1 at token position 5"
    ):
        request_tokens(req, 2, 6)
    assert request_tokens(req, 2, 5).tolist() == [3, 4, 5]
    req = Request(array(typecode, [1, -1, 3, 4]), array(typecode, [5]), rid="p")
    with pytest.raises(
        InvalidArgumentError, match=r"^origin_input_ids\[1\]: rid='p' holds the placeholder id -1 at token position 1"
    ):
        request_tokens(req, 0, 5)


# ---- the replay's requests hold array('q'), as sglang's do ---------------------------------------


def test_the_replays_requests_hold_array_q_and_its_run_hashes_them_as_arrays(monkeypatch, tmp_path):
    from kvstage.replay.command import replay
    from kvstage.replay.engine import ReplayConfig
    from kvstage.replay.models import resolve_model
    from kvstage.replay.replay_request import ReplayRequest
    from kvstage.replay.trace import TraceRequest

    trace = [TraceRequest(i, float(i), n_in, n_out, tuple(ids)) for i, (n_in, n_out, ids) in
             enumerate([(700, 20, [0, 1]), (900, 9, [0, 1]), (300, 1, [0]), (64, 40, [5])])]  # fmt: skip
    req = ReplayRequest(trace[0], np.arange(700, dtype=np.int64), np.arange(20, dtype=np.int64) + 10**6, None, None)
    assert type(req.origin_input_ids) is array and req.origin_input_ids.typecode == "q"
    assert type(req.output_ids) is array and req.output_ids.typecode == "q" and len(req.output_ids) == 0
    req.sample_next()
    assert req.output_ids.tolist() == [10**6]
    assert type(req.kv_tokens) is array and req.kv_tokens.tolist() == list(range(700)) + list(range(10**6, 10**6 + 19))

    seen = []  # the type of every token sequence the run's hasher is handed
    for method in ("prefill_keys", "continue_keys"):
        original = getattr(PageHasher, method)

        def spy(self, tokens, *args, _original=original, **kwargs):
            seen.append(type(tokens))
            return _original(self, tokens, *args, **kwargs)

        monkeypatch.setattr(PageHasher, method, spy)
    config = ReplayConfig(
        model=resolve_model(None, layers=1, heads=1, head_dim=8, dtype="float16"),
        page_size=16,
        max_running=2,
        backend="torch",
        storage=f"file:{tmp_path}",
    )
    # The runs alone (verify_sample=0: the verify pass, whose requests are SimpleRequest lists,
    # checks nothing); each load during a run checks its bytes (load_mismatches). Within one run a
    # request hits only what an earlier one's writes landed before its lookup (timing: the CI
    # run once loaded 0 pages), so a second run over the first's file store is what loads for sure.
    report, _ = replay(config, trace, verify_sample=0)
    assert report["pages_stored"] > 0
    report, _ = replay(config, trace, verify_sample=0)
    assert report["pages_loaded"] > 0
    assert report["load_mismatches"] == report["pages_failed"] == report["pages_dropped"] == 0
    assert seen and set(seen) == {array}


@pytest.mark.parametrize("kind", ["tuple", "numpy-output", "numpy-prompt", "tensor-prompt"])
def test_sequence_types_of_a_request_give_the_same_keys(kind):
    """A request's token ids as a tuple, numpy arrays or a tensor give the keys of lists."""
    rig = make_rig(page_size=4, store_prompt=True)
    req = rig.new_request("a", STORED_PROMPT, 8)
    for token in range(100, 106):
        rig.decode(req, token)
    expected = rig.chain(req)
    if kind == "tuple":
        req.output_ids = tuple(req.output_ids)
    elif kind == "numpy-output":
        req.output_ids = np.array(req.output_ids, dtype=np.int64)
    elif kind == "numpy-prompt":
        req.origin_input_ids = np.array(req.origin_input_ids)
    else:
        req.origin_input_ids = torch.tensor(req.origin_input_ids)
    req.done = True
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.drain()
    assert rig.storage.exists(expected) == [True, True, True]
    assert rig.manager.match_prefix(SimpleRequest("b", STORED_PROMPT)).num_pages == 2


# ---- ids that are not integers are refused before anything is copied -----------------------------


@pytest.mark.parametrize(
    "prompt, output, where, position",
    [
        ([1.5] * 6, [], r"origin_input_ids\[0\]", 0),  # floats
        ([1, 2, 3, True, 5, 6], [], r"origin_input_ids\[3\]", 3),  # a bool, which __index__ would take as 1
        (np.arange(6, dtype=np.float32), [], r"origin_input_ids\[0\]", 0),  # a float array, as tolist() gives floats
        (array("d", [1.0] * 6), [], r"origin_input_ids\[0\]", 0),
        ([1, 2, 3, 4], [5, 6.0], r"output_ids\[1\]", 5),
        ([1, None, 3, 4, 5, 6], [], r"origin_input_ids\[1\]", 1),  # before the placeholder check's min()
    ],
)
def test_offload_refuses_ids_that_are_not_integers_before_any_copy(prompt, output, where, position):
    rig = make_rig(page_size=2, store_prompt=True)
    req = SimpleRequest("f", prompt)
    req.output_ids = list(output) if isinstance(output, list) else output
    rig.slots.assign(req, 8)
    with pytest.raises(
        ArgumentTypeError, match=rf"^{where}: rid='f' holds .+, not an integer token id, at token position {position}"
    ):
        rig.manager.offload(req, kv_length=6)
    assert rig.manager.metrics.pages_launched == 0 and rig.manager.in_flight(req) == 0


def test_integer_ids_of_numpy_types_in_a_list_are_taken_as_the_ints_they_are():
    values = [3, 1, 4, 1, 5, 9]
    req = Request([np.int64(v) for v in values], [])
    assert [int(t) for t in request_tokens(req, 0, 6)] == values


@pytest.mark.parametrize("big", [2**63, 2**64 + 5])
def test_offload_refuses_an_id_above_the_largest_before_any_copy(big):
    # The page hash takes ids up to 2**63-1: before, such an id failed the keys after the copy.
    rig = make_rig(page_size=2, store_prompt=True)
    req = SimpleRequest("big", [1, 2, 3, 4, big, 6])
    rig.slots.assign(req, 8)
    with pytest.raises(
        InvalidArgumentError,
        match=rf"^origin_input_ids\[4\]: rid='big' holds {big}, above the largest token id 2\*\*63-1, at token position 4$",
    ):
        rig.manager.offload(req, kv_length=6)
    assert rig.manager.metrics.pages_launched == 0 and rig.manager.in_flight(req) == 0


def test_offload_names_a_placeholder_after_other_ids_as_a_placeholder():
    rig = make_rig(page_size=2, store_prompt=True)
    req = SimpleRequest("spec", [1, 2, 3, 4, 5, 6])
    req.output_ids = [7, -1]
    rig.slots.assign(req, 8)
    with pytest.raises(
        InvalidArgumentError, match=r"^output_ids\[1\]: rid='spec' holds the placeholder id -1 at token position 7"
    ):
        rig.manager.offload(req, kv_length=8)
    assert rig.manager.metrics.pages_launched == 0
