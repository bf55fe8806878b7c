"""The per-token statistics of a policy loss, defined once (trustclip.objectives.statistics): the metrics against a
float64 reference built token by token, the reduction over several processes against one big batch, and the lazy
metrics of `compute_policy_loss`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import trustclip as tc
from trustclip.objectives import compute_token_loss, get_objective, policy_metrics
from trustclip.objectives.statistics import PolicyMetrics, reduce_statistics, token_statistics

NAMES = ["clip", "kl3", "dual_clip", "cispo", "gspo", "sapo"]  # plain clipping and objectives with own statistics


def random_batch(seed: int, batch: int = 5, length: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.4 * torch.randn(batch, length, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).to(torch.float64)
    return logp, old, adv, mask


def reference_metrics(out, logp, old, adv, mask) -> dict[str, float]:
    """Every metric from its definition, one valid token at a time, in float64."""
    valid = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]
    w = {(i, t): math.exp(float(logp[i, t] - old[i, t])) for i, t in valid}
    low, high = out.clipped_low, out.clipped_high

    def mean(values) -> float:
        return float(np.mean([float(v) for v in values]))

    metrics = {
        "clip_frac_low": mean(low[p] for p in valid),
        "clip_frac_high": mean(high[p] for p in valid),
        "clip_frac": mean(low[p] or high[p] for p in valid),
        "offpolicy_frac": mean(abs(w[p] - 1) > 0.2 for p in valid),
        "ratio_mean": mean(w[p] for p in valid),
        "ratio_min": min(w.values()),
        "ratio_max": max(w.values()),
        "kl3_mean": mean(w[p] - 1 - math.log(w[p]) for p in valid),
    }
    return metrics | {key: mean(value[p] for p in valid) for key, value in out.stats.items()}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_metrics_match_the_token_by_token_reference(name, seed):
    logp, old, adv, mask = random_batch(seed)
    out, batch = compute_token_loss(get_objective(name), logp=logp, old_logp=old, advantages=adv, mask=mask)
    metrics = policy_metrics(out, batch)
    expected = reference_metrics(out, logp, old, adv, mask)
    assert list(metrics)[:8] == ["clip_frac_low", "clip_frac_high", "clip_frac", "offpolicy_frac", "ratio_mean",
                                 "ratio_min", "ratio_max", "kl3_mean"]
    assert metrics == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_all_reduced_over_two_processes_equals_the_whole_batch(name):
    """The trainer's reduction (sums all-reduced, extremes all-gathered) of two halves of a batch, one per process,
    gives the metrics of the whole batch on one process."""
    logp, old, adv, mask = random_batch(7, batch=6)
    objective = get_objective(name)
    if name == "gspo":  # sequence statistics: each half is its own batch of sequences, as on two processes
        objective = get_objective(name, epsilon_low=0.05, epsilon_high=0.05)
    halves = []
    for rows in (slice(0, 3), slice(3, 6)):
        out, batch = compute_token_loss(objective, logp=logp[rows], old_logp=old[rows], advantages=adv[rows],
                                        mask=mask[rows])
        halves.append((token_statistics(out, batch), batch.mask))
    local = []  # what each process would contribute to the collectives
    for stats, half_mask in halves:
        local.append({})
        reduce_statistics(stats, half_mask, sum_over_processes=lambda x, d=local[-1]: d.setdefault("sum", x),
                          max_over_processes=lambda x, d=local[-1]: d.setdefault("max", x), num_processes=2)
    total = local[0]["sum"] + local[1]["sum"]
    most = torch.maximum(local[0]["max"], local[1]["max"])
    got, count = reduce_statistics(halves[0][0], halves[0][1], sum_over_processes=lambda _: total,
                                   max_over_processes=lambda _: most, num_processes=2)
    out, batch = compute_token_loss(objective, logp=logp, old_logp=old, advantages=adv, mask=mask)
    assert count == float(mask.sum())
    assert got == pytest.approx(policy_metrics(out, batch), rel=1e-12, abs=1e-12)


def test_no_valid_token_on_any_process_gives_no_extremes():
    logp, old, adv, mask = random_batch(1)
    out, batch = compute_token_loss(get_objective("kl3"), logp=logp, old_logp=old, advantages=adv, mask=mask)
    metrics, count = reduce_statistics(token_statistics(out, batch), torch.zeros_like(mask))
    assert count == 0 and metrics["clip_frac"] == 0.0
    assert metrics["ratio_max"] == -math.inf and metrics["ratio_min"] == math.inf


def test_compute_policy_loss_reduces_its_metrics_when_first_read():
    logp, old, adv, mask = random_batch(2)
    logp.requires_grad_(True)
    loss, metrics = tc.compute_policy_loss("kl3", logp=logp, old_logp=old, advantages=adv, mask=mask,
                                           aggregation="token_mean")
    assert isinstance(metrics, PolicyMetrics)
    kept = [t for part in metrics._inputs for t in vars(part).values() if torch.is_tensor(t)]
    assert kept and not any(t.requires_grad for t in kept)  # detached: the autograd graph is not kept alive
    loss.backward()  # reading after the backward pass (and any optimizer step) gives the same values
    out, batch = compute_token_loss("kl3", logp=logp.detach(), old_logp=old, advantages=adv, mask=mask)
    assert dict(metrics) == policy_metrics(out, batch)
    assert metrics._inputs is None  # read once, the tensors are released
    assert metrics["kl3_mean"] == policy_metrics(out, batch)["kl3_mean"] and len(metrics) == 8
