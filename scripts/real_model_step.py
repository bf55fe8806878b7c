"""One RL optimizer step of the SmolLM2 recipe on this machine: float32 (as before mixed precision), then each kept
speed lever added in turn, the last row being the recipe itself (a benchmark, not a test).

    python scripts/real_model_step.py [--recipe recipes/smollm2_arith.yaml] [--steps 4] [--rounds 2]

The batch is the recipe's (prompts x G completions, micro-batches, updates per generation batch), read from the
recipe itself. Every completion is generated to the recipe's full `max_completion_length` (min_new_tokens), and
the reward is a dense one (the fraction of digits), so every configuration does the same work on the same number
of tokens: only the levers differ. Each (configuration, round) is a fresh process (its own peak RSS); the
configurations are interleaved round by round so drifting machine load hits all alike.

Per configuration it prints the median seconds per optimizer step, split into generation (TRL's
`_generate_single_turn`), the scoring forward (the old log-probs, no gradient) and the update (forward + backward +
optimizer), the ratio to float32, and peak RSS. Every configuration but the recipe scores every slice of a
generation batch, as TRL does; the recipe's trainer skips the scoring forward of the slices used only before the next
optimizer update (their ratio is exactly 1). Then the generation levers one by one (32 x L tokens: autocast, a
merged bfloat16 copy, a static KV cache, half batches, the evaluation's entropy recorder, the prompt's prefill
share) and the bf16 log-prob error per token on real SmolLM2 completions (the trainer's path: autocast body, float32
LM head and log-softmax; and the bfloat16 sampling copy's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer_overhead import digit_fraction  # a dense reward: every row is updated in every configuration alike

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
# name -> overrides of the recipe, each lever added to the ones above it. "float32" is the recipe without its speed
# levers (how it ran before them).
FLOAT32 = ["bf16=false", "data.system_prompt=null", "rl.trl_kwargs={}"]
CONFIGS = {
    "float32": FLOAT32,
    "+ bf16 autocast": [*FLOAT32[1:], "bf16=true"],
    "+ empty system prompt": ["rl.trl_kwargs={}", "bf16=true", "data.system_prompt=''"],
    "+ bf16 sampling copy": [],
    "+ on-policy slices unscored": [],  # = the recipe, with every kept lever
}
# Configurations that score every slice of a generation batch, as TRL does (before the trainer skipped the scoring
# forward of the slices used only before the next optimizer update).
SCORE_EVERY_SLICE = set(list(CONFIGS)[:-1])


def recipe_config(recipe: str, overrides: list[str], steps: int, out: Path):
    from trustclip.settings import load_config

    config = load_config(recipe, [*overrides, f"output_dir={out}", f"rl.max_steps={steps}", "report_to=[]",
                                  "rl.skip_zero_advantage=false", "rl.save_steps=100000"])
    length = config.rl.max_completion_length
    config.rl.trl_kwargs = {**config.rl.trl_kwargs, "generation_kwargs": {"min_new_tokens": length}}
    return config


class Timer:
    """Wall seconds spent inside wrapped callables, by label."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, label: str, fn, only=lambda *a, **k: True):
        def timed(*args, **kwargs):
            if not only(*args, **kwargs):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - start
        return timed


def worker(name: str, recipe: str, steps: int, threads: int, scratch: Path) -> dict:
    """Train `steps` optimizer steps of configuration `name` after one warm-up generation batch; seconds per step."""
    import resource

    import torch

    torch.set_num_threads(threads)
    from trustclip.integrations.trl import TrustClipGRPOTrainer
    from trustclip.train.stages import grpo_config, load_policy, lora_config, rl_dataset

    config = recipe_config(recipe, CONFIGS[name], steps, scratch)
    model, tokenizer = load_policy(config.model.name_or_path, config)
    args = grpo_config(config, scratch / "rl")
    trainer = TrustClipGRPOTrainer(model, reward_funcs=digit_fraction, args=args, processing_class=tokenizer,
                                   train_dataset=rl_dataset(config, tokenizer), peft_config=lora_config(config))
    if name in SCORE_EVERY_SLICE:
        trainer._step_counts.on_policy_slices = lambda _step: [False] * args.steps_per_generation
    timer = Timer()
    trainer._generate_single_turn = timer.wrap("generation", trainer._generate_single_turn)
    scoring = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = timer.wrap("scoring", scoring,
                                                            lambda *a, **k: not torch.is_grad_enabled())
    marks: list[float] = []
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_step_end(self, *_args, **_kwargs):
            marks.append(time.perf_counter())
            marks_spent.append(dict(timer.spent))

    marks_spent: list[dict] = []
    trainer.add_callback(Marks())
    start = time.perf_counter()
    trainer.train()
    # The first generation batch (its `per_generation` steps) warms up: measure the steps after it.
    per_generation = args.num_iterations * args.steps_per_generation // args.gradient_accumulation_steps
    first, last = per_generation - 1, len(marks) - 1
    if last <= first:
        raise SystemExit(f"--steps must exceed one generation batch ({per_generation} steps)")
    n = last - first
    spent = {k: (marks_spent[last].get(k, 0.0) - marks_spent[first].get(k, 0.0)) / n
             for k in ("generation", "scoring")}
    total = (marks[last] - marks[first]) / n
    return {"name": name, "step_s": total, "generation_s": spent["generation"], "scoring_s": spent["scoring"],
            "update_s": total - spent["generation"] - spent["scoring"], "steps": n,
            "wall_s": time.perf_counter() - start,
            "prompt_tokens": int(trainer._buffered_inputs[0]["prompt_ids"].size(1)),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def generation_levers(recipe: str, threads: int, rounds: int) -> dict[str, float]:
    """Seconds to sample one generation batch (prompts x G completions of L tokens) from the LoRA policy."""
    import torch
    from peft import get_peft_model

    from trustclip.data import format_prompt
    from trustclip.evaluation.generation import entropy_recorder
    from trustclip.precision import LowPrecisionCopy
    from trustclip.train.stages import load_policy, lora_config

    torch.set_num_threads(threads)
    config = recipe_config(recipe, [], 1, Path("/tmp"))
    model, tokenizer = load_policy(config.model.name_or_path, config)
    peft_config = lora_config(config)
    peft_config.init_lora_weights = False  # a trained-looking adapter: its deltas are not zero
    policy = get_peft_model(model, peft_config).eval()
    size, length = config.rl.per_device_train_batch_size * config.rl.gradient_accumulation_steps, \
        config.rl.max_completion_length
    prompt = format_prompt("Compute 12+35-7.", tokenizer, config.data.prompt_style, config.data.system_prompt)
    enc = tokenizer([prompt] * size, return_tensors="pt")
    copy = LowPrecisionCopy(policy, torch.bfloat16)

    def sample(model, new_tokens=length, batch=size, autocast=False, **kwargs):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for i in range(0, size, batch):
                rows = {key: value[i:i + batch] for key, value in enc.items()}
                model.generate(**rows, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                               pad_token_id=tokenizer.pad_token_id, **kwargs)

    variants = {
        "policy, float32": lambda: sample(policy),
        "policy, bf16 autocast": lambda: sample(policy, autocast=True),
        "bf16 merged copy (refresh included)": lambda: sample(copy.refresh(policy)),
        "bf16 merged copy, static KV cache": lambda: sample(copy.refresh(policy), cache_implementation="static"),
        "bf16 merged copy, half batches": lambda: sample(copy.refresh(policy), batch=size // 2),
        # the evaluation's per-step entropy (trustclip.evaluation.generation): one log-softmax of the logits a token
        "bf16 merged copy + entropy recorder": lambda: sample(copy.refresh(policy),
                                                             logits_processor=[entropy_recorder()]),
        "bf16 merged copy, prefill only (1 token)": lambda: sample(copy.refresh(policy), new_tokens=1),
    }
    sample(copy.refresh(policy), new_tokens=2)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, run in variants.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()} | {
        "batch": size, "new_tokens": length, "prompt_tokens": enc["input_ids"].size(1)}


def logprob_error(recipe: str, threads: int) -> dict[str, float]:
    """Per-token |error| against float32 on real SmolLM2 completions (32 sampled at T = 1): of the log-probs, and of
    the log-ratio log pi_new - log pi_old after one update of a fresh LoRA adapter (what the constraint acts on)."""
    import torch
    from peft import get_peft_model

    from trustclip.data import format_prompt
    from trustclip.precision import LowPrecisionCopy
    from trustclip.train.stages import load_policy, lora_config

    torch.set_num_threads(threads)
    config = recipe_config(recipe, [], 1, Path("/tmp"))
    model, tokenizer = load_policy(config.model.name_or_path, config)
    policy = get_peft_model(model, lora_config(config)).eval()  # fresh adapter: B = 0, the RL start
    torch.manual_seed(0)
    problems = [f"Compute {a}+{b}-{c}." for a, b, c in [(12, 35, 7), (3, 18, 9), (20, 4, 11), (7, 7, 13)]]
    prompts = [format_prompt(p, tokenizer, config.data.prompt_style, config.data.system_prompt) for p in problems]
    enc = tokenizer(prompts * 8, return_tensors="pt", padding=True)
    start = enc["input_ids"].size(1)
    with torch.no_grad():
        ids = policy.generate(**enc, max_new_tokens=config.rl.max_completion_length, do_sample=True, temperature=1.0,
                              pad_token_id=tokenizer.pad_token_id)
        mask = torch.cat([enc["attention_mask"], (ids[:, start:] != tokenizer.pad_token_id)], 1)
        completion, real = ids[:, start:], mask[:, start:].bool()
        head = policy.get_output_embeddings().weight.float()

        def logps(autocast: bool):  # the trainer's path: autocast body, float32 LM head and log-softmax
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                hidden = policy.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = hidden[:, start - 1:-1].float() @ head.T
            return torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)

        old = {flag: logps(flag) for flag in (False, True)}
        copy = LowPrecisionCopy(policy, torch.bfloat16).refresh(policy)
        low = torch.log_softmax(copy(input_ids=ids, attention_mask=mask).logits[:, start - 1:-1].float(), -1)
        low = low.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        for name, param in policy.named_parameters():  # one update's worth of change in the adapter
            if "lora_B" in name:
                param.normal_(0.0, 2e-4)
        new = {flag: logps(flag) for flag in (False, True)}
    measured = {
        "log-prob, bf16 autocast + float32 head (the trainer)": old[True] - old[False],
        "log-prob, bf16 sampling copy": low - old[False],
        "log-ratio after one update, the trainer": (new[True] - old[True]) - (new[False] - old[False]),
    }
    out = {"tokens": int(real.sum()), "update |log-ratio| in float32": (new[False] - old[False])[real].abs().mean()}
    for name, value in measured.items():
        error = value[real].abs()
        out[name] = {"mean": error.mean().item(), "p99": error.quantile(0.99).item(), "max": error.max().item()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2_arith.yaml"))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first generation batch's "
                        "steps are a warm-up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated sections: steps, generation, error")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.recipe, args.steps, args.threads, Path(args.scratch))))
        return
    sections = set(args.only.split(",")) if args.only else {"steps", "generation", "error"}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"recipe {args.recipe}; {args.threads} torch threads; machine load average {os.getloadavg()[0]:.2f}")
    if "steps" in sections:
        import tempfile

        results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for round_ in range(args.rounds):
            for name in CONFIGS:
                with tempfile.TemporaryDirectory() as scratch:
                    proc = subprocess.run([sys.executable, str(HERE), "--worker", name, "--recipe", args.recipe,
                                           "--steps", str(args.steps), "--threads", str(args.threads),
                                           "--scratch", scratch], capture_output=True, text=True, env=env)
                if proc.returncode:
                    raise SystemExit(f"{name}: failed\n{proc.stderr[-3000:]}")
                results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"  round {round_}: {name}: {results[name][-1]['step_s']:.1f} s/step", flush=True)
        base = statistics.median(r["step_s"] for r in results["float32"])
        print("\nRL optimizer step, median over rounds (seconds; ratio = step / float32 step):")
        print(f"{'configuration':30s} {'step':>7s} {'gen':>7s} {'score':>7s} {'update':>7s} {'ratio':>6s} "
              f"{'prompt':>6s} {'peak RSS':>9s}")
        for name, runs in results.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("step_s", "generation_s", "scoring_s",
                                                                     "update_s", "peak_rss_gib")}
            print(f"{name:30s} {med['step_s']:7.2f} {med['generation_s']:7.2f} {med['scoring_s']:7.2f} "
                  f"{med['update_s']:7.2f} {med['step_s'] / base:6.3f} {runs[0]['prompt_tokens']:6d} "
                  f"{med['peak_rss_gib']:7.2f} GiB")
    if "generation" in sections:
        levers = generation_levers(args.recipe, args.threads, args.rounds)
        size, length, prompt = levers.pop("batch"), levers.pop("new_tokens"), levers.pop("prompt_tokens")
        print(f"\nGeneration of {size} x {length} tokens from a {prompt}-token prompt, median seconds:")
        base = levers["policy, float32"]
        for key, value in levers.items():
            print(f"  {key:42s} {value:7.2f}  ({value / base:.3f} x float32)")
    if "error" in sections:
        error = logprob_error(args.recipe, args.threads)
        print(f"\nError per token against float32, {error.pop('tokens')} completion tokens of SmolLM2 (nats); the "
              f"update moves the float32 log-ratio by {error.pop('update |log-ratio| in float32'):.2e} on average:")
        for key, value in error.items():
            print(f"  {key:44s} mean {value['mean']:.2e}  p99 {value['p99']:.2e}  max {value['max']:.2e}")


if __name__ == "__main__":
    main()
