"""TRL's own loss options (`GRPOConfig.loss_type`, `epsilon`, `epsilon_high`, `delta`, the SAPO / VESPO parameters
and `scale_rewards`) under a trustclip objective: `translate` maps each onto the trustclip setting it spells, or
refuses it; never silently ignored. Exact correspondences (TRL 1.16's `_compute_loss`, `trl/trainer/grpo_trainer.py`):

- loss_type grpo / dr_grpo / dapo: the PPO clip -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A) = objective
  `clip` (epsilon_high unset or equal to epsilon) or `clip_higher`, aggregated as `seq_mean_token_mean` / `dr_grpo`
  / `token_mean`. With TRL's `delta` (INTELLECT-2's two-sided clip, arXiv 2505.07291: w capped at delta for A < 0),
  for delta >= 1 + epsilon_high, it is `dual_clip` with clip_ratio_c = delta (Ye et al. 2020, arXiv 1912.09729).
- loss_type cispo: -sg(min(w, epsilon_high)) A log pi, token mean = objective `cispo` with epsilon_high - 1 (TRL's
  epsilon_high is an absolute cap on w; trustclip's is 1 + epsilon_high), no lower bound.
- loss_type sapo: -sigmoid(tau (w - 1)) 4 / tau A, tau = sapo_temperature_pos / _neg = objective `sapo` (tau_pos /
  tau_neg), aggregated `seq_mean_token_mean`.
- scale_rewards group (True) / none (False): advantage_estimator `grpo` / `dr_grpo`.

loss_type grpo / dr_grpo / dapo without epsilon, epsilon_high or delta is TRL's default clip plus a normaliser: with
an objective given, the objective replaces the clip and loss_type keeps its meaning for the normaliser (the
aggregation), as GRPOConfig's own loss_type (always set: TRL cannot tell its default from a given value) must.

Refused, each with what to set instead: loss_type bnpo (per-micro-batch normaliser), luspo and vespo, an unknown
loss_type, an option TRL itself ignores with the loss type given, scale_rewards batch; and every option where
objective, aggregation and advantage_estimator are all given (as `trustclip train` always gives them), since it could
only spell one of those a second time (`refuse_second_spelling`). One policy, the library's and `trustclip train`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trustclip.objectives.registry import is_finite_number

# GRPOConfig fields that only TRL's own loss reads: the trustclip objective replaces all of them.
LOSS_OPTIONS = ("loss_type", "epsilon", "epsilon_high", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
                "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
OPTIONS = (*LOSS_OPTIONS, "scale_rewards")
# the ones a plain GRPOConfig always means (its normaliser and reward scaling), whatever the objective
ALWAYS_MEANT = ("loss_type", "scale_rewards")
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# TRL loss type -> trustclip aggregation of the same normaliser
AGGREGATION_OF = {"grpo": "seq_mean_token_mean", "dr_grpo": "dr_grpo", "dapo": "token_mean", "cispo": "token_mean",
                  "sapo": "seq_mean_token_mean"}
ESTIMATOR_OF = {"group": "grpo", True: "grpo", "none": "dr_grpo", False: "dr_grpo"}
# advantage estimator -> TRL's reward scaling that computes it (rloo additionally rescales by G / (G - 1))
SCALE_REWARDS_OF = {"grpo": "group", "dr_grpo": "none", "rloo": "none"}
CLIP_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")  # TRL's PPO clip, each with its own normaliser
# options that only one TRL loss type reads
OWNER_OF = {"sapo_temperature_pos": "sapo", "sapo_temperature_neg": "sapo", "vespo_k_pos": "vespo",
            "vespo_lambda_pos": "vespo", "vespo_k_neg": "vespo", "vespo_lambda_neg": "vespo"}
TRL_EPSILON = 0.2  # GRPOConfig.epsilon's default, which TRL's loss uses when epsilon is not given


@dataclass
class TrlLoss:
    """The trustclip settings TRL's loss options stand for; None where the options say nothing."""

    objective: str | None = None
    objective_kwargs: dict[str, Any] = field(default_factory=dict)
    aggregation: str | None = None
    advantage_estimator: str | None = None
    default_clip: bool = False  # the objective is TRL's clip at TRL's default epsilon, spelled by loss_type alone

    def as_settings(self, prefix: str = "") -> str:
        """`objective='clip', objective_kwargs={'epsilon': 0.3}, aggregation='token_mean'` (`prefix` e.g. 'rl.')."""
        items = [("objective", self.objective), ("objective_kwargs", self.objective_kwargs or None),
                 ("aggregation", self.aggregation), ("advantage_estimator", self.advantage_estimator)]
        return ", ".join(f"{prefix}{key}={value!r}" for key, value in items if value is not None)


def spelled(options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


def translate(options: dict[str, Any]) -> TrlLoss:
    """The trustclip settings that TRL's loss computes with `options` (the OPTIONS the user gave; the others at TRL's
    defaults). Raises ValueError naming the option when no trustclip setting computes it."""
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise ValueError(f"not TRL loss options: {unknown}")
    out = TrlLoss()
    if "scale_rewards" in options:
        value = options["scale_rewards"]
        if value not in ESTIMATOR_OF:
            raise ValueError(f"scale_rewards={value!r}: trustclip has no advantage estimator with this reward scaling "
                             "(TRL's 'batch' divides by the batch's std); choose advantage_estimator from grpo "
                             "(group std, scale_rewards='group'), dr_grpo (no scaling, 'none') or rloo")
        out.advantage_estimator = ESTIMATOR_OF[value]
    loss = {k: v for k, v in options.items() if k in LOSS_OPTIONS}
    if not loss:
        return out
    loss_type = loss.get("loss_type", "dapo")  # TRL's default
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not a TRL loss type ({', '.join(TRL_LOSS_TYPES)}); trustclip "
                         "replaces TRL's loss: set objective (see `trustclip objectives`) and aggregation instead")
    if loss_type == "bnpo":
        raise ValueError("loss_type='bnpo' normalises by the tokens of each micro-batch, which no trustclip "
                         "aggregation does; use aggregation='token_mean' (the whole optimizer step's tokens, TRL's "
                         "'dapo') with objective='clip'")
    if loss_type in ("luspo", "vespo"):
        raise ValueError(f"{spelled(loss)}: trustclip has no objective computing TRL's {loss_type} loss; choose a "
                         "trustclip objective (`trustclip objectives`; gspo for sequence-level ratios) with "
                         "objective / objective_kwargs")
    if "loss_type" in loss:
        out.aggregation = AGGREGATION_OF[loss_type]
    out.objective, out.objective_kwargs = _objective_of(loss_type, loss)
    out.default_clip = loss_type in CLIP_LOSS_TYPES and not {"epsilon", "epsilon_high", "delta"} & loss.keys()
    return out


def refuse_second_spelling(options: dict[str, Any], prefix: str = "") -> None:
    """The policy where objective, aggregation and advantage_estimator are all given (always in `trustclip train`):
    TRL's loss options `options` could only spell those settings a second time, so any is refused, naming the
    settings it stands for (or why none computes it). `prefix`: how the caller spells its settings, e.g. 'rl.' (the
    options are then its `rl.trl_kwargs`). Nothing given, nothing refused."""
    if not options:
        return
    where = f"{prefix}trl_kwargs: " if prefix else ""
    try:
        equivalent = translate(options)
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None
    raise ValueError(f"{where}{spelled(options)} are TRL's loss options, which the trustclip objective replaces; set "
                     f"{equivalent.as_settings(prefix)} instead")


def _objective_of(loss_type: str, loss: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    def unused(*keys: str) -> None:
        given = [key for key in keys if key in loss]
        if given:
            owners = sorted({OWNER_OF[k] for k in given if k in OWNER_OF})
            only = f" (only loss_type={' / '.join(map(repr, owners))} does)" if owners else ""
            default = "" if "loss_type" in loss else ", TRL's default,"
            raise ValueError(f"{spelled({k: loss[k] for k in given})}: TRL's loss_type={loss_type!r}{default} does "
                             f"not use {' or '.join(given)}{only}; drop it (trustclip's objective_kwargs hold the "
                             "objective's hyper-parameters)")

    unused(*(key for key, owner in OWNER_OF.items() if owner != loss_type))
    if loss_type == "sapo":
        unused("epsilon", "epsilon_high", "delta")
        names = {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"}
        return "sapo", {names[k]: v for k, v in loss.items() if k in names}
    if loss_type == "cispo":
        unused("delta", *(("epsilon",) if "epsilon_high" in loss else ()))
        cap = loss.get("epsilon_high", loss.get("epsilon", TRL_EPSILON))
        if not is_finite_number(cap) or cap < 1:
            raise ValueError(f"{spelled(loss)}: TRL's cispo caps the ratio w at epsilon_high (epsilon when it is "
                             f"not set), here {cap!r}, below 1; give epsilon_high >= 1 (ScaleRL's 5.0), or use "
                             "objective='cispo' with objective_kwargs={'epsilon_high': ...} (a cap of "
                             "1 + epsilon_high)")
        return "cispo", {"epsilon_high": cap - 1}
    low = loss.get("epsilon", TRL_EPSILON)
    high = loss.get("epsilon_high", low)
    delta = loss.get("delta")
    if delta is not None:
        if not (is_finite_number(high) and is_finite_number(delta) and delta >= 1 + high):
            raise ValueError(f"{spelled(loss)}: TRL's two-sided clip (delta) is dual_clip only for delta >= "
                             f"1 + epsilon_high; use objective='dual_clip' with objective_kwargs epsilon_low, "
                             "epsilon_high and clip_ratio_c")
        return "dual_clip", {"epsilon_low": low, "epsilon_high": high, "clip_ratio_c": delta}
    if high == low:
        return "clip", {"epsilon": low}
    return "clip_higher", {"epsilon_low": low, "epsilon_high": high}
