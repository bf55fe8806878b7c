"""Finished runs as one tidy table: a row (run, group, seed, outcome, value) per number of a run, read from the files
the training pipeline wrote (`eval/after.json`, `eval/before.json`, `metrics.jsonl`, `summary.json`). A `Group` is
the table pivoted to one group (outcome -> seed -> value); the paired comparisons and the RL start are computed from
it. Outcome keys: `final|best|before|gain/<split>/<metric>`, `dynamics/<series> (last 10%)|(mean)`,
`completions/<final|before>/<split>/<length|entropy>`, `seconds` and the `OUTCOMES` (docs/compare-statistics.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trustclip import metric_names as names
from trustclip.compare.paired_stats import Difference, Stat, paired_difference, stat
from trustclip.compare.plan import RunSpec
from trustclip.evaluation.metrics import AVERAGE
from trustclip.files import read_json
from trustclip.metrics_file import METRICS_FILE, read_series

OFFPOLICY = names.objective_name("offpolicy_frac")  # tokens whose ratio left [0.8, 1.2], whatever the objective
SERIES = {  # training series of the paper's Figure 2 (as TRL / trustclip log them): label, report summary, digits
    names.REWARD: ("reward (train)", "last 10%", 3),
    names.ENTROPY: ("entropy (nats/token)", "last 10%", 3),
    names.COMPLETION_LENGTH: ("completion length (tokens)", "last 10%", 1),
    names.CLIP_ANY: ("active-constraint fraction", "mean", 4),
    OFFPOLICY: ("off-policy fraction (ratio outside [0.8, 1.2])", "mean", 4),
    names.CLIP_LOW: ("clip fraction low", "mean", 4),
    names.CLIP_HIGH: ("clip fraction high", "mean", 4),
    # what acts where no token is clipped (cfpo: its clip_frac is 0 by construction) or the mask ignores A (m2po)
    names.objective_name("pushback_frac"): ("penalty pull-back fraction (cfpo)", "mean", 4),
    names.objective_name("m2_masked_frac"): ("second-moment masked fraction (m2po)", "mean", 4),
}


@dataclass(frozen=True)
class Outcome:
    """A per-run scalar that the report compares between groups: the tidy row `source` (`{split}`: the held-out
    average, `{k}`: the evaluation K; None: computed by `run_rows`), shown as scale * value in `unit`."""

    key: str
    label: str
    source: str | None
    scale: float = 100.0
    unit: str = " points"
    digits: int = 1


OUTCOMES = (
    Outcome("mean@K", "held-out Mean@{k}, final", "final/{split}/mean@{k}"),  # the primary outcome
    Outcome("pass@K", "held-out Pass@{k}, final", "final/{split}/pass@{k}"),
    Outcome("gain", "held-out Mean@{k} gain over the run's RL start", "gain/{split}/mean@{k}"),
    Outcome("entropy", "entropy, last 10% of RL (nats/token)", f"dynamics/{names.ENTROPY} (last 10%)", 1.0, " nats", 3),
    Outcome("reward", "train reward, last 10% of RL", f"dynamics/{names.REWARD} (last 10%)", 1.0, "", 3),
    Outcome("length", "completion length, last 10% of RL (tokens)", f"dynamics/{names.COMPLETION_LENGTH} (last 10%)",
            1.0, " tokens", 1),
    Outcome("clip_frac", "active-constraint fraction, mean over RL (% of tokens)", f"dynamics/{names.CLIP_ANY} (mean)",
            100.0, " pp", 2),
    Outcome("offpolicy_frac", "off-policy fraction (ratio outside [0.8, 1.2]), mean over RL (% of tokens)",
            f"dynamics/{OFFPOLICY} (mean)", 100.0, " pp", 2),
    Outcome("collapse", "collapse: final Mean@{k} below the RL start (% of runs)", None, 100.0, " pp", 0),
    Outcome("eval_entropy", "held-out entropy, final (nats/token, T = 1)", None, 1.0, " nats", 3),
    Outcome("eval_length", "held-out completion length, final (tokens)", None, 1.0, " tokens", 1),
)
OPTIONAL = ("eval_entropy", "eval_length")  # only in evaluations that recorded completion stats
PRIMARY, OUTCOME = OUTCOMES[0], {o.key: o for o in OUTCOMES}


class RunDataError(ValueError):
    """A finished run's files are missing or inconsistent."""


@dataclass
class RunRecord:
    """The numbers of one finished run; `final`, `best`, `before`: split -> {"mean@K", "pass@K"}, incl. "average"."""

    spec: RunSpec
    k: int
    metrics: tuple[str, str]  # ("mean@K", "pass@K"): the keys of each split's numbers
    final: dict[str, dict[str, float]]
    best: dict[str, dict[str, float]]
    before: dict[str, dict[str, float]] | None
    history: dict[int, dict[str, dict[str, float]]]  # RL step -> split -> metric, of the evaluated checkpoints
    curves: dict[str, dict[str, list[float]]]  # split -> {"k", "mean", "pass"} of the final policy
    series: dict[str, tuple[np.ndarray, np.ndarray]]  # RL metric -> (steps, values)
    seconds: dict[str, float]
    completions: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # final|before -> split -> stats
    solved: dict[str, list[int]] = field(default_factory=dict)  # split -> correct samples (of k) of each problem, final


def _average_curve(curves: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """Adds the `average` curve (mean over splits, like the `average` metrics) when every split has the same k."""
    curves = {s: c for s, c in curves.items() if s != AVERAGE}
    if curves and len({tuple(c.get("k", ())) for c in curves.values()}) == 1:
        curves[AVERAGE] = {"k": list(next(iter(curves.values()))["k"])} | {
            kind: np.mean([c[kind] for c in curves.values()], axis=0).tolist() for kind in ("mean", "pass")
            if all(kind in c for c in curves.values())}
    return curves


def load_run(spec: RunSpec) -> RunRecord:
    """Numbers of a finished run from its files; raises RunDataError when they are missing."""
    summary = read_json(spec.run_dir / "summary.json")
    if not isinstance(summary, dict):
        raise RunDataError(f"{spec.run_dir / 'summary.json'} is missing or unreadable")
    metric = str(summary.get("metric", ""))
    name, _, k = metric.partition("@")
    if name != "mean" or not k.isdigit():
        raise RunDataError(f"{spec.run_dir / 'summary.json'}: 'metric' should look like 'mean@8', got {metric!r}")
    after, before = (read_json(spec.run_dir / "eval" / f"{when}.json") for when in ("after", "before"))
    for when, data in (("after", after), ("before", before)):
        if data is not None and not (isinstance(data, dict) and isinstance(data.get("metrics"), dict)):
            raise RunDataError(f"{spec.run_dir / 'eval' / when}.json: no 'metrics' mapping")
    if after is None:
        raise RunDataError(f"{spec.run_dir / 'eval' / 'after.json'} is missing: the run has no final evaluation "
                           "(the recipe must include the rl and eval stages)")
    metrics = (f"mean@{k}", f"pass@{k}")
    final, start = ({s: {m: float(v[m]) for m in metrics} for s, v in e["metrics"].items()} if e else None
                    for e in (after, before))
    series = read_series(spec.run_dir / METRICS_FILE)  # a step logged twice (resumed run) keeps its last values
    history: dict[int, dict[str, dict[str, float]]] = {}
    for key, (steps, values) in series.items():  # periodic evaluations: eval/<split>/<metric>
        split, _, metric = key.removeprefix("eval/").rpartition("/")
        if key.startswith("eval/") and split and metric in metrics:
            for step, value in zip(steps.tolist(), values.tolist(), strict=True):
                history.setdefault(step, {}).setdefault(split, {})[metric] = value
    rl_steps = summary.get("rl_steps")
    history[rl_steps if isinstance(rl_steps, int) else max([*history, 0])] = final  # the last checkpoint
    best = {s: {m: max(h[s][m] for h in history.values() if m in h.get(s, {})) for m in metrics} for s in final}
    return RunRecord(spec, int(k), metrics, final, best, start, dict(sorted(history.items())),
                     _average_curve(after.get("curves") or {}), series,
                     {str(a): float(b) for a, b in (summary.get("seconds") or {}).items()},
                     {w: e["completion_stats"] for w, e in (("final", after), ("before", before))
                      if e and e.get("completion_stats")},
                     {split: [int(c) for c in counts] for split, counts in (after.get("solved") or {}).items()})


def run_rows(record: RunRecord) -> dict[str, float]:
    """Every number of one run, outcome -> value, each computed once: the `OUTCOMES` are entries of the rest on the
    held-out average (NaN where missing); a run "collapsed" when its final Mean@K is below its own RL start."""
    out = {f"{section}/{split}/{m}": v for section in ("final", "best", "before")
           for split, values in (getattr(record, section) or {}).items() for m, v in values.items()}
    out |= {f"gain/{split}/{m}": record.final[split][m] - values[m] for split, values in (record.before or {}).items()
            if split in record.final for m in record.metrics}
    for key, (_, y) in ((key, record.series[key]) for key in SERIES if key in record.series):
        tail = y[-max(1, int(round(0.1 * y.size))):]  # the series' value at the end of training
        out |= {f"dynamics/{key} (last 10%)": float(tail.mean()), f"dynamics/{key} (mean)": float(y.mean())}
    out |= {f"completions/{when}/{split}/{k}": float(v) for when, splits in record.completions.items()
            for split, stats in splits.items() for k, v in stats.items()}
    out["seconds"] = record.seconds.get("total", math.nan)
    split = AVERAGE if AVERAGE in record.final else list(record.final)[-1]
    out |= {f"eval_{k}": v for k, v in record.completions.get("final", {}).get(split, {}).items()}
    out |= {o.key: out.get(o.source.format(split=split, k=record.k), math.nan) for o in OUTCOMES if o.source}
    return out | {"collapse": float(out["gain"] < 0) if math.isfinite(out["gain"]) else math.nan}


def tidy(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """The table every report table and figure is a pivot of: one row (run, group, seed, outcome, value) per number."""
    return [{"run": r.spec.run_id, "group": r.spec.group, "seed": r.spec.seed, "outcome": key, "value": float(value)}
            for r in records for key, value in run_rows(r).items()]


@dataclass
class Group:
    """One (objective, sweep value): its first run's `spec`, its runs and the tidy table as outcome -> seed -> value."""

    spec: RunSpec
    runs: list[RunRecord]
    values: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return self.spec.group

    def stat(self, outcome: str) -> Stat:
        return stat(list(self.values.get(outcome, {}).values()))


def group_runs(records: Sequence[RunRecord]) -> list[Group]:
    """The finished runs by (objective, sweep value) group, in plan order, each with its pivot of `tidy`."""
    if len({r.k for r in records}) > 1:
        raise RunDataError(f"runs were evaluated with different K ({sorted({r.k for r in records})}); they cannot "
                           "share a table")
    groups: dict[str, Group] = {}
    for r in records:
        groups.setdefault(r.spec.group, Group(r.spec, [])).runs.append(r)
    for row in tidy(records):
        groups[row["group"]].values.setdefault(row["outcome"], {})[row["seed"]] = row["value"]
    return list(groups.values())


def outcomes_of(groups: Sequence[Group]) -> list[Outcome]:
    """The `OUTCOMES` the runs have: the optional ones only where some run recorded them."""
    return [o for o in OUTCOMES if o.key not in OPTIONAL or any(o.key in g.values for g in groups)]


def splits_of(records: Sequence[RunRecord]) -> list[str]:
    """Held-out splits in first-seen order, `average` last."""
    found = list(dict.fromkeys(s for r in records for s in r.final if s != AVERAGE))
    return [*found, AVERAGE] if any(AVERAGE in r.final for r in records) else found


# --------------------------------------------------------------------------------------- statistics of groups
def paired_comparisons(groups: Sequence[Group], reference: str) -> list[Difference]:
    """Every outcome of every other group against the reference group, paired by seed."""
    ref = next(g for g in groups if g.group == reference)
    return [paired_difference(g.values.get(o.key, {}), ref.values.get(o.key, {}), group=g.group, ref=ref.group,
                              outcome=o.key) for g in groups if g is not ref for o in outcomes_of(groups)]


def start_stats(groups: Sequence[Group], splits: Sequence[str], metric: str) -> dict[str, Stat]:
    """The RL start's `metric` per split over the SFT models the runs started from (one per seed, or per seed and swept
    value when the sweep changes SFT), each once; without SFT runs, each seed once."""
    starts: dict[str, dict[Any, float]] = {s: {} for s in splits}  # split -> SFT run (or seed) -> its RL start
    for r, s in ((r, s) for g in groups for r in g.runs for s in splits if r.before and s in r.before):
        starts[s].setdefault(r.spec.depends_on.run_id if r.spec.depends_on else r.spec.seed, r.before[s][metric])
    return {s: stat(list(by_start.values())) for s, by_start in starts.items()}


def title_of(split: str) -> str:
    return "Average" if split == AVERAGE else split
