"""Bad input gets a clear error naming the problem; aggregation, advantages and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

import trustclip as tc
from trustclip.cli import main as cli_main
from trustclip.objectives import aggregate, compute_advantages, get_objective


def inputs(batch=2, length=3):
    logp = torch.full((batch, length), -1.0, requires_grad=True)
    return {"logp": logp, "old_logp": torch.full((batch, length), -1.1), "advantages": torch.ones(batch),
            "mask": torch.ones(batch, length)}


def loss_of(objective="kl3", **changes):
    kwargs = inputs() | changes
    if kwargs.get("aggregation", "dr_grpo") == "dr_grpo":
        kwargs.setdefault("max_len", 3)  # dr_grpo's constant L_max
    return tc.compute_policy_loss(objective, **kwargs)


@pytest.mark.parametrize("field,value,message", [
    ("logp", torch.tensor([[-1.0, float("nan"), -1.0], [-1.0] * 3]), r"logp has 1 non-finite value.*\(0, 1\)"),
    ("old_logp", torch.tensor([[-1.0] * 3, [-1.0, -1.0, float("-inf")]]), r"old_logp has 1 non-finite.*\(1, 2\)"),
    ("advantages", torch.tensor([1.0, float("inf")]), "advantages has 3 non-finite"),
    ("logp", torch.zeros(2, 4), r"mask has shape \(2, 3\), expected \(2, 4\)"),
    ("old_logp", torch.zeros(2, 2), r"old_logp has shape \(2, 2\), expected \(2, 3\)"),
    ("advantages", torch.ones(3), r"advantages has shape \(3,\), expected \(2,\) or \(2, 3\)"),
    ("mask", torch.zeros(2, 3), "mask is empty"),
    ("mask", torch.full((2, 3), 0.5), "only 0 and 1"),
    ("logp", torch.full((2, 3), 2.5), "log-probabilities .* found 2.5.*logits"),
    ("logp", torch.zeros(6), r"logp must be a \(B, T\) tensor"),
])
def test_bad_tensors_raise_clear_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        loss_of(**{field: value})


def test_nan_on_padding_is_ignored_but_nan_on_a_token_is_not():
    logp = torch.tensor([[-1.0, float("nan")], [-1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    loss, _ = tc.compute_policy_loss("kl3", logp=logp, old_logp=torch.full((2, 2), -1.2), advantages=torch.ones(2),
                                     mask=mask, aggregation="token_mean")
    loss.backward()
    assert torch.isfinite(loss) and logp.grad[0, 1] == 0
    with pytest.raises(ValueError, match="non-finite"):
        tc.compute_policy_loss("kl3", logp=logp, old_logp=torch.full((2, 2), -1.2), advantages=torch.ones(2),
                               mask=torch.ones(2, 2), aggregation="token_mean")


@pytest.mark.parametrize("name,hparams,message", [
    ("kl3", {"delta": 0}, r"kl3: delta=0 is invalid; it must be > 0"),
    ("kl3", {"delta": -0.1}, "delta=-0.1 is invalid"),
    ("atr", {"delta": float("nan")}, "delta=nan is invalid"),
    ("clip", {"epsilon": -0.1}, r"epsilon=-0.1 is invalid; it must be >= 0.0 and <= 1.0"),
    ("clip_higher", {"epsilon_high": -1}, "epsilon_high=-1 is invalid"),
    ("dual_clip", {"clip_ratio_c": 1.0}, r"clip_ratio_c=1.0 is invalid; it must be > 1.0"),
    ("sapo", {"tau_pos": 0}, "tau_pos=0 is invalid"),
    ("clip", {"delta": 0.1}, r"unknown hyper-parameter\(s\) \['delta'\] for objective 'clip'; valid: epsilon"),
    ("kl1", {"two_sided": "yes"}, "two_sided='yes' is invalid; it must be one of"),
    ("is_kl3", {"delta": 1.5}, "is_kl3 needs delta < 1"),
    ("general", {}, "constraint=None is invalid; it must be a trustclip Constraint"),
    ("atr_seq", {"delta": 0}, r"atr_seq: delta=0 is invalid; it must be > 0"),
    ("dppo_tv", {"delta_low": 0}, r"dppo_tv: delta_low=0 is invalid; it must be > 0.0"),
    ("dppo_kl", {"tis_cap": 0.5}, r"dppo_kl: tis_cap=0.5 is invalid; it must be >= 1.0 \(or None\)"),
    ("cfpo", {"epsilon": -0.2}, r"cfpo: epsilon=-0.2 is invalid; it must be > 0.0"),
    ("m2po", {"m2_threshold": float("inf")}, r"m2po: m2_threshold=inf is invalid"),
    ("atr_adaptive", {"delta_min": 0.2, "delta_max": 0.1}, r"delta range \[delta_min=0.2, delta_max=0.1\] is empty"),
    ("atr_adaptive", {"delta_min": 0.1, "delta_max": 0.1}, r"delta range .* is empty; it needs delta_min < delta_max"),
    ("atr_adaptive", {"delta": 0.9}, r"initial delta=0.9 is outside the delta range \[0.005, 0.5\]"),
    ("atr_adaptive", {"delta": 0.001}, r"initial delta=0.001 is outside"),
    ("atr_adaptive", {"target": "clip_frac", "target_value": 1.5}, r"target_value=1.5 is outside the range of "
                                                                    r"target='clip_frac'.*\(0, 1\)"),
    ("atr_adaptive", {"target_value": 0.5}, r"target_value=0.5 is outside the range of target='kl3_mean'.*"
                                            r"\(0, delta_max=0.5\)"),
    ("atr_adaptive", {"target_value": 0}, r"target_value=0 is invalid; it must be > 0.0"),
    ("atr_adaptive", {"target_value": -0.01}, r"target_value=-0.01 is invalid"),
    ("atr_adaptive", {"target": "entropy"}, r"target='entropy' is invalid; it must be one of \('kl3_mean', "
                                            r"'clip_frac'\)"),
    ("atr_adaptive", {"tolerance": 1.0}, r"tolerance=1.0 is invalid; it must be > 1.0"),
    ("atr_adaptive", {"factor": 0.5}, r"factor=0.5 is invalid; it must be > 1.0"),
    ("atr_adaptive", {"delta_min": -1}, r"delta_min=-1 is invalid; it must be > 0.0"),
    ("atr_adaptive", {"delta_max": float("inf")}, r"delta_max=inf is invalid"),
])
def test_bad_hyper_parameters_name_the_value(name, hparams, message):
    with pytest.raises(ValueError, match=message):
        get_objective(name, **hparams)


def test_unknown_objective_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown objective 'ppo2'; valid names: .*atr.*clip.*kl3"):
        get_objective("ppo2")


def test_missing_and_unknown_extras():
    with pytest.raises(ValueError, match=r"'truly_ppo' needs the extra input\(s\) \['full_kl'\]"):
        loss_of("truly_ppo")
    with pytest.raises(ValueError, match=r"'aspo' needs the extra input\(s\) \['entropy'\]"):
        loss_of(get_objective("aspo", entropy_split=True))
    with pytest.raises(ValueError, match=r"unknown extra input\(s\) \['entropies'\]"):
        loss_of(entropies=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"extra input 'full_kl' has shape \(3,\)"):
        loss_of("truly_ppo", full_kl=torch.zeros(3))


def test_bad_aggregation_and_normalisers():
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; valid: token_mean"):
        loss_of(aggregation="mean")
    with pytest.raises(ValueError, match="max_len=2 is shorter than the longest response in the batch"):
        loss_of(max_len=2)
    with pytest.raises(ValueError, match="num_tokens must be a finite number > 0"):
        loss_of(aggregation="token_mean", num_tokens=0)


def test_aggregations_against_hand_computation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(18 / 5)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 5) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx((3 + 15) / 2)
    assert aggregate(loss, mask, "dr_grpo", max_len=10).item() == pytest.approx(18 / (2 * 10))
    assert aggregate(loss, mask, "dr_grpo").item() == pytest.approx(18 / (2 * 3))  # longest response


def test_advantage_estimators():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    dr = compute_advantages(rewards, 4, "dr_grpo")
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    grpo = compute_advantages(rewards, 4, "grpo")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(grpo[:4], dr[:4] / (std + 1e-6))
    assert (grpo[4:] == 0).all()  # a group whose rewards agree carries no signal
    rloo = compute_advantages(rewards, 4, "rloo")
    loo = torch.stack([rewards[i] - torch.cat([rewards[(i // 4) * 4:i], rewards[i + 1:(i // 4 + 1) * 4]]).mean()
                       for i in range(8)])
    torch.testing.assert_close(rloo, loo)
    torch.testing.assert_close(compute_advantages(rewards, 1, "grpo"), rewards)
    with pytest.raises(ValueError, match="group_size=3 must be a positive int dividing the batch"):
        compute_advantages(rewards, 3)
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        compute_advantages(rewards, 4, "gae")
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_cli_objectives_json_lists_every_objective(capsys):
    assert cli_main(["objectives", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {r["name"] for r in rows}
    assert {"kl3", "clip", "dcpo", "truly_ppo", "aspo", "dppo_tv", "dppo_kl", "cfpo", "m2po"} <= names
    kl3 = next(r for r in rows if r["name"] == "kl3")
    assert kl3["defaults"] == {"delta": 0.07} and "atr" in kl3["aliases"] and "2602.05494" in kl3["source"]
    assert next(r for r in rows if r["name"] == "truly_ppo")["requires"] == ["full_kl"]


def test_cli_bounds(capsys):
    assert cli_main(["bounds", "--objective", "atr", "--delta", "0.07", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["bounds"]
    assert (row["low"], row["high"]) == pytest.approx((0.6710, 1.4222), abs=5e-5)
    assert cli_main(["bounds", "--objective", "trgppo", "--q", "0.5", "--q", "0.01", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["bounds"]
    assert [r["q"] for r in rows] == [0.5, 0.01] and rows[1]["high"] > 9
    assert cli_main(["bounds", "--objective", "kl1"]) == 0
    assert "[0.9324, inf]" in capsys.readouterr().out
    assert cli_main(["bounds", "--objective", "sapo"]) == 2
    assert "has no ratio interval" in capsys.readouterr().err
    assert cli_main(["bounds", "--objective", "kl3", "--delta", "-1"]) == 2
    assert "delta=-1.0 is invalid" in capsys.readouterr().err
    assert math.isfinite(tc.ratio_bounds("clip")[1])


def test_the_one_transfer_validation_builds_the_batch_of_the_token_by_token_path():
    """make_batch checks a usual batch from a few reductions read back at once, and anything unusual on the
    token-by-token path (which names the bad value); both must build the same batch, values and gradients."""
    from trustclip.objectives.batch import _checked_batch, _fast_batch

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    logp = (old + 0.3 * torch.randn(4, 6, generator=g)).clamp(max=0).requires_grad_(True)
    mask = torch.arange(6)[None] < torch.tensor([[6], [2], [4], [1]])
    args = (logp, old, torch.randn(4, 1, generator=g), mask, {"entropy": torch.rand(4, 6, generator=g)}, ["entropy"])
    fast, checked = _fast_batch(*args), _checked_batch(*args)
    assert fast is not None
    for field in ("logp", "old_logp", "advantages", "mask", "log_ratio", "ratio"):
        assert torch.equal(getattr(fast, field), getattr(checked, field)), field
    assert torch.equal(fast.extras["entropy"], checked.extras["entropy"])
    weights = torch.rand(4, 6, generator=g)
    grads = [torch.autograd.grad((b.ratio * b.logp * weights).sum(), logp)[0] for b in (fast, checked)]
    assert torch.equal(*grads) and (grads[0][~mask] == 0).all()
    # what the one-transfer check leaves to the token-by-token path
    junk = logp.detach().masked_fill(~mask, float("nan"))
    assert _fast_batch(junk, *args[1:]) is None  # NaN on padding: neutralised there, never multiplied by 0
    assert _fast_batch(logp, old - 25.0, *args[2:]) is None  # |log w| beyond the clamp
    assert _fast_batch(logp, old, args[2], mask.float() * 0.5, *args[4:]) is None  # not a 0/1 mask
    assert _fast_batch(*args[:4], {"entropy": -args[4]["entropy"]}, ["entropy"]) is None  # a negative entropy


@pytest.mark.parametrize("field", ["old_logp", "advantages", "mask", "token_weights"])
def test_an_input_on_another_device_is_named(field, device):
    """torch's own "Expected all tensors to be on the same device" names no argument. With a GPU: log-probs on it, one
    input on the CPU; on the CPU, the meta device (no data, so nothing is computed) stands for the other device."""
    other = "meta" if device == "cpu" else "cpu"
    values = {k: v.to(device) for k, v in (inputs() | {"token_weights": torch.ones(2, 3)}).items()}
    values[field] = values[field].to(other)
    with pytest.raises(ValueError, match=f"{field} is on device {other}, logp on {device}"):
        tc.compute_policy_loss("kl3", aggregation="token_mean", **values)


def test_dr_grpo_without_its_constant_length_is_refused():
    """Dividing by the batch's longest response is not Dr.GRPO's constant L_max: the default asks for max_len."""
    with pytest.raises(ValueError, match=r"aggregation='dr_grpo' divides by a constant L_max: pass max_len"):
        tc.compute_policy_loss("kl3", **inputs())
    short = inputs() | {"mask": torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])}
    loss, _ = tc.compute_policy_loss("kl3", **short, max_len=3)
    per_token = tc.compute_token_loss("kl3", **short)[0].loss
    torch.testing.assert_close(loss, per_token.sum() / (2 * 3))  # / (2 sequences x L_max 3), not x the longest (2)


@pytest.mark.parametrize("aggregation,unused", [
    ("dr_grpo", {"num_tokens": 6}), ("token_mean", {"num_sequences": 2}), ("token_mean", {"max_len": 3}),
    ("seq_mean_token_mean", {"max_len": 3}), ("seq_mean_token_sum", {"num_tokens": 6}),
])
def test_a_normaliser_the_aggregation_does_not_use_is_refused(aggregation, unused):
    needed = {"max_len": 3} if aggregation == "dr_grpo" else {}
    (name, value), = unused.items()
    with pytest.raises(ValueError, match=f"{name}={value} is .*aggregation='{aggregation}' does not use it"):
        tc.compute_policy_loss("kl3", **inputs(), aggregation=aggregation, **needed, **unused)


def test_low_precision_log_probs_are_computed_in_float32(device):
    """bfloat16 log-probs: the ratio, the clip decisions and the loss are those of float32 (64 x 256 tokens, a ratio
    spread across the clip bounds); the gradient still reaches the bfloat16 tensor."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 256, generator=g) * 3 - 0.05
    logp = (old + 0.15 * torch.randn(64, 256, generator=g)).clamp(max=0.0).to(device, torch.bfloat16)
    logp.requires_grad_(True)
    batch = {"old_logp": old.to(device, torch.bfloat16), "advantages": torch.randn(64, generator=g).to(device),
             "mask": torch.ones(64, 256, device=device), "aggregation": "token_mean"}
    low, low_metrics = tc.compute_policy_loss("clip", logp=logp, **batch)
    high, high_metrics = tc.compute_policy_loss("clip", logp=logp.detach().float(), **batch)
    assert low.dtype == torch.float32 and low.item() == high.item()
    assert low_metrics["clip_frac"] == high_metrics["clip_frac"] > 0
    low.backward()
    assert logp.grad.dtype == torch.bfloat16 and logp.grad.abs().sum() > 0
