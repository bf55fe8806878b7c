"""Full-vocabulary KL(pi_old || pi) from a bounded-memory summary of pi_old: its top-k log-probs plus tail mass.

Truly PPO (arXiv 1903.07940) constrains the exact per-state KL_t = KL(pi_old(.|s_t) || pi(.|s_t)). Keeping
pi_old's whole (B, T, V) log-softmax costs 4 V bytes per token (3.2 GB for 256 x 64 tokens at V = 49,152).
Instead, pi_old is stored per token as its k most likely tokens I, their log-probs log p_i, and the log of the
remaining (tail) mass P = 1 - sum_{i in I} p_i: 8 k + 4 bytes per token. The KL is then taken between the
coarse-grained distributions over k + 1 outcomes (each top-k token, and "any other token"):

    KL_k = sum_{i in I} p_i (log p_i - log q_i) + P (log P - log Q),      Q = 1 - sum_{i in I} q_i.

By the chain rule of the KL divergence, the exact KL splits into this term and the KL within the tail:

    KL = KL_k + P * KL(p_tail / P || q_tail / Q)  >=  KL_k,

so KL_k is a lower bound and its error is exactly P times the KL between the two renormalised tail
distributions: zero when pi keeps the shape of pi_old's tail, small when the tail mass P is small. On real
SmolLM2 logits (T = 1) the default k = 256 kept it within 1e-2 nats on every token up to a policy move of mean
KL 0.036, not at 0.082 (`scripts/full_kl_memory.py`; README). KL_k is differentiable in the current policy's
log-probs (Truly PPO's rollback term needs that gradient). The trainer's default keeps pi_old's hidden states
instead, which gives the exact KL (`TrustClipGRPOConfig.full_kl_storage`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

DEFAULT_TOPK = 256


class TopKLogProbs(NamedTuple):
    """A distribution over V tokens summarised by its top k: `indices` and `logprobs` (..., k), `tail_logprob` (...)
    = log of the mass outside the top k."""

    indices: torch.Tensor
    logprobs: torch.Tensor
    tail_logprob: torch.Tensor


def topk_logprobs(logprobs: torch.Tensor, k: int = DEFAULT_TOPK) -> TopKLogProbs:
    """Top-k summary of full log-probs (..., V). k is capped at V - 1 (a one-token tail: the summary is exact).

    The tail mass is a log-sum-exp over the other tokens, not 1 - sum(top k), so it stays accurate when tiny."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    vocab = logprobs.size(-1)
    if vocab < 2:
        raise ValueError(f"need a vocabulary of at least 2 tokens, got {vocab}")
    top, indices = logprobs.topk(min(k, vocab - 1), dim=-1)
    return TopKLogProbs(indices, top, _outside_logsumexp(logprobs, indices))


def topk_kl(old: TopKLogProbs, logprobs: torch.Tensor) -> torch.Tensor:
    """KL_k(pi_old || pi) per position (...): the KL between the coarse-grained distributions (top-k tokens of
    pi_old, plus the tail), given pi_old's summary and the current policy's full log-probs (..., V).

    A lower bound of the exact KL, low by exactly P_tail * KL(tails) (module docstring); differentiable in
    `logprobs`. Tokens and tails of zero old mass contribute 0 (0 log 0 = 0)."""
    new_top = logprobs.gather(-1, old.indices)
    new_tail = _outside_logsumexp(logprobs, old.indices)
    top = _plogp_ratio(old.logprobs, new_top).sum(-1)
    return top + _plogp_ratio(old.tail_logprob, new_tail)


def exact_kl(old_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(pi_old || pi) per position from both full log-probs (..., V) (the reference of `topk_kl`)."""
    return _plogp_ratio(old_logprobs, logprobs).sum(-1)


def _plogp_ratio(old_logp: torch.Tensor, new_logp: torch.Tensor) -> torch.Tensor:
    """p (log p - log q), with 0 where p = 0 (also when q = 0 there)."""
    p = old_logp.exp()
    return torch.where(p > 0, p * (old_logp - new_logp), torch.zeros_like(p))


def _outside_logsumexp(logprobs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log sum_{j not in indices} exp(logprobs_j)."""
    return logprobs.scatter(-1, indices, -torch.inf).logsumexp(-1)
