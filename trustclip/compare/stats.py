"""Seed statistics and the rules that turn them into sentences.

Every sentence of a compare report comes from these rules applied to the numbers, never from a
hard-coded conclusion. The separation rule is descriptive, not a significance test: with n seeds, group A
is "ahead" of group B only if mean_A - std_A > mean_B + std_B (sample std, ddof = 1); with one seed
there is no spread and nothing is called ahead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    """Summary of one quantity over seeds (std is the sample std, NaN for a single seed)."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / self.n if self.n else math.nan

    @property
    def std(self) -> float:
        if self.n < 2:
            return math.nan
        m = self.mean
        return math.sqrt(math.fsum((v - m) ** 2 for v in self.values) / (self.n - 1))

    @property
    def min(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def max(self) -> float:
        return max(self.values) if self.values else math.nan

    @property
    def low(self) -> float:
        """mean - std (the mean itself for one seed)."""
        return self.mean - (0.0 if math.isnan(self.std) else self.std)

    @property
    def high(self) -> float:
        return self.mean + (0.0 if math.isnan(self.std) else self.std)

    def to_dict(self) -> dict[str, float | int | list[float]]:
        return {"mean": self.mean, "std": self.std, "n": self.n, "min": self.min, "max": self.max,
                "values": list(self.values)}


def stat(values: Sequence[float]) -> Stat:
    """Stat of the finite values (NaN and None are dropped)."""
    return Stat(tuple(float(v) for v in values if v is not None and math.isfinite(float(v))))


def ahead(a: Stat, b: Stat) -> bool:
    """a's seed range lies above b's: both have >= 2 seeds and mean_a - std_a > mean_b + std_b."""
    return a.n >= 2 and b.n >= 2 and a.low > b.high


def fmt_pct(x: float, digits: int = 1) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.{digits}f}"


def fmt_pm(s: Stat, scale: float = 100.0, digits: int = 1) -> str:
    """'41.2 ± 1.3' (or '41.2' for one seed, 'n/a' for none)."""
    if s.n == 0:
        return "n/a"
    if s.n == 1:
        return f"{scale * s.mean:.{digits}f}"
    return f"{scale * s.mean:.{digits}f} ± {scale * s.std:.{digits}f}"


def rank_sentence(name: str, stats: dict[str, Stat], *, higher_is_better: bool = True, scale: float = 100.0,
                  unit: str = " points", digits: int = 1) -> str:
    """One sentence on which group has the highest (or lowest) mean of `name`, and whether that lead is
    beyond the seed spread of every other group."""
    stats = {g: s for g, s in stats.items() if s.n}
    if not stats:
        return f"{name}: no finished runs."
    sign = 1 if higher_is_better else -1
    order = sorted(stats, key=lambda g: sign * stats[g].mean, reverse=True)
    top, best = order[0], stats[order[0]]
    word = "highest" if higher_is_better else "lowest"
    tied = [g for g in order if math.isclose(stats[g].mean, best.mean, rel_tol=1e-9, abs_tol=1e-12)]
    if len(tied) > 1:
        who = "all groups" if len(tied) == len(order) else ", ".join(f"**{g}**" for g in tied)
        return f"{name}: {who} share the {word} mean ({fmt_pm(best, scale, digits)}{unit}); no ordering among them."
    if len(order) == 1:
        return f"{name}: {top} {fmt_pm(best, scale, digits)}{unit} (n={best.n}, the only group)."
    text = f"{name}: **{top}** has the {word} mean ({fmt_pm(best, scale, digits)}{unit}, n={best.n})"
    others = order[1:]
    if best.n < 2:
        return text + "; with a single seed there is no spread, so no ordering is claimed."
    beaten = [g for g in others if (ahead(best, stats[g]) if higher_is_better else ahead(stats[g], best))]
    close = [g for g in others if g not in beaten]
    if not close:
        return text + ("; its mean - std is above every other group's mean + std "
                       "(a descriptive rule, not a significance test).")
    listed = ", ".join(f"{g} ({fmt_pm(stats[g], scale, digits)})" for g in close)
    return text + f", but it is within seed spread of {listed}, so the data do not order them."


def change_sentence(group: str, gain: Stat, name: str, scale: float = 100.0) -> str:
    """Whether a paired per-seed change (after - before) is beyond its seed spread."""
    if gain.n == 0:
        return f"{group}: no paired before/after numbers."
    text = f"{group}: {name} changed by {fmt_pm(gain, scale)} points (after - before RL, n={gain.n})"
    if gain.n < 2:
        return text + "; one seed, no spread."
    if gain.low > 0:
        return text + ", an increase larger than its seed std."
    if gain.high < 0:
        return text + ", a decrease larger than its seed std."
    return text + ", not distinguishable from no change at this seed spread."
