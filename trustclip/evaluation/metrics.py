"""Mean@K and Pass@K from one set of n samples per problem.

Pass@k uses the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on
Code": with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), the probability that a
random size-k subset contains a correct sample. It is computed in the numerically stable product form
1 - prod_{i=n-c+1}^{n} (1 - k/i). Mean@k (the mean accuracy over k samples) has expectation c/n for any
k <= n, so curves over k = 1..n (the paper's Figure 4) come from the same samples.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import numpy as np

AVERAGE = "average"  # the row of a result that averages its benchmarks


def _check(n: int, c: int, k: int) -> None:
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if n < 1:
        raise ValueError(f"need n >= 1 samples, got n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `n` samples, `c` of them correct (Chen et al., 2021)."""
    _check(n, c, k)
    if n - c < k:  # every size-k subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_at_k(n: int, c: int, k: int) -> float:
    """Expected accuracy over `k` of the `n` samples (c/n for every k <= n), for one problem."""
    _check(n, c, k)
    return c / n


def benchmark_metrics(correct: Sequence[Sequence[float | bool]], ks: Iterable[int]) -> dict[str, float]:
    """`{"mean@k": ..., "pass@k": ...}` (fractions in [0, 1]) averaged over problems, for each k in `ks`;
    `correct[i][j]` is the 0/1 score of sample j of problem i."""
    counts = []  # (n, c) per problem
    for i, row in enumerate(correct):
        if len(row) == 0:
            raise ValueError(f"problem {i} has no samples")
        if bad := [x for x in row if float(x) not in (0.0, 1.0)]:
            raise ValueError(f"problem {i}: scores must be 0/1 (or bools), got {bad[0]!r}")
        counts.append((len(row), int(sum(float(x) for x in row))))
    if not counts:
        raise ValueError("no problems to score")
    return {f"{name}@{k}": float(np.mean([metric(n, c, k) for n, c in counts]))
            for k in ks for name, metric in (("mean", mean_at_k), ("pass", pass_at_k))}


def metric_curves(correct: Sequence[Sequence[float | bool]]) -> dict[str, list[float]]:
    """Mean@k and Pass@k for k = 1..n (n = fewest samples any problem has), from one set of samples."""
    ks = list(range(1, min(map(len, correct), default=1) + 1))  # benchmark_metrics checks `correct`
    scores = benchmark_metrics(correct, ks)
    return {"k": [float(k) for k in ks], **{name: [scores[f"{name}@{k}"] for k in ks] for name in ("mean", "pass")}}
