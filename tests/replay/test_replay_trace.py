"""Trace lines are validated with errors naming the line and field; the synthetic trace keeps the format's rules."""

from __future__ import annotations

import json

import pytest

from kvstage.errors import InvalidArgumentError
from kvstage.replay.trace import BLOCK_TOKENS, TraceError, load_trace, parse_line, synthetic_trace

GOOD = {"timestamp": 5, "input_length": 1030, "output_length": 7, "hash_ids": [3, 4, 9]}


def write_lines(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_good_lines_load_in_order_and_blank_lines_are_skipped(tmp_path):
    path = write_lines(tmp_path, [GOOD, "", {**GOOD, "timestamp": 9.5, "hash_ids": [3, 4, 10]}])
    requests = load_trace(path)
    assert [r.index for r in requests] == [0, 1]
    assert [r.line for r in requests] == [1, 3]
    assert requests[1].timestamp == 9.5
    assert requests[1].hash_ids == (3, 4, 10)
    assert requests[0].input_length == 1030 and requests[0].output_length == 7


def test_limit_reads_only_the_first_requests(tmp_path):
    path = write_lines(tmp_path, [GOOD, GOOD, "not json at all"])
    assert len(load_trace(path, limit=2)) == 2  # the bad third line is never read


@pytest.mark.parametrize(
    "line, field",
    [
        ("{not json", "json"),
        ("[1, 2]", "json"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "hash_ids: missing"),
        ({**GOOD, "timestamp": -1}, "timestamp"),
        ({**GOOD, "input_length": 0}, "input_length"),
        ({**GOOD, "input_length": 1030.0}, "input_length"),
        ({**GOOD, "output_length": True}, "output_length"),
        ({**GOOD, "hash_ids": [3, -4, 9]}, "hash_ids[1]"),
        ({**GOOD, "hash_ids": "3,4,9"}, "hash_ids"),
        ({**GOOD, "hash_ids": [3, 4]}, "ceil(input_length / 512) = 3"),
    ],
    ids=[
        "bad-json",
        "not-object",
        "missing",
        "negative-time",
        "zero-input",
        "float-input",
        "bool-output",
        "negative-block",
        "ids-not-list",
        "too-few-blocks",
    ],
)
def test_malformed_line_names_line_number_and_field(tmp_path, line, field):
    path = write_lines(tmp_path, [GOOD, GOOD, line])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert "line 3:" in message
    assert field in message
    assert isinstance(info.value, InvalidArgumentError)


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(TraceError, match="TRACE: cannot open"):
        load_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no request"):
        load_trace(tmp_path / "empty.jsonl")


def test_parse_line_accepts_a_conversation_trace_line(shared_dir):
    with open(shared_dir / "data/mooncake-traces/conversation_trace.jsonl") as handle:
        first = handle.readline()
    request = parse_line(first, 0, 1)
    assert request.input_length == 6758
    assert request.hash_ids == tuple(range(14))


def test_synthetic_trace_is_seeded_and_follows_the_format():
    a, b, c = synthetic_trace(40, seed=1), synthetic_trace(40, seed=1), synthetic_trace(40, seed=2)
    assert a == b
    assert a != c
    position_of = {}
    timestamps = [r.timestamp for r in a]
    assert timestamps == sorted(timestamps)
    for request in a:
        # Same validation as a file line.
        line = json.dumps(
            {
                "timestamp": request.timestamp,
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": list(request.hash_ids),
            }
        )
        assert parse_line(line, request.index, 0) == request
        # A block id is a node of one prefix tree: always at one position, after one prefix.
        for position, block in enumerate(request.hash_ids):
            prefix = request.hash_ids[:position]
            assert position_of.setdefault(block, prefix) == prefix
    # Conversations repeat earlier turns: many prompts share 2+ leading blocks with an earlier one.
    seen, sharing = set(), 0
    for request in a:
        sharing += request.hash_ids[:2] in seen and len(request.hash_ids) > 2
        seen.add(request.hash_ids[:2])
    assert sharing >= 10
    assert len({r.hash_ids[0] for r in a}) <= 4  # every conversation starts with one of four system prompts
    assert all(64 <= r.input_length - (len(r.hash_ids) - 1) * BLOCK_TOKENS <= BLOCK_TOKENS for r in a)
    assert all(8 <= r.output_length <= 160 for r in a)


def test_synthetic_trace_rejects_a_bad_count():
    with pytest.raises(InvalidArgumentError, match="num_requests"):
        synthetic_trace(0)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    good = b'{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
    path.write_bytes(good + b'{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\xff\n')
    with pytest.raises(TraceError, match=r"t\.jsonl line 2: .*UTF-8"):
        load_trace(path)
