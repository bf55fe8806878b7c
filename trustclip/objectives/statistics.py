"""The per-token statistics of a policy loss, defined once (`token_statistics`); each integration only chooses how
to reduce them (`reduce_statistics`): on one process (`policy_metrics`, the verl plugin), or over every process with
the TRL trainer's all-reduce and all-gather. All values leave the device in one transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.registry import TokenLoss

# Objective-independent measure of how off-policy an update is: the fraction of valid tokens whose ratio left
# PPO's default region [1 - 0.2, 1 + 0.2]. It is logged for every objective (the unconstrained control too),
# so that "the constraint never acted" can be told apart from "the ratio never moved".
OFFPOLICY_EPSILON = 0.2

Reduce = Callable[[torch.Tensor], torch.Tensor]
_BEYOND_ANY_RATIO = 1e30  # added to padding for the ratio's min; ratios are at most exp(LOG_RATIO_CLAMP) ~ 4.9e8


@dataclass
class TokenStatistics:
    """What one loss evaluation measures: `means` (B, T) series, each logged as its mean over the valid tokens;
    `ratio` (B, T), logged as its min and max over them (`ratio_min`, `ratio_max`); `scalars` () logged as they
    are (averaged over processes). Integrations may add their own series or scalars before reducing."""

    means: dict[str, torch.Tensor]
    ratio: torch.Tensor
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)


def token_statistics(out: TokenLoss, batch: PolicyBatch) -> TokenStatistics:
    """Clipped-low / clipped-high fractions (`clip_frac`: tokens whose gradient the constraint removed, i.e. where
    it is active), the fraction whose ratio left [0.8, 1.2] (`offpolicy_frac`, whatever the objective), the mean
    ratio, the mean KL3 = w - 1 - log w, and the objective's own statistics."""
    ratio = batch.ratio.detach()
    means = {
        "clip_frac_low": out.clipped_low,
        "clip_frac_high": out.clipped_high,
        "clip_frac": out.clipped_low | out.clipped_high,
        "offpolicy_frac": (ratio - 1).abs() > OFFPOLICY_EPSILON,
        "ratio_mean": ratio,
        "kl3_mean": ratio - 1 - batch.log_ratio.detach(),
    }
    scalars = {}
    for name, value in out.stats.items():
        (means if value.dim() == 2 else scalars)[name] = value.detach()
    return TokenStatistics(means, ratio, scalars)


def reduce_statistics(
    stats: TokenStatistics, mask: torch.Tensor, *, sum_over_processes: Reduce | None = None,
    max_over_processes: Reduce | None = None, num_processes: int = 1,
) -> tuple[dict[str, float], float]:
    """Plain-float metrics of `stats` over the valid tokens (`mask` (B, T) > 0), and the number of those tokens.

    `sum_over_processes` / `max_over_processes` reduce a 1-D tensor across processes (e.g. an all-reduce sum and an
    all-gather max); None: this process alone. Scalars are averaged over `num_processes`. Keys come in the order
    of the series, with `ratio_min` / `ratio_max` after `ratio_mean`, then the scalars."""
    sums, extremes = statistic_totals(stats, mask, num_processes=num_processes)
    if sum_over_processes is not None:
        sums = sum_over_processes(sums)
    if max_over_processes is not None:
        extremes = max_over_processes(extremes)
    values = torch.cat([sums, extremes]).tolist()  # the one device-to-host transfer
    return metrics_of_totals(list(stats.means), list(stats.scalars), values)


def statistic_totals(stats: TokenStatistics, mask: torch.Tensor, *,
                     num_processes: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The device side of `reduce_statistics` (no transfer, no Python branch on values, so it compiles into one
    graph): `sums`, 1-D, the totals of the series over the valid tokens, then their count, then the scalars divided
    by `num_processes`; `extremes`, the ratio's (max, -min) over them."""
    weights = mask.to(stats.ratio.dtype)
    valid = weights.bool()
    # bool series counted on the valid tokens, float series weighted by the mask
    sums = [(x & valid).count_nonzero() if x.dtype == torch.bool else (x * weights).sum() for x in stats.means.values()]
    sums.append(weights.sum())
    sums += [s.reshape(()) / num_processes for s in stats.scalars.values()]
    sums = torch.stack([s.to(weights.dtype) for s in sums])
    # The ratio (> 0) at its max is unchanged by the mask's 1; padding, at 0 or pushed beyond any ratio, never wins.
    ratio = stats.ratio
    extremes = torch.stack([(ratio * weights).amax(), -torch.add(ratio, 1 - weights, alpha=_BEYOND_ANY_RATIO).amin()])
    return sums, extremes


def metrics_of_totals(means: list[str], scalars: list[str], values: list[float]) -> tuple[dict[str, float], float]:
    """The host side of `reduce_statistics`: the metrics and the token count from `values` (plain floats: the sums,
    reduced over processes or not, then the extremes of `statistic_totals`), whose series are named `means` and
    scalars `scalars` (the keys of a `TokenStatistics`)."""
    k = len(means)
    count = values[k]
    if count == 0:  # no valid token anywhere: no extremes
        values[-2:] = [-torch.inf, -torch.inf]
    metrics = {}
    for key, total in zip(means, values[:k], strict=True):
        metrics[key] = total / max(count, 1.0)
        if key == "ratio_mean":
            metrics |= {"ratio_min": -values[-1], "ratio_max": values[-2]}
    metrics |= dict(zip(scalars, values[k + 1:-2], strict=True))
    return metrics, count


def policy_metrics(out: TokenLoss, batch: PolicyBatch) -> dict[str, float]:
    """Plain-float metrics of this batch alone: the masked means of `token_statistics` (clip fractions,
    `offpolicy_frac`, ratio mean, mean KL3, the objective's own statistics) and the ratio's min / max."""
    return reduce_statistics(token_statistics(out, batch), batch.mask)[0]


class PolicyMetrics(Mapping[str, float]):
    """The metrics of one batch (`policy_metrics`), reduced when first read: a training loop that logs every k steps
    pays for the reduction, and its device-to-host transfer, only on those steps. A read-only mapping of plain
    floats (`dict(metrics)` for a dict). It keeps detached tensors only, never the autograd graph."""

    def __init__(self, out: TokenLoss, batch: PolicyBatch) -> None:
        stats = {key: value.detach() for key, value in out.stats.items()}
        self._inputs = (TokenLoss(out.loss.detach(), out.clipped_low, out.clipped_high, stats),
                        PolicyBatch(batch.logp.detach(), batch.old_logp, batch.advantages, batch.mask,
                                    batch.log_ratio.detach(), batch.ratio.detach()))

    @cached_property
    def _values(self) -> dict[str, float]:
        values = self._reduce()
        self._inputs = None  # the tensors are no longer needed
        return values

    def _reduce(self) -> dict[str, float]:
        return policy_metrics(*self._inputs)

    def __getitem__(self, key: str) -> float:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"PolicyMetrics({self._values!r})"
