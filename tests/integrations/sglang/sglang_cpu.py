"""Importing sglang 0.5.23 on a CPU machine (see conftest.py for why each step is needed); used
by conftest.py and by the processes the TP tests spawn."""

from __future__ import annotations

import importlib
import sys
import types


def import_sglang() -> str | None:
    """Import what the tests use; None when it worked, else why not."""
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError as error:
        return f"torchvision is not installed ({error}); run tools/install-sglang.sh"
    except RuntimeError:
        for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision  # noqa: F401
    try:
        sglang = importlib.import_module("sglang")
        importlib.import_module("sglang.srt.managers.cache_controller")
    except ImportError as error:
        return f"sglang is not importable ({error}); run tools/install-sglang.sh"
    if sglang.__version__ != "0.5.23":
        return f"sglang {sglang.__version__} is installed; these tests are for 0.5.23"
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(device="cpu").install()
    return None
