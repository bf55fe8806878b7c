"""Policy-divergence constraints C_t: the pluggable part of the unified clipping framework.

ATR paper (arXiv 2602.05494), eq. 5:
    clip_general(w_t, C) = w_t if C_t(theta) holds, else w_t(theta_old) (= 1, no gradient)
    J = E[min(w_t A_t, clip_general(w_t, C) A_t)]
A constraint answers one question per token, `holds(batch) -> bool (B, T)`; one whose feasible set is a ratio
interval [l, u] also exposes `interval(batch)`, for PPO's form of the surrogate (`clipped_surrogate`). Write your own
by subclassing `Constraint` (or pass any divergence of w to `DivergenceConstraint`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trustclip.objectives import bounds as B
from trustclip.objectives.batch import PolicyBatch

Bound = float | torch.Tensor


class Constraint:
    """Base class: a per-token feasibility test C_t(theta)."""

    def holds(self, batch: PolicyBatch) -> torch.Tensor:
        """Bool (B, T); by default the ratio is within `interval` (a constraint without one overrides this)."""
        bounds = self.interval(batch)
        if bounds is None:
            raise NotImplementedError
        return (batch.ratio >= bounds[0]) & (batch.ratio <= bounds[1])

    def interval(self, batch: PolicyBatch) -> tuple[Bound, Bound] | None:
        """Ratio bounds [l, u] equivalent to the constraint, or None if it is not an interval. An interval holds
        the unchanged policy: l <= 1 <= u (floats, or (B, T) tensors)."""
        return None


@dataclass(frozen=True)
class RatioInterval(Constraint):
    """C_t := low <= w_t <= high (PPO / GRPO / DAPO ratio clipping)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (0 <= self.low <= 1 <= self.high):
            raise ValueError(f"ratio interval must satisfy 0 <= low <= 1 <= high, got [{self.low}, {self.high}]")

    def interval(self, batch: PolicyBatch) -> tuple[Bound, Bound]:
        return self.low, self.high


@dataclass(frozen=True)
class DivergenceConstraint(Constraint):
    """C_t := D(w_t) <= delta for a per-token divergence estimator D of the ratio.

    `bounds` is the equivalent ratio interval when D is convex in w (closed form or root-found);
    leave it None for a D whose sublevel set is not an interval: the boolean test is then used as is.
    """

    name: str
    divergence: Callable[[torch.Tensor], torch.Tensor]
    delta: float
    bounds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.bounds is not None and not self.bounds[0] <= 1 <= self.bounds[1]:
            raise ValueError(f"{self.name}: bounds {self.bounds} must hold w = 1 (a divergence of the ratio is 0 "
                             "there): low <= 1 <= high")

    def holds(self, batch: PolicyBatch) -> torch.Tensor:
        return self.divergence(batch.ratio.detach()) <= self.delta

    def interval(self, batch: PolicyBatch) -> tuple[Bound, Bound] | None:
        return self.bounds


def kl_constraint(kind: str, delta: float, **options) -> DivergenceConstraint:
    """The paper's estimator constraints (Schulman 2020 k1/k2/k3, IS-weighted k3) with exact bounds.

    Memoised per (estimator, delta, options): an objective's bounds (a Lambert-W or root solve) are computed once,
    not on every forward; the constraint is immutable, so sharing it is safe."""
    return _kl_constraint(kind, B.check_delta(delta), **options)


@functools.lru_cache(maxsize=256)
def _kl_constraint(kind: str, delta: float, **options) -> DivergenceConstraint:
    if kind == "kl1":
        if options.get("two_sided"):
            return DivergenceConstraint("|kl1|", lambda w: w.log().abs(), delta, B.kl1_bounds(delta, True))
        return DivergenceConstraint("kl1", B.kl1, delta, B.kl1_bounds(delta))
    if kind == "kl2":
        return DivergenceConstraint("kl2", B.kl2, delta, B.kl2_bounds(delta))
    if kind == "kl3":
        return DivergenceConstraint("kl3", B.kl3, delta, B.kl3_bounds(delta))
    if kind == "is_kl3":
        if options.get("form", "w_log_w") == "w_times_kl3":
            # w * (w - 1 - log w): not monotone on (0, 1), so not an interval; use the boolean test.
            return DivergenceConstraint("w*kl3", lambda w: w * B.kl3(w), delta, None)
        if delta >= 1:
            raise ValueError(f"is_kl3 needs delta < 1 (w log w - w + 1 < 1 for all w < e), got {delta}")
        return DivergenceConstraint("is_kl3", B.is_kl3, delta, B.is_kl3_bounds(delta))
    raise ValueError(f"unknown KL estimator {kind!r}; choose from kl1, kl2, kl3, is_kl3")


def custom_divergence(divergence: Callable, delta: float, name: str = "custom") -> DivergenceConstraint:
    """A user divergence of w (D(1) = 0, D >= 0, convex in w): bounds are root-found once (float64, brentq), after
    checking on a grid what can be checked (`bounds.divergence_bounds`); a D that fails is refused (ValueError)."""

    def scalar(w: float) -> float:
        return float(divergence(torch.tensor(w, dtype=torch.float64)))

    return DivergenceConstraint(name, divergence, B.check_delta(delta), B.divergence_bounds(scalar, delta))


@dataclass(frozen=True)
class ProbabilityInterval(Constraint):
    """C_t := l(q_t) <= w_t <= u(q_t), bounds depending on q_t = pi_old(y_t | s_t) (DCPO, TRGPPO)."""

    name: str
    bounds_of_q: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def interval(self, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bounds_of_q(batch.old_logp.exp())


BINARY_DIVERGENCES = ("tv", "kl")


@dataclass(frozen=True)
class BinaryDivergence(Constraint):
    """C_t := D(q_t, p_t) <= delta, D a divergence between the old and the new policy with the vocabulary collapsed to
    {sampled token, every other token} (DPPO's Binary approximation, arXiv 2602.04879): q = pi_old(y_t),
    p = pi_theta(y_t) = w q. `kind` 'tv': D = |p - q|; 'kl': D = q log(q/p) + (1 - q) log((1 - q)/(1 - p)) =
    KL(pi_old || pi_theta) of the two-point distributions. delta_low applies where p < q, delta_high where p > q.

    D is computed from the log-probabilities themselves (as DPPO's code does), not from the ratio clamped at
    e^+-20. For fixed q, D is convex in p with D = 0 at p = q, so the feasible set is a ratio interval that depends on
    q (`interval`): [1 - delta_low / q, 1 + delta_high / q] for TV, TRGPPO's KL region for KL."""

    kind: str
    delta_low: float
    delta_high: float

    def __post_init__(self) -> None:
        if self.kind not in BINARY_DIVERGENCES:
            raise ValueError(f"binary divergence kind must be one of {BINARY_DIVERGENCES}, got {self.kind!r}")
        for name in ("delta_low", "delta_high"):
            B.check_delta(getattr(self, name))

    def divergence(self, batch: PolicyBatch) -> torch.Tensor:
        """D(q_t, p_t) per token, (B, T), no gradient."""
        logp, old_logp = batch.logp.detach(), batch.old_logp.detach()
        q = old_logp.exp()
        if self.kind == "tv":
            return (logp.exp() - q).abs()
        # log(1 - x) = log(-expm1(log x)) keeps precision when x is close to 1; (1 - q) * ... is 0 when q == 1,
        # even where p == 1 makes the log infinite (then D is +inf for q < 1: the token left any trust region)
        log_rest = torch.log(-torch.expm1(old_logp)) - torch.log(-torch.expm1(logp))
        rest = torch.where(q < 1, (1 - q) * log_rest, torch.zeros_like(q))
        return q * (old_logp - logp) + rest

    def holds(self, batch: PolicyBatch) -> torch.Tensor:
        divergence = self.divergence(batch)  # compared with each threshold as a Python float: no rounding of delta
        return torch.where(batch.logp.detach() > batch.old_logp, divergence <= self.delta_high,
                           divergence <= self.delta_low)

    def interval(self, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        q = batch.old_logp.exp()
        if self.kind == "tv":
            return B.dppo_tv_bounds(q, self.delta_low, self.delta_high)
        return B.trgppo_bounds(q, self.delta_low, None)[0], B.trgppo_bounds(q, self.delta_high, None)[1]


@dataclass(frozen=True)
class FullKLConstraint(Constraint):
    """C_t := KL(pi_old(.|s_t) || pi_theta(.|s_t)) < delta, the exact full-vocabulary KL given as the
    `full_kl` extra (TR-PPO, Wang et al. 2020)."""

    delta: float

    def holds(self, batch: PolicyBatch) -> torch.Tensor:
        return batch.extra("full_kl", "truly_ppo").detach() < self.delta
