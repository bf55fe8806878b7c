"""`trustclip train`: SFT for format, RLVR with any objective, held-out evaluation (see trustclip.train)."""

from __future__ import annotations

import argparse
import sys
import textwrap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trustclip.train.config import option_table

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = textwrap.dedent("""\
        SFT for format -> evaluation before -> RLVR with a trustclip objective -> evaluation after, then plots
        and summary.json in --output-dir. With no arguments: the embedded offline CPU run (tiny Qwen3 on the
        built-in arithmetic task, ATR-GRPO kl3 delta=0.07). Settings come from the defaults, then --config,
        then --set overrides, then the dedicated flags below.""")
    parser.add_argument("--config", metavar="RECIPE.yaml", help="YAML recipe (see recipes/).")
    parser.add_argument("--objective", metavar="NAME",
                        help="RL objective (rl.objective); its hyper-parameters reset to the objective's defaults "
                             "unless given with --set rl.objective_kwargs={...}.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override any option below, e.g. --set rl.learning_rate=1e-5 --set "
                             "'rl.objective_kwargs={delta: 0.1}' (values are YAML). Repeatable.")
    parser.add_argument("--output-dir", metavar="DIR", help="Output directory (output_dir).")
    parser.add_argument("--stages", metavar="LIST", help="Comma-separated subset of sft,rl,eval to run.")
    parser.add_argument("--skip", metavar="LIST", help="Comma-separated stages to skip (e.g. --skip sft).")
    parser.add_argument("--resume", action="store_true",
                        help="Continue an interrupted run in --output-dir: finished stages are kept, RL/SFT resume "
                             "from their last checkpoint.")
    parser.add_argument("--seed", type=int, help="Training seed (seed).")
    parser.add_argument("--report-to", metavar="LIST", help="Comma-separated logging integrations (report_to).")
    parser.add_argument("--quiet", action="store_true", help="Print only the final table.")
    parser.add_argument("--print-config", action="store_true", help="Print the resolved configuration and exit.")
    rows = option_table()
    width = max(len(name) for name, _, _ in rows)
    lines = [f"  {name:<{width}}  {help_text} [default: {default}]" for name, default, help_text in rows]
    parser.epilog = "options for --set KEY=VALUE (and recipe files):\n" + "\n".join(lines)


def build_config(args: argparse.Namespace):
    from trustclip.train.config import STAGES, load_config

    overrides = list(args.overrides)
    top: dict = {"output_dir": args.output_dir, "seed": args.seed}
    if args.objective:
        top["rl.objective"] = args.objective
        if not any(o.split("=", 1)[0].strip() == "rl.objective_kwargs" for o in overrides):
            top["rl.objective_kwargs"] = {}  # the objective's own defaults, not kl3's delta
    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
    if args.skip:
        skip = {s.strip() for s in args.skip.split(",")}
        unknown = skip - set(STAGES)
        if unknown:
            raise ValueError(f"--skip {args.skip!r}: unknown stage(s) {sorted(unknown)}; valid: {', '.join(STAGES)}")
        stages = [s for s in (stages or STAGES) if s not in skip]
    if stages is not None:
        top["stages"] = stages
    if args.report_to:
        top["report_to"] = [s.strip() for s in args.report_to.split(",")]
    if args.resume:
        top["resume"] = True
    if args.quiet:
        top["quiet"] = True
    return load_config(args.config, overrides, **top)


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"trustclip train: error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if not config.stages:
        print("trustclip train: error: no stage left to run", file=sys.stderr)
        return 2
    from trustclip.train.pipeline import run_pipeline

    try:
        run_pipeline(config)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"trustclip train: error: {err}", file=sys.stderr)
        return 1
    return 0
