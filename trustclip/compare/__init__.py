"""`trustclip compare`: multi-seed comparison of objectives with everything else held fixed.

    plan.py     an experiment as data: groups x seeds, each run a validated training config
    runner.py   the runs, resumable, in a small pool of worker processes
    results.py  finished runs -> one tidy table (run, group, seed, outcome, value) and its pivots per group
    stats.py    paired differences and their intervals; text.py: the report's English
    report.py, figures.py   report.md, results.json / .csv, curves.csv and the figures

`run_compare(CompareSettings)` does all of it; the settings are saved as `compare.json` in the output directory so
that `--report-only` (or a rerun without `--objectives`) reuses them. The reference group (`--reference`) is a report
setting: it changes no run, and `--report-only --reference X` rebuilds the report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trustclip.compare.plan import (
    RunSpec,
    Sweep,
    base_config,
    parse_hparams,
    parse_objectives,
    parse_seeds,
    parse_sweep,
    plan_runs,
    resolve_reference,
)
from trustclip.compare.report import write_report
from trustclip.compare.results import Group, RunDataError, RunRecord, group_runs, load_run
from trustclip.compare.runner import ExecutionResult, check_changed, check_runs, execute, is_finished
from trustclip.files import read_json, write_json_atomic
from trustclip.train.config import parse_override

SETTINGS_FILE = "compare.json"
EXPERIMENT_KEYS = ("objectives", "seeds", "config", "overrides", "sweep", "hparams", "share_sft", "eval_every",
                   "runs_dir")
DEFAULT_SEEDS = 5  # fewer than 4 seeds can never give a bounded paired interval (trustclip.compare.stats)
EVAL_POINTS = 5  # periodic evaluations per run when the recipe has none (eval accuracy vs step)

__all__ = ["CompareSettings", "ExecutionResult", "Group", "RunDataError", "RunRecord", "RunSpec", "Sweep",
           "group_runs", "build_report", "execute", "is_finished", "load_run", "plan_runs", "run_compare"]


@dataclass
class CompareSettings:
    """Everything `trustclip compare` needs; see `trustclip compare --help`."""

    output_dir: Path
    objectives: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: list(range(DEFAULT_SEEDS)))
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    sweep: str | None = None
    hparams: list[str] = field(default_factory=list)
    jobs: int | None = None
    threads_per_job: int | None = None
    resume_partial: bool = True
    redo_changed: bool = False
    run_timeout: float | None = None
    dry_run: bool = False
    report_only: bool = False
    progress_every: float = 30.0
    pipeline: str | None = None
    smooth: int | None = None
    share_sft: bool = True
    eval_every: int | None = None  # None: the recipe's rl.eval_every, or max_steps // EVAL_POINTS if that is 0
    reference: str | None = None  # group the report compares against; None: the first clip group, else the first
    runs_dir: str | None = None  # where the runs live (a pool several compares share); None: the output directory

    def __post_init__(self) -> None:
        for flag, value in (("--run-timeout", self.run_timeout), ("--progress-every", self.progress_every)):
            if value is not None and not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"{flag} {value!r} is invalid: give a number of seconds > 0"
                                 + (" (or leave it out for no limit)" if flag == "--run-timeout" else ""))

    @classmethod
    def from_args(cls, args: Any) -> CompareSettings:
        """From parsed CLI arguments; without --objectives, the experiment saved in --output-dir is reused."""
        out = Path(args.output_dir)
        saved = read_json(out / SETTINGS_FILE)
        if args.objectives is None:
            if not isinstance(saved, dict):
                raise ValueError(f"--objectives is required ({out / SETTINGS_FILE} holds no earlier compare)")
            given = [flag for flag, value in (("--seeds", args.seeds), ("--seed-list", args.seed_list),
                                              ("--config", args.config), ("--set", args.overrides),
                                              ("--sweep", args.sweep), ("--hparam", args.hparam),
                                              ("--no-share-sft", args.no_share_sft),
                                              ("--eval-every", args.eval_every),
                                              ("--runs-dir", args.runs_dir)) if value]
            if given:
                raise ValueError(f"{', '.join(given)} change(s) the experiment: give --objectives too "
                                 f"(without it, the experiment saved in {out / SETTINGS_FILE} is reused)")
            experiment = {k: saved[k] for k in EXPERIMENT_KEYS if k in saved}
        else:
            experiment = {"objectives": parse_objectives(args.objectives),
                          "seeds": parse_seeds(DEFAULT_SEEDS if args.seeds is None else args.seeds, args.seed_list),
                          "config": args.config,
                          "overrides": list(args.overrides), "sweep": args.sweep, "hparams": list(args.hparam),
                          "share_sft": not args.no_share_sft, "eval_every": args.eval_every,
                          "runs_dir": None if args.runs_dir is None else str(args.runs_dir)}
        for name in ("jobs", "threads_per_job", "smooth"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        reference = args.reference
        if reference is None and args.objectives is None:
            reference = saved.get("reference")  # the reused experiment's last reference
        return cls(output_dir=out, **experiment, jobs=args.jobs, threads_per_job=args.threads_per_job,
                   resume_partial=not args.restart_partial, redo_changed=args.redo_changed,
                   run_timeout=args.run_timeout,
                   dry_run=args.dry_run, report_only=args.report_only, progress_every=args.progress_every,
                   pipeline=args.pipeline, smooth=args.smooth, reference=reference)

    def experiment(self) -> dict[str, Any]:
        """The part that defines the runs (saved to compare.json)."""
        return {k: v for k, v in asdict(self).items() if k in EXPERIMENT_KEYS}

    def base_config(self) -> dict[str, Any]:
        """Recipe + overrides, with the periodic evaluation the accuracy-vs-step figure needs: `eval_every`
        if given, else the recipe's (or `--set rl.eval_every`), else max_steps // 5 when that is 0."""
        base = base_config(self.config, self.overrides)
        if self.eval_every is not None:
            if self.eval_every < 0:
                raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")
            base["rl"]["eval_every"] = self.eval_every
        elif base["rl"]["eval_every"] == 0 and "rl.eval_every" not in {parse_override(o)[0] for o in self.overrides}:
            base["rl"]["eval_every"] = max(1, base["rl"]["max_steps"] // EVAL_POINTS)
        return base

    def plan(self) -> list[RunSpec]:
        labels = parse_objectives(self.objectives)
        saved = read_json(self.output_dir / SETTINGS_FILE)
        base = None
        if self.report_only and isinstance(saved, dict) and saved.get("experiment") == self.experiment():
            base = saved.get("base_config")  # the recipe file may have changed since; the runs have not
        if base is None:
            base = self.base_config()
        return plan_runs(labels, self.seeds, self.runs_root, sweep=parse_sweep(self.sweep),
                         hparams=parse_hparams(self.hparams, labels), base=base, share_sft=self.share_sft)

    @property
    def runs_root(self) -> Path:
        """The directory whose `runs/` holds the runs: `runs_dir` when several compares share a pool (a run with the
        same settings is then made once, and every compare of the pool starts RL from the same SFT model per seed),
        else the output directory."""
        return Path(self.runs_dir) if self.runs_dir else self.output_dir

    def reference_group(self, runs: list[RunSpec]) -> str:
        """The reference group among the planned runs (raises ValueError naming the groups)."""
        return resolve_reference(self.reference, [(r.group, r.label, r.objective) for r in runs if r.kind == "rl"])


def build_report(settings: CompareSettings, runs: list[RunSpec], failed: dict[str, str] | None = None,
                 say: Callable[[str], None] = print) -> dict[str, Path] | None:
    """Report on the finished runs of the plan (None when none has finished)."""
    records = []
    sft_runs = [s for s in runs if s.kind == "sft"]
    runs = [s for s in runs if s.kind == "rl"]
    for spec in runs:
        if not is_finished(spec):
            continue
        try:
            records.append(load_run(spec))
        except RunDataError as err:
            (failed if failed is not None else {})[spec.run_id] = str(err)
            say(f"! {spec.run_id}: {err}")
    if not records:
        say("no finished runs yet: no report written")
        return None
    groups = group_runs(records)
    paths = write_report(records, groups, settings.output_dir, settings=settings.experiment(), planned=runs,
                         failed=failed, window=settings.smooth, sft_runs=sft_runs,
                         reference=settings.reference_group(runs))
    say(f"report: {paths['report']} ({len(records)}/{len(runs)} runs; {len(paths) - 4} figures)")
    return paths


def _print_plan(runs: list[RunSpec], say: Callable[[str], None]) -> None:
    for spec in runs:
        status = "finished" if is_finished(spec) else ("partial" if spec.run_dir.exists() else "pending")
        say(f"  {spec.run_id:<40} {status:<9} {spec.objective} {spec.hparams}  -> {spec.run_dir}")


def run_compare(settings: CompareSettings, say: Callable[[str], None] = print) -> int:
    """Plan, run what is unfinished, report. Exit code: 0 all runs finished, 1 some failed or missing,
    130 interrupted."""
    runs = settings.plan()
    reference = settings.reference_group(runs)  # a bad --reference fails before any run starts
    if settings.pipeline is None:
        check_runs(runs)  # every run as `trustclip train` checks it, before any starts (also with --dry-run)
    rl = [r for r in runs if r.kind == "rl"]
    sft = f" + {len(runs) - len(rl)} shared SFT runs" if len(rl) < len(runs) else ""
    say(f"compare: {len(rl)} runs ({len({r.group for r in rl})} objectives/settings x {len(settings.seeds)} seeds)"
        f"{sft} in {settings.output_dir}")
    say(f"paired comparisons against: {reference}")
    if settings.dry_run:
        _print_plan(runs, say)
        return 0
    if not settings.report_only:
        if not settings.redo_changed:
            check_changed(runs)  # refuse before touching compare.json
        settings.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(settings.output_dir / SETTINGS_FILE, {
            "experiment": settings.experiment(), **settings.experiment(), "base_config": settings.base_config(),
            "reference": settings.reference, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")})
        t0 = time.time()
        result = execute(runs, settings.output_dir, jobs=settings.jobs, threads=settings.threads_per_job,
                         resume_partial=settings.resume_partial, redo_changed=settings.redo_changed,
                         pipeline=settings.pipeline, run_timeout=settings.run_timeout, progress=say,
                         progress_every=settings.progress_every)
        say(f"ran {len(result.finished)} run(s) in {time.time() - t0:.0f} s; {len(result.skipped)} were already "
            f"finished; {len(result.failed)} failed")
        if result.interrupted:
            return 130
        failed = dict(result.failed)
    else:
        failed = {}
        saved = read_json(settings.output_dir / SETTINGS_FILE)
        if isinstance(saved, dict) and saved.get("reference") != settings.reference:
            write_json_atomic(settings.output_dir / SETTINGS_FILE, {**saved, "reference": settings.reference})
    build_report(settings, runs, failed, say)
    return 0 if all(is_finished(r) for r in runs) else 1
