"""The fused path: the objective's per-token loss, its weighting, the aggregation and the metrics' statistics as one
`torch.compile`d graph, so that a GPU runs a few fused kernels instead of dozens of small ones (the loss layer is
launch-bound: `scripts/objective_overhead.py`).

Opt in with `compute_policy_loss(..., fused=True)` (or `compute_token_loss(..., fused=True)`, the per-token loss a
trainer aggregates itself: the TRL trainer's `fused_loss`, verl's `policy_loss.fused`); a string names the
`torch.compile` backend instead of the default (inductor), e.g. `fused="aot_eager"`, which captures the graph without
generating code (no C++ compiler needed). The default, `DEFAULT_FUSED`, is the eager path. Values and gradients
equal the eager path's to float rounding (`tests/test_fused_loss.py`); docs/fused-loss.md has the figures.

What stays eager, and why:
- validation (`make_batch`): its probe of the inputs is one device-to-host transfer by design, and its error names
  the bad value, so it runs before the compiled graph, as on the eager path;
- the metrics' transfer: `compute_policy_loss` computes their totals inside the graph (a few more reductions over the
  tensors the loss already reads) and moves them to the host only when the metrics are first read, as on the
  eager path;
- dr_grpo's L_max (`dr_grpo_length`: max_len checked against the longest response, or that length) reads one
  number on the host, as on the eager path, before the graph.

Compilation: each (objective, hyper-parameters, backend) compiles once per process (seconds per graph on a CPU),
then again only for a new dtype, device or set of inputs, and once when max_len, num_tokens or
num_sequences first changes (they then stay symbolic); sizes are marked dynamic, so a new B or T does not
recompile. atr_adaptive compiles once per distinct delta its controller reaches. Objectives whose
per-token loss needs host-side, data-dependent work cannot be fused (`UNFUSABLE`): asking for it is a ValueError
(`fused_backend`), before any work.
"""

from __future__ import annotations

import itertools
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

from trustclip.objectives import bounds
from trustclip.objectives.aggregation import aggregate_with_length, check_aggregation, dr_grpo_length
from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.registry import Objective, TokenLoss, resolve_name
from trustclip.objectives.statistics import PolicyMetrics, metrics_of_totals, statistic_totals, token_statistics

DEFAULT_FUSED = False  # the eager path unless asked: a first fused call compiles (seconds), which a short run loses
DEFAULT_BACKEND = "inductor"  # torch.compile's own default; fused=True means it
# Objectives that select tokens with a data-dependent count on the host (nonzero, randperm with a CPU generator,
# topk of int(r * N_valid)): a graph cannot hold that selection.
UNFUSABLE = {
    "clip_cov": "its random selection of covariance tokens has a data-dependent size (nonzero, randperm)",
    "kl_cov": "its top-k covariance selection has a data-dependent size (nonzero, topk of k = r * N_valid)",
}
# Pure functions of Python floats that objectives call while they build a constraint, in scipy (Lambert W, brentq)
CONSTANT_HELPERS = (bounds.kl1_bounds, bounds.kl2_bounds, bounds.kl3_bounds, bounds.is_kl3_bounds)
MAX_COMPILED = 64  # compiled functions kept (least recently used dropped): an objective per distinct hyper-parameters


def fused_backend(fused: bool | str, objective: str | Objective, setting: str = "fused") -> str | None:
    """The torch.compile backend that `fused` asks for `objective` (a name, an alias or an Objective), or None for
    the eager path. Raises ValueError, naming `setting` (where the value came from), on a `fused` that is neither a
    bool nor a backend name, and on an objective without a fused path (`UNFUSABLE`): before any work."""
    if fused is False:
        return None
    if fused is not True and not (isinstance(fused, str) and fused):
        raise ValueError(f"{setting} must be True, False or the name of a torch.compile backend, got {fused!r}")
    name = objective.name if isinstance(objective, Objective) else resolve_name(objective).name
    if name in UNFUSABLE:
        raise ValueError(f"objective {name!r} cannot be fused: {UNFUSABLE[name]}; set {setting}=False "
                         f"(the objectives without a fused path: {', '.join(UNFUSABLE)})")
    return DEFAULT_BACKEND if fused is True else fused


def weighted_token_loss(objective: Objective, batch: PolicyBatch, weights: torch.Tensor | None) -> TokenLoss:
    """The objective's per-token loss, zero on padding and times the (detached) token weights: the eager path's
    step, and the start of every fused graph."""
    out = objective(batch)
    out.loss = out.loss * batch.mask if weights is None else out.loss * batch.mask * weights.detach()
    return out


def fused_token_loss(objective: Objective, batch: PolicyBatch, weights: torch.Tensor | None,
                     backend: str = DEFAULT_BACKEND) -> TokenLoss:
    """`weighted_token_loss` as one compiled graph."""
    fn = _compiled(("token", backend), objective, lambda: _token_graph(objective), backend)
    loss, low, high, stats = fn(*_dynamic_inputs(batch, weights))
    return TokenLoss(loss, low, high, stats)


def fused_policy_loss(objective: Objective, batch: PolicyBatch, weights: torch.Tensor | None, aggregation: str,
                      backend: str = DEFAULT_BACKEND, **counts: float | None) -> tuple[torch.Tensor, PolicyMetrics]:
    """The aggregated loss and the metrics of `compute_policy_loss`, from one compiled graph (`counts`: the
    max_len, num_tokens and num_sequences of `aggregate`; a changed L_max of dr_grpo recompiles once, then is a
    symbol). The metrics' totals are computed in the graph and moved
    to the host when the metrics are first read."""
    check_aggregation(aggregation)
    if aggregation == "dr_grpo":
        counts["max_len"] = dr_grpo_length(batch.mask, counts["max_len"])
    fn = _compiled(("policy", backend, aggregation), objective, lambda: _policy_graph(objective, aggregation), backend)
    loss, totals, means, scalars = fn(*_dynamic_inputs(batch, weights), **counts)
    return loss, TotalsMetrics(totals, means, scalars)


class TotalsMetrics(PolicyMetrics):
    """`PolicyMetrics` whose statistics were totalled on the device (`statistic_totals`): reading them is the one
    device-to-host transfer."""

    def __init__(self, totals: torch.Tensor, means: list[str], scalars: list[str]) -> None:
        self._inputs = (totals.detach(), list(means), list(scalars))

    def _reduce(self) -> dict[str, float]:
        totals, means, scalars = self._inputs
        return metrics_of_totals(means, scalars, totals.tolist())[0]


def _dynamic_inputs(batch: PolicyBatch, weights: torch.Tensor | None) -> tuple[Any, ...]:
    """The graph's inputs, their sizes marked dynamic: a new B or T reuses the graph. (Not `dynamic=True`, which
    would also trace the hyper-parameters, Python floats, as symbols: the objectives check them in Python.)"""
    inputs = (batch.logp, batch.old_logp, batch.advantages, batch.mask, batch.log_ratio, batch.ratio, batch.extras,
              weights)
    for x in (*inputs[:6], *batch.extras.values(), weights):
        if x is not None:
            torch._dynamo.maybe_mark_dynamic(x, tuple(range(x.dim())))
    return inputs


def _token_graph(objective: Objective) -> Callable:
    def fused_token_loss_graph(logp, old_logp, advantages, mask, log_ratio, ratio, extras, weights):
        batch = PolicyBatch(logp, old_logp, advantages, mask, log_ratio, ratio, extras)
        out = weighted_token_loss(objective, batch, weights)
        return out.loss, out.clipped_low, out.clipped_high, out.stats

    return fused_token_loss_graph


def _policy_graph(objective: Objective, aggregation: str) -> Callable:
    def fused_policy_loss_graph(logp, old_logp, advantages, mask, log_ratio, ratio, extras, weights, *, max_len,
                                num_tokens, num_sequences):
        batch = PolicyBatch(logp, old_logp, advantages, mask, log_ratio, ratio, extras)
        out = weighted_token_loss(objective, batch, weights)
        loss = aggregate_with_length(out.loss, batch.mask, aggregation, max_len=max_len, num_tokens=num_tokens,
                                     num_sequences=num_sequences)
        stats = token_statistics(out, batch)
        sums, extremes = statistic_totals(stats, batch.mask)
        return loss, torch.cat([sums, extremes]), list(stats.means), list(stats.scalars)

    return fused_policy_loss_graph


_COMPILED: OrderedDict[Hashable, Callable] = OrderedDict()
_SERIAL = itertools.count()


def _compiled(kind: tuple, objective: Objective, make: Callable[[], Callable], backend: str) -> Callable:
    """The compiled function of `kind` for `objective`, compiled on first use.

    Each gets its own code object, and name: dynamo keeps its compiled graphs per code object, guarded on the
    closure's values, and stops compiling one after `torch._dynamo.config.recompile_limit` (8) variants (with one
    shared code object, a process that used more objectives would silently fall back to eager); and it remembers
    per code name which Python floats changed between calls, and traces those as symbols, which the objectives'
    checks of their hyper-parameters cannot take (an atr_adaptive whose delta moved would break the graph)."""
    key = (*kind, objective.name, tuple((k, _hashable(v)) for k, v in objective.hparams.items()))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    _mark_constant_helpers()
    fn = make()
    name = f"{fn.__name__}_{objective.name}_{next(_SERIAL)}"  # a name of its own: see the docstring
    fn = types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name,
                            fn.__defaults__, fn.__closure__)
    _COMPILED[key] = compiled = torch.compile(fn, backend=backend)
    if len(_COMPILED) > MAX_COMPILED:
        _COMPILED.popitem(last=False)
    return compiled


def clear_compiled() -> None:
    """Drop every compiled function (the next fused call of each objective compiles again)."""
    _COMPILED.clear()


def _mark_constant_helpers() -> None:
    """Tell the compiler that `CONSTANT_HELPERS` return a constant for given arguments: it calls them while tracing
    instead of breaking the graph at scipy. Done here, not where they are defined, because the mark imports
    torch._dynamo (1.5 s), which the eager path never needs. `kl_constraint` memoises them with lru_cache, which the
    compiler traces through (with a warning, silenced for that call alone: its arguments are guarded constants)."""
    for helper in CONSTANT_HELPERS:
        torch.compiler.assume_constant_result(helper)
    warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools.lru_cache`-wrapped function "
                            r"at 'constraints\.py", category=UserWarning)


def _hashable(value: Any) -> Hashable:
    """A cache key for a hyper-parameter: itself, or for an unhashable one (a user Constraint) its identity, which
    stays unique while the cached function (whose closure holds the objective) is alive."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value
