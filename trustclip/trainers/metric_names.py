"""Names under which trainer integrations log the policy-objective metrics (one place, no heavy imports).

`trustclip.compute_policy_loss` returns plain keys (`clip_frac_low`, `ratio_max`, ...). Trainers log each
under `objective/<key>`, and additionally under the name the host framework already uses for the same
quantity, so existing dashboards keep working. verl integrations use `VERL_NAMES` the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "objective/"

# trustclip key -> TRL 1.16 GRPOTrainer metric name with the same meaning (fraction of valid tokens).
TRL_NAMES: Mapping[str, str] = {
    "clip_frac_low": "clip_ratio/low_mean",
    "clip_frac_high": "clip_ratio/high_mean",
    "clip_frac": "clip_ratio/region_mean",
}
# trustclip key -> verl actor metric name with the same meaning. verl's `pg_clipfrac_lower` is the dual-clip
# fraction (A < 0 and w > c), not low-side ratio clipping.
VERL_NAMES: Mapping[str, str] = {
    "clip_frac": "actor/pg_clipfrac",
    "dual_clip_frac": "actor/pg_clipfrac_lower",
}

# Trainer-level series (same names as TRL logs them), used by plots and summaries.
REWARD = "reward"
REWARD_STD = "reward_std"
FRAC_ZERO_STD = "frac_reward_zero_std"
ENTROPY = "entropy"
COMPLETION_LENGTH = "completions/mean_length"
POLICY_LOSS = "policy_loss"
KL_REF = "kl"  # k3 KL to the reference model, only when beta != 0
REWARD_TIMEOUTS = "reward/timeouts"  # cumulative math-verify timeouts (trustclip.rewards counters)
REWARD_ERRORS = "reward/errors"
CLIP_LOW = PREFIX + "clip_frac_low"
CLIP_HIGH = PREFIX + "clip_frac_high"
CLIP_ANY = PREFIX + "clip_frac"


def objective_name(key: str) -> str:
    """`clip_frac_low` -> `objective/clip_frac_low`."""
    return PREFIX + key


def logged_names(key: str, framework: str = "trl") -> list[str]:
    """Every name a metric of `compute_policy_loss` is logged under for `framework` ('trl' or 'verl')."""
    table = {"trl": TRL_NAMES, "verl": VERL_NAMES}.get(framework)
    if table is None:
        raise ValueError(f"unknown framework {framework!r}; valid: trl, verl")
    return [objective_name(key)] + ([table[key]] if key in table else [])


def rename(metrics: Mapping[str, float], framework: str = "trl") -> dict[str, float]:
    """Metrics of `compute_policy_loss` under all their logged names."""
    return {name: value for key, value in metrics.items() for name in logged_names(key, framework)}
