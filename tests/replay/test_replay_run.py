"""End-to-end replays: every stored page reads back intact, namespaces never share keys,
verification catches wrong and missing pages, and the command line's errors exit with 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvstage.cli import main
from kvstage.replay.command import replay
from kvstage.replay.engine import ReplayConfig
from kvstage.replay.kv_content import KVContent
from kvstage.replay.models import resolve_model
from kvstage.replay.trace import TraceRequest, synthetic_trace
from kvstage.replay.verify import verify_pages
from support import REPO_ROOT

TINY = resolve_model(None, layers=1, heads=1, head_dim=8, dtype="float16")


def tiny_trace(n=6):
    """Short requests sharing a first block; the second also shares the first's second block."""
    shapes = [(700, 20, [0, 1]), (900, 9, [0, 1]), (300, 1, [0]), (1200, 33, [0, 2, 3]), (520, 16, [0, 4]), (64, 64, [5])]
    return [TraceRequest(i, float(i), n_in, n_out, tuple(ids)) for i, (n_in, n_out, ids) in enumerate(shapes[:n])]


def run_in_process(requests, **overrides):
    settings = dict(model=TINY, page_size=16, max_running=3, backend="torch")
    settings.update(overrides)
    return replay(ReplayConfig(**settings), requests, keep_engine=True)


def expected_page_count(requests, page_size):
    """Full pages of prompt + output[:-1] of each request, and distinct full prompt pages."""
    return sum((r.input_length + r.output_length - 1) // page_size for r in requests)


def test_tiny_replay_stores_and_verifies_every_page(device):
    requests = tiny_trace()
    report, engine = run_in_process(requests, device=device.type)
    engine.close()
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0
    assert report["requests"] == 6
    assert report["prompt_tokens"] == sum(r.input_length for r in requests)
    assert report["output_tokens"] == sum(r.output_length for r in requests)
    assert report["prefill_pages_total"] == sum(r.input_length // 16 for r in requests)
    assert report["prefill_pages_unique_stored"] + report["prefill_pages_deduplicated"] == report["prefill_pages_total"]
    # Request 1 finds all 43 full pages of request 0 (block 0's 32 and block 1's first 11);
    # requests 2, 3, 4 find their pages of block 0 (18, 32 and 32 of them).
    assert report["prefill_pages_deduplicated"] == 43 + 18 + 32 + 32
    decode_pages = expected_page_count(requests, 16) - report["prefill_pages_total"]
    assert report["decode_pages_offloaded"] == report["decode_pages_stored"] == decode_pages
    assert report["verify_pages_checked"] == report["prefill_pages_unique_stored"] + decode_pages
    assert report["bytes_d2h"] == report["verify_pages_checked"] * TINY.page_bytes(16)
    assert report["storage_failures"] == 0
    assert report["device"].startswith(device.type)


def test_triton_backend_replays_the_same_pages():
    requests = tiny_trace(3)
    report, engine = run_in_process(requests, backend="triton", page_size=64)
    engine.close()
    assert report["copy_backend"] == "triton"
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0 and report["verify_pages_checked"] > 0


def test_mla_and_strides_replay_clean():
    requests = tiny_trace()
    model = resolve_model("deepseek-v3", layers=2, head_dim=32)
    report, engine = run_in_process(requests, model=model, stride=64)
    engine.close()
    assert report["stride"] == 64
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0
    assert report["decode_pages_offloaded"] == expected_page_count(requests, 16) - report["prefill_pages_total"]


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
    # Namespaces split pages that one namespace shares: more unique pages, fewer deduplicated.
    assert report["prefill_pages_unique_stored"] > plain["prefill_pages_unique_stored"]
    assert report["prefill_pages_deduplicated"] < plain["prefill_pages_deduplicated"]
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0


def test_verify_catches_wrong_bytes_and_missing_pages(tmp_path):
    report, engine = run_in_process(tiny_trace(3), storage=f"file:{tmp_path}")
    keys = list(engine.expected_keys)
    assert report["lost_pages"] == 0 and len(keys) == report["verify_pages_checked"]
    wrong_content = KVContent(TINY, 16, seed=99)
    wrong = verify_pages(engine.storage, wrong_content, keys)
    assert wrong.mismatches == len(keys) and wrong.pages_matched == 0
    os.remove(engine.storage.path_of(keys[1]))
    missing = verify_pages(engine.storage, engine.content, keys, sample=len(keys) - 1, seed=0)
    full = verify_pages(engine.storage, engine.content, keys)
    assert full.lost == 1 and full.mismatches == 0 and full.pages_matched == len(keys) - 1
    assert missing.sampled and missing.pages_checked == len(keys) - 1
    engine.close()


def test_a_second_run_on_the_same_file_store_stores_nothing_new(tmp_path):
    first, engine = run_in_process(tiny_trace(4), storage=f"file:{tmp_path}")
    engine.close()
    second, engine = run_in_process(tiny_trace(4), storage=f"file:{tmp_path}")
    engine.close()
    assert first["prefill_pages_unique_stored"] > 0
    assert second["prefill_pages_unique_stored"] == 0
    assert second["prefill_pages_deduplicated"] == second["prefill_pages_total"]
    assert second["decode_pages_deduplicated"] == second["decode_pages_offloaded"]
    assert second["lost_pages"] == 0 and second["verify_mismatches"] == 0


def test_a_small_host_pool_still_offloads_every_page():
    requests = tiny_trace()
    report, engine = run_in_process(requests, host_pages=4, max_running=6)
    engine.close()
    assert report["host_pool_high_water_pages"] <= 4
    assert report["lost_pages"] == 0 and report["decode_pages_dropped"] == 0
    assert report["decode_pages_stored"] == expected_page_count(requests, 16) - report["prefill_pages_total"]


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
    assert main(["replay", "--no-progress", "--requests", "4", *argv] if "--requests" not in argv else ["replay", "--no-progress", *argv]) == 2
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
    return subprocess.run([sys.executable, "-m", "kvstage", "replay", "--no-progress", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_default_run_works(tmp_path):
    result = cli("--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["trace"] == "built-in synthetic" and report["requests"] == 48
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0
    assert report["verify_pages_checked"] == report["prefill_pages_unique_stored"] + report["decode_pages_stored"] > 0
    assert report["prefill_pages_deduplicated"] > 0
    assert report["copy_backend"] == ("triton" if torch.cuda.is_available() else "torch")
    assert "verify: lost pages" in result.stdout
    assert report["round_trip_pages"] == 256 and report["round_trip_mismatches"] == 0
    assert report["elapsed_s"] < 60


@pytest.mark.slow
def test_conversation_slice_stores_each_distinct_block_page_once(shared_dir, tmp_path):
    trace = shared_dir / "data/mooncake-traces/conversation_trace.jsonl"
    result = cli(str(trace), "--requests", "200", "--page-size", "64", "--json", "out.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    # Independently: full prompt pages of the 200 requests, keyed by (block id, page offset in block).
    pairs, full_pages = set(), 0
    with open(trace) as handle:
        for _, line in zip(range(200), handle):
            request = json.loads(line)
            n_full = request["input_length"] // 64
            full_pages += n_full
            for page in range(n_full):
                pairs.add((request["hash_ids"][page * 64 // 512], page * 64 % 512 // 64))
    assert report["requests"] == 200
    assert report["prefill_pages_total"] == full_pages
    assert report["prefill_pages_unique_stored"] == len(pairs)
    assert report["storage_pages_evicted"] == 0
    assert report["verify_mismatches"] == 0 and report["lost_pages"] == 0
    assert report["verify_pages_checked"] == len(pairs) + report["decode_pages_stored"]
    assert report["round_trip_mismatches"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_exits_2(capsys):
    assert main(["replay", "--no-progress", "--device", "cuda", "--requests", "2"]) == 2
    assert "--device: cuda was asked for" in capsys.readouterr().err


def test_report_sizes_the_store():
    report, engine = run_in_process(tiny_trace(4))
    engine.close()
    stored = report["prefill_pages_unique_stored"] + report["decode_pages_stored"]
    assert report["stored_bytes"] == stored * TINY.page_bytes(16) == len(engine.expected_keys) * TINY.page_bytes(16)


def test_a_store_too_small_evicts_and_verify_explains_the_missing_pages():
    requests = tiny_trace()
    page_bytes = TINY.page_bytes(16)
    report, engine = run_in_process(requests, storage=f"memory:{40 * page_bytes}")
    engine.close()
    missing = report["verify_missing_explained"]
    # An evicted prefill page can be stored again by a later request, so evictions >= missing.
    assert report["storage_pages_evicted"] >= missing > 0
    assert report["lost_pages"] == 0 and report["verify_mismatches"] == 0
    assert report["verify_pages_checked"] - missing == 40  # the store is full of intact pages


def test_xxh3_keys_replay_clean_and_differ_from_sglang_keys():
    requests = tiny_trace(3)
    sha, engine = run_in_process(requests)
    engine.close()
    sha_keys = set(engine.expected_keys)
    xxh, engine = run_in_process(requests, hash_scheme="xxh3-128")
    engine.close()
    assert {len(key) for key in sha_keys} == {64} and {len(key) for key in engine.expected_keys} == {32}
    assert xxh["verify_mismatches"] == 0 and xxh["lost_pages"] == 0
    assert xxh["prefill_pages_unique_stored"] == sha["prefill_pages_unique_stored"]
    assert xxh["hash_scheme"] == "xxh3-128"


def test_progress_bar_and_summary_print(capsys, tmp_path):
    assert main(["replay", "--requests", "3", "--backend", "torch", "--json", str(tmp_path / "r.json")]) == 0
    captured = capsys.readouterr()
    assert "3/3" in captured.err and "GB/s D2H" in captured.err
    assert "verify: lost pages" in captured.out and "unique stored" in captured.out
    assert json.loads((tmp_path / "r.json").read_text())["requests"] == 3


def test_the_default_memory_store_is_capped_by_available_host_memory(monkeypatch):
    import kvstage.replay.engine as engine_module

    page_bytes = TINY.page_bytes(16)
    monkeypatch.setattr(engine_module, "_available_host_bytes", lambda: 50 * page_bytes)
    report, engine = run_in_process(tiny_trace())
    engine.close()
    assert report["storage"] == f"memory:{30 * page_bytes}"  # 60% of 50 pages
    assert report["notes"] and "capped" in report["notes"][0]
    assert report["lost_pages"] == 0 and report["storage_pages_evicted"] > 0


def test_loading_pages_back_into_the_device_pool_checks_them_there(device):
    from kvstage.replay.verify import round_trip_pages

    report, engine = run_in_process(tiny_trace(), device=device.type)
    keys = list(engine.expected_keys)
    assert report["round_trip_pages"] == min(len(keys), 256) and report["round_trip_mismatches"] == 0
    assert report["h2d_gbps"] > 0
    good = round_trip_pages(engine.storage, engine.content, engine.kv_pool, keys[::-1], page_size=16, backend="torch", max_pages=7)
    wrong_content = KVContent(TINY, 16, seed=99, device=device)
    bad = round_trip_pages(engine.storage, wrong_content, engine.kv_pool, keys, page_size=16, backend="torch", max_pages=7)
    engine.close()
    assert (good.pages, good.mismatches, good.bytes_h2d) == (7, 0, 7 * TINY.page_bytes(16))
    assert (bad.pages, bad.mismatches) == (7, 7)


def test_storage_write_failures_make_the_exit_code_1(capsys):
    # A store smaller than one put (here: smaller than one page) fails writes: the run must not
    # report itself clean even though every missing page is explained by those failures.
    assert main(["replay", "--requests", "3", "--backend", "torch", "--no-progress", "--storage", "memory:10"]) == 1
    assert "storage write" in capsys.readouterr().err
