"""Scenarios that start a vLLM engine, each run in a fresh process by tests/test_vllm.py (an in-process vLLM engine
sets up torch.distributed and replaces torch.set_num_threads for the whole process, which the rest of the suite must
not inherit). Each prints one JSON line of measurements; the test asserts on them.

    python tests/vllm_scenarios.py NAME MODEL_DIR WORK_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trustclip.metric_names import SAMPLER_GAP_MAX as GAP_MAX
from trustclip.metric_names import SAMPLER_GAP_MEAN as GAP_MEAN

PROMPTS = [f"Compute {a}+{b}. Answer in \\boxed{{}}.\n" for a, b in [(3, 4), (12, 7), (5, 9), (21, 30)]]


def digit_reward(completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def vllm_logprobs(llm, ids: list[int]) -> list[float]:
    """vLLM's log-prob of each token of `ids` after the first (prompt log-probs of the sequence)."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [entry[token].logprob for entry, token in zip(out[0].prompt_logprobs[1:], ids[1:], strict=True)]


def hf_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=model.device)[:, None])[:, 0].tolist()


def max_abs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def weight_sync(model_dir: str, work: str, peft: bool = False) -> dict:
    """Train 2 steps with vLLM colocated on the CPU as the sampler; compare vLLM's log-probs of a fixed sequence
    with the policy's (HF) before training and after the sync that follows it."""
    import copy

    from datasets import Dataset

    from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer
    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir)
    args = TrustClipGRPOConfig(
        output_dir=work, max_steps=2, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        learning_rate=5e-2 if not peft else 5e-1, num_iterations=2, use_cpu=True, bf16=False, **checkpointing_off(),
        report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
        objective="kl3", use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True)
    extra = {}
    if peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    trainer = TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward, args=args,
                                   train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 4]),
                                   processing_class=tokenizer, **extra)
    llm = trainer.vllm_generation.llm
    ids = tokenizer(PROMPTS[1] + "19. \\boxed{19}", add_special_tokens=False)["input_ids"]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    before, hf_before, text_before = vllm_logprobs(llm, ids), hf_logprobs(policy, ids), greedy(llm)
    trainer.train()
    trainer.vllm_generation.sync_weights()
    after, hf_after, text_after = vllm_logprobs(llm, ids), hf_logprobs(policy, ids), greedy(llm)
    logs = [h for h in trainer.state.log_history if GAP_MEAN in h]
    return {"before_vs_hf": max_abs(before, hf_before), "after_vs_hf": max_abs(after, hf_after),
            "after_vs_before": max_abs(after, before), "hf_moved": max_abs(hf_after, hf_before),
            "greedy_changed": sum(a != b for a, b in zip(text_before, text_after, strict=True)),
            "gap_mean": [h[GAP_MEAN] for h in logs], "gap_max": [h[GAP_MAX] for h in logs],
            "clip_logged": sum(any(k.endswith("clip_frac") for k in h) for h in trainer.state.log_history),
            "steps": trainer.state.global_step, "threads": __import__("torch").get_num_threads()}


def greedy(llm) -> list[str]:
    """vLLM's greedy completions of PROMPTS (16 tokens)."""
    from vllm import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


if __name__ == "__main__":
    name, model_dir, work = sys.argv[1:4]
    Path(work).mkdir(parents=True, exist_ok=True)
    result = {"weight_sync": weight_sync, "weight_sync_lora": lambda m, w: weight_sync(m, w, peft=True)}[name](
        model_dir, work)
    print(json.dumps(result))
