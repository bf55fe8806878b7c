"""`trustclip` command line. Each subcommand lives in `trustclip.commands.<name>` and exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs,
so `trustclip objectives` does not pay for importing transformers."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "objectives": "list every objective with its source and defaults",
    "bounds": "print (or plot) the ratio region of a divergence constraint",
    "train": "SFT for format, RLVR with any objective, evaluation (the main job)",
    "eval": "Mean@K / Pass@K of a model on benchmarks",
    "compare": "multi-seed comparison of objectives, with report and figures",
    "theory": "tabular softmax checks of the paper's Theorems 5.1 and 5.2",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trustclip", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        # Subparsers are filled lazily in main(); --help on the root lists names only.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
        parser.parse_args(argv)  # handles --help
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(f"trustclip.commands.{name.replace('-', '_')}")
    parser = argparse.ArgumentParser(prog=f"trustclip {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
