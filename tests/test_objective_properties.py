"""Property tests over random inputs for every objective: finiteness, masking, padding invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trustclip as tc
from trustclip.objectives import AGGREGATIONS, REGISTRY, DeltaController, get_objective

NAMES = [name for name in REGISTRY if name != "general"] + ["aspo_entropy", "general_kl3", "atr_seq_wide",
                                                             "dppo_kl_tis"]
PROPERTY_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(name: str):
    if name == "aspo_entropy":
        return get_objective("aspo", entropy_split=True)
    if name == "general_kl3":
        return get_objective("general", constraint=tc.DivergenceConstraint("kl3", lambda w: w - 1 - w.log(), 0.07))
    if name == "atr_seq_wide":  # the default delta (GSPO's scale) holds nearly every sequence of these batches
        return get_objective("atr_seq", delta=0.05)
    if name == "dppo_kl_tis":  # truncated IS: value and gradient set apart
        return get_objective("dppo_kl", tis_cap=2.0)
    if name == "clip_cov":
        return get_objective(name, clip_cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9, seed=0)
    return get_objective(name)


@st.composite
def batches(draw):
    """Random (B, T) batches with log-probs anywhere in [-60, 0]: log-ratios far beyond the +-20 clamp."""
    seed = draw(st.integers(0, 2**31 - 1))
    batch, length = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.01, 1.0, 10.0, 60.0]))
    logp = -np.abs(rng.normal(0, scale, (batch, length)))
    old = -np.abs(rng.normal(0, scale, (batch, length)))
    adv = rng.normal(0, draw(st.sampled_from([0.0, 1.0, 100.0])), batch)
    mask = rng.random((batch, length)) < 0.7
    mask[rng.integers(batch), rng.integers(length)] = True
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    entropy, full_kl = rng.random((batch, length)) * 5, rng.random((batch, length))
    return t(logp), t(old), t(adv), torch.tensor(mask), t(entropy), t(full_kl)


def normalisers(aggregation, max_len, num_tokens=None, num_sequences=None):
    """The normalisers `aggregation` divides by (compute_policy_loss refuses the others)."""
    if aggregation == "token_mean":
        return {} if num_tokens is None else {"num_tokens": num_tokens}
    given = {"max_len": max_len} if aggregation == "dr_grpo" else {}
    return given | ({} if num_sequences is None else {"num_sequences": num_sequences})


def run(objective, logp, old, adv, mask, entropy, full_kl, aggregation="dr_grpo", max_len=16):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = tc.compute_policy_loss(objective, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                           aggregation=aggregation, **normalisers(aggregation, max_len),
                                           entropy=entropy, full_kl=full_kl)
    loss.backward()
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("name", NAMES)
@PROPERTY_SETTINGS
@given(data=batches(), aggregation=st.sampled_from(AGGREGATIONS))
def test_finite_loss_gradient_and_metrics_and_zero_gradient_on_padding(name, data, aggregation, device):
    logp, old, adv, mask, entropy, full_kl = (t.to(device) for t in data)
    loss, grad, metrics = run(build(name), logp, old, adv, mask, entropy, full_kl, aggregation)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert (grad[~mask] == 0).all()  # exactly zero, not just small
    assert 0 <= metrics["clip_frac_low"] <= 1 and 0 <= metrics["clip_frac_high"] <= 1


@pytest.mark.parametrize("name", NAMES)
@PROPERTY_SETTINGS
@given(data=batches(), aggregation=st.sampled_from(AGGREGATIONS), pad=st.integers(1, 4),
       junk=st.sampled_from([0.0, -1e4, float("nan"), float("-inf")]))
def test_appending_padding_changes_nothing(name, data, aggregation, pad, junk):
    logp, old, adv, mask, entropy, full_kl = data
    objective = build(name)
    loss, grad, metrics = run(objective, logp, old, adv, mask, entropy, full_kl, aggregation)

    def padded(x, value):
        return torch.cat([x, torch.full((x.shape[0], pad), value, dtype=x.dtype)], dim=1)

    loss_p, grad_p, metrics_p = run(objective, padded(logp, junk), padded(old, junk), adv, padded(mask, False),
                                    padded(entropy, junk), padded(full_kl, junk), aggregation)
    # Only float rounding may differ (sums over longer rows); float64 is held to 1e-10. The loss and its gradient are
    # sums of terms up to |A| times a ratio weight, which can cancel to a small total: their absolute rounding error
    # scales with the largest |A| (a 1e-4 relative difference at |A| = 148 in float32 is rounding, not padding).
    tol = {"rtol": 1e-5, "atol": 1e-6} if logp.dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    scaled = {**tol, "atol": tol["atol"] * max(1.0, float(adv.abs().max()))}
    torch.testing.assert_close(loss_p, loss, **scaled)
    torch.testing.assert_close(grad_p[:, : logp.shape[1]], grad, **scaled)
    assert (grad_p[:, logp.shape[1]:] == 0).all()
    assert metrics_p == pytest.approx(metrics, rel=tol["rtol"], abs=tol["atol"])


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(data=batches())
def test_all_zero_advantages_give_zero_gradient(name, data):
    logp, old, adv, mask, entropy, full_kl = data
    _, grad, _ = run(build(name), logp, old, torch.zeros_like(adv), mask, entropy, full_kl)
    assert (grad == 0).all()


@settings(max_examples=60, deadline=None)
@given(data=batches(), splits=st.integers(1, 4), aggregation=st.sampled_from(AGGREGATIONS))
def test_micro_batches_with_global_denominators_sum_to_the_big_batch(data, splits, aggregation):
    logp, old, adv, mask, entropy, full_kl = (x.to(torch.float64) if x.is_floating_point() else x for x in data)
    objective = get_objective("kl3")
    loss, grad, _ = run(objective, logp, old, adv, mask, entropy, full_kl, aggregation)
    total, grads = 0.0, []
    for idx in torch.arange(logp.shape[0]).tensor_split(splits):
        if len(idx) == 0 or not mask[idx].any():
            grads.append(torch.zeros_like(logp[idx]))
            continue
        part = logp[idx].clone().requires_grad_(True)
        part_loss, _ = tc.compute_policy_loss(objective, logp=part, old_logp=old[idx], advantages=adv[idx],
                                              mask=mask[idx], aggregation=aggregation,
                                              **normalisers(aggregation, 16, mask.sum(), logp.shape[0]))
        part_loss.backward()
        total, grads = total + part_loss.detach(), grads + [part.grad]
    torch.testing.assert_close(torch.as_tensor(total, dtype=loss.dtype), loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads), grad, rtol=1e-10, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(target=st.sampled_from(["kl3_mean", "clip_frac"]), low=st.floats(1e-4, 0.2), span=st.floats(1.01, 100.0),
       start=st.floats(0.0, 1.0), target_value=st.floats(1e-4, 0.9), tolerance=st.floats(1.01, 3.0),
       factor=st.floats(1.01, 4.0), statistics=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30))
def test_delta_controller_stays_in_range_and_moves_the_right_way(target, low, span, start, target_value, tolerance,
                                                                 factor, statistics):
    high = low * span
    target_value = min(target_value, high * 0.99) if target == "kl3_mean" else target_value
    controller = DeltaController(target=target, target_value=target_value, delta_min=low, delta_max=high,
                                 delta=min(low + start * (high - low), high), tolerance=tolerance, factor=factor)
    for value in statistics:
        before = controller.delta
        after = controller.update({target: value})
        assert low <= after <= high
        too_high, too_low = value > target_value * tolerance, value < target_value / tolerance
        widen = too_low if target == "kl3_mean" else too_high
        tighten = too_high if target == "kl3_mean" else too_low
        expected = before * factor if widen else before / factor if tighten else before
        assert after == pytest.approx(min(max(expected, low), high), rel=1e-12)
