"""ChainIndex.holds answers from a set kept beside the entries: it must follow every add,
remove, eviction and re-add."""

from __future__ import annotations

import random

from kvstage.storage.chain_index import ChainIndex


def test_holds_follows_add_remove_and_eviction():
    rng = random.Random(7)
    index: ChainIndex[str, int] = ChainIndex()
    universe = [f"k{i}" for i in range(40)]
    for step in range(400):
        key = rng.choice(universe)
        action = rng.random()
        if action < 0.5 and key not in index:
            index.add(key, step, rng.choice([None, *universe]))
        elif action < 0.75:
            index.remove(key)
        else:
            index.pop_victim()
        assert index.holds(universe) == [k in set(index.keys()) for k in universe]
    assert sum(index.holds(universe)) == len(index)
