"""M2PO, Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161; in AReaL as `actor.m2_threshold`, and in
Trinity-RFT).

M2PO bounds a statistic of the whole batch instead of testing each token:
    M2_t = (log w_t)^2;   mask the tokens of largest M2_t until the mean M2 of the remaining valid tokens is < tau
    J_t = M_t w_t A_t     (no ratio clipping: a kept token keeps its unclipped weight w)
It is not clip_general(w, C) for any per-token constraint C: whether a token is masked depends on every other token of
the batch (so, as with clip_cov / kl_cov, on the micro-batch composition), and a masked token loses its gradient
whatever the sign of its advantage, also when its ratio moved against it, which clip_general never removes.

The log-ratio is taken against the policy that generated the batch (`old_logp`, AReaL's behaviour log-probabilities)
at the current parameters, detached: AReaL's proximal log-probabilities are those of the policy at the start of the
update, the same thing when each update is one step on the whole batch (its `ppo_n_minibatches: 1`).
"""

from __future__ import annotations

import torch

from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.registry import TokenLoss, number, register_objective


def second_moment_mask(log_ratio: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool (B, T): the valid tokens M2PO masks. Sorted by M2 = (log w)^2, largest first (a stable sort, so ties keep
    their order and padding cannot change the choice), the fewest largest are masked so that the mean M2 of the rest
    is < threshold; if no such set exists, all but the smallest are masked (AReaL keeps one token)."""
    # Static shapes (one compiled graph for the fused path): padding sorts last (M2 = -1) and adds 0 to the sums;
    # the stable sort keeps the valid tokens in the order `log_ratio[valid]` would give them.
    m2 = torch.where(valid, log_ratio.detach() ** 2, -1.0).flatten()
    ordered, order = torch.sort(m2, descending=True, stable=True)
    n = valid.sum()
    position = torch.arange(ordered.numel(), device=m2.device)
    suffix_sum = ordered.clamp(min=0).flip(0).cumsum(0).flip(0)
    rest_mean = suffix_sum / (n - position).clamp(min=1).to(m2.dtype)
    below = (rest_mean < threshold) & (position < n)
    count = torch.where(below.any(), below.to(torch.uint8).argmax(), n - 1)  # argmax: the first suffix below
    masked = torch.zeros_like(valid).flatten()
    masked[order] = position < count
    return masked.view_as(valid)


@register_objective(
    "m2po",
    source="M2PO second-moment trust policy optimization, Zheng et al. 2025 (arXiv 2510.01161); AReaL `m2_threshold`",
    summary="mask the largest (log w)^2 until the batch's mean second moment is < tau; J = M w A, no ratio clipping",
    params={"m2_threshold": number(0.04, low=0.0, strict_low=True,
                                   doc="tau, bound on the mean (log w)^2 of the kept tokens (AReaL's M2PO example)")},
)
def m2po(batch: PolicyBatch, *, m2_threshold: float) -> TokenLoss:
    """J_t = M_t w_t A_t with M from `second_moment_mask` over the valid tokens of this batch; phi = w on kept tokens,
    0 on masked ones (either sign of A). `m2_mean`: the batch's second moment before masking; `m2_masked_frac`:
    the masked tokens (clip_frac counts those with A != 0, whose gradient the mask removed)."""
    w, adv = batch.ratio, batch.advantages
    masked = second_moment_mask(batch.log_ratio, batch.mask > 0, m2_threshold)
    loss = -torch.where(masked, torch.zeros_like(w), w * adv)
    moved = masked & (adv != 0)
    return TokenLoss(loss, clipped_low=moved & (w < 1), clipped_high=moved & (w > 1),
                     stats={"m2_masked_frac": masked, "m2_mean": batch.log_ratio.detach() ** 2})
