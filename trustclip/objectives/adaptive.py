"""Adaptive delta: a controller that moves an objective's delta between updates, and `atr_adaptive`, the KL3 trust
region with it (ATR + the controller).

The ATR paper (arXiv 2602.05494, Section 6.5) leaves "adaptively adjust delta" to future work. Here delta
follows the rule of PPO's adaptive KL coefficient (Schulman et al. 2017, arXiv 1707.06347, Section 4), with
the trust-region radius delta in the place of the penalty coefficient beta:

    measure d on the last update                     (target="kl3_mean": mean KL3 = w - 1 - log w of its tokens)
    d > target_value * tolerance  ->  delta / factor  (the update moved too far: a tighter region)
    d < target_value / tolerance  ->  delta * factor  (it moved too little: a wider region)
    delta = min(max(delta, delta_min), delta_max)

PPO's defaults: tolerance 1.5, factor 2, target 0.01 (its best d_targ, Table 1). The mean KL3 of the tokens is
an unbiased estimate of the same per-state KL(pi_old || pi_theta) that PPO measures. With target="clip_frac"
the controller holds the fraction of tokens whose gradient the constraint removes, and moves delta the other
way (too many tokens held -> a wider region). Why kl3_mean is the default: docs/beyond-the-paper.md.

The controller is a trainer feature: `DeltaController` moves the `delta` of any objective that has one (kl1, kl2,
kl3, is_kl3, trgppo, truly_ppo, atr_seq, ...), and `TrustClipGRPOTrainer` runs it with `adaptive_delta=True`
(`adaptive_delta_kwargs`: its settings, `CONTROLLER_PARAMS`) and saves its state in every checkpoint. Objectives
stay pure and stateless: `atr_adaptive` is exactly ATR-GRPO (`kl3`) at a given delta, whose hyper-parameters also
carry the controller's settings, so that naming it asks for the controller (`carries_controller`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.clipping import clipped_surrogate
from trustclip.objectives.constraints import Constraint, kl_constraint
from trustclip.objectives.registry import (
    REGISTRY,
    Objective,
    TokenLoss,
    choice,
    get_objective,
    number,
    register_objective,
    resolve_name,
)

TARGETS = ("kl3_mean", "clip_frac")  # metric names of `policy_metrics`, held near target_value
# The controller's settings, declared once: `adaptive_delta_kwargs` of the trainer, and atr_adaptive's own.
CONTROLLER_PARAMS = {
    "target": choice(*TARGETS, doc="statistic held near target_value: mean KL3 of the update (PPO's rule) or the "
                     "fraction of tokens the constraint holds"),
    "target_value": number(0.01, low=0.0, strict_low=True, doc="kl3_mean: PPO's d_targ 0.01; clip_frac: 1% of tokens"),
    "delta_min": number(0.005, low=0.0, strict_low=True, doc="narrowest region (kl3: [0.903, 1.103])"),
    "delta_max": number(0.5, low=0.0, strict_low=True, doc="widest region (kl3: [0.302, 2.358])"),
    "tolerance": number(1.5, low=1.0, strict_low=True, doc="dead band [target / tol, target * tol] (PPO: 1.5)"),
    "factor": number(2.0, low=1.0, strict_low=True, doc="multiplicative step of delta (PPO: 2)"),
}


def _check_controller(hp: Mapping[str, Any], who: str = "atr_adaptive") -> None:
    """Cross-parameter rules: a non-empty delta range holding the initial delta, a target in its range."""
    low, high, delta = hp["delta_min"], hp["delta_max"], hp["delta"]
    if low >= high:
        raise ValueError(f"{who}: the delta range [delta_min={low}, delta_max={high}] is empty; "
                         "it needs delta_min < delta_max")
    if not low <= delta <= high:
        raise ValueError(f"{who}: the initial delta={delta} is outside the delta range [{low}, {high}]")
    value = hp["target_value"]
    if hp["target"] == "clip_frac" and value >= 1:
        raise ValueError(f"{who}: target_value={value} is outside the range of target='clip_frac' "
                         "(a fraction of tokens): it must be in (0, 1)")
    if hp["target"] == "kl3_mean" and value >= high:
        raise ValueError(f"{who}: target_value={value} is outside the range of target='kl3_mean': it must be "
                         f"in (0, delta_max={high}) (tokens kept inside the widest region have mean KL3 < delta_max)")


def carries_controller(objective: str | Objective) -> bool:
    """Whether naming this objective asks for the delta controller: its hyper-parameters carry the controller's
    settings (atr_adaptive, ATR + the controller)."""
    spec = objective.spec if isinstance(objective, Objective) else resolve_name(objective)
    return set(CONTROLLER_PARAMS) <= set(spec.params)


def controller_settings(objective: Objective, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The controller's settings for `objective` (its initial `delta`, then `CONTROLLER_PARAMS`), checked: those the
    objective carries (atr_adaptive; `given` is not read), else `given` over the defaults. ValueError naming a bad
    one, or an objective without a delta."""
    if "delta" not in objective.hparams:
        with_delta = sorted(name for name, spec in REGISTRY.items() if "delta" in spec.params)
        raise ValueError(f"adaptive delta moves the objective's delta, and objective {objective.name!r} has none; "
                         f"objectives with one: {', '.join(with_delta)}")
    if carries_controller(objective):  # checked with the objective's own hyper-parameters
        return {"delta": objective.hparams["delta"], **{k: objective.hparams[k] for k in CONTROLLER_PARAMS}}
    given = dict(given or {})
    if unknown := sorted(set(given) - set(CONTROLLER_PARAMS)):
        raise ValueError(f"adaptive delta: unknown setting(s) {unknown}; valid: {', '.join(CONTROLLER_PARAMS)}")
    settings = {"delta": objective.hparams["delta"], **{k: p.default for k, p in CONTROLLER_PARAMS.items()}, **given}
    for key, value in given.items():
        if not CONTROLLER_PARAMS[key].check(value):
            raise ValueError(f"adaptive delta: {key}={value!r} is invalid; it must be {CONTROLLER_PARAMS[key].rule}")
    _check_controller(settings, who=f"adaptive delta of {objective.name}")
    return settings


@register_objective(
    "atr_adaptive",
    source="ATR-GRPO (arXiv 2602.05494, Section 6.5 future work) with PPO's adaptive-KL rule "
           "(arXiv 1707.06347, Section 4); beyond both papers",
    summary="ATR-GRPO whose delta a controller moves between updates to hold the mean KL3 (or the clip fraction) "
            "near a target",
    params={"delta": number(0.07, low=0.0, strict_low=True, doc="delta of the first update (the paper's 0.07)"),
            **CONTROLLER_PARAMS},
    constraint=lambda hp: kl_constraint("kl3", hp["delta"]),
    check_all=_check_controller,
)
def atr_adaptive(batch: PolicyBatch, constraint: Constraint) -> TokenLoss:
    """At the current delta, ATR-GRPO (`kl3`): J = min(w A, clip(w, l_delta, u_delta) A), [l, u] the Lambert-W
    region of w - 1 - log w <= delta (arXiv 2602.05494, Theorem 4.2); the controller reads the other settings."""
    return clipped_surrogate(batch, constraint)


class DeltaController:
    """The state of adaptive delta: the objective's current delta, moved by `update` (the rule in the module
    docstring).

        controller = DeltaController("kl3", delta=0.07, target="clip_frac")   # any objective with a delta
        controller = DeltaController("atr_adaptive")        # an objective that carries the settings: its own
        loss, metrics = compute_policy_loss(controller.objective, ...)   # the objective at the current delta
        controller.update(metrics)                          # once per update (the trainer: per generation batch)

    `hparams` are the objective's hyper-parameters and the controller's settings (`CONTROLLER_PARAMS`, checked by
    `controller_settings`); an objective that carries the settings (atr_adaptive) takes them all itself.
    """

    def __init__(self, objective: Objective | str = "atr_adaptive", **hparams: Any) -> None:
        if carries_controller(objective):
            objective, control = get_objective(objective, **hparams), None
        else:
            control = {k: v for k, v in hparams.items() if k in CONTROLLER_PARAMS}
            objective = get_objective(objective, **{k: v for k, v in hparams.items() if k not in CONTROLLER_PARAMS})
        self.settings: dict[str, Any] = controller_settings(objective, control)
        self.delta: float = float(self.settings["delta"])
        self.updates = 0
        self.last_statistic: float | None = None
        self._objective = objective

    @property
    def target(self) -> str:
        """The metric held near `target_value` (`kl3_mean` or `clip_frac`), a key of `policy_metrics`."""
        return self.settings["target"]

    @property
    def objective(self) -> Objective:
        """The objective at the current delta."""
        if self._objective.hparams["delta"] != self.delta:
            self._objective = get_objective(self._objective, delta=self.delta)
        return self._objective

    def update(self, metrics: Mapping[str, float]) -> float:
        """Move delta from the statistic `metrics[target]` of the last update; returns the new delta."""
        if self.target not in metrics:
            raise ValueError(f"DeltaController.update needs the statistic {self.target!r} (target); got keys "
                             f"{sorted(metrics)}")
        value = float(metrics[self.target])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"DeltaController.update: {self.target}={value} must be a finite number >= 0")
        s = self.settings
        too_high, too_low = value > s["target_value"] * s["tolerance"], value < s["target_value"] / s["tolerance"]
        widen = too_low if self.target == "kl3_mean" else too_high  # kl3 too low / too many tokens held: widen
        tighten = too_high if self.target == "kl3_mean" else too_low
        step = s["factor"] if widen else (1 / s["factor"] if tighten else 1.0)
        self.delta = min(max(self.delta * step, s["delta_min"]), s["delta_max"])
        self.updates += 1
        self.last_statistic = value
        return self.delta

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: current delta, update count, last statistic, and the settings."""
        return {"delta": self.delta, "updates": self.updates, "last_statistic": self.last_statistic,
                "settings": dict(self.settings)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (e.g. a checkpoint's); its settings must be this controller's."""
        missing = {"delta", "updates", "last_statistic", "settings"} - set(state)
        if missing:
            raise ValueError(f"delta controller state lacks {sorted(missing)}")
        differ = {k: (v, self.settings.get(k)) for k, v in state["settings"].items() if self.settings.get(k) != v}
        if differ or set(state["settings"]) != set(self.settings):
            shown = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differ.items()) or "different keys"
            raise ValueError(f"the saved delta controller has other settings than this run ({shown}); a resumed run "
                             "continues with the settings of the run it resumes")
        delta = float(state["delta"])
        if not self.settings["delta_min"] <= delta <= self.settings["delta_max"]:
            raise ValueError(f"saved delta={delta} is outside [{self.settings['delta_min']}, "
                             f"{self.settings['delta_max']}]")
        self.delta, self.updates, self.last_statistic = delta, int(state["updates"]), state["last_statistic"]

    def __repr__(self) -> str:
        return (f"DeltaController(delta={self.delta:.6g}, target={self.target}={self.settings['target_value']}, "
                f"range=[{self.settings['delta_min']}, {self.settings['delta_max']}], updates={self.updates})")
