"""Writing a file that other processes read while it is being replaced."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | Path, data: dict, indent: int = 2) -> None:
    """Write atomically (temporary file, then rename): readers see the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    tmp.replace(path)
