"""`trustclip train`: SFT for format, RLVR with any objective, held-out evaluation (see trustclip.train)."""

from __future__ import annotations

import argparse
import sys
import textwrap

import yaml

from trustclip.settings import STAGES, explicit_settings, from_dict, resume_config
from trustclip.train import TrainConfig, check_run, option_table, run_pipeline
from trustclip.train.checks import local_sources, run_generation_room


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = textwrap.dedent("""\
        SFT for format -> evaluation before -> RLVR with a trustclip objective -> evaluation after, then plots
        and summary.json in --output-dir. With no arguments: the embedded offline CPU run (tiny Qwen3 on the
        built-in arithmetic task, ATR-GRPO kl3 delta=0.07). Settings come from the defaults, then --config,
        then --objective, then --set overrides, then the other flags below. The whole configuration is checked
        (objective, data sources, model, TRL's own checks) before any work starts; --print-config checks it too.
        With --resume the run's own config.yaml gives every setting: repeat none, and any that differs is an
        error.""")
    parser.add_argument("--config", metavar="RECIPE.yaml", help="YAML recipe (see recipes/).")
    parser.add_argument("--objective", metavar="NAME",
                        help="RL objective (rl.objective; the same as --set rl.objective=NAME); its "
                             "hyper-parameters reset to the objective's own defaults, and --set "
                             "rl.objective_kwargs.KEY=VALUE sets any of them.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override any option below, e.g. --set rl.learning_rate=1e-5 --set "
                             "'rl.objective_kwargs={delta: 0.1}' (values are YAML). Repeatable.")
    parser.add_argument("--output-dir", metavar="DIR", help="Output directory (output_dir).")
    parser.add_argument("--stages", metavar="LIST", help="Comma-separated subset of sft,rl,eval to run.")
    parser.add_argument("--skip", metavar="LIST", help="Comma-separated stages to skip (e.g. --skip sft).")
    parser.add_argument("--resume", action="store_true",
                        help="Continue the interrupted run in --output-dir with its own settings (config.yaml): "
                             "finished stages are kept, RL/SFT resume from their last complete checkpoint.")
    parser.add_argument("--seed", type=int, help="Training seed (seed).")
    parser.add_argument("--report-to", metavar="LIST", help="Comma-separated logging integrations (report_to).")
    parser.add_argument("--quiet", action="store_true", help="Print only the final table (no progress lines).")
    parser.add_argument("--print-config", action="store_true",
                        help="Check and print the resolved configuration, and exit.")
    rows = option_table()
    width = max(len(name) for name, _, _ in rows)
    lines = [f"  {name:<{width}}  {help_text} [default: {default}]" for name, default, help_text in rows]
    parser.epilog = "options for --set KEY=VALUE (and recipe files):\n" + "\n".join(lines)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig: from the command line, or with --resume from the run's config.yaml plus what the
    command line states (which must agree with it)."""
    stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
    if args.skip:
        skip = {s.strip() for s in args.skip.split(",") if s.strip()}
        if unknown := skip - set(STAGES):
            raise ValueError(f"--skip {args.skip!r}: unknown stage(s) {sorted(unknown)}; valid: {', '.join(STAGES)}")
        stages = [s for s in (stages or STAGES) if s not in skip]
    report_to = [s.strip() for s in args.report_to.split(",")] if args.report_to else None
    # On resume --objective (or --set rl.objective) only names the objective: its hyper-parameters are the run's.
    explicit = explicit_settings(args.config, list(args.overrides), objective=args.objective,
                                 reset_objective_kwargs=not args.resume, output_dir=args.output_dir, seed=args.seed,
                                 stages=stages, report_to=report_to, quiet=True if args.quiet else None)
    return resume_config(explicit) if args.resume else from_dict(TrainConfig, explicit)


def run(args: argparse.Namespace) -> int:
    try:
        checked = check_run(build_config(args))  # the one check of the run, in this process
        config = checked.config
        if args.print_config and local_sources(config):  # the prompts are known: would they fit the model?
            _check_prompts(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"trustclip train: error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    try:
        run_pipeline(checked)
    except (ValueError, OSError) as err:  # OSError: FileNotFoundError too
        print(f"trustclip train: error: {err}", file=sys.stderr)
        return 1
    return 0


def _check_prompts(config: TrainConfig) -> None:
    """The run's own prompt-length check (`run_pipeline` runs it once the rows are read), on local data."""
    from trustclip.run_data import load_benchmarks
    from trustclip.train.stages import rl_rows

    run_generation_room(config, rl_rows(config) if "rl" in config.stages else None,
                        load_benchmarks(config) if config.evaluates else None)
