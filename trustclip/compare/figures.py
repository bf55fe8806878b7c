"""The comparison's figures (paper Figures 2-4): curves over seeds as mean ± std bands, and a sweep's metric against
its swept value; `make_figures` also returns the plotted data (`curves.csv`). The style is `trustclip.figures`'."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from functools import reduce
from itertools import cycle
from pathlib import Path
from typing import Any

import numpy as np

from trustclip.compare.paired_stats import Stat, log_scale
from trustclip.compare.results import SERIES, Group, title_of
from trustclip.figures import COLORS, figure_context, new_figure, pyplot, save_figure, style_axes
from trustclip.train.plots import default_window, smooth

PerSeed = list[tuple[np.ndarray, np.ndarray]]  # (x, y) of each seed
Band = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # a curve over seeds: x, mean, std (NaN with one seed), seeds


def band(per_seed: PerSeed) -> Band | None:
    """At the x values every seed has; None when no seed has the curve or the seeds share no x value."""
    if not per_seed or not (common := reduce(np.intersect1d, (x for x, _ in per_seed))).size:
        return None
    stack = np.array([y[np.searchsorted(x, common)] for x, y in per_seed])
    std = stack.std(axis=0, ddof=1) if len(per_seed) > 1 else np.full(common.size, np.nan)
    return common, stack.mean(axis=0), std, len(per_seed)


def series_points(group: Group, key: str, window: int) -> PerSeed:
    """A training series of each seed, smoothed over `window` steps."""
    return [(x, smooth(y, window)) for x, y in (r.series[key] for r in group.runs if key in r.series)]


def eval_points(group: Group, split: str, metric: str) -> PerSeed:
    """Held-out metric against the RL step (periodic evaluations and the final one; step 0: the RL start)."""
    out = []
    for run in group.runs:
        start = {0: run.before[split][metric]} if run.before and split in run.before else {}
        points = start | {step: h[split][metric] for step, h in run.history.items() if metric in h.get(split, {})}
        if points:
            out.append((np.array(sorted(points)), np.array([points[s] for s in sorted(points)])))
    return out


def at_k_points(group: Group, split: str, kind: str) -> PerSeed:
    """Mean@k (`kind` "mean") or Pass@k ("pass") of each seed's final policy against k."""
    return [(np.asarray(r.curves[split]["k"], float), np.asarray(r.curves[split][kind], float)) for r in group.runs
            if kind in r.curves.get(split, {})]


def make_figures(groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str], out: Path,
                 window: int | None, reference: str | None = None) -> tuple[list[Path], list[dict[str, Any]]]:
    """The report's figures (training curves, accuracy vs step, Mean@k / Pass@k vs k, the sweep, each group against
    the reference seed by seed) and their data."""
    window = window or default_window(max((len(s[0]) for g in groups for r in g.runs for s in r.series.values()),
                                          default=1))
    rows: list[dict[str, Any]] = []
    paths: list[Path] = []

    def figure(name: str, title: str, ncols: int, xlabel: str, ylabel: str | None, points: Callable[..., PerSeed],
               specs: Sequence[tuple[str, tuple]], logx: bool = False) -> None:
        """`name`.png and its rows: a panel per (title, args of `points`) that some group has data for."""
        panels = {panel: {g.group: b for g in groups if (b := band(points(g, *args)))} for panel, args in specs}
        rows.extend({"figure": name, "panel": panel, "group": group, "x": float(x), "mean": float(m), "std": float(s),
                     "n_seeds": n} for panel, bands in panels.items() for group, (xs, means, stds, n) in bands.items()
                    for x, m, s in zip(xs, means, stds, strict=True))
        if panels := {panel: bands for panel, bands in panels.items() if bands}:
            paths.append(plot_bands(out / f"{name}.png", panels, title, ncols, xlabel, ylabel, logx))

    figure("training_curves", f"Training curves: mean ± std over seeds, moving average over {window} steps", 4,
           "RL step", None, series_points, [(label, (key, window)) for key, (label, *_) in SERIES.items()])
    figure("eval_vs_step", "Held-out accuracy during RL (step 0: RL start), mean ± std", len(splits), "RL step",
           "accuracy", eval_points, [(f"{title_of(s)} {m.capitalize()}", (s, m)) for m in metrics for s in splits])
    figure("at_k", "Mean@k and Pass@k of the final policy vs k, mean ± std", len(splits), "k", "accuracy", at_k_points,
           [(f"{title_of(s)} {m.capitalize()}@k", (s, m)) for m in ("mean", "pass") for s in splits], logx=True)
    if swept := [g for g in groups if g.spec.sweep_key is not None]:
        avg = splits[-1]
        stats = {m: {g.group: g.stat(f"final/{avg}/{m}") for g in groups} for m in metrics}
        rows.extend({"figure": "sweep", "panel": m, "group": g.group, "x": g.spec.sweep_value, "mean": st[g.group].mean,
                     "std": st[g.group].std, "n_seeds": st[g.group].n} for m, st in stats.items() for g in swept)
        paths.append(plot_sweep(out / "sweep.png", groups, stats, title_of(avg)))
    ref = next((g for g in groups if g.group == reference), None)
    if ref is not None and len(groups) > 1:
        avg, panels = splits[-1], {}
        for m in metrics:
            key = f"final/{avg}/{m}"
            reference_by_seed = ref.values.get(key, {})
            panels[m] = {g.group: [(seed, reference_by_seed[seed], y) for seed, y in g.values.get(key, {}).items()
                                   if seed in reference_by_seed] for g in groups if g is not ref}
            rows.extend({"figure": "paired_by_seed", "panel": m, "group": group, "x": x, "mean": y, "std": math.nan,
                         "n_seeds": 1} for group, pts in panels[m].items() for _, x, y in pts)
        if any(pts for panel in panels.values() for pts in panel.values()):
            paths.append(plot_paired(out / "paired_by_seed.png", panels, ref.group, title_of(avg)))
    return paths, rows


def distinct_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per name: the shared `COLORS` entry where there is one, else the next tab10/tab20 colour not yet
    used in this figure (so up to 20 names never share a colour)."""
    from matplotlib.colors import to_hex

    cmap = pyplot().get_cmap("tab20" if len(names) > 10 else "tab10")
    known = {n: COLORS[n] for n in names if n in COLORS}
    free = cycle([c for c in (to_hex(cmap(i)) for i in range(cmap.N)) if c not in known.values()])
    return {n: known.get(n) or next(free) for n in names}  # `free` is never empty: COLORS holds 2 of tab10's colours


def plot_bands(path: Path, panels: dict[str, dict[str, Band]], title: str, ncols: int, xlabel: str,
               ylabel: str | None, logx: bool) -> Path:
    """A grid of panels (title -> group -> band), one line per group with its mean ± std band shaded, one colour per
    group, one legend (ylabel None: the panel's title)."""
    ncols = min(ncols, len(panels))
    with figure_context():
        colors = distinct_colors(list(dict.fromkeys(g for bands in panels.values() for g in bands)))
        fig, axes = new_figure(math.ceil(len(panels) / ncols), ncols, width=5.0, height=3.4)
        handles: dict[str, Any] = {}
        for ax, (panel, bands) in zip(axes.flat, panels.items(), strict=False):
            for group, (x, mean, std, _) in bands.items():
                ax.plot(x, mean, color=colors[group], lw=1.6, marker="o" if x.size <= 12 else None, ms=3.5, label=group)
                low, high = mean - np.nan_to_num(std), mean + np.nan_to_num(std)
                if np.any(np.isfinite(low) & (high > low)):  # no band for one seed
                    ax.fill_between(x, low, high, color=colors[group], alpha=0.18, lw=0)
            if logx:
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(pyplot().FuncFormatter(lambda v, _: f"{v:g}"))
            style_axes(ax, title=panel, xlabel=xlabel, ylabel=ylabel or panel)
            ax.get_legend().remove()  # one legend beside the grid: inside a panel it covers the curves
            handles.update({lb: h for h, lb in zip(*ax.get_legend_handles_labels(), strict=True) if lb not in handles})
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.legend(list(handles.values()), list(handles), loc="outside right center")
        # wrapped to the grid's width: one narrow panel cannot hold a long title on one line
        fig.suptitle(textwrap.fill(title, max(30, int(8 * 5.0 * ncols))))
        return save_figure(fig, path)


def plot_sweep(path: Path, groups: Sequence[Group], panels: dict[str, dict[str, Stat]], average: str) -> Path:
    """Final `average` accuracy against the swept value (paper Figure 3), a panel per metric (group -> Stat): swept
    groups with ± std error bars, the others as horizontal lines with a ± std band; log x where `log_scale` says."""
    swept = [g for g in groups if g.spec.sweep_key is not None]
    references, key = [g for g in groups if g.spec.sweep_key is None], swept[0].spec.sweep_key
    xs, labels = [g.spec.sweep_value for g in swept], list(dict.fromkeys(g.spec.label for g in swept))
    with figure_context():
        colors = distinct_colors(list(dict.fromkeys([*labels, *(g.group for g in references)])))
        fig, axes = new_figure(1, len(panels), width=4.8, height=3.6)
        for ax, (metric, stats) in zip(axes.flat, panels.items(), strict=True):
            for label, members in ((lb, [g for g in swept if g.spec.label == lb]) for lb in labels):
                ax.errorbar([g.spec.sweep_value for g in members], [stats[g.group].mean for g in members],
                            yerr=np.nan_to_num(np.asarray([stats[g.group].std for g in members], float)),
                            color=colors[label], marker="o", ms=4, capsize=3, lw=1.6, label=label)
            for g, r in ((g, stats[g.group]) for g in references):
                ax.axhline(r.mean, color=colors[g.group], ls="--", lw=1.2, label=f"{g.group} (no {key})")
                if np.isfinite(r.std) and r.std > 0:
                    ax.axhspan(r.mean - r.std, r.mean + r.std, color=colors[g.group], alpha=0.1, lw=0)
            if all(isinstance(x, int | float) for x in xs) and log_scale(xs):
                ax.set_xscale("log")
                ax.set_xticks(sorted(set(xs)), [f"{v:g}" for v in sorted(set(xs))])
                ax.minorticks_off()
            style_axes(ax, title=f"{average} {metric.capitalize()} (final)", xlabel=key, ylabel="accuracy")
        fig.suptitle(f"Final {average} accuracy vs {key}")
        return save_figure(fig, path)


def plot_paired(path: Path, panels: dict[str, dict[str, list[tuple[int, float, float]]]], reference: str,
                average: str) -> Path:
    """Each group's final `average` accuracy against the reference's, one point per seed (metric -> group ->
    [(seed, reference's, group's)]): above the diagonal, the group did better on that seed."""
    with figure_context():
        colors = distinct_colors([g for panel in panels.values() for g in panel])
        fig, axes = new_figure(1, len(panels), width=4.2, height=4.0)
        for ax, (metric, by_group) in zip(axes.flat, panels.items(), strict=True):
            values = [v for pts in by_group.values() for _, x, y in pts for v in (x, y)]
            if values:
                low, high = min(values), max(values)
                pad = 0.05 * (high - low or 1.0)
                ax.plot([low - pad, high + pad], [low - pad, high + pad], color="0.6", lw=1, ls="--")
            for group, pts in by_group.items():
                ax.scatter([x for _, x, _ in pts], [y for _, _, y in pts], s=16, color=colors[group], alpha=0.8,
                           label=f"{group} ({len(pts)} seeds)")
            style_axes(ax, title=f"{average} {metric.capitalize()} (final), per seed", xlabel=reference,
                       ylabel="other objective")
            ax.legend(fontsize=7)
        fig.suptitle(f"Paired by seed against {reference}")
        return save_figure(fig, path)
