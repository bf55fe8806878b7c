"""The statistics of `trustclip compare` (trustclip/compare/paired_stats.py): coverage of the paired interval on
synthetic seed results with a known effect, no call on a zero effect, seeds needed against textbook values.
~15 s (1,400 bootstraps)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from trustclip.compare.paired_stats import (
    bootstrap_t_interval,
    log_scale,
    paired_difference,
    seeds_needed,
    stat,
    sweep_trend,
)
from trustclip.compare.report import difference_sentence

EXPERIMENTS, SEEDS, EFFECT = 200, 5, 0.04  # 200 synthetic comparisons of 5 paired seeds, true effect +4 points
NOISE = {  # per-seed noise of the difference (sd 0.02), centred so that the true mean difference is EFFECT
    "normal": lambda rng, n: 0.02 * rng.standard_normal(n),
    "exponential (skewed)": lambda rng, n: 0.02 * (rng.exponential(1.0, n) - 1.0),
}


def synthetic(rng: np.random.Generator, noise, effect: float) -> tuple[dict[int, float], dict[int, float]]:
    """Seed results of a reference and a group that share each seed's start (the start varies a lot from
    seed to seed, the paired difference only by `noise`)."""
    start = 0.30 + 0.05 * rng.standard_normal(SEEDS)
    reference = start + 0.01 * rng.standard_normal(SEEDS)
    group = reference + effect + noise(rng, SEEDS)
    return dict(enumerate(group)), dict(enumerate(reference))


def coverage(noise, effect: float, seed: int = 0) -> tuple[float, float]:
    """(fraction of intervals that contain the true effect, fraction that exclude 0) over EXPERIMENTS."""
    rng = np.random.default_rng(seed)
    covered = called = 0
    for _ in range(EXPERIMENTS):
        group, reference = synthetic(rng, noise, effect)
        d = paired_difference(group, reference, group="x", ref="ref", outcome="mean@K")
        covered += d.low <= effect <= d.high
        called += d.verdict in ("higher", "lower")
    return covered / EXPERIMENTS, called / EXPERIMENTS


@pytest.mark.parametrize("noise", list(NOISE))
def test_paired_interval_covers_a_known_effect_at_five_seeds(noise):
    covered, called = coverage(NOISE[noise], EFFECT)
    print(f"\n{noise}: 95% bootstrap-t interval covers the true effect in {covered:.1%} of {EXPERIMENTS} "
          f"experiments at n = {SEEDS}; the effect (2 sd) is called in {called:.1%}")
    assert covered >= 0.90
    assert called >= 0.6  # not trivially wide: a 2-sd effect is mostly resolved at n = 5


@pytest.mark.parametrize("noise", list(NOISE))
def test_zero_effect_is_not_called(noise):
    covered, called = coverage(NOISE[noise], 0.0, seed=1)
    print(f"\n{noise}: zero effect called (interval excludes 0) in {called:.1%} of {EXPERIMENTS} experiments")
    assert called <= 0.10
    assert covered == 1 - called


SWEEP = (0.01, 0.02, 0.05, 0.07, 0.1, 0.2, 0.5)  # Figure 3's deltas


def synthetic_sweep(rng: np.random.Generator, slope: float) -> dict[float, dict[int, float]]:
    """Seed results along a sweep: each seed has its own start, the outcome moves by `slope` per tenfold value,
    plus noise per (seed, value) of sd 0.02."""
    start = 0.30 + 0.05 * rng.standard_normal(SEEDS)
    return {v: {s: start[s] + slope * math.log10(v) + 0.02 * rng.standard_normal() for s in range(SEEDS)}
            for v in SWEEP}


@pytest.mark.parametrize("slope", [-0.03, 0.0])
def test_sweep_trend_covers_a_known_slope_and_does_not_call_a_flat_one(slope):
    rng = np.random.default_rng(2)
    covered = called = 0
    for _ in range(EXPERIMENTS):
        d, log = sweep_trend(synthetic_sweep(rng, slope), group="atr", outcome="mean@K")
        assert log and d.n == SEEDS and d.reference == "zero slope"
        covered += d.low <= slope <= d.high
        called += d.verdict in ("higher", "lower")
    print(f"\nslope {slope}: covered in {covered / EXPERIMENTS:.1%}, called in {called / EXPERIMENTS:.1%}")
    assert covered / EXPERIMENTS >= 0.90
    assert called / EXPERIMENTS >= 0.6 if slope else called / EXPERIMENTS <= 0.10


def test_sweep_trend_by_hand():
    """Exact slopes per seed; only seeds with every value count; a linear scale for a narrow or signed sweep."""
    by_value = {0.01: {0: 0.5, 1: 0.4, 2: 0.9}, 0.1: {0: 0.4, 1: 0.2}, 1.0: {0: 0.3, 1: 0.0}}
    d, log = sweep_trend(by_value, group="atr", outcome="mean@K")
    assert log and d.seeds == (0, 1) and d.differences == pytest.approx((-0.1, -0.2))
    d, log = sweep_trend({-1: {0: 1.0, 1: 2.0}, 0: {0: 2.0, 1: 2.0}, 1: {0: 3.0, 1: 2.0}}, group="x", outcome="o")
    assert not log and d.differences == pytest.approx((1.0, 0.0))
    with pytest.raises(ValueError, match="at least 3 swept values"):
        sweep_trend({0.1: {0: 1.0}, 0.2: {0: 1.0}}, group="x", outcome="o")

def test_percentile_bootstrap_under_covers_at_five_seeds():
    """Why the interval is studentised: scipy's percentile interval of the same differences is too narrow
    (it cannot leave the range of the 5 values)."""
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(EXPERIMENTS):
        group, reference = synthetic(rng, NOISE["normal"], EFFECT)
        d = np.array([group[s] - reference[s] for s in range(SEEDS)])
        ci = sps.bootstrap((d,), np.mean, method="percentile", rng=rng).confidence_interval
        hits += ci.low <= EFFECT <= ci.high
    print(f"\npercentile bootstrap: covers the true effect in {hits / EXPERIMENTS:.1%} at n = {SEEDS}")
    assert hits / EXPERIMENTS < 0.90


def test_interval_edge_cases_and_sentences():
    one = paired_difference({0: 0.5}, {0: 0.3, 1: 0.2}, group="atr", ref="clip", outcome="mean@K")
    assert one.n == 1 and one.verdict == "no interval" and math.isnan(one.low) and one.seeds_needed is None
    assert "no interval with one seed" in difference_sentence(one, "Mean@8")
    with pytest.raises(ValueError, match="at least 2"):
        bootstrap_t_interval([0.1])
    # 3 seeds: a resample repeating one seed has no spread in 1/9 of the cases > 2.5 %: unbounded
    three = paired_difference({0: 0.5, 1: 0.6, 2: 0.58}, {0: 0.3, 1: 0.31, 2: 0.29}, group="a", ref="b", outcome="x")
    assert three.low == -math.inf and three.high == math.inf and three.verdict == "not resolved"
    same = paired_difference({s: 0.2 + 0.03 * s for s in range(4)}, {s: 0.2 + 0.03 * s for s in range(4)},
                             group="atr", ref="identity", outcome="mean@K")
    assert same.verdict == "identical" and same.low == same.high == 0.0
    assert "identical on all 4 paired seed(s)" in difference_sentence(same, "Mean@8")
    shift = paired_difference({s: 0.6 + 0.03 * s for s in range(3)}, {s: 0.2 + 0.03 * s for s in range(3)},
                              group="a", ref="b", outcome="x")  # float rounding is no spread
    assert shift.differences == (0.4, 0.4, 0.4) and (shift.low, shift.high) == (0.4, 0.4)
    assert shift.verdict == "higher" and shift.seeds_needed is None
    # NaN (a run without that metric) and seeds only one group has are left out of the pairing
    partial = paired_difference({0: 0.5, 1: math.nan, 2: 0.4, 3: 0.45, 7: 0.9}, {0: 0.4, 1: 0.3, 2: 0.41, 3: 0.4},
                                group="a", ref="b", outcome="x")
    assert partial.seeds == (0, 2, 3) and partial.differences == (0.1, -0.01, 0.05)
    rng = np.random.default_rng(3)
    reference = rng.normal(0.3, 0.05, 6)
    up = paired_difference(dict(enumerate(reference + 0.05 + 0.01 * rng.standard_normal(6))),
                           dict(enumerate(reference)), group="atr", ref="clip", outcome="mean@K")
    text = difference_sentence(up, "Mean@8")
    assert up.verdict == "higher" and up.low > 0
    assert text.startswith(f"atr - clip, Mean@8: +{100 * up.mean:.1f} points [95% CI +{100 * up.low:.1f}, ")
    assert text.endswith("n = 6 paired seeds: higher than clip.")
    flat = paired_difference(dict(enumerate(reference + 0.002 * rng.standard_normal(6))), dict(enumerate(reference)),
                             group="atr", ref="clip", outcome="mean@K")
    assert flat.low < 0 < flat.high and flat.verdict == "not resolved"
    assert (f"the interval includes 0: no difference resolved at n = 6; about {flat.seeds_needed} seeds would be "
            "needed to resolve a difference this size.") in difference_sentence(flat, "Mean@8")


def test_stat_of_seeds_drops_non_finite_values():  # moved from the removed rank-sentence test of test_compare.py
    assert math.isnan(stat([1.0]).std) and stat([1.0, float("nan"), 3.0]).n == 2


def test_seeds_needed_matches_textbook_power():
    """Paired / one-sample t-test, two-sided alpha 0.05, power 0.8 (Cohen 1988; G*Power): effect size
    d = 0.5 -> 34, 0.8 -> 15, 1.0 -> 10 seeds."""
    assert [seeds_needed(d, 1.0) for d in (0.5, 0.8, 1.0)] == [34, 15, 10]
    assert seeds_needed(-0.5, 1.0) == 34 and seeds_needed(0.05, 0.1) == 34  # sign- and scale-free
    n = [seeds_needed(mean, 1.0) for mean in (0.2, 0.4, 0.8, 1.6, 3.2)]
    assert n == sorted(n, reverse=True) and n[-1] >= 2
    assert seeds_needed(0.0, 1.0) is None and seeds_needed(0.1, 0.0) is None and seeds_needed(1e-3, 1.0) is None
    # the paper-claims note: 0.8 points at std 0.85 needs ~18 seeds per arm unpaired; paired with sd of
    # differences sqrt(2) * 0.85 it is the same order
    assert 15 <= seeds_needed(0.8, math.sqrt(2) * 0.85) <= 22


@pytest.mark.parametrize("values, log", [((0.02, 0.07, 0.2), True), ((0.05, 0.1, 0.2), False),
                                         ((0.0, 0.1, 1.0), False), ((-1.0, 1.0, 10.0), False), ((1, 5, 100), True)])
def test_a_sweep_is_read_on_log10_when_its_positive_values_span_tenfold(values, log):
    # the trend's slope and the sweep figure's axis both follow this one rule
    assert log_scale(values) is log
    outcome = {v: {0: 0.1, 1: 0.2} for v in values}
    assert sweep_trend(outcome, group="g", outcome="o")[1] is log
