"""Benchmark (not a test): cost of trustclip's policy loss vs a bare inline PPO loss.

For each objective, forward + backward of `compute_policy_loss` (validation, the objective, aggregation) on a
(B, T) batch, against the minimal clip-higher loss a trainer would inline (the loss TRL computes for
loss_type="dapo"), interleaved in one run so that both see the same machine state. `compute_policy_loss` returns
its metrics reduced when first read, so it is timed twice: the loss alone (`loss ms`, what the inline loss
computes) and the loss with its metrics read (`+metrics ms`: clip fractions, ratio mean / extremes, KL3, the
objective's statistics, one device-to-host transfer). Prints the median time per call and both ratios to the
inline loss. This measures the loss layer only; in training it is dwarfed by the model's forward/backward (see
benchmarks/trainer_overhead.py).

The ratio objectives (the issue-26 target, at most 1.5x the inline loss at B 16 x T 1024) are those whose per-token
loss is a function of the ratio (per token, or GSPO's per sequence) and the advantage alone, with constant bounds or
gates: unconstrained, clip, clip_higher, dual_clip, kl1, kl2, kl3, is_kl3, atr_adaptive, sapo, cispo, aspo, gspo,
atr_seq. The others need more per token: dcpo and trgppo bounds from the old token probability (trgppo solves them
by Newton's method), truly_ppo a full-vocabulary KL input, clip_cov / kl_cov a batch covariance and a selection.

    python benchmarks/objective_overhead.py [--batch 16] [--length 1024] [--repeats 30] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import trustclip as tc

RATIO_OBJECTIVES = ("unconstrained", "clip", "clip_higher", "dual_clip", "kl1", "kl2", "kl3", "is_kl3",
                    "atr_adaptive", "sapo", "cispo", "aspo", "gspo", "atr_seq")


def inline_dapo(logp, old_logp, adv, mask):
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    return (per_token * mask).sum() / mask.sum()


def time_call(fn, logp) -> float:
    x = logp.detach().clone().requires_grad_(True)
    sync = torch.cuda.synchronize if logp.is_cuda else (lambda: None)  # a GPU call returns before its kernels end
    sync()
    start = time.perf_counter()
    loss = fn(x)
    loss.backward()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="torch device of the batch, e.g. cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length)
    old = -torch.rand(shape, generator=gen) * 3
    logp = (old + 0.3 * torch.randn(shape, generator=gen)).clamp(max=0)
    adv = torch.randn(args.batch, generator=gen)
    mask = (torch.arange(args.length)[None] < torch.randint(1, args.length + 1, (args.batch,), generator=gen)[:, None])
    extras = {"entropy": torch.rand(shape, generator=gen), "full_kl": torch.rand(shape, generator=gen) * 0.05}
    old, logp, adv, mask = (t.to(args.device) for t in (old, logp, adv, mask))
    extras = {k: v.to(args.device) for k, v in extras.items()}
    baseline = lambda x: inline_dapo(x, old, adv, mask.float())  # noqa: E731

    print(f"batch {shape} on {args.device}, {int(mask.sum())} valid tokens, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats} interleaved forward+backward calls")
    print(f"{'objective':<14} {'loss ms':>8} {'+metrics ms':>11} {'inline ms':>9} {'ratio':>6} {'+metrics':>8}")
    worst = [0.0, 0.0]
    for row in tc.list_objectives():
        name = row["name"]
        if name == "general":
            continue
        objective = tc.get_objective(name)
        needed = {k: extras[k] for k in objective.requires}

        def loss_only(x, objective=objective, needed=needed):
            return tc.compute_policy_loss(objective, logp=x, old_logp=old, advantages=adv, mask=mask,
                                          aggregation="token_mean", **needed)[0]

        def with_metrics(x, objective=objective, needed=needed):
            loss, metrics = tc.compute_policy_loss(objective, logp=x, old_logp=old, advantages=adv, mask=mask,
                                                   aggregation="token_mean", **needed)
            dict(metrics)  # read them: the reduction and its transfer happen here
            return loss

        calls = (loss_only, with_metrics, baseline)
        times = [[], [], []]
        for _ in range(3):  # warm-up
            for fn in calls:
                time_call(fn, logp)
        for _ in range(args.repeats):
            for fn, series in zip(calls, times, strict=True):
                series.append(time_call(fn, logp))
        ours, ours_metrics, inline = (statistics.median(t) * 1e3 for t in times)
        ratios = ours / inline, ours_metrics / inline
        if name in RATIO_OBJECTIVES:
            worst = [max(w, r) for w, r in zip(worst, ratios, strict=True)]
        flag = "" if name in RATIO_OBJECTIVES else "  (not a ratio objective)"
        print(f"{name:<14} {ours:8.2f} {ours_metrics:11.2f} {inline:9.2f} {ratios[0]:6.2f} {ratios[1]:8.2f}{flag}")
    print(f"ratio objectives, worst ratio to the inline loss: {worst[0]:.2f} (loss), {worst[1]:.2f} (loss + metrics)")


if __name__ == "__main__":
    main()
