"""TrustClipGRPOTrainer: every objective trains, TRL's built-in losses are reproduced exactly, and gradient
accumulation gives the one-big-batch gradient. Tiny offline model, a few steps each."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

pytest.importorskip("trl")

from trustclip import compute_policy_loss, get_objective, list_objectives, ratio_bounds  # noqa: E402
from trustclip.integrations.trl.compat import checkpointing_off  # noqa: E402
from trustclip.objectives.constraints import custom_divergence  # noqa: E402

PROMPTS = [f"Compute {a}+{b}. Answer in \\boxed{{}}.\n" for a, b in [(3, 4), (12, 7), (5, 9), (21, 30)]]


def digit_reward(completions, **kwargs):
    """A dense reward (fraction of digits) so every group has variance and every step has a gradient."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trustclip.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


def make_config(tmp_path, **overrides):
    from trustclip.integrations.trl import TrustClipGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=5e-3, num_iterations=2, use_cpu=True, bf16=False,
        **checkpointing_off(), report_to="none", logging_steps=1,
        save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    return TrustClipGRPOConfig(**(kwargs | overrides))


def make_trainer(tiny, tmp_path, reward=digit_reward, objective_object=None, **overrides):
    from datasets import Dataset

    from trustclip.integrations.trl import TrustClipGRPOTrainer

    model, tokenizer = tiny
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    return TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=reward, args=make_config(tmp_path, **overrides),
                                train_dataset=dataset, processing_class=tokenizer, objective=objective_object)


# Tight bounds so that the second update of each batch (num_iterations=2) certainly clips something.
TIGHT = {
    "clip": {"epsilon": 0.01}, "clip_higher": {"epsilon_low": 0.01, "epsilon_high": 0.015},
    "dual_clip": {"epsilon_low": 0.01, "epsilon_high": 0.01, "clip_ratio_c": 1.02},
    "dcpo": {"epsilon_low": 1e-5, "epsilon_high": 1e-5}, "trgppo": {"delta": 1e-6, "epsilon": None},
    "kl1": {"delta": 1e-4}, "kl2": {"delta": 1e-5}, "kl3": {"delta": 1e-5}, "is_kl3": {"delta": 1e-5},
    "truly_ppo": {"delta": 1e-7}, "cispo": {"epsilon_low": 0.01, "epsilon_high": 0.01},
    "aspo": {"epsilon_low": 0.01, "epsilon_high": 0.01}, "gspo": {"epsilon_low": 1e-5, "epsilon_high": 1e-5},
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -100.0, "clip_cov_ub": 100.0, "seed": 0},
    "kl_cov": {"kl_cov_ratio": 0.2},
    "atr_seq": {"delta": 1e-10}, "atr_adaptive": {"delta": 1e-5, "delta_min": 1e-6},
    "dppo_tv": {"delta_low": 1e-7, "delta_high": 1e-7}, "dppo_kl": {"delta_low": 1e-10, "delta_high": 1e-10},
    "cfpo": {"epsilon": 1e-4}, "m2po": {"m2_threshold": 1e-9},
}
# soft gate / penalty only: clip fractions must stay exactly 0, and the statistic that shows the mechanism acting
NO_HARD_CLIP = {"sapo": "gate_weight_mean", "kl_cov": "cov_selected_frac", "cfpo": "pushback_frac"}
OBJECTIVES = [row["name"] for row in list_objectives() if row["name"] != "general"]


@pytest.mark.parametrize("name", OBJECTIVES + ["general"])
def test_every_objective_trains(tiny, tmp_path, name):
    if name == "general":  # a user constraint object goes to the trainer directly
        constraint = custom_divergence(lambda w: (w - 1) ** 2, 1e-5, name="squared")
        trainer = make_trainer(tiny, tmp_path, objective="general",
                               objective_object=get_objective("general", constraint=constraint))
    else:
        trainer = make_trainer(tiny, tmp_path, objective=name, objective_kwargs=TIGHT.get(name, {}))
    assert trainer.objective.name == name
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert all(math.isfinite(h["loss"]) for h in logs)
    changed = sum(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert changed > 0, "no parameter moved"
    first, second = logs
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "objective/clip_frac", "objective/ratio_max",
                "objective/kl3_mean", "entropy", "policy_loss"):
        assert key in first and key in second, key
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"):
        assert key in first, key  # logged when the batch is generated
    assert first["objective/ratio_max"] == pytest.approx(1.0, abs=1e-5)  # first update: on-policy
    assert second["objective/kl3_mean"] > 0  # second update of the same batch: off-policy
    if name == "unconstrained":  # the control: the ratio moves (offpolicy_frac) and nothing is ever clipped
        assert second["objective/clip_frac"] == 0.0
        assert second["objective/offpolicy_frac"] > 0
    elif name in NO_HARD_CLIP:
        assert second["objective/clip_frac"] == 0.0
        assert 0 < second[f"objective/{NO_HARD_CLIP[name]}"] < 1
    else:
        assert second["objective/clip_frac"] > 0, f"{name} clipped nothing off-policy"


def test_on_policy_configuration_warns(tiny, tmp_path):
    with pytest.warns(UserWarning, match="identically 1"):
        make_trainer(tiny, tmp_path, num_iterations=1)


def test_bad_configuration_names_the_value(tmp_path):
    with pytest.raises(ValueError, match="delta=-1"):
        make_config(tmp_path, objective="kl3", objective_kwargs={"delta": -1})
    with pytest.raises(ValueError, match="aggregation='mean'"):
        make_config(tmp_path, aggregation="mean")
    with pytest.raises(ValueError, match="unknown objective 'atr2'"):
        make_config(tmp_path, objective="atr2")
    with pytest.raises(ValueError, match="steps_per_generation=3 x num_iterations=1"):
        make_config(tmp_path, skip_zero_advantage=True, steps_per_generation=3, gradient_accumulation_steps=2,
                    num_iterations=1)


def test_truncated_completions_get_the_truncated_reward(tiny, tmp_path):
    """A completion cut without EOS scores `truncated_reward` whatever its text; finished ones keep their score."""
    tokenizer = tiny[1]
    eos = tokenizer.eos_token_id
    ids = [[5, 6, eos], [5, 6, 7], [eos], [7, 8, 9]]  # finished, cut, finished (empty answer), cut
    for value, expected in ((0.0, [1.0, 0.0, 1.0, 0.0]), (-0.5, [1.0, -0.5, 1.0, -0.5]), (None, [1.0] * 4)):
        trainer = make_trainer(tiny, tmp_path / str(value), reward=lambda completions, **_: [1.0] * len(completions),
                               truncated_reward=value)
        trainer.model.train()
        rewards = trainer._calculate_rewards([{"prompt": "p"}] * 4, ["p"] * 4, ["x"] * 4, ids)
        assert rewards[:, 0].tolist() == expected
    with pytest.raises(ValueError, match="truncated_reward=nan"):
        make_config(tmp_path, truncated_reward=float("nan"))


# ------------------------------------------------------------------ equivalence with TRL's built-in losses
def _batch(tokenizer, seed=0, b=8, t=6):
    """A fixed batch with a perturbed old policy (so ratios differ from 1), ragged lengths, mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt = tokenizer(PROMPTS[:2] * (b // 2), return_tensors="pt", padding=True, add_special_tokens=False)
    completion_ids = torch.randint(5, 60, (b, t), generator=g)
    lengths = torch.tensor([t, 2, 5, t, 1, 4, t, 3])[:b]
    completion_mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return {
        "prompt_ids": prompt["input_ids"], "prompt_mask": prompt["attention_mask"],
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=g), "num_items_in_batch": completion_mask.sum(),
    }


def _with_old_logps(trainer, inputs, seed=1, scale=0.3):
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1))
    g = torch.Generator().manual_seed(seed)
    noise = scale * torch.randn(logps.shape, generator=g)
    return {**inputs, "old_per_token_logps": (logps + noise).clamp(max=0.0)}


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def assert_same_loss_and_grads(ours, theirs, inputs):
    """Our trainer's loss and parameter gradients equal TRL's on the same inputs; returns our loss."""
    loss_ours, grads_ours = _loss_and_grads(ours, inputs)
    loss_trl, grads_trl = _loss_and_grads(theirs, inputs)
    torch.testing.assert_close(loss_ours, loss_trl, rtol=1e-5, atol=1e-7)
    assert len(grads_ours) == len(grads_trl) > 0
    for a, b in zip(grads_ours, grads_trl, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    return loss_ours


def _trl_trainer(tiny, tmp_path, **config):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = tiny
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, use_cpu=True, bf16=False, report_to="none",
                      **checkpointing_off(), **config)
    return GRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward, args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))


L3, U3 = ratio_bounds("kl3", delta=0.07)
TRL_MATCHES = {  # name: (our objective, kwargs, aggregation, TRL config)
    "dapo": ("clip_higher", {"epsilon_low": 0.2, "epsilon_high": 0.28}, "token_mean",
             {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}),
    "dr_grpo": ("clip", {"epsilon": 0.2}, "dr_grpo", {"loss_type": "dr_grpo", "epsilon": 0.2}),
    "grpo": ("clip", {"epsilon": 0.2}, "seq_mean_token_mean", {"loss_type": "grpo", "epsilon": 0.2}),
    "sapo": ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq_mean_token_mean",
             {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}),
    "cispo": ("cispo", {"epsilon_low": None, "epsilon_high": 4.0}, "token_mean",
              {"loss_type": "cispo", "epsilon_high": 5.0}),
    "dapo+delta": ("dual_clip", {"epsilon_low": 0.2, "epsilon_high": 0.2, "clip_ratio_c": 1.3}, "token_mean",
                   {"loss_type": "dapo", "epsilon": 0.2, "delta": 1.3}),
    "gspo": ("gspo", {"epsilon_low": 0.05, "epsilon_high": 0.05}, "seq_mean_token_mean",
             {"loss_type": "grpo", "epsilon": 0.05, "importance_sampling_level": "sequence"}),
    "kl3=asymmetric dapo": ("kl3", {"delta": 0.07}, "token_mean",
                            {"loss_type": "dapo", "epsilon": 1 - L3, "epsilon_high": U3 - 1}),
}


@pytest.mark.parametrize("case", list(TRL_MATCHES))
def test_matches_trl_builtin_loss(tiny, tmp_path, case):
    objective, kwargs, aggregation, trl_config = TRL_MATCHES[case]
    ours = make_trainer(tiny, tmp_path / "ours", objective=objective, objective_kwargs=kwargs,
                        aggregation=aggregation, max_completion_length=6)
    theirs = _trl_trainer(tiny, tmp_path, **trl_config)
    inputs = _with_old_logps(theirs, _batch(tiny[1]))
    assert_same_loss_and_grads(ours, theirs, inputs)
    if case in ("dapo", "dr_grpo", "grpo", "kl3=asymmetric dapo"):  # same clip statistics, same names
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert ours._metrics["train"][key] == pytest.approx(theirs._metrics["train"][key])
        assert ours._metrics["train"]["objective/clip_frac"][0] > 0  # the batch does clip


@pytest.mark.parametrize("case", [c for c in TRL_MATCHES if c not in ("gspo", "kl3=asymmetric dapo")])
def test_trl_loss_options_are_honoured_as_trl_computes_them(tiny, tmp_path, case):
    """TRL's own loss options given to TrustClipGRPOConfig (no objective) train exactly TRL's loss: same loss and
    gradient as TRL's GRPOTrainer with the same options, not the default kl3."""
    objective, kwargs, aggregation, trl_config = TRL_MATCHES[case]
    ours = make_trainer(tiny, tmp_path / "ours", max_completion_length=6, **trl_config)
    assert (ours.objective.name, ours.aggregation) == (objective, aggregation)
    assert dict(ours.objective.hparams) == dict(get_objective(objective, **kwargs).hparams)
    theirs = _trl_trainer(tiny, tmp_path, **trl_config)
    assert_same_loss_and_grads(ours, theirs, _with_old_logps(theirs, _batch(tiny[1])))


@pytest.mark.parametrize(("options", "message"), [
    ({"loss_type": "bnpo"}, "loss_type='bnpo' normalises by the tokens of each micro-batch"),
    ({"loss_type": "nonsense"}, "loss_type='nonsense' is not a TRL loss type"),
    ({"loss_type": "vespo"}, "no objective computing TRL's vespo loss"),
    ({"objective": "clip", "loss_type": "cispo", "epsilon": 0.9}, "TRL's cispo caps the ratio w at epsilon_high"),
    ({"objective": "clip", "loss_type": "cispo", "epsilon_high": 5.0}, "not objective='clip'"),
    ({"objective": "kl3", "epsilon": 0.3}, "which are objective 'clip' {'epsilon': 0.3} in trustclip, not "
                                           "objective='kl3'"),
    ({"objective": "clip", "epsilon": 0.3, "objective_kwargs": {"epsilon": 0.2}}, "set epsilon to two values"),
    ({"delta": 1.1}, "dual_clip only for delta >= 1 + epsilon_high"),
    ({"loss_type": "sapo", "epsilon": 0.3}, "loss_type='sapo' does not use epsilon"),
    ({"scale_rewards": "batch"}, "scale_rewards='batch': trustclip has no advantage estimator"),
    ({"scale_rewards": "group", "advantage_estimator": "rloo"}, "scale_rewards='group' is advantage_estimator='grpo'"),
    ({"loss_type": "dapo", "aggregation": "dr_grpo"}, "loss_type='dapo' is aggregation='token_mean'"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5 is invalid: must be in [0, 1]"),
    ({"top_entropy_quantile": -0.1}, "top_entropy_quantile=-0.1 is invalid"),
    ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold=-1.0 is invalid"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min=0.5 is above entropy_coef_max=0.1"),
])
def test_trl_loss_options_without_a_trustclip_equivalent_are_refused(tmp_path, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(tmp_path, **options)


@pytest.mark.parametrize(("options", "message"), [
    ({"vespo_k_pos": 2.0}, "TRL's loss_type='dapo', TRL's default, does not use vespo_k_pos (only "
                           "loss_type='vespo' does)"),
    ({"loss_type": "grpo", "sapo_temperature_neg": 2.0}, "does not use sapo_temperature_neg (only loss_type='sapo'"),
])
def test_an_option_of_another_trl_loss_type_is_refused_naming_that_loss_type(tmp_path, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(tmp_path, **options)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_a_temperature_that_cannot_sample_is_refused_with_the_config(tmp_path, temperature):
    """TRL accepts temperature=0 and fails at the first generation; the config refuses it."""
    with pytest.raises(ValueError, match=re.escape(f"temperature={temperature!r} is invalid: must be a finite number "
                                                   "> 0")):
        make_config(tmp_path, temperature=temperature)


def test_trl_options_map_onto_the_named_objective(tmp_path):
    config = make_config(tmp_path, objective="clip", epsilon=0.3)  # the same objective: its epsilon, honoured
    assert (config.objective, config.objective_kwargs) == ("clip", {"epsilon": 0.3})
    config = make_config(tmp_path, epsilon=0.9, epsilon_high=5.0, scale_rewards="group")
    assert (config.objective, config.objective_kwargs, config.advantage_estimator, config.scale_rewards) == (
        "clip_higher", {"epsilon_low": 0.9, "epsilon_high": 5.0}, "grpo", "group")
    config = make_config(tmp_path)  # nothing of TRL's given: trustclip's defaults
    assert (config.objective, config.aggregation, config.advantage_estimator) == ("kl3", "dr_grpo", "dr_grpo")


def test_trl_loss_options_beside_every_trustclip_setting_are_refused_naming_them(tmp_path):
    """With objective, aggregation and advantage_estimator all given (as a trustclip train recipe gives them), TRL's
    loss options could only spell them again: refused, as trustclip train refuses them, naming the settings."""
    given = dict(objective="clip", aggregation="dr_grpo", advantage_estimator="dr_grpo")
    with pytest.raises(ValueError, match=re.escape("epsilon=0.3 are TRL's loss options, which the trustclip objective "
                                                   "replaces; set objective='clip', objective_kwargs={'epsilon': 0.3} "
                                                   "instead")):
        make_config(tmp_path, **given, epsilon=0.3)
    with pytest.raises(ValueError, match=re.escape("loss_type='bnpo' normalises by the tokens of each micro-batch")):
        make_config(tmp_path, **given, loss_type="bnpo")
    assert make_config(tmp_path, objective="clip", aggregation="dr_grpo", epsilon=0.3).objective_kwargs == {
        "epsilon": 0.3}  # a setting left unset: TRL's options fill it


def test_the_config_resolves_its_objective_once_and_pickles_without_it(tmp_path):
    """The trainer trains the Objective its config resolved when it was built; the Trainer pickles its args with
    every checkpoint, without that Objective, and a loaded copy resolves the same one."""
    import pickle

    config = make_config(tmp_path, objective="kl3", objective_kwargs={"delta": 0.1})
    assert config.build_objective() is config.build_objective()
    loaded = pickle.loads(pickle.dumps(config))
    assert "_resolved" not in vars(loaded) and loaded.build_objective() == config.build_objective()
    assert dict(config.build_objective("atr").hparams) == {"delta": 0.1}  # another name, the same kwargs


def test_translate_refuses_a_key_that_is_no_trl_loss_option():
    from trustclip.integrations.trl.loss_options import translate

    with pytest.raises(ValueError, match=re.escape("not TRL loss options: ['loss_typ']")):
        translate({"loss_typ": "bnpo"})


def test_star_import_of_the_trainers_gives_the_lazy_names():
    namespace: dict = {}
    exec("from trustclip.integrations.trl import *", namespace)  # noqa: S102 - the public names a star import gives
    assert {"TrustClipGRPOConfig", "TrustClipGRPOTrainer", "on_policy_warning"} <= namespace.keys()


def test_a_plain_grpo_config_trains_with_trustclips_defaults(tiny, tmp_path):
    """The documented path TrustClipGRPOTrainer(model, args=GRPOConfig(...), objective=...) trains (it crashed at the
    first step), with trustclip's own fields at their defaults and TRL's loss_type / scale_rewards as TRL means them
    (its defaults: token_mean, grpo); its checks run when the trainer is built."""
    from datasets import Dataset
    from trl import GRPOConfig

    from trustclip.integrations.trl import TrustClipGRPOTrainer

    model, tokenizer = tiny
    common = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, num_iterations=2, use_cpu=True, bf16=False, report_to="none",
                  **checkpointing_off(), save_strategy="no", disable_tqdm=True,
                  logging_steps=1)
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    trainer = TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward, args=GRPOConfig(**common),
                                   train_dataset=dataset, processing_class=tokenizer, objective="clip")
    assert (trainer.objective.name, trainer.aggregation, trainer.advantage_estimator) == ("clip", "token_mean", "grpo")
    assert trainer.args.truncated_reward is None and trainer.args.scale_rewards == "group"
    trainer.train()
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for bad, message in (({"importance_sampling_level": "sequence"}, "importance_sampling_level='sequence'"),
                         ({"epsilon": 0.3}, "not objective='kl3'"), ({"loss_type": "bnpo"}, "loss_type='bnpo'")):
        with pytest.raises(ValueError, match=message):
            TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward, args=GRPOConfig(**common | bad),
                                 train_dataset=dataset, processing_class=tokenizer, objective="kl3")
    with_epsilon = TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward,
                                        args=GRPOConfig(**common | {"epsilon": 0.3}), train_dataset=dataset,
                                        processing_class=tokenizer, objective="clip")
    assert dict(with_epsilon.objective.hparams) == {"epsilon": 0.3}  # a changed TRL option is honoured


# Each TRL setting -> the trustclip settings it decides, whichever config class carries it.
TRL_SETTINGS = [
    ({"scale_rewards": "group"}, {"advantage_estimator": "grpo"}),
    ({"scale_rewards": "none"}, {"advantage_estimator": "dr_grpo"}),
    ({"loss_type": "dapo"}, {"aggregation": "token_mean"}),
    ({"loss_type": "grpo"}, {"aggregation": "seq_mean_token_mean"}),
    ({"loss_type": "dr_grpo", "scale_rewards": "group"}, {"aggregation": "dr_grpo", "advantage_estimator": "grpo"}),
]


@pytest.mark.parametrize(("settings", "decided"), TRL_SETTINGS)
def test_explicit_trl_settings_mean_the_same_in_either_config_class(tmp_path, settings, decided):
    """GRPOConfig(scale_rewards='group') trained unscaled Dr.GRPO advantages and GRPOConfig(loss_type='dapo') the
    dr_grpo normaliser (a value equal to TRL's default was read as not given); TrustClipGRPOConfig refused the
    latter with objective='atr'. Both now mean what TRL means, next to the objective that replaces TRL's clip."""
    from trl import GRPOConfig

    from trustclip.integrations.trl import TrustClipGRPOConfig

    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True, bf16=False)
    plain = TrustClipGRPOConfig.from_grpo_config(GRPOConfig(**common, **settings), objective="atr")
    ours = TrustClipGRPOConfig(**common, objective="atr", **settings)
    for config in (plain, ours):
        assert config.objective == "atr" and {k: getattr(config, k) for k in decided} == decided


def test_a_plain_grpo_config_and_a_trustclip_config_train_alike(tiny, tmp_path):
    """The same TRL settings through either config class: the same objective, normaliser, advantage estimator and
    reward scaling, and the same loss and gradient on a batch; the start says what they became."""
    import logging

    from datasets import Dataset
    from trl import GRPOConfig

    from trustclip.integrations.trl import TrustClipGRPOTrainer

    model, tokenizer = tiny
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                  num_iterations=2, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                  **checkpointing_off(), loss_type="grpo", scale_rewards="group")
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    logger = logging.getLogger("trustclip.integrations.trl.trainer")
    with _records(logger) as records:
        plain = TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward, args=GRPOConfig(**common),
                                     train_dataset=dataset, processing_class=tokenizer, objective="atr")
    ours = make_trainer(tiny, tmp_path / "ours", objective="atr", **common)
    for trainer in (plain, ours):
        assert (trainer.objective.name, trainer.aggregation, trainer.advantage_estimator, trainer.args.scale_rewards
                ) == ("kl3", "seq_mean_token_mean", "grpo", "group")
    inputs = _with_old_logps(plain, _batch(tokenizer))
    assert_same_loss_and_grads(plain, ours, inputs)
    (line,) = [r for r in records if r.getMessage().startswith("trustclip trains")]
    assert line.levelno == logging.WARNING and "\n" not in line.getMessage()
    assert "aggregation='seq_mean_token_mean' (from TRL's loss_type='grpo')" in line.getMessage()
    assert "advantage_estimator='grpo' (from TRL's scale_rewards='group')" in line.getMessage()


def test_the_start_says_when_trustclips_defaults_replace_trls(tiny, tmp_path):
    """A TRL user's script switched to TrustClipGRPOConfig(objective='atr') trains Dr.GRPO, not TRL's token-mean loss
    on std-scaled advantages: the one start-up line says so."""
    import logging

    logger = logging.getLogger("trustclip.integrations.trl.trainer")
    with _records(logger) as records:
        make_trainer(tiny, tmp_path, objective="atr")
    (line,) = [r.getMessage() for r in records if r.getMessage().startswith("trustclip trains")]
    assert "objective='kl3' {'delta': 0.07} (given)" in line
    assert "aggregation='dr_grpo' (trustclip's default, not TRL's default loss_type='dapo' (token_mean))" in line
    assert "advantage_estimator='dr_grpo' (trustclip's default, not TRL's default scale_rewards='group'" in line


class _records:
    """Every record `logger` emits inside the block (at any level)."""

    def __init__(self, logger):
        import logging

        self.logger, self.records = logger, []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(1)
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def test_a_trl_loss_type_keeps_its_normaliser_under_another_objective(tmp_path):
    """loss_type='grpo' with objective='atr': the objective replaces TRL's clip, loss_type keeps GRPO's per-sequence
    normaliser; with TRL's clip parameters too, the refusal names the aggregation that keeps it."""
    config = make_config(tmp_path, objective="atr", loss_type="grpo")
    assert (config.objective, config.aggregation) == ("atr", "seq_mean_token_mean")
    with pytest.raises(ValueError, match=re.escape("set aggregation='seq_mean_token_mean' (loss_type's normaliser) "
                                                   "and objective_kwargs instead of them")):
        make_config(tmp_path, objective="atr", loss_type="grpo", epsilon=0.3)


def test_truncated_reward_replaces_the_weighted_total_and_keeps_each_functions_scores(tiny, tmp_path):
    """Two reward functions weighted [1, 0.5]: a truncated completion's total reward is truncated_reward (not
    truncated_reward x 1.5), and each function's logged mean is what it returned."""
    def first(completions, **kwargs):
        return [1.0] * len(completions)

    def second(completions, **kwargs):
        return [0.25] * len(completions)

    trainer = make_trainer(tiny, tmp_path, reward=[first, second], reward_weights=[1.0, 0.5], truncated_reward=-1.0,
                           max_steps=1, max_completion_length=4)
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "reward" in h)
    cut = logged["completions/clipped_ratio"]
    assert cut > 0  # 4 new tokens from an untrained model: most completions are cut
    assert logged["reward"] == pytest.approx(-1.0 * cut + (1.0 + 0.5 * 0.25) * (1 - cut), abs=1e-6)
    assert logged["rewards/first/mean"] == pytest.approx(1.0) and logged["rewards/second/mean"] == pytest.approx(0.25)
    assert logged["rewards/first/std"] == pytest.approx(0.0, abs=1e-7)
    assert list(trainer._logs["rewards"]["second"]) == pytest.approx([0.25] * len(trainer._logs["rewards"]["second"]))
    with pytest.raises(ValueError, match="multi_objective_aggregation='normalize_then_sum' does not form"):
        make_config(tmp_path, truncated_reward=0.0, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match=re.escape("reward_weights=[0.0, 0.0] make 0 whatever the scores")):
        make_config(tmp_path, truncated_reward=0.0, reward_weights=[0.0, 0.0])


@pytest.mark.parametrize("case", ["dapo", "grpo", "kl3=asymmetric dapo"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_per_sequence_clip_extremes_are_logged_as_trl_logs_them(tiny, tmp_path, case, mode):
    """TRL's clip_ratio/low_min and clip_ratio/high_max (dashboards built on TRL's names keep working), with TRL's
    values on the same batch, in training and in evaluation."""
    objective, kwargs, aggregation, trl_config = TRL_MATCHES[case]
    ours = make_trainer(tiny, tmp_path / "ours", objective=objective, objective_kwargs=kwargs,
                        aggregation=aggregation, max_completion_length=6)
    theirs = _trl_trainer(tiny, tmp_path, **trl_config)
    inputs = _with_old_logps(theirs, _batch(tiny[1]))
    for trainer in (ours, theirs):
        trainer.model.train(mode == "train")
        trainer.current_gradient_accumulation_steps = 1
        with torch.no_grad():
            trainer.compute_loss(trainer.model, inputs)
    for key in ("clip_ratio/low_min", "clip_ratio/high_max"):
        assert ours._metrics[mode][key] == pytest.approx(theirs._metrics[mode][key]), key
    assert ours._metrics[mode]["clip_ratio/high_max"][0] > 0  # some sequence is clipped on this batch


# ------------------------------------------------------------------ faithful normalisation
@pytest.mark.parametrize("aggregation", ["dr_grpo", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gradient_accumulation_equals_one_big_batch(tiny, tmp_path, aggregation):
    """ga=2 micro-batches of 4 (summed by the Trainer) == one batch of 8 == compute_policy_loss on all 8."""
    full = make_trainer(tiny, tmp_path / "full", objective="kl3", objective_kwargs={"delta": 0.02},
                        aggregation=aggregation, max_completion_length=6)
    accum = make_trainer(tiny, tmp_path / "accum", objective="kl3", objective_kwargs={"delta": 0.02},
                         aggregation=aggregation, max_completion_length=6, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, num_generations=4)
    inputs = _with_old_logps(full, _batch(tiny[1]))
    loss_full, grads_full = _loss_and_grads(full, inputs)

    halves = [{k: (v[i * 4:(i + 1) * 4] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in inputs.items()}
              for i in range(2)]
    accum.count_slices(halves)
    accum.model.train()
    accum.model.zero_grad()
    accum.current_gradient_accumulation_steps = 2
    total = 0.0
    for step, half in enumerate(halves):
        accum._step = step
        loss = accum.compute_loss(accum.model, half)
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, loss_full, rtol=1e-5, atol=1e-7)
    grads_accum = [p.grad for p in accum.model.parameters() if p.grad is not None]
    for a, b in zip(grads_accum, grads_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)

    # and both equal the pure objective on the whole batch (no trainer denominators)
    model = full.model
    model.zero_grad()
    logps, _, _ = full._get_per_token_logps_and_entropies(
        model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1))
    ref, _ = compute_policy_loss(get_objective("kl3", delta=0.02), logp=logps, old_logp=inputs["old_per_token_logps"],
                                 advantages=inputs["advantages"], mask=inputs["completion_mask"],
                                 aggregation=aggregation,
                                 **({"max_len": 6} if aggregation == "dr_grpo" else {}))
    torch.testing.assert_close(ref.detach(), loss_full, rtol=1e-5, atol=1e-7)


def test_empty_micro_batch_gives_zero_loss(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, objective="kl3")
    inputs = _batch(tiny[1])
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    loss, grads = _loss_and_grads(trainer, inputs)
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_rloo_scales_advantages(tiny, tmp_path, monkeypatch):
    from trl import GRPOTrainer

    trainer = make_trainer(tiny, tmp_path, advantage_estimator="rloo")
    assert trainer.args.scale_rewards == "none"
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions",
                        lambda self, inputs: {"advantages": torch.tensor([1.0, -1.0, 3.0, -3.0])})
    out = trainer._generate_and_score_completions([])
    torch.testing.assert_close(out["advantages"], torch.tensor([1.0, -1.0, 3.0, -3.0]) * 4 / 3)


# ------------------------------------------------------------------ skip_zero_advantage (DAPO's filter)
ZERO_ROWS = [1, 4, 6]  # rows of `_batch` whose advantage is set to exactly 0


def _batch_with_zero_advantages(tokenizer):
    inputs = _batch(tokenizer)
    inputs["advantages"][ZERO_ROWS] = 0.0
    return inputs


@pytest.mark.parametrize("aggregation", ["dr_grpo", "token_mean", "seq_mean_token_mean"])
def test_skip_zero_advantage_keeps_the_update_direction(tiny, tmp_path, aggregation):
    """Dropping the zero-advantage rows changes the gradient only by the normaliser: kept rows instead of all."""
    kwargs = dict(objective="kl3", objective_kwargs={"delta": 0.02}, aggregation=aggregation, max_completion_length=6)
    full = make_trainer(tiny, tmp_path / "full", **kwargs)
    skip = make_trainer(tiny, tmp_path / "skip", skip_zero_advantage=True, **kwargs)
    inputs = _with_old_logps(full, _batch_with_zero_advantages(tiny[1]))
    full.count_slices([inputs])
    full._step = 0
    loss_full, grads_full = _loss_and_grads(full, inputs)

    kept = skip.drop_zero_advantage(inputs)
    keep = [i for i in range(8) if i not in ZERO_ROWS]
    assert torch.equal(kept["completion_ids"], inputs["completion_ids"][keep])
    assert torch.equal(kept["old_per_token_logps"], inputs["old_per_token_logps"][keep])
    assert kept["num_items_in_batch"].item() == inputs["completion_mask"][keep].sum().item()
    assert skip._metrics["train"]["update/kept_frac"] == [5 / 8]
    skip.count_slices([kept])
    skip._step = 0
    loss_kept, grads_kept = _loss_and_grads(skip, kept)

    mask = inputs["completion_mask"]
    scale = mask.sum() / mask[keep].sum() if aggregation == "token_mean" else torch.tensor(8 / 5)
    torch.testing.assert_close(loss_kept, loss_full * scale, rtol=1e-5, atol=1e-7)
    assert len(grads_kept) == len(grads_full) > 0
    for a, b in zip(grads_kept, grads_full, strict=True):
        torch.testing.assert_close(a, b * scale, rtol=1e-4, atol=1e-7)


def test_skip_zero_advantage_fills_whole_slices(tiny, tmp_path):
    """With steps_per_generation = 2 the kept rows are topped up with zero-advantage rows to an even count."""
    trainer = make_trainer(tiny, tmp_path, skip_zero_advantage=True, per_device_train_batch_size=4,
                           steps_per_generation=2)
    advantages = torch.tensor([0.0, 0.5, 0.0, 0.0, -0.5, 0.0, 1.0, 0.0])
    output = {"advantages": advantages, "completion_ids": torch.arange(8)[:, None].repeat(1, 3),
              "completion_mask": torch.ones(8, 3, dtype=torch.long), "texts": [f"t{i}" for i in range(8)],
              "num_items_in_batch": torch.tensor(24)}
    kept = trainer.drop_zero_advantage(output)
    assert kept["completion_ids"][:, 0].tolist() == [0, 1, 4, 6]  # 3 informative rows + the first filler, in order
    assert kept["texts"] == ["t0", "t1", "t4", "t6"]
    assert kept["num_items_in_batch"].item() == 12
    none_informative = trainer.drop_zero_advantage({**output, "advantages": torch.zeros(8)})
    assert none_informative["completion_ids"][:, 0].tolist() == [0, 1]  # one row per slice
    with pytest.raises(ValueError, match="multimodal"):
        trainer.drop_zero_advantage({**output, "pixel_values": torch.zeros(8, 3)})


def _same_rows(rows, whole, values):
    """`values` of `whole`'s rows, in the order of `rows`: each row found by its prompt and completion ids (equal
    sequences have equal log-probs, so repeated ones may match any copy)."""
    def key(batch, i):
        return (tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist()))

    index = {key(whole, i): i for i in range(whole["completion_ids"].size(0))}
    return values[[index[key(rows, i)] for i in range(rows["completion_ids"].size(0))]]


def _record_scoring(trainer):
    """(rows, rows per forward) of every no-gradient log-prob forward the trainer runs (scoring, not the loss)."""
    rows_scored = []
    forward = trainer._get_per_token_logps_and_entropies

    def recording_forward(model, input_ids, *args, **kwargs):
        if not torch.is_grad_enabled() and not trainer._defer_old_logps:
            rows_scored.append((input_ids.size(0), kwargs.get("batch_size")))
        return forward(model, input_ids, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = recording_forward
    return rows_scored


def _whole_batch_logps(trainer, whole):
    """The old log-probs TRL's own forward gives a whole generation batch (no deferral)."""
    with torch.no_grad():
        return trainer._completion_logps(trainer.model, whole, batch_size=whole["completion_ids"].size(0))[0]


@pytest.mark.parametrize(("beta", "steps_per_generation"), [(0.0, 1), (0.1, 1), (0.0, 2)])
def test_skip_zero_advantage_scores_old_logps_on_kept_rows(tiny, tmp_path, beta, steps_per_generation):
    """Old log-probs are computed after the drop, for the kept rows only (beta = 0; with a reference model TRL's
    forward over the whole batch stays), one forward per slice, and equal the whole-batch forward's rows."""
    def reward(completions, prompts, **kwargs):  # only the 3+4 group can have non-zero advantages
        return [digit_reward([c])[0] if "3+4" in p else 1.0 for c, p in zip(completions, prompts, strict=True)]

    spg = steps_per_generation
    trainer = make_trainer(tiny, tmp_path, reward=reward, skip_zero_advantage=True, beta=beta, seed=1,
                           per_device_train_batch_size=8 // spg, steps_per_generation=spg)
    rows_scored = _record_scoring(trainer)
    before_drop = []
    drop = trainer.drop_zero_advantage
    trainer.drop_zero_advantage = lambda output: drop(before_drop.append(output) or output)
    trainer.model.train()
    trainer._prepare_inputs([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    slices = trainer._buffered_inputs
    kept = sum(piece["completion_ids"].size(0) for piece in slices)
    assert 0 < kept < 8, "the test needs a batch with dropped rows"
    # beta > 0: old and reference log-probs over the whole batch, as TRL computes them
    assert rows_scored == ([(kept // spg, kept // spg)] * spg if beta == 0 else [(8, 8 // spg)] * 2)
    (whole,) = before_drop
    whole_batch_logps = _whole_batch_logps(trainer, whole)  # the forward TRL runs without the deferral: all 8 rows
    for piece in slices:
        informative = piece["advantages"].nonzero().flatten()  # spg = 2 may add a zero-advantage filler
        assert torch.isfinite(piece["old_per_token_logps"]).all()
        torch.testing.assert_close(piece["old_per_token_logps"][informative],
                                   _same_rows(piece, whole, whole_batch_logps)[informative], rtol=1e-5, atol=1e-6)


def test_slices_used_before_the_next_update_are_not_scored(tiny, tmp_path):
    """One generation batch over two optimizer steps (num_iterations 1, steps_per_generation 4, accumulation 2): the
    two slices of the first step are on-policy (no old log-probs, no scoring forward; the loss's ratio is exactly 1),
    the two of the second step get the sampling model's log-probs, as TRL's whole-batch forward gives them."""
    trainer = make_trainer(tiny, tmp_path, num_iterations=1, steps_per_generation=4, gradient_accumulation_steps=2,
                           per_device_train_batch_size=2, seed=1)
    rows_scored = _record_scoring(trainer)
    generated = []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda batch: generated.append(generate(batch)) or generated[-1]
    trainer.model.train()
    trainer._prepare_inputs([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    slices = trainer._buffered_inputs
    assert [("old_per_token_logps" in piece) for piece in slices] == [False, False, True, True]
    assert rows_scored == [(2, 2), (2, 2)]
    (whole,) = generated
    reference = _whole_batch_logps(trainer, whole)
    for piece in slices[2:]:
        torch.testing.assert_close(piece["old_per_token_logps"], _same_rows(piece, whole, reference),
                                   rtol=1e-5, atol=1e-6)
    trainer.current_gradient_accumulation_steps = 2  # set by transformers' training loop
    trainer.compute_loss(trainer.model, slices[0])
    ratios = trainer._metrics["train"]
    assert ratios["objective/ratio_min"][-1] == ratios["objective/ratio_max"][-1] == 1.0


@pytest.mark.parametrize(("micro_step", "spg", "accumulation", "iterations", "on_policy"), [
    (0, 4, 2, 1, [True, True, False, False]),  # two optimizer steps per generation batch
    (0, 2, 2, 1, [True, True]),  # one optimizer step per generation batch: all on-policy (TRL scores none)
    (0, 2, 2, 2, [False, False]),  # each slice is used again after the update
    (0, 4, 3, 1, [False] * 4),  # windows straddle generation batches: transformers' per-epoch steps move them
    (4, 4, 3, 1, [False] * 4),
    (0, 6, 3, 1, [True, True, True, False, False, False]),  # two whole windows per generation batch
    (12, 6, 3, 1, [True, True, True, False, False, False]),  # a later generation batch: the same schedule
    (0, 1, 1, 1, [True]),
])
def test_on_policy_slices_follow_the_schedule(micro_step, spg, accumulation, iterations, on_policy):
    from trustclip.integrations.trl.step_counts import StepCounts

    counts = StepCounts(steps_per_generation=spg, gradient_accumulation_steps=accumulation, num_iterations=iterations)
    assert counts.on_policy_slices(micro_step) == on_policy


def test_skip_zero_advantage_trains(tiny, tmp_path):
    """Groups whose rewards all agree (here: every prompt but one) leave the update; training still moves."""
    def reward(completions, prompts, **kwargs):
        return [digit_reward([c])[0] if "3+4" in p else 1.0 for c, p in zip(completions, prompts, strict=True)]

    trainer = make_trainer(tiny, tmp_path, reward=reward, skip_zero_advantage=True)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)
    kept = trainer.state.log_history[0].get("update/kept_frac")
    assert kept is not None and 0 < kept < 1
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_fused_loss_gives_the_eager_loss_gradients_and_metrics(tiny, tmp_path):
    """fused_loss=True (the per-token loss as one compiled graph, trustclip.objectives.fused) changes nothing the
    trainer computes beyond float rounding: loss, parameter gradients, logged metrics."""
    from torch._dynamo.utils import counters  # dynamo's own count of the graphs it compiled

    from trustclip.objectives.fused import clear_compiled

    kwargs = dict(objective="clip_higher", aggregation="token_mean", max_completion_length=6)
    eager = make_trainer(tiny, tmp_path / "eager", **kwargs)
    fused = make_trainer(tiny, tmp_path / "fused", fused_loss=True, **kwargs)
    inputs = _with_old_logps(eager, _batch(tiny[1]))
    clear_compiled()
    counters.clear()
    assert_same_loss_and_grads(fused, eager, inputs)
    assert counters["stats"]["unique_graphs"] == 1  # the fused trainer's loss was the compiled graph
    logged = {key: values for key, values in eager._metrics["train"].items() if key.startswith("objective/")}
    assert logged and logged["objective/clip_frac"][0] > 0  # the batch does clip
    for key, values in logged.items():
        assert fused._metrics["train"][key] == pytest.approx(values, rel=1e-5, abs=1e-7), key


def test_trl_config_refuses_fused_loss_for_an_objective_without_a_fused_path(tmp_path):
    with pytest.raises(ValueError, match="objective 'kl_cov' cannot be fused.*set fused_loss=False"):
        make_config(tmp_path, objective="kl_cov", fused_loss=True)
    assert not make_config(tmp_path, objective="kl_cov").fused_loss  # eager default
