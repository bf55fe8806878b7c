"""Statistics of a comparison over seeds (numpy and scipy only): a group against a reference, paired by seed, with a
studentised-bootstrap interval of the mean difference; a sweep through the per-seed slope. `trustclip compare` words
them (`compare/report.py`); why these and their measured coverage: docs/compare-statistics.md."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
from scipy import stats as sps

LEVEL = 0.95  # confidence level of every interval of the report
ALPHA, POWER = 0.05, 0.8  # the paired t-test whose power defines "seeds needed"
MAX_SEEDS = 10_000  # beyond this, "seeds needed" is reported as more than MAX_SEEDS
RESAMPLES = 9_999  # bootstrap resamples (scipy's default)
BOOTSTRAP_SEED = 0  # fixed: a rebuilt report shows the same intervals


class Stat(NamedTuple):
    """One quantity over seeds: its finite values, their mean and sample std (NaN for one seed)."""

    values: tuple[float, ...]
    mean: float
    std: float

    @property
    def n(self) -> int:
        return len(self.values)


def stat(values: Sequence[float]) -> Stat:
    """Stat of the finite values (NaN and None are dropped)."""
    v = tuple(float(x) for x in values if x is not None and math.isfinite(float(x)))
    return Stat(v, math.fsum(v) / len(v) if v else math.nan, float(np.std(v, ddof=1)) if len(v) >= 2 else math.nan)


def bootstrap_t_interval(differences: Sequence[float]) -> tuple[float, float]:
    """Studentised bootstrap interval of the mean of per-seed differences: t* = (mean* - mean) / se* per resample
    (`scipy.stats.bootstrap` draws them), interval [mean - q(1 - a/2) se, mean - q(a/2) se]. +-inf bounds when more
    than a/2 of the resamples have no spread (n <= 3); a point when the differences have none."""
    d = np.asarray(differences, float)
    if d.size < 2:
        raise ValueError(f"a paired interval needs at least 2 paired seeds, got {d.size}")
    mean, se = d.mean(), sps.sem(d)
    if np.ptp(d) == 0:
        return float(d[0]), float(d[0])

    def t_star(sample: np.ndarray, axis: int = -1) -> np.ndarray:
        m, s = sample.mean(axis=axis), sps.sem(sample, axis=axis)
        spread = s > 1e-6 * se  # below: one seed repeated n times, up to rounding; t* = +-inf
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(spread, (m - mean) / s, np.select([m > mean, m < mean], [np.inf, -np.inf], 0.0))

    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's own percentile interval of t* (unused) sees infs
        t = sps.bootstrap((d,), t_star, vectorized=True, n_resamples=RESAMPLES, method="percentile",
                          rng=np.random.default_rng(BOOTSTRAP_SEED)).bootstrap_distribution
    q_low, q_high = np.quantile(t, [(1 - LEVEL) / 2, (1 + LEVEL) / 2], method="inverted_cdf")  # no interpolating infs
    return float(mean - q_high * se), float(mean - q_low * se)


def seeds_needed(mean: float, sd: float) -> int | None:
    """Smallest n at which a two-sided paired t-test at ALPHA has POWER for a true mean difference `mean` with sd of
    differences `sd` (T ~ nct(n - 1, mean / sd * sqrt(n))); None when not estimable or above MAX_SEEDS."""
    if not (math.isfinite(mean) and math.isfinite(sd)) or sd <= 0 or mean == 0:
        return None
    n = np.arange(2, MAX_SEEDS + 1)
    critical, noncentrality = sps.t.ppf(1 - ALPHA / 2, n - 1), abs(mean) / sd * np.sqrt(n)
    achieved = sps.nct.sf(critical, n - 1, noncentrality) + sps.nct.cdf(-critical, n - 1, noncentrality)
    enough = np.flatnonzero(achieved >= POWER)
    return int(n[enough[0]]) if enough.size else None


@dataclass(frozen=True)
class Difference:
    """Paired differences of one outcome, group - reference, on the seeds both have; the interval NaN below 2 seeds."""

    group: str
    reference: str
    outcome: str
    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    sd: float
    low: float
    high: float

    @property
    def n(self) -> int:
        return len(self.differences)

    @cached_property  # a root search over n: the table, the sentences and the JSON all read it
    def seeds_needed(self) -> int | None:
        return seeds_needed(self.mean, self.sd)

    @property
    def verdict(self) -> str:
        """higher / lower (the interval excludes 0), identical (every difference 0), not resolved, no interval."""
        if self.n and not any(self.differences):
            return "identical"
        if self.n < 2:
            return "no interval"
        return "higher" if self.low > 0 else "lower" if self.high < 0 else "not resolved"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "reference": self.reference, "outcome": self.outcome, "n": self.n,
                "seeds": list(self.seeds), "differences": list(self.differences), "mean": self.mean, "sd": self.sd,
                "low": self.low, "high": self.high, "bounded": math.isfinite(self.low) and math.isfinite(self.high),
                "level": LEVEL, "verdict": self.verdict, "seeds_needed": self.seeds_needed}


def _difference(group: str, ref: str, outcome: str, seeds: Sequence[int], values: Sequence[float]) -> Difference:
    # rounded to 12 decimals: float rounding (0.6 + 0.03 - (0.2 + 0.03) != 0.4) is no seed-to-seed spread; + 0.0: no -0
    values = tuple(round(float(v), 12) + 0.0 for v in values)
    low, high = bootstrap_t_interval(values) if len(values) >= 2 else (math.nan, math.nan)
    spread = stat(values)
    return Difference(group, ref, outcome, tuple(seeds), values, spread.mean, spread.std, low, high)


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float], *, group: str, ref: str,
                      outcome: str) -> Difference:
    """values - reference on the seeds where both are finite, with its interval."""
    seeds = [s for s in sorted(set(values) & set(reference))
             if math.isfinite(values[s]) and math.isfinite(reference[s])]
    return _difference(group, ref, outcome, seeds, [float(values[s]) - float(reference[s]) for s in seeds])


def log_scale(values: Sequence[float]) -> bool:
    """A sweep is read on log10 (the trend's slope, the figure's axis) when its values are all > 0 and span 10x+."""
    return min(values) > 0 and max(values) / min(values) >= 10


def sweep_trend(outcome_by_value: Mapping[float, Mapping[int, float]], *, group: str,
                outcome: str) -> tuple[Difference, bool]:
    """One test for a whole sweep, not k(k-1)/2 pairs: per seed with every value, the least-squares slope of the
    outcome on log10(value) if `log_scale` (else on the value), as a `Difference` against "zero slope"; and `log`."""
    values = sorted(float(v) for v in outcome_by_value)
    if len(values) < 3:
        raise ValueError(f"a sweep trend needs at least 3 swept values, got {len(values)}")
    log = log_scale(values)
    x = np.log10(values) if log else np.asarray(values)
    seeds = sorted(set.intersection(*({s for s, y in outcome_by_value[v].items() if y is not None and math.isfinite(y)}
                                      for v in values)))
    slopes = [np.polyfit(x, [outcome_by_value[v][s] for v in values], 1)[0] for s in seeds]
    return _difference(group, "zero slope", outcome, seeds, slopes), log
