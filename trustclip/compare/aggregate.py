"""Reading finished runs and aggregating them over seeds.

Per run, everything comes from the files the training pipeline wrote in its directory:
- `eval/after.json` / `eval/before.json`: Mean@K / Pass@K per held-out split (and `average`) of the final
  RL policy and of the RL start (the SFT model), with the Mean@k / Pass@k curves for k = 1..n;
- `metrics.jsonl`: the per-step RL metrics (reward, entropy, completion length, clip fractions, ...) and,
  with `rl.eval_every`, periodic evaluations logged as `eval/<split>/<metric>` at their step;
- `summary.json`: seconds per stage and the RL step count.

"final" is the last RL checkpoint's value; "best" is the maximum over the RL checkpoints that were
evaluated (the periodic evaluations and the final one), per split and metric, exactly as
`trustclip.evaluation.final_and_best` does for a list of checkpoints. Selecting the best checkpoint on the
held-out problems themselves is optimistic, as in the paper; the report says so.

Each run is also reduced to the scalar `OUTCOMES` the report compares between groups, paired by seed
(`paired_comparisons`), and each group's (seed x split) scores to rliable's aggregates (`group_aggregates`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trustclip import metric_names as names
from trustclip.compare.plan import RunSpec
from trustclip.compare.stats import Difference, Estimate, Stat, iqm, paired_difference, probability_of_improvement, stat
from trustclip.files import read_json, read_jsonl
from trustclip.train.plots import default_window as plot_window
from trustclip.train.plots import series_from_rows, smooth

AVERAGE = "average"
EVAL_PREFIX = "eval/"
# Training series of the paper's Figure 2 (names as TRL / trustclip log them), with their labels.
OFFPOLICY = names.objective_name("offpolicy_frac")  # tokens whose ratio left [0.8, 1.2], whatever the objective
SERIES = {
    names.REWARD: "reward (train)",
    names.ENTROPY: "entropy (nats/token)",
    names.COMPLETION_LENGTH: "completion length (tokens)",
    names.CLIP_ANY: "active-constraint fraction",
    OFFPOLICY: "off-policy fraction (ratio outside [0.8, 1.2])",
    names.CLIP_LOW: "clip fraction low",
    names.CLIP_HIGH: "clip fraction high",
}


@dataclass(frozen=True)
class Outcome:
    """A per-run scalar that the report compares between groups (`{k}` in the label is the evaluation K)."""

    key: str
    label: str
    scale: float = 100.0  # shown as scale * value ...
    unit: str = " points"  # ... in this unit
    digits: int = 1


OUTCOMES = (
    Outcome("mean@K", "held-out Mean@{k}, final"),  # the primary outcome
    Outcome("pass@K", "held-out Pass@{k}, final"),
    Outcome("gain", "held-out Mean@{k} gain over the run's RL start"),
    Outcome("entropy", "entropy, last 10% of RL (nats/token)", 1.0, " nats", 3),
    Outcome("reward", "train reward, last 10% of RL", 1.0, "", 3),
    Outcome("length", "completion length, last 10% of RL (tokens)", 1.0, " tokens", 1),
    Outcome("clip_frac", "active-constraint fraction, mean over RL (% of tokens)", 100.0, " pp", 2),
    Outcome("offpolicy_frac", "off-policy fraction (ratio outside [0.8, 1.2]), mean over RL (% of tokens)",
            100.0, " pp", 2),
    Outcome("collapse", "collapse: final Mean@{k} below the RL start (% of runs)", 100.0, " pp", 0),
)
PRIMARY = OUTCOMES[0]


class RunDataError(ValueError):
    """A finished run's files are missing or inconsistent."""


@dataclass
class RunRecord:
    """The numbers of one finished run."""

    spec: RunSpec
    k: int
    final: dict[str, dict[str, float]]  # split -> {"mean@K", "pass@K"}, incl. "average"
    best: dict[str, dict[str, float]]
    before: dict[str, dict[str, float]] | None
    history: dict[int, dict[str, dict[str, float]]]  # RL step -> split -> metric (evaluated checkpoints)
    curves: dict[str, dict[str, list[float]]]  # split -> {"k", "mean", "pass"} of the final policy
    series: dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values), RL stage
    seconds: dict[str, float]
    rl_steps: int | None

    @property
    def metrics(self) -> tuple[str, str]:
        return f"mean@{self.k}", f"pass@{self.k}"


def _eval_metrics(path: Path) -> dict[str, Any] | None:
    data = read_json(path)
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise RunDataError(f"{path}: no 'metrics' mapping")
    return data


def _k_of(summary: dict[str, Any], path: Path) -> int:
    metric = str(summary.get("metric", ""))
    name, _, k = metric.partition("@")
    if name != "mean" or not k.isdigit():
        raise RunDataError(f"{path}: 'metric' should look like 'mean@8', got {metric!r}")
    return int(k)


def _rl_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("stage") == "rl"]
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:  # a step logged twice (resumed run) keeps its last values
        by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def _history(rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> dict[int, dict[str, dict[str, float]]]:
    """Periodic evaluations: `eval/<split>/<metric>` values at their step."""
    out: dict[int, dict[str, dict[str, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith(EVAL_PREFIX) or not isinstance(value, int | float):
                continue
            split, _, metric = key[len(EVAL_PREFIX):].rpartition("/")
            if split and metric in metrics:
                out.setdefault(int(row["step"]), {}).setdefault(split, {})[metric] = float(value)
    return out


def _with_average_curve(curves: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """Adds the `average` curve (mean over splits, like the `average` metrics) when every split has the
    same k values."""
    curves = {s: c for s, c in curves.items() if s != AVERAGE}
    if not curves or len({tuple(c.get("k", ())) for c in curves.values()}) != 1:
        return curves
    ks = next(iter(curves.values()))["k"]
    average = {"k": list(ks)}
    for kind in ("mean", "pass"):
        if all(kind in c for c in curves.values()):
            average[kind] = [float(np.mean([c[kind][i] for c in curves.values()])) for i in range(len(ks))]
    return {**curves, AVERAGE: average}


def load_run(spec: RunSpec) -> RunRecord:
    """Numbers of a finished run from its files; raises RunDataError when they are missing."""
    run_dir = spec.run_dir
    summary = read_json(run_dir / "summary.json")
    if not isinstance(summary, dict):
        raise RunDataError(f"{run_dir / 'summary.json'} is missing or unreadable")
    k = _k_of(summary, run_dir / "summary.json")
    after = _eval_metrics(run_dir / "eval" / "after.json")
    if after is None:
        raise RunDataError(f"{run_dir / 'eval' / 'after.json'} is missing: the run has no final evaluation "
                           "(the recipe must include the rl and eval stages)")
    before = _eval_metrics(run_dir / "eval" / "before.json")
    metrics = (f"mean@{k}", f"pass@{k}")
    final = {s: {m: float(v[m]) for m in metrics} for s, v in after["metrics"].items()}
    rows = _rl_rows(run_dir)
    history = _history(rows, metrics)
    rl_steps = summary.get("rl_steps")
    last = int(rl_steps) if isinstance(rl_steps, int) else max([*history, 0])
    history[last] = final  # the final evaluation is the last checkpoint's
    best = {s: {m: max(h[s][m] for h in history.values() if s in h and m in h[s]) for m in metrics}
            for s in final}
    return RunRecord(
        spec=spec, k=k, final=final, best=best,
        before=({s: {m: float(v[m]) for m in metrics} for s, v in before["metrics"].items()} if before else None),
        history=dict(sorted(history.items())), curves=_with_average_curve(after.get("curves") or {}),
        series=series_from_rows(rows),
        seconds={str(a): float(b) for a, b in (summary.get("seconds") or {}).items()},
        rl_steps=rl_steps if isinstance(rl_steps, int) else None,
    )


# ----------------------------------------------------------------------------------------------- groups
@dataclass
class Band:
    """A curve over seeds: x, mean, std (NaN with one seed) and the number of seeds per point."""

    x: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    n: int

    def lines(self) -> dict[str, np.ndarray]:
        std = np.nan_to_num(self.std)
        return {"x": self.x, "mean": self.mean, "low": self.mean - std, "high": self.mean + std}


@dataclass
class GroupResult:
    """One (objective, sweep value) aggregated over its finished seeds."""

    group: str
    label: str
    objective: str
    hparams: dict[str, Any]
    sweep_key: str | None
    sweep_value: Any
    runs: list[RunRecord]
    final: dict[str, dict[str, Stat]] = field(default_factory=dict)
    best: dict[str, dict[str, Stat]] = field(default_factory=dict)
    before: dict[str, dict[str, Stat]] = field(default_factory=dict)
    gain: dict[str, dict[str, Stat]] = field(default_factory=dict)
    dynamics: dict[str, Stat] = field(default_factory=dict)
    seconds: Stat = field(default_factory=lambda: stat([]))
    outcomes: dict[str, dict[int, float]] = field(default_factory=dict)  # outcome key -> seed -> value

    @property
    def seeds(self) -> list[int]:
        return [r.spec.seed for r in self.runs]

    @property
    def n(self) -> int:
        return len(self.runs)


def splits_of(records: Sequence[RunRecord]) -> list[str]:
    """Held-out splits in first-seen order, `average` last."""
    names = list(dict.fromkeys(s for r in records for s in r.final if s != AVERAGE))
    return [*names, AVERAGE] if any(AVERAGE in r.final for r in records) else names


def _per_split(records: Sequence[RunRecord], attr: str, splits: Sequence[str]) -> dict[str, dict[str, Stat]]:
    metrics = records[0].metrics
    out = {}
    for split in splits:
        tables = [getattr(r, attr) for r in records]
        out[split] = {m: stat([t[split][m] for t in tables if t and split in t]) for m in metrics}
    return out


def _gain(records: Sequence[RunRecord], splits: Sequence[str]) -> dict[str, dict[str, Stat]]:
    metrics = records[0].metrics
    paired = [r for r in records if r.before]
    return {s: {m: stat([r.final[s][m] - r.before[s][m] for r in paired if s in r.before]) for m in metrics}
            for s in splits}


def tail_mean(values: np.ndarray, fraction: float = 0.1) -> float:
    """Mean of the last `fraction` of a series (at least one point): its value at the end of training."""
    if values.size == 0:
        return math.nan
    n = max(1, int(round(fraction * values.size)))
    return float(values[-n:].mean())


def _dynamics(records: Sequence[RunRecord]) -> dict[str, Stat]:
    out = {}
    for key in SERIES:
        have = [r.series[key][1] for r in records if key in r.series]
        if have:
            out[f"{key} (last 10%)"] = stat([tail_mean(v) for v in have])
            out[f"{key} (mean)"] = stat([float(v.mean()) for v in have])
    return out


def run_outcomes(record: RunRecord) -> dict[str, float]:
    """The `OUTCOMES` of one run (NaN where the run lacks the data: no RL-start evaluation, no such series).
    Held-out numbers are on the average over splits. A run "collapsed" when RL ended below where it started
    on held-out Mean@K (final < RL start): the policy got worse than its own SFT start."""
    split = AVERAGE if AVERAGE in record.final else list(record.final)[-1]
    mean_k, pass_k = record.metrics
    final = record.final[split]
    start = (record.before or {}).get(split, {}).get(mean_k, math.nan)

    def series(key: str, reduce: Any) -> float:
        return reduce(record.series[key][1]) if key in record.series else math.nan

    return {
        "mean@K": final[mean_k], "pass@K": final[pass_k], "gain": final[mean_k] - start,
        "entropy": series(names.ENTROPY, tail_mean), "reward": series(names.REWARD, tail_mean),
        "length": series(names.COMPLETION_LENGTH, tail_mean),
        "clip_frac": series(names.CLIP_ANY, np.mean), "offpolicy_frac": series(OFFPOLICY, np.mean),
        "collapse": float(final[mean_k] < start) if math.isfinite(start) else math.nan,
    }


def aggregate(records: Sequence[RunRecord]) -> list[GroupResult]:
    """Group finished runs by (objective, sweep value), in plan order, and summarise each over seeds."""
    if not records:
        return []
    ks = {r.k for r in records}
    if len(ks) > 1:
        raise RunDataError(f"runs were evaluated with different K ({sorted(ks)}); they cannot share a table")
    splits = splits_of(records)
    groups: dict[str, list[RunRecord]] = {}
    for record in records:
        groups.setdefault(record.spec.group, []).append(record)
    results = []
    for name, runs in groups.items():
        spec = runs[0].spec
        g = GroupResult(name, spec.label, spec.objective, spec.hparams, spec.sweep_key, spec.sweep_value, runs)
        g.final, g.best = _per_split(runs, "final", splits), _per_split(runs, "best", splits)
        g.before, g.gain = _per_split(runs, "before", splits), _gain(runs, splits)
        g.dynamics = _dynamics(runs)
        g.seconds = stat([r.seconds.get("total", math.nan) for r in runs])
        per_run = {r.spec.seed: run_outcomes(r) for r in runs}
        g.outcomes = {o.key: {seed: float(v[o.key]) for seed, v in per_run.items()} for o in OUTCOMES}
        results.append(g)
    return results


# ------------------------------------------------------------------------------------------- comparisons
def paired_comparisons(groups: Sequence[GroupResult], reference: str) -> list[Difference]:
    """Every outcome of every other group against the reference group, paired by seed (runs of one seed
    start RL from the same SFT model), in group then outcome order."""
    ref = next(g for g in groups if g.group == reference)
    return [paired_difference(g.outcomes[o.key], ref.outcomes[o.key], group=g.group, ref=ref.group, outcome=o.key)
            for g in groups if g is not ref for o in OUTCOMES]


def score_matrix(group: GroupResult, metric: str, splits: Sequence[str]) -> np.ndarray:
    """Final `metric` of each run (rows) on each held-out split (columns), runs lacking a split left out."""
    return np.array([[r.final[s][metric] for s in splits] for r in group.runs if all(s in r.final for s in splits)])


def group_aggregates(groups: Sequence[GroupResult], reference: str, splits: Sequence[str],
                     metrics: Sequence[str]) -> dict[str, dict[str, dict[str, Estimate]]]:
    """group -> {"iqm": {metric: Estimate}, "poi": {metric: P(group > reference)}} over the (seed x split)
    scores of the held-out splits (not their average: rliable aggregates over tasks)."""
    tasks = [s for s in splits if s != AVERAGE] or list(splits)
    ref = next(g for g in groups if g.group == reference)
    out: dict[str, dict[str, dict[str, Estimate]]] = {}
    for g in groups:
        scores = {m: score_matrix(g, m, tasks) for m in metrics}
        out[g.group] = {"iqm": {m: iqm(x) for m, x in scores.items() if x.size}}
        if g is not ref:
            out[g.group]["poi"] = {m: probability_of_improvement(x, score_matrix(ref, m, tasks))
                                   for m, x in scores.items() if x.size and score_matrix(ref, m, tasks).size}
    return out


# ----------------------------------------------------------------------------------------------- curves
def _band(per_seed: Sequence[tuple[np.ndarray, np.ndarray]]) -> Band:
    """Mean and std over seeds at the x values every seed has."""
    common = per_seed[0][0]
    for x, _ in per_seed[1:]:
        common = np.intersect1d(common, x)
    stack = np.array([y[np.searchsorted(x, common)] for x, y in per_seed]) if common.size else np.empty((0, 0))
    if stack.size == 0:
        return Band(np.array([]), np.array([]), np.array([]), len(per_seed))
    std = stack.std(axis=0, ddof=1) if len(per_seed) > 1 else np.full(common.size, np.nan)
    return Band(common, stack.mean(axis=0), std, len(per_seed))


def series_band(group: GroupResult, key: str, window: int) -> Band | None:
    """A training series of a group, each seed smoothed with `window`, then mean / std over seeds."""
    have = [r.series[key] for r in group.runs if key in r.series]
    if not have:
        return None
    return _band([(x, smooth(y, window)) for x, y in have])


def eval_band(group: GroupResult, split: str, metric: str) -> Band | None:
    """Held-out metric against the RL step (periodic evaluations + final; step 0 is the RL start)."""
    per_seed = []
    for run in group.runs:
        points = {step: h[split][metric] for step, h in run.history.items() if split in h and metric in h[split]}
        if run.before and split in run.before:
            points.setdefault(0, run.before[split][metric])
        if points:
            steps = np.array(sorted(points))
            per_seed.append((steps, np.array([points[s] for s in steps])))
    return _band(per_seed) if per_seed else None


def at_k_band(group: GroupResult, split: str, kind: str) -> Band | None:
    """Mean@k (`kind="mean"`) or Pass@k (`"pass"`) of the final policy for k = 1..n, over seeds."""
    per_seed = [(np.asarray(r.curves[split]["k"], float), np.asarray(r.curves[split][kind], float))
                for r in group.runs if split in r.curves and kind in r.curves[split]]
    return _band(per_seed) if per_seed else None


def default_window(groups: Sequence[GroupResult]) -> int:
    """The training plots' window for the longest run."""
    return plot_window(max((len(s[0]) for g in groups for r in g.runs for s in r.series.values()), default=1))
