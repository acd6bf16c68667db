"""MooncakeStore against a real mooncake_master: clear() of one key space, store events, and
the cause of a failed put."""

from __future__ import annotations

import logging
import uuid

import torch

from kvstage.errors import StorageError
from kvstage.kv_layout import KVLayout
from kvstage.storage import LayoutFingerprint, PutStatus
from kvstage.storage.mooncake.status import MooncakeCodeError
from kvstage.storage.mooncake.store import MooncakeStore

from mooncake_master import free_port

LAYOUT = KVLayout(2, 2, 2, 64, "bfloat16")  # 16 KiB pages of 16 tokens


def fingerprint(model: str) -> LayoutFingerprint:
    return LayoutFingerprint(model, LAYOUT, 16)


def pages(n: int, fp: LayoutFingerprint, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return list(torch.randn(n, fp.page_bytes // 2, generator=generator).to(torch.bfloat16))


def new_keys(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


def test_clear_removes_this_key_space_only_also_what_other_clients_stored(mooncake_master):
    fp = fingerprint(f"clear-{uuid.uuid4().hex[:8]}")
    other_fp = fingerprint(f"other-{uuid.uuid4().hex[:8]}")
    with (
        MooncakeStore(fp, mooncake_master.url()) as store,
        MooncakeStore(fp, mooncake_master.url()) as peer,
        MooncakeStore(other_fp, mooncake_master.url()) as other,
    ):
        mine, theirs = new_keys(4), new_keys(3)
        data = pages(4, fp, seed=1)
        assert store.put(mine, data) == [PutStatus.STORED] * 4
        assert peer.put(theirs, pages(3, fp, seed=2)) == [PutStatus.STORED] * 3
        assert other.put(mine, pages(4, other_fp, seed=3)) == [PutStatus.STORED] * 4
        store.take_events()

        assert store.clear() == 7  # the peer's pages of this key space too
        assert store.exists(mine) == [False] * 4 and peer.exists(theirs) == [False] * 3
        assert other.exists(mine) == [True] * 4
        events = store.take_events()
        assert sorted(e.key for e in events) == sorted(mine + theirs)  # named through the admin listing
        assert {(e.kind, e.tier, e.page_bytes, e.key_space) for e in events} == {
            ("removed", "mooncake", fp.page_bytes, fp.prefix())
        }
        assert store.stats.pages_removed == 7
        # The peer asked for its pages and found them gone: it reports them evicted (it cannot
        # tell who removed them).
        assert sorted(e.key for e in peer.take_events() if e.kind == "evicted") == sorted(theirs)
        assert store.clear() == 0
        assert store.put(mine, data) == [PutStatus.STORED] * 4  # written again, not deduplicated
        back = [torch.zeros_like(p) for p in data]
        assert store.get(mine, back) == [True] * 4 and all(torch.equal(a, b) for a, b in zip(back, data))


def test_two_engines_b_clearing_announces_the_pages_a_stored(mooncake_master):
    # Two engines (two clients) on one master: A stores, B stores, B clears. B's events name
    # every page it removed, A's included, each once; A's stream has only what it stored.
    fp = fingerprint(f"two-{uuid.uuid4().hex[:8]}")
    other_fp = fingerprint(f"keep-{uuid.uuid4().hex[:8]}")
    with (
        MooncakeStore(fp, mooncake_master.url()) as a,
        MooncakeStore(fp, mooncake_master.url()) as b,
        MooncakeStore(other_fp, mooncake_master.url()) as other,
    ):
        a_keys, b_keys, shared = new_keys(5), new_keys(2), new_keys(2)
        assert a.put(a_keys + shared, pages(7, fp, seed=11)) == [PutStatus.STORED] * 7
        assert b.put(b_keys + shared, pages(4, fp, seed=12)) == [PutStatus.STORED] * 2 + [PutStatus.DEDUPLICATED] * 2
        assert other.put(a_keys, pages(5, other_fp, seed=13)) == [PutStatus.STORED] * 5
        assert [e.kind for e in b.take_events()] == ["stored"] * 2
        a.take_events()

        assert b.clear() == 9
        events = b.take_events()
        assert sorted(e.key for e in events) == sorted(a_keys + b_keys + shared)  # each once
        assert {e.kind for e in events} == {"removed"} and b.stats.events_removed == 9 == b.stats.pages_removed
        assert a.take_events() == [] and other.exists(a_keys) == [True] * 5
        assert b.clear() == 0 and b.take_events() == []


def test_clear_without_an_admin_server_names_this_clients_pages_only(mooncake_master, caplog):
    fp = fingerprint(f"noadmin-{uuid.uuid4().hex[:8]}")
    with (
        MooncakeStore(fp, mooncake_master.url()) as a,
        MooncakeStore(fp, mooncake_master.url(admin=None)) as b,  # no admin server given
        MooncakeStore(fp, mooncake_master.url(admin=f"127.0.0.1:{free_port()}")) as c,  # nothing listens
    ):
        a_keys, b_keys, c_keys = new_keys(3), new_keys(2), new_keys(2)
        a.put(a_keys, pages(3, fp, seed=14))
        b.put(b_keys, pages(2, fp, seed=15))
        b.take_events()
        assert b.clear() == 5
        assert sorted(e.key for e in b.take_events()) == sorted(b_keys)

        a.put(a_keys, pages(3, fp, seed=14))
        c.put(c_keys, pages(2, fp, seed=16))
        c.take_events()
        with caplog.at_level(logging.WARNING, logger="kvstage.storage.mooncake.store"):
            assert c.clear() == 5  # the clear itself does not need the admin server
        assert sorted(e.key for e in c.take_events()) == sorted(c_keys)
        assert any(
            "get_all_keys" in r.getMessage() and "only this client's pages" in r.getMessage() for r in caplog.records
        )
        assert a.exists(a_keys) == [False] * 3


class FailingRemoves:
    """A Mooncake client whose ``batch_remove`` removes only the first ``n`` keys and answers
    OBJECT_HAS_LEASE (-706) for the rest (a lease a forced remove should not meet)."""

    def __init__(self, inner, n: int) -> None:
        self._inner, self._n = inner, n

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def batch_remove(self, keys, force):
        return list(self._inner.batch_remove(keys[: self._n], force)) + [-706] * len(keys[self._n :])


def test_clear_sweeps_what_batch_remove_left_and_names_what_it_removed(mooncake_master, caplog):
    fp = fingerprint(f"sweep-{uuid.uuid4().hex[:8]}")
    with MooncakeStore(fp, mooncake_master.url()) as a, MooncakeStore(fp, mooncake_master.url()) as b:
        keys = new_keys(6)
        a.put(keys, pages(6, fp, seed=17))
        b._store = FailingRemoves(b._store, 4)  # the client object: no public seam for its calls
        with caplog.at_level(logging.WARNING, logger="kvstage.storage.mooncake.store"):
            assert b.clear() == 6
        named = [e.key for e in b.take_events()]
        assert len(named) == 4 and set(named) <= set(keys)
        assert a.exists(keys) == [False] * 6
        assert any("swept 2 more pages by regex" in r.getMessage() for r in caplog.records)
        assert any("failed for 2 of 6 pages: -706 OBJECT_HAS_LEASE" in r.getMessage() for r in caplog.records)


def test_stored_events_for_stored_pages_only(mooncake_master):
    fp = fingerprint(f"events-{uuid.uuid4().hex[:8]}")
    with MooncakeStore(fp, mooncake_master.url(), event_capacity=3) as store:
        keys = new_keys(5)
        assert store.put(keys[:2], pages(2, fp, seed=4)) == [PutStatus.STORED] * 2
        assert store.put(keys[:2], pages(2, fp, seed=4)) == [PutStatus.DEDUPLICATED] * 2
        events = store.take_events()
        assert [(e.key, e.kind, e.tier, e.key_space) for e in events] == [
            (k, "stored", "mooncake", fp.prefix()) for k in keys[:2]
        ]
        store.put(keys[2:], pages(3, fp, seed=5))
        store.put([keys[0] + "x", keys[1] + "x"], pages(2, fp, seed=6))
        assert [e.key for e in store.take_events()] == [keys[4], keys[0] + "x", keys[1] + "x"]  # the oldest dropped
        assert store.stats.events_dropped == 2 and store.stats.events_stored == 7


def test_put_failure_carries_its_cause(private_master):
    fp = fingerprint(f"fail-{uuid.uuid4().hex[:8]}")
    store = MooncakeStore(fp, private_master.url(rpc_timeout_ms=2000))
    try:
        assert store.put(new_keys(1), pages(1, fp, seed=7)).error is None
        private_master.kill()
        answer = store.put(new_keys(2), pages(2, fp, seed=8))
        assert answer == [PutStatus.FAILED] * 2
        assert isinstance(answer.error, StorageError)
        if isinstance(answer.error, MooncakeCodeError):  # the first call after the kill reaches Mooncake
            assert answer.error.code in (-900, -901)
        answer = store.put(new_keys(1), pages(1, fp, seed=9))  # then the port check fails at once
        assert answer == [PutStatus.FAILED] and "unreachable" in str(answer.error)
    finally:
        store.close()


def test_a_full_segment_fails_puts_with_their_code_and_master_evictions_show_when_asked(mooncake_master):
    # 320 MiB of 1 MiB pages into a 16 MB segment: the master evicts, and puts that find no
    # room fail with a Mooncake code.
    fp = fingerprint(f"full-{uuid.uuid4().hex[:8]}")
    big = LayoutFingerprint(fp.model_id, KVLayout(2, 2, 16, 128, "bfloat16"), 64)  # 1 MiB pages
    with MooncakeStore(big, mooncake_master.url(segment="16MiB", buffer="16MiB")) as store:
        batches = [new_keys(8) for _ in range(40)]
        answers = [store.put(keys, pages(8, big, seed=10 + i)) for i, keys in enumerate(batches)]
        failed = [answer for answer in answers if PutStatus.FAILED in answer]
        assert failed and all(isinstance(a.error, MooncakeCodeError) and a.error.code < 0 for a in failed)
        assert all(a.error is None for a in answers if PutStatus.FAILED not in a)
        stored = [k for keys, a in zip(batches, answers) for k, status in zip(keys, a) if status is PutStatus.STORED]
        store.take_events()
        found = store.exists(stored)
        gone = {k for k, hit in zip(stored, found) if not hit}
        assert len(gone) > len(stored) // 2  # at most 16 of 1 MiB fit
        events = store.take_events()
        assert {e.key for e in events} == gone and {e.kind for e in events} == {"evicted"}
        assert store.exists(sorted(gone)[:3]) == [False] * 3 and store.take_events() == []  # reported once
