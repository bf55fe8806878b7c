"""The comparison's figures (paper Figures 2-4): curves over seeds as mean ± std bands, and a sweep's metric against
its swept value. Each returns the plotted data as rows for `curves.csv`; the style is `trustclip.figures`'."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trustclip.compare.results import SERIES, Group, metric_title, title_of
from trustclip.figures import COLORS, color_for, figure_context, new_figure, pyplot, save_figure, style_axes
from trustclip.train.plots import default_window as plot_window
from trustclip.train.plots import smooth

FIGURES_DIR = "figures"


@dataclass
class Band:
    """A curve over seeds: x, mean, std (NaN with one seed) and the number of seeds per point."""

    x: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    n: int

    def lines(self) -> dict[str, np.ndarray]:
        std = np.nan_to_num(self.std)
        return {"x": self.x, "mean": self.mean, "low": self.mean - std, "high": self.mean + std}


def band(per_seed: Sequence[tuple[np.ndarray, np.ndarray]]) -> Band | None:
    """Mean and std over seeds at the x values every seed has (None without seeds)."""
    if not per_seed:
        return None
    common = per_seed[0][0]
    for x, _ in per_seed[1:]:
        common = np.intersect1d(common, x)
    if not common.size:
        return Band(np.array([]), np.array([]), np.array([]), len(per_seed))
    stack = np.array([y[np.searchsorted(x, common)] for x, y in per_seed])
    std = stack.std(axis=0, ddof=1) if len(per_seed) > 1 else np.full(common.size, np.nan)
    return Band(common, stack.mean(axis=0), std, len(per_seed))


def series_band(group: Group, key: str, window: int) -> Band | None:
    """A training series, each seed smoothed with `window`, then mean / std over seeds."""
    return band([(x, smooth(y, window)) for x, y in (r.series[key] for r in group.runs if key in r.series)])


def eval_band(group: Group, split: str, metric: str) -> Band | None:
    """Held-out metric against the RL step (periodic evaluations + final; step 0 is the RL start)."""
    per_seed = []
    for run in group.runs:
        points = {step: h[split][metric] for step, h in run.history.items() if split in h and metric in h[split]}
        if run.before and split in run.before:
            points.setdefault(0, run.before[split][metric])
        if points:
            steps = np.array(sorted(points))
            per_seed.append((steps, np.array([points[s] for s in steps])))
    return band(per_seed)


def at_k_band(group: Group, split: str, kind: str) -> Band | None:
    """Mean@k (`kind="mean"`) or Pass@k (`"pass"`) of the final policy for k = 1..n, over seeds."""
    return band([(np.asarray(r.curves[split]["k"], float), np.asarray(r.curves[split][kind], float))
                 for r in group.runs if split in r.curves and kind in r.curves[split]])


def default_window(groups: Sequence[Group]) -> int:
    """The training plots' window for the longest run."""
    return plot_window(max((len(s[0]) for g in groups for r in g.runs for s in r.series.values()), default=1))


def make_figures(groups: Sequence[Group], splits: Sequence[str], metrics: Sequence[str], out: Path,
                 window: int | None) -> tuple[list[Path], list[dict[str, Any]]]:
    """Every figure of the report; returns the paths and the plotted data rows (for curves.csv)."""
    window = window or default_window(groups)
    rows: list[dict[str, Any]] = []
    paths: list[Path] = []

    def panel(name: str, title: str, xlabel: str, ylabel: str, fn: Any, *args: Any, logx: bool = False) -> dict:
        bands = {g.group: b for g in groups if (b := fn(g, *args)) is not None and b.x.size}
        rows.extend({"figure": name, "panel": title, "group": group, "x": float(x), "mean": float(m), "std": float(s),
                     "n_seeds": b.n} for group, b in bands.items() for x, m, s in zip(b.x, b.mean, b.std, strict=True))
        return {"title": title, "xlabel": xlabel, "ylabel": ylabel, "logx": logx,
                "lines": {g: b.lines() for g, b in bands.items()}}

    training = [p for key, label in SERIES.items()
                if (p := panel("training_curves", label, "RL step", label, series_band, key, window))["lines"]]
    if training:
        title = f"Training curves: mean ± std over seeds, moving average over {window} steps"
        paths.append(plot_seed_bands(out / "training_curves.png", training, title=title, ncols=4))
        for p in training:
            stem = p["title"].split(" (")[0].replace(" ", "_")
            paths.append(plot_seed_bands(out / f"training_{stem}.png", [p], title=title, ncols=1))
    evals = [panel("eval_vs_step", f"{title_of(s)} {metric_title(m)}", "RL step", "accuracy", eval_band, s, m)
             for m in metrics for s in splits]
    if any(p["lines"] for p in evals):
        paths.append(plot_seed_bands(out / "eval_vs_step.png", evals, ncols=len(splits),
                                     title="Held-out accuracy during RL (step 0: RL start), mean ± std"))
    at_k = [panel("at_k", f"{title_of(s)} {kind.capitalize()}@k", "k", "accuracy", at_k_band, s, kind, logx=True)
            for kind in ("mean", "pass") for s in splits]
    if any(p["lines"] for p in at_k):
        paths.append(plot_seed_bands(out / "at_k.png", at_k, ncols=len(splits),
                                     title="Mean@k and Pass@k of the final policy vs k, mean ± std"))
    swept = [g for g in groups if g.sweep_key is not None]
    if swept:
        key, avg = swept[0].sweep_key, splits[-1]
        panels = []
        for metric in metrics:
            series: dict[str, dict[str, list]] = {}
            for g in swept:
                st = g.stat(f"final/{avg}/{metric}")
                for name, value in (("x", g.sweep_value), ("mean", st.mean), ("std", st.std)):
                    series.setdefault(g.label, {"x": [], "mean": [], "std": []})[name].append(value)
                rows.append({"figure": "sweep", "panel": metric, "group": g.group, "x": g.sweep_value,
                             "mean": st.mean, "std": st.std, "n_seeds": st.n})
            refs = {g.group: {"mean": (st := g.stat(f"final/{avg}/{metric}")).mean, "std": st.std}
                    for g in groups if g.sweep_key is None}
            panels.append({"title": f"{title_of(avg)} {metric_title(metric)} (final)", "ylabel": "accuracy",
                           "series": series, "references": refs})
        paths.append(plot_sweep(out / "sweep.png", key, panels, title=f"Final {title_of(avg)} accuracy vs {key}"))
    return paths, rows


# ----------------------------------------------------------------------------------------------------- drawing
def distinct_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per name: the shared `COLORS` entry where there is one, otherwise the next tab10/tab20 colour not
    yet used in this figure (so up to 20 names never share a colour)."""
    from matplotlib.colors import to_hex

    cmap = pyplot().get_cmap("tab20" if len(names) > 10 else "tab10")
    out = {n: COLORS[n] for n in names if n in COLORS}
    free = [c for c in (to_hex(cmap(i)) for i in range(cmap.N)) if c not in out.values()]
    for i, name in enumerate(n for n in names if n not in out):
        out[name] = free[i % len(free)] if free else color_for(name)
    return out


def draw_seed_bands(ax: Any, lines: dict[str, dict[str, Sequence[float]]], colors: dict[str, str], *,
                    title: str = "", xlabel: str = "", ylabel: str = "", logx: bool = False) -> None:
    """One line per group, `lines[group] = {"x", "mean"[, "low", "high"]}`, with the band low..high shaded.
    Artist gids: "<group>-line" and "<group>-band"."""
    for group, d in lines.items():
        x, mean = np.asarray(d["x"], float), np.asarray(d["mean"], float)
        if x.size == 0:
            continue
        color = colors.get(group, color_for(group))
        ax.plot(x, mean, color=color, lw=1.6, marker="o" if x.size <= 12 else None, ms=3.5, label=group,
                gid=f"{group}-line")
        if "low" in d and "high" in d:
            low, high = np.asarray(d["low"], float), np.asarray(d["high"], float)
            if np.any(np.isfinite(low) & (high > low)):
                ax.fill_between(x, low, high, color=color, alpha=0.18, lw=0, gid=f"{group}-band")
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(pyplot().FuncFormatter(lambda v, _: f"{v:g}"))
    style_axes(ax, title=title, xlabel=xlabel, ylabel=ylabel)


def plot_seed_bands(path: str | Path, panels: Sequence[dict[str, Any]], *, title: str | None = None,
                    ncols: int = 2, width: float = 5.0, height: float = 3.4) -> Path:
    """A grid of `draw_seed_bands` panels sharing one colour per group and one legend; each panel is a dict with
    `lines` and optional `title`, `xlabel`, `ylabel`, `logx`. Empty panels are left out."""
    panels = [p for p in panels if any(len(d["x"]) for d in p["lines"].values())]
    if not panels:
        raise ValueError("nothing to plot: every panel is empty")
    ncols = max(1, min(ncols, len(panels)))
    with figure_context():
        colors = distinct_colors(list(dict.fromkeys(g for p in panels for g in p["lines"])))
        fig, axes = new_figure(math.ceil(len(panels) / ncols), ncols, width=width, height=height)
        handles: dict[str, Any] = {}
        for ax, p in zip(axes.flat, panels, strict=False):
            draw_seed_bands(ax, p["lines"], colors, title=p.get("title", ""), xlabel=p.get("xlabel", ""),
                            ylabel=p.get("ylabel", ""), logx=p.get("logx", False))
            ax.get_legend().remove()  # one legend beside the grid: inside a panel it covers the curves
            handles.update({lb: h for h, lb in zip(*ax.get_legend_handles_labels(), strict=True) if lb not in handles})
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.legend(list(handles.values()), list(handles), loc="outside right center")
        if title:  # wrapped to the grid's width: one narrow panel cannot hold a long title on one line
            fig.suptitle(textwrap.fill(title, max(30, int(8 * width * ncols))))
        return save_figure(fig, path)


def plot_sweep(path: str | Path, key: str, panels: Sequence[dict[str, Any]], *, title: str | None = None) -> Path:
    """Metric against a swept hyper-parameter (paper Figure 3). Each panel: `ylabel`, optional `title`,
    `series = {group: {"x", "mean", "std"}}` drawn with error bars (gid "<group>-sweep"), and `references = {group:
    {"mean", "std"}}` for groups without the parameter, as horizontal lines with a -/+ std band."""
    if not panels or not any(p.get("series") for p in panels):
        raise ValueError("nothing to plot: no swept series")
    with figure_context():
        colors = distinct_colors(list(dict.fromkeys(g for p in panels for g in [*p["series"], *p["references"]])))
        fig, axes = new_figure(1, len(panels), width=4.8, height=3.6)
        for ax, panel in zip(axes.flat, panels, strict=True):
            for group, s in panel["series"].items():
                ax.errorbar(s["x"], s["mean"], yerr=np.nan_to_num(np.asarray(s["std"], float)), color=colors[group],
                            marker="o", ms=4, capsize=3, lw=1.6, label=group, gid=f"{group}-sweep")
            for group, r in panel["references"].items():
                ax.axhline(r["mean"], color=colors[group], ls="--", lw=1.2, label=f"{group} (no {key})",
                           gid=f"{group}-reference")
                if np.isfinite(r["std"]) and r["std"] > 0:
                    ax.axhspan(r["mean"] - r["std"], r["mean"] + r["std"], color=colors[group], alpha=0.1, lw=0)
            xs = [x for s in panel["series"].values() for x in s["x"]]
            positive = sorted({x for x in xs if isinstance(x, int | float) and x > 0})
            if positive and all(isinstance(x, int | float) and x > 0 for x in xs) and positive[-1] / positive[0] >= 4:
                ax.set_xscale("log")
                ax.set_xticks(positive, [f"{v:g}" for v in positive])
                ax.minorticks_off()
            style_axes(ax, title=panel.get("title", ""), xlabel=key, ylabel=panel.get("ylabel", ""))
        if title:
            fig.suptitle(title)
        return save_figure(fig, path)
