"""`trustclip theory`: the check of Theorems 5.1 and 5.2 of the ATR paper (arXiv 2602.05494) on a tabular
softmax policy; the maths is in `trustclip.theory`."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import asdict

from trustclip import theory
from trustclip.commands import check_figure_path

NOTES = """\
Thm5.1 err: exact logit difference vs Theorem 5.1 (exact up to round-off: a PG step is linear in eta).
1st-order:  -Cov_pi_k(Delta theta, log pi_k)
              = +/- eta d(s) Cov_pi_k(pi_k(a) [A 1[X](a) - E A 1[X]], log pi_k(a))   (X-: +, X+: -);
            its error must shrink like eta^2.
printed:    Theorem 5.2 as printed, +/- eta d(s) Cov_pi_k(A 1[X](a), log pi_k(a)), without the pi_k(a)
            weight of Theorem 5.1: its error shrinks only like eta for the vanilla step (it is the
            first-order term of the natural-gradient step: --step natural).
sign:       fraction of states where the prediction has the sign of the exact Delta H = H(ATR) - H(clip)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delta", type=float, default=0.07, help="KL3 threshold (default 0.07)")
    parser.add_argument("--seeds", type=int, default=8, help="random problems per event (default 8)")
    parser.add_argument("--states", type=int, default=4, help="states per problem (default 4)")
    parser.add_argument("--actions", type=int, default=6, help="actions per state (default 6, >= 3)")
    parser.add_argument("--etas", type=float, nargs="+", default=list(theory.DEFAULT_ETAS),
                        help="learning rates (default %(default)s)")
    parser.add_argument("--form", choices=theory.FORMS, default="clip",
                        help="surrogate: 'clip' = paper eq. 14/15 (default), 'ppo' = min(w A, clip(w) A)")
    parser.add_argument("--step", choices=theory.STEPS, default="vanilla",
                        help="update: 'vanilla' policy gradient (the theorems' setting) or 'natural'")
    parser.add_argument("--plot", metavar="FILE.png", help="also write error-vs-eta and sign figure")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _setting_text(s: theory.EventSetting) -> str:
    who = "ATR clips, ratio clipping does not" if s.event == "X-" else "ratio clipping clips, ATR does not"
    return (f"  {s.event}: ATR [{s.atr[0]:.4f}, {s.atr[1]:.4f}] vs clip eps={s.epsilon:.4f} "
            f"[{s.ratio[0]:.4f}, {s.ratio[1]:.4f}]; "
            f"{s.event} = w in [{s.interval[0]:.4f}, {s.interval[1]:.4f}] ({who})")


def run(args: argparse.Namespace) -> int:
    kwargs = dict(delta=args.delta, seeds=args.seeds, num_states=args.states, num_actions=args.actions,
                  form=args.form, step=args.step)
    try:
        if args.plot:
            check_figure_path(args.plot)
        settings = {event: theory.event_setting(event, args.delta) for event in theory.EVENTS}
        with warnings.catch_warnings(record=True) as caught:  # shown below only if the table can be built
            warnings.simplefilter("always")
            rows = theory.theorem_table(etas=args.etas, **kwargs)
            slopes = theory.fit_slopes(rows) if len(args.etas) > 1 else {}
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except ValueError as err:
        print(f"trustclip theory: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # no random state has actions in the event's ratio region at this delta
        low, high = settings["X-"].atr
        print(f"trustclip theory: error: --delta {args.delta:g}: {err} (ATR region [{low:.3g}, {high:.3g}]: the "
              "events X- / X+ need ratios the softmax states cannot reach; use a trust-region delta such as 0.07)",
              file=sys.stderr)
        return 2
    if args.plot:
        from trustclip.figures import plot_theory_check

        eta = min(args.etas)
        plot_theory_check(args.plot, rows, theory.entropy_samples(eta=eta, **kwargs), eta=eta)
    if args.json:
        print(json.dumps({"config": kwargs, "settings": {e: asdict(s) for e, s in settings.items()},
                          "rows": [asdict(r) for r in rows], "slopes": slopes, "plot": args.plot}, indent=2))
        return 0
    print(f"Theorems 5.1/5.2 of arXiv 2602.05494: one exact PG step (autograd, surrogate '{args.form}', "
          f"{args.step} step)\non {args.seeds} seeds x {args.states} states x {args.actions} actions "
          f"per event; delta = {args.delta:g}")
    print(*map(_setting_text, settings.values()), "", theory.format_table(rows), "", sep="\n")
    if slopes:
        parts = [f"{e}: first-order {s['first_order']:.2f}, printed {s['paper']:.2f}" for e, s in slopes.items()]
        print("fitted slope of log(max |dH error|) vs log(eta) -- " + " | ".join(parts))
    print(NOTES)
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0
