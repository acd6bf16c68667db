"""tools/overlay-scripts.sh: an overlay environment's console scripts run its own python.

tools/install-vllm.sh installs vLLM into the overlay with the base environment's pip, which
writes each console script (``vllm``) for the base python; that python cannot import vllm. The
script rewrites those shebangs; the test runs it on a real overlay made with ``venv`` over the
environment running the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "overlay-scripts.sh"


def run(venv: Path, base: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(venv), str(base)], capture_output=True, text=True, timeout=60)


def test_console_scripts_written_for_the_base_python_run_the_overlays(tmp_path):
    base = Path(sys.prefix)
    venv = tmp_path / "overlay"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    # as BASE's pip writes them: a plain shebang, and the sh form pip uses for long paths
    (bin_dir / "vllm").write_text(f"#!{base}/bin/python\nimport sys\nprint(sys.prefix)\n")
    (bin_dir / "long").write_text(
        f"#!/bin/sh\n'''exec' '{base}/bin/python3' \"$0\" \"$@\"\n' '''\nimport sys\nprint(sys.prefix)\n"
    )
    (bin_dir / "other").write_text("#!/bin/sh\necho other\n")
    for name in ("vllm", "long", "other"):
        (bin_dir / name).chmod(0o755)
    done = run(venv, base)
    assert done.returncode == 0, done.stderr
    assert "2 console scripts" in done.stdout
    for name in ("vllm", "long"):
        ran = subprocess.run(
            [str(bin_dir / name)], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""}
        )
        assert ran.returncode == 0, ran.stderr
        assert Path(ran.stdout.strip()) == venv.resolve()  # the overlay's python, not the base's
    assert (bin_dir / "other").read_text() == "#!/bin/sh\necho other\n"
    assert (bin_dir / "vllm").read_text().splitlines()[0] == f"#!{venv.resolve()}/bin/python"
    again = run(venv, base)  # idempotent
    assert again.returncode == 0 and "0 console scripts" in again.stdout
