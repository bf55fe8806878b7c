"""Mixed precision (`bf16`) on CPU: the log-probs and the ratio stay float32, an on-policy update has a ratio of
exactly 1, a bf16 run trains, evaluates and resumes bit-identically after a kill, and a machine that cannot honour
bf16 refuses it up front. Tiny offline model."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from test_train_cli import cli_env, kill_at_checkpoint, tiny_overrides  # noqa: E402
from test_trainer import make_trainer  # noqa: E402

from trustclip import precision  # noqa: E402

needs_bf16 = pytest.mark.skipif(precision.bf16_problem("cpu") is not None, reason="this CPU has no bfloat16")


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trustclip.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


def first_update(trainer) -> dict:
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h)


@needs_bf16
@pytest.mark.parametrize("skip_zero_advantage", [False, True])  # TRL's scoring forward, and trustclip's deferred one
def test_on_policy_ratio_is_exactly_one_under_bf16(tiny, tmp_path, skip_zero_advantage):
    trainer = make_trainer(tiny, tmp_path, objective="kl3", bf16=True, max_steps=1,
                           skip_zero_advantage=skip_zero_advantage)
    first = first_update(trainer)
    assert first["objective/ratio_max"] == 1.0 and first["objective/ratio_min"] == 1.0
    assert first["objective/clip_frac"] == 0.0


@needs_bf16
def test_log_probs_are_float32_from_a_float32_head_under_bf16(tiny, tmp_path):
    """Under autocast the trainer's log-probs equal a float32 LM head + log-softmax applied to the (autocast) final
    hidden states; a bfloat16 head would be off by ~1e-2."""
    trainer = make_trainer(tiny, tmp_path, objective="kl3", bf16=True, max_steps=1)
    trainer.train()
    inputs = trainer._buffered_inputs[0]
    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    n = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logps, entropies, _ = trainer._completion_logps(model, inputs, compute_entropy=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -n - 1:-1]
        head = model.get_output_embeddings().weight
        reference = torch.log_softmax(hidden.float() @ head.float().T / trainer.temperature, dim=-1)
        reference = reference.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what a bfloat16 head would give
            low = torch.log_softmax((hidden @ head.T).float() / trainer.temperature, dim=-1)
        low = low.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    assert logps.dtype == torch.float32 and entropies.dtype == torch.float32
    real = inputs["completion_mask"].bool()
    error = (logps - reference)[real].abs().max().item()
    bf16_error = (low - reference)[real].abs().max().item()
    assert error < 1e-4 < bf16_error, (error, bf16_error)


@needs_bf16
def test_the_ratio_is_float32_under_bf16(tiny, tmp_path):
    from trustclip.objectives.registry import TokenLoss

    seen = []
    trainer = make_trainer(tiny, tmp_path, objective="kl3", bf16=True, max_steps=2)
    original = trainer._log_objective_metrics

    def spy(mode, out: TokenLoss, batch, *args, **kwargs):
        seen.append((batch.logp.dtype, batch.old_logp.dtype, batch.ratio.dtype, out.loss.dtype))
        return original(mode, out, batch, *args, **kwargs)

    trainer._log_objective_metrics = spy
    trainer.train()
    assert seen and all(dtypes == (torch.float32,) * 4 for dtypes in seen), seen


@needs_bf16
def test_bf16_trains_and_evaluates(tiny_model_path, tmp_path):
    from trustclip.settings import load_config
    from trustclip.train.pipeline import run_pipeline

    out = tmp_path / "run"
    config = load_config(None, [*tiny_overrides(tiny_model_path, out), "bf16=true", "quiet=true"])
    summary = run_pipeline(config)
    assert set(summary["accuracy_after"]) == {"amc_like", "aime24_like", "aime25_like", "average"}
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [h for h in logs if h["stage"] == "rl" and "loss" in h]
    assert len(rl) == 2 and all(abs(h["loss"]) < 1e3 for h in rl)
    saved = (out / "config.yaml").read_text()
    assert "bf16: true" in saved


@needs_bf16
def test_bf16_resumes_bit_identically_after_a_kill(tiny_model_path, tmp_path):
    sets = {"rl.max_steps": 6, "rl.save_steps": 2, "rl.save_total_limit": 3, "bf16": True}
    env = cli_env(tmp_path)

    def command(out):
        overrides = tiny_overrides(tiny_model_path, out, **sets)
        return [sys.executable, "-m", "trustclip.cli", "train", "--skip", "sft,eval",
                *[a for o in overrides for a in ("--set", o)]]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(command(whole), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    kill_at_checkpoint(command(killed), env, killed / "rl" / "checkpoint-2")
    resumed = subprocess.run([*command(killed), "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout

    def losses(out):
        return [(h["step"], h["loss"], h["objective/ratio_max"]) for h in map(json.loads, (out / "metrics.jsonl")
                .read_text().splitlines()) if h["stage"] == "rl" and "loss" in h]

    assert losses(killed) == losses(whole)
    from safetensors.torch import load_file

    a = load_file(str(next((whole / "rl" / "final").glob("*.safetensors"))))
    b = load_file(str(next((killed / "rl" / "final").glob("*.safetensors"))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_on_a_cpu_without_bfloat16_is_refused_up_front(monkeypatch, tiny_model_path, tmp_path):
    from trustclip.settings import load_config
    from trustclip.train.checks import check_run

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(None, [*tiny_overrides(tiny_model_path, tmp_path / "run"), "bf16=true"])
    with pytest.raises(ValueError, match=r"bf16=true cannot be honoured here: this CPU has no bfloat16"):
        check_run(config)
    assert not (tmp_path / "run").exists()  # refused before any work
    # null (the default) means off on CPU, with no error
    assert precision.resolve_bf16(None) is False


def lora_policy(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    from trustclip.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_path)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config), tokenizer


def test_low_precision_copy_samples_from_the_current_merged_policy(tiny_model_path):
    policy, tokenizer = lora_policy(tiny_model_path)
    ids = tokenizer(["Compute 3+4. Answer:", "Compute 12+5. Answer:"], return_tensors="pt", padding=True)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    exact = precision.LowPrecisionCopy(policy, torch.float32)
    low = precision.LowPrecisionCopy(policy, torch.bfloat16)
    for step in range(2):
        with torch.no_grad():
            want = policy(**ids).logits
            assert torch.allclose(exact.refresh(policy)(**ids).logits, want, atol=1e-5)
            assert (low.refresh(policy)(**ids).logits.float() - want).abs().max() < 0.5
        assert all(p.dtype == torch.bfloat16 for p in low.model.parameters())
        assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # the policy is untouched
        with torch.no_grad():  # an update of the adapter (and of a non-adapter weight): the copy follows it
            for name, param in policy.named_parameters():
                if "lora_B" in name or name.endswith("norm.weight"):
                    param.add_(0.05 * torch.randn_like(param))
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        if step == 0:  # before the refresh the copy still holds the old weights
            with torch.no_grad():
                assert not torch.allclose(exact.model(**ids).logits, policy(**ids).logits, atol=1e-5)


def test_generation_dtype_samples_from_the_copy_and_keeps_the_ratio(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, objective="kl3", max_steps=2, generation_dtype="bfloat16")
    calls = []
    copy_model = trainer._sampler.model
    original = copy_model.generate
    copy_model.generate = lambda *a, **k: calls.append(1) or original(*a, **k)
    policy_calls = []
    hook = trainer.model.get_output_embeddings().register_forward_hook(lambda *_: policy_calls.append(1))
    trainer.train()
    first = next(h for h in trainer.state.log_history if "loss" in h)
    hook.remove()
    assert calls, "TRL's generation did not sample from the copy"
    # the policy's LM head ran only for the scoring and update forwards (fused head: its weight, not its module)
    assert not policy_calls, "generation ran the policy's forward, not the copy's"
    assert first["objective/ratio_max"] == 1.0 and first["objective/ratio_min"] == 1.0
    assert trainer.model_wrapped is not copy_model


def test_generation_dtype_is_checked(tmp_path):
    from trustclip.integrations.trl import TrustClipGRPOConfig

    with pytest.raises(ValueError, match="generation_dtype='int8' is invalid"):
        TrustClipGRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_dtype="int8")


def test_bf16_in_trl_kwargs_points_to_the_top_level_setting():
    from trustclip.settings import load_config

    with pytest.raises(ValueError, match=r"run-wide settings \(bf16: set them at the top level"):
        load_config(None, ["rl.trl_kwargs={bf16: true}"])


# ------------------------------------------------------------------------- LoRA layers under autocast (merged product)
def one_lora_layer(dropout: float = 0.0, b_std: float = 1e-3):
    """A 256 -> 256 linear layer (outputs ~8) with a LoRA adapter whose contribution (~0.003) is below half a bfloat16
    step of the output, as an RL update of a few steps is."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(256, 256, bias=False)

        def forward(self, x):
            return self.proj(x)

    base = Proj()
    torch.nn.init.normal_(base.proj.weight, std=0.5)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], lora_dropout=dropout))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=b_std)
    return model, layer


def shown_share_of_the_adapter(model, layer, x) -> float:
    """Regression slope of what the layer's autocast output shows of the adapter on what it adds in float32."""
    with torch.no_grad():
        exact = model(x)
        base = layer.base_layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x).float()
    added = exact - base
    return float(((low - base) * added).sum() / (added * added).sum())


@needs_bf16
def test_under_autocast_the_merged_product_shows_the_whole_adapter_where_peft_erases_most_of_it():
    model, layer = one_lora_layer()
    x = torch.randn(64, 256)
    peft_share = shown_share_of_the_adapter(model, layer, x)
    assert precision.merge_lora_under_autocast(model) == 1
    merged_share = shown_share_of_the_adapter(model, layer, x)
    assert peft_share < 0.5, peft_share  # PEFT rounds the base output, adds the adapter, rounds again: 0.33
    assert 0.9 < merged_share < 1.1, merged_share  # one rounding of x (W + s B A): 1.05
    with torch.no_grad():  # outside autocast the layer is PEFT's, to the bit
        plain = model(x)
        layer.forward = layer.forward.args[1]
        assert torch.equal(plain, model(x))


@needs_bf16
def test_the_merged_product_is_the_samplers_arithmetic(tiny_model_path):
    """Under autocast the patched policy computes what the merged copy (the sampler's weights) computes, exactly."""
    policy, tokenizer = lora_policy(tiny_model_path)
    ids = tokenizer(["Compute 3+4. Answer:", "Compute 12+5. Answer:"], return_tensors="pt", padding=True)
    merged = precision.LowPrecisionCopy(policy, torch.float32).model
    assert precision.merge_lora_under_autocast(policy) == 3 * policy.config.num_hidden_layers
    assert precision.merge_lora_under_autocast(policy) == 3 * policy.config.num_hidden_layers  # idempotent
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(policy(**ids).logits, merged(**ids).logits)


def test_the_merged_products_gradient_is_peft_s(monkeypatch):
    """The merged product's gradient with respect to A and B, taken in float64 (the formula without the rounding),
    equals PEFT's forward's."""
    model, layer = one_lora_layer(b_std=0.1)
    model.double()
    x = torch.randn(16, 256, dtype=torch.float64)

    def grads():
        model.zero_grad()
        (model(x) ** 2).sum().backward()
        return [p.grad.clone() for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]

    want = grads()
    precision.merge_lora_under_autocast(model)
    monkeypatch.setattr(precision, "_merged_product_applies", lambda *_: True)  # the merged path, in float64
    got = grads()
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-9)
        assert not torch.equal(g, torch.zeros_like(g))


@needs_bf16
def test_an_active_lora_dropout_keeps_peft_s_forward():
    model, layer = one_lora_layer(dropout=0.5)
    precision.merge_lora_under_autocast(model)
    x = torch.randn(8, 256)
    calls = []
    peft_forward = layer.forward.args[1]
    layer.forward.keywords.clear()
    layer.forward = functools.partial(precision._merged_lora_forward, layer,
                                      lambda *a, **k: calls.append(1) or peft_forward(*a, **k))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()
        model(x)
        assert calls == [1]  # training with dropout: the adapter's input dropout needs PEFT's separate product
        model.eval()
        model(x)
        assert calls == [1]  # evaluation: no dropout, the merged product


@needs_bf16
@pytest.mark.parametrize("merged", [True, False])
def test_the_trainer_merges_lora_layers_under_bf16_unless_told_not_to(tiny_model_path, tmp_path, merged):
    policy, tokenizer = lora_policy(tiny_model_path)
    trainer = make_trainer((policy, tokenizer), tmp_path, objective="kl3", bf16=True, max_steps=1,
                           merged_lora_forward=merged)
    from peft.tuners.lora import Linear as LoraLinear

    layers = [m for m in trainer.model.modules() if isinstance(m, LoraLinear)]
    assert layers and all((getattr(m.forward, "func", None) is precision._merged_lora_forward) == merged
                          for m in layers)
    first = first_update(trainer)  # the old-log-prob and the update forwards take the same path
    assert first["objective/ratio_max"] == 1.0 and first["objective/ratio_min"] == 1.0
