"""Benchmark (not a test): cost of trustclip's policy loss vs a bare inline PPO loss, eager and fused.

For each objective, forward + backward of `compute_policy_loss` (validation, the objective, aggregation) on a
(B, T) batch, against the minimal clip-higher loss a trainer would inline (the loss TRL computes for
loss_type="dapo"), interleaved in one run so that all see the same machine state. `compute_policy_loss` returns
its metrics reduced when first read, so each path is timed twice: the loss alone (`eager`, `fused`: what the inline
loss computes) and the loss with its metrics read (`eager+m`, `fused+m`: clip fractions, ratio mean / extremes, KL3,
the objective's statistics, one device-to-host transfer). Prints the median time per call, the ratios to the inline
loss, and the kernels one call runs. This measures the loss layer only; in training it is dwarfed by the model's
forward/backward (see scripts/trainer_overhead.py).

The fused path (`compute_policy_loss(..., fused=True)`, `trustclip.objectives.fused`) runs the objective, the
aggregation and the metrics' totals as one `torch.compile`d graph (validation stays eager); its first call per
objective compiles it (`compile s`, not in the medians). Kernels per call are counted on a CPU only, as the proxy for
a GPU's launch cost: the ATen operations that run a kernel (leaves of the profiler's tree, without views and
allocations) plus inductor's generated kernels.

The ratio objectives (targets at B 16 x T 1024 on a GPU: eager at most 1.5x the inline loss (issue 26); fused at
most 1.2x, 1.5x with its metrics (issue 40)) are those whose per-token loss is a function of the ratio (per token, or
GSPO's per sequence) and the advantage alone, with constant bounds or gates: unconstrained, clip, clip_higher,
dual_clip, kl1, kl2, kl3, is_kl3, atr_adaptive, sapo, cispo, aspo, gspo, atr_seq. The others need more per token:
dcpo and trgppo bounds from the old token probability (trgppo solves them by Newton's method), truly_ppo a
full-vocabulary KL input, clip_cov / kl_cov a batch covariance and a selection (these two have no fused path).

    python scripts/objective_overhead.py [--batch 16] [--length 1024] [--repeats 30] [--device cuda]
        [--objectives kl3,clip | ratio] [--no-fused] [--backend inductor]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time

import torch

import trustclip as tc
from trustclip.objectives.fused import UNFUSABLE

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


# ATen operations that run no kernel: views, allocations, and `to` / `reshape`, whose kernel (if any) is a child
NOT_KERNELS = {"aten::" + name for name in (
    "detach", "detach_", "view", "unsqueeze", "squeeze", "expand", "alias", "as_strided", "slice", "select", "t",
    "transpose", "permute", "_unsafe_view", "_reshape_alias", "reshape", "lift_fresh", "resolve_conj", "resolve_neg",
    "empty", "empty_strided", "empty_like", "to", "set_")}


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null: the profiler's C++ side prints two lines per use there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def count_kernels(fn, logp) -> int:
    """Kernels one forward + backward call runs: the leaf ATen operations that run one, and inductor's kernels."""
    x = logp.detach().clone().requires_grad_(True)
    with quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(x).backward()

    def is_kernel(event) -> bool:
        if "cpp_fused" in event.name or event.name.startswith("triton_"):
            return True
        return (event.name.startswith("aten::") and event.name not in NOT_KERNELS
                and not any(child.name.startswith("aten::") for child in event.cpu_children))

    return sum(is_kernel(event) for event in prof.events())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="torch device of the batch, e.g. cuda")
    parser.add_argument("--objectives", default=None,
                        help="comma-separated names, or 'ratio' for the ratio objectives (default: every objective)")
    parser.add_argument("--no-fused", dest="fused", action="store_false", help="leave the fused path out")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the fused path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.fused:  # inductor's CPU kernels then show in the profiler, to be counted (no effect on a GPU)
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
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
    paths = {"eager": False, "fused": args.backend} if args.fused else {"eager": False}
    names = [row["name"] for row in tc.list_objectives() if row["name"] != "general"]
    if args.objectives:
        names = list(RATIO_OBJECTIVES) if args.objectives == "ratio" else args.objectives.split(",")
    counting = logp.device.type == "cpu"

    print(f"batch {shape} on {args.device}, {int(mask.sum())} valid tokens, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats} interleaved forward+backward calls; ratios to the inline loss; kernels per call"
          + ("" if counting else " counted on a CPU only"))
    columns = [f"{path}{part}" for path in paths for part in ("", "+m")]
    print(f"{'objective':<14} " + " ".join(f"{c + ' ms':>10}" for c in columns) + f" {'inline ms':>9} | "
          + " ".join(f"{c:>8}" for c in columns) + " | " + " ".join(f"{c:>8}" for c in columns) + f" {'inline':>6}"
          + (f" | {'compile s':>9}" if args.fused else ""))
    worst = {c: 0.0 for c in columns}
    for name in names:
        objective = tc.get_objective(name)
        needed = {k: extras[k] for k in objective.requires}
        fusable = name not in UNFUSABLE

        def loss_of(x, fused, read_metrics, objective=objective, needed=needed):
            loss, metrics = tc.compute_policy_loss(objective, logp=x, old_logp=old, advantages=adv, mask=mask,
                                                   aggregation="token_mean", fused=fused, **needed)
            if read_metrics:
                dict(metrics)  # read them: the reduction (eager) and the transfer happen here
            return loss

        calls = {f"{path}{part}": functools.partial(loss_of, fused=fused, read_metrics=part == "+m")
                 for path, fused in paths.items() for part in ("", "+m") if fusable or not fused}
        compile_s = time_call(calls["fused"], logp) if "fused" in calls else math.nan  # the first call compiles
        calls["inline"] = baseline
        times = {key: [] for key in calls}
        for _ in range(3):  # warm-up
            for fn in calls.values():
                time_call(fn, logp)
        for _ in range(args.repeats):
            for key, fn in calls.items():
                times[key].append(time_call(fn, logp))
        ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        ratios = {key: ms[key] / ms["inline"] for key in calls if key != "inline"}
        kernels = {key: count_kernels(fn, logp) for key, fn in calls.items()} if counting else {}
        if name in RATIO_OBJECTIVES:
            worst = {key: max(value, ratios.get(key, 0.0)) for key, value in worst.items()}
        flag = "" if name in RATIO_OBJECTIVES else "  (not a ratio objective)"
        if not fusable:
            flag += "  (no fused path)"

        def cell(table, key, width, fmt):
            return f"{table[key]:{width}{fmt}}" if key in table else f"{'-':>{width}}"

        print(f"{name:<14} " + " ".join(cell(ms, c, 10, ".2f") for c in columns) + f" {ms['inline']:9.2f} | "
              + " ".join(cell(ratios, c, 8, ".2f") for c in columns) + " | "
              + " ".join(cell(kernels, c, 8, "d") for c in columns) + " " + cell(kernels, "inline", 6, "d")
              + (f" | {compile_s:9.1f}" if args.fused else "") + flag)
    print("ratio objectives, worst ratio to the inline loss: "
          + ", ".join(f"{key} {value:.2f}" for key, value in worst.items()))


if __name__ == "__main__":
    main()
