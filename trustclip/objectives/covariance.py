"""Covariance-based token selection: Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617;
official code PRIME-RL/Entropy-Mechanism-of-RL, ported to verl as `clip_cov` / `kl_cov`).

Both rank the valid tokens of the batch by the centred covariance
    cov_t = (A_t - mean A) (logp_t - mean logp)          (means over valid tokens, current logp)
which drives the entropy change of a softmax policy, and treat the high-covariance tokens specially.
The statistic couples tokens across the batch, so results depend on the micro-batch composition.
"""

from __future__ import annotations

import torch

from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.clipping import _interval_bounds
from trustclip.objectives.registry import TokenLoss, number, register_objective


def centred_covariance(batch: PolicyBatch) -> torch.Tensor:
    valid = batch.mask > 0
    adv, logp = batch.advantages, batch.logp.detach()
    return (adv - adv[valid].mean()) * (logp - logp[valid].mean())


@register_objective(
    "clip_cov",
    source="Clip-Cov, Cui et al. 2025 (arXiv 2505.22617); verl `compute_policy_loss_clip_cov`",
    summary="PPO clip, plus a random fraction of tokens with cov in (lb, ub) detached from the gradient",
    params={
        "epsilon_low": number(1.0, low=0.0, high=1.0, doc="official recipes: 1, i.e. ratio clip [0, 2]"),
        "epsilon_high": number(1.0, low=0.0, doc="official recipes: 1"),
        "clip_cov_ratio": number(2e-4, low=0.0, high=1.0, strict_low=True, doc="fraction of tokens detached"),
        "clip_cov_lb": number(1.0, doc="lower covariance bound of the candidates"),
        "clip_cov_ub": number(5.0, doc="upper covariance bound of the candidates"),
        "seed": number(None, low=0, optional=True, doc="seed of the random selection (None: torch's global RNG)"),
    },
    bounds=_interval_bounds("epsilon_low", "epsilon_high"),
)
def clip_cov(batch: PolicyBatch, *, epsilon_low: float, epsilon_high: float, clip_cov_ratio: float,
             clip_cov_lb: float, clip_cov_ub: float, seed: int | None) -> TokenLoss:
    """PPO terms with clip(w, 1 - eps_l, 1 + eps_h); among valid tokens not already clipped with
    lb < cov_t < ub, pick k = max(floor(r N_valid), 1) uniformly at random and set their loss to 0
    (phi = 0 whatever the sign of A). The official recipes set eps = 1, so Clip-Cov replaces PPO
    clipping; pass epsilon_low/high = 0.2 to combine it with standard clipping."""
    w, adv, valid = batch.ratio, batch.advantages, batch.mask > 0
    unclipped, clipped = -adv * w, -adv * w.clamp(1 - epsilon_low, 1 + epsilon_high)
    clipped_by_ratio = (clipped > unclipped) & valid
    cov = centred_covariance(batch)
    candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & valid & ~clipped_by_ratio).flatten().nonzero()[:, 0]
    k = max(int(clip_cov_ratio * int(valid.sum())), 1)
    generator = None if seed is None else torch.Generator(device="cpu").manual_seed(int(seed))
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k].to(candidates.device)]
    detached = torch.zeros(w.numel(), dtype=torch.bool, device=w.device).index_fill_(0, chosen, True).view_as(w)
    loss = torch.where(detached, torch.zeros_like(w), torch.maximum(unclipped, clipped))
    return TokenLoss.outside(loss, adv, below=clipped_by_ratio, above=clipped_by_ratio, cov_selected_frac=detached)


@register_objective(
    "kl_cov",
    source="KL-Cov, Cui et al. 2025 (arXiv 2505.22617); verl `compute_policy_loss_kl_cov`",
    summary="no ratio clipping; the top-k covariance tokens get a |log w| penalty",
    params={
        "kl_cov_ratio": number(2e-3, low=0.0, high=1.0, strict_low=True,
                               doc="fraction of tokens penalised (0.2 %, the 7B recipe; the original code's "
                                   "k_percent is a percentage)"),
        "ppo_kl_coef": number(1.0, low=0.0, doc="penalty beta (paper scripts: 1; verl's config default 0.1)"),
    },
)
def kl_cov(batch: PolicyBatch, *, kl_cov_ratio: float, ppo_kl_coef: float) -> TokenLoss:
    """J_t = w A for all tokens; for the top-k = max(floor(r N_valid), 1) tokens by cov_t (deterministic
    topk), J_t = w A - beta |log w|. Only tokens with cov_t > 0 are penalised: verl's topk would also
    pick zero- or negative-covariance tokens when fewer than k are positive (e.g. an all-zero-advantage
    batch), which then get a gradient although nothing drives their entropy down."""
    w, adv, valid = batch.ratio, batch.advantages, batch.mask > 0
    loss = -adv * w
    flat_valid = valid.flatten().nonzero()[:, 0]
    k = max(int(kl_cov_ratio * len(flat_valid)), 1)
    cov = centred_covariance(batch).flatten()[flat_valid]
    top_cov, top_idx = torch.topk(cov, k, largest=True)
    top = flat_valid[top_idx[top_cov > 0]]
    penalised = torch.zeros(w.numel(), dtype=torch.bool, device=w.device).index_fill_(0, top, True).view_as(w)
    loss = torch.where(penalised, loss + ppo_kl_coef * batch.log_ratio.abs(), loss)
    return TokenLoss.unclipped(loss, cov_selected_frac=penalised)
