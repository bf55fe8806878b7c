"""The report's English: numbers formatted, and sentences that follow from paired differences only.

Every sentence that compares groups states a `Difference` (`trustclip.compare.stats`) through `difference_sentence`
or its verdict: nothing is called higher or lower whose 95 % interval includes 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trustclip import metric_names as names
from trustclip.compare.results import AVERAGE, OFFPOLICY, OUTCOME, PRIMARY, Group, Outcome, metric_title, title_of
from trustclip.compare.stats import LEVEL, MAX_SEEDS, RESAMPLES, Difference, Stat, paired_difference, sweep_trend


def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.{digits}f}"


def fmt_pm(s: Stat, scale: float = 100.0, digits: int = 1) -> str:
    """'41.2 ± 1.3' (or '41.2' for one seed, 'n/a' for none)."""
    if s.n == 0:
        return "n/a"
    return f"{scale * s.mean:.{digits}f}" + (f" ± {scale * s.std:.{digits}f}" if s.n > 1 else "")


def fmt_signed(x: float, scale: float = 100.0, digits: int = 1) -> str:
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{scale * x:+.{digits}f}"


def fmt_interval(d: Difference, scale: float = 100.0, digits: int = 1) -> str:
    """'[+1.1, +5.0]' ('n/a' below 2 seeds)."""
    return "n/a" if d.n < 2 else f"[{fmt_signed(d.low, scale, digits)}, {fmt_signed(d.high, scale, digits)}]"


def needed_text(d: Difference) -> str:
    """'12', '> 10000' or 'not estimable'."""
    if d.n < 2 or not d.sd > 0 or d.mean == 0:
        return "not estimable"
    return str(d.seeds_needed) if d.seeds_needed is not None else f"> {MAX_SEEDS}"


def outcome_label(outcome: Outcome, k: int) -> str:
    return outcome.label.format(k=k)


def difference_sentence(d: Difference, what: str, scale: float = 100.0, unit: str = " points",
                        digits: int = 1) -> str:
    """The sentence of one paired comparison, from its interval only."""
    head = f"{d.group} - {d.reference}, {what}: "
    if d.n == 0:
        return head + "no seed has both runs finished."
    if d.verdict == "identical":
        return head + f"identical on all {d.n} paired seed(s) (every difference is exactly 0)."
    text = head + f"{fmt_signed(d.mean, scale, digits)}{unit}"
    if d.n < 2:
        return text + f" on one paired seed (seed {d.seeds[0]}): no interval with one seed, nothing is claimed."
    text += f" [{LEVEL:.0%} CI {fmt_interval(d, scale, digits)[1:-1]}], n = {d.n} paired seeds"
    if d.verdict in ("higher", "lower"):
        return text + f": {d.verdict} than {d.reference}."
    needed = needed_text(d)
    more = (f"about {needed} seeds would be needed to resolve a difference this size" if needed[0].isdigit()
            else f"the seeds needed to resolve it are {needed}" + (" (more than we try)" if ">" in needed else ""))
    return text + f"; the interval includes 0: no difference resolved at n = {d.n}; {more}."


def outcome_sentence(d: Difference, k: int) -> str:
    o = OUTCOME[d.outcome]
    return difference_sentence(d, outcome_label(o, k), o.scale, o.unit, o.digits)


def rank_sentence(name: str, groups: Sequence[Group], outcome: Outcome = PRIMARY) -> str:
    """Which group has the highest mean of `outcome`, and which others its paired intervals resolve it from."""
    means = {g.group: g.stat(outcome.key) for g in groups}
    ranked = sorted((g for g in groups if means[g.group].n), key=lambda g: means[g.group].mean, reverse=True)
    if len(ranked) < 2:
        return f"{name}: fewer than two groups with finished runs, no ordering."
    top, best = ranked[0], means[ranked[0].group]
    tied = [g.group for g in ranked if means[g.group].mean == best.mean]
    value = f"{fmt_pm(best, outcome.scale, outcome.digits)}{outcome.unit}"
    if len(tied) > 1:
        who = ", ".join(f"**{g}**" for g in tied)
        return f"{name}: {who} share the highest mean ({value}); no ordering among them."
    text = f"{name}: **{top.group}** has the highest mean ({value}, n = {best.n})"
    diffs = [paired_difference(top.values[outcome.key], g.values[outcome.key], group=top.group, ref=g.group,
                               outcome=outcome.key) for g in ranked[1:]]
    above = [d.reference for d in diffs if d.verdict == "higher"]
    open_ = [d.reference for d in diffs if d.verdict != "higher"]
    if not open_:
        return text + f"; its paired {LEVEL:.0%} interval against every other group lies above 0."
    if not above:
        return text + f", but no paired {LEVEL:.0%} interval against the others ({', '.join(open_)}) excludes 0: " \
                      "the data do not order them."
    return text + f"; its paired {LEVEL:.0%} intervals lie above 0 against {', '.join(above)}, not against " \
                  f"{', '.join(open_)}."


def trend_sentence(label: str, members: Sequence[Group], k: int, outcome: Outcome = PRIMARY) -> str:
    """The sweep's trend (`stats.sweep_trend`): the per-seed slope of an outcome and its interval."""
    key = members[0].sweep_key
    d, log = sweep_trend({g.sweep_value: g.values[outcome.key] for g in members}, group=label, outcome=outcome.key)
    text = (f"Trend of {label} over {key} (least-squares slope of {outcome_label(outcome, k)} on "
            f"{f'log10 {key}' if log else key}, per seed, seeds with every value): ")
    if d.n < 2:
        return text + f"{d.n} complete seed(s), no interval."
    slopes = ", ".join(fmt_signed(v, outcome.scale, outcome.digits) for v in d.differences)
    text += (f"{fmt_signed(d.mean, outcome.scale, outcome.digits)}{outcome.unit} "
             f"{f'per tenfold {key}' if log else f'per unit of {key}'} [{LEVEL:.0%} CI "
             f"{fmt_interval(d, outcome.scale, outcome.digits)[1:-1]}], n = {d.n} (per seed: {slopes})")
    verdict = {"higher": "increasing", "lower": "decreasing", "identical": "flat on every seed"}.get(d.verdict)
    return text + (f": {verdict}." if verdict else "; the interval includes 0: no trend resolved.")


def findings(groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str], n_planned: int,
             n_finished: int, eval_every: int | None, reference: str, diffs: Sequence[Difference]) -> list[str]:
    """The Findings: sentences generated from the paired intervals."""
    avg = AVERAGE if AVERAGE in splits else splits[-1]
    k = int(metrics[0].partition("@")[2])
    primary = f"{title_of(avg)} {metric_title(metrics[0])}"
    out = [f"{n_finished} of {n_planned} planned runs finished; seeds per group: "
           + ", ".join(f"{g.group} {g.n}" for g in groups) + "."]
    if not any(g.group == reference for g in groups):
        out.append(f"The reference group {reference} has no finished run: no paired comparisons yet.")
    out += [outcome_sentence(d, k) for d in diffs if d.outcome == PRIMARY.key]
    resolved = [d for d in diffs if d.outcome != PRIMARY.key and d.verdict in ("higher", "lower")]
    if resolved:
        out.append("Other outcomes whose paired interval excludes 0: " + "; ".join(
            f"{d.group} {outcome_label(o := OUTCOME[d.outcome], k)} {fmt_signed(d.mean, o.scale, o.digits)}{o.unit} "
            f"{fmt_interval(d, o.scale, o.digits)} ({d.verdict})" for d in resolved) + ".")
    elif diffs:
        out.append(f"No other outcome differs from {reference} by a paired interval that excludes 0.")
    out.append(rank_sentence(f"{primary} of the final policy", groups))
    for g in groups:  # the change over RL, paired within each run (final policy - its own RL start)
        gain = paired_difference(g.values.get(f"gain/{avg}/{metrics[0]}", {}), dict.fromkeys(g.seeds, 0.0),
                                 group=g.group, ref="RL start", outcome="gain")
        out.append(difference_sentence(gain, f"held-out {title_of(avg)} Mean@{k}"))
    for key in ("eval_entropy", "eval_length"):  # where the evaluations recorded them: how RL moved the completions
        o, stat = OUTCOME[key], key.removeprefix("eval_")
        for g in groups:
            final, start = (g.values.get(f"completions/{when}/{avg}/{stat}", {}) for when in ("final", "before"))
            if final:
                change = paired_difference(final, start, group=g.group, ref="RL start", outcome=key)
                out.append(difference_sentence(change, o.label.replace(", final", f", {title_of(avg)}"), o.scale,
                                               o.unit, o.digits))
    swept: dict[str, list[Group]] = {}
    for g in groups:
        if g.sweep_key is not None:
            swept.setdefault(g.label, []).append(g)
    for label, members in swept.items():
        if len(members) >= 2:
            out.append(rank_sentence(f"Sweep of {label} over {members[0].sweep_key}, {primary}", members))
        if len(members) >= 3 and all(isinstance(g.sweep_value, int | float) for g in members):
            out += [trend_sentence(label, members, k, OUTCOME[key]) for key in (PRIMARY.key, "pass@K")]
    intervals = sum(d.n >= 2 for d in diffs)
    if intervals:
        out.append(f"{intervals} paired intervals at {LEVEL:.0%} each, not adjusted for multiplicity: were no "
                   f"difference real, about {(1 - LEVEL) * intervals:.1f} of them would exclude 0 by chance. The "
                   f"primary outcome is the final held-out {primary}.")
    if max((g.n for g in groups), default=0) < 2:
        out.append("With one seed per group there is no interval: nothing is called higher or lower.")
    checkpoints = sorted({len(r.history) for g in groups for r in g.runs})
    if checkpoints == [1]:
        out.append("Only the RL start and the final policy were evaluated (rl.eval_every = 0), so best = final "
                   "and the accuracy-vs-step figure has two points; `--set rl.eval_every=N` adds checkpoints.")
    else:
        out.append(f"'best' is the maximum over {'/'.join(map(str, checkpoints))} evaluated RL checkpoints "
                   f"(every {eval_every} steps and the last), chosen on the same held-out problems it is "
                   "reported on, so it is optimistic; 'final' is the unbiased number.")
    return out


def method_lines(reference: str, k: int) -> list[str]:
    return [
        f"Difference = group - **{reference}** per seed (the runs of one seed start RL from the same SFT model), "
        "averaged over the n seeds both groups have finished. "
        f"{LEVEL:.0%} CI: studentised bootstrap (bootstrap-t) of the mean difference, seeds resampled in pairs "
        f"({RESAMPLES} resamples of the per-seed differences, `scipy.stats.bootstrap`); a percentile or BCa "
        "interval stays inside the range of the seeds and under-covers with a handful of them (see "
        "`trustclip/compare/stats.py`). "
        "With 2-3 seeds the interval is unbounded (a resample that repeats one seed has no spread).",
        "Verdict: higher / lower only when the interval excludes 0; identical: every difference exactly 0. "
        "Seeds needed: the number of seeds at which a two-sided paired t-test at alpha 0.05 has power 0.8 if "
        f"the observed mean and standard deviation of the differences were the true ones (> {MAX_SEEDS}: more "
        "than that; not estimable: no spread, no difference or one seed); the bootstrap-t interval is wider than "
        "the t-test's at a handful of seeds, so it may need a few more.",
        f"Outcomes on the held-out average; train reward, entropy and length over the last 10% of RL steps; "
        f"active-constraint fraction = `{names.CLIP_ANY}`, off-policy fraction = `{OFFPOLICY}`, both averaged "
        f"over RL; collapse = 1 for a run whose final held-out Mean@{k} is below its own RL start.",
    ]

