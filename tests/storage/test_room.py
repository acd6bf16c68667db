"""Room accounting (kvstage.storage.room.Room) without files: reserve, commit, abort, touch,
pin and unpin, chain-aware eviction, and ``used + held <= capacity`` through any mix of them."""

from __future__ import annotations

import random

from kvstage.storage.room import Room


def filled(capacity: int, *pages: tuple[str, int, str | None]) -> Room[str, str]:
    """A room holding ``pages`` (key, size, prior), each reserved and committed in turn."""
    room: Room[str, str] = Room(capacity)
    for key, size, prior in pages:
        assert room.reserve(size)
        room.commit(key, f"file-{key}", size, prior, held=size)
    return room


def test_reserve_holds_room_until_commit_makes_it_the_page_s_or_abort_gives_it_back():
    room: Room[str, str] = Room(100)
    assert room.reserve(60) and (room.used, room.held) == (0, 60)
    assert not room.reserve(41) and room.held == 60  # refused: nothing held
    assert room.reserve(40) and room.held == 100
    assert room.commit("a", "file-a", 60, None, held=60) is None
    assert (room.used, room.held, len(room), "a" in room) == (60, 40, 1, True)
    room.abort(40)
    assert (room.used, room.held) == (60, 0)
    assert room.values() == ["file-a"]


def test_commit_over_an_entry_indexed_meanwhile_counts_its_bytes_once():
    room = filled(100)
    room.add("a", "adopted-a", 30, None)  # another process's file, indexed by a reader
    assert room.reserve(30)
    assert room.commit("a", "file-a", 30, None, held=30) == "adopted-a"
    assert (room.used, room.held, room.values()) == (30, 0, ["file-a"])


def test_evict_takes_chain_tails_least_recently_used_first():
    room = filled(100, ("a", 10, None), ("b", 10, "a"), ("x", 10, None))
    # a has a stored successor: never a candidate while b is there
    assert room.evict() == ("b", "file-b") and room.used == 20
    assert room.evict() == ("a", "file-a")  # older than x, now a tail
    room.touch("x")
    assert room.evict() == ("x", "file-x") and room.evict() is None and room.used == 0


def test_touch_makes_a_page_the_most_recently_used():
    room = filled(100, ("a", 10, None), ("b", 10, None))
    assert room.touch("a") is not None and room.touch("missing") is None
    assert room.evict() == ("b", "file-b")


def test_pinned_pages_are_never_evicted_until_unpinned_as_often():
    room = filled(100, ("a", 10, None), ("b", 10, None))
    room.pin(["a"])
    room.pin(["a", "b"])
    assert room.evict() is None
    room.unpin(["a", "b"])
    assert room.evict() == ("b", "file-b")  # unpinned; a is pinned once more
    assert room.evict() is None and "a" in room
    room.unpin(["a"])
    assert room.evict() == ("a", "file-a")


def test_pages_added_past_the_capacity_are_evicted_by_the_next_reserve():
    room: Room[str, str] = Room(25)
    for key in "abc":
        room.add(key, f"file-{key}", 10, None)  # found at open: no reservation
    assert room.used == 30 > room.capacity_bytes
    assert not room.reserve(0)
    assert room.evict() == ("a", "file-a") and room.reserve(0)
    assert room.used + room.held <= room.capacity_bytes


def test_remove_and_clear_forget_pages_and_their_bytes():
    room = filled(100, ("a", 10, None), ("b", 20, "a"))
    assert room.remove("b") == "file-b" and room.remove("b") is None and room.used == 10
    assert room.reserve(5)
    room.clear()
    assert (len(room), room.used, room.held) == (0, 0, 5)  # held room stays held


def test_used_plus_held_never_exceeds_the_capacity_through_random_lifecycles():
    rng = random.Random(26)
    room: Room[int, int] = Room(1000)
    in_flight: list[tuple[int, int]] = []  # (key, held)
    sizes: dict[int, int] = {}  # committed pages
    next_key = evicted = 0
    for _ in range(5000):
        action = rng.random()
        if action < 0.45:
            size = rng.randint(1, 300)
            while not room.reserve(size):
                victim = room.evict()
                if victim is None:
                    break
                del sizes[victim[0]]
                evicted += 1
            else:
                in_flight.append((next_key, size))
                next_key += 1
        elif action < 0.75 and in_flight:
            key, held = in_flight.pop(rng.randrange(len(in_flight)))
            prior = rng.choice([None, key - 1])
            room.commit(key, key, held, prior if prior in room else None, held=held)
            sizes[key] = held
        elif action < 0.9 and in_flight:
            room.abort(in_flight.pop(rng.randrange(len(in_flight)))[1])
        else:
            room.touch(rng.randrange(max(next_key, 1)))
        assert room.used + room.held <= room.capacity_bytes
        assert room.held == sum(held for _, held in in_flight)
        assert room.used == sum(sizes.values()) and sorted(room.values()) == sorted(sizes)
    assert evicted > 100 and sizes  # the run evicted for room, and holds pages at the end
