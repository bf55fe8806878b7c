"""Objectives that reshape the importance weight instead of (only) masking it: soft gates, penalties, detached
clipped weights, flipped weights, and sequence-level ratios."""

from __future__ import annotations

from dataclasses import replace

import torch

from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.clipping import EPS_RULE, _interval_bounds, clipped_surrogate
from trustclip.objectives.constraints import Constraint, RatioInterval, kl_constraint
from trustclip.objectives.registry import TokenLoss, choice, number, register_objective


def loss_with_weight(batch: PolicyBatch, value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """-J per token where J has the value `value` and the gradient weight * A * grad(logp).

    The term logp - sg(logp) is 0 in value and has gradient 1, so the two are set independently; this
    makes the effective weight phi of a method readable in one line."""
    return -(value.detach() + weight.detach() * batch.advantages * (batch.logp - batch.logp.detach()))


@register_objective(
    "sapo",
    source="SAPO soft adaptive policy optimization, Gao et al. 2025 (arXiv 2511.20347)",
    summary="soft gate f(w) = sigmoid(tau (w - 1)) 4 / tau instead of hard clipping",
    params={"tau_pos": number(1.0, low=0.0, strict_low=True), "tau_neg": number(1.05, low=0.0, strict_low=True)},
)
def sapo(batch: PolicyBatch, *, tau_pos: float, tau_neg: float) -> TokenLoss:
    """J = f_tau(w) A with f_tau(w) = sigmoid(tau (w - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg.
    phi = 4 s (1 - s) w, s = sigmoid(tau (w - 1)): 1 at w = 1, decaying like sech^2; nothing is hard-clipped.
    The paper aggregates seq_mean_token_mean (as TRL's loss_type='sapo' and verl do)."""
    w, adv = batch.ratio, batch.advantages
    tau = torch.where(adv > 0, torch.full_like(w, tau_pos), torch.full_like(w, tau_neg))
    s = torch.sigmoid(tau * (w - 1))
    return TokenLoss.unclipped(-(s * 4 / tau) * adv, gate_weight_mean=4 * s.detach() * (1 - s.detach()))


@register_objective(
    "cfpo",
    source="CFPO clipping-free policy optimization, Cagatan, Akgun, Sahin, Zhao 2026 (arXiv 2601.22801); TRL PR #5027",
    summary="no clipping: a quadratic penalty J = w A - |A| (w - 1)^2 / (2 eps), peaked at PPO's clip boundary",
    params={"epsilon": number(0.2, low=0.0, strict_low=True,
                              doc="the clip range it replaces (no new hyper-parameter; TRL PR #5027: epsilon_high)")},
)
def cfpo(batch: PolicyBatch, *, epsilon: float) -> TokenLoss:
    """J = w A - |A| (w - 1)^2 / (2 eps), the paper's convex (in w) penalty derived from a TV trust region, as the
    authors' TRL PR writes it. Not clip_general: no token loses its gradient; the weight
        phi = w (1 - sign(A) (w - 1) / eps)
    is w at w = 1, 0 at w = 1 + sign(A) eps (each token's term peaks at PPO's clip boundary) and negative beyond it,
    where the penalty pulls the ratio back. `pushback_frac`: the tokens past that peak."""
    w, adv = batch.ratio, batch.advantages
    pushback = (w.detach() - 1) * torch.sign(adv) > epsilon
    return TokenLoss.unclipped(-(w * adv - adv.abs() * (w - 1) ** 2 / (2 * epsilon)), pushback_frac=pushback)


@register_objective(
    "cispo",
    source="CISPO, MiniMax-M1 (arXiv 2506.13585); verl `cispo` semantics",
    summary="REINFORCE with a clipped, detached IS weight: no token loses its gradient",
    params={
        "epsilon_low": number(None, low=0.0, optional=True, doc="None: no lower bound (the paper tunes only eps_high)"),
        "epsilon_high": number(0.2, low=0.0, doc="weight cap 1 + eps_high; TRL's absolute cap 5.0 = eps_high 4.0"),
    },
    bounds=lambda hp: (0.0 if hp["epsilon_low"] is None else 1 - hp["epsilon_low"], 1 + hp["epsilon_high"]),
)
def cispo(batch: PolicyBatch, *, epsilon_low: float | None, epsilon_high: float) -> TokenLoss:
    """J = sg(clip(w, 1 - eps_l, 1 + eps_h)) A logp; phi = clip(w, ...). Note verl clamps two-sided
    (1 - eps_l, 1 + eps_h) while TRL's `epsilon_high` is an absolute cap on w."""
    w, adv = batch.ratio, batch.advantages
    low = 0.0 if epsilon_low is None else 1.0 - epsilon_low
    high = 1.0 + epsilon_high
    weight = w.clamp(min=low, max=high).detach()
    return TokenLoss.outside(-weight * adv * batch.logp, adv, below=w < low, above=w > high,
                             capped_frac=(w < low) | (w > high))


@register_objective(
    "aspo",
    source="ASPO asymmetric importance sampling, Wang et al. 2025 (arXiv 2510.06062); code wizard-III/Archer2.0",
    summary="flipped IS weight 1/w for A > 0, soft dual clipping (weight c) for extreme ratios",
    params={
        "epsilon_low": number(0.2, **EPS_RULE),
        "epsilon_high": number(0.2, low=0.0),
        "clip_ratio_c": number(3.0, low=1.0, strict_low=True, doc="soft dual-clip bound c"),
        "entropy_split": choice(False, True, doc="Archer2.0: eps depends on token entropy (needs `entropy`)"),
        "high_entropy_epsilon": number(0.4, **EPS_RULE, doc="eps of the high-entropy tokens"),
        "entropy_quantile": number(0.8, low=0.0, high=1.0, doc="per-response entropy quantile of the split"),
    },
    requires=lambda hp: ("entropy",) if hp["entropy_split"] else (),
    bounds=_interval_bounds("epsilon_low", "epsilon_high"),
)
def aspo(batch: PolicyBatch, *, epsilon_low: float, epsilon_high: float, clip_ratio_c: float,
         entropy_split: bool, high_entropy_epsilon: float, entropy_quantile: float) -> TokenLoss:
    """Effective weights (derived from the official code, reference notes section 15):
      A > 0:  phi = 1/w on [1/c, 1 + eps_h];  0 above 1 + eps_h;  c below 1/c   (value A / clip(w, 1/c, 1+eps_h))
      A < 0:  phi = w   on [1 - eps_l, c];    0 below 1 - eps_l;  c above c     (value A * clip(w, 1-eps_l, c))
    With entropy_split the top (1 - quantile) entropy tokens of each response use high_entropy_epsilon
    for both eps (Archer2.0's default scheme); the default is the single-eps ASPO of the paper."""
    w, adv, c = batch.ratio, batch.advantages, clip_ratio_c
    eps_low, eps_high = epsilon_low, epsilon_high
    if entropy_split:  # Archer2.0: split at the per-response entropy quantile of the valid tokens
        entropy = batch.extra("entropy", "aspo")
        masked = torch.where(batch.mask > 0, entropy.detach(), torch.full_like(entropy, float("nan")))
        threshold = torch.nanquantile(masked.float(), entropy_quantile, dim=-1, keepdim=True).to(entropy.dtype)
        eps_low = eps_high = torch.where(entropy >= threshold, torch.full_like(entropy, high_entropy_epsilon),
                                         torch.full_like(entropy, epsilon_low))
    upper, lower = 1 + eps_high, 1 - eps_low  # floats, or (B, T) tensors with entropy_split
    pos, neg = adv > 0, adv < 0
    above, below, tiny, huge = w > upper, w < lower, w < 1 / c, w > c
    weight_pos = torch.where(above, 0.0, torch.where(tiny, c, 1 / w))
    value_pos = adv / w.clamp(min=1 / c).clamp(max=upper)
    weight_neg = torch.where(below, 0.0, torch.where(huge, c, w))
    value_neg = adv * w.clamp(min=lower).clamp(max=c)
    loss = loss_with_weight(batch, torch.where(pos, value_pos, value_neg), torch.where(pos, weight_pos, weight_neg))
    return TokenLoss.outside(loss, adv, below=below, above=above, soft_clip_frac=(pos & tiny) | (neg & huge))


def sequence_clipped_surrogate(batch: PolicyBatch, constraint: Constraint) -> TokenLoss:
    """`clipped_surrogate` with GSPO's sequence ratio s_i = exp((1/L_i) sum_t log w_t) in the place of w: per token
    -min(s A, clip(s, l, u) A), [l, u] the ratio interval of `constraint`.

    Built in verl's GSPO-token form s_it = sg(s_i) pi(y_t) / sg(pi(y_t)) (log clamped at 10): its value is s_i on
    every token of sequence i and d s_it / d logp_t = s_it. With a sequence advantage A_i and seq_mean_token_mean
    aggregation the loss is exactly -(1/B) sum_i J_i and its gradient is GSPO's, A_i s_i (1/L_i) sum_t grad logp_t,
    zero for the whole sequence when s_i left [l, u] in the direction A_i favours. With per-token advantages
    A_it (GSPO-token) the gate is still the sequence's ratio, the direction test each token's."""
    mask = batch.mask
    lengths = mask.sum(-1).clamp(min=1)
    seq_log_ratio = (batch.log_ratio * mask).sum(-1) / lengths
    token_log_ratio = (seq_log_ratio.detach().unsqueeze(-1) + batch.logp - batch.logp.detach()).clamp(max=10.0)
    s = token_log_ratio.exp()
    out = clipped_surrogate(replace(batch, log_ratio=token_log_ratio, ratio=s), constraint)
    out.stats = {"seq_ratio_mean": s.detach(), "seq_kl3_mean": s.detach() - 1 - token_log_ratio.detach()}
    return out


@register_objective(
    "gspo",
    source="GSPO group sequence policy optimization, Zheng et al. 2025 (arXiv 2507.18071)",
    summary="sequence-level length-normalised ratio s_i = exp(mean_t log w_t), clipped per sequence",
    params={"epsilon_low": number(3e-4, **EPS_RULE), "epsilon_high": number(4e-4, low=0.0)},
    bounds=_interval_bounds("epsilon_low", "epsilon_high"),
)
def gspo(batch: PolicyBatch, *, epsilon_low: float, epsilon_high: float) -> TokenLoss:
    """J_i = min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i), s_i = exp((1/L_i) sum_t log w_t), in verl's
    GSPO-token form (`sequence_clipped_surrogate`)."""
    return sequence_clipped_surrogate(batch, RatioInterval(1 - epsilon_low, 1 + epsilon_high))


# GSPO's published range [1 - 3e-4, 1 + 4e-4] has KL3 4.5e-8 at its lower and 8.0e-8 at its upper end; atr_seq's
# default delta is their geometric mean, 6.0e-8: region [1 - 3.464e-4, 1 + 3.465e-4], width 6.93e-4 (GSPO's: 7e-4).
# Why this calibration, and what it leaves open: docs/beyond-the-paper.md.
ATR_SEQ_DELTA = 6e-8


@register_objective(
    "atr_seq",
    source="ATR-GRPO's KL3 constraint (arXiv 2602.05494, Section 6.5 future work) on GSPO's sequence ratio "
           "(arXiv 2507.18071); beyond both papers",
    summary="sequence-level ATR: KL3(s_i) = s_i - 1 - log s_i <= delta on GSPO's ratio s_i, Lambert-W bounds",
    params={"delta": number(ATR_SEQ_DELTA, low=0.0, strict_low=True,
                            doc="calibrated to GSPO's range: KL3 of a sequence ratio is ~(mean log w)^2 / 2")},
    bounds=lambda hp: kl_constraint("kl3", hp["delta"]).bounds,
)
def atr_seq(batch: PolicyBatch, *, delta: float) -> TokenLoss:
    """J_i = min(s_i A_i, clip(s_i, l_delta, u_delta) A_i), s_i = exp((1/L_i) sum_t log w_t), where
    [l, u] = [-W_0(-e^{-(1+delta)}), -W_{-1}(-e^{-(1+delta)})] is the region of KL3(s) = s - 1 - log s <= delta
    (ATR's Theorem 4.2 applied to s). Gradient (seq_mean_token_mean, A_i per sequence):
        d J_i / d logp_it = A_i s_i / L_i   if l <= s_i <= u or (s_i - 1) A_i <= 0,   else 0.
    For small delta l, u = 1 -+ sqrt(2 delta) + 2 delta / 3 + O(delta^1.5): at GSPO's scale the region is symmetric
    to 1e-7 (u - 1 - (1 - l) = 4 delta / 3), so ATR's asymmetry does not carry over at the default delta."""
    return sequence_clipped_surrogate(batch, kl_constraint("kl3", delta))
