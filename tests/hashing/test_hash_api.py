"""The hashing API: request objects, the decode form, partial pages, argument rules, determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvstage.errors import ArgumentTypeError, InvalidArgumentError
from kvstage.hashing import (
    DEFAULT_SCHEME,
    SCHEMES,
    PageHasher,
    compute_prefix_hash,
    full_pages,
    get_scheme,
    namespace_seed,
    page_keys,
    prefill_page_keys,
)

from support import REPO_ROOT

TOKENS = [(i * 2654435761) % 152064 for i in range(40)]  # 40 ids: 2 full pages of 16, 8 left over


def test_schemes_are_named_and_sglang_v1_is_the_default():
    assert SCHEMES == ("sglang-v1", "xxh3-128")
    assert DEFAULT_SCHEME == "sglang-v1"
    assert get_scheme("sglang-v1").cryptographic and not get_scheme("xxh3-128").cryptographic
    assert page_keys(TOKENS, 16) == page_keys(TOKENS, 16, scheme="sglang-v1")
    with pytest.raises(InvalidArgumentError, match="scheme: must be one of sglang-v1, xxh3-128; got 'md5'"):
        page_keys(TOKENS, 16, scheme="md5")
    with pytest.raises(ArgumentTypeError, match="scheme: must be a scheme name"):
        PageHasher(scheme=3)


@pytest.mark.parametrize("scheme, length", [("sglang-v1", 64), ("xxh3-128", 32)])
def test_keys_are_lowercase_hex_of_the_scheme_length(scheme, length):
    keys = page_keys(TOKENS, 16, scheme=scheme) + [namespace_seed("a", None, scheme)]
    assert all(len(k) == length and k == k.lower() and int(k, 16) >= 0 for k in keys)
    assert PageHasher(scheme).key_length == length


def test_request_without_extra_key_names_the_attribute_and_the_type():
    class EngineRequest:
        cache_salt = None

    with pytest.raises(ArgumentTypeError) as info:
        compute_prefix_hash(EngineRequest(), TOKENS, page_size=16)
    message = str(info.value)
    assert "'extra_key'" in message and "EngineRequest" in message
    assert not isinstance(info.value, AttributeError)


def test_request_without_cache_salt_names_the_attribute_and_the_type():
    with pytest.raises(ArgumentTypeError, match=r"types\.SimpleNamespace has no attribute 'cache_salt'"):
        PageHasher(page_size=16).compute_prefix_hash(SimpleNamespace(extra_key="x"), TOKENS)


def test_request_attributes_must_be_str_or_none():
    with pytest.raises(ArgumentTypeError, match="req.cache_salt: must be a str or None, got int"):
        compute_prefix_hash(SimpleNamespace(extra_key=None, cache_salt=7), TOKENS, page_size=16)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_form_continues_without_reapplying_the_seed(scheme):
    req = SimpleNamespace(extra_key="lora-a", cache_salt="tenant-a")
    whole = prefill_page_keys(TOKENS[:32], 16, extra_key="lora-a", cache_salt="tenant-a", scheme=scheme)
    first = compute_prefix_hash(req, TOKENS[:16], "", page_size=16, scheme=scheme)
    second = compute_prefix_hash(req, TOKENS[16:32], first[-1], page_size=16, scheme=scheme)
    assert first + second == whole
    assert compute_prefix_hash(req, TOKENS[:16], None, page_size=16, scheme=scheme) == first
    # Re-applying the seed on the second segment would give a different (wrong) key.
    assert second != compute_prefix_hash(req, TOKENS[16:32], "", page_size=16, scheme=scheme)
    # continue_keys from the last key equals the decode form; from None it is un-namespaced.
    hasher = PageHasher(scheme, 16)
    assert hasher.continue_keys(TOKENS[16:32], first[-1]) == second
    assert hasher.continue_keys(TOKENS[:32], None) == page_keys(TOKENS[:32], 16, scheme=scheme)
    assert hasher.continue_keys(TOKENS[:32], None) != whole


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partial_last_page_is_not_hashed(scheme):
    hasher = PageHasher(scheme, 16)
    keys = hasher.prefill_keys(TOKENS, "x")  # 40 tokens: 2 full pages, 8 left over
    assert hasher.full_pages(len(TOKENS)) == (2, 8)
    assert keys == hasher.prefill_keys(TOKENS[:32], "x")
    # The leftover alone is never hashed as a page, with or without a prior.
    assert hasher.continue_keys(TOKENS[32:], keys[-1]) == []
    # Once the page is full, passing the leftover again continues the chain correctly.
    tail = TOKENS[32:] + [11] * 8
    assert keys + hasher.continue_keys(tail, keys[-1]) == hasher.prefill_keys(TOKENS + [11] * 8, "x")
    assert page_keys(TOKENS[:15], 16, scheme=scheme) == []


def test_full_pages_counts():
    assert full_pages(0, 64) == (0, 0)
    assert full_pages(63, 64) == (0, 63)
    assert full_pages(129, 64) == (2, 1)
    with pytest.raises(InvalidArgumentError, match="num_tokens: must be >= 0"):
        full_pages(-1, 4)


@pytest.mark.parametrize(
    "bad, error",
    [(0, InvalidArgumentError), (-4, InvalidArgumentError), (2.0, ArgumentTypeError), (True, ArgumentTypeError)],
)
def test_page_size_rule(bad, error):
    with pytest.raises(error, match="page_size: must be"):
        page_keys(TOKENS, bad)
    with pytest.raises(error, match="page_size: must be"):
        PageHasher(page_size=bad)


def test_prior_hash_must_be_a_key_of_the_same_scheme():
    sha_key = page_keys(TOKENS, 16)[0]
    xxh_key = page_keys(TOKENS, 16, scheme="xxh3-128")[0]
    with pytest.raises(InvalidArgumentError, match="prior_hash: must be a 64-character sglang-v1 key .* got 32"):
        page_keys(TOKENS, 16, prior_hash=xxh_key)
    with pytest.raises(InvalidArgumentError, match="prior_hash: must be a 32-character xxh3-128 key"):
        page_keys(TOKENS, 16, prior_hash=sha_key, scheme="xxh3-128")
    with pytest.raises(InvalidArgumentError, match="prior_hash: must be hexadecimal"):
        page_keys(TOKENS, 16, prior_hash="z" * 64)
    with pytest.raises(ArgumentTypeError, match="prior_hash: must be a hex str or None, got bytes"):
        page_keys(TOKENS, 16, prior_hash=bytes(32))
    assert page_keys(TOKENS, 16, prior_hash=sha_key.upper()) == page_keys(TOKENS, 16, prior_hash=sha_key)
    assert page_keys(TOKENS, 16, prior_hash="") == page_keys(TOKENS, 16, prior_hash=None)


def test_namespace_inputs_must_be_str_or_none():
    with pytest.raises(ArgumentTypeError, match="extra_key: must be a str or None, got bytes"):
        namespace_seed(b"lora", None)
    with pytest.raises(ArgumentTypeError, match="cache_salt: must be a str or None, got int"):
        prefill_page_keys(TOKENS, 16, cache_salt=5)
    with pytest.raises(InvalidArgumentError, match="cache_salt: must be encodable as UTF-8"):
        namespace_seed(None, "\ud800")


def test_hasher_properties_and_repr():
    hasher = PageHasher("xxh3-128", 32)
    assert (hasher.scheme, hasher.page_size) == ("xxh3-128", 32)
    assert repr(hasher) == "PageHasher(scheme='xxh3-128', page_size=32)"
    assert hasher.seed() is None and hasher.seed("a") == namespace_seed("a", None, "xxh3-128")
    assert PageHasher().scheme == "sglang-v1" and PageHasher().page_size == 64


SUBPROCESS_CODE = """
import json, sys
from kvstage.hashing import prefill_page_keys, namespace_seed
tokens = list(range(1000, 1100))
out = {s: [namespace_seed("lora-a", "tenant-a", s)] + prefill_page_keys(tokens, 16, extra_key="lora-a", cache_salt="tenant-a", scheme=s)
       for s in ("sglang-v1", "xxh3-128")}
print(json.dumps(out))
"""


def test_keys_do_not_depend_on_pythonhashseed():
    here = {
        s: [namespace_seed("lora-a", "tenant-a", s)]
        + prefill_page_keys(list(range(1000, 1100)), 16, extra_key="lora-a", cache_salt="tenant-a", scheme=s)
        for s in SCHEMES
    }
    for hash_seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        result = subprocess.run(
            [sys.executable, "-c", SUBPROCESS_CODE],
            cwd=REPO_ROOT.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == here


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prior_hash_with_whitespace_is_not_hexadecimal(scheme):
    # bytes.fromhex skips whitespace: a padded key of the right length once hashed a shorter prior.
    length = get_scheme(scheme).key_length
    for prior_hash in (
        " " + "0" * (length - 2) + " ",
        "\t" + "0" * (length - 2) + "\n",
        "0" * (length - 4) + "    ",
        " ".join(["00"] * length)[:length],
    ):
        assert len(prior_hash) == length
        with pytest.raises(InvalidArgumentError, match="prior_hash: must be hexadecimal"):
            page_keys(TOKENS, 16, prior_hash=prior_hash, scheme=scheme)
        with pytest.raises(InvalidArgumentError, match="prior_hash: must be hexadecimal"):
            PageHasher(scheme, 16).continue_keys(TOKENS, prior_hash)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_page_size_larger_than_any_input_gives_no_keys(scheme):
    for page_size in (2**40, 2**61, 2**80):
        assert page_keys([], page_size, scheme=scheme) == []
        assert page_keys(TOKENS, page_size, scheme=scheme) == []
        assert page_keys(TOKENS, page_size, scheme=get_scheme(scheme).pure_python()) == []
    with pytest.raises(InvalidArgumentError, match=r"tokens\[1\] = -1"):
        page_keys([1, -1], 2**80, scheme=get_scheme(scheme).pure_python())


def test_a_request_property_that_fails_is_not_reported_as_missing():
    class EngineRequest:
        cache_salt = None

        @property
        def extra_key(self):
            return self.lora.name  # no such attribute: a bug inside the engine's property

    with pytest.raises(AttributeError, match="'lora'"):
        compute_prefix_hash(EngineRequest(), TOKENS, page_size=16)
