"""`metrics.jsonl`, a run's training log: one line per logged step, `{"stage": "sft"|"rl", "step", "time",
**metrics}`. `trustclip train` writes it (`append_step`; `drop_rows` when a stage restarts or resumes), its plots and
`trustclip compare` read it (`read_series`): the writer and the reader of the format sit together here."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from trustclip.files import append_jsonl, read_jsonl, write_jsonl_atomic

METRICS_FILE = "metrics.jsonl"


def append_step(path: str | Path, stage: str, step: int, logs: dict[str, Any]) -> None:
    """One logged step of `stage` (NaN / inf are stored as null)."""
    append_jsonl(path, {"stage": stage, "step": step, "time": round(time.time(), 3), **logs})


def drop_rows(path: str | Path, stage: str, after: int = -1) -> None:
    """Remove the lines of `stage` logged after step `after` (default: all of them); a line cut short by a kill goes
    too. The other stages' lines are kept."""
    rows = read_jsonl(path)
    write_jsonl_atomic(path, [row for row in rows if row.get("stage") != stage or row.get("step", 0) <= after])


def read_series(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{metric: (steps, values)} of the RL stage's numeric, finite metrics in a metrics.jsonl file, by step (a step
    logged twice, e.g. by a resumed run, keeps its last value)."""
    series: dict[str, dict[int, float]] = {}
    for row in read_jsonl(path):
        for key, value in row.items():
            if (row.get("stage") == "rl" and isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and key not in ("step", "time")):
                series.setdefault(key, {})[int(row["step"])] = float(value)
    return {k: (np.array(sorted(v), dtype=int), np.array([v[s] for s in sorted(v)], dtype=float))
            for k, v in series.items()}
