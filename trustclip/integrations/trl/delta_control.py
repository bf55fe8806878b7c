"""Adaptive delta, a trainer feature: the objective's delta controller (`controller_for`: atr_adaptive, or
`adaptive_delta` with any objective that has a delta) as a transformers `TrainerCallback`, fed by the loss, moved
once per generation batch, kept with every checkpoint.

Delta moves from the token-weighted mean of the target statistic over the batch's off-policy micro-batches (those
after its first optimizer step; on the first the ratio is 1 and says nothing about the update), and applies from the
next generation batch, so every update of one batch uses one delta, as PPO keeps beta fixed within an iteration. The
statistics are global, so every process moves delta alike. The state is written before the Trainer saves, so a
complete checkpoint (one with `trainer_state.json`) has it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trustclip.files import write_json_atomic
from trustclip.metric_names import objective_name
from trustclip.objectives import DeltaController, Objective
from trustclip.objectives.adaptive import carries_controller

DELTA_CONTROLLER_FILE = "delta_controller.json"


def controller_for(objective: Objective, adaptive_delta: bool = False,
                   settings: Mapping[str, Any] | None = None) -> DeltaController | None:
    """The delta controller a run trains with: for an objective that carries its settings (atr_adaptive = ATR + the
    controller), or with `adaptive_delta` for any objective with a delta (`settings` over the controller's defaults);
    None otherwise. ValueError for settings it cannot take."""
    if carries_controller(objective):
        if settings:
            raise ValueError(f"objective {objective.name!r} takes the controller's settings among its own "
                             f"hyper-parameters: give {sorted(settings)} in objective_kwargs")
        return DeltaController(objective)
    if not adaptive_delta:
        if settings:
            raise ValueError(f"controller settings {sorted(settings)} are given, but adaptive_delta is off: set "
                             "adaptive_delta=True, or drop them")
        return None
    return DeltaController(objective, **dict(settings or {}))


class DeltaControlCallback(TrainerCallback):
    """Moves `controller.delta` once per generation batch of `generate_every` micro-batches, the first
    `gradient_accumulation_steps` of which (the first optimizer step) are on-policy."""

    def __init__(self, controller: DeltaController, *, gradient_accumulation_steps: int, generate_every: int) -> None:
        self.controller = controller
        self.accumulation, self.generate_every = gradient_accumulation_steps, generate_every
        self._window = (0.0, 0.0)  # (statistic x tokens, tokens) of this generation batch's off-policy micro-batches

    def record(self, statistics: Mapping[str, float], tokens: float, micro_step: int) -> dict[str, float]:
        """Feed one training micro-batch (`micro_step`: its index since training began, as TRL counts them); at the
        last micro-batch of a generation batch, move delta. Returns the metrics to log for this micro-batch."""
        key = self.controller.target
        logged = {objective_name("delta"): self.controller.delta}  # the delta this update used
        position = micro_step % self.generate_every
        if position >= self.accumulation:  # an optimizer step has passed since the batch was generated
            total, count = self._window
            self._window = (total + statistics[key] * tokens, count + tokens)
        if position == self.generate_every - 1:
            total, count = self._window
            self._window = (0.0, 0.0)
            if count > 0:
                self.controller.update({key: total / count})
                logged[objective_name(f"controller_{key}")] = total / count
        return logged

    # ------------------------------------------------------------------ checkpoints
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:  # the Trainer saves right after this event
            self._write(args, state)

    on_epoch_end = on_step_end

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a save decided after on_step_end (save_strategy="best") gets its file here, after trainer_state.json
        if not (_checkpoint(args, state) / DELTA_CONTROLLER_FILE).is_file():
            self._write(args, state)

    def _write(self, args: Any, state: Any) -> None:
        if args.should_save:
            write_json_atomic(_checkpoint(args, state) / DELTA_CONTROLLER_FILE, self.controller.state_dict())

    def load(self, checkpoint: str | Path, objective: str) -> None:
        """Continue from the controller state saved in `checkpoint`; ValueError if it has none."""
        path = Path(checkpoint) / DELTA_CONTROLLER_FILE
        if not path.is_file():
            raise ValueError(f"cannot resume {objective} from {checkpoint}: it has no {DELTA_CONTROLLER_FILE} (not "
                             "written by a run with adaptive delta), so its delta is unknown")
        self.controller.load_state_dict(json.loads(path.read_text()))


def _checkpoint(args: Any, state: Any) -> Path:
    """The folder the Trainer saves this step's checkpoint in (no hyper-parameter search)."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
