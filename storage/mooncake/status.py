"""Mooncake store return codes: names, meanings, and the ones kvstage acts on.

The table is Mooncake's ``ErrorCode`` enum (``mooncake-store/include/types.h``), plus ``-901``
RPC_TIMEOUT as observed from the 0.3.13 client.
"""

from __future__ import annotations

from kvstage.errors import StorageError

# Mooncake's ErrorCode (mooncake-store/include/types.h): code -> (name, meaning).
MOONCAKE_ERROR_CODES: dict[int, tuple[str, str]] = {
    -1: ("INTERNAL_ERROR", "internal error"),
    -10: ("BUFFER_OVERFLOW", "insufficient buffer space"),
    -100: ("SHARD_INDEX_OUT_OF_RANGE", "shard index out of bounds"),
    -101: ("SEGMENT_NOT_FOUND", "no available segment"),
    -102: ("SEGMENT_ALREADY_EXISTS", "segment already exists"),
    -103: ("CLIENT_NOT_FOUND", "client not found"),
    -200: ("NO_AVAILABLE_HANDLE", "no space left in the store's segments"),
    -300: ("INVALID_VERSION", "invalid version"),
    -400: ("INVALID_KEY", "invalid key"),
    -500: ("WRITE_FAIL", "write failed"),
    -600: ("INVALID_PARAMS", "invalid parameters"),
    -601: ("ILLEGAL_CLIENT", "illegal client for this operation"),
    -700: ("INVALID_WRITE", "invalid write"),
    -701: ("INVALID_READ", "invalid read"),
    -702: ("INVALID_REPLICA", "invalid replica"),
    -703: ("REPLICA_IS_NOT_READY", "replica not ready (a put still in progress)"),
    -704: ("OBJECT_NOT_FOUND", "object not found"),
    -705: ("OBJECT_ALREADY_EXISTS", "object already exists"),
    -706: ("OBJECT_HAS_LEASE", "object has a lease"),
    -707: ("LEASE_EXPIRED", "lease expired before the transfer completed"),
    -708: ("OBJECT_HAS_REPLICATION_TASK", "object has a replication task"),
    -709: ("OBJECT_NO_REPLICATION_TASK", "object has no replication task"),
    -710: ("REPLICA_NOT_FOUND", "replica not found"),
    -711: ("REPLICA_ALREADY_EXISTS", "replica already exists"),
    -712: ("REPLICA_IS_GONE", "replica is gone"),
    -713: ("REPLICA_NOT_IN_LOCAL_MEMORY", "replica not in this node's memory"),
    -800: ("TRANSFER_FAIL", "transfer failed"),
    -900: ("RPC_FAIL", "RPC to the master failed (master down or unreachable?)"),
    -901: ("RPC_TIMEOUT", "RPC to the master timed out (master hung or overloaded?)"),
    -1000: ("ETCD_OPERATION_ERROR", "etcd operation failed"),
    -1001: ("ETCD_KEY_NOT_EXIST", "key not found in etcd"),
    -1002: ("ETCD_TRANSACTION_FAIL", "etcd transaction failed"),
    -1003: ("ETCD_CTX_CANCELLED", "etcd context cancelled"),
    -1010: ("UNAVAILABLE_IN_CURRENT_STATUS", "unavailable in the master's current status"),
    -1011: ("UNAVAILABLE_IN_CURRENT_MODE", "unavailable in the master's current mode"),
    -1100: ("FILE_NOT_FOUND", "file not found"),
    -1101: ("FILE_OPEN_FAIL", "file open failed"),
    -1102: ("FILE_READ_FAIL", "file read failed"),
    -1103: ("FILE_WRITE_FAIL", "file write failed"),
    -1104: ("FILE_INVALID_BUFFER", "invalid file buffer"),
    -1105: ("FILE_LOCK_FAIL", "file lock failed"),
    -1106: ("FILE_INVALID_HANDLE", "invalid file handle"),
    -1200: ("BUCKET_NOT_FOUND", "bucket not found"),
    -1201: ("BUCKET_ALREADY_EXISTS", "bucket already exists"),
    -1202: ("KEYS_EXCEED_BUCKET_LIMIT", "keys exceed the bucket limit"),
    -1203: ("KEYS_ULTRA_LIMIT", "keys over the limit"),
    -1300: ("UNABLE_OFFLOAD", "offload not enabled"),
    -1301: ("UNABLE_OFFLOADING", "unable to offload"),
    -1400: ("TASK_NOT_FOUND", "task not found"),
    -1401: ("TASK_PENDING_LIMIT_EXCEEDED", "too many pending tasks"),
}

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
RPC_TIMEOUT = -901
MASTER_DOWN_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})


class MooncakeCodeError(StorageError):
    """A Mooncake call answered a negative return code for a page (see :func:`describe_code`).

    Attributes:
        code: the return code (e.g. -200 NO_AVAILABLE_HANDLE).
    """

    def __init__(self, operation: str, code: int) -> None:
        super().__init__(f"mooncake: {operation} failed with {describe_code(code)}")
        self.code = code


def describe_code(code: int) -> str:
    """``"-900 RPC_FAIL (RPC to the master failed ...)"`` for a Mooncake return code."""
    name, meaning = MOONCAKE_ERROR_CODES.get(code, ("UNKNOWN", "an error code kvstage does not know"))
    return f"{code} {name} ({meaning})"
