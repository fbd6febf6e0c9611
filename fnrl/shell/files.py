"""Files the roles share: atomic replacement, the tail of a log for error messages,
optional JSON files (a checkpoint's generation_config.json), and a full disk told apart
from every other failure (`no_space`, `DiskFull`, `SpaceReserve`)."""

from __future__ import annotations

import errno
import json
import os
import shutil
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


def no_space(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from, is a full disk (ENOSPC or a
    quota; Orbax wraps the OSError of its writer threads)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, DiskFull) or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


class DiskFull(Exception):
    """The disk a run writes to is full: a fault with its own name and exit code, never a
    role failure (restarting a role cannot make room). Not an OSError on purpose, so the
    handlers that restart roles on OSError let it through."""

    def __init__(self, where: str, path: str | os.PathLike, err: BaseException | str = ""):
        self.where, self.path = where, Path(path)
        try:
            free = shutil.disk_usage(self.path if self.path.is_dir() else self.path.parent).free
        except OSError:
            free = -1
        self.free_bytes = free
        said = f"{free / 2**20:.1f} MiB free" if free >= 0 else "free space unknown"
        super().__init__(f"no space left on the device of {self.path} while {where} "
                         f"({said}{f'; {err}' if err else ''})")

    @classmethod
    def of(cls, err: BaseException, where: str, path: str | os.PathLike) -> DiskFull:
        """`err` itself if it is one already, else the fault it means (`no_space(err)`)."""
        return err if isinstance(err, cls) else cls(where, path, err)


class SpaceReserve:
    """A few MiB set aside in the run directory at start and given back when the disk
    fills, so that the clean stop (the attempt's end record, summary.json, the closing
    lines of every log) still has room to be written."""

    NAME = ".fnrl_space_reserve"

    def __init__(self, directory: str | os.PathLike, nbytes: int = 8 * 2**20):
        self.path = Path(directory) / self.NAME
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:   # blocks really allocated (a sparse file would give nothing back)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            pass   # no room even for this: the stop writes what it can
        finally:
            os.close(fd)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def remove_unfinished_saves(directory: str | os.PathLike) -> list[str]:
    """Removes the temporary directories of checkpoint saves that never finished (Orbax
    names them `<step>.orbax-checkpoint-tmp-...`; a finished save is renamed to its step
    number) and returns their names. A full disk fails a save half way."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    names = [p.name for p in directory.iterdir() if p.is_dir() and not p.name.isdigit()
             and "tmp" in p.name]
    for name in names:
        shutil.rmtree(directory / name, ignore_errors=True)
    return names
