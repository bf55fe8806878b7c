"""File helpers shared by the training pipeline and `trustclip compare`: atomic writes (a killed process
leaves the old file or the complete new one, never half of one), tolerant JSON / JSONL reads, and a
non-blocking lock file."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to a temporary file in the same folder, fsync it, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Atomic JSON write (indented; NaN / inf stored as null)."""
    return write_text_atomic(path, json.dumps(_clean(data), indent=2, default=str) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Atomic rewrite of a JSONL file (e.g. after dropping some rows)."""
    return write_text_atomic(path, "".join(_json_line(row) for row in rows))


def append_jsonl(path: str | Path, row: dict[str, Any]) -> None:
    """Append one JSON line to `path` (written when the call returns: the file is closed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(_json_line(row))


def _json_line(row: dict[str, Any]) -> str:
    return json.dumps(_clean(row), default=str) + "\n"


def _clean(value: Any) -> Any:
    """NaN/inf -> None so the JSON is standard (readable by any tool)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def read_json(path: str | Path) -> Any | None:
    """Parsed JSON, or None when the file is missing or not valid JSON (e.g. cut short by a kill)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file ([] when missing); a last line cut short by a kill is skipped, any other bad line
    raises."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def try_lock(path: str | Path) -> Any | None:
    """Open `path` and lock it exclusively without waiting; returns the open file (keep it: closing it, or the
    process dying, releases the lock) with this process's pid written in it, or None if another holds it."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    handle.truncate(0)  # append mode: the pid is then written at offset 0
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
