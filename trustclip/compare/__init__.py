"""`trustclip compare`: a multi-seed comparison of objectives with everything else held fixed. `run_compare` plans the
experiment (plan.py), makes its unfinished runs (runner.py) and reports on the finished ones (results.py, report.py,
figures.py; the statistics: paired_stats.py). The experiment is saved as compare.json in the
output directory, so that `--report-only` (or a rerun without `--objectives`) reuses it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from trustclip.compare import plan as planning
from trustclip.compare.plan import RunSpec, plan_runs
from trustclip.compare.report import write_report
from trustclip.compare.results import RunDataError, group_runs, load_run
from trustclip.compare.runner import check_runs, execute, is_finished
from trustclip.files import read_json, write_json_atomic

SETTINGS_FILE = "compare.json"
DEFAULT_SEEDS = 5  # fewer than 4 seeds can never give a bounded paired interval (docs/compare-statistics.md)


def read_saved(output_dir: str | Path) -> dict[str, Any] | None:
    """The settings an earlier compare saved in `output_dir` (None when there are none)."""
    saved = read_json(Path(output_dir) / SETTINGS_FILE)
    return saved if isinstance(saved, dict) else None


@dataclass(kw_only=True)
class Experiment:
    """What defines the runs, saved in compare.json: groups (objectives x sweep values) x seeds x settings."""

    objectives: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: list(range(DEFAULT_SEEDS)))
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    sweep: str | None = None
    runs_dir: str | None = None  # where runs/ is: a pool that several compares share (--runs-dir); None: output_dir


EXPERIMENT_KEYS = tuple(f.name for f in fields(Experiment))  # compare.json


@dataclass(kw_only=True)
class CompareSettings(Experiment):
    """Everything `trustclip compare` needs (`trustclip.commands.compare` builds it from the command line); the numbers
    are checked on creation, before anything is planned or written."""

    output_dir: Path
    # how to run them
    jobs: int | None = None
    threads_per_job: int | None = None
    dry_run: bool = False
    report_only: bool = False
    pipeline: str | None = None  # MODULE:FUNCTION in place of run_pipeline (the tests' stand-in); None: the real one
    # the report
    smooth: int | None = None
    reference: str | None = None  # group the report compares against; None: the first clip group, else the first

    def __post_init__(self) -> None:
        for name, least in (("jobs", 1), ("threads_per_job", 1), ("smooth", 1)):
            if (value := getattr(self, name)) is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")

    def experiment(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in EXPERIMENT_KEYS}

    def plan(self) -> list[RunSpec]:
        """The runs; a report-only rebuild of the saved experiment plans from its saved base config (the recipe file
        may have changed since; the runs have not)."""
        saved = read_saved(self.output_dir) if self.report_only else None
        same = saved is not None and {k: saved.get(k) for k in EXPERIMENT_KEYS} == self.experiment()
        base = (same and saved.get("base_config")) or planning.base_config(self.config, self.overrides)
        return plan_runs(self.objectives, self.seeds, self.runs_dir or self.output_dir,
                         sweep=planning.parse_sweep(self.sweep), base=base)


def build_report(settings: CompareSettings, runs: list[RunSpec], failed: dict[str, str], reference: str,
                 say: Callable[[str], None]) -> None:
    """Report on the finished runs of the plan, if any has finished; unreadable runs join `failed`."""
    records, rl = [], [s for s in runs if s.kind == "rl"]
    for spec in filter(is_finished, rl):
        try:
            records.append(load_run(spec))
        except RunDataError as err:
            failed[spec.run_id] = str(err)
            say(f"! {spec.run_id}: {err}")
    if not records:
        say("no finished runs yet: no report written")
        return
    paths = write_report(records, group_runs(records), settings.output_dir, settings=settings.experiment(),
                         planned=rl, failed=failed, window=settings.smooth, reference=reference,
                         sft_runs=[s for s in runs if s.kind == "sft"])
    say(f"report: {paths['report']} ({len(records)}/{len(rl)} runs; {len(paths) - 4} figures)")


def run_compare(settings: CompareSettings, say: Callable[[str], None] = print) -> int:
    """Plan, run what is unfinished, report. Exit code: 0 all runs finished, 1 some failed or missing,
    130 interrupted."""
    runs = settings.plan()
    rl = [r for r in runs if r.kind == "rl"]
    # a bad --reference, or a run `trustclip train` would refuse, fails before any run starts (also with --dry-run)
    reference = planning.resolve_reference(settings.reference, [(r.group, r.label, r.objective) for r in rl])
    if settings.pipeline is None:
        check_runs(runs)
    sft = f" + {len(runs) - len(rl)} shared SFT runs" if len(rl) < len(runs) else ""
    say(f"compare: {len(rl)} runs ({len({r.group for r in rl})} objectives/settings x {len(settings.seeds)} seeds)"
        f"{sft} in {settings.output_dir}")
    say(f"paired comparisons against: {reference}")
    if settings.dry_run:
        for spec in runs:
            status = "finished" if is_finished(spec) else ("partial" if spec.run_dir.exists() else "pending")
            say(f"  {spec.run_id:<40} {status:<9} {spec.objective} {spec.hparams}  -> {spec.run_dir}")
        return 0
    if settings.report_only:
        failed: dict[str, str] = {}
        if (saved := read_saved(settings.output_dir)) is not None and saved.get("reference") != settings.reference:
            write_json_atomic(settings.output_dir / SETTINGS_FILE, {**saved, "reference": settings.reference})
    else:
        saved = {**settings.experiment(), "base_config": planning.base_config(settings.config, settings.overrides),
                 "reference": settings.reference, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
        failed, interrupted = execute(  # compare.json is written once the pool is ours and its runs are unchanged
            runs, settings.runs_dir or settings.output_dir, log_dir=settings.output_dir, jobs=settings.jobs,
            threads=settings.threads_per_job, pipeline=settings.pipeline, progress=say,
            on_locked=lambda: write_json_atomic(settings.output_dir / SETTINGS_FILE, saved))
        if interrupted:
            return 130
    build_report(settings, runs, failed, reference, say)
    return 0 if all(is_finished(r) for r in runs) else 1
