"""Benchmark (not a test): tabular softmax checks of the ATR paper's section 5 (Wu et al., arXiv 2602.05494,
Thms 5.1, 5.2): a simulator of one exact policy-gradient step, its table and figure.

    python scripts/theory_check.py [--json] [--plot FILE.png] [--form ppo] [--step natural] [--delta 0.07]

Setting of the paper (section 5.1): softmax policy pi_theta(a|s) = exp(theta_{s,a}) / sum_b exp(theta_{s,b}),
full-batch policy gradient on the clipped surrogate (Appendix A.2, eq. 14/15)

    J(theta) = sum_s d(s) sum_a pi_old(a|s) clip(w(s,a), lo, hi) A(s,a),   w = pi_theta / pi_old,

one gradient-ascent step theta^{k+1} = theta^k + eta * grad J(theta^k) from the same theta^k under
symmetric ratio clipping [1-eps, 1+eps] and under ATR clipping [l_delta, u_delta] (KL3 <= delta), and
the two events of the paper:

    X-(s) = {a : w(s,a) in [1-eps, l_delta]},  with 1+eps = u_delta   (ATR clips, ratio clipping does not)
    X+(s) = {a : w(s,a) in [1+eps, u_delta]},  with 1-eps = l_delta   (ratio clipping clips, ATR does not)

What is checked, and against what:
* "exact" side: torch autograd through the surrogate above (the clip is `torch.clamp`), one step
  per method, then the exact entropies H(softmax(theta^{k+1})). Nothing of the theorems is reused.
* Theorem 5.1 (logit difference Delta theta = theta^ATR - theta^ratio), with v = A * 1[X](a):
      X-:  Delta theta_{s,a} = -eta d(s) pi_k(a|s) [v(a) - E_{a'~pi_k} v(a')]
      X+:  Delta theta_{s,a} = +eta d(s) pi_k(a|s) [v(a) - E_{a'~pi_k} v(a')]
  This is exact (not first order): the gradient of the surrogate is d(s) pi_k(a) [A M(a) - E_{pi_k} A M]
  with M the unclipped mask, pi_old cancels against the 1/pi_old in w, and the two masks differ
  exactly on X. The simulator confirms it to float round-off.
* Theorem 5.2 (entropy difference). The first-order expansion the proof uses (eq. 28) is
      Delta H = -Cov_{a~pi_k}(Delta theta_{s,a}, log pi_k(a|s)) + O(eta^2).
  Substituting Theorem 5.1 gives
      X-:  Delta H = +eta d(s) Cov_{pi_k}( pi_k(a) [v(a) - E v], log pi_k(a) ) + O(eta^2)
      X+:  Delta H = -eta d(s) Cov_{pi_k}( pi_k(a) [v(a) - E v], log pi_k(a) ) + O(eta^2)

DISCREPANCY with the paper. Theorem 5.2 as printed reads Delta H = +/- eta d(s) Cov_{pi_k}(A 1[X](a),
log pi_k(a)): the factor pi_k(a|s) of Theorem 5.1 is dropped between eq. 29 and eq. 30 of Appendix A.3.
For the vanilla policy-gradient step that Theorem 5.1 assumes, the printed formula is not the first-order
term: its error is O(eta), not O(eta^2), and its sign can disagree with the true entropy difference
(see `counterexample_problem`). The printed formula *is* the first-order term for the natural-gradient
step (per-state Fisher preconditioning, Delta theta = eta F_s^+ grad_s J, as in Cui et al. 2025's NPG
lemma), which the simulator offers as `step="natural"`. `predicted_entropy_difference(formula=...)`
provides both: "first_order" (correct for either step) and "paper" (as printed).

Second remark: eq. 14/15 have no min with the unclipped term. With the PPO min form that trainers use
(`form="ppo"`, J = E[min(w A, clip(w) A)]) a token outside the range keeps its gradient when (w-1) A <= 0,
so the theorems hold with v = A * 1[X](a) * 1[(w-1) A > 0]: only A < 0 tokens in X-, A > 0 in X+.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.special import log_softmax, softmax

from trustclip.commands import check_figure_path
from trustclip.figures import color_for, figure_context, new_figure, save_figure, style_axes
from trustclip.objectives.bounds import check_delta, kl3_bounds

EVENTS = ("X-", "X+")
FORMS = ("clip", "ppo")
STEPS = ("vanilla", "natural")
DEFAULT_ETAS = (0.01, 0.03, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class EventSetting:
    """The two clip ranges compared in one event of section 5.1, and the ratio interval of the event."""

    event: str
    delta: float
    atr: tuple[float, float]  # [l_delta, u_delta] from KL3 <= delta (Theorem 4.2)
    ratio: tuple[float, float]  # [1 - eps, 1 + eps]
    interval: tuple[float, float]  # ratios where exactly one of the two methods clips

    @property
    def epsilon(self) -> float:
        return 1.0 - self.ratio[0]

    @property
    def sign(self) -> float:
        """Sign of Theorem 5.1 (-1 for X-: ATR drops the gradient there; +1 for X+: ATR keeps it)."""
        return -1.0 if self.event == "X-" else 1.0


def event_setting(event: str, delta: float = 0.07) -> EventSetting:
    """X-: eps = u_delta - 1, X- = [1-eps, l_delta]; X+: eps = 1 - l_delta, X+ = [1+eps, u_delta]."""
    if event not in EVENTS:
        raise ValueError(f"event must be one of {EVENTS}, got {event!r}")
    low, high = kl3_bounds(check_delta(delta))
    if event == "X-":
        eps = high - 1.0
        return EventSetting(event, float(delta), (low, high), (1.0 - eps, high), (max(1.0 - eps, 0.0), low))
    eps = 1.0 - low
    return EventSetting(event, float(delta), (low, high), (low, 1.0 + eps), (1.0 + eps, high))


@dataclass(frozen=True)
class TabularProblem:
    """theta^k (S, n) logits, pi_old (S, n), A(s, a) (S, n) and the state weights d(s) (S,)."""

    logits: np.ndarray
    old_probs: np.ndarray
    advantages: np.ndarray
    state_dist: np.ndarray

    def __post_init__(self) -> None:
        shape = np.shape(self.logits)
        if len(shape) != 2 or shape[1] < 2:
            raise ValueError(f"logits must have shape (states, actions>=2), got {shape}")
        for name, want in (("old_probs", shape), ("advantages", shape), ("state_dist", shape[:1]), ("logits", shape)):
            if np.shape(getattr(self, name)) != want or not np.all(np.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be finite, of shape {want}, got {np.shape(getattr(self, name))}")
        if np.any(self.old_probs <= 0) or not np.allclose(self.old_probs.sum(-1), 1.0, atol=1e-9):
            raise ValueError("old_probs must be positive and sum to 1 over actions")
        if np.any(self.state_dist < 0) or not math.isclose(float(self.state_dist.sum()), 1.0, abs_tol=1e-9):
            raise ValueError("state_dist must be non-negative and sum to 1")

    @property
    def probs(self) -> np.ndarray:
        """pi_k(a|s) = softmax(theta^k)."""
        return softmax(self.logits, axis=-1)

    @property
    def ratios(self) -> np.ndarray:
        """w(s, a) = pi_k(a|s) / pi_old(a|s)."""
        return self.probs / self.old_probs


def random_problem(setting: EventSetting, rng: np.random.Generator, num_states: int = 4, num_actions: int = 6,
                   margin: float = 0.05) -> TabularProblem:
    """Random pi_old, A ~ N(0, 1), d ~ Dirichlet, and pi_k built from target ratios w(s, a).

    Per state, 1..n-2 actions get a ratio inside the event interval, the others inside both clip ranges
    or outside both; one "slack" action (largest pi_old) takes the remaining probability mass so that
    pi_k sums to 1. Ratios stay a relative `margin` away from every clip boundary (the surrogate is not
    differentiable there), so the events are exactly what the ratios say they are.
    """
    if num_states < 1 or num_actions < 3:
        raise ValueError(f"need num_states >= 1 and num_actions >= 3, got {num_states}, {num_actions}")
    if not 0 < margin < 0.5:
        raise ValueError(f"margin must be in (0, 0.5), got {margin}")
    states = [_random_state(setting, rng, num_actions, margin) for _ in range(num_states)]
    old, new = map(np.stack, zip(*states, strict=True))
    adv = rng.standard_normal((num_states, num_actions))
    return TabularProblem(np.log(new), old, adv, rng.dirichlet(np.full(num_states, 4.0)))


def _regions(setting: EventSetting, margin: float) -> dict[str, tuple[float, float]]:
    """Ratio intervals (shrunk by `margin`) where: only one method clips, neither clips, both clip."""
    lo_out, lo_in, hi_in, hi_out = sorted((*setting.atr, *setting.ratio))  # the two ranges overlap
    regions = {"event": setting.interval, "inside": (lo_in, hi_in), "above": (hi_out, 1.6 * hi_out)}
    if lo_out > 0.05:
        regions["below"] = (0.3 * lo_out, lo_out)
    return {k: (a + margin * (b - a), b - margin * (b - a)) for k, (a, b) in regions.items()}


def _random_state(setting: EventSetting, rng: np.random.Generator, n: int, margin: float):
    regions = _regions(setting, margin)
    others = [k for k in regions if k != "event"]
    boundaries = np.array([*setting.atr, *setting.ratio])
    for _ in range(1000):
        old = 0.5 * rng.dirichlet(np.ones(n)) + 0.5 / n
        slack = int(np.argmax(old))
        num_event = int(rng.integers(1, n - 1))
        kinds = ["event"] * num_event + list(rng.choice(others, size=n - 1 - num_event))
        targets = np.array([rng.uniform(*regions[k]) for k in kinds])
        rest = np.delete(np.arange(n), slack)
        new = np.empty(n)
        new[rest] = targets * old[rest]
        new[slack] = 1.0 - new[rest].sum()
        w_slack = new[slack] / old[slack]
        if w_slack > 0.05 and np.min(np.abs(w_slack / boundaries - 1.0)) > 1e-2:
            return old, new
    raise RuntimeError("could not build a state with these clip ranges; is delta too large?")


def counterexample_problem(delta: float = 0.07) -> tuple[TabularProblem, EventSetting]:
    """One state where Theorem 5.2 as printed predicts the wrong sign for the vanilla PG step.

    pi_k = (0.45, 0.35, 0.10, 0.10); action 1 is the only X- action, with A = +1. Its log-probability is
    above the mean (log 0.35 > E log pi_k), so the printed Cov(A 1[X-], log pi_k) > 0 says ATR keeps the
    higher entropy; the pi_k-weighted covariance 0.35 * [0.35 (l_1 - E l) - sum_a pi_a^2 (l_a - E l)] < 0,
    and the exact update agrees with the weighted one: ATR's entropy is lower.
    """
    setting = event_setting("X-", delta)
    new = np.array([0.45, 0.35, 0.10, 0.10])
    w_event = 0.5 * (setting.interval[0] + setting.interval[1])
    old = np.empty(4)
    old[1] = new[1] / w_event
    rest = [0, 2, 3]
    old[rest] = new[rest] * (1.0 - old[1]) / new[rest].sum()  # one common ratio > u: both methods clip
    adv = np.array([0.5, 1.0, -0.7, 0.2])
    return TabularProblem(np.log(new)[None], old[None], adv[None], np.ones(1)), setting


def surrogate(logits: torch.Tensor, problem: TabularProblem, clip_range: tuple[float, float],
              form: str = "clip") -> torch.Tensor:
    """J(theta) = sum_s d(s) sum_a pi_old(a|s) f(w) with f = clip(w, lo, hi) A (eq. 14/15, `form="clip"`)
    or f = min(w A, clip(w, lo, hi) A) (PPO/GRPO min form, `form="ppo"`)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    old, adv, dist = (torch.as_tensor(x, dtype=logits.dtype)
                      for x in (problem.old_probs, problem.advantages, problem.state_dist))
    w = torch.softmax(logits, dim=-1) / old
    clipped = torch.clamp(w, clip_range[0], clip_range[1]) * adv
    per_token = clipped if form == "clip" else torch.minimum(w * adv, clipped)
    return (dist * (old * per_token).sum(-1)).sum()


def surrogate_gradient(problem: TabularProblem, clip_range: tuple[float, float], form: str = "clip",
                       step: str = "vanilla") -> np.ndarray:
    """Update direction at theta^k: grad J (vanilla PG, eq. 18) or F_s^+ grad_s J per state (natural PG,
    F_s = diag(pi_k) - pi_k pi_k^T is the Fisher matrix of the softmax in the logits)."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    theta = torch.tensor(problem.logits, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(surrogate(theta, problem, clip_range, form), theta)
    if step == "vanilla":
        return grad.numpy()
    fishers = [np.diag(p) - np.outer(p, p) for p in problem.probs]
    return np.stack([np.linalg.pinv(f) @ g for f, g in zip(fishers, grad.numpy(), strict=True)])


def entropy(logits: np.ndarray) -> np.ndarray:
    """H(theta | s) = -sum_a pi(a|s) log pi(a|s), per state."""
    log_p = log_softmax(logits, axis=-1)
    return -(np.exp(log_p) * log_p).sum(-1)


def exact_differences(problem: TabularProblem, setting: EventSetting, etas, form: str = "clip",
                      step: str = "vanilla") -> tuple[np.ndarray, np.ndarray]:
    """theta^ATR - theta^ratio (len(etas), S, n) and H(theta^ATR) - H(theta^ratio) (len(etas), S)
    after one step from theta^k with each clip range."""
    etas = np.asarray(etas, dtype=np.float64).reshape(-1, 1, 1)
    theta_atr, theta_ratio = (problem.logits + etas * surrogate_gradient(problem, clip_range, form, step)
                              for clip_range in (setting.atr, setting.ratio))
    return theta_atr - theta_ratio, entropy(theta_atr) - entropy(theta_ratio)


def event_advantage(problem: TabularProblem, setting: EventSetting, form: str = "clip") -> np.ndarray:
    """v(s, a) = A(s, a) 1[X](a) for eq. 14/15; with the PPO min form only tokens that moved the way that
    raises the surrogate lose their gradient: v = A 1[X](a) 1[(w - 1) A > 0]."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    w, adv = problem.ratios, problem.advantages
    in_event = (w >= setting.interval[0]) & (w <= setting.interval[1])
    if form == "ppo":
        in_event &= (w - 1.0) * adv > 0
    return adv * in_event


def _expect(p: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (p * x).sum(-1, keepdims=True)


def _cov(p: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cov_{a ~ p}(x(a), y(a)) per state."""
    return (p * (x - _expect(p, x)) * (y - _expect(p, y))).sum(-1)


def predicted_logit_difference(problem: TabularProblem, setting: EventSetting, eta: float, form: str = "clip",
                               step: str = "vanilla") -> np.ndarray:
    """Theorem 5.1: Delta theta_{s,a} = sign * eta d(s) pi_k(a|s) [v(a) - E_{pi_k} v] (sign -1 for X-, +1
    for X+). For the natural step the pi_k(a|s) factor is absent (defined up to a per-state constant)."""
    p, v = problem.probs, event_advantage(problem, setting, form)
    centred = v - _expect(p, v)
    weight = p if step == "vanilla" else 1.0
    return setting.sign * eta * problem.state_dist[:, None] * weight * centred


def predicted_entropy_difference(problem: TabularProblem, setting: EventSetting, eta: float, form: str = "clip",
                                 step: str = "vanilla", formula: str = "first_order") -> np.ndarray:
    """Theorem 5.2, per state. "first_order": -Cov_{pi_k}(Delta theta, log pi_k) with Delta theta from
    Theorem 5.1 (eq. 28 + 29). "paper": as printed, +/- eta d(s) Cov_{pi_k}(v, log pi_k) for X- / X+ (first
    order only for the natural step; see the module docstring)."""
    p = problem.probs
    log_p = np.log(p)
    if formula == "first_order":
        return -_cov(p, predicted_logit_difference(problem, setting, eta, form, step), log_p)
    if formula == "paper":
        v = event_advantage(problem, setting, form)
        return -setting.sign * eta * problem.state_dist * _cov(p, v, log_p)
    raise ValueError(f"formula must be 'first_order' or 'paper', got {formula!r}")


@dataclass(frozen=True)
class TheoryRow:
    """One (event, eta) row; aggregates over every (seed, state) pair.

    logit_error: max |Delta theta exact - Theorem 5.1| (per-state constants removed).
    entropy_rms: root mean square of the exact Delta H.
    first_order_error / paper_error: max |Delta H exact - prediction|.
    first_order_rel / paper_rel: ||Delta H exact - prediction||_2 / ||Delta H exact||_2.
    first_order_sign / paper_sign: fraction of states where sign(prediction) == sign(exact Delta H).
    """

    event: str
    eta: float
    logit_error: float
    entropy_rms: float
    first_order_error: float
    first_order_rel: float
    paper_error: float
    paper_rel: float
    first_order_sign: float
    paper_sign: float


def _check_etas(etas) -> np.ndarray:
    etas = np.asarray(etas, dtype=np.float64).reshape(-1)
    if etas.size == 0 or not np.all(np.isfinite(etas)) or np.any(etas <= 0):
        raise ValueError(f"etas must be a non-empty sequence of positive numbers, got {etas.tolist()}")
    return etas


def _collect(setting, etas, seeds, num_states, num_actions, form, step):
    """Exact and predicted differences for every seed, stacked as (len(etas), seeds * states[, n])."""
    out = {"dtheta": [], "dtheta_pred": [], "dh": [], "first_order": [], "paper": []}
    for seed in range(seeds):
        rng = np.random.default_rng([seed, EVENTS.index(setting.event)])
        problem = random_problem(setting, rng, num_states, num_actions)
        dtheta, dh = exact_differences(problem, setting, etas, form, step)
        out["dtheta"].append(dtheta)
        out["dh"].append(dh)
        out["dtheta_pred"].append(np.stack([predicted_logit_difference(problem, setting, e, form, step) for e in etas]))
        for f in ("first_order", "paper"):
            out[f].append(np.stack([predicted_entropy_difference(problem, setting, e, form, step, f) for e in etas]))
    return {k: np.concatenate(v, axis=1) for k, v in out.items()}


def theorem_table(delta: float = 0.07, etas=DEFAULT_ETAS, seeds: int = 8, num_states: int = 4, num_actions: int = 6,
                  form: str = "clip", step: str = "vanilla") -> list[TheoryRow]:
    """Exact one-step update vs Theorems 5.1/5.2 for both events, `seeds` random problems each."""
    etas = _check_etas(etas)
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")

    def centre(x: np.ndarray) -> np.ndarray:  # a logit difference is defined up to a per-state constant
        return x - x.mean(-1, keepdims=True)

    def agreement(exact: np.ndarray, pred: np.ndarray) -> float:
        informative = np.abs(pred) > 1e-13
        return float(np.mean(np.sign(exact[informative]) == np.sign(pred[informative])))

    rows = []
    for event in EVENTS:
        data = _collect(event_setting(event, delta), etas, seeds, num_states, num_actions, form, step)
        for i, eta in enumerate(etas):
            dh, stats = data["dh"][i], {}
            for f in ("first_order", "paper"):
                err = dh - data[f][i]
                stats |= {f"{f}_error": float(np.abs(err).max()), f"{f}_sign": agreement(dh, data[f][i]),
                          f"{f}_rel": float(np.linalg.norm(err) / np.linalg.norm(dh))}
            logit_error = np.abs(centre(data["dtheta"][i]) - centre(data["dtheta_pred"][i])).max()
            rows.append(TheoryRow(event=event, eta=float(eta), logit_error=float(logit_error),
                                  entropy_rms=float(np.sqrt(np.mean(dh**2))), **stats))
    return rows


def entropy_samples(delta: float = 0.07, eta: float = 0.01, seeds: int = 8, num_states: int = 4, num_actions: int = 6,
                    form: str = "clip", step: str = "vanilla") -> dict[str, dict[str, np.ndarray]]:
    """Delta H per (seed, state) at one eta: {event: {"exact", "first_order", "paper"}} (scatter plots)."""
    _check_etas([eta])
    data = {event: _collect(event_setting(event, delta), [eta], seeds, num_states, num_actions, form, step)
            for event in EVENTS}
    return {event: {"exact": d["dh"][0], "first_order": d["first_order"][0], "paper": d["paper"][0]}
            for event, d in data.items()}


def fit_slope(etas, errors) -> float:
    """Least-squares slope of log(error) against log(eta): 2 for an O(eta^2) error, 1 for O(eta)."""
    x, y = np.log(np.asarray(etas, dtype=np.float64)), np.log(np.asarray(errors, dtype=np.float64))
    if x.size < 2 or not np.all(np.isfinite(y)):
        raise ValueError("fit_slope needs >= 2 points with positive errors")
    return float(np.polyfit(x, y, 1)[0])


def fit_slopes(rows: list[TheoryRow]) -> dict[str, dict[str, float]]:
    """{event: {"first_order": slope, "paper": slope}} of the max entropy error against eta."""
    by_event = {event: [r for r in rows if r.event == event] for event in EVENTS}
    return {event: {f: fit_slope([r.eta for r in mine], [getattr(r, f"{f}_error") for r in mine])
                    for f in ("first_order", "paper")} for event, mine in by_event.items()}


def format_table(rows: list[TheoryRow]) -> str:
    """Fixed-width text table of `theorem_table` rows."""
    header = (f"{'event':<5} {'eta':>6}  {'Thm5.1 err':>10}  {'rms dH':>9}  "
              f"{'1st-order err':>13} {'rel':>8} {'sign':>5}  {'printed err':>11} {'rel':>8} {'sign':>5}")
    return "\n".join([header, "-" * len(header)] + [
        f"{r.event:<5} {r.eta:>6.3g}  {r.logit_error:>10.1e}  {r.entropy_rms:>9.2e}  "
        f"{r.first_order_error:>13.2e} {r.first_order_rel:>8.1e} {r.first_order_sign:>5.0%}  "
        f"{r.paper_error:>11.2e} {r.paper_rel:>8.1e} {r.paper_sign:>5.0%}" for r in rows])


# ------------------------------------------------------------------------------------------------ figure
def _draw_error_vs_eta(ax, rows: Sequence[Any]) -> None:
    """Max |Delta H exact - prediction| against eta (log-log) per event, with eta and eta^2 guides."""
    for event in EVENTS:
        mine = [r for r in rows if r.event == event]
        etas = np.array([r.eta for r in mine])
        color = color_for(event)
        ax.plot(etas, [r.first_order_error for r in mine], "o-", color=color, label=f"{event}: first order")
        ax.plot(etas, [r.paper_error for r in mine], "s--", color=color, mfc="none",
                label=f"{event}: Thm 5.2 as printed")
    etas = np.array(sorted({r.eta for r in rows}))
    # Guides offset from the data so they stay visible.
    anchor = 0.2 * min(r.first_order_error for r in rows if r.eta == etas[0])
    ax.plot(etas, anchor * (etas / etas[0]) ** 2, color="black", lw=1, ls=":", label="slope 2 ($\\eta^2$)")
    anchor = 3.0 * max(r.paper_error for r in rows if r.eta == etas[0])
    ax.plot(etas, anchor * (etas / etas[0]), color="black", lw=1, ls="-.", label="slope 1 ($\\eta$)")
    ax.set(xscale="log", yscale="log")
    style_axes(ax, title="Entropy difference: error of the prediction", xlabel="learning rate $\\eta$",
               ylabel="max |$\\Delta H$ exact - predicted|")


def _draw_sign_scatter(ax, samples: dict[str, dict[str, np.ndarray]], eta: float | None) -> None:
    """Predicted vs exact Delta H per state; points off quadrants I/III have the wrong sign."""
    preds = np.concatenate([np.concatenate([s["first_order"], s["paper"]]) for s in samples.values()])
    exact = np.concatenate([s["exact"] for s in samples.values()])
    xlim, ylim = 1.1 * np.abs(preds).max(), 1.1 * np.abs(exact).max()
    ax.fill_between([-xlim, 0], 0, ylim, color="red", alpha=0.07, lw=0)
    ax.fill_between([0, xlim], -ylim, 0, color="red", alpha=0.07, lw=0, label="wrong sign")
    ax.plot([-ylim, ylim], [-ylim, ylim], color="0.4", lw=0.8, label="exact = predicted")
    agreement = []
    for event, s in samples.items():
        color = color_for(event)
        ax.scatter(s["first_order"], s["exact"], s=14, color=color, label=f"{event}: first order")
        ax.scatter(s["paper"], s["exact"], s=18, facecolors="none", edgecolors=color, lw=0.9,
                   label=f"{event}: as printed")
        rates = [np.mean(np.sign(s[k]) == np.sign(s["exact"])) for k in ("first_order", "paper")]
        agreement.append(f"{event}: first order {rates[0]:.0%}, printed {rates[1]:.0%}")
    ax.text(0.98, 0.03, "same sign as exact\n" + "\n".join(agreement), transform=ax.transAxes,
            ha="right", va="bottom", fontsize=8)
    ax.set(xlim=(-xlim, xlim), ylim=(-ylim, ylim))
    ax.ticklabel_format(style="sci", scilimits=(-2, 2))
    title = "Sign of $\\Delta H$ = H(ATR) - H(clip) per state" + (f" ($\\eta$ = {eta:g})" if eta else "")
    style_axes(ax, title=title, xlabel="predicted $\\Delta H$", ylabel="exact $\\Delta H$")
    ax.legend(loc="upper left")


def plot_theory_check(path: str | Path, rows: Sequence[Any], samples: dict[str, dict[str, np.ndarray]] | None = None,
                      eta: float | None = None) -> Path:
    """Figure of `theorem_table` rows (error vs eta, log-log) and, with `samples` from
    `entropy_samples`, a predicted-vs-exact scatter of Delta H showing the sign per event."""
    if not rows:
        raise ValueError("rows is empty; run theorem_table first")
    with figure_context():
        fig, axes = new_figure(1, 2 if samples else 1, width=5.4, height=4.2)
        _draw_error_vs_eta(axes[0, 0], rows)
        if samples:
            _draw_sign_scatter(axes[0, 1], samples, eta)
        fig.suptitle("ATR vs ratio clipping: one exact PG step on a tabular softmax policy "
                     "(arXiv 2602.05494, Thm 5.2)")
        return save_figure(fig, path)


# --------------------------------------------------------------------------------------------- command line
NOTES = """\
Thm5.1 err: exact logit difference vs Theorem 5.1 (exact up to round-off: a PG step is linear in eta).
1st-order:  -Cov_pi_k(Delta theta, log pi_k)
              = +/- eta d(s) Cov_pi_k(pi_k(a) [A 1[X](a) - E A 1[X]], log pi_k(a))   (X-: +, X+: -);
            its error must shrink like eta^2.
printed:    Theorem 5.2 as printed, +/- eta d(s) Cov_pi_k(A 1[X](a), log pi_k(a)), without the pi_k(a)
            weight of Theorem 5.1: its error shrinks only like eta for the vanilla step (it is the
            first-order term of the natural-gradient step: --step natural).
sign:       fraction of states where the prediction has the sign of the exact Delta H = H(ATR) - H(clip)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="theory_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--delta", type=float, default=0.07, help="KL3 threshold (default 0.07)")
    parser.add_argument("--seeds", type=int, default=8, help="random problems per event (default 8)")
    parser.add_argument("--states", type=int, default=4, help="states per problem (default 4)")
    parser.add_argument("--actions", type=int, default=6, help="actions per state (default 6, >= 3)")
    parser.add_argument("--etas", type=float, nargs="+", default=list(DEFAULT_ETAS),
                        help="learning rates (default %(default)s)")
    parser.add_argument("--form", choices=FORMS, default="clip",
                        help="surrogate: 'clip' = paper eq. 14/15 (default), 'ppo' = min(w A, clip(w) A)")
    parser.add_argument("--step", choices=STEPS, default="vanilla",
                        help="update: 'vanilla' policy gradient (the theorems' setting) or 'natural'")
    parser.add_argument("--plot", metavar="FILE.png", help="also write error-vs-eta and sign figure")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return _run(parser.parse_args(argv))


def _setting_text(s: EventSetting) -> str:
    who = "ATR clips, ratio clipping does not" if s.event == "X-" else "ratio clipping clips, ATR does not"
    return (f"  {s.event}: ATR [{s.atr[0]:.4f}, {s.atr[1]:.4f}] vs clip eps={s.epsilon:.4f} "
            f"[{s.ratio[0]:.4f}, {s.ratio[1]:.4f}]; "
            f"{s.event} = w in [{s.interval[0]:.4f}, {s.interval[1]:.4f}] ({who})")


def _run(args: argparse.Namespace) -> int:
    kwargs = dict(delta=args.delta, seeds=args.seeds, num_states=args.states, num_actions=args.actions,
                  form=args.form, step=args.step)
    try:
        if args.plot:
            check_figure_path(args.plot)
        settings = {event: event_setting(event, args.delta) for event in EVENTS}
        with warnings.catch_warnings(record=True) as caught:  # shown below only if the table can be built
            warnings.simplefilter("always")
            rows = theorem_table(etas=args.etas, **kwargs)
            slopes = fit_slopes(rows) if len(args.etas) > 1 else {}
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except ValueError as err:
        print(f"theory_check: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # no random state has actions in the event's ratio region at this delta
        low, high = settings["X-"].atr
        print(f"theory_check: error: --delta {args.delta:g}: {err} (ATR region [{low:.3g}, {high:.3g}]: the "
              "events X- / X+ need ratios the softmax states cannot reach; use a trust-region delta such as 0.07)",
              file=sys.stderr)
        return 2
    if args.plot:
        eta = min(args.etas)
        plot_theory_check(args.plot, rows, entropy_samples(eta=eta, **kwargs), eta=eta)
    if args.json:
        print(json.dumps({"config": kwargs, "settings": {e: asdict(s) for e, s in settings.items()},
                          "rows": [asdict(r) for r in rows], "slopes": slopes, "plot": args.plot}, indent=2))
        return 0
    print(f"Theorems 5.1/5.2 of arXiv 2602.05494: one exact PG step (autograd, surrogate '{args.form}', "
          f"{args.step} step)\non {args.seeds} seeds x {args.states} states x {args.actions} actions "
          f"per event; delta = {args.delta:g}")
    print(*map(_setting_text, settings.values()), "", format_table(rows), "", sep="\n")
    if slopes:
        parts = [f"{e}: first-order {s['first_order']:.2f}, printed {s['paper']:.2f}" for e, s in slopes.items()]
        print("fitted slope of log(max |dH error|) vs log(eta) -- " + " | ".join(parts))
    print(NOTES)
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
