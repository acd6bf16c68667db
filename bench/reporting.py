"""What every benchmark's command line does with its report: write it as JSON where ``--json`` asks.

Imported by the ``bench_<name>.py`` scripts from their own folder (they run as files, not as a
package: see :func:`bench.run_all.load`).
"""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, path: Path | None) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folders made) and say so; None: nothing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
