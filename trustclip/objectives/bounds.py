"""Ratio regions of divergence constraints: {w : D(w) <= delta} as an interval [l, u].

Every per-token divergence estimator used here is a convex function of the ratio w with minimum 0
at w = 1, so its sublevel set is an interval, and clipping with the constraint is exactly asymmetric
ratio clipping with these bounds (ATR paper, arXiv 2602.05494, Theorem 4.2).

Closed forms (float64, scipy):
  KL3     w - 1 - log w        l = -W_0(-e^{-(1+d)}),        u = -W_{-1}(-e^{-(1+d)})
  IS-KL3  w log w - w + 1      l = exp(1 + W_{-1}((d-1)/e)), u = exp(1 + W_0((d-1)/e))
  KL2     (log w)^2 / 2        [exp(-sqrt(2d)), exp(sqrt(2d))]
  KL1     -log w               [exp(-d), inf)  (|log w| <= d: [exp(-d), exp(d)])
and `divergence_bounds` root-finds the interval of any user divergence that is convex in w.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.special import lambertw


def check_delta(delta: float) -> float:
    """Return delta as a float, or raise ValueError if it is not a finite positive number."""
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"delta must be a positive number, got {delta!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"delta must be a finite number > 0, got {delta!r}")
    return value


def check_probability(q):
    """Return q unchanged, or raise ValueError unless every value is a probability in (0, 1] (q = pi_old(y_t) is the
    probability of a sampled token, so 0 cannot occur; NaN, inf and values outside the range are rejected)."""
    try:
        values = np.asarray(q.detach().double().cpu() if hasattr(q, "detach") else q, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ValueError(f"q must be a probability in (0, 1], got {q!r}") from None
    if values.size == 0:
        raise ValueError("q is empty: give at least one probability in (0, 1]")
    bad = ~((values > 0) & (values <= 1))
    if bad.any():
        raise ValueError("q must be a probability in (0, 1] (the old probability of the sampled token), "
                         f"got {float(values[bad][0])!r}")
    return q


# Per-token divergence estimators of the ratio w (numpy or torch, elementwise).
def kl1(w):
    """k1 = -log w (Schulman 2020): unbiased, can be negative."""
    return -_log(w)


def kl2(w):
    """k2 = (log w)^2 / 2: biased, non-negative."""
    return 0.5 * _log(w) ** 2


def kl3(w):
    """k3 = w - 1 - log w: unbiased estimate of KL(pi_old || pi_theta), non-negative, convex."""
    return w - 1 - _log(w)


def is_kl3(w):
    """IS-weighted k3 = w * k3(1/w) = w log w - w + 1: unbiased for KL(pi_theta || pi_old)."""
    return w * _log(w) - w + 1


def _log(w):
    return w.log() if hasattr(w, "log") else np.log(w)


def kl3_bounds(delta: float) -> tuple[float, float]:
    """Exact KL3 ratio region via the two real Lambert-W branches (ATR paper, Appendix A.1)."""
    delta = check_delta(delta)
    z = -math.exp(-(1.0 + delta))
    low = -lambertw(z, 0).real
    high = -lambertw(z, -1).real
    if not math.isfinite(high):
        # z underflows to -0 for delta > ~700 and W_{-1}(-0) = -inf, yet the root is finite (about delta + log delta):
        # solve u - 1 - log u = delta on its bracket (1 + delta, 2 (1 + delta)) instead.
        high = brentq(lambda u: u - 1.0 - math.log(u) - delta, 1.0 + delta, 2.0 * (1.0 + delta), xtol=1e-12)
    return float(low), float(high)


def is_kl3_bounds(delta: float) -> tuple[float, float]:
    """Region of w log w - w + 1 <= delta. Needs delta < 1 (at w -> 0 the divergence tends to 1)."""
    delta = check_delta(delta)
    z = (delta - 1.0) / math.e
    high = math.exp(1.0 + lambertw(z, 0).real)
    low = math.exp(1.0 + lambertw(z, -1).real) if delta < 1.0 else 0.0
    return float(low), float(high)


def kl2_bounds(delta: float) -> tuple[float, float]:
    """Region of (log w)^2 / 2 <= delta: symmetric in log space."""
    delta = check_delta(delta)
    r = math.sqrt(2.0 * delta)
    return math.exp(-r), (math.exp(r) if r < 709.0 else math.inf)  # exp overflows float64 beyond ~709.78


def kl1_bounds(delta: float, two_sided: bool = False) -> tuple[float, float]:
    """Region of -log w <= delta (one-sided: no upper bound) or of |log w| <= delta."""
    delta = check_delta(delta)
    return math.exp(-delta), (math.exp(delta) if two_sided and delta < 709.0 else math.inf)


DIVERGENCE_GRID = np.unique(np.concatenate([np.geomspace(1e-12, 1e6, 181), np.linspace(0.5, 1.5, 101), [1.0]]))
NEGATIVE_TOLERANCE = 1e-12  # float64 round-off of a divergence that is 0


def divergence_bounds(divergence: Callable[[float], float], delta: float) -> tuple[float, float]:
    """Interval {w > 0 : D(w) <= delta} for a divergence D of the ratio (D(1) = 0, D >= 0, convex in w), found with
    brentq from the first grid points on each side of 1 where D exceeds delta.

    What can be checked is, on `DIVERGENCE_GRID` (1e-12 to 1e6, denser near 1): D(1) = 0, D >= 0, D a number (or +inf)
    everywhere, and the interval being the whole feasible set, i.e. no grid point beyond it with D <= delta again (a
    non-convex D, whose sublevel set is not an interval, is refused rather than given wrong bounds). A side where D
    never exceeds delta is unbounded: the low end becomes 0, the high end inf.
    """
    delta = check_delta(delta)
    d1 = float(divergence(1.0))
    if not abs(d1) <= NEGATIVE_TOLERANCE:  # also catches NaN
        raise ValueError(f"divergence must be 0 at w = 1 (got D(1) = {d1}); is it a divergence of the ratio?")
    grid = DIVERGENCE_GRID
    values = np.array([float(divergence(float(w))) for w in grid])
    for w, value in zip(grid, values, strict=True):
        if math.isnan(value) or value == -math.inf:
            raise ValueError(f"divergence is {value} at w = {w:.4g}: it must be a number (or +inf) for every ratio "
                             f"w in [{grid[0]:g}, {grid[-1]:g}]")
    if (negative := values < -NEGATIVE_TOLERANCE).any():
        w = grid[negative][0]
        raise ValueError(f"divergence is negative at w = {w:.4g} (D = {values[negative][0]:.4g}): a divergence of the "
                         "ratio is >= 0, with its minimum 0 at w = 1")

    def excess(w: float) -> float:
        return min(float(divergence(w)) - delta, np.finfo(np.float64).max)  # +inf would stall brentq

    one = int(np.flatnonzero(grid == 1.0)[0])
    above = values > delta
    right = next((i for i in range(one, len(grid)) if above[i]), None)
    left = next((i for i in range(one, -1, -1) if above[i]), None)
    low = 0.0 if left is None else brentq(excess, grid[left], grid[left + 1], xtol=1e-15)
    high = math.inf if right is None else brentq(excess, grid[right - 1], grid[right], xtol=1e-15)
    stray = ~above & ((grid < low) | (grid > high))
    if stray.any():
        w = grid[stray][0]
        raise ValueError(
            f"divergence: {{w : D(w) <= {delta:g}}} is not an interval, so it has no ratio bounds: D leaves it at "
            f"[{low:.4g}, {high:.4g}] and is back below delta at w = {w:.4g} (D = {values[stray][0]:.4g}). Ratio "
            "bounds need a D convex in w; for any other D use DivergenceConstraint(name, D, delta) without bounds, "
            "whose per-token test D(w) <= delta is exact")
    return float(low), float(high)


# Probability-dependent regions (bounds are functions of q = pi_old(y_t | s_t)).
def dcpo_bounds(q, epsilon_low: float = 0.16, epsilon_high: float = 0.2, max_high: float = 10.0):
    """DCPO dynamic adaptive clipping (arXiv 2509.02333): from |w - 1| * w <= eps / q,
    l(q) = 1/2 + 1/2 sqrt(max(1 - 4 eps_l / q, 0)),  u(q) = min(1/2 + 1/2 sqrt(1 + 4 eps_h / q), max_high).
    Works on floats, numpy arrays and torch tensors (q in (0, 1]; checked for floats and arrays)."""
    xp, q = (torch, q) if hasattr(q, "clamp") else (np, np.asarray(check_probability(q), dtype=np.float64))
    low = 0.5 + 0.5 * xp.sqrt(xp.clip(1 - 4 * epsilon_low / q, 0, None))
    high = xp.clip(0.5 + 0.5 * xp.sqrt(1 + 4 * epsilon_high / q), None, max_high)
    return (float(low), float(high)) if xp is np and low.ndim == 0 else (low, high)


def dppo_tv_bounds(q, delta_low: float = 0.15, delta_high: float = 0.15):
    """DPPO Binary-TV region (arXiv 2602.04879): -delta_low <= pi(y) - q <= delta_high with pi(y) = w q, i.e.
    l(q) = max(1 - delta_low / q, 0),  u(q) = 1 + delta_high / q.
    Works on floats, numpy arrays and torch tensors (q in (0, 1]; checked for floats and arrays)."""
    xp, q = (torch, q) if hasattr(q, "clamp") else (np, np.asarray(check_probability(q), dtype=np.float64))
    low = xp.clip(1 - delta_low / q, 0, None)
    high = 1 + delta_high / q
    return (float(low), float(high)) if xp is np and low.ndim == 0 else (low, high)


def trgppo_bounds(q, delta: float = 0.07, epsilon: float | None = 0.2, iterations: int = 10):
    """TRGPPO (Wang et al. 2019, arXiv 1901.10314) KL-guided ratio region for discrete actions.

    [l, u] = [min over, max over] pi(a)/pi_old(a) subject to KL(pi_old || pi) <= delta; for discrete
    actions the optimum rescales the other actions proportionally, so only q is needed and the
    bounds solve q log(1/r) + (1-q) log((1-q)/(1-rq)) = delta on each side of 1.
    With `epsilon`, the region is widened to at least [1 - eps, 1 + eps] as in the paper:
    [min(l, 1 - eps), max(u, 1 + eps)]. `epsilon=None` gives the raw KL bounds (official code).
    Works on floats, numpy arrays and torch tensors (returned in q's dtype).

    Solver (float64, vectorised). Lower root in s = log(1/r):
        g(s) = q s + (1-q) [log(1-q) - log(1 - q e^-s)] - delta,   s in [delta/q, (delta - (1-q) log(1-q))/q]
    upper root in t = log((1-q)/(1-rq)), r = (1 - (1-q) e^-t)/q:
        h(t) = -q log r + (1-q) t - delta,                         t in [delta/(1-q), (delta - q log q)/(1-q)]
    (the brackets follow from the sign of the other term). g and h are increasing and convex there, so
    Newton's method from the right end of the bracket decreases monotonically to the root, quadratically.
    """
    delta = check_delta(delta)
    is_tensor = hasattr(q, "clamp")
    xp = torch if is_tensor else np
    qd = q.detach().to(torch.float64) if is_tensor else np.asarray(check_probability(q), dtype=np.float64)
    qd = xp.clip(qd, 1e-12, 1 - 1e-12)
    log_1mq, log_q = xp.log1p(-qd), xp.log(qd)
    s = (delta - (1 - qd) * log_1mq) / qd
    t = (delta - qd * log_q) / (1 - qd)
    for _ in range(iterations):
        x = xp.exp(-s)
        g = qd * s + (1 - qd) * (log_1mq - xp.log1p(-qd * x)) - delta
        s = s - g * (1 - qd * x) / (qd * (1 - x))
        e = xp.exp(-t)
        log_r = xp.log(-xp.expm1(-t) + qd * e) - log_q
        h = -qd * log_r + (1 - qd) * t - delta
        t = t - h / ((1 - qd) * (1 - e / xp.exp(log_r)))
    low, high = xp.exp(-s), (-xp.expm1(-t) + qd * xp.exp(-t)) / qd
    if epsilon is not None:
        low, high = low.clip(max=1 - epsilon), high.clip(min=1 + epsilon)
    if is_tensor:
        return low.to(q.dtype), high.to(q.dtype)
    return (float(low), float(high)) if np.ndim(low) == 0 else (low, high)
