"""The README's engine example runs as written and prints what it claims."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from support import REPO_ROOT


def test_engine_example_runs(tmp_path):
    readme = (REPO_ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4 pages stored, 2 hit, 2 loaded"


def test_the_sglang_cpu_note_states_the_ranks_the_sglang_tests_state():
    """Without this line sglang built by hand raises the error the README names; the sglang
    tests (tests/integrations/sglang/test_sglang_user.py) run the README's line itself."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Use with sglang"):]
    assert "`parallel name 'tp_rank' has not been written in this process`" in " ".join(section.split())
    (call,) = re.findall(r"`(get_parallel\(\)\.override_permanently\([^`]*\))`", section)
    rig = (REPO_ROOT / "tests" / "integrations" / "sglang" / "decode_rig.py").read_text()
    (rig_call,) = re.findall(r"get_parallel\(\)\.override_permanently\((.*?)\)\n", rig, flags=re.S)

    def names(source: str) -> set[str]:
        return {keyword.arg for keyword in ast.parse(source, mode="eval").body.keywords}

    assert names(call) == names(f"f({rig_call})") == {
        "tp_rank", "pp_rank", "attn_tp_rank", "attn_dp_rank", "attn_cp_rank", "attn_dcp_rank",
    }
