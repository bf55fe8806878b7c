"""The comparison report: `report.md` (tables, generated findings, figures), `results.json` (the groups' pivots,
the paired comparisons, the aggregates), `results.csv` (the tidy table, one row per number of a run, with the paired
comparisons and aggregates) and `curves.csv` (the data of every figure).

Table cells are percentages of the fractions stored in the runs' `eval/*.json` (rounded to one decimal); the CSV
and JSON hold the unrounded fractions. The sentences come from `trustclip.compare.text`.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trustclip import metric_names as names
from trustclip.compare.figures import FIGURES_DIR, make_figures
from trustclip.compare.plan import RunSpec, format_value, resolve_reference
from trustclip.compare.results import (
    AVERAGE,
    OFFPOLICY,
    OUTCOME,
    SECTIONS,
    SERIES,
    Group,
    RunRecord,
    group_aggregates,
    metric_title,
    outcomes_of,
    paired_comparisons,
    splits_of,
    tidy,
    title_of,
)
from trustclip.compare.stats import LEVEL, Difference, Estimate, Stat, stat
from trustclip.compare.text import (
    findings,
    fmt_interval,
    fmt_pct,
    fmt_pm,
    fmt_signed,
    method_lines,
    needed_text,
    outcome_label,
)
from trustclip.files import read_json, write_json_atomic, write_text_atomic

DYNAMICS = (f"{names.REWARD} (last 10%)", f"{names.ENTROPY} (last 10%)", f"{names.COMPLETION_LENGTH} (last 10%)",
            f"{names.CLIP_ANY} (mean)", f"{OFFPOLICY} (mean)", f"{names.CLIP_LOW} (mean)", f"{names.CLIP_HIGH} (mean)")
CSV_COLUMNS = ("section", "group", "objective", "sweep_key", "sweep_value", "seed", "split", "metric", "statistic",
               "value", "run")


def _table(head: Sequence[str], align: str, rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; `align`: the separator line after the first column's `|---`."""
    return "\n".join(["| " + " | ".join(head) + " |", "|---" + align + "|",
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def _hp(hparams: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in hparams.items() if v is not None) or "-"


# ---------------------------------------------------------------------------------------------------- tables
def table2(groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str]) -> str:
    """Paper Table 2 layout: per split and on average, "final (best)" means over seeds, in %."""
    head = ["Objective"] + [f"{title_of(s)} {metric_title(m)}" for s in splits for m in metrics]
    return _table(head, "|---:" * (len(head) - 1), [
        [g.group] + [f"{fmt_pct(g.stat(f'final/{s}/{m}').mean)} ({fmt_pct(g.stat(f'best/{s}/{m}').mean)})"
                     for s in splits for m in metrics] for g in groups])


def table3(groups: Sequence[Group], splits: Sequence[str], metric: str, start: dict[str, Stat] | None = None) -> str:
    """Paper Table 3 layout: final `metric` as mean ± std over seeds, per split and on average, in %."""
    rows = [[g.group, g.n] + [fmt_pm(g.stat(f"final/{s}/{metric}")) for s in splits] for g in groups]
    if start:
        rows.append(["*RL start (SFT model)*", max((st.n for st in start.values()), default=0)]
                    + [fmt_pm(start[s]) for s in splits])
    return _table(["Objective", "seeds"] + [title_of(s) for s in splits], "|---:" * (len(splits) + 1), rows)


def dynamics_table(groups: Sequence[Group]) -> str:
    """End-of-training reward / entropy / length and the mean clip fractions over RL, per group."""
    keys = [k for k in DYNAMICS if any(f"dynamics/{k}" in g.values for g in groups)]
    if not keys:
        return "_No RL metrics were logged._"
    labels = [SERIES[k.rsplit(" (", 1)[0]] + (" (mean over RL)" if k.endswith("(mean)") else " (last 10%)")
              for k in keys]
    digits = [1 if "length" in k else (4 if "_frac" in k else 3) for k in keys]
    return _table(["Objective", *labels, "seconds per run"], "|---:" * (len(keys) + 1), [
        [g.group] + [fmt_pm(g.stat(f"dynamics/{k}"), 1.0, d) for k, d in zip(keys, digits, strict=True)]
        + [fmt_pm(g.stat("seconds"), 1.0, 0)] for g in groups])


def completions_table(groups: Sequence[Group]) -> str | None:
    """Held-out completions at the RL start and at the end (length, and the policy's entropy where recorded), on the
    held-out average, per group; None when no run's evaluation recorded them."""
    stats = [(key, label, digits) for key, label, digits in (("length", "length (tokens)", 1),
                                                              ("entropy", "entropy (nats/token, T = 1)", 3))
             if any(f"completions/final/{AVERAGE}/{key}" in g.values for g in groups)]
    if not stats:
        return None
    head = ["Objective", *(f"{label}, {when}" for _, label, _ in stats for when in ("RL start", "final"))]
    return _table(head, "|---:" * (len(head) - 1), [
        [g.group] + [fmt_pm(g.stat(f"completions/{when}/{AVERAGE}/{key}"), 1.0, digits)
                     for key, _, digits in stats for when in ("before", "final")] for g in groups])


def runs_table(records: Sequence[RunRecord], splits: Sequence[str]) -> str:
    metrics = records[0].metrics
    avg = AVERAGE if AVERAGE in splits else splits[-1]
    head = ["Run", "objective", "hyper-parameters", *(f"{title_of(avg)} {metric_title(m)} final (best)"
                                                      for m in metrics), "evaluated checkpoints", "seconds"]
    return _table(head, "|---|---" + "|---:" * (len(head) - 3), [
        [r.spec.run_id, r.spec.objective, _hp(r.spec.hparams),
         *(f"{fmt_pct(r.final[avg][m])} ({fmt_pct(r.best[avg][m])})" for m in metrics), len(r.history),
         f"{r.seconds.get('total', math.nan):.0f}"] for r in records])


def paired_table(diffs: Sequence[Difference], k: int) -> str:
    """One row per (group, outcome): group - reference, its interval, seeds, verdict and seeds needed."""
    if not diffs:
        return "_No other group to compare with the reference._"
    return _table(["Group", "Outcome", "Difference", f"{LEVEL:.0%} CI", "n", "Verdict", "Seeds needed"],
                  "|---|---:|---:|---:|---|---:", [
        [d.group, outcome_label(o := OUTCOME[d.outcome], k), f"{fmt_signed(d.mean, o.scale, o.digits)}{o.unit}",
         fmt_interval(d, o.scale, o.digits), d.n, d.verdict, needed_text(d)] for d in diffs])


def _fmt_estimate(e: Estimate | None, scale: float = 100.0, digits: int = 1) -> str:
    if e is None:
        return "n/a"
    if math.isnan(e.low):
        return f"{scale * e.value:.{digits}f} (no interval)"
    return f"{scale * e.value:.{digits}f} [{scale * e.low:.{digits}f}, {scale * e.high:.{digits}f}]"


def aggregates_table(groups: Sequence[Group], aggregates: dict, reference: str, metrics: Sequence[str]) -> str:
    """rliable's IQM and probability of improvement over the reference, with stratified bootstrap intervals."""
    head = (["Group", "seeds"] + [f"IQM {metric_title(m)} (%)" for m in metrics]
            + [f"P(group > {reference}), {metric_title(m)}" for m in metrics])
    return _table(head, "|---:" * (len(head) - 1), [
        [g.group, g.n] + [_fmt_estimate(aggregates.get(g.group, {}).get("iqm", {}).get(m)) for m in metrics]
        + ["(reference)" if g.group == reference else
           _fmt_estimate(aggregates.get(g.group, {}).get("poi", {}).get(m), 1.0, 2) for m in metrics]
        for g in groups])


def start_stats(groups: Sequence[Group], splits: Sequence[str], metric: str) -> tuple[dict[str, Stat], float]:
    """RL-start (SFT) metric per split over distinct seeds, and the largest disagreement between runs of the same
    seed (0 when SFT is deterministic per seed: every objective starts from the same model)."""
    per_seed: dict[int, list[dict[str, dict[str, float]]]] = {}
    for r in (r for g in groups for r in g.runs if r.before):
        per_seed.setdefault(r.spec.seed, []).append(r.before)
    spread = max((abs(a[s][metric] - b[s][metric]) for bs in per_seed.values() for a in bs for b in bs
                  for s in splits if s in a and s in b), default=0.0)
    return {s: stat([bs[0][s][metric] for bs in per_seed.values() if s in bs[0]]) for s in splits}, spread


# --------------------------------------------------------------------------------------------------- writers
def csv_rows(groups: Sequence[Group], diffs: Sequence[Difference] = (),
             aggregates: dict | None = None) -> list[dict[str, Any]]:
    """The tidy table of the groups' runs in long format (fractions, not percentages), then the paired comparisons and
    aggregates."""
    rows: list[dict[str, Any]] = []
    for row in tidy([r for g in groups for r in g.runs]):
        section, sep, rest = row["outcome"].partition("/")
        if not sep:
            section, rest = ("outcome", section) if section in OUTCOME else (section, "total")
        split, metric = rest.rsplit("/", 1) if section in SECTIONS else ("", rest)
        rows.append({"section": section, "group": row["group"], "seed": row["seed"], "split": split, "metric": metric,
                     "statistic": "value", "value": row["value"], "run": row["run"]})
    for d in diffs:
        info = d.to_dict()
        rows += [{"section": f"paired vs {d.reference}", "group": d.group, "metric": d.outcome, "statistic": name,
                  "value": info[name]} for name in ("mean", "low", "high", "n", "sd", "verdict", "seeds_needed")]
    rows += [{"section": kind, "group": group, "metric": metric, "statistic": name, "value": value}
             for group, kinds in (aggregates or {}).items() for kind, per_metric in kinds.items()
             for metric, estimate in per_metric.items() for name, value in estimate.to_dict().items()]
    info = {g.group: {"objective": g.objective, "sweep_key": g.sweep_key or "",
                      "sweep_value": "" if g.sweep_value is None else g.sweep_value} for g in groups}
    return [{**info.get(r["group"], {}), **r} for r in rows]


def _write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                     for row in rows)
    return write_text_atomic(path, buffer.getvalue())


def _group_json(g: Group) -> dict[str, Any]:
    dynamics = {k.partition("/")[2]: g.stat(k).to_dict() for k in g.values if k.startswith("dynamics/")}
    return {"group": g.group, "label": g.label, "objective": g.objective, "hparams": g.hparams,
            "sweep_key": g.sweep_key, "sweep_value": g.sweep_value, "seeds": g.seeds,
            **{section: {s: {m: st.to_dict() for m, st in ms.items()} for s, ms in g.table(section).items()}
               for section in SECTIONS},
            "dynamics": dynamics, "seconds": g.stat("seconds").to_dict(),
            "outcomes": {o.key: {str(seed): v for seed, v in g.values.get(o.key, {}).items()}
                         for o in outcomes_of([g])}}


def _run_json(r: RunRecord) -> dict[str, Any]:
    return {"run_id": r.spec.run_id, "group": r.spec.group, "seed": r.spec.seed, "objective": r.spec.objective,
            "hparams": r.spec.hparams, "dir": str(r.spec.run_dir), "final": r.final, "best": r.best,
            "before": r.before, "history": {str(k): v for k, v in r.history.items()}, "curves": r.curves,
            "seconds": r.seconds, "rl_steps": r.rl_steps}


def sft_seconds(sft_runs: Sequence[RunSpec]) -> Stat:
    """Seconds of the shared SFT runs (from their summary.json)."""
    return stat([(s.get("seconds") or {}).get("total", math.nan) for spec in sft_runs
                 if isinstance(s := read_json(spec.run_dir / "summary.json"), dict)])


def _setting_lines(settings: dict[str, Any], records: Sequence[RunRecord], sft_runs: Sequence[RunSpec],
                   sft_time: Stat) -> list[str]:
    cfg = records[0].spec.config
    rl, ev, data = cfg["rl"], cfg["eval"], cfg["data"]
    seconds = stat([r.seconds.get("total", math.nan) for r in records])
    return [
        f"- Recipe: `{settings.get('config') or 'embedded default'}`; overrides: "
        f"`{' '.join(settings.get('overrides') or []) or 'none'}`",
        f"- Model `{cfg['model']['name_or_path']}`; SFT "
        f"{cfg['sft']['max_steps'] if 'sft' in cfg['stages'] or records[0].spec.depends_on else 0} "
        f"steps; RL {rl['max_steps']} steps, G = {rl['num_generations']}, mu = {rl['num_iterations']}, "
        f"lr = {rl['learning_rate']:g}, aggregation {rl['aggregation']}, advantages {rl['advantage_estimator']}",
        f"- Train data `{data['train']}`; held-out `{', '.join(data['eval'])}`"
        + (f" (first {data['eval_limit']} problems each)" if data.get("eval_limit") else ""),
        f"- Evaluation: K = {ev['k']}, {ev.get('n_samples') or ev['k']} samples per problem, temperature "
        f"{ev['temperature']:g}, top-p {ev['top_p']:g}, max {ev['max_new_tokens']} new tokens, sampling seed "
        f"{ev['seed']}",
        f"- Training seeds: {', '.join(map(str, sorted({r.spec.seed for r in records})))}; only the objective"
        + (f", its hyper-parameters and `{settings['sweep']}`" if settings.get("sweep")
           else " and its hyper-parameters") + " differ between runs",
        f"- Run time (each run's own summary.json): {fmt_pm(seconds, 1.0, 0)} s per RL run, "
        f"{math.fsum(seconds.values) / 60:.1f} min summed over {seconds.n} runs",
        *([f"- SFT shared per seed: every objective of a seed starts RL from the same SFT model ({len(sft_runs)} SFT "
           f"run(s) in `runs/_sft*`, {fmt_pm(sft_time, 1.0, 0)} s each; not included in the seconds per run "
           "below)"] if sft_runs else []),
    ]


def _statistics_markdown(groups: Sequence[Group], metrics: Sequence[str], reference: str,
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


def _markdown(records: Sequence[RunRecord], groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str],
              setting: Sequence[str], text: Sequence[str], figs: Sequence[Path], out: Path, start: dict[str, Stat],
              missing: Sequence[str], failed: dict[str, str], statistics: Sequence[str]) -> str:
    m0, m1 = (metric_title(m) for m in metrics)
    parts = ["# trustclip compare: " + ", ".join(g.group for g in groups), "", "## Setting", "", *setting, "",
             "## Findings (generated from the numbers below)", "", *[f"- {t}" for t in text], ""]
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
              *statistics, "## Training dynamics (mean ± std over seeds)", "", dynamics_table(groups), ""]
    if (held_out := completions_table(groups)) is not None:
        parts += ["## Held-out completions (mean ± std over seeds)", "", held_out, "",
                  "The evaluation's samples (K per problem, the evaluation's temperature), averaged over the held-out "
                  "splits; entropy: the policy's own next-token distribution (T = 1) over each completion's tokens.",
                  ""]
    parts += ["## Figures", ""]
    singles = [p for p in figs if p.stem.startswith("training_") and p.stem != "training_curves"]
    parts += [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in figs if p not in singles]
    if singles:
        parts += ["", "Single panels: " + ", ".join(f"[{p.stem}]({p.relative_to(out).as_posix()})" for p in singles)]
    return "\n".join([*parts, "", "## Runs", "", runs_table(records, splits), "", "## Files", "",
                      "- `results.json`: every number above (fractions, unrounded; per seed and per group); "
                      "`results.csv`: one row per number of a run, then the paired comparisons and IQM / "
                      "P(improvement)",
                      "- `curves.csv`: the data of every figure; `compare_log.jsonl`: run starts / finishes / failures",
                      "- `runs/<objective>[_<key>=<value>]/seed<k>/`: each run's own files (summary.json, "
                      "metrics.jsonl, eval/, plots/, checkpoints)", ""])


def write_report(records: Sequence[RunRecord], groups: Sequence[Group], out: str | Path, *, settings: dict[str, Any],
                 planned: Sequence[RunSpec], failed: dict[str, str] | None = None, window: int | None = None,
                 sft_runs: Sequence[RunSpec] = (), reference: str | None = None) -> dict[str, Path]:
    """Write report.md, results.json, results.csv, curves.csv and the figures; returns their paths.
    `reference`: the group the paired comparisons are against (default as `resolve_reference`)."""
    out = Path(out)
    if not records:
        raise ValueError("no finished runs to report on")
    splits, metrics, k = splits_of(records), list(records[0].metrics), records[0].k
    reference = reference or resolve_reference(None, [(g.group, g.label, g.objective) for g in groups])
    finished_reference = any(g.group == reference for g in groups)
    diffs = paired_comparisons(groups, reference) if finished_reference else []
    aggregates = group_aggregates(groups, reference, splits, metrics) if finished_reference else {}
    figs, curve_rows = make_figures(groups, splits, metrics, out / FIGURES_DIR, window)
    start, start_spread = start_stats(groups, splits, metrics[0])
    done = {r.spec.run_id for r in records}
    missing = [s.run_id for s in planned if s.run_id not in done]
    text = findings(groups, splits, metrics, len(planned), len(records), records[0].spec.config["rl"].get(
        "eval_every"), reference, diffs)
    if start_spread > 1e-9:
        text.append(f"Runs of the same seed started RL from SFT models whose {metric_title(metrics[0])} differs by "
                    f"up to {fmt_pct(start_spread)} points: SFT is not bit-reproducible here.")
    sft_time = sft_seconds(sft_runs)
    md = _markdown(records, groups, splits, metrics, _setting_lines(settings, records, sft_runs, sft_time), text,
                   figs, out, start, missing, failed or {},
                   _statistics_markdown(groups, metrics, reference, diffs, aggregates, k))
    paths = {"report": write_text_atomic(out / "report.md", md),
             "csv": _write_csv(out / "results.csv", csv_rows(groups, diffs, aggregates), CSV_COLUMNS),
             "curves": _write_csv(out / "curves.csv", curve_rows,
                                  ["figure", "panel", "group", "x", "mean", "std", "n_seeds"])}
    paths["json"] = write_json_atomic(out / "results.json", {
        "settings": settings, "k": k, "splits": splits, "metrics": metrics,
        "planned": [s.run_id for s in planned], "missing": missing, "failed": failed or {},
        "findings": text, "groups": [_group_json(g) for g in groups], "runs": [_run_json(r) for r in records],
        "rl_start": {s: st.to_dict() for s, st in start.items()},
        "shared_sft": {"runs": [s.run_id for s in sft_runs], "seconds": sft_time.to_dict()},
        "figures": [str(p.relative_to(out)) for p in figs], "reference": reference,
        "method": method_lines(reference, k),
        "outcomes": {o.key: outcome_label(o, k) for o in outcomes_of(groups)},
        "comparisons": [d.to_dict() for d in diffs],
        "aggregates": {g: {kind: {m: e.to_dict() for m, e in per.items()} for kind, per in kinds.items()}
                       for g, kinds in aggregates.items()},
    })
    return paths | {fig.stem: fig for fig in figs}
