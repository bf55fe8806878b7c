"""`trustclip compare`: train every (objective, seed[, sweep value]) with everything else held fixed, then
write a report (Table-2 / Table-3 style tables, figures, CSV / JSON of every number).

Examples::

    trustclip compare --objectives clip,dcpo,atr --seeds 5 --output-dir outputs/compare
    trustclip compare --objectives clip,atr --seeds 5 --sweep delta=0.03,0.05,0.07,0.1,0.2 \\
        --config recipes/qwen3_1.7b_atr.yaml --set rl.max_steps=500 --output-dir outputs/sweep
    trustclip compare --objectives "clip,clip[epsilon=0.329],clip_higher[epsilon_low=0.2,epsilon_high=0.28]" \\
        --seeds 5 --reference clip --output-dir outputs/variants   # one objective at several settings
    trustclip compare --output-dir outputs/compare --report-only --reference atr   # rebuild the report, against atr
    trustclip compare --objectives clip,atr --runs-dir outputs/pool --output-dir outputs/pool/first
    trustclip compare --objectives clip,dcpo --runs-dir outputs/pool --output-dir outputs/pool/second  # clip reused

Rerunning the same command resumes: finished runs are kept, unfinished ones are continued (the
trainer's resume). Ctrl-C stops the running runs cleanly.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trustclip.compare import DEFAULT_SEEDS, EXPERIMENT_KEYS, SETTINGS_FILE, CompareSettings, read_saved, run_compare
from trustclip.compare.plan import parse_objectives, parse_seeds

# The tests' seam: MODULE:FUNCTION, a training callable with run_pipeline's contract that replaces it in every run.
PIPELINE_SEAM = "TRUSTCLIP_TEST_PIPELINE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    what = parser.add_argument_group("what to run")
    what.add_argument("--objectives", help="comma-separated objectives (names or aliases, see `trustclip objectives`); "
                      "an objective may appear again as a variant with its own hyper-parameters, NAME[KEY=VALUE,...], "
                      "e.g. clip,clip[epsilon=0.329] (quote it for the shell); default: the previous compare's")
    what.add_argument("--seeds", type=int, help=f"number of training seeds, 0..N-1 (default {DEFAULT_SEEDS}; a paired "
                      "interval is finite from 4 seeds, 5 or more to resolve anything but large differences)")
    what.add_argument("--config", metavar="RECIPE.yaml", help="training recipe shared by all runs (default: the "
                      "embedded CPU setting of `trustclip train`)")
    what.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                      help="override a recipe option for every run, e.g. rl.max_steps=100 (repeatable); where the "
                      "recipe has rl.eval_every 0, compare evaluates every max_steps // 5 steps (the accuracy-vs-step "
                      "figure; --set rl.eval_every=0 turns that off)")
    what.add_argument("--sweep", metavar="KEY=V1,V2,...", help="sweep an objective hyper-parameter (applied to the "
                      "objectives that have it; the others run once) or a dotted training option (all runs)")
    where = parser.add_argument_group("execution")
    where.add_argument("--output-dir", type=Path, required=True, help="runs go to DIR/runs, the report to DIR")
    where.add_argument("--runs-dir", type=Path, metavar="POOL", help="keep the runs in POOL/runs instead, a pool that "
                       "several compares share: a run with the same settings is made once and reported by each, and "
                       "all start RL from one SFT model per seed")
    where.add_argument("--jobs", type=int, help="parallel runs (default min(2, cores))")
    where.add_argument("--threads-per-job", type=int, help="torch threads per run (default cores // jobs)")
    where.add_argument("--dry-run", action="store_true", help="print the plan (runs, status) and exit")
    where.add_argument("--report-only", action="store_true", help="rebuild the report from finished runs only")
    rep = parser.add_argument_group("report")
    rep.add_argument("--smooth", type=int, metavar="STEPS",
                     help="moving-average window of the training curves (default: a tenth of the run)")
    rep.add_argument("--reference", metavar="GROUP", help="group the paired per-seed comparisons are against: a "
                     "group name or an item of --objectives as written (default: clip when compared, else the first "
                     "group; a report setting: --report-only --reference X rebuilds)")


def settings_from_args(args: argparse.Namespace) -> CompareSettings:
    """The settings of parsed arguments (checked as CompareSettings checks them); without --objectives, the experiment
    saved in --output-dir is reused, with its last reference unless --reference is given."""
    out, reference = Path(args.output_dir), args.reference
    # the flags that define the experiment; one not given is None (one given as 0 is given)
    given = {"--seeds": args.seeds, "--config": args.config, "--set": args.overrides, "--sweep": args.sweep,
             "--runs-dir": args.runs_dir}
    if args.objectives is None:
        if (saved := read_saved(out)) is None:
            raise ValueError(f"--objectives is required ({out / SETTINGS_FILE} holds no earlier compare)")
        if flags := [flag for flag, value in given.items() if value is not None]:
            raise ValueError(f"{', '.join(flags)} change(s) the experiment: give --objectives too "
                             f"(without it, the experiment saved in {out / SETTINGS_FILE} is reused)")
        experiment = {k: saved[k] for k in EXPERIMENT_KEYS if k in saved}
        reference = saved.get("reference") if reference is None else reference
    else:
        experiment = {"objectives": parse_objectives(args.objectives),
                      "seeds": parse_seeds(DEFAULT_SEEDS if args.seeds is None else args.seeds),
                      "config": args.config, "overrides": args.overrides or [], "sweep": args.sweep,
                      "runs_dir": None if args.runs_dir is None else str(args.runs_dir)}
    as_given = ("jobs", "threads_per_job", "dry_run", "report_only", "smooth")
    return CompareSettings(output_dir=out, **experiment, **{k: getattr(args, k) for k in as_given}, reference=reference,
                           pipeline=os.environ.get(PIPELINE_SEAM))


def run(args: argparse.Namespace) -> int:
    try:
        return run_compare(settings_from_args(args))
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"trustclip compare: error: {err}", file=sys.stderr)
        return 2
