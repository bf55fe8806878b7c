"""Trainer callbacks of `trustclip train`: metrics.jsonl logging, compact progress lines, periodic eval."""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trustclip import metric_names as names
from trustclip.metrics_file import append_step, drop_rows


class JsonlMetricsCallback(TrainerCallback):
    """Appends every log of the main process to `path` as `{"stage", "step", **metrics}` lines. On resume, the
    lines the killed run logged after its last checkpoint are dropped first, so the file has one line per step."""

    def __init__(self, path: str | Path, stage: str) -> None:
        self.path, self.stage = Path(path), stage

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and state.global_step > 0 and self.path.exists():
            drop_rows(self.path, self.stage, after=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        append_step(self.path, self.stage, state.global_step, logs)


class ProgressCallback(TrainerCallback):
    """One compact line every `every` optimizer steps (interval means of the chosen metrics, speed, ETA)."""

    RL_FIELDS = (("reward", (names.REWARD,)), ("clip lo/hi", (names.CLIP_LOW, names.CLIP_HIGH)),
                 ("entropy", (names.ENTROPY,)), ("len", (names.COMPLETION_LENGTH,)))
    SFT_FIELDS = (("loss", ("loss",)), ("tok acc", ("mean_token_accuracy",)))

    def __init__(self, stage: str, every: int, printer: Callable[[str], None] = print) -> None:
        self.stage, self.every, self.printer = stage, max(1, every), printer
        self.fields = self.RL_FIELDS if stage == "rl" else self.SFT_FIELDS
        self.window: dict[str, list[float]] = defaultdict(list)
        self.start = self.start_step = self.last_printed = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start, self.start_step = time.perf_counter(), state.global_step

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        for key, value in logs.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.window[key].append(float(value))
        step, total = state.global_step, state.max_steps
        # Logs may come every k steps: print at the first log at or after each multiple of `every`.
        if step == self.last_printed or (step // self.every == (self.last_printed or 0) // self.every
                                         and step != total):
            return
        self.last_printed = step
        per_step = (time.perf_counter() - self.start) / max(step - self.start_step, 1)
        parts = [f"[{self.stage}] step {step:>4}/{total}"]
        for label, keys in self.fields:
            if all(self.window.get(k) for k in keys):
                parts.append(f"{label} " + "/".join(f"{statistics.fmean(self.window[k]):.3f}" for k in keys))
        eta = round(per_step * (total - step))
        parts.append(f"{per_step:.2f} s/step, eta " + (f"{eta // 60}m{eta % 60:02d}s" if eta >= 60 else f"{eta}s"))
        self.printer(" | ".join(parts))
        self.window.clear()


class PeriodicEvalCallback(TrainerCallback):
    """Runs `evaluate_fn(model, step=step)` (an EvalResult) every `every` steps on the main process and hands its
    metrics to the trainer's metric buffer, so they are logged with that step (logs, report_to, jsonl)."""

    def __init__(self, trainer: Any, every: int, evaluate_fn: Callable[..., Any]) -> None:
        self.trainer, self.every, self.evaluate_fn = trainer, every, evaluate_fn

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.every or state.global_step % self.every:  # every=0: never (as rl.eval_every=0)
            return
        accelerator = self.trainer.accelerator
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(self.trainer.model)
            for key, value in self.evaluate_fn(model, step=state.global_step).flat_metrics("eval/").items():
                self.trainer._metrics["train"][key].append(value)
        accelerator.wait_for_everyone()
