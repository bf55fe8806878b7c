"""`trustclip bounds`: the ratio region [l, u] of an objective's constraint (and its figure)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from trustclip.commands import check_figure_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objective", default="atr", help="objective name (default: atr, i.e. kl3)")
    parser.add_argument("--delta", type=float, help="divergence threshold (objectives with a delta)")
    parser.add_argument("--epsilon", type=float, help="clip range (clip, trgppo)")
    parser.add_argument("--q", type=float, action="append",
                        help="old token probability, for q-dependent regions (dcpo, trgppo); repeatable")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw every divergence vs w with its interval, and dcpo/trgppo bounds vs q")


def run(args: argparse.Namespace) -> int:
    from trustclip.objectives import get_objective, ratio_bounds
    from trustclip.objectives.registry import resolve_name

    try:
        if args.plot:
            check_figure_path(args.plot)
        params = resolve_name(args.objective).params
        given = {k: v for k, v in {"delta": args.delta, "epsilon": args.epsilon}.items() if v is not None}
        unused = [k for k in given if k not in params]
        if unused:
            raise ValueError(f"objective {args.objective!r} has no hyper-parameter {unused[0]!r}")
        objective = get_objective(args.objective, **given)
        if objective.spec.q_dependent:
            qs = args.q or [0.9, 0.5, 0.1, 0.01]
            rows = [{"q": q, "low": lo, "high": hi} for q in qs for lo, hi in [ratio_bounds(objective, q=q)]]
        elif args.q:
            raise ValueError(f"objective {objective.name!r} has constant bounds; --q does not apply")
        else:
            low, high = ratio_bounds(objective)
            rows = [{"low": low, "high": high}]
    except ValueError as err:
        print(f"trustclip bounds: error: {err}", file=sys.stderr)
        return 2
    result = {"objective": objective.name, "hparams": dict(objective.hparams), "bounds": rows}
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        settings = ", ".join(f"{k}={v}" for k, v in objective.hparams.items())
        print(f"{objective.name} ({settings}): ratio region")
        for row in rows:
            where = f"q={row['q']:<6g} " if "q" in row else ""
            print(f"  {where}[{_fmt(row['low'])}, {_fmt(row['high'])}]")
    if args.plot:
        from trustclip.figures import plot_divergence_regions

        kwargs = {"delta": args.delta} if args.delta is not None else {}
        plot_divergence_regions(args.plot, **kwargs)
        print(f"figure written to {args.plot}")
    return 0


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return f"{x:.4f}" if abs(x - 1) >= 1e-3 else f"{x:.8f}"  # sequence-level regions (atr_seq, gspo) hug 1
