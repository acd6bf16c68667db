"""The README's python examples run as written and print what they claim."""

from __future__ import annotations

import re
import subprocess
import sys

from support import REPO_ROOT


def section_example(heading: str) -> str:
    """The one python block of the README section under ``heading`` (up to the next ``## ``)."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return example


def run_example(example: str, tmp_path) -> str:
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_engine_example_runs(tmp_path):
    assert run_example(section_example("## Using it from an engine"), tmp_path) == "4 pages stored, 2 hit, 2 loaded"


def test_transformers_example_runs(tmp_path):
    assert run_example(section_example("## Use with transformers"), tmp_path) == "32 tokens loaded, same tokens: True"
