"""How far a LoRA policy's log-probs under bfloat16 autocast are from its float32 ones: PEFT's forward (the base
layer's output and the adapter's rounded to bfloat16 separately) against the merged product that `merged_lora_forward`
computes (trustclip.precision.merge_lora_under_autocast). On completions sampled from the run's merged policy in
bfloat16 (as `generation_dtype` samples) for the first prompts of its RL pool, at its RL temperature. Prints |log-prob
- float32 log-prob| per completion token, the time of one forward + backward of those completions in each form and in
float32, and what autograd keeps for the backward.

    python scripts/lora_autocast_gap.py runs/smollm2-vllm/runs/kl3/seed4            # its rl/final adapter
    python scripts/lora_autocast_gap.py runs/smollm2-vllm/runs/kl3/seed4 --adapter rl/checkpoint-80
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from trustclip import precision
from trustclip.models import load_model_and_tokenizer
from trustclip.settings import load_config
from trustclip.train.stages import rl_dataset


def completion_logps(policy, batch: dict, temperature: float, autocast: bool, grad: bool = False) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    n = batch["completion_ids"].size(1)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = policy(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(2, batch["completion_ids"][..., None])[..., 0]


def sample(policy, tokenizer, prompts: list[str], config) -> dict:
    """G completions per prompt from the merged bfloat16 copy of the policy (left-padded prompts)."""
    copy = precision.LowPrecisionCopy(policy, torch.bfloat16).model
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = copy.generate(**enc, do_sample=True, temperature=config.rl.temperature, top_p=1.0, top_k=0,
                            max_new_tokens=config.rl.max_completion_length,
                            num_return_sequences=config.rl.num_generations, pad_token_id=tokenizer.pad_token_id)
    completion = out[:, enc["input_ids"].size(1):]
    eos = torch.cumsum((completion == tokenizer.eos_token_id).int(), 1)
    completion_mask = ((eos == 0) | ((eos == 1) & (completion == tokenizer.eos_token_id))).int()
    repeat = config.rl.num_generations
    return {"prompt_ids": enc["input_ids"].repeat_interleave(repeat, 0),
            "prompt_mask": enc["attention_mask"].repeat_interleave(repeat, 0),
            "completion_ids": completion, "completion_mask": completion_mask}


def step_seconds(policy, batch: dict, temperature: float, autocast: bool, repeats: int = 3) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        (completion_logps(policy, batch, temperature, autocast, grad=True) * batch["completion_mask"]).sum().backward()
        policy.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[1:]


def saved_megabytes(policy, batch: dict, temperature: float, autocast: bool) -> float:
    """What autograd keeps for the backward of one forward (each tensor once), in MB."""
    seen: dict[tuple, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        completion_logps(policy, batch, temperature, autocast, grad=True)
    return sum(seen.values()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a trustclip train run with an RL stage (its config.yaml)")
    parser.add_argument("--adapter", default="rl/final", help="the adapter, relative to run_dir")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from peft import PeftModel

    config = load_config(args.run_dir / "config.yaml")
    model, tokenizer = load_model_and_tokenizer(config.model.name_or_path, dtype=torch.float32)
    policy = PeftModel.from_pretrained(model, str(args.run_dir / args.adapter), is_trainable=True).eval()
    prompts = rl_dataset(config, tokenizer)["prompt"][: args.prompts]
    torch.manual_seed(args.seed)
    batch = sample(policy, tokenizer, prompts, config)
    valid = batch["completion_mask"].bool()
    temperature = config.rl.temperature

    exact = completion_logps(policy, batch, temperature, autocast=False)[valid]
    peft = completion_logps(policy, batch, temperature, autocast=True)[valid]
    peft_time = step_seconds(policy, batch, temperature, autocast=True)
    float32_time = step_seconds(policy, batch, temperature, autocast=False)
    peft_saved = saved_megabytes(policy, batch, temperature, autocast=True)
    float32_saved = saved_megabytes(policy, batch, temperature, autocast=False)
    precision.merge_lora_under_autocast(policy)
    merged = completion_logps(policy, batch, temperature, autocast=True)[valid]
    merged_time = step_seconds(policy, batch, temperature, autocast=True)
    merged_saved = saved_megabytes(policy, batch, temperature, autocast=True)

    print(f"{args.run_dir / args.adapter}: {len(prompts)} prompts x {config.rl.num_generations}, {len(exact)} "
          f"completion tokens, T = {temperature}")
    print("| forward under bf16 autocast | mean abs(logp - float32 logp) | p99 | max | tokens > 1 nat "
          "| forward + backward (s) | saved for the backward (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, values, times, saved in (("PEFT (base and adapter rounded apart)", peft, peft_time, peft_saved),
                                       ("merged product (merged_lora_forward)", merged, merged_time, merged_saved),
                                       ("float32, no autocast (the reference)", exact, float32_time, float32_saved)):
        gap = (values - exact).abs()
        print(f"| {name} | {gap.mean():.4f} | {gap.quantile(0.99):.3f} | {gap.max():.2f} | {int((gap > 1).sum())} "
              f"| {min(times):.2f}-{max(times):.2f} | {saved:.0f} |")


if __name__ == "__main__":
    main()
