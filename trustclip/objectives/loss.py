"""The entry points: per-token loss of any objective, its aggregation, and the standard metrics."""

from __future__ import annotations

import torch

from trustclip.objectives.aggregation import aggregate, check_aggregation
from trustclip.objectives.batch import PolicyBatch, make_batch
from trustclip.objectives.fused import (
    DEFAULT_FUSED,
    fused_backend,
    fused_policy_loss,
    fused_token_loss,
    weighted_token_loss,
)
from trustclip.objectives.registry import Objective, TokenLoss, get_objective
from trustclip.objectives.statistics import PolicyMetrics

EXTRA_INPUTS = ("entropy", "full_kl")
NONNEGATIVE_INPUTS = ("entropy", "full_kl", "token_weights")  # see batch.NONNEGATIVE_TOLERANCE
LOW_PRECISION = (torch.bfloat16, torch.float16)  # log-probs in these are upcast to float32 (the trainer's precision)


def compute_token_loss(
    objective: str | Objective,
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_weights: torch.Tensor | None = None,
    fused: bool | str = DEFAULT_FUSED,
    **extra: torch.Tensor | None,
) -> tuple[TokenLoss, PolicyBatch]:
    """Validate inputs and return the objective's per-token loss (zero on padding) and the batch.

    `token_weights` (B, T) multiplies the per-token loss (e.g. rollout importance-sampling
    corrections); extras are (B, T) tensors some objectives need: `entropy`, `full_kl`. bfloat16 / float16 log-probs
    are upcast: the ratio, the constraint's decisions and the loss are computed in float32. `fused`: as in
    `compute_policy_loss` (the objective and the weighting as one compiled graph).
    """
    objective, batch, weights, backend = _validated(objective, logp, old_logp, advantages, mask, token_weights, fused,
                                                    extra)
    if backend is not None:
        return fused_token_loss(objective, batch, weights, backend), batch
    return weighted_token_loss(objective, batch, weights), batch


def _validated(objective: str | Objective, logp: torch.Tensor, old_logp: torch.Tensor | None,
               advantages: torch.Tensor, mask: torch.Tensor, token_weights: torch.Tensor | None, fused: bool | str,
               extra: dict[str, torch.Tensor | None]) -> tuple[Objective, PolicyBatch, torch.Tensor | None, str | None]:
    """The objective, the validated batch, the token weights and the compile backend (None: eager)."""
    objective = get_objective(objective)
    if isinstance(logp, torch.Tensor) and logp.dtype in LOW_PRECISION:
        # exp(logp - old_logp) and its clip decisions in bfloat16 are off by ~1% (flipping decisions near a bound);
        # the upcast is differentiable, so the gradient still reaches the caller's low-precision tensor
        logp = logp.float()
    backend = fused_backend(fused, objective)
    unknown = set(extra) - set(EXTRA_INPUTS)
    if unknown:
        raise ValueError(f"unknown extra input(s) {sorted(unknown)}; valid: {', '.join(EXTRA_INPUTS)}")
    missing = [name for name in objective.requires if extra.get(name) is None]
    if missing:
        raise ValueError(f"objective {objective.name!r} needs the extra input(s) {missing} as (B, T) tensors "
                         f"(e.g. compute_policy_loss(..., {missing[0]}=tensor))")
    # make_batch validates the weights with the extras (and drops them when None)
    batch = make_batch(logp, old_logp, advantages, mask, {**extra, "token_weights": token_weights},
                       nonnegative=NONNEGATIVE_INPUTS)
    weights = batch.extras.pop("token_weights", None)
    return objective, batch, weights, backend


def _check_global_count(name: str, value: float, local: float, what: str) -> None:
    """A global count of the optimizer step counts this micro-batch too, so it cannot be smaller."""
    if float(value) < local:
        raise ValueError(f"{name}={value} is smaller than this batch's {local:g} {what}: it must be the global count "
                         "of the optimizer step (every micro-batch and process; with DDP also pass num_processes), "
                         "or None for this batch alone")


def _check_normalisers(aggregation: str, max_len: int | None, num_tokens: float | None,
                       num_sequences: float | None) -> None:
    """Each normaliser only where the aggregation divides by it: one given elsewhere would be silently ignored, and
    dr_grpo's L_max must be a constant (the batch's longest response changes from batch to batch: not Dr.GRPO)."""
    if aggregation == "dr_grpo" and max_len is None:
        raise ValueError("aggregation='dr_grpo' divides by a constant L_max: pass max_len (the generation limit, e.g. "
                         "max_completion_length); without it the normaliser would be this batch's longest response, "
                         "which is not Dr.GRPO's (or choose another aggregation, e.g. 'token_mean')")
    unused = {"max_len": (max_len, aggregation != "dr_grpo", "dr_grpo's L_max"),
              "num_tokens": (num_tokens, aggregation != "token_mean", "token_mean's normaliser"),
              "num_sequences": (num_sequences, aggregation == "token_mean", "the per-sequence aggregations' count")}
    for name, (value, ignored, what) in unused.items():
        if value is not None and ignored:
            raise ValueError(f"{name}={value!r} is {what}; aggregation={aggregation!r} does not use it: drop it")


def compute_policy_loss(
    objective: str | Objective,
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "dr_grpo",
    max_len: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    num_processes: int = 1,
    token_weights: torch.Tensor | None = None,
    fused: bool | str = DEFAULT_FUSED,
    **extra: torch.Tensor | None,
) -> tuple[torch.Tensor, PolicyMetrics]:
    """Policy loss of `objective` on one batch, and its metrics (`policy_metrics`, a mapping of floats reduced when
    first read).

    logp, old_logp, mask: (B, T); advantages: (B,) or (B, T). `aggregation`: one of AGGREGATIONS; dr_grpo needs
    its constant L_max, `max_len` (the generation limit). `num_tokens` / `num_sequences`: the global counts of the
    optimizer step (every micro-batch on every process), for a gradient however the step is split
    (`trustclip.objectives.aggregation`); a count below this batch's is an error, except `num_sequences` with
    seq_mean_token_sum, the normaliser of a sum (1: verl's token-sum). `num_processes`: with DDP, which averages the
    processes' gradients, each returns num_processes times its share, so that the average is the one-big-batch
    gradient. A normaliser the aggregation does not use (max_len but with dr_grpo, num_tokens but with token_mean,
    num_sequences with token_mean) is an error, not silently ignored. bfloat16 / float16 log-probs are computed in
    float32 (`compute_token_loss`). Raises ValueError on bad input.

    `fused=True` runs the objective, the aggregation and the metrics' totals as one `torch.compile`d graph (inductor;
    a string names another backend, e.g. "aot_eager"): fewer kernel launches, the same values and gradient to float
    rounding; validation stays eager. Each objective compiles on its first call (`trustclip.objectives.fused`, which
    also lists the objectives that cannot be fused: a ValueError).
    """
    check_aggregation(aggregation)
    _check_normalisers(aggregation, max_len, num_tokens, num_sequences)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an integer >= 1, got {num_processes!r}")
    objective, batch, weights, backend = _validated(objective, logp, old_logp, advantages, mask, token_weights, fused,
                                                    extra)

    def share(count: float | None) -> float | None:
        return None if count is None else float(count) / num_processes

    counts = {"max_len": max_len, "num_tokens": share(num_tokens), "num_sequences": share(num_sequences)}
    if backend is not None:
        loss, metrics = fused_policy_loss(objective, batch, weights, aggregation, backend, **counts)
    else:
        out = weighted_token_loss(objective, batch, weights)
        loss, metrics = aggregate(out.loss, batch.mask, aggregation, **counts), PolicyMetrics(out, batch)
    if aggregation == "token_mean" and num_tokens is not None:
        _check_global_count("num_tokens", num_tokens, float(batch.mask.sum()), "valid tokens")
    elif aggregation not in ("token_mean", "seq_mean_token_sum") and num_sequences is not None:
        _check_global_count("num_sequences", num_sequences, float(batch.mask.shape[0]), "sequences")
    return loss, metrics
