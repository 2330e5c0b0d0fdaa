"""What every benchmark script ends with: its JSON report, written and announced."""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path


def machine() -> dict:
    return {"cpu_cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def write_report(path: Path, name: str, **fields) -> dict:
    """``{"benchmark": name, "date": ..., "machine": ..., **fields}`` to ``path``."""
    report = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return report
