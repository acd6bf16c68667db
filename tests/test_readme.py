"""The README's engine example runs as written and prints what it claims."""

from __future__ import annotations

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


def test_the_vllm_section_installs_from_a_checkout_and_names_the_offloading_size_clash():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Use with vLLM", 1)[1].split("\n## ", 1)[0]
    assert 'pip install ".[vllm]"' in section and 'pip install "kvstage[vllm]"' not in section  # kvstage is on no index
    assert "`--kv-offloading-size`" in section and "`OffloadingConnector` under kvstage's module path" in section
    assert "`storage` (required" in section
