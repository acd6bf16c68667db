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


def test_the_readme_never_teaches_installing_kvstage_by_name_from_an_index():
    """kvstage is on no package index: ``pip install "kvstage[vllm]"`` fails. Every install the
    README teaches is from the checkout (``.`` or ``-e .``, with an extra as ``".[vllm]"``)."""
    readme = (REPO_ROOT / "README.md").read_text()
    by_name = re.findall(r"""pip install [^`\n]*?["']?\bkvstage\b[^`\n]*|["'`]kvstage\[[^\]]*\]""", readme)
    assert by_name == []


def test_the_readme_installs_each_engine_extra_from_the_checkout_with_its_range_and_tested_version():
    import tomllib

    readme = (REPO_ROOT / "README.md").read_text()
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set(re.findall(r"""["']\.\[([a-z0-9-]+)\]["']""", readme))
    assert {"vllm", "sglang", "mooncake", "mooncake-cuda"} <= named and named <= set(extras)
    for engine in ("vllm", "sglang"):
        (requirement,) = extras[engine]
        bounds = requirement[len(engine):]
        tested = re.fullmatch(r">=([0-9.]+),<[0-9.]+", bounds).group(1)
        # one sentence gives the install, the range pip takes and the release the tests ran
        assert re.search(rf"""pip install (-e )?"\.\[{engine}\]"`?\s+\([^)]*`{re.escape(bounds)}`, tested: {re.escape(tested)}\)""", readme), engine
