"""Loss aggregation: how per-token losses c_{i,t} = -J_{i,t} become one scalar (the normaliser
decides the length bias). B responses, mask m, lengths L_i = sum_t m_{i,t}.

  token_mean           sum_{i,t} m c / sum_{i,t} m                    DAPO (arXiv 2503.14476)
  seq_mean_token_mean  (1/B) sum_i (1/L_i) sum_t m c                  GRPO (arXiv 2402.03300)
  seq_mean_token_sum   (1/B) sum_i sum_t m c
  dr_grpo              (1/B) sum_i sum_t m c / L_max                  Dr.GRPO (arXiv 2503.20783)

For a gradient that is the same however the batch is split (gradient accumulation, several
processes), pass the global denominators: `num_tokens` (all valid tokens of the optimizer step) for
token_mean, `num_sequences` (all responses of the step) for the others. Each slice then returns its
share of the global loss, and the shares sum to the one-big-batch loss.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo")


def check_aggregation(mode: str) -> str:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return mode


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "dr_grpo",
    *,
    max_len: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    `max_len` is Dr.GRPO's constant L_max (use the generation limit, e.g. max_completion_length). When
    it is None the longest response in the batch is used: padding-invariant, but not constant across
    batches, so pass it for a faithful Dr.GRPO.
    """
    check_aggregation(mode)
    if mode == "dr_grpo":
        max_len = dr_grpo_length(mask, max_len)
    return aggregate_with_length(loss, mask, mode, max_len=max_len, num_tokens=num_tokens,
                                 num_sequences=num_sequences)


def dr_grpo_length(mask: torch.Tensor, max_len: int | None) -> int:
    """Dr.GRPO's L_max: `max_len`, checked against the longest response, or that response's length when None. Reads
    one number on the host (the rest of `aggregate` does not, so that it compiles into one graph)."""
    longest = int(mask.sum(-1).max().item())
    if max_len is None:
        return max(longest, 1)
    if _positive("max_len", max_len) < longest:
        raise ValueError(f"max_len={max_len} is shorter than the longest response in the batch ({longest} tokens)")
    return max_len


def aggregate_with_length(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, max_len: int | None,
                          num_tokens: float | None, num_sequences: float | None) -> torch.Tensor:
    """`aggregate` once dr_grpo's L_max is known (`dr_grpo_length`)."""
    mask = mask.to(loss.dtype)
    masked = loss * mask
    lengths = mask.sum(-1)
    if mode == "token_mean":
        denom = lengths.sum() if num_tokens is None else _positive("num_tokens", num_tokens)
        return masked.sum() / denom
    n_seq = loss.shape[0] if num_sequences is None else _positive("num_sequences", num_sequences)
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / lengths.clamp(min=1)).sum() / n_seq
    if mode == "seq_mean_token_sum":
        return masked.sum() / n_seq
    return masked.sum() / (n_seq * max_len)


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not 0 < value < float("inf"):  # NaN fails both comparisons
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value
