"""Objectives of the unified clipping framework: J_t = min(w A, clip_general(w, C) A) for a constraint C.

Notation: w = exp(logp - old_logp) (log-ratio clamped to +-20), A the advantage. Every objective here
has the effective per-token gradient weight (ATR paper arXiv 2602.05494, Section 4)
    phi_t = w_t * 1[C_t or (w_t - 1) A_t <= 0]
i.e. a token loses its gradient iff the constraint is violated and the ratio moved the way A favours.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trustclip.objectives import bounds as B
from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.constraints import (
    Constraint,
    FullKLConstraint,
    ProbabilityInterval,
    RatioInterval,
    kl_constraint,
)
from trustclip.objectives.registry import Param, TokenLoss, choice, number, register_objective

EPS_RULE = dict(low=0.0, high=1.0)  # ratio-clip epsilons: 1 - eps must stay a valid ratio >= 0


def clipped_surrogate(batch: PolicyBatch, constraint: Constraint, *, general_form: bool = False) -> TokenLoss:
    """-min(w A, clip_general(w, C) A), per token.

    If C is a ratio interval [l, u] (and `general_form` is False) this is PPO's -min(wA, clip(w,l,u)A):
    the same gradient as the general operator (Theorem 4.1) and the loss value TRL / verl report.
    Otherwise clip_general replaces w by w_old = 1 where C fails.
    """
    w, adv = batch.ratio, batch.advantages
    interval = None if general_form else constraint.interval(batch)
    if interval is not None:
        low, high = interval  # low <= 1 <= high: below the region is w < low, above it w > high
        loss = -torch.minimum(w * adv, torch.clamp(w, min=low, max=high) * adv)
        return TokenLoss.outside(loss, adv, below=w < low, above=w > high)
    holds = constraint.holds(batch)
    loss = -torch.minimum(w * adv, torch.where(holds, w, torch.ones_like(w)) * adv)
    return TokenLoss.outside(loss, adv, below=~holds & (w < 1), above=~holds & (w > 1))


def apply_dual_clip(out: TokenLoss, batch: PolicyBatch, clip_ratio_c: float | None) -> TokenLoss:
    """Dual clip (Ye et al. 2020, arXiv 1912.09729): for A < 0, J = max(J_ppo, c A), so a huge
    ratio on a bad token cannot produce an unbounded loss; those tokens get no gradient."""
    if clip_ratio_c is None:
        return out
    # loss = min(loss_ppo, -c A) for A < 0; for A >= 0 the cap is 0, above the PPO loss there (-A min(w, clip(w)))
    cap = -clip_ratio_c * batch.advantages.clamp(max=0)
    out.stats["dual_clip_frac"] = out.loss > cap
    out.loss = torch.minimum(out.loss, cap)
    return out


def _interval_bounds(low_key: str, high_key: str):
    return lambda hp: (1.0 - hp[low_key], 1.0 + hp[high_key])


# --------------------------------------------------------------------------- the control: no constraint
@register_objective(
    "unconstrained",
    source="PPO, Schulman et al. 2017 (arXiv 1707.06347), Table 1 row 'no clipping or penalty'",
    summary="ratio-weighted policy gradient J = w A with no trust region: the control of every constraint",
    bounds=lambda hp: (0.0, math.inf),
)
def unconstrained(batch: PolicyBatch) -> TokenLoss:
    """J = w A, phi = w on every token, nothing clipped: the control a trust region is shown to matter against
    (on-policy, w = 1, every ratio objective here equals it exactly)."""
    w, adv = batch.ratio, batch.advantages
    return TokenLoss.unclipped(-w * adv)


# --------------------------------------------------------------------------- ratio clipping
@register_objective(
    "clip",
    source="PPO, Schulman et al. 2017 (arXiv 1707.06347); GRPO, Shao et al. 2024 (arXiv 2402.03300)",
    summary="symmetric ratio clip: C = 1 - eps <= w <= 1 + eps",
    params={"epsilon": number(0.2, **EPS_RULE, doc="clip range")},
    bounds=_interval_bounds("epsilon", "epsilon"),
)
def clip(batch: PolicyBatch, *, epsilon: float) -> TokenLoss:
    """PPO/GRPO: J = min(w A, clip(w, 1 - eps, 1 + eps) A)."""
    return clipped_surrogate(batch, RatioInterval(1 - epsilon, 1 + epsilon))


@register_objective(
    "clip_higher",
    source="DAPO, Yu et al. 2025 (arXiv 2503.14476)",
    summary="asymmetric ratio clip: C = 1 - eps_low <= w <= 1 + eps_high",
    params={"epsilon_low": number(0.2, **EPS_RULE), "epsilon_high": number(0.28, low=0.0)},
    bounds=_interval_bounds("epsilon_low", "epsilon_high"),
    aliases=("dapo",),
)
def clip_higher(batch: PolicyBatch, *, epsilon_low: float, epsilon_high: float) -> TokenLoss:
    """DAPO Clip-Higher: J = min(w A, clip(w, 1 - eps_l, 1 + eps_h) A), eps_h > eps_l."""
    return clipped_surrogate(batch, RatioInterval(1 - epsilon_low, 1 + epsilon_high))


@register_objective(
    "dual_clip",
    source="Dual-clip PPO, Ye et al. 2020 (arXiv 1912.09729); verl `vanilla` loss",
    summary="ratio clip plus, for A < 0, J = max(J_ppo, c A)",
    params={
        "epsilon_low": number(0.2, **EPS_RULE),
        "epsilon_high": number(0.2, low=0.0),
        "clip_ratio_c": number(3.0, low=1.0, strict_low=True, doc="dual-clip bound c > 1"),
    },
    bounds=_interval_bounds("epsilon_low", "epsilon_high"),
)
def dual_clip(batch: PolicyBatch, *, epsilon_low: float, epsilon_high: float, clip_ratio_c: float) -> TokenLoss:
    """J = min(w A, clip(w) A) for A >= 0; max(min(w A, clip(w) A), c A) for A < 0 (phi = 0 if w > c)."""
    out = clipped_surrogate(batch, RatioInterval(1 - epsilon_low, 1 + epsilon_high))
    return apply_dual_clip(out, batch, clip_ratio_c)


@register_objective(
    "dcpo",
    source="DCPO dynamic adaptive clipping, Yang et al. 2025 (arXiv 2509.02333); official code lime-RL/DCPO",
    summary="per-token bounds from q = pi_old(y_t): |w - 1| w <= eps / q",
    params={
        "epsilon_low": number(0.16, low=0.0, doc="paper value; the official run scripts use 0.2"),
        "epsilon_high": number(0.2, low=0.0, doc="paper value; the official run scripts use 0.28"),
        "max_high": number(10.0, low=1.0, doc="cap on u(q), as in the official code"),
        "clip_ratio_c": number(None, low=1.0, strict_low=True, optional=True,
                               doc="dual clip for A < 0 (the official 'dynamic' mode uses 10)"),
    },
    bounds=lambda hp, q: B.dcpo_bounds(q, hp["epsilon_low"], hp["epsilon_high"], hp["max_high"]),
    q_dependent=True,
)
def dcpo(batch: PolicyBatch, *, epsilon_low: float, epsilon_high: float, max_high: float,
         clip_ratio_c: float | None) -> TokenLoss:
    """DCPO: J = min(w A, clip(w, l(q), u(q)) A) with
    l(q) = 1/2 + 1/2 sqrt(max(1 - 4 eps_l / q, 0)), u(q) = min(1/2 + 1/2 sqrt(1 + 4 eps_h / q), max_high)."""
    constraint = ProbabilityInterval("dcpo", lambda q: B.dcpo_bounds(q, epsilon_low, epsilon_high, max_high))
    return apply_dual_clip(clipped_surrogate(batch, constraint), batch, clip_ratio_c)


@register_objective(
    "trgppo",
    source="TRGPPO, Wang, He, Tan, Gan 2019 (arXiv 1901.10314); official code wangyuhuix/TRGPPO",
    summary="KL-guided per-token bounds: extreme ratios with KL(pi_old || pi) <= delta, closed form from q",
    params={
        "delta": number(0.07, low=0.0, strict_low=True, doc="trust-region threshold (ATR paper Table 3)"),
        "epsilon": number(0.2, **EPS_RULE, optional=True,
                          doc="floor [1 - eps, 1 + eps] as in the paper; None gives the raw KL bounds"),
    },
    bounds=lambda hp, q: B.trgppo_bounds(q, hp["delta"], hp["epsilon"]),
    q_dependent=True,
)
def trgppo(batch: PolicyBatch, *, delta: float, epsilon: float | None) -> TokenLoss:
    """TRGPPO: J = min(w A, clip(w, l, u) A), [l, u] = [min(l_d, 1 - eps), max(u_d, 1 + eps)] where
    l_d / u_d solve q log(1/r) + (1 - q) log((1 - q) / (1 - r q)) = delta (the exact KL when only the
    sampled token's probability moves, the others rescaled: the KL-optimal move for discrete actions)."""
    constraint = ProbabilityInterval("trgppo", lambda q: B.trgppo_bounds(q, delta, epsilon))
    return clipped_surrogate(batch, constraint)


# --------------------------------------------------------------------------- estimator-constrained clipping
DELTA = number(0.07, low=0.0, strict_low=True, doc="threshold on the estimator")


@register_objective(
    "kl1",
    source="ATR paper ablation (arXiv 2602.05494, Table 3); k1 estimator, Schulman 2020",
    summary="C = -log w <= delta (one-sided by default)",
    params={"delta": DELTA, "two_sided": choice(False, True, doc="|log w| <= delta")},
    constraint=lambda hp: kl_constraint("kl1", hp["delta"], two_sided=hp["two_sided"]),
)
def kl1(batch: PolicyBatch, constraint: Constraint) -> TokenLoss:
    """KL1 clipping: C = -log w <= delta, i.e. w >= exp(-delta); one-sided (no upper bound, A > 0 tokens are
    never clipped), the reading of the reference notes. two_sided=True uses |log w| <= delta."""
    return clipped_surrogate(batch, constraint)


@register_objective(
    "kl2",
    source="ATR paper ablation (arXiv 2602.05494, Table 3); k2 estimator, Schulman 2020",
    summary="C = (log w)^2 / 2 <= delta",
    params={"delta": DELTA},
    constraint=lambda hp: kl_constraint("kl2", hp["delta"]),
)
def kl2(batch: PolicyBatch, constraint: Constraint) -> TokenLoss:
    """KL2 clipping: C = (log w)^2 / 2 <= delta, i.e. w in [exp(-sqrt(2 delta)), exp(sqrt(2 delta))]."""
    return clipped_surrogate(batch, constraint)


@register_objective(
    "kl3",
    source="ATR-GRPO, Wu, Wang et al. 2026 (arXiv 2602.05494); k3 estimator, Schulman 2020",
    summary="ATR-GRPO: C = w - 1 - log w <= delta (Lambert-W bounds)",
    params={"delta": DELTA},
    constraint=lambda hp: kl_constraint("kl3", hp["delta"]),
    aliases=("atr", "atr_grpo"),
)
def kl3(batch: PolicyBatch, constraint: Constraint) -> TokenLoss:
    """ATR-GRPO: C = KL3 = w - 1 - log w <= delta (arXiv 2602.05494, eq. 6 and Theorem 4.2).
    Exactly asymmetric ratio clipping with l = -W_0(-e^{-(1+delta)}), u = -W_{-1}(-e^{-(1+delta)});
    delta = 0.07 gives [0.6710, 1.4222]."""
    return clipped_surrogate(batch, constraint)


def _is_kl3(hp: Any) -> Constraint:
    return kl_constraint("is_kl3", hp["delta"], form=hp["form"])


@register_objective(
    "is_kl3",
    source="ATR paper ablation (arXiv 2602.05494, Table 3); IS-weighted k3",
    summary="C = w log w - w + 1 <= delta",
    params={"delta": DELTA, "form": choice("w_log_w", "w_times_kl3", doc="which IS-weighted KL3 reading")},
    constraint=_is_kl3,
    bounds=lambda hp: _is_kl3(hp).bounds or _no_interval("is_kl3 with form='w_times_kl3'"),
    check_all=_is_kl3,  # the constructor refuses a form / delta it cannot build
)
def is_kl3(batch: PolicyBatch, constraint: Constraint) -> TokenLoss:
    """IS-weighted KL3 clipping: C = w log w - w + 1 <= delta (= w * k3(1/w), unbiased for KL(pi_theta || pi_old);
    the reading the reference notes recommend, an interval). form='w_times_kl3' uses w (w - 1 - log w) <= delta
    instead, whose feasible set is not an interval."""
    return clipped_surrogate(batch, constraint)


def _no_interval(what: str):
    raise ValueError(f"{what} has no ratio interval (its feasible set is a union of intervals)")


# --------------------------------------------------------------------------- full-KL trust region
@register_objective(
    "truly_ppo",
    source="Truly PPO / TR-PPO-RB, Wang, He, Tan 2020 (arXiv 1903.07940); official code wangyuhuix/TrulyPPO",
    summary="trust-region rollback on the exact per-state KL (needs the full_kl extra)",
    params={
        "delta": number(0.03, low=0.0, strict_low=True, doc="KL threshold (paper MuJoCo default)"),
        "rollback": number(5.0, low=0.0, doc="alpha, rollback strength (paper MuJoCo default)"),
        "mode": choice("rollback", "stop_gradient", doc="TR-PPO-RB, or TR-PPO (clip_general with C = KL < delta)"),
    },
    requires=lambda hp: ("full_kl",),
)
def truly_ppo(batch: PolicyBatch, *, delta: float, rollback: float, mode: str) -> TokenLoss:
    """Triggered tokens: KL_t = KL(pi_old(.|s_t) || pi_theta(.|s_t)) >= delta and (w - 1) A > 0.
    TR-PPO-RB: J = w A - alpha KL_t if triggered, else w A (the rollback pushes the policy back; give
    `full_kl` with its graph for that gradient). TR-PPO: J = clip_general(w, KL_t < delta) A."""
    if mode == "stop_gradient":
        return clipped_surrogate(batch, FullKLConstraint(delta), general_form=True)
    kl = batch.extra("full_kl", "truly_ppo")
    w, adv = batch.ratio, batch.advantages
    triggered = (kl.detach() >= delta) & ((w - 1) * adv > 0)
    loss = -torch.where(triggered, w * adv - rollback * kl, w * adv)
    return TokenLoss.outside(loss, adv, below=triggered, above=triggered, full_kl_mean=kl.detach())


# --------------------------------------------------------------------------- any user constraint
@register_objective(
    "general",
    source="Unified clipping framework, ATR paper (arXiv 2602.05494, eq. 5)",
    summary="clip_general with any user Constraint (see trustclip.objectives.constraints)",
    params={"constraint": Param(None, lambda c: isinstance(c, Constraint), "a trustclip Constraint instance")},
)
def general(batch: PolicyBatch, *, constraint: Constraint) -> TokenLoss:
    """J = min(w A, clip_general(w, C) A), clip_general = w where C holds, else w_old = 1 (no gradient)."""
    return clipped_surrogate(batch, constraint, general_form=True)
