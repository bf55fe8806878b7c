"""Figures: the shared style and the ratio regions of divergence constraints (ATR paper, Wu et al., arXiv
2602.05494, Figure 1, generalised).

matplotlib is imported lazily (Agg backend) so that importing this module costs nothing. New plots should
use the style helpers (`figure_context`, `new_figure`, `style_axes`, `color_for`, `save_figure`) so every
figure of the library looks the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trustclip.objectives import bounds

# ---------------------------------------------------------------------------------------- shared style
STYLE: dict[str, Any] = {
    "figure.dpi": 100, "savefig.dpi": 150, "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9,
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8,
    "legend.frameon": False,
}

# Stable colours per method / quantity (colour-blind-safe Dark2 / tab10 picks); unknown names get a
# deterministic colour from tab10 so later plots (e.g. training curves per objective) stay consistent.
COLORS: dict[str, str] = {
    "clip": "#666666", "kl1": "#1b9e77", "kl2": "#d95f02", "kl3": "#7570b3", "atr": "#7570b3", "is_kl3": "#e7298a",
    "dcpo": "#66a61e", "trgppo": "#e6ab02", "X-": "#d62728", "X+": "#1f77b4",
}
_FALLBACK = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def pyplot():
    """matplotlib.pyplot with the non-interactive Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure_context() -> Iterator[Any]:
    """`with figure_context() as plt:` applies STYLE without touching global rcParams."""
    plt = pyplot()
    with plt.rc_context(STYLE):
        yield plt


def new_figure(nrows: int = 1, ncols: int = 1, width: float = 5.0, height: float = 3.6):
    """(fig, axes) with panel size width x height inches, constrained layout and a 2-D axes array;
    call inside `figure_context`."""
    return pyplot().subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, layout="constrained")


def style_axes(ax, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None) -> None:
    """Title, labels and a legend when the axes has labelled artists."""
    ax.set(**{key: text for key, text in {"title": title, "xlabel": xlabel, "ylabel": ylabel}.items() if text})
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def color_for(name: str) -> str:
    """Colour of a method or quantity, stable across figures and runs."""
    return COLORS.get(name, _FALLBACK[sum(map(ord, name)) % len(_FALLBACK)])


def save_figure(fig, path: str | Path) -> Path:
    """Write the figure (format from the suffix, parent folders created) and close it."""
    path = Path(path)
    if not path.suffix:
        raise ValueError(f"figure path needs a suffix such as .png or .pdf, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    pyplot().close(fig)
    return path


# ------------------------------------------------------------ divergence regions (paper Figure 1, generalised)
# name -> (label, D(w), bounds(delta)); the KL1 entry's bounds take the one-/two-sided flag.
DIVERGENCES: dict[str, tuple[str, Callable, Callable]] = {
    "kl1": ("KL1 = -log w", bounds.kl1, bounds.kl1_bounds),
    "kl2": ("KL2 = (log w)$^2$/2", bounds.kl2, bounds.kl2_bounds),
    "kl3": ("KL3 = w - 1 - log w  (ATR)", bounds.kl3, bounds.kl3_bounds),
    "is_kl3": ("IS-KL3 = w log w - w + 1", bounds.is_kl3, bounds.is_kl3_bounds),
}


def divergence_regions(delta: float = 0.07, kl1_two_sided: bool = False) -> dict[str, tuple[float, float]]:
    """{name: (l, u)} with {w : D(w) <= delta} = [l, u] for every divergence in DIVERGENCES (each checks delta)."""
    return {name: region(delta, kl1_two_sided) if name == "kl1" else region(delta)
            for name, (_, _, region) in DIVERGENCES.items()}


def _fmt(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "$\\infty$"


def draw_divergence_curve(ax, name: str, delta: float, epsilon: float, region: tuple[float, float],
                          w_range: tuple[float, float]) -> None:
    """D(w) with the line D = delta, the shaded feasible interval [l, u] (artist gid "<name>-region"), its
    endpoints (gid "<name>-endpoints", finite ones only) and the clip range 1 -/+ eps (gid "clip-range")."""
    label, fn, _ = DIVERGENCES[name]
    color = color_for(name)
    w = np.linspace(w_range[0], w_range[1], 800)
    low, high = region
    ax.plot(w, fn(w), color=color, lw=2)
    ax.axhline(delta, color="black", ls="--", lw=0.8, label=f"$\\delta$ = {delta:g}")
    ax.axvspan(low, min(high, w_range[1]), color=color, alpha=0.15, gid=f"{name}-region",
               label=f"D $\\leq$ $\\delta$: [{_fmt(low)}, {_fmt(high)}]")
    finite = [x for x in (low, high) if math.isfinite(x)]
    ax.plot(finite, [delta] * len(finite), "o", color=color, ms=5, gid=f"{name}-endpoints")
    for x in finite:
        right = x > 1
        ax.annotate(f"{x:.3f}", (x, delta), textcoords="offset points", xytext=(5 if right else -5, -11),
                    ha="left" if right else "right", fontsize=8)
    ax.vlines([1 - epsilon, 1 + epsilon], -delta, 4 * delta, colors=color_for("clip"), ls=":", lw=1.2, gid="clip-range",
              label=f"clip 1$\\pm${epsilon:g}")
    ax.set(xlim=w_range, ylim=(-delta, 4 * delta))
    style_axes(ax, title=label, xlabel="ratio w = $\\pi_\\theta / \\pi_{old}$", ylabel="D(w)")
    ax.legend(loc="upper center")


def draw_intervals(ax, regions: dict[str, tuple[float, float]], epsilon: float, w_range) -> None:
    """One horizontal bar per interval (gid "<name>-interval") and the clip range, with 1 - l and u - 1."""
    rows = [("clip", (1 - epsilon, 1 + epsilon)), *regions.items()]
    for y, (name, (low, high)) in enumerate(rows):
        shown_high = min(high, w_range[1])
        ax.hlines(y, low, shown_high, colors=color_for(name), lw=7, gid=f"{name}-interval")
        if not math.isfinite(high):
            ax.plot(shown_high, y, ">", color=color_for(name), ms=10)
        ax.annotate(f"1-l = {1 - low:.3f}", (low, y), textcoords="offset points", xytext=(-4, 0),
                    ha="right", va="center", fontsize=8)
        gap = 4 if high == shown_high else 12  # room for the arrow head of an unbounded interval
        ax.annotate(f"u-1 = {_fmt(high - 1)}", (shown_high, y), textcoords="offset points", xytext=(gap, 0),
                    ha="left", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    labels = ["clip (symmetric)"] + [DIVERGENCES[n][0].split(" =")[0] for n in regions]
    ax.set_yticks(range(len(rows)), labels)
    ax.set(ylim=(-0.7, len(rows) - 0.3), xlim=(w_range[0] - 0.25, w_range[1] + 0.25))
    ax.grid(axis="y", visible=False)
    style_axes(ax, title="Feasible ratio intervals", xlabel="ratio w")


def draw_q_bounds(ax, delta: float, epsilon: float, q_range: tuple[float, float] = (1e-3, 1.0),
                  dcpo_epsilons: tuple[float, float] = (0.16, 0.2)) -> None:
    """Bounds against q = pi_old(token) on log axes: DCPO (gids "dcpo-low"/"dcpo-high"), TRGPPO with its
    1 -/+ eps floor (gids "trgppo-low"/"trgppo-high") and without (dotted), and the constant ATR and clip
    ranges."""
    q = np.logspace(np.log10(q_range[0]), np.log10(q_range[1]), 400)
    q = np.minimum(q, 1 - 1e-6)  # q = 1 makes every bound degenerate
    dcpo = bounds.dcpo_bounds(q, *dcpo_epsilons)
    with np.errstate(divide="ignore"):  # the binary KL in trgppo_bounds hits log1p(-1) near q = 1; harmless there
        trgppo, raw = bounds.trgppo_bounds(q, delta, epsilon), bounds.trgppo_bounds(q, delta, None)
    atr_lo, atr_hi = bounds.kl3_bounds(delta)
    eps_l, eps_h = dcpo_epsilons
    curves = [  # (gid stem, (low, high), colour, line style, legend label)
        ("dcpo", dcpo, "dcpo", {"lw": 2}, f"DCPO ($\\epsilon_l$={eps_l:g}, $\\epsilon_h$={eps_h:g})"),
        ("trgppo", trgppo, "trgppo", {"lw": 2}, f"TRGPPO ($\\delta$={delta:g}, floor 1$\\pm${epsilon:g})"),
        (None, raw, "trgppo", {"lw": 1, "ls": ":"}, "TRGPPO raw KL bounds"),
    ]
    for gid, (low, high), color, style, label in curves:
        ax.plot(q, low, color=color_for(color), gid=gid and f"{gid}-low", label=label, **style)
        ax.plot(q, high, color=color_for(color), gid=gid and f"{gid}-high", **style)
    ax.hlines([atr_lo, atr_hi], q[0], q[-1], colors=color_for("atr"), lw=1.5, ls="--",
              label=f"ATR / KL3 [{atr_lo:.3f}, {atr_hi:.3f}]")
    ax.hlines([1 - epsilon, 1 + epsilon], q[0], q[-1], colors=color_for("clip"), lw=1.2, ls=":",
              label=f"clip 1$\\pm${epsilon:g}")
    ticks = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20]
    ax.set(xscale="log", yscale="log", ylim=(ticks[0], ticks[-1]))
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    style_axes(ax, title="Probability-dependent bounds", xlabel="q = $\\pi_{old}$(token)",
               ylabel="ratio bound (log scale)")


def plot_divergence_regions(path: str | Path, delta: float = 0.07, epsilon: float = 0.2, *, kl1_two_sided: bool = False,
                            q_range: tuple[float, float] = (1e-3, 1.0),
                            dcpo_epsilons: tuple[float, float] = (0.16, 0.2)) -> dict[str, tuple[float, float]]:
    """Write the paper's Figure 1, generalised, to `path`; return the plotted intervals {name: (l, u)}.

    Top row: D(w) for KL1, KL2, KL3, IS-KL3 with {D <= delta} shaded and the clip range 1 -/+ eps.
    Bottom left: all intervals side by side (KL3: 1 - l < u - 1, Theorem 4.2 (2)).
    Bottom right: DCPO and TRGPPO bounds against the old token probability q (log axes).
    """
    delta = bounds.check_delta(delta)
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon!r}")
    epsilon = float(epsilon)
    if not 0 < q_range[0] < q_range[1] <= 1:
        raise ValueError(f"q_range must satisfy 0 < q_min < q_max <= 1, got {q_range}")
    regions = divergence_regions(delta, kl1_two_sided)
    # The ratio axis shows every interval's finite ends and the clip range, with a margin.
    lows = [lo for lo, _ in regions.values()] + [1 - epsilon]
    highs = [hi for _, hi in regions.values() if math.isfinite(hi)] + [1 + epsilon]
    w_range = (max(0.8 * min(lows), 0.02), 1.15 * max(highs))
    with figure_context() as plt:
        fig = plt.figure(figsize=(15, 7.5), layout="constrained")
        grid = fig.add_gridspec(2, 4)
        for i, name in enumerate(DIVERGENCES):
            draw_divergence_curve(fig.add_subplot(grid[0, i]), name, delta, epsilon, regions[name], w_range)
        draw_intervals(fig.add_subplot(grid[1, :2]), regions, epsilon, w_range)
        draw_q_bounds(fig.add_subplot(grid[1, 2:]), delta, epsilon, q_range, dcpo_epsilons)
        fig.suptitle(f"Ratio regions of divergence constraints D(w) $\\leq$ $\\delta$ = {delta:g} "
                     f"vs symmetric clipping (arXiv 2602.05494, Fig. 1)")
        save_figure(fig, path)
    return {"clip": (1 - epsilon, 1 + epsilon), **regions}
