"""Overhead of TrustClipGRPOTrainer against TRL's built-in loss (a benchmark, not a test).

Same tiny model, seed, data and config; TRL's `loss_type="dapo"` (eps 0.2 / 0.28) against our `clip_higher`
with `token_mean` aggregation, which computes the same loss (tests/test_trainer.py checks equality), so both
runs generate the same completions and differ only in the loss code. Each run is a fresh subprocess (peak RSS
is per process); runs are interleaved A B B A ... so that drifting machine load hits both alike.

    python scripts/trainer_overhead.py [--steps 40] [--rounds 3] [--objective kl3 --aggregation dr_grpo]
                                          [--device cuda]

Prints median step time (TRL's `step_time`: generation + loss + backward + optimizer), the time of the loss
forward + backward alone, and peak memory (RSS on the CPU; on a GPU, torch's peak allocated GPU memory); then the
ratios ours / TRL. Targets: time <= 1.02, memory <= 1.00.
Separate processes are noisy on a shared machine (per-round ratios spread by +-10%), so it also times both
trainers alternated call by call in one process: the loss forward + backward and the generation side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def digit_fraction(completions, **_):
    """A dense, cheap reward, so that the loss code is a visible share of the step."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def build_trainer(kind: str, model, tokenizer, dataset, reward, objective: str, aggregation: str, **common):
    """TRL's GRPOTrainer with its built-in `dapo` loss (kind "trl"), or ours with `objective` (the same loss for
    clip_higher + token_mean); both with Dr.GRPO advantages (R - group mean)."""
    from trl import GRPOConfig, GRPOTrainer

    from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer

    if kind == "trl":
        args = GRPOConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="none", **common)
        return GRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    kwargs = {"epsilon_low": 0.2, "epsilon_high": 0.28} if objective == "clip_higher" else {}
    args = TrustClipGRPOConfig(objective=objective, objective_kwargs=kwargs, aggregation=aggregation,
                               advantage_estimator="dr_grpo", **common)
    return TrustClipGRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=dataset,
                                processing_class=tokenizer)


def worker(kind: str, steps: int, objective: str, aggregation: str, threads: int, device: str) -> dict:
    import resource

    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset

    from trustclip.data import build_prompt_rows, make_synthetic_splits
    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import build_tiny_model, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(build_tiny_model(seed=0))
    rows = build_prompt_rows(make_synthetic_splits(0, n_train=512, n_eval=1)["train"], tokenizer)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    common = dict(output_dir=f"/tmp/trustclip-bench-{kind}", max_steps=steps, per_device_train_batch_size=32,
                  num_generations=8, max_completion_length=32, learning_rate=1e-4, num_iterations=2, seed=0,
                  use_cpu=device == "cpu", bf16=False, **checkpointing_off(),
                  report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, temperature=1.0)

    trainer = build_trainer(kind, model, tokenizer, dataset, digit_fraction, objective, aggregation, **common)
    loss_times: list[float] = []
    compute_loss = trainer.compute_loss

    def timed_compute_loss(*a, **k):  # forward + loss; the backward below completes the entry
        loss_times.append(-time.perf_counter())
        return compute_loss(*a, **k)

    backward = trainer.accelerator.backward

    def timed_backward(loss, **k):
        backward(loss, **k)
        loss_times[-1] += time.perf_counter()

    trainer.compute_loss, trainer.accelerator.backward = timed_compute_loss, timed_backward
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":  # the GPU's own peak; RSS is the host's
        peak, rss_before = torch.cuda.max_memory_allocated() / 1024, 0
    step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    warm = max(2, steps // 5)  # drop warm-up steps
    return {"step_s": statistics.median(step_times[warm:]), "loss_s": statistics.median(loss_times[2 * warm:]),
            "peak_rss_mb": peak / 1024, "rss_before_mb": rss_before / 1024}


def alternated_microbenchmark(objective: str, aggregation: str, threads: int, device: str, repeats: int = 60) -> dict:
    """Both trainers alternated call by call in one process, so machine-load drift cancels: the loss forward +
    backward on one fixed batch (B=32, T=32, ratios != 1), and the generation side (sampling, rewards,
    advantages, old log-probs) on the same prompts with the same sampling seed."""
    import copy

    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset

    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import build_tiny_model, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(build_tiny_model(seed=0))
    common = dict(output_dir="/tmp/trustclip-bench-micro", per_device_train_batch_size=32, num_generations=8,
                  max_completion_length=32, num_iterations=2, use_cpu=device == "cpu", bf16=False,
                  **checkpointing_off(), report_to="none")
    data = Dataset.from_list([{"prompt": "Compute 1+2.\n"}] * 8)

    trl, ours = (build_trainer(kind, copy.deepcopy(model), tokenizer, data, digit_fraction, objective, aggregation,
                               **common) for kind in ("trl", "trustclip"))
    g = torch.Generator().manual_seed(0)
    prompt = tokenizer(["Compute 12+35.\n"] * 32, return_tensors="pt", add_special_tokens=False)
    completion_ids = torch.randint(5, 60, (32, 32), generator=g)
    mask = (torch.arange(32)[None] < torch.randint(8, 33, (32, 1), generator=g)).long()
    batch = {"prompt_ids": prompt["input_ids"], "prompt_mask": prompt["attention_mask"],
             "completion_ids": completion_ids, "completion_mask": mask, "advantages": torch.randn(32, generator=g),
             "num_items_in_batch": mask.sum()}
    with torch.no_grad():
        old, _, _ = trl._get_per_token_logps_and_entropies(
            trl.model, torch.cat([batch["prompt_ids"], completion_ids], 1).to(trl.accelerator.device),
            torch.cat([batch["prompt_mask"], mask], 1).to(trl.accelerator.device), 32)
    batch["old_per_token_logps"] = (old.cpu() + 0.2 * torch.randn(old.shape, generator=g)).clamp(max=0.0)
    batch = {k: v.to(trl.accelerator.device) for k, v in batch.items()}
    for trainer in (trl, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    ours.count_slices([batch])

    def loss_step(trainer) -> None:
        trainer.compute_loss(trainer.model, batch).backward()
        trainer.model.zero_grad(set_to_none=True)

    # Generation side (sampling, rewards, advantages, old log-probs): same prompts and sampling seed for both.
    prompts = [{"prompt": "Compute 12+35-7.\n"}, {"prompt": "Compute (4+5)*3.\n"}, {"prompt": "Compute 9-2.\n"},
               {"prompt": "Compute 61+8.\n"}]
    inputs = [row for row in prompts for _ in range(8)]
    loss = alternate(trl, ours, loss_step, repeats, warmup=5)
    generation = alternate(trl, ours, lambda trainer: trainer._generate_and_score_completions(inputs), repeats // 3,
                           warmup=3)
    return {"trl_ms": loss["trl_ms"], "ours_ms": loss["ours_ms"], "ratio": loss["ratio"],
            "trl_gen_ms": generation["trl_ms"], "ours_gen_ms": generation["ours_ms"], "gen_ratio": generation["ratio"]}


def alternate(trl, ours, call, repeats: int, warmup: int) -> dict[str, float]:
    """Time `call(trainer)` for both trainers, alternating which goes first, with the same torch seed per pair:
    median milliseconds of each and the median of the paired ratios ours / TRL."""
    import torch

    times: dict[str, list[float]] = {"trl": [], "trustclip": []}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # GPU calls return early
    for i in range(repeats + warmup):
        for name, trainer in (("trl", trl), ("trustclip", ours)) if i % 2 else (("trustclip", ours), ("trl", trl)):
            torch.manual_seed(i)
            sync()
            start = time.perf_counter()
            call(trainer)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    paired = [a / b for a, b in zip(times["trustclip"], times["trl"], strict=True)]
    return {"trl_ms": 1000 * statistics.median(times["trl"]), "ours_ms": 1000 * statistics.median(times["trustclip"]),
            "ratio": statistics.median(paired)}


def run_worker(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, HERE, "--worker", kind, "--steps", str(args.steps), "--objective", args.objective,
           "--aggregation", args.aggregation, "--threads", str(args.threads), "--device", args.device]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"worker {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--objective", default="clip_higher")
    parser.add_argument("--aggregation", default="token_mean")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worker", choices=["trl", "trustclip", "micro"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not args.worker:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is visible to torch")
    if args.worker == "micro":
        print(json.dumps(alternated_microbenchmark(args.objective, args.aggregation, args.threads, args.device)))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.objective, args.aggregation, args.threads, args.device)))
        return
    load = os.getloadavg()[0]
    results: dict[str, list[dict]] = {"trl": [], "trustclip": []}
    for r in range(args.rounds):
        for kind in (("trl", "trustclip") if r % 2 == 0 else ("trustclip", "trl")):
            results[kind].append(run_worker(kind, args))
            print(f"round {r + 1} {kind:<9}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[kind][-1].items()),
                  flush=True)
    med = {k: {m: statistics.median(r[m] for r in runs) for m in runs[0]} for k, runs in results.items()}
    ours = f"trustclip {args.objective}/{args.aggregation}"
    print(f"\ntiny Qwen3, {args.steps} steps x {args.rounds} rounds interleaved, {args.threads} threads, "
          f"load average at start {load:.2f} (end {os.getloadavg()[0]:.2f})")
    memory = "peak GPU (MB)" if args.device == "cuda" else "peak RSS (MB)"
    print(f"{'':<36}{'step time (ms)':>16}{'loss fwd+bwd (ms)':>19}{memory:>15}")
    for name, m in (("TRL GRPOTrainer loss_type=dapo", med["trl"]), (ours, med["trustclip"])):
        print(f"{name:<36}{1000 * m['step_s']:>16.1f}{1000 * m['loss_s']:>19.1f}{m['peak_rss_mb']:>15.1f}")
    t, o = med["trl"], med["trustclip"]
    print(f"{'ratio ours / TRL':<36}{o['step_s'] / t['step_s']:>16.3f}{o['loss_s'] / t['loss_s']:>19.3f}"
          f"{o['peak_rss_mb'] / t['peak_rss_mb']:>15.3f}   (targets: time <= 1.02, memory <= 1.00)")
    spread = [b["step_s"] / a["step_s"] for a, b in zip(results["trl"], results["trustclip"], strict=True)]
    print(f"per-round step-time ratios: {', '.join(f'{r:.3f}' for r in spread)} (run-to-run noise on a shared machine)")
    micro = run_worker("micro", args)
    print("alternated call by call in one process (machine-load drift cancels):")
    print(f"  loss fwd+bwd, same batch:                TRL {micro['trl_ms']:.1f} ms, ours {micro['ours_ms']:.1f} ms, "
          f"median ratio {micro['ratio']:.3f}")
    print(f"  generation + rewards + old log-probs:    TRL {micro['trl_gen_ms']:.1f} ms, ours "
          f"{micro['ours_gen_ms']:.1f} ms, median ratio {micro['gen_ratio']:.3f}")
    trl_ms, ours_ms = micro["trl_ms"] + micro["trl_gen_ms"], micro["ours_ms"] + micro["ours_gen_ms"]
    print(f"  the two together (the optimizer step is the same code): ratio {ours_ms / trl_ms:.3f}")


if __name__ == "__main__":
    main()
