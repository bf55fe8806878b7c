"""`TrustclipPolicyLossConfig` through verl's real Hydra config, the docs' command line, and the plugin's
warnings and errors."""

from __future__ import annotations

import json
import logging
import re
import shlex
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import PolicyLossConfig
from verl_testkit import actor_config, assert_close, make_inputs, trustclip_config

from trustclip import compute_advantages, compute_policy_loss, get_objective, list_objectives, ratio_bounds
from trustclip.integrations.verl import plugin as verl_plugin
from trustclip.integrations.verl.config import TrustclipPolicyLossConfig
from trustclip.objectives import REGISTRY, RatioInterval

DOCS = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
TARGET = "actor_rollout_ref.actor.policy_loss._target_=trustclip.integrations.verl.config.TrustclipPolicyLossConfig"


def compose_ppo_config(overrides: list[str]):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def docs_command_overrides() -> list[str]:
    block = re.search(r"```bash\n(python3 -m verl\.trainer\.main_ppo .*?)```", DOCS.read_text(), re.S)
    assert block, "docs/verl.md lost its verl command line"
    tokens = shlex.split(block.group(1).replace("\\\n", " "))
    return tokens[tokens.index("verl.trainer.main_ppo") + 1:]


def test_the_earlier_dotted_paths_name_the_same_modules() -> None:
    """Configs written for earlier versions (`_target_=trustclip.integrations.verl_config...`,
    `VERL_USE_EXTERNAL_MODULES=trustclip.integrations.verl_plugin`) load the same classes and functions."""
    import importlib

    assert importlib.import_module("trustclip.integrations.verl_config").TrustclipPolicyLossConfig \
        is TrustclipPolicyLossConfig
    assert importlib.import_module("trustclip.integrations.verl_plugin").build_objective is verl_plugin.build_objective
    cfg = compose_ppo_config([TARGET.replace("verl.config", "verl_config"),
                              "actor_rollout_ref.actor.policy_loss.loss_mode=trustclip_kl3",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    assert type(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss) is TrustclipPolicyLossConfig


# --------------------------------------------------------------------------- defaults and validation
@pytest.mark.parametrize("row", [r for r in list_objectives() if r["name"] not in ("general", "truly_ppo",
                                                                                     "atr_adaptive")],
                         ids=lambda r: r["name"])
def test_defaults_are_trustclips(row: dict) -> None:
    config = TrustclipPolicyLossConfig(loss_mode=f"trustclip_{row['name']}")
    objective = verl_plugin.build_objective(config.loss_mode, config.objective_kwargs)
    assert dict(objective.hparams) == dict(get_objective(row["name"]).hparams) == row["defaults"]


def test_objective_kwargs_override_defaults() -> None:
    config = TrustclipPolicyLossConfig(loss_mode="trustclip_clip_higher", objective_kwargs={"epsilon_high": 0.5})
    objective = verl_plugin.build_objective(config.loss_mode, config.objective_kwargs)
    assert dict(objective.hparams) == {"epsilon_low": 0.2, "epsilon_high": 0.5}
    as_json = TrustclipPolicyLossConfig(loss_mode="trustclip_kl3", objective_kwargs='{"delta": 0.05}')
    assert as_json.objective_kwargs == {"delta": 0.05}


@pytest.mark.parametrize("loss_mode, kwargs, message", [
    ("trustclip_kl3", {"detla": 0.05}, r"unknown hyper-parameter\(s\) \['detla'\] for objective 'kl3'; valid: delta"),
    ("trustclip_kl3", {"delta": -1}, r"delta=-1 is invalid; it must be > 0"),
    ("trustclip_kl3", "{delta: 1}", r"not a JSON object"),
    ("trustclip_truly_ppo", {}, r"needs the per-token input\(s\) \['full_kl'\].*does not provide"),
    ("trustclip_aspo", {"entropy_split": True}, r"needs the per-token input\(s\) \['entropy'\]"),
    ("trustclip_general", {}, r"constraint=None is invalid"),
    ("trustclip_atr_adaptive", {}, r"trustclip_atr_adaptive adapts delta between updates with a controller.*no step "
                                   r"boundary and no checkpoint hook. Use it through trustclip's TRL trainer"),
    ("trustclip_atr_adaptive", {"delta_min": 0.3, "delta_max": 0.2}, r"delta range .* is empty"),
    ("trustclip_atr_seq", {"delta": -1}, r"atr_seq: delta=-1 is invalid"),
    ("trustclip_nope", {}, r"'trustclip_nope' is not a trustclip loss mode; valid: trustclip_aspo"),
    ("vanilla", {"delta": 0.05}, r"only read by trustclip_\* loss modes"),
])
def test_bad_config_fails_when_built(loss_mode: str, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrustclipPolicyLossConfig(loss_mode=loss_mode, objective_kwargs=kwargs)


@pytest.mark.parametrize("loss_mode, message", [
    ("trustclip_kl_cov", r"objective 'kl_cov' cannot be fused: .*; set policy_loss.fused=False"),
    ("trustclip_clip_cov", r"objective 'clip_cov' cannot be fused"),
    ("vanilla", r"policy_loss.fused=True is only read by trustclip_\* loss modes, but loss_mode='vanilla'"),
])
def test_fused_loss_the_plugin_cannot_give_fails_when_built(loss_mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrustclipPolicyLossConfig(loss_mode=loss_mode, fused=True)


@pytest.mark.parametrize("loss_mode, message", [("trustclip_truly_ppo", "needs the per-token input"),
                                                ("trustclip_atr_adaptive", "adapts delta between updates")])
def test_losses_verl_cannot_feed_fail_clearly_at_call(loss_mode: str, message: str) -> None:
    inputs = make_inputs()
    config = actor_config(PolicyLossConfig(loss_mode=loss_mode))
    with pytest.raises(ValueError, match=f"{loss_mode} {message}"):
        core_algos.get_policy_loss_fn(loss_mode)(config=config, **inputs.args())


def test_config_unknown_to_verl_is_rejected_without_the_subclass() -> None:
    """Why the subclass exists: verl's own PolicyLossConfig rejects unknown keys."""
    cfg = compose_ppo_config(["actor_rollout_ref.actor.policy_loss.loss_mode=trustclip_kl3",
                              "+actor_rollout_ref.actor.policy_loss.objective_kwargs={delta:0.05}",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    with pytest.raises(Exception, match="objective_kwargs"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@pytest.mark.parametrize("loss_mode, refused", [("trustclip_kl3", False), ("trustclip_kl_cov", True)])
def test_fused_from_the_command_line(loss_mode: str, refused: bool) -> None:
    cfg = compose_ppo_config([TARGET, f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                              "+actor_rollout_ref.actor.policy_loss.fused=true",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    if refused:
        with pytest.raises(Exception, match="objective 'kl_cov' cannot be fused"):
            omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    else:
        assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss.fused is True


def test_general_constraint_from_a_hydra_node() -> None:
    cfg = compose_ppo_config([
        TARGET, "actor_rollout_ref.actor.policy_loss.loss_mode=trustclip_general",
        "+actor_rollout_ref.actor.policy_loss.objective_kwargs={constraint:"
        "{_target_:trustclip.objectives.constraints.RatioInterval,low:0.8,high:1.3}}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    ])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.objective_kwargs == {"constraint": RatioInterval(0.8, 1.3)}
    inputs = make_inputs(seed=4)
    loss, _ = core_algos.get_policy_loss_fn("trustclip_general")(config=actor, loss_agg_mode="token-mean",
                                                                  **inputs.args())
    expected, _ = compute_policy_loss(get_objective("general", constraint=RatioInterval(0.8, 1.3)),
                                      logp=inputs.log_prob, old_logp=inputs.old_log_prob,
                                      advantages=inputs.advantages, mask=inputs.response_mask,
                                      aggregation="token_mean")
    assert_close(loss, expected)


# --------------------------------------------------------------------------- the docs' command line
def test_docs_command_line_is_atr_grpo_with_the_papers_settings(monkeypatch) -> None:
    """verl composes and validates the documented command (as `main_ppo` does before starting Ray), and it
    holds the paper's settings. vLLM is not installed here: its LoRA-rank check is recorded instead."""
    lora_ranks: list[int] = []
    vllm_utils = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    vllm_utils.get_vllm_max_lora_rank = lora_ranks.append
    monkeypatch.setitem(sys.modules, vllm_utils.__name__, vllm_utils)
    cfg = compose_ppo_config(docs_command_overrides())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Disabled critic as algorithm.adv_estimator != gae")
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert lora_ranks == [32]
    actor_cfg, rollout, data = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.data
    actor = omega_conf_to_dataclass(actor_cfg)
    objective = verl_plugin.build_objective(actor.policy_loss.loss_mode, actor.policy_loss.objective_kwargs)
    assert isinstance(actor.policy_loss, TrustclipPolicyLossConfig) and objective.name == "kl3"
    assert ratio_bounds(objective) == pytest.approx((0.6710, 1.4222), abs=5e-5)
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B"
    assert (cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha) == (32, 64)
    assert (actor_cfg.optim.lr, actor_cfg.optim.weight_decay, actor_cfg.optim.optimizer) == (5e-6, 1e-3, "AdamW")
    assert (rollout.n, rollout.temperature, rollout.top_p, rollout.top_k) == (8, 1.0, 1.0, -1)
    val = rollout.val_kwargs
    assert (val.do_sample, val.n, val.temperature, val.top_p) == (True, 8, 0.3, 0.95)
    assert len(data.val_files) == 3
    assert data.max_prompt_length + data.max_response_length == 2048
    sequences_per_step = actor_cfg.ppo_mini_batch_size * rollout.n
    assert sequences_per_step == 8 * 4  # the paper's batch size x gradient-accumulation steps
    assert sequences_per_step // (actor_cfg.ppo_micro_batch_size_per_gpu * cfg.trainer.n_gpus_per_node) == 4
    assert not actor_cfg.use_kl_loss and not cfg.algorithm.use_kl_in_reward and not need_reference_policy(cfg)
    assert actor_cfg.entropy_coeff == 0
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert actor_cfg.loss_agg_mode == "seq-mean-token-sum-norm"
    assert actor_cfg.loss_scale_factor == data.max_response_length
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq) == (1000, 50)


def test_docs_advantage_setting_is_dr_grpo() -> None:
    """adv_estimator=grpo with norm_adv_by_std_in_grpo=False is Dr.GRPO's R - mean_group(R)."""
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 1])
    mask = torch.ones(16, 5, dtype=torch.bool)
    token_rewards = torch.zeros(16, 5)
    token_rewards[:, -1] = rewards
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, index=np.repeat(np.arange(2), 8), norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(advantages[:, 0], compute_advantages(rewards, 8, "dr_grpo"))


def test_mapping_table_in_docs_is_current() -> None:
    """Every loss mode with its objective, the registry's defaults and summary, and "not usable in verl" exactly where
    the plugin refuses to build the objective."""
    table = re.search(r"<!-- mapping-table:start -->\n(.*?)\n<!-- mapping-table:end -->", DOCS.read_text(), re.S)
    assert table
    rows = re.findall(r"^\| `(trustclip_\w+)` \| `(\w+)` \| (.*) \| (.*) \|$", table.group(1), re.M)
    assert {mode: name for mode, name, _, _ in rows} == verl_plugin.verl_loss_names() and len(rows) > 20
    registry = {o["name"]: o for o in list_objectives()}
    for mode, name, shown, notes in rows:
        summary = registry[name]["summary"].replace("|", "\\|")
        if name == "general":  # its constraint is an object: no default, refused without one
            assert shown.startswith("constraint (required") and notes == summary, mode
            continue
        defaults = registry[name]["defaults"].items()  # as YAML writes them: null / true / false
        assert shown == ", ".join(f"{k}={json.dumps(v) if v is None or isinstance(v, bool) else v}"
                                  for k, v in defaults), mode
        try:
            verl_plugin.build_objective(mode)
            refused = False
        except ValueError:
            refused = True
        assert notes == summary if not refused else (notes.startswith(summary + "; ")
                                                      and notes.endswith("not usable in verl")), mode


def test_mapping_covers_every_objective_and_alias() -> None:
    names = verl_plugin.verl_loss_names()
    assert set(names.values()) == set(REGISTRY)
    assert {"trustclip_kl3": "kl3", "trustclip_atr": "kl3", "trustclip_atr_grpo": "kl3"}.items() <= names.items()
    assert all(name.startswith("trustclip_") for name in names)


# --------------------------------------------------------------------------- one-time warnings
@pytest.mark.usefixtures("fresh_warnings")
def test_warns_once_about_settings_it_ignores_or_that_change_its_meaning(caplog) -> None:
    inputs = make_inputs()
    fn = core_algos.get_policy_loss_fn("trustclip_sapo")
    config = actor_config(PolicyLossConfig(loss_mode="trustclip_sapo", ppo_kl_coef=1.0), clip_ratio_high=0.28)
    with caplog.at_level(logging.WARNING, logger=verl_plugin.__name__):
        for _ in range(2):
            fn(config=config, loss_agg_mode="seq-mean-token-sum-norm", **inputs.args())
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages
    assert any("not a TrustclipPolicyLossConfig, so trustclip's default" in m for m in messages)
    assert any("ignores actor.clip_ratio_high, actor.policy_loss.ppo_kl_coef" in m for m in messages)
    assert any("its paper (and verl's own sapo, which forces it) uses seq-mean-token-mean" in m for m in messages)
    assert any("without actor.loss_scale_factor divides by the padded length" in m for m in messages)


@pytest.mark.usefixtures("fresh_warnings")
def test_no_warning_for_the_documented_setup(caplog) -> None:
    inputs = make_inputs()
    config = trustclip_config("trustclip_kl3", {"loss_scale_factor": 1536}, delta=0.07)
    with caplog.at_level(logging.WARNING, logger=verl_plugin.__name__):
        core_algos.get_policy_loss_fn("trustclip_kl3")(config=config, loss_agg_mode="seq-mean-token-sum-norm",
                                                       **inputs.args())
    assert caplog.records == []


# --------------------------------------------------------------------------- registration
def test_registration_is_idempotent_and_picks_up_new_objectives(monkeypatch) -> None:
    from dataclasses import replace

    monkeypatch.setitem(REGISTRY, "my_kl3", replace(REGISTRY["kl3"], name="my_kl3", aliases=()))
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "trustclip_my_kl3", None)  # removed again afterwards
    assert "trustclip_my_kl3" in verl_plugin.register_verl_losses()
    assert core_algos.get_policy_loss_fn("trustclip_my_kl3").trustclip_objective == "my_kl3"
    assert core_algos.get_policy_loss_fn("vanilla").__module__ == "verl.trainer.ppo.core_algos"


def test_registration_never_overwrites_a_foreign_loss(monkeypatch) -> None:
    foreign = core_algos.POLICY_LOSS_REGISTRY["vanilla"]
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "trustclip_kl3", foreign)
    with pytest.raises(verl_plugin.VerlPluginError, match="already has a policy loss named 'trustclip_kl3'"):
        verl_plugin.register_verl_losses()
    assert core_algos.POLICY_LOSS_REGISTRY["trustclip_kl3"] is foreign


def test_module_main_reports_registration(capsys) -> None:
    assert verl_plugin.main() == 0
    out = capsys.readouterr().out
    count = len(verl_plugin.verl_loss_names())
    assert f"{count} of {count} trustclip losses registered" in out
