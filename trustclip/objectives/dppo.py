"""DPPO, Divergence Proximal Policy Optimization (Qi, Zhou, Liu et al. 2026, "Rethinking the Trust Region in LLM
Reinforcement Learning", arXiv 2602.04879; authors' code sail-sg/Stable-RL, shipped in verl 0.9.1 as the policy losses
`dppo_tv` / `dppo_kl`).

DPPO keeps PPO's masked surrogate but tests a direct estimate of the policy divergence instead of the ratio:
    J_t = M_t w_t A_t,   M_t = 0 iff D_t > delta and (w_t - 1) A_t > 0
(the token moved past the threshold in the direction its advantage favours), with D the Binary approximation: the
divergence between the two-point distributions (pi(y_t), 1 - pi(y_t)) of the old and the new policy. The paper's text
could not be read here (offline), so neither its equation numbers nor its sections are cited: the formula is read from
the authors' code (sail-sg/Stable-RL, `core_algos.py`) and verl 0.9.1's, which agree.

In the unified framework this is clip_general(w, C) with C = `BinaryDivergence` (eq. 5 of the ATR paper, arXiv
2602.05494): the same gradient phi_t = w_t 1[C_t or (w_t - 1) A_t <= 0]. Its value is min(w A, clip_general(w, C) A),
the framework's surrogate; the authors' code and verl report -A sg(w) log pi instead (same gradient, a different
number; tests/verl_plugin/test_verl_parity.py pins the difference).

Hyper-parameters: the thresholds of the authors' run script (verl's examples/dppo_trainer): 0.15 for TV and 0.05 for
KL, on both sides. Truncated importance sampling (weight min(w, c)) is off by default: that script sets c = 10000
("disable ... TIS for a fair comparison"), and verl's code recommends a large c because of the truncation bias (citing
the paper's Section 5.4); the authors' code falls back to c = 10, verl to `actor.clip_ratio_c` (3.0 unless set). With
`tis_cap` the objective is no longer clip_general: kept tokens get the gradient weight min(w, c).
"""

from __future__ import annotations

import torch

from trustclip.objectives import bounds as B
from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.clipping import clipped_surrogate
from trustclip.objectives.constraints import BinaryDivergence
from trustclip.objectives.registry import TokenLoss, number, register_objective
from trustclip.objectives.reweighting import loss_with_weight

TIS_CAP = number(None, low=1.0, optional=True,
                 doc="truncated IS: kept tokens' gradient weight min(w, c); None (the paper's runs) leaves w as is. "
                     "verl reads its actor.clip_ratio_c (3.0 unless set); the authors' code falls back to 10")


def dppo_surrogate(batch: PolicyBatch, constraint: BinaryDivergence, tis_cap: float | None) -> TokenLoss:
    """-min(w A, clip_general(w, C) A) per token; with `tis_cap` c the kept tokens' gradient weight is min(w, c)
    (the value is unchanged)."""
    out = clipped_surrogate(batch, constraint, general_form=True)
    if tis_cap is None:
        return out
    w = batch.ratio
    kept = ~(out.clipped_low | out.clipped_high)  # masked tokens are exactly those (w - 1) A > 0 outside C
    out.loss = loss_with_weight(batch, -out.loss, torch.where(kept, w.clamp(max=tis_cap), 0.0))
    out.stats["tis_capped_frac"] = kept & (w > tis_cap)
    return out


@register_objective(
    "dppo_tv",
    source="DPPO-Binary-TV, Qi, Zhou, Liu et al. 2026 (arXiv 2602.04879); code sail-sg/Stable-RL, "
           "verl `dppo_tv`",
    summary="mask on the sampled token's probability change: C = -delta_low <= pi(y) - pi_old(y) <= delta_high",
    params={
        "delta_low": number(0.15, low=0.0, strict_low=True, doc="TV threshold where pi(y) falls (paper runs: 0.15)"),
        "delta_high": number(0.15, low=0.0, strict_low=True, doc="TV threshold where pi(y) rises (paper runs: 0.15)"),
        "tis_cap": TIS_CAP,
    },
    bounds=lambda hp, q: B.dppo_tv_bounds(q, hp["delta_low"], hp["delta_high"]),
    q_dependent=True,
)
def dppo_tv(batch: PolicyBatch, *, delta_low: float, delta_high: float, tis_cap: float | None) -> TokenLoss:
    """J = min(w A, clip_general(w, C) A), C: |pi(y) - q| <= delta (delta_low below q, delta_high above), q = pi_old(y).
    As a ratio region: [max(1 - delta_low / q, 0), 1 + delta_high / q], wide for rare tokens and narrow for likely
    ones, where a ratio clip's region is the same for every q."""
    return dppo_surrogate(batch, BinaryDivergence("tv", delta_low, delta_high), tis_cap)


@register_objective(
    "dppo_kl",
    source="DPPO-Binary-KL, Qi, Zhou, Liu et al. 2026 (arXiv 2602.04879); code sail-sg/Stable-RL, "
           "verl `dppo_kl`",
    summary="mask on the binary KL(pi_old || pi) of the sampled token: C = q log(q/p) + (1-q) log((1-q)/(1-p)) <= "
            "delta",
    params={
        "delta_low": number(0.05, low=0.0, strict_low=True, doc="KL threshold where pi(y) falls (paper runs: 0.05)"),
        "delta_high": number(0.05, low=0.0, strict_low=True, doc="KL threshold where pi(y) rises (paper runs: 0.05)"),
        "tis_cap": TIS_CAP,
    },
    bounds=lambda hp, q: (B.trgppo_bounds(q, hp["delta_low"], None)[0], B.trgppo_bounds(q, hp["delta_high"], None)[1]),
    q_dependent=True,
)
def dppo_kl(batch: PolicyBatch, *, delta_low: float, delta_high: float, tis_cap: float | None) -> TokenLoss:
    """J = min(w A, clip_general(w, C) A), C: KL(Bern(q) || Bern(p)) <= delta, q = pi_old(y), p = pi(y). Its ratio
    region is TRGPPO's raw KL region (arXiv 1901.10314, `trgppo` with epsilon=None): the same KL of the sampled
    token's probability, solved for the extreme ratios; so dppo_kl with delta_low = delta_high = delta has the
    gradient of trgppo(delta, epsilon=None)."""
    return dppo_surrogate(batch, BinaryDivergence("kl", delta_low, delta_high), tis_cap)
