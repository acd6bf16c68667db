"""A put whose pages fail because of an error says which: ``PutStatuses.error`` and, through
``write_pages``, ``WriteOutcome.error``.

Real file systems: a process in its own mount namespace (``unshare --mount --map-root-user``)
mounts a small tmpfs (full: ``ENOSPC``) and remounts it read-only (``EROFS``), then writes a
``FileStore`` there. Skipped, saying why, where the kernel allows no such namespace.
(Mooncake codes: ``mooncake/test_mooncake_clear_events.py``.)
"""

from __future__ import annotations

import errno
import textwrap

import pytest
import torch

from kvstage.errors import StorageError
from kvstage.kv_layout import KVLayout
from kvstage.offload.store_io import write_pages
from kvstage.storage import FileStore, LayoutFingerprint, MemoryStore, MissingPriorError, PutStatus, PutStatuses

from mount_namespace import run_in_mount_namespace

SCRIPT = textwrap.dedent(
    """
    import errno, json, os, subprocess, sys, torch
    from kvstage.kv_layout import KVLayout
    from kvstage.offload.store_io import write_pages
    from kvstage.storage import FileStore, LayoutFingerprint

    directory = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", directory], check=True)
    fp = LayoutFingerprint("tiny", KVLayout(2, 2, 8, 64, "float32"), 4)  # 32 KiB pages
    store = FileStore(fp, directory)
    page = torch.ones(fp.page_bytes // 4)
    answer = store.put(["a" * 64, "b" * 64, "c" * 64], [page, page, page])
    full = dict(statuses=[s.value for s in answer], errno=getattr(answer.error, "errno", None))
    outcome = write_pages(store, ["d" * 64], [page])
    full_outcome = dict(failed=outcome.failed_keys, errno=getattr(outcome.error, "errno", None))
    subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
    answer = store.put(["e" * 64], [page])
    ro = dict(statuses=[s.value for s in answer], errno=getattr(answer.error, "errno", None),
              exists=store.exists(["e" * 64]), leftovers=sorted(n for n in os.listdir(directory) if n.endswith(".tmp")))
    outcome = write_pages(store, ["f" * 64], [page])
    ro_outcome = dict(failed=outcome.failed_keys, errno=getattr(outcome.error, "errno", None))
    print(json.dumps(dict(full=full, full_outcome=full_outcome, ro=ro, ro_outcome=ro_outcome)))
    """
)


def test_a_full_and_a_read_only_directory_fail_puts_with_their_errno(tmp_path):
    seen = run_in_mount_namespace(SCRIPT, str(tmp_path))
    assert seen["full"]["statuses"][0] == "stored" and "failed" in seen["full"]["statuses"]
    assert seen["full"]["errno"] == errno.ENOSPC
    assert seen["full_outcome"] == {"failed": ["d" * 64], "errno": errno.ENOSPC}
    assert seen["ro"] == {"statuses": ["failed"], "errno": errno.EROFS, "exists": [False], "leftovers": []}
    assert seen["ro_outcome"] == {"failed": ["f" * 64], "errno": errno.EROFS}


def test_pages_refused_for_room_carry_no_error():
    fp = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 2)
    store = MemoryStore(fp, capacity_pages=1)
    page = torch.zeros(32)
    answer = store.put(["a", "b"], [page, page])  # "b" fits only by evicting "a", its predecessor
    assert isinstance(answer, PutStatuses) and answer == [PutStatus.STORED, PutStatus.FAILED]
    assert answer.error is None  # "b"'s predecessor "a" is missing only because the call refused it for room


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_pages_refused_for_a_missing_prior_say_which_key(kind, tmp_path):
    """A page whose chain predecessor is not stored is unreachable, so it is refused; the answer's
    error names the missing key (the first one: the pages after it in the call miss theirs too)."""
    fp = LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 2)
    store = MemoryStore(fp) if kind == "memory" else FileStore(fp, tmp_path)
    page = torch.zeros(32)
    answer = store.put(["c", "d"], [page, page], prior_key="b" * 64)
    assert answer == [PutStatus.FAILED, PutStatus.FAILED]
    assert isinstance(answer.error, MissingPriorError) and isinstance(answer.error, StorageError)
    assert answer.error.prior_key == "b" * 64 and "b" * 64 in str(answer.error)
    outcome = write_pages(store, ["e"], [page], prior_key="missing")
    assert (
        outcome.failed_keys == ["e"]
        and isinstance(outcome.error, MissingPriorError)
        and outcome.error.prior_key == "missing"
    )
    assert store.put(["b" * 64], [page]) == [PutStatus.STORED]
    assert store.put(["c", "d"], [page, page], prior_key="b" * 64) == [PutStatus.STORED, PutStatus.STORED]


def test_write_pages_takes_the_error_a_store_answers_with():
    class Refusing(MemoryStore):
        def _put(self, full_keys, pages, full_prior_key=None):
            return PutStatuses([PutStatus.FAILED] * len(full_keys), OSError(errno.EACCES, "Permission denied"))

    store = Refusing(LayoutFingerprint("tiny", KVLayout(2, 2, 1, 4, "float32"), 2))
    outcome = write_pages(store, ["a", "b", "a"], [torch.zeros(32)] * 3)
    assert outcome.failed_keys == ["a", "b"] and outcome.deduplicated == 1
    assert isinstance(outcome.error, OSError) and outcome.error.errno == errno.EACCES
    assert store.stats.pages_failed == 2


MANAGER_SCRIPT = textwrap.dedent(
    """
    import json, subprocess, sys
    sys.path.insert(0, sys.argv[2])  # the tests' rig
    from offload_rig import make_rig
    from kvstage.kv_layout import KVLayout
    from kvstage.storage import FileStore, LayoutFingerprint

    directory = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", directory], check=True)
    store = FileStore(LayoutFingerprint("rig", KVLayout(2, 2, 1, 4, "int32"), 4), directory)
    # read-only after the open (a read-only directory at open is refused: test_store_file.py)
    subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
    failures = []
    rig = make_rig(page_size=4, offload_stride=8, storage=store, store_prompt=True,
                   on_storage_failure=lambda req, keys, error: failures.append((len(keys), getattr(error, "errno", None))))
    req = rig.new_request("r", range(4), 16)
    for token in range(100, 109):
        rig.decode(req, token)
    rig.manager.finish(req)
    rig.copy_stream.complete_all()
    rig.manager.poll()
    print(json.dumps(dict(failures=failures, failed=rig.manager.metrics.pages_failed)))
    """
)


def test_the_managers_on_storage_failure_gets_the_errno_of_a_read_only_directory(tmp_path):
    from support import REPO_ROOT

    seen = run_in_mount_namespace(MANAGER_SCRIPT, str(tmp_path), str(REPO_ROOT / "tests"))
    # The prompt page's write fails with EROFS; the decode pages after it are refused by the
    # chain rule (their predecessor is not stored), which is no error.
    assert seen == {"failures": [[1, errno.EROFS], [2, None]], "failed": 3}
