"""The replay's option lists match the real constants, and `kvstage --help` needs no torch."""

from __future__ import annotations

import subprocess
import sys

from kvstage.hashing import SCHEMES
from kvstage.kernels.backend import BACKEND_CHOICES
from kvstage.replay import command


def test_option_choices_are_the_real_constants():
    assert command.HASH_SCHEMES == SCHEMES
    assert command.BACKENDS == BACKEND_CHOICES


def test_the_command_line_parser_imports_no_torch():
    code = "import sys, kvstage.cli; kvstage.cli.build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
