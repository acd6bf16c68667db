"""Python scripts run in a mount namespace of their own (``unshare --mount --map-root-user``),
where they may mount a small tmpfs (a full disk: ``ENOSPC``) and remount it read-only
(``EROFS``) without touching this machine's mounts."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys

import pytest

UNSHARE = ["unshare", "--mount", "--map-root-user"]


@functools.cache
def namespaces_usable() -> str | None:
    """None when a mount namespace with a tmpfs can be made here, else why not (probed once)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(UNSHARE + ["sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"no mount namespace here: {probe.stderr.strip()}"


def run_in_mount_namespace(script: str, *args: str, timeout: float = 300) -> dict:
    """Run the Python source ``script`` (``sys.argv[1:]`` = ``args``) in a mount namespace of its
    own and return the JSON object on the last line it prints. Skips the calling test, saying
    why, where the kernel allows no such namespace; fails it with the script's stderr when the
    script exits non-zero."""
    reason = namespaces_usable()
    if reason is not None:
        pytest.skip(reason)
    result = subprocess.run(
        UNSHARE + [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
