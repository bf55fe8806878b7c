"""Every objective against the float64 reference: loss value and autograd gradient = phi * A * mask / norm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference_objectives import DIVERGENCES, ratio_clip, reference, sequence_ratio, sublevel_interval, trgppo_interval

import trustclip as tc
from trustclip.objectives import REGISTRY, compute_token_loss, get_objective

# Objectives with a closed-form float64 reference (clip_cov is random and checked separately).
REFERENCED = ["unconstrained", "clip", "clip_higher", "dual_clip", "dcpo", "trgppo", "kl1", "kl2", "kl3", "is_kl3",
              "truly_ppo", "sapo", "cispo", "aspo", "gspo", "kl_cov", "atr_seq", "atr_adaptive", "dppo_tv", "dppo_kl",
              "cfpo", "m2po"]
SETTINGS = {  # non-default settings, so each code path is exercised
    "trgppo": [{"epsilon": None}, {"delta": 0.02}],
    "kl1": [{"two_sided": True}],
    "truly_ppo": [{"mode": "stop_gradient"}, {"delta": 0.01}],
    "cispo": [{"epsilon_low": 0.2}],
    "dcpo": [{"epsilon_low": 0.2, "epsilon_high": 0.28}],
    "dual_clip": [{"clip_ratio_c": 1.5}],
    "kl_cov": [{"kl_cov_ratio": 0.1}],
    "aspo": [{"clip_ratio_c": 1.6}],
    # atr_seq's default delta (GSPO's scale) clips nearly every sequence of these inputs; 0.01 / 0.001 clip some
    "atr_seq": [{"delta": 0.01}, {"delta": 0.001}],
    "atr_adaptive": [{"delta": 0.02, "target": "clip_frac", "target_value": 0.1}],
    "dppo_tv": [{"tis_cap": 1.5}, {"delta_low": 0.05, "delta_high": 0.3}],
    "dppo_kl": [{"tis_cap": 1.5}, {"delta_low": 0.01, "delta_high": 0.1}],
    "cfpo": [{"epsilon": 0.5}],
    # 10: the mean of (log w)^2 is below it at once, nothing masked; 1e-4: nearly every token masked
    "m2po": [{"m2_threshold": 0.01}, {"m2_threshold": 10.0}, {"m2_threshold": 1e-4}],
}


def random_inputs(seed: int, batch: int = 6, length: int = 9, spread: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3 - 0.01
    logp = (old + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)).clamp(max=-1e-6)
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    adv[0] = 0.0  # a zero-advantage response
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[1] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    entropy = torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    full_kl = torch.rand(batch, length, generator=gen, dtype=torch.float64) * 0.1
    return logp, old, adv, mask, entropy, full_kl


def test_registry_holds_every_method_of_the_brief():
    wanted = {"unconstrained", "clip", "clip_higher", "dual_clip", "dcpo", "clip_cov", "kl_cov", "sapo", "gspo",
              "cispo", "kl1", "kl2", "kl3", "is_kl3", "trgppo", "truly_ppo", "aspo", "general", "dppo_tv", "dppo_kl",
              "cfpo", "m2po"}
    assert wanted <= set(REGISTRY)
    assert get_objective("atr").name == "kl3"
    for spec in REGISTRY.values():
        assert "arXiv" in spec.source and spec.fn.__doc__, spec.name


CASES = [(name, {}) for name in REFERENCED] + [(n, s) for n, ss in SETTINGS.items() for s in ss]


@pytest.mark.parametrize("name,settings", CASES, ids=[f"{n}-{s}" for n, s in CASES])
@pytest.mark.parametrize("seed", range(4))
def test_value_and_gradient_match_float64_reference(name, settings, seed, device):
    logp, old, adv, mask, entropy, full_kl = (t.to(device) for t in random_inputs(seed))
    objective = get_objective(name, **settings)
    logp.requires_grad_(True)
    max_len = logp.shape[1]
    loss, _ = tc.compute_policy_loss(objective, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                     max_len=max_len, entropy=entropy, full_kl=full_kl)
    loss.backward()

    n = lambda t: t.detach().cpu().numpy()  # noqa: E731
    a = np.broadcast_to(n(adv)[:, None], n(logp).shape)
    value, phi, extra = reference(name, dict(objective.hparams), n(logp), n(old), a, n(mask), n(entropy), n(full_kl))
    m, norm = n(mask), logp.shape[0] * max_len
    np.testing.assert_allclose(loss.item(), -(value * m).sum() / norm, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(n(logp.grad), -(phi * a + extra) * m / norm, rtol=1e-9, atol=1e-12)


def test_truly_ppo_rollback_pushes_back_through_full_kl():
    logp, old, adv, mask, _, full_kl = random_inputs(7, spread=0.8)
    full_kl = (full_kl * 3).requires_grad_(True)
    obj = get_objective("truly_ppo", delta=0.05, rollback=2.0)
    out, batch = compute_token_loss(obj, logp=logp, old_logp=old, advantages=adv, mask=mask, full_kl=full_kl)
    out.loss.sum().backward()
    w, a = batch.ratio.detach(), batch.advantages
    triggered = (full_kl.detach() >= 0.05) & ((w - 1) * a > 0) & (mask > 0)
    assert triggered.any()
    torch.testing.assert_close(full_kl.grad, 2.0 * triggered.to(torch.float64))


def test_aspo_entropy_split_uses_per_response_quantile():
    logp, old, adv, mask, entropy, _ = random_inputs(3, length=12, spread=0.35)
    mask[:] = 1
    logp.requires_grad_(True)
    obj = get_objective("aspo", entropy_split=True)
    assert obj.requires == ("entropy",)
    out, batch = compute_token_loss(obj, logp=logp, old_logp=old, advantages=adv, mask=mask, entropy=entropy)
    out.loss.sum().backward()
    threshold = torch.quantile(entropy, 0.8, dim=-1, keepdim=True)
    eps = torch.where(entropy >= threshold, 0.4, 0.2).numpy()
    w, a = batch.ratio.detach().numpy(), batch.advantages.numpy()
    phi_pos = np.where(w > 1 + eps, 0, np.where(w < 1 / 3, 3, 1 / w))
    phi_neg = np.where(w < 1 - eps, 0, np.where(w > 3, 3, w))
    np.testing.assert_allclose(logp.grad.numpy(), -np.where(a > 0, phi_pos, phi_neg) * a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_clip_cov_detaches_random_high_covariance_tokens(seed):
    logp, old, adv, mask, _, _ = random_inputs(seed, batch=16, length=32, spread=0.3)
    adv = adv * 4
    logp.requires_grad_(True)
    obj = get_objective("clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=50.0, seed=seed,
                        epsilon_low=0.2, epsilon_high=0.2)
    out, batch = compute_token_loss(obj, logp=logp, old_logp=old, advantages=adv, mask=mask)
    out.loss.sum().backward()
    selected = out.stats["cov_selected_frac"].numpy()
    a, w, m = batch.advantages.numpy(), batch.ratio.detach().numpy(), mask.numpy() > 0
    _, phi = ratio_clip(w, a, 0.8, 1.2)
    ppo_clipped = (phi == 0) & (a != 0)
    cov = (a - a[m].mean()) * (logp.detach().numpy() - logp.detach().numpy()[m].mean())
    assert selected.sum() == min(max(int(0.05 * m.sum()), 1), ((cov > 0) & (cov < 50) & m & ~ppo_clipped).sum())
    assert not (selected & ~m).any() and not (selected & ppo_clipped).any()
    assert (cov[selected] > 0).all() and (cov[selected] < 50).all()
    np.testing.assert_allclose(logp.grad.numpy(), -np.where(selected, 0, phi) * a * m, rtol=1e-10, atol=1e-12)
    again, _ = compute_token_loss(obj, logp=logp, old_logp=old, advantages=adv, mask=mask)
    assert torch.equal(again.stats["cov_selected_frac"], out.stats["cov_selected_frac"])  # seeded


# ----------------------------------------------------------------------------- the paper's theorems
def _grad(objective, logp, old, adv, mask):
    logp = logp.clone().requires_grad_(True)
    loss, _ = tc.compute_policy_loss(objective, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                     aggregation="token_mean")
    loss.backward()
    return logp.grad


@pytest.mark.parametrize("seed", range(10))
def test_theorem_4_1_general_operator_with_ratio_constraint_is_ppo(seed):
    logp, old, adv, mask, _, _ = random_inputs(seed, spread=0.6)
    rng = np.random.default_rng(seed)
    eps_low, eps_high = rng.uniform(0.05, 0.6, size=2)
    general = get_objective("general", constraint=tc.RatioInterval(1 - eps_low, 1 + eps_high))
    ppo = get_objective("clip_higher", epsilon_low=eps_low, epsilon_high=eps_high)
    assert torch.equal(_grad(general, logp, old, adv, mask), _grad(ppo, logp, old, adv, mask))


def test_atr_equals_asymmetric_ratio_clipping_with_lambert_bounds_for_any_delta():
    for i, delta in enumerate(np.geomspace(1e-3, 1.0, 25)):
        low, high = tc.ratio_bounds("atr", delta=delta)
        kl3 = lambda w: w - 1 - math.log(w)  # noqa: E731
        assert kl3(low) == pytest.approx(delta, abs=1e-12) and kl3(high) == pytest.approx(delta, abs=1e-12)
        assert 0 < low < 1 < high and 1 - low < high - 1
        logp, old, adv, mask, _, _ = random_inputs(100 + i, spread=1.5 * math.sqrt(delta))
        atr = _grad(get_objective("atr", delta=delta), logp, old, adv, mask)
        boolean_kl3 = tc.DivergenceConstraint("kl3", lambda w: w - 1 - w.log(), delta)  # no interval: eq. 5 as is
        general = _grad(get_objective("general", constraint=boolean_kl3), logp, old, adv, mask)
        asym = _grad(get_objective("clip_higher", epsilon_low=1 - low, epsilon_high=high - 1), logp, old, adv, mask)
        assert torch.equal(atr, asym)
        torch.testing.assert_close(general, atr, rtol=0, atol=0)


def test_bounds_reproduce_reference_table():
    table = {  # delta: (KL3 l, u), (IS-KL3 l, u), (KL2 l, u) -- reference notes section 5
        0.01: ((0.8652, 1.1482), (0.8620, 1.1447), (0.8681, 1.1519)),
        0.05: ((0.7162, 1.3504), (0.7009, 1.3325), (0.7289, 1.3719)),
        0.07: ((0.6710, 1.4222), (0.6500, 1.3968), (0.6879, 1.4538)),
        0.20: ((0.4932, 1.7722), (0.4385, 1.6961), (0.5313, 1.8822)),
    }
    for delta, expected in table.items():
        for name, (low, high) in zip(("kl3", "is_kl3", "kl2"), expected, strict=True):
            got = tc.ratio_bounds(name, delta=delta)
            assert got == pytest.approx((low, high), abs=6e-5), (name, delta)
    assert tc.ratio_bounds("kl1") == (pytest.approx(math.exp(-0.07)), math.inf)
    assert tc.ratio_bounds("kl1", two_sided=True) == pytest.approx((math.exp(-0.07), math.exp(0.07)))


def test_q_dependent_bounds_match_reference_examples():
    dcpo = {0.9: (0.769, 1.187), 0.5: (0.5, 1.306), 0.1: (0.5, 2.0), 0.01: (0.5, 5.0)}
    for q, expected in dcpo.items():
        assert tc.ratio_bounds("dcpo", q=q) == pytest.approx(expected, abs=1e-3)
    trgppo = {0.9: (0.837, 1.085), 0.5: (0.639, 1.361), 0.1: (0.239, 2.469), 0.01: (0.0003, 9.87)}
    for q, expected in trgppo.items():
        got = tc.ratio_bounds("trgppo", q=q, epsilon=None)
        assert got == pytest.approx(expected, rel=2e-3, abs=1e-4)
        ref = trgppo_interval(np.array(q), 0.07, None)
        assert got == pytest.approx((float(ref[0]), float(ref[1])), rel=1e-9)
    low_fn, high_fn = tc.ratio_bounds("trgppo")
    assert (low_fn(0.9), high_fn(0.9)) == pytest.approx((0.8, 1.2))  # widened to [1-eps, 1+eps]


def test_generic_root_finder_matches_closed_forms_and_user_divergence_objective():
    from trustclip.objectives.bounds import divergence_bounds

    for name, fn in DIVERGENCES.items():
        if name == "kl1":
            continue
        assert divergence_bounds(fn, 0.07) == pytest.approx(tc.ratio_bounds(name, delta=0.07), rel=1e-10)
    # A user divergence (squared Hellinger-like, convex in w): its root-found interval drives clipping.
    hellinger = tc.custom_divergence(lambda w: (w.sqrt() - 1) ** 2, 0.05, name="hellinger")
    low, high = hellinger.bounds
    assert (math.sqrt(low) - 1) ** 2 == pytest.approx(0.05) and (math.sqrt(high) - 1) ** 2 == pytest.approx(0.05)
    logp, old, adv, mask, _, _ = random_inputs(5)
    user = _grad(get_objective("general", constraint=hellinger), logp, old, adv, mask)
    asym = _grad(get_objective("clip_higher", epsilon_low=1 - low, epsilon_high=high - 1), logp, old, adv, mask)
    torch.testing.assert_close(user, asym, rtol=0, atol=0)


def test_is_kl3_alternative_reading_is_not_an_interval():
    with pytest.raises(ValueError, match="no ratio interval"):
        tc.ratio_bounds("is_kl3", form="w_times_kl3")
    obj = get_objective("is_kl3", form="w_times_kl3")
    w = torch.tensor([[0.01, 0.3, 0.9, 1.2, 1.5]], dtype=torch.float64)
    logp = torch.log(w * 0.5).requires_grad_(True)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    out, _ = compute_token_loss(obj, logp=logp, old_logp=torch.full_like(w, math.log(0.5)), advantages=adv,
                                mask=torch.ones_like(w))
    out.loss.sum().backward()
    # w = 0.01 is feasible again (w (w-1-log w) ~ 0.036 < 0.07): it keeps its gradient; w = 0.3 does not.
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0


def test_policy_metrics_count_clipped_tokens():
    w = torch.tensor([[0.5, 0.9, 1.1, 1.6], [0.5, 0.9, 1.1, 1.6]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    old = torch.full_like(w, -1.0)
    _, metrics = tc.compute_policy_loss("clip", logp=old + w.log(), old_logp=old, advantages=adv,
                                        mask=torch.ones_like(w), aggregation="token_mean")
    assert metrics["clip_frac_high"] == pytest.approx(1 / 8)  # w = 1.6 with A > 0
    assert metrics["clip_frac_low"] == pytest.approx(1 / 8)  # w = 0.5 with A < 0
    assert metrics["ratio_max"] == pytest.approx(1.6) and metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["kl3_mean"] == pytest.approx(float((w - 1 - w.log()).mean()))


@pytest.mark.parametrize("delta", [1e-3, 0.02, 0.07, 0.3, 1.0, 5.0])
def test_trgppo_newton_solver_converges_over_the_whole_probability_range(delta):
    from reference_objectives import binary_kl

    from trustclip.objectives.bounds import trgppo_bounds

    q = np.concatenate([np.geomspace(1e-10, 0.5, 400), 1 - np.geomspace(1e-10, 0.5, 400)])
    low, high = trgppo_bounds(q, delta, None)
    converged = trgppo_bounds(q, delta, None, iterations=60)
    np.testing.assert_allclose(low, converged[0], rtol=1e-12, atol=0)
    np.testing.assert_allclose(high, converged[1], rtol=1e-12)
    assert (low < 1).all() and (high > 1).all() and (high <= 1 / q * (1 + 1e-12)).all()
    # Plug the roots back where the KL itself can be evaluated accurately (1 - r q is far from 0).
    ok = (q <= 0.5) & (low > 1e-200) & (high * q < 0.99)
    np.testing.assert_allclose(binary_kl(q[ok], low[ok]), delta, rtol=1e-9)
    np.testing.assert_allclose(binary_kl(q[ok], high[ok]), delta, rtol=1e-9)
    assert ok.sum() > 50 or delta > 1  # for large delta every upper root has r q near 1


# ----------------------------------------------------------------------------- beyond the paper: atr_seq, atr_adaptive
def _separated_sequences(seed: int, delta: float, margin: float = 1e-3):
    """float64 inputs whose sequence ratios all lie at least `margin` (relative) away from atr_seq's bounds, with
    some sequences inside and some outside, so that finite differences never cross a kink."""
    low, high = tc.ratio_bounds("atr_seq", delta=delta)
    for attempt in range(200):
        logp, old, adv, mask, _, _ = random_inputs(1000 * seed + attempt, batch=8, spread=0.4)
        seq = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
        near = [(seq / b - 1).abs().min() < margin for b in (low, high)]
        inside = (seq >= low) & (seq <= high)
        if not any(near) and inside.any() and (~inside & (adv != 0)).any():
            return logp, old, adv, mask
    raise AssertionError("no separated inputs found")


@pytest.mark.parametrize("seed", range(4))
def test_atr_seq_gradient_is_the_derived_sequence_level_gradient(seed):
    """J = (1/B) sum_i min(s_i A_i, clip(s_i, l, u) A_i) with s_i = exp(mean_t log w_it): the value of atr_seq with
    seq_mean_token_mean aggregation is -J, and its gradient is the derived
        dJ / dlogp_it = (1/B) A_i s_i / L_i * 1[l <= s_i <= u or (s_i - 1) A_i <= 0]    (float64, numpy)."""
    delta = 0.01
    logp, old, adv, mask = _separated_sequences(seed, delta)
    logp.requires_grad_(True)
    loss, _ = tc.compute_policy_loss(get_objective("atr_seq", delta=delta), logp=logp, old_logp=old, advantages=adv,
                                     mask=mask, aggregation="seq_mean_token_mean")
    loss.backward()
    n = lambda t: t.detach().numpy()  # noqa: E731
    m, a = n(mask), n(adv)[:, None]
    s = sequence_ratio(n(logp) - n(old), m)  # (B, 1)
    low, high = sublevel_interval(DIVERGENCES["kl3"], delta)
    j = np.minimum(s * a, np.clip(s, low, high) * a)
    keep = ((s >= low) & (s <= high)) | ((s - 1) * a <= 0)
    lengths = m.sum(-1, keepdims=True)
    batch = m.shape[0]
    np.testing.assert_allclose(loss.item(), -j.sum() / batch, rtol=1e-12)
    np.testing.assert_allclose(n(logp.grad), -(a * s / lengths * keep) * m / batch, rtol=1e-10, atol=1e-15)
    assert (~keep).any() and keep[a != 0].any()  # both branches are exercised


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "dr_grpo", "token_mean"])
def test_atr_seq_autograd_matches_finite_differences(aggregation):
    """With one advantage per sequence the GSPO-token form's gradient is the true gradient of its value."""
    logp, old, adv, mask = _separated_sequences(7, 0.01)
    objective = get_objective("atr_seq", delta=0.01)
    max_len = {"max_len": logp.shape[1]} if aggregation == "dr_grpo" else {}

    def loss_of(x):
        return tc.compute_policy_loss(objective, logp=x, old_logp=old, advantages=adv, mask=mask,
                                      aggregation=aggregation, **max_len)[0]

    assert torch.autograd.gradcheck(loss_of, (logp.clone().requires_grad_(True),), eps=1e-7, atol=1e-9, rtol=1e-6)


def test_atr_seq_token_advantages_gate_by_sequence_and_token_direction():
    """GSPO-token variant: per-token advantages A_it keep the sequence gate s_i outside [l, u], with each
    token's own direction test: phi_it = s_i * 1[l <= s_i <= u or (s_i - 1) A_it <= 0]."""
    logp, old, _, mask, _, _ = random_inputs(11, spread=0.4)
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(logp.shape, generator=gen, dtype=torch.float64)
    logp.requires_grad_(True)
    loss, _ = tc.compute_policy_loss(get_objective("atr_seq", delta=0.005), logp=logp, old_logp=old,
                                     advantages=adv, mask=mask, aggregation="token_mean")
    loss.backward()
    n = lambda t: t.detach().numpy()  # noqa: E731
    value, phi, _ = reference("atr_seq", {"delta": 0.005}, n(logp), n(old), n(adv), n(mask))
    m = n(mask)
    np.testing.assert_allclose(loss.item(), -(value * m).sum() / m.sum(), rtol=1e-10)
    np.testing.assert_allclose(n(logp.grad), -phi * n(adv) * m / m.sum(), rtol=1e-9, atol=1e-15)
    gated = (phi == 0) & (m > 0)
    kept_in_gated_sequence = (phi != 0) & (m > 0) & gated.any(-1, keepdims=True)
    assert gated.any() and kept_in_gated_sequence.any()  # one sequence, tokens on both sides of the gate


def test_atr_seq_is_gspo_with_the_kl3_region():
    """One machinery: atr_seq at delta is gspo with eps_low = 1 - l_delta, eps_high = u_delta - 1, exactly."""
    for seed, delta in enumerate([6e-8, 1e-4, 0.01]):
        logp, old, adv, mask, _, _ = random_inputs(40 + seed, spread=3 * math.sqrt(delta))
        low, high = tc.ratio_bounds("atr_seq", delta=delta)
        gspo = get_objective("gspo", epsilon_low=1 - low, epsilon_high=high - 1)
        assert torch.equal(_grad(get_objective("atr_seq", delta=delta), logp, old, adv, mask),
                           _grad(gspo, logp, old, adv, mask))


def test_atr_seq_default_delta_is_calibrated_to_gspos_range():
    """The default delta is the geometric mean of KL3 at GSPO's two bounds [1 - 3e-4, 1 + 4e-4]; its region lies
    between them and, at this scale, is symmetric to 4 delta / 3 (docs/beyond-the-paper.md)."""
    kl3 = lambda w: w - 1 - math.log(w)  # noqa: E731
    delta = get_objective("atr_seq").hparams["delta"]
    assert delta == pytest.approx(math.sqrt(kl3(1 - 3e-4) * kl3(1 + 4e-4)), rel=1e-3)
    low, high = tc.ratio_bounds("atr_seq")
    assert kl3(low) == pytest.approx(delta, rel=1e-6) and kl3(high) == pytest.approx(delta, rel=1e-6)
    assert 1 - 4e-4 < low < 1 - 3e-4 and 1 + 3e-4 < high < 1 + 4e-4
    assert (high - 1) - (1 - low) == pytest.approx(4 * delta / 3, rel=1e-3)


def test_atr_adaptive_at_a_fixed_delta_is_atr():
    for seed, delta in enumerate([0.005, 0.07, 0.3]):
        logp, old, adv, mask, _, _ = random_inputs(60 + seed, spread=1.5 * math.sqrt(delta))
        adaptive = get_objective("atr_adaptive", delta=delta)
        assert torch.equal(_grad(adaptive, logp, old, adv, mask), _grad(get_objective("atr", delta=delta), logp, old,
                                                                          adv, mask))
        assert tc.ratio_bounds(adaptive) == tc.ratio_bounds("atr", delta=delta)



# Each case its own delta, one no other test uses: the memo of the bounds starts without it.
ESTIMATOR_CASES = [("kl1", 0.0111), ("kl2", 0.0112), ("kl3", 0.0113), ("is_kl3", 0.0114), ("atr_adaptive", 0.0115),
                   ("atr_seq", 0.0116)]


@pytest.mark.parametrize("name,delta", ESTIMATOR_CASES)
def test_divergence_bounds_are_solved_once_per_objective(name, delta, monkeypatch):
    """The Lambert-W / closed-form bounds of an estimator constraint are computed once per (estimator, delta), not on
    every forward."""
    from trustclip.objectives import bounds as B

    solver = {"kl1": "kl1_bounds", "kl2": "kl2_bounds", "is_kl3": "is_kl3_bounds"}.get(name, "kl3_bounds")
    calls = []
    original = getattr(B, solver)
    monkeypatch.setattr(B, solver, lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs))
    objective = get_objective(name, delta=delta)
    logp, old, adv, mask, _, _ = random_inputs(0)
    losses = [tc.compute_policy_loss(objective, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                     aggregation="token_mean")[0]
              for _ in range(3)]
    assert len(calls) == 1, calls
    assert losses[0].item() == losses[2].item()
