"""Mooncake client configuration: :class:`MooncakeConfig`, from a ``mooncake://`` URL or a dict.

Field names follow Mooncake's docs and JSON config: ``master_server_address``,
``metadata_server``, ``local_hostname``, ``protocol``, ``device_name``, ``global_segment_size``,
``local_buffer_size``; ``admin_address`` and ``watch_s`` are kvstage's (the master's admin
HTTP server, for announcing other clients' pages).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlsplit

from kvstage.errors import InvalidArgumentError
from kvstage.storage.sizes import parse_size as parse_any_size

PROTOCOLS = ("tcp", "rdma")

# Short URL query names -> config field names (the long names are accepted too).
_URL_ALIASES = {
    "metadata": "metadata_server",
    "segment": "global_segment_size",
    "buffer": "local_buffer_size",
    "device": "device_name",
    "bounce": "bounce_bytes",
    "admin": "admin_address",
    "watch": "watch_s",
    "soft_pin": "soft_pin_ms",
}
# What a mooncake:// URL's query may name, as the README teaches it (short names first).
URL_QUERY_NAMES = (
    *_URL_ALIASES,
    "protocol",
    "local_hostname",
    "connect_timeout_s",
    "rpc_timeout_ms",
    "setup_retries",
)
_SIZE_FIELDS = ("global_segment_size", "local_buffer_size", "bounce_bytes")
# A client may bring no memory to the pool (its pages then live in other clients' segments).
_ZERO_ALLOWED = ("global_segment_size",)
# Names other Mooncake APIs use for the same fields.
_DICT_ALIASES = {"master_server_addr": "master_server_address", "rdma_devices": "device_name"}


def _minimum(field: str) -> int:
    return 0 if field in _ZERO_ALLOWED else 1


def parse_size(value: int | str, argument: str, *, minimum: int = 1) -> int:
    """Bytes from an int or a size string (:func:`kvstage.storage.sizes.parse_size`: ``4096``,
    ``"512MB"`` = 512 * 1000**2, ``"1GiB"`` = 1024**3), at least ``minimum`` (0 or 1).

    Raises:
        InvalidArgumentError: not a size, or below ``minimum``; names ``argument``.
    """
    size = parse_any_size(value, argument)
    if size < minimum:
        raise InvalidArgumentError(f"{argument}: must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the Mooncake cluster is and what this client brings to it.

    Attributes:
        master_server_address: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata_server: the transfer-engine metadata service: ``http://host:port/metadata``
            (the master's ``-enable_http_metadata_server``), ``etcd://...``, or
            ``"P2PHANDSHAKE"`` (no metadata service; the default).
        local_hostname: the address other Mooncake nodes reach this one at. Default: the local
            address of the route to the master (loopback for a local master).
        protocol: ``"tcp"`` or ``"rdma"``.
        device_name: RDMA devices, comma-separated (e.g. ``"mlx5_0,mlx5_1"``); ``""`` lets
            Mooncake discover them.
        global_segment_size: bytes of this process's memory given to the distributed pool;
            with one client this is the whole store's capacity. 0: this client brings none, its
            pages are placed in other clients' segments (an engine that may die without taking
            pages with it: in Mooncake's embedded mode an object lives in one client's segment).
        local_buffer_size: bytes of Mooncake's own registered transfer buffer in this process.
        bounce_bytes: size of each of kvstage's bounce buffers for pages outside registered
            memory (rounded down to whole pages, at least one); one per call bouncing at once,
            at most ``store.BOUNCE_BUFFERS_LIMIT`` (4), made on first use.
        connect_timeout_s: seconds to wait for a TCP connection to the master (and an HTTP
            metadata server) before setup, so an absent master fails fast.
        rpc_timeout_ms: when set, exported as ``MC_RPC_TIMEOUT_MS`` before setup: how long one
            RPC to the master may take (Mooncake's default is 30 s). Process-wide.
        setup_retries: when set, exported as ``MC_STORE_CLIENT_SETUP_RETRIES`` (Mooncake's
            default 20, about 4.5 s each when the master does not answer). Process-wide.
        admin_address: ``host:port`` of the master's admin HTTP server (its ``-metrics_host`` and
            ``-metrics_port``, 9003 by default), or None. Set, ``clear`` lists the key space
            there first (``GET /get_all_keys``) and announces every page it removes, other
            clients' included; None: only the pages this client stored.
        watch_s: seconds between listings of the key space on the admin server by a background
            thread that announces pages which vanished (the master evicted them) as
            ``evicted``, other clients' included; None: no watcher. Needs ``admin_address``.
        soft_pin_ms: when set, every page this client puts is soft-pinned for that many
            milliseconds (``ReplicateConfig`` with ``SoftPinAction.ENABLE`` and
            ``soft_pin_ttl_ms``): a master started with
            ``-allow_evict_soft_pinned_objects=false`` evicts no page younger than that, so a
            watcher listing more often sees every eviction. None: Mooncake's default (no pin).
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str | None = None
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 64 << 20
    bounce_bytes: int = 64 << 20
    connect_timeout_s: float = 2.0
    rpc_timeout_ms: int | None = None
    setup_retries: int | None = None
    admin_address: str | None = None
    watch_s: float | None = None
    soft_pin_ms: int | None = None

    def __post_init__(self) -> None:
        host, port = split_host_port(self.master_server_address, "master_server_address")
        object.__setattr__(self, "master_server_address", f"{host}:{port}")
        if not isinstance(self.metadata_server, str) or not self.metadata_server:
            raise InvalidArgumentError("metadata_server: must be a non-empty string (e.g. 'P2PHANDSHAKE')")
        if self.protocol not in PROTOCOLS:
            raise InvalidArgumentError(f"protocol: must be one of {PROTOCOLS}, got {self.protocol!r}")
        for name in _SIZE_FIELDS:
            object.__setattr__(self, name, parse_size(getattr(self, name), name, minimum=_minimum(name)))
        timeout = float(self.connect_timeout_s)
        if not timeout > 0:
            raise InvalidArgumentError(f"connect_timeout_s: must be positive, got {self.connect_timeout_s!r}")
        object.__setattr__(self, "connect_timeout_s", timeout)
        for name in ("rpc_timeout_ms", "setup_retries", "soft_pin_ms"):
            value = getattr(self, name)
            if value is not None:
                try:
                    number = int(value)
                except (TypeError, ValueError):
                    number = 0
                if number < 1:
                    raise InvalidArgumentError(f"{name}: must be a positive int, got {value!r}")
                object.__setattr__(self, name, number)
        if self.admin_address is not None:
            host, port = split_host_port(self.admin_address, "admin_address")
            object.__setattr__(self, "admin_address", f"{host}:{port}")
        if self.watch_s is not None:
            try:
                watch = float(self.watch_s)
            except (TypeError, ValueError):
                watch = float("nan")
            if not watch > 0:
                raise InvalidArgumentError(f"watch_s: must be positive seconds, got {self.watch_s!r}")
            if self.admin_address is None:
                raise InvalidArgumentError("watch_s: needs admin_address (the master's admin HTTP server, host:port)")
            object.__setattr__(self, "watch_s", watch)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "MooncakeConfig":
        """Build from a dict with the field names above (Mooncake's ``master_server_addr`` and
        ``rdma_devices`` are accepted as aliases).

        Raises:
            InvalidArgumentError: an unknown key, a missing ``master_server_address`` or a bad value.
        """
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = _DICT_ALIASES.get(key, key)
            if name not in known:
                raise InvalidArgumentError(f"mooncake config: unknown key {key!r}; known: {sorted(known)}")
            kwargs[name] = value
        if "master_server_address" not in kwargs:
            raise InvalidArgumentError("master_server_address: required (host:port of mooncake_master)")
        for name in ("local_hostname", "admin_address", "watch_s", "soft_pin_ms"):
            if kwargs.get(name) == "":
                kwargs[name] = None
        return cls(**kwargs)


def parse_mooncake_url(url: str) -> MooncakeConfig:
    """Parse ``mooncake://MASTER_HOST:PORT?metadata=...&protocol=tcp&segment=1GiB&buffer=64MiB``.

    Query names (:data:`URL_QUERY_NAMES`): the short ``metadata``, ``segment``, ``buffer``,
    ``device``, ``bounce``, ``admin``, ``watch``, ``soft_pin``, and ``protocol``, ``local_hostname``, ``connect_timeout_s``,
    ``rpc_timeout_ms``, ``setup_retries``; the :class:`MooncakeConfig` field names of the short
    ones are accepted too. Sizes take the syntax of every storage URL
    (:mod:`kvstage.storage.sizes`). Values are percent-decoded, so a metadata URL may be given
    plainly (``metadata=http://127.0.0.1:8080/metadata``) or encoded.

    Raises:
        InvalidArgumentError: not a ``mooncake://`` URL, no master address, a repeated or
            unknown query name (the message lists the query names above), or a bad value (a
            size's message names the query name as given, e.g. ``url: segment: ...``).
    """
    if not isinstance(url, str) or not url.startswith("mooncake://"):
        raise InvalidArgumentError(f"url: must start with 'mooncake://', got {url!r}")
    parts = urlsplit(url)
    if not parts.netloc:
        raise InvalidArgumentError(f"url: no master address in {url!r}; expected mooncake://HOST:PORT?...")
    values: dict[str, Any] = {"master_server_address": parts.netloc}
    long_names = set(_URL_ALIASES.values())
    for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if key not in URL_QUERY_NAMES and key not in long_names:
            raise InvalidArgumentError(
                f"url: unknown query name {key!r} in {url!r}; known: {', '.join(URL_QUERY_NAMES)}"
            )
        name = _URL_ALIASES.get(key, key)
        if name in values:
            raise InvalidArgumentError(f"url: {key!r} given twice in {url!r}")
        values[name] = parse_size(value, f"url: {key}", minimum=_minimum(name)) if name in _SIZE_FIELDS else value
    return MooncakeConfig.from_mapping(values)


def split_host_port(address: str, argument: str) -> tuple[str, int]:
    """``"host:port"`` (brackets around an IPv6 host allowed) as ``(host, port)``.

    Raises:
        InvalidArgumentError: not ``host:port`` with a port in 1..65535; names ``argument``.
    """
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgumentError(f"{argument}: must be 'host:port', got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgumentError(f"{argument}: must be 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port_text)
