"""truly_ppo's full-vocabulary quantities from the LM head's input, in bounded memory (Liger-Kernel style).

Truly PPO (arXiv 1903.07940) constrains the exact per-state KL_t = KL(pi_old(.|s_t) || pi(.|s_t)), a sum over the
whole vocabulary V, whose (B, T, V) logits would not fit (3.2 GB for 256 x 64 tokens at V = 49,152, and as much
again for the backward pass). `full_vocab_logprobs` runs the LM head on chunks of positions and recomputes each
chunk's logits in the backward pass (activation checkpointing): at most one (chunk, V) block exists at a time. The KL
is exact, sum_v p_old(v) (log p_old(v) - log p(v)) from pi_old's hidden states and LM head, or the top-k lower bound
of `trustclip.objectives.topk_kl`; both are differentiable in the current policy (TR-PPO-RB's rollback term needs that
gradient), pi_old's side carries none. Pure torch: usable from any trainer (`TrustClipGRPOTrainer` captures the
hidden states of a transformers model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trustclip.objectives.topk_kl import TopKLogProbs, exact_kl, topk_kl, topk_logprobs

Head = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # a (V, H) weight, or a module mapping (.., H) -> (.., V)
CHUNK_ELEMENTS = 2**23  # elements of one (positions, V) block of logits: 32 MB in float32


class FullVocabLogProbs(NamedTuple):
    """Per position (the shape of `targets`): the target's log-prob, the entropy, and KL(pi_old || pi) when pi_old
    was given; `topk`, the policy's own top-k summary, when asked for."""

    logp: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor | None = None
    topk: TopKLogProbs | None = None


def full_vocab_logprobs(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    old_hidden: torch.Tensor | None = None,
    old_head: Head | None = None,
    old_topk: TopKLogProbs | None = None,
    keep_topk: int | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> FullVocabLogProbs:
    """Log-probs of `targets` (...) and entropies under softmax(head(hidden) / temperature), hidden (..., H), in
    chunks of positions of at most `chunk_elements` logits each, recomputed in the backward pass.

    pi_old, for the KL, is either `old_hidden` (..., H) with `old_head` (exact), or `old_topk` (top-k summary per
    position). `keep_topk=k` returns the policy's top-k summary (no gradient). `head` is the LM head's (V, H) weight
    or, when it is not a plain matrix (e.g. adapters on the head), the module itself. Raises ValueError on
    inconsistent arguments."""
    _check(hidden, targets, temperature, old_hidden, old_head, old_topk, keep_topk)
    shape = targets.shape
    width = hidden.size(-1)
    old = ([] if old_hidden is None else [old_hidden.reshape(-1, width)]) + (
        [] if old_topk is None else [x.reshape(-1, *x.shape[len(shape):]) for x in old_topk])

    def chunk_scores(h: torch.Tensor, target: torch.Tensor, *old_chunk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logprobs = torch.log_softmax(_logits(head, h) / temperature, dim=-1)  # (chunk, V)
        logp = logprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        if old_hidden is not None:
            with torch.no_grad():
                old_logprobs = torch.log_softmax(_logits(old_head, old_chunk[0]) / temperature, dim=-1)
            return logp, entropy, exact_kl(old_logprobs, logprobs)
        if old_topk is not None:
            return logp, entropy, topk_kl(TopKLogProbs(old_chunk[0].long(), *old_chunk[1:]), logprobs)
        if keep_topk is not None:
            return (logp, entropy, *topk_logprobs(logprobs.detach(), keep_topk))
        return logp, entropy

    flat = [hidden.reshape(-1, width), targets.reshape(-1), *old]
    vocab = _vocabulary(head, flat[0][:1])
    step = max(1, chunk_elements // vocab)
    pieces = []
    for start in range(0, flat[1].numel(), step):
        args = [x[start:start + step] for x in flat]
        if torch.is_grad_enabled():  # keep the chunk's inputs, not its (chunk, V) logits: recomputed in backward
            pieces.append(checkpoint(chunk_scores, *args, use_reentrant=False))
        else:
            pieces.append(chunk_scores(*args))
    logp, entropy, *rest = [torch.cat(x).reshape(*shape, *x[0].shape[1:]) for x in zip(*pieces, strict=True)]
    if keep_topk is not None:
        return FullVocabLogProbs(logp, entropy, topk=TopKLogProbs(*rest))
    return FullVocabLogProbs(logp, entropy, kl=rest[0] if rest else None)


def _logits(head: Head, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits, in float32 at least (a half-precision softmax over V loses the tail)."""
    logits = F.linear(hidden, head) if isinstance(head, torch.Tensor) else head(hidden)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _vocabulary(head: Head, probe: torch.Tensor) -> int:
    weight = head if isinstance(head, torch.Tensor) else getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.size(0)
    with torch.no_grad():
        return _logits(head, probe).size(-1)


def _check(hidden: torch.Tensor, targets: torch.Tensor, temperature: float, old_hidden: torch.Tensor | None,
           old_head: Head | None, old_topk: TopKLogProbs | None, keep_topk: int | None) -> None:
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected {tuple(targets.shape)} + (H,) to match "
                         "targets")
    if targets.numel() == 0:
        raise ValueError("targets is empty: no position to score")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if (old_hidden is None) != (old_head is None):
        raise ValueError("the exact KL needs both old_hidden and old_head (pi_old's hidden states and LM head)")
    if sum(x is not None for x in (old_hidden, old_topk, keep_topk)) > 1:
        raise ValueError("give at most one of old_hidden (exact KL), old_topk (top-k KL) and keep_topk")
    if old_hidden is not None and old_hidden.shape != hidden.shape:
        raise ValueError(f"old_hidden has shape {tuple(old_hidden.shape)}, expected {tuple(hidden.shape)}")
    if old_topk is not None and old_topk.tail_logprob.shape != targets.shape:
        raise ValueError(f"old_topk covers positions {tuple(old_topk.tail_logprob.shape)}, expected "
                         f"{tuple(targets.shape)}")
