"""TRL's private surface, fenced: every private TRL name TrustClipGRPOTrainer touches is listed in
trustclip/integrations/trl/surface.py, exists in the installed TRL (a rename fails naming it), and the options the
subclass re-implements from TRL's `_compute_loss` (entropy bonus, static and adaptive; top_entropy_quantile;
off_policy_mask_threshold; use_bias_correction_kl) match TRL's own loss on the same batch, loss and gradients."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from test_trainer import (  # noqa: E402
    _batch,
    _loss_and_grads,
    _trl_trainer,
    _with_old_logps,
    assert_same_loss_and_grads,
    make_trainer,
)

from trustclip.integrations.trl import surface as trl_surface  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_TRAINER_API = {"accelerator", "args", "model"}  # documented transformers.Trainer attributes


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trustclip.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def trl_instance(tiny, tmp_path_factory):
    return _trl_trainer(tiny, tmp_path_factory.mktemp("trl"), loss_type="dr_grpo")


def test_every_listed_name_exists_in_the_installed_trl(trl_instance):
    assert trl_surface.missing_names(trainer=trl_instance) == []


def test_a_renamed_trl_name_fails_naming_it(tiny, tmp_path, monkeypatch, trl_instance):
    """What a TRL upgrade that renames a method, a parameter or an attribute looks like."""
    from trl import GRPOTrainer

    monkeypatch.delattr(GRPOTrainer, "get_off_policy_mask")
    monkeypatch.delattr(trl_instance, "_buffered_inputs")
    original = GRPOTrainer._calculate_rewards
    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", lambda self, inputs, prompts, completions, ids: original(
        self, inputs, prompts, completions, ids))
    missing = trl_surface.missing_names(trainer=trl_instance)
    assert "method GRPOTrainer.get_off_policy_mask" in missing
    assert any(m.startswith("attribute GRPOTrainer._buffered_inputs") for m in missing)
    assert "parameter 'completion_ids_list' of GRPOTrainer._calculate_rewards" in missing
    with pytest.raises(RuntimeError, match="get_off_policy_mask"):
        make_trainer(tiny, tmp_path)  # the trainer refuses to start, naming what is gone


def _attributes(tree: ast.AST, owner: str) -> set[str]:
    """Names X of every `<owner>.X` in the tree (owner: 'self', or 'self.trainer' / 'self.args' as dotted)."""
    *base, last = owner.split(".")
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        on_name = not base and isinstance(value, ast.Name) and value.id == last
        on_attribute = (base and isinstance(value, ast.Attribute) and value.attr == last
                        and isinstance(value.value, ast.Name) and value.value.id == base[0])
        if on_name or on_attribute:
            found.add(node.attr)
    return found


def test_every_trl_name_the_trainer_touches_is_listed():
    from trustclip.integrations.trl import TrustClipGRPOConfig

    tree = ast.parse((ROOT / "trustclip" / "integrations" / "trl" / "trainer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrustClipGRPOTrainer")
    ours = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    ours |= {n.attr for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    listed = {*trl_surface.OVERRIDDEN_METHODS, *trl_surface.CALLED_METHODS, *trl_surface.ATTRIBUTES,
              *trl_surface.TRAINING_ATTRIBUTES}
    unlisted = _attributes(cls, "self") - ours - listed - PUBLIC_TRAINER_API
    assert not unlisted, f"trainer.py uses TRL's {sorted(unlisted)}: list them in surface.py"
    trl = __import__("trl")
    overridden = {n for n in ours if n.startswith("_") and not n.startswith("__") and hasattr(trl.GRPOTrainer, n)}
    assert overridden <= set(trl_surface.OVERRIDDEN_METHODS), sorted(overridden - set(trl_surface.OVERRIDDEN_METHODS))
    own_fields = {f.name for f in dataclasses.fields(TrustClipGRPOConfig)} - {
        f.name for f in dataclasses.fields(trl.GRPOConfig)}
    read = _attributes(cls, "self.args") - own_fields
    listed_config = {*trl_surface.CONFIG_FIELDS, *trl_surface.CONFIG_PROPERTIES}
    assert read <= listed_config, f"GRPOConfig fields read but not listed: {sorted(read - listed_config)}"
    callbacks = ast.parse((ROOT / "trustclip" / "train" / "callbacks.py").read_text())
    private = {n for n in _attributes(callbacks, "self.trainer") if n.startswith("_")}
    assert private <= listed, f"train/callbacks.py uses TRL's {sorted(private - listed)}: list them"


def test_the_parts_apart_from_the_trainer_import_no_trl():
    """The zero-advantage filter, the delta callback, truly_ppo's forward and the step counts (each tested without
    TRL) import nothing of it, so no private TRL name hides outside trainer.py."""
    for module in ("zero_advantage", "delta_control", "full_vocab", "step_counts"):
        tree = ast.parse((ROOT / "trustclip" / "integrations" / "trl" / f"{module}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not {name for name in imported if name.split(".")[0] == "trl"}, module


# ------------------------------------------------------------------ parity with TRL's _compute_loss
CLIP_DR_GRPO = dict(objective="clip", objective_kwargs={"epsilon": 0.2}, aggregation="dr_grpo", max_completion_length=6)


def _plain_loss(tiny, tmp_path, inputs):
    """Our loss without the option, to show that the option changes it on this batch."""
    return _loss_and_grads(make_trainer(tiny, tmp_path / "plain", **CLIP_DR_GRPO), inputs)[0]


@pytest.mark.parametrize("option", [
    {"entropy_coef": 0.05},
    {"top_entropy_quantile": 0.5},
    {"top_entropy_quantile": 0.5, "entropy_coef": 0.05},  # the bonus acts on the same high-entropy tokens
    {"off_policy_mask_threshold": 0.02},
], ids=["entropy_bonus", "top_entropy_quantile", "top_entropy_quantile+bonus", "off_policy_mask"])
def test_option_matches_trl_loss(tiny, tmp_path, option):
    ours = make_trainer(tiny, tmp_path / "ours", **CLIP_DR_GRPO, **option)
    theirs = _trl_trainer(tiny, tmp_path, loss_type="dr_grpo", epsilon=0.2, **option)
    inputs = _with_old_logps(theirs, _batch(tiny[1]))
    loss = assert_same_loss_and_grads(ours, theirs, inputs)
    assert not torch.allclose(loss, _plain_loss(tiny, tmp_path, inputs))  # the option acts on this batch


def test_adaptive_entropy_matches_trl_over_steps(tiny, tmp_path):
    """The controller's coefficient and gate follow TRL's step by step (three optimizer steps on one batch)."""
    option = dict(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.02,
                  entropy_coef_min=0.0, entropy_coef_max=0.2)
    ours = make_trainer(tiny, tmp_path / "ours", **CLIP_DR_GRPO, **option)
    theirs = _trl_trainer(tiny, tmp_path, loss_type="dr_grpo", epsilon=0.2, **option)
    inputs = _with_old_logps(theirs, _batch(tiny[1]))
    losses = []
    for _ in range(3):
        losses.append(assert_same_loss_and_grads(ours, theirs, inputs))
        assert ours.entropy_coef == pytest.approx(theirs.entropy_coef)
        assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy)
    assert ours.entropy_coef == pytest.approx(0.05 + 3 * 0.02)  # the controller stepped each time
    assert not torch.allclose(losses[0], losses[1])  # step 1: gate closed (no window entropy yet); then open


@pytest.mark.parametrize("bias_correction", [False, True])
def test_reference_kl_matches_trl(tiny, tmp_path, bias_correction):
    option = dict(beta=0.1, use_bias_correction_kl=bias_correction)
    ours = make_trainer(tiny, tmp_path / "ours", **CLIP_DR_GRPO, **option)
    theirs = _trl_trainer(tiny, tmp_path, loss_type="dr_grpo", epsilon=0.2, **option)
    inputs = _with_old_logps(theirs, _batch(tiny[1]))
    g = torch.Generator().manual_seed(2)
    inputs["ref_per_token_logps"] = (inputs["old_per_token_logps"] + 0.2 * torch.randn(
        inputs["old_per_token_logps"].shape, generator=g)).clamp(max=0.0)
    loss = assert_same_loss_and_grads(ours, theirs, inputs)
    other = make_trainer(tiny, tmp_path / "other", **CLIP_DR_GRPO, beta=0.1, use_bias_correction_kl=not bias_correction)
    assert not torch.allclose(loss, _loss_and_grads(other, inputs)[0])  # the correction changes the loss here


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_vllm_importance_sampling_weights_match_trl(tiny, tmp_path, mode):
    """TRL's correction of the sampler's log-probs (truncated IS, TIS, or masked, per token or per sequence)
    multiplies our per-token loss as it multiplies TRL's: same loss and gradients on a batch whose weights TRL's
    formula made from perturbed sampler log-probs. (use_vllm is switched on after construction: no engine.)"""
    ours = make_trainer(tiny, tmp_path / "ours", **CLIP_DR_GRPO)
    theirs = _trl_trainer(tiny, tmp_path, loss_type="dr_grpo", epsilon=0.2)
    inputs = _with_old_logps(theirs, _batch(tiny[1]))
    g = torch.Generator().manual_seed(3)
    sampler = inputs["old_per_token_logps"] + 0.3 * torch.randn(inputs["old_per_token_logps"].shape, generator=g)
    diff = (inputs["old_per_token_logps"] - sampler) * inputs["completion_mask"]
    ratio = (diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff).exp()
    low, high = 0.5, 2.0
    ratio = ratio.clamp(max=high) if mode.endswith("truncate") else ratio.masked_fill((ratio < low) | (ratio > high), 0)
    assert mode.endswith("truncate") or bool((ratio == 0).any())  # the mask drops some tokens on this batch
    inputs = {**inputs, "sampling_per_token_logps": sampler, "importance_sampling_ratio": ratio}
    for trainer in (ours, theirs):
        trainer.args.use_vllm = True
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    loss = assert_same_loss_and_grads(ours, theirs, inputs)
    plain = {k: v for k, v in inputs.items() if k not in ("sampling_per_token_logps", "importance_sampling_ratio")}
    ours.args.use_vllm = False
    assert not torch.allclose(loss, _loss_and_grads(ours, plain)[0])  # the weights act on this batch
