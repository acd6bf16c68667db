"""The README's python examples run as written and print what they claim."""

from __future__ import annotations

import ast
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


def test_the_sglang_cpu_note_states_the_ranks_the_sglang_tests_state():
    """Without this line sglang built by hand raises the error the README names; the sglang
    tests (tests/integrations/sglang/test_sglang_user.py) run the README's line itself."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Use with sglang") :]
    assert "`parallel name 'tp_rank' has not been written in this process`" in " ".join(section.split())
    (call,) = re.findall(r"`(get_parallel\(\)\.override_permanently\([^`]*\))`", section)
    rig = (REPO_ROOT / "tests" / "integrations" / "sglang" / "decode_rig.py").read_text()
    (rig_call,) = re.findall(r"get_parallel\(\)\.override_permanently\((.*?)\)\n", rig, flags=re.S)

    def names(source: str) -> set[str]:
        return {keyword.arg for keyword in ast.parse(source, mode="eval").body.keywords}

    assert (
        names(call)
        == names(f"f({rig_call})")
        == {
            "tp_rank",
            "pp_rank",
            "attn_tp_rank",
            "attn_dp_rank",
            "attn_cp_rank",
            "attn_dcp_rank",
        }
    )


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
        bounds = requirement[len(engine) :]
        tested = re.fullmatch(r">=([0-9.]+),<[0-9.]+", bounds).group(1)
        # one sentence gives the install, the range pip takes and the release the tests ran
        assert re.search(
            rf"""pip install (-e )?"\.\[{engine}\]"`?\s+\([^)]*`{re.escape(bounds)}`, tested: {re.escape(tested)}\)""",
            readme,
        ), engine


def test_the_vllm_section_installs_from_a_checkout_and_names_the_offloading_size_clash():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Use with vLLM", 1)[1].split("\n## ", 1)[0]
    assert 'pip install ".[vllm]"' in section and 'pip install "kvstage[vllm]"' not in section  # kvstage is on no index
    assert "`--kv-offloading-size`" in section and "`OffloadingConnector` under kvstage's module path" in section
    assert "`storage` (required" in section
