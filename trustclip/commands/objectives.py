"""`trustclip objectives`: every registered objective with its source and defaults."""

from __future__ import annotations

import argparse
import json

from trustclip.objectives import list_objectives


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def run(args: argparse.Namespace) -> int:
    rows = list_objectives()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        aliases = f" (alias: {', '.join(row['aliases'])})" if row["aliases"] else ""
        print(f"{row['name']}{aliases}: {row['summary']}")
        print(f"    source:   {row['source']}")
        defaults = ", ".join(f"{k}={v}" for k, v in row["defaults"].items()) or "-"
        print(f"    defaults: {defaults}")
        if row["requires"]:
            print(f"    needs:    {', '.join(row['requires'])}")
    return 0
