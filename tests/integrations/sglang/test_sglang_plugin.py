"""sglang's own plugin loader switches its scheduler to KVStageDecodeOffloadManager through
kvstage's entry point, only when KVSTAGE_SGLANG_DECODE_OFFLOAD=1 (a fresh process each: sglang
loads plugins once per process, as in each scheduler process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CHECK = """
from sglang_cpu import import_sglang
assert import_sglang() is None
import sys, types
import sglang.srt.disaggregation.decode_kvcache_offload_manager as source
# sglang.srt.managers.scheduler binds the name with `from ... import` (its other imports need
# GPU-side packages): a module doing the same stands in for it.
scheduler = types.ModuleType("scheduler_stand_in")
scheduler.DecodeKVCacheOffloadManager = source.DecodeKVCacheOffloadManager
sys.modules["scheduler_stand_in"] = scheduler
from sglang.srt.plugins import load_plugins
load_plugins()  # what run_scheduler_process does first
from kvstage.integrations.sglang import KVStageDecodeOffloadManager
assert scheduler.DecodeKVCacheOffloadManager is source.DecodeKVCacheOffloadManager
print("kvstage" if scheduler.DecodeKVCacheOffloadManager is KVStageDecodeOffloadManager else scheduler.DecodeKVCacheOffloadManager.__module__)
"""


@pytest.mark.parametrize(
    "enabled,expected", [("1", "kvstage"), ("", "sglang.srt.disaggregation.decode_kvcache_offload_manager")]
)
def test_the_plugin_replaces_the_decode_offload_manager_only_when_enabled(enabled, expected):
    env = {**os.environ, "PYTHONPATH": str(HERE), "KVSTAGE_SGLANG_DECODE_OFFLOAD": enabled}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == expected
