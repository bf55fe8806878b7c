"""DPPO (Binary-TV / Binary-KL), CFPO and M2PO in the unified framework: where each is clip_general(w, C) the identity
is tested (same loss and gradient through `general` with that C), where it is not, the property that makes it
something else is. Their float64 reference tests are in test_objectives.py, the shared property tests (finiteness,
padding, zero advantages) in test_objective_properties.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_objectives import binary_divergence
from test_objectives import random_inputs

import trustclip as tc
from trustclip.objectives import BinaryDivergence, ProbabilityInterval, compute_token_loss, get_objective
from trustclip.objectives.bounds import dppo_tv_bounds

DELTA_RANGES = {"tv": (0.02, 0.3), "kl": (0.005, 0.1)}


def dr_grpo_length(aggregation, logp):
    """dr_grpo's constant L_max (the padded width); other aggregations take none (compute_policy_loss refuses it)."""
    return {"max_len": logp.shape[1]} if aggregation == "dr_grpo" else {}


def loss_and_grad(objective, logp, old, adv, mask, aggregation="token_mean"):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = tc.compute_policy_loss(objective, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                           aggregation=aggregation, **dr_grpo_length(aggregation, logp))
    loss.backward()
    return loss.detach(), logp.grad, metrics


def one_token(w: float, adv: float, q: float = 0.01):
    """A (1, 1) batch whose token has ratio w, advantage adv and old probability q."""
    old = torch.full((1, 1), math.log(q), dtype=torch.float64)
    return old + math.log(w), old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)


# ----------------------------------------------------------------------------- DPPO: clip_general with C = D <= delta
@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", range(6))
def test_dppo_is_clip_general_with_the_binary_divergence_constraint(kind, seed):
    """dppo_<kind> = `general` with C = BinaryDivergence(kind, delta_low, delta_high): same loss, gradient, metrics."""
    logp, old, adv, mask, _, _ = random_inputs(seed, spread=0.6)
    delta_low, delta_high = np.random.default_rng(seed).uniform(*DELTA_RANGES[kind], size=2)
    dppo = get_objective(f"dppo_{kind}", delta_low=delta_low, delta_high=delta_high)
    general = get_objective("general", constraint=BinaryDivergence(kind, delta_low, delta_high))
    loss, grad, metrics = loss_and_grad(dppo, logp, old, adv, mask)
    loss_g, grad_g, metrics_g = loss_and_grad(general, logp, old, adv, mask)
    assert torch.equal(loss, loss_g) and torch.equal(grad, grad_g)
    assert dict(metrics) == dict(metrics_g)
    assert metrics["clip_frac"] > 0  # the constraint acts on these inputs


@pytest.mark.parametrize("seed", range(6))
def test_dppo_tv_is_ratio_clipping_with_probability_dependent_bounds(seed):
    """|pi - q| <= delta is w in [1 - delta_low / q, 1 + delta_high / q]: the gradient of the ratio test equals that
    of the probability test (a second path: bounds on w instead of differences of probabilities)."""
    logp, old, adv, mask, _, _ = random_inputs(seed, spread=0.6)
    delta_low, delta_high = np.random.default_rng(seed).uniform(*DELTA_RANGES["tv"], size=2)
    region = ProbabilityInterval("dppo_tv", lambda q: dppo_tv_bounds(q, delta_low, delta_high))
    _, grad, metrics = loss_and_grad(get_objective("dppo_tv", delta_low=delta_low, delta_high=delta_high),
                                     logp, old, adv, mask)
    _, grad_ratio, _ = loss_and_grad(get_objective("general", constraint=region), logp, old, adv, mask)
    assert torch.equal(grad, grad_ratio) and metrics["clip_frac"] > 0


@pytest.mark.parametrize("seed", range(6))
def test_dppo_kl_is_trgppos_raw_kl_region(seed):
    """The binary KL of the sampled token is TRGPPO's KL for discrete actions: dppo_kl(delta, delta) has the gradient
    of trgppo(delta, epsilon=None) (its ratio region in PPO form, from Newton-solved bounds), and the same bounds."""
    logp, old, adv, mask, _, _ = random_inputs(seed, spread=0.6)
    delta = float(np.random.default_rng(seed).uniform(*DELTA_RANGES["kl"]))
    dppo = get_objective("dppo_kl", delta_low=delta, delta_high=delta)
    _, grad, metrics = loss_and_grad(dppo, logp, old, adv, mask)
    _, grad_trgppo, _ = loss_and_grad(get_objective("trgppo", delta=delta, epsilon=None), logp, old, adv, mask)
    assert torch.equal(grad, grad_trgppo) and metrics["clip_frac"] > 0
    q = np.array([0.01, 0.3, 0.9])
    np.testing.assert_array_equal(tc.ratio_bounds(dppo, q=q), tc.ratio_bounds("trgppo", q=q, delta=delta, epsilon=None))


def test_dppo_bounds_and_divergences_in_closed_form():
    assert tc.ratio_bounds("dppo_tv", q=0.5) == pytest.approx((0.7, 1.3))
    assert tc.ratio_bounds("dppo_tv", q=0.05) == pytest.approx((0.0, 4.0))  # a rare token may fall to 0 or rise 4x
    assert tc.ratio_bounds("dppo_tv", q=1.0, delta_low=0.1, delta_high=0.3) == pytest.approx((0.9, 1.3))
    with pytest.raises(ValueError, match="has no ratio interval"):
        tc.ratio_bounds("cfpo")
    with pytest.raises(ValueError, match="has no ratio interval"):
        tc.ratio_bounds("m2po")
    # D at the edges: q = 1 (only the q log(q/p) term), p = 1 with q < 1 (infinite KL: outside any region)
    q = torch.tensor([[0.3, 1.0, 0.3, 0.9]], dtype=torch.float64)
    p = torch.tensor([[0.5, 0.8, 1.0, 0.9]], dtype=torch.float64)
    batch = tc.objectives.make_batch(p.log(), q.log(), torch.ones(1), torch.ones_like(p))
    kl = BinaryDivergence("kl", 0.05, 0.05).divergence(batch)
    np.testing.assert_allclose(kl[0, :2].numpy(), binary_divergence("kl", q.numpy(), p.numpy())[0, :2], rtol=1e-14)
    assert kl[0, 1] == pytest.approx(-math.log(0.8)) and kl[0, 2] == math.inf and kl[0, 3] == 0
    np.testing.assert_allclose(BinaryDivergence("tv", 0.1, 0.1).divergence(batch).numpy(), [[0.2, 0.2, 0.7, 0.0]],
                               atol=1e-15)
    assert BinaryDivergence("kl", 0.05, 0.05).holds(batch).tolist() == [[False, False, False, True]]


@pytest.mark.parametrize("kind, delta", [("js", 0.1), ("tv", 0.0), ("kl", -1.0), ("tv", float("nan"))])
def test_binary_divergence_rejects_bad_settings(kind, delta):
    with pytest.raises(ValueError, match=r"kind must be one of \('tv', 'kl'\), got 'js'|delta must be a finite number"):
        BinaryDivergence(kind, 0.1, delta)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_tis_cap_changes_the_gradient_only_of_kept_tokens_above_the_cap(kind):
    """Truncated IS: kept tokens with w > c get weight c instead of w (this breaks the clip_general identity); the
    value, the masked tokens and every other token are unchanged."""
    logp, old, adv, mask, _, _ = random_inputs(3, spread=0.6)
    cap = 1.3
    loss, grad, _ = loss_and_grad(get_objective(f"dppo_{kind}"), logp, old, adv, mask)
    loss_c, grad_c, metrics_c = loss_and_grad(get_objective(f"dppo_{kind}", tis_cap=cap), logp, old, adv, mask)
    out, batch = compute_token_loss(get_objective(f"dppo_{kind}", tis_cap=cap), logp=logp, old_logp=old,
                                    advantages=adv, mask=mask)
    w = batch.ratio
    capped = out.stats["tis_capped_frac"]
    assert torch.equal(capped, ~(out.clipped_low | out.clipped_high) & (w > cap) & (mask > 0))
    assert loss_c == loss and capped.any() and metrics_c["tis_capped_frac"] > 0
    changed = capped & (batch.advantages != 0)
    torch.testing.assert_close(grad_c[changed], grad[changed] * cap / w[changed], rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_c[~changed], grad[~changed], rtol=1e-14, atol=0)  # the same, up to rounding


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "cfpo", "m2po"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "dr_grpo"])
def test_autograd_matches_finite_differences(name, aggregation):
    """Away from their masks' edges (inputs fixed here) the losses are differentiable and autograd is their gradient;
    dppo with tis_cap is left out on purpose: its value and its gradient are decoupled."""
    logp, old, adv, mask, _, _ = random_inputs(11, spread=0.4)
    objective = get_objective(name)

    def loss_of(x):
        return tc.compute_policy_loss(objective, logp=x, old_logp=old, advantages=adv, mask=mask,
                                      aggregation=aggregation, **dr_grpo_length(aggregation, x))[0]

    assert torch.autograd.gradcheck(loss_of, (logp.clone().requires_grad_(True),), eps=1e-7, atol=1e-9, rtol=1e-6)


# ----------------------------------------------------------------------------- CFPO: a penalty, not clip_general
@settings(max_examples=200, deadline=None)
@given(log_w=st.floats(-3.0, 3.0), adv=st.floats(0.01, 10.0) | st.floats(-10.0, -0.01), epsilon=st.floats(0.01, 0.95))
def test_cfpo_term_rises_to_the_clip_boundary_and_pulls_back_beyond_it(log_w, adv, epsilon):
    """Each token's J = w A - |A| (w - 1)^2 / (2 eps) peaks at PPO's boundary w = 1 + sign(A) eps: inside it the
    gradient points the way A favours, past it the other way (the penalty pulls back). No token is ever clipped."""
    w = math.exp(log_w)
    logp, old, advantages, mask = one_token(w, adv)
    logp.requires_grad_(True)
    out, _ = compute_token_loss(get_objective("cfpo", epsilon=epsilon), logp=logp, old_logp=old,
                                advantages=advantages, mask=mask)
    (-out.loss).sum().backward()  # dJ / dlogp
    beyond = (w - 1) * math.copysign(1.0, adv) - epsilon
    gradient = logp.grad.item()
    expected = w * adv - abs(adv) * w * (w - 1) / epsilon
    assert gradient == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if abs(beyond) > 1e-6:
        assert (gradient * adv > 0) == (beyond < 0)
        assert bool(out.stats["pushback_frac"].item()) == (beyond > 0)
    assert not (out.clipped_low | out.clipped_high).any()


def test_cfpo_on_policy_is_the_policy_gradient():
    """At w = 1 the penalty and its gradient vanish: J = A, dJ/dlogp = A, as for every objective."""
    logp, old, adv, mask = one_token(1.0, -0.7)
    logp.requires_grad_(True)
    out, _ = compute_token_loss("cfpo", logp=logp, old_logp=old, advantages=adv, mask=mask)
    (-out.loss).sum().backward()
    assert out.loss.item() == pytest.approx(0.7) and logp.grad.item() == pytest.approx(-0.7)


# ----------------------------------------------------------------------------- M2PO: a batch statistic
@st.composite
def log_ratio_batches(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 10)))
    x = rng.normal(0, draw(st.sampled_from([0.05, 0.3, 1.0])), shape)
    if draw(st.booleans()):  # ties: repeated log-ratios (the clamp at +-20 makes them in practice)
        x = np.round(x, 1)
    mask = rng.random(shape) < 0.8
    mask[0, 0] = True
    adv = rng.normal(0, 1, shape[0])
    return x, mask, adv, draw(st.sampled_from([1e-3, 0.01, 0.04, 0.2]))


def run_m2po(x, mask, adv, threshold):
    old = torch.full(x.shape, -10.0, dtype=torch.float64)  # room for the log-ratios drawn (|x| < 10)
    logp = (old + torch.tensor(x)).requires_grad_(True)
    out, batch = compute_token_loss(get_objective("m2po", m2_threshold=threshold), logp=logp, old_logp=old,
                                    advantages=torch.tensor(adv), mask=torch.tensor(mask))
    out.loss.sum().backward()
    return out, batch, logp.grad


@settings(max_examples=150, deadline=None)
@given(data=log_ratio_batches())
def test_m2po_masks_the_fewest_largest_second_moments_that_bring_the_mean_below_tau(data):
    x, mask, adv, threshold = data
    out, batch, grad = run_m2po(x, mask, adv, threshold)
    masked = out.stats["m2_masked_frac"].numpy()
    m2 = x**2
    kept, dropped = m2[mask & ~masked], m2[masked]
    assert not (masked & ~mask).any() and kept.size >= 1
    rounding = 1e-12  # a mean equal to tau (ties on a grid) may round either way
    assert kept.mean() < threshold + rounding or kept.size == 1  # the bound, or AReaL's keep-one fallback
    if dropped.size:
        assert dropped.min() >= kept.max()  # largest first
        assert np.append(kept, dropped.min()).mean() > threshold - rounding  # and no more than needed
    w, a = batch.ratio.detach().numpy(), batch.advantages.numpy()
    np.testing.assert_allclose(grad.numpy(), np.where(masked | ~mask, 0.0, -w * a), rtol=1e-12, atol=0)
    assert np.array_equal(out.clipped_low.numpy() | out.clipped_high.numpy(), masked & (a != 0))


@settings(max_examples=50, deadline=None)
@given(data=log_ratio_batches())
def test_m2po_mask_ignores_the_advantage(data):
    """clip_general removes a gradient only where (w - 1) A > 0, so flipping A moves its mask; M2PO's does not move."""
    x, mask, adv, threshold = data
    out, _, _ = run_m2po(x, mask, adv, threshold)
    flipped, _, _ = run_m2po(x, mask, -adv, threshold)
    assert torch.equal(out.stats["m2_masked_frac"], flipped.stats["m2_masked_frac"])


def test_m2po_masks_a_token_or_not_depending_on_the_rest_of_the_batch():
    """Not a per-token constraint: the same token (log w = 0.5, A > 0) is masked among 3 on-policy tokens (mean M2
    0.0625 >= 0.04) and kept among 20 (0.25 / 21 < 0.04)."""
    for companions, masked in ((3, True), (20, False)):
        x = np.array([[0.5] + [0.0] * companions])
        out, _, grad = run_m2po(x, np.ones_like(x, bool), np.ones(1), 0.04)
        assert bool(out.stats["m2_masked_frac"][0, 0]) == masked and (grad[0, 0] == 0) == masked


def test_m2po_masks_tokens_that_moved_against_their_advantage():
    """A token whose ratio fell with A > 0 keeps its gradient under every clip_general objective (here ATR); M2PO
    masks it when its (log w)^2 is an outlier."""
    x = np.array([[-1.0, 0.0, 0.0, 0.0]])
    _, _, grad = run_m2po(x, np.ones_like(x, bool), np.ones(1), 0.04)
    logp, old = torch.tensor(x - 2.0), torch.full(x.shape, -2.0, dtype=torch.float64)
    _, grad_atr, _ = loss_and_grad("atr", logp, old, torch.ones(1, dtype=torch.float64), torch.ones_like(old))
    assert grad[0, 0] == 0 and grad_atr[0, 0] != 0


def test_m2po_keeps_one_token_when_no_subset_meets_tau():
    """Every (log w)^2 >= tau: all tokens but the smallest are masked (ties: the earliest of the largest go first)."""
    x = np.array([[1.0, -1.0, 2.0]])
    out, _, _ = run_m2po(x, np.ones_like(x, bool), np.ones(1), 0.04)
    assert out.stats["m2_masked_frac"].tolist() == [[True, False, True]]
