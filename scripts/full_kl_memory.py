"""truly_ppo's full-vocabulary KL at real vocabulary size: SmolLM2-135M-Instruct (V = 49,152), a benchmark.

(a) Error against the exact KL(pi_old || pi) on real logits, for both ways the trainer keeps pi_old per token
    (`full_kl_storage`): the final hidden state (pi_old's logits recomputed through its LM head) and the top-k +
    tail summary (trustclip.objectives.topk_kl) at several k. pi_old = the model; completions sampled from it (G per
    prompt, built-in arithmetic prompts through the chat template); pi = the same model after `--steps`
    policy-gradient updates of a LoRA adapter (r 32, alpha 64, Adam at `--lr`, random binary rewards, Dr.GRPO
    advantages): realistic RL steps, not pi == pi_old. Per valid completion token: max and mean |KL_approx - KL|,
    next to the size of the exact KL itself and of pi_old's tail mass.
(b) Peak memory and time of one generation batch (two updates, num_iterations 2; micro-batches of `--micro-batch`
    completions) with truly_ppo (each storage) against the same with kl3 (ATR-GRPO, TRL's fused log-prob path), same
    real-model LoRA configuration, completions forced to the full length. Each in a fresh subprocess, one after the
    other: peak RSS (VmHWM, reset through /proc/self/clear_refs once the model and trainer are built, so it is the
    training's peak). `--exact` adds top-k storage with k = V - 1 (the whole distribution stored: what exact storage
    of pi_old would cost).

    nice -n 15 python scripts/full_kl_memory.py [--part error|memory|all] [--ks 8,16,32,64,128,256]

Targets: max error <= 1e-2 nats per token at the default setting, truly_ppo's peak <= 1.1 x kl3's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
MODEL = "builtin:smollm2-135m-instruct"
LORA = {"r": 32, "lora_alpha": 64, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]}


def prompts(tokenizer, n: int) -> list[str]:
    from trustclip.data import format_prompt, make_synthetic_splits

    rows = make_synthetic_splits(seed=0, n_train=n, n_eval=0)["train"]
    return [format_prompt(r["problem"], tokenizer, style="math") for r in rows]


# ------------------------------------------------------------------ (a) error of the top-k KL on real logits
def completion_logprobs(model, ids, attention, n: int, temperature: float, rows: int = 8):
    """Full log-softmax (B, n, V) of the completion positions at the sampling temperature (no gradient)."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, ids.size(0), rows):
            logits = model(input_ids=ids[s:s + rows], attention_mask=attention[s:s + rows]).logits[:, -n - 1:-1]
            out.append(torch.log_softmax(logits.float() / temperature, -1))
    return torch.cat(out)


def error_part(args) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from trustclip.models import load_model_and_tokenizer
    from trustclip.objectives.topk_kl import exact_kl, topk_kl, topk_logprobs

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(MODEL)
    texts = [p for p in prompts(tokenizer, args.prompts) for _ in range(args.group)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0,
                             max_new_tokens=args.max_tokens, pad_token_id=tokenizer.pad_token_id)
    n = out.size(1) - enc.input_ids.size(1)
    completion = out[:, -n:]
    finished = (completion == tokenizer.eos_token_id).cumsum(1)
    mask = ((finished == 0) | ((finished == 1) & (completion == tokenizer.eos_token_id))).float()
    attention = torch.cat([enc.attention_mask, mask.long()], 1)
    print(f"sampled {len(texts)} completions ({int(mask.sum())} tokens, T = {args.temperature}) in "
          f"{time.perf_counter() - t0:.0f}s")
    old = completion_logprobs(model, out, attention, n, args.temperature)
    with torch.no_grad():  # "hidden" storage: pi_old's final hidden states, through its (frozen) LM head later
        hidden = torch.cat([model(input_ids=out[s:s + 8], attention_mask=attention[s:s + 8],
                                  output_hidden_states=True).hidden_states[-1][:, -n - 1:-1]
                            for s in range(0, out.size(0), 8)])

    policy = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=args.lr)
    rewards = torch.randint(0, 2, (args.prompts, args.group), generator=torch.Generator().manual_seed(1)).float()
    advantages = (rewards - rewards.mean(1, keepdim=True)).flatten()
    summaries = {k: topk_logprobs(old, k) for k in args.ks}
    valid = mask.bool()
    print(f"{'step':>4} {'k':>5} {'bytes/token':>11} {'max |err|':>10} {'mean |err|':>10} {'max tail mass':>13}"
          f"   (exact KL: mean / max)")
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        policy.train()
        for s in range(0, out.size(0), 8):  # policy gradient, Dr.GRPO normalisation, micro-batches of 8
            logits = policy(input_ids=out[s:s + 8], attention_mask=attention[s:s + 8]).logits[:, -n - 1:-1]
            logp = torch.log_softmax(logits.float() / args.temperature, -1).gather(
                -1, completion[s:s + 8].unsqueeze(-1)).squeeze(-1)
            loss = -(advantages[s:s + 8, None] * logp * mask[s:s + 8]).sum() / (out.size(0) * n)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        policy.eval()
        new = completion_logprobs(policy, out, attention, n, args.temperature)
        exact = exact_kl(old, new)[valid]
        with torch.no_grad():
            recomputed = torch.log_softmax(model.get_output_embeddings()(hidden).float() / args.temperature, -1)
        error = (exact - exact_kl(recomputed, new)[valid]).abs()
        print(f"{step:>4} {'hidden':>5} {4 * hidden.size(-1):>11} {error.max():>10.2e} {error.mean():>10.2e} "
              f"{'-':>13}   ({exact.mean():.4f} / {exact.max():.4f})")
        for k, summary in summaries.items():
            error = (exact - topk_kl(summary, new)[valid]).abs()
            tail = summary.tail_logprob.exp()[valid].max()
            print(f"{step:>4} {k:>5} {8 * k + 4:>11} {error.max():>10.2e} {error.mean():>10.2e} {tail:>13.3f}"
                  f"   ({exact.mean():.4f} / {exact.max():.4f})")
        print(f"     (update + scoring {time.perf_counter() - t:.0f}s)")
    vocab = old.size(-1)
    print(f"full storage: {4 * vocab} bytes/token (V = {vocab})")


# ------------------------------------------------------------------ (b) peak memory of a truly_ppo vs a kl3 step
def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def worker(objective: str, storage: str, topk: int, args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer
    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(MODEL)
    vocab = model.get_output_embeddings().weight.size(0)
    dataset = Dataset.from_list([{"prompt": p} for p in prompts(tokenizer, args.prompts)])
    config = TrustClipGRPOConfig(
        output_dir=f"/tmp/full_kl_memory-{objective}", objective=objective, full_kl_storage=storage,
        full_kl_topk=vocab - 1 if topk == -1 else topk, max_steps=2, num_iterations=2,
        per_device_train_batch_size=args.micro_batch, num_generations=args.group,
        gradient_accumulation_steps=args.prompts * args.group // args.micro_batch,
        max_completion_length=args.max_tokens, generation_kwargs={"min_new_tokens": args.max_tokens},
        temperature=args.temperature, learning_rate=2e-4, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, **checkpointing_off(),
         dataloader_num_workers=0,
    )
    trainer = TrustClipGRPOTrainer(
        model, reward_funcs=lambda completions, **_: [sum(c.isdigit() for c in x) / max(len(x), 1)
                                                       for x in completions],
        args=config, train_dataset=dataset, processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
    )
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # reset VmHWM: the peak below is the training's
        fh.write("5")
    t, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    return {"peak": _status("VmHWM"), "before": before, "seconds": seconds, "cpu_seconds": cpu,
            "step_times": [h["step_time"] for h in logs], "tokens": args.prompts * args.group * args.max_tokens}


def memory_part(args) -> None:
    from trustclip.objectives.topk_kl import DEFAULT_TOPK

    runs = [("kl3", "hidden", DEFAULT_TOPK, "kl3"), ("truly_ppo", "hidden", DEFAULT_TOPK, "truly_ppo hidden"),
            ("truly_ppo", "topk", DEFAULT_TOPK, f"truly_ppo top-{DEFAULT_TOPK}")]
    if args.exact:
        runs.append(("truly_ppo", "topk", -1, "truly_ppo top-(V-1)"))
    results = {}
    for objective, storage, topk, label in runs:
        cmd = [sys.executable, HERE, "--worker", objective, "--storage", storage, "--topk", str(topk),
               "--prompts", str(args.prompts), "--micro-batch", str(args.micro_batch),
               "--group", str(args.group), "--max-tokens", str(args.max_tokens), "--temperature",
               str(args.temperature), *(["--threads", str(args.threads)] if args.threads else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            sys.exit(f"{label} worker failed:\n{proc.stderr[-3000:]}")
        results[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[label]
        print(f"{label:<20} peak RSS {r['peak'] / 2**30:6.2f} GiB (model + trainer before training "
              f"{r['before'] / 2**30:.2f} GiB); one batch of {r['tokens']} completion tokens, 2 updates: "
              f"{r['seconds']:.0f} s wall, {r['cpu_seconds']:.0f} s CPU (TRL step_time "
              f"{', '.join(f'{s:.0f}' for s in r['step_times'])} s)", flush=True)
    base = results["kl3"]["peak"]
    for label, r in results.items():
        if label != "kl3":
            print(f"peak ratio {label} / kl3: {r['peak'] / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["error", "memory", "all"], default="all")
    parser.add_argument("--ks", default="8,16,32,64,128,256", help="k values of the error table")
    parser.add_argument("--steps", type=int, default=3, help="policy-gradient updates before each error table")
    parser.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate of those updates")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion length")
    parser.add_argument("--micro-batch", type=int, default=8, help="(b) completions per forward / backward")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the KL's too)")
    parser.add_argument("--exact", action="store_true", help="(b) also truly_ppo storing the whole distribution")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--storage", default="hidden", help=argparse.SUPPRESS)
    parser.add_argument("--topk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args.worker, args.storage, args.topk, args)))
        return
    print(f"SmolLM2-135M-Instruct, {args.prompts} prompts x G {args.group}, {args.max_tokens} tokens, "
          f"T = {args.temperature}")
    if args.part in ("error", "all"):
        error_part(args)
    if args.part in ("memory", "all"):
        memory_part(args)


if __name__ == "__main__":
    main()
