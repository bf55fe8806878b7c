"""Benchmark (not a test): cost of trustclip's policy loss vs a bare inline PPO loss.

For each objective, forward + backward of `compute_policy_loss` (validation, the objective, aggregation
and the float metrics) on a (B, T) batch, against the minimal clip-higher loss a trainer would inline
(the loss TRL computes for loss_type="dapo"), interleaved in one run so that both see the same machine
state. Prints the median time per call and the ratio. This measures the loss layer only; in training
it is dwarfed by the model's forward/backward (see benchmarks/trainer_overhead.py).

    python benchmarks/objective_overhead.py [--batch 16] [--length 1024] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import trustclip as tc


def inline_dapo(logp, old_logp, adv, mask):
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    return (per_token * mask).sum() / mask.sum()


def time_call(fn, logp) -> float:
    x = logp.detach().clone().requires_grad_(True)
    start = time.perf_counter()
    loss = fn(x)
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.length)
    old = -torch.rand(shape, generator=gen) * 3
    logp = (old + 0.3 * torch.randn(shape, generator=gen)).clamp(max=0)
    adv = torch.randn(args.batch, generator=gen)
    mask = (torch.arange(args.length)[None] < torch.randint(1, args.length + 1, (args.batch,), generator=gen)[:, None])
    extras = {"entropy": torch.rand(shape, generator=gen), "full_kl": torch.rand(shape, generator=gen) * 0.05}
    baseline = lambda x: inline_dapo(x, old, adv, mask.float())  # noqa: E731

    print(f"batch {shape}, {int(mask.sum())} valid tokens, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats} interleaved forward+backward calls")
    print(f"{'objective':<12} {'trustclip ms':>12} {'inline ms':>10} {'ratio':>7}")
    for row in tc.list_objectives():
        name = row["name"]
        if name == "general":
            continue
        objective = tc.get_objective(name)
        needed = {k: extras[k] for k in objective.requires}

        def ours(x, objective=objective, needed=needed):
            return tc.compute_policy_loss(objective, logp=x, old_logp=old, advantages=adv, mask=mask,
                                          aggregation="token_mean", **needed)[0]

        ours_t, base_t = [], []
        for _ in range(3):  # warm-up
            time_call(ours, logp), time_call(baseline, logp)
        for _ in range(args.repeats):
            ours_t.append(time_call(ours, logp))
            base_t.append(time_call(baseline, logp))
        a, b = statistics.median(ours_t) * 1e3, statistics.median(base_t) * 1e3
        print(f"{name:<12} {a:12.2f} {b:10.2f} {a / b:7.2f}")


if __name__ == "__main__":
    main()
