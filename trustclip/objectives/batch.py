"""The per-token inputs every objective sees, validated once.

Validation lives here so that each objective can be a short formula: shapes are checked, advantages
are broadcast to (B, T), padded positions are neutralised (their values never reach the loss or the
gradient), and non-finite values on real tokens are rejected with the position that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Log-ratios are clamped before exp (as verl does) so that a stale old policy cannot overflow w.
LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyBatch:
    """Per-token tensors of one batch, shape (B, T); `log_ratio` is clamped to +-20."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def extra(self, name: str, objective: str) -> torch.Tensor:
        if name not in self.extras:
            raise ValueError(
                f"objective {objective!r} needs the extra input {name!r} (a (B, T) tensor); "
                f"pass it as compute_policy_loss(..., {name}=tensor)"
            )
        return self.extras[name]


def _check_finite(name: str, x: torch.Tensor, valid: torch.Tensor) -> None:
    bad = ~torch.isfinite(x) & valid
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) on unmasked tokens "
            f"(first at index {where}: {x[where].item()})"
        )


def _as_valid_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)} (same as logp)")
    if mask.dtype != torch.bool:
        if not torch.isfinite(mask).all() or not ((mask == 0) | (mask == 1)).all():
            raise ValueError("mask must contain only 0 and 1 (or be a bool tensor)")
        mask = mask != 0
    if not mask.any():
        raise ValueError("mask is empty: no token to train on (every position is padding)")
    return mask


def make_batch(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    extras: dict[str, torch.Tensor | None] | None = None,
) -> PolicyBatch:
    """Validate inputs and build a PolicyBatch. `old_logp=None` means on-policy (ratio == 1)."""
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a (B, T) tensor, got {_describe(logp)}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be a floating-point tensor, got dtype {logp.dtype}")
    shape = logp.shape
    valid = _as_valid_mask(mask, shape)
    old_logp = logp.detach() if old_logp is None else old_logp
    if not isinstance(old_logp, torch.Tensor) or old_logp.shape != shape:
        raise ValueError(f"old_logp has shape {_describe(old_logp)}, expected {tuple(shape)} (same as logp)")
    advantages = _broadcast_advantages(advantages, shape)
    _check_finite("logp", logp.detach(), valid)
    _check_finite("old_logp", old_logp.detach(), valid)
    _check_finite("advantages", advantages.detach(), valid)
    for name, x in (("logp", logp), ("old_logp", old_logp)):
        too_big = (x.detach() > 1e-3) & valid
        if too_big.any():
            raise ValueError(
                f"{name} must hold log-probabilities (<= 0); found {x.detach()[too_big].max().item():.4g}. "
                "Were logits passed instead?"
            )

    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Padding is replaced by a harmless constant so NaN/inf there cannot leak through 0 * x.
    logp = torch.where(valid, logp, zero)
    old_logp = torch.where(valid, old_logp.detach().to(logp.dtype), zero)
    advantages = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    clean_extras: dict[str, torch.Tensor] = {}
    for name, x in (extras or {}).items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.shape != shape:
            raise ValueError(f"extra input {name!r} has shape {_describe(x)}, expected {tuple(shape)}")
        _check_finite(name, x.detach(), valid)
        clean_extras[name] = torch.where(valid, x.to(logp.dtype), zero)
    return PolicyBatch(
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=valid.to(logp.dtype),
        log_ratio=log_ratio,
        ratio=log_ratio.exp(),
        extras=clean_extras,
    )


def _broadcast_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a tensor of shape (B,) or (B, T), got {_describe(advantages)}")
    if advantages.dim() == 2 and advantages.shape[1] == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages[:, 0]
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages.unsqueeze(1).expand(shape)
    if advantages.shape == shape:
        return advantages
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)}, expected ({shape[0]},) or {tuple(shape)}"
    )


def _describe(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
