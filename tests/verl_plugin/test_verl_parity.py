"""Parity through verl's path: each `trustclip_*` loss fetched from verl's registry gives the loss, gradient and
metrics of trustclip's own `compute_policy_loss`, and matches verl's losses of the same name where their
definitions agree; where they differ, the difference is pinned here (see docs/verl.md)."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch._dynamo.utils import counters  # dynamo's own count of the graphs it compiled
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss
from verl_testkit import (
    AGG_MODES,
    BATCH_INFOS,
    actor_config,
    assert_close,
    grad,
    make_inputs,
    reference_aggregation,
    trustclip_config,
)

from trustclip import compute_policy_loss, compute_token_loss, get_objective, ratio_bounds
from trustclip.integrations.verl.config import TrustclipPolicyLossConfig
from trustclip.objectives import RatioInterval
from trustclip.objectives.fused import clear_compiled

# objective -> hyper-parameters that make its mechanism bite on the test inputs (others: trustclip defaults)
OBJECTIVES = {
    "clip": {}, "clip_higher": {}, "dual_clip": {}, "dcpo": {"clip_ratio_c": 3.0}, "trgppo": {}, "kl1": {},
    "kl2": {}, "kl3": {}, "is_kl3": {}, "general": {"constraint": RatioInterval(0.75, 1.3)}, "sapo": {},
    "cispo": {}, "aspo": {}, "gspo": {}, "clip_cov": {"clip_cov_ratio": 0.1, "seed": 3}, "kl_cov": {},
    "unconstrained": {}, "atr_seq": {"delta": 0.01}, "dppo_tv": {"tis_cap": 1.5}, "dppo_kl": {}, "cfpo": {},
    "m2po": {},
}


def trustclip_via_verl(name: str, inputs, mode: str, info: dict, **kwargs):
    config = trustclip_config(f"trustclip_{name}", info, **kwargs)
    return get_policy_loss_fn(f"trustclip_{name}")(loss_agg_mode=mode, config=config, **inputs.args())


def test_every_runnable_objective_is_covered() -> None:
    from trustclip.objectives import REGISTRY

    # truly_ppo, atr_adaptive: see test_verl_config.py::test_losses_verl_cannot_feed_fail_clearly_at_call
    assert set(OBJECTIVES) == set(REGISTRY) - {"truly_ppo", "atr_adaptive"}


@pytest.mark.parametrize("info", BATCH_INFOS, ids=str)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_matches_compute_policy_loss(name: str, mode: str, info: str) -> None:
    inputs = make_inputs(seed=len(name), weights=info == "global")
    loss, metrics = trustclip_via_verl(name, inputs, mode, BATCH_INFOS[info], **OBJECTIVES[name])
    expected, expected_metrics = compute_policy_loss(
        get_objective(name, **OBJECTIVES[name]), logp=inputs.log_prob, old_logp=inputs.old_log_prob,
        advantages=inputs.advantages, mask=inputs.response_mask, token_weights=inputs.rollout_is_weights,
        **reference_aggregation(mode, BATCH_INFOS[info], inputs.log_prob.shape[1]),
    )
    assert_close(loss, expected)
    gradient = grad(loss, inputs)
    assert_close(gradient, grad(expected, inputs))
    assert gradient[~inputs.response_mask].eq(0).all() and gradient.abs().sum() > 0
    assert {k: metrics[f"actor/objective/{k}"] for k in expected_metrics} == expected_metrics
    assert metrics["actor/pg_clipfrac"] == expected_metrics["clip_frac"]
    assert all(isinstance(v, float) for v in metrics.values())


def test_fused_loss_is_the_eager_loss() -> None:
    """policy_loss.fused=True (one compiled graph, trustclip.objectives.fused): the same loss, gradient and metrics
    to float rounding, through verl's registry and aggregation."""
    clear_compiled()
    counters.clear()
    results = []
    for fused in (False, True):
        inputs = make_inputs(seed=5, weights=True)
        config = actor_config(TrustclipPolicyLossConfig(loss_mode="trustclip_dual_clip", fused=fused))
        loss, metrics = get_policy_loss_fn("trustclip_dual_clip")(loss_agg_mode="seq-mean-token-mean", config=config,
                                                                  **inputs.args())
        results.append((loss, grad(loss, inputs), metrics))
    (loss, gradient, metrics), (fused_loss, fused_gradient, fused_metrics) = results
    assert counters["stats"]["unique_graphs"] == 1  # the fused call was the compiled graph
    assert_close(fused_loss, loss)
    assert_close(fused_gradient, gradient)
    assert fused_metrics.keys() == metrics.keys() and metrics["actor/pg_clipfrac_lower"] > 0  # the dual clip acts
    assert fused_metrics == pytest.approx(metrics, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("alias, name", [("atr", "kl3"), ("atr_grpo", "kl3"), ("dapo", "clip_higher")])
def test_aliases_are_the_same_loss(alias: str, name: str) -> None:
    inputs = make_inputs(seed=1)
    loss, metrics = trustclip_via_verl(alias, inputs, "token-mean", {})
    expected, expected_metrics = trustclip_via_verl(name, inputs, "token-mean", {})
    assert loss.item() == expected.item() and metrics == expected_metrics


def test_rollout_is_weights_are_applied() -> None:
    plain, weighted = make_inputs(seed=2), make_inputs(seed=2, weights=True)
    loss, _ = trustclip_via_verl("kl3", weighted, "token-mean", {})
    loss_plain, _ = trustclip_via_verl("kl3", plain, "token-mean", {})
    assert not torch.isclose(loss, loss_plain)
    per_token, _ = trustclip_via_verl("kl3", weighted, "token-sum", {})
    weighted.rollout_is_weights = weighted.rollout_is_weights * 2
    assert_close(trustclip_via_verl("kl3", weighted, "token-sum", {})[0], 2 * per_token)


# --------------------------------------------------------------------------- against verl's own losses
def verl_loss(loss_mode: str, inputs, mode: str, info: dict, policy_loss: dict | None = None, **actor):
    config = actor_config(PolicyLossConfig(loss_mode=loss_mode, **(policy_loss or {})), info, **actor)
    return get_policy_loss_fn(loss_mode)(loss_agg_mode=mode, config=config, **inputs.args())


# atr_seq is verl's gspo with the sequence ratio's KL3 region as its clip range
ATR_SEQ_LOW, ATR_SEQ_HIGH = ratio_bounds("atr_seq", delta=0.01)
# (trustclip objective, its objective_kwargs, verl loss, verl actor knobs, verl policy_loss knobs)
SAME_LOSSES = {
    "vanilla": ("dual_clip", {"epsilon_low": 0.2, "epsilon_high": 0.28, "clip_ratio_c": 3.0}, "vanilla",
                {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}, {}),
    "gspo": ("gspo", {"epsilon_low": 3e-4, "epsilon_high": 4e-4}, "gspo",
             {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, {}),
    "atr_seq": ("atr_seq", {"delta": 0.01}, "gspo",
                {"clip_ratio_low": 1 - ATR_SEQ_LOW, "clip_ratio_high": ATR_SEQ_HIGH - 1}, {}),
    "sapo": ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, {}),
    "cispo": ("cispo", {"epsilon_low": 0.3, "epsilon_high": 0.2}, "cispo",
              {"clip_ratio_low": 0.3, "clip_ratio_high": 0.2}, {}),
    "clip_cov": ("clip_cov", {"epsilon_low": 0.2, "epsilon_high": 0.2, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.5,
                              "clip_cov_ub": 5.0, "seed": 11}, "clip_cov", {},
                 {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.5, "clip_cov_ub": 5.0}),
    "kl_cov": ("kl_cov", {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.7}, "kl_cov", {},
               {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.7}),
}
# metrics whose meaning agrees (the others are pinned in test_metric_meanings_that_differ)
SHARED_METRICS = {
    "vanilla": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "gspo": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "atr_seq": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "sapo": ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "cispo": ("actor/ppo_kl", "actor/pg_clipfrac_lower"),
    "clip_cov": ("actor/ppo_kl",),
    "kl_cov": (),
}


def run_pair(pair: str, inputs, mode: str, info: dict):
    name, kwargs, verl_name, actor, policy_loss = SAME_LOSSES[pair]
    if name == "clip_cov":
        torch.manual_seed(kwargs["seed"])  # verl draws from torch's global RNG, trustclip from its seed
    theirs = verl_loss(verl_name, inputs, mode, info, policy_loss, **actor)
    ours = trustclip_via_verl(name, inputs, mode, info, **kwargs)
    return ours, theirs


# verl's sapo ignores loss_agg_mode (always seq-mean-token-mean): pinned in test_sapo_aggregation_differs
PAIR_MODES = [(p, m) for p in SAME_LOSSES for m in AGG_MODES if p != "sapo" or m == "seq-mean-token-mean"]


@pytest.mark.parametrize("info", BATCH_INFOS, ids=str)
@pytest.mark.parametrize("pair, mode", PAIR_MODES)
def test_matches_verl_loss_of_the_same_name(pair: str, mode: str, info: str) -> None:
    inputs = make_inputs(seed=5, weights=info == "global")
    (loss, metrics), (verl, verl_metrics) = run_pair(pair, inputs, mode, BATCH_INFOS[info])
    assert_close(loss, verl)
    assert_close(grad(loss, inputs), grad(verl, inputs))
    for key in SHARED_METRICS[pair]:
        assert metrics[key] == pytest.approx(verl_metrics[key], rel=1e-6, abs=1e-9), key


def test_the_mechanisms_are_exercised() -> None:
    """Guard against vacuous parity: every compared mechanism acts on the test inputs."""
    inputs = make_inputs(seed=5)
    (_, vanilla), _ = run_pair("vanilla", inputs, "token-mean", {})
    (_, gspo), _ = run_pair("gspo", inputs, "token-mean", {})
    (_, atr_seq), _ = run_pair("atr_seq", inputs, "token-mean", {})
    (_, cov), _ = run_pair("clip_cov", inputs, "token-mean", {})
    (_, klcov), _ = run_pair("kl_cov", inputs, "token-mean", {})
    (_, cispo), _ = run_pair("cispo", inputs, "token-mean", {})
    assert vanilla["actor/pg_clipfrac_lower"] > 0 and vanilla["actor/objective/clip_frac_low"] > 0
    assert vanilla["actor/objective/clip_frac_high"] > 0 and gspo["actor/pg_clipfrac"] > 0
    assert 0 < atr_seq["actor/pg_clipfrac"] < gspo["actor/pg_clipfrac"]  # a wider region than GSPO's
    assert cov["actor/objective/cov_selected_frac"] > 0 and klcov["actor/objective/cov_selected_frac"] > 0
    assert cispo["actor/objective/capped_frac"] > 0


def test_verl_vanilla_always_dual_clips() -> None:
    """verl's `vanilla` is trustclip `dual_clip`, not `clip_higher`: they differ only on A < 0, w > c tokens."""
    inputs = make_inputs(seed=5)
    vanilla, _ = verl_loss("vanilla", inputs, "token-mean", {})
    assert_close(trustclip_via_verl("dual_clip", inputs, "token-mean", {})[0], vanilla)
    no_dual, _ = trustclip_via_verl("clip_higher", inputs, "token-mean", {}, epsilon_low=0.2, epsilon_high=0.2)
    assert not torch.isclose(no_dual, vanilla)
    assert_close(trustclip_via_verl("dual_clip", inputs, "token-mean", {}, clip_ratio_c=1e9)[0], no_dual)


def test_sapo_aggregation_differs() -> None:
    """verl's sapo always aggregates seq-mean-token-mean; trustclip_sapo honours actor.loss_agg_mode."""
    inputs = make_inputs(seed=6)
    verl_token, _ = verl_loss("sapo", inputs, "token-mean", {})
    verl_seq, _ = verl_loss("sapo", inputs, "seq-mean-token-mean", {})
    ours_token, _ = trustclip_via_verl("sapo", inputs, "token-mean", {})
    assert_close(verl_token, verl_seq)
    assert_close(trustclip_via_verl("sapo", inputs, "seq-mean-token-mean", {})[0], verl_seq)
    assert not torch.isclose(ours_token, verl_token)


@pytest.mark.parametrize("name, verl_name, actor, policy_loss", [
    ("gspo", "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, {}),
    ("cispo", "cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 0.2}, {}),
    ("clip_cov", "clip_cov", {"clip_ratio_low": 1.0, "clip_ratio_high": 1.0}, {}),
    ("kl_cov", "kl_cov", {}, {"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}),
    ("dual_clip", "vanilla", {}, {}),
])
def test_default_hyper_parameters(name: str, verl_name: str, actor: dict, policy_loss: dict) -> None:
    """trustclip defaults (the papers') equal verl's loss only with these verl settings; for all but
    vanilla they are not verl's defaults, so verl with its defaults gives another loss."""
    inputs = make_inputs(seed=7, batch=40, length=30)
    torch.manual_seed(0)
    ours, _ = trustclip_via_verl(name, inputs, "token-mean", {})
    torch.manual_seed(0)
    assert_close(ours, verl_loss(verl_name, inputs, "token-mean", {}, policy_loss, **actor)[0])
    torch.manual_seed(0)
    verl_defaults, _ = verl_loss(verl_name, inputs, "token-mean", {})
    assert torch.isclose(ours, verl_defaults) == (name == "dual_clip")


def test_metric_meanings_that_differ() -> None:
    """verl's clip_cov pg_clipfrac = covariance-detached fraction, its kl_cov ppo_kl = mean |log w|, its
    cispo pg_clipfrac = any capped weight; trustclip keeps one meaning for its verl metrics and logs
    verl's quantity under actor/objective/*."""
    inputs = make_inputs(seed=5)
    mask = inputs.response_mask
    metrics = {pair: run_pair(pair, inputs, "token-mean", {}) for pair in ("clip_cov", "kl_cov", "cispo")}
    (_, cov), (_, verl_cov) = metrics["clip_cov"]
    (_, klcov), (_, verl_klcov) = metrics["kl_cov"]
    (_, cispo), (_, verl_cispo) = metrics["cispo"]
    assert verl_cov["actor/pg_clipfrac"] == pytest.approx(cov["actor/objective/cov_selected_frac"])
    assert cov["actor/pg_clipfrac"] == cov["actor/objective/clip_frac"] != verl_cov["actor/pg_clipfrac"]
    abs_log_ratio = ((inputs.log_prob - inputs.old_log_prob).abs().detach() * mask).sum() / mask.sum()
    assert verl_klcov["actor/ppo_kl"] == pytest.approx(abs_log_ratio.item())
    assert klcov["actor/ppo_kl"] != pytest.approx(verl_klcov["actor/ppo_kl"])
    assert verl_cispo["actor/pg_clipfrac"] == pytest.approx(cispo["actor/objective/capped_frac"])
    assert cispo["actor/pg_clipfrac"] != pytest.approx(verl_cispo["actor/pg_clipfrac"])


@pytest.mark.parametrize("pair", ["gspo", "clip_cov", "kl_cov"])
def test_log_ratio_clamp_differs_only_beyond_20(pair: str) -> None:
    """trustclip clamps log w to +-20 everywhere; verl's gspo, clip_cov and kl_cov do not."""
    inputs = make_inputs(seed=8)
    (ours, _), (theirs, _) = run_pair(pair, inputs, "token-sum", {})
    assert_close(ours, theirs)
    with torch.no_grad():  # w = e^25 on one A < 0 token, so the unclipped branch (and the clamp) counts
        inputs.log_prob[3, 0], inputs.old_log_prob[3, 0], inputs.advantages[3, 0] = -0.01, -25.01, -1.0
    (ours, _), (theirs, _) = run_pair(pair, inputs, "token-sum", {})
    assert torch.isfinite(ours) and not torch.isclose(ours, theirs)


# --------------------------------------------------------------------------- DPPO against verl's dppo_tv / dppo_kl
# verl reads DPPO's thresholds from actor.clip_ratio_low / _high and its truncated-IS cap from actor.clip_ratio_c; it
# cannot switch the cap off, so trustclip's tis_cap=None (the paper's runs) is compared with the authors' c = 10000.
DPPO_DELTAS = {"tv": (0.1, 0.2), "kl": (0.03, 0.06)}  # (low, high): asymmetric, so each side is checked
NO_CAP = 1e4


def run_dppo(kind: str, inputs, mode: str, info: dict, cap: float | None):
    low, high = DPPO_DELTAS[kind]
    ours = trustclip_via_verl(f"dppo_{kind}", inputs, mode, info, delta_low=low, delta_high=high, tis_cap=cap)
    theirs = verl_loss(f"dppo_{kind}", inputs, mode, info, clip_ratio_low=low, clip_ratio_high=high,
                       clip_ratio_c=NO_CAP if cap is None else cap)
    return ours, theirs


def verl_dppo_value(kind: str, inputs, mode: str, info: dict, cap: float | None) -> torch.Tensor:
    """verl's loss value: -A sg(min(w, c)) log pi on the tokens trustclip keeps, aggregated by verl's agg_loss."""
    low, high = DPPO_DELTAS[kind]
    objective = get_objective(f"dppo_{kind}", delta_low=low, delta_high=high, tis_cap=cap)
    out, batch = compute_token_loss(objective, logp=inputs.log_prob, old_logp=inputs.old_log_prob,
                                    advantages=inputs.advantages, mask=inputs.response_mask)
    kept = ~(out.clipped_low | out.clipped_high)
    weight = batch.ratio.detach().clamp(max=NO_CAP if cap is None else cap)
    values = -inputs.advantages * weight * inputs.log_prob * kept
    if inputs.rollout_is_weights is not None:
        values = values * inputs.rollout_is_weights
    return agg_loss(loss_mat=values, loss_mask=inputs.response_mask, loss_agg_mode=mode, **info)


@pytest.mark.parametrize("info", BATCH_INFOS, ids=str)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("cap", [None, 1.5], ids=["no-tis", "tis"])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_matches_verl_gradient_and_clip_fraction_and_reports_the_surrogate(kind: str, cap, mode: str,
                                                                                 info: str) -> None:
    """Same gradient, clip fraction and ppo_kl as verl's dppo_<kind> in every loss_agg_mode; by design the loss value
    differs: trustclip reports the framework's surrogate min(w A, clip_general(w, C) A), verl -A sg(min(w, c)) log pi
    (the authors' code), a number with the same gradient that depends on log pi's scale. verl's truncated-IS fraction
    (its pg_clipfrac_lower) is trustclip's objective/tis_capped_frac; trustclip's pg_clipfrac_lower keeps its
    dual-clip meaning (0: DPPO has no dual clip)."""
    inputs = make_inputs(seed=21, weights=info == "global")
    (loss, metrics), (verl, verl_metrics) = run_dppo(kind, inputs, mode, BATCH_INFOS[info], cap)
    assert_close(grad(loss, inputs), grad(verl, inputs))
    for key in ("actor/pg_clipfrac", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(verl_metrics[key], rel=1e-6, abs=1e-9), key  # verl: float32 fractions
    assert metrics["actor/pg_clipfrac"] > 0  # the masks act on these inputs
    assert_close(verl, verl_dppo_value(kind, inputs, mode, BATCH_INFOS[info], cap))
    assert not torch.isclose(loss, verl)
    assert verl_metrics["actor/pg_clipfrac_lower"] == pytest.approx(metrics.get("actor/objective/tis_capped_frac", 0.0))
    assert metrics["actor/pg_clipfrac_lower"] == 0.0 and (cap is None or verl_metrics["actor/pg_clipfrac_lower"] > 0)


def test_dppo_default_hyper_parameters() -> None:
    """trustclip's defaults are the authors' run script's (TV 0.15, KL 0.05, no truncation); verl's defaults are
    another loss: thresholds clip_ratio_low/high = 0.2 and, through actor.clip_ratio_c (the dual-clip c, default 3.0),
    truncated IS at 3 (the 20.0 in verl's code is only the fallback of a config without that field)."""
    inputs = make_inputs(seed=22, batch=40, length=30)
    for kind, delta in (("tv", 0.15), ("kl", 0.05)):
        ours, _ = trustclip_via_verl(f"dppo_{kind}", inputs, "token-mean", {})
        script, _ = verl_loss(f"dppo_{kind}", inputs, "token-mean", {}, clip_ratio_low=delta, clip_ratio_high=delta,
                              clip_ratio_c=NO_CAP)
        ours_grad = grad(ours, inputs)
        assert_close(ours_grad, grad(script, inputs))
        verl_default, _ = verl_loss(f"dppo_{kind}", inputs, "token-mean", {})
        as_verl, _ = trustclip_via_verl(f"dppo_{kind}", inputs, "token-mean", {}, delta_low=0.2, delta_high=0.2,
                                        tis_cap=3.0)
        verl_default_grad = grad(verl_default, inputs)
        assert_close(grad(as_verl, inputs), verl_default_grad)
        assert not torch.allclose(ours_grad, verl_default_grad)


def test_dppo_clip_fraction_differs_on_zero_advantage_tokens() -> None:
    """verl applies its A < 0 test to A = 0 tokens, so one whose probability fell past delta counts in verl's
    pg_clipfrac; trustclip counts only tokens whose gradient the mask removed (an A = 0 token has none). Gradients
    agree."""
    inputs = make_inputs(seed=23)
    with torch.no_grad():
        inputs.advantages[3] = 0.0
        inputs.log_prob[3, 0], inputs.old_log_prob[3, 0] = -2.0, -0.1  # pi falls from 0.90 to 0.14
    (loss, metrics), (verl, verl_metrics) = run_dppo("tv", inputs, "token-sum", {}, None)
    assert_close(grad(loss, inputs), grad(verl, inputs))
    fell = (inputs.log_prob.exp() - inputs.old_log_prob.exp() < -DPPO_DELTAS["tv"][0]) & inputs.response_mask
    only_in_verl = (fell & (inputs.advantages == 0)).sum().item()
    valid = inputs.response_mask.sum().item()
    assert only_in_verl >= 1
    assert verl_metrics["actor/pg_clipfrac"] == pytest.approx(metrics["actor/pg_clipfrac"] + only_in_verl / valid)


def test_dppo_kl_smoothing_differs_near_probability_one() -> None:
    """verl computes the binary KL's second term as log((1 - q + 1e-8) / (1 - p + 1e-8)); trustclip's is exact
    (log(1 - p) through expm1). Where 1 - p is far below 1e-8 the smoothing shrinks the KL: q = 1 - 1e-6 rising to
    p = 1 - 1e-13 has KL 1.5e-5 (over delta = 1e-5: masked for A > 0) and verl's 3.6e-6 (kept)."""
    inputs = make_inputs(seed=24)
    with torch.no_grad():
        inputs.advantages[1] = 1.0
        inputs.old_log_prob[1, 0], inputs.log_prob[1, 0] = math.log1p(-1e-6), math.log1p(-1e-13)
    ours, _ = trustclip_via_verl("dppo_kl", inputs, "token-sum", {}, delta_low=1e-5, delta_high=1e-5)
    verl, _ = verl_loss("dppo_kl", inputs, "token-sum", {}, clip_ratio_low=1e-5, clip_ratio_high=1e-5,
                        clip_ratio_c=NO_CAP)
    ours_grad, verl_grad = grad(ours, inputs), grad(verl, inputs)
    assert ours_grad[1, 0] == 0 and verl_grad[1, 0] != 0
    ours_grad[1, 0] = verl_grad[1, 0] = 0
    assert_close(ours_grad, verl_grad)


# --------------------------------------------------------------------------- Dr.GRPO normaliser in verl 0.9.1
def test_seq_mean_token_sum_norm_is_dr_grpo_with_loss_scale_factor() -> None:
    """verl 0.9.1 divides by global_batch_size (older verl did not) and by loss_scale_factor, whose
    default is the padded width of the micro-batch: padding then changes the loss; a constant does not."""
    inputs = make_inputs(seed=9, length=12)
    info = {"dp_size": 1, "global_batch_size": 21, "loss_scale_factor": 1536}
    loss, _ = trustclip_via_verl("kl3", inputs, "seq-mean-token-sum-norm", info)
    token_sum, _ = trustclip_via_verl("kl3", inputs, "token-sum", {})
    assert_close(loss, token_sum / (21 * 1536))
    padded = make_inputs(seed=9, length=12)
    pad = torch.zeros(padded.log_prob.shape[0], 8, dtype=torch.float64)
    padded.log_prob = torch.cat([padded.log_prob.detach(), pad], 1).requires_grad_()
    padded.old_log_prob, padded.advantages = (torch.cat([x, pad], 1) for x in (padded.old_log_prob, padded.advantages))
    padded.response_mask = torch.cat([padded.response_mask, pad.bool()], 1)
    assert_close(trustclip_via_verl("kl3", padded, "seq-mean-token-sum-norm", info)[0], loss)
    default, _ = trustclip_via_verl("kl3", inputs, "seq-mean-token-sum-norm", {"global_batch_size": 21})
    default_padded, _ = trustclip_via_verl("kl3", padded, "seq-mean-token-sum-norm", {"global_batch_size": 21})
    assert_close(default, token_sum / (21 * 12))
    assert_close(default_padded, token_sum / (21 * 20))


# --------------------------------------------------------------------------- verl's real caller
def ppo_loss_inputs(inputs, dp_size: int, batch_num_tokens: int, global_batch_size: int):
    """verl's `ppo_loss` inputs for `inputs`: padded TensorDict + flat model log-probs (1-token prompts)."""
    batch, length = inputs.log_prob.shape
    lengths = inputs.response_mask.sum(-1)
    attention = torch.cat([torch.ones(batch, 1, dtype=torch.long), inputs.response_mask.long()], 1)
    flat = torch.cat([torch.cat([inputs.log_prob[i, : lengths[i]], inputs.log_prob.new_zeros(1)])
                      for i in range(batch)])  # model output of sequence i is left-shifted by one token
    data = TensorDict({"prompts": torch.ones(batch, 1, dtype=torch.long), "attention_mask": attention,
                       "responses": torch.ones(batch, length, dtype=torch.long),
                       "response_mask": inputs.response_mask, "old_log_probs": inputs.old_log_prob,
                       "advantages": inputs.advantages}, batch_size=[batch])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    return {"log_probs": flat}, data


def test_through_verls_ppo_loss() -> None:
    """verl's `ppo_loss` (the function its workers call) fills global_batch_info and calls our loss."""
    inputs = make_inputs(seed=10)
    model_output, data = ppo_loss_inputs(inputs, dp_size=2, batch_num_tokens=120, global_batch_size=16)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             policy_loss=TrustclipPolicyLossConfig(loss_mode="trustclip_kl3"))
    loss, metrics = ppo_loss(config, model_output, data)
    expected, expected_metrics = compute_policy_loss(
        "kl3", logp=inputs.log_prob, old_logp=inputs.old_log_prob, advantages=inputs.advantages,
        mask=inputs.response_mask, aggregation="token_mean", num_tokens=120, num_processes=2,
    )
    assert_close(loss, expected)
    assert_close(grad(loss, inputs), grad(expected, inputs))
    assert metrics["actor/objective/kl3_mean"].aggregate() == expected_metrics["kl3_mean"]
    vanilla = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                              policy_loss=PolicyLossConfig(loss_mode="vanilla"))
    dual = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           policy_loss=TrustclipPolicyLossConfig(loss_mode="trustclip_dual_clip"))
    assert_close(ppo_loss(dual, model_output, data)[0], ppo_loss(vanilla, model_output, data)[0])


# --------------------------------------------------------------------------- edge cases
def test_fully_masked_micro_batch_gives_zero_loss() -> None:
    inputs = make_inputs(seed=11)
    inputs.response_mask = torch.zeros_like(inputs.response_mask)
    loss, metrics = trustclip_via_verl("kl3", inputs, "token-mean", {})
    assert loss.item() == 0.0 and grad(loss, inputs).eq(0).all()
    assert metrics == {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}


def test_invalid_inputs_fail_with_trustclip_messages() -> None:
    inputs = make_inputs(seed=12)
    with torch.no_grad():
        inputs.log_prob[0, 0] = float("nan")
    with pytest.raises(ValueError, match="logp has 1 non-finite"):
        trustclip_via_verl("kl3", inputs, "token-mean", {})


def test_loss_without_global_batch_info_or_config() -> None:
    """config=None (verl's own losses assert on it) uses trustclip's defaults and the local token count."""
    inputs = make_inputs(seed=13)
    loss, _ = get_policy_loss_fn("trustclip_kl3")(loss_agg_mode="token-mean", config=None, **inputs.args())
    expected, _ = compute_policy_loss("kl3", logp=inputs.log_prob, old_logp=inputs.old_log_prob,
                                      advantages=inputs.advantages, mask=inputs.response_mask, aggregation="token_mean")
    assert_close(loss, expected)
