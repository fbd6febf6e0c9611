"""Files the roles share: atomic replacement, the tail of a log for error messages, and
optional JSON files (a checkpoint's generation_config.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Enough for the last lines of a Python traceback without reading a long vLLM log whole.
_TAIL_BYTES = 16_384


def write_atomic(path: str | os.PathLike, data: str | bytes, *, fsync: bool = False) -> None:
    """Writes `data` to a temporary file beside `path`, then renames it over `path`, so a
    reader (or a restart after a crash) sees the old file or the new one, never half.
    `fsync`: also survive power loss, not just a crash of this process."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_tail(path: str | os.PathLike, since: int = 0) -> bytes:
    """The last bytes of a log (at most _TAIL_BYTES), none before offset `since`."""
    with open(path, "rb") as f:
        f.seek(max(since, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
        return f.read()


def log_tail(path: str | os.PathLike | None, lines: int = 30) -> str:
    """"; last lines of PATH:\\n..." for an error message, or "" when there is no log."""
    if not path:
        return ""
    try:
        text = read_tail(path).decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"; last lines of {path}:\n" + "\n".join(text)


def read_json_if_present(path: str | os.PathLike) -> Any | None:
    """The JSON value in `path`, or None when there is no such file; a ValueError naming
    the file when it is not valid JSON."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
