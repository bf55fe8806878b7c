"""Statistics of a comparison over seeds (scipy does them; this docstring states the design).

- **Paired by seed.** The runs of one seed share their SFT start, so a group is compared with the reference through
  the per-seed differences (group - reference) on the seeds both have: the start's variation cancels, and
  resampling the differences resamples seeds in pairs.
- **Interval: studentised bootstrap (bootstrap-t)** of the mean difference (Efron & Tibshirani 1993, ch. 12;
  Hesterberg 2015, Am. Stat. 69(4)). Percentile-type intervals stay inside the sample range, which holds a symmetric
  distribution's mean with probability 1 - 2^(1-n) only. Coverage of a nominal 95 % at n = 5
  (benchmarks/interval_coverage.py, 1,000 experiments per row; tests/test_stats.py checks 200):

      differences      percentile  BCa   expanded  bootstrap-t  paired t
      normal              83 %     82 %    91 %       94 %        95 %
      exponential         76 %     78 %    85 %       91 %        87 %
      lognormal           74 %     75 %    83 %       91 %        84 %
      t(3)                83 %     80 %    92 %       94 %        96 %

  The price: it is wider (median 3.0 sd of the differences at n = 5, 2.3 for the t-interval), and unbounded at
  n <= 3 (a resample repeating one seed has no spread).
- **Verdicts follow from the interval alone**: higher / lower when it excludes 0; not adjusted for multiplicity.
- **Seeds needed**: the n at which a two-sided paired t-test at alpha 0.05 has power 0.8 for the observed mean and
  sd of the differences (noncentral t; Cohen 1988): a planning figure.
- **Aggregates** (rliable; Agarwal et al. 2021, arXiv 2108.13264): the interquartile mean of the (seed x split)
  scores and P(X > Y) (Mann-Whitney U / (n m), averaged over splits), with stratified-bootstrap percentile
  intervals: they describe, the paired intervals decide. (rliable is no dependency: it pulls arch, seaborn and absl
  for two formulas.)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
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
    a = 1 - LEVEL
    q_low, q_high = np.quantile(t, [a / 2, 1 - a / 2], method="inverted_cdf")  # no interpolation across infs
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
    """Paired differences of one outcome, group - reference, on the seeds both have, with their interval (NaN below 2
    seeds)."""

    group: str
    reference: str
    outcome: str
    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    low: float
    high: float

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def mean(self) -> float:
        return math.fsum(self.differences) / self.n if self.n else math.nan

    @property
    def sd(self) -> float:
        return float(np.std(self.differences, ddof=1)) if self.n >= 2 else math.nan

    @cached_property  # a root search over n: the table, the sentences, the CSV and the JSON all read it
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
    return Difference(group, ref, outcome, tuple(seeds), values, low, high)


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float], *, group: str, ref: str,
                      outcome: str) -> Difference:
    """values - reference on the seeds where both are finite, with its interval."""
    seeds = [s for s in sorted(set(values) & set(reference))
             if math.isfinite(values[s]) and math.isfinite(reference[s])]
    return _difference(group, ref, outcome, seeds, [float(values[s]) - float(reference[s]) for s in seeds])


def log_scale(values: Sequence[float]) -> bool:
    """A sweep is read on log10 of its values (the trend's slope, the figure's axis) when they are all > 0 and span
    10x or more."""
    return min(values) > 0 and max(values) / min(values) >= 10


def sweep_trend(outcome_by_value: Mapping[float, Mapping[int, float]], *, group: str,
                outcome: str) -> tuple[Difference, bool]:
    """One test for a whole sweep (pairs of values would make k(k-1)/2 intervals): per seed with every value, the
    least-squares slope of the outcome on log10(value) (on the value when one is <= 0 or they span less than 10x),
    as a `Difference` against "no trend"; and whether the scale is log10."""
    values = sorted(float(v) for v in outcome_by_value)
    if len(values) < 3:
        raise ValueError(f"a sweep trend needs at least 3 swept values, got {len(values)}")
    log = log_scale(values)
    x = np.log10(values) if log else np.asarray(values)
    seeds = sorted(set.intersection(*({s for s, y in outcome_by_value[v].items() if y is not None and math.isfinite(y)}
                                      for v in values)))
    slopes = [np.polyfit(x, [outcome_by_value[v][s] for v in values], 1)[0] for s in seeds]
    return _difference(group, "no trend", outcome, seeds, slopes), log


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its percentile bootstrap interval (NaN when not computable)."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "level": LEVEL}


def _stratified(columns: Sequence[np.ndarray], statistic: Callable[..., np.ndarray]) -> Estimate:
    """statistic(*columns), with a percentile interval from resampling each column (stratum) on its own."""
    value = float(statistic(*columns))
    if min(len(c) for c in columns) < 2:
        return Estimate(value, math.nan, math.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sps.DegenerateDataWarning)  # all resamples equal: a point interval
        ci = sps.bootstrap(tuple(columns), statistic, vectorized=True, n_resamples=RESAMPLES, method="percentile",
                           confidence_level=LEVEL, rng=np.random.default_rng(BOOTSTRAP_SEED)).confidence_interval
    low, high = (value, value) if np.isnan(ci.low) and np.isnan(ci.high) else (float(ci.low), float(ci.high))
    return Estimate(value, low, high)


def iqm(scores: np.ndarray) -> Estimate:
    """Interquartile mean of a (seeds x splits) score matrix; seeds resampled within each split (rliable's
    StratifiedBootstrap)."""
    scores = np.asarray(scores, float)
    return _stratified(list(scores.T), lambda *c, axis=-1: sps.trim_mean(np.concatenate(c, axis=axis), 0.25, axis=axis))


def probability_of_improvement(x: np.ndarray, y: np.ndarray) -> Estimate:
    """rliable's P(X > Y) for (seeds x splits) scores of a group `x` and the reference `y`: the mean over splits of
    U / (n m), U the Mann-Whitney statistic (ties count one half); each group's seeds resampled within each split."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    k = x.shape[1]

    def statistic(*c: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean([sps.mannwhitneyu(a, b, axis=axis, method="asymptotic").statistic
                        / (a.shape[axis] * b.shape[axis]) for a, b in zip(c[:k], c[k:], strict=True)], axis=0)

    return _stratified([*x.T, *y.T], statistic)
