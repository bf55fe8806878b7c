"""The comparison report: `report.md` (tables, generated findings, figures), `results.json`,
`results.csv` (every number of the report, long format) and `curves.csv` (the data of every figure).

Table cells are percentages of the fractions stored in the runs' `eval/*.json` (rounded to one decimal);
the CSV and JSON hold the unrounded fractions. Every sentence that compares groups follows from a paired
95 % interval (`trustclip.compare.stats`): nothing is called higher or lower whose interval includes 0.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trustclip import metric_names as names
from trustclip.compare.aggregate import (
    AVERAGE,
    OFFPOLICY,
    OUTCOMES,
    PRIMARY,
    SERIES,
    GroupResult,
    Outcome,
    RunRecord,
    at_k_band,
    default_window,
    eval_band,
    group_aggregates,
    paired_comparisons,
    series_band,
    splits_of,
)
from trustclip.compare.plan import RunSpec, format_value, resolve_reference
from trustclip.compare.stats import (
    LEVEL,
    MAX_SEEDS,
    RESAMPLES,
    Difference,
    Estimate,
    Stat,
    difference_sentence,
    fmt_interval,
    fmt_pct,
    fmt_pm,
    fmt_signed,
    needed_text,
    paired_difference,
    stat,
    sweep_trend,
)
from trustclip.files import read_json, write_json_atomic, write_text_atomic

FIGURES = "figures"
OUTCOME = {o.key: o for o in OUTCOMES}


def _title(split: str) -> str:
    return "Average" if split == AVERAGE else split


def _metric_title(metric: str) -> str:
    name, _, k = metric.partition("@")
    return f"{name.capitalize()}@{k}"


def _hp(hparams: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in hparams.items() if v is not None) or "-"


# ---------------------------------------------------------------------------------------------- tables
def table2(groups: Sequence[GroupResult], splits: Sequence[str], metrics: Sequence[str]) -> str:
    """Paper Table 2 layout: per split and on average, "final (best)" means over seeds, in %."""
    head = ["Objective"] + [f"{_title(s)} {_metric_title(m)}" for s in splits for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for g in groups:
        cells = [f"{fmt_pct(g.final[s][m].mean)} ({fmt_pct(g.best[s][m].mean)})" for s in splits for m in metrics]
        lines.append(f"| {g.group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table3(groups: Sequence[GroupResult], splits: Sequence[str], metric: str,
           start: dict[str, Stat] | None = None) -> str:
    """Paper Table 3 layout: final `metric` as mean ± std over seeds, per split and on average, in %."""
    head = ["Objective", "seeds"] + [_title(s) for s in splits]
    lines = ["| " + " | ".join(head) + " |", "|---|---:" + "|---:" * len(splits) + "|"]
    for g in groups:
        lines.append(f"| {g.group} | {g.n} | " + " | ".join(fmt_pm(g.final[s][metric]) for s in splits) + " |")
    if start:
        n = max((st.n for st in start.values()), default=0)
        lines.append(f"| *RL start (SFT model)* | {n} | " + " | ".join(fmt_pm(start[s]) for s in splits) + " |")
    return "\n".join(lines)


DYNAMICS = (f"{names.REWARD} (last 10%)", f"{names.ENTROPY} (last 10%)", f"{names.COMPLETION_LENGTH} (last 10%)",
            f"{names.CLIP_ANY} (mean)", f"{OFFPOLICY} (mean)", f"{names.CLIP_LOW} (mean)", f"{names.CLIP_HIGH} (mean)")


def dynamics_table(groups: Sequence[GroupResult]) -> str:
    """End-of-training reward / entropy / length and the mean clip fractions over RL, per group."""
    keys = [k for k in DYNAMICS if any(k in g.dynamics for g in groups)]
    if not keys:
        return "_No RL metrics were logged._"
    labels = [SERIES[k.rsplit(" (", 1)[0]] + (" (mean over RL)" if k.endswith("(mean)") else " (last 10%)")
              for k in keys]
    lines = ["| Objective | " + " | ".join(labels) + " | seconds per run |", "|---" + "|---:" * (len(keys) + 1) + "|"]
    for g in groups:
        cells = [_fmt_plain(g.dynamics.get(k, stat([])), k) for k in keys]
        lines.append(f"| {g.group} | " + " | ".join(cells) + f" | {fmt_pm(g.seconds, 1.0, 0)} |")
    return "\n".join(lines)


def _fmt_plain(s: Stat, key: str) -> str:
    digits = 1 if "length" in key else (4 if "_frac" in key else 3)
    return fmt_pm(s, 1.0, digits)


def runs_table(records: Sequence[RunRecord], splits: Sequence[str]) -> str:
    metrics = records[0].metrics
    avg = AVERAGE if AVERAGE in splits else splits[-1]
    head = ["Run", "objective", "hyper-parameters"] + [f"{_title(avg)} {_metric_title(m)} final (best)"
                                                       for m in metrics] + ["evaluated checkpoints", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---" + "|---:" * (len(head) - 3) + "|"]
    for r in records:
        cells = [f"{fmt_pct(r.final[avg][m])} ({fmt_pct(r.best[avg][m])})" for m in metrics]
        lines.append(f"| {r.spec.run_id} | {r.spec.objective} | {_hp(r.spec.hparams)} | " + " | ".join(cells)
                     + f" | {len(r.history)} | {r.seconds.get('total', math.nan):.0f} |")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- findings
def start_stats(groups: Sequence[GroupResult], splits: Sequence[str], metric: str) -> tuple[dict[str, Stat], float]:
    """RL-start (SFT) metric per split over distinct seeds, and the largest disagreement between runs of
    the same seed (0 when SFT is deterministic per seed: every objective starts from the same model)."""
    per_seed: dict[int, list[dict[str, dict[str, float]]]] = {}
    for g in groups:
        for r in g.runs:
            if r.before:
                per_seed.setdefault(r.spec.seed, []).append(r.before)
    spread = max((abs(a[s][metric] - b[s][metric]) for bs in per_seed.values() for a in bs for b in bs
                  for s in splits if s in a and s in b), default=0.0)
    return {s: stat([bs[0][s][metric] for bs in per_seed.values() if s in bs[0]]) for s in splits}, spread


def outcome_label(outcome: Outcome, k: int) -> str:
    return outcome.label.format(k=k)


def _short(d: Difference, o: Outcome, k: int) -> str:
    """'atr entropy, ... +0.120 nats [+0.050, +0.190] (higher)'."""
    return (f"{d.group} {outcome_label(o, k)} {fmt_signed(d.mean, o.scale, o.digits)}{o.unit} "
            f"{fmt_interval(d, o.scale, o.digits)} ({d.verdict})")


def _say(d: Difference, outcome: Outcome, k: int) -> str:
    return difference_sentence(d, outcome_label(outcome, k), outcome.scale, outcome.unit, outcome.digits)


def rank_sentence(name: str, groups: Sequence[GroupResult], outcome: Outcome = PRIMARY) -> str:
    """Which group has the highest mean of `outcome`, and which others its paired intervals resolve it from."""
    means = {g.group: stat(list(g.outcomes[outcome.key].values())) for g in groups}
    ranked = sorted((g for g in groups if means[g.group].n), key=lambda g: means[g.group].mean, reverse=True)
    if len(ranked) < 2:
        return f"{name}: fewer than two groups with finished runs, no ordering."
    top, best = ranked[0], means[ranked[0].group]
    tied = [g.group for g in ranked if means[g.group].mean == best.mean]
    value = f"{fmt_pm(best, outcome.scale, outcome.digits)}{outcome.unit}"
    if len(tied) > 1:
        who = ", ".join(f"**{g}**" for g in tied)
        return f"{name}: {who} share the highest mean ({value}); no ordering among them."
    text = f"{name}: **{top.group}** has the highest mean ({value}, n = {best.n})"
    diffs = [paired_difference(top.outcomes[outcome.key], g.outcomes[outcome.key], group=top.group, ref=g.group,
                               outcome=outcome.key) for g in ranked[1:]]
    above = [d.reference for d in diffs if d.verdict == "higher"]
    open_ = [d.reference for d in diffs if d.verdict != "higher"]
    if not open_:
        return text + f"; its paired {LEVEL:.0%} interval against every other group lies above 0."
    if not above:
        return text + f", but no paired {LEVEL:.0%} interval against the others ({', '.join(open_)}) excludes 0: " \
                      "the data do not order them."
    return text + f"; its paired {LEVEL:.0%} intervals lie above 0 against {', '.join(above)}, not against " \
                  f"{', '.join(open_)}."


def gain_sentence(g: GroupResult, split: str, metric: str, k: int) -> str:
    """Change over RL of one group, paired within each run (final policy - its own RL start)."""
    final = {r.spec.seed: r.final[split][metric] for r in g.runs if split in r.final}
    start = {r.spec.seed: r.before[split][metric] for r in g.runs if r.before and split in r.before}
    d = paired_difference(final, start, group=g.group, ref="RL start", outcome="gain")
    return difference_sentence(d, f"held-out {_title(split)} Mean@{k}")


def findings(groups: Sequence[GroupResult], splits: Sequence[str], metrics: Sequence[str], n_planned: int,
             n_finished: int, eval_every: int | None, reference: str, diffs: Sequence[Difference]) -> list[str]:
    """Sentences generated from the paired intervals (see `trustclip.compare.stats`)."""
    avg = AVERAGE if AVERAGE in splits else splits[-1]
    k = int(metrics[0].partition("@")[2])
    out = [f"{n_finished} of {n_planned} planned runs finished; seeds per group: "
           + ", ".join(f"{g.group} {g.n}" for g in groups) + "."]
    if not any(g.group == reference for g in groups):
        out.append(f"The reference group {reference} has no finished run: no paired comparisons yet.")
    out += [_say(d, PRIMARY, k) for d in diffs if d.outcome == PRIMARY.key]
    resolved = [d for d in diffs if d.outcome != PRIMARY.key and d.verdict in ("higher", "lower")]
    if resolved:
        out.append("Other outcomes whose paired interval excludes 0: "
                   + "; ".join(_short(d, OUTCOME[d.outcome], k) for d in resolved) + ".")
    elif diffs:
        out.append(f"No other outcome differs from {reference} by a paired interval that excludes 0.")
    out.append(rank_sentence(f"{_title(avg)} {_metric_title(metrics[0])} of the final policy", groups))
    out += [gain_sentence(g, avg, metrics[0], k) for g in groups]
    out += _sweep_findings(groups, avg, metrics[0], k)
    intervals = sum(d.n >= 2 for d in diffs)
    if intervals:
        out.append(f"{intervals} paired intervals at {LEVEL:.0%} each, not adjusted for multiplicity: were no "
                   f"difference real, about {(1 - LEVEL) * intervals:.1f} of them would exclude 0 by chance. The "
                   f"primary outcome is the final held-out {_title(avg)} {_metric_title(metrics[0])}.")
    if max((g.n for g in groups), default=0) < 2:
        out.append("With one seed per group there is no interval: nothing is called higher or lower.")
    checkpoints = sorted({len(r.history) for g in groups for r in g.runs})
    if checkpoints == [1]:
        out.append("Only the RL start and the final policy were evaluated (rl.eval_every = 0), so best = final "
                   "and the accuracy-vs-step figure has two points; `--set rl.eval_every=N` adds checkpoints.")
    else:
        out.append(f"'best' is the maximum over {'/'.join(map(str, checkpoints))} evaluated RL checkpoints "
                   f"(every {eval_every} steps and the last), chosen on the same held-out problems it is "
                   "reported on, so it is optimistic; 'final' is the unbiased number.")
    return out


def _sweep_findings(groups: Sequence[GroupResult], avg: str, metric: str, k: int) -> list[str]:
    swept: dict[str, list[GroupResult]] = {}
    for g in groups:
        if g.sweep_key is not None:
            swept.setdefault(g.label, []).append(g)
    out = []
    for label, members in swept.items():
        if len(members) >= 2:
            out.append(rank_sentence(f"Sweep of {label} over {members[0].sweep_key}, {_title(avg)} "
                                     f"{_metric_title(metric)}", members))
        if len(members) >= 3 and all(isinstance(g.sweep_value, int | float) for g in members):
            out += [trend_sentence(label, members, k, OUTCOME[key]) for key in (PRIMARY.key, "pass@K")]
    return out


def trend_sentence(label: str, members: Sequence[GroupResult], k: int, outcome: Outcome = PRIMARY) -> str:
    """The sweep's trend (`stats.sweep_trend`): the per-seed slope of the primary outcome and its interval."""
    key = members[0].sweep_key
    d, log = sweep_trend({g.sweep_value: g.outcomes[outcome.key] for g in members}, group=label,
                         outcome=outcome.key)
    per = f"per tenfold {key}" if log else f"per unit of {key}"
    text = (f"Trend of {label} over {key} (least-squares slope of {outcome_label(outcome, k)} on "
            f"{f'log10 {key}' if log else key}, per seed, seeds with every value): ")
    if d.n < 2:
        return text + f"{d.n} complete seed(s), no interval."
    slopes = ", ".join(fmt_signed(v, outcome.scale, outcome.digits) for v in d.differences)
    text += (f"{fmt_signed(d.mean, outcome.scale, outcome.digits)}{outcome.unit} {per} "
             f"[{LEVEL:.0%} CI {fmt_interval(d, outcome.scale, outcome.digits)[1:-1]}], n = {d.n} (per seed: {slopes})")
    verdict = {"higher": "increasing", "lower": "decreasing", "identical": "flat on every seed"}.get(d.verdict)
    return text + (f": {verdict}." if verdict else "; the interval includes 0: no trend resolved.")


def paired_table(diffs: Sequence[Difference], k: int) -> str:
    """One row per (group, outcome): group - reference, its interval, seeds, verdict and seeds needed."""
    if not diffs:
        return "_No other group to compare with the reference._"
    lines = [f"| Group | Outcome | Difference | {LEVEL:.0%} CI | n | Verdict | Seeds needed |",
             "|---|---|---:|---:|---:|---|---:|"]
    for d in diffs:
        o = OUTCOME[d.outcome]
        lines.append(f"| {d.group} | {outcome_label(o, k)} | {fmt_signed(d.mean, o.scale, o.digits)}{o.unit} | "
                     f"{fmt_interval(d, o.scale, o.digits)} | {d.n} | {d.verdict} | {needed_text(d)} |")
    return "\n".join(lines)


def _fmt_estimate(e: Estimate | None, scale: float = 100.0, digits: int = 1) -> str:
    if e is None:
        return "n/a"
    if math.isnan(e.low):
        return f"{scale * e.value:.{digits}f} (no interval)"
    return f"{scale * e.value:.{digits}f} [{scale * e.low:.{digits}f}, {scale * e.high:.{digits}f}]"


def aggregates_table(groups: Sequence[GroupResult], aggregates: dict, reference: str, metrics: Sequence[str]) -> str:
    """rliable's IQM and probability of improvement over the reference, with stratified bootstrap intervals."""
    head = (["Group", "seeds"] + [f"IQM {_metric_title(m)} (%)" for m in metrics]
            + [f"P(group > {reference}), {_metric_title(m)}" for m in metrics])
    lines = ["| " + " | ".join(head) + " |", "|---|---:" + "|---:" * (len(head) - 2) + "|"]
    for g in groups:
        agg = aggregates.get(g.group, {})
        cells = [_fmt_estimate(agg.get("iqm", {}).get(m)) for m in metrics]
        cells += ["(reference)" if g.group == reference else _fmt_estimate(agg.get("poi", {}).get(m), 1.0, 2)
                  for m in metrics]
        lines.append(f"| {g.group} | {g.n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def method_lines(reference: str, k: int) -> list[str]:
    return [
        f"Difference = group - **{reference}** per seed (the runs of one seed start RL from the same SFT model), "
        "averaged over the n seeds both groups have finished. "
        f"{LEVEL:.0%} CI: studentised bootstrap (bootstrap-t) of the mean difference, seeds resampled in pairs "
        f"({RESAMPLES} resamples of the per-seed differences, `scipy.stats.bootstrap`); a percentile or BCa "
        "interval stays inside the range of the seeds and under-covers with a handful of them (see "
        "`trustclip/compare/stats.py`). "
        "With 2-3 seeds the interval is unbounded (a resample that repeats one seed has no spread).",
        "Verdict: higher / lower only when the interval excludes 0; identical: every difference exactly 0. "
        "Seeds needed: the number of seeds at which a two-sided paired t-test at alpha 0.05 has power 0.8 if "
        f"the observed mean and standard deviation of the differences were the true ones (> {MAX_SEEDS}: more "
        "than that; not estimable: no spread, no difference or one seed); the bootstrap-t interval is wider than "
        "the t-test's at a handful of seeds, so it may need a few more.",
        f"Outcomes on the held-out average; train reward, entropy and length over the last 10% of RL steps; "
        f"active-constraint fraction = `{names.CLIP_ANY}`, off-policy fraction = `{OFFPOLICY}`, both averaged "
        f"over RL; collapse = 1 for a run whose final held-out Mean@{k} is below its own RL start.",
    ]


# ---------------------------------------------------------------------------------------------- figures
def make_figures(groups: Sequence[GroupResult], splits: Sequence[str], metrics: Sequence[str], out: Path,
                 window: int | None) -> tuple[list[Path], list[dict[str, Any]]]:
    """Every figure of the report; returns the paths and the plotted data rows (for curves.csv)."""
    from trustclip import figures

    window = window or default_window(groups)
    rows: list[dict[str, Any]] = []
    paths: list[Path] = []

    def panel(name: str, title: str, xlabel: str, ylabel: str, bands: dict, logx: bool = False) -> dict:
        for group, band in bands.items():
            for x, m, s in zip(band.x, band.mean, band.std, strict=True):
                rows.append({"figure": name, "panel": title, "group": group, "x": float(x), "mean": float(m),
                             "std": float(s), "n_seeds": band.n})
        return {"title": title, "xlabel": xlabel, "ylabel": ylabel, "logx": logx,
                "lines": {g: b.lines() for g, b in bands.items()}}

    def bands(fn: Any, *args: Any) -> dict:
        return {g.group: b for g in groups if (b := fn(g, *args)) is not None and b.x.size}

    training = [panel("training_curves", label, "RL step", label, bands(series_band, key, window))
                for key, label in SERIES.items()]
    training = [p for p in training if p["lines"]]
    if training:
        title = f"Training curves: mean ± std over seeds, moving average over {window} steps"
        paths.append(figures.plot_seed_bands(out / "training_curves.png", training, title=title, ncols=4))
        for p in training:
            stem = p["title"].split(" (")[0].replace(" ", "_")
            paths.append(figures.plot_seed_bands(out / f"training_{stem}.png", [p], title=title, ncols=1))
    evals = [panel("eval_vs_step", f"{_title(s)} {_metric_title(m)}", "RL step", "accuracy",
                   bands(eval_band, s, m)) for m in metrics for s in splits]
    if any(p["lines"] for p in evals):
        paths.append(figures.plot_seed_bands(out / "eval_vs_step.png", evals, ncols=len(splits),
                                             title="Held-out accuracy during RL (step 0: RL start), mean ± std"))
    at_k = [panel("at_k", f"{_title(s)} {kind.capitalize()}@k", "k", "accuracy", bands(at_k_band, s, kind),
                  logx=True) for kind in ("mean", "pass") for s in splits]
    if any(p["lines"] for p in at_k):
        paths.append(figures.plot_seed_bands(out / "at_k.png", at_k, ncols=len(splits),
                                             title="Mean@k and Pass@k of the final policy vs k, mean ± std"))
    sweep = _sweep_panels(groups, splits[-1], metrics, rows)
    if sweep:
        paths.append(figures.plot_sweep(out / "sweep.png", sweep[0], sweep[1],
                                        title=f"Final {_title(splits[-1])} accuracy vs {sweep[0]}"))
    return paths, rows


def _sweep_panels(groups: Sequence[GroupResult], avg: str, metrics: Sequence[str],
                  rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]] | None:
    swept = [g for g in groups if g.sweep_key is not None]
    if not swept:
        return None
    key = swept[0].sweep_key
    panels = []
    for metric in metrics:
        series: dict[str, dict[str, list]] = {}
        for g in swept:
            s = series.setdefault(g.label, {"x": [], "mean": [], "std": []})
            st = g.final[avg][metric]
            s["x"].append(g.sweep_value)
            s["mean"].append(st.mean)
            s["std"].append(st.std)
            rows.append({"figure": "sweep", "panel": metric, "group": g.group, "x": g.sweep_value, "mean": st.mean,
                         "std": st.std, "n_seeds": st.n})
        refs = {g.group: {"mean": g.final[avg][metric].mean, "std": g.final[avg][metric].std}
                for g in groups if g.sweep_key is None}
        panels.append({"title": f"{_title(avg)} {_metric_title(metric)} (final)", "ylabel": "accuracy",
                       "series": series, "references": refs})
    return key, panels


# -------------------------------------------------------------------------------------------- writers
def _stat_rows(section: str, group: str, table: dict[str, dict[str, Stat]]) -> list[dict[str, Any]]:
    rows = []
    for split, metrics in table.items():
        for metric, st in metrics.items():
            for name in ("mean", "std", "n", "min", "max"):
                rows.append({"section": section, "group": group, "seed": "", "split": split, "metric": metric,
                             "statistic": name, "value": getattr(st, name)})
    return rows


def csv_rows(groups: Sequence[GroupResult], diffs: Sequence[Difference] = (),
             aggregates: dict | None = None) -> list[dict[str, Any]]:
    """Every number of the report in long format (fractions, not percentages)."""
    rows: list[dict[str, Any]] = []
    for g in groups:
        for section in ("final", "best", "before", "gain"):
            rows += _stat_rows(section, g.group, getattr(g, section))
        rows += _stat_rows("dynamics", g.group, {"train": g.dynamics})
        rows += _stat_rows("seconds", g.group, {"run": {"total": g.seconds}})
        for r in g.runs:
            for section in ("final", "best", "before"):
                for split, metrics in (getattr(r, section) or {}).items():
                    for metric, value in metrics.items():
                        rows.append({"section": section, "group": g.group, "seed": r.spec.seed, "split": split,
                                     "metric": metric, "statistic": "value", "value": value})
        for outcome, per_seed in g.outcomes.items():
            rows += [{"section": "outcome", "group": g.group, "seed": seed, "split": "", "metric": outcome,
                      "statistic": "value", "value": value} for seed, value in per_seed.items()]
    for d in diffs:  # one row per statistic of each paired comparison against the reference
        info = d.to_dict()
        rows += [{"section": f"paired vs {d.reference}", "group": d.group, "seed": "", "split": "",
                  "metric": d.outcome, "statistic": name, "value": info[name]}
                 for name in ("mean", "low", "high", "n", "sd", "verdict", "seeds_needed")]
    for group, kinds in (aggregates or {}).items():
        for kind, per_metric in kinds.items():
            for metric, estimate in per_metric.items():
                rows += [{"section": kind, "group": group, "seed": "", "split": "", "metric": metric,
                          "statistic": name, "value": value} for name, value in estimate.to_dict().items()]
    base = {"objective": "", "sweep_key": "", "sweep_value": ""}
    info = {g.group: {"objective": g.objective, "sweep_key": g.sweep_key or "",
                      "sweep_value": "" if g.sweep_value is None else g.sweep_value} for g in groups}
    return [{**base, **info.get(r["group"], {}), **r} for r in rows]


def _write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})
    return write_text_atomic(path, buffer.getvalue())


def _group_json(g: GroupResult) -> dict[str, Any]:
    def table(t: dict[str, dict[str, Stat]]) -> dict:
        return {s: {m: st.to_dict() for m, st in ms.items()} for s, ms in t.items()}

    return {"group": g.group, "label": g.label, "objective": g.objective, "hparams": g.hparams,
            "sweep_key": g.sweep_key, "sweep_value": g.sweep_value, "seeds": g.seeds, "final": table(g.final),
            "best": table(g.best), "before": table(g.before), "gain": table(g.gain),
            "dynamics": {k: v.to_dict() for k, v in g.dynamics.items()}, "seconds": g.seconds.to_dict(),
            "outcomes": {key: {str(seed): v for seed, v in per_seed.items()} for key, per_seed in g.outcomes.items()}}


def _run_json(r: RunRecord) -> dict[str, Any]:
    return {"run_id": r.spec.run_id, "group": r.spec.group, "seed": r.spec.seed, "objective": r.spec.objective,
            "hparams": r.spec.hparams, "dir": str(r.spec.run_dir), "final": r.final, "best": r.best,
            "before": r.before, "history": {str(k): v for k, v in r.history.items()}, "curves": r.curves,
            "seconds": r.seconds, "rl_steps": r.rl_steps}


def _setting_lines(settings: dict[str, Any], records: Sequence[RunRecord]) -> list[str]:
    cfg = records[0].spec.config
    rl, ev, data = cfg["rl"], cfg["eval"], cfg["data"]
    n = ev.get("n_samples") or ev["k"]
    return [
        f"- Recipe: `{settings.get('config') or 'embedded default'}`; overrides: "
        f"`{' '.join(settings.get('overrides') or []) or 'none'}`",
        f"- Model `{cfg['model']['name_or_path']}`; SFT "
        f"{cfg['sft']['max_steps'] if 'sft' in cfg['stages'] or records[0].spec.depends_on else 0} "
        f"steps; RL {rl['max_steps']} steps, G = {rl['num_generations']}, mu = {rl['num_iterations']}, "
        f"lr = {rl['learning_rate']:g}, aggregation {rl['aggregation']}, advantages {rl['advantage_estimator']}",
        f"- Train data `{data['train']}`; held-out `{', '.join(data['eval'])}`"
        + (f" (first {data['eval_limit']} problems each)" if data.get("eval_limit") else ""),
        f"- Evaluation: K = {ev['k']}, {n} samples per problem, temperature {ev['temperature']:g}, "
        f"top-p {ev['top_p']:g}, max {ev['max_new_tokens']} new tokens, sampling seed {ev['seed']}",
        f"- Training seeds: {', '.join(map(str, sorted({r.spec.seed for r in records})))}; only the objective"
        + (f", its hyper-parameters and `{settings['sweep']}`" if settings.get("sweep")
           else " and its hyper-parameters")
        + " differ between runs",
    ]


def sft_summary(sft_runs: Sequence[RunSpec]) -> dict[str, Any]:
    """Seconds of the shared SFT runs (from their summary.json), for the report."""
    seconds = []
    for spec in sft_runs:
        summary = read_json(spec.run_dir / "summary.json")
        if isinstance(summary, dict):
            seconds.append((summary.get("seconds") or {}).get("total", math.nan))
    return {"runs": [s.run_id for s in sft_runs], "seconds": stat(seconds)}


def write_report(records: Sequence[RunRecord], groups: Sequence[GroupResult], out: str | Path, *,
                 settings: dict[str, Any], planned: Sequence[RunSpec], failed: dict[str, str] | None = None,
                 window: int | None = None, sft_runs: Sequence[RunSpec] = (),
                 reference: str | None = None) -> dict[str, Path]:
    """Write report.md, results.json, results.csv, curves.csv and the figures; returns their paths.
    `reference`: the group the paired comparisons are against (default as `resolve_reference`)."""
    out = Path(out)
    if not records:
        raise ValueError("no finished runs to report on")
    splits, metrics = splits_of(records), list(records[0].metrics)
    eval_every = records[0].spec.config["rl"].get("eval_every")
    reference = reference or resolve_reference(None, [(g.group, g.label, g.objective) for g in groups])
    finished_reference = any(g.group == reference for g in groups)
    diffs = paired_comparisons(groups, reference) if finished_reference else []
    aggregates = group_aggregates(groups, reference, splits, metrics) if finished_reference else {}
    figs, curve_rows = make_figures(groups, splits, metrics, out / FIGURES, window)
    start, start_spread = start_stats(groups, splits, metrics[0])
    done = {r.spec.run_id for r in records}
    missing = [s.run_id for s in planned if s.run_id not in done]
    text = findings(groups, splits, metrics, len(planned), len(records), eval_every, reference, diffs)
    if start_spread > 1e-9:
        text.append(f"Runs of the same seed started RL from SFT models whose {_metric_title(metrics[0])} differs by "
                    f"up to {fmt_pct(start_spread)} points: SFT is not bit-reproducible here.")
    sft = sft_summary(sft_runs)
    stats_md = _statistics_markdown(groups, metrics, reference, diffs, aggregates, records[0].k)
    md = _markdown(records, groups, splits, metrics, settings, text, figs, out, start, missing, failed or {}, sft,
                   stats_md)
    paths = {"report": write_text_atomic(out / "report.md", md)}
    columns = ["section", "group", "objective", "sweep_key", "sweep_value", "seed", "split", "metric",
               "statistic", "value"]
    paths["csv"] = _write_csv(out / "results.csv", csv_rows(groups, diffs, aggregates), columns)
    paths["curves"] = _write_csv(out / "curves.csv", curve_rows,
                                 ["figure", "panel", "group", "x", "mean", "std", "n_seeds"])
    paths["json"] = write_json_atomic(out / "results.json", {
        "settings": settings, "k": records[0].k, "splits": splits, "metrics": metrics,
        "planned": [s.run_id for s in planned], "missing": missing, "failed": failed or {},
        "findings": text, "groups": [_group_json(g) for g in groups], "runs": [_run_json(r) for r in records],
        "rl_start": {s: st.to_dict() for s, st in start.items()},
        "shared_sft": {"runs": sft["runs"], "seconds": sft["seconds"].to_dict()},
        "figures": [str(p.relative_to(out)) for p in figs],
        "reference": reference, "method": method_lines(reference, records[0].k),
        "outcomes": {o.key: outcome_label(o, records[0].k) for o in OUTCOMES},
        "comparisons": [d.to_dict() for d in diffs],
        "aggregates": {g: {kind: {m: e.to_dict() for m, e in per.items()} for kind, per in kinds.items()}
                       for g, kinds in aggregates.items()},
    })
    for fig in figs:
        paths[fig.stem] = fig
    return paths


def _statistics_markdown(groups: Sequence[GroupResult], metrics: Sequence[str], reference: str,
                         diffs: Sequence[Difference], aggregates: dict, k: int) -> list[str]:
    if not any(g.group == reference for g in groups):
        return [f"## Paired comparisons against {reference}", "", f"_{reference} has no finished run yet._", ""]
    return [f"## Paired comparisons against {reference}", "", paired_table(diffs, k), "",
            *[f"{line}\n" for line in method_lines(reference, k)],
            f"## IQM and probability of improvement over {reference} (rliable)", "",
            aggregates_table(groups, aggregates, reference, metrics), "",
            "IQM: interquartile mean of the final scores of every (seed, held-out split), in %. "
            f"P(group > {reference}): probability that a run of the group scores higher than a run of "
            f"{reference} on a split (ties count one half), averaged over splits (Agarwal et al. 2021, "
            f"arXiv 2108.13264). Brackets: {LEVEL:.0%} percentile intervals of a stratified bootstrap (seeds "
            "resampled within each split), descriptive: with a handful of seeds they are too narrow, and the "
            "verdicts come from the paired intervals above.", ""]


def _markdown(records: Sequence[RunRecord], groups: Sequence[GroupResult], splits: Sequence[str],
              metrics: Sequence[str], settings: dict[str, Any], text: Sequence[str], figs: Sequence[Path],
              out: Path, start: dict[str, Stat], missing: Sequence[str], failed: dict[str, str],
              sft: dict[str, Any], statistics: Sequence[str]) -> str:
    m0, m1 = (_metric_title(m) for m in metrics)
    setting = _setting_lines(settings, records)
    run_seconds = stat([r.seconds.get("total", math.nan) for r in records])
    setting.append(f"- Run time (each run's own summary.json): {fmt_pm(run_seconds, 1.0, 0)} s per RL run, "
                   f"{math.fsum(run_seconds.values) / 60:.1f} min summed over {run_seconds.n} runs")
    if sft["runs"]:
        setting.append(f"- SFT shared per seed: every objective of a seed starts RL from the same SFT model "
                       f"({len(sft['runs'])} SFT run(s) in `runs/_sft*`, {fmt_pm(sft['seconds'], 1.0, 0)} s each; "
                       "not included in the seconds per run below)")
    parts = ["# trustclip compare: " + ", ".join(g.group for g in groups), "", "## Setting", "",
             *setting, "", "## Findings (generated from the numbers below)", "",
             *[f"- {t}" for t in text], ""]
    if missing:
        parts += [f"**Missing runs ({len(missing)}):** " + ", ".join(missing), ""]
        parts += [f"- {run_id}: {why}" for run_id, why in failed.items()] + ([""] if failed else [])
    parts += [f"## Table 2 style: final (best) {m0} / {m1} in %, mean over seeds", "",
              table2(groups, splits, metrics), "",
              "Final = last RL checkpoint; best = best evaluated RL checkpoint (see Findings). "
              "Average = mean over the held-out splits.", "",
              f"## Table 3 style: final {m0} in %, mean ± std over seeds (sample std)", "",
              table3(groups, splits, metrics[0], start), "",
              f"Final {m1} in %, mean ± std over seeds:", "", table3(groups, splits, metrics[1]), "",
              *statistics,
              "## Training dynamics (mean ± std over seeds)", "", dynamics_table(groups), "",
              "## Figures", ""]
    singles = [p for p in figs if p.stem.startswith("training_") and p.stem != "training_curves"]
    parts += [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in figs if p not in singles]
    if singles:
        parts += ["", "Single panels: " + ", ".join(f"[{p.stem}]({p.relative_to(out).as_posix()})"
                                                     for p in singles)]
    parts.append("")
    parts += ["## Runs", "", runs_table(records, splits), "", "## Files", "",
              "- `results.json`, `results.csv`: every number above (fractions, unrounded; per seed and aggregated)",
              "- `curves.csv`: the data of every figure; `compare_log.jsonl`: run starts / finishes / failures",
              "- `runs/<objective>[_<key>=<value>]/seed<k>/`: each run's own files (summary.json, metrics.jsonl, "
              "eval/, plots/, checkpoints)", ""]
    return "\n".join(parts)
