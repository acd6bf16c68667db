"""MooncakeStore's configuration and its import guard: no Mooncake cluster needed."""

from __future__ import annotations

import sys

import pytest

from kvstage.errors import BackendUnavailableError, InvalidArgumentError
from kvstage.storage import STORAGE_SCHEMES, open_storage
from kvstage.storage.mooncake import store as mooncake_store
from kvstage.storage.mooncake.config import MooncakeConfig, parse_mooncake_url, parse_size
from kvstage.storage.mooncake.status import describe_code
from kvstage.storage.mooncake.store import MooncakeStore


def test_url_with_every_field():
    config = parse_mooncake_url(
        "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&protocol=rdma&segment=4GB"
        "&buffer=512MiB&local_hostname=10.0.0.7&device=mlx5_0,mlx5_1&bounce=16MB&rpc_timeout_ms=2000"
        "&setup_retries=3&connect_timeout_s=0.5&admin=10.0.0.5:9003&watch=2.5"
    )
    assert config == MooncakeConfig(
        master_server_address="10.0.0.5:50051",
        metadata_server="http://10.0.0.5:8080/metadata",
        local_hostname="10.0.0.7",
        protocol="rdma",
        device_name="mlx5_0,mlx5_1",
        global_segment_size=4 * 10**9,  # GB: powers of 1000 (kvstage.storage.sizes)
        local_buffer_size=512 << 20,
        bounce_bytes=16 * 10**6,
        connect_timeout_s=0.5,
        rpc_timeout_ms=2000,
        setup_retries=3,
        admin_address="10.0.0.5:9003",
        watch_s=2.5,
    )


def test_url_defaults_and_percent_encoded_metadata():
    config = parse_mooncake_url("mooncake://master:7000?metadata=http%3A%2F%2Fmeta%3A8080%2Fmetadata")
    assert config.master_server_address == "master:7000"
    assert config.metadata_server == "http://meta:8080/metadata"
    assert (config.protocol, config.device_name, config.local_hostname) == ("tcp", "", None)
    assert config.global_segment_size == 1 << 30 and config.local_buffer_size == 64 << 20
    assert parse_mooncake_url("mooncake://master:7000").metadata_server == "P2PHANDSHAKE"
    assert (config.admin_address, config.watch_s) == (None, None)  # clear names this client's pages only


def test_dict_takes_mooncake_field_names_and_aliases():
    config = MooncakeConfig.from_mapping(
        {
            "local_hostname": "node1",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": "1GiB",
            "local_buffer_size": 16 << 20,
            "protocol": "tcp",
            "rdma_devices": "",
            "master_server_addr": "node0:50051",
        }
    )
    assert config.master_server_address == "node0:50051"
    assert config.global_segment_size == 1 << 30 and config.local_buffer_size == 16 << 20


@pytest.mark.parametrize(
    "url, message",
    [
        ("memory:", "must start with 'mooncake://'"),
        ("mooncake://?metadata=P2PHANDSHAKE", "no master address"),
        ("mooncake://host", "master_server_address: must be 'host:port'"),
        ("mooncake://host:70000", "port in 1..65535"),
        ("mooncake://host:1?protocol=udp", "protocol: must be one of ('tcp', 'rdma')"),
        ("mooncake://host:1?segment=lots", "url: segment: must be a size, got 'lots'"),
        ("mooncake://host:1?buffer=0", "url: buffer: must be positive"),
        ("mooncake://host:1?global_segment_size=-1", "url: global_segment_size: must be a size, got '-1'"),
        ("mooncake://host:1?colour=blue", "unknown query name 'colour'"),
        ("mooncake://host:1?segment=1GB&global_segment_size=2GB", "given twice"),
        ("mooncake://host:1?rpc_timeout_ms=0", "rpc_timeout_ms: must be a positive int"),
        ("mooncake://host:1?soft_pin=0", "soft_pin_ms: must be a positive int, got '0'"),
        ("mooncake://host:1?soft_pin=long", "soft_pin_ms: must be a positive int, got 'long'"),
        ("mooncake://host:1?admin=9003", "admin_address: must be 'host:port'"),
        ("mooncake://host:1?watch=2", "watch_s: needs admin_address"),
        ("mooncake://host:1?admin=h:9003&watch=0", "watch_s: must be positive seconds, got '0'"),
        ("mooncake://host:1?admin=h:9003&watch=soon", "watch_s: must be positive seconds, got 'soon'"),
    ],
)
def test_bad_urls_name_the_field(url, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_mooncake_url(url)


def test_soft_pin_is_milliseconds_and_off_by_default():
    assert parse_mooncake_url("mooncake://h:1?soft_pin=2000").soft_pin_ms == 2000
    assert parse_mooncake_url("mooncake://h:1").soft_pin_ms is None


def test_dict_without_master_is_refused():
    with pytest.raises(InvalidArgumentError, match="master_server_address: required"):
        MooncakeConfig.from_mapping({"metadata_server": "P2PHANDSHAKE"})


def test_sizes_must_be_positive_in_the_syntax_of_every_storage_url():
    assert [parse_size(v, "x") for v in (4096, "4096", "2KiB", "3MB", "1GiB", "1 TB")] == [
        4096,
        4096,
        2048,
        3 * 10**6,
        1 << 30,
        10**12,
    ]
    with pytest.raises(InvalidArgumentError, match="x: must be an int number of bytes or a size string"):
        parse_size(True, "x")
    with pytest.raises(InvalidArgumentError, match="x: must be positive, got '0KB'"):
        parse_size("0KB", "x")


def test_an_unknown_query_name_lists_the_names_the_readme_teaches():
    """Was: ``mooncake config: unknown key 'segmnet'; known: ['bounce_bytes', ...,
    'global_segment_size', ...]``: the long field names, not ``segment`` / ``metadata`` the
    README's URLs use, and ``master_server_address``, which a URL gives as its host."""
    url = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&segmnet=4GB"
    with pytest.raises(InvalidArgumentError) as caught:
        parse_mooncake_url(url)
    assert str(caught.value) == (
        f"url: unknown query name 'segmnet' in {url!r}; known: metadata, segment, buffer, device, bounce, "
        "admin, watch, soft_pin, protocol, local_hostname, connect_timeout_s, rpc_timeout_ms, setup_retries"
    )
    # the long names of the short ones still work
    assert (
        parse_mooncake_url("mooncake://h:1?global_segment_size=2GiB&metadata_server=P2PHANDSHAKE").global_segment_size
        == 2 << 30
    )


def test_codes_have_names_and_meanings():
    assert describe_code(-900).startswith("-900 RPC_FAIL (")
    assert describe_code(-704) == "-704 OBJECT_NOT_FOUND (object not found)"
    assert describe_code(-4242) == "-4242 UNKNOWN (an error code kvstage does not know)"


def test_scheme_is_registered():
    assert STORAGE_SCHEMES["mooncake"] == ("kvstage.storage.mooncake.store", "open_mooncake_store")


def test_missing_mooncake_names_the_install_command(monkeypatch, fingerprint):
    # None in sys.modules makes `from mooncake.store import ...` raise ImportError, as when absent.
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(BackendUnavailableError, match="tools/install-mooncake.sh") as caught:
        MooncakeStore(fingerprint, "mooncake://127.0.0.1:1")
    assert "mooncake-transfer-engine-non-cuda" in str(caught.value)
    with pytest.raises(BackendUnavailableError, match="not installed"):
        open_storage("mooncake://127.0.0.1:1", fingerprint)
    assert mooncake_store.mooncake_available() is False


def test_a_client_may_bring_no_memory_to_the_pool():
    """``segment=0``: a client (a fleet engine that may die) whose pages live in other clients'
    segments; the other sizes stay positive."""
    assert parse_mooncake_url("mooncake://host:1?segment=0").global_segment_size == 0
    assert MooncakeConfig("host:1", global_segment_size=0).global_segment_size == 0
    with pytest.raises(InvalidArgumentError, match=r"^local_buffer_size: must be positive"):
        MooncakeConfig("host:1", local_buffer_size=0)
