"""The per-token inputs every objective sees, validated once.

Validation lives here so that each objective can be a short formula: shapes are checked, advantages
are broadcast to (B, T), padded positions are neutralised (their values never reach the loss or the
gradient), and non-finite values on real tokens are rejected with the position that holds them.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

# Log-ratios are clamped before exp (as verl does) so that a stale old policy cannot overflow w.
LOG_RATIO_CLAMP = 20.0
LOGP_MAX = 1e-3  # a log-probability above this is not one (logits passed instead?)
# Inputs that are non-negative by definition (an entropy, a KL, a weight). Computed in float32 an exact 0 can come
# out a hair below it, so values down to -NONNEGATIVE_TOLERANCE pass; anything lower is a bug upstream.
NONNEGATIVE_TOLERANCE = 1e-4


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
            raise ValueError(f"objective {objective!r} needs the extra input {name!r} (a (B, T) tensor); "
                             f"pass it as compute_policy_loss(..., {name}=tensor)")
        return self.extras[name]


NON_FINITE = "{name} has {count} non-finite value(s) on unmasked tokens (first at index {where}: {value})"
NEGATIVE = ("{name} must be >= 0 on every valid token; found {count} negative value(s) "
            "(first at index {where}: {value:.4g})")


def _reject(name: str, x: torch.Tensor, bad: torch.Tensor, message: str) -> None:
    """Raise `message` (NON_FINITE, NEGATIVE) if any token is bad, naming the count and the first bad value."""
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(message.format(name=name, count=int(bad.sum()), where=where, value=x[where].item()))


def make_batch(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    extras: dict[str, torch.Tensor | None] | None = None,
    *,
    nonnegative: Collection[str] = (),
) -> PolicyBatch:
    """Validate inputs and build a PolicyBatch. `old_logp=None` means on-policy (ratio == 1). The extras named in
    `nonnegative` must be >= -NONNEGATIVE_TOLERANCE on every valid token."""
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a (B, T) tensor, got {_describe(logp)}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be a floating-point tensor, got dtype {logp.dtype}")
    shape = logp.shape
    old_logp = logp.detach() if old_logp is None else old_logp
    for name, x in (("mask", mask), ("old_logp", old_logp)):
        if not isinstance(x, torch.Tensor) or x.shape != shape:
            raise ValueError(f"{name} has shape {_describe(x)}, expected {tuple(shape)} (same as logp)")
    extras = {name: x for name, x in (extras or {}).items() if x is not None}
    for name, x in extras.items():
        if not isinstance(x, torch.Tensor) or x.shape != shape:
            raise ValueError(f"extra input {name!r} has shape {_describe(x)}, expected {tuple(shape)}")
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a tensor of shape (B,) or (B, T), got {_describe(advantages)}")
    for name, x in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask), *extras.items()):
        if x.device != logp.device:  # torch's own error would name no argument
            raise ValueError(f"{name} is on device {x.device}, logp on {logp.device}: every input must be on "
                             "logp's device")
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages.unsqueeze(1)  # per sequence: (B, 1), which broadcasts against (B, T)
    elif advantages.shape not in (shape, (shape[0], 1)):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({shape[0]},) or {tuple(shape)}")
    checked = [name for name in nonnegative if name in extras]
    return (_fast_batch(logp, old_logp, advantages, mask, extras, checked)
            or _checked_batch(logp, old_logp, advantages, mask, extras, checked))


def _fast_batch(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                extras: dict[str, torch.Tensor], nonnegative: list[str]) -> PolicyBatch | None:
    """The batch, when every input is finite everywhere, the mask is 0/1 and not empty, the log-probs are <= LOGP_MAX
    and |log w| <= LOG_RATIO_CLAMP on the valid tokens; else None. Padding is zeroed by multiplying with the mask
    (its gradient there is exactly 0), and the clamp, a no-op on such a batch, is skipped."""
    dtype = logp.dtype
    weights = (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).to(dtype)
    logp_w = logp * weights
    old_w = old_logp.detach().to(dtype) * weights
    log_ratio = logp_w - old_w
    cleaned = {name: x.to(dtype) * weights for name, x in extras.items()}
    must_be_finite = [logp.detach().sum(), old_logp.detach().sum(), advantages.detach().sum(),
                      *(x.detach().sum() for x in extras.values())]  # a sum is finite only if every term is
    at_most = [(logp_w.detach().amax(), LOGP_MAX), (old_w.amax(), LOGP_MAX),
               (log_ratio.detach().abs().amax(), LOG_RATIO_CLAMP),
               *((-cleaned[name].detach().amin(), NONNEGATIVE_TOLERANCE) for name in nonnegative)]
    binary = [] if mask.dtype == torch.bool else [(weights * (1 - weights)).abs().sum()]  # 0 iff every value 0 or 1
    probe = [weights.sum(), *binary, *must_be_finite, *(value for value, _ in at_most)]
    values = iter(torch.stack([v.to(dtype) for v in probe]).tolist())  # one device-to-host transfer
    usable = (next(values) > 0 and all(next(values) == 0 for _ in binary)
              and all(math.isfinite(next(values)) for _ in must_be_finite)
              and all(next(values) <= limit for _, limit in at_most))
    if not usable:
        return None
    return PolicyBatch(logp=logp_w, old_logp=old_w, advantages=advantages.detach().to(dtype) * weights, mask=weights,
                       log_ratio=log_ratio, ratio=log_ratio.exp(), extras=cleaned)


def _checked_batch(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   extras: dict[str, torch.Tensor], nonnegative: list[str]) -> PolicyBatch:
    """The token-by-token path: raises naming the first bad value, else neutralises padding whatever it holds."""
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():  # NaN and inf are neither
        raise ValueError("mask must contain only 0 and 1 (or be a bool tensor)")
    valid = mask != 0
    if not valid.any():
        raise ValueError("mask is empty: no token to train on (every position is padding)")
    advantages = advantages.expand(logp.shape)
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        _reject(name, x.detach(), ~torch.isfinite(x.detach()) & valid, NON_FINITE)
    for name, x in (("logp", logp), ("old_logp", old_logp)):
        too_big = (x.detach() > LOGP_MAX) & valid
        if too_big.any():
            raise ValueError(f"{name} must hold log-probabilities (<= 0); found {x.detach()[too_big].max().item():.4g}"
                             ". Were logits passed instead?")

    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Padding is replaced by a harmless constant so NaN/inf there cannot leak through 0 * x.
    logp = torch.where(valid, logp, zero)
    old_logp = torch.where(valid, old_logp.detach().to(logp.dtype), zero)
    advantages = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    clean_extras: dict[str, torch.Tensor] = {}
    for name, x in extras.items():
        _reject(name, x.detach(), ~torch.isfinite(x.detach()) & valid, NON_FINITE)
        clean_extras[name] = torch.where(valid, x.to(logp.dtype), zero)
    for name in nonnegative:
        _reject(name, clean_extras[name], (clean_extras[name].detach() < -NONNEGATIVE_TOLERANCE) & valid, NEGATIVE)
    return PolicyBatch(logp=logp, old_logp=old_logp, advantages=advantages, mask=valid.to(logp.dtype),
                       log_ratio=log_ratio, ratio=log_ratio.exp(), extras=clean_extras)


def _describe(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
