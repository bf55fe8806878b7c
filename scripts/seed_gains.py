"""Does RL improve the model? Per seed of a finished `trustclip compare` pool: held-out Mean@K and Pass@K at the RL
start (the SFT model) and after RL, the gain, the train reward's first and second half of RL, and the seed's wall time
(its SFT run + its RL run, from their summary.json); then the mean with the paired 95% intervals of the gains
(bootstrap-t, as the compare report, and a t interval). Prints the README's markdown table.

    python scripts/seed_gains.py runs/smollm2/arith          # make smollm2 (HF sampling)
    python scripts/seed_gains.py runs/smollm2-vllm/arith     # make smollm2-vllm (vLLM sampling)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from scipy import stats

from trustclip import metric_names as names
from trustclip.compare import EXPERIMENT_KEYS, CompareSettings, read_saved
from trustclip.compare.paired_stats import paired_difference
from trustclip.compare.results import AVERAGE, load_run
from trustclip.compare.runner import is_finished
from trustclip.files import read_json


def seconds(run_dir: Path) -> float:
    summary = read_json(run_dir / "summary.json") or {}
    return float((summary.get("seconds") or {}).get("total", math.nan))


def t_interval(values: list[float]) -> tuple[float, float]:
    mean, sem = float(np.mean(values)), float(stats.sem(values))
    half = stats.t.ppf(0.975, len(values) - 1) * sem
    return mean - half, mean + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="a compare's --output-dir (its compare.json names the pool)")
    parser.add_argument("--group", help="the compared group to tabulate (default: the only one)")
    args = parser.parse_args()
    saved = read_saved(args.output_dir)
    if saved is None:
        raise SystemExit(f"{args.output_dir}: no compare.json (run trustclip compare first)")
    settings = CompareSettings(output_dir=args.output_dir, report_only=True,
                               **{k: saved[k] for k in EXPERIMENT_KEYS if k in saved})
    runs = [spec for spec in settings.plan() if spec.kind == "rl" and is_finished(spec)]
    groups = list(dict.fromkeys(spec.group for spec in runs))
    if args.group is None and len(groups) > 1:
        raise SystemExit(f"{args.output_dir} compares {', '.join(groups)}: choose one with --group")
    runs = [spec for spec in runs if args.group in (None, spec.group)]
    if not runs:
        raise SystemExit(f"{args.output_dir}: no finished RL run of {args.group or 'any group'} yet")
    records = [load_run(spec) for spec in runs]
    mean_k, pass_k = records[0].metrics
    rows, gains = [], {mean_k: [], pass_k: []}
    print(f"| seed | {mean_k.capitalize()} start -> after RL | gain | {pass_k.capitalize()} start -> after RL | gain "
          "| train reward, 1st -> 2nd half of RL | wall time |\n|---|---|---:|---|---:|---|---:|")
    for r in sorted(records, key=lambda r: r.spec.seed):
        before, after = r.before[AVERAGE], r.final[AVERAGE]
        reward = r.series[names.REWARD][1]
        half = reward.size // 2
        wall = r.seconds.get("total", math.nan) + (seconds(r.spec.depends_on.run_dir) if r.spec.depends_on else 0.0)
        cells = []
        for m in (mean_k, pass_k):
            gains[m].append(after[m] - before[m])
            cells += [f"{100 * before[m]:.1f} -> {100 * after[m]:.1f}", f"{100 * gains[m][-1]:+.1f}"]
        rows.append((r.spec.seed, before, after))
        print(f"| {r.spec.seed} | {' | '.join(cells)} | {reward[:half].mean():.3f} -> {reward[half:].mean():.3f} "
              f"| {wall / 60:.1f} min |")
    cells = []
    for m in (mean_k, pass_k):
        d = paired_difference({s: a[m] for s, _, a in rows}, {s: b[m] for s, b, _ in rows}, group="after RL",
                              ref="RL start", outcome=m)
        low, high = t_interval(gains[m]) if len(gains[m]) > 1 else (math.nan, math.nan)
        start, end = np.mean([b[m] for _, b, _ in rows]), np.mean([a[m] for _, _, a in rows])
        cells += [f"{100 * start:.1f} -> {100 * end:.1f}",
                  f"**{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]** "
                  f"(t: [{100 * low:+.1f}, {100 * high:+.1f}])"]
    print(f"| mean, paired 95% interval (bootstrap-t; t) | {' | '.join(cells)} | | |")


if __name__ == "__main__":
    main()
