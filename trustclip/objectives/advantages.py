"""Outcome-reward advantage estimators; rewards (B,) with each group of G responses contiguous.

  grpo     A_i = (R_i - mean_g R) / (std_g R + eps)   GRPO (arXiv 2402.03300); std is Bessel-corrected
  dr_grpo  A_i = R_i - mean_g R                       Dr.GRPO (arXiv 2503.20783): no difficulty bias
  rloo     A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g R)   RLOO (arXiv 2402.14740)

A group of one has no baseline: its advantage is R itself (verl's convention: mean 0, std 1).
A group whose rewards all agree gets A = 0 and contributes no gradient.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def compute_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "dr_grpo", *, eps: float = 1e-6
) -> torch.Tensor:
    """Per-response advantages (B,) from per-response rewards (B,)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing the batch ({rewards.numel()})")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards contain non-finite values: {rewards[~torch.isfinite(rewards)].tolist()}")
    grouped = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32).view(-1, group_size)
    if group_size == 1:
        return grouped.view(-1)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif estimator == "rloo":
        centred = centred * group_size / (group_size - 1)
    return centred.view(-1)
