"""Straightforward float64 reference implementations of every objective, written independently of
the library from the papers' formulas (reference notes: ../shared/reference/objectives.md).

Each reference returns, per token, the surrogate value J and the effective gradient weight phi such
that dJ/dlogp = phi * A (plus, where noted, a penalty term returned as `extra_grad`). Inputs are
numpy float64 arrays (B, T) with moderate log-ratios (|x| < 20, so no clamping is involved).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import brentq

SIG = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731


def ratio_clip(w, a, low, high):
    """PPO with bounds [low, high] (scalars or arrays)."""
    value = np.minimum(w * a, np.clip(w, low, high) * a)
    frozen = ((a > 0) & (w > high)) | ((a < 0) & (w < low))
    return value, np.where(frozen, 0.0, w)


def constraint_clip(w, a, feasible, low, high):
    """clip_general with a boolean constraint; value in PPO form with the equivalent [low, high]."""
    value = np.minimum(w * a, np.clip(w, low, high) * a) if low is not None else np.minimum(
        w * a, np.where(feasible, w, 1.0) * a)
    keep = feasible | ((w - 1) * a <= 0)
    return value, np.where(keep, w, 0.0)


def sublevel_interval(divergence, delta):
    """Independent root-finding of {w: D(w) <= delta} for the tests (brentq, not the library's)."""
    f = lambda w: divergence(w) - delta  # noqa: E731
    low = brentq(f, 1e-14, 1.0, xtol=1e-16) if f(1e-14) > 0 else 0.0
    high = brentq(f, 1.0, 1e8, xtol=1e-14) if f(1e8) > 0 else np.inf
    return low, high


DIVERGENCES = {
    "kl1": lambda w: -np.log(w),
    "kl2": lambda w: 0.5 * np.log(w) ** 2,
    "kl3": lambda w: w - 1 - np.log(w),
    "is_kl3": lambda w: w * np.log(w) - w + 1,
}


def kl_family(kind, w, a, delta, two_sided=False):
    d = (lambda v: np.abs(np.log(v))) if two_sided else DIVERGENCES[kind]
    low, high = sublevel_interval(d, delta)
    return constraint_clip(w, a, d(w) <= delta, low, high)


def sequence_ratio(x, mask):
    """GSPO's s_i = exp((1/L_i) sum_t x_it), (B, 1); the exponent capped at 10 as verl's GSPO-token form does."""
    lengths = np.maximum(mask.sum(-1, keepdims=True), 1)
    return np.exp(np.minimum((x * mask).sum(-1, keepdims=True) / lengths, 10.0))


def binary_kl(q, r):
    return q * np.log(1 / r) + (1 - q) * np.log((1 - q) / (1 - r * q))


def trgppo_interval(q, delta, eps):
    low = np.empty_like(q)
    high = np.empty_like(q)
    for i, qi in np.ndenumerate(q):
        qi = min(max(qi, 1e-12), 1 - 1e-12)
        f = lambda r: binary_kl(qi, r) - delta  # noqa: E731, B023
        low[i] = brentq(f, 1e-300, 1.0, xtol=1e-300, rtol=1e-15)
        high[i] = brentq(f, 1.0, (1 / qi) * (1 - 1e-15), rtol=1e-15)
    if eps is not None:
        low, high = np.minimum(low, 1 - eps), np.maximum(high, 1 + eps)
    return low, high


def binary_divergence(kind, q, p):
    """DPPO's Binary approximation (arXiv 2602.04879): the old and new two-point distributions (q, 1 - q), (p, 1 - p)
    of the sampled token; 'tv' |p - q|, 'kl' KL(old || new), written out directly (numpy, float64)."""
    if kind == "tv":
        return np.abs(p - q)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(q < 1, (1 - q) * np.log((1 - q) / (1 - p)), 0.0)
    return q * np.log(q / p) + rest


def dppo(kind, w, a, q, p, hp):
    """clip_general with C = D(q, p) <= delta (delta_low where p < q, delta_high where p > q), value in the general
    form min(w A, (w if C else 1) A); with tis_cap c the kept tokens' weight is min(w, c)."""
    d = binary_divergence(kind, q, p)
    feasible = np.where(p > q, d <= hp["delta_high"], d <= hp["delta_low"])
    value, phi = constraint_clip(w, a, feasible, None, None)
    if hp["tis_cap"] is not None:
        phi = np.minimum(phi, hp["tis_cap"])
    return value, phi


def second_moment_masked(x, mask, threshold):
    """M2PO's mask, by a plain loop: drop the largest (log w)^2 one at a time until the mean of the rest is below
    threshold (all but the smallest when it never is)."""
    flat = np.flatnonzero(mask > 0)
    m2 = x.ravel()[flat] ** 2
    order = np.argsort(-m2, kind="stable")
    count = len(order) - 1
    for k in range(len(order)):
        if m2[order[k:]].mean() < threshold:
            count = k
            break
    masked = np.zeros(x.size, bool)
    masked[flat[order[:count]]] = True
    return masked.reshape(x.shape)


def reference(name, hp, logp, old_logp, adv, mask, entropy=None, full_kl=None):
    """Return (J, phi, extra_grad) for objective `name` with hyper-parameters `hp`."""
    x = logp - old_logp
    w = np.exp(x)
    a = adv
    q = np.exp(old_logp)
    extra = np.zeros_like(w)
    if name == "unconstrained":  # PPO paper Table 1, "no clipping or penalty": J = w A
        value, phi = w * a, w
    elif name == "clip":
        value, phi = ratio_clip(w, a, 1 - hp["epsilon"], 1 + hp["epsilon"])
    elif name in ("clip_higher", "dual_clip"):
        value, phi = ratio_clip(w, a, 1 - hp["epsilon_low"], 1 + hp["epsilon_high"])
        if name == "dual_clip":
            c = hp["clip_ratio_c"]
            value = np.where(a < 0, np.maximum(value, c * a), value)
            phi = np.where((a < 0) & (w > c), 0.0, phi)
    elif name == "dcpo":
        low = 0.5 + 0.5 * np.sqrt(np.maximum(1 - 4 * hp["epsilon_low"] / q, 0))
        high = np.minimum(0.5 + 0.5 * np.sqrt(1 + 4 * hp["epsilon_high"] / q), hp["max_high"])
        value, phi = ratio_clip(w, a, low, high)
    elif name == "trgppo":
        low, high = trgppo_interval(q, hp["delta"], hp["epsilon"])
        value, phi = ratio_clip(w, a, low, high)
    elif name in DIVERGENCES:
        value, phi = kl_family(name, w, a, hp["delta"], hp.get("two_sided", False))
    elif name == "truly_ppo":
        trig = (full_kl >= hp["delta"]) & ((w - 1) * a > 0)
        if hp["mode"] == "rollback":
            value, phi = w * a - hp["rollback"] * full_kl * trig, w
        else:
            value, phi = np.where(trig, a, w * a), np.where(trig, 0.0, w)
    elif name == "sapo":
        tau = np.where(a > 0, hp["tau_pos"], hp["tau_neg"])
        s = SIG(tau * (w - 1))
        value, phi = s * 4 / tau * a, 4 * s * (1 - s) * w
    elif name == "cispo":
        low = 0.0 if hp["epsilon_low"] is None else 1 - hp["epsilon_low"]
        weight = np.clip(w, low, 1 + hp["epsilon_high"])
        value, phi = weight * a * logp, weight
    elif name == "aspo":
        c, up, lo = hp["clip_ratio_c"], 1 + hp["epsilon_high"], 1 - hp["epsilon_low"]
        phi_pos = np.where(w > up, 0.0, np.where(w < 1 / c, c, 1 / w))
        val_pos = a / np.clip(w, 1 / c, up)
        phi_neg = np.where(w < lo, 0.0, np.where(w > c, c, w))
        val_neg = a * np.clip(w, lo, c)
        value, phi = np.where(a > 0, val_pos, val_neg), np.where(a > 0, phi_pos, phi_neg)
    elif name in ("gspo", "atr_seq"):  # sequence ratio s_i on every token; d s_it / d logp_t = s_i (GSPO-token)
        seq = sequence_ratio(x, mask) * np.ones_like(w)
        if name == "gspo":
            low, high = 1 - hp["epsilon_low"], 1 + hp["epsilon_high"]
        else:  # the KL3 region of the sequence ratio, root-found independently of the library's Lambert-W
            low, high = sublevel_interval(DIVERGENCES["kl3"], hp["delta"])
        value, phi = ratio_clip(seq, a, low, high)
    elif name == "atr_adaptive":  # at its current delta: ATR-GRPO
        value, phi = kl_family("kl3", w, a, hp["delta"])
    elif name == "kl_cov":
        valid = mask > 0
        cov = (a - a[valid].mean()) * (logp - logp[valid].mean())
        k = max(int(hp["kl_cov_ratio"] * valid.sum()), 1)
        flat = np.flatnonzero(valid)
        top = flat[np.argsort(-cov.ravel()[flat], kind="stable")[:k]]
        top = top[cov.ravel()[top] > 0]  # only positive covariance is penalised
        selected = np.zeros(w.size, bool)
        selected[top] = True
        selected = selected.reshape(w.shape)
        value, phi = w * a - hp["ppo_kl_coef"] * np.abs(x) * selected, w
        extra = -hp["ppo_kl_coef"] * np.sign(x) * selected
    elif name in ("dppo_tv", "dppo_kl"):
        value, phi = dppo(name[-2:], w, a, q, np.exp(logp), hp)
    elif name == "cfpo":  # J = w A - |A| (w - 1)^2 / (2 eps); dJ/dlogp = w A - |A| w (w - 1) / eps
        eps = hp["epsilon"]
        value, phi = w * a - np.abs(a) * (w - 1) ** 2 / (2 * eps), w * (1 - np.sign(a) * (w - 1) / eps)
    elif name == "m2po":
        masked = second_moment_masked(x, mask, hp["m2_threshold"])
        value, phi = np.where(masked, 0.0, w * a), np.where(masked, 0.0, w)
    else:
        raise KeyError(name)
    return value, phi, extra
