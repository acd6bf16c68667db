"""End-to-end replays: every page is stored once and loads back intact, namespaces never share
keys, small pools and stores are accounted for, and the command line's errors exit with 2.
(The load path's hits and checks: test_replay_load.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvstage.cli import main
from kvstage.errors import InvalidArgumentError
from kvstage.replay.models import resolve_model
from kvstage.replay.trace import synthetic_trace

from replay_helpers import PAGE_BYTES, distinct_pages, expected_page_count, run_in_process, tiny_trace


def test_tiny_replay_stores_each_page_once_and_verifies_it(device):
    requests = tiny_trace()
    report, engine = run_in_process(requests, device=device.type)
    engine.close()
    assert report["requests"] == 6
    assert report["prompt_tokens"] == sum(r.input_length for r in requests)
    assert report["output_tokens"] == sum(r.output_length for r in requests)
    assert report["prompt_pages"] == sum(r.input_length // 16 for r in requests)
    # Requests run three at a time: a shared page is loaded when its store write landed before
    # the lookup, else copied again and deduplicated; each distinct page is stored once.
    total, distinct = expected_page_count(requests, 16), distinct_pages(requests, 16)
    assert report["pages_loaded"] + report["pages_launched"] == total
    assert report["pages_stored"] == distinct == 110
    assert report["pages_loaded"] + report["pages_deduplicated"] == total - distinct
    assert report["pages_offloaded"] == report["pages_launched"]
    assert report["bytes_offloaded"] == report["pages_launched"] * PAGE_BYTES
    assert report["bytes_loaded"] == report["pages_loaded"] * PAGE_BYTES
    assert report["pages_failed"] == report["pages_dropped"] == report["load_mismatches"] == 0
    assert report["verify_pages_checked"] == distinct and report["verify_sampled"] is False
    assert report["verify_mismatches"] == report["lost_pages"] == report["verify_pages_unreachable"] == 0
    assert report["verify_bytes_loaded"] >= distinct * PAGE_BYTES
    assert report["device"].startswith(device.type)


def test_triton_backend_replays_the_same_pages():
    requests = tiny_trace(3)
    report, engine = run_in_process(requests, backend="triton", page_size=64)
    engine.close()
    assert report["copy_backend"] == "triton"
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["load_mismatches"] == 0
    assert report["verify_pages_checked"] == report["pages_stored"] == distinct_pages(requests, 64)


def test_mla_and_strides_replay_clean():
    requests = tiny_trace()
    model = resolve_model("deepseek-v3", layers=2, head_dim=32)
    report, engine = run_in_process(requests, model=model, stride=64)
    engine.close()
    assert report["stride"] == 64
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["load_mismatches"] == 0
    assert report["pages_loaded"] + report["pages_launched"] == expected_page_count(requests, 16)
    assert report["pages_stored"] == distinct_pages(requests, 16)


def test_tenants_never_share_a_page_key():
    requests = synthetic_trace(24, seed=3)
    plain, engine = run_in_process(requests)
    engine.close()
    report, engine = run_in_process(requests, tenants=3, lora_share=0.3)
    engine.close()
    namespaces_of = engine.expected_keys
    assert all(len(namespaces) == 1 for namespaces in namespaces_of.values())
    salts = {salt for namespaces in namespaces_of.values() for _, salt in namespaces}
    assert salts == {"tenant-0", "tenant-1", "tenant-2"}
    assert any(extra for namespaces in namespaces_of.values() for extra, _ in namespaces)
    by_tenant = {}
    for key, namespaces in namespaces_of.items():
        by_tenant.setdefault(next(iter(namespaces)), set()).add(key)
    groups = list(by_tenant.values())
    assert all(a.isdisjoint(b) for i, a in enumerate(groups) for b in groups[i + 1 :])
    # Namespaces split pages that one namespace shares: more stored, fewer loaded or deduplicated.
    assert report["pages_stored"] == len(namespaces_of) > plain["pages_stored"]
    shared = report["pages_loaded"] + report["pages_deduplicated"]
    assert shared < plain["pages_loaded"] + plain["pages_deduplicated"]
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["load_mismatches"] == 0


def test_a_second_run_on_the_same_file_store_stores_nothing_new(tmp_path):
    first, engine = run_in_process(tiny_trace(4), storage=f"file:{tmp_path}")
    engine.close()
    second, engine = run_in_process(tiny_trace(4), storage=f"file:{tmp_path}")
    engine.close()
    assert first["pages_stored"] == distinct_pages(tiny_trace(4), 16)
    # Every lookup hits all it asks; the pages past it (a prompt's last page, decode) are deduplicated.
    assert second["pages_stored"] == 0
    assert second["pages_hit"] == second["pages_looked_up"] == second["pages_loaded"] > 0
    assert second["pages_deduplicated"] == second["pages_launched"] > 0
    assert second["lost_pages"] == 0 and second["verify_mismatches"] == 0 and second["load_mismatches"] == 0


def test_a_host_pool_of_the_longest_request_still_offloads_every_page():
    requests = tiny_trace()
    longest = max((r.input_length + r.output_length - 1) // 16 for r in requests)
    report, engine = run_in_process(requests, num_host_pages=longest, max_running=6)
    engine.close()
    assert report["host_pool_high_water_pages"] <= report["host_pool_capacity_pages"] == longest == 77
    assert report["lost_pages"] == 0 and report["pages_dropped"] == 0 and report["load_mismatches"] == 0
    assert report["pages_stored"] == distinct_pages(requests, 16)
    assert report["pages_loaded"] + report["pages_launched"] == expected_page_count(requests, 16)


def test_a_host_pool_smaller_than_the_longest_request_is_refused(capsys):
    with pytest.raises(InvalidArgumentError, match="^--num-host-pages: 76 pages cannot hold the longest request's 77"):
        run_in_process(tiny_trace(), num_host_pages=76)
    assert main(["replay", "--no-progress", "--requests", "3", "--num-host-pages", "2"]) == 2
    assert "--num-host-pages" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--page-size", "0"], "--page-size"),
        (["--stride", "100"], "--stride"),
        (["--lora-share", "1.5"], "--lora-share"),
        (["--storage", "ftp://host"], "--storage"),
        (["--requests", "0"], "--requests"),
        (["--tenants", "-1"], "--tenants"),
        (["--pool-tokens", "64"], "--pool-tokens"),
        (["--layers", "0"], "--layers"),
    ],
)
def test_bad_options_exit_2_naming_the_option(capsys, argv, needle):
    assert (
        main(
            ["replay", "--no-progress", "--requests", "4", *argv]
            if "--requests" not in argv
            else ["replay", "--no-progress", *argv]
        )
        == 2
    )
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "gpt-5"], ["--hash", "md5"], ["--page-size", "x"]])
def test_argparse_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(["replay", *argv])
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_a_malformed_trace_line_exits_2_naming_the_line(tmp_path, capsys):
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]})
    bad = json.dumps({"timestamp": 0, "input_length": 600, "output_length": "3", "hash_ids": [1, 2]})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([good, good, good, bad]) + "\n")
    assert main(["replay", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 4" in err and "output_length" in err


def cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as `make run` runs it
    return subprocess.run(
        [sys.executable, "-m", "kvstage", "replay", "--no-progress", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_default_run_works(tmp_path):
    result = cli("--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["trace"] == "built-in synthetic" and report["requests"] == 48
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["load_mismatches"] == 0
    assert report["verify_pages_checked"] == report["pages_stored"] == distinct_pages(synthetic_trace(48), 64)
    # Conversations repeat earlier turns: later requests load them.
    assert 0 < report["pages_hit"] == report["pages_loaded"] <= report["pages_looked_up"]
    assert report["prefill_tokens_saved"] == 64 * report["pages_loaded"]
    assert report["copy_backend"] == ("triton" if torch.cuda.is_available() else "torch")
    assert "verify: lost pages" in result.stdout and "prefix hit: pages" in result.stdout
    assert report["elapsed_s"] < 60


@pytest.mark.slow
def test_conversation_slice_stores_each_distinct_block_page_once(shared_dir, tmp_path):
    trace = shared_dir / "data/mooncake-traces/conversation_trace.jsonl"
    result = cli(str(trace), "--requests", "200", "--page-size", "64", "--json", "out.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    # Independently: whole prompt pages of the 200 requests, keyed by (block id, page offset in
    # block) (a Mooncake block id names its whole prefix), and their decode pages.
    pairs, prompt_pages, decode_pages = set(), 0, 0
    with open(trace) as handle:
        for _, line in zip(range(200), handle):
            request = json.loads(line)
            n_full = request["input_length"] // 64
            prompt_pages += n_full
            decode_pages += (request["input_length"] + request["output_length"] - 1) // 64 - n_full
            for page in range(n_full):
                pairs.add((request["hash_ids"][page * 64 // 512], page * 64 % 512 // 64))
    assert report["requests"] == 200
    assert report["prompt_pages"] == prompt_pages
    assert report["pages_stored"] == len(pairs) + decode_pages == report["verify_pages_checked"]
    assert report["pages_loaded"] + report["pages_launched"] == prompt_pages + decode_pages
    assert report["pages_hit"] == report["pages_loaded"] > 0
    assert report["storage_pages_evicted"] == 0
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["load_mismatches"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_exits_2(capsys):
    assert main(["replay", "--no-progress", "--device", "cuda", "--requests", "2"]) == 2
    assert "--device: cuda was asked for" in capsys.readouterr().err


def test_report_sizes_the_store():
    report, engine = run_in_process(tiny_trace(4))
    engine.close()
    assert report["stored_bytes"] == report["pages_stored"] * PAGE_BYTES == len(engine.expected_keys) * PAGE_BYTES


def test_a_store_too_small_evicts_and_verify_explains_the_missing_pages():
    requests = tiny_trace()
    report, engine = run_in_process(requests, storage=f"memory:{40 * PAGE_BYTES}")
    engine.close()
    missing = report["verify_missing_explained"]
    # A put larger than the store fails its pages past 40; an evicted page can be stored again
    # by a later request: so evictions + failures >= missing.
    assert report["storage_pages_evicted"] > 0 and report["pages_failed"] > 0
    assert report["storage_pages_evicted"] + report["pages_failed"] >= missing > 0
    assert report["lost_pages"] == 0 and report["verify_mismatches"] == 0 and report["load_mismatches"] == 0
    # The store is full of intact pages: loaded and matched, or behind an evicted page of their chain.
    assert report["verify_pages_checked"] - missing == 40


def test_xxh3_keys_replay_clean_and_differ_from_sglang_keys():
    requests = tiny_trace(3)
    sha, engine = run_in_process(requests)
    engine.close()
    sha_keys = set(engine.expected_keys)
    xxh, engine = run_in_process(requests, hash_scheme="xxh3-128")
    engine.close()
    assert {len(key) for key in sha_keys} == {64} and {len(key) for key in engine.expected_keys} == {32}
    assert xxh["verify_mismatches"] == 0 and xxh["lost_pages"] == 0 and xxh["load_mismatches"] == 0
    assert xxh["pages_stored"] == sha["pages_stored"] == distinct_pages(requests, 16)
    assert xxh["hash_scheme"] == "xxh3-128"


def test_progress_bar_and_summary_print(capsys, tmp_path):
    assert main(["replay", "--requests", "3", "--backend", "torch", "--json", str(tmp_path / "r.json")]) == 0
    captured = capsys.readouterr()
    assert "3/3" in captured.err and "GB/s D2H" in captured.err
    assert "verify: lost pages" in captured.out and "prefill tokens saved" in captured.out
    assert json.loads((tmp_path / "r.json").read_text())["requests"] == 3


def test_the_default_memory_store_is_capped_by_available_host_memory(monkeypatch):
    import kvstage.replay.engine as engine_module

    monkeypatch.setattr(engine_module, "_available_host_bytes", lambda: 50 * PAGE_BYTES)
    report, engine = run_in_process(tiny_trace())
    engine.close()
    assert report["storage"] == f"memory:{30 * PAGE_BYTES}"  # 60% of 50 pages
    assert report["notes"] and "capped" in report["notes"][0]
    assert report["lost_pages"] == 0 and report["storage_pages_evicted"] > 0


def test_storage_write_failures_make_the_exit_code_1(capsys):
    # A store smaller than one put (here: one page of 65536 bytes; a store smaller than a page is
    # refused at open, exit 2) fails writes: the run must not report itself clean even though
    # every missing page is explained by those failures.
    assert main(["replay", "--requests", "3", "--backend", "torch", "--no-progress", "--storage", "memory:65536"]) == 1
    assert "storage write" in capsys.readouterr().err


def test_a_device_torch_does_not_know_is_refused_naming_the_argument():
    """The command line offers cpu and cuda only; a program passing another string gets the same clear error."""
    from kvstage.errors import InvalidArgumentError
    from kvstage.replay.device_pages import pick_device

    with pytest.raises(InvalidArgumentError, match="--device: 'gpu0' is not a device"):
        pick_device("gpu0")
