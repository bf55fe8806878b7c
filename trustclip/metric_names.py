"""Names under which trainers log metrics (one place, no heavy imports). `trustclip.compute_policy_loss` returns
plain keys (`clip_frac_low`, ...): trainers log each as `objective/<key>`, and also under the name the host framework
uses for the same quantity, so existing dashboards keep working."""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "objective/"

# trustclip key -> TRL 1.16 GRPOTrainer metric name with the same meaning (fraction of valid tokens).
TRL_NAMES: Mapping[str, str] = {
    "clip_frac_low": "clip_ratio/low_mean",
    "clip_frac_high": "clip_ratio/high_mean",
    "clip_frac": "clip_ratio/region_mean",
}
# TRL 1.16's per-sequence extremes of the same clip decisions: over every sequence of every process, the smallest
# fraction of its valid tokens clipped low / the largest clipped high (the TRL trainer logs them, train and eval).
TRL_CLIP_LOW_MIN = "clip_ratio/low_min"
TRL_CLIP_HIGH_MAX = "clip_ratio/high_max"
# trustclip key -> verl actor metric name with the same meaning. verl's `pg_clipfrac_lower` is the dual-clip
# fraction (A < 0 and w > c), not low-side ratio clipping.
VERL_NAMES: Mapping[str, str] = {
    "clip_frac": "actor/pg_clipfrac",
    "dual_clip_frac": "actor/pg_clipfrac_lower",
}

# Trainer-level series (same names as TRL logs them), used by plots and summaries.
REWARD = "reward"
ENTROPY = "entropy"
COMPLETION_LENGTH = "completions/mean_length"
POLICY_LOSS = "policy_loss"
KL_REF = "kl"  # k3 KL to the reference model, only when beta != 0
REWARD_TIMEOUTS = "reward/timeouts"  # cumulative math-verify timeouts (trustclip.rewards counters)
REWARD_ERRORS = "reward/errors"
KEPT_FRACTION = "update/kept_frac"  # completions left in the policy update by skip_zero_advantage
# |log pi_sampler - log pi_old| per completion token when vLLM samples (its own copy of the weights, its own kernels)
SAMPLER_GAP_MEAN = "sampler/logp_gap_mean"
SAMPLER_GAP_MAX = "sampler/logp_gap_max"
CLIP_LOW = PREFIX + "clip_frac_low"
CLIP_HIGH = PREFIX + "clip_frac_high"
CLIP_ANY = PREFIX + "clip_frac"


def objective_name(key: str) -> str:
    """`clip_frac_low` -> `objective/clip_frac_low`."""
    return PREFIX + key


def logged_names(key: str) -> list[str]:
    """Every name the TRL trainer logs a metric of `compute_policy_loss` under."""
    return [objective_name(key)] + ([TRL_NAMES[key]] if key in TRL_NAMES else [])
