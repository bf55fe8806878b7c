"""Figures: the files are real PNGs and what is drawn equals the bounds functions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import theory_check as theory

from trustclip import figures
from trustclip.objectives.bounds import (
    dcpo_bounds,
    is_kl3_bounds,
    kl1_bounds,
    kl2_bounds,
    kl3_bounds,
    trgppo_bounds,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DELTA, EPSILON = 0.07, 0.2


def expected_bounds(delta: float, two_sided: bool = False) -> dict[str, tuple[float, float]]:
    return {"kl1": kl1_bounds(delta, two_sided), "kl2": kl2_bounds(delta), "kl3": kl3_bounds(delta),
            "is_kl3": is_kl3_bounds(delta)}


def by_gid(ax, gid: str):
    found = [a for a in ax.get_children() if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist with gid {gid!r}, found {len(found)}"
    return found[0]


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000


@pytest.fixture
def axes():
    with figures.figure_context() as plt:
        fig, ax = figures.new_figure(1, 1)
        yield ax[0, 0]
        plt.close(fig)


def test_plot_divergence_regions_writes_png_and_returns_the_bounds(tmp_path):
    path = tmp_path / "sub" / "regions.png"
    regions = figures.plot_divergence_regions(path, delta=0.1, epsilon=EPSILON)
    assert_png(path)
    assert regions == {"clip": (1 - EPSILON, 1 + EPSILON), **expected_bounds(0.1)}


@pytest.mark.parametrize("delta", [0.02, 0.07, 0.2, 1.5])
def test_divergence_regions_equal_the_bounds(delta):
    assert figures.divergence_regions(delta) == expected_bounds(delta)
    assert figures.divergence_regions(delta, kl1_two_sided=True)["kl1"] == pytest.approx(
        (math.exp(-delta), math.exp(delta)))


@pytest.mark.parametrize("name", list(figures.DIVERGENCES))
def test_drawn_curve_interval_endpoints_equal_the_bounds(axes, name):
    low, high = expected_bounds(DELTA)[name]
    w_range = (0.5, 1.7)
    figures.draw_divergence_curve(axes, name, DELTA, EPSILON, (low, high), w_range)
    xs = by_gid(axes, f"{name}-endpoints").get_xdata()
    assert list(xs) == [x for x in (low, high) if math.isfinite(x)]
    region = by_gid(axes, f"{name}-region")
    assert region.get_x() == pytest.approx(low, abs=1e-15)
    assert region.get_x() + region.get_width() == pytest.approx(min(high, w_range[1]), abs=1e-12)
    clip_x = sorted(seg[0, 0] for seg in by_gid(axes, "clip-range").get_segments())
    assert clip_x == pytest.approx([1 - EPSILON, 1 + EPSILON])


def test_drawn_intervals_equal_the_bounds(axes):
    regions = expected_bounds(DELTA, two_sided=True)
    figures.draw_intervals(axes, regions, EPSILON, (0.5, 1.7))
    for name, (low, high) in [("clip", (1 - EPSILON, 1 + EPSILON)), *regions.items()]:
        (segment,) = by_gid(axes, f"{name}-interval").get_segments()
        assert segment[:, 0] == pytest.approx([low, high], abs=1e-15)


def test_drawn_q_bounds_equal_dcpo_and_trgppo(axes):
    figures.draw_q_bounds(axes, DELTA, EPSILON, (1e-3, 1.0), (0.2, 0.28))
    q = by_gid(axes, "dcpo-low").get_xdata()
    assert q.min() == pytest.approx(1e-3) and q.max() < 1
    dcpo = dcpo_bounds(q, 0.2, 0.28)
    trg = trgppo_bounds(q, DELTA, EPSILON)
    for gid, expected in [("dcpo-low", dcpo[0]), ("dcpo-high", dcpo[1]), ("trgppo-low", trg[0]),
                          ("trgppo-high", trg[1])]:
        line = by_gid(axes, gid)
        np.testing.assert_array_equal(line.get_xdata(), q)
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [{"delta": 0.0}, {"delta": float("nan")}, {"epsilon": 1.0}, {"epsilon": -0.1}, {"q_range": (0.0, 1.0)},
     {"q_range": (0.5, 0.1)}],
)
def test_plot_divergence_regions_rejects_bad_input(tmp_path, kwargs):
    with pytest.raises(ValueError):
        figures.plot_divergence_regions(tmp_path / "r.png", **kwargs)
    assert not (tmp_path / "r.png").exists()


def test_save_figure_needs_a_suffix(tmp_path):
    with figures.figure_context():
        fig, _ = figures.new_figure()
        with pytest.raises(ValueError):
            figures.save_figure(fig, tmp_path / "noext")


def test_plot_theory_check(tmp_path):
    rows = theory.theorem_table(etas=[0.01, 0.1, 1.0], seeds=2, num_states=2, num_actions=4)
    samples = theory.entropy_samples(eta=0.01, seeds=2, num_states=2, num_actions=4)
    assert_png(theory.plot_theory_check(tmp_path / "t.png", rows, samples, eta=0.01))
    assert_png(theory.plot_theory_check(tmp_path / "t1.png", rows))
    with pytest.raises(ValueError):
        theory.plot_theory_check(tmp_path / "t2.png", [])


def test_style_helpers_are_stable_and_local():
    import matplotlib

    before = matplotlib.rcParams["font.size"]
    with figures.figure_context():
        assert matplotlib.rcParams["font.size"] == figures.STYLE["font.size"]
    assert matplotlib.rcParams["font.size"] == before
    assert figures.color_for("kl3") == figures.COLORS["kl3"]
    assert figures.color_for("my-new-objective") == figures.color_for("my-new-objective")


def test_cli_theory_plot(tmp_path):
    path = tmp_path / "theory.png"
    assert theory.main(["--seeds", "2", "--plot", str(path)]) == 0
    assert_png(path)
