"""The comparison report: `report.md`, `results.csv` (the tidy table), `results.json` (the settings, the groups and the
paired comparisons), `curves.csv` (the data of every figure) and `problems.csv` (each run's count per held-out problem,
where its evaluation recorded them); table cells round the CSV's fractions to percentages.
Comparing sentences are `difference_sentence`s: nothing whose 95 % interval includes 0 is called higher or lower."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trustclip.compare.figures import make_figures
from trustclip.compare.paired_stats import (
    LEVEL,
    MAX_SEEDS,
    RESAMPLES,
    Difference,
    Stat,
    paired_difference,
    stat,
    sweep_trend,
)
from trustclip.compare.plan import RunSpec
from trustclip.compare.results import (
    AVERAGE,
    OUTCOME,
    PRIMARY,
    SERIES,
    Group,
    Outcome,
    RunRecord,
    outcomes_of,
    paired_comparisons,
    splits_of,
    start_stats,
    tidy,
    title_of,
)
from trustclip.files import read_json, write_json_atomic, write_text_atomic


# ------------------------------------------------------------------------------------------------- numbers
def fmt(x: float | None, scale: float = 100.0, digits: int = 1, sign: str = "") -> str:
    """scale * x rounded, 'n/a' for None or NaN; `sign` "+" for a signed difference (infinite bounds: '+inf')."""
    return "n/a" if x is None or math.isnan(x) else f"{scale * x:{sign}.{digits}f}"


def fmt_pm(s: Stat, scale: float = 100.0, digits: int = 1) -> str:
    """'41.2 ± 1.3' ('41.2' for one seed, 'n/a' for none)."""
    return fmt(s.mean, scale, digits) + (f" ± {fmt(s.std, scale, digits)}" if s.n > 1 else "")


def fmt_interval(d: Difference, o: Outcome = PRIMARY, head: str = "") -> str:
    """'[-0.4, +2.1]' in the outcome's unit, `head` inside the bracket ('n/a' below 2 seeds)."""
    return "n/a" if d.n < 2 else f"[{head}{fmt(d.low, o.scale, o.digits, '+')}, {fmt(d.high, o.scale, o.digits, '+')}]"


def needed_text(d: Difference) -> str:
    if d.seeds_needed is not None:
        return str(d.seeds_needed)
    return f"> {MAX_SEEDS}" if d.n >= 2 and d.sd > 0 and d.mean != 0 else "not estimable"


# ----------------------------------------------------------------------------------------------- sentences
def difference_sentence(d: Difference, what: str, o: Outcome = PRIMARY) -> str:
    """The sentence of one paired difference (`what`: its outcome's words, `o`: its unit), from its interval only."""
    head = f"{d.group} - {d.reference}, {what}: "
    if d.n == 0:
        return head + "no seed has both runs finished."
    if d.verdict == "identical":
        return head + f"identical on all {d.n} paired seed(s) (every difference is exactly 0)."
    text = head + fmt(d.mean, o.scale, o.digits, "+") + o.unit  # '+1.2 points': in the outcome's unit
    if d.n < 2:
        return text + f" on one paired seed (seed {d.seeds[0]}): no interval with one seed, nothing is claimed."
    text += f" {fmt_interval(d, o, f'{LEVEL:.0%} CI ')}, n = {d.n} paired seeds"
    if d.verdict in ("higher", "lower"):
        return text + f": {d.verdict} than {d.reference}."
    needed = needed_text(d)
    more = (f"about {needed} seeds would be needed to resolve a difference this size" if d.seeds_needed
            else f"the seeds needed to resolve it are {needed}" + (" (more than we try)" if ">" in needed else ""))
    return text + f"; the interval includes 0: no difference resolved at n = {d.n}; {more}."


def findings(groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str], n_planned: int,
             n_finished: int, eval_every: int | None, reference: str, diffs: Sequence[Difference]) -> list[str]:
    """The Findings: sentences generated from the paired intervals; of the comparisons with the reference, the primary
    outcome's only (lifting the resolved ones out of every outcome's would be fishing: they are in the paired table)."""
    avg, k = splits[-1], int(metrics[0].partition("@")[2])  # `splits_of`: the average is last
    primary = f"{title_of(avg)} {metrics[0].capitalize()}"
    out = [f"{n_finished} of {n_planned} planned runs finished; seeds per group: "
           + ", ".join(f"{g.group} {len(g.runs)}" for g in groups) + "."]
    if not any(g.group == reference for g in groups):
        out.append(f"The reference group {reference} has no finished run: no paired comparisons yet.")
    out += [difference_sentence(d, PRIMARY.label.format(k=k)) for d in diffs if d.outcome == PRIMARY.key]
    # how RL moved each run: final policy - its own RL start, paired within the run (completions where recorded)
    changes = [(f"final/{avg}/{metrics[0]}", f"before/{avg}/{metrics[0]}", PRIMARY, f"held-out {primary}")] + [
        (f"completions/final/{avg}/{what}", f"completions/before/{avg}/{what}", o := OUTCOME[f"eval_{what}"],
         o.label.replace(", final", f", {title_of(avg)}")) for what in ("entropy", "length")]
    out += [difference_sentence(paired_difference(g.values[final], g.values.get(start, {}), group=g.group,
                                                  ref="RL start", outcome=o.key), what, o)
            for final, start, o, what in changes for g in groups if final in g.values]
    for label in dict.fromkeys(g.spec.label for g in groups if g.spec.sweep_key is not None):  # a sweep: its slope
        members = [g for g in groups if g.spec.label == label and g.spec.sweep_key is not None]
        if len(members) >= 3 and all(isinstance(g.spec.sweep_value, int | float) for g in members):
            for o in (PRIMARY, OUTCOME["pass@K"]):
                d, log = sweep_trend({g.spec.sweep_value: g.values[o.key] for g in members}, group=label, outcome=o.key)
                per = f"tenfold {members[0].spec.sweep_key}" if log else f"unit of {members[0].spec.sweep_key}"
                if d.n:  # no seed has every swept value yet: no slope to state
                    out.append(difference_sentence(d, f"slope of {o.label.format(k=k)} per {per}", o))
    if intervals := sum(d.n >= 2 for d in diffs):
        out.append(f"{intervals} paired intervals at {LEVEL:.0%} each, not adjusted for multiplicity: were no "
                   f"difference real, about {(1 - LEVEL) * intervals:.1f} of them would exclude 0 by chance. The "
                   f"primary outcome is the final held-out {primary}.")
    checkpoints = sorted({len(r.history) for g in groups for r in g.runs})
    out.append("Only the RL start and the final policy were evaluated (rl.eval_every = 0), so best = final and the "
               "accuracy-vs-step figure has two points; `--set rl.eval_every=N` adds checkpoints." if checkpoints == [1]
               else f"'best' is the maximum over {'/'.join(map(str, checkpoints))} evaluated RL checkpoints (every "
               f"{eval_every} steps and the last), chosen on the same held-out problems it is reported on, so it is "
               "optimistic; 'final' is the unbiased number.")
    return out


# -------------------------------------------------------------------------------------------------- tables
def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; `align`: the separator after the first column's `|---` (default: the others right)."""
    return "\n".join(["| " + " | ".join(head) + " |", "|---" + (align or "|---:" * (len(head) - 1)) + "|",
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def stat_table(groups: Sequence[Group], columns: Sequence[tuple[str, str, float, int]]) -> str:
    """Groups x outcomes of the tidy table as mean ± std over seeds; `columns`: (head, outcome, scale, digits)."""
    return _table(["Objective", *(head for head, *_ in columns)], [
        [g.group, *(fmt_pm(g.stat(key), scale, digits) for _, key, scale, digits in columns)] for g in groups])


def table2(groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str]) -> str:
    """Paper Table 2 layout: per split and on average, "final (best)" means over seeds, in %."""
    return _table(["Objective", *(f"{title_of(s)} {m.capitalize()}" for s in splits for m in metrics)], [
        [g.group, *(f"{fmt(g.stat(f'final/{s}/{m}').mean)} ({fmt(g.stat(f'best/{s}/{m}').mean)})"
                    for s in splits for m in metrics)] for g in groups])


def table3(groups: Sequence[Group], splits: Sequence[str], metric: str, start: dict[str, Stat] | None = None) -> str:
    """Paper Table 3 layout: final `metric` as mean ± std over seeds, per split and on average, in %."""
    rows = [[g.group, len(g.runs), *(fmt_pm(g.stat(f"final/{s}/{metric}")) for s in splits)] for g in groups]
    if start:
        rows.append(["*RL start (SFT model)*", max(st.n for st in start.values()), *(fmt_pm(start[s]) for s in splits)])
    return _table(["Objective", "seeds", *map(title_of, splits)], rows)


def dynamics_table(groups: Sequence[Group]) -> str:
    """End-of-training reward / entropy / length and the mean clip fractions over RL (`SERIES`), per group."""
    columns = [(f"{label} ({'mean over RL' if how == 'mean' else how})", f"dynamics/{key} ({how})", 1.0, digits)
               for key, (label, how, digits) in SERIES.items()
               if any(f"dynamics/{key} ({how})" in g.values for g in groups)]
    seconds = ("seconds per run", "seconds", 1.0, 0)
    return stat_table(groups, [*columns, seconds]) if columns else "_No RL metrics were logged._"


def completions_table(groups: Sequence[Group]) -> str | None:
    """Held-out length (and entropy) of the completions at the RL start and the end, per group; None if unrecorded."""
    stats = (("length", "length (tokens)", 1), ("entropy", "entropy (nats/token, T = 1)", 3))
    columns = [(f"{label}, {when_text}", f"completions/{when}/{AVERAGE}/{key}", 1.0, digits)
               for key, label, digits in stats
               if any(f"completions/final/{AVERAGE}/{key}" in g.values for g in groups)
               for when, when_text in (("before", "RL start"), ("final", "final"))]
    return stat_table(groups, columns) if columns else None


def problems_table(groups: Sequence[Group], splits: Sequence[str], k: int, reference: str | None) -> str | None:
    """Per held-out split and group, the share of problems the final policy solved 0 of K and K of K times (mean over
    seeds, %), and the share of (seed, problem) pairs at the same extreme as the reference's run of that seed: such a
    problem adds exactly 0 to the paired difference, so a split where most are tied cannot separate the groups. None
    where no evaluation recorded its per-problem counts."""
    runs = {g.group: {r.spec.seed: r.solved for r in g.runs if r.solved} for g in groups}
    if not any(runs.values()):
        return None
    ref = runs.get(reference or "", {})

    def share(values: list[bool]) -> str:
        return fmt(float(np.mean(values))) if values else "n/a"

    rows = []
    for split in (s for s in splits if s != AVERAGE):
        for g in groups:
            counts = {seed: c[split] for seed, c in runs[g.group].items() if split in c}
            if not counts:
                continue
            per_run = [(np.mean([c == 0 for c in cs]), np.mean([c == k for c in cs])) for cs in counts.values()]
            tied: list[bool] = []
            for seed, cs in counts.items() if g.group != reference else ():
                theirs = ref.get(seed, {}).get(split)
                if theirs is not None and len(theirs) == len(cs):  # the same problems, in order
                    tied += [a == b and a in (0, k) for a, b in zip(cs, theirs, strict=True)]
            rows.append([title_of(split), g.group, len(counts), len(next(iter(counts.values()))),
                         fmt(float(np.mean([z for z, _ in per_run]))), fmt(float(np.mean([a for _, a in per_run]))),
                         *([share(tied) if g.group != reference else "-"] if reference else [])])
    head = ["Split", "Objective", "seeds", "problems", f"0 of {k} (%)", f"{k} of {k} (%)"]
    return _table(head + ([f"tied with {reference} at 0 or {k} (%)"] if reference else []), rows,
                  "|---" + "|---:" * (len(rows[0]) - 2))


def problem_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """problems.csv: every final policy's correct samples of each held-out problem (run, group, seed, split, problem,
    solved, k)."""
    return [{"run": r.spec.run_id, "group": g.group, "seed": r.spec.seed, "split": split, "problem": i,
             "solved": c, "k": r.k} for g in groups for r in g.runs for split, counts in r.solved.items()
            for i, c in enumerate(counts)]


def paired_table(diffs: Sequence[Difference], k: int) -> str:
    """One row per (group, outcome): group - reference, its interval, seeds, verdict and seeds needed."""
    if not diffs:
        return "_No other group to compare with the reference._"
    return _table(["Group", "Outcome", "Difference", f"{LEVEL:.0%} CI", "n", "Verdict", "Seeds needed"], [
        [d.group, (o := OUTCOME[d.outcome]).label.format(k=k), fmt(d.mean, o.scale, o.digits, "+") + o.unit,
         fmt_interval(d, o), d.n,
         d.verdict, needed_text(d)] for d in diffs], "|---|---:|---:|---:|---|---:")


# ----------------------------------------------------------------------------------------------- the files
def _write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()} for row in rows)
    return write_text_atomic(path, buffer.getvalue())


def write_report(records: Sequence[RunRecord], groups: Sequence[Group], out: str | Path, *, settings: dict[str, Any],
                 planned: Sequence[RunSpec], failed: dict[str, str], window: int | None, sft_runs: Sequence[RunSpec],
                 reference: str) -> dict[str, Path]:
    """Write report.md, results.csv, results.json, curves.csv and the figures; returns their paths."""
    out, splits, metrics, k = Path(out), splits_of(records), list(records[0].metrics), records[0].k
    cfg = records[0].spec.config
    (m0, m1), rl, ev, data = (m.capitalize() for m in metrics), cfg["rl"], cfg["eval"], cfg["data"]
    finished_reference = any(g.group == reference for g in groups)
    diffs = paired_comparisons(groups, reference) if finished_reference else []
    figs, curve_rows = make_figures(groups, splits, metrics, out / "figures", window,
                                    reference if finished_reference else None)
    start = start_stats(groups, splits, metrics[0])
    missing = [s.run_id for s in planned if s.run_id not in {r.spec.run_id for r in records}]
    text = findings(groups, splits, metrics, len(planned), len(records), rl.get("eval_every"), reference, diffs)
    seconds = stat([r.seconds.get("total", math.nan) for r in records])
    sft = stat([(s.get("seconds") or {}).get("total", math.nan) for spec in sft_runs
                if isinstance(s := read_json(spec.run_dir / "summary.json"), dict)])
    setting = [
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
        f"{math.fsum(seconds.values) / 60:.1f} min summed over {seconds.n} runs"]
    # a swept option that changes SFT gives each of its values its own SFT run
    start_model = "the same SFT model" if len(sft_runs) == len({s.seed for s in sft_runs}) else "its value's SFT model"
    if sft_runs:
        setting.append(f"- SFT shared per seed: every objective of a seed starts RL from {start_model} "
                       f"({len(sft_runs)} SFT run(s) in `runs/_sft*`, {fmt_pm(sft, 1.0, 0)} s each; not included in "
                       "the seconds per run below)")
    # the blocks of report.md, separated by blank lines
    md = ["# trustclip compare: " + ", ".join(g.group for g in groups), "## Setting", "\n".join(setting),
          "## Findings (generated from the numbers below)", "\n".join(f"- {t}" for t in text)]
    if missing:
        md.append(f"**Missing runs ({len(missing)}):** " + ", ".join(missing))
        md += ["\n".join(f"- {run_id}: {why}" for run_id, why in failed.items())] if failed else []
    md += [f"## Table 2 style: final (best) {m0} / {m1} in %, mean over seeds", table2(groups, splits, metrics),
           "Final = last RL checkpoint; best = best evaluated RL checkpoint (see Findings). Average = mean over the "
           "held-out splits.", f"## Table 3 style: final {m0} in %, mean ± std over seeds (sample std)",
           table3(groups, splits, metrics[0], start), f"Final {m1} in %, mean ± std over seeds:",
           table3(groups, splits, metrics[1]), f"## Paired comparisons against {reference}"]
    md += [f"_{reference} has no finished run yet._"] if not finished_reference else [
        paired_table(diffs, k),
        f"Difference = group - **{reference}** per seed (the runs of one seed start RL from {start_model}), on "
        f"the seeds both groups have finished; {LEVEL:.0%} CI: studentised bootstrap (bootstrap-t) of the mean "
        f"difference ({RESAMPLES} resamples), unbounded with 2-3 seeds; verdict higher / lower only when the interval "
        "excludes 0; seeds needed: for a paired t-test at power 0.8. The outcomes, the method and its measured "
        "coverage: `docs/compare-statistics.md` in the trustclip repository."]
    md += ["## Training dynamics (mean ± std over seeds)", dynamics_table(groups)]
    if (held_out := completions_table(groups)) is not None:
        md += ["## Held-out completions (mean ± std over seeds)", held_out,
               "The evaluation's samples (K per problem, the evaluation's temperature), averaged over the held-out "
               "splits; entropy: the policy's own next-token distribution (T = 1) over each completion's tokens."]
    if (problems := problems_table(groups, splits, k, reference if finished_reference else None)) is not None:
        md += [f"## Held-out problems: how many can separate the groups (final policies, K = {k})", problems,
               f"Per run, the share of the split's problems its final policy solved in none and in all of its {k} "
               "samples, mean over seeds; tied: (seed, problem) pairs where the run and the reference's run of the "
               "same seed are both at 0 or both at K, which add exactly 0 to that seed's difference. Every run's "
               "count per problem: `problems.csv`."]
    md += ["## Figures", "\n".join(f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in figs)]
    return {"report": write_text_atomic(out / "report.md", "\n\n".join(md) + "\n"),
            "csv": _write_csv(out / "results.csv", tidy([r for g in groups for r in g.runs]),
                              ["run", "group", "seed", "outcome", "value"]),
            "curves": _write_csv(out / "curves.csv", curve_rows, ["figure", "panel", "group", "x", "mean", "std",
                                                                   "n_seeds"]),
            **({"problems": _write_csv(out / "problems.csv", rows, ["run", "group", "seed", "split", "problem",
                                                                    "solved", "k"])}
               if (rows := problem_rows(groups)) else {}),
            "json": write_json_atomic(out / "results.json", {  # the runs' numbers are in results.csv only
                "settings": settings, "reference": reference, "k": k, "splits": splits, "metrics": metrics,
                "planned": [s.run_id for s in planned], "missing": missing, "failed": failed,
                "shared_sft": [s.run_id for s in sft_runs], "figures": [str(p.relative_to(out)) for p in figs],
                "outcomes": {o.key: o.label.format(k=k) for o in outcomes_of(groups)},
                "groups": [{"group": g.group, "label": g.spec.label, "objective": g.spec.objective,
                            "hparams": g.spec.hparams, "sweep_key": g.spec.sweep_key, "sweep_value": g.spec.sweep_value,
                            "seeds": [r.spec.seed for r in g.runs]} for g in groups],
                "comparisons": [d.to_dict() for d in diffs]}),
            } | {fig.stem: fig for fig in figs}
