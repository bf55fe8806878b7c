"""Benchmark (not a test): how well 95 % intervals of a mean paired difference do with a handful of seeds.

For n seeds and a distribution of the per-seed difference, draws `--experiments` synthetic comparisons and
reports, per interval method, its coverage of the true mean (nominal 0.95), its median width (in standard
deviations of the difference) and how often it resolves (excludes 0 for) a true difference of 2 standard
deviations. Methods: scipy's percentile and BCa bootstrap, Hesterberg's expanded percentile bootstrap, the
studentised bootstrap `trustclip compare` uses (`trustclip.compare.paired_stats.bootstrap_t_interval`) and the
paired t-interval. The coverage table of docs/compare-statistics.md comes from this script.

    python scripts/interval_coverage.py [--experiments 1000] [--seeds 3 4 5 6 8 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy import stats

from trustclip.compare.paired_stats import bootstrap_t_interval

DISTRIBUTIONS = {  # centred: the true mean is 0; scaled to unit sd below
    "normal": lambda rng, n: rng.standard_normal(n),
    "exponential": lambda rng, n: rng.exponential(1.0, n) - 1.0,
    "lognormal(0,1)": lambda rng, n: rng.lognormal(0.0, 1.0, n) - np.exp(0.5),
    "t(3)": lambda rng, n: rng.standard_t(3, n),
}
SD = {"normal": 1.0, "exponential": 1.0, "lognormal(0,1)": float(np.sqrt((np.e - 1) * np.e)), "t(3)": float(np.sqrt(3))}


def percentile(d, level=0.95, method="percentile"):
    return stats.bootstrap((d,), np.mean, method=method, confidence_level=level,
                           rng=np.random.default_rng(0)).confidence_interval


def expanded_percentile(d):
    """Hesterberg 2015 (Am. Stat. 69(4)): percentile interval at the level whose normal quantile is
    sqrt(n / (n - 1)) t_{n-1}, correcting the bootstrap's narrowness bias."""
    n = d.size
    level = 1 - 2 * stats.norm.sf(np.sqrt(n / (n - 1)) * stats.t.ppf(0.975, n - 1))
    return percentile(d, level)


METHODS = {
    "percentile": percentile,
    "BCa": lambda d: percentile(d, method="BCa"),
    "expanded": expanded_percentile,
    "bootstrap-t": bootstrap_t_interval,
    "t": lambda d: stats.ttest_1samp(d, 0.0).confidence_interval(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5, 6, 8, 10])
    args = parser.parse_args()
    print(f"{'n':>3} {'distribution':<15} " + " ".join(f"{m:>22}" for m in METHODS))
    print(f"{'':>3} {'':<15} " + " ".join(f"{'cover width resolve':>22}" for _ in METHODS))
    for n in args.seeds:
        for name, draw in DISTRIBUTIONS.items():
            rng = np.random.default_rng(n)
            t0 = time.time()
            cover = {m: 0 for m in METHODS}
            resolve = {m: 0 for m in METHODS}
            width = {m: [] for m in METHODS}
            with np.errstate(all="ignore"):
                for _ in range(args.experiments):
                    d = draw(rng, n) / SD[name]
                    for method, interval in METHODS.items():
                        low, high = interval(d)
                        cover[method] += low <= 0 <= high
                        width[method].append(high - low)
                        low, high = interval(d + 2.0)
                        resolve[method] += low > 0
            cells = [f"{cover[m] / args.experiments:>7.3f} {np.median(width[m]):>6.2f} "
                     f"{resolve[m] / args.experiments:>7.2f}" for m in METHODS]
            print(f"{n:>3} {name:<15} " + " ".join(f"{c:>22}" for c in cells) + f"  ({time.time() - t0:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
