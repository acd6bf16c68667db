"""A ``file:`` directory shared by processes of one key space: the prefill/decode split continues
chains across processes, and a reader's corrupt-page cleanup never deletes a page rewritten since.

Real processes (``subprocess``), each with its own ``FileStore`` on one directory, ordered by
lines on their stdin/stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from kvstage.hashing import prefill_page_keys
from kvstage.kv_layout import KVLayout
from kvstage.storage import FileStore, LayoutFingerprint, PutStatus

FP = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 4)  # 256 B a page
KEYS = prefill_page_keys(list(range(20)), 4)  # one chain of 5 pages: 3 prompt pages, 2 decode

PRELUDE = textwrap.dedent(
    """
    import json, sys, torch
    from kvstage.kv_layout import KVLayout
    from kvstage.storage import FileStore, LayoutFingerprint
    FP = LayoutFingerprint("tiny/model", KVLayout(2, 2, 1, 4, "float32"), 4)
    KEYS = json.loads(sys.argv[2])
    def page(value):
        return torch.arange(64, dtype=torch.float32).add_(value)
    def say(**values):
        print(json.dumps(values), flush=True)
    def wait():
        assert sys.stdin.readline().strip() == "go"
    store = FileStore(FP, sys.argv[1])
    """
)

PREFILL = PRELUDE + textwrap.dedent(
    """
    answer = store.put(KEYS[:3], [page(i) for i in range(3)])
    say(statuses=[s.value for s in answer])
    """
)

DECODE = PRELUDE + textwrap.dedent(
    """
    say(opened=True)
    wait()  # the prefill process has stored the prompt pages meanwhile
    exists = store.exists(KEYS[:3])
    answer = store.put(KEYS[3:], [page(3), page(4)], prior_key=KEYS[2])
    back = [torch.zeros(64) for _ in KEYS]
    hits = store.get(KEYS, back)
    say(exists=exists, statuses=[s.value for s in answer], hits=hits,
        equal=[torch.equal(b, page(i)) for i, b in enumerate(back)])
    """
)

# A reader that stops between reading a corrupt page and cleaning it up, until told to go on.
READER = PRELUDE + textwrap.dedent(
    """
    # Fault injection before a corrupt page's cleanup: FileStore has no public hook there.
    drop = store._drop_corrupt
    def paused(*args):
        say(read_corrupt=True)
        wait()  # a writer heals the page meanwhile
        drop(*args)
    store._drop_corrupt = paused
    hit = store.get([KEYS[0]], [torch.zeros(64)])
    say(hit=hit)
    """
)

WRITER = PRELUDE + textwrap.dedent(
    """
    answer = store.put([KEYS[0]], [page(7)])
    say(statuses=[s.value for s in answer])
    """
)


def start(script: str, directory) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, str(directory), json.dumps(KEYS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def line(process: subprocess.Popen) -> dict:
    text = process.stdout.readline()
    assert text, f"the process said nothing; stderr: {process.stderr.read()}"
    return json.loads(text)


def run(script: str, directory) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", script, str(directory), json.dumps(KEYS)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def go(process: subprocess.Popen) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()


def test_a_decode_process_continues_the_chain_a_prefill_process_stored_after_it_opened(tmp_path):
    decode = start(DECODE, tmp_path)
    try:
        assert line(decode) == {"opened": True}
        assert run(PREFILL, tmp_path) == {"statuses": ["stored"] * 3}
        go(decode)
        seen = line(decode)
    finally:
        decode.kill()
        decode.wait()
    assert seen == {"exists": [True] * 3, "statuses": ["stored"] * 2, "hits": [True] * 5, "equal": [True] * 5}
    # A third process sees one whole chain, links included (it evicts from the tail).
    store = FileStore(FP, tmp_path, capacity_bytes=4 * (FileStore(FP, tmp_path).used_bytes // 5))
    assert store.exists(KEYS) == [True] * 4 + [False]
    assert store.stats.pages_evicted == 1


def test_a_readers_cleanup_never_deletes_the_page_a_writer_healed_meanwhile(tmp_path):
    store = FileStore(FP, tmp_path)
    store.put([KEYS[0]], [torch.zeros(64)])
    path = store.path_of(KEYS[0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # corrupt at its size: exists() still says True
    path.write_bytes(bytes(data))
    reader = start(READER, tmp_path)
    try:
        assert line(reader) == {"read_corrupt": True}
        assert run(WRITER, tmp_path) == {"statuses": ["stored"]}  # the writer drops the corrupt file and heals it
        go(reader)
        assert line(reader) == {"hit": [False]}  # it read the corrupt bytes: a miss, never wrong bytes
    finally:
        reader.kill()
        reader.wait()
    fresh = FileStore(FP, tmp_path)
    into = torch.zeros(64)
    assert fresh.get([KEYS[0]], [into]) == [True]
    assert torch.equal(into, torch.arange(64, dtype=torch.float32).add_(7))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no tombstone left


def test_a_put_finds_a_prior_written_by_another_store_after_it_opened(tmp_path):
    decode = FileStore(FP, tmp_path)
    prefill = FileStore(FP, tmp_path)
    prefill.put(KEYS[:3], [torch.full((64,), float(i)) for i in range(3)])
    assert decode.put(KEYS[3:4], [torch.ones(64)], prior_key=KEYS[2]) == [PutStatus.STORED]
    # A page deduplicated against the other store's file links the next one too.
    assert decode.put(KEYS[2:5], [torch.ones(64)] * 3, prior_key=KEYS[1]) == [
        PutStatus.DEDUPLICATED,
        PutStatus.DEDUPLICATED,
        PutStatus.STORED,
    ]
    assert decode.put(["f" * 64], [torch.ones(64)], prior_key="e" * 64) == [PutStatus.FAILED]  # nowhere


def test_opening_never_removes_a_torn_page_another_writer_has_just_healed(tmp_path, monkeypatch):
    writer = FileStore(FP, tmp_path)
    writer.put([KEYS[0]], [torch.zeros(64)])
    path = writer.path_of(KEYS[0])
    path.write_bytes(path.read_bytes()[:40])  # torn
    # Fault injection between a header's read and its parse: FileStore has no public hook there.
    parse = FileStore._parse_header

    def healed_meanwhile(self, head, size):
        # The opening store read the torn header; another writer heals the page now.
        monkeypatch.setattr(FileStore, "_parse_header", parse)
        path.unlink()
        healer = FileStore(FP, tmp_path / "elsewhere")
        assert healer.put([KEYS[0]], [torch.ones(64)]) == [PutStatus.STORED]
        os.replace(healer.path_of(KEYS[0]), path)  # a fresh file (inode) under the page's name
        return parse(self, head, size)

    monkeypatch.setattr(FileStore, "_parse_header", healed_meanwhile)
    FileStore(FP, tmp_path)
    into = torch.zeros(64)
    assert FileStore(FP, tmp_path).get([KEYS[0]], [into]) == [True] and torch.equal(into, torch.ones(64))
