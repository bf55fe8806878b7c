"""Training curves of an RL run (the paper's Figure 2 panels): reward, entropy, completion length and
clip fractions against the optimizer step, read from `metrics.jsonl`, raw (faint) and smoothed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trustclip import metric_names as names
from trustclip.metrics_file import read_series

# file stem -> (title, [(metric, label)])
PANELS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward": ("Reward (train)", [(names.REWARD, "mean reward")]),
    "entropy": ("Policy entropy", [(names.ENTROPY, "entropy (nats/token)")]),
    "completion_length": ("Completion length", [(names.COMPLETION_LENGTH, "mean length (tokens)")]),
    "clip_fractions": ("Clipped tokens", [(names.CLIP_LOW, "clipped low (A<0)"),
                                          (names.CLIP_HIGH, "clipped high (A>0)")]),
}


def default_window(n_steps: int) -> int:
    """Smoothing window: a tenth of the run (the paper smooths 1000 steps over 100)."""
    return max(1, n_steps // 10)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (window shrinks at the start), as the paper's 100-step smoothing."""
    if window <= 1 or len(values) == 0:
        return values
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (cumsum[idx] - cumsum[lo]) / (idx - lo)


def plot_training_curves(metrics_path: str | Path, out_dir: str | Path, title: str) -> list[Path]:
    """Write one PNG per panel plus `training_curves.png` (all four) of the RL stage, `title` (the objective) in
    every title; returns the paths written."""
    from trustclip.figures import color_for, figure_context, new_figure, save_figure, style_axes

    series = read_series(metrics_path)
    if not series:
        raise ValueError(f"{metrics_path}: no RL metrics to plot")
    window = default_window(max(len(s[0]) for s in series.values()))
    out_dir = Path(out_dir)
    written = []
    with figure_context():
        fig_all, axes = new_figure(2, 2, width=4.6, height=3.2)
        for ax_all, (stem, (panel_title, curves)) in zip(axes.flat, PANELS.items(), strict=True):
            fig, ax = new_figure(1, 1)
            for target in (ax[0, 0], ax_all):
                for metric, label in (curve for curve in curves if curve[0] in series):
                    steps, values = series[metric]
                    target.plot(steps, values, color=color_for(metric), alpha=0.25, linewidth=0.8)
                    target.plot(steps, smooth(values, window), color=color_for(metric), linewidth=1.8, label=label)
                style_axes(target, title=f"{panel_title} ({title})", xlabel="step")
            written.append(save_figure(fig, out_dir / f"{stem}.png"))
        fig_all.suptitle(f"{title}: moving average over {window} steps")
        written.append(save_figure(fig_all, out_dir / "training_curves.png"))
    return written
